"""Announcing round r+1 as soon as round r commits must not hold round r's mean back: a next-round
leader that takes the join's stream and never answers held every peer's outcome a slack (found by
a review). The announcement runs on, owned by the exchange, and is let go a contribution later."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import torch
from groundswell.peer.swarm_exchange import SwarmExchange
from groundswell.protocol.client import AttemptResult
from groundswell.protocol.schema import Decision

SLACK_S = 3.0


def test_a_next_round_leader_that_never_answers_does_not_hold_the_outcome_back():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    announcing: list[int] = []
    cancelled: list[int] = []

    class Client:
        own_scaled: dict = {}

        async def run_attempt(self, round_id, *a, **k):
            d = Decision(round_id, 0, "commit", ["me"], ["me"], ["me"], "me", ["me"], 1, time.time(), [b"x" * 16])
            return AttemptResult(d, b"signed", 0, True, True)

        async def fetch_aggregate(self, signed):
            return torch.zeros(4)

        async def announce(self, round_id, **k):
            announcing.append(round_id)
            try:
                await asyncio.sleep(10 * SLACK_S)  # a leader that took the stream and never answers
            except asyncio.CancelledError:
                cancelled.append(round_id)
                raise

    node = types.SimpleNamespace(
        identity=types.SimpleNamespace(peer_id="me"), client=Client(),
        transport=types.SimpleNamespace(bytes_sent=0, bytes_received=0),
        ctx=types.SimpleNamespace(deadline_s=10.0, slack_s=SLACK_S, min_peers=1), book=None, down=None,
        submit=lambda coro: asyncio.run_coroutine_threadsafe(coro, loop))
    try:
        ex = SwarmExchange(node)
        ex.announce_next = True
        took = []
        for r in range(3):
            start = time.monotonic()
            ex.contribute(r, [])
            result = ex.collect(r)
            took.append(time.monotonic() - start)
            assert torch.equal(result.mean, torch.zeros(4))
        assert max(took) < SLACK_S / 2, took  # (it waited out the announcement: >= SLACK_S each)
        time.sleep(0.2)
        assert announcing == [1, 2, 3]
        # each announcement outlives one contribution and is let go at the next (round 1's at
        # round 2's contribution); round 3's still runs, owned by the exchange
        assert cancelled == [1], cancelled
        assert ex._announced is not None and not ex._announced.done()
        # leaving: every announcement still out is cancelled first (a join after the leave undid it)
        ex.drop_announcements()
        time.sleep(0.2)
        assert sorted(cancelled) == [1, 2, 3], cancelled
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
