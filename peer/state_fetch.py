"""How a joiner fetches the global state from one peer: the signed reply over the libp2p stream,
the blob over a direct TCP connection when the peer offers one (open runs) and we reach it,
else as the reply's trailer. Verification of what arrives is the caller's (`Participant`)."""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any

from groundswell.protocol.digests import bulk_hasher
from groundswell.protocol.direct import fetch_direct
from groundswell.protocol.schema import ProtocolError, StateReply, StateRequest
from groundswell.protocol.transport import PeerUnavailable

log = logging.getLogger(__name__)


def direct_host(maddr: str) -> str | None:
    """The IP of a stream's remote multiaddr if it is a direct TCP one (None: relayed, or not TCP)."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


async def fetch_state(node: Any, peer: str, min_round: int, size: Callable[[StateReply], int], timeout_s: float
                      ) -> tuple[StateReply, bytearray | memoryview, str, str]:
    """`peer`'s state reply, its blob, the blob's BLAKE3 digest (computed as it arrives) and how it
    came: "direct" or "stream". `size(reply)` returns the announced size or raises ProtocolError
    (too large); it runs before a byte of the blob is read. All steps share `timeout_s`. `node`
    is a `SwarmNode`.

    Nothing authenticates the direct connection (the IP may reach someone else's port, or the
    path may alter bytes), so whatever goes wrong on it is never held against `peer`: a blob that
    is not the one the signed reply vouches for, or not its size, is fetched again over the stream."""
    t = node.transport
    assert t is not None
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerUnavailable(f"{peer[-8:]}: no state within {timeout_s:.0f}s")
        return remaining

    def trailer(r: StateReply) -> int:
        announced = size(r)  # the budget check comes first, whichever way the blob comes
        return 0 if r.direct_port else announced

    remote: dict[str, str] = {}
    reply, blob, digest = await t.request_bulk(peer, "get-state", StateRequest(min_round, direct=True), StateReply,
                                               timeout_s=left(), trailer_size=trailer, remote=remote)
    if not reply.direct_port or not reply.size:
        return reply, blob, digest, "stream"
    host = direct_host(remote.get("addr", ""))
    if host is not None:
        hasher = bulk_hasher(threads=True)  # pieces of 8 MiB: every core helps
        try:
            blob = await fetch_direct(host, reply.direct_port, reply.direct_token, reply.size, hasher=hasher,
                                      timeout_s=left())
            if hasher.hexdigest() == reply.digest:
                return reply, blob, reply.digest, "direct"
            log.warning("the direct state download from %s failed its hash check: using the stream", peer[-8:])
        except (ProtocolError, OSError, TimeoutError) as exc:  # firewalled, NAT'ed, gone, or not that peer
            log.info("direct state download from %s failed (%r): using the stream", peer[-8:], exc)
    reply, blob, digest = await t.request_bulk(peer, "get-state", StateRequest(min_round), StateReply,
                                               timeout_s=left(), trailer_size=size)
    return reply, blob, digest, "stream"
