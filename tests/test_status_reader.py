"""`groundswell status` reads the run as a DHT client that costs the run nothing.

Before, its node started like a volunteer's: a bootstrap peer dialled it back (a probe), and,
found public, it joined the DHT as a server (into every routing table it touched) and served
rendezvous; found private, it took a relay slot. Asked every few seconds (`watch`), that is churn."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from groundswell.peer.swarm import NodeOptions, SwarmNode, reader_options
from groundswell.protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


def _node(tmp_path: Path, name: str, options: NodeOptions) -> SwarmNode:
    ident = Identity.generate()
    ident.save(tmp_path / f"{name}.key")
    return SwarmNode(ident, str(tmp_path / f"{name}.key"), options)


async def _knows(node: SwarmNode, peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    return node.dht.protocol.routing_table.get(peer_id=PeerID.from_base58(peer_id)) is not None


def test_the_status_reader_is_a_dht_client_that_is_not_probed_and_takes_no_relay_slot(tmp_path, monkeypatch):
    from groundswell.peer import reachability

    boot = _node(tmp_path, "boot", NodeOptions(reachability="public", direct_state=False))
    boot.start()
    probed = []
    real_probe = reachability.find_reachability

    async def probe(*args, **kwargs):
        probed.append(args)
        return await real_probe(*args, **kwargs)

    monkeypatch.setattr("groundswell.peer.node_nat.find_reachability", probe)
    try:
        volunteer = _node(tmp_path, "volunteer", NodeOptions(initial_peers=boot.maddrs[:1], trains=False,
                                                              serves=False))
        reader = _node(tmp_path, "reader", reader_options(boot.maddrs[:1], boot.identity.peer_id))
        try:
            for node in (volunteer, reader):  # (inside: a start that fails still closes the other)
                node.start()
            assert len(probed) == 1  # the volunteer's: the reader is not dialled back
            assert reader.dht.protocol.client_mode and not volunteer.dht.protocol.client_mode
            assert reader.direct is None and reader.record.serves is False
            cmdline = Path(f"/proc/{reader.p2p._child.pid}/cmdline").read_bytes().split(b"\0")
            assert b"-autoRelay=0" in cmdline and not any(a.startswith(b"-trustedRelays") for a in cmdline)
            # The bootstrap peer adds a DHT server that reached it to its routing table; the reader, never.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not boot.call(_knows(boot, volunteer.identity.peer_id), timeout_s=10):
                time.sleep(0.1)
            assert boot.call(_knows(boot, volunteer.identity.peer_id), timeout_s=10)
            assert not boot.call(_knows(boot, reader.identity.peer_id), timeout_s=10)
        finally:
            reader.close()
            volunteer.close()
    finally:
        boot.close()
