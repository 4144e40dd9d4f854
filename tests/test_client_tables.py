"""The round client's per-round tables stay bounded however long the run: the coordinator, which
sends no segments, kept one `retried` entry per retried round for good (found by a review)."""

from __future__ import annotations

import asyncio
import time
import types

from groundswell.protocol.client import RoundClient
from groundswell.protocol.schema import Decision


def retrying_client(me: str, plan: types.SimpleNamespace, opened_ago_s: float = 0.0) -> RoundClient:
    """A RoundClient with no network: `plan` for every attempt, opened `opened_ago_s` before now,
    its joins told to nobody, and every attempt decided "retry"."""
    class Book:
        def __init__(self) -> None:
            self.committed: dict = {}

        def opened_at(self, r):
            return time.time() - opened_ago_s

        def latest(self):
            return -1

    server = types.SimpleNamespace(ctx=types.SimpleNamespace(deadline_s=30.0, slack_s=5.0), transport=None,
                                   book=Book(), identity=types.SimpleNamespace(peer_id=me))

    async def plan_of(*a, **k):
        return plan

    async def told(*a):
        return None

    async def retry(p):
        return Decision(0, 0, "retry", [], [], list(plan.leaders), "x", [], 1, time.time()), b"x"

    server.plan = plan_of
    client = RoundClient(server, lambda r: [])
    client._tell, client._await_decision = told, retry
    return client


def test_a_coordinators_retried_rounds_are_pruned():
    plan = types.SimpleNamespace(leaders=["coord"], trainers=["coord"], num_shards=1)
    client = retrying_client("coord", plan)

    async def main() -> None:
        for r in range(200):  # as `coordinator_role._follow_rounds` calls it: no segments
            await client.run_attempt(r, 0, None, trains=False, serves=True)

    asyncio.run(main())
    assert 1 <= len(client.retried) <= 3, len(client.retried)
