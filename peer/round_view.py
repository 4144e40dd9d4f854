"""How the CLI shows rounds to people: the launch's live table, its line per round where there is
no terminal, and the loss texts a volunteer's line uses."""

from __future__ import annotations

import math
from typing import Any

from rich.markup import escape
from rich.table import Table


def loss_text(loss: float) -> str:
    """A held-out loss for people: "-" until one is known (no evaluation published yet)."""
    return "-" if math.isnan(loss) else f"{loss:.4f}"


def of_round(info: Any) -> str:
    """The text " (round N)" when the loss shown was measured after another round than the one reported."""
    return "" if info.eval_round is None or math.isnan(info.eval_loss) else f" (round {info.eval_round})"


def round_table(rows: list, header: str) -> Table:
    """The launch's live table: the newest 12 rounds."""
    table = Table(title=escape(header), expand=False)  # (a retry's reason may quote a peer's words)
    for col in ("round", "peers online", "contributors", "held-out loss", "kB/round/peer", "round s"):
        table.add_column(col, justify="right")
    for info in rows[-12:]:
        table.add_row(str(info.round), str(info.peers_online), str(info.contributors),
                      "" if math.isnan(info.eval_loss) else f"{info.eval_loss:.4f}",
                      f"{info.bytes_sent / 1e3:,.1f}" if info.bytes_sent else "", f"{info.round_s:.1f}")
    return table


def round_line(info: Any) -> str:
    """One round as a line of text: the live table's row where there is no terminal."""
    if info.status == "caught-up":
        return f"caught up to round {info.round}: {info.reason}"
    if info.status != "applied":
        return f"round {info.round}: runs again ({info.reason})"
    loss = "" if math.isnan(info.eval_loss) else f", held-out loss {info.eval_loss:.4f}"
    sent = f", {info.bytes_sent / 1e3:,.1f} kB/round/peer" if info.bytes_sent else ""
    return (f"round {info.round}: applied, {count_of(info.contributors, 'contributor')}, "
            f"{count_of(info.peers_online, 'peer')} online{loss}{sent}, {info.round_s:.1f} s")


def count_of(n: int, what: str) -> str:
    """"1 peer", "2 peers"."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def in_aggregate(info: Any) -> str:
    """Whether a volunteer's work is in the round's aggregate, in words."""
    if info.included:
        return "in aggregate"
    # the commit names us for other work of ours: what the process before this one sent (restarted
    # mid-round), or an earlier attempt's contribution a later leader adopted
    return "earlier work of ours in aggregate" if getattr(info, "superseded", False) else "NOT in aggregate"
