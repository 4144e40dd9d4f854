"""The tensor work of a round (checking a contribution, building a shard's mean, decoding a
commit's aggregate) runs in worker threads, not on a node's network loop, so that a large model's
round does not stall the node's handlers and heartbeat."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

pytestmark = pytest.mark.timeout(240)


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("codec_name", ["fp32", "sparseloco"])
def test_a_rounds_tensor_work_runs_off_the_network_loop(monkeypatch, codec_name):
    from groundswell.protocol import aggregator, fetch
    from swarm_harness import Cluster

    calls: list[tuple[str, bool]] = []
    lock = threading.Lock()

    def spy(name, real):
        def wrapped(*args, **kwargs):
            with lock:
                calls.append((name, _on_loop()))
            return real(*args, **kwargs)
        return wrapped

    # contributions checked on arrival, a dense shard's mean at the seal, the fetched commit's mean
    monkeypatch.setattr(aggregator, "validate_segments", spy("check contribution", aggregator.validate_segments))
    monkeypatch.setattr(aggregator, "robust_mean", spy("build shard", aggregator.robust_mean))
    monkeypatch.setattr(fetch, "robust_mean", spy("mean of signed contributions", fetch.robust_mean))
    monkeypatch.setattr(fetch, "_dense_weight", spy("decode dense mean", fetch._dense_weight))
    monkeypatch.setattr(fetch, "validate_segments", spy("check fetched shard", fetch.validate_segments))
    c = Cluster(n=3, codec_name=codec_name, numel=6 * 4096, min_peers=3)
    try:
        g = torch.Generator().manual_seed(5)
        xs = {i: torch.randn(c.numel, generator=g) for i in range(3)}
        for attempt in range(3):
            out = c.attempt(0, xs, attempt=attempt)
            if out[0].decision is not None and out[0].decision.status == "commit":
                break
        assert out[0].decision.status == "commit"
        means = [c.fetch(i, out[i].signed) for i in range(3)]
        assert all(torch.equal(m, means[0]) for m in means)
        expected = sum(c.sent(xs[i]) for i in range(3)) / 3
        assert torch.allclose(means[0], expected, atol=1e-6)
    finally:
        c.close()
    kinds = {name for name, _ in calls}
    # (sparse contributions a node took as an aggregator are parsed once: a fetch reuses them)
    wanted = {"check contribution"} | ({"build shard", "decode dense mean", "check fetched shard"}
                                       if codec_name == "fp32" else {"mean of signed contributions"})
    assert wanted <= kinds, f"the round exercised only {kinds}"
    assert not [name for name, on_loop in calls if on_loop], "tensor work ran on the network loop"


def test_contributions_arriving_together_still_fill_a_shard_only_up_to_its_room():
    """Found by a review of this change: checking a contribution in a worker thread lets others
    land meanwhile, and all of them had passed the room check before any was stored."""
    import torch
    from groundswell.compression.segments import encode_segments
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import ProtocolError, ShardContribution
    from groundswell.protocol.shards import MIN_ROOM
    from inproc_harness import RUN, make_target

    gen = make_target()
    t = next(gen)
    try:
        plan = t.loop.run_until_complete(t.server.plan(0, 0, 0.0))
        shard = next(s for s in range(plan.num_shards) if t.me.peer_id in plan.candidates(s)[:4])
        first, stop = plan.shard_segments[shard]
        segments = [p.to_bytes() for p in encode_segments(t.ctx.codec, torch.randn(sum(t.ctx.segment_numels)),
                                                           4096)][first:stop]
        msg = ShardContribution(0, 0, shard, first, segments)
        senders = [Identity.generate() for _ in range(3 * MIN_ROOM)]

        async def all_at_once() -> list:
            return await asyncio.gather(*(t.server._on_contribute(s.peer_id, msg, seal(s, RUN, msg)) for s in senders),
                                        return_exceptions=True)

        answers = t.loop.run_until_complete(all_at_once())
        held = t.server.attempts[(0, 0)].contributions[shard]
        assert len(held) == MIN_ROOM, f"{len(held)} contributions held, room for {MIN_ROOM}"
        full = [a for a in answers if isinstance(a, ProtocolError) and a.reason == "slot-full"]
        assert len(full) == len(senders) - MIN_ROOM
        # Found by a review: fresh identities that filled the shard first shut the round's own
        # trainers out of it. A planned trainer always finds a place.
        trainer = next(p for p in t.peers if p.peer_id in plan.trainers)
        ack = t.loop.run_until_complete(t.server._on_contribute(trainer.peer_id, msg, seal(trainer, RUN, msg)))
        assert ack.ok and trainer.peer_id in held and len(held) == MIN_ROOM + 1
    finally:
        next(gen, None)
