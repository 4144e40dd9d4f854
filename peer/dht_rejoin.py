"""Getting back into the DHT after a network outage.

A peer whose link went down fails every DHT request meanwhile, which evicts every peer from its
routing table, and hivemind's DHT node bootstraps only at start: it would then see and publish
nothing but its own record for the rest of the run, while the round protocol (direct streams)
went on. `DhtRejoiner` remembers where peers were and, once the table is empty, dials them and
pings them back in.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groundswell.protocol.tasks import gather_owned

log = logging.getLogger(__name__)

MAX_REMEMBERED = 64  # peers whose addresses are kept, in each tier
MAX_TARGETS = 16  # peers dialled per attempt
MAX_ADDRS = 4  # addresses dialled per peer

LOOPBACK, PRIVATE, PUBLIC = "loopback", "private", "public"


def address_scope(maddr: str) -> str | None:
    """Where a multiaddr's IP lives: loopback, private (RFC 1918, ULA, CGNAT) or public; None for
    one never worth dialling (link-local, multicast, unspecified, reserved, malformed) and for a
    DNS name, which may resolve anywhere (`localhost`, or a rebinding name pointing into a home
    network): only a bootstrap address the user gave may be one."""
    parts = str(maddr).split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return None
    if ip.is_private or (ip.version == 4 and ip in _CGNAT):
        return PRIVATE
    return PUBLIC if ip.is_global else None


_CGNAT = ipaddress.ip_network("100.64.0.0/10")


def dialable_scopes(own: Sequence[str]) -> frozenset[str]:
    """The scopes of the addresses a run's own peers may be dialled at, judged from `own` (the
    bootstrap addresses the user gave, else our own listen addresses): public always; private
    only if none of them is public (a LAN run; an unspecified 0.0.0.0 counts as private); loopback
    only if all of them are loopback (a run on 127.0.0.1). A bootstrap line lists every address
    its daemon listens on, 127.0.0.1 and a cloud machine's VPC address among them, so a public
    run's line names those too; but a public run never has a hostile record make its peers dial
    their own machine or home network."""
    scopes = []
    for maddr in own:
        parts = str(maddr).split("/")
        scopes.append(PRIVATE if len(parts) >= 3 and parts[2] in ("0.0.0.0", "::") else address_scope(maddr))
    if scopes and all(scope == LOOPBACK for scope in scopes):
        return frozenset({PUBLIC, LOOPBACK})
    if PRIVATE in scopes and PUBLIC not in scopes:
        return frozenset({PUBLIC, PRIVATE})
    return frozenset({PUBLIC})


def listen_scopes(own: Sequence[str], visible: Sequence[str]) -> frozenset[str]:
    """`dialable_scopes` of `own`, or, when every one of them is unspecified (0.0.0.0, ::: a
    coordinator launched without --announce), of the addresses our daemon turned out to listen
    at (`visible`): judged from 0.0.0.0 alone, a coordinator with a public address took its run
    for a LAN run, and its probe, whose answer decides, judged a volunteer it saw at 10.x public
    (a review)."""
    unspecified = bool(own) and all(str(m).split("/")[2:3] in (["0.0.0.0"], ["::"]) for m in own)
    return dialable_scopes(visible if unspecified and visible else own)


MERGE_EVERY_S = 60.0  # a routing table lacking bootstrap or proven peers pings them this often
MAX_MERGE_PINGS = 16  # ...that many at most

class DhtRejoiner:
    """Peer addresses seen in records, and the re-entry into the DHT once its table is empty.

    Peers are kept in two tiers. *Proven* peers are the coordinator and those named in commits
    this node holds (they did the run's work); *seen* ones only published a record, which in an
    open run anyone can do by the thousand. Proven peers are dialled first, and a flood of records
    only ever pushes seen ones out."""

    def __init__(self, me: str, bootstrap: Sequence[str], every_s: float = 10.0,
                 scopes: frozenset[str] | None = None) -> None:
        self.me = me
        self.bootstrap = list(bootstrap)
        self.every_s = every_s
        self.scopes = scopes if scopes is not None else dialable_scopes(self.bootstrap)
        self._addrs: dict[str, list[str]] = {}  # seen: peer -> addresses from its last record, oldest first
        self._proven: dict[str, list[str]] = {}  # proven: the same, for proven peers
        self._vouched: dict[str, None] = {}  # proven peer ids, addresses known or not (newest last)
        self._tried_at = -1e9  # monotonic time of the last attempt

    def remember(self, records: Iterable[tuple[str, Sequence[str]]]) -> None:
        """Note the addresses of peers whose records were just read (they outlive the records);
        only addresses in a dialable scope are kept."""
        for pid, maddrs in records:
            usable = [m for m in maddrs if isinstance(m, str) and address_scope(m) in self.scopes][:8]
            tier = self._proven if pid in self._vouched else self._addrs
            tier.pop(pid, None)
            tier[pid] = usable
        self._trim()

    def vouch(self, peers: Iterable[str]) -> None:
        """Mark `peers` as proven (the coordinator, peers named in commits): their addresses move
        to the tier a flood of records cannot push out."""
        for pid in peers:
            self._vouched.pop(pid, None)
            self._vouched[pid] = None
            if pid in self._addrs:
                self._proven.pop(pid, None)
                self._proven[pid] = self._addrs.pop(pid)
        while len(self._vouched) > 4 * MAX_REMEMBERED:
            del self._vouched[next(iter(self._vouched))]
        self._trim()

    def is_proven(self, pid: str) -> bool:
        """Was `pid` vouched for (the coordinator, a peer named in a commit we hold)?"""
        return pid in self._vouched

    def _trim(self) -> None:
        for tier in (self._addrs, self._proven):
            while len(tier) > MAX_REMEMBERED:
                del tier[next(iter(tier))]

    def remembered(self) -> KnownPeers:
        """Both tiers, oldest first (what a file keeps; the loop thread adds to them meanwhile)."""
        return KnownPeers(proven=list(dict(self._proven).items()), seen=list(dict(self._addrs).items()))

    def restore(self, known: KnownPeers) -> None:
        """Take back what `remembered` returned (from a file kept by `save_known_peers`)."""
        self.vouch(pid for pid, _ in known.proven)
        self.remember(known.proven)
        self.remember(known.seen)

    def targets(self) -> list[tuple[str, list[str]]]:
        """(peer id, plain addresses) to dial: bootstrap peers first, then proven peers, then seen
        ones, the most recently seen first in each tier."""
        known: dict[str, list[str]] = {}
        for maddr in self.bootstrap:
            head, _, pid = str(maddr).rpartition("/p2p/")
            known.setdefault(pid, []).append(head)
        self._add_plain(known, self._proven)
        self._add_plain(known, self._addrs)
        known.pop(self.me, None)
        return list(known.items())[:MAX_TARGETS]

    def proven_targets(self) -> list[tuple[str, list[str]]]:
        """`targets` of the proven tier alone, less the bootstrap line's addresses (those failed
        already; a bootstrap peer, the coordinator above all, stays at any other address it was
        seen at: back on a new port, say), each peer id and address well-formed (a start whose
        bootstrap peers are all down enters through them: a peer that only published a record,
        which anyone can, never takes their place; and one malformed address, which any
        contributor can publish, must not fail the others)."""
        known: dict[str, list[str]] = {}
        self._add_plain(known, self._proven)
        known.pop(self.me, None)
        failed = {str(m).rpartition("/p2p/")[0] for m in self.bootstrap}
        known = {pid: [a for a in addrs if a not in failed] for pid, addrs in known.items()}
        return [(pid, addrs) for pid, addrs in ((pid, well_formed(pid, addrs)) for pid, addrs in known.items())
                if addrs][:MAX_TARGETS]

    @staticmethod
    def _add_plain(known: dict[str, list[str]], tier: dict[str, list[str]]) -> None:
        for pid, maddrs in reversed(list(tier.items())):  # the most recently seen first
            plain = [m.rpartition("/p2p/")[0] or m for m in maddrs if "p2p-circuit" not in m]
            if plain:
                known.setdefault(pid, []).extend(plain[:MAX_ADDRS])

    async def maybe_rejoin(self, p2p: Any, dht: Any) -> None:
        """If `dht`'s routing table is empty (and the last attempt is `every_s` old), dial the
        known peers, ping them back into the table and look up our neighbours again. If it is not
        empty but lacks bootstrap or proven peers, ping those (every MERGE_EVERY_S): a DHT split
        in two (a partition that healed, a coordinator restarted without its known peers) keeps
        two tables that are not empty and never meet again, each side without the other's
        records (the coordinator's among them)."""
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        protocol = dht.protocol
        table = protocol.routing_table.uid_to_peer_id
        empty = not len(table)
        if time.monotonic() - self._tried_at < (self.every_s if empty else max(self.every_s, MERGE_EVERY_S)):
            return
        self._tried_at = time.monotonic()
        targets = self.targets()
        if not empty:
            present = {p.to_base58() if hasattr(p, "to_base58") else str(p) for p in list(table.values())}
            anchors = {str(m).rpartition("/p2p/")[2] for m in self.bootstrap} | set(self._proven)
            targets = [(pid, addrs) for pid, addrs in targets if pid in anchors and pid not in present]
            targets = targets[:MAX_MERGE_PINGS]
        if not targets:  # the first peer of a run, alone so far (the others will find us), or none missing
            return

        async def ping(pid: str, addrs: list[str]) -> bool:
            """One target, best effort: whatever it (or its file entry) does wrong costs only itself."""
            try:
                peer = PeerID.from_base58(pid)
            except Exception as exc:  # noqa: BLE001 (hivemind raises several types for a bad id)
                log.info("known peer %r: not a peer id (%r)", pid[:64], exc)
                return False
            try:
                async with asyncio.timeout(5):
                    await p2p._client.connect(peer, [Multiaddr(a) for a in addrs])
            except Exception:  # not reachable now, or known only through a relay: the ping may still work
                pass
            try:  # (a hostile answer makes hivemind raise, an AssertionError among others)
                return await protocol.call_ping(peer) is not None  # adds it to the table when it answers
            except Exception as exc:  # noqa: BLE001
                log.info("pinging %s failed: %r", pid[-8:], exc)
                return False

        answered = sum(await gather_owned(ping(pid, addrs) for pid, addrs in targets))
        if answered:
            await dht.find_nearest_nodes([dht.node_id])
        log.info("routing table %s: %d of %d known peers answered",
                 "was empty" if empty else "lacked bootstrap or proven peers", answered, len(targets))


def well_formed(pid: str, addrs: Sequence[str]) -> list[str]:
    """Those of `addrs` that parse as multiaddrs, none if `pid` is not a peer id."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    try:
        raw = PeerID.from_base58(pid).to_bytes()
    except Exception:  # noqa: BLE001 (hivemind raises several types for a bad id)
        return []
    if len(raw) < 2 or raw[0] not in (0x00, 0x12) or len(raw) != raw[1] + 2:  # a multihash: identity or sha2-256
        return []
    good = []
    for addr in addrs:
        try:
            Multiaddr(addr)
        except Exception:  # noqa: BLE001 (a port of 99999, an unknown protocol: several types)
            continue
        good.append(addr)
    return good


@dataclass(frozen=True)
class KnownPeers:
    """Where the run's peers were: (peer id, multiaddrs) pairs, oldest first, in two tiers."""

    proven: list[tuple[str, list[str]]] = field(default_factory=list)
    seen: list[tuple[str, list[str]]] = field(default_factory=list)


def save_known_peers(path: Path, rejoiner: DhtRejoiner | None) -> None:
    """Keep where the run's peers were (atomically; a disk refusing it is logged, not raised): a
    peer restarted without any bootstrap peer, as a coordinator usually is, dials them to get back
    into the DHT instead of sitting alone in it while the run goes on."""
    from .state_files import write_atomically

    known = rejoiner.remembered() if rejoiner is not None else KnownPeers()
    if not known.proven and not known.seen:
        return
    data = {"proven": dict(known.proven), "seen": dict(known.seen)}
    try:
        write_atomically(path, lambda f: f.write(json.dumps(data).encode()))
    except OSError as exc:
        log.info("could not keep the known peers' addresses: %s", exc)


def load_known_peers(path: Path) -> KnownPeers:
    """What `save_known_peers` kept (nothing if none, or unreadable; malformed entries dropped)."""
    from .state_files import parse_json

    try:
        data = parse_json(path.read_text())
    except (OSError, ValueError):
        return KnownPeers()
    if not isinstance(data, dict):
        return KnownPeers()

    if "proven" not in data and "seen" not in data:  # the flat {peer: addresses} file of 2026-12-05
        data = {"seen": data}

    def tier(name: str) -> list[tuple[str, list[str]]]:
        entries = data.get(name)
        if not isinstance(entries, dict):
            return []
        return [(pid, [m for m in maddrs if isinstance(m, str)][:8]) for pid, maddrs in entries.items()
                if isinstance(pid, str) and isinstance(maddrs, list)][-MAX_REMEMBERED:]

    return KnownPeers(proven=tier("proven"), seen=tier("seen"))
