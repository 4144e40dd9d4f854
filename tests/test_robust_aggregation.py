"""Robust aggregation: norm clipping to the median norm and the trimmed mean, bit-identical on every
peer, and on real nodes a scaled contribution is clipped in every shard."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from groundswell.compression import (
    RobustOptions,
    RobustStats,
    contribution_sq_norm,
    make_codec,
    robust_mean,
    robust_weights,
    tree_sum_of_squares,
)
from groundswell.compression.base import CodecError
from groundswell.compression.robust import clip_weights

sys.path.insert(0, str(Path(__file__).parent))


def test_tree_sum_of_squares_is_exact_enough_and_thread_independent():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 4095, 4096, 100_003):
        x = torch.randn(n, generator=g) * 1e3
        got = tree_sum_of_squares(x)
        exact = math.fsum(float(v) ** 2 for v in x.tolist())
        assert got == pytest.approx(exact, rel=1e-12)
    x = torch.randn(1 << 18, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tree_sum_of_squares(x)
        torch.set_num_threads(max(2, before))
        many = tree_sum_of_squares(x)
    finally:
        torch.set_num_threads(before)
    assert one == many  # the same bits, whatever the thread count
    assert tree_sum_of_squares(torch.zeros(0)) == 0.0


def _reference_tree(values: list[float]) -> float:
    """The documented tree, in plain Python floats: the last half added onto the first half."""
    v = [x * x for x in values]
    while len(v) > 1:
        half, keep = len(v) // 2, len(v) - len(v) // 2
        v = [v[i] + v[keep + i] for i in range(half)] + v[half:keep]
    return v[0] if v else 0.0


def test_tree_sum_of_squares_is_the_documented_tree_and_leaves_its_input_alone():
    # every peer of a run must sum in this one order: a different tree differs in the last bits,
    # which can move a clipping factor and so the aggregate's bytes
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 5, 7, 8, 31, 100, 257, 1000):
        x = torch.randn(n, generator=g) * torch.logspace(-8, 8, n).float()
        assert tree_sum_of_squares(x) == _reference_tree([float(v) for v in x.tolist()])
    x64 = torch.randn(1001, generator=g, dtype=torch.float64)
    before = x64.clone()
    tree_sum_of_squares(x64)
    assert torch.equal(x64, before)


def test_a_dense_codecs_norm_counts_its_zeros_and_a_sparse_codecs_only_its_kept_entries():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, 4096).float()
    x[::3] = 0.0
    dense = make_codec("fp32")
    row = [dense.encode(x[:2048]), dense.encode(x[2048:])]
    decoded = [dense.decode(p) for p in row]
    with_zeros = tree_sum_of_squares(decoded[0]) + tree_sum_of_squares(decoded[1])
    assert with_zeros != (tree_sum_of_squares(decoded[0][decoded[0] != 0])
                          + tree_sum_of_squares(decoded[1][decoded[1] != 0]))  # (the two trees differ here)
    assert contribution_sq_norm(dense, row) == with_zeros
    sparse = make_codec("sparseloco")
    row = [sparse.encode(x[:2048]), sparse.encode(x[2048:])]
    kept = [sparse.decode(p) for p in row]
    assert contribution_sq_norm(sparse, row) == (tree_sum_of_squares(kept[0][kept[0] != 0])
                                                 + tree_sum_of_squares(kept[1][kept[1] != 0]))


def test_clip_weights_bound_every_norm_by_the_median():
    sq = [1.0, 4.0, 9.0, 10_000.0]  # norms 1, 2, 3, 100; lower median norm 2
    w = clip_weights(sq, clip=1.0)
    assert w[0] == 1.0 and w[1] == 1.0
    assert w[2] == pytest.approx(2 / 3) and w[3] == pytest.approx(2 / 100)
    assert clip_weights(sq, clip=0.0) == [1.0] * 4  # off
    # an all-zero contribution (no step made) sets no reference: one of two peers' zeros used to
    # scale the other's whole update to nothing
    assert clip_weights([0.0, 16.0], clip=1.0) == [1.0, 1.0]
    assert clip_weights([0.0, 0.0, 1.0], clip=1.0) == [1.0, 1.0, 1.0]
    assert clip_weights([0.0, 1.0, 4.0, 100.0], clip=1.0) == [1.0, 1.0, 1.0, pytest.approx(2 / 10)]
    assert clip_weights([0.0, 0.0], clip=1.0) == [1.0, 1.0]
    # the reference is the lower median: two attackers of four cannot raise it
    assert clip_weights([1.0, 1.0, 1e6, 1e6], clip=1.0)[2] == pytest.approx(1e-3)


@pytest.mark.parametrize("codec_name", ["fp32", "int8", "sparseloco"])
def test_robust_mean_clips_the_outlier_and_is_the_plain_mean_when_off(codec_name):
    codec = make_codec(codec_name)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 4096, generator=g) for _ in range(5)]
    xs[4] = xs[4] * 1000  # a scaled (byzantine) contribution
    rows = [[codec.encode(x[0]), codec.encode(x[1])] for x in xs]
    plain = robust_mean(codec, rows, RobustOptions(clip=0.0))
    for i in range(2):
        assert torch.equal(plain[i], codec.aggregate([r[i] for r in rows]))
    stats = RobustStats()
    clipped = robust_mean(codec, rows, RobustOptions(clip=1.0), stats)
    assert stats.clipped >= {4} and set(stats.weights) == stats.clipped
    assert all(0 < w < 1 and w == float(torch.tensor(w, dtype=torch.float32)) for w in stats.weights.values())
    # the factors the mean used: the scaled contributions, summed and averaged, give its bits
    scaled = [torch.cat([codec.decode(p) for p in r]) * torch.tensor(stats.weights.get(c, 1.0))
              for c, r in enumerate(rows)]
    assert torch.allclose(torch.cat(clipped), sum(scaled) / 5, atol=1e-6 * float(sum(scaled).abs().max()))
    honest = torch.stack([torch.cat([codec.decode(p) for p in r]) for r in rows[:4]])
    out = torch.cat(clipped)
    median = sorted(float(h.norm()) for h in honest)[2]  # the median of the five (the outlier is the largest)
    assert float(out.norm()) <= median * 1.0001  # every contribution counts with a norm of at most the median
    assert float(torch.cat(plain).norm()) > 50 * float(out.norm())
    again = robust_mean(codec, rows, RobustOptions(clip=1.0))
    assert all(torch.equal(a, b) for a, b in zip(again, clipped))  # deterministic


class _DenseOnly:
    """The sparseloco codec without `entries`: forces robust_mean's dense path."""

    def __init__(self, codec) -> None:
        self.name, self._codec = codec.name, codec

    def decode(self, payload, device=None):
        return self._codec.decode(payload, device)

    def aggregate(self, payloads, device=None):
        return self._codec.aggregate(payloads, device)


@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0), (1.0, 30.0, 1.0, 0.5), (2.0,), (1e-30, 1.0, 1e30)])
def test_sparse_clipped_mean_is_bit_identical_to_the_dense_one(scales):
    # Every peer of a sparse run computes this mean itself: the fast path from the kept entries
    # must give the dense path's bits exactly (sign of zero included), and clip the same peers.
    codec = make_codec("sparseloco", chunk=64, k=4)
    g = torch.Generator().manual_seed(len(scales))
    rows = []
    for c, scale in enumerate(scales):
        x = torch.randn(64 * 9 + 13, generator=g) * scale
        x[: 64 * 2] = 0.0 if c % 2 else -0.0  # all-zero chunks: scale 0, values +-0
        rows.append([codec.encode(x[:300]), codec.encode(x[300:])])
    clipped = set()
    for clip in (1.0, 0.5, 3.0):
        fast_stats, dense_stats = RobustStats(), RobustStats()
        fast = robust_mean(codec, rows, RobustOptions(clip=clip), fast_stats)
        dense = robust_mean(_DenseOnly(codec), rows, RobustOptions(clip=clip), dense_stats)
        assert fast_stats.clipped == dense_stats.clipped
        for a, b in zip(fast, dense, strict=True):
            assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
        clipped |= fast_stats.clipped
    if len(scales) > 1:
        assert clipped, "nothing was clipped: the weighted path went untested"


@pytest.mark.parametrize("options", [RobustOptions(clip=0.0), RobustOptions(clip=1.0), RobustOptions(clip=1.0, trim=0.2)])
@pytest.mark.parametrize("codec_name", ["fp32", "sparseloco"])
def test_means_written_into_the_callers_buffers_are_the_same_bits(codec_name, options):
    codec = make_codec(codec_name)
    g = torch.Generator().manual_seed(5)
    rows = [[codec.encode(torch.randn(4096, generator=g) * s), codec.encode(torch.randn(1000, generator=g) * s)]
            for s in (1.0, 2.0, 50.0, 0.5, 1.0)]
    fresh = robust_mean(codec, rows, options)
    whole = torch.full((5096,), float("nan"))  # stale contents must not leak into a mean
    got = robust_mean(codec, rows, options, out=[whole[:4096], whole[4096:]])
    for a, b, buf in zip(fresh, got, (whole[:4096], whole[4096:]), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and b.data_ptr() == buf.data_ptr()
    assert torch.equal(torch.cat(fresh).view(torch.int32), whole.view(torch.int32))
    from groundswell.compression import CodecError

    for bad in ([whole[:4096]], [whole[:4096], whole[4096:5095]], [whole[:4096], torch.zeros(1000, dtype=torch.float64)],
                [whole[:4096], whole.view(2, -1)[:, :500]],  # too few, too short, not fp32, not contiguous
                [whole[:4096], torch.empty(1000, device="meta")]):  # not on the CPU (a CUDA buffer, say)
        with pytest.raises(CodecError, match="output buffers"):
            robust_mean(codec, rows, options, out=bad)


@pytest.mark.parametrize("options", [RobustOptions(clip=0.0), RobustOptions(clip=1.0), RobustOptions(clip=0.5),
                                     RobustOptions(clip=1.0, trim=0.2)])
@pytest.mark.parametrize("codec_name", ["fp32", "sparseloco"])
def test_the_clip_factors_alone_are_the_ones_the_mean_takes(codec_name, options):
    # A contribution settled late learns where the mean took it clipped without the mean itself.
    codec = make_codec(codec_name)
    g = torch.Generator().manual_seed(9)
    rows = [[codec.encode(torch.randn(4096, generator=g) * s), codec.encode(torch.randn(1000, generator=g) * s)]
            for s in (1.0, 2.0, 50.0, 0.5, 1.0)]
    stats = RobustStats()
    robust_mean(codec, rows, options, stats)
    weights = robust_weights(codec, rows, options)
    assert {c: w for c, w in enumerate(weights) if w < 1.0} == stats.weights
    assert any(w < 1.0 for w in weights) == (options.clip > 0)


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    codec = make_codec("fp32")
    xs = [torch.full((8,), v) for v in (1.0, 2.0, 3.0, 4.0, 1e9)]
    rows = [[codec.encode(x)] for x in xs]
    out = robust_mean(codec, rows, RobustOptions(clip=0.0, trim=0.2))[0]
    assert torch.equal(out, torch.full((8,), 3.0))  # mean of 2, 3, 4
    with pytest.raises(ValueError):
        RobustOptions(trim=0.5)
    with pytest.raises(ValueError):
        RobustOptions(clip=-1.0)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec_name", ["fp32", "sparseloco"])
def test_a_scaled_contribution_is_clipped_on_every_peer(codec_name):
    from swarm_harness import Cluster

    c = Cluster(n=4, codec_name=codec_name, numel=8 * 4096, min_peers=4, robust=RobustOptions(clip=1.0))
    try:
        g = torch.Generator().manual_seed(7)
        xs = {i: torch.randn(c.numel, generator=g) for i in range(4)}
        xs[3] = xs[3] * 1000
        out = c.attempt(0, xs)
        d = out[0].decision
        assert d.status == "commit" and len(d.contributors) == 4
        means = [c.fetch(i, out[i].signed) for i in range(4)]
        assert all(torch.equal(m, means[0]) for m in means)  # bit-identical on every peer
        attacker = c.ids[3]
        for node in c.nodes:
            assert node.client.clipped[0][attacker] == d.num_shards  # clipped in every shard
        # the attacker learns where, and by how much, its contribution was scaled (its error
        # feedback keeps the rest); a dense mean's shards carry the factors its aggregators took
        mine = c.nodes[3].client.own_scaled[0]  # one range per shard, covering the whole vector
        assert len(mine) == d.num_shards and mine[0][0] == 0 and mine[-1][1] == c.numel
        assert all(mine[i][1] == mine[i + 1][0] for i in range(len(mine) - 1))
        assert all(0 < w < 2e-3 for _, _, w in mine)  # about the median norm over 1000x its own
        # an honest peer above the (lower) median is clipped a little too: it learns by how much
        assert all(0.5 < w < 1 for i in range(3) for _, _, w in c.nodes[i].client.own_scaled[0])
        # a peer that settles its contribution late works the same factors out from the shards
        # (sparse: from the signed contributions alone, without the mean)
        for i in range(4):
            client, noted = c.nodes[i].client, c.nodes[i].client.own_scaled.pop(0)
            c.nodes[i].call(client.note_own_scaled(out[i].signed), timeout_s=60)
            assert client.own_scaled[0] == noted
        honest = sum(xs[i] for i in range(3)) / 4
        # clipped to the median norm: the attacker moves the mean by about |x| / 4, not 1000 |x| / 4
        assert float((means[0] - honest).norm()) < 2 * float(xs[0].norm()) / 4
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_aggregate_that_overflows_with_clipping_off_is_applied_as_zero_there_on_every_peer():
    # each contribution is finite, their sum near fp32's limit is not: every peer must still end
    # with the same finite parameters
    from swarm_harness import Cluster

    c = Cluster(n=4, codec_name="fp32", numel=8 * 4096, min_peers=4, robust=RobustOptions(clip=0.0))
    try:
        xs = {i: torch.full((c.numel,), 0.5) for i in range(4)}
        for i in (0, 1):
            xs[i][:10] = 3e38
        out = c.attempt(0, xs)
        assert out[0].decision.status == "commit"
        means = [c.fetch(i, out[i].signed) for i in range(4)]
        assert all(torch.equal(m, means[0]) for m in means)
        assert bool(torch.isfinite(means[0]).all()) and means[0][:10].eq(0).all() and means[0][10:].eq(0.5).all()
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_aggregator_that_alters_a_contribution_is_caught_and_bypassed():
    from groundswell.compression import Payload
    from groundswell.protocol.envelope import seal, unseal
    from groundswell.protocol.schema import AggregateShard, ProtocolError, ShardContribution
    from swarm_harness import Cluster

    c = Cluster(n=4, codec_name="sparseloco", numel=8 * 4096, min_peers=4)
    try:
        node0 = c.nodes[0]
        plan = node0.call(node0.server.plan(0, 0, 5.0), timeout_s=10)
        forger_id = next(a for a in plan.aggregators if a not in plan.leaders)
        forger = c.nodes[c.ids.index(forger_id)]
        honest_build = forger.server._build

        def forged_build(signed, shard, held, first, sq_norms=None):  # swap a payload for noise, re-signed
            agg = honest_build(signed, shard, held, first, sq_norms)
            _, msg = unseal(agg.parts[0], c.ctx.run_id, ShardContribution, max_bytes=1 << 24)
            noise = [c.codec.encode(torch.randn(len(c.codec.decode(Payload.from_bytes(s))))).to_bytes()
                     for s in msg.segments]
            fake = seal(forger.identity, c.ctx.run_id, ShardContribution(msg.round, msg.attempt, msg.shard,
                                                                         msg.first_segment, noise))
            return AggregateShard(agg.decision, agg.shard, agg.mode, [fake, *agg.parts[1:]])

        forger.server._build = forged_build
        g = torch.Generator().manual_seed(11)
        xs = {i: torch.randn(c.numel, generator=g) for i in range(4)}
        for attempt in range(3):  # a round the leader cannot gather is retried (roles reshuffle): also fine
            out = c.attempt(0, xs, attempt=attempt)
            if out[0].decision is not None and out[0].decision.status == "commit":
                break
        assert out[0].decision.status == "commit" and len(out[0].decision.contributors) == 4
        honest = [i for i in range(4) if c.ids[i] != forger_id]
        means = [c.fetch(i, out[i].signed) for i in honest]
        assert all(torch.equal(m, means[0]) for m in means)


        expected = sum(c.sent(xs[i]) for i in range(4)) / 4
        assert float((means[0] - expected).norm()) < 1e-5 * float(expected.norm())
        # Whether an honest peer happened to fetch from the forger depends on who sourced and who
        # replicated which shard; ask the forger for every shard it built, and check each is caught.
        signed = out[0].signed
        built = [sh for (r, sh), agg in forger.server.aggregates.items() if r == 0 and agg.decision == signed]
        assert built, "the forger built no shard of the commit: the test exercised nothing"
        asker = c.nodes[honest[0]]
        for sh in built:
            async def forged_reply(sh=sh):
                from groundswell.protocol.schema import AggregateRequest

                agg = await asker.transport.request(forger_id, "get-aggregate", AggregateRequest(0, sh, 1.0),
                                                    AggregateShard, timeout_s=30, max_reply=1 << 26)
                plan = await asker.server.plan(0, out[0].decision.attempt, 5.0)
                first, stop = plan.shard_segments[sh]
                asker.client._contributions(out[0].decision, sh, first, stop, agg)

            with pytest.raises(ProtocolError, match="not the one the commit pins|signed by"):
                asker.call(forged_reply(), timeout_s=60)
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_verified_aggregates_ship_signed_dense_contributions():
    from swarm_harness import Cluster

    c = Cluster(n=3, codec_name="int8", min_peers=3, verify_aggregates=True, robust=RobustOptions(clip=1.0))
    try:
        g = torch.Generator().manual_seed(2)
        xs = {i: torch.randn(c.numel, generator=g) for i in range(3)}
        out = c.attempt(0, xs)
        assert out[0].decision.status == "commit"
        means = [c.fetch(i, out[i].signed) for i in range(3)]
        assert all(torch.equal(m, means[0]) for m in means)
        held = [agg for node in c.nodes for agg in node.server.aggregates.values()]
        assert held and all(agg.mode == "signed" and len(agg.parts) == 3 for agg in held)
        assert float((means[0] - sum(xs.values()) / 3).norm()) < 0.2 * float(means[0].norm())  # int8 + clipping
    finally:
        c.close()


@pytest.mark.parametrize("codec_name", ["fp32", "sparseloco"])
def test_contributions_of_other_shapes_are_refused_not_broadcast(codec_name):
    """Found by a review: a one-value dense contribution broadcast over every element of the
    clipped sum, and a shorter sparse one scattered into the wrong places (or raised IndexError)."""
    codec = make_codec(codec_name, chunk=64, k=4) if codec_name == "sparseloco" else make_codec(codec_name)
    good = [codec.encode(torch.zeros(256)), codec.encode(torch.zeros(256))]
    other = codec.encode(torch.full((128,), 5.0) if codec_name == "sparseloco" else torch.full((1,), 5.0))
    rows = [[good[0]], [good[1]], [other]]
    options = RobustOptions(clip=2.0)
    with pytest.raises(CodecError, match="shapes"):
        robust_mean(codec, rows, options)
    with pytest.raises(CodecError, match="shapes"):
        robust_weights(codec, rows, options)
