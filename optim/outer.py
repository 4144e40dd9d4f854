"""What DiLoCo and SparseLoCo share: a global copy of the parameters, a round counter, and the
two-phase round (`prepare` a contribution, later `apply` the round's aggregate).

The parameters of the model are the *local* parameters theta_local; the outer optimizer keeps
theta_global, the parameters every worker agreed on at the end of the last applied round. All
vectors are flat fp32 over the model's parameters in `parameters()` order. Parameters that do not
require gradients when the optimizer is made are frozen: they are in the vectors (and the state
every peer agrees on), but no outer step or error feedback ever moves them. A codec may still
send their (zero) pseudo-gradient as a small nonzero value (SparseLoCo's 2-bit values have no
zero), and with many peers a frozen tensor would otherwise drift.

The rebase rule, shared by both algorithms, keeps every bit of local work. After a round the
local parameters become the new theta_global plus the local progress that is not yet in anyone's
hands: the progress since `prepare` if the contribution was absorbed (applied in the aggregate,
or kept in SparseLoCo's error feedback), else all progress since the old theta_global (DiLoCo's
"rebase" of a left-out contribution). With no overlap and an absorbed contribution that progress
is exactly zero, so workers end each round bit-identical to theta_global. Progress made after
`prepare` (overlapped rounds) is carried over in every case; an optimizer may first move the
local parameters at `prepare` to a better starting point for that progress (SparseLoCo's eager
start), and the progress is then measured from there.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from groundswell.compression import Codec, Payload, all_finite, decode_segments, encode_segments, segment_size

from .exchange import Exchange, RoundFailed, RoundResult

log = logging.getLogger(__name__)


def parameters_to_vector(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters as one flat vector, in order. (torch's own `view`s each one, which fails on
    a non-contiguous parameter: a channels_last weight, a transposed view.)"""
    return torch.cat([p.detach().reshape(-1) for p in params])


def copy_into_parameters(vector: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    """Copy a flat vector into the parameters' own storage. (torch's vector_to_parameters makes the
    parameters *views* of the vector, so training would silently write into it.)"""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(vector[offset:offset + n].view_as(p))
            offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} values, the parameters {offset}")


@dataclass
class PendingRound:
    """A contribution handed to the exchange whose round has not been applied yet."""

    round_id: int
    local: torch.Tensor  # theta_local at prepare time (flat fp32)
    payloads: list[Payload]  # the contribution, one payload per segment of the flat vector


class OuterOptimizer(ABC):
    """Base of the outer (cross-worker) optimizers; subclasses define the update rule."""

    def __init__(self, params: Iterable[torch.nn.Parameter], codec: Codec, segment: int | None = None) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("the outer optimizer needs at least one parameter")
        odd = sorted({str(p.dtype) for p in self.params if p.dtype != torch.float32})
        if odd:  # rounding theta_global into them would be sent as a pseudo-gradient every round
            raise ValueError(f"the outer optimizer needs float32 parameters, not {', '.join(odd)}")
        self.codec = codec
        self.global_params = parameters_to_vector(self.params).detach().float().clone()
        # True at the coordinates of frozen parameters; None when every parameter trains (the usual case)
        frozen = torch.cat([torch.full((p.numel(),), not p.requires_grad, dtype=torch.bool) for p in self.params])
        self.frozen: torch.Tensor | None = frozen.to(self.global_params.device) if bool(frozen.any()) else None
        # Contributions are encoded segment by segment so the swarm can shard them (see
        # groundswell.compression.segments); 16 segments unless the caller says otherwise.
        self.segment = segment or segment_size(self.global_params.numel())
        self.round_id = 0  # the next round to run; advances only when a round is applied
        self.pending: PendingRound | None = None

    # --- the round -------------------------------------------------------------------------
    def local_vector(self) -> torch.Tensor:
        """The model's current parameters as one flat fp32 vector."""
        return parameters_to_vector(self.params).detach().float()

    def prepare(self) -> list[Payload]:
        """Compute this worker's contribution for the current round; it stays pending until
        `apply` learns whether the round absorbed it."""
        if self.pending is not None:
            raise RuntimeError(f"round {self.pending.round_id} is still pending; apply it first")
        local = self.local_vector().clone()
        # All or nothing: a codec refusing the contribution (CodecError) must leave the optimizer
        # as it was, or a caller that carries on would count the pseudo-gradient twice (once in
        # the optimizer's state, once in the local parameters it keeps training).
        try:
            payloads = self._encode_contribution(self._trainable(self.global_params - local))
            start = self._train_on_from(payloads)
        except BaseException:
            self._discard_contribution()
            raise
        self._commit_contribution()
        if start is not None:  # training goes on from there; progress is measured from there too
            copy_into_parameters(start, self.params)
            local = start
        self.pending = PendingRound(self.round_id, local, payloads)
        return payloads

    def apply(self, result: RoundResult | None) -> None:
        """Apply the round's aggregate, or `None` if the round failed (then it is retried)."""
        pending = self.pending
        if pending is None:
            raise RuntimeError("apply() without a prepared round")
        if result is not None and result.round_id != pending.round_id:
            raise ValueError(f"result is for round {result.round_id}, pending round is {pending.round_id}")
        mean = None if result is None else self._checked_mean(result.mean)  # before anything changes
        self.pending = None
        absorbed = self._settle_contribution(pending, result)
        old_global = self.global_params
        if result is None:
            if not absorbed:
                return  # nothing moved and the local progress stays where it is
            new_global = old_global
        else:
            new_global = self._stepped(old_global, mean)
            self.round_id += 1
        # Local work not yet in anyone's hands rides on top of the new global parameters. In a
        # blocking round that is exactly zero, so every worker ends bit-identical to theta_global.
        progress = self.local_vector() - (pending.local if absorbed else old_global)
        copy_into_parameters(new_global + progress, self.params)
        self.global_params = new_global

    def follow(self, round_id: int, mean: torch.Tensor) -> None:
        """Apply a round this worker did not contribute to (a follower, or catching up): the
        global parameters take the outer step and the local progress rides along."""
        if self.pending is not None:
            raise RuntimeError("follow() with a round pending; apply it first")
        if round_id != self.round_id:
            raise ValueError(f"cannot apply round {round_id}: the next round here is {self.round_id}")
        old_global = self.global_params
        new_global = self._stepped(old_global, self._checked_mean(mean))
        progress = self.local_vector() - old_global
        copy_into_parameters(new_global + progress, self.params)
        self.global_params = new_global
        self.round_id += 1

    def settle_late(self, payloads: list[Payload], prepared_since: int,
                    scaled: tuple[tuple[int, int, float], ...] = ()) -> None:
        """A contribution that `apply(None)` (or a result that did not count it) left in the local
        work turned out to be in an aggregate the global parameters took since: its outcome was
        learned late (the leader died after committing, the aggregate could not be fetched, a
        later attempt found the round closed). Take it out of the local work now, or it would be
        sent a second time. `prepared_since`: contributions prepared after it. `scaled`: where the
        mean took it clipped, as in `RoundResult.scaled` (empty: taken whole, or not known)."""
        if self.pending is not None:
            raise RuntimeError("settle_late() with a round pending; apply it first")
        self._absorb_late(self.decode(payloads), prepared_since, scaled)

    def sync(self, exchange: Exchange) -> RoundResult | None:
        """One blocking round: prepare, contribute, collect, apply. None if the round failed."""
        payloads = self.prepare()
        try:  # a refused contribution (too late) fails the round like a failed collect: work kept
            exchange.contribute(self.round_id, payloads)
            result: RoundResult | None = exchange.collect(self.round_id)
        except RoundFailed:
            result = None
        self.apply(result)
        return result

    # --- what subclasses define --------------------------------------------------------------
    @abstractmethod
    def _encode_contribution(self, delta: torch.Tensor) -> list[Payload]:
        """Turn this round's pseudo-gradient into the segment payloads to send. `delta` is a
        fresh tensor the callee may reuse. State changes must be staged, not made: they take
        effect in `_commit_contribution`, once the whole of `prepare` succeeded."""

    def _commit_contribution(self) -> None:
        """Make the state staged by `_encode_contribution` / `_train_on_from` current."""

    def _discard_contribution(self) -> None:
        """Drop the state staged by `_encode_contribution` / `_train_on_from` (prepare failed)."""

    def encode(self, vector: torch.Tensor) -> list[Payload]:
        """Encode a flat vector segment by segment with this optimizer's codec."""
        return encode_segments(self.codec, vector, self.segment)

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        """Decode a contribution (all segments) into a flat fp32 vector."""
        return self._trainable(decode_segments(self.codec, payloads, self.global_params.numel(), self.segment,
                                               device=self.global_params.device))

    def _trainable(self, vector: torch.Tensor) -> torch.Tensor:
        """`vector` (ours to change) with the frozen parameters' coordinates set to zero."""
        return vector if self.frozen is None else vector.masked_fill_(self.frozen, 0.0)

    def _train_on_from(self, payloads: list[Payload]) -> torch.Tensor | None:
        """Where the local parameters go once a contribution is prepared (None: they stay put).
        Matters only when training runs on while the round is exchanged (overlap). Stages, as
        `_encode_contribution` does."""
        return None

    @abstractmethod
    def _settle_contribution(self, pending: PendingRound, result: RoundResult | None) -> bool:
        """Update per-worker state once the outcome is known; return True if the contribution
        is absorbed (applied, or kept inside the optimizer's own state)."""

    @abstractmethod
    def _absorb_late(self, sent: torch.Tensor, prepared_since: int,
                     scaled: tuple[tuple[int, int, float], ...]) -> None:
        """`settle_late` for this algorithm: `sent` is the decoded contribution."""

    @abstractmethod
    def _outer_step(self, mean: torch.Tensor) -> torch.Tensor:
        """The change to theta_global for an aggregated mean pseudo-gradient."""

    def _checked_mean(self, mean: torch.Tensor) -> torch.Tensor:
        """`mean` as a flat fp32 vector on the parameters' device; a ValueError, before any state
        changes, if it does not hold one value per parameter (it would broadcast silently)."""
        if mean.numel() != self.global_params.numel() or not mean.is_floating_point():
            raise ValueError(f"the mean has {mean.numel()} {mean.dtype} values, the model "
                             f"{self.global_params.numel()} parameters")
        return mean.reshape(-1).to(self.global_params.device, torch.float32)

    def _stepped(self, old_global: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """theta_global after the outer step for `mean`. A coordinate the step would take past
        fp32's range (a finite mean near its limit: one hostile contribution with clipping off)
        keeps its old value and loses its optimizer state: every worker computes the same bits,
        so all of them do so alike, and the parameters stay finite."""
        if self.frozen is not None:  # the mean may be shared (a fetched aggregate): not ours to change
            mean = mean.masked_fill(self.frozen, 0.0)
        new_global = old_global + self._outer_step(mean)
        if all_finite(new_global):
            return new_global
        overflowed = ~torch.isfinite(new_global)
        log.warning("round %d: the outer step overflowed %d parameters; they keep their values",
                    self.round_id, int(overflowed.sum()))
        self._forget_state_at(overflowed)
        return torch.where(overflowed, old_global, new_global)

    def _forget_state_at(self, where: torch.Tensor) -> None:
        """Reset the optimizer's own state (momentum) at the coordinates `where` is True."""

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (tensors are cloned to the CPU)."""
        if self.pending is not None:
            raise RuntimeError("cannot snapshot with a round pending; apply it first")
        return {"round_id": self.round_id, "global_params": self.global_params.cpu().clone(), **self._extra_state()}

    def _like_params(self, state: dict[str, Any], name: str) -> torch.Tensor:
        """`state[name]` as a finite float32 tensor shaped like the parameters, on their device; a
        ValueError if it is not one (a buffer too long or short would fail a round later, or be
        cut silently)."""
        t = state.get(name)
        if not isinstance(t, torch.Tensor) or t.shape != self.global_params.shape or not t.is_floating_point():
            what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"state's {name} is {what}, not {tuple(self.global_params.shape)} floats")
        out = t.to(self.global_params.device, torch.float32).clone()
        if not all_finite(out):  # a NaN here would fail every later round, or spread into the model
            raise ValueError(f"state's {name} is not all finite")
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the model's parameters are not touched."""
        g = self._like_params(state, "global_params")
        round_id = state.get("round_id")
        if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
            raise ValueError(f"state's round_id is {round_id!r}, not a round")
        self._load_extra_state(state)  # first: a bad extra state leaves this one as it was
        self.global_params = g
        self.round_id = round_id
        self.pending = None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass
