"""An aggregator's seals, against a hostile fellow leader (found by a review of the round
protocol): a fellow leader's retry must not lift another leader's withdrawal, and one leader
cannot have us build any number of commits of one attempt."""

from __future__ import annotations

import asyncio
import time

import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.peer.run_state import RunContext
from groundswell.protocol.aggregator import MAX_SEALS_PER_LEADER
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


def _server(codec_name: str, tg: asyncio.TaskGroup):
    """An aggregator (`me`) of a run whose genesis names three servers and two trainers."""
    me, l1, h, c1, c2 = (Identity.generate() for _ in range(5))
    numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
    ctx = RunContext(RUN, 2, 30.0, 1.0, 4, numels, make_codec(codec_name), 4 * NUMEL + 8192, None,
                     RobustOptions(), Limits())
    book = DecisionBook(RUN)
    servers, trainers = sorted([me.peer_id, l1.peer_id, h.peer_id]), sorted([c1.peer_id, c2.peer_id])
    # (made before the round opens, as a peer's server is: a restarted one seals nothing of an attempt
    # that began before it, see test_restarted_aggregator)
    server = RoundServer(ctx, Transport(FakeP2P(), me, RUN, Guard(ctx.limits)), book, me, tg)
    book.add(seal(me, RUN, Decision(-1, 0, "commit", [], trainers, servers, me.peer_id, [], 0, time.time())))
    return server, me, l1, h, (c1, c2), servers, trainers, numels


def test_a_fellow_leaders_retry_does_not_let_a_withdrawn_commit_be_sealed():
    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            s, me, l1, h, _, servers, trainers, _ = _server("sparseloco", tg)
            plan = await s.plan(0, 0, 0)
            assert {l1.peer_id, h.peer_id} <= set(plan.leaders)
            n = plan.num_shards
            commit = seal(l1, RUN, Decision(0, 0, "commit", trainers, trainers, servers, l1.peer_id,
                                            [l1.peer_id] * n, n, time.time(), [b"\x01" * 16] * (2 * n)))

            def retry(leader):
                return seal(leader, RUN, Decision(0, 0, "retry", [], trainers, servers, leader.peer_id, [], n,
                                                  time.time()))

            assert (await s._on_seal(l1.peer_id, Seal(retry(l1), False))).ok
            late = await s._on_seal(l1.peer_id, Seal(commit, False))
            assert not late.ok and "took its commits" in late.reason
            assert (await s._on_seal(h.peer_id, Seal(retry(h), False))).ok  # a fellow leader's retry ...
            late = await s._on_seal(l1.peer_id, Seal(commit, False))  # ... used to replace l1's withdrawal
            assert not late.ok and "took its commits" in late.reason
            assert s.attempts[(0, 0)].sealed is None

    asyncio.run(main())


def test_one_leader_cannot_have_an_aggregator_build_commits_of_an_attempt_without_end():
    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            s, me, _, h, contributors, servers, trainers, numels = _server("fp32", tg)
            plan = await s.plan(0, 0, 0)
            n = plan.num_shards
            slot = s.attempts[(0, 0)]
            digests = {}
            for c in contributors:
                for shard in range(n):
                    a, b = plan.shard_segments[shard]
                    segs = [s.ctx.codec.encode(torch.randn(numels[i])).to_bytes() for i in range(a, b)]
                    digests[(shard, c.peer_id)] = contribution_digest(a, segs)
                    slot.contributions[shard][c.peer_id] = (a, segs, seal(c, RUN, ShardContribution(0, 0, shard, a, segs)),
                                                            digests[(shard, c.peer_id)])
            builds = []
            real = s._build

            def counting(*args, **kw):
                builds.append(args[1])
                return real(*args, **kw)

            s._build = counting
            pinned = [digests[(shard, c)] for shard in range(n) for c in trainers]
            acks = []
            for i in range(MAX_SEALS_PER_LEADER + 12):  # variants: another time each
                d = Decision(0, 0, "commit", trainers, trainers, servers, h.peer_id, [me.peer_id] * n, n,
                             time.time() + i * 1e-3, pinned)
                acks.append(await s._on_seal(h.peer_id, Seal(seal(h, RUN, d), False)))
            assert all(a.ok for a in acks[:MAX_SEALS_PER_LEADER])
            assert not any(a.ok for a in acks[MAX_SEALS_PER_LEADER:])
            assert "commits of this attempt from one leader" in acks[-1].reason
            await asyncio.sleep(0.5)  # spare builds, if any, run in the background
            assert len(builds) <= MAX_SEALS_PER_LEADER * n

    asyncio.run(main())
