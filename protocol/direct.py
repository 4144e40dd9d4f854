"""Direct bulk downloads: a peer hands out one-time tickets for a blob over the (authenticated,
encrypted) libp2p stream, and the holder of a ticket fetches the blob over a plain TCP connection.

Why: every byte through libp2p crosses two p2pd daemons, Noise and yamux, and moves at 300-500
MB/s on this class of machine, several times slower than TCP. The state a joiner downloads is
the largest thing a run sends. A requester that cannot reach the port (NAT, firewall) falls back
to the stream.

The blob travels sealed: AES-256-GCM in pieces of `SEAL_PIECE` bytes (piece i under nonce i),
with a fresh key per ticket that only the signed reply carries, over the encrypted stream. So a
closed run's state stays private to the peers it is offered to, and bytes altered on the way, or
a port that belongs to someone else, fail authentication: what opens is exactly what the server
sealed for this requester, which needs no second check by hash. Each piece is sealed just before
it is sent and opened as it arrives, on the event loop (AES-GCM runs at several GB/s with AES-NI,
tens of microseconds per piece), so sealing adds no copy of the state in memory.

Wire format on the TCP connection: the client sends the 32-byte token; the server answers with one
length-prefixed frame (8-byte big-endian size, then the sealed blob) and waits for the client to
close. An unknown, expired or already used token gets the connection closed with nothing sent.
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

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .schema import ProtocolError

log = logging.getLogger(__name__)
TOKEN_BYTES = 32
TOKEN_WAIT_S = 5.0  # a connection that has not sent its token by then is closed
SILENT_S = 1.0  # a connection without a token for this long makes room for a new one when all slots are taken
MAX_TICKETS = 64  # outstanding tickets; the oldest is dropped beyond this
MAX_CONNECTIONS = 16  # concurrent downloads
_LEN = struct.Struct(">Q")
SEAL_PIECE = 1 << 20  # plaintext bytes per AES-GCM piece: small enough to open while the next arrive
SEAL_TAG = 16
KEY_BYTES = 32


def sealed_size(size: int) -> int:
    """Bytes on the wire for a `size`-byte blob sealed in pieces."""
    return size + SEAL_TAG * -(-size // SEAL_PIECE)


def _nonce(i: int) -> bytes:
    return i.to_bytes(12, "big")


# Plain non-blocking sockets with the loop's sock_* calls, not asyncio streams: each piece is
# sealed from the cached state into a small slot and sent from there, and the joiner receives it
# into a small slot and opens it straight into its one output buffer (a StreamWriter copies what
# the kernel does not take at once; a StreamReader copies every read).


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await _recv_into(loop, sock, memoryview(buf), 0, n)
    return bytes(buf)


@dataclass
class _Ticket:
    blob: bytes | bytearray | memoryview
    key: bytes
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
        # connections that have not sent their token yet, oldest first, with when they were
        # accepted: those silent for a while are the ones a full server drops
        self._waiting: OrderedDict[asyncio.Task, float] = OrderedDict()
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

    def offer(self, blob: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
        """A fresh one-time token for `blob`, valid for `ttl_s` seconds, and the fresh key it will
        be sealed under."""
        self._expire()
        while len(self._tickets) >= MAX_TICKETS:
            self._tickets.popitem(last=False)
        token, key = secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(KEY_BYTES)
        self._tickets[token] = _Ticket(blob, key, self._clock() + self.ttl_s)
        if self._expiry is None and self._listener is not None:
            # an unused ticket (a joiner that cannot reach us) must not keep an old state alive
            self._expiry = asyncio.get_running_loop().call_later(self.ttl_s + 1, self._expire_on_timer)
        return token, key

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
            if sum(1 for t in self._connections if not t.cancelling()) >= MAX_CONNECTIONS:
                oldest = next(iter(self._waiting.items()), None)
                if oldest is None or time.monotonic() - oldest[1] < SILENT_S:
                    # every slot is a download under way, or a connection that may be sending its
                    # token right now (a burst of joiners): this one waits for a free slot elsewhere
                    self.refused += 1
                    conn.close()
                    continue
                # Connections that send no token (anyone can open them, no ticket needed) must not
                # fill the slots: the one silent longest makes room. A joiner sends its token at
                # once. (It stays in `_connections`, owned, until its cancellation has closed it.)
                del self._waiting[oldest[0]]
                oldest[0].cancel()
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            self._waiting[task] = time.monotonic()
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(TOKEN_WAIT_S):
                token = await _recv_exactly(loop, conn, TOKEN_BYTES)
            self._waiting.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._expire()
            ticket = self._tickets.pop(token, None)
            if ticket is None:
                self.refused += 1
                return
            # Bounded like any download: the slowest honest link still moves ~1 MB/s.
            src, aead = memoryview(ticket.blob).cast("B"), AESGCM(ticket.key)
            slot = memoryview(bytearray(min(SEAL_PIECE, len(src)) + SEAL_TAG))
            async with asyncio.timeout(60 + len(src) / 1e6):
                await loop.sock_sendall(conn, _LEN.pack(sealed_size(len(src))))
                for i, start in enumerate(range(0, len(src), SEAL_PIECE)):
                    piece = src[start:start + SEAL_PIECE]
                    sealed = slot[:len(piece) + SEAL_TAG]
                    aead.encrypt_into(_nonce(i), piece, None, sealed)
                    await loop.sock_sendall(conn, sealed)
                while await loop.sock_recv(conn, 1 << 16):
                    pass  # the client closes first, once it holds everything
            self.served += 1
        except (TimeoutError, OSError) as exc:
            self.refused += 1
            log.debug("direct download ended early: %r", exc)
        except asyncio.CancelledError:  # made room for another connection (or the server is closing)
            self.refused += 1
            raise
        finally:
            self._waiting.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            conn.close()


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, done: int,
                     total: int) -> None:
    got = 0
    while got < len(view):
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError(f"the connection ended after {done + got} of {total} bytes")
        got += k


async def fetch_direct(host: str, port: int, token: bytes, key: bytes, size: int, *,
                       connect_timeout_s: float = 2.0, timeout_s: float = 600.0) -> memoryview:
    """Download and open one ticket's sealed blob (returned as a writable byte view), which must
    be exactly `size` bytes. Raises ConnectionError (or TimeoutError) when the server cannot be
    reached, sends another size or bytes that fail authentication, ProtocolError (oversized)
    when it announces more than `size` allows."""
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"a direct download key has {len(key)} bytes, not {KEY_BYTES}", reason="bad-key")
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
            wire = sealed_size(size)
            if announced > wire:
                raise ProtocolError(f"a direct download of {announced} bytes exceeds the limit of {wire}",
                                    reason="oversized")
            if announced != wire:
                raise ConnectionError(f"the direct download holds {announced} bytes, {wire} were announced")
            # np.empty: no zero-fill pass over a buffer the pieces are about to fill anyway
            out = memoryview(np.empty(size, dtype=np.uint8))
            aead = AESGCM(key)
            slot = memoryview(bytearray(min(SEAL_PIECE, size) + SEAL_TAG))
            for i, start in enumerate(range(0, size, SEAL_PIECE)):
                piece = out[start:start + SEAL_PIECE]
                sealed = slot[:len(piece) + SEAL_TAG]
                await _recv_into(loop, sock, sealed, start + i * SEAL_TAG, wire)
                try:
                    aead.decrypt_into(_nonce(i), sealed, None, piece)
                except InvalidTag:
                    raise ConnectionError(f"piece {i} of the direct download failed authentication") from None
        return out
    finally:
        with contextlib.suppress(OSError):
            sock.close()
