"""SparseLoCo's unsent work, on disk after every contribution, so that a crash loses one round's
training at most, not the error feedback of every round since the last checkpoint.

A checkpoint is written every K rounds, and a volunteer contributes every round: when a process
dies, the contribution it sent last is almost always newer than its newest checkpoint, and that
checkpoint's error feedback still holds what the contribution sent. Restoring it would send that
work twice, so the restart used to drop it (event `unsent-work-dropped`), 14 times in the 16
restarts of a churn run.

So after each contribution the volunteer writes `work.pt`: the error feedback right after the
contribution was encoded (what stays ours if no commit counts it), the contribution's payloads,
and those of earlier contributions whose outcome is still unknown. A restart takes that error
feedback back and settles each listed contribution against its round's commit by digest, like
any late outcome (`settle_late`): one a commit counted is taken out of the work then.

Which contribution the file describes is matched against `contributed.json` (written before a
contribution is sent, by the network loop): the record names the token of its own contribution
and what `contributed.json` said just before it. If `contributed.json` names the record's token,
the contribution may have gone out (its outcome is settled late); if it still says what it said
before, the contribution never went out; anything else (the record could not be written, say)
and the record is not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from groundswell.compression import all_finite

from .checkpoint_check import DIGEST_KEY, checkpoint_digest
from .state_files import load_torch_file, parse_json, write_atomically
from .unsettled import KEEP_UNSETTLED, parse_unsettled, unsettled_item

log = logging.getLogger(__name__)

WORK_FILE = "work.pt"
CONTRIBUTED_FILE = "contributed.json"
OUTCOME_FILE = "outcome.json"  # what the process learned of the record's contribution (see WorkJournal.outcome)


@dataclass
class WorkRecord:
    """What `work.pt` holds: the state of the work right after one contribution was encoded."""

    token: str  # names this record's contribution in contributed.json
    before: dict[str, Any] | None  # contributed.json just before this contribution (None: there was none)
    round_id: int
    error: torch.Tensor  # SparseLoCo's error feedback with this contribution encoded, not yet settled
    own: dict[str, Any]  # this contribution (`unsettled_item`)
    earlier: list[dict[str, Any]]  # earlier contributions of unknown outcome, their work still in `error`
    progress: dict[str, Any] | None = None  # the inner trainer's `progress_state()` then (None: not kept)


def new_token() -> str:
    """A fresh name for a contribution."""
    return os.urandom(8).hex()


# contributed.json is there but cannot be read (torn, damaged, foreign): it may name a contribution
# that went out, so the work a restart holds is not sent again on its word (`contribution_unknown`).
UNREADABLE: dict[str, Any] = {"unreadable": True}
LEGACY_MARKER_KEYS = {"round", "attempt", "work"}  # contributed.json of versions before its "check"


def contributed_bytes(round_id: int, attempt: int, work: str | None) -> bytes:
    """contributed.json's content naming a contribution, with a check of its fields: a flipped
    digit (round 13 read as 12, attempt 1 as 0) would otherwise read as another contribution, and
    a restart would send work again or contribute twice to one attempt."""
    return json.dumps({"round": round_id, "attempt": attempt, "work": work,
                       "check": _marker_check(round_id, attempt, work)}).encode()


def _marker_check(round_id: object, attempt: object, work: object) -> str:
    return hashlib.blake2b(json.dumps([round_id, attempt, work]).encode(), digest_size=8).hexdigest()


def unreadable_marker_digest(state_dir: Path) -> str | None:
    """A digest of contributed.json's bytes if it is there but unreadable (else None): a checkpoint
    written after a restart dropped its work for that file records it, so the next restart, finding
    the same bytes, knows the checkpoint's work was made since and keeps it."""
    if read_contributed(state_dir) is not UNREADABLE:
        return None
    try:
        return hashlib.blake2b((state_dir / CONTRIBUTED_FILE).read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return None


def read_contributed(state_dir: Path) -> dict[str, Any] | None:
    """contributed.json as it is now: None if absent, `UNREADABLE` if it cannot be read."""
    path = state_dir / CONTRIBUTED_FILE
    if not path.exists():
        return None
    try:
        data = parse_json(path.read_text())
    except (OSError, ValueError) as exc:
        data = exc
    if not isinstance(data, dict) or _marker(data) is None:
        why = str(data) if isinstance(data, Exception) else "damaged, or not what this program writes"
        if (path, why) not in _warned:  # (read several times at a start: said once)
            _warned.add((path, why))
            log.warning("%s is unreadable (%s): a contribution may have gone out since the last checkpoint",
                        path.name, why)
        return UNREADABLE
    return data


_warned: set[tuple[Path, str]] = set()


def contributed_marker(data: dict[str, Any] | None) -> dict[int, int]:
    """{round: attempt} of the contribution contributed.json names ({} if none, or unreadable):
    what a settled checkpoint records as the last outcome it holds."""
    return {} if data is None or data is UNREADABLE else _marker(data) or {}


def contribution_unknown(data: dict[str, Any] | None) -> bool:
    """Is it unknown whether (and when) a contribution went out? (contributed.json is there but
    unreadable: then the unsent work a restart holds may be in the swarm already.)"""
    return data is UNREADABLE


def _marker(data: dict[str, Any]) -> dict[int, int] | None:
    # Exactly what we write: JSON ints. int() took true as 1, "7" as 7, and raised OverflowError
    # out of start-up for 1e999 (JSON reads it as inf).
    round_id, attempt = data.get("round"), data.get("attempt")
    if type(round_id) is not int or type(attempt) is not int:
        return None
    if set(data) == LEGACY_MARKER_KEYS:  # written before the check: as trustworthy as it was then
        return {round_id: attempt}
    if data.get("check") != _marker_check(round_id, attempt, data.get("work")):
        return None  # a flipped bit
    return {round_id: attempt}


def write_work(state_dir: Path, record: WorkRecord) -> bool:
    """Write the record atomically; False (and a log line) if the disk or the memory refuses it."""
    try:
        state = {"token": record.token, "before": json.dumps(record.before), "round": record.round_id,
                 "error": record.error.detach().cpu(), "sent": [record.own, *record.earlier]}
        if record.progress is not None:
            state["progress"] = record.progress
        state[DIGEST_KEY] = checkpoint_digest(state)  # torch.load reads a flipped byte in a segment as is
        write_atomically(state_dir / WORK_FILE, lambda f: torch.save(state, f))
    except (OSError, MemoryError) as exc:  # as save_checkpoint: the round goes on, this work is not sent
        why = str(exc) or type(exc).__name__  # a bare MemoryError() says nothing
        log.warning("the work record was not written (%s); a crash now would drop the unsent work", why)
        return False
    return True


def read_work(state_dir: Path, numel: int, report: Callable[[str], None] = lambda why: None
              ) -> WorkRecord | None:
    """The record in `state_dir`, if there is one that fits a model of `numel` parameters; one
    that is there but cannot be used is logged and `report`ed (why), and None is returned."""
    path = state_dir / WORK_FILE
    if not path.exists():
        return None
    try:
        state = load_torch_file(path)
        # A record without a digest is refused too: a damaged key name reads so, and refusing one
        # written by an older version costs what an unreadable record costs (the checkpoint's rule:
        # its work is kept unless a contribution was sent since it), never work sent twice.
        if not isinstance(state, dict) or state.get(DIGEST_KEY) != checkpoint_digest(state):
            raise ValueError("its contents do not match its digest")
        sent = parse_unsettled(state["sent"])
        error = state["error"]
        progress = state.get("progress")
        record = WorkRecord(str(state["token"]), parse_json(state["before"]), int(state["round"]), error,
                            sent[0], sent[1:], progress if isinstance(progress, dict) else None)
    except Exception as exc:  # noqa: BLE001 (a torn or foreign file: torch raises many types)
        return _unusable(path, f"unreadable: {exc}", report)
    if not isinstance(error, torch.Tensor) or error.dtype != torch.float32 or error.shape != (numel,) \
            or not all_finite(error):
        return _unusable(path, "it does not fit this model", report)
    return record


def _unusable(path: Path, why: str, report: Callable[[str], None]) -> None:
    log.warning("%s is not used (%s)", path.name, why)
    report(why)


def resumable_work(record: WorkRecord, state_dir: Path, checkpoint_settled: Any, checkpoint_work: Any
                   ) -> list[dict[str, Any]] | None:
    """Whether a restart should take its error feedback from `record`: the contributions to settle
    late (oldest first) if so; None if the record does not match contributed.json, or the newest
    checkpoint was written after it (`checkpoint_settled`, `checkpoint_work`: that checkpoint's
    marker of the last contribution whose outcome it holds, and the newest record's token then)."""
    now = read_contributed(state_dir)
    if contribution_unknown(now):
        return None  # the record cannot be matched: the checkpoint's unsent work is dropped (see resume)
    marker = contributed_marker(now)
    # A checkpoint that holds the outcome of every contribution up to now, written since the record:
    # newer, and exact. (When the record's contribution went out, a checkpoint settled on it is
    # necessarily later; when it did not, the token tells.)
    if checkpoint_settled == marker and (
            checkpoint_work == record.token or (now is not None and now.get("work") == record.token)):
        return None
    if now is not None and now.get("work") == record.token:  # it may have gone out
        return [*record.earlier, _with_outcome(record.own, state_dir, record.token)]
    if now == record.before:  # it never went out: its work is all in the record's error feedback
        return list(record.earlier)
    return None


def _with_outcome(own: dict[str, Any], state_dir: Path, token: str) -> dict[str, Any]:
    """The record's own contribution with what its process learned of its outcome (outcome.json),
    if it learned anything; else presumed counted when its commit cannot be checked."""
    try:
        seen = parse_json((state_dir / OUTCOME_FILE).read_text())
        if not isinstance(seen, dict) or seen.get("work") != token:
            raise ValueError("another contribution's")
        included, retried = seen["included"], seen["retried"]
        if type(included) not in (type(None), bool) or type(retried) is not bool:
            raise ValueError("malformed")
    except (OSError, ValueError, KeyError):  # not learned (or torn): unknown
        included, retried = None, False
    return dict(own, included=included, retried=retried, presume=included is None and not retried)


class WorkJournal:
    """Writes `work.pt` after each contribution (a SparseLoCo volunteer with a state dir; with no
    state dir, or DiLoCo, whose unsent work a checkpoint's local progress covers, it does nothing)."""

    def __init__(self, state_dir: Path | None, enabled: bool) -> None:
        self.state_dir = state_dir if enabled else None
        self._token: str | None = None
        self._before: dict[str, Any] | None = None

    def start(self) -> str | None:
        """Call once a contribution is encoded, before `record` and before it is handed to the
        exchange: the token contributed.json will name it by (None: no journal).
        contributed.json is read now, while no attempt is out."""
        if self.state_dir is None:
            return None
        self._before = read_contributed(self.state_dir)
        self._token = new_token()
        return self._token

    def record(self, round_id: int, error: torch.Tensor, segments: list[bytes], earlier: list[dict[str, Any]],
               progress: dict[str, Any] | None = None, basis: bytes = b"") -> bool:
        """Write the record of the contribution `segments` (as it will be sent), before it is
        handed to the exchange: if it is written later, a crash in between leaves contributed.json
        naming a contribution with no record, and the work is dropped. `error` has it encoded;
        `earlier` lists each earlier contribution whose outcome is unknown (`unsettled_item`s, their
        `decayed` not counting this one); `progress`: where training is (the batches trained are in
        `error`: a restart must not train them again); `basis`: the signed commit round `round_id`
        was planned from (a restart that took a later state checks the round's commit with it).
        False if nothing was written."""
        if self.state_dir is None or self._token is None:
            return False
        own = unsettled_item(round_id, segments, 0, basis=basis)
        # this contribution's encoding decayed the error feedback once more
        # the newest few, and every one counted or presumed counted (SwarmExchange keeps those)
        cut = len(earlier) - KEEP_UNSETTLED
        older = [dict(item, decayed=item["decayed"] + 1) for n, item in enumerate(earlier)
                 if n >= cut or item.get("included") is True or item.get("presume")]
        record = WorkRecord(self._token, self._before, round_id, error, own, older, progress)
        if not write_work(self.state_dir, record):
            self._token = None  # never sent: its outcome must not overwrite the one the last record's relies on
            return False
        return True

    def outcome(self, included: bool | None, retried: bool) -> None:
        """Note what `collect` learned of the recorded contribution (counted? None: unknown;
        retried?): a crash later in the round then restores it knowing that, instead of looking
        for its commit (which a restart may not be able to check)."""
        if self.state_dir is None or self._token is None:
            return
        token, self._token = self._token, None
        try:
            write_atomically(self.state_dir / OUTCOME_FILE, lambda f: f.write(json.dumps(
                {"work": token, "included": included, "retried": retried}).encode()))
        except OSError as exc:  # then a restart looks for the commit, as without the note
            log.warning("the outcome of our contribution was not noted (%s)", exc)
