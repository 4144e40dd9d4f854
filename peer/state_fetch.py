"""How a joiner fetches the global state from one peer: the signed reply over the libp2p stream,
the blob sealed over a direct TCP connection when the peer offers one and we reach it, else
as the reply's trailer. Verification of what arrives is `state_trust`'s."""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any

from groundswell.protocol.direct import KEY_BYTES, TOKEN_BYTES, fetch_direct, wire_size
from groundswell.protocol.schema import ProtocolError, StateReply, StateRequest
from groundswell.protocol.transport import RequestTimedOut

from .dht_rejoin import LOOPBACK
from .holepunch import punchable

# What the direct attempt leaves of the per-server time for the stream, should it fail: the
# blob at this rate plus a margin. (A server that trickles a piece just inside the stall bound
# was never "stalled", and used to spend the whole budget: the fallback never ran.)
FALLBACK_RATE = 20e6
FALLBACK_MARGIN_S = 10.0

log = logging.getLogger(__name__)


def direct_host(maddr: str, loopback_run: bool = True) -> str | None:
    """The IP of a stream's remote multiaddr if it is a direct TCP one to another machine (None:
    relayed, not TCP, or one we must not dial). A loopback address is taken only in a run on
    127.0.0.1 (`loopback_run`): elsewhere it is a connection our hole punch forwarded to our own
    daemon, and a hostile peer's reply would have us send its token bytes to any port of this
    machine (a Redis, say)."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if not (punchable(str(ip)) or (loopback_run and ip.is_loopback)):
        return None
    return str(ip)


def _loopback_run(node: Any) -> bool:
    """Whether the run's peers are dialled on 127.0.0.1 (a simulation; see `dialable_scopes`)."""
    return LOOPBACK in getattr(getattr(node, "rejoiner", None), "scopes", ())


async def fetch_state(node: Any, peer: str, min_round: int, size: Callable[[StateReply], int], timeout_s: float,
                      reply_timeout_s: float | None = None) -> tuple[StateReply, bytearray | memoryview, str, str]:
    """`peer`'s state reply, its blob, the blob's BLAKE3 digest and how it came: "direct" or
    "stream" (over the stream the digest is computed as the blob arrives; over the direct
    connection the blob is authenticated by its sealing, and the digest is the signed one).
    `size(reply)` returns the announced size or raises ProtocolError (too large); it runs before
    a byte of the blob is read. All steps share `timeout_s`; the signed reply must come within
    `reply_timeout_s` (a peer that never answers costs that much, not the whole download's time).
    `node` is a `SwarmNode`.

    The direct connection itself is not authenticated (the IP may reach someone else's port, or the
    path may alter bytes; the sealing catches both), so whatever goes wrong on it is never held
    against `peer`: a blob that fails to open, or is not its size, is fetched again over the
    stream."""
    t = node.transport
    assert t is not None
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            # (a timeout, as the transport's: the time ran out, nothing stalled; see `download_state`)
            raise RequestTimedOut(f"{peer[-8:]}: no state within {timeout_s:.0f}s")
        return remaining

    def reply_within() -> float:
        return min(left(), reply_timeout_s) if reply_timeout_s is not None else left()

    def blob_within(_size: int) -> float:  # the reply came: the rest of the budget is the blob's
        return max(0.0, deadline - time.monotonic())

    def trailer(r: StateReply) -> int:
        announced = size(r)  # the budget check comes first, whichever way the blob comes
        return 0 if r.direct_port else announced

    remote: dict[str, str] = {}
    reply, blob, digest = await t.request_bulk(peer, "get-state", StateRequest(min_round, direct=True), StateReply,
                                               timeout_s=reply_within(), trailer_size=trailer, remote=remote,
                                               trailer_timeout_s=blob_within)
    if not reply.direct_port or not reply.size:
        return reply, blob, digest, "stream"
    host = direct_host(remote.get("addr", ""), _loopback_run(node))
    if (len(reply.direct_token), len(reply.direct_key)) != (TOKEN_BYTES, KEY_BYTES):
        # A signed offer no honest server makes (the schema bounds both at 32 bytes, not to 32):
        # counted against the peer, and the blob taken over the stream.
        t.guard.count(peer, "get-state", "bad-ticket", strike=True)
        log.info("%s offered a direct download with a %d-byte token and a %d-byte key: using the stream",
                 peer[-8:], len(reply.direct_token), len(reply.direct_key))
        host = None
    if host is not None:
        try:
            blob = await fetch_direct(host, reply.direct_port, reply.direct_token, reply.direct_key, reply.size,
                                      timeout_s=direct_time(left(), reply.size))
            node.direct_received += wire_size(reply.size)
            # Opened under a key only `peer` and we hold: these are the bytes `peer` sealed for us,
            # so its signed digest stands for them (a second pass to hash them would prove nothing
            # more; the caller still checks the state against the swarm).
            return reply, blob, reply.digest, "direct"
        except (ProtocolError, OSError, TimeoutError) as exc:  # firewalled, NAT'ed, gone, not that peer, altered
            log.info("direct state download from %s failed (%r): using the stream", peer[-8:], exc)
    reply, blob, digest = await t.request_bulk(peer, "get-state", StateRequest(min_round), StateReply,
                                               timeout_s=reply_within(), trailer_size=size, trailer_timeout_s=blob_within)
    return reply, blob, digest, "stream"


def direct_time(left_s: float, size: int) -> float:
    """Seconds the direct download of a `size`-byte blob may take, of `left_s`: what the stream
    would need after it, were it to fail, stays unspent (at least a tenth of what is left goes
    to the direct try)."""
    return max(left_s / 10, left_s - (size / FALLBACK_RATE + FALLBACK_MARGIN_S))
