"""What `join` and `launch` print besides their rounds: a restart's resume line, a failed final
save, and the log's set-up."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

if TYPE_CHECKING:
    from .participant import Participant


def resumed_line(state_dir: Path, what: dict) -> str:
    """The line a restarted volunteer prints once its state is in (`roles.resume_summary`)."""
    where = escape(str(state_dir))
    start = (f"resumed from {where}: its checkpoint at the start of round {what['checkpoint_round']}"
             if what["checkpoint_round"] is not None else f"resumed from {where}: the work not yet sent (no "
                                                          "readable checkpoint)")
    settling = sorted(set(what["settling"]))  # (a round's retried attempts: each round named once)
    sent = (f"; settling the contributions sent before the stop (round{'s' if len(settling) > 1 else ''} "
            f"{', '.join(map(str, settling))}) against their commits" if settling else "")
    return f"{start}{sent}; now at round {what['round']}"


def saved_before(p: Participant) -> str:
    """What is on disk when the final save failed: the newest checkpoint this process wrote (its
    round, older than the peer's), or none."""
    if p.last_checkpoint is None:
        return "no checkpoint of this process is on disk (see the error above)"
    return (f"the newest on disk is {escape(str(p.last_checkpoint))}, older than round {p.outer.round_id} "
            "(see the error above)")


def setup_logging(verbose: bool) -> None:
    """Log to stderr: warnings and up, or everything from INFO with `--verbose`; asyncio's noise only
    when verbose."""
    handler = CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
    if not verbose:  # asyncio's warnings (a child reaped late, a slow callback) say nothing a user can act on
        logging.getLogger("asyncio").setLevel(logging.ERROR)
        if not any(isinstance(f, DaemonGoneFilter) for f in logging.getLogger("asyncio").filters):
            logging.getLogger("asyncio").addFilter(DaemonGoneFilter())


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at each record: rich's live table and progress bar
    redirect it while they run, and print what comes through above themselves. A handler bound to
    the real stderr at start glued its lines onto the table's border (a review, 2026-12-07)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - a text stream, as StreamHandler's
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler sets it once: looked up each time instead
        pass


class DaemonGoneFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for a lost connection: hivemind's
    daemon client leaves such tasks behind when the daemon goes first (leaving at once on a
    second Ctrl+C or SIGTERM), and their tracebacks say nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (ConnectionError, asyncio.IncompleteReadError))
