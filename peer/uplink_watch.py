"""Telling a volunteer when its own uplink is the likely reason its contributions do not get out.

Nothing else says so: each failed send is an INFO line naming the aggregator ("did not answer
contribute within 10.2s"), which reads as the other peer's fault, and the round line only says
"NOT in aggregate". A review put a volunteer on a 1 Mbit/s uplink: every send of every round was
cut short, and the volunteer was never told why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
WARN_AFTER = 3  # attempts in a row whose contribution did not get out whole: one may be an aggregator's fault
REPEAT_S = 600.0  # while it lasts, said again this often


class UplinkWatch:
    """Counts a volunteer's attempts in a row whose contribution's sends failed or were cut short."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_a_row = 0
        self._said_at: float | None = None

    def note(self, delivered: bool, size: int, slack_s: float) -> str | None:
        """Record one attempt's delivery; the warning (also logged) once `WARN_AFTER` in a row failed."""
        if delivered:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        now = self._clock()
        if self.in_a_row < WARN_AFTER or (self._said_at is not None and now - self._said_at < REPEAT_S):
            return None
        self._said_at = now
        text = (f"our contribution ({size / 1e6:.2f} MB, sent to an aggregator and its replicas) did not get out whole "
                f"in the last {self.in_a_row} attempts: its sends failed or were cut short. When other peers' rounds "
                f"go on, the likely cause is this computer's uplink, too slow to send it well within a slack "
                f"({slack_s:g} s); see \"What a volunteer's link needs\" in peer/README.md")
        log.warning(text)
        return text
