"""Getting back into the DHT after a network outage.

A peer whose link went down fails every DHT request meanwhile, which evicts every peer from its
routing table, and hivemind's DHT node bootstraps only at start: it would then see and publish
nothing but its own record for the rest of the run, while the round protocol (direct streams)
went on. `DhtRejoiner` remembers where peers were and, once the table is empty, dials them and
pings them back in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_REMEMBERED = 64  # peers whose addresses are kept
MAX_TARGETS = 16  # peers dialled per attempt


class DhtRejoiner:
    """Peer addresses seen in records, and the re-entry into the DHT once its table is empty."""

    def __init__(self, me: str, bootstrap: Sequence[str], every_s: float = 10.0) -> None:
        self.me = me
        self.bootstrap = list(bootstrap)
        self.every_s = every_s
        self._addrs: dict[str, list[str]] = {}  # peer -> addresses from its last record, oldest first
        self._tried_at = -1e9  # monotonic time of the last attempt

    def remember(self, records: Iterable[tuple[str, Sequence[str]]]) -> None:
        """Note the addresses of peers whose records were just read (they outlive the records)."""
        for pid, maddrs in records:
            self._addrs.pop(pid, None)
            self._addrs[pid] = list(maddrs)
        while len(self._addrs) > MAX_REMEMBERED:
            del self._addrs[next(iter(self._addrs))]

    def remembered(self) -> dict[str, list[str]]:
        """Peer -> addresses, oldest first (what `remember` took in, for a file to keep them)."""
        return {pid: list(maddrs) for pid, maddrs in list(self._addrs.items())}  # (the loop thread adds to it)

    def targets(self) -> list[tuple[str, list[str]]]:
        """(peer id, plain addresses) to dial: bootstrap peers first, then the most recently seen."""
        known: dict[str, list[str]] = {}
        for maddr in self.bootstrap:
            head, _, pid = str(maddr).rpartition("/p2p/")
            known.setdefault(pid, []).append(head)
        for pid, maddrs in reversed(self._addrs.items()):
            known.setdefault(pid, []).extend(m.rpartition("/p2p/")[0] or m for m in maddrs[:4])
        known.pop(self.me, None)
        return [(pid, [a for a in addrs if "p2p-circuit" not in a]) for pid, addrs in known.items()][:MAX_TARGETS]

    async def maybe_rejoin(self, p2p: Any, dht: Any) -> None:
        """If `dht`'s routing table is empty (and the last attempt is `every_s` old), dial the
        known peers, ping them back into the table and look up our neighbours again."""
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        protocol = dht.protocol
        if len(protocol.routing_table.uid_to_peer_id) or time.monotonic() - self._tried_at < self.every_s:
            return
        self._tried_at = time.monotonic()
        targets = self.targets()
        if not targets:  # the first peer of a run, alone so far: the others will find us
            return

        async def ping(pid: str, addrs: list[str]) -> bool:
            peer = PeerID.from_base58(pid)
            try:
                async with asyncio.timeout(5):
                    await p2p._client.connect(peer, [Multiaddr(a) for a in addrs])
            except Exception:  # not reachable now, or known only through a relay: the ping may still work
                pass
            return await protocol.call_ping(peer) is not None  # adds it to the table when it answers

        answered = sum(await asyncio.gather(*(ping(pid, addrs) for pid, addrs in targets)))
        if answered:
            await dht.find_nearest_nodes([dht.node_id])
        log.info("routing table was empty: %d of %d known peers answered", answered, len(targets))


def save_known_peers(path: Path, rejoiner: DhtRejoiner | None) -> None:
    """Keep where the run's peers were (atomically; a disk refusing it is logged, not raised): a
    peer restarted without any bootstrap peer, as a coordinator usually is, dials them to get back
    into the DHT instead of sitting alone in it while the run goes on."""
    from .state_files import write_atomically

    known = rejoiner.remembered() if rejoiner is not None else {}
    if not known:
        return
    try:
        write_atomically(path, lambda f: f.write(json.dumps(known).encode()))
    except OSError as exc:
        log.info("could not keep the known peers' addresses: %s", exc)


def load_known_peers(path: Path) -> list[tuple[str, list[str]]]:
    """(peer, addresses) kept by `save_known_peers`, oldest first ([] if none, or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict):
        return []
    return [(pid, [m for m in maddrs if isinstance(m, str)][:8]) for pid, maddrs in data.items()
            if isinstance(pid, str) and isinstance(maddrs, list)][-MAX_REMEMBERED:]
