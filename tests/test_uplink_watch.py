"""A volunteer whose contribution's sends keep being cut short is told its uplink is the likely cause."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from groundswell.optim import RoundFailed
from groundswell.peer.swarm_exchange import SwarmExchange
from groundswell.peer.uplink_watch import REPEAT_S, WARN_AFTER, UplinkWatch
from groundswell.protocol.client import AttemptResult, RoundClient
from groundswell.protocol.failures import PeerDead, PeerGone, PeerUnavailable, RequestTimedOut
from test_client_tables import retrying_client
from test_late_outcome import _Node, _payloads


def test_it_warns_after_a_few_attempts_in_a_row_and_at_most_every_ten_minutes():
    now = [0.0]
    watch = UplinkWatch(clock=lambda: now[0])
    assert [watch.note(True, False, 880_000, 5.0) for _ in range(WARN_AFTER - 2)] == [None] * (WARN_AFTER - 2)
    assert watch.note(True, True, 880_000, 5.0) is None
    said = watch.note(True, False, 880_000, 5.0)
    assert said is not None and "0.88 MB a copy" in said and f"last {WARN_AFTER} attempts" in said
    assert "counted all the same in 1" in said and "uplink" in said
    now[0] += REPEAT_S / 2
    assert watch.note(True, False, 880_000, 5.0) is None  # said already: not every round
    now[0] += REPEAT_S
    assert watch.note(True, False, 880_000, 5.0) is not None  # still so, ten minutes on: said again
    assert watch.note(False, True, 880_000, 5.0) is None and watch.in_a_row == 0  # sent whole: starts over
    now[0] += REPEAT_S
    assert [watch.note(True, False, 880_000, 5.0) for _ in range(WARN_AFTER - 1)] == [None] * (WARN_AFTER - 1)
    assert watch.note(True, False, 880_000, 5.0) is not None


@pytest.mark.parametrize("late,cut,warned", [(False, 1, True), (True, 1, False), (False, 0, False)])
def test_a_volunteer_is_told_when_its_sends_keep_being_cut_unless_its_training_ran_late(caplog, late, cut, warned):
    # Found by a review: on a 1 Mbit/s uplink every send of every round was cut short, and the
    # volunteer only saw "NOT in aggregate" (and, with --verbose, lines blaming the aggregators).
    # Shards sent after the attempt's close are refused for our training's lateness, not the link's,
    # and an attempt whose sends were refused (not cut) is not the link's doing either.
    retry = SimpleNamespace(status="retry", round=0, contributors=[])
    ex = SwarmExchange(_Node((AttemptResult(retry, b"", 0, False, False, late, cut), None, None)))
    with caplog.at_level(logging.WARNING, logger="groundswell.peer.uplink_watch"):
        for _ in range(WARN_AFTER):
            ex.contribute(0, _payloads())
            with pytest.raises(RoundFailed):
                ex.collect(0)
    said = [r.getMessage() for r in caplog.records if r.name == "groundswell.peer.uplink_watch"]
    assert bool(said) is warned, said
    assert not warned or "this computer's uplink" in said[0]


@pytest.mark.parametrize("failure,after_s,counted", [
    (RequestTimedOut("x did not answer contribute within 10.2s"), 0.2, True),
    (RequestTimedOut("x did not answer contribute within 10.2s"), 0.0, False),  # (a slack at least)
    # closed by the aggregator: its body-rate rule, but also a refusal after its wait for room
    (PeerGone("x unavailable for contribute: IncompleteReadError"), 0.2, False),
    (PeerDead("x unavailable for contribute: dial failed"), 0.2, False),  # gone, not slow
    (PeerUnavailable("x sent a bad contribute reply"), 0.2, False),
])
def test_only_sends_that_ran_a_slack_and_timed_out_or_were_cut_count(failure, after_s, counted):
    client = object.__new__(RoundClient)
    client.ctx = SimpleNamespace(slack_s=0.1)
    client.me, client.sends_cut = "me", 0

    async def request(peer, handler, msg, expect, timeout_s):
        await asyncio.sleep(after_s)
        raise failure

    client.transport = SimpleNamespace(request=request)
    assert asyncio.run(client._offer("x", SimpleNamespace(shard=0), 10.0)) == "failed"
    assert client.sends_cut == counted


@pytest.mark.parametrize("opened_ago_s,late", [(1.0, False), (1000.0, True)])
def test_an_attempt_reports_its_own_cut_sends_and_whether_they_went_out_late(opened_ago_s, late):
    # the hand-over from the shards' sends to what the exchange's watch reads
    plan = SimpleNamespace(round=0, attempt=0, leaders=["lead"], trainers=["me"], num_shards=3)
    client = retrying_client("me", plan, opened_ago_s)
    client.sends_cut = 5  # earlier attempts' cut sends are not this one's

    async def send_shard(plan, shard, segments):
        client.sends_cut += shard > 0  # shards 1 and 2 ran out of time
        return shard == 0

    client._send_shard = send_shard
    result = asyncio.run(client.run_attempt(0, 0, [b"a", b"b", b"c"], trains=True, serves=True))
    assert (result.sends_cut, result.late, result.delivered) == (2, late, False)
