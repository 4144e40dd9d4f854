"""Per-block absmax int8: ~1.03 bytes per parameter (3.9x smaller than fp32).

Wire format (a `Payload` named "int8", params {"block": B}):
- "q":     n int8 values, q = round(x / scale), in -127..127;
- "scale": ceil(n / B) float32 scales, scale = max |x| of the block / 127 (the last block may be
           partial; its padding is not sent).
Decoded value = q * scale, so each entry is within half a step (scale / 2) of the input.
Default B = 128 with fp32 scales: the same 1/32 overhead as B = 64 with fp16 scales, but no fp16
range trouble (overflow above 65504, precision loss for blocks of tiny pseudo-gradients).
Decoding rejects negative, non-finite or overflowing scales; q = -128 decodes as is. Encoding
rejects non-finite input and saturates finite values beyond `SATURATE_AT` (whose scale times 128
stays finite), so whatever a payload decodes to (an aggregator's mean of one such value
included) encodes again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    CodecError,
    Payload,
    bytes_to_tensor,
    mean_of_decoded,
    require_buffer,
    require_fields,
    require_param,
    tensor_to_bytes,
)
from .segments import ALIGN

DEFAULT_BLOCK = 128
MIN_BLOCK = 8
MAX_BLOCK = ALIGN  # a block must divide the segment alignment: no segment ends in a partial block
_STREAM_ELEMS = 1 << 21  # elements per streamed step on CPU: temporaries stay small and cached
# The largest magnitude encoded as is: its scale (/127) times 128, what `_parse` checks, is finite.
SATURATE_AT = torch.finfo(torch.float32).max / 128 * 126


class Int8Codec:
    """Symmetric int8 quantisation with one fp32 absmax scale per block."""

    name = "int8"

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        check_int8_options(block)
        self.block = block

    def __repr__(self) -> str:
        return f"Int8Codec(block={self.block})"

    def encode(self, x: torch.Tensor) -> Payload:
        """Encode a float tensor (any device) into an int8 payload."""
        if not x.is_floating_point():
            raise CodecError(f"int8 encodes floating-point tensors, got {x.dtype}")
        flat = x.detach().reshape(-1).to(torch.float32)
        n = flat.numel()
        q = torch.empty(n, dtype=torch.int8, device=flat.device)
        scales = torch.empty(-(-n // self.block), dtype=torch.float32, device=flat.device)
        for lo, hi, rows in self._steps(n, flat.device):
            xb = flat[lo:hi].view(rows, -1)
            amax = torch.maximum(xb.amax(1), xb.amin(1).neg_())
            if not bool((amax <= SATURATE_AT).all()):  # (NaN fails this too)
                if not bool(torch.isfinite(amax).all()):
                    raise CodecError("cannot encode non-finite values with int8")
                xb = xb.clamp(-SATURATE_AT, SATURATE_AT)  # saturate (a decoded -128 * max scale, say)
                amax = torch.maximum(xb.amax(1), xb.amin(1).neg_())
            s = amax.div_(torch.full_like(amax, 127.0))  # a true division on every device
            scales[lo // self.block : lo // self.block + rows] = s
            safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)  # all-zero block: q = 0
            q[lo:hi].view(rows, -1).copy_(torch.div(xb, safe).round_().clamp_(-127, 127))
        return Payload(
            codec=self.name,
            shape=tuple(x.shape),
            params={"block": self.block},
            buffers={"q": tensor_to_bytes(q), "scale": tensor_to_bytes(scales)},
        )

    def expected_nbytes(self, numel: int) -> dict[str, int]:
        """Exact buffer sizes for a tensor of `numel` elements."""
        return {"q": numel, "scale": 4 * -(-numel // self.block)}

    def validate(self, payload: Payload) -> None:
        """Raise CodecError unless the payload decodes cleanly with this codec."""
        self._parse(payload, None)

    def decode(self, payload: Payload, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode into an fp32 tensor of the payload's shape."""
        q, scales = self._parse(payload, device)
        n = q.numel()
        out = torch.empty(n, dtype=torch.float32, device=q.device)
        for lo, hi, rows in self._steps(n, q.device):
            ob = out[lo:hi].view(rows, -1)
            ob.copy_(q[lo:hi].view(rows, -1))  # int8 -> fp32 in cache, then scale in place
            ob.mul_(scales[lo // self.block : lo // self.block + rows].unsqueeze(1))
        return out.view(payload.shape)

    def aggregate(
        self, payloads: Sequence[Payload], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Mean of the decoded payloads, summed in order."""
        return mean_of_decoded(self, payloads, device)

    def _steps(self, n: int, device: torch.device):
        """(start, end, rows) spans: whole blocks in streamed steps, then the partial last block."""
        full = n // self.block
        step = max(1, full) if device.type != "cpu" else max(1, _STREAM_ELEMS // self.block)  # full: 0 under a block
        for r0 in range(0, full, step):
            r1 = min(full, r0 + step)
            yield r0 * self.block, r1 * self.block, r1 - r0
        if n > full * self.block:
            yield full * self.block, n, 1

    def _parse(
        self, payload: Payload, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if payload.codec != self.name:
            raise CodecError(f"expected a {self.name!r} payload, got {payload.codec!r}")
        require_fields(payload, {"block"}, {"q", "scale"})
        require_param(payload, "block", self.block)
        n = payload.numel
        nblocks = -(-n // self.block)
        q_buf = require_buffer(payload, "q", n)
        s_buf = require_buffer(payload, "scale", 4 * nblocks)
        scales = bytes_to_tensor(s_buf, torch.float32, device)
        if nblocks:
            lo, hi = torch.aminmax(scales)
            # |q| <= 128, so 128 * max scale bounds every decoded magnitude
            if not (bool(torch.isfinite(hi * 128.0)) and float(lo) >= 0):
                raise CodecError("int8 scales must be finite, non-negative and at most fp32 max / 128")
        return bytes_to_tensor(q_buf, torch.int8, device), scales


def check_int8_options(block: object) -> None:
    """CodecError unless block is a power of two in 8..4096 (so it divides segments.ALIGN)."""
    if (
        not isinstance(block, int)
        or isinstance(block, bool)
        or not MIN_BLOCK <= block <= MAX_BLOCK
        or block & (block - 1)
    ):
        raise CodecError(f"int8 block must be a power of two in {MIN_BLOCK}..{MAX_BLOCK} (a divisor of the "
                         f"segment alignment), got {block!r}")
