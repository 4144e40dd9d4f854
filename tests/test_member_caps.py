"""A round's commit names at most `max_members` peers in each list, however many contribute, so
that it stays a control message every peer takes (found by a review of the wire boundary): the
previous commit's trainers are expected without joining, and with as many fresh joiners the
leader built a 1.7 MB commit that every peer refused, retry included, for as long as they came."""

from __future__ import annotations

import asyncio
import sys
import time
import types
from pathlib import Path

import torch
from groundswell.compression import RobustOptions, make_codec
from groundswell.peer.run_state import RunContext
from groundswell.protocol.context import DecisionBook
from groundswell.protocol.envelope import seal, unseal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.plan import make_plan
from groundswell.protocol.schema import (
    MAX_LIST,
    MAX_SMALL,
    Ack,
    Decision,
    HaveReport,
    ProtocolError,
    ShardContribution,
)
from groundswell.protocol.server import RoundServer
from groundswell.protocol.shards import first_members, max_members
from groundswell.protocol.transport import Transport

sys.path.insert(0, str(Path(__file__).parent))
from inproc_harness import FakeP2P
from test_scoring import _stub_leader

SHARDS = 16


def _ids(n: int) -> list[str]:
    return sorted(Identity.generate().peer_id for _ in range(n))


def test_first_members_prefers_the_preferred_and_caps():
    assert first_members({"c", "a"}, {"b", "d", "a"}, 3) == ["a", "b", "c"]
    assert first_members({"c", "a", "e"}, {"b"}, 2) == ["a", "c"]
    assert first_members(set(), {"b", "a"}, 5) == ["a", "b"]


def test_a_commit_names_at_most_a_rounds_members_however_many_contributed():
    cap = max_members(SHARDS)
    old, new, servers = _ids(cap), _ids(cap), _ids(SHARDS)
    plan = make_plan("r", 1, 0, servers, old, SHARDS, SHARDS)

    class Leader(_stub_leader(30.0, 1.0, trainers=old, servers=servers)):
        signed = b""

        async def _seal_all(self, signed, peers, groups=None, **kw):
            return set(), False

        async def _witnesses(self, *a):
            return {servers[0]}, set(), False

        async def _unheld_shards(self, *a):
            return set()

        async def _learn(self, plan, signed):
            self.signed = signed

    leader = Leader()
    leader.joins = {1: {p: (True, True) for p in new}}  # as many newcomers as members, all complete
    digest = b"D" * 16
    slot = types.SimpleNamespace(have={s: {plan.candidates(s)[0]: {p: digest for p in old + new}}
                                       for s in range(plan.num_shards)})
    asyncio.run(leader._decide(plan, slot))
    assert leader.signed, "no commit"
    assert len(leader.signed) <= MAX_SMALL - 4096, len(leader.signed)
    d = unseal(leader.signed, "r", Decision)[1]  # every peer takes it
    assert d.status == "commit" and d.contributors == old  # the round's own trainers first
    assert len(d.trainers) <= cap and len(d.servers) <= cap and set(d.trainers) == set(old)


def test_an_aggregator_holds_no_more_than_a_commit_can_name_and_reports_a_valid_message():
    max_shards = 256
    cap = max_members(max_shards)  # 128

    async def main() -> None:
        me = Identity.generate()
        trainers = _ids(cap - 100)
        ctx = RunContext("r", 2, 60.0, 5.0, max_shards, (4096,) * 4, make_codec("fp32"), 1 << 24, None,
                         RobustOptions(), Limits(requests_per_s=1e9, strikes=10**9))
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(ctx, Transport(FakeP2P(), me, "r", Guard(ctx.limits)), DecisionBook("r"), me, tg)
            server.book.add(seal(me, "r", Decision(0, 0, "commit", [], trainers, [me.peer_id], me.peer_id, [], 0,
                                                   time.time(), [])))
            server._report = lambda *a: None  # (no leader to tell here)
            server.attempts[(1, 0)].refresh = True  # (nor a refresh of reports to wait for)
            plan = await server.plan(1, 0, 0)
            first, stop = plan.shard_segments[0]
            segs = [ctx.codec.encode(torch.zeros(4096)).to_bytes() for _ in range(first, stop)]
            taken, full = 0, 0
            for _ in range(300):  # newcomers: room for the 100 members a commit can still name, not 4 x 28
                ident = Identity.generate()
                msg = ShardContribution(1, 0, 0, first, segs)
                try:
                    taken += (await server._on_contribute(ident.peer_id, msg, seal(ident, "r", msg))).ok
                except ProtocolError as exc:
                    assert exc.reason == "slot-full"
                    full += 1
            assert (taken, full) == (100, 200)
            # However it came to hold more (a commit naming 4,096 trainers, say), a report stays valid
            held = server.attempts[(1, 0)].contributions[0]
            for who in _ids(MAX_LIST + 100):
                held[who] = (first, segs, b"", b"D" * 16)
            reports: list[HaveReport] = []

            async def told(leader, report):
                reports.append(report)
                return Ack(True, "")

            server._on_have = told
            await server._send_have(1, 0, plan, me.peer_id, True)
            assert len(reports) == 1 and len(reports[0].contributors) == MAX_LIST
            assert set(trainers) & set(held) <= set(reports[0].contributors)  # the round's own first

    asyncio.run(main())


def test_a_leader_waits_for_no_more_new_trainers_than_its_aggregators_hold():
    # Found by a review of the caps above: joins were taken up to the round's member cap whatever
    # the planned trainers, so the leader waited, to the close, for newcomers no aggregator held.
    from groundswell.protocol.schema import Join
    from groundswell.protocol.shards import newcomer_room

    max_shards = 256
    cap = max_members(max_shards)

    async def main() -> None:
        me = Identity.generate()
        trainers = _ids(cap - 100)
        ctx = RunContext("r", 2, 60.0, 5.0, max_shards, (4096,) * 4, make_codec("fp32"), 1 << 24, None,
                         RobustOptions(), Limits())
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(ctx, Transport(FakeP2P(), me, "r", Guard(ctx.limits)), DecisionBook("r"), me, tg)
            server.book.add(seal(me, "r", Decision(0, 0, "commit", [], trainers, [me.peer_id], me.peer_id, [], 0,
                                                   time.time(), [])))
            assert newcomer_room(len(trainers), max_shards) == 100
            taken = full = 0
            for who in _ids(cap) + trainers[:5]:  # newcomers first, then some of the planned trainers
                try:
                    taken += (await server._on_join(who, Join(1, True, True))).ok
                except ProtocolError as exc:
                    assert exc.reason == "full"
                    full += 1
            assert (taken, full) == (105, cap - 100)  # the planned trainers always join
            plan = await server.plan(1, 0, 0)
            assert len(server._expected(plan, server.attempts[(1, 0)])) == len(trainers) + 100
            assert (await server._on_join(_ids(1)[0], Join(1, False, True))).ok  # a mere server still may

    asyncio.run(main())


def test_strangers_cannot_fill_a_closed_runs_join_table_and_planned_members_always_join():
    # Found by a review: a stranger's leave (a join that neither trains nor serves) was taken in a
    # closed run and counted against the round's member cap; strangers filled it, and then the
    # run's own members (a planned trainer, a listed newcomer, a leave) were refused as "full".
    import dataclasses

    from groundswell.protocol.schema import Join

    max_shards = 16
    cap = max_members(max_shards)

    async def main() -> None:
        me = Identity.generate()
        members, newcomer = _ids(4), _ids(1)[0]
        ctx = RunContext("r", 2, 60.0, 5.0, max_shards, (4096,) * 4, make_codec("fp32"), 1 << 24, None,
                         RobustOptions(), Limits())
        closed = dataclasses.replace(ctx, allowlist=frozenset([*members, newcomer, me.peer_id]))
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(closed, Transport(FakeP2P(), me, "r", Guard(closed.limits)), DecisionBook("r"), me,
                                 tg)
            server.book.add(seal(me, "r", Decision(0, 0, "commit", [], members, [me.peer_id, *members], me.peer_id,
                                                   [], 0, time.time(), [])))
            strangers = _ids(cap)
            taken = sum([(await server._on_join(s, Join(1, False, False))).ok for s in strangers])
            assert taken == 0 and not server.joins[1]
            assert server.transport.guard.rejected.get("unauthorized:join", 0) == cap
            assert (await server._on_join(newcomer, Join(1, True, False))).ok
            assert (await server._on_join(members[0], Join(1, False, False))).ok  # a member's leave

            # An open run takes anyone's join, up to the cap; a planned member still gets in.
            opened = RoundServer(ctx, Transport(FakeP2P(), me, "r", Guard(ctx.limits)), DecisionBook("r"), me, tg)
            opened.book.add(server.book.committed[0][0])
            for s in strangers:
                assert (await opened._on_join(s, Join(1, False, True))).ok
            assert len(opened.joins[1]) == cap
            try:
                await opened._on_join(newcomer, Join(1, False, True))
                raise AssertionError("a stranger got into a full round")
            except ProtocolError as exc:
                assert exc.reason == "full"
            assert (await opened._on_join(members[1], Join(1, True, True))).ok  # planned: room is made
            assert len(opened.joins[1]) == cap and members[1] in opened.joins[1]

    asyncio.run(main())


def test_a_full_round_drops_nobodys_join_for_a_member_it_then_refuses():
    # Found by the second review of the fix above: room was made (a newcomer's acked join dropped)
    # before the newcomer-trainer check, which then refused the planned server anyway.
    from groundswell.protocol.schema import Join
    from groundswell.protocol.shards import newcomer_room

    async def main() -> None:
        me = Identity.generate()
        trainers, server_only = _ids(4), _ids(1)[0]
        ctx = RunContext("r", 2, 60.0, 5.0, 16, (4096,) * 4, make_codec("fp32"), 1 << 24, None, RobustOptions(),
                         Limits())
        async with asyncio.TaskGroup() as tg:
            s = RoundServer(ctx, Transport(FakeP2P(), me, "r", Guard(ctx.limits)), DecisionBook("r"), me, tg)
            s.book.add(seal(me, "r", Decision(0, 0, "commit", [], trainers, [me.peer_id, *trainers, server_only],
                                              me.peer_id, [], 0, time.time(), [])))
            cap, room = max_members(16), newcomer_room(len(trainers), 16)
            for p in _ids(room):  # newcomers that will train: the room for them is full
                assert (await s._on_join(p, Join(1, True, False))).ok
            servers = _ids(cap - room)
            for p in servers:
                assert (await s._on_join(p, Join(1, False, True))).ok
            try:
                await s._on_join(server_only, Join(1, True, True))  # planned to serve, not to train
                raise AssertionError("taken past the newcomer-trainer room")
            except ProtocolError as exc:
                assert exc.reason == "full"
            assert servers[-1] in s.joins[1] and len(s.joins[1]) == cap
            assert (await s._on_join(server_only, Join(1, False, True))).ok  # as a server: room is made
            assert servers[-1] not in s.joins[1] and len(s.joins[1]) == cap

    asyncio.run(main())
