"""`wire_pack.pack` writes exactly msgpack's bytes (peers compare signed messages by their bytes),
whatever mix of headers, sizes and bulk values an object has."""

from __future__ import annotations

import random

import msgpack
import pytest
from groundswell.compression.wire_pack import BULK, bin_header, pack


def _big(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("length", [BULK - 1, BULK, BULK + 1, (1 << 16) - 1, 1 << 16, (1 << 16) + 7])
def test_bin_values_of_every_header_width_pack_as_msgpack_does(length):
    data = _big(length)
    for obj in (data, bytearray(data), memoryview(data), [data], (1, data, "x"), {"q": data, "s": b"ab"}):
        assert pack(obj) == msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("count", [0, 1, 14, 15, 16, 17, (1 << 16) - 1, 1 << 16])
def test_arrays_and_maps_of_every_header_width_around_a_bulk_value(count):
    bulk = _big(BULK + 3, seed=count)
    items = [bulk] + list(range(count))
    assert pack(items) == msgpack.packb(items, use_bin_type=True)
    if count < 5000:  # maps: string keys, one value bulk
        mapping = {f"k{i}": (bulk if i == 0 else i) for i in range(max(1, count))}
        assert pack(mapping) == msgpack.packb(mapping, use_bin_type=True)


def test_nested_messages_like_the_protocols_pack_as_msgpack_does():
    rng = random.Random(7)
    for _ in range(200):
        segments = [rng.randbytes(rng.choice([0, 5, BULK - 1, BULK, 3 * BULK])) for _ in range(rng.randrange(0, 5))]
        payload = [2, "fp32", [rng.randrange(1, 1 << 20)], {"block": 64, "x": -1.5}, {"q": rng.randbytes(BULK),
                                                                                         "scale": b""}]
        msg = ["contribute", [rng.randrange(-(1 << 40), 1 << 40), "peer", segments, None, True, 0.25,
                              pack(payload), payload]]
        assert pack(msg) == msgpack.packb(msg, use_bin_type=True)
        assert msgpack.unpackb(pack(msg), raw=False) == msgpack.unpackb(msgpack.packb(msg, use_bin_type=True),
                                                                         raw=False)


def test_bin_header_is_the_shortest_form_and_refuses_what_msgpack_cannot_hold():
    assert bin_header(0) == b"\xc4\x00" and bin_header(255) == b"\xc4\xff"
    assert bin_header(256) == b"\xc5\x01\x00" and bin_header(1 << 16) == b"\xc6\x00\x01\x00\x00"
    with pytest.raises(ValueError):
        bin_header(1 << 32)
