"""The round protocol's required behaviours, on real nodes (libp2p streams over 127.0.0.1).

1 consistency, 2 no silent partial rounds, 3 bounded time under dead/frozen peers, 4 sharded
aggregation, 5 stragglers catch up. Each test ends by comparing what the peers hold.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def make_cluster():
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(**kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _inputs(n: int, numel: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(numel, generator=g) for i in range(n)}


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

    async def lose_shard_one(plan, shard, segments):
        if shard == 1:
            return False  # this shard never reaches an aggregator
        return await original(plan, shard, segments)

    client._send_shard = lose_shard_one
    xs = _inputs(3, c.numel, seed=7)
    out = c.attempt(0, xs)
    d = out[0].decision
    assert d.status == "commit" and d.contributors == sorted(c.ids[:2])
    assert not out[2].delivered and c.ids[2] not in out[2].decision.contributors
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])
    assert torch.allclose(means[0], (xs[0] + xs[1]) / 2, atol=1e-6)  # none of peer 2's other shards leaked in


def test_a_dead_peer_cannot_hold_the_round_past_its_deadline(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=6 * 4096, min_peers=2, deadline_s=6.0, slack_s=1.0)
    c.nodes[3].close()  # dead, yet still in the membership: it is an aggregator (and maybe a leader)
    start = time.monotonic()
    out = c.attempt(0, {i: x for i, x in _inputs(3, c.numel, 1).items()})
    elapsed = time.monotonic() - start
    d = out[0].decision
    assert d is not None and d.status == "commit" and d.contributors == sorted(c.ids[:3])
    assert elapsed < c.deadline_s + 4 * c.slack_s + 2, elapsed
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])


def test_a_shard_whose_first_aggregator_is_dead_still_gets_a_replica(make_cluster):
    # Contributors send the shard to its next candidate; the copy then goes to the next one that
    # takes it, not only to the dead first candidate: the leader can still replace a source.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=5, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    shard, dead = next((s, c.ids.index(plan.candidates(s)[0])) for s in range(plan.num_shards)
                       if plan.candidates(s)[0] != plan.leaders[0])
    c.nodes[dead].close()
    alive = [i for i in range(5) if i != dead]
    xs = _inputs(5, c.numel, 15)
    out = c.attempt(0, {i: xs[i] for i in alive})
    assert out[alive[0]].decision.status == "commit"
    leader = c.nodes[c.ids.index(plan.leaders[0])].server
    holders = [a for a, ids in leader.attempts[(0, 0)].have[shard].items() if len(ids) == len(alive)]
    assert len(holders) >= 2, f"shard {shard} is held whole by {len(holders)} aggregator(s) only"
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_burst_of_contributions_does_not_trip_the_leaders_stream_limits(make_cluster):
    # Every contribution makes its aggregator report to every leader; reports are coalesced per
    # attempt, so a burst never opens more streams to a leader than its limit (which would refuse
    # the reports and strike an honest aggregator).
    import dataclasses

    c = make_cluster(n=6, codec_name="sparseloco", numel=12 * 4096, max_shards=6, min_peers=2)
    for node in c.nodes:  # a tighter stream limit than the default 32 (more peers, more shards each)
        node.transport.guard.limits = dataclasses.replace(node.transport.guard.limits, max_streams=8)
    out = c.attempt(0, _inputs(6, c.numel, 18))
    assert out[0].decision.status == "commit" and len(out[0].decision.contributors) == 6
    refused = {k: v for n in c.nodes for k, v in n.transport.guard.rejected.items()}
    assert not refused, f"requests refused during an honest round: {refused}"
    means = [c.fetch(i, out[i].signed) for i in range(6)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_frozen_aggregator_cannot_hold_the_round_past_its_deadline(make_cluster):
    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.0)
    # Block the node's event loop: its daemon keeps the sockets open but nothing answers, as
    # with a closed laptop lid.
    c.nodes[3]._loop.call_soon_threadsafe(time.sleep, c.deadline_s + 8 * c.slack_s)
    start = time.monotonic()
    out = c.attempt(0, {i: x for i, x in _inputs(3, c.numel, 2).items()})
    elapsed = time.monotonic() - start
    d = out[0].decision
    assert d is not None and d.status in ("commit", "retry")
    assert elapsed < c.deadline_s + 6 * c.slack_s, elapsed
    if d.status == "commit":
        means = [c.fetch(i, out[i].signed) for i in range(3)]
        assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])


def test_aggregation_is_sharded_across_peers(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=4)
    out = c.attempt(0, _inputs(4, c.numel, 3))
    d = out[0].decision
    assert d.status == "commit" and d.num_shards == 4 and len(set(d.sources)) == 4
    from groundswell.protocol.aggregator import replica_count

    copies = 0
    for node in c.nodes:  # a shard lives on its aggregator and its replicas: nobody holds them all
        held = node.server.attempts[(0, 0)].contributions
        assert len(held) < d.num_shards
        copies += sum(len(by_sender) for by_sender in held.values())
    # each contributor's shard went to at most 1 + replica_count peers (its own shard may stay local)
    assert copies <= (1 + replica_count(c.ctx)) * d.num_shards * 4
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


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
    # round 1: the straggler contributes again and is in the aggregate
    out = c.attempt(1, {0: xs[0], 1: xs[1], 2: xs[2]})
    d = out[2].decision
    assert d.status == "commit" and c.ids[2] in d.contributors
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert all(torch.equal(m, means[0]) for m in means)


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

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=30.0, slack_s=1.0)
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
    if commits:
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


def test_the_leader_claims_its_attempt_before_the_close_so_a_frozen_fellow_costs_no_time(make_cluster):
    # A claim waits up to a slack for each fellow leader's answer; a frozen one never answers. The
    # leader therefore claims one slack before the close, while contributions still arrive.
    from groundswell.protocol.plan import close_time, make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.5)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.ids.index(plan.leaders[0])
    server = c.nodes[leader].server
    claimed_at = []
    real_claim = server._claim

    async def claim(plan, slot):
        claimed_at.append(time.time())
        return await real_claim(plan, slot)

    async def patch() -> None:
        server._claim = claim

    c.nodes[leader].call(patch(), timeout_s=10)
    idle = next(i for i in range(4) if i != leader)  # joins, never contributes: the leader waits to the close
    xs = _inputs(4, c.numel, 13)
    out = c.attempt(0, {i: (None if i == idle else x) for i, x in xs.items()})
    assert out[leader].decision.status == "commit"
    close = close_time(c.nodes[leader].book.opened_at(0), 0, c.ctx.deadline_s, c.ctx.slack_s)
    assert claimed_at and claimed_at[0] < close, "the leader claimed only after the close"
    means = [c.fetch(i, out[0].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_stand_in_does_not_wait_a_slack_for_a_leader_that_is_gone(make_cluster):
    # The stand-in waits one slack past the close for a leader that may be slow or frozen; one
    # that is not there at all (its dial is refused) cannot decide, so it is not waited for.
    from groundswell.protocol.plan import close_time, make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=3.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    dead, stand_in = (c.ids.index(p) for p in plan.leaders[:2])
    server = c.nodes[stand_in].server
    claimed_at = []
    real_claim = server._claim

    async def claim(plan, slot):
        claimed_at.append(time.time())
        return await real_claim(plan, slot)

    async def patch() -> None:
        server._claim = claim

    c.nodes[stand_in].call(patch(), timeout_s=10)
    c.nodes[dead].close()
    alive = [i for i in range(4) if i != dead]
    xs = _inputs(4, c.numel, 16)
    out = c.attempt(0, {i: xs[i] for i in alive})
    assert out[stand_in].decision.status == "commit" and out[stand_in].decision.leader == c.ids[stand_in]
    close = close_time(c.nodes[stand_in].book.opened_at(0), 0, c.ctx.deadline_s, c.ctx.slack_s)
    assert claimed_at and claimed_at[0] < close + c.ctx.slack_s / 2, "the stand-in waited for a dead leader"
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_leader_that_lost_its_reports_before_the_close_still_decides_on_everything_held(make_cluster):
    # A leader that restarts mid-attempt forgets every report. Aggregators send their reports
    # again one slack before the close, so it still commits every complete contribution.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.5)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.ids.index(plan.leaders[0])
    server = c.nodes[leader].server
    idle = next(i for i in range(4) if i != leader)  # joins, never contributes: the leader waits to the close
    xs = _inputs(4, c.numel, 17)
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == idle else c.segments(xs[i]),
                                                                trains=True, serves=True)) for i in range(4)}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(server._sources(plan, server.attempts[(0, 0)])[1]) < 3:
        time.sleep(0.05)

    async def forget() -> None:  # what a restart leaves of the leader's view of the attempt
        server.attempts[(0, 0)].have.clear()

    c.nodes[leader].call(forget(), timeout_s=10)
    out = {i: f.result(timeout=60) for i, f in runs.items()}
    d = out[leader].decision
    assert d.status == "commit" and d.contributors == sorted(c.ids[i] for i in range(4) if i != idle)
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_leader_that_lost_its_join_records_still_names_every_serving_aggregator(make_cluster):
    # The next round is planned from a commit's servers. A leader that restarted mid-round has no
    # join records; the aggregators that reported to it still serve, so they stay servers.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.5)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.ids.index(plan.leaders[0])
    server = c.nodes[leader].server
    idle = next(i for i in range(4) if i != leader)  # the leader waits to the close
    xs = _inputs(4, c.numel, 19)
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == idle else c.segments(xs[i]),
                                                                trains=True, serves=True)) for i in range(4)}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(server._sources(plan, server.attempts[(0, 0)])[1]) < 3:
        time.sleep(0.05)

    async def forget() -> None:
        server.joins.clear()

    c.nodes[leader].call(forget(), timeout_s=10)
    out = {i: f.result(timeout=60) for i, f in runs.items()}
    d = out[leader].decision
    assert d.status == "commit"
    reporters = {a for held in server.attempts[(0, 0)].have.values() for a in held}
    assert len(reporters) >= 3 and reporters <= set(d.servers), (reporters, d.servers)


def test_an_aggregator_that_is_behind_refuses_shards_it_could_not_report(make_cluster):
    # A peer that does not know the previous round's decision yet (it is catching up) cannot plan
    # the round, so it could never report a shard it held: it refuses, and the contributor's
    # shard goes to the next candidate.
    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.0)
    behind = 3

    async def forget() -> None:
        c.nodes[behind].book.committed.clear()

    c.nodes[behind].call(forget(), timeout_s=10)
    xs = _inputs(3, c.numel, 20)
    out = c.attempt(0, xs)
    d = out[0].decision
    assert d.status == "commit" and d.contributors == sorted(c.ids[:3])
    held = c.nodes[behind].server.attempts.get((0, 0))
    assert held is None or not any(held.contributions.values()), "a peer that is behind held shards"
    means = [c.fetch(i, out[i].signed) for i in range(3)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_commit_its_leader_could_not_gather_is_taken_back_and_stops_no_later_attempt(make_cluster):
    # Attempt 0's leaders seal a commit and then cannot gather its aggregate (forced here), so
    # they decide retry. The retry takes the sealed commit back at every aggregator: attempt 1's
    # leader must not be handed it (it would spend its window trying to adopt it), and decides.
    from groundswell.protocol.transport import PeerUnavailable

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=6.0, slack_s=1.0)

    async def cannot_gather(signed: bytes) -> None:
        raise PeerUnavailable("forced: the aggregate cannot be gathered")

    real = {}
    for node in c.nodes:
        async def patch(node=node) -> None:
            real[node.identity.peer_id] = node.server.prefetch
            node.server.prefetch = cannot_gather

        node.call(patch(), timeout_s=10)
    xs = _inputs(4, c.numel, 12)
    out0 = c.attempt(0, xs)
    assert {o.decision.status for o in out0.values()} == {"retry"}
    sealed = [i for i, n in enumerate(c.nodes) if n.server.attempts[(0, 0)].sealed is not None]
    assert not sealed, f"nodes {sealed} still hold attempt 0's commit after its leader retried"
    for node in c.nodes:
        async def restore(node=node) -> None:
            node.server.prefetch = real[node.identity.peer_id]

        node.call(restore(), timeout_s=10)
    out1 = c.attempt(0, xs, attempt=1)
    signed = out1[0].signed
    assert out1[0].decision.status == "commit" and out1[0].decision.attempt == 1
    assert len({o.signed for o in out1.values()}) == 1
    means = [c.fetch(i, signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_restarted_peer_never_sends_a_second_contribution_to_an_attempt_and_knows_which_one_counted(make_cluster):
    # Peer X sends v1 to attempt 0 and "crashes"; its restart (the attempt it contributed to is
    # restored from its state dir) trains v2 while attempt 0 is still open. v2 must go to attempt 1,
    # not to attempt 0 (aggregators would refuse it as equivocation and strike X), and when attempt
    # 0 commits with v1, X must see that its v2 is not the one counted: it keeps v2's work.
    import asyncio

    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=8.0, slack_s=1.0)
    x = 3
    xs = _inputs(4, c.numel, 14)
    v2 = xs[x] + 1.0
    client = c.nodes[x].client
    plan0 = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    first_life = c.segments(xs[x])
    async def first_life_sends() -> None:
        client.contributed[0] = 0
        await asyncio.gather(*(client._send_shard(plan0, s, first_life) for s in range(plan0.num_shards)))

    c.nodes[x].call(first_life_sends(), timeout_s=30)

    async def restart() -> None:  # what a restarted process knows: only the persisted marker
        client.contributed = {0: 0}
        client.retried = {}

    c.nodes[x].call(restart(), timeout_s=10)
    futures = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, c.segments(xs[i]), trains=True, serves=True))
               for i in range(3)}
    futures[x] = c.nodes[x].submit(client.run_attempt(0, None, c.segments(v2), trains=True, serves=True))
    out = {i: f.result(timeout=90) for i, f in futures.items()}
    assert out[x].attempt == 1, "the restarted peer sent to the attempt its earlier life had contributed to"
    d = out[0].decision
    assert d.status == "commit" and d.attempt == 0 and c.ids[x] in d.contributors
    assert out[x].decision is not None and out[x].signed == out[0].signed
    assert not out[x].included and all(out[i].included for i in range(3))
    assert not any(k.startswith("equivocation") for n in c.nodes for k in n.transport.guard.rejected)
    mean = c.fetch(0, out[0].signed)
    assert torch.allclose(mean, sum(c.sent(xs[i]) for i in range(4)) / 4, atol=1e-6)  # v1 counted, not v2
    assert all(torch.equal(c.fetch(i, out[0].signed), mean) for i in range(1, 4))


@pytest.mark.parametrize("stalled_answers", [True, False], ids=["stalled-leader-objects", "frozen-leader-fenced"])
def test_a_leader_stalled_while_deciding_and_the_next_attempts_leader_never_both_commit(make_cluster,
                                                                                         stalled_answers):
    # Attempt 0's leader passes its claim and stalls inside its decision (a freeze, a slow disk, a
    # loaded CI machine); attempt 1's leader then claims the round. If the stalled leader answers,
    # it objects; if it is frozen, the peers attempt 1's leader asked fence attempt 0 off, so the
    # stalled leader's seals are refused when it wakes and it stands back. Never two commits.
    import asyncio
    import concurrent.futures

    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=30.0, slack_s=1.0)
    plan0 = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    plan1 = make_plan(c.ctx.run_id, 0, 1, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    l0 = c.ids.index(plan0.leaders[0])
    l1 = next(c.ids.index(p) for p in plan1.leaders if c.ids.index(p) != l0)
    s0, s1 = c.nodes[l0].server, c.nodes[l1].server
    xs = _inputs(4, c.numel, 10)
    idle = next(i for i in range(4) if i not in (l0, l1))  # joins, never contributes: nobody closes early
    runs = [c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == idle else c.segments(xs[i]),
                                                             trains=True, serves=True)) for i in range(4)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(s0._sources(plan0, s0.attempts[(0, 0)])[1]) < 3:
        time.sleep(0.1)
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
