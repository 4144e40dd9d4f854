"""One peer's inbound handlers wired to in-process streams: a fake `P2P` hands frames straight
to the registered stream handlers, so tests can feed thousands of raw frames in seconds."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.peer.run_state import GlobalState, RunContext
from groundswell.peer.swarm import NodeOptions, SwarmNode
from groundswell.protocol.context import DecisionBook, contribution_bound
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import MESSAGES, Decision
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import Transport

RUN = "fuzz-run"
NUMEL = 3 * 4096 + 17


def frame(data: bytes) -> bytes:
    """A length-prefixed frame."""
    return struct.pack(">Q", len(data)) + data


class _PeerID:
    def __init__(self, peer_id: str) -> None:
        self._id = peer_id

    def to_base58(self) -> str:
        return self._id


@dataclass
class _Info:
    peer_id: _PeerID


class _Writer:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeP2P:
    """Stream handlers by protocol name; outgoing streams fail at once (nobody else is there)."""

    handlers: dict[str, Any] = field(default_factory=dict)

    async def add_binary_stream_handler(self, name: str, fn: Any) -> None:
        self.handlers[name] = fn

    async def call_binary_stream_handler(self, peer: Any, name: str) -> Any:
        raise ConnectionError("no other peers in this test")


class _CrashRecords(logging.Handler):
    """Collects the transport's "handler failed" records (a request that raised an unexpected error)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is not None:
            self.seen.append(f"{record.getMessage()}: {record.exc_info[1]!r}")


@dataclass
class Target:
    loop: asyncio.AbstractEventLoop
    p2p: FakeP2P
    server: RoundServer
    node: SwarmNode
    me: Identity
    peers: list[Identity]  # identities the attacker controls (some are the round's servers)
    ctx: RunContext
    genesis: bytes
    stop: asyncio.Event

    def feed(self, handler: str, sender: str, frame: bytes, timeout: float = 10.0, eof: bool = True) -> bytes:
        """Hand one raw frame to a handler as `sender`'s stream; returns what it wrote back.
        Raises AssertionError if the handler crashed: the transport logs a crash and closes the
        stream (a peer must not die of one request), so the log is where a crash shows.
        `eof=False`: the caller never hangs up its end of the stream."""
        name = next(n for n in self.p2p.handlers if n.split("/")[-2] == handler)
        crashes = _CrashRecords()
        transport_log = logging.getLogger("groundswell.protocol.transport")
        transport_log.addHandler(crashes)
        try:
            out = self._feed(name, sender, frame, timeout, eof)
        finally:
            transport_log.removeHandler(crashes)
        assert not crashes.seen, f"{handler} handler crashed on a frame from {sender[-8:]}: {crashes.seen[0]}"
        return out

    def _feed(self, name: str, sender: str, frame: bytes, timeout: float, eof: bool) -> bytes:

        async def go() -> bytes:
            reader = asyncio.StreamReader()
            reader.feed_data(frame)
            if eof:
                reader.feed_eof()
            writer = _Writer()
            await asyncio.wait_for(self.p2p.handlers[name](_Info(_PeerID(sender)), reader, writer), timeout)
            assert writer.closed  # every stream is closed, answered or not
            return bytes(writer.data)

        return self.loop.run_until_complete(go())


HANDLERS = ("contribute", "have", "join", "get-decision", "seal", "claim", "get-aggregate", "get-contributions",
            "get-state",
            "get-manifest", "probe")


def make_target(allowlisted: int | None = None, open_state: bool = True):
    """A generator: yields a `Target` and tears it down when resumed (use from a fixture).
    `allowlisted`: a closed run whose allowlist is the first that many of `Target.peers`."""
    loop = asyncio.new_event_loop()
    ready: asyncio.Future = loop.create_future()
    stop = asyncio.Event()

    async def hold() -> None:
        async with asyncio.TaskGroup() as tg:
            ready.set_result(tg)
            await stop.wait()

    holder = loop.create_task(hold())
    tasks = loop.run_until_complete(ready)
    me, *peers = [Identity.generate() for _ in range(6)]
    allowlist = None if allowlisted is None else frozenset(p.peer_id for p in peers[:allowlisted])
    state_readers = None if allowlist is None or open_state else allowlist | {me.peer_id}
    codec = make_codec("sparseloco")
    numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
    # a generous rate limit: this test is about content, test_guard.py about floods
    limits = Limits(requests_per_s=1e6, max_streams=1000, strikes=10**9)
    ctx = RunContext(RUN, 2, 0.3, 0.05, 4, numels, codec, contribution_bound(codec, numels), allowlist, RobustOptions(), limits,
                     state_readers)
    p2p = FakeP2P()
    guard = Guard(limits)
    transport = Transport(p2p, me, RUN, guard)
    book = DecisionBook(RUN)
    servers = [me.peer_id, *(p.peer_id for p in peers[:3])]
    genesis = seal(me, RUN, Decision(-1, 0, "commit", [], servers, servers, me.peer_id, [], 0, time.time()))
    book.add(genesis)
    server = RoundServer(ctx, transport, book, me, tasks)
    node = SwarmNode(me, "unused", NodeOptions())  # only its handlers are used: never started
    node.ctx, node.guard, node.book, node.transport = ctx, guard, book, transport
    node.signed_manifest = b"signed manifest bytes"
    node.state_provider = lambda: GlobalState(0, {"global_params": torch.zeros(NUMEL)}, genesis)
    boot = Transport(p2p, me, "", guard)

    async def register() -> None:
        await server.start()
        await transport.serve("get-state", MESSAGES["get-state"], node._on_state, max_request=4096, trailer=True)
        await boot.serve("get-manifest", MESSAGES["get-manifest"], node._on_manifest)
        await boot.serve("probe", MESSAGES["probe"], node._dial_back.handle)

    loop.run_until_complete(register())
    t = Target(loop, p2p, server, node, me, peers, ctx, genesis, stop)
    try:
        yield t
    finally:
        stop.set()
        loop.run_until_complete(asyncio.wait_for(holder, 30))
        node._loop.close()
        loop.close()


