"""Robust means of contributions: norm clipping to the median norm, and a coordinate-wise trimmed
mean, computed bit-identically on every CPU.

Every peer that averages a sparse round computes this mean itself, so it must not depend on the
thread count or the vector width of the machine: reductions are done as a fixed binary tree of
elementwise float64 additions (IEEE-754 additions are correctly rounded, so a fixed order gives
fixed bits), and a contribution's weight is one correctly rounded fp64 division cast to fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .base import Codec, CodecError, Payload, sum_to_mean_


@dataclass(frozen=True)
class RobustOptions:
    """How contributions are made robust before averaging; zeros turn a defence off."""

    clip: float = 1.0  # clip each contribution's norm to clip * the median norm (per shard)
    trim: float = 0.0  # coordinate-wise trimmed mean: drop this fraction at each end (dense codecs)

    def __post_init__(self) -> None:
        if not self.clip >= 0:
            raise ValueError(f"clip must be >= 0, got {self.clip}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim}")

    @property
    def active(self) -> bool:
        """Does this change the plain mean at all?"""
        return self.clip > 0 or self.trim > 0


@dataclass
class RobustStats:
    """What the robust mean did: which contributions (by position) had their norm clipped."""

    clipped: set[int] = field(default_factory=set)
    weights: dict[int, float] = field(default_factory=dict)  # clipped ones: the fp32 factor each entered the mean with
    trimmed: int = 0  # values dropped per coordinate at each end


def tree_sum_of_squares(x: torch.Tensor) -> float:
    """sum(x**2) in float64 by a fixed pairwise tree: the same bits on every CPU and thread count.

    Level by level, the last half of the values is added elementwise onto the first half (one
    correctly rounded addition per element: no order is left to the library); of an odd count the
    middle value passes up unchanged. Contiguous halves, added in place, cost a fraction of
    strided pairs; any fixed tree is as exact, but every peer of a run must use this one."""
    v = x.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    n = v.numel()
    if n == 0:
        return 0.0
    if v.data_ptr() == x.data_ptr():
        v = v.clone()  # the caller's fp64 tensor is not ours to fold
    v.mul_(v)  # an fp32 value's square is exact in fp64
    while n > 1:
        half, keep = n // 2, n - n // 2
        v[:half] += v[keep:n]
        n = keep
    return float(v[0])


def _nonzeros(t: torch.Tensor) -> torch.Tensor:
    """`t[t != 0]`, without the copy when nothing is zero."""
    return t if int(torch.count_nonzero(t)) == t.numel() else t[t != 0]


def _row_sq_norm(segments: Iterable[torch.Tensor], sparse: bool) -> float:
    """One contribution's squared norm: its segments' tree sums, added in segment order. Of a
    sparse codec's, over the nonzeros alone: its kept entries give the same tree as its dense
    decoding (a sparse update has ~1/64 of them, so that is also much cheaper); a dense codec's
    zeros stay in (taking them out is a masked copy of every value, for nothing)."""
    return _sum_in_order(tree_sum_of_squares(_nonzeros(t) if sparse else t) for t in segments)


def _is_sparse(codec: Codec) -> bool:
    """Does the codec carry kept entries (positions and values), whose mean is taken from them?"""
    return getattr(codec, "entries", None) is not None


def contribution_sq_norm(codec: Codec, row: Sequence[Payload]) -> float:
    """A contribution's squared norm over its segments, as `robust_mean` computes it for clipping:
    an aggregator can work it out when the contribution arrives, and pass it in at the seal."""
    return _row_sq_norm((codec.decode(p, device="cpu") for p in row), _is_sparse(codec))


def clip_weights(sq_norms: Sequence[float], clip: float) -> list[float]:
    """Per-contribution scale factors (<= 1) that clip every norm to `clip` * the median of the
    non-zero norms. An all-zero contribution (a peer that made no step) has nothing to clip and
    sets no reference: counted in the median, one of two peers' zeros used to scale the other's
    whole update to nothing, which DiLoCo then dropped from the peer's progress."""
    ordered = sorted(sq for sq in sq_norms if sq > 0)
    if clip <= 0 or not ordered:
        return [1.0] * len(sq_norms)
    mid = len(ordered) // 2
    # the lower median: with an even count, the larger half cannot pull the reference up
    median_sq = ordered[mid - 1] if len(ordered) % 2 == 0 else ordered[mid]
    ref = clip * math.sqrt(median_sq)  # sqrt and / are correctly rounded everywhere (pow is not)
    out = []
    for sq in sq_norms:
        norm = math.sqrt(sq)
        out.append(1.0 if norm <= ref or norm == 0 else ref / norm)
    return out


def robust_mean(codec: Codec, rows: Sequence[Sequence[Payload]], options: RobustOptions,
                stats: RobustStats | None = None, sq_norms: Sequence[float] | None = None,
                out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The robust mean of each segment over contributions: `rows[c][i]` is contribution c's
    payload of segment i; the norm that is clipped is contribution c's over all its segments.
    `sq_norms`: each row's `contribution_sq_norm`, if already known (dense codecs). `out`: one
    contiguous fp32 buffer per segment to write the means into (the caller's slices of one whole
    vector, say: no second copy of it); the returned means are then views of them."""
    if not rows:
        raise CodecError("cannot aggregate zero contributions")
    _check_alike(rows)
    num_segments = len(rows[0])
    buffers = _checked_out(out, [p.numel for p in rows[0]])
    if not options.active:
        means = [codec.aggregate([r[i] for r in rows]) for i in range(num_segments)]
        return means if buffers is None else [b.copy_(m.view(-1)).view(m.shape) for b, m in zip(buffers, means)]
    entries = getattr(codec, "entries", None)
    if entries is not None and not options.trim:
        return _sparse_clipped_mean(entries, rows, options.clip, stats, buffers)
    decoded = [[codec.decode(p, device="cpu") for p in row] for row in rows]
    if sq_norms is not None and len(sq_norms) != len(rows):
        raise CodecError(f"{len(sq_norms)} norms for {len(rows)} contributions")
    if sq_norms is None:
        sq_norms = [_row_sq_norm(row, _is_sparse(codec)) for row in decoded]
    weights = clip_weights(list(sq_norms), options.clip)
    if stats is not None:
        _note_clipped(stats, weights)
    n = len(rows)
    trim = int(options.trim * n)
    if stats is not None:
        stats.trimmed = trim
    out = []
    for i in range(num_segments):
        scaled = [decoded[c][i] if weights[c] == 1.0 else decoded[c][i] * torch.tensor(weights[c], dtype=torch.float32)
                  for c in range(n)]
        if trim:
            kept = torch.sort(torch.stack(scaled), dim=0).values[trim:n - trim]  # a sort is exact
            scaled = list(kept.unbind(0))
        total = scaled[0].clone() if buffers is None else buffers[i].copy_(scaled[0].view(-1)).view(scaled[0].shape)
        for t in scaled[1:]:  # one after another: a fixed order, like the codecs' own aggregate
            total += t
        if trim:
            total.add_(0.0)  # -0 + 0 = +0: the sort may have put a -0 or a +0 first
        out.append(sum_to_mean_(total, len(scaled)))
    return out


def robust_weights(codec: Codec, rows: Sequence[Sequence[Payload]], options: RobustOptions) -> list[float]:
    """The fp32 factor each contribution enters `robust_mean`'s clipped mean with (1.0: whole),
    without computing the mean: a sparse contribution's norm comes from its kept entries alone."""
    if options.clip <= 0:
        return [1.0] * len(rows)
    _check_alike(rows)
    entries = getattr(codec, "entries", None)
    if entries is not None and not options.trim:  # as `_sparse_clipped_mean` sums them
        sq = [_row_sq_norm((v for _, v in (entries(p) for p in row)), True) for row in rows]
    else:
        sq = [contribution_sq_norm(codec, row) for row in rows]
    return [1.0 if w >= 1.0 else float(torch.tensor(w, dtype=torch.float32)) for w in clip_weights(sq, options.clip)]


def _check_alike(rows: Sequence[Sequence[Payload]]) -> None:
    """CodecError unless every contribution has segments of the same shapes (a shorter one would
    broadcast into a dense sum, or scatter into the wrong places of a sparse one)."""
    if not rows:
        raise CodecError("cannot aggregate zero contributions")
    shapes = [tuple(p.shape) for p in rows[0]]
    if any([tuple(p.shape) for p in r] != shapes for r in rows[1:]):
        raise CodecError("contributions cover different segments or shapes")


def _note_clipped(stats: RobustStats, weights: list[float]) -> None:
    """Record which contributions were clipped, and the fp32 factor each was scaled by (the
    value the mean multiplied it by: its sender keeps the rest in its error feedback)."""
    for c, w in enumerate(weights):
        if w < 1.0:
            stats.clipped.add(c)
            stats.weights[c] = float(torch.tensor(w, dtype=torch.float32))


def _checked_out(out: Sequence[torch.Tensor] | None, numels: list[int]) -> list[torch.Tensor] | None:
    """`robust_mean`'s output buffers, flat, once checked to fit the segments."""
    if out is None:
        return None
    if len(out) != len(numels) or any(
            b.dtype != torch.float32 or not b.is_contiguous() or b.numel() != n or b.device.type != "cpu"
            for b, n in zip(out, numels)):
        # (on the CPU: the entries are parsed there, and a mean every peer must get bit for bit
        # is summed there, whatever device a peer trains on)
        raise CodecError("output buffers must be contiguous fp32 on the CPU, one per segment, of the segments' sizes")
    return [b.view(-1) for b in out]


def _sparse_clipped_mean(entries: Callable[[Payload], tuple[torch.Tensor, torch.Tensor]],
                         rows: Sequence[Sequence[Payload]], clip: float, stats: RobustStats | None,
                         buffers: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The clipped mean of sparse contributions from their kept entries alone, never densely
    decoded. Bit for bit what the dense path computes: the squared norms are summed over the
    same nonzero values in the same (ascending position) order, and each output element gets
    0 + w0 v0 + w1 v1 + ... in contribution order (one scatter-add per contribution, whose
    positions are unique)."""
    parsed = [[entries(p) for p in row] for row in rows]
    sq = [_row_sq_norm((v for _, v in row), True) for row in parsed]
    weights = clip_weights(sq, clip)
    if stats is not None:
        _note_clipped(stats, weights)
    out = []
    for i in range(len(rows[0])):
        n = rows[0][i].numel
        total = torch.zeros(n, dtype=torch.float32) if buffers is None else buffers[i].zero_()
        for c, row in enumerate(parsed):
            pos, vals = row[i]
            total.scatter_add_(0, pos, vals if weights[c] == 1.0 else vals * torch.tensor(weights[c],
                                                                                          dtype=torch.float32))
        out.append(sum_to_mean_(total, len(rows)).view(rows[0][i].shape))
    return out


def _sum_in_order(values: Iterable[float]) -> float:
    """Left-to-right float addition (Python 3.12's sum() compensates; 3.11's does not)."""
    total = 0.0
    for v in values:
        total += v
    return total
