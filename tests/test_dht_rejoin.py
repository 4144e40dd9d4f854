"""A peer whose routing table emptied (a network outage evicts every peer) gets back into the DHT."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import Cluster

pytestmark = pytest.mark.timeout(180)


async def _forget(node, ids: set[str] | None) -> int:
    """Drop `ids` (None: everyone) from a node's DHT routing table, as failed requests would."""
    table = node.dht.protocol.routing_table
    gone = [uid for uid, pid in list(table.uid_to_peer_id.items()) if ids is None or str(pid) in ids]
    for uid in gone:
        del table[uid]
    return len(table.uid_to_peer_id)


async def _table_size(node) -> int:
    return len(node.dht.protocol.routing_table.uid_to_peer_id)


def test_a_peer_cut_off_from_the_dht_rejoins_and_is_seen_again():
    cluster = Cluster(3)
    try:
        a, _, c = cluster.nodes
        c_id = c.identity.peer_id
        deadline = time.monotonic() + 30
        while c_id not in a.call(a.refresh_records(), 10) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert c_id in a.call(a.refresh_records(), 10)
        c.call(c.refresh_records(), 10)  # c has seen the others' records (and addresses)
        # The outage: c lost everyone, and everyone lost c.
        assert c.call(_forget(c, None), 10) == 0
        for node in cluster.nodes[:2]:
            node.call(_forget(node, {c_id}), 10)
        c.update_record(round=41)  # what c publishes from now on must reach the others
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            seen = a.call(a.refresh_records(), 10).get(c_id)
            if seen is not None and seen.round == 41 and c.call(_table_size(c), 10) > 0:
                break
            time.sleep(1.0)
        assert c.call(_table_size(c), 10) > 0, "c's routing table stayed empty"
        assert seen is not None and seen.round == 41, "the others never saw c's new record"
        assert len(c.call(c.refresh_records(), 10)) == 3  # and c sees everyone again
    finally:
        cluster.close()


def test_rejoin_targets_are_bootstrap_peers_then_the_most_recently_seen_without_ourselves():
    from groundswell.peer.dht_rejoin import MAX_REMEMBERED, DhtRejoiner

    r = DhtRejoiner("me", ["/ip4/10.0.0.1/tcp/1/p2p/boot"])
    r.remember([("old", ["/ip4/10.0.0.2/tcp/2/p2p/old"]), ("me", ["/ip4/10.0.0.9/tcp/9/p2p/me"])])
    r.remember([("new", ["/ip4/10.0.0.3/tcp/3/p2p/new", "/ip4/10.0.0.4/tcp/4/p2p/R/p2p-circuit/p2p/new"])])
    assert r.targets() == [("boot", ["/ip4/10.0.0.1/tcp/1"]), ("new", ["/ip4/10.0.0.3/tcp/3"]),
                           ("old", ["/ip4/10.0.0.2/tcp/2"])]
    r.remember((f"p{i}", []) for i in range(2 * MAX_REMEMBERED))
    assert len(r._addrs) == MAX_REMEMBERED and "old" not in r._addrs  # the oldest are forgotten


def test_the_peers_a_node_knew_are_kept_on_disk_and_read_back(tmp_path):
    from groundswell.peer.dht_rejoin import DhtRejoiner, load_known_peers, save_known_peers

    path = tmp_path / "known_peers.json"
    assert load_known_peers(path) == []  # none kept yet
    rejoiner = DhtRejoiner("me", [])
    save_known_peers(path, rejoiner)
    assert not path.exists()  # nothing to keep: an empty file would only hide the older one
    rejoiner.remember([("a", ["/ip4/127.0.0.1/tcp/1/p2p/a"]), ("b", ["/ip4/127.0.0.1/tcp/2/p2p/b"])])
    save_known_peers(path, rejoiner)
    again = DhtRejoiner("me", [])
    again.remember(load_known_peers(path))
    assert again.targets() == rejoiner.targets()
    path.write_text('{"a": "not a list", "b": [1, "/ip4/127.0.0.1/tcp/2/p2p/b"]}')
    assert load_known_peers(path) == [("b", ["/ip4/127.0.0.1/tcp/2/p2p/b"])]
    path.write_text("[torn")
    assert load_known_peers(path) == []


def test_a_node_started_without_bootstrap_peers_gets_into_the_dht_through_the_peers_it_knew():
    """A coordinator restarted from its state dir, without --peer: its known peers (kept with
    each checkpoint) are dialled, and it sees the run's records again. It used to sit alone in
    its own DHT for good, saying "0 volunteers online" while the run went on without it."""
    from groundswell.peer.swarm import NodeOptions, SwarmNode
    from groundswell.protocol.identity import Identity

    cluster = Cluster(1)
    node = None
    try:
        a = cluster.nodes[0]
        path = Path(cluster._tmp.name) / "back.key"
        ident = Identity.generate()
        ident.save(path)
        node = SwarmNode(ident, str(path), NodeOptions())  # no initial peers
        node.rejoiner.remember([(a.identity.peer_id, a.maddrs)])
        node.start()
        node.attach(cluster.ctx)
        deadline = time.monotonic() + 60
        while a.identity.peer_id not in node.call(node.refresh_records(), 10) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert a.identity.peer_id in node.call(node.refresh_records(), 10), "never got back into the run's DHT"
    finally:
        if node is not None:
            node.close()
        cluster.close()
