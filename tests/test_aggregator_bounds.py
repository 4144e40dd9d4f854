"""What anyone's requests can make an aggregator hold or do (protocol/aggregator.py), found by a
review (2026-12-07): attempts long past took contributions again; each request planned its attempt
again; asks for old rounds' aggregates held up the first ask for a round just committed.

An aggregator holds contributions of the newest KEEP_ATTEMPTS attempts of a round at most:
attempts were bounded from above only, so sybils filling attempts newest first had every attempt
long past held again (each freed only those before itself), and a round retried N times held N
attempts' contributions."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.peer.run_state import RunContext
from groundswell.protocol.aggregator import KEEP_ATTEMPTS
from groundswell.protocol.context import DecisionBook, contribution_bound
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.plan import attempt_for, slot_width
from groundswell.protocol.schema import Decision, ShardContribution
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import Transport

sys.path.insert(0, str(Path(__file__).parent))
from inproc_harness import FakeP2P

pytestmark = pytest.mark.timeout(60)
RUN, NUMEL, DEADLINE, SLACK = "old-attempts", 4 * 4096, 30.0, 1.0


class _Done(Exception):
    """Ends the server's task group (its reports to absent leaders would wait on)."""


async def _fill_newest_first(tg: asyncio.TaskGroup) -> None:
    me, lead, c1, c2 = (Identity.generate() for _ in range(4))
    numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
    ctx = RunContext(RUN, 2, DEADLINE, SLACK, 4, numels, make_codec("fp32"), contribution_bound(make_codec("fp32"), numels), None,
                     RobustOptions(), Limits())
    server = RoundServer(ctx, Transport(FakeP2P(), me, RUN, Guard(ctx.limits)), DecisionBook(RUN), me, tg)
    opened = time.time() - 20 * slot_width(DEADLINE, SLACK)  # the round has been retried for 20 attempts
    server.started_at = opened - 100
    trainers = sorted([c1.peer_id, c2.peer_id])
    server.book.add(seal(lead, RUN, Decision(-1, 0, "commit", [], trainers, sorted([me.peer_id, lead.peer_id]),
                                             lead.peer_id, [], 0, opened)))
    current = attempt_for(time.time(), opened, DEADLINE, SLACK)

    async def contribute(who: Identity, attempt: int) -> bool:
        plan = await server.plan(0, attempt, 0)
        a, b = plan.shard_segments[0]
        msg = ShardContribution(0, attempt, 0, a, [ctx.codec.encode(torch.randn(numels[i])).to_bytes()
                                                   for i in range(a, b)])
        return (await server._on_contribute(who.peer_id, msg, seal(who, RUN, msg))).ok

    assert await contribute(c1, current)
    sybil = Identity.generate()
    taken = {a: await contribute(sybil, a) for a in reversed(range(current))}
    held = sorted(a for (r, a), slot in server.attempts.items() if r == 0 and slot.contributions)
    raise _Done(current, taken, held)


def test_attempts_long_past_take_no_contribution_whatever_the_order():
    found = []
    try:
        async def go() -> None:
            async with asyncio.TaskGroup() as tg:
                await _fill_newest_first(tg)
        asyncio.run(go())
    except* _Done as done:
        found.extend(done.exceptions[0].args)
    current, taken, held = found
    assert all(taken[a] for a in range(current - KEEP_ATTEMPTS, current))  # recent ones: a straggler's, say
    assert not any(taken[a] for a in range(current - KEEP_ATTEMPTS))
    assert held == list(range(current - KEEP_ATTEMPTS, current + 1))


def test_an_attempts_plan_is_made_once_and_none_for_an_attempt_not_begun(monkeypatch):
    # Found by the same review: each request planned its attempt again, ranking every server
    # (2.4 ms at 2,048), and get-contributions did so for any attempt up to 2**20, for anyone.
    from groundswell.protocol import server as server_module
    from groundswell.protocol.schema import ContributionsRequest, ProtocolError

    made = []
    real = server_module.make_plan
    monkeypatch.setattr(server_module, "make_plan", lambda *a: made.append(a) or real(*a))

    async def go() -> None:
        me, lead, c1 = (Identity.generate() for _ in range(3))
        numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
        ctx = RunContext(RUN, 2, DEADLINE, SLACK, 4, numels, make_codec("fp32"), contribution_bound(make_codec("fp32"), numels), None,
                         RobustOptions(), Limits())
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(ctx, Transport(FakeP2P(), me, RUN, Guard(ctx.limits)), DecisionBook(RUN), me, tg)
            server.book.add(seal(lead, RUN, Decision(-1, 0, "commit", [], [c1.peer_id],
                                                     sorted([me.peer_id, lead.peer_id]), lead.peer_id, [], 0,
                                                     time.time())))
            plans = [await server.plan(0, 0, 0) for _ in range(5)]
            assert len(made) == 1 and all(p is plans[0] for p in plans)
            assert (await server.plan(0, 1, 0)).attempt == 1 and len(made) == 2
            with pytest.raises(ProtocolError, match="has not begun"):
                await server._on_get_contributions(c1.peer_id, ContributionsRequest(0, 2 ** 20, 0, [c1.peer_id]))
            assert len(made) == 2

    asyncio.run(go())


def test_the_first_ask_for_a_round_just_committed_does_not_wait_behind_asks_for_old_rounds():
    from groundswell.protocol.schema import AggregateRequest, AggregateShard

    async def go() -> int:
        me = Identity.generate()
        numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
        ctx = RunContext(RUN, 2, DEADLINE, SLACK, 4, numels, make_codec("fp32"), contribution_bound(make_codec("fp32"), numels), None,
                         RobustOptions(), Limits())
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(ctx, Transport(FakeP2P(), me, RUN, Guard(ctx.limits)), DecisionBook(RUN), me, tg)
            blob = bytes(16 << 20)  # a dense shard: each sealing copies and hashes it
            for r in range(8):  # the kept rounds; round 7 was just committed
                for shard in range(4):
                    server.aggregates[(r, shard)] = AggregateShard(b"d%d" % r, shard, "mean", [blob])
            server.book.latest = lambda: 7
            old = [asyncio.ensure_future(server._on_get_aggregate("x", AggregateRequest(r, s, 1.0)))
                   for r in range(6) for s in range(4)]
            await asyncio.sleep(0)  # (all of them queued first)
            await server._on_get_aggregate("x", AggregateRequest(7, 0, 1.0))
            ahead = sum(t.done() for t in old)
            await asyncio.gather(*old)
            return ahead

    assert asyncio.run(go()) <= 2  # (one lane for all, first come first served: all 24 went first)


def test_a_refused_trainer_is_reported_before_strangers_and_strangers_are_bounded():
    # (same review) `slot.refused` kept every identity that sent an invalid payload, and reports
    # named the 64 lowest ids: sybils with low ids pushed a refused trainer out, so its leader
    # waited for a contribution that would never come.
    from groundswell.protocol.aggregator import REFUSED_KEPT
    from groundswell.protocol.schema import Ack, ProtocolError

    async def run() -> None:
        me, lead, trainer = Identity.generate(), Identity.generate(), Identity.generate()
        numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
        ctx = RunContext(RUN, 2, DEADLINE, SLACK, 4, numels, make_codec("fp32"), contribution_bound(make_codec("fp32"), numels), None,
                         RobustOptions(), Limits())
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(ctx, Transport(FakeP2P(), me, RUN, Guard(ctx.limits)), DecisionBook(RUN), me, tg)
            server.book.add(seal(lead, RUN, Decision(-1, 0, "commit", [], ["~" + trainer.peer_id],
                                                     sorted([me.peer_id, lead.peer_id]), lead.peer_id, [], 0,
                                                     time.time())))
            plan = await server.plan(0, 0, 0)
            a, b = plan.shard_segments[0]
            bad = ShardContribution(0, 0, 0, a, [bytes(7) for _ in range(a, b)])
            for i in range(REFUSED_KEPT + 50):  # strangers, then the trainer, each with an invalid payload
                with pytest.raises(ProtocolError):
                    await server._on_contribute(f"{i:04d}", bad, b"envelope")
            with pytest.raises(ProtocolError):
                await server._on_contribute("~" + trainer.peer_id, bad, b"envelope")
            slot = server.attempts[(0, 0)]
            slot.contributions[0]["0000"] = (a, [], b"", b"d" * 16)
            sent = []

            async def request(peer, kind, report, reply, timeout_s):
                sent.append(report)
                return Ack(True, "")

            server.transport.request = request
            await server._send_have(0, 0, plan, lead.peer_id, True)
            raise _Done(sent[0].refused, len(slot.refused))

    found = []
    try:
        asyncio.run(run())
    except* _Done as done:
        found.extend(done.exceptions[0].args)
    refused, kept = found
    assert refused[-1].startswith("~") and len(refused) == 64  # (sorted: "~" after the digits)
    assert kept == REFUSED_KEPT + 1
