"""A trainer or leader whose process died does not hold the round to its close: once the others
are in, the leaders probe the silent trainers, drop those no stream can reach, and a stand-in
whose leaders ahead are all gone decides at once. A live trainer that is merely slow is waited for."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import inputs as _inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _plan(c, attempt: int = 0):
    from groundswell.protocol.plan import make_plan

    return make_plan(c.ctx.run_id, 0, attempt, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)


def test_a_dead_leader_that_trains_does_not_hold_the_round_to_its_close(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=6 * 4096, min_peers=2, deadline_s=30.0, slack_s=1.0)
    dead = c.ids.index(_plan(c).leaders[0])
    c.nodes[dead].close()  # killed while training: a trainer of the round, and its first leader
    live = [i for i in range(4) if i != dead]
    xs = _inputs(4, c.numel, 7)
    start = time.monotonic()
    out = c.attempt(0, {i: xs[i] for i in live})
    took = time.monotonic() - start
    d = out[live[0]].decision
    assert d is not None and d.status == "commit" and d.contributors == sorted(c.ids[i] for i in live)
    # the close is 29 s after the round opened; two probes a slack apart and the decision: seconds
    assert took < 12.0, f"the round took {took:.1f} s with its dead member"
    means = [c.fetch(i, out[i].signed) for i in live]
    assert all(torch.equal(m, means[0]) for m in means)
    assert all(out[i].decision.status == "commit" and out[i].signed == out[live[0]].signed for i in live)


def test_a_slow_trainer_that_is_alive_is_waited_for(make_cluster):
    c = make_cluster(n=4, codec_name="sparseloco", numel=6 * 4096, min_peers=2, deadline_s=30.0, slack_s=1.0)
    xs = _inputs(4, c.numel, 8)
    slow = 3
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, c.segments(xs[i]), trains=True, serves=True))
            for i in range(3)}
    time.sleep(8 * c.slack_s)  # still training, as far as the leaders know: it answers their probes
    late = c.nodes[slow].submit(c.nodes[slow].client.run_attempt(0, 0, c.segments(xs[slow]), trains=True,
                                                                  serves=True))
    out = {i: f.result(timeout=90) for i, f in [*runs.items(), (slow, late)]}
    d = out[0].decision
    assert d is not None and d.status == "commit" and d.contributors == sorted(c.ids)
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)


def test_a_trainer_that_cannot_be_reached_once_is_still_waited_for(make_cluster, monkeypatch):
    """One failed dial is no death (a NAT'ed peer's relay hiccup): `DEAD_PROBES` in a row are."""
    from groundswell.protocol import claims, trainer_probes
    from groundswell.protocol.transport import PeerDead

    c = make_cluster(n=4, codec_name="sparseloco", numel=6 * 4096, min_peers=2, deadline_s=30.0, slack_s=1.0)
    xs = _inputs(4, c.numel, 9)
    first = c.ids.index(_plan(c).leaders[0])
    slow = next(i for i in (3, 2) if i != first)  # probed by the first leader, which closes early
    flaky = c.ids[slow]
    failed = threading.Event()
    real = claims.ping
    probers: set[int] = set()

    async def ping_once_failing(transport, peer, round_id, attempt, timeout_s):
        if peer == flaky and id(transport) not in probers:  # each leader's first probe of it fails
            probers.add(id(transport))
            failed.set()
            return PeerDead("dial failed")
        return await real(transport, peer, round_id, attempt, timeout_s)

    monkeypatch.setattr(claims, "ping", ping_once_failing)
    assert trainer_probes.DEAD_PROBES == 2  # (with 1, each leader would drop it at its first probe)
    runs = {i: c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, c.segments(xs[i]), trains=True, serves=True))
            for i in range(4) if i != slow}
    time.sleep(6 * c.slack_s)
    assert failed.is_set()  # the leaders did probe it
    late = c.nodes[slow].submit(c.nodes[slow].client.run_attempt(0, 0, c.segments(xs[slow]), trains=True,
                                                                  serves=True))
    out = {i: f.result(timeout=90) for i, f in [*runs.items(), (slow, late)]}
    assert out[0].decision.status == "commit" and out[0].decision.contributors == sorted(c.ids)
    means = [c.fetch(i, out[i].signed) for i in range(4)]
    assert all(torch.equal(m, means[0]) for m in means)
