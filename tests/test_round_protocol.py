"""The round protocol's required behaviours, on real nodes (libp2p streams over 127.0.0.1).

1 consistency, 2 no silent partial rounds, 3 bounded time under dead/frozen peers, 4 sharded
aggregation, 5 stragglers catch up. Each test ends by comparing what the peers hold.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import inputs as _inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_every_peer_applies_the_identical_exact_aggregate(make_cluster):
    c = make_cluster(n=3, codec_name="fp32", min_peers=3)
    for r in range(2):
        xs = _inputs(3, c.numel, seed=r)
        out = c.attempt(r, xs)
        decisions = [o.decision for o in out.values()]
        assert all(d is not None and d.status == "commit" for d in decisions)
        assert all(d.contributors == sorted(c.ids) for d in decisions)
        means = [c.fetch(i, out[i].signed) for i in range(3)]
        for m in means[1:]:
            assert torch.equal(m, means[0])  # bit-identical on every peer
        expected = (xs[0] + xs[1] + xs[2]) / 3
        assert torch.allclose(means[0], expected, atol=1e-6)


def test_incomplete_contribution_is_wholly_out_and_its_owner_knows(make_cluster):
    c = make_cluster(n=3, codec_name="fp32", min_peers=2)
    client = c.nodes[2].client
    original = client._send_shard

    async def lose_shard_one(plan, shard, segments, watch=None):
        if shard == 1:
            return False  # this shard never reaches an aggregator
        return await original(plan, shard, segments, watch)

    client._send_shard = lose_shard_one
    xs = _inputs(3, c.numel, seed=7)
    out = c.attempt(0, xs)
    d = out[0].decision
    assert d.status == "commit" and d.contributors == sorted(c.ids[:2])
    assert not out[2].delivered and c.ids[2] not in out[2].decision.contributors
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])
    assert torch.allclose(means[0], (xs[0] + xs[1]) / 2, atol=1e-6)  # none of peer 2's other shards leaked in


def test_a_contribution_that_could_not_be_recorded_is_not_sent(make_cluster):
    # A restart from an older checkpoint must know what went out: a peer whose disk refused the
    # record of its contribution keeps the work instead of sending it.
    c = make_cluster(n=3, codec_name="fp32", min_peers=2)
    recorded: list[tuple[int, int]] = []
    for i, node in enumerate(c.nodes):
        node.client.on_contribute = lambda r, a, i=i: recorded.append((i, r)) or i != 2  # node 2's disk is full
    sent = []
    original = c.nodes[2].client._send_shard

    async def count(plan, shard, segments, watch=None):
        sent.append(shard)
        return await original(plan, shard, segments, watch)

    c.nodes[2].client._send_shard = count
    xs = _inputs(3, c.numel, seed=11)
    out = c.attempt(0, xs)
    d = out[0].decision
    assert sorted(recorded) == [(0, 0), (1, 0), (2, 0)] and sent == []
    assert d.status == "commit" and d.contributors == sorted(c.ids[:2]) and not out[2].included
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert torch.allclose(means[2], (xs[0] + xs[1]) / 2, atol=1e-6)
    assert all(torch.equal(m, means[0]) for m in means)  # every peer applies the same aggregate


def test_the_contribution_record_is_written_off_the_network_loop(make_cluster):
    # It is fsynced before anything is sent: on the loop, a slow disk stalled every handler and
    # heartbeat of the node for as long.
    c = make_cluster(n=2, codec_name="fp32", min_peers=2)
    on_loop: list[bool] = []

    def record(r, a):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        return True

    for node in c.nodes:
        node.client.on_contribute = record
    out = c.attempt(0, _inputs(2, c.numel, seed=3))
    assert out[0].decision.status == "commit" and on_loop == [False, False]
    means = [c.fetch(i, out[i].signed) for i in range(2)]
    assert torch.equal(means[0], means[1])


def test_a_dead_peer_cannot_hold_the_round_past_its_deadline(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=6 * 4096, min_peers=2, deadline_s=7.0, slack_s=1.0)
    c.nodes[3].close()  # dead, yet still in the membership: it is an aggregator (and maybe a leader)
    start = time.monotonic()
    out = c.attempt(0, {i: x for i, x in _inputs(3, c.numel, 1).items()})
    elapsed = time.monotonic() - start
    d = out[0].decision
    assert d is not None and d.status == "commit" and d.contributors == sorted(c.ids[:3])
    assert elapsed < c.deadline_s + 4 * c.slack_s + 2, elapsed
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])


def test_a_frozen_aggregator_cannot_hold_the_round_past_its_deadline(make_cluster):
    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=7.0, slack_s=1.0)
    # Block the node's event loop: its daemon keeps the sockets open but nothing answers, as
    # with a closed laptop lid.
    c.freeze(3, c.deadline_s + 8 * c.slack_s)
    start = time.monotonic()
    out = c.attempt(0, {i: x for i, x in _inputs(3, c.numel, 2).items()})
    elapsed = time.monotonic() - start
    d = out[0].decision
    assert d is not None and d.status in ("commit", "retry")
    assert elapsed < c.deadline_s + 6 * c.slack_s, elapsed
    # every live peer learned the same outcome: all apply the same aggregate, or none applies one
    assert [out[i].decision.status if out[i].decision else None for i in range(3)] == [d.status] * 3
    if d.status == "commit":
        means = [c.fetch(i, out[i].signed) for i in range(3)]
        assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])
    else:  # a retry: no live peer holds a commit of the round, so none applies anything
        assert not any(0 in c.nodes[i].book.committed for i in range(3))


def test_aggregation_is_sharded_across_peers(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=4)
    out = c.attempt(0, _inputs(4, c.numel, 3))
    d = out[0].decision
    assert d.status == "commit" and d.num_shards == 4 and len(set(d.sources)) == 4
    from groundswell.protocol.shards import replica_count

    copies = 0
    for node in c.nodes:  # a shard lives on its aggregator and its replicas: nobody holds them all
        held = node.server.attempts[(0, 0)].contributions
        assert len(held) < d.num_shards
        copies += sum(len(by_sender) for by_sender in held.values())
    # each contributor's shard went to at most 1 + replica_count peers (its own shard may stay local)
    assert copies <= (1 + replica_count(c.ctx)) * d.num_shards * 4
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_an_aggregator_fetching_a_commit_parses_only_contributions_it_did_not_take(make_cluster, monkeypatch):
    # A sparse commit ships every signed contribution, and each fetcher checks them all. Those this
    # peer took as an aggregator (the commit pins the same digest) were parsed on arrival: a peer
    # holds about three of every four shards, and the old code parsed each of them twice.
    import groundswell.protocol.fetch as fetch_module

    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=4)
    out = c.attempt(0, _inputs(4, c.numel, 7))
    d = out[0].decision
    assert d.status == "commit"
    parsed: list[int] = []
    real = fetch_module.validate_segments
    monkeypatch.setattr(fetch_module, "validate_segments",
                        lambda ctx, first, segments: parsed.append(first) or real(ctx, first, segments))
    # Not the leader: it gathered and checked every shard before it announced, so its fetch parses nothing.
    me = next(i for i in range(4) if c.ids[i] != d.leader)
    node = c.nodes[me].server
    took = node.attempts[(0, d.attempt)].contributions
    held = sum(who in took.get(s, {}) for s in range(d.num_shards) for who in d.contributors)
    assert 0 < held < d.num_shards * len(d.contributors)
    mean = c.fetch(me, out[me].signed)
    assert len(parsed) == d.num_shards * len(d.contributors) - held
    assert all(torch.equal(c.fetch(i, out[i].signed), mean) for i in range(4) if i != me)


def test_a_straggler_catches_up_from_peers_and_rejoins(make_cluster):
    c = make_cluster(n=3, codec_name="int8", min_peers=2)
    xs = _inputs(3, c.numel, 4)
    out = c.attempt(0, {0: xs[0], 1: xs[1]})  # peer 2 is still training
    signed = out[0].signed
    assert out[0].decision.contributors == sorted(c.ids[:2])
    straggler = c.nodes[2]
    got = straggler.call(straggler.client.ask_decision(c.ids[0], 0, 0, 0.0), timeout_s=30)
    assert got == signed
    caught_up = c.fetch(2, got)
    assert torch.equal(caught_up, c.fetch(0, signed))
    # round 1: the straggler contributes again and is in the aggregate. Like a peer, it announces
    # itself before training: otherwise the others' contributions may complete before its join
    # reaches the leader, which then closes without it.
    straggler.call(straggler.client.announce(1, trains=True, serves=True), timeout_s=30)
    out = c.attempt(1, {0: xs[0], 1: xs[1], 2: xs[2]})
    d = out[2].decision
    assert d.status == "commit" and c.ids[2] in d.contributors
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_joiner_that_announces_a_round_already_committed_learns_it_and_announces_the_next(make_cluster):
    # Found by a review: a volunteer whose state download ended after the next commit announced
    # that round; its leaders answered "already committed", which was ignored, so nobody waited
    # for it, each contribution came after the close, and it stayed a round behind, counted in
    # nothing, for 15 rounds and more while rounds were quick.
    c = make_cluster(n=3, codec_name="int8", min_peers=2)
    xs = _inputs(3, c.numel, 4)
    out = c.attempt(0, {0: xs[0], 1: xs[1]})
    late = c.nodes[2]
    late.call(_forget_commit(late, 0), timeout_s=5)  # it has not heard of the commit (as a late joiner)
    late.call(late.client.announce(0, trains=True, serves=True), timeout_s=30)
    assert late.book.committed[0][0] == out[0].signed  # told "already committed": it asked for the commit
    plan = late.call(late.server.plan(1, late.client.current_attempt(1), wait_s=0), timeout_s=5)
    by_id = dict(zip(c.ids, c.nodes))
    assert set(plan.leaders) - {c.ids[2]}
    for leader in plan.leaders:
        if leader != c.ids[2]:
            joins = by_id[leader].call(_joins(by_id[leader], 1), timeout_s=5)
            assert joins.get(c.ids[2]) == (True, True)  # and the round after it is waiting for it
    means = [c.fetch(i, out[i].signed) for i in (0, 1)]  # round 0's contributors hold the same mean
    assert torch.equal(means[0], means[1])


async def _joins(node, round_id):
    return dict(node.server.joins[round_id])


async def _forget_commit(node, round_id):
    node.book.committed.pop(round_id, None)


def test_an_aggregator_that_dies_after_sealing_loses_nothing(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=3)
    out = c.attempt(0, _inputs(4, c.numel, 5))
    d = out[0].decision
    assert d.status == "commit"
    # kill an aggregator (not the leader, not peer 0) that sealed its shard, before peer 0 fetches
    victim = next(i for i, pid in enumerate(c.ids) if i != 0 and pid != d.leader and pid in d.sources)
    c.nodes[victim].close()
    alive = [i for i in range(4) if i != victim]
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_two_leaders_deciding_one_attempt_at_once_commit_at_most_once(make_cluster):
    # A leader that wakes from a freeze while its stand-in is still sealing both want to decide:
    # forced here by calling both at once, after the contributions are in and before the deadline.
    import concurrent.futures

    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=31.0, slack_s=1.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leaders = [c.ids.index(p) for p in plan.leaders[:2]]
    xs = _inputs(4, c.numel, 8)
    idle = next(i for i in range(4) if i not in leaders)  # joins, never contributes: nobody closes early
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(
        0, 0, None if i == idle else c.segments(xs[i]), trains=True, serves=True)) for i in range(4)}
    slot = c.nodes[leaders[0]].server.attempts[(0, 0)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(c.nodes[leaders[0]].server._sources(plan, slot)[1]) < 3:
        time.sleep(0.1)
    both = [c.nodes[i].submit(c.nodes[i].server.decide_exclusively(plan, c.nodes[i].server.attempts[(0, 0)]))
            for i in leaders]
    concurrent.futures.wait(both + list(runs.values()), timeout=60)
    out = {i: f.result(timeout=1) for i, f in runs.items()}
    decided = {n.server.attempts[(0, 0)].decision for n in c.nodes} - {None}
    commits = {n.book.committed[0][0] for n in c.nodes if 0 in n.book.committed}
    assert len(decided) == 1 and len(commits) <= 1, "two leaders decided the same attempt"
    assert len({o.signed for o in out.values()}) == 1  # every peer got the same one decision
    # three contributions were in, well before the deadline: the one decision is a commit
    assert len(commits) == 1 and decided == commits
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_later_attempt_adopts_a_commit_whose_leader_died_before_announcing_it(make_cluster):
    # Attempt 0 commits, then its leader dies before anyone asks it: only the aggregators it sealed
    # (sources and replicas) know the commit. Attempt 1's leader must adopt it, not decide again.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2)
    out = c.attempt(0, _inputs(4, c.numel, 9))
    signed, d = out[0].signed, out[0].decision
    assert d.status == "commit"
    dead = c.ids.index(d.leader)
    for node in c.nodes:  # forget the announcement everywhere; the sealed aggregates stay
        async def forget(node=node) -> None:
            node.book.committed.pop(0, None)
            node.server.attempts[(0, 0)].decision = None

        node.call(forget(), timeout_s=10)
    c.nodes[dead].close()
    plan = make_plan(c.ctx.run_id, 0, 1, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = next(c.ids.index(p) for p in plan.leaders if c.ids.index(p) != dead)
    server = c.nodes[leader].server
    c.nodes[leader].call(server.decide_exclusively(plan, server.attempts[(0, 1)]), timeout_s=60)
    assert server.attempts[(0, 1)].decision is None, "attempt 1 was decided although round 0 had a commit"
    assert server.book.committed[0][0] == signed
    alive = [i for i in range(4) if i != dead]
    means = [c.fetch(i, signed) for i in alive]  # the dead leader's shard survives on its replica
    assert all(torch.equal(m, means[0]) for m in means)


@pytest.mark.parametrize("stalled_answers", [True, False], ids=["stalled-leader-objects", "frozen-leader-fenced"])
def test_a_leader_stalled_while_deciding_and_the_next_attempts_leader_never_both_commit(make_cluster,
                                                                                         stalled_answers):
    # Attempt 0's leader passes its claim and stalls inside its decision (a freeze, a slow disk, a
    # loaded CI machine); attempt 1's leader then claims the round. If the stalled leader answers,
    # it objects; if it is frozen, the peers attempt 1's leader asked fence attempt 0 off, so the
    # stalled leader's seals are refused when it wakes and it stands back. Never two commits.
    import asyncio
    import concurrent.futures

    from swarm_harness import attempt_0_with_two_leaders

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=31.0, slack_s=1.0)
    two = attempt_0_with_two_leaders(c, seed=10)
    plan0, plan1, l0, l1, s0, s1, runs = two.plan0, two.plan1, two.l0, two.l1, two.s0, two.s1, two.runs
    deadline = time.monotonic() + 20
    stalled, wake = [], None

    async def install() -> None:
        nonlocal wake
        wake = asyncio.Event()

        async def screen(*args, **kw):  # the stall: after the claim, before anything is sealed
            stalled.append(True)
            await wake.wait()
            return set()

        s0._screen = screen

    c.nodes[l0].call(install(), timeout_s=10)
    deciding = c.nodes[l0].submit(s0.decide_exclusively(plan0, s0.attempts[(0, 0)]))
    while time.monotonic() < deadline and not stalled:
        time.sleep(0.05)
    assert stalled, "attempt 0's leader never got past its claim"
    if not stalled_answers:
        real_ask = s1._ask_claim

        async def ask(peer, plan, fence=False):  # the frozen leader does not answer
            return None if peer == c.ids[l0] else await real_ask(peer, plan, fence)

        async def patch() -> None:
            s1._ask_claim = ask

        c.nodes[l1].call(patch(), timeout_s=10)
    passed = c.nodes[l1].call(s1._claim(plan1, s1.attempts[(0, 1)]), timeout_s=30)
    assert passed != stalled_answers  # a stalled leader that answers objects; a frozen one cannot
    c.nodes[l0].call(asyncio.sleep(0), timeout_s=10)
    c.nodes[l0]._loop.call_soon_threadsafe(wake.set)
    deciding.result(timeout=60)
    concurrent.futures.wait(runs, timeout=60)
    committed_0 = {n.book.committed[0][0] for n in c.nodes if 0 in n.book.committed}
    if stalled_answers:  # attempt 1 stood back; attempt 0 commits, once, the same everywhere
        assert len(committed_0) == 1 and s0.attempts[(0, 0)].decision in committed_0
        signed = committed_0.pop()
        means = [c.fetch(i, signed) for i in range(4)]
        assert all(torch.equal(m, means[0]) for m in means)
    else:  # attempt 1's leader may decide: the woken leader of attempt 0 must have stood back
        assert s0.attempts[(0, 0)].decision is None and not committed_0


def test_an_aggregator_tells_a_leader_about_a_shard_only_when_what_it_holds_changed(make_cluster):
    # Reports used to repeat every held shard to every leader at each new contribution: 91 of a
    # 4-peer sparse round's ~170 requests. A leader's view of an aggregator only grows, so a
    # repeat tells it nothing (the refresh one slack before the close still repeats everything).
    from groundswell.protocol.schema import HaveReport

    # a long deadline: the refresh (one slack before the close) must not come into this attempt
    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=4, deadline_s=40.0, slack_s=5.0)
    sent: list[tuple[str, str, int, tuple[str, ...]]] = []
    acked: list[tuple[str, str, int, tuple[str, ...]]] = []  # repeats of these are what must not happen
    for node in c.nodes:
        transport = node.transport
        real = transport.request

        async def request(peer, handler, msg, expect, *, real=real, me=node.identity.peer_id, **kwargs):
            if not (handler == "have" and isinstance(msg, HaveReport)):
                return await real(peer, handler, msg, expect, **kwargs)
            report = (me, peer, msg.shard, tuple(msg.contributors))
            sent.append(report)
            ack = await real(peer, handler, msg, expect, **kwargs)
            if ack.ok:  # a not-ok leader (a join not there yet) is told again, by design
                acked.append(report)
            return ack

        async def patch(transport=transport, request=request) -> None:
            transport.request = request

        node.call(patch(), timeout_s=10)
    out = c.attempt(0, _inputs(4, c.numel, 5))
    assert all(o.decision is not None and o.decision.status == "commit" for o in out.values())
    assert sent, "no reports went over the network"
    assert len(acked) == len(set(acked)), "an aggregator repeated an unchanged report to a leader"
    final = {}
    for me, leader, shard, ids in sent:  # what each leader last heard: every shard's full set
        final[(me, leader, shard)] = ids
    assert any(len(ids) == 4 for ids in final.values())
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_the_same_seal_again_is_acknowledged_without_rebuilding_anything(make_cluster):
    # A leader may send its seal twice (a retransmission); a hostile one could send it in a loop
    # to make every aggregator of the attempt re-parse and re-average its shards each time.
    from groundswell.protocol.schema import Ack, Seal

    c = make_cluster(n=3, codec_name="fp32", min_peers=3)
    out = c.attempt(0, _inputs(3, c.numel, seed=5))
    d = out[0].decision
    assert d.status == "commit"
    leader = c.ids.index(d.leader)
    source = c.ids.index(d.sources[0])
    node = c.nodes[source]
    built = node.server.aggregates[(0, 0)]
    ack = c.nodes[leader].call(c.nodes[leader].transport.request(c.ids[source], "seal", Seal(out[0].signed), Ack,
                                                                timeout_s=10), timeout_s=20) \
        if leader != source else node.call(node.server._on_seal(c.ids[source], Seal(out[0].signed)), timeout_s=20)
    assert ack.ok and node.server.aggregates[(0, 0)] is built
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert all(torch.equal(m, means[0]) for m in means)  # and the round's result is the same everywhere


def test_an_aggregate_shard_is_sealed_once_however_many_peers_fetch_it(make_cluster, monkeypatch):
    # Sealing a dense shard copies and hashes all of it, and every other peer asks for it right
    # after the commit: its holder seals it once and serves those bytes to each.
    from groundswell.protocol import aggregator
    from groundswell.protocol.schema import AggregateShard
    from groundswell.protocol.server import RoundServer

    sealed, served = [], []
    real_seal, real_serve = aggregator.seal, RoundServer._sealed_aggregate

    def counting_seal(identity, run_id, msg):
        if isinstance(msg, AggregateShard):
            sealed.append((identity.peer_id, msg.shard))
        return real_seal(identity, run_id, msg)

    def counting_serve(self, key, agg):
        served.append((self.identity.peer_id, key))
        return real_serve(self, key, agg)

    monkeypatch.setattr(aggregator, "seal", counting_seal)
    monkeypatch.setattr(RoundServer, "_sealed_aggregate", counting_serve)
    c = make_cluster(n=4, codec_name="fp32", min_peers=4)
    out = c.attempt(0, _inputs(4, c.numel, 7))
    assert out[0].decision.status == "commit"
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)
    assert len(served) > len(set(served)), "no aggregate shard was asked for twice: nothing to show"
    assert sorted(sealed) == sorted(set(sealed)) and len(sealed) == len({(p, k) for p, k in served})
