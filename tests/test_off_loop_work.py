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
    import groundswell.protocol.aggregator as aggregator
    import groundswell.protocol.fetch as fetch
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
    wanted = {"check contribution"} | ({"build shard", "decode dense mean"} if codec_name == "fp32"
                                       else {"mean of signed contributions"})
    assert wanted <= kinds, f"the round exercised only {kinds}"
    assert not [name for name, on_loop in calls if on_loop], "tensor work ran on the network loop"
