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


def test_the_status_reader_checks_the_runs_records_before_it_reads_them(monkeypatch):
    # Found by a review: only a node attached to the run switched its record check on, so for
    # `status` any DHT node could replace a peer's record by junk (hiding that peer, the
    # coordinator too) or fail the whole lookup with bytes that are not msgpack.
    import asyncio
    from types import SimpleNamespace

    from groundswell.peer import join_network
    from groundswell.peer.cli import app
    from typer.testing import CliRunner

    calls: list[str] = []

    async def watch_records(self, run_id):
        calls.append(f"watch {run_id}")

    async def peer_records(self, run_id):
        calls.append(f"read {run_id}")
        return {}

    monkeypatch.setattr(SwarmNode, "start", lambda self, timeout_s=60.0: None)
    monkeypatch.setattr(SwarmNode, "close", lambda self: None)
    monkeypatch.setattr(SwarmNode, "call", lambda self, coro, timeout_s=None: asyncio.run(coro))
    monkeypatch.setattr(SwarmNode, "watch_records", watch_records)
    monkeypatch.setattr(SwarmNode, "peer_records", peer_records)
    monkeypatch.setattr(join_network, "fetch_manifest", lambda node, maddrs, coordinator: (
        b"", SimpleNamespace(run=SimpleNamespace(id="the-run"))))
    monkeypatch.setattr(time, "sleep", lambda s: None)
    pid = Identity.generate().peer_id
    res = CliRunner().invoke(app, ["status", f"gs1:{pid}@/ip4/127.0.0.1/tcp/1/p2p/{pid}", "--json"])
    assert res.exit_code == 0, res.output
    assert calls == ["watch the-run", "read the-run"]
