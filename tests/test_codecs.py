"""Codec behaviour: the registry, dense and int8 error bounds and sizes, aggregation (SparseLoCo's codec: test_sparseloco_codec.py)."""

from __future__ import annotations

import pytest
import torch
from groundswell.compression import (
    CODEC_NAMES,
    Codec,
    DenseCodec,
    Int8Codec,
    Payload,
    SparseLoCoCodec,
    make_codec,
    wire_bound,
)


def _randn(*shape: int, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _round_trip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(Payload.from_bytes(codec.encode(x).to_bytes()))


# ---------------------------------------------------------------- registry and protocol


def test_every_name_builds_a_codec_that_round_trips() -> None:
    x = _randn(3, 1000)
    for name in CODEC_NAMES:
        codec = make_codec(name)
        assert isinstance(codec, Codec) and codec.name == name
        y = _round_trip(codec, x)
        assert y.shape == x.shape and y.dtype == torch.float32


# ---------------------------------------------------------------- dense


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 3), (2, 3, 5)])
def test_fp32_is_exact(shape: tuple[int, ...]) -> None:
    x = _randn(*shape, seed=1)
    assert torch.equal(_round_trip(make_codec("fp32"), x), x)


@pytest.mark.parametrize(("name", "rtol", "atol"), [("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 0.0)])
def test_half_precision_within_dtype_rounding(name: str, rtol: float, atol: float) -> None:
    x = torch.cat([_randn(5000, seed=2, scale=1.0), _randn(5000, seed=3, scale=1e-6)])
    y = _round_trip(make_codec(name), x)
    err = (y - x).abs()
    assert bool((err <= rtol * x.abs() + atol).all())
    assert float(err.max()) > 0  # it is lossy: the bound is actually exercised


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    assert _round_trip(make_codec("fp16"), x).tolist() == [65504.0, -65504.0, 1.0]


def test_dense_byte_sizes() -> None:
    x = _randn(1000)
    for name, itemsize in (("fp32", 4), ("fp16", 2), ("bf16", 2)):
        payload = make_codec(name).encode(x)
        assert len(payload.buffers["data"]) == 1000 * itemsize
        assert (
            payload.nbytes == 1000 * itemsize + 21
        )  # msgpack envelope: 16 bytes + bin16 header + 'data' key


# ---------------------------------------------------------------- int8


@pytest.mark.parametrize(("n", "block"), [(1000, 128), (128 * 5, 128), (77, 64), (1, 8), (0, 128)])
def test_int8_within_half_a_step_per_block(n: int, block: int) -> None:
    x = _randn(n, seed=n) * torch.logspace(-6, 0, n)  # blocks of very different magnitude
    if n > 20:
        x[3:20] = 0.0
    codec = Int8Codec(block)
    y = _round_trip(codec, x)
    nblocks = -(-n // block)
    padded = torch.cat([x, x.new_zeros(nblocks * block - n)]).view(nblocks, block)
    step = (padded.abs().amax(1) / 127).repeat_interleave(block)[:n]
    assert bool(((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())
    payload = codec.encode(x)
    assert len(payload.buffers["q"]) == n and len(payload.buffers["scale"]) == 4 * nblocks


def test_int8_zero_block_and_exact_extremes() -> None:
    x = torch.zeros(256)
    x[130] = -3.0
    y = _round_trip(Int8Codec(128), x)
    assert torch.equal(y, x)  # absmax maps to exactly +-127 steps; zeros stay zero


@pytest.mark.parametrize("name", ["fp32", "sparseloco"])
def test_a_mean_whose_sum_overflows_is_zero_there_and_finite_everywhere(name: str) -> None:
    codec = make_codec(name)
    x = torch.full((4096,), 1e-3)
    x[7] = 3e38  # finite, and so is each payload; two of them sum past fp32's limit
    mean = codec.aggregate([codec.encode(x), codec.encode(x)])
    assert bool(torch.isfinite(mean).all()) and float(mean[7]) == 0.0
    assert float(mean[8]) == float(codec.decode(codec.encode(x))[8])  # the rest untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64])
def test_all_finite_matches_the_elementwise_check_even_when_the_sum_overflows(dtype: torch.dtype) -> None:
    from groundswell.compression import all_finite

    big = torch.finfo(dtype).max if not dtype.is_complex else torch.finfo(torch.float32).max
    cases = [
        torch.zeros(0, dtype=dtype),
        torch.randn(10_000).to(dtype),
        torch.full((1000,), big, dtype=dtype),  # every element finite, the sum is not
        torch.tensor([big, -big, big], dtype=dtype),
    ]
    for bad in (float("inf"), float("-inf"), float("nan")):
        for at in (0, 4_999, 9_999):
            t = torch.randn(10_000).to(dtype)
            t[at] = bad
            cases.append(t)
    both = torch.zeros(8, dtype=dtype)
    both[1], both[5] = float("inf"), float("-inf")  # the sum is NaN: still not finite
    cases.append(both)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
    assert all_finite(torch.tensor([2**62, 2**62], dtype=torch.int64))  # integers are always finite


def test_int8_steps_cover_a_tensor_shorter_than_a_block_on_every_device() -> None:
    # CUDA takes all whole blocks in one step; with none (a short last segment) the step was 0
    codec = Int8Codec(128)
    for device in (torch.device("cpu"), torch.device("cuda")):  # only the device's type is read
        assert list(codec._steps(100, device)) == [(0, 100, 1)]
        assert list(codec._steps(0, device)) == []
        assert list(codec._steps(300, device))[-1] == (256, 300, 1)


def test_int8_saturates_what_its_decoder_would_refuse_and_refuses_non_finite() -> None:
    from groundswell.compression import CodecError
    from groundswell.compression.int8 import SATURATE_AT

    y = _round_trip(Int8Codec(128), torch.full((128,), 3.39e38))  # its scale * 128 would overflow
    assert bool(torch.isfinite(y).all()) and float(y.max()) <= SATURATE_AT * 1.01
    big = torch.full((128,), 3.0e38)  # 128 * (3e38 / 127) is still finite: encodes and decodes
    assert bool(torch.isfinite(_round_trip(Int8Codec(128), big)).all())
    for bad in (float("inf"), float("nan")):
        with pytest.raises(CodecError, match="non-finite"):
            Int8Codec(128).encode(torch.tensor([1.0] * 127 + [bad]))


def test_int8_whatever_decodes_encodes_again() -> None:
    # Found by a review: a payload may hold q = -128 at the largest scale `_parse` allows, which
    # decodes to -fp32 max; an aggregator's mean of that one value (a single contributor, or a
    # trimmed mean keeping one value) then failed to encode, and the seal went unanswered.
    from groundswell.compression import Payload
    from groundswell.compression.base import tensor_to_bytes

    q = torch.full((128,), -128, dtype=torch.int8)
    scale = torch.tensor([torch.finfo(torch.float32).max / 128])
    payload = Payload("int8", (128,), {"block": 128}, {"q": tensor_to_bytes(q), "scale": tensor_to_bytes(scale)})
    decoded = Int8Codec(128).decode(payload)
    assert float(decoded.min()) == -torch.finfo(torch.float32).max
    assert bool(torch.isfinite(_round_trip(Int8Codec(128), decoded)).all())


def test_fp32_saturates_fp64_input_beyond_its_range() -> None:
    from groundswell.compression import CodecError

    y = _round_trip(make_codec("fp32"), torch.tensor([1e300, -1e300, 1.0], dtype=torch.float64))
    assert y.tolist() == [torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 1.0]
    for name in ("fp32", "fp16", "bf16"):  # but an fp64 inf is refused, not saturated (found by a review)
        with pytest.raises(CodecError, match="non-finite"):
            make_codec(name).encode(torch.tensor([float("inf"), 1.0], dtype=torch.float64))


def test_sparseloco_one_value_per_largest_chunk_round_trips() -> None:
    # 12 low bits per index: unpacked from a slice at an odd byte offset
    codec = SparseLoCoCodec(chunk=4096, k=1)
    x = _randn(4096 * 2 + 5, seed=3)
    y = _round_trip(codec, x)
    kept = [int(i) for i in torch.nonzero(y).flatten()]
    chunks = [(0, 4096), (4096, 8192), (8192, x.numel())]
    assert kept == [lo + int(x[lo:hi].abs().argmax()) for lo, hi in chunks]  # each chunk's largest


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_encode_matches_cpu_and_decode_is_bit_identical() -> None:
    x = _randn(4096 * 50 + 77, seed=10)
    for name in CODEC_NAMES:
        codec = make_codec(name)
        data = codec.encode(x).to_bytes()
        gpu = codec.encode(x.cuda())
        if name == "sparseloco":  # same selection and codes; scales may differ in the last bit
            assert gpu.buffers["idx"] == codec.encode(x).buffers["idx"]
        payload = Payload.from_bytes(data)
        on_gpu = codec.decode(payload, device="cuda")
        assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), codec.decode(payload))
        assert torch.equal(
            codec.aggregate([payload] * 3, device="cuda").cpu(), codec.aggregate([payload] * 3)
        )


def test_dense_and_int8_aggregate_is_the_mean() -> None:
    xs = [_randn(1000, seed=s) for s in range(3)]
    for codec in (DenseCodec("fp32"), DenseCodec("fp16"), Int8Codec()):
        payloads = [codec.encode(x) for x in xs]
        expected = sum(codec.decode(p) for p in payloads) / 3
        assert torch.allclose(codec.aggregate(payloads), expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("n", [1, 63, 64, 4095, 4096, 4097, 70_001, 300_000])
def test_wire_bound_holds_every_encoding_and_is_tight(name: str, n: int) -> None:
    # What peers size their budgets by: an encoding past it would be refused by every honest peer,
    # one far under it was the fp32 bound of a sparse run (hundreds of times too loose).
    codec = make_codec(name)
    bound = wire_bound(codec, n)
    for seed, scale in ((0, 1e-3), (1, 1e4)):
        size = len(codec.encode(_randn(n, seed=seed, scale=scale)).to_bytes())
        assert size <= bound <= size + 16, (size, bound)


def test_non_default_codec_settings_change_the_bound() -> None:
    small, big = make_codec("sparseloco", chunk=1024, k=8), make_codec("sparseloco", chunk=1024, k=128)
    x = _randn(50_000)
    for codec in (small, big):
        assert len(codec.encode(x).to_bytes()) <= wire_bound(codec, 50_000)
    assert wire_bound(big, 50_000) > 8 * wire_bound(small, 50_000) // 2
