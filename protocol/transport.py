"""Signed request/response over hivemind's libp2p: unary calls for small messages, binary streams for bulk.

A request whose sealed bytes fit in `UNARY_MAX_REQUEST`, and whose largest allowed reply is a
control message's (`UNARY_MAX_REPLY`), goes as one unary call over the daemon's persistent control connection: half
the CPU and latency of a stream per request (no unix socket set up on either side), and most of a
round's requests are that small (reports, joins, claims, seals, decision polls). Everything else goes on a
stream of frames: an 8-byte big-endian length and that many bytes; the length is checked against
the handler's budget *before* anything is read into memory (a unary call's bytes are capped by
the daemon's message limit before they reach us, then by the handler's budget). Every request and reply is a signed
`Envelope` (`envelope.py`) around a schema message: the signature is checked against the sender's peer id (an
Ed25519 peer id embeds its public key), and the sender must be the stream's remote peer, which
libp2p's secure channel authenticates. Every network wait sits inside an `asyncio.timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .digests import bulk_hasher
from .envelope import seal, unseal
from .failures import (  # noqa: F401  (re-exported: callers name these from the transport)
    PeerDead,
    PeerGone,
    PeerUnavailable,
    Refused,
    RequestTimedOut,
    ShardsUnavailable,
    dial_failed,
    remote_failure,
    target_peer_id,
)
from .framing import (
    _LEN,
    TRAILER_STALL_S,
    SendProgress,
    close_stream,
    read_frame,
    read_frame_into,
    read_frame_paced,
    read_until_eof,
    write_frame,
    write_frame_paced,
)
from .guard import SMALL_BODY, Guard
from .identity import Identity
from .schema import MAX_SMALL, PROTOCOL_VERSION, Message, ProtocolError
from .unary_calls import harden_unary_calls  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)
# Sealed request size up to which a request is a unary call: measured between two local
# processes (scripts/bench_p2p_requests.py), a unary call costs half the CPU of a stream at 300
# bytes, 1.4x at 64 KiB and 2.3x at 256 KiB (the daemon handles unary messages whole, with copies).
# A caller writes its request as soon as the stream is open: one whose request has not begun
# within this many seconds is cut off, not left holding a stream slot for the handler's whole time.
REQUEST_START_S = 30.0
MIN_BODY_RATE = 128 << 10  # bytes/s a booked request body must keep up (1 Mbit/s), after a grace of BODY_STALL_S
ROOM_WAIT_S = 10.0  # how long a request body waits for room in the node's inbound budget
BODY_STALL_S = 10.0  # a request body with no new piece for this long is cut off
# How long an answered stream stays open for its caller to read the reply's tail: at most the
# daemon's stream window, ~16 MiB, 128 s at the slowest rate a request body may keep
# (MIN_BODY_RATE, 1 Mbit/s), and some. Not the handler's whole timeout (600 s): a caller that
# never hangs up would hold one of our file descriptors that long for free.
LINGER_S = 160.0
# Answered streams lingering at once, all peers together and one peer alone. A lingering stream
# no longer holds a request slot (32 throwaway identities used to take all 1,024 of the node's
# with tiny requests, and every honest stream was refused "busy" for LINGER_S: a review); past
# these, the oldest of the peer, else of the peer lingering most, is closed: its reply is out,
# though a slow reader may still lose its tail. Per peer, as many as `Limits.max_streams` (32):
# a fetcher reading many large shards of ours loses nothing it had before.
MAX_LINGERING = 512
MAX_LINGERING_PER_PEER = 32
UNARY_MAX_REQUEST = 32 << 10
# Largest allowed reply for a unary call: a control message's budget. Bulk replies (aggregates,
# contributions) are budgeted from the model size plus MAX_SMALL, so they always take a stream.
UNARY_MAX_REPLY = MAX_SMALL
Handler = Callable[[str, Any], Awaitable[Message]]


@dataclass(frozen=True)
class WithTrailer:
    """A handler's reply followed by raw bulk bytes (a state blob) that the signed reply vouches
    for, by a digest it carries: bulk data skips the envelope's copy and signature."""

    reply: Message
    trailer: bytes
    # Called once the trailer is written, or once it cannot be (the stream failed, timed out): a
    # handler that bounds its bulk uploads (see `peer.state_serving`) frees the slot here.
    release: Callable[[], None] | None = None


@dataclass(frozen=True)
class Presealed:
    """A reply the handler sealed once and serves as-is to every requester (a large aggregate
    shard asked for by every peer): its nonce and time are those of its first sealing, which is
    fine as replies, unlike requests, are not checked for freshness (the request they answer is)."""

    data: bytes
    of: Any = field(default=None, compare=False)  # what was sealed (a cache checks it is still current)


def _hold(_: object) -> None:
    """A no-op whose partial keeps its argument alive until the partial is dropped."""


class Transport:
    """Typed, signed request/response between peers of one run over a `hivemind.P2P`."""

    def __init__(self, p2p: Any, identity: Identity, run_id: str, guard: Guard | None = None) -> None:
        harden_unary_calls(p2p)
        self.p2p = p2p
        self.identity = identity
        self.run_id = run_id
        self.guard = guard or Guard()  # shared by a node's transports: limits and bans are per peer
        self._lingering: OrderedDict[Any, str] = OrderedDict()  # answered streams' writers -> their peer
        self.rejected_replies: Counter[str] = Counter()  # bad replies to our requests, by reason
        self.local_failures: Counter[str] = Counter()  # requests that failed on our side, by exception type
        self.bytes_sent = 0
        self.trailer_bytes_sent = 0  # of `bytes_sent`: raw trailers (the state a joiner downloads)
        self.bytes_received = 0

    def _name(self, handler: str) -> str:
        return f"groundswell/{self.run_id}/{handler}/{PROTOCOL_VERSION}"

    def _linger(self, writer: Any, remote: str) -> None:
        """Count an answered stream as lingering; close the lingering streams past the bounds
        (`MAX_LINGERING_PER_PEER`: the peer's oldest; `MAX_LINGERING`: the oldest of the peer
        lingering most). Closing one ends its wait for the caller's EOF."""
        self._lingering[writer] = remote
        mine = [w for w, peer in self._lingering.items() if peer == remote]
        if len(mine) > MAX_LINGERING_PER_PEER:
            self._end_lingering(mine[0])
        if len(self._lingering) > MAX_LINGERING:
            most = Counter(self._lingering.values()).most_common(1)[0][0]
            self._end_lingering(next(w for w, peer in self._lingering.items() if peer == most))

    def _end_lingering(self, writer: Any) -> None:
        self._lingering.pop(writer, None)
        close_stream(writer)

    def _unary_name(self, handler: str) -> str:
        # its own protocol id: the daemon keeps one handler per id, and the stream one stays
        return self._name(handler) + "/unary"

    async def serve(self, handler: str, expect: Any, fn: Handler, max_request: int = MAX_SMALL,
                    timeout_s: float = 600.0, with_envelope: bool = False, trailer: bool = False,
                    admit: Callable[[str], str | None] | None = None) -> None:
        """Register `fn(sender, request) -> reply` for one request kind (`fn(sender, request,
        envelope)` with `with_envelope`: the verified signed bytes, to pass on), on a stream
        protocol and (without `trailer`) a unary one. With `trailer`, every reply is followed by
        one raw frame: `WithTrailer.trailer`, or empty. `admit(remote)`: why a peer may not send
        this request at all (checked before a byte of it is read), or None."""

        def refusal(remote: str, stream: bool = True) -> str | None:
            refused = self.guard.admit(remote, handler, stream)  # bans, floods, stream count
            if refused is None and admit is not None and (refused := admit(remote)) is not None:
                self.guard.release(remote, stream)
                self.guard.count(remote, handler, refused, strike=True)
            return refused

        async def answer(remote: str, data: bytes, opened: float) -> tuple[bytes, bytes, Callable[[], None] | None]:
            """The sealed reply, its trailer and the trailer's release (the caller's to call), for
            one request's bytes."""
            self.bytes_received += len(data) + _LEN.size
            received = time.time()  # all of the request is here: the clock sample's "now"
            stamps: list[float] = []

            def fresh(nonce: bytes, stamp: float) -> None:
                stamps.append(stamp)
                self.guard.check_fresh(nonce, stamp, opened)

            sender, request = unseal(data, self.run_id, expect, max_request, sender=remote, fresh=fresh)
            if stamps and len(data) <= SMALL_BODY and self.run_id:  # verified, and quick to arrive: a clock sample
                # (not on a node's run-less bootstrap transport: anyone may call its probes)
                self.guard.clock_offsets.note(sender, stamps[-1] - received)
            reply = await (fn(sender, request, data) if with_envelope else fn(sender, request))
            bulk, release = b"", None
            if isinstance(reply, WithTrailer):
                reply, bulk, release = reply.reply, reply.trailer, reply.release
            elif isinstance(reply, Presealed):
                # Held until written (the caller drops `release` then): a handler may share one
                # sealing between the streams sending it through a weak reference to it.
                release = functools.partial(_hold, reply)
            try:
                out = reply.data if isinstance(reply, Presealed) else seal(self.identity, self.run_id, reply)
            except BaseException:
                if release is not None:
                    release()
                raise
            return out, bulk, release  # (counted in bytes_sent once written: a reply that fails is not sent)

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            remote = info.peer_id.to_base58()
            opened = time.time()
            refused = refusal(remote)  # before a byte is read
            if refused is not None:
                writer.close()
                self._log_rejection(handler, refused, remote, "")
                return
            release, reserved, admitted = None, 0, True

            async def admit_body(size: int) -> None:
                """Book a `size`-byte body in the node's inbound budget (see `read_frame_paced`)."""
                nonlocal reserved
                if size <= SMALL_BODY:  # control messages are not counted
                    return
                full = await self.guard.room_for(remote, size, max_request + 512, ROOM_WAIT_S)
                if full is not None:
                    raise ProtocolError(f"no room for a {size}-byte request", reason=full, strike=False)
                reserved = size

            try:
                ends = asyncio.get_running_loop().time() + timeout_s  # (the trailer's pace is held to it)
                async with asyncio.timeout(timeout_s):
                    try:
                        request = await read_frame_paced(reader, max_request + 512, min(timeout_s, REQUEST_START_S),
                                                         admit_body, MIN_BODY_RATE, BODY_STALL_S)
                        out, bulk, release = await answer(remote, request, opened)
                    finally:
                        self.guard.release_bytes(remote, reserved)
                    # (a large reply, an aggregate shard, is held to the trailers' pace: a caller
                    # reading it a trickle at a time held its request slot for the handler's whole
                    # timeout, and 32 identities of 32 streams each held all 1,024; a review)
                    await write_frame_paced(writer, out, ends - asyncio.get_running_loop().time())
                    self.bytes_sent += len(out) + _LEN.size
                    if trailer:
                        await write_frame_paced(writer, bulk, ends - asyncio.get_running_loop().time())
                        self.bytes_sent += len(bulk) + _LEN.size
                        self.trailer_bytes_sent += len(bulk) + _LEN.size
                    if release is not None:  # written: the slot is free, whenever the caller hangs up
                        release()
                        release = None
                    out = bulk = b""  # (a shared sealing is freed once every stream has written it)
                    self.guard.release(remote)  # answered: its request slot is free (see MAX_LINGERING)
                    admitted = False
                    # Keep our end open until the caller closes its own: p2pd resets a stream whose
                    # handler hangs up first, and the reset drops the reply's tail still buffered
                    # in the caller's daemon (a slow reader then sees a truncated reply).
                    self._linger(writer, remote)
                    async with asyncio.timeout(LINGER_S):
                        await read_until_eof(reader)
            except ProtocolError as exc:
                self.guard.reject(remote, handler, exc)
                self._log_rejection(handler, exc.reason, remote, str(exc))
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                log.debug("%s request from %s ended early: %r", handler, remote[-8:], exc)
            except Exception:  # a bug some request found: logged here, not left to hivemind's callback
                log.exception("%s handler failed on a request from %s", handler, remote[-8:])
            finally:
                if release is not None:
                    release()
                if admitted:
                    self.guard.release(remote)
                self._lingering.pop(writer, None)
                close_stream(writer)  # without this the caller's read never sees EOF

        async def on_unary(data: bytes, remote_id: Any) -> bytes:
            # The same checks as a stream; a refusal raises, which the caller sees as an answerless
            # end (`PeerGone`), as a stream closed unanswered. Whatever happens, this returns or
            # raises `Refused`: hivemind forgets a handler task only when it ends that way (one that
            # ends cancelled, because its caller gave up, would stay in its table for good).
            remote = remote_id.to_base58()
            opened = time.time()
            refused = refusal(remote, stream=False)
            if refused is not None:
                self._log_rejection(handler, refused, remote, "")
                raise Refused(refused)
            try:
                async with asyncio.timeout(timeout_s):
                    if len(data) > min(max_request + 512, UNARY_MAX_REQUEST):
                        # An honest caller sends a bigger request on a stream, where its bytes are
                        # booked against the inbound budget; a unary call's are not (the daemon
                        # caps them at 4 MiB), so a review held 256 MiB of them from 4 identities.
                        raise ProtocolError(f"a unary request of {len(data)} bytes exceeds the limit", reason="oversized")
                    out, _, release = await answer(remote, data, opened)
                    if release is not None:  # no trailer goes with a unary reply
                        release()
                    if len(out) > UNARY_MAX_REPLY + 512:
                        # Honest callers ask on a stream when the reply may be this big; handed to
                        # the daemon it would be copied whole before being dropped as oversized.
                        raise ProtocolError(f"a reply of {len(out)} bytes is too big for a unary call",
                                            reason="unary-oversized", strike=False)
                    self.bytes_sent += len(out) + _LEN.size  # (handed to the daemon, which sends it)
                    return out
            except ProtocolError as exc:
                self.guard.reject(remote, handler, exc)
                self._log_rejection(handler, exc.reason, remote, str(exc))
                raise Refused(exc.reason) from None
            except asyncio.CancelledError:  # the caller gave up (its stream is gone), or we are closing
                raise Refused("cancelled") from None
            except (TimeoutError, ConnectionError) as exc:
                log.debug("%s request from %s ended early: %r", handler, remote[-8:], exc)
                raise Refused("ended early") from None
            except Exception:
                log.exception("%s handler failed on a request from %s", handler, remote[-8:])
                raise Refused("internal error") from None
            finally:
                self.guard.release(remote, stream=False)

        await self.p2p.add_binary_stream_handler(self._name(handler), on_stream)
        client = getattr(self.p2p, "_client", None)  # hivemind's daemon client; absent in in-process fakes
        if not trailer and client is not None:
            await client.add_unary_handler(self._unary_name(handler), on_unary)

    @property
    def rejected(self) -> Counter[str]:
        """Refused inbound requests, as "reason:handler" -> count (shared with the node's other transports)."""
        return self.guard.rejected

    def _log_rejection(self, handler: str, reason: str, remote: str, detail: str) -> None:
        # one clear line per (handler, reason) class the first time, then every 100th: a flood
        # must not turn into a flood of log lines
        n = self.guard.rejected[f"{reason}:{handler}"]
        if n == 1 or n % 100 == 0:
            # a request for a round ahead of ours is what a peer still catching up (a joiner) gets
            # as a matter of course: said, but not as a warning
            (log.info if reason == "future-round" else log.warning)(
                "rejected %s request from %s (%s, %d so far): %s", handler, remote[-8:], reason, n, detail)

    async def request(self, peer_id: str, handler: str, msg: Message, expect: Any, *, timeout_s: float,
                      max_reply: int = MAX_SMALL, unary: bool = True, progress: SendProgress | None = None) -> Any:
        """Send one request and return the verified reply; `PeerUnavailable` on any failure.

        `unary=False` keeps a small request on a stream: for one whose effect must not depend on
        the caller still listening. A unary call whose caller gave up while the request still
        waited in the receiver's socket is dropped before its handler runs (hivemind cancels the
        handler task as it reads the cancel); a stream's request that arrived is still handled.
        `progress` (a stream's request only): kept up to date as the request goes out."""
        if progress is not None:
            reply, _ = await self._request_stream(peer_id, handler, msg, None, expect, timeout_s, max_reply, None,
                                                  progress=progress)
            return reply
        reply, _ = await self._request(peer_id, handler, msg, expect, timeout_s, max_reply, unary=unary)
        return reply

    async def request_bulk(self, peer_id: str, handler: str, msg: Message, expect: Any, *, timeout_s: float,
                           trailer_size: Callable[[Any], int], max_reply: int = MAX_SMALL,
                           remote: dict[str, str] | None = None,
                           trailer_timeout_s: Callable[[int], float] | None = None) -> tuple[Any, bytearray, str]:
        """`request` to a handler served with `trailer`: the verified reply, the raw bytes after
        it, whose length must be `trailer_size(reply)` (checked before they are read), and their
        BLAKE3 digest (hex, computed while they arrive). The caller checks them against the reply.
        `remote`: filled with the stream's remote multiaddr ("addr"), where the peer was reached.
        `trailer_timeout_s(size)`: how long the trailer may then take (else `timeout_s` bounds
        reply and trailer together), so that a short `timeout_s` bounds a peer that never replies."""
        hasher = bulk_hasher()
        reply, bulk = await self._request_stream(peer_id, handler, msg, None, expect, timeout_s, max_reply,
                                                 trailer_size, hasher, remote, trailer_timeout_s)
        return reply, bulk, hasher.hexdigest()

    def _unary_client(self, max_reply: int) -> Any:
        """hivemind's daemon client when a request may be a unary call, else None."""
        if max_reply > UNARY_MAX_REPLY:
            return None
        return getattr(self.p2p, "_client", None)

    async def _request(self, peer_id: str, handler: str, msg: Message, expect: Any, timeout_s: float,
                       max_reply: int, unary: bool = True) -> tuple[Any, bytearray]:
        client = self._unary_client(max_reply) if unary else None
        data = None
        if client is not None:
            data = seal(self.identity, self.run_id, msg)
            if len(data) <= UNARY_MAX_REQUEST:
                return await self._request_unary(client, peer_id, handler, data, expect, timeout_s, max_reply), bytearray()
        return await self._request_stream(peer_id, handler, msg, data, expect, timeout_s, max_reply, None)

    async def _request_unary(self, client: Any, peer_id: str, handler: str, data: bytes, expect: Any,
                             timeout_s: float, max_reply: int) -> Any:
        """One request as a unary call; failures map to the same errors as on a stream."""
        target = target_peer_id(peer_id, handler)
        with self._failures(peer_id, handler, timeout_s, dial_failed):
            async with asyncio.timeout(timeout_s):
                try:
                    reply = await client.call_unary_handler(target, self._unary_name(handler), data)
                except BaseException as exc:  # sent unless no connection could be made (nothing went out)
                    if not (isinstance(exc, Exception) and dial_failed(exc)):
                        self.bytes_sent += len(data) + _LEN.size
                    raise
                self.bytes_sent += len(data) + _LEN.size
                if len(reply) > max_reply + 512:
                    raise ProtocolError(f"reply of {len(reply)} bytes exceeds the limit", reason="oversized")
                self.bytes_received += len(reply) + _LEN.size
                return unseal(reply, self.run_id, expect, max_reply, sender=peer_id)[1]

    @contextlib.contextmanager
    def _failures(self, peer_id: str, handler: str, timeout_s: float,
                  dead: Callable[[BaseException], bool]) -> Iterator[None]:
        """Map a request's failures to `PeerUnavailable`: a bad reply (counted), a timeout, or the
        peer gone (`PeerDead` where `dead(exc)`: nothing could be opened, else `PeerGone`). Any
        other error (our daemon's socket gone, a bug of ours) is plain `PeerUnavailable`, logged
        with its traceback: it says nothing of the peer, so it must not take a grant from it."""
        started = time.monotonic()
        try:
            yield
        except ProtocolError as exc:
            self.rejected_replies[f"{exc.reason}:{handler}"] += 1
            raise PeerUnavailable(f"{peer_id[-8:]} sent a bad {handler} reply: {exc}") from None
        except TimeoutError:
            # the time it took, not `timeout_s`: a bulk trailer gets a timeout of its own
            raise RequestTimedOut(f"{peer_id[-8:]} did not answer {handler} within "
                                  f"{max(timeout_s, time.monotonic() - started):.1f}s") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure of a request is the caller's PeerUnavailable
            # the text may come from the other side: keep it short
            if dead(exc):
                raise PeerDead(f"{peer_id[-8:]} unavailable for {handler}: {exc!r:.200}") from None
            if remote_failure(exc):  # resets, EOF, refusals
                raise PeerGone(f"{peer_id[-8:]} unavailable for {handler}: {exc!r:.200}") from None
            kind = type(exc).__qualname__
            if kind not in self.local_failures:  # its traceback once (every request may fail alike)
                log.warning("%s request to %s failed on our side", handler, peer_id[-8:], exc_info=True)
            self.local_failures[kind] += 1
            raise PeerUnavailable(f"{handler} request to {peer_id[-8:]} failed on our side: {exc!r:.200}") from None

    async def _request_stream(self, peer_id: str, handler: str, msg: Message, sealed: bytes | None, expect: Any,
                              timeout_s: float, max_reply: int, trailer_size: Callable[[Any], int] | None,
                              hasher: Any = None, remote: dict[str, str] | None = None,
                              trailer_timeout_s: Callable[[int], float] | None = None,
                              progress: SendProgress | None = None) -> tuple[Any, bytearray]:
        """One request on its own stream (`sealed`: the request already sealed, else sealed here)."""
        target = target_peer_id(peer_id, handler)
        writer = None
        opened = False
        try:
            with self._failures(peer_id, handler, timeout_s, lambda exc: not opened and dial_failed(exc)):
                async with asyncio.timeout(timeout_s) as scope:
                    info, reader, writer = await self.p2p.call_binary_stream_handler(
                        target, self._name(handler)
                    )
                    opened = True
                    if progress is not None:
                        progress.opened = time.monotonic()
                    if remote is not None:
                        remote["addr"] = str(getattr(info, "addr", ""))
                    data = sealed if sealed is not None else seal(self.identity, self.run_id, msg)
                    await write_frame(writer, data, progress)
                    self.bytes_sent += len(data) + _LEN.size
                    reply = await read_frame(reader, max_reply + 512)
                    self.bytes_received += len(reply) + _LEN.size
                    _, decoded = unseal(reply, self.run_id, expect, max_reply, sender=peer_id)
                    bulk = bytearray()
                    if trailer_size is not None:
                        size = trailer_size(decoded)
                        if trailer_timeout_s is not None:
                            scope.reschedule(asyncio.get_running_loop().time() + trailer_timeout_s(size))
                        # (a server that stops sending costs TRAILER_STALL_S, not the trailer's whole time)
                        bulk = await read_frame_into(reader, size, hasher=hasher, stall_s=TRAILER_STALL_S)
                        if len(bulk) != size:
                            raise ProtocolError(f"{len(bulk)} trailing bytes, the reply announced {size}")
                        self.bytes_received += size + _LEN.size
                    return decoded, bulk
        finally:
            if writer is not None:
                close_stream(writer)
