"""How a node is reached and reaches NAT'ed peers: its reachability as the bootstrap peers'
dial-backs find it, the relays it may hold a reservation at, the dial-backs it answers for
others, relayed connections, and which punch requesters are NAT'ed members of its run.
`SwarmNode` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from groundswell.protocol.schema import PeerRecord, ProbeReply, ProbeRequest

from .dht_rejoin import address_scope
from .node_options import NodeOptions
from .reachability import DialBack, connect_via_relay, connection_paths, find_reachability, observed_ips

log = logging.getLogger(__name__)
MEMBERS_REFRESH_S = 5.0  # a rendezvous re-reads the run's records for an unknown punch requester at most this often


class NatTraversal:
    """The reachability half of `SwarmNode`; needs its options, p2p, maddrs, bootstrap transport,
    ctx, cached records and refresh_records()."""

    options: NodeOptions
    p2p: Any
    maddrs: list[str]
    bootstrap_transport: Any
    ctx: Any
    _cached_records: dict[str, PeerRecord]
    _members_lock: asyncio.Lock
    _members_refreshed: float
    _dial_back: DialBack

    refresh_records: Callable[[], Awaitable[dict[str, PeerRecord]]]  # PeerRecords.refresh_records
    _bootstrap_ids: Callable[[], list[str]]  # SwarmNode._bootstrap_ids

    def _relay_candidates(self) -> list[str]:
        """One address per bootstrap peer: autorelay's static relays (see `static_relay_args`).
        It waits for as many candidates as it is given, and counts them by peer, not address."""
        seen: dict[str, str] = {}
        for maddr in self.options.initial_peers:
            if "/p2p/" in maddr and "/p2p-circuit" not in maddr:  # a peer behind a relay is no relay itself
                seen.setdefault(maddr.rsplit("/p2p/", 1)[-1], maddr)
        return list(seen.values())

    async def _find_reachability(self) -> str:
        """"public" or "private" as our bootstrap peers' dial-backs find us (`find_reachability`)."""
        if self.options.reachability != "auto":
            return self.options.reachability
        return await find_reachability(self.bootstrap_transport, self.maddrs[:8], self._bootstrap_ids(),
                                       self.options.coordinator)

    async def _nated_members(self, ids: tuple[str, ...]) -> bool:
        """Are all `ids` NAT'ed peers of our run? Our cached records, refreshed (at most every
        MEMBERS_REFRESH_S) when they do not know one of them yet."""
        def known() -> bool:
            records = self._cached_records
            return all(i in records and records[i].reachability == "private" for i in ids)

        if self.ctx is None:  # not in a run (yet)
            return False
        if known():
            return True
        async with self._members_lock:  # requests arriving together wait for one refresh, then look again
            if known():
                return True
            if time.monotonic() - self._members_refreshed < MEMBERS_REFRESH_S:
                return False
            self._members_refreshed = time.monotonic()
            try:
                await self.refresh_records()
            except Exception as exc:  # a DHT hiccup: refuse now, the punch is retried later
                log.info("refreshing peer records for a punch request failed: %r", exc)
                return False
            return known()

    async def _on_probe(self, sender: str, msg: ProbeRequest) -> ProbeReply:
        """Dial the requester back, at the IPs it is connected to us from and nowhere else."""
        if self._dial_back.busy(sender):  # before asking the daemon for its connections
            return ProbeReply(False, "rate limited")
        observed = observed_ips(await self.p2p.list_peers(), sender)
        scopes = getattr(getattr(self, "rejoiner", None), "scopes", None)
        if scopes is not None:
            # Only where the run's peers may dial (a review): a volunteer on our machine or in our
            # VPC, connected from 127.0.0.1 or 10.x, was judged public in a public run whose peers
            # cannot reach it there, and took roles; and behind a tunnel every requester comes from
            # 127.0.0.1, so probes scanned this machine's own ports.
            observed = {ip for ip in observed if ip_scope(ip) in scopes}
        return await self._dial_back.handle(sender, msg, observed)

    async def connect_via_relay(self, target: str, relay_maddr: str) -> None:
        """Open a libp2p connection to `target` through the relay at `relay_maddr` (…/p2p/<relay>);
        raises if the relay holds no reservation for it yet (see `reachability.connect_via_relay`)."""
        await connect_via_relay(self.p2p, target, relay_maddr)

    async def connections(self) -> dict[str, str]:
        """Peers this node has open libp2p connections to, and whether "direct" or via "relay"."""
        return connection_paths(await self.p2p.list_peers())


def ip_scope(ip: str) -> str | None:
    """`address_scope` of a bare IP address (as `observed_ips` gives them)."""
    return address_scope(f"/ip{6 if ':' in ip else 4}/{ip}/tcp/1")
