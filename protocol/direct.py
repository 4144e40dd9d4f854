"""Direct bulk downloads: a peer hands out one-time tickets for a blob over the (authenticated,
encrypted) libp2p stream, and the holder of a ticket fetches the blob over a plain TCP connection.

Why: every byte through libp2p crosses two p2pd daemons, Noise and yamux, and moves at 300-500
MB/s on this class of machine, several times slower than TCP. The state a joiner downloads is
the largest thing a run sends; it is public within an open run (anyone may join and read it), and
its BLAKE3 digest is in the signed reply, so a cleartext copy needs no trust in the connection.
The owner offers tickets only when the state is not secret (an open run); closed runs keep the
libp2p stream. A requester that cannot reach the port (NAT, firewall) falls back to the stream.

Wire format on the TCP connection: the client sends the 32-byte token; the server answers with one
length-prefixed frame (8-byte big-endian size, then the blob) and waits for the client to close.
An unknown, expired or already used token gets the connection closed with nothing sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .schema import ProtocolError

log = logging.getLogger(__name__)
TOKEN_BYTES = 32
TOKEN_WAIT_S = 5.0  # a connection that has not sent its token by then is closed
MAX_TICKETS = 64  # outstanding tickets; the oldest is dropped beyond this
MAX_CONNECTIONS = 16  # concurrent downloads
_LEN = struct.Struct(">Q")
HASH_PIECE = 8 << 20  # bytes hashed per worker-thread call while a download is still arriving

# Plain non-blocking sockets with the loop's sock_* calls, not asyncio streams: the blob goes out
# from the cached buffer and lands in the joiner's preallocated one with no copy in between
# (a StreamWriter copies what the kernel does not take at once; a StreamReader copies every read).


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


@dataclass
class _Ticket:
    blob: bytes | bytearray | memoryview
    expires: float


class DirectServer:
    """A TCP listener that serves each ticket's blob once, to whoever presents its token."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._tickets: OrderedDict[bytes, _Ticket] = OrderedDict()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None  # owned here: cancelled and awaited by close()
        self._connections: set[asyncio.Task] = set()  # likewise
        self._expiry: asyncio.TimerHandle | None = None  # drops expired tickets (and their blobs)
        self.port = 0
        self.served = 0  # blobs sent whole
        self.refused = 0  # connections closed without a blob: bad token, too many, too slow

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: any free port; "::" also takes IPv4 where the OS can); returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dual = host == "::" and socket.has_dualstack_ipv6()
        self._listener = socket.create_server((host, port), family=family, backlog=64, dualstack_ipv6=dual)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop(self._listener))
        return self.port

    async def close(self) -> None:
        """Stop listening, end every download in progress, forget every ticket."""
        self._tickets.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def offer(self, blob: bytes | bytearray | memoryview) -> bytes:
        """A fresh one-time token for `blob`, valid for `ttl_s` seconds."""
        self._expire()
        while len(self._tickets) >= MAX_TICKETS:
            self._tickets.popitem(last=False)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._tickets[token] = _Ticket(blob, self._clock() + self.ttl_s)
        if self._expiry is None and self._listener is not None:
            # an unused ticket (a joiner that cannot reach us) must not keep an old state alive
            self._expiry = asyncio.get_running_loop().call_later(self.ttl_s + 1, self._expire_on_timer)
        return token

    def _expire(self) -> None:
        now = self._clock()
        for token in [t for t, ticket in self._tickets.items() if ticket.expires < now]:
            del self._tickets[token]

    def _expire_on_timer(self) -> None:
        self._expiry = None
        self._expire()
        if self._tickets:
            self._expiry = asyncio.get_running_loop().call_later(self.ttl_s + 1, self._expire_on_timer)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, say: joiners fall back to the stream meanwhile
                log.warning("direct state server cannot accept: %r", exc)
                await asyncio.sleep(1.0)
                continue
            conn.setblocking(False)
            if len(self._connections) >= MAX_CONNECTIONS:
                self.refused += 1
                conn.close()
                continue
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(TOKEN_WAIT_S):
                token = await _recv_exactly(loop, conn, TOKEN_BYTES)
            self._expire()
            ticket = self._tickets.pop(token, None)
            if ticket is None:
                self.refused += 1
                return
            # Bounded like any download: the slowest honest link still moves ~1 MB/s.
            async with asyncio.timeout(60 + len(ticket.blob) / 1e6):
                await loop.sock_sendall(conn, _LEN.pack(len(ticket.blob)))
                await loop.sock_sendall(conn, memoryview(ticket.blob))
                while await loop.sock_recv(conn, 1 << 16):
                    pass  # the client closes first, once it holds everything
            self.served += 1
        except (TimeoutError, OSError) as exc:
            self.refused += 1
            log.debug("direct download ended early: %r", exc)
        finally:
            conn.close()


async def fetch_direct(host: str, port: int, token: bytes, size: int, *, hasher: Any = None,
                       connect_timeout_s: float = 2.0, timeout_s: float = 600.0) -> memoryview:
    """Download one ticket's blob (a writable byte view), which must be exactly `size` bytes;
    `hasher` is fed all of it, in order, mostly while it arrives.
    Raises ConnectionError (or TimeoutError) when the server cannot be reached or sends another
    size, ProtocolError (oversized) when it announces more than `size`."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(connect_timeout_s):
            await loop.sock_connect(sock, (host, port))
        async with asyncio.timeout(timeout_s):
            await loop.sock_sendall(sock, token)
            (announced,) = _LEN.unpack(await _recv_exactly(loop, sock, _LEN.size))
            if announced > size:
                raise ProtocolError(f"a direct download of {announced} bytes exceeds the limit of {size}",
                                    reason="oversized")
            if announced != size:
                raise ConnectionError(f"the direct download holds {announced} bytes, {size} were announced")
            # np.empty: no zero-fill pass over a buffer the socket is about to fill anyway
            buf = np.empty(size, dtype=np.uint8)
            view, got, hashed = memoryview(buf), 0, 0
            hashing: asyncio.Future | None = None
            while got < size:
                k = await loop.sock_recv_into(sock, view[got:])
                if k == 0:
                    raise ConnectionError(f"the direct download ended after {got} of {size} bytes")
                got += k
                # Hash what has arrived on a worker thread (BLAKE3 drops the GIL) while the next
                # bytes come in; one piece at a time keeps the hasher's input in order.
                if hasher is not None and got - hashed >= HASH_PIECE and (hashing is None or hashing.done()):
                    if hashing is not None:
                        hashing.result()
                    hashing = loop.run_in_executor(None, hasher.update, view[hashed:got])
                    hashed = got
            if hashing is not None:
                await hashing
        if hasher is not None and hashed < size:
            hasher.update(view[hashed:])
        return view
    finally:
        with contextlib.suppress(OSError):
            sock.close()
