"""Dense codecs: the tensor as raw little-endian fp32, fp16 or bf16 ("data" buffer, no params).

Encoding rejects non-finite input and saturates finite values beyond the target dtype's range
to its largest finite value (an fp16 overflow would otherwise turn into inf). Decoding rejects
non-finite values: one NaN from a hostile peer would poison every aggregate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import (
    CodecError,
    Payload,
    bytes_to_tensor,
    mean_of_decoded,
    require_buffer,
    require_fields,
    tensor_to_bytes,
)

DENSE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DenseCodec:
    """Lossless (fp32) or half-precision (fp16, bf16) dense encoding."""

    def __init__(self, name: str = "fp32") -> None:
        if name not in DENSE_DTYPES:
            raise CodecError(f"unknown dense codec {name!r}; choose one of {sorted(DENSE_DTYPES)}")
        self.name = name
        self.dtype = DENSE_DTYPES[name]
        self.itemsize = torch.finfo(self.dtype).bits // 8

    def __repr__(self) -> str:
        return f"DenseCodec({self.name!r})"

    def encode(self, x: torch.Tensor) -> Payload:
        """Encode a float tensor (any device) as raw little-endian values of this codec's dtype."""
        if not x.is_floating_point():
            raise CodecError(f"{self.name} encodes floating-point tensors, got {x.dtype}")
        flat = x.detach().reshape(-1)
        if flat.numel():
            lo, hi = torch.aminmax(flat)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                raise CodecError(f"cannot encode non-finite values with {self.name}")
            if flat.dtype == torch.float64:  # an fp64 value past fp32's range saturates too (not inf)
                flat = flat.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max).to(torch.float32)
            limit = torch.finfo(self.dtype).max
            if self.dtype != torch.float32 and max(-float(lo), float(hi)) > limit:
                flat = flat.to(torch.float32).clamp(-limit, limit)  # saturate instead of producing inf
        return Payload(
            codec=self.name, shape=tuple(x.shape), buffers={"data": tensor_to_bytes(flat.to(self.dtype))}
        )

    def expected_nbytes(self, numel: int) -> dict[str, int]:
        """Exact buffer sizes for a tensor of `numel` elements."""
        return {"data": numel * self.itemsize}

    def validate(self, payload: Payload) -> None:
        """Raise CodecError unless the payload is a well-formed, finite dense payload."""
        if not _bytes_all_finite(self._checked_buffer(payload), self.dtype):
            raise CodecError(f"{self.name} payload holds non-finite values")

    def decode(self, payload: Payload, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode into an fp32 tensor of the payload's shape."""
        buf = self._checked_buffer(payload)
        t = bytes_to_tensor(buf, self.dtype, device)
        _require_finite(t, self.name)
        return t.to(torch.float32).view(payload.shape)

    def aggregate(
        self, payloads: Sequence[Payload], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Mean of the decoded payloads, summed in order."""
        return mean_of_decoded(self, payloads, device)

    def _checked_buffer(self, payload: Payload) -> bytes:
        if payload.codec != self.name:
            raise CodecError(f"expected a {self.name!r} payload, got {payload.codec!r}")
        require_fields(payload, set(), {"data"})
        return require_buffer(payload, "data", payload.numel * self.itemsize)


# Per dtype: little-endian unsigned and signed integer views of its bits, and its exponent mask.
_BIT_LAYOUT: dict[torch.dtype, tuple[str, str, int]] = {
    torch.float32: ("<u4", "<i4", 0x7F80_0000),
    torch.float16: ("<u2", "<i2", 0x7C00),
    torch.bfloat16: ("<u2", "<i2", 0x7F80),
}
_BLOCK_BYTES = 1 << 18  # scanned twice: small enough that the second scan reads from cache


def _bytes_all_finite(buf: bytes, dtype: torch.dtype) -> bool:
    """True when no value of the raw little-endian `buf` is inf or NaN, without copying it.

    Inf and NaN are the values with every exponent bit set. On the bits read as unsigned, the
    negative ones are the largest (sign bit set) and among them those at or above sign|exponent;
    read as signed, the positive ones are the largest, those at or above the exponent mask. Two
    max-reductions per block, in numpy, which views read-only bytes silently: torch.frombuffer
    warns on them, and silencing that with warnings.catch_warnings would swap the process-wide
    filters from the network thread, under the trainer's feet."""
    unsigned, signed, exponent = _BIT_LAYOUT[dtype]
    bits = np.frombuffer(buf, dtype=unsigned)
    negative_limit = exponent | (1 << (8 * bits.itemsize - 1))
    as_signed = bits.view(signed)
    step = _BLOCK_BYTES // bits.itemsize
    for start in range(0, bits.size, step):
        if int(bits[start:start + step].max()) >= negative_limit:
            return False
        if int(as_signed[start:start + step].max()) >= exponent:
            return False
    return True


def _require_finite(t: torch.Tensor, name: str) -> None:
    if t.numel():
        lo, hi = torch.aminmax(t)  # NaN propagates into both
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise CodecError(f"{name} payload holds non-finite values")
