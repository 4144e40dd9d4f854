"""A source's seal is given the time to build its shards' means (protocol/decision.py, `_seal_all`).

Found by a review (2026-12-07): a source acks a seal once it has built the means of the shards it
sources, a replica acks at once and builds after. Once every shard had a holder that sealed, the
others got only `seal_grace`, so a source of a big dense shard was replaced by its replica, which
as the next source was replaced the same way: such a round never committed."""

from __future__ import annotations

import asyncio
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.peer.run_state import RunContext
from groundswell.protocol import decision as decision_module
from groundswell.protocol.context import DecisionBook
from groundswell.protocol.decision import Decider, seal_grace
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision, ShardContribution
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import Transport

sys.path.insert(0, str(Path(__file__).parent))
from inproc_harness import FakeP2P

pytestmark = pytest.mark.timeout(60)
RUN, NUMEL, BUILD_S = "seal-build", 4 * 4096, 1.5


class _Done(Exception):
    """Ends the servers' task group (their reports to the absent leader would wait on)."""


async def _seal_with_a_slow_source(verify_aggregates: bool = False) -> tuple[set[str], bool, str]:
    found = []
    try:
        async with asyncio.TaskGroup() as tg:
            await _seal(tg, verify_aggregates)
    except* _Done as done:
        found.append(done.exceptions[0].args[0])
    return found[0]


async def _seal(tg: asyncio.TaskGroup, verify_aggregates: bool) -> None:
    source, replica, lead, c1, c2 = (Identity.generate() for _ in range(5))
    numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
    ctx = RunContext(RUN, 2, 30.0, 1.0, 4, numels, make_codec("fp32"), 4 * NUMEL + 8192, None,
                     RobustOptions(), Limits(), verify_aggregates=verify_aggregates)
    servers = sorted([source.peer_id, replica.peer_id, lead.peer_id])
    trainers = sorted([c1.peer_id, c2.peer_id])
    genesis = seal(lead, RUN, Decision(-1, 0, "commit", [], trainers, servers, lead.peer_id, [], 0, time.time()))
    aggs = {}
    for who in (source, replica):
        server = RoundServer(ctx, Transport(FakeP2P(), who, RUN, Guard(ctx.limits)), DecisionBook(RUN), who, tg)
        server.started_at -= 100
        server.book.add(genesis)
        aggs[who.peer_id] = server
    plan = await aggs[source.peer_id].plan(0, 0, 0)
    digests = {}
    for c in (c1, c2):
        for shard in range(plan.num_shards):
            a, b = plan.shard_segments[shard]
            msg = ShardContribution(0, 0, shard, a, [ctx.codec.encode(torch.randn(numels[i])).to_bytes()
                                                     for i in range(a, b)])
            for server in aggs.values():
                assert (await server._on_contribute(c.peer_id, msg, seal(c, RUN, msg))).ok
            digests[(shard, c.peer_id)] = server.attempts[(0, 0)].contributions[shard][c.peer_id][3]
    n = plan.num_shards
    pinned = [digests[(shard, c)] for shard in range(n) for c in trainers]
    built = aggs[source.peer_id]._build_jobs

    def slow_build(*args):  # a big dense shard's means, longer than the grace
        time.sleep(BUILD_S)
        return built(*args)

    aggs[source.peer_id]._build_jobs = slow_build

    async def request(peer, kind, msg, reply, timeout_s):  # cancelled with its caller, as a unary call is
        return await aggs[peer]._on_seal(lead.peer_id, msg)

    leader = object.__new__(Decider)
    leader.ctx, leader.identity, leader.transport = ctx, lead, types.SimpleNamespace(request=request)
    decision = Decision(0, 0, "commit", trainers, trainers, servers, lead.peer_id, [source.peer_id] * n, n,
                        time.time(), pinned)
    loop = asyncio.get_running_loop()
    unsealed, _ = await leader._seal_all(seal(lead, RUN, decision), [source.peer_id, replica.peer_id],
                                         [[source.peer_id, replica.peer_id]] * n,
                                         patient_until=loop.time() + 60)
    assert seal_grace(ctx) < BUILD_S
    raise _Done((unsealed, aggs[source.peer_id].attempts[(0, 0)].sealed is not None, source.peer_id))


def test_a_source_building_a_big_shard_is_not_replaced_by_a_replica_that_acked_first(monkeypatch):
    # The build is allowed for by the values averaged (4 shards of 2 contributors' fp32 values,
    # 128 KiB in all), not by the codec's bytes: an int8 mean takes as long to build as an fp32
    # one. At a build rate made slow enough, that is an allowance of 2 s, longer than this build.
    monkeypatch.setattr(decision_module, "BUILD_BYTES_PER_S", 4 * NUMEL * 2 / 2.0)
    unsealed, source_sealed, _ = asyncio.run(_seal_with_a_slow_source())
    assert unsealed == set() and source_sealed


def test_a_source_slower_than_its_shards_allow_is_still_replaced():
    # (the grace still ends: a source whose build takes far longer than its shards' size allows,
    # frozen say, is replaced by the replica that sealed)
    unsealed, source_sealed, source = asyncio.run(_seal_with_a_slow_source())
    assert unsealed == {source} and not source_sealed


def test_a_source_that_averages_nothing_gets_no_build_time(monkeypatch):
    # Where aggregates carry the signed contributions (sparse codecs, or verify_aggregates), a
    # source only hands them on: a build's allowance there only let a frozen source hold the
    # round longer (~32 s at 100m parameters and 64 contributors; a review, 2026-12-07).
    monkeypatch.setattr(decision_module, "BUILD_BYTES_PER_S", 4 * NUMEL * 2 / 2.0)
    unsealed, source_sealed, source = asyncio.run(_seal_with_a_slow_source(verify_aggregates=True))
    assert unsealed == {source} and not source_sealed
