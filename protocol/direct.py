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

Bounds (a ticket needs no stream upload slot, so the port bounds its own downloads): each
requester holds at most one ticket (a new one replaces it) and one download (redeeming a new
ticket ends the one before); at most `MAX_TICKETS` tickets are out at once (past that a request
is answered busy; `TICKETS_KEPT_FOR_CONTRIBUTORS` of them go only to contributors); at most
`MAX_CONNECTIONS` downloads run at once (`DOWNLOADS_KEPT_FOR_CONTRIBUTORS` of them only on
contributors' tickets), and while every download open to a requester is taken it gets no ticket
either (busy: it asks again later, or another peer); a download whose reader takes no piece for `STALL_S`
seconds is ended, as is one that, past its first `RATE_GRACE_S`, has read less than half of
what it would by now at the rate that finishes in time; and none runs longer than the longest a joiner waits for a blob of its size
(`serve_timeout_s`), so a reader that stalls neither holds a slot for long nor keeps an old state
in memory. Connections that have not sent their token yet
hold no download slot: at most `MAX_SILENT` of them are kept (the oldest goes to make room), and
one source address holds at most `MAX_SILENT_PER_SOURCE` of those. The joiner ends a download whose
server sends nothing for `STALL_S` seconds, and falls back to the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import secrets
import socket
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .schema import ProtocolError

log = logging.getLogger(__name__)
T = TypeVar("T")
TOKEN_BYTES = 32
TOKEN_WAIT_S = 5.0  # a connection that has not sent its token by then is closed
# Outstanding tickets, one per requester at most. Past this a request is answered busy rather than
# pushing out the oldest: a ticket needs no upload slot, so requests under fresh identities would
# otherwise flush an honest joiner's ticket between its offer and its redemption.
MAX_TICKETS = 64
TICKETS_KEPT_FOR_CONTRIBUTORS = 16  # of those, tickets only requesters the node vouches for may take
# Concurrent downloads (connections that sent a valid token), as many as the stream's upload slots:
# a home uplink shared by more is slower for every joiner than taking turns (with 16, joiners at a
# launch would each get too little of the coordinator's uplink to finish in time; a review).
MAX_CONNECTIONS = 4
DOWNLOADS_KEPT_FOR_CONTRIBUTORS = 1  # of those, downloads only requesters the node vouches for may hold
# Connections that have not sent their token yet, kept apart from the downloads: anyone can open
# them (no ticket needed), so they take no download slot, and past this many the oldest is
# dropped whatever its age. A joiner sends its token within a round trip of connecting, so it is
# rarely the oldest of so many.
MAX_SILENT = 64
# No piece may wait longer than this for the reader to take it (nor the end for the reader to
# close): a piece is 1 MiB, about a second on an honest 1 MB/s link, so this leaves room for TCP
# retransmission backoff and a busy joiner; a reader that stops reading frees its slot (and the
# state it pins) this soon, not after the whole download's time. The joiner holds the server to
# the same bound: a server that stops sending costs it this, not its whole budget for that server.
STALL_S = 20.0
RATE_GRACE_S = 20.0  # a download's first seconds, before its rate is held to RATE_SHARE of what finishes in time
RATE_SHARE = 0.5
# Connections that have not sent their token yet, per source address (an IPv6 /64 counts as one):
# a joiner sends its token at once, so this is only reached by connections opened to hold slots,
# and the source's next ones are refused instead of making other sources' connections room.
MAX_SILENT_PER_SOURCE = 2
# Loopback sources are this machine's own peers (`groundswell simulate` runs every peer on
# 127.0.0.1, and its joiners sync at once): the per-source bound does not apply to them.
CAP_LOOPBACK = False
_LEN = struct.Struct(">Q")
# accept() errors that are one pending connection's, not the listener's (Linux passes their network
# errors on; BSD reports one aborted): the next is accepted at once. Any other pauses accepting.
_ONE_CONNECTIONS_FAILURE = frozenset(getattr(errno, name) for name in (
    "ECONNABORTED", "ECONNRESET", "EPROTO", "ENETDOWN", "ENETUNREACH", "ENOPROTOOPT", "EHOSTDOWN", "EHOSTUNREACH",
    "ENONET", "EOPNOTSUPP") if hasattr(errno, name))
SEAL_PIECE = 1 << 20  # plaintext bytes per AES-GCM piece: small enough to open while the next arrive
SEAL_TAG = 16
KEY_BYTES = 32


def wire_size(size: int) -> int:
    """Bytes a whole download of a `size`-byte blob puts on the connection: its length, then it sealed."""
    return _LEN.size + sealed_size(size)


def sealed_size(size: int) -> int:
    """Bytes on the wire for a `size`-byte blob sealed in pieces."""
    return size + SEAL_TAG * -(-size // SEAL_PIECE)


def _nonce(i: int) -> bytes:
    return i.to_bytes(12, "big")


def serve_timeout_s(size: int) -> float:
    """The longest a download of a `size`-byte blob may run: what a joiner waits for it at most
    (`peer.state_download.state_timeout_s`: a minute plus 16 bytes per parameter at 20 MB/s; a state
    blob holds at least 4 bytes per parameter), so a slow reader holds its slot no longer than an
    honest joiner would still be reading."""
    return 60 + size / 5e6


def source_of(host: str) -> str | None:
    """The key connections from `host` are counted under (an IPv6 address's /64, the IPv4 address
    of an IPv4-mapped one), or None when they are not bounded (loopback, unless `CAP_LOOPBACK`)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback and not CAP_LOOPBACK:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


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
    requester: str
    vouched: bool


class DirectServer:
    """A TCP listener that serves each ticket's blob once, to whoever presents its token."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._tickets: OrderedDict[bytes, _Ticket] = OrderedDict()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None  # owned here: cancelled and awaited by close()
        self._connections: set[asyncio.Task] = set()  # likewise
        # connections that have not sent their token yet, oldest first (the one a full pool
        # drops), with their source
        self._waiting: OrderedDict[asyncio.Task, str | None] = OrderedDict()
        self._silent: Counter[str] = Counter()  # of those, how many per source (`source_of`)
        self._serving: dict[str, asyncio.Task] = {}  # the download under way per requester
        self._vouched: set[str] = set()  # those of `_serving`'s requesters whose ticket was a vouched one
        self._expiry: asyncio.TimerHandle | None = None  # drops expired tickets (and their blobs)
        self.port = 0
        self.served = 0  # blobs sent whole
        self.bytes_sent = 0  # on every download, whole or not (the node's traffic figure counts them)
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
        if self._listener is not None:  # first: a close cancelled below must not leave the port bound
            self._listener.close()
            self._listener = None
        self.port = 0
        self._tickets.clear()
        self._serving.clear()
        self._vouched.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def offer(self, blob: bytes | bytearray | memoryview, requester: str,
              vouched: bool = False) -> tuple[bytes, bytes] | None:
        """A fresh one-time token for `blob`, valid for `ttl_s` seconds, and the fresh key it will
        be sealed under; None (busy) if every ticket open to `requester` (a peer id; `vouched`:
        the kept ones too) is out. It replaces `requester`'s earlier ticket if it holds one: a
        requester asking again and again holds one ticket, and pushes no one else's out."""
        if self._listener is None:  # closed (or never started): its port is nobody's to dial
            return None
        self._expire()
        for token in [t for t, ticket in self._tickets.items() if ticket.requester == requester]:
            del self._tickets[token]
        strangers = sum(not ticket.vouched for ticket in self._tickets.values())
        if len(self._tickets) >= MAX_TICKETS or (
                not vouched and strangers >= MAX_TICKETS - TICKETS_KEPT_FOR_CONTRIBUTORS):
            return None
        if requester not in self._serving and not self._download_open(vouched):
            return None  # (a ticket it could not redeem would cost it a connection, then the stream)
        token, key = secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(KEY_BYTES)
        self._tickets[token] = _Ticket(blob, key, self._clock() + self.ttl_s, requester, vouched)
        self._arm_expiry()
        return token, key

    def _download_open(self, vouched: bool) -> bool:
        """Is a download slot open to a requester (`vouched`: the kept ones too) that holds none?"""
        strangers = sum(1 for r in self._serving if r not in self._vouched)
        return len(self._serving) < MAX_CONNECTIONS and (
            vouched or strangers < MAX_CONNECTIONS - DOWNLOADS_KEPT_FOR_CONTRIBUTORS)

    def _expire(self) -> None:
        now = self._clock()
        for token in [t for t, ticket in self._tickets.items() if ticket.expires < now]:
            del self._tickets[token]

    def _arm_expiry(self) -> None:
        """Drop the oldest ticket when it expires (an unused ticket, of a joiner that cannot reach
        us, must not keep an old state alive): tickets are kept in the order they expire."""
        if self._expiry is None and self._tickets and self._listener is not None:
            due = next(iter(self._tickets.values())).expires - self._clock()
            self._expiry = asyncio.get_running_loop().call_later(max(0.0, due) + 0.05, self._expire_on_timer)

    def _expire_on_timer(self) -> None:
        self._expiry = None
        self._expire()
        self._arm_expiry()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno in _ONE_CONNECTIONS_FAILURE:
                    log.debug("direct state server: a connection failed before it was accepted: %r", exc)
                    await asyncio.sleep(0)
                else:  # out of file descriptors, say: joiners fall back to the stream meanwhile
                    log.warning("direct state server cannot accept: %r", exc)
                    await asyncio.sleep(1.0)
                continue
            conn.setblocking(False)
            source = source_of(addr[0])
            if source is not None and self._silent[source] >= MAX_SILENT_PER_SOURCE:
                # this source already holds its share of connections without a token: it waits,
                # and makes no room at others' expense
                self.refused += 1
                conn.close()
                # `sock_accept` returns at once while the backlog holds more: without a yield here,
                # one source connecting faster than it is refused held the whole event loop
                # (heartbeats, rounds), found by a review
                await asyncio.sleep(0)
                continue
            if len(self._waiting) >= MAX_SILENT:
                # Connections that send no token (anyone can open them, from many addresses) must
                # not keep joiners out: the one silent longest makes room, however young. A joiner
                # sends its token at once. (It stays in `_connections`, owned, until its
                # cancellation has closed it.)
                oldest = next(iter(self._waiting))
                self._heard(oldest)
                oldest.cancel()
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            self._waiting[task] = source
            if source is not None:
                self._silent[source] += 1
            task.add_done_callback(self._connections.discard)
            # let it take its token if that came already, before the next connection of a burst
            # is counted against its source
            await asyncio.sleep(0)

    def _heard(self, task: asyncio.Task | None) -> None:
        """`task`'s connection is no longer one without a token (it sent it, or it ends)."""
        if task not in self._waiting:
            return
        source = self._waiting.pop(task)  # type: ignore[arg-type]
        if source is not None:
            self._silent[source] -= 1
            if not self._silent[source]:
                del self._silent[source]

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        ticket: _Ticket | None = None
        requester: str | None = None
        src: memoryview | None = None
        piece: memoryview | None = None
        try:
            async with asyncio.timeout(TOKEN_WAIT_S):
                token = await _recv_exactly(loop, conn, TOKEN_BYTES)
            self._heard(me)
            self._expire()
            ticket = self._tickets.pop(token, None)
            if ticket is None:
                self.refused += 1
                return
            requester = ticket.requester
            earlier = self._serving.get(requester)
            if earlier is None and not self._download_open(ticket.vouched):
                # every download slot open to this requester is taken (only connections with a
                # valid token hold one; tickets handed out while one was open may outnumber them):
                # the joiner falls back to the stream. Some are kept for the peers we vouch for:
                # tickets kept for them were of no use while slow readers under fresh identities
                # held every slot (a review).
                self.refused += 1
                return
            if earlier is not None and earlier is not me:
                earlier.cancel()  # one download per requester: its newer ticket ends the one before
            self._serving[requester] = me
            if ticket.vouched:
                self._vouched.add(requester)
            else:
                self._vouched.discard(requester)
            src, aead = memoryview(ticket.blob).cast("B"), AESGCM(ticket.key)
            ticket = None
            slot = memoryview(bytearray(min(SEAL_PIECE, len(src)) + SEAL_TAG))
            # the whole download is bounded, and so is each piece: a reader that stops reading
            # frees its slot (and the state) within STALL_S
            async with asyncio.timeout(serve_timeout_s(len(src))), asyncio.timeout(STALL_S) as stall:
                await loop.sock_sendall(conn, _LEN.pack(sealed_size(len(src))))
                self.bytes_sent += _LEN.size
                began, needed = loop.time(), len(src) / serve_timeout_s(len(src))  # bytes/s to finish in time
                for i, start in enumerate(range(0, len(src), SEAL_PIECE)):
                    if (took := loop.time() - began) > RATE_GRACE_S and start < RATE_SHARE * needed * took:
                        # A reader that takes a piece just inside the stall bound never stalls, and
                        # held its slot and this (perhaps superseded) state for the whole serve time:
                        # 16 of them kept old multi-GB states alive for ~50 KB/s each (a review). At
                        # under half the rate that finishes in time, it would not finish anyway.
                        raise TimeoutError(f"reader too slow: {start} bytes in {took:.0f} s")
                    stall.reschedule(loop.time() + STALL_S)
                    piece = src[start:start + SEAL_PIECE]
                    sealed = slot[:len(piece) + SEAL_TAG]
                    aead.encrypt_into(_nonce(i), piece, None, sealed)
                    await loop.sock_sendall(conn, sealed)
                    self.bytes_sent += len(sealed)
                piece = src = None  # all sent: the state is no longer needed here
                stall.reschedule(loop.time() + STALL_S)
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
            # nothing of this download pins the state once it ends (not even a traceback's frame)
            ticket = src = piece = None
            self._heard(me)
            if requester is not None and self._serving.get(requester) is me:
                del self._serving[requester]
                self._vouched.discard(requester)
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
    reached, sends another size or bytes that fail authentication, or sends nothing for `STALL_S`
    seconds (the length, or a piece), ProtocolError (oversized) when it announces more than `size`
    allows."""
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
            (announced,) = _LEN.unpack(await _unstalled(_recv_exactly(loop, sock, _LEN.size)))
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
                await _unstalled(_recv_into(loop, sock, sealed, start + i * SEAL_TAG, wire))
                try:
                    aead.decrypt_into(_nonce(i), sealed, None, piece)
                except InvalidTag:
                    raise ConnectionError(f"piece {i} of the direct download failed authentication") from None
        return out
    finally:
        with contextlib.suppress(OSError):
            sock.close()


async def _unstalled(read: Awaitable[T]) -> T:
    """`read`, which must finish within `STALL_S` (ConnectionError if not): a server that sends its
    length, or some pieces, then nothing costs the joiner that long, not its whole budget for it."""
    bound = asyncio.timeout(STALL_S)
    try:
        async with bound:
            return await read
    except TimeoutError:
        if not bound.expired():  # the connection's own (TCP gave up): not a stall of ours
            raise
        raise ConnectionError(f"the direct download stalled for {STALL_S:g}s") from None
