"""A big (dense) shard goes to one candidate at a time, and a transfer once started is never cut
short; but a copy that goes out too slowly, or is never acked, must not hold the shard alone past
the attempt's close: the next candidate gets a copy while it runs on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.protocol.client import RoundClient
from groundswell.protocol.framing import SendProgress, write_frame
from groundswell.protocol.plan import make_plan
from groundswell.protocol.schema import Ack
from groundswell.protocol.shard_send import PARALLEL_COPIES_BYTES, UPLINK_ASSUMED
from groundswell.protocol.transport import RequestTimedOut

pytestmark = pytest.mark.timeout(60)
SERVERS = [f"server-{i}" for i in range(6)]
SLACK = 1.0


class _Transport:
    """Candidates take the shard at `rate` bytes/s; the first one does as `first` says."""

    def __init__(self, first: str, rate: float) -> None:
        self.first, self.rate, self.asked, self.took = first, rate, [], []

    async def request(self, peer, handler, msg, expect, timeout_s, progress=None, **kwargs):
        try:
            return await self._request(peer, handler, msg, timeout_s, progress)
        except TimeoutError:  # as the transport says it
            raise RequestTimedOut(f"{peer} did not answer within {timeout_s:.1f}s") from None

    async def _request(self, peer, handler, msg, timeout_s, progress):
        if handler == "get-decision":  # the ping before a big shard: everyone answers
            return SimpleNamespace(decision=b"")
        self.asked.append(peer)
        size = sum(len(s) for s in msg.segments)
        progress = progress if progress is not None else SendProgress()  # (unwatched: as the old code sent)
        async with asyncio.timeout(timeout_s):
            progress.opened = progress.moved = time.monotonic()
            progress.size = size
            hostile = self.first if peer == self.asked[0] else "honest"
            if hostile == "never-acks":  # reads it all at once, then keeps quiet
                progress.written, progress.finished = size, time.monotonic()
                await asyncio.sleep(3600)
            if hostile == "stops-reading":  # takes what the buffers hold, then nothing
                progress.written = min(size, 256 << 10)
                await asyncio.sleep(3600)
            if hostile == "trickles":  # a piece now and then, never stalled, far below the pace
                while progress.written < size:
                    await asyncio.sleep(0.2)
                    progress.written, progress.moved = progress.written + 1024, time.monotonic()
            step = 0.1
            while progress.written < size:  # honest: at `rate`
                await asyncio.sleep(step)
                progress.written, progress.moved = min(size, progress.written + int(self.rate * step)), time.monotonic()
            progress.finished = time.monotonic()
            await asyncio.sleep(0.05)
        self.took.append(peer)
        return Ack(True, "")


def _send(first: str, rate: float, size: int, replicas: int | None = 0) -> tuple[bool, float, _Transport, list]:
    plan = make_plan("run", 5, 0, SERVERS, ["me"], 4, 1)
    transport = _Transport(first, rate)
    client = object.__new__(RoundClient)
    client.me, client.transport, client.sends_cut, client.cut_to = "me", transport, 0, {}
    client.ctx = SimpleNamespace(slack_s=SLACK, deadline_s=60.0, replicas=replicas, codec=SimpleNamespace(name="fp32"))
    opened = time.time()
    client.book = SimpleNamespace(committed={}, latest=lambda: 4, opened_at=lambda round_id: opened)
    started = time.monotonic()
    delivered = asyncio.run(client._send_shard(plan, 0, [b"x" * (size // 4)] * 4))
    return delivered, time.monotonic() - started, transport, plan.candidates(0)


@pytest.mark.parametrize("first", ["never-acks", "stops-reading", "trickles"])
def test_a_hostile_first_candidate_does_not_hold_a_big_shard_past_a_few_slacks(first):
    # Before, the shard waited on it for the whole request timeout (2 slacks plus the contribution
    # at 5 MB/s: at the default timing, past the attempt's close) and reached nobody else in time.
    size = 4 << 20
    delivered, took, transport, candidates = _send(first, rate=UPLINK_ASSUMED, size=size)
    timeout = 2 * SLACK + size / UPLINK_ASSUMED
    assert delivered and transport.asked[:2] == candidates[:2] and transport.took == [candidates[1]]
    assert took < timeout, f"the shard waited {took:.1f}s, its whole timeout ({timeout:.1f}s), on a hostile candidate"
    assert took < 5 * SLACK + size / UPLINK_ASSUMED


def test_an_honest_copy_on_pace_is_not_doubled():
    # The other side: a live aggregator taking the shard at the assumed rate (or at half of it,
    # the slowest pace allowed) is waited for, and no second copy goes out over our uplink.
    size = PARALLEL_COPIES_BYTES * 40  # ~10 MB: a few seconds at half the rate
    delivered, took, transport, candidates = _send("honest", rate=0.6 * UPLINK_ASSUMED, size=size)
    assert delivered and transport.asked == [candidates[0]] and transport.took == [candidates[0]]
    assert took > 2 * SLACK  # (the transfer did take long enough for a hedge to have been possible)


def test_the_replica_still_goes_out_when_the_first_candidate_lags():
    # With a replica, the lagging first copy does not take the slot of the replica's copy: two
    # honest holders get the shard, and the lagging one is given up once they have it.
    delivered, took, transport, candidates = _send("never-acks", rate=UPLINK_ASSUMED, size=1 << 20, replicas=1)
    assert delivered and sorted(transport.took) == sorted(candidates[1:3])


def test_write_frame_reports_how_far_the_frame_went():
    class _Writer:
        def __init__(self) -> None:
            self.out = bytearray()

        def write(self, data) -> None:
            self.out += data

        async def drain(self) -> None:
            await asyncio.sleep(0)

    writer, progress = _Writer(), SendProgress()
    asyncio.run(write_frame(writer, b"y" * (3 << 20) + b"z", progress))
    assert progress.size == progress.written == (3 << 20) + 1 and len(writer.out) == progress.size + 8
    assert progress.finished is not None and progress.moved is not None and progress.finished >= progress.moved
