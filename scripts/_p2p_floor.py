"""The transport's floor for a dense fp32 round: bare bytes over the same p2pd streams, no protocol.

`bench_exchange.py --floor` runs this among the same worker processes and the same `SwarmNode`s
as the real rounds. Per round, every peer moves exactly what a ring all-reduce (and groundswell's
fp32 round without replicas) moves per peer, 2(N-1)/N x 4P bytes:

1. scatter: peer i sends slice j of its fp32 tensor (P/N elements) to every peer j != i, and waits
   until it holds the N-1 slices of its own index;
2. gather: peer i sends its slice i to every other peer, and waits until it holds the N-1 others.

Nothing is summed, hashed, signed, parsed or checked, and every transfer starts at once: the time
is what the libp2p daemons take to move the bytes between the processes on this machine, a lower
bound for any dense fp32 exchange on this transport. A receiver acknowledges each message with one
byte once it holds all of it (and the sender then closes its end: p2pd resets a stream whose
handler hangs up first).
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from typing import Any

HANDLER = "gs-bench-floor"
_HEAD = struct.Struct("<IBQ")  # round, phase, payload length


class Floor:
    """One peer's side of the floor measurement, on a started hivemind `P2P`."""

    def __init__(self, p2p: Any, rank: int, n: int, data: memoryview) -> None:
        self.p2p, self.rank, self.n = p2p, rank, n
        self.data = data  # this peer's fp32 tensor as bytes
        self.bounds = [(len(data) // 4 * j // n * 4, len(data) // 4 * (j + 1) // n * 4) for j in range(n)]
        self.arrived: Counter[tuple[int, int]] = Counter()
        self.received: Counter[int] = Counter()  # payload bytes taken, per round
        self.sent: Counter[int] = Counter()  # payload bytes acknowledged by their receiver, per round
        self.changed = asyncio.Condition()

    async def serve(self) -> None:
        """Register the stream handler that takes slices."""
        await self.p2p.add_binary_stream_handler(HANDLER, self._on_stream)

    async def _on_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            round_id, phase, size = _HEAD.unpack(await reader.readexactly(_HEAD.size))
            if size > len(self.data):
                raise ValueError(f"slice of {size} bytes from {info.peer_id}, larger than a whole tensor")
            await reader.readexactly(size)
            async with self.changed:
                self.arrived[(round_id, phase)] += 1
                self.received[round_id] += size
                self.changed.notify_all()
            writer.write(b"\x01")
            await writer.drain()
            await reader.read()  # until the sender closes
        finally:
            writer.close()

    async def _send(self, peer_id: Any, round_id: int, phase: int, piece: memoryview) -> None:
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, HANDLER)
        try:
            writer.write(_HEAD.pack(round_id, phase, len(piece)))
            writer.write(piece)
            await writer.drain()
            if await reader.readexactly(1) != b"\x01":
                raise RuntimeError("bad acknowledgement")
            self.sent[round_id] += len(piece)
        finally:
            writer.close()

    async def _phase(self, peers: list[Any], round_id: int, phase: int) -> None:
        me = self.rank
        mine = self.bounds[me]
        sends = [
            self._send(peers[j], round_id, phase,
                       self.data[slice(*self.bounds[j])] if phase == 0 else self.data[slice(*mine)])
            for j in range(self.n) if j != me
        ]
        await asyncio.gather(*sends)
        async with self.changed:
            await self.changed.wait_for(lambda: self.arrived[(round_id, phase)] >= self.n - 1)

    def expected_bytes(self) -> int:
        """Payload bytes each round must bring this peer: the others' copies of its slice, then the others' slices."""
        mine = self.bounds[self.rank][1] - self.bounds[self.rank][0]
        return (self.n - 1) * mine + sum(b - a for j, (a, b) in enumerate(self.bounds) if j != self.rank)

    async def round(self, peer_ids: list[str], round_id: int, timeout_s: float) -> None:
        """Scatter, then gather; returns once this peer sent and holds everything of the round."""
        from hivemind.p2p import PeerID

        peers = [PeerID.from_base58(p) for p in peer_ids]
        async with asyncio.timeout(timeout_s):
            await self._phase(peers, round_id, 0)
            await self._phase(peers, round_id, 1)
