"""A volunteer whose contributions keep failing to get out is told its uplink is the likely cause."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from groundswell.optim import RoundFailed
from groundswell.peer.swarm_exchange import SwarmExchange
from groundswell.peer.uplink_watch import REPEAT_S, WARN_AFTER, UplinkWatch
from groundswell.protocol.client import AttemptResult
from test_late_outcome import _Node, _payloads


def test_it_warns_after_a_few_attempts_in_a_row_and_again_only_while_it_lasts():
    now = [0.0]
    watch = UplinkWatch(clock=lambda: now[0])
    assert [watch.note(False, 880_000, 5.0) for _ in range(WARN_AFTER - 1)] == [None] * (WARN_AFTER - 1)
    said = watch.note(False, 880_000, 5.0)
    assert said is not None and "0.88 MB" in said and f"last {WARN_AFTER} attempts" in said and "uplink" in said
    now[0] += REPEAT_S / 2
    assert watch.note(False, 880_000, 5.0) is None  # said already: not every round
    now[0] += REPEAT_S
    assert watch.note(False, 880_000, 5.0) is not None  # still so, ten minutes on: said again
    assert watch.note(True, 880_000, 5.0) is None and watch.in_a_row == 0  # one that got out starts over
    assert [watch.note(False, 880_000, 5.0) for _ in range(WARN_AFTER - 1)] == [None] * (WARN_AFTER - 1)


@pytest.mark.parametrize("late,warned", [(False, True), (True, False)])
def test_a_volunteer_is_told_when_its_sends_keep_failing_unless_its_training_ran_late(caplog, late, warned):
    # Found by a review: on a 1 Mbit/s uplink every send of every round was cut short, and the
    # volunteer only saw "NOT in aggregate" (and, with --verbose, lines blaming the aggregators).
    # Shards sent after the attempt's close are refused for our training's lateness, not the link's.
    retry = SimpleNamespace(status="retry", round=0, contributors=[])
    ex = SwarmExchange(_Node((AttemptResult(retry, b"", 0, False, False, late), None, None)))
    with caplog.at_level(logging.WARNING, logger="groundswell.peer.uplink_watch"):
        for _ in range(WARN_AFTER):
            ex.contribute(0, _payloads())
            with pytest.raises(RoundFailed):
                ex.collect(0)
    said = [r.getMessage() for r in caplog.records if r.name == "groundswell.peer.uplink_watch"]
    assert bool(said) is warned, said
    assert not warned or "this computer's uplink" in said[0]
