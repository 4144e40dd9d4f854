"""A leader whose claim is refused only by objections (an earlier attempt's leader still deciding)
claims again: its fellow leaders granted it the attempt and will not decide it themselves, so a
claim made once, refused, left the attempt undecided for good."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from groundswell.protocol.schema import HaveReport

sys.path.insert(0, str(Path(__file__).parent))
from claims_net import Net  # noqa: E402

pytestmark = pytest.mark.timeout(60)
DEADLINE, SLACK = 4.0, 0.5


async def _attempt_one(early_close: bool) -> tuple[list[tuple[float, str, bool]], list[str]]:
    """Attempt 1 of round 0 while a leader of attempt 0 (or a fellow) is still deciding for its
    first second; every trainer reports at once (`early_close`) or one stays missing."""
    net = Net(4, deadline_s=DEADLINE, slack_s=SLACK)
    p0, p1 = net.plan(0, 0), net.plan(0, 1)
    first = p1.leaders[0]
    busy = next(p for p in [*p1.leaders[1:], *p0.leaders] if p != first)
    claims: list[tuple[float, str, bool]] = []
    decided: list[str] = []
    t0 = time.monotonic()
    async with asyncio.TaskGroup() as tg:  # (waits for the leading tasks: each ends by itself)
        servers = await net.start(tg)
        for pid, server in servers.items():
            async def claim(plan, slot, pid=pid, real=server._claim):
                ok = await real(plan, slot)
                claims.append((time.monotonic() - t0, pid, ok))
                return ok

            async def decide(plan, slot, pid=pid):
                decided.append(pid)

            server._claim, server._decide = claim, decide
        servers[busy].attempts[(0, 0)].deciding = True  # gathering its commit
        contributors = net.pids if early_close else net.pids[:3]
        for leader in p1.leaders:
            for shard in range(p1.num_shards):
                await servers[leader]._on_have(p1.candidates(shard)[0], HaveReport(
                    0, 1, shard, sorted(contributors), [bytes(16)] * len(contributors), []))
        await asyncio.sleep(1.0)
        servers[busy].attempts[(0, 0)].deciding = False  # ...and it ends in a retry: nothing committed
    return claims, decided


@pytest.mark.parametrize("early_close", [True, False])
def test_a_claim_refused_by_objections_is_made_again_and_the_attempt_is_decided(early_close):
    claims, decided = asyncio.run(_attempt_one(early_close))
    assert any(not ok for _, _, ok in claims), "no claim was refused: the scenario did not happen"
    assert len(decided) == 1, f"attempt 1 was decided by {len(decided)} leaders (claims: {claims})"


def test_a_leader_stops_leading_an_attempt_once_its_round_is_decided_elsewhere():
    # Found by the same review: a leading task woke on the round's commit but kept waiting for the
    # attempt's close (probing trainers every slack), for a round it had nothing left to decide.
    from test_claim_splits import _commit

    async def go() -> float:
        net = Net(4, deadline_s=DEADLINE, slack_s=SLACK)
        p0, p1 = net.plan(0, 0), net.plan(0, 1)
        async with asyncio.TaskGroup() as tg:
            servers = await net.start(tg)
            leader = servers[p1.leaders[1]]  # a stand-in: it would wait for the close and a slack
            await leader._on_have(p1.candidates(0)[0], HaveReport(0, 1, 0, net.pids[:1], [bytes(16)], []))
            lead = tg.create_task(leader._lead(0, 1))
            await asyncio.sleep(0.2)
            assert not lead.done()
            leader.book.add(_commit(net, p0.leaders[0], 0, [p0.candidates(s)[0] for s in range(p0.num_shards)]))
            leader.attempts[(0, 1)].poke()
            t0 = time.monotonic()
            await lead
            return time.monotonic() - t0

    assert asyncio.run(go()) < 1.0


def test_a_report_that_comes_after_the_attempt_is_over_does_not_get_it_decided():
    # Found by the same review: a report for an attempt long past (withheld by its aggregator) had
    # its leader claim and commit that attempt at once, and every peer took the commit, though
    # its contributors had sent their work on to later attempts.
    from claims_net import RUN
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.plan import attempt_for
    from groundswell.protocol.schema import Decision

    async def go() -> list[int]:
        net = Net(4, deadline_s=DEADLINE, slack_s=SLACK)
        opened = time.time() - 8 * (DEADLINE + 3 * SLACK) - 0.2  # the clock is in attempt 8
        net.genesis = seal(net.ids[net.pids[0]], RUN, Decision(-1, 0, "commit", [], net.pids, net.pids, net.pids[0],
                                                               [], 0, opened))
        assert attempt_for(time.time(), opened, DEADLINE, SLACK) == 8
        decided: list[int] = []
        async with asyncio.TaskGroup() as tg:
            servers = await net.start(tg)
            for pid, server in servers.items():
                async def decide(plan, slot):
                    decided.append(plan.attempt)

                server._decide = decide
            for attempt in (1, 8):  # long over, then the open one
                plan = net.plan(0, attempt)
                for leader in plan.leaders:
                    for shard in range(plan.num_shards):
                        await servers[leader]._on_have(plan.candidates(shard)[0], HaveReport(
                            0, attempt, shard, net.pids, [bytes(16)] * 4, []))
                await asyncio.sleep(1.0)
        return decided

    assert asyncio.run(go()) == [8]
