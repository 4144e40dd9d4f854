"""Telling a volunteer when its own uplink is the likely reason its contributions are late or lost.

Nothing else says so: each failed send is an INFO line naming the aggregator ("did not answer
contribute within 10.2s"), which reads as the other peer's fault, and the round line only says
"NOT in aggregate". A review put a volunteer on a 1 Mbit/s uplink: every send of every round was
cut short, and the volunteer was never told why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)
WARN_AFTER = 3  # attempts in a row whose contribution did not get out whole: one may be an aggregator's fault
REPEAT_S = 600.0  # while it lasts, said again this often
# Attempts in a row whose sends all got out before a peer found slow takes aggregator roles again.
# More than WARN_AFTER: roles load the uplink too (serving aggregates), so sends that get through
# once they are shed may be cut again once they are back; the wider gap keeps that swing slow.
CLEAR_AFTER = 10


class UplinkWatch:
    """Counts a volunteer's attempts in a row in which sends of its contribution were cut short."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_a_row = 0
        self.counted = 0  # of those, attempts whose commit counted the contribution all the same
        self._said_at: float | None = None
        # Found too slow to serve: from the third cut attempt in a row (with sends to two
        # aggregators or more cut) until CLEAR_AFTER clean attempts in a row. The
        # peer then declines aggregator and leader roles (`SwarmExchange.serving`): an aggregator
        # serves its shard's aggregate to every peer of the round over that same uplink, and a
        # review's run lost a round's aggregate to a volunteer on a 1 Mbit/s uplink so.
        self.slow = False
        self.clean_in_a_row = 0
        self.cut_to: set[str] = set()  # the aggregators whose sends were cut, in the attempts in a row

    def note(self, cut: bool, included: bool, size: int, slack_s: float,
             cut_to: Collection[str] = ()) -> str | None:
        """Record one attempt (`cut`: some send of it timed out or was cut short, to the aggregators
        `cut_to`); the warning (also logged) once `WARN_AFTER` in a row were, at most once every
        `REPEAT_S`."""
        if not cut:
            self.in_a_row = self.counted = 0
            self.cut_to.clear()
            self.clean_in_a_row += 1
            self.slow = self.slow and self.clean_in_a_row < CLEAR_AFTER
            return None
        self.in_a_row += 1
        self.clean_in_a_row = 0
        self.cut_to.update(cut_to)
        # Roles are shed only if sends to two aggregators or more were cut: sends to one alone
        # may be cut at its end (its downlink, its CPU), and in a small run every contributor
        # sends to every server, so one slow receiver would have every sender shed its roles.
        self.slow = self.slow or (self.in_a_row >= WARN_AFTER and len(self.cut_to) >= 2)
        self.counted += included
        now = self._clock()
        if self.in_a_row < WARN_AFTER or (self._said_at is not None and now - self._said_at < REPEAT_S):
            return None
        self._said_at = now
        text = (f"sends of our contribution ({size / 1e6:.2f} MB a copy) timed out or were cut short in each of the "
                f"last {self.in_a_row} attempts (counted all the same in {self.counted}, late): the likely cause is "
                f"this computer's uplink, too slow to send its copies well within a slack ({slack_s:g} s), and "
                "every round waits for it; see \"What a volunteer's link needs\" in peer/README.md")
        log.warning(text)
        return text
