"""Round liveness under churn, on real nodes (libp2p streams over 127.0.0.1): what keeps a round
committing on its first attempt when aggregators and contributors die, freeze, fall behind or
restart mid-round. Faults of the attempt's leaders are in test_leader_faults.py and test_leader_claims.py.

Each test fails on the code before its fix and ends by comparing what the peers hold.
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


def test_a_shard_whose_first_aggregator_is_dead_still_gets_a_replica(make_cluster):
    # Contributors send the shard to its next candidate; the copy then goes to the next one that
    # takes it, not only to the dead first candidate: the leader can still replace a source.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=5, codec_name="fp32", min_peers=2, deadline_s=7.0, slack_s=1.0)
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


@pytest.mark.parametrize("codec_name, numel", [("fp32", None), ("fp32", 8 * 65536), ("sparseloco", 8 * 4096)],
                         ids=["fp32", "fp32-512KB-shards", "sparseloco"])
def test_a_frozen_aggregator_costs_contributors_a_hedge_not_the_attempt(make_cluster, codec_name, numel):
    # A shard's first aggregator froze (sockets open, no answers). Contributors give the shard to
    # the next candidate once a short hedge has passed (shards up to 256 KiB go to every copy's
    # aggregator at once), or, for a bigger shard, once the frozen one has not answered a ping for
    # a slack. The old code waited out the request timeout, two slacks and more, which at these
    # settings (and the manifest defaults) ends after the attempt's close: the round was retried.
    from groundswell.protocol.plan import make_plan

    size = {"numel": numel} if numel else {}
    # The frozen peer may also be a fellow leader (its claim answer then costs the leader a slack).
    c = make_cluster(n=4, codec_name=codec_name, min_peers=2, deadline_s=12.0, slack_s=4.0, **size)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    frozen = next(c.ids.index(plan.candidates(s)[0]) for s in range(plan.num_shards)
                  if plan.candidates(s)[0] != plan.leaders[0])
    thaw = c.freeze(frozen, 2 * c.deadline_s)
    alive = [i for i in range(4) if i != frozen]
    xs = _inputs(4, c.numel, 31)
    out = c.attempt(0, {i: xs[i] for i in alive})
    d = out[alive[0]].decision
    assert d is not None and d.status == "commit", f"attempt 0 ended in {d and d.status}"
    assert sorted(d.contributors) == sorted(c.ids[i] for i in alive)
    assert all(out[i].delivered and out[i].included for i in alive)
    thaw()  # (after the attempt: the frozen peer then learns the commit and fetches the mean too)
    means = [c.fetch(i, out[alive[0]].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_an_aggregator_one_round_behind_learns_the_commit_from_whoever_sends_it_work(make_cluster):
    # A peer still busy with round 0 (it has not polled round 0's decision: a coordinator that is
    # evaluating, a volunteer still training) gets round 1's shards. It asks the sender for the
    # commit it lacks and takes them. The old code refused them ("round 0 is not known here yet")
    # and, as a leader, could not plan the attempt for up to a slack per request.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=2, deadline_s=9.0, slack_s=1.5)
    plan0 = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    lag = next(i for i in range(4) if c.ids[i] not in plan0.leaders)  # learns round 0's commit only by asking
    others = [i for i in range(4) if i != lag]
    xs = _inputs(4, c.numel, 51)
    out0 = c.attempt(0, {i: xs[i] for i in others})
    d0 = out0[others[0]].decision
    assert d0.status == "commit" and c.ids[lag] in d0.servers
    assert c.nodes[lag].book.latest() == -1, "the lagging peer learned round 0's commit without asking"
    out1 = c.attempt(1, {i: xs[i] for i in others})
    d1 = out1[others[0]].decision
    assert d1.status == "commit" and d1.round == 1
    node = c.nodes[lag]
    assert node.book.latest() >= 0, "the lagging peer never learned round 0's commit"
    took = node.server.attempts.get((1, d1.attempt))
    assert took is not None and any(took.contributions.values()), "the lagging peer took no shard of round 1"
    means = [c.fetch(i, out1[others[0]].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_long_poll_for_an_attempt_ends_when_the_round_commits_in_another(make_cluster):
    # A follower polls the leaders of the attempt it joined. When the round commits in another
    # attempt, the poll must end then, not when its wait runs out: the coordinator's follower,
    # waiting on attempt 0 while attempt 1 committed, fell 15 rounds behind a fast swarm, past
    # the 8 rounds whose aggregates peers keep, and had to download the state twice in one run.
    from groundswell.protocol.plan import make_plan
    from groundswell.protocol.schema import DecisionReply, DecisionRequest

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=1.0)
    plan0 = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    asked = c.ids.index(plan0.leaders[0])
    asker = next(i for i in range(4) if i != asked)
    wait_s = 8.0
    poll = c.nodes[asker].submit(c.nodes[asker].transport.request(
        c.ids[asked], "get-decision", DecisionRequest(0, 0, wait_s), DecisionReply, timeout_s=wait_s + 5))
    out = c.attempt(0, _inputs(4, c.numel, 61), attempt=1)
    d = out[asked].decision
    assert d.status == "commit" and d.attempt == 1
    committed_at = time.monotonic()
    reply = poll.result(timeout=wait_s + 10)
    late = time.monotonic() - committed_at
    assert reply.decision == out[asked].signed
    assert late < wait_s / 2, f"the poll for attempt 0 answered {late:.1f} s after the round committed in attempt 1"
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_commit_of_an_attempt_that_has_not_begun_is_refused_and_not_learned(make_cluster):
    # Roles reshuffle every attempt, so any server leads some far-off attempt of the open round.
    # A commit it signs for that attempt must not count: a peer that asks it for the round's
    # commit (because it sent work for the next round) would otherwise record a commit nobody
    # made and refuse the real one. A review of the first version found this hole.
    import os

    from groundswell.protocol.envelope import seal
    from groundswell.protocol.plan import make_plan
    from groundswell.protocol.schema import Decision, DecisionReply, ProtocolError

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=1.0)
    victim, hostile = 0, 1
    numels = len(c.ctx.segment_numels)
    far = next(a for a in range(10, 200) if c.ids[hostile] in
               make_plan(c.ctx.run_id, 0, a, c.ids, c.ids, numels, c.max_shards).leaders)
    plan = make_plan(c.ctx.run_id, 0, far, c.ids, c.ids, numels, c.max_shards)
    contributors = sorted(c.ids[:2])
    forged = seal(c.nodes[hostile].identity, c.ctx.run_id, Decision(
        0, far, "commit", contributors, list(c.ids), list(c.ids), c.ids[hostile],
        [plan.candidates(s)[0] for s in range(plan.num_shards)], plan.num_shards, time.time(),
        [os.urandom(16) for _ in range(plan.num_shards * len(contributors))]))
    node = c.nodes[victim]
    with pytest.raises(ProtocolError, match="has not begun"):
        node.call(node.server.verify_commit(forged), timeout_s=10)
    # The hostile peer sent work for round 1; asked for round 0's commit, it answers with the forgery.
    real_request = node.transport.request

    async def request(peer, handler, msg, reply_type, **kw):
        if peer == c.ids[hostile] and handler == "get-decision":
            return DecisionReply(forged)
        return await real_request(peer, handler, msg, reply_type, **kw)

    async def learn() -> object:
        node.transport.request = request
        try:
            return await node.server.plan(1, 0, 1.0, ask=c.ids[hostile])
        finally:
            node.transport.request = real_request

    assert node.call(learn(), timeout_s=10) is None
    assert node.book.latest() == -1, "the victim recorded a commit of an attempt that has not begun"
    assert node.transport.guard.rejected.get("forged-decision:decision-reply", 0) == 1


@pytest.mark.parametrize("replicas, holders", [(None, 2), (0, 1)])
def test_round_replicas_sets_how_many_aggregators_hold_each_dense_shard(make_cluster, replicas, holders):
    # A dense shard goes to its aggregator and, by default, one replica; `round.replicas = 0` saves
    # that upload (a source that dies before its seal then costs a retry).
    c = make_cluster(n=4, codec_name="fp32", min_peers=4, replicas=replicas)
    out = c.attempt(0, _inputs(4, c.numel, 21))
    d = out[0].decision
    assert d.status == "commit" and len(d.contributors) == 4
    leader = c.nodes[c.ids.index(d.leader)].server
    have = leader.attempts[(0, d.attempt)].have
    for shard in range(d.num_shards):
        whole = [a for a, ids in have[shard].items() if len(ids) == 4]
        assert len(whole) == holders, f"shard {shard} is held whole by {len(whole)} aggregators, not {holders}"
    means = [c.fetch(i, out[i].signed) for i in range(4)]
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


def test_an_aggregator_that_is_behind_refuses_shards_it_could_not_report(make_cluster):
    # A peer that does not know the previous round's decision yet (it is catching up) cannot plan
    # the round, so it could never report a shard it held: it refuses, and the contributor's
    # shard goes to the next candidate.
    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=7.0, slack_s=1.0)
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


def test_a_restarted_peer_never_sends_a_second_contribution_to_an_attempt_and_knows_which_one_counted(make_cluster):
    # Peer X sends v1 to attempt 0 and "crashes"; its restart (the attempt it contributed to is
    # restored from its state dir) trains v2 while attempt 0 is still open. v2 must go to attempt 1,
    # not to attempt 0 (aggregators would refuse it as equivocation and strike X), and when attempt
    # 0 commits with v1, X must see that its v2 is not the one counted: it keeps v2's work.
    import asyncio

    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=1.0)
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


def _freeze_first_sealer(c, leader, pick, seconds: float, thaws_at: list[float] | None = None) -> list[str]:
    """Patch every aggregator but `leader`: the first asked to seal (build) a decision `d` with
    `pick(its id, d)` true stalls that build `seconds` first (it runs in a worker thread: the
    seal goes unanswered meanwhile, as from a frozen peer). The list names it once it has;
    `thaws_at` gets the monotonic time its freeze ends (set as it begins)."""
    import threading

    from groundswell.protocol.envelope import unseal
    from groundswell.protocol.schema import Decision

    frozen: list[str] = []
    lock = threading.Lock()
    for node in c.nodes:
        if node is leader:
            continue
        server = node.server
        real_build = server._build

        def build(signed, shard, held, first, sq_norms=None, server=server, real_build=real_build):
            _, d = unseal(signed, c.ctx.run_id, Decision)
            me = server.identity.peer_id
            with lock:
                freeze = not frozen and pick(me, d)
                if freeze:
                    frozen.append(me)
            if freeze:
                if thaws_at is not None:
                    thaws_at.append(time.monotonic() + seconds)
                time.sleep(seconds)
            return real_build(signed, shard, held, first, sq_norms)

        async def patch(server=server, build=build) -> None:
            server._build = build

        node.call(patch(), timeout_s=10)
    return frozen


def test_a_source_that_freezes_at_the_seal_does_not_hold_the_commit_until_it_thaws(make_cluster):
    # Each shard's replicas are sealed with its source. A source that froze just then never
    # answers; once its shard's replica has sealed, it gets only a short grace before the leader
    # replaces it by that replica. (If the replica's report has not reached the leader yet, the
    # source gets the full seal timeout, about a slack.) The old code sealed the replicas only
    # after replacing the source, the frozen one among them, and so waited until it thawed.

    from groundswell.protocol.decision import seal_grace
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=10.0, slack_s=4.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.nodes[c.ids.index(plan.leaders[0])]
    # the source's seal goes unanswered for 12 s (three slacks): the lid closes as it seals
    thaws_at: list[float] = []
    frozen = _freeze_first_sealer(c, leader, lambda me, d: me in d.sources, 3 * c.slack_s, thaws_at)
    timeline: dict[str, float] = {}
    real_seal_all, real_learn = leader.server._seal_all, leader.server._learn

    async def seal_all(*args, **kwargs):
        timeline.setdefault("first_seal", time.monotonic())
        return await real_seal_all(*args, **kwargs)

    async def learn(*args, **kwargs):
        timeline.setdefault("decided", time.monotonic())
        return await real_learn(*args, **kwargs)

    async def patch_leader() -> None:
        leader.server._seal_all, leader.server._learn = seal_all, learn

    leader.call(patch_leader(), timeout_s=10)
    out = c.attempt(0, _inputs(4, c.numel, 21))
    d = out[c.ids.index(plan.leaders[0])].decision
    assert frozen, "no source was asked to seal"
    assert d.status == "commit" and frozen[0] not in d.sources, d
    # Causal, not a wall-clock bound (a loaded machine once stretched a 1.5-slack bound): the
    # commit came while the source was still frozen, not after it thawed as with the old code.
    took = timeline["decided"] - timeline["first_seal"]
    assert thaws_at and timeline["decided"] < thaws_at[0], \
        f"the commit waited for the frozen source: sealing to commit took {took:.1f} s (grace {seal_grace(c.ctx)} s)"
    # The frozen source's own attempt once ended without the decision in a full-suite run (the
    # cause is not pinned down). A peer in that state asks for it as any straggler does, and
    # must get the commit and assemble the same mean as everyone.
    thawed = c.ids.index(frozen[0])
    assert all(out[i].signed for i in range(4) if i != thawed)
    signed = out[thawed].signed
    if not signed:
        node = c.nodes[thawed]
        signed = node.call(node.client.ask_decision(plan.leaders[0], 0, 0, 5.0), timeout_s=30)
    assert signed == out[c.ids.index(plan.leaders[0])].signed
    means = [c.fetch(i, out[i].signed or signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_the_only_holder_of_a_shard_frozen_at_the_seal_is_waited_for_within_the_attempts_deadline(make_cluster):
    # With no replica, a source that froze for longer than one seal timeout (a slack and the
    # shard's transfer) used to be given up on: its shard had no holder left, the round was
    # retried, and a churn run lost 70 s of one round waiting for the next attempts, although
    # the source was back (holding every contribution) 20 ms later, well within the attempt's
    # deadline. The leader now waits for it until the attempt's deadline.

    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=3, codec_name="fp32", min_peers=2, deadline_s=16.0, slack_s=2.0, replicas=0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.nodes[c.ids.index(plan.leaders[0])]
    # blocks the node's event loop for longer than a seal's timeout
    frozen = _freeze_first_sealer(c, leader, lambda me, d: d.status == "commit", 3 * c.slack_s)
    out = c.attempt(0, _inputs(3, c.numel, 23))
    d = out[c.ids.index(plan.leaders[0])].decision
    assert frozen, "no aggregator other than the leader was asked to seal"
    assert d is not None and d.status == "commit" and len(d.contributors) == 3, d
    assert frozen[0] in d.sources  # waited for, not replaced: no other peer held its shard
    means = [c.fetch(i, out[i].signed or out[c.ids.index(plan.leaders[0])].signed) for i in range(3)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_source_that_freezes_after_the_commit_costs_a_fetcher_a_short_hedge_not_a_timeout(make_cluster):
    # A fetcher asks a shard's source first. If the source froze after the commit, the next
    # holder is asked too once a short hedge has passed, instead of after the whole request timeout.
    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=10.0, slack_s=4.0)
    out = c.attempt(0, _inputs(4, c.numel, 23))
    d = out[0].decision
    assert d.status == "commit"
    pick = next(((s, c.ids.index(src), f) for s, src in enumerate(d.sources) if src != d.leader
                 for f in range(4) if c.ids[f] not in (src, d.leader)
                 and (0, s) not in c.nodes[f].server.aggregates), None)
    assert pick is not None, "every other node already holds every shard; nothing to fetch"
    shard, source, fetcher = pick
    thaw = c.freeze(source, 3 * c.slack_s)
    start = time.monotonic()
    mean = c.fetch(fetcher, out[fetcher].signed)
    took = time.monotonic() - start
    assert took < c.slack_s, f"fetching round 0 took {took:.1f} s with shard {shard}'s source frozen"
    thaw()  # then everyone must agree
    assert all(torch.equal(c.fetch(i, out[i].signed), mean) for i in range(4))


def test_a_commit_whose_time_is_far_from_its_rounds_opening_and_now_is_refused(make_cluster):
    # A commit's time opens the next round, and every later attempt number is counted from it: a
    # leader signing time 0 (attempts past what messages may carry) or an hour ahead (no retry
    # would open for an hour) would stall the run.
    import os
    from dataclasses import replace

    from groundswell.protocol.envelope import seal
    from groundswell.protocol.plan import make_plan
    from groundswell.protocol.schema import Decision, ProtocolError

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=1.0)
    numels = len(c.ctx.segment_numels)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, numels, c.max_shards)
    leader = c.ids.index(plan.leaders[0])
    contributors = sorted(c.ids[:2])
    honest = Decision(0, 0, "commit", contributors, sorted(c.ids), sorted(c.ids), plan.leaders[0],
                      [plan.candidates(s)[0] for s in range(plan.num_shards)], plan.num_shards, time.time(),
                      [os.urandom(16) for _ in range(plan.num_shards * len(contributors))])
    node = c.nodes[(leader + 1) % 4]

    def check(when: float):
        return node.call(node.server.verify_commit(seal(c.nodes[leader].identity, c.ctx.run_id,
                                                        replace(honest, time=when))), timeout_s=10)

    assert check(time.time()).round == 0
    for when in (0.0, time.time() + 3600):
        with pytest.raises(ProtocolError, match="a commit's time"):
            check(when)


def test_a_contributor_late_to_its_attempt_polls_a_silent_leader_only_until_the_attempt_is_over():
    # A peer that contributed near its attempt's close used to long-poll the leader for the whole
    # `wait_s` (deadline plus slacks) and so missed the next attempt (20 s in a churn run).
    import asyncio
    from types import SimpleNamespace

    from groundswell.protocol.client import RoundClient

    asked: list[float] = []

    async def ask_decision(peer, round_id, attempt, wait_s, plan=None) -> bytes:
        asked.append(wait_s)
        await asyncio.sleep(min(wait_s, 0.2))
        return b""

    client = SimpleNamespace(ask_decision=ask_decision)
    plan = SimpleNamespace(round=3, attempt=1)
    signed = asyncio.run(RoundClient._poll_decision(client, "leader", plan, time.time() + 1.0, 20.0))
    assert signed == b"" and asked and asked[0] <= 1.0 and all(w <= 1.0 for w in asked)


def _shard_sender(over: bool, verdict: str = "ok"):
    """A RoundClient whose offers record their timeout and answer `verdict`; `over`: the attempt's
    close has passed by our clock."""
    from types import SimpleNamespace

    from groundswell.protocol.client import RoundClient

    client = object.__new__(RoundClient)
    client.ctx = SimpleNamespace(slack_s=5.0, replicas=0, codec=SimpleNamespace(name="fp32"), verify_aggregates=False)
    timeouts: list[float] = []

    async def offer(peer, msg, timeout, progress=None):
        timeouts.append(timeout)
        return verdict

    client._offer = client._pinged_offer = offer
    client._attempt_over = lambda plan: over
    plan = SimpleNamespace(round=0, attempt=0, shard_segments=[(i, i + 1) for i in range(8)],
                           candidates=lambda shard: ["a", "b", "c", "d"])
    return client, plan, timeouts


def test_a_big_shard_gets_the_time_of_the_whole_contribution_it_shares_the_uplink_with():
    # Found by a review: each of a contribution's 8 big shards (all sent at once) got the time its
    # own bytes need, so on a 6 MB/s uplink that could carry the whole contribution in time every
    # request was cut off and sent again elsewhere, and none landed.
    from groundswell.protocol.shard_send import PARALLEL_COPIES_BYTES

    client, plan, timeouts = _shard_sender(over=False)
    segments = [b"x" * (PARALLEL_COPIES_BYTES + 1)] * 8
    assert asyncio.run(client._send_shard(plan, 0, segments))
    assert timeouts == [2 * 5.0 + 8 * len(segments[0]) / 5e6]
    small = [b"x" * 1000] * 8  # a small shard's copies go at once, each with its own time
    client, plan, timeouts = _shard_sender(over=False)
    asyncio.run(client._send_shard(plan, 0, small))
    assert timeouts == [2 * 5.0 + 1000 / 5e6]


def test_past_the_close_a_shard_goes_to_no_candidate_more():
    # ...and once the attempt's close had passed, a refused shard still went to candidate after
    # candidate, past the close and the decision it should be waiting for.
    from groundswell.protocol.shard_send import PARALLEL_COPIES_BYTES

    client, plan, timeouts = _shard_sender(over=True, verdict="busy")
    assert not asyncio.run(client._send_shard(plan, 0, [b"x" * (PARALLEL_COPIES_BYTES + 1)] * 8))
    assert len(timeouts) == 1  # the first candidate only
