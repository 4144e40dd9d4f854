"""Leaders' claims on real nodes (libp2p on loopback): claim timing, stand-ins, dead or lagging leaders."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import inputs as _inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _record_claims(node) -> list[float]:
    """Wall-clock times at which `node` claims an attempt (appended as it happens)."""
    server, times = node.server, []
    real_claim = server._claim

    async def claim(plan, slot):
        times.append(time.time())
        return await real_claim(plan, slot)

    async def patch() -> None:
        server._claim = claim

    node.call(patch(), timeout_s=10)
    return times


def test_the_leader_claims_its_attempt_before_the_close_so_a_frozen_fellow_costs_no_time(make_cluster):
    # A claim waits up to a slack for each fellow leader's answer; a frozen one never answers. The
    # leader therefore claims one slack before the close, while contributions still arrive.
    from groundswell.protocol.plan import close_time, make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=7.5, slack_s=1.5)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.ids.index(plan.leaders[0])
    claimed_at = _record_claims(c.nodes[leader])
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

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=3.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    dead, stand_in = (c.ids.index(p) for p in plan.leaders[:2])
    claimed_at = _record_claims(c.nodes[stand_in])
    c.nodes[dead].close()
    alive = [i for i in range(4) if i != dead]
    xs = _inputs(4, c.numel, 16)
    out = c.attempt(0, {i: xs[i] for i in alive})
    assert out[stand_in].decision.status == "commit" and out[stand_in].decision.leader == c.ids[stand_in]
    close = close_time(c.nodes[stand_in].book.opened_at(0), 0, c.ctx.deadline_s, c.ctx.slack_s)
    assert claimed_at and claimed_at[0] < close + c.ctx.slack_s / 2, "the stand-in waited for a dead leader"
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_leader_that_failed_to_answer_is_asked_again_for_the_decision(make_cluster):
    # A contributor's long poll at a leader whose process just died fails at once. The leader may
    # be restarted within seconds and decide (it did, in a churn run: the others learned the
    # commit only 14 s later, by catching up), so it is asked again until it could have decided.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=5, codec_name="fp32", min_peers=2, deadline_s=7.0, slack_s=1.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader = c.ids.index(plan.leaders[0])
    for fellow in plan.leaders[1:]:  # gone, so no fellow leader can pass the decision on either
        c.nodes[c.ids.index(fellow)].close()
    alive = [i for i in range(5) if c.ids[i] not in plan.leaders[1:]]
    failed_once: set[int] = set()
    for i in alive:
        node = c.nodes[i]
        if i == leader:
            continue
        client = node.client
        real_ask = client.ask_decision

        async def ask(peer, round_id, attempt, wait_s, attempt_plan=None, i=i, real_ask=real_ask):
            if peer == plan.leaders[0] and i not in failed_once:
                failed_once.add(i)
                return b""  # as when the leader's process has just been killed
            return await real_ask(peer, round_id, attempt, wait_s, attempt_plan)

        async def patch(client=client, ask=ask) -> None:
            client.ask_decision = ask

        node.call(patch(), timeout_s=10)
    xs = _inputs(5, c.numel, 22)
    out = c.attempt(0, {i: xs[i] for i in alive})
    assert failed_once == set(alive) - {leader}
    signed = out[leader].signed
    assert out[leader].decision.status == "commit"
    assert all(o.signed == signed for o in out.values()), {i: o.decision for i, o in out.items()}
    means = [c.fetch(i, signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_stand_in_whose_leader_died_after_the_close_does_not_wait_on_leaders_behind_it(make_cluster):
    # The leader is alive at the close (so the stand-in gives it a slack) and dies before deciding.
    # The stand-in then asks who may have decided: the leaders ahead of it, not those behind it,
    # which wait longer than it does (a long poll at one of them cost half a slack more).
    import threading

    from groundswell.protocol.plan import close_time, make_plan

    c = make_cluster(n=5, codec_name="fp32", min_peers=2, deadline_s=8.0, slack_s=2.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader, stand_in = (c.ids.index(p) for p in plan.leaders[:2])

    async def never_claims(plan, slot) -> bool:
        return False  # stands back, then is killed below (a claim it passed would bind the others' grants)

    async def patch() -> None:
        c.nodes[leader].server._claim = never_claims

    c.nodes[leader].call(patch(), timeout_s=10)
    claimed_at = _record_claims(c.nodes[stand_in])
    close = close_time(c.nodes[stand_in].book.opened_at(0), 0, c.ctx.deadline_s, c.ctx.slack_s)
    killer = threading.Timer(close + c.ctx.slack_s / 2 - time.time(), c.nodes[leader].close)
    killer.start()
    try:
        alive = [i for i in range(5) if i != leader]
        xs = _inputs(5, c.numel, 24)
        out = c.attempt(0, {i: xs[i] for i in alive})
    finally:
        killer.join()
    d = out[stand_in].decision
    assert d.status == "commit" and d.leader == c.ids[stand_in]
    assert claimed_at and claimed_at[0] < close + 1.25 * c.ctx.slack_s, f"claimed at close + {claimed_at[0] - close:.2f} s"
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_leader_that_dies_after_its_claim_passed_gives_its_grants_back(make_cluster):
    # The leader claims one slack before the close and its fellow leaders grant it the attempt.
    # If it dies before deciding, they take their grants back once no stream to it can be opened
    # (its process is gone), and a stand-in decides the attempt. Before, the dead leader kept the
    # grants, nobody could decide attempt 0, and the round lost a whole slot (a 73 s round in a
    # churn run with a 30 s deadline).
    import asyncio
    import threading

    from groundswell.protocol.plan import close_time, make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=7.5, slack_s=1.5)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    leader, stand_in = (c.ids.index(p) for p in plan.leaders[:2])
    passed = threading.Event()

    async def die_instead_of_deciding(plan_, slot_) -> None:  # the claim passed; the process dies
        passed.set()
        await asyncio.Event().wait()

    async def patch() -> None:
        c.nodes[leader].server._decide_claimed = die_instead_of_deciding

    c.nodes[leader].call(patch(), timeout_s=10)
    idle = next(i for i in range(4) if i not in (leader, stand_in))  # joins, never contributes: no early close
    xs = _inputs(4, c.numel, 22)
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == idle else c.segments(xs[i]),
                                                                trains=True, serves=True)) for i in range(4)}
    assert passed.wait(60), "the leader never passed its claim"
    c.nodes[leader].close()
    alive = [i for i in range(4) if i != leader]
    out = {i: runs[i].result(timeout=120) for i in alive}
    decision = out[stand_in].decision
    assert decision is not None and decision.status == "commit" and decision.attempt == 0, \
        "nobody decided the attempt whose leader died holding the grants"
    close = close_time(c.nodes[stand_in].book.opened_at(0), 0, c.ctx.deadline_s, c.ctx.slack_s)
    assert decision.time < close + 3 * c.ctx.slack_s, f"decided {decision.time - close:.1f} s after the close"
    assert all(out[i].signed == out[stand_in].signed for i in alive)
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_stand_in_does_not_wait_for_a_leader_that_is_behind(make_cluster):
    # A leader that has not learned the previous round's decision cannot plan the attempt: it
    # neither claims it (on time, a slack before the close) nor objects to a stand-in's claim.
    # The stand-in, not having heard its claim by the close, claims at once. Before, it waited a
    # slack first, and the leader answered its claim with a refusal once it had waited a slack
    # for the plan itself (a churn run's round took 36 s against a 30 s deadline).
    from groundswell.protocol.plan import close_time, make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=3.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    behind, stand_in = (c.ids.index(p) for p in plan.leaders[:2])
    claimed_at = _record_claims(c.nodes[stand_in])

    async def forget_genesis() -> None:
        c.nodes[behind].book.committed.pop(-1)

    c.nodes[behind].call(forget_genesis(), timeout_s=10)
    alive = [i for i in range(4) if i != behind]
    xs = _inputs(4, c.numel, 23)
    out = c.attempt(0, {i: xs[i] for i in alive})
    decision = out[stand_in].decision
    assert decision is not None and decision.status == "commit" and decision.leader == c.ids[stand_in]
    close = close_time(c.nodes[stand_in].book.opened_at(0), 0, c.ctx.deadline_s, c.ctx.slack_s)
    assert claimed_at and claimed_at[0] < close + c.ctx.slack_s / 2, \
        f"the stand-in claimed {claimed_at[0] - close:.1f} s after the close"
    assert decision.time < close + c.ctx.slack_s, f"decided {decision.time - close:.1f} s after the close"
    means = [c.fetch(i, out[i].signed) for i in alive]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_retry_counts_only_when_one_of_the_attempts_leaders_signed_it(make_cluster):
    # Any peer can sign a "retry" that names itself as leader. A witness that answered a leader's
    # claim with one used to stop that leader, which then handed the retry to every stand-in and
    # contributor: one hostile server in the fence group ended every attempt it was asked about.
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.schema import Decision, DecisionReply, ProtocolError

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=9.0, slack_s=1.0)
    plan = c.nodes[0].call(c.nodes[0].server.plan(0, 0, 5.0), timeout_s=10)
    hostile = next(i for i, p in enumerate(c.ids) if p not in plan.leaders)
    leader = c.ids.index(plan.leaders[-1])
    node = c.nodes[next(i for i in range(4) if i != hostile)]  # asks the hostile peer over the network

    def retry(signer: int, attempt: int = 0) -> bytes:
        return seal(c.nodes[signer].identity, c.ctx.run_id, Decision(
            0, attempt, "retry", [], list(c.ids), list(c.ids), c.ids[signer], [], plan.num_shards, time.time()))

    forged = retry(hostile)
    assert not node.call(node.server._adopt(plan, forged), timeout_s=10)
    assert node.server.attempts[(0, 0)].decision is None, "a leader stood back for a forged retry"
    with pytest.raises(ProtocolError, match="leaders"):
        node.call(node.server._learn(plan, forged), timeout_s=10)
    assert node.server.attempts[(0, 0)].decision is None
    # A contributor asking a peer that serves the forgery does not take it either.
    real_request = node.transport.request

    async def ask(reply: bytes) -> bytes:
        async def request(peer, handler, msg, reply_type, **kw):
            return DecisionReply(reply) if handler == "get-decision" else await real_request(
                peer, handler, msg, reply_type, **kw)

        node.transport.request = request
        try:
            return await node.client.ask_decision(c.ids[hostile], 0, 0, 0.0, plan)
        finally:
            node.transport.request = real_request

    assert node.call(ask(forged), timeout_s=10) == b""
    # A retry one of the attempt's leaders signed is taken, from anyone; one of another attempt is not.
    genuine = retry(leader)
    assert node.call(ask(genuine), timeout_s=10) == genuine
    assert node.call(ask(retry(leader, attempt=1)), timeout_s=10) == b""
    assert node.call(node.server._adopt(plan, genuine), timeout_s=10)
    assert node.server.attempts[(0, 0)].decision == genuine


def test_a_stand_in_told_the_rounds_commit_of_another_attempt_takes_it_and_stands_back(make_cluster):
    # A peer asked for an attempt's decision answers with the round's commit whatever attempt was
    # asked. A stand-in of attempt 1 handed attempt 0's commit by a fellow leader records it and
    # does not decide attempt 1 (a second commit of the round); a forged answer is refused.
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.schema import Decision

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=7.0, slack_s=1.0)
    out = c.attempt(0, _inputs(4, c.numel, 31))
    commit = out[0].signed
    assert out[0].decision.status == "commit" and out[0].decision.attempt == 0
    node = c.nodes[1]
    later = node.call(node.server.plan(0, 1, 5.0), timeout_s=10)

    async def forget_and_learn(signed: bytes) -> bool:
        node.book.committed.pop(0, None)
        return await node.server._learn_from_fellow(later, signed)

    forged = seal(node.identity, c.ctx.run_id, Decision(0, 1, "retry", [], list(c.ids), list(c.ids),
                                                         "someone else", [], later.num_shards, time.time()))
    assert not node.call(forget_and_learn(forged), timeout_s=10)
    assert node.call(forget_and_learn(commit), timeout_s=30)
    assert node.book.committed[0][0] == commit
    means = [c.fetch(i, out[i].signed) for i in range(4)]  # and the round's one result is everyone's
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_leader_whose_early_claim_was_refused_claims_again_at_the_close(make_cluster):
    # Attempt 1's first leader claims a slack before the close while a leader of attempt 0 is
    # still deciding that one (it then stops, as after a retry): the claim is refused. Its fellow
    # leaders granted it the attempt and do not claim themselves, so the attempt used to go
    # undecided and the round ran again a slot later. It now claims again at the close.
    import concurrent.futures

    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=4.0, slack_s=1.0)
    plan0 = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    plan1 = make_plan(c.ctx.run_id, 0, 1, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    first = c.ids.index(plan1.leaders[0])
    busy = next(c.ids.index(p) for p in [*plan1.leaders[1:], *plan0.leaders] if c.ids.index(p) != first)
    idle = next(i for i in range(4) if i not in (first, busy))  # joins, never contributes: no early close
    server, results = c.nodes[first].server, []
    real_claim = server._claim

    async def claim(plan, slot):
        passed = await real_claim(plan, slot)
        results.append((plan.attempt, passed))
        return passed

    async def setup() -> None:
        server._claim = claim

    async def deciding(flag: bool) -> None:
        c.nodes[busy].server.attempts[(0, 0)].deciding = flag

    c.nodes[first].call(setup(), timeout_s=10)
    c.nodes[busy].call(deciding(True), timeout_s=10)
    xs = _inputs(4, c.numel, 21)
    end = time.monotonic() + 60
    while time.monotonic() < end and c.nodes[first].client.current_attempt(0) != 1:  # attempt 1's slot
        time.sleep(0.05)
    runs = [c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 1, None if i == idle else c.segments(xs[i]),
                                                             trains=True, serves=True)) for i in range(4)]
    end = time.monotonic() + 60
    while time.monotonic() < end and not results:
        time.sleep(0.05)
    assert results[:1] == [(1, False)], "the early claim should have met the objection"
    c.nodes[busy].call(deciding(False), timeout_s=10)  # attempt 0 is over
    concurrent.futures.wait(runs, timeout=90)
    out = [r.result(timeout=1) for r in runs]
    d = out[first].decision
    assert d is not None and d.status == "commit" and d.attempt == 1 and d.leader == c.ids[first]
    assert results[-1] == (1, True) and len(results) >= 2
    assert all(out[i].decision == d for i in range(4) if i != idle)  # every contributor learned it
    means = [c.fetch(i, out[first].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)
