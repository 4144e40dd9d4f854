"""Contribution scoring: how much one contribution, applied alone, changes the loss on a probe batch.

The round's leader runs it (manifest `[defences] scoring = true`) on every contributor's own update
before it announces a commit, and decides again without those that make the loss worse by more
than `score_threshold`. It runs on a scratch copy of the model, so training goes on undisturbed.
"""

from __future__ import annotations

import os
import threading

import torch
from groundswell.optim import copy_into_parameters

from .batches import ShardSampler, evaluate
from .data import Corpus
from .manifest import RunManifest
from .workload import build_workload


class ScoringBusy(RuntimeError):
    """A scoring was asked for while the one before still runs."""


class ScoringCancelled(RuntimeError):
    """The scoring's caller gave up on it (its round's deadline, or the node closing)."""


class ContributionScorer:
    """Loss after applying one update alone (outer step without momentum) minus the loss before."""

    def __init__(self, manifest: RunManifest, corpus: Corpus, device: str = "cpu", seed: int | None = None) -> None:
        workload = build_workload(manifest.model.spec, corpus.vocab_size, manifest.run.seed)
        self.device = torch.device(device)
        self.model, self.loss_fn = workload.model.to(self.device), workload.loss_fn
        # One scoring at a time: a leader's scoring that ran past its round's timeout goes on in
        # its thread (a thread cannot be cancelled), and a second one would write its weights
        # into the same scratch model mid-evaluation, so both would score garbage.
        self._busy = threading.Lock()
        self.params = list(self.model.parameters())
        # Frozen parameters (requires_grad=False) never move in an outer step (optim/outer.py):
        # scored with the update's values there, a contribution would be judged on noise that
        # SparseLoCo's 2-bit codec puts at frozen coordinates and nobody ever applies.
        frozen = torch.cat([torch.full((p.numel(),), not p.requires_grad, dtype=torch.bool) for p in self.params])
        self.frozen = frozen.to(self.device) if bool(frozen.any()) else None
        # Probe windows from a seed of this process's own (`seed`: tests only): drawn from the
        # manifest's public seed, anyone could replay them and tune an update to pass the probe.
        probe_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.sampler = ShardSampler(corpus, workload.block_size, manifest.data.batch_size, seed=probe_seed)
        self.batches = manifest.defences.score_batches
        self.lr = manifest.outer.lr_value

    def __call__(self, global_params: torch.Tensor, updates: dict[str, torch.Tensor],
                 cancelled: threading.Event | None = None) -> dict[str, float]:
        """Score each update on fresh probe batches (the same batches for every update);
        ScoringCancelled once `cancelled` is set (checked between updates: a thread cannot be
        interrupted, and one left scoring held up the process's exit for as long)."""
        # Not waited for: a scoring blocked here would hold an executor thread that the node's other
        # work (the contribution record, state packing) needs; the leader commits unscored instead.
        if not self._busy.acquire(blocking=False):
            raise ScoringBusy("the previous round's scoring still runs (slower than a round)")
        try:
            batches = [self.sampler.next_batch() for _ in range(self.batches)]
            global_params = global_params.to(self.device)
            copy_into_parameters(global_params, self.params)
            before = evaluate(self.model, self.loss_fn, batches)
            scores = {}
            for who, update in updates.items():
                if cancelled is not None and cancelled.is_set():
                    raise ScoringCancelled("scoring given up on")
                step = self.lr * update.to(self.device)
                if self.frozen is not None:
                    step = step.masked_fill(self.frozen, 0.0)
                copy_into_parameters(global_params - step, self.params)
                scores[who] = evaluate(self.model, self.loss_fn, batches) - before
            return scores
        finally:
            self._busy.release()
