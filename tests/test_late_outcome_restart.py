"""A restarted volunteer that took a later state checks an older round's commit with the commit
that round was planned from, stored with its contribution (real nodes, libp2p over 127.0.0.1).

Before, it could not: checking a commit needs the plan the round before's commit gives, and a
process that took a later state holds only commits from that state on. Its crashed process's
last contribution was then presumed counted and taken out of its work (lost if it was not),
and any other one kept (sent a second time if it was counted). Seen in a CI churn run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from groundswell.peer.swarm import NodeOptions, SwarmNode
from groundswell.peer.swarm_exchange import SwarmExchange

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import Cluster, inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _restarted(c: Cluster, i: int, held: bytes) -> SwarmNode:
    """Node i's process, restarted: the same identity, holding only the commit `held` (it took
    the state that commit leads to)."""
    c.nodes[i].close()
    node = SwarmNode(c.nodes[i].identity, str(Path(c._tmp.name) / f"id{i}.key"),
                     NodeOptions(initial_peers=c.nodes[0].maddrs[:1]))
    c.nodes[i] = node  # closed with the cluster
    node.start()
    node.attach(c.ctx)
    c.add_decision(node, held)
    node.holders = lambda round_id: [c.ids[0], c.ids[1]]  # (what its peer-record cache would name)
    return node


def test_a_restart_that_took_a_later_state_checks_an_older_commit_with_the_one_it_was_planned_from(make_cluster):
    c = make_cluster(n=3, codec_name="fp32", min_peers=2)
    xs = inputs(3, c.numel, seed=5)
    sent: dict[int, list[bytes]] = {}
    basis: dict[int, bytes] = {}
    for r in range(3):
        basis[r] = SwarmExchange(c.nodes[2]).basis_for(r)  # as the contribution's record stores it
        sent[r] = c.segments(xs[2] * (r + 1))
        results = c.attempt(r, {i: xs[i] * (r + 1) for i in range(3)})
        assert all(res.decision is not None and res.decision.status == "commit" and res.included
                   for res in results.values()), results
    commits = {r: c.nodes[0].book.committed[r][0] for r in range(3)}  # type: ignore[union-attr]
    assert basis[1] == commits[0] and basis[2] == commits[1] and basis[0]  # (round 0's: the genesis)
    means = [c.fetch(i, commits[2]) for i in range(3)]
    assert all(torch.equal(m, means[0]) for m in means)

    node = _restarted(c, 2, commits[2])  # it took the state after round 2
    ex = SwarmExchange(node)
    assert node.call(ex.counts_ours(1, sent[1]), timeout_s=60) is None  # no basis: cannot be checked
    # a basis of another round, or not a commit of this run, is not taken
    assert node.call(ex.counts_ours(1, sent[1], commits[1]), timeout_s=60) is None
    assert node.call(ex.counts_ours(1, sent[1], b"\x93garbage"), timeout_s=60) is None
    assert sorted(node.book.committed) == [2]  # type: ignore[union-attr]
    other = c.segments(torch.ones(c.numel))
    assert node.call(ex.counts_ours(1, other, basis[1]), timeout_s=60) is False  # checked: not ours
    assert node.book.committed[1][0] == commits[1]  # type: ignore[union-attr]
    assert node.call(ex.counts_ours(1, sent[1], basis[1]), timeout_s=60) is True
