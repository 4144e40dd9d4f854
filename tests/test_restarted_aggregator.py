"""A restarted aggregator has forgotten the seals it gave and the fences later claims put on
earlier attempts (they are in memory): it must not seal an attempt that began before it started,
or a second leader of an attempt (or one a later claimer fenced off) could commit the round too."""

from __future__ import annotations

import asyncio
import time

import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.peer.run_state import RunContext
from groundswell.protocol.aggregator import BEGAN_BEFORE_START, SEALED_BY_ANOTHER
from groundswell.protocol.context import DecisionBook, contribution_digest
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision, Seal, ShardContribution
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import Transport
from inproc_harness import FakeP2P

RUN = "unit"
NUMEL = 4 * 4096
DEADLINE_S, SLACK_S = 30.0, 1.0


class Run:
    """One aggregator identity (`me`) of a run whose genesis names three servers and two trainers."""

    def __init__(self) -> None:
        self.me, self.l1, self.h, *contributors = (Identity.generate() for _ in range(5))
        self.contributors = contributors
        self.numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
        self.ctx = RunContext(RUN, 2, DEADLINE_S, SLACK_S, 4, self.numels, make_codec("fp32"), 4 * NUMEL + 8192,
                              None, RobustOptions(), Limits())
        self.servers = sorted([self.me.peer_id, self.l1.peer_id, self.h.peer_id])
        self.trainers = sorted(c.peer_id for c in contributors)
        # round 0 opened 100 s ago: attempt 3 of its 33 s slots is under way
        self.opened = time.time() - 100
        self.genesis = seal(self.me, RUN, Decision(-1, 0, "commit", [], self.trainers, self.servers, self.me.peer_id,
                                                   [], 0, self.opened))
        self.payloads = {c.peer_id: [make_codec("fp32").encode(torch.randn(n)).to_bytes() for n in self.numels]
                         for c in contributors}

    def process(self, tg: asyncio.TaskGroup, started_at: float | None = None) -> RoundServer:
        """A process of `me` (a fresh one each call: a restart), holding the run's genesis, made at
        `started_at` (default: now)."""
        server = RoundServer(self.ctx, Transport(FakeP2P(), self.me, RUN, Guard(self.ctx.limits)), DecisionBook(RUN),
                             self.me, tg)
        if started_at is not None:
            server.started_at = started_at
        server.book.add(self.genesis)
        return server

    async def leader(self, server: RoundServer, attempt: int) -> Identity:
        """A leader of `attempt` other than `me`."""
        plan = await server.plan(0, attempt, 0)
        return next(x for x in (self.l1, self.h) if x.peer_id in plan.leaders)

    async def deliver(self, server: RoundServer, attempt: int) -> tuple[int, list[bytes]]:
        """Every contributor's shards of `attempt` held by `server`; (shards, digests pinned)."""
        plan = await server.plan(0, attempt, 0)
        slot = server.attempts[(0, attempt)]
        digests = {}
        for c in self.contributors:
            for shard in range(plan.num_shards):
                a, b = plan.shard_segments[shard]
                segs = self.payloads[c.peer_id][a:b]
                digests[(shard, c.peer_id)] = contribution_digest(a, segs)
                slot.contributions[shard][c.peer_id] = (
                    a, segs, seal(c, RUN, ShardContribution(0, attempt, shard, a, segs)), digests[(shard, c.peer_id)])
        return plan.num_shards, [digests[(s, c)] for s in range(plan.num_shards) for c in self.trainers]

    async def seal_by(self, server: RoundServer, leader: Identity, attempt: int, stamp: float = 0.0):
        """`leader`'s seal, at `server`, of a commit of `attempt` that `me` sources wholly."""
        n, pinned = await self.deliver(server, attempt)
        d = Decision(0, attempt, "commit", self.trainers, self.trainers, self.servers, leader.peer_id,
                     [self.me.peer_id] * n, n, time.time() + stamp, pinned)
        return await server._on_seal(leader.peer_id, Seal(seal(leader, RUN, d), False))


def test_a_restarted_aggregator_seals_no_attempt_that_began_before_it():
    async def main() -> None:
        run = Run()
        async with asyncio.TaskGroup() as tg:
            first = run.process(tg, started_at=run.opened - 60)  # up before the round opened
            plan = await first.plan(0, 3, 0)
            assert {run.l1.peer_id, run.h.peer_id} <= set(plan.leaders)
            assert (await run.seal_by(first, run.l1, 3)).ok
            # A second leader of the attempt is refused by the process that sealed the first's ...
            refused = await run.seal_by(first, run.h, 3, stamp=1e-3)
            assert not refused.ok and refused.reason == SEALED_BY_ANOTHER
            # ... and by a restarted one, which no longer knows of that seal; so is the next attempt,
            # which the first process could have sealed already (early closes run ahead of the clock)
            again = run.process(tg)
            late = await run.seal_by(again, run.h, 3, stamp=1e-3)
            assert not late.ok and late.reason == BEGAN_BEFORE_START
            assert again.attempts[(0, 3)].sealed is None
            ahead = await run.seal_by(again, await run.leader(again, 4), 4)
            assert not ahead.ok and ahead.reason == BEGAN_BEFORE_START
            # A process restarted early in attempt 0 serves attempt 3, which began after it
            earlier = run.process(tg, started_at=run.opened + 10)
            assert (await run.seal_by(earlier, await run.leader(earlier, 3), 3)).ok

    asyncio.run(main())


def test_a_restarted_aggregator_forgets_no_fence_that_matters():
    """A later attempt's claim fenced attempt 3 off here; after a restart the fence is gone, and
    the slow leader of attempt 3 must still not have its commit sealed here."""
    async def main() -> None:
        run = Run()
        async with asyncio.TaskGroup() as tg:
            first = run.process(tg, started_at=run.opened - 60)
            first.later_claims[0] = 4  # a leader of attempt 4 claimed it here (a fence on attempt 3)
            fenced = await run.seal_by(first, run.l1, 3)
            assert not fenced.ok and "later attempt" in fenced.reason
            again = run.process(tg)
            assert again.later_claims == {}  # forgotten
            late = await run.seal_by(again, run.l1, 3)
            assert not late.ok and late.reason == BEGAN_BEFORE_START

    asyncio.run(main())


def test_a_first_process_serves_the_rounds_it_joined():
    """A peer's first process is named in a round's plan only by a commit after its join: every
    attempt of that round, early ones included, it seals."""
    async def main() -> None:
        run = Run()
        async with asyncio.TaskGroup() as tg:
            first = run.process(tg, started_at=run.opened - 5)
            for attempt in (3, 4):
                assert (await run.seal_by(first, await run.leader(first, attempt), attempt)).ok

    asyncio.run(main())
