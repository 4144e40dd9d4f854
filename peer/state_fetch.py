"""How a joiner fetches the global state from one peer: the signed reply over the libp2p stream,
the blob over a direct TCP connection when the peer offers one (open runs) and we reach it,
else as the reply's trailer. Verification of what arrives is the caller's (`Participant`)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from groundswell.protocol.digests import bulk_hasher
from groundswell.protocol.direct import fetch_direct
from groundswell.protocol.schema import ProtocolError, StateReply, StateRequest

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
    (too large); it runs before a byte of the blob is read. `node` is a `SwarmNode`."""
    t = node.transport
    assert t is not None

    def trailer(r: StateReply) -> int:
        announced = size(r)  # the budget check comes first, whichever way the blob comes
        return 0 if r.direct_port else announced

    remote: dict[str, str] = {}
    reply, blob, digest = await t.request_bulk(peer, "get-state", StateRequest(min_round, direct=True), StateReply,
                                               timeout_s=timeout_s, trailer_size=trailer, remote=remote)
    if not reply.direct_port or not reply.size:
        return reply, blob, digest, "stream"
    host = direct_host(remote.get("addr", ""))
    if host is not None:
        hasher = bulk_hasher(threads=True)  # pieces of 8 MiB: every core helps
        try:
            blob = await fetch_direct(host, reply.direct_port, reply.direct_token, reply.size, hasher=hasher,
                                      timeout_s=timeout_s)
            return reply, blob, hasher.hexdigest(), "direct"
        except ProtocolError as exc:  # it sent more than it announced: count it, then use the stream
            node.guard.count(peer, "state-direct", exc.reason, strike=exc.strike)
            log.warning("direct state download from %s refused: %s", peer[-8:], exc)
        except (OSError, TimeoutError) as exc:  # firewalled, NAT'ed, or gone: the stream still works
            log.info("direct state download from %s failed (%r): using the stream", peer[-8:], exc)
    reply, blob, digest = await t.request_bulk(peer, "get-state", StateRequest(min_round), StateReply,
                                               timeout_s=timeout_s, trailer_size=size)
    return reply, blob, digest, "stream"
