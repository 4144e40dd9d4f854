"""No second commit of a round through claims (protocol/claims.py). Found by a review (2026-12-07),
each reproduced in-process and then split honest peers' books:
- a peer holding an earlier attempt's seal answered every claim with it, before its grant logic,
  so two leaders of an attempt that both held one passed their claims;
- a commit a replier called final was adopted before a deciding leader's objection was heard;
- a hostile earlier leader signing a fresh commit for every reply cost each claim two windows."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
from groundswell.protocol.envelope import seal
from groundswell.protocol.schema import Claim, ClaimReply, Decision, Seal
from groundswell.protocol.transport import ShardsUnavailable

sys.path.insert(0, str(Path(__file__).parent))
from claims_net import RUN, Net

pytestmark = pytest.mark.timeout(60)


def _commit(net: Net, leader: str, attempt: int, sources: list[str], t: float | None = None) -> bytes:
    """A commit of round 0 that checks out (any 16-byte digests: nobody gathers it here)."""
    plan = net.plan(0, attempt)
    contributors = net.pids[:2]
    return seal(net.ids[leader], RUN, Decision(0, attempt, "commit", contributors, net.pids, net.pids, leader, sources,
                                               plan.num_shards, time.time() if t is None else t,
                                               [os.urandom(16)] * (plan.num_shards * len(contributors))))


def test_two_leaders_holding_an_earlier_attempts_seal_do_not_both_pass_their_claims():
    async def go() -> list[bool]:
        net = Net()
        plan0, plan1 = net.plan(0, 0), net.plan(0, 1)
        h = plan0.leaders[0]
        async with asyncio.TaskGroup() as tasks:
            servers = await net.start(tasks)

            async def nothing_to_gather(signed: bytes) -> None:  # only H held the shards, and H is gone
                raise ShardsUnavailable(0, list(range(plan0.num_shards)))

            held = _commit(net, h, 0, [h] * plan0.num_shards)
            for pid in net.pids:
                servers[pid].prefetch = nothing_to_gather
                if pid != h:
                    assert (await servers[pid]._on_seal(h, Seal(held))).ok
            net.dead.add(h)
            claimers = [p for p in plan1.leaders if p != h]
            passed = await asyncio.gather(*(servers[p]._claim(plan1, servers[p].attempts[(0, 1)]) for p in claimers))
            for server in servers.values():
                for slot in server.attempts.values():
                    slot.deciding = False
            return list(passed)

    passed = asyncio.run(go())
    assert sum(passed) == 1, passed  # (before: every one of them passed, and each sealed its own commit)


def test_a_commit_called_final_is_not_adopted_over_the_objection_of_a_leader_still_deciding():
    async def go() -> tuple[bool, bool]:
        net = Net()
        plan0, plan1 = net.plan(0, 0), net.plan(0, 1)
        lead, hostile = plan0.leaders[0], plan0.leaders[1]
        claimer = next(p for p in plan1.leaders if p not in (lead, hostile))
        holder = next(p for p in net.pids if p not in (lead, hostile, claimer))
        async with asyncio.TaskGroup() as tasks:
            servers = await net.start(tasks)
            c = _commit(net, lead, 0, list(plan0.aggregators))
            servers[lead].attempts[(0, 0)].deciding = True  # passed its claim, deciding attempt 0
            servers[holder].attempts[(0, 0)].sealed = c

            async def final_on_its_word(sender: str, msg: Claim) -> ClaimReply:
                return ClaimReply(False, c, True)

            servers[hostile]._on_claim = final_on_its_word
            passed = await servers[claimer]._claim(plan1, servers[claimer].attempts[(0, 1)])
            servers[lead].attempts[(0, 0)].deciding = False
            return passed, 0 in servers[claimer].book.committed

    passed, adopted = asyncio.run(go())
    assert not passed and not adopted  # it stands back, and leaves the commit to its leader


def test_a_leader_signing_a_fresh_commit_for_every_reply_costs_claims_one_gather_in_all():
    async def go() -> list[int]:
        net = Net()
        plan0, plan1 = net.plan(0, 0), net.plan(0, 1)
        hostile = plan0.leaders[0]
        claimer = next(p for p in plan1.leaders if p != hostile)
        async with asyncio.TaskGroup() as tasks:
            servers = await net.start(tasks)

            async def fresh_final(sender: str, msg: Claim) -> ClaimReply:
                return ClaimReply(False, _commit(net, hostile, 0, [hostile] * plan0.num_shards), True)

            servers[hostile]._on_claim = fresh_final
            gathers = []

            async def never_gathered(signed: bytes, timeout_s: float | None) -> bool:
                gathers.append(signed)  # (a gather of a final commit waits out the attempt's window)
                return False

            servers[claimer]._hold_all = never_gathered
            counts = []
            for _ in range(2):
                slot = servers[claimer].attempts[(0, 1)]
                slot.granted_to, slot.deciding = None, False
                await servers[claimer]._claim(plan1, slot)
                counts.append(len(gathers))
            slot.deciding = False
            return counts

    assert asyncio.run(go()) == [1, 1]  # (before: two gathers a claim, each a whole window)
