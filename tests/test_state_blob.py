"""The state blob a joiner downloads: exact round trip, views without a copy, and strict refusal
of anything malformed (a hostile server writes these bytes)."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from groundswell.peer.state_blob import pack_tensors, unpack_tensors
from groundswell.protocol.schema import ProtocolError
from hypothesis import given, settings
from hypothesis import strategies as st


def _blob(items, body: bytes) -> bytes:
    header = msgpack.packb([1, items], use_bin_type=True)
    return struct.pack(">Q", len(header)) + header + body


def test_round_trip_is_exact_and_a_bytearray_is_mapped_not_copied():
    tensors = {"global_params": torch.randn(1000), "momentum_buffer": torch.tensor([-0.0, float("inf"), 1e-45])}
    blob = bytearray(pack_tensors(tensors))
    out = unpack_tensors(blob)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(out[name].view(torch.int32), t.view(torch.int32))  # bits, -0 and subnormals too
    blob[-4:] = struct.pack("<f", 7.0)  # the tensors are views of the downloaded buffer
    assert float(out["momentum_buffer"][-1]) == 7.0
    frozen = unpack_tensors(bytes(pack_tensors(tensors)))  # immutable bytes: copied, still exact
    assert torch.equal(frozen["global_params"], tensors["global_params"])


def _header(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack(">Q", len(header)) + header + body


@pytest.mark.parametrize("blob, why", [
    (b"", "too short"),
    (b"\x00" * 7, "too short"),
    (struct.pack(">Q", 1 << 40) + b"x", "header is malformed"),  # header length far past the blob
    (_header(b"\xc1\xc1\xc1"), "does not decode"),  # not msgpack
    (_blob([["g", "float32", 2]], b"\x00" * 4), "shorter than its header says"),
    (_blob([["g", "float32", 1]], b"\x00" * 8), "bytes after its tensors"),
    (_blob([["g", "float64", 1]], b"\x00" * 8), "non-fp32"),
    (_blob([["g", "float32", 1], ["g", "float32", 1]], b"\x00" * 8), "duplicate"),
    (_blob([["g", "float32", -1]], b""), "malformed"),
    (_blob([["g", "float32", True]], b"\x00" * 4), "malformed"),  # a bool is not a count
    (_blob([["x" * 65, "float32", 0]], b""), "malformed"),
    (_blob([["g", "float32", 0]] * 17, b""), "not a version-1 tensor list"),  # too many tensors
    (_header(msgpack.packb([2, []])), "not a version-1 tensor list"),  # another format version
    (_header(msgpack.packb([True, []])), "not a version-1 tensor list"),  # a version of another type (True == 1)
    (_header(msgpack.packb([1.0, []])), "not a version-1 tensor list"),
    (_header(msgpack.packb({"v": 1})), "not a version-1 tensor list"),
], ids=lambda b: str(len(b)) if isinstance(b, bytes) else None)
def test_malformed_blobs_are_refused(blob, why):
    with pytest.raises(ProtocolError, match=why):
        unpack_tensors(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 80), st.binary(max_size=3))
def test_mutated_blobs_decode_exactly_or_are_refused(noise, cut, patch):
    good = pack_tensors({"global_params": torch.arange(8, dtype=torch.float32)})
    mutated = bytearray(good[:cut] + patch + good[cut + len(patch):] + noise)
    try:
        out = unpack_tensors(mutated)
    except ProtocolError:
        return
    assert all(t.dtype == torch.float32 and t.dim() == 1 for t in out.values())
    assert 8 + sum(4 * t.numel() for t in out.values()) <= len(mutated)


def test_packing_holds_the_state_once_beside_it_not_twice():
    # (a review: each tensor was copied to bytes, then all of them joined: the state held three
    # times over while a server built its blob)
    import tracemalloc

    tensors = {"global_params": torch.randn(4 << 20), "momentum_buffer": torch.randn(1 << 20)}
    tracemalloc.start()
    try:
        blob = pack_tensors(tensors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.25 * len(blob), (peak, len(blob))
    assert torch.equal(unpack_tensors(bytearray(blob))["global_params"], tensors["global_params"])
