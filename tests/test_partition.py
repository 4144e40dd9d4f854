"""A leader whose link goes down mid-attempt (real nodes, libp2p on loopback; the cut is made in
each node's transport): it must not commit the round on its own while the others commit it too."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import inputs as _inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _cut_links(c, isolated: str, cut: threading.Event) -> None:
    """While `cut` is set, every request to or from `isolated` waits out its timeout and fails, as
    over a link that went down (no reset, no refusal: the packets go nowhere)."""
    from groundswell.protocol.transport import PeerUnavailable

    for node in c.nodes:
        me, transport = node.identity.peer_id, node.transport
        for name in ("_request", "_request_stream"):
            real = getattr(transport, name)

            async def down(peer_id, handler, *args, real=real, me=me, **kwargs):
                def dead() -> bool:
                    return cut.is_set() and isolated in (me, peer_id) and me != peer_id

                timeout_s = next((a for a in args if isinstance(a, float)), kwargs.get("timeout_s", 1.0))
                started = time.monotonic()
                if not dead():  # a request in flight when the link goes down is lost too
                    task = asyncio.ensure_future(real(peer_id, handler, *args, **kwargs))
                    try:
                        while not task.done() and not dead():
                            await asyncio.wait({task}, timeout=0.05)
                        if task.done():
                            return task.result()
                    finally:
                        task.cancel()
                await asyncio.sleep(max(0.0, started + timeout_s - time.monotonic()))
                raise PeerUnavailable(f"{handler} to {peer_id[-6:]}: the link is down")

            setattr(transport, name, down)


def _attempt_led_by(c, lead: int, xs: dict) -> tuple[dict, object]:
    """Round 0 attempt 0 on every node; the leader only serves (as the coordinator does): it trains
    nothing, so the attempt runs to its close. The attempts' futures, and the leader's slot."""
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == lead else c.segments(xs[i]),
                                                                trains=True, serves=True)) for i in range(4)}
    return runs, c.nodes[lead].server.attempts[(0, 0)]


def _wait_for(condition, within_s: float = 8.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not condition():
        time.sleep(0.05)


def test_a_leader_cut_off_after_the_contributions_arrived_does_not_commit_alone(make_cluster):
    # The coordinator's link went down in a netlab run while it led an attempt of a one-shard round:
    # it held every contribution (it is the shard's primary aggregator), claimed the attempt (nobody
    # answered, so nobody objected), sealed itself as the source and committed; the others, who
    # could not reach it, let the stand-in decide the same attempt from the shard's replicas, and
    # the round had two commits (the run's parameter hashes split). A commit of others' work now
    # needs a seal from some peer other than its leader: a leader that reaches nobody decides retry.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=2, max_shards=1, deadline_s=9.0,
                     slack_s=1.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    lead = c.ids.index(plan.leaders[0])
    assert plan.num_shards == 1 and plan.candidates(0)[0] == plan.leaders[0]  # it holds the whole shard
    cut = threading.Event()
    _cut_links(c, c.ids[lead], cut)
    xs = _inputs(4, c.numel, 41)
    contributors = [i for i in range(4) if i != lead]
    runs, slot = _attempt_led_by(c, lead, xs)
    # every contribution is at the leader, and a replica reported holding them all
    _wait_for(lambda: len(slot.have.get(0, {}).get(c.ids[lead], {})) == 3
              and any(a != c.ids[lead] and len(ids) == 3 for a, ids in slot.have.get(0, {}).items()))
    assert len(slot.have.get(0, {}).get(c.ids[lead], {})) == 3, "the contributions did not all reach the leader in time"
    cut.set()
    concurrent.futures.wait(list(runs.values()), timeout=120)
    out = {i: f.result(timeout=1) for i, f in runs.items()}
    commits = {n.book.committed[0][0] for n in c.nodes if 0 in n.book.committed}
    assert len(commits) == 1, f"round 0 has {len(commits)} commits"
    signed = commits.pop()
    assert 0 not in c.nodes[lead].book.committed, "the cut-off leader committed the round"
    mine = out[lead].decision
    assert mine is not None and mine.status == "retry" and mine.leader == c.ids[lead], mine
    d = out[contributors[0]].decision
    assert d is not None and d.status == "commit" and d.leader != c.ids[lead]
    assert all(out[i].included for i in contributors)
    cut.clear()  # the link is back: the leader takes the others' commit
    Cluster = type(c)
    Cluster.add_decision(c.nodes[lead], signed)
    means = [c.fetch(i, signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)
    assert torch.allclose(means[0], sum(c.sent(xs[i]) for i in contributors) / 3, atol=1e-6)


def test_a_leader_whose_replicas_do_not_answer_commits_with_a_fellow_leader_as_witness(make_cluster):
    # The other side of the rule above: a leader that is not cut off, only unlucky (the shard's one
    # replica froze after taking its copy), still commits. A fellow leader seals the commit as a
    # witness (it holds no shard, but now hands the commit to any later claimer).
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=4, codec_name="fp32", min_peers=2, max_shards=1, deadline_s=9.0, slack_s=1.0)
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
    lead, replica, witness = (c.ids.index(p) for p in plan.leaders)
    assert plan.candidates(0)[:2] == [c.ids[lead], c.ids[replica]]  # fp32: one replica, the next leader
    xs = _inputs(4, c.numel, 43)
    contributors = [i for i in range(4) if i != lead]
    runs, slot = _attempt_led_by(c, lead, xs)
    _wait_for(lambda: len(slot.have.get(0, {}).get(c.ids[replica], {})) == 3)
    assert len(slot.have[0][c.ids[replica]]) == 3, "the replica never reported every contribution"
    thaw = c.freeze(replica, 14)  # its daemon takes bytes; nothing answers
    concurrent.futures.wait([runs[i] for i in range(4) if i != replica], timeout=60)
    d = runs[lead].result(timeout=1).decision
    assert d is not None and d.status == "commit" and d.leader == c.ids[lead], d
    signed = runs[lead].result(timeout=1).signed
    assert c.nodes[witness].server.attempts[(0, 0)].sealed == signed  # the witness's seal
    thaw()
    concurrent.futures.wait([runs[replica]], timeout=60)
    assert all(runs[i].result(timeout=1).included for i in contributors if i != replica)  # it froze past its wait
    assert d.contributors == sorted(c.ids[i] for i in contributors)
    means = [c.fetch(i, signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)
    assert torch.allclose(means[0], sum(xs[i] for i in contributors) / 3, atol=1e-6)


def test_a_leader_whose_fellow_servers_died_commits_with_a_contributor_as_witness(make_cluster):
    # A coordinator and one public volunteer serve; a volunteer behind a NAT only trains. The public
    # one dies: its replicas and its fellow leader's seat are gone, and every attempt of the round
    # has the same servers (only a commit changes them). With nobody but the dead peer to seal, the
    # rule above would retry the round for good; the live contributor is the witness instead.
    from groundswell.protocol.plan import make_plan

    c = make_cluster(n=3, codec_name="fp32", min_peers=1, max_shards=1, deadline_s=9.0, slack_s=1.0, servers=(0, 1))
    plan = make_plan(c.ctx.run_id, 0, 0, c.ids[:2], c.ids, len(c.ctx.segment_numels), c.max_shards)
    lead = c.ids.index(plan.leaders[0])
    dead = 1 - lead
    c.nodes[dead].close()
    xs = _inputs(3, c.numel, 47)
    # the leader only serves; the NAT'ed volunteer (node 2) trains
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, c.segments(xs[i]) if i == 2 else None,
                                                                trains=i == 2, serves=i != 2)) for i in (lead, 2)}
    concurrent.futures.wait(list(runs.values()), timeout=90)
    d = runs[2].result(timeout=1).decision
    assert d is not None and d.status == "commit" and d.leader == c.ids[lead] and d.contributors == [c.ids[2]], d
    signed = runs[2].result(timeout=1).signed
    assert c.nodes[2].server.attempts[(0, 0)].sealed == signed  # the contributor's seal
    means = [c.fetch(i, signed) for i in (lead, 2)]
    assert torch.equal(means[0], means[1]) and torch.allclose(means[0], xs[2], atol=1e-6)
