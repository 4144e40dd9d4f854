"""A large frame (a state upload's trailer) held to a pace: a reader that takes it far too slowly
to finish in its time is cut off past its first seconds, freeing its upload slot and the state."""

from __future__ import annotations

import asyncio

import pytest
from groundswell.protocol import framing

pytestmark = pytest.mark.timeout(60)


class _Reader:
    """A StreamWriter stand-in whose reader takes one piece every `per_piece_s`."""

    def __init__(self, per_piece_s: float) -> None:
        self.per_piece_s, self.taken = per_piece_s, 0

    def write(self, data) -> None:
        self.taken += len(data)

    async def drain(self) -> None:
        await asyncio.sleep(self.per_piece_s)


def test_a_reader_far_too_slow_to_finish_in_time_is_cut_off(monkeypatch):
    # Found by a review of the state uploads: the direct port held its readers to a pace since
    # 2026-12-06, but a state sent over a stream as a trailer had only its whole timeout, so slow
    # readers under fresh identities could hold every upload slot, and old states, for minutes.
    monkeypatch.setattr(framing, "WRITE_PIECE", 1000)
    monkeypatch.setattr(framing, "PACED_GRACE_S", 0.1)
    data = bytes(20_000)  # 20 pieces, to be sent within 1 s: 20,000 B/s; half of that is the floor
    slow = _Reader(per_piece_s=0.2)  # 5,000 B/s
    with pytest.raises(TimeoutError, match="reader too slow"):
        asyncio.run(framing.write_frame_paced(slow, data, within_s=1.0))
    assert slow.taken < len(data)
    fast = _Reader(per_piece_s=0.0)
    asyncio.run(framing.write_frame_paced(fast, data, within_s=1.0))
    assert fast.taken == len(data) + framing._LEN.size
    steady = _Reader(per_piece_s=0.06)  # 16,700 B/s: slower than the pace that finishes in time, over half of it
    asyncio.run(framing.write_frame_paced(steady, data, within_s=1.0))
    assert steady.taken == len(data) + framing._LEN.size


def test_a_reader_that_stops_taking_bytes_mid_piece_is_cut_off_on_time(monkeypatch):
    # Found by a review (2026-12-07): the pace was checked between pieces only, so a reader that
    # stopped reading kept a piece's drain, and its stream, waiting for the whole timeout.
    import time

    monkeypatch.setattr(framing, "WRITE_PIECE", 1000)
    monkeypatch.setattr(framing, "PACED_GRACE_S", 0.2)
    stuck = _Reader(per_piece_s=3600.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="reader too slow"):
        asyncio.run(framing.write_frame_paced(stuck, bytes(20_000), within_s=1.0))
    assert time.monotonic() - started < 5
