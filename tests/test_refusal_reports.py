"""A leader stops waiting for a trainer whose contribution aggregators refused as invalid, but only
once two of them said so: one reporting candidate's word alone let a hostile aggregator have the
leader close without any trainer it chose (found by a review, 2026-12-07)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from groundswell.protocol.schema import HaveReport

sys.path.insert(0, str(Path(__file__).parent))
from claims_net import Net  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_one_aggregators_refusal_alone_does_not_stop_the_wait_for_a_trainer():
    async def go() -> list[bool]:
        net = Net(4)
        plan = net.plan(0, 1)
        leader_id, victim = plan.leaders[0], plan.trainers[-1]
        waited = []
        async with asyncio.TaskGroup() as tg:
            servers = await net.start(tg)
            leader = servers[leader_id]
            leader._lead_guarded = lambda *args: asyncio.sleep(0)  # (its waiting is not what is tested)
            slot = leader.attempts[(0, 1)]
            others = sorted(set(plan.trainers) - {victim})
            for n, aggregator in enumerate(plan.candidates(0)[:3]):
                await leader._on_have(aggregator, HaveReport(0, 1, 0, others, [bytes(16)] * len(others),
                                                             [victim] if n < 2 else []))
                waited.append(victim in leader._expected(plan, slot))
        return waited

    assert asyncio.run(go()) == [True, False, False]
