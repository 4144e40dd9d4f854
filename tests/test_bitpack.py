"""Bit packing: exact layout, round trips for every width, strict unpacking."""

from __future__ import annotations

import pytest
import torch
from groundswell.compression import CodecError
from groundswell.compression.bitpack import (
    _pack_generic,
    _unpack_generic,
    pack_2bit,
    pack_12bit,
    pack_bits,
    packed_nbytes,
    unpack_2bit,
    unpack_12bit,
    unpack_bits,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _u8(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def test_12bit_layout_is_two_values_per_three_bytes() -> None:
    packed = pack_12bit(torch.tensor([0xABC, 0x123]))
    assert packed.tolist() == [0xBC, 0x3A, 0x12]
    odd = pack_12bit(torch.tensor([0xABC, 0x123, 0xFFF]))
    assert odd.tolist() == [0xBC, 0x3A, 0x12, 0xFF, 0x0F]  # the last value owns 1.5 bytes
    assert unpack_12bit(odd, 3).tolist() == [0xABC, 0x123, 0xFFF]


def test_12bit_is_genuinely_packed() -> None:
    values = torch.randint(0, 4096, (1000,))
    assert pack_12bit(values).numel() == 1500
    assert packed_nbytes(1001, 12) == 1502


def test_2bit_layout_is_four_codes_per_byte_low_bits_first() -> None:
    packed = pack_2bit(torch.tensor([1, 2, 3, 0, 1]))
    assert packed.tolist() == [0b00_11_10_01, 0b01]
    assert unpack_2bit(packed, 5).tolist() == [1, 2, 3, 0, 1]


@pytest.mark.parametrize("nbits", [1, 2, 6, 8, 12, 16])
def test_fast_paths_match_the_generic_bit_stream(nbits: int) -> None:
    gen = torch.Generator().manual_seed(nbits)
    for count in (0, 1, 2, 3, 5, 7, 8, 9, 1001):
        values = torch.randint(0, 1 << nbits, (count,), generator=gen)
        fast = pack_bits(values, nbits)
        assert torch.equal(fast, _pack_generic(values, nbits))
        assert torch.equal(unpack_bits(fast, nbits, count), _unpack_generic(fast, nbits, count))


@settings(max_examples=150, deadline=None)
@given(nbits=st.integers(1, 16), data=st.data())
def test_round_trip_every_width(nbits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, (1 << nbits) - 1), max_size=70))
    t = torch.tensor(values, dtype=torch.int64)
    packed = pack_bits(t, nbits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(len(values), nbits) == (len(values) * nbits + 7) // 8
    assert unpack_bits(packed, nbits, len(values)).tolist() == values


@pytest.mark.parametrize(
    ("data", "nbits", "count"),
    [
        (_u8(0b0100_0000), 2, 3),  # fourth code slot is padding
        (_u8(0xFF, 0xFF), 12, 1),  # high nibble of the second byte is padding
        (_u8(0x00, 0x00, 0x00, 0x00, 0x10), 12, 3),
        (_u8(0b1110_0000), 5, 1),  # generic path: bits 5..7 are padding
        (_u8(0b0000_0100), 1, 2),  # bitmaps: bits 2..7 are padding
        (_u8(0x3F, 0x10), 6, 2),  # four bits of the second byte are padding
        (_u8(0x00, 0x00, 0x40), 6, 3),  # the last two bits of three bytes are padding
    ],
)
def test_nonzero_padding_bits_are_rejected(data: torch.Tensor, nbits: int, count: int) -> None:
    with pytest.raises(CodecError, match="padding"):
        unpack_bits(data, nbits, count)


@pytest.mark.parametrize(
    ("nbytes", "nbits", "count"), [(2, 2, 4), (0, 2, 1), (4, 12, 2), (3, 12, 3), (5, 5, 9)]
)
def test_wrong_lengths_are_rejected(nbytes: int, nbits: int, count: int) -> None:
    with pytest.raises(CodecError, match="cannot hold"):
        unpack_bits(torch.zeros(nbytes, dtype=torch.uint8), nbits, count)


def test_bad_widths_and_dtypes() -> None:
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(3, dtype=torch.int64), 17)
    with pytest.raises(ValueError):
        packed_nbytes(3, 0)
    with pytest.raises(CodecError):
        unpack_bits(torch.zeros(3, dtype=torch.int32), 8, 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    for nbits in (2, 5, 12, 16):
        values = torch.randint(0, 1 << nbits, (12345,))
        cpu = pack_bits(values, nbits)
        gpu = pack_bits(values.cuda(), nbits)
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
        back = unpack_bits(gpu, nbits, values.numel())
        assert back.is_cuda and torch.equal(back.cpu(), values)
