"""No second commit of a round through claims (protocol/claims.py). Found by a review (2026-12-07),
each reproduced in-process and then split honest peers' books:
- a peer holding an earlier attempt's seal answered every claim with it, before its grant logic,
  so two leaders of an attempt that both held one passed their claims;
- a commit a replier called final was adopted before a deciding leader's objection was heard;
- a hostile earlier leader signing a fresh commit for every reply cost each claim two windows.
A second review of those fixes found the last one hid a leader's re-seal behind its stale commit,
and that objections heard before adoption stopped it in the fenced step too."""

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


def test_a_leader_signing_a_fresh_commit_for_every_reply_gets_the_whole_window_twice_in_all():
    # (before: every claim step gave each fresh commit the whole window: two windows a claim, every claim)
    from groundswell.protocol.claims import WHOLE_TRIES

    async def go() -> list[float | None]:
        net = Net()
        plan0, plan1 = net.plan(0, 0), net.plan(0, 1)
        hostile = plan0.leaders[0]
        claimer = next(p for p in plan1.leaders if p != hostile)
        async with asyncio.TaskGroup() as tasks:
            servers = await net.start(tasks)

            async def fresh_final(sender: str, msg: Claim) -> ClaimReply:
                return ClaimReply(False, _commit(net, hostile, 0, [hostile] * plan0.num_shards), True)

            servers[hostile]._on_claim = fresh_final
            windows: list[float | None] = []

            async def never_gathered(signed: bytes, timeout_s: float | None) -> bool:
                windows.append(timeout_s)  # (None: the attempt's whole window)
                return False

            servers[claimer]._hold_all = never_gathered
            for _ in range(3):
                slot = servers[claimer].attempts[(0, 1)]
                slot.granted_to, slot.deciding = None, False
                await servers[claimer]._claim(plan1, slot)
            slot.deciding = False
            return windows

    windows = asyncio.run(go())
    assert windows.count(None) == WHOLE_TRIES and len(windows) == 6
    assert all(w == 2 * Net().ctx.slack_s for w in windows if w is not None)


def test_a_leaders_stale_commit_does_not_hide_its_re_seal():
    # (a second review: tried once per leader, a superseded commit handed back first, or our own
    # stale seal, hid the leader's re-seal, and the round could commit twice)
    async def go() -> tuple[bool, list[str]]:
        net = Net(n=5)
        plan0, plan1 = net.plan(0, 0), net.plan(0, 1)
        lead = plan0.leaders[0]
        claimer = next(p for p in plan1.leaders if p != lead)
        async with asyncio.TaskGroup() as tasks:
            servers = await net.start(tasks)
            sources = [plan0.candidates(k)[0] for k in range(plan0.num_shards)]
            stale = _commit(net, lead, 0, sources, time.time() - 1.0)
            reseal = _commit(net, lead, 0, [plan0.candidates(0)[1], *sources[1:]], time.time() - 0.5)
            net.dead.add(lead)
            servers[claimer].attempts[(0, 0)].sealed = stale  # it missed the re-seal
            for pid in net.pids:
                if pid not in (lead, claimer):
                    servers[pid].attempts[(0, 0)].sealed = reseal
            tried = []

            async def only_the_reseal(signed: bytes, timeout_s: float | None) -> bool:
                tried.append("reseal" if signed == reseal else "stale")
                return signed == reseal

            servers[claimer]._hold_all = only_the_reseal
            await servers[claimer]._claim(plan1, servers[claimer].attempts[(0, 1)])
            for server in servers.values():
                for slot in server.attempts.values():
                    slot.deciding = False
            return servers[claimer].book.committed.get(0, (b"",))[0] == reseal, tried

    adopted, tried = asyncio.run(go())
    assert adopted and tried[0] == "reseal"  # (more holders hand it over, and it is the newer)


def test_a_peer_catching_up_that_cannot_note_a_fence_does_not_stop_the_adoption():
    # (the second review: objections were all heard before adoption, even in the fenced step)
    async def go() -> bool:
        net = Net(n=5)
        plan0, plan1 = net.plan(0, 0), net.plan(0, 1)
        lead = plan0.leaders[0]
        claimer = next(p for p in plan1.leaders if p != lead)
        behind = next(p for p in net.pids if p not in (lead, claimer) and p not in plan1.leaders)
        async with asyncio.TaskGroup() as tasks:
            servers = await net.start(tasks)
            c0 = _commit(net, lead, 0, [plan0.candidates(k)[0] for k in range(plan0.num_shards)])
            for pid in net.pids:
                if pid not in (lead, behind):
                    servers[pid].attempts[(0, 0)].sealed = c0

            async def cannot_plan(*args: object, **kwargs: object) -> None:
                return None

            servers[behind].plan = cannot_plan
            net.dead.add(lead)

            async def gathered(signed: bytes, timeout_s: float | None) -> bool:
                return True

            servers[claimer]._hold_all = gathered
            await servers[claimer]._claim(plan1, servers[claimer].attempts[(0, 1)])
            for server in servers.values():
                for slot in server.attempts.values():
                    slot.deciding = False
            return 0 in servers[claimer].book.committed

    assert asyncio.run(go())
