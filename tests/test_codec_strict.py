"""Strict decoding of untrusted bytes: every malformed payload is a CodecError, never anything else."""

from __future__ import annotations

import math
import warnings

import msgpack
import pytest
import torch
from groundswell.compression import (
    ALIGN,
    CODEC_NAMES,
    CodecError,
    DenseCodec,
    Int8Codec,
    Payload,
    SparseLoCoCodec,
    codec_for_payload,
    make_codec,
)
from groundswell.compression.base import WIRE_VERSION
from groundswell.compression.bitpack import pack_bits
from groundswell.compression.int8 import check_int8_options
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NUMEL = 4096 * 3 + 100  # three full chunks and a partial one of 100 entries


def _x(n: int = NUMEL, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3


VALID = {name: make_codec(name).encode(_x()).to_bytes() for name in CODEC_NAMES}


def _decode_any(data: bytes, **kwargs: object) -> torch.Tensor:
    """The full untrusted path: parse, validate, decode."""
    payload = Payload.from_bytes(data, **kwargs)
    return codec_for_payload(payload).decode(payload)


def _envelope(
    version: object = WIRE_VERSION,
    codec: object = "sparseloco",
    shape: object = None,
    params: object = None,
    buffers: object = None,
) -> bytes:
    base = Payload.from_bytes(VALID["sparseloco"])
    return msgpack.packb(
        [
            version,
            codec,
            list(base.shape) if shape is None else shape,
            dict(base.params) if params is None else params,
            dict(base.buffers) if buffers is None else buffers,
        ],
        use_bin_type=True,
    )


def _sparse_payload(**changes: bytes) -> Payload:
    base = Payload.from_bytes(VALID["sparseloco"])
    return Payload(base.codec, base.shape, dict(base.params), {**base.buffers, **changes})


def _indices() -> torch.Tensor:
    """The fixture's kept in-chunk positions, flat (64 per full chunk, then 64 of the last 100)."""
    codec = SparseLoCoCodec()
    positions, _ = codec.entries(Payload.from_bytes(VALID["sparseloco"]))
    return positions % codec.chunk


def _with_indices(idx: torch.Tensor) -> Payload:
    """The fixture with its positions replaced, Elias-Fano coded here independently of the codec:
    position p_i (i-th of its chunk) sets bit (p_i >> 6) + i of the chunk's high bitmap, whose
    length is n + ((u - 1) >> 6) + 1 bits (u = 4096, or 100 for the last chunk); then all 6-bit
    low parts. Positions the format cannot carry (their bits would collide) are the caller's problem."""
    bitmaps = []
    for start, universe in ((0, 4096), (64, 4096), (128, 4096), (192, 100)):
        chunk = idx[start : start + 64]
        bitmap = torch.zeros(64 + ((universe - 1) >> 6) + 1, dtype=torch.uint8)
        bitmap[(chunk >> 6) + torch.arange(64)] = 1
        bitmaps.append(bitmap)
    buf = torch.cat([pack_bits(torch.cat(bitmaps), 1), pack_bits(idx & 63, 6)])
    return _sparse_payload(idx=buf.numpy().tobytes())


# ---------------------------------------------------------------- fuzzing


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_codec_error(data: bytes) -> None:
    try:
        payload = Payload.from_bytes(data)
        out = codec_for_payload(payload).decode(payload)
    except CodecError:
        return
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(payload.shape)  # accepted: what it claims


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CODEC_NAMES), st.data())
def test_truncated_payloads_are_rejected(name: str, data: st.DataObject) -> None:
    valid = VALID[name]
    cut = data.draw(st.integers(0, len(valid) - 1))
    with pytest.raises(CodecError):
        _decode_any(valid[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CODEC_NAMES), st.data())
def test_bit_flips_decode_cleanly_or_raise_codec_error(name: str, data: st.DataObject) -> None:
    valid = bytearray(VALID[name])
    # bias half of the flips towards the envelope and the small buffers, where structure lives
    limit = data.draw(st.sampled_from([min(len(valid), 200), len(valid)]))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, limit - 1))
        valid[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        y = _decode_any(bytes(valid))
    except CodecError:
        return
    assert y.dtype == torch.float32
    assert bool(torch.isfinite(y).all())


def test_trailing_garbage_is_rejected() -> None:
    with pytest.raises(CodecError):
        _decode_any(VALID["fp32"] + b"\x00")


# ---------------------------------------------------------------- envelope


@pytest.mark.parametrize(
    "data",
    [
        msgpack.packb({"not": "a list"}),
        msgpack.packb([1, 2, 3]),
        _envelope(version=WIRE_VERSION + 1),
        _envelope(version=WIRE_VERSION - 1),
        _envelope(version=True),
        _envelope(codec="nope"),
        _envelope(codec=""),
        _envelope(codec=7),
        _envelope(shape=[-1]),
        _envelope(shape=[2.0]),
        _envelope(shape="12388"),
        _envelope(shape=[1] * 9),
        _envelope(params=[1]),
        _envelope(buffers={"idx": "text, not bytes"}),
        _envelope(buffers={1: b""}),
        _envelope(version=float(WIRE_VERSION)),  # 2.0 for 2: another spelling of the same payload
    ],
)
def test_bad_envelopes(data: bytes) -> None:
    with pytest.raises(CodecError):
        _decode_any(data)


def test_wrong_codec_for_expected_codec() -> None:
    with pytest.raises(CodecError, match="expected"):
        Payload.from_bytes(VALID["int8"], expect=make_codec("sparseloco"))
    with pytest.raises(CodecError, match="expected"):
        make_codec("fp16").decode(Payload.from_bytes(VALID["fp32"]))


def test_expect_with_different_settings() -> None:
    with pytest.raises(CodecError, match="k="):
        Payload.from_bytes(VALID["sparseloco"], expect=SparseLoCoCodec(k=32))
    with pytest.raises(CodecError, match="block="):
        Payload.from_bytes(VALID["int8"], expect=Int8Codec(64))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_shape_mismatch_is_a_length_error(name: str) -> None:
    p = Payload.from_bytes(VALID[name])
    shapes = [(NUMEL + 4096,), (NUMEL - 100,), (2, NUMEL), (0,)]
    if name != "sparseloco":  # a sparse payload fits any shape with the same chunk layout
        shapes += [(NUMEL + 1,), (NUMEL - 1,)]
    for shape in shapes:
        with pytest.raises(CodecError):
            codec_for_payload(p).decode(Payload(p.codec, shape, dict(p.params), dict(p.buffers)))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_buffer_length_is_checked(name: str) -> None:
    p = Payload.from_bytes(VALID[name])
    codec = codec_for_payload(p)
    for key, buf in p.buffers.items():
        for bad in (buf[:-1], buf + b"\x00"):
            with pytest.raises(CodecError, match=key):
                codec.validate(Payload(p.codec, p.shape, dict(p.params), {**p.buffers, key: bad}))
        missing = {k: v for k, v in p.buffers.items() if k != key}
        with pytest.raises(CodecError, match="lacks"):
            codec.validate(Payload(p.codec, p.shape, dict(p.params), missing))
    with pytest.raises(CodecError, match="unknown fields"):
        codec.validate(Payload(p.codec, p.shape, dict(p.params), {**p.buffers, "extra": b""}))


def test_an_oversized_numel_claim_is_refused_by_the_size_checks_before_decoding() -> None:
    # Over the hard limit: refused by the envelope, from its header alone.
    for shape in ([2**35], [2**18, 2**17], [2**40]):
        with pytest.raises(CodecError, match=f"claims {math.prod(shape)} elements, over the limit of {2**34}"):
            _decode_any(_envelope(shape=shape))
    # Under it, but more than the buffers hold: refused by the buffer-length check, which sizes what
    # the shape needs from the header before anything of that size is allocated.
    for shape in ([2**33], [2**17, 2**16]):
        with pytest.raises(CodecError, match=r"buffer '\w+' is \d+ bytes, expected \d+"):
            _decode_any(_envelope(shape=shape))
    with pytest.raises(CodecError, match="over the limit"):
        Payload.from_bytes(VALID["fp32"], max_numel=NUMEL - 1)
    with pytest.raises(CodecError, match="over the limit"):
        Payload.from_bytes(VALID["fp32"], max_bytes=100)
    for name in ("int8", "fp16"):  # dense codecs size the check from the shape too
        p = Payload.from_bytes(VALID[name])
        with pytest.raises(CodecError, match=r"buffer '\w+' is \d+ bytes, expected \d+"):
            codec_for_payload(p).decode(Payload(p.codec, (2**33,), dict(p.params), dict(p.buffers)))


# ---------------------------------------------------------------- params (untrusted)


@pytest.mark.parametrize(
    "params",
    [
        {"chunk": 4000, "k": 64},  # not a power of two
        {"chunk": 1 << 17, "k": 64},  # too large
        {"chunk": 1, "k": 1},
        {"chunk": 4096, "k": 0},
        {"chunk": 4096, "k": 4097},
        {"chunk": 4096.0, "k": 64},
        {"chunk": "4096", "k": 64},
        {"chunk": True, "k": 64},
        {"chunk": 4096, "k": 64, "extra": 1},
        {"chunk": 4096},
        {},
    ],
)
def test_sparseloco_params_are_range_checked(params: dict) -> None:
    with pytest.raises(CodecError):
        _decode_any(_envelope(params=params))


@pytest.mark.parametrize("block", [0, 7, 1 << 17, 128.0, "128", False])
def test_int8_params_are_range_checked(block: object) -> None:
    p = Payload.from_bytes(VALID["int8"])
    data = Payload("int8", p.shape, {"block": block}, dict(p.buffers)).to_bytes()
    with pytest.raises(CodecError):
        _decode_any(data)


def test_dense_payloads_take_no_params() -> None:
    p = Payload.from_bytes(VALID["fp16"])
    with pytest.raises(CodecError):
        _decode_any(Payload("fp16", p.shape, {"x": 1}, dict(p.buffers)).to_bytes())


def test_make_codec_rejects_unknown_names_and_options() -> None:
    with pytest.raises(CodecError, match="unknown codec"):
        make_codec("topk")
    with pytest.raises(CodecError, match="no option"):
        make_codec("fp32", chunk=4)
    with pytest.raises(CodecError, match="no option"):
        make_codec("sparseloco", chunks=4096)
    with pytest.raises(CodecError):
        make_codec("sparseloco", chunk=3000)


def test_codecs_accept_exactly_the_chunks_and_blocks_that_divide_the_segment_alignment() -> None:
    # segments start at multiples of ALIGN: a chunk or block that does not divide it would leave
    # a partial (denser) chunk at the end of every segment
    def accepted(build) -> bool:
        try:
            build()
        except CodecError:
            return False
        return True

    for log in range(1, 18):
        chunk = 1 << log
        assert accepted(lambda: make_codec("sparseloco", chunk=chunk, k=1)) == (ALIGN % chunk == 0), chunk
    for block in range(1, 1 << 17):
        assert accepted(lambda: check_int8_options(block)) == (block >= 8 and ALIGN % block == 0), block
    with pytest.raises(CodecError, match="power of two in 8..4096"):
        make_codec("int8", block=100)
    p = Payload.from_bytes(VALID["sparseloco"])  # a peer announcing a chunk of 8192
    with pytest.raises(CodecError, match="power of two in 2..4096"):
        codec_for_payload(Payload(p.codec, p.shape, {"chunk": 8192, "k": 64}, dict(p.buffers)))


# ---------------------------------------------------------------- sparseloco content


def test_valid_fixture_decodes() -> None:
    assert _decode_any(VALID["sparseloco"]).shape == (NUMEL,)
    assert SparseLoCoCodec().decode(_with_indices(_indices())).shape == (NUMEL,)


def test_index_in_the_padding_of_the_last_chunk() -> None:
    idx = _indices()
    for bad in (100, 101, 191):  # the last chunk holds 100 entries: 0..99 (191: the highest its bitmap can say)
        moved = idx.clone()
        moved[-1] = bad
        with pytest.raises(CodecError, match="padding"):
            SparseLoCoCodec().decode(_with_indices(moved))
    ok = idx.clone()
    ok[-1] = 99 if idx[-2] < 99 else idx[-1]
    SparseLoCoCodec().decode(_with_indices(ok))


def test_index_past_the_end_of_a_full_chunk() -> None:
    idx = _indices()
    idx[:64] = torch.arange(64) * 64 + 1  # one per high bucket: the last bit of the bitmap is free
    idx[63] = 4096 + 5  # high 64: the bitmap's last bit, a position no chunk of 4096 has
    with pytest.raises(CodecError, match="past the end"):
        SparseLoCoCodec().decode(_with_indices(idx))


@pytest.mark.parametrize("where", ["full", "tail"])
def test_duplicate_or_unordered_indices(where: str) -> None:
    # Within one high bucket (same p >> 6) the low parts carry the order: a repeat or a descent
    # there is what the coded form can express, and it must be refused.
    base = _indices()
    at = 5 if where == "full" else len(base) - 3
    lo, hi = int(base[at - 1]), int(base[at + 2])
    a, b = next((a, a + 1) for a in range(lo + 1, hi - 1) if a >> 6 == (a + 1) >> 6)  # between the neighbours
    dup = base.clone()
    dup[at], dup[at + 1] = a, a
    swapped = base.clone()
    swapped[at], swapped[at + 1] = b, a
    for bad in (dup, swapped):
        with pytest.raises(CodecError, match="ascending"):
            SparseLoCoCodec().decode(_with_indices(bad))


def test_index_bitmaps_must_hold_exactly_k_ones_per_chunk() -> None:
    p = Payload.from_bytes(VALID["sparseloco"])
    data = bytearray(p.buffers["idx"])
    for byte in range(16):  # chunk 0's 128-bit bitmap: find a zero bit and set it
        if data[byte] != 0xFF:
            data[byte] |= (~data[byte] & 0xFF) & -(~data[byte] & 0xFF)
            break
    with pytest.raises(CodecError, match="exactly 64 ones"):
        SparseLoCoCodec().decode(Payload(p.codec, p.shape, dict(p.params), {**p.buffers, "idx": bytes(data)}))


def test_chunk_boundaries_are_not_an_ordering_violation() -> None:
    idx = _indices()
    idx[63], idx[64] = 4095, 0  # last of chunk 0, first of chunk 1
    idx[:63] = torch.arange(63)
    idx[65:128] = torch.arange(1, 64)
    y = SparseLoCoCodec().decode(_with_indices(idx))
    assert y[4095] != 0 and y[4096] != 0


def _bf16_bytes(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), -1e-3])
def test_bad_scales(value: float) -> None:
    p = Payload.from_bytes(VALID["sparseloco"])
    scales = bytearray(p.buffers["scale"])
    scales[2:4] = _bf16_bytes(value)
    with pytest.raises(CodecError, match="scale"):
        SparseLoCoCodec().decode(_sparse_payload(scale=bytes(scales)))


@pytest.mark.parametrize("levels", [(float("nan"), 1.0), (0.5, float("inf")), (-0.5, 1.0)])
def test_bad_levels(levels: tuple[float, float]) -> None:
    p = _sparse_payload(level=torch.tensor(levels, dtype=torch.float32).numpy().tobytes())
    with pytest.raises(CodecError, match="level"):
        SparseLoCoCodec().decode(p)


def test_levels_times_scales_must_not_overflow() -> None:
    scales = bytearray(Payload.from_bytes(VALID["sparseloco"]).buffers["scale"])
    scales[0:2] = _bf16_bytes(100.0)
    big = torch.tensor([0.5, 3e37], dtype=torch.float32).numpy().tobytes()
    SparseLoCoCodec().decode(_sparse_payload(level=big))  # fine with the real scales (~1e-3)
    with pytest.raises(CodecError, match="overflow"):
        SparseLoCoCodec().decode(_sparse_payload(level=big, scale=bytes(scales)))


def test_nonzero_padding_bits_in_codes() -> None:
    codec = SparseLoCoCodec()
    x = _x(4096 + 3)  # 64 + 3 kept: the last code byte holds one padding code
    p = codec.encode(x)
    codes = bytearray(p.buffers["code"])
    assert math.ceil(67 / 4) == len(codes)
    codes[-1] |= 0b11 << 6
    with pytest.raises(CodecError, match="padding"):
        codec.decode(Payload(p.codec, p.shape, dict(p.params), {**p.buffers, "code": bytes(codes)}))


def test_nonzero_padding_bits_in_indices() -> None:
    codec = SparseLoCoCodec()
    p = codec.encode(_x(4096 + 1))  # 65 positions: 65 x 6 low bits end 2 bits into the last byte
    idx = bytearray(p.buffers["idx"])
    idx[-1] |= 0x80
    with pytest.raises(CodecError, match="padding"):
        codec.decode(Payload(p.codec, p.shape, dict(p.params), {**p.buffers, "idx": bytes(idx)}))


def test_aggregate_rejects_mixed_shapes_and_empty_lists() -> None:
    codec = SparseLoCoCodec()
    with pytest.raises(CodecError):
        codec.aggregate([])
    with pytest.raises(CodecError):
        codec.aggregate([codec.encode(_x(5000)), codec.encode(_x(5001))])
    with pytest.raises(CodecError):
        DenseCodec("fp32").aggregate([DenseCodec("fp32").encode(_x(5)), DenseCodec("fp32").encode(_x(6))])


# ---------------------------------------------------------------- dense and int8 content


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_dense_non_finite_values_are_rejected(name: str, value: float) -> None:
    codec = DenseCodec(name)
    bad = torch.tensor([1.0, value, 2.0], dtype=codec.dtype).view(torch.uint8).numpy().tobytes()
    data = Payload(name, (3,), {}, {"data": bad}).to_bytes()
    with pytest.raises(CodecError, match="non-finite"):
        _decode_any(data)
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(torch.tensor([1.0, value]))


class _WatchedFilters(list):
    """warnings.filters that counts copies: warnings.catch_warnings starts with one."""

    copies = 0

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            self.copies += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_dense_validate_refuses_exactly_the_non_finite_and_leaves_the_warning_filters_alone(
        name: str, recwarn: pytest.WarningsRecorder) -> None:
    # validate runs on the network thread while the trainer trains: catch_warnings there would
    # swap warnings.filters under the trainer (not thread-safe; its warnings could be lost)
    codec = DenseCodec(name)
    info = torch.finfo(codec.dtype)
    bits = torch.int32 if codec.itemsize == 4 else torch.int16
    quiet_nan = torch.tensor([float("nan")], dtype=codec.dtype)
    negative_nan = (quiet_nan.view(bits) | torch.tensor([-1], dtype=bits)).view(codec.dtype)  # all bits set
    cases = {
        "nan": (quiet_nan, False), "-nan": (negative_nan, False),
        "+inf": (torch.tensor([float("inf")], dtype=codec.dtype), False),
        "-inf": (torch.tensor([-float("inf")], dtype=codec.dtype), False),
        "max": (torch.tensor([info.max, -info.max], dtype=codec.dtype), True),
        "subnormal": (torch.tensor([info.smallest_normal / 2, -info.smallest_normal / 4], dtype=codec.dtype), True),
        "-0.0": (torch.tensor([-0.0, 0.0], dtype=codec.dtype), True),
    }
    original = warnings.filters
    watched = warnings.filters = _WatchedFilters(original)
    try:
        for case, (special, finite) in cases.items():
            for at in (0, 300_000):  # in the first block the check scans, and past it
                x = torch.ones(at + 2 * special.numel(), dtype=codec.dtype)
                x[at:at + special.numel()] = special
                payload = Payload(name, tuple(x.shape), {}, {"data": x.view(torch.uint8).numpy().tobytes()})
                if finite:
                    codec.validate(payload)
                    assert torch.equal(codec.decode(payload), x.float()), case
                else:
                    with pytest.raises(CodecError, match="non-finite"):
                        codec.validate(payload)
        codec.validate(Payload(name, (0,), {}, {"data": b""}))
    finally:
        warnings.filters = original
    assert watched.copies == 0
    assert not recwarn.list  # and it raises no warning of its own


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 3e38])
def test_int8_bad_scales(value: float) -> None:
    p = Payload.from_bytes(VALID["int8"])
    scales = torch.frombuffer(bytearray(p.buffers["scale"]), dtype=torch.float32).clone()
    scales[1] = value
    bad = Payload("int8", p.shape, dict(p.params), {**p.buffers, "scale": scales.numpy().tobytes()})
    with pytest.raises(CodecError, match="scale"):
        _decode_any(bad.to_bytes())


@pytest.mark.parametrize("name", ["sparseloco", "int8"])
def test_encoders_reject_non_finite_input(name: str) -> None:
    for value in (float("nan"), float("inf")):
        x = _x()
        x[4096 + 17] = value
        with pytest.raises(CodecError, match="non-finite|too large"):
            make_codec(name).encode(x)


def test_encoders_reject_integer_tensors() -> None:
    for name in CODEC_NAMES:
        with pytest.raises(CodecError):
            make_codec(name).encode(torch.arange(10))


def test_nested_containers_in_a_payload_are_refused_before_they_are_built() -> None:
    import tracemalloc

    def tree(depth: int) -> bytes:  # 16-wide nested arrays: within every array-length cap
        return b"\x90" if depth == 0 else b"\xdc\x00\x10" + tree(depth - 1) * 16

    bomb = msgpack.packb([WIRE_VERSION, "sparseloco", [], {}], use_bin_type=True)
    bomb = b"\x95" + bomb[1:] + b"\x81\xa1k" + tree(5)  # 1 MB: a buffer that is a tree
    in_params = _envelope()[:-1]  # a params map whose value is a tree, not a scalar
    tracemalloc.start()
    try:
        with pytest.raises(CodecError):
            Payload.from_bytes(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(bomb)
    with pytest.raises(CodecError):
        Payload.from_bytes(_envelope(params={"k": [[]] * 4}))
    with pytest.raises(CodecError):
        Payload.from_bytes(in_params)  # cut short
    with pytest.raises(CodecError, match="bytes after"):
        Payload.from_bytes(VALID["fp32"] + b"\x00")


def test_an_empty_shape_cannot_hide_a_dimension_no_tensor_can_take() -> None:
    for shape in ([0, 2**63], [2**40, 0]):
        with pytest.raises(CodecError, match="dimension"):
            _decode_any(_envelope(shape=shape, buffers={}))


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=300) | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=5), inner, max_size=20),
    max_leaves=60,
)


def _objects(value: object) -> int:
    if isinstance(value, list):
        return 1 + sum(_objects(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(1 + _objects(v) for v in value.values())
    return 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_MSGPACK_VALUES)
def test_count_objects_counts_what_msgpack_would_build(value: object) -> None:
    from groundswell.compression.wire_bounds import count_objects

    data = msgpack.packb(value, use_bin_type=True)
    assert count_objects(data, 10**6) == _objects(value)
    if _objects(value) > 1:
        with pytest.raises(ValueError, match="more than"):
            count_objects(data, _objects(value) - 1)
    for cut in {1, len(data) // 2, len(data) - 1} - {0, len(data)}:
        with pytest.raises(ValueError):
            count_objects(data[:cut], 10**6)
    with pytest.raises(ValueError, match="after"):
        count_objects(data + b"\x00", 10**6)


def test_count_objects_refuses_reserved_bytes_and_huge_headers_without_reading_on() -> None:
    from groundswell.compression.wire_bounds import count_objects

    with pytest.raises(ValueError, match="reserved"):
        count_objects(b"\x92\x01\xc1", 10)
    with pytest.raises(ValueError, match="more than 10"):
        count_objects(b"\xdd\xff\xff\xff\xff", 10)  # an array of 4 billion, refused from its header
    with pytest.raises(ValueError, match="cut short"):
        count_objects(b"\xc6\xff\xff\xff\xff", 10)  # a 4 GiB bin that is not there


def test_running_out_of_memory_while_parsing_is_not_taken_for_a_bad_payload(monkeypatch) -> None:
    # A MemoryError is this peer's trouble: read as a bad payload, a stored contribution would be
    # given up as undecodable (and a sender struck for it).
    from groundswell.compression import base

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(base.msgpack, "unpackb", no_memory)
    with pytest.raises(MemoryError):
        Payload.from_bytes(VALID["fp32"])
    from groundswell.protocol.schema import Ack, decode_message, encode_message

    with pytest.raises(MemoryError):
        decode_message(encode_message(Ack(True, "")), Ack)


def test_a_map_that_repeats_a_key_is_refused() -> None:
    # Found by a review of the wire boundary: msgpack keeps the last of repeated keys, so a payload
    # could carry junk under a key said again later and decode like the short one.
    good = msgpack.unpackb(VALID["fp32"], raw=False)
    assert Payload.from_bytes(VALID["fp32"]).codec == "fp32"
    buffers = good[4]
    key = next(iter(buffers))
    junk = bytes([0x80 | (len(buffers) + 1)]) + msgpack.packb(key) + msgpack.packb(b"\x00" * 800) + b"".join(
        msgpack.packb(k) + msgpack.packb(v) for k, v in buffers.items())
    raw = b"\x95" + b"".join(msgpack.packb(x) for x in good[:4]) + junk
    assert msgpack.unpackb(raw, raw=False)[4] == buffers  # what msgpack alone makes of it: the short one
    with pytest.raises(CodecError, match="repeats a key"):
        Payload.from_bytes(raw)
