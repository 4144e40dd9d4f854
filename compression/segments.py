"""A flat parameter vector as fixed, aligned segments, each encoded on its own.

The swarm splits the parameter space into shards, each aggregated by a different peer. Encoding
segment by segment (instead of the whole vector at once) lets any contiguous run of segments be
one shard without re-encoding, and keeps every codec's chunks and blocks inside one segment.

Chunks (sparseloco) and blocks (int8) are runs of consecutive values of the flat vector, all the
model's parameters concatenated in `parameters()` order: not tiles of each matrix, and a run may
span two parameter tensors. Segments start at multiples of ALIGN, which every chunk and block
size divides, so only the vector's last segment may end in a partial chunk or block, and the
boundaries fall where they would if the whole vector were encoded at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, CodecError, Payload

# A multiple of every codec's chunk or block (defaults: sparseloco 4096, int8 128): the codecs'
# option checks accept only powers of two up to it.
ALIGN = 4096


def segment_size(numel: int, max_segments: int = 16) -> int:
    """Elements per segment so that a vector of `numel` has at most `max_segments` of them."""
    if numel <= 0 or max_segments <= 0:
        raise ValueError("numel and max_segments must be positive")
    per = -(-numel // max_segments)
    return -(-per // ALIGN) * ALIGN


def segment_bounds(numel: int, segment: int) -> list[tuple[int, int]]:
    """[(start, stop)] of each segment of a `numel`-element vector; the last may be short."""
    if segment <= 0 or segment % ALIGN:
        raise ValueError(f"segment size must be a positive multiple of {ALIGN}, got {segment}")
    return [(s, min(s + segment, numel)) for s in range(0, numel, segment)]


def encode_segments(codec: Codec, vector: torch.Tensor, segment: int) -> list[Payload]:
    """Encode each segment of a flat vector separately."""
    flat = vector.reshape(-1)
    return [codec.encode(flat[a:b]) for a, b in segment_bounds(flat.numel(), segment)]


def check_segments(payloads: Sequence[Payload], numel: int, segment: int) -> None:
    """Raise `CodecError` unless `payloads` are exactly the segments of a `numel` vector."""
    bounds = segment_bounds(numel, segment)
    if len(payloads) != len(bounds):
        raise CodecError(f"expected {len(bounds)} segments, got {len(payloads)}")
    for i, (p, (a, b)) in enumerate(zip(payloads, bounds)):
        if p.shape != (b - a,):
            raise CodecError(f"segment {i} has shape {p.shape}, expected ({b - a},)")


def decode_segments(
    codec: Codec, payloads: Sequence[Payload], numel: int, segment: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Decode a full list of segment payloads into one flat fp32 vector."""
    check_segments(payloads, numel, segment)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for p, (a, b) in zip(payloads, segment_bounds(numel, segment)):
        out[a:b] = codec.decode(p, device=device)
    return out


def aggregate_segments(
    codec: Codec,
    contributions: Sequence[Sequence[Payload]],
    numel: int,
    segment: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Mean over contributions (each a full list of segments), one segment at a time."""
    if not contributions:
        raise CodecError("cannot aggregate zero contributions")
    for c in contributions:
        check_segments(c, numel, segment)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for i, (a, b) in enumerate(segment_bounds(numel, segment)):
        out[a:b] = codec.aggregate([c[i] for c in contributions], device=device)
    return out
