"""One training worker: a model replica, its inner AdamW with its schedule, and its data shard.

The worker knows nothing about rounds or peers; the outer optimizer and the exchange are wired
around it by the driver (`train_local` here, the swarm peer later).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from groundswell.optim import warmup_cosine_scheduler

from .batches import ShardSampler
from .config import DataSection, InnerSection
from .data import Corpus
from .workload import Workload

log = logging.getLogger(__name__)


@dataclass
class InnerStats:
    """What a stretch of inner steps did."""

    steps: int
    mean_loss: float
    tokens: int
    compute_s: float


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Total 2-norm of the parameters' gradients, leaving them as they are."""
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return torch.nn.utils.clip_grad_norm_(params, float("inf"))  # older torch: scales each gradient by 1


def allow_tf32_matmuls(device: torch.device) -> bool:
    """On a CUDA device, let fp32 matmuls and convolutions use TF32 tensor cores (several times
    faster on Ampere and later; torch turns it off by default). Only the inner steps run them, and
    those are each peer's own: what peers must agree on bit for bit (the mean, the outer step,
    the hashes) is elementwise or summed on the CPU. Returns whether it was turned on."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


class InnerTrainer:
    """Runs inner AdamW steps on one model replica over one data shard."""

    def __init__(
        self,
        workload: Workload,
        corpus: Corpus,
        data: DataSection,
        inner: InnerSection,
        *,
        total_steps: int,
        seed: int,
        shard_index: int,
        num_shards: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = workload.model.to(device)
        self.loss_fn = workload.loss_fn
        self.device = torch.device(device)
        allow_tf32_matmuls(self.device)
        self.block_size = workload.block_size
        self.inner = inner
        self.optimizer = torch.optim.AdamW(
            decay_groups(self.model, inner.weight_decay),
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
        )
        self.scheduler = warmup_cosine_scheduler(self.optimizer, total_steps, inner.warmup_steps, inner.min_lr_ratio)
        self.sampler = ShardSampler(
            corpus,
            block_size=workload.block_size,
            batch_size=data.batch_size,
            seed=seed,
            shard_index=shard_index,
            num_shards=num_shards,
        )
        self.step = 0

    def run(self, num_steps: int, on_step: Callable[[int, float], None] | None = None) -> InnerStats:
        """Run `num_steps` inner steps (calling `on_step(i, loss)` after each); returns their mean
        loss and timing."""
        self.model.train()
        total, tokens = 0.0, 0
        start = time.perf_counter()
        for _ in range(num_steps):
            x, y = self.sampler.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = self.loss_fn(self.model, x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # (a non-finite loss only makes non-finite gradients: refused below, before the step)
            if self.inner.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
            else:
                grad_norm = _grad_norm(list(self.model.parameters()))
            # One read from the device per step (each read waits for the GPU): the loss for the
            # progress bar and both finiteness checks come from it.
            loss_value, norm_value = torch.stack([loss.detach().float(), grad_norm.float().to(loss.device)]).tolist()
            if not math.isfinite(loss_value):
                # A non-finite loss would poison the pseudo-gradient; refuse it loudly.
                raise FloatingPointError(self._diverged(f"loss is {loss_value}"))
            if not math.isfinite(norm_value):
                # A finite loss can still have an inf/NaN gradient: AdamW would write NaN into the
                # weights, and the failure would surface rounds later as a codec error.
                raise FloatingPointError(self._diverged(f"gradient norm is {norm_value}"))
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            total += loss_value
            tokens += x.numel()
            if on_step is not None:
                on_step(self.step, loss_value)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return InnerStats(num_steps, total / max(1, num_steps), tokens, time.perf_counter() - start)

    def _diverged(self, what: str) -> str:
        return f"inner step {self.step}: {what}: training diverged; try a lower inner.lr (now {self.inner.lr:g})"

    def state_dict(self) -> dict:
        """Inner state for a checkpoint: model, AdamW, schedule and data position."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
        }

    def progress_state(self) -> dict:
        """Where training is, without the model and AdamW (small: the work record keeps it with
        every contribution, so a restart does not train the batches since its checkpoint again)."""
        return {"scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(), "step": self.step}

    def load_progress_state(self, state: dict) -> None:
        """Restore a `progress_state()` (after `load_state_dict`, which it moves forward)."""
        step = int(state["step"])
        # All or nothing: a sampler moved on with the schedule left behind (a damaged record whose
        # schedule does not load) would pair the record's data position with the checkpoint's rate.
        sampler_before, schedule_before = self.sampler.state_dict(), self.scheduler.state_dict()
        try:
            # checked against this corpus and seed before it moves
            same_data = self.sampler.load_state_dict(state["sampler"], data_may_differ=True)
            self.scheduler.load_state_dict(self._fitted_schedule(state["scheduler"]))
        except BaseException:
            self.sampler.load_state_dict(sampler_before)
            self.scheduler.load_state_dict(schedule_before)
            raise
        # (the schedule's rate reaches the optimizer at its next step only: the next step is now)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.step = step
        _say_if_data_changed(same_data, self.sampler.epoch)

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`. Over data that changed since (its fingerprint), the optimizer
        and schedule are kept and the data order starts the epoch after the saved one."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(self._fitted_optimizer(state["optimizer"]))
        self.scheduler.load_state_dict(self._fitted_schedule(state["scheduler"]))
        _say_if_data_changed(self.sampler.load_state_dict(state["sampler"], data_may_differ=True), self.sampler.epoch)
        self.step = int(state["step"])

    def load_data_position(self, state: dict) -> None:
        """Restore only the data position of a `state_dict()` (whose model or optimizer did not
        fit): a trainer started afresh would otherwise train its first batches again."""
        _say_if_data_changed(self.sampler.load_state_dict(state["sampler"], data_may_differ=True), self.sampler.epoch)

    def _fitted_optimizer(self, saved: dict) -> dict:
        """An AdamW state as this trainer's groups hold it. A version before the decay split
        saved one group of every parameter (in `parameters()` order): its moments are moved to
        the parameters' places in the groups now, each group keeping its own weight decay."""
        groups = self.optimizer.param_groups
        if len(saved["param_groups"]) == len(groups):  # each group's decay is this version's (a 1-D-only model
            return {**saved, "param_groups": [{**old, "weight_decay": group["weight_decay"]}  # had one group too)
                                              for old, group in zip(saved["param_groups"], groups)]}
        params = list(self.model.parameters())
        if len(saved["param_groups"]) != 1 or len(saved["param_groups"][0]["params"]) != len(params):
            raise ValueError(f"a saved inner optimizer of {len(saved['param_groups'])} parameter groups does not fit")
        old = saved["param_groups"][0]
        position = {id(p): k for k, p in enumerate(params)}
        state, fitted, n = {}, [], 0
        for group in groups:
            ids = []
            for p in group["params"]:
                before = old["params"][position[id(p)]]
                if before in saved["state"]:
                    state[n] = saved["state"][before]
                ids.append(n)
                n += 1
            fitted.append({**old, "weight_decay": group["weight_decay"], "params": ids})
        return {"state": state, "param_groups": fitted}

    def _fitted_schedule(self, saved: dict) -> dict:
        """A schedule's state with a base rate per parameter group (a version before the decay
        split had one group: LambdaLR would then move only the first group's rate)."""
        groups = len(self.optimizer.param_groups)
        fitted = dict(saved)
        for key in ("base_lrs", "_last_lr"):
            rates = saved.get(key)
            if isinstance(rates, list) and rates and len(rates) != groups:
                fitted[key] = [rates[0]] * groups  # every group shares the peak rate
        return fitted


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: matrices (and embeddings) decay; gains and biases (1-D) do not,
    as in nanoGPT's recipe (decaying them pulled LayerNorm gains towards 0: 2% worse loss)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _say_if_data_changed(same_data: bool, epoch: int) -> None:
    if not same_data:
        log.warning("the training data differs from the checkpoint's (its files changed: a Python upgrade, say); "
                    "going on from the start of data epoch %d", epoch)
