"""A start whose bootstrap peers are all down, or frozen, enters the run's DHT through the proven
peers it knew (peer/dht_entry.py), and nobody else takes their place."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import Cluster

pytestmark = pytest.mark.timeout(180)


async def _table_size(node) -> int:
    return len(node.dht.protocol.routing_table.uid_to_peer_id)


DEAD = "12D3KooWKLLqcy4gjNQKeLa6jkKaXzTqVYkLmQU14qaiz7GtnFib"  # a proven peer that is gone


def _node_knowing(cluster, tmp_path, line, proven, reachability="auto", coordinator=""):
    """A node whose bootstrap line is `line`, that knows `proven` (nodes, or (id, addresses) pairs)
    as proven peers of the run; closed with the cluster."""
    from groundswell.peer.swarm import NodeOptions, SwarmNode
    from groundswell.protocol.identity import Identity

    ident = Identity.generate()
    path = tmp_path / f"{ident.peer_id}.key"
    ident.save(path)
    node = SwarmNode(ident, str(path), NodeOptions(initial_peers=line, reachability=reachability,
                                                   coordinator=coordinator))
    cluster.nodes.append(node)
    known = [(p.identity.peer_id, p.maddrs) if hasattr(p, "maddrs") else p for p in proven]
    node.rejoiner.remember(known)
    node.rejoiner.vouch(pid for pid, _ in known)
    return node


def test_a_start_whose_bootstrap_peers_are_all_down_enters_through_the_proven_peers_it_knew(tmp_path):
    """A volunteer restarted (its process or its daemon) while the coordinator, often its only
    bootstrap peer, was away could not get back in: p2pd exits when it reaches no bootstrap peer.
    It now enters through the run's proven peers it knew; a peer that only published a record
    (anyone can, by the thousand) never takes their place."""
    from groundswell.peer.net_errors import NetworkError

    cluster = Cluster(3)
    try:
        gone, b, c = cluster.nodes
        line = gone.maddrs[:1]
        gone.close()  # the bootstrap peer is down; b and c go on
        seen_only = _node_knowing(cluster, tmp_path, line, [])
        seen_only.rejoiner.remember([(b.identity.peer_id, b.maddrs)])  # a record read, never vouched for
        with pytest.raises(NetworkError, match="bootstrap peers"):
            seen_only.start()
        # one proven peer gone too, one whose address is malformed (any contributor can publish one)
        bad = ("12D3KooWLs4rkCqfo3kBvLhWNBzSCpTP5RYxwTm3u8Pv5jNzfpTf", ["/ip4/127.0.0.1/tcp/99999"])
        node = _node_knowing(cluster, tmp_path, line, [(DEAD, ["/ip4/127.0.0.1/tcp/9"]), bad, b, c])
        assert [pid for pid, _ in node.rejoiner.proven_targets()] == [c.identity.peer_id, b.identity.peer_id, DEAD]
        node.start()
        assert sorted(node.entered_through) == sorted([b.identity.peer_id, c.identity.peer_id])  # those that answered
        assert node.reachability == "public"  # two proven peers' dial-backs, in the bootstrap peer's place
        node.attach(cluster.ctx)
        deadline = time.monotonic() + 30
        while b.identity.peer_id not in node.call(node.refresh_records(), 10) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert b.identity.peer_id in node.call(node.refresh_records(), 10), "never got into the run's DHT"
        seen_by_b = b.call(b.refresh_records(), 10)
        deadline = time.monotonic() + 30
        while node.identity.peer_id not in seen_by_b and time.monotonic() < deadline:
            time.sleep(0.5)
            seen_by_b = b.call(b.refresh_records(), 10)
        assert node.identity.peer_id in seen_by_b, "the run never saw the node that came back"
        # One proven peer alone finding us reachable is no verdict (any contributor is proven):
        # private, the safe side.
        lone = _node_knowing(cluster, tmp_path, line, [b])
        lone.start()
        assert lone.entered_through == [b.identity.peer_id] and lone.reachability == "private"
    finally:
        cluster.close()


def test_a_start_whose_bootstrap_peer_is_frozen_enters_through_the_proven_peers_it_knew(tmp_path, monkeypatch):
    """A frozen bootstrap peer (a closed laptop lid): its daemon takes the connection, so p2pd
    starts, but nothing answers. Told its reachability, the start waits out the bootstrap DHT,
    then enters through a proven peer; left to probe it, the silent probe has it ask the proven
    peers' dial-backs, and their DHT along with the bootstrap peer's (no wait for it first)."""
    from groundswell.peer import dht_entry, node_nat, reachability

    monkeypatch.setattr(dht_entry, "BOOTSTRAP_S", 4.0)  # how long the frozen one is waited for (25 s)
    monkeypatch.setattr(reachability, "PROBE_TIMEOUT_S", 1.0)  # and its probe (17 s)
    cluster = Cluster(3)
    try:
        frozen, b, c = cluster.nodes
        cluster.freeze(0, 90)
        told = _node_knowing(cluster, tmp_path, frozen.maddrs[:1], [b], reachability="public")
        told.start()
        assert told.entered_through == [b.identity.peer_id]
        assert told.call(_table_size(told), 10) >= 1, "nobody in the routing table"
        # the frozen one is the coordinator, seen at another address too: it is no prober in their place
        frozen_id = frozen.identity.peer_id
        elsewhere = (frozen_id, [*frozen.maddrs, f"/ip4/127.0.0.2/tcp/9/p2p/{frozen_id}"])
        probed = _node_knowing(cluster, tmp_path, frozen.maddrs[:1], [elsewhere, b, c], coordinator=frozen_id)
        probers: list[list[str]] = []
        real_find = node_nat.find_reachability

        async def find_reachability(transport, maddrs, peers, *args, **kwargs):
            probers.append(list(peers))
            return await real_find(transport, maddrs, peers, *args, **kwargs)

        monkeypatch.setattr(node_nat, "find_reachability", find_reachability)
        pinged: list[list[str]] = []
        real_enter = dht_entry.enter_dht

        async def enter_dht(dht, peers, *args, **kwargs):
            pinged.append([str(m).rpartition("/p2p/")[2] for m in peers])
            return await real_enter(dht, peers, *args, **kwargs)

        monkeypatch.setattr(dht_entry, "enter_dht", enter_dht)
        probed.start()
        assert probed.reachability == "public" and probed._bootstrap_silent
        assert probers[0] == [frozen_id] and sorted(probers[1]) == sorted([b.identity.peer_id, c.identity.peer_id])
        assert sorted(probed.entered_through) == sorted([b.identity.peer_id, c.identity.peer_id])
        assert len(pinged) == 1 and set(pinged[0]) == {frozen.identity.peer_id, b.identity.peer_id,
                                                        c.identity.peer_id}  # all at once, frozen one never alone
    finally:
        cluster.close()


@pytest.mark.parametrize("words", ["failed to connect to bootstrap peers",  # refused: p2pd's own words
                                   "Daemon failed to start in 15.0 seconds"])  # silent: hivemind's wait ran out
def test_a_daemon_that_reached_no_bootstrap_peer_starts_again_without_them_if_proven_peers_are_known(words):
    import asyncio

    from groundswell.peer.swarm import NodeOptions, SwarmNode
    from groundswell.protocol.identity import Identity

    class Daemons:
        bootstrapped: list = []

        @classmethod
        async def create(cls, initial_peers, **kw):
            cls.bootstrapped.append(initial_peers)
            if initial_peers:
                raise RuntimeError(f"Daemon failed to start: {words}")

            class P2P:
                async def get_visible_maddrs(self):
                    return []
            return P2P()

    line = ["/ip4/127.0.0.1/tcp/9/p2p/QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupMKb"]
    for proven, started in ((False, False), (True, True)):
        Daemons.bootstrapped = []
        node = SwarmNode(Identity.generate(), None, NodeOptions(initial_peers=line))
        if proven:
            node.rejoiner.remember([(DEAD, ["/ip4/127.0.0.1/tcp/8"])])
            node.rejoiner.vouch([DEAD])
        try:
            if started:
                asyncio.run(node._create_p2p(Daemons, None))
                assert Daemons.bootstrapped == [line, None] and node.bootstrap_down
            else:  # no peer of the run known: the start fails with p2pd's words
                with pytest.raises(RuntimeError, match=words):
                    asyncio.run(node._create_p2p(Daemons, None))
                assert Daemons.bootstrapped == [line]
        finally:
            node._loop.close()


def test_proven_targets_leave_out_the_bootstrap_lines_addresses_not_the_peer_and_malformed_entries():
    from groundswell.peer.dht_rejoin import DhtRejoiner, dialable_scopes
    from groundswell.protocol.identity import Identity

    coord, vol, me = (Identity.generate().peer_id for _ in range(3))
    line = [f"/ip4/127.0.0.1/tcp/7000/p2p/{coord}"]
    r = DhtRejoiner(me, line, scopes=dialable_scopes(line))
    r.remember([(coord, [f"/ip4/127.0.0.1/tcp/7000/p2p/{coord}", f"/ip4/127.0.0.1/tcp/7100/p2p/{coord}"]),
                (vol, [f"/ip4/127.0.0.1/tcp/7200/p2p/{vol}", "/ip4/127.0.0.1/tcp/99999"]),
                ("Qmnotapeerid", ["/ip4/127.0.0.1/tcp/7300"]), (me, ["/ip4/127.0.0.1/tcp/7400"])])
    r.vouch([coord, vol, "Qmnotapeerid", me])
    # the coordinator back on a new port is dialled there; a port of 99999 and a bad id are dropped
    assert r.proven_targets() == [(vol, ["/ip4/127.0.0.1/tcp/7200"]), (coord, ["/ip4/127.0.0.1/tcp/7100"])]
