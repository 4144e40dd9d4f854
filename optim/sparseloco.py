"""SparseLoCo's outer optimizer: error feedback, a sparse 2-bit codec, and plain outer SGD.

Per worker: e <- beta*e + delta; payload = encode(e); once the round is known, e <- e - decode(payload)
if the payload made it into the aggregate (scaled by the factor the mean took it with, where norm
clipping scaled it down: `RoundResult.scaled`). A payload the round left out therefore stays in e
and goes out again with the next round, and so does the part clipping took off; like all of e, it
decays by beta at each later prepare, a retried attempt's included (a known limit: a peer failing
attempt after attempt loses part of that work). The outer step is plain SGD (no momentum) on the mean of
the decoded payloads: theta -= lr * mean.

Eager start (`eager=True`, for overlapped rounds): once a contribution is prepared, the local
parameters move to theta_global + step(own payload), the global parameters this worker would reach
if the aggregate were its own contribution, and the next H steps train from there instead of from
the raw local progress. Only the part of that progress the round will transmit is then assumed;
the rest waits in the error feedback, as it does for every worker when rounds do not overlap. When
the aggregate arrives, the local parameters become the new theta_global plus the progress made
since that start, so the global parameters stay identical on every worker. Measured in
scripts/overlap_quality.py: it takes back most of what the delayed outer step costs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from groundswell.compression import Codec, Payload

from .exchange import RoundResult
from .outer import OuterOptimizer, PendingRound


@dataclass(frozen=True)
class SparseLoCoConfig:
    """Outer settings of SparseLoCo (Covenant-72B: lr 1.0, error-feedback decay 0.95)."""

    lr: float = 1.0
    error_decay: float = 0.95
    eager: bool = False  # overlapped rounds: train on from theta_global + step(own payload)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be positive, got {self.lr}")
        if not 0 <= self.error_decay <= 1:
            raise ValueError(f"error_decay must be in [0, 1], got {self.error_decay}")


class SparseLoCo(OuterOptimizer):
    """SparseLoCo outer optimizer over an `Exchange` (see `OuterOptimizer` for the round API)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        codec: Codec,
        config: SparseLoCoConfig = SparseLoCoConfig(),
        segment: int | None = None,
    ):
        super().__init__(params, codec, segment)
        self.config = config
        self.error = torch.zeros_like(self.global_params)
        # The eager start decodes our own payload; settling the round needs the same vector, so it
        # is kept (by the payloads' identity) instead of decoded twice per round.
        self._sent: tuple[list[Payload], torch.Tensor] | None = None
        # What `prepare` stages until it has succeeded (see `OuterOptimizer.prepare`).
        self._staged_error: torch.Tensor | None = None
        self._staged_sent: tuple[list[Payload], torch.Tensor] | None = None

    def _encode_contribution(self, delta: torch.Tensor) -> list[Payload]:
        # e <- beta*e + delta, written into `delta` (ours to reuse) so that self.error stays as it
        # was should encoding fail; on success the two are swapped: no extra full-size copy.
        self._staged_error = _decay_into(delta, self.error, self.config.error_decay)
        return self.encode(self._staged_error)

    def _train_on_from(self, payloads: list[Payload]) -> torch.Tensor | None:
        if not self.config.eager:
            return None
        sent = self.decode(payloads)
        self._staged_sent = (payloads, sent)
        return self.global_params + self._outer_step(sent)

    def _commit_contribution(self) -> None:
        if self._staged_error is not None:
            self.error = self._staged_error
        if self._staged_sent is not None:
            self._sent = self._staged_sent
        self._discard_contribution()

    def _discard_contribution(self) -> None:
        self._staged_error = self._staged_sent = None

    def _settle_contribution(self, pending: PendingRound, result: RoundResult | None) -> bool:
        cached, self._sent = self._sent, None
        if result is not None and result.included:
            sent = cached[1] if cached is not None and cached[0] is pending.payloads else self.decode(pending.payloads)
            self.error -= _taken(sent, result.scaled)
        return True  # either sent and applied, or still held in the error feedback

    def _absorb_late(self, sent: torch.Tensor, prepared_since: int,
                     scaled: tuple[tuple[int, int, float], ...]) -> None:
        # Settled on time: e <- e - taken. Every contribution prepared since decayed e by beta.
        self.error -= _taken(sent, scaled) * (self.config.error_decay ** prepared_since)

    def _outer_step(self, mean: torch.Tensor) -> torch.Tensor:
        return mean * (-self.config.lr)

    def _extra_state(self) -> dict[str, Any]:
        return {"algorithm": "sparseloco", "error": self.error.cpu().clone()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("algorithm") != "sparseloco":
            raise ValueError(f"not a SparseLoCo state (algorithm={state.get('algorithm')!r})")
        self.error = self._trainable(self._like_params(state, "error"))  # (an older state's, at frozen ones)
        self._sent = None
        self._discard_contribution()


def _decay_into(out: torch.Tensor, error: torch.Tensor, decay: float, block: int = 1 << 20) -> torch.Tensor:
    """out <- decay*error + out, leaving `error` unchanged; bitwise `error.mul_(decay).add_(out)`
    (the same two fp32 roundings; the sum commutes exactly). Block by block, so the temporary for
    decay*error stays small next to a 25M-value vector."""
    flat_out, flat_err = out.view(-1), error.view(-1)
    scratch = torch.empty(min(block, flat_out.numel()), dtype=error.dtype, device=error.device)
    for start in range(0, flat_out.numel(), block):
        stop = min(start + block, flat_out.numel())
        part = scratch[: stop - start]
        torch.mul(flat_err[start:stop], decay, out=part)
        flat_out[start:stop].add_(part)
    return out


def _taken(sent: torch.Tensor, scaled: tuple[tuple[int, int, float], ...]) -> torch.Tensor:
    """What the mean took of a decoded contribution: all of it, but where norm clipping scaled it
    down. The rest stays in the error feedback and goes out again, as a part left out does."""
    if not scaled:
        return sent
    taken = sent.clone()  # a decode may be shared (the eager start's): not ours to change
    for start, stop, factor in scaled:
        taken[start:stop] *= torch.tensor(factor, dtype=torch.float32, device=sent.device)
    return taken
