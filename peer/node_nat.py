"""How a node is reached and reaches NAT'ed peers: its libp2p daemon's start (with its bootstrap
peers, or without them when none is reached), its reachability as the bootstrap peers' (or the
run's proven peers') dial-backs find it, the relays it may hold a reservation at, the dial-backs
it answers for others, relayed connections, and which punch requesters are NAT'ed members of its
run. `SwarmNode` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from groundswell.protocol.schema import PeerRecord, ProbeReply, ProbeRequest
from groundswell.protocol.transport import Transport

from .daemon import adopt_p2pd_daemons, reap_daemons
from .dht_entry import dial_known
from .dht_rejoin import address_scope, listen_scopes
from .net_errors import NetworkError
from .node_options import NodeOptions
from .reachability import (
    DialBack,
    busy_listen_address,
    connect_via_relay,
    connection_paths,
    find_reachability,
    observed_ips,
)

log = logging.getLogger(__name__)
MEMBERS_REFRESH_S = 5.0  # a rendezvous re-reads the run's records for an unknown punch requester at most this often


class NatTraversal:
    """The reachability half of `SwarmNode`; needs its options, p2p, maddrs, bootstrap transport,
    ctx, cached records and refresh_records()."""

    options: NodeOptions
    identity: Any  # Identity
    identity_path: str | None
    guard: Any  # Guard
    p2p: Any
    maddrs: list[str]
    bootstrap_transport: Any
    ctx: Any
    _cached_records: dict[str, PeerRecord]
    _members_lock: asyncio.Lock
    _members_refreshed: float
    _dial_back: DialBack
    entered_through: list[str]  # proven peers dialled in place of bootstrap peers that were down
    rejoiner: Any  # DhtRejoiner: the run's proven peers
    _bootstrap_silent: bool  # our bootstrap peers, connected, gave no probe verdict (frozen?)
    bootstrap_down: bool  # p2pd reached none of our bootstrap peers
    _start_by: float  # monotonic time the node's start gives up at

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

    async def _check_listen_addresses(self, wait_s: float = 5.0) -> None:
        """NetworkError if a fixed listen port is taken for longer than `wait_s` (a daemon of
        this peer's previous process, killed a moment ago, may still hold it) or an IP is not ours."""
        deadline = time.monotonic() + wait_s
        while (busy := busy_listen_address(self.options.host_maddrs)) is not None:
            if "already in use" not in busy or time.monotonic() >= deadline:
                raise NetworkError(busy)
            await asyncio.sleep(0.25)

    async def _create_p2p(self, p2p_class: Any, reachability: str | None) -> Any:
        """Start the libp2p daemon; `reachability` ("public"/"private", None: let AutoNAT guess)
        is what AutoNAT is told. Behind a NAT the node holds a relay reservation (its bootstrap
        peers are the trusted relays) so that others can still open a stream to it, unless its
        options say it needs none (`relay_slot`: a passing reader's node)."""
        adopt_p2pd_daemons()  # Ctrl+C reaches us, not the daemon; it still ends with us (Linux)
        relayed = reachability != "public" and self.options.relay_slot
        bootstrap = [] if self.bootstrap_down else list(self.options.initial_peers)
        try:
            p2p = await self._create_daemon(p2p_class, reachability, bootstrap, relayed)
        except Exception as exc:  # (hivemind's P2PDaemonError)
            # p2pd exits when it reaches none of its bootstrap peers (refused at once; a silent
            # address outlasts hivemind's 15 s start-up wait): started without them, the node
            # enters the DHT through the run's proven peers instead (`dht_entry.enter_run_dht`)
            unreached = "failed to connect to bootstrap peers" in str(exc) or "Daemon failed to start in" in str(exc)
            if not (bootstrap and unreached and self.rejoiner.proven_targets()):
                raise
            log.warning("p2pd reached none of the bootstrap peers (%s): starting without them", exc)
            await reap_daemons()
            self.bootstrap_down = True
            p2p = await self._create_daemon(p2p_class, reachability, [], relayed)
        self.p2p = p2p
        self.maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        if not (self.options.initial_peers or self.options.announce_maddrs):  # (see `listen_scopes`)
            self.rejoiner.scopes = listen_scopes(self.options.host_maddrs, self.maddrs)
        self.bootstrap_transport = Transport(p2p, self.identity, "", self.guard)
        return p2p

    async def _create_daemon(self, p2p_class: Any, reachability: str | None, bootstrap: list[str], relayed: bool) -> Any:
        """hivemind's P2P: our daemon, bootstrapped from `bootstrap`, with relays if `relayed`."""
        return await p2p_class.create(
            initial_peers=bootstrap or None,
            host_maddrs=list(self.options.host_maddrs),
            announce_maddrs=list(self.options.announce_maddrs) or None,
            identity_path=self.identity_path,
            check_if_identity_free=False,  # hivemind's check assumes RSA identity files
            nat_port_map=False,  # UPnP probes the LAN; never on by default
            use_auto_relay=relayed,
            trusted_relays=self._relay_candidates() if relayed else None,
            force_reachability=reachability,
        )

    async def _find_reachability(self) -> str:
        """"public" or "private" as our bootstrap peers' dial-backs find us (`find_reachability`);
        with those down or silent, the run's proven peers (two of them must find us reachable:
        any contributor is one, and a NAT'ed peer that takes itself for public takes roles nobody
        reaches)."""
        if self.options.reachability != "auto":
            return self.options.reachability
        maddrs, coordinator = self.maddrs[:8], self.options.coordinator
        by = self._start_by - 20.0  # what is left then: the DHT's entry, through the proven peers if need be
        if self.bootstrap_down:  # the proven peers we connected to, if any (none to ask: no verdict)
            verdict = await find_reachability(self.bootstrap_transport, maddrs, self.entered_through, coordinator,
                                              public_needs=2, unknown=None, give_up_at=by) if self.entered_through else None
        else:
            verdict = await find_reachability(self.bootstrap_transport, maddrs, self._bootstrap_ids(), coordinator,
                                              unknown=None, give_up_at=by)
            boot = set(self._bootstrap_ids())  # (a frozen coordinator, seen at other addresses too, is no prober)
            others = [(pid, addrs) for pid, addrs in self.rejoiner.proven_targets() if pid not in boot]
            if verdict is None and others:
                self._bootstrap_silent = True  # (their DHT is then asked with the proven peers: dht_entry.enter_run_dht)
                if time.monotonic() + 2.0 < by:  # (time left to ask them)
                    proven = await dial_known(self.p2p, others)
                    verdict = await find_reachability(self.bootstrap_transport, maddrs, proven, coordinator,
                                                      public_needs=2, unknown=None, give_up_at=by) if proven else None
        if verdict is None:
            log.warning("reachability unknown: no verdict from our dial-back probes; taking ourselves for "
                        "private (start with --reachability public if others can connect to us)")
        return verdict or "private"

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
