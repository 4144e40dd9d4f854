"""The rounds of a simulation as its processes' event logs tell them: when each ended, whom it
counted, its held-out loss, and whether every process that finished it held the same parameter
hash (report.json's `param_hash_agreement` and the keys that say why it is false), and how long
each round took. `build_report` (sim_report.py) puts them in report.json."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from .event_log import NONFINITE


@dataclass
class Rounds:
    """What the logs say of each round (keys: round numbers; times: seconds after the run's t0)."""

    end_t: dict[int, float] = field(default_factory=dict)  # the earliest time any process had it applied
    loss: dict[int, float] = field(default_factory=dict)  # finite held-out losses only: the report is strict JSON
    contributors: dict[int, set[str]] = field(default_factory=dict)  # as the round's first commit named them
    hashes: dict[int, set[str]] = field(default_factory=dict)  # the distinct hashes reported
    reporters: dict[int, set[str]] = field(default_factory=dict)  # the processes (state dirs) that reported one
    # every process that finished a round (in it, or in catching up) and logged no hash for it
    unhashed: list[dict] = field(default_factory=list)
    nonfinite: list[int] = field(default_factory=list)  # evaluated, and the loss was NaN or infinite

    @property
    def completed(self) -> int:
        """Rounds completed: numbered from 0, and one no process logged still happened (a later one
        builds on it) and keeps its place."""
        return max(self.end_t) + 1 if self.end_t else 0

    @property
    def divergent(self) -> list[int]:
        """Rounds two processes reported different hashes for."""
        return sorted(r for r, h in self.hashes.items() if len(h) > 1)

    @property
    def hashless(self) -> list[int]:
        """Completed rounds no process reported a hash for: nothing says they agreed."""
        return [r for r in range(self.completed) if r not in self.hashes]

    @property
    def unchecked(self) -> list[int]:
        """Completed rounds fewer than two processes reported a hash for: nothing compared them."""
        return [r for r in range(self.completed) if len(self.reporters.get(r, ())) < 2]

    @property
    def agreement(self) -> bool:
        """True only if, for every round, all processes that finished it had the same hash: none
        differs, none finished it without one, and no completed round lacks one altogether. A
        round one process alone reported agrees vacuously (churn leaves such rounds)."""
        return bool(self.hashes) and not (self.divergent or self.unhashed or self.hashless)


def read_rounds(logs: dict[str, list[dict]], t0: float, eval_every: int) -> Rounds:
    """The rounds from each process's events (name -> events): its `round` events, and `follow`
    events for the rounds it applied in catching up, which count as finished there too."""
    rs = Rounds()
    rounds = [dict(e, who=name) for name, evs in logs.items() for e in evs if e["kind"] == "round"]
    follows = [dict(e, who=name) for name, evs in logs.items() for e in evs if e["kind"] == "follow"]
    missing: set[tuple[int, str]] = set()
    for e in sorted(rounds, key=lambda e: e["t"]):
        r = e["round"]
        _note_hash(rs, e, missing)
        rs.end_t.setdefault(r, e["t"] - t0)
        if _finite(e.get("eval_loss")):
            rs.loss.setdefault(r, e["eval_loss"])
        rs.contributors.setdefault(r, set(e.get("contributors", [])))
    for e in follows:  # rounds a process applied while catching up finished there too
        r = e["round"]
        if _finite(e.get("eval_loss")):  # the coordinator's, caught up
            rs.loss.setdefault(r, e["eval_loss"])
        _note_hash(rs, e, missing)
        if r not in rs.end_t or e["t"] - t0 < rs.end_t[r]:
            rs.end_t[r] = e["t"] - t0  # (whom it counted is not logged there)
    rs.unhashed = [{"round": r, "peer": name} for r, name in sorted(missing)]
    # A caught-up round's evaluation diverges like any other (it was dropped, found by a review);
    # a round with a finite loss elsewhere is not listed.
    rs.nonfinite = sorted({e["round"] for e in rounds + follows if _diverged(e, eval_every)} - set(rs.loss))
    return rs


def _note_hash(rs: Rounds, e: dict, missing: set[tuple[int, str]]) -> None:
    """Count one process's hash of a round it finished, or that it logged none (an empty hash is
    no hash: not a distinct one to diverge from, and not one that agrees either)."""
    if e.get("hash"):
        rs.hashes.setdefault(e["round"], set()).add(e["hash"])
        rs.reporters.setdefault(e["round"], set()).add(e["who"])
    else:
        missing.add((e["round"], e["who"]))


def round_times(start: float | None, end_t: dict[int, float], completed: int) -> list[float | None]:
    """Each round's duration: from the end of the one before (round 0: from the first sync,
    `start`) to its own end; None where either is unknown. A round known only from a late
    catch-up can end after the next round did: for timing, a round ends no earlier than the one
    before it (its time is then 0, never negative)."""
    marks, latest = [], -math.inf
    for m in [start, *(end_t.get(r) for r in range(completed))]:
        if m is not None:
            latest = max(latest, m)
        marks.append(None if m is None else latest)
    return [round(b - a, 3) if a is not None and b is not None else None for a, b in itertools.pairwise(marks)]


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _diverged(e: dict, eval_every: int) -> bool:
    """Was this round (or catch-up) event's held-out loss evaluated and NaN or infinite? Logs
    write such a loss as "NaN", "Infinity" or "-Infinity" and a round not evaluated as null
    (`event_log.py`); in older logs a bare NaN also stood for "not evaluated", and only the
    coordinator's evaluation rounds tell the two apart."""
    x = e.get("eval_loss")
    if isinstance(x, str):
        return x in NONFINITE
    if not isinstance(x, float) or math.isfinite(x):
        return False
    return math.isinf(x) or (e["who"] == "coordinator" and (e["round"] + 1) % eval_every == 0)
