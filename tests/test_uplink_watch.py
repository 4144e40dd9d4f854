"""A volunteer whose contribution's sends keep being cut short is told its uplink is the likely cause."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import SimpleNamespace

import pytest
from groundswell.optim import RoundFailed
from groundswell.peer.swarm_exchange import SwarmExchange
from groundswell.peer.uplink_watch import CLEAR_AFTER, REPEAT_S, WARN_AFTER, UplinkWatch
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


def test_a_peer_found_slow_declines_roles_until_its_sends_get_out_for_a_while():
    watch = UplinkWatch()
    for _ in range(WARN_AFTER - 1):
        watch.note(True, False, 1, 5.0, {"a", "b"})
    assert not watch.slow  # one or two cut attempts may be an aggregator's fault
    watch.note(True, False, 1, 5.0, {"a"})
    assert watch.slow
    for _ in range(CLEAR_AFTER - 1):
        watch.note(False, True, 1, 5.0)
    watch.note(True, False, 1, 5.0, {"c"})  # cut again before the clean streak is long enough: starts over
    for _ in range(CLEAR_AFTER - 1):
        watch.note(False, True, 1, 5.0)
        assert watch.slow
    watch.note(False, True, 1, 5.0)
    assert not watch.slow


def test_sends_cut_only_at_one_aggregator_warn_but_shed_no_roles():
    # One slow receiver (its downlink, its CPU) cuts every sender's sends to it: in a small run
    # every contributor sends to it each round, and all of them would shed their roles.
    watch = UplinkWatch()
    said = [watch.note(True, False, 1, 5.0, {"slow-aggregator"}) for _ in range(WARN_AFTER + 2)]
    assert said[WARN_AFTER - 1] is not None and not watch.slow
    watch.note(True, False, 1, 5.0, {"another"})  # a second aggregator in the same streak: our end
    assert watch.slow
    watch.note(False, True, 1, 5.0)
    watch.note(True, False, 1, 5.0, {"x"})
    assert watch.cut_to == {"x"}  # a clean attempt starts the streak's aggregators over


def test_the_exchange_joins_without_serving_while_its_uplink_is_found_slow(caplog):
    # A review's volunteer on a 1 Mbit/s uplink kept its aggregator roles, and a round's aggregate
    # was lost when it held one: it could not serve the aggregate to the others in time.
    retry = SimpleNamespace(status="retry", round=0, contributors=[])
    node = _Node((AttemptResult(retry, b"", 0, False, False, False, 1, frozenset({"a", "b"})), None, None))
    joined: list[bool] = []

    async def run_attempt(round_id, attempt, segments, *, trains, serves):
        joined.append(serves)

    node.client.run_attempt = run_attempt

    def submit(coro):  # runs the attempt's first step, the join, and gives the canned outcome
        with contextlib.suppress(StopIteration, AttributeError):
            coro.send(None)
        coro.close()
        return _Node.submit(node, _noop())

    node.submit = submit
    published: list[dict] = []
    node.update_record = lambda **changes: published.append(changes)
    ex = SwarmExchange(node)
    with caplog.at_level(logging.WARNING, logger="groundswell.peer.swarm_exchange"):
        for _ in range(WARN_AFTER + 1):
            ex.contribute(0, _payloads())
            with pytest.raises(RoundFailed):
                ex.collect(0)
    assert joined == [True] * WARN_AFTER + [False] and not ex.serving
    assert published == [{"serves": False}]  # and `status` shows it
    assert any("declines aggregator and leader roles" in r.getMessage() for r in caplog.records)
    assert not SwarmExchange(node, serves=False).serving  # a private peer never serves, slow or not


async def _noop() -> None:
    pass


def test_a_commit_leaves_out_of_the_next_servers_a_reporting_aggregator_that_declined_to_serve(make_cluster):
    # Every server of a small run aggregates a shard and reports to the leader, and reporters stay
    # servers (a restarted leader lost the joins): without this a slow peer kept its roles for good.
    import torch
    from groundswell.protocol.plan import make_plan
    from swarm_harness import inputs

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=7.5, slack_s=1.5)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    slow = next(i for i in range(4) if c.ids[i] != plan.leaders[0] and c.ids[i] in plan.aggregators)
    xs = inputs(4, c.numel, 23)
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, c.segments(xs[i]), trains=True,
                                                                serves=i != slow)) for i in range(4)}
    out = {i: f.result(timeout=60) for i, f in runs.items()}
    d = out[0].decision
    assert d.status == "commit" and c.ids[slow] in d.contributors  # its work counts all the same
    # the shard's replica holds the same contributions: it is the source (it serves the aggregate)
    assert c.ids[slow] not in d.sources and c.ids[slow] not in d.servers and len(d.servers) == 3, d
    server = c.nodes[c.ids.index(plan.leaders[0])].server
    assert c.ids[slow] in {a for held in server.attempts[(0, 0)].have.values() for a in held}  # it did report
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


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
    client.me, client.sends_cut, client.cut_to = "me", 0, {}

    async def request(peer, handler, msg, expect, timeout_s):
        await asyncio.sleep(after_s)
        raise failure

    client.transport = SimpleNamespace(request=request)
    assert asyncio.run(client._offer("x", SimpleNamespace(shard=0, round=4, attempt=1), 10.0)) == "failed"
    assert client.sends_cut == counted
    assert client.cut_to == ({(4, 1): {"x"}} if counted else {})


@pytest.mark.parametrize("opened_ago_s,late", [(1.0, False), (1000.0, True)])
def test_an_attempt_reports_its_own_cut_sends_and_whether_they_went_out_late(opened_ago_s, late):
    # the hand-over from the shards' sends to what the exchange's watch reads
    plan = SimpleNamespace(round=0, attempt=0, leaders=["lead"], trainers=["me"], num_shards=3)
    client = retrying_client("me", plan, opened_ago_s)
    client.sends_cut = 5  # earlier attempts' cut sends are not this one's

    async def send_shard(plan, shard, segments, watch=None):
        if shard > 0:  # shards 1 and 2 ran out of time
            client.sends_cut += 1
            client.cut_to.setdefault((0, 0), set()).add(f"agg{shard}")
        return shard == 0

    client._send_shard = send_shard
    client.cut_to[(0, 1)] = {"another attempt's"}
    result = asyncio.run(client.run_attempt(0, 0, [b"a", b"b", b"c"], trains=True, serves=True))
    assert (result.sends_cut, result.late, result.delivered) == (2, late, False)
    assert result.cut_to == {"agg1", "agg2"} and client.cut_to == {(0, 1): {"another attempt's"}}
