"""scripts/bench_exchange.py end to end on a tiny case: 2 peer processes, one sparseloco round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_exchange_sparseloco_two_peers(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A plain module from scripts/; it stays on sys.path while the test runs because the spawned
    # workers unpickle their target by module name, with the parent's sys.path.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_exchange
    params = 200_000
    result = bench_exchange.main(["--peers", "2", "--params", str(params), "--codecs", "sparseloco",
                                  "--repeats", "1", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(result))

    assert result["peers"] == 2 and result["params"] == params
    assert result["gloo_allreduce_s"] > 0
    assert set(result["codecs"]) == {"sparseloco"}
    sl = result["codecs"]["sparseloco"]
    for key in ("round_s", "ratio_vs_gloo", "bytes_sent_per_peer", "bytes_received_per_peer", "identical",
                "rel_error"):
        assert key in sl, key
    assert sl["identical"] is True
    assert sl["exact"] is True  # the protocol's robust mean of what both peers sent, recomputed by peer 0
    assert sl["round_s"] > 0
    # each method's ratio is to the gloo rounds timed right before it, not to one run-wide figure
    assert sl["ratio_vs_gloo"] == pytest.approx(sl["round_s"] / sl["gloo_round_s"])
    assert sl["gloo_round_s"] == result["gloo"]["by_method"]["sparseloco"]["round_s"]
    assert sorted(result["gloo"]["by_method"]) == ["p2pd_floor", "sparseloco"]
    assert len(result["gloo"]["round_s_all"]) == 2  # 1 measured gloo round next to each of the 2 methods
    assert result["gloo"]["identical"] is True
    assert result["run"]["argv"][1:] == ["--peers", "2", "--params", str(params), "--codecs", "sparseloco",
                                         "--repeats", "1", "--json"]
    assert 0 < sl["bytes_sent_per_peer"] < 4 * params  # far below a dense fp32 copy
    assert 0 < sl["bytes_received_per_peer"] < 4 * params
    assert 0 < sl["rel_error"] < 1.5  # lossy (top-k without error feedback), but a mean of the inputs
    assert result["goals"]["sparseloco_faster_than_gloo"] == (sl["round_s"] < sl["gloo_round_s"])  # all identical

    # the transport's floor ran among the same processes: every peer received exactly what a ring
    # all-reduce moves per peer, 2(N-1)/N x 4P bytes (the bench fails if any peer got other than that)
    floor = result["p2pd_floor"]
    assert floor["bytes_received_per_peer"] == 2 * (2 - 1) / 2 * 4 * params
    assert len(floor["round_s_all"]) == 1 and floor["round_s"] > 0
    assert floor["ratio_vs_gloo"] == pytest.approx(floor["round_s"] / floor["gloo_round_s"])
    assert floor["identical"] is None  # the floor computes no mean: nothing was compared
    assert floor["bytes_sent_per_peer"] == floor["bytes_received_per_peer"]  # each peer sends what it takes


def test_the_floor_splits_a_tensor_into_slices_that_cover_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from _p2p_floor import Floor

    for n, numel in ((2, 10), (3, 10), (4, 25_000_003)):
        floors = [Floor(None, rank, n, memoryview(bytearray(4 * numel))) for rank in range(n)]
        bounds = floors[0].bounds
        assert bounds[0][0] == 0 and bounds[-1][1] == 4 * numel
        assert all(a % 4 == 0 and a <= b for a, b in bounds)
        assert all(bounds[j][1] == bounds[j + 1][0] for j in range(n - 1))
        # what peer i must receive per round: N-1 copies of its slice, then every other slice once
        for rank, f in enumerate(floors):
            mine = bounds[rank][1] - bounds[rank][0]
            assert f.expected_bytes() == (n - 1) * mine + 4 * numel - mine


def test_a_method_names_a_codec_and_optionally_its_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_exchange
    assert bench_exchange.parse_method("fp32") == ("fp32", None)
    assert bench_exchange.parse_method("int8@0") == ("int8", 0)
    for bad in ("fp32@", "fp32@x", "fp32@4", "fp32@-1"):
        if bad == "fp32@":
            assert bench_exchange.parse_method(bad) == ("fp32", None)
            continue
        with pytest.raises(bench_exchange.BenchError):
            bench_exchange.parse_method(bad)
    with pytest.raises(SystemExit):
        bench_exchange.parse_args(["--codecs", "fp32@9"])


def test_a_round_spans_from_the_first_start_to_the_last_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_exchange

    def rec(t0: float, t3: float, sha: str | None, warmup: bool = False) -> dict:
        return {"warmup": warmup, "t0": t0, "t3": t3, "sha": sha, "rel_error": None}

    # peer 0 starts early and ends early, peer 1 starts late and ends late: the round is neither
    # peer's own duration (1.0 each) but the span 10.0 .. 11.5
    per_peer = [{"rounds": [rec(0.0, 9.0, "a", warmup=True), rec(10.0, 11.0, "b")]},
                {"rounds": [rec(0.5, 9.0, "a", warmup=True), rec(10.5, 11.5, "b")]}]
    out = bench_exchange._summarize(per_peer, 2)
    assert out["round_s_all"] == [1.5] and out["identical"] is True
    per_peer[1]["rounds"][0]["sha"] = "c"  # a warm-up round that disagrees still counts against identical
    assert bench_exchange._summarize(per_peer, 2)["identical"] is False
    for p in per_peer:
        for r in p["rounds"]:
            r["sha"] = None  # nothing hashed (the floor): nothing to call identical
    assert bench_exchange._summarize(per_peer, 2)["identical"] is None


def test_the_reference_check_tells_a_wrong_mean_from_the_right_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by a review: every peer holding the same mean was the only check, and the peers agree
    # by construction (they fetch the same sealed shards) even on a wrong mean. One fp32 peer:
    # the protocol's mean of its own contribution is its tensor, bit for bit.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from _exchange_worker import _Worker, free_port
    from groundswell.compression import encode_segments, make_codec, segment_bounds, segment_size
    from groundswell.peer.run_state import RunContext

    params = 4 * 8192
    worker = object.__new__(_Worker)
    worker.rank, worker.n, worker.ids, worker.codec = 0, 1, ["A"], make_codec("fp32")
    segment = segment_size(params, 4)
    numels = tuple(b - a for a, b in segment_bounds(params, segment))
    worker.ctx = RunContext(run_id="r", min_peers=1, deadline_s=30.0, slack_s=5.0, max_shards=4, segment_numels=numels,
                            codec=worker.codec, max_payload_bytes=4 * params + 4096, allowlist=None)
    x = torch.randn(params, generator=torch.Generator().manual_seed(0))
    segments = [p.to_bytes() for p in encode_segments(worker.codec, x, segment)]
    decision = SimpleNamespace(num_shards=2, contributors=["A"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert worker._is_reference_mean(decision, segments, x.clone()) is True
        wrong = x.clone()
        wrong[12345] = torch.nextafter(wrong[12345], torch.tensor(float("inf")))  # one ulp off, one value
        assert worker._is_reference_mean(decision, segments, wrong) is False
    finally:
        dist.destroy_process_group()
    # and a method whose mean was not exact meets no goal
    import bench_exchange

    gloo = {"identical": True}
    assert bench_exchange._goal_ok({"identical": True, "exact": True}, gloo)
    assert not bench_exchange._goal_ok({"identical": True, "exact": False}, gloo)
