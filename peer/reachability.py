"""Is this peer reachable from the internet? A dial-back probe, and the libp2p paths in use.

A volunteer asks a bootstrap peer to open a plain TCP connection to the addresses it listens on
(nothing is sent; the connection is closed at once). If none accepts, the peer is behind a NAT
or a firewall: it then never serves (no aggregator or leader role needs inbound connections from
it), keeps its DHT node in client mode, restarts its daemon telling AutoNAT it is private (so
that autorelay reserves a slot, within seconds), and relies on that relay (the bootstrap
peers, the coordinator first, are its trusted relays) for the rare stream another peer opens to it.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import itertools
import logging
import math
import socket
import time
from collections.abc import Sequence
from typing import Any

from groundswell.protocol.schema import ProbeReply, ProbeRequest

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0  # for a whole probe, all its addresses together
PROBE_EVERY_S = 10.0  # one probe per sender per this many seconds: a prober is not a port scanner
MAX_TARGETS = 4
MAX_PROBES = 16  # probes under way at once, whoever asks: fresh identities are free, sockets are not


def tcp_targets(maddrs: list[str], allowed: set[str] | None = None) -> list[tuple[str, int]]:
    """The (host, port) pairs of plain TCP multiaddrs (only at `allowed` IPs, if given), loopback
    ones only if there is nothing else."""
    out: list[tuple[str, int]] = []
    for m in maddrs:
        parts = m.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
            continue
        try:
            host, port = ipaddress.ip_address(parts[2]), int(parts[4])
        except ValueError:
            continue
        if host.is_unspecified or host.is_multicast or not 0 < port < 65536:
            continue
        if allowed is not None and str(host) not in allowed:
            continue
        out.append((str(host), port))
    outside = [t for t in out if not ipaddress.ip_address(t[0]).is_loopback]
    return list(dict.fromkeys(outside or out))[:MAX_TARGETS]


def busy_listen_address(maddrs: Sequence[str]) -> str | None:
    """Why the node cannot listen on one of its plain TCP multiaddrs with a fixed port (the port is
    taken, or the IP is not this machine's), or None. go-libp2p binds with SO_REUSEPORT, so a second
    daemon of the same user on a busy port starts anyway and the kernel splits the port's
    connections between the two: a second `launch` on a running coordinator's port would take
    part of its volunteers. A plain bind (no SO_REUSEPORT) fails on such a port, so we try one."""
    for m in maddrs:
        parts = str(m).split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
            continue
        try:
            host, port = ipaddress.ip_address(parts[2]), int(parts[4])
        except ValueError:
            continue  # p2pd reports a malformed address in its own words
        if port == 0:
            continue
        family = socket.AF_INET6 if host.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as go does: TIME_WAIT is no obstacle
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((str(host), port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (f"TCP port {port} on {host} is already in use (another groundswell peer or "
                            f"coordinator on this machine?): stop it, or listen on another port")
                if exc.errno == errno.EADDRNOTAVAIL:
                    return f"cannot listen on {host}: it is not an address of this machine"
                return f"cannot listen on {host} port {port}: {exc.strerror or exc}"
    return None


def listen_host(maddrs: Sequence[str]) -> str | None:
    """The IP of the first plain TCP multiaddr a node listens on (0.0.0.0 included), or None;
    "::" when it listens on every address of both families (one dual-stack socket serves both)."""
    wildcards = {str(m).split("/")[2] for m in maddrs if str(m).count("/") >= 4}
    if {"0.0.0.0", "::"} <= wildcards:
        return "::"
    for m in maddrs:
        parts = str(m).split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and "p2p-circuit" not in parts:
            try:
                return str(ipaddress.ip_address(parts[2]))
            except ValueError:
                continue
    return None


class DialBack:
    """The prober's side: connect back to a requester's addresses, at a bounded rate."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._running = 0  # probes under way

    def busy(self, sender: str) -> bool:
        """Would a probe for `sender` be refused as "rate limited" now? It asked within
        PROBE_EVERY_S, or MAX_PROBES are under way (not charged to it: it may ask again at once).
        Cheap: checked before anything else is done for a request."""
        return (time.monotonic() - self._last.get(sender, -PROBE_EVERY_S) < PROBE_EVERY_S
                or self._running >= MAX_PROBES)

    async def handle(self, sender: str, msg: ProbeRequest, observed: set[str] | None = None) -> ProbeReply:
        """Dial the TCP addresses at once, for PROBE_TIMEOUT_S in all; the first that accepts a
        connection is the answer. `observed`: the IPs the requester is connected from; only those
        are dialed, so a probe cannot make this peer connect to a third party (behind a NAT none
        match: "private"). "rate limited" (ask another peer) when this sender asked within
        PROBE_EVERY_S or MAX_PROBES are under way."""
        now = time.monotonic()
        if self.busy(sender):
            return ProbeReply(False, "rate limited")
        self._last[sender] = now
        if len(self._last) > 4096:  # forget the oldest senders
            for key in sorted(self._last, key=self._last.get)[:2048]:  # type: ignore[arg-type]
                del self._last[key]
        async def dial(host: str, port: int) -> str | None:
            try:
                _, writer = await asyncio.open_connection(host, port)
            except OSError:
                return None
            writer.close()
            return f"{host}:{port}"

        # Filter before choosing: a volunteer on the coordinator's machine (connected from
        # 127.0.0.1) also lists its LAN address, which must not push its loopback one out.
        # All at once, one budget: in turn, ports that drop SYNs held a socket 3 s each (12 s).
        # The first to accept answers (the others are cancelled, and awaited: none is left behind).
        self._running += 1
        dials = [asyncio.ensure_future(dial(host, port)) for host, port in tcp_targets(msg.maddrs, observed)]
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                for done in asyncio.as_completed(dials):
                    if (reached := await done) is not None:
                        return ProbeReply(True, reached)
        except TimeoutError:
            pass
        finally:
            self._running -= 1  # first: a second cancellation in the await below must not leak it
            for task in dials:
                task.cancel()
            await asyncio.gather(*dials, return_exceptions=True)
        return ProbeReply(False, "")


def observed_ips(peer_infos: list[Any], peer_id: str) -> set[str]:
    """The IP addresses of our open connections to `peer_id`."""
    out = set()
    for info in peer_infos:
        if str(info.peer_id) == peer_id:
            for addr in getattr(info, "addrs", []):
                parts = str(addr).split("/")
                if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in parts:
                    out.add(str(ipaddress.ip_address(parts[2])))
    return out


def connection_paths(peer_infos: list[Any]) -> dict[str, str]:
    """peer id -> "relay" if every open connection to it goes through a relay, else "direct"."""
    paths: dict[str, str] = {}
    for info in peer_infos:  # one entry per connection: a peer may be listed more than once
        addrs = [str(a) for a in getattr(info, "addrs", [])]
        relayed = bool(addrs) and all("p2p-circuit" in a for a in addrs)
        peer = str(info.peer_id)
        if paths.get(peer) != "direct":  # any direct connection makes the peer direct
            paths[peer] = "relay" if relayed else "direct"
    return paths


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


P2P_CODE, CIRCUIT_CODE = 421, 290  # multicodec codes of /p2p/ and /p2p-circuit


def circuit_maddr_bytes(relay_maddr: str, target_id: str) -> bytes:
    """The binary multiaddr `<relay_maddr>/p2p-circuit/p2p/<target_id>` (relay_maddr ends in
    /p2p/<relay id>), for the daemon's connect. hivemind's `Multiaddr` writes a /p2p/ component
    as a CID, which p2pd refuses ("length greater than remaining number of bytes"); the wire form
    is the peer id's multihash."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    host, sep, relay_id = relay_maddr.partition("/p2p/")
    if not sep or not relay_id:
        raise ValueError(f"{relay_maddr!r} does not name its relay (/p2p/<id>)")

    def p2p(peer: str) -> bytes:
        raw = PeerID.from_base58(peer).to_bytes()
        return _varint(P2P_CODE) + _varint(len(raw)) + raw

    return Multiaddr(host).to_bytes() + p2p(relay_id) + _varint(CIRCUIT_CODE) + p2p(target_id)


class _RawMaddr:
    """What the daemon client's `connect` wants of an address: an object with `to_bytes()`."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def to_bytes(self) -> bytes:
        return self.data


async def connect_via_relay(p2p: Any, target: str, relay_maddr: str) -> None:
    """Connect `p2p` (a hivemind P2P) to `target` through the relay at `relay_maddr`, which must
    hold a reservation for it (a NAT'ed peer reserves one within seconds of finding itself
    private); later streams to `target` use the connection. Raises if the relay refuses."""
    from hivemind.p2p import PeerID

    await p2p._client.connect(PeerID.from_base58(target), [_RawMaddr(circuit_maddr_bytes(relay_maddr, target))])


async def find_reachability(transport: Any, maddrs: list[str], bootstrap_ids: list[str], coordinator: str,
                            public_needs: int = 1, unknown: str | None = "private",
                            give_up_at: float = math.inf) -> str | None:
    """"public" or "private" as the bootstrap peers' dial-backs find us at `maddrs` ("private" if
    none answers; "public" with no bootstrap peer to ask). Any libp2p identity can be a bootstrap
    peer, and a lying one makes a public peer stop serving ("private") or a NAT'ed one take roles nobody reaches ("public"). So the
    coordinator, asked first, decides. Without its answer a "public" decides (one more probe
    would lengthen every public peer's start) and a "private" is checked with one more peer: it
    stands unless that peer finds us reachable (or none other answers). `public_needs`: how many
    peers other than the coordinator must find us reachable (2 for probers the user did not name:
    peers proven in the run, asked when the bootstrap peers are down); `unknown`: the verdict when
    there is none; nobody is asked (or waited for) past `give_up_at` (monotonic: the start's
    own limit)."""
    # each peer once (a bootstrap line lists one at several addresses; a request goes by id)
    peers = sorted(dict.fromkeys(bootstrap_ids), key=lambda peer: peer != coordinator)
    privates: set[str] = set()
    publics: set[str] = set()
    # Asking a busy prober again is bounded for the whole step: the node's start (60 s in all, the
    # DHT's entry alone up to 25 s) must not wait out every bootstrap peer's window in turn.
    extra = [math.ceil(PROBE_EVERY_S / PROBE_TIMEOUT_S)]  # asks past each peer's second, for all of them
    for peer in peers[:3]:
        if time.monotonic() + 1.0 >= give_up_at:
            break
        reply = await _probe_by(transport, peer, maddrs, extra, give_up_at)
        if reply is None:
            continue
        if peer == coordinator:
            return "public" if reply.reachable else "private"
        if reply.reachable:
            publics.add(peer)
            if len(publics) >= public_needs:
                return "public"
            continue
        privates.add(peer)
        if len(privates) == 2:
            break
    if privates:
        return "private"
    if publics or peers:
        if unknown is None:
            return None
        # No verdict: "private", the safe side. A peer that is private contributes and receives
        # every aggregate all the same, but one that wrongly takes itself for public takes roles
        # nobody can reach it in; and a verdict can be withheld on purpose ("rate limited": a
        # review kept a prober's slots busy with throwaway identities and every NAT'ed joiner
        # came out "public").
        log.warning("reachability unknown: no bootstrap peer answered our dial-back probe; taking "
                    "ourselves for private (start with --reachability public if others can connect to us)")
        return "private"
    return "public"  # nobody to ask: the first peer of a run


async def _probe_by(transport: Any, peer: str, maddrs: list[str], extra: list[int],
                    give_up_at: float = math.inf) -> ProbeReply | None:
    """`peer`'s dial-back verdict; asked again, a probe's time apart, while it is busy ("rate
    limited"): once, and then while `extra[0]` (shared by the step's peers, taken from here) lasts,
    enough to outwait one peer's per-sender window; None if it gave none. (Asked once more only,
    a volunteer restarted within PROBE_EVERY_S of its last probe got no verdict, and took itself
    for public: behind a NAT, too.)"""
    from groundswell.protocol.transport import PeerUnavailable

    for ask in itertools.count():
        left = give_up_at - time.monotonic()
        if left < 1.0:
            break
        try:
            reply = await transport.request(peer, "probe", ProbeRequest(maddrs), ProbeReply,
                                            timeout_s=min(4 * PROBE_TIMEOUT_S + 5, left))
        except PeerUnavailable as exc:
            log.info("reachability probe by %s: %s", peer[-8:], exc)
            return None
        if reply.address != "rate limited":
            return reply
        if ask >= 1:
            if extra[0] <= 0:
                break
            extra[0] -= 1
        if time.monotonic() + PROBE_TIMEOUT_S + 1.0 >= give_up_at:
            break  # no ask would fit after the wait: not waited for (it ran 3 s past the limit)
        await asyncio.sleep(PROBE_TIMEOUT_S)  # its probes under way end within this
    return None
