"""SparseLoCo's codec: canonical top-k selection (the fast path against references), exact byte
counts and budgets, least-squares levels, deterministic decode, and its parse cache."""

from __future__ import annotations

import math

import pytest
import torch
from groundswell.compression import Payload, SparseLoCoCodec
from groundswell.compression.base import mean_of_decoded
from groundswell.compression.topk import _plan, exact_topk_indices, topk_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codecs import _randn, _round_trip


def _canonical_topk(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Independent reference: stable sort by -|x| (ties -> lowest index), first k, ascending."""
    order = torch.sort(-rows.abs(), dim=1, stable=True).indices[:, :k]
    return order.sort(1).values


# ---------------------------------------------------------------- sparseloco: selection


def test_fast_path_is_actually_taken_for_the_default_layout() -> None:
    assert _plan(4096, 64) == (16, 256)
    assert _plan(4096, 2048) is None and _plan(4000, 64) is None


@pytest.mark.parametrize(("rows", "width", "k"), [(300, 4096, 64), (50, 1024, 16), (40, 256, 1), (33, 64, 2)])
def test_fast_topk_matches_torch_topk_on_random_data(rows: int, width: int, k: int) -> None:
    x = _randn(rows, width, seed=rows)
    idx, vals = topk_rows(x, k)
    expected = torch.topk(x.abs(), k, dim=1).indices.sort(1).values
    assert torch.equal(idx, expected)
    assert torch.equal(vals, x.gather(1, expected))


def _adversarial_rows(width: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(12, width, generator=gen)
    x[0] = 0.0  # all zeros
    x[1] = 0.25  # constant
    x[2] = torch.randint(-2, 3, (width,), generator=gen).float()  # heavy ties
    x[3] = 0.0
    x[3, :5] = torch.tensor([3.0, -1.0, 2.0, 2.0, -3.0])  # fewer nonzeros than k
    x[4] = x[4].to(torch.bfloat16).float()  # quantised: ties at the k-th value
    x[5, ::3] = 7.0  # many equal maxima, one per column and more
    x[6] = torch.arange(width, dtype=torch.float32)  # sorted ascending
    x[7] = -x[6].flip(0)  # sorted descending, negative
    x[8, :] = 1e-40  # subnormals
    x[8, 17] = 2e-40
    x[9] = x[9].abs().round()  # small integers, huge tie groups
    plan = _plan(width, k)
    assert plan is not None
    g = plan[1]
    x[10, 5::g] = 5.0 + torch.arange(width // g) * 0.125  # one fast-path column holds many winners
    x[11, 7::g] = 5.0  # ... and ties among them
    return x


@pytest.mark.parametrize(("width", "k"), [(4096, 64), (256, 4), (64, 2)])
def test_fast_topk_is_canonical_on_adversarial_data(width: int, k: int) -> None:
    for seed in range(3):
        x = _adversarial_rows(width, k, seed)
        idx, vals = topk_rows(x, k)
        assert torch.equal(idx, _canonical_topk(x, k))
        assert torch.equal(vals, x.gather(1, idx))
        # any valid top-k: the kept magnitudes are the k largest ones
        top = torch.topk(x.abs(), k, dim=1).values.sort(1).values
        assert torch.equal(vals.abs().sort(1).values, top)


@settings(max_examples=60, deadline=None)
@given(
    log_width=st.integers(4, 10),
    k_frac=st.integers(1, 8),
    rows=st.integers(1, 20),
    levels=st.integers(1, 50),
    seed=st.integers(0, 2**16),
)
def test_fast_topk_matches_reference_with_ties(
    log_width: int, k_frac: int, rows: int, levels: int, seed: int
) -> None:
    width = 1 << log_width
    k = max(1, width * k_frac // 256)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels + 1, (rows, width), generator=gen).float()  # few distinct values
    idx, _ = topk_rows(x, k)
    assert torch.equal(idx, _canonical_topk(x, k))
    assert torch.equal(exact_topk_indices(x, k), _canonical_topk(x, k))


def test_topk_rejects_non_finite() -> None:
    x = _randn(4, 4096)
    x[2, 100] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        topk_rows(x, 64)


# ---------------------------------------------------------------- sparseloco: codec


def _kept(codec: SparseLoCoCodec, numel: int) -> int:
    full, rem = divmod(numel, codec.chunk)
    return full * codec.k + min(codec.k, rem)


@pytest.mark.parametrize("numel", [4096 * 8, 4096 * 3 + 1000, 4096 + 40, 1000, 50, 1])
def test_sparseloco_keeps_exactly_the_top_k_of_each_chunk(numel: int) -> None:
    codec = SparseLoCoCodec()
    x = _randn(numel, seed=numel)
    y = _round_trip(codec, x)
    expected = torch.zeros(numel, dtype=torch.bool)
    for start in range(0, numel, 4096):
        chunk = x[start : start + 4096]
        kk = min(64, chunk.numel())
        expected[start + torch.topk(chunk.abs(), kk).indices] = True
    assert torch.equal(y != 0, expected)
    assert int(expected.sum()) == _kept(codec, numel)
    assert torch.equal(torch.sign(y[expected]), torch.sign(x[expected]))


@settings(max_examples=80, deadline=None)
@given(
    numel=st.integers(0, 3000),
    log_chunk=st.integers(1, 8),
    k_seed=st.integers(0, 10**6),
    levels=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_sparseloco_payload_holds_the_canonical_selection(
    numel: int, log_chunk: int, k_seed: int, levels: int, seed: int
) -> None:
    chunk = 1 << log_chunk
    k = 1 + k_seed % chunk
    codec = SparseLoCoCodec(chunk, k)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels + 1, (numel,), generator=gen).float() * 0.01  # many ties
    payload = Payload.from_bytes(codec.encode(x).to_bytes())
    pos = codec.entries(payload)[0]  # flat positions of the kept entries, ascending
    idx = pos % chunk  # in-chunk, chunk after chunk
    expected = []
    for start in range(0, numel, chunk):
        part = x[start : start + chunk].unsqueeze(0)
        expected.append(_canonical_topk(part, min(k, part.numel())).view(-1))
    assert torch.equal(idx, torch.cat(expected) if expected else idx)
    y = codec.decode(payload)
    assert bool((y[pos] * x[pos] >= 0).all())  # signs agree (zeros are kept as +level * 0-scale or +)
    mask = torch.ones(numel, dtype=torch.bool)
    mask[pos] = False
    assert not bool(y[mask].any())


def test_sparseloco_residual_is_smaller_than_the_input() -> None:
    codec = SparseLoCoCodec()
    x = _randn(4096 * 16, seed=5)
    residual = x - _round_trip(codec, x)
    assert float(residual.norm()) < 0.97 * float(x.norm())  # 1.6% of entries, ~12% of the energy
    # error feedback: over a few rounds the transmitted sum tracks the accumulated signal
    err = torch.zeros_like(x)
    sent = torch.zeros_like(x)
    for _ in range(8):
        g = x + err
        d = codec.decode(codec.encode(g))
        sent += d
        err = g - d
    assert float((8 * x - sent).norm()) < float(x.norm()) * 8 * 0.9


def test_sparseloco_levels_are_least_squares_optimal() -> None:
    codec = SparseLoCoCodec()
    x = _randn(4096 * 4, seed=6)
    y = codec.decode(codec.encode(x))
    kept = y != 0
    base = float((y[kept] - x[kept]).square().sum())
    for factor in (0.98, 1.02):  # scaling either level away from its value only adds error
        assert float((y[kept] * factor - x[kept]).square().sum()) > base


def _msgpack_overhead(codec: SparseLoCoCodec, shape: tuple[int, ...], sizes: dict[str, int]) -> int:
    def uint(v: int) -> int:
        return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 2**32 else 9

    def s(text: str) -> int:
        return 1 + len(text)

    def binary(n: int) -> int:
        return (2 if n < 256 else 3 if n < 65536 else 5) + n

    envelope = 1 + 1 + s(codec.name) + 1 + sum(uint(d) for d in shape)
    params = 1 + s("chunk") + uint(codec.chunk) + s("k") + uint(codec.k)
    buffers = 1 + sum(s(name) + binary(n) for name, n in sizes.items())
    return envelope + params + buffers


def _ef_bytes(numel: int, chunk: int = 4096, k: int = 64) -> int:
    """Elias-Fano "idx" size: per chunk of u entries keeping n, an n + ((u-1) >> l) + 1 bit bitmap,
    then l low bits per kept entry, l = floor(log2(chunk / k)); each stream padded to a byte."""
    low = int(math.log2(chunk // k))
    full, rem = divmod(numel, chunk)
    bitmap = full * (k + ((chunk - 1) >> low) + 1) + (min(k, rem) + ((rem - 1) >> low) + 1 if rem else 0)
    return math.ceil(bitmap / 8) + math.ceil((full * k + min(k, rem)) * low / 8)


@pytest.mark.parametrize("numel", [0, 1, 4096, 1_000_000, 4_000_000])
def test_sparseloco_exact_byte_count(numel: int) -> None:
    codec = SparseLoCoCodec()
    payload = codec.encode(_randn(numel, seed=7))
    kept = _kept(codec, numel)
    rows = -(-numel // 4096)
    sizes = {"idx": _ef_bytes(numel), "code": math.ceil(kept / 4), "scale": 2 * rows, "level": 8}
    assert {k: len(v) for k, v in payload.buffers.items()} == sizes
    assert len(payload.to_bytes()) == _msgpack_overhead(codec, (numel,), sizes)


def test_sparseloco_budget() -> None:
    codec = SparseLoCoCodec()
    n = 4_000_000
    nbytes = len(codec.encode(_randn(n, seed=8)).to_bytes())
    assert 8 * nbytes / n <= 0.165  # 12-bit plain positions made it 0.23
    assert 4 * n / nbytes >= 195
    # and at 25M, from the size formula (no 25M encode in the test suite)
    n = 25_000_000
    assert _ef_bytes(n) == 6103 * 16 + 13 + 6104 * 64 * 6 // 8  # 8 bits per kept entry, plus the last bitmap
    sizes = {
        "idx": _ef_bytes(n),
        "code": math.ceil(_kept(codec, n) / 4),
        "scale": 2 * 6104,
        "level": 8,
    }
    assert sizes == codec.expected_nbytes(n)
    total = _msgpack_overhead(codec, (n,), sizes)
    assert 8 * total / n <= 0.165 and 4 * n / total >= 195


def test_sparseloco_survives_extreme_scale_mixes() -> None:
    codec = SparseLoCoCodec()
    x = _randn(4096 * 6, seed=11, scale=1.0)
    x[:4096] *= 1e-30  # tiny chunk next to huge ones: their weights differ by 1e100
    x[4096:8192] = 1e-3  # constant chunk: every kept entry lands in one bin
    x[8192:12288] = -3.0
    x[12288:16384] *= 1e20
    y = _round_trip(codec, x)
    kept = y != 0
    assert int(kept.sum()) == 6 * 64 and bool(torch.isfinite(y).all())
    assert torch.equal(torch.sign(y[kept]), torch.sign(x[kept]))
    assert torch.allclose(y[4096:8192][kept[4096:8192]].abs(), torch.full((64,), 1e-3), rtol=0.3)


def test_sparseloco_decode_is_deterministic_and_aggregate_is_the_mean() -> None:
    codec = SparseLoCoCodec()
    payloads = [Payload.from_bytes(codec.encode(_randn(4096 * 5 + 123, seed=s)).to_bytes()) for s in range(5)]
    assert torch.equal(codec.decode(payloads[0]), codec.decode(payloads[0]))
    agg = codec.aggregate(payloads)
    assert torch.equal(agg, codec.aggregate(payloads))
    assert torch.equal(agg, mean_of_decoded(codec, payloads, None))
    manual = sum(codec.decode(p).double() for p in payloads) / 5
    assert torch.allclose(agg.double(), manual, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("chunk, k, numel", [(4096, 64, 4096 * 5 + 123), (4096, 128, 4096 * 3), (4096, 64, 37),
                                              (256, 4, 256 * 7 + 3), (16, 16, 16 * 4 + 9), (2, 1, 5)])
def test_sparseloco_own_decode_skips_the_parse_and_is_bit_identical_to_one(
        chunk: int, k: int, numel: int, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = SparseLoCoCodec(chunk, k)
    for seed, x in enumerate((_randn(numel, seed=1), torch.zeros(numel), _randn(numel, seed=2).round(decimals=3))):
        payload = codec.encode(x)
        parsed = SparseLoCoCodec(chunk, k)._parse(Payload.from_bytes(payload.to_bytes()), None)
        calls: list[tuple] = []
        real = codec._parse
        monkeypatch.setattr(codec, "_parse", lambda *a, calls=calls, real=real: calls.append(a) or real(*a))
        pos, vals = codec.entries(payload)  # the encoder's own entries, kept at encode time
        assert calls == [], f"case {seed}: the encoder re-parsed its own payload"
        assert torch.equal(pos, parsed[0]) and pos.dtype == parsed[0].dtype
        assert torch.equal(vals.view(torch.int32), parsed[1].view(torch.int32)), f"case {seed}: not bit-identical"
        assert torch.equal(codec.decode(payload), codec.decode(Payload.from_bytes(payload.to_bytes())))
        assert len(calls) == 2  # consumed once used: the second decode of our payload parses again
        monkeypatch.undo()


def test_sparseloco_encodings_nobody_decodes_neither_pile_up_nor_push_validated_parses_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from groundswell.compression.sparseloco import OWN_CACHE_ITEMS, PARSED_CACHE_ITEMS

    codec = SparseLoCoCodec(256, 4)
    received = Payload.from_bytes(codec.encode(_randn(1000, seed=1)).to_bytes())
    codec.validate(received)  # as an aggregator does, long before it decodes
    for s in range(PARSED_CACHE_ITEMS + 10):  # a codec bench, tampered copies: encoded, never decoded here
        codec.encode(_randn(1000, seed=s))
    assert len(codec._own._items) <= OWN_CACHE_ITEMS
    calls = []
    real = codec._parse
    monkeypatch.setattr(codec, "_parse", lambda *a: calls.append(a) or real(*a))
    codec.decode(received)
    assert calls == [], "the validated parse was pushed out by our own encodings"


def test_sparseloco_other_chunk_sizes() -> None:
    for chunk, k in ((256, 4), (2048, 64), (2, 1), (16, 16)):
        codec = SparseLoCoCodec(chunk, k)
        x = _randn(chunk * 3 + 5, seed=chunk)
        y = _round_trip(codec, x)
        assert int((y != 0).sum()) == _kept(codec, x.numel())
        assert len(codec.encode(x).buffers["idx"]) == _ef_bytes(x.numel(), chunk, k)


def test_sparseloco_preserves_shape_and_accepts_other_dtypes() -> None:
    codec = SparseLoCoCodec()
    x = _randn(64, 300, seed=9)
    for t in (x, x.double(), x.to(torch.bfloat16), x.t()):
        y = _round_trip(codec, t)
        assert y.shape == t.shape and y.dtype == torch.float32
