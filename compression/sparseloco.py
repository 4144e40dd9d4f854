"""SparseLoCo: per-chunk top-k sparsification with 2-bit values, ~0.16 bits per parameter.

Wire format (a `Payload` named "sparseloco", params {"chunk": C, "k": k}):
- the tensor is flattened and cut into R = ceil(n / C) chunks; the last may be partial (r = n mod
  C entries) and keeps min(k, r) entries, every other chunk exactly k. K = total kept entries.
  Padding is never sent: it is implied by the shape, and no index may point into it;
- "idx":   the K in-chunk positions, strictly ascending within each chunk, Elias-Fano coded per
           chunk with l = floor(log2(C / k)) low bits (6 for C = 4096, k = 64): a chunk of u
           entries keeping n writes, for its i-th position p_i, bit (p_i >> l) + i of an
           (n + ((u - 1) >> l) + 1)-bit "high" bitmap (exactly n ones), and p_i's l low bits.
           The buffer is every chunk's high bitmap, in chunk order, as one bit stream, then
           every low part as one l-bit stream. 2 + l bits per position (8 for top-64 of 4096,
           against 12 for plain positions), a size fixed by the shape, and one canonical byte
           form per selection;
- "code":  K 2-bit codes, four per byte: bit 1 = sign (1 = negative), bit 0 = magnitude bin;
- "scale": R bfloat16 chunk scales, s = mean |v| of the chunk's kept entries;
- "level": two float32 magnitude levels L0, L1 shared by the whole tensor;
- decoded value = (-1)**sign * L[bin] * s. The bin threshold is |v| >= s. The levels minimise the
  total squared error given the scales: L[b] = sum(|v| s) / sum(s**2) over the entries of bin b.
Bit streams are little-endian, see `bitpack`. bfloat16 scales keep fp32's range (no overflow or
flush for tiny pseudo-gradients); their 3 fewer mantissa bits than fp16 are noise next to 2-bit
values. Selection is the canonical top-k of `topk` (ties to the lowest index).

Decoding checks everything a hostile peer could get wrong before touching the output: field set,
buffer lengths (from the shape, before any allocation), finite non-negative scales and levels,
no decoded magnitude that overflows fp32, exactly n ones in each chunk's high bitmap, ascending
in-range positions, zero padding bits.
Decoding is deterministic: values come from one fp32 multiply, and `aggregate` adds the
payloads one after another into a single fp32 buffer, each payload's indices being unique.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    CodecError,
    Payload,
    bytes_to_tensor,
    require_buffer,
    require_fields,
    require_param,
    sum_to_mean_,
    tensor_to_bytes,
)
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .parse_cache import ParseCache
from .segments import ALIGN
from .topk import topk_rows

DEFAULT_CHUNK = 4096
DEFAULT_K = 64
MAX_CHUNK = ALIGN  # a chunk must divide the segment alignment: no segment ends in a partial chunk
PARSED_CACHE_BYTES = 256 << 20  # validated-but-not-yet-decoded payloads kept parsed, at most
PARSED_CACHE_ITEMS = 1024
OWN_CACHE_BYTES = 64 << 20  # the encoder's own payloads, kept parsed until decoded (one round's worth)
OWN_CACHE_ITEMS = 256
_BF16_MAX = torch.finfo(torch.bfloat16).max
_EMPTY_BIN_LEVELS = (0.5, 1.5)  # any finite value: an empty bin's level is never used


class SparseLoCoCodec:
    """Top-k per chunk, Elias-Fano coded indices, 2-bit values with per-chunk scales."""

    name = "sparseloco"

    def __init__(self, chunk: int = DEFAULT_CHUNK, k: int = DEFAULT_K) -> None:
        check_sparseloco_options(chunk, k)
        self.chunk = chunk
        self.k = k
        self.low_bits = ef_low_bits(chunk, k)
        # Payloads `validate` parsed, so that from_bytes -> decode (or -> entries) does not
        # unpack and check one twice (an aggregator validates contributions it never decodes);
        # and the encoder's own payloads, apart, so that encodings nobody decodes here (a codec
        # bench, a tampered copy) never push the network's parses out.
        self._validated = ParseCache(PARSED_CACHE_BYTES, PARSED_CACHE_ITEMS)
        self._own = ParseCache(OWN_CACHE_BYTES, OWN_CACHE_ITEMS)

    def __repr__(self) -> str:
        return f"SparseLoCoCodec(chunk={self.chunk}, k={self.k})"

    def layout(self, numel: int) -> tuple[int, int, int]:
        """(full chunks, entries in the partial last chunk, total kept entries K) for `numel`."""
        full, rem = divmod(numel, self.chunk)
        return full, rem, full * self.k + min(self.k, rem)

    def expected_nbytes(self, numel: int) -> dict[str, int]:
        """Exact buffer sizes for a tensor of `numel` elements."""
        full, rem, kept = self.layout(numel)
        high = full * _high_len(self.chunk, self.k, self.low_bits) + (
            _high_len(rem, min(self.k, rem), self.low_bits) if rem else 0)
        return {
            "idx": packed_nbytes(high, 1) + (packed_nbytes(kept, self.low_bits) if self.low_bits else 0),
            "code": packed_nbytes(kept, 2),
            "scale": 2 * (full + (rem > 0)),
            "level": 8,
        }

    def encode(self, x: torch.Tensor) -> Payload:
        """Encode a float tensor (any device) into a sparseloco payload."""
        if not x.is_floating_point():
            raise CodecError(f"sparseloco encodes floating-point tensors, got {x.dtype}")
        flat = x.detach().reshape(-1).to(torch.float32)
        full, rem, _ = self.layout(flat.numel())
        parts = []
        try:
            if full:
                parts.append(topk_rows(flat[: full * self.chunk].view(full, self.chunk), self.k))
            if rem:
                parts.append(topk_rows(flat[full * self.chunk :].view(1, rem), min(self.k, rem)))
        except ValueError as exc:
            raise CodecError(f"cannot encode: {exc}") from None
        scales, codes, levels = _quantize([vals for _, vals in parts], flat.device)
        universes = [self.chunk] * bool(full) + [rem] * bool(rem)
        idx = ef_encode([i for i, _ in parts], universes, self.low_bits, flat.device)
        payload = Payload(
            codec=self.name,
            shape=tuple(x.shape),
            params={"chunk": self.chunk, "k": self.k},
            buffers={
                "idx": tensor_to_bytes(idx),
                "code": tensor_to_bytes(pack_bits(codes, 2)),
                "scale": tensor_to_bytes(scales),
                "level": tensor_to_bytes(levels),
            },
        )
        if flat.device.type == "cpu":
            # The encoder's own decode (SparseLoCo decodes what it sent, for the eager start and
            # the error feedback) then skips unpacking and checking bytes it just wrote.
            self._own.put(payload, _decoded_entries([i for i, _ in parts], codes, scales, levels, self.chunk))
        return payload

    def validate(self, payload: Payload) -> None:
        """Raise CodecError unless the payload decodes cleanly with this codec."""
        self._validated.put(payload, self._parse(payload, None))

    def decode(self, payload: Payload, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode into a dense fp32 tensor of the payload's shape."""
        pos, vals = self._parsed(payload, device)
        out = torch.zeros(payload.numel, dtype=torch.float32, device=vals.device)
        out.index_copy_(0, pos, vals)
        return out.view(payload.shape)

    def entries(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload's kept entries on the CPU: (flat int64 positions, ascending and unique;
        their fp32 values), exactly what `decode` scatters into zeros."""
        return self._parsed(payload, None)

    def aggregate(
        self, payloads: Sequence[Payload], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Mean of the decoded payloads, scatter-added in order into one fp32 buffer."""
        if not payloads:
            raise CodecError("cannot aggregate zero payloads")
        shape = payloads[0].shape
        if any(p.shape != shape for p in payloads):
            raise CodecError("cannot aggregate payloads of different shapes")
        parsed = self._parsed(payloads[0], device)
        out = torch.zeros(payloads[0].numel, dtype=torch.float32, device=parsed[1].device)
        for i, p in enumerate(payloads):
            pos, vals = parsed if i == 0 else self._parsed(p, device)
            out.scatter_add_(0, pos, vals)  # indices unique within a payload: deterministic
        return sum_to_mean_(out, len(payloads)).view(shape)

    def _parsed(
        self, payload: Payload, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_parse`, reusing the parse `validate` (or our own `encode`) just made of the same payload."""
        cached = self._own.take(payload) or self._validated.take(payload)
        if cached is not None:
            pos, vals = cached  # parsed on the CPU; the values are the same on any device
            return (pos, vals) if device is None else (pos.to(device), vals.to(device))
        return self._parse(payload, device)

    def _parse(
        self, payload: Payload, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a payload and return (flat int64 positions, fp32 values), both on `device`."""
        if payload.codec != self.name:
            raise CodecError(f"expected a {self.name!r} payload, got {payload.codec!r}")
        require_fields(payload, {"chunk", "k"}, {"idx", "code", "scale", "level"})
        require_param(payload, "chunk", self.chunk)
        require_param(payload, "k", self.k)
        numel = payload.numel
        sizes = self.expected_nbytes(numel)
        bufs = {name: require_buffer(payload, name, size) for name, size in sizes.items()}
        full, rem, kept = self.layout(numel)
        dev = torch.device(device) if device is not None else torch.device("cpu")

        levels = bytes_to_tensor(bufs["level"], torch.float32, dev)
        scales = bytes_to_tensor(bufs["scale"], torch.bfloat16, dev).to(torch.float32)
        if not bool(torch.isfinite(levels).all()) or bool((levels < 0).any()):
            raise CodecError("sparseloco levels must be finite and non-negative")
        if scales.numel():
            lo, hi = torch.aminmax(scales)
            if not (bool(torch.isfinite(hi)) and float(lo) >= 0):
                raise CodecError("sparseloco chunk scales must be finite and non-negative")
            if not bool(torch.isfinite(levels.max() * hi)):
                raise CodecError("sparseloco levels times scales overflow fp32")

        idx = self._positions(bytes_to_tensor(bufs["idx"], torch.uint8, dev), full, rem, kept)
        codes = unpack_bits(bytes_to_tensor(bufs["code"], torch.uint8, dev), 2, kept)
        body = idx[: full * self.k].view(full, self.k)
        tail = idx[full * self.k :]
        table = torch.stack([levels[0], levels[1], -levels[0], -levels[1]])
        vals = table.index_select(0, codes)
        vals[: full * self.k].view(full, self.k).mul_(scales[:full].unsqueeze(1))
        if rem:
            vals[full * self.k :].mul_(scales[full])
        starts = torch.arange(full, device=dev, dtype=torch.int64).mul_(self.chunk).unsqueeze(1)
        body.add_(starts)  # in-chunk index -> flat position, in place: idx is ours
        tail.add_(full * self.chunk)
        return idx, vals


    def _positions(self, data: torch.Tensor, full: int, rem: int, kept: int) -> torch.Tensor:
        """The K in-chunk positions of an "idx" buffer (of the right length), checked: exactly n
        ones per high bitmap, strictly ascending within each chunk, none past the chunk's end."""
        k, low = self.k, self.low_bits
        body_high = full * _high_len(self.chunk, k, low)
        tail_n = min(k, rem)
        nhigh = body_high + (_high_len(rem, tail_n, low) if rem else 0)
        split = packed_nbytes(nhigh, 1)
        bits = unpack_bits(data[:split], 1, nhigh)
        lows = unpack_bits(data[split:], low, kept) if low else torch.zeros(kept, dtype=torch.int64, device=data.device)
        parts = []
        for rows, n, universe, chunk_bits in ((full, k, self.chunk, bits[:body_high]), (int(rem > 0), tail_n, rem, bits[body_high:])):
            if not rows:
                continue
            grid = chunk_bits.view(rows, -1)
            if not bool((grid.sum(1) == n).all()):
                raise CodecError(f"sparseloco index bitmaps must hold exactly {n} ones per chunk")
            cols = grid.nonzero()[:, 1].view(rows, n)  # row-major: each row's n ones, in order
            parts.append((cols - torch.arange(n, device=data.device)).bitwise_left_shift_(low))
        idx = torch.cat([p.view(-1) for p in parts]) if parts else lows
        idx.bitwise_or_(lows)
        body = idx[: full * k].view(full, k)
        tail = idx[full * k :]
        if full and (k > 1 and not bool((body[:, 1:] > body[:, :-1]).all())):
            raise CodecError("sparseloco indices must be strictly ascending within each chunk")
        if full and int(body[:, -1].max()) >= self.chunk:
            raise CodecError("sparseloco index past the end of its chunk")
        if tail.numel():
            if bool((tail[1:] <= tail[:-1]).any()):
                raise CodecError("sparseloco indices must be strictly ascending within each chunk")
            if int(tail[-1]) >= rem:
                raise CodecError(f"sparseloco index {int(tail[-1])} lies in the padding of the last chunk")
        return idx


def ef_low_bits(chunk: int, k: int) -> int:
    """Elias-Fano low bits for k positions out of `chunk`: floor(log2(chunk / k))."""
    return (chunk // k).bit_length() - 1


def _high_len(universe: int, n: int, low: int) -> int:
    """Bits of the high bitmap of one chunk of `universe` entries keeping `n`."""
    return n + ((universe - 1) >> low) + 1


def ef_encode(groups: list[torch.Tensor], universes: list[int], low: int, device: torch.device) -> torch.Tensor:
    """Elias-Fano code per row: `groups` are (rows, n) ascending in-chunk positions of chunks of
    `universes[i]` entries; returns the "idx" buffer (all high bitmaps, then all low parts)."""
    highs, lows = [], []
    for idx, universe in zip(groups, universes, strict=True):
        rows, n = idx.shape
        bitmap = torch.zeros(rows, _high_len(universe, n, low), dtype=torch.uint8, device=device)
        bitmap.scatter_(1, (idx >> low) + torch.arange(n, device=device), 1)
        highs.append(bitmap.view(-1))
        lows.append((idx & ((1 << low) - 1)).view(-1))
    if not highs:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    packed = [pack_bits(torch.cat(highs), 1)]
    if low:
        packed.append(pack_bits(torch.cat(lows), low))
    return torch.cat(packed)


def _decoded_entries(groups: list[torch.Tensor], codes: torch.Tensor, scales: torch.Tensor,
                     levels: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_parse` makes of an encoding (flat positions, fp32 values), from the encoder's own
    tensors: `groups` are the (rows, n) ascending in-chunk positions of the full chunks, then of
    the partial last one; the rest as `_quantize` returns them. The same operations on the same
    numbers as `_parse`, so bit-identical to parsing the payload's bytes."""
    table = torch.stack([levels[0], levels[1], -levels[0], -levels[1]])
    vals = table.index_select(0, codes.to(torch.int64))
    scale = scales.to(torch.float32)
    positions, start, offset, row = [], 0, 0, 0
    for g in groups:
        rows, n = g.shape
        positions.append((g + torch.arange(rows, dtype=torch.int64).mul_(chunk).add_(start).unsqueeze(1)).view(-1))
        vals[offset:offset + rows * n].view(rows, n).mul_(scale[row:row + rows].unsqueeze(1))
        start, offset, row = start + rows * chunk, offset + rows * n, row + rows
    return (torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)), vals


def check_sparseloco_options(chunk: object, k: object) -> None:
    """CodecError unless chunk is a power of two in 2..4096 (so it divides segments.ALIGN) and k
    is in 1..chunk."""
    if (
        not isinstance(chunk, int)
        or isinstance(chunk, bool)
        or not 2 <= chunk <= MAX_CHUNK
        or chunk & (chunk - 1)
    ):
        raise CodecError(f"sparseloco chunk must be a power of two in 2..{MAX_CHUNK} (a divisor of the "
                         f"segment alignment), got {chunk!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= chunk:
        raise CodecError(f"sparseloco k must be an int in 1..chunk ({chunk}), got {k!r}")


def _quantize(
    parts: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept values (one 2-D tensor per group of equal-size chunks) -> bf16 scales, 2-bit codes, levels."""
    scales, codes = [], []
    # Per bin b: L[b] = sum(|v| s) / sum(s^2) = sum(ratio w) / sum(w) with w = (s / top)^2, the
    # normalisation by the largest magnitude keeping w in [0, 1]. Accumulated per chunk into
    # [ratio*w over bin 0, over bin 1, w over bin 0, over bin 1]: all terms >= 0, no cancellation.
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    top = max((float(v.abs().amax()) for v in parts if v.numel()), default=0.0)
    for vals in parts:
        if not bool(torch.isfinite(vals).all()):  # the selection keeps any inf: it is the largest
            raise CodecError("cannot encode non-finite values with sparseloco")
        mag = vals.abs()
        # mean in fp64: 64 finite fp32 magnitudes can overflow an fp32 sum
        s = mag.mean(1, dtype=torch.float64).clamp_(max=_BF16_MAX).to(torch.bfloat16)
        sf = s.to(torch.float32)
        ratio = mag.div_(torch.where(sf > 0, sf, 1.0).unsqueeze(1))  # all-zero chunk: scale 0, decodes to 0
        high = ratio >= 1.0
        codes.append(((vals < 0).to(torch.uint8).mul_(2) + high).reshape(-1))
        scales.append(s)
        if top > 0:
            w = (sf.to(torch.float64) / top).square_()
            high_f = high.to(torch.float32)
            low_f = 1.0 - high_f
            per_chunk = torch.stack(
                [(ratio * low_f).sum(1), (ratio * high_f).sum(1), low_f.sum(1), high_f.sum(1)]
            )
            sums += (per_chunk.to(torch.float64) * w).sum(1)
    num, den = sums[:2], sums[2:]
    empty = torch.tensor(_EMPTY_BIN_LEVELS, dtype=torch.float64, device=device)
    levels = torch.where(den > 0, num / den.clamp(min=1e-300), empty).to(torch.float32)
    scale_all = torch.cat(scales) if scales else torch.zeros(0, dtype=torch.bfloat16, device=device)
    if scale_all.numel() and not bool(torch.isfinite(levels.max() * scale_all.max().to(torch.float32))):
        raise CodecError("cannot encode: values too large for sparseloco's fp32 levels times bf16 scales")
    code_all = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.uint8, device=device)
    return scale_all, code_all, levels
