"""`groundswell train-local`: several workers in one process, in lockstep, over the in-process
exchange. The same outer optimizers and codecs as the swarm, minus the network: the place to
study the algorithms and to prove them before any byte crosses a socket.

Algorithms: `diloco` and `sparseloco` (W workers, H inner steps a round), `data-parallel` (the
baseline: one replica whose every step sees all W workers' batches, i.e. gradients averaged every
step), `single` (one worker alone, the lone-volunteer baseline).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from groundswell.compression import make_codec
from groundswell.optim import (
    DiLoCo,
    DiLoCoConfig,
    InProcessHub,
    OuterOptimizer,
    SparseLoCo,
    SparseLoCoConfig,
    copy_into_parameters,
    parameters_to_vector,
)

from .batches import ShardSampler, evaluate, heldout_batches
from .config import TrainLocalConfig
from .data import Corpus, load_corpus
from .worker import InnerTrainer
from .workload import build_workload

ProgressFn = Callable[[int, int, dict], None]


@dataclass
class TrainLocalResult:
    """What a `train-local` run measured."""

    name: str
    algorithm: str
    codec: str
    workers: int
    steps: int
    inner_steps: int
    params: int
    eval_loss: float
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (inner step, held-out loss)
    bytes_per_worker: int = 0
    bytes_vs_data_parallel: float = 0.0
    tokens_per_worker: int = 0
    wall_s: float = 0.0
    params_identical: bool = True  # do all workers hold bit-identical parameters at the end?

    def as_dict(self) -> dict:
        """JSON-ready form."""
        return dict(self.__dict__)


def dense_ring_bytes(workers: int, params: int) -> int:
    """Bytes one worker sends in a dense fp32 ring all-reduce of `params` values."""
    return 0 if workers <= 1 else (2 * (workers - 1) * 4 * params) // workers


def params_digest(model: torch.nn.Module) -> str:
    """Short sha256 of a model's parameters, bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class _ConcatSampler:
    """The data-parallel baseline's sampler: one batch from each of W shards, stacked."""

    def __init__(self, samplers: list[ShardSampler]) -> None:
        self.samplers = samplers

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(s.next_batch() for s in self.samplers))
        return torch.cat(xs), torch.cat(ys)

    def state_dict(self) -> dict:
        return {"samplers": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        for s, st in zip(self.samplers, state["samplers"]):
            s.load_state_dict(st)


def _make_outer(cfg: TrainLocalConfig, params) -> OuterOptimizer:
    outer = cfg.outer
    codec_opts = {"chunk": outer.chunk, "k": outer.topk} if outer.codec_name == "sparseloco" else {}
    codec = make_codec(outer.codec_name, **codec_opts)
    if outer.algorithm == "sparseloco":
        return SparseLoCo(params, codec, SparseLoCoConfig(lr=outer.lr_value, error_decay=outer.error_decay,
                                                           eager=bool(outer.overlap and outer.eager)))
    return DiLoCo(params, codec, DiLoCoConfig(lr=outer.lr_value, momentum=outer.momentum))


def _collect_all(outers: list[OuterOptimizer], exchanges: list) -> int:
    """Collect and apply every worker's pending round; returns worker 0's bytes sent."""
    sent = 0
    for i, outer in enumerate(outers):
        result = exchanges[i].collect(outer.pending.round_id if outer.pending else outer.round_id)
        outer.apply(result)
        sent = result.bytes_sent if i == 0 else sent
    return sent


def _eval_global(trainer: InnerTrainer, outer: OuterOptimizer | None, evalset: list, device: str) -> float:
    """Held-out loss of the agreed (global) parameters; with overlap the local ones run ahead."""
    if outer is None:
        return evaluate(trainer.model, trainer.loss_fn, evalset, device=device)
    params = list(trainer.model.parameters())
    saved = parameters_to_vector(params).detach().clone()
    copy_into_parameters(outer.global_params, params)
    try:
        return evaluate(trainer.model, trainer.loss_fn, evalset, device=device)
    finally:
        copy_into_parameters(saved, params)


def run_train_local(
    cfg: TrainLocalConfig, corpus: Corpus | None = None, progress: ProgressFn | None = None
) -> TrainLocalResult:
    """Run one in-process training job and measure it."""
    torch.manual_seed(cfg.seed)
    corpus = corpus if corpus is not None else load_corpus(cfg.data.source)
    algo = cfg.outer.algorithm
    replicas = cfg.workers if algo in ("diloco", "sparseloco") else 1
    trainers = []
    for i in range(replicas):
        workload = build_workload(cfg.model.spec, vocab_size=corpus.vocab_size, seed=cfg.seed)
        trainer = InnerTrainer(
            workload, corpus, cfg.data, cfg.inner, total_steps=cfg.steps, seed=cfg.seed,
            shard_index=i, num_shards=cfg.workers, device=cfg.device,
        )
        if algo == "data-parallel":
            trainer.sampler = _ConcatSampler([
                ShardSampler(corpus, block_size=workload.block_size, batch_size=cfg.data.batch_size,
                             seed=cfg.seed, shard_index=w, num_shards=cfg.workers)
                for w in range(cfg.workers)
            ])
        if trainers:  # every replica starts from the first's parameters: a custom model seeded by
            # numpy, or built on CUDA, was not the same in each, and its workers never agreed
            trainer.model.load_state_dict(trainers[0].model.state_dict())  # (in place: buffers too)
        trainers.append(trainer)
    evalset = heldout_batches(corpus, trainers[0].block_size, cfg.eval.batch_size, cfg.eval.batches)
    n_params = sum(p.numel() for p in trainers[0].model.parameters())

    outers: list[OuterOptimizer] = []
    hub = None
    if algo in ("diloco", "sparseloco"):
        outers = [_make_outer(cfg, t.model.parameters()) for t in trainers]
        hub = InProcessHub(outers[0].codec, [f"w{i}" for i in range(replicas)], device=cfg.device)
    exchanges = [hub.endpoint(f"w{i}") for i in range(replicas)] if hub else []

    H = cfg.outer.inner_steps
    overlap = cfg.outer.overlap
    total_rounds = -(-cfg.steps // H)
    curve: list[tuple[int, float]] = []
    bytes_sent = 0
    tokens = 0
    start = time.perf_counter()
    done = 0
    for r in range(total_rounds):
        n = min(H, cfg.steps - done)
        losses = []
        for i, trainer in enumerate(trainers):
            stats = trainer.run(n)
            losses.append(stats.mean_loss)
            if i == 0:
                tokens += stats.tokens // (cfg.workers if algo == "data-parallel" else 1)
        if outers:
            if overlap and r > 0:  # the previous round was exchanged while this block trained
                bytes_sent += _collect_all(outers, exchanges)
            for i, outer in enumerate(outers):
                exchanges[i].contribute(outer.round_id, outer.prepare())
            if not overlap or r == total_rounds - 1:
                bytes_sent += _collect_all(outers, exchanges)
        done += n
        if (r + 1) % cfg.eval.every_rounds == 0 or r == total_rounds - 1:
            curve.append((done, _eval_global(trainers[0], outers[0] if outers else None, evalset, cfg.device)))
        if progress is not None:
            progress(r + 1, total_rounds, {"step": done, "train_loss": sum(losses) / len(losses),
                                           "eval_loss": curve[-1][1] if curve else float("nan")})
    wall = time.perf_counter() - start
    if algo == "data-parallel":
        bytes_sent = cfg.steps * dense_ring_bytes(cfg.workers, n_params)
    dp_bytes = cfg.steps * dense_ring_bytes(cfg.workers, n_params)
    digests = {params_digest(t.model) for t in trainers}
    return TrainLocalResult(
        name=cfg.name or f"{algo}-h{H}",
        algorithm=algo,
        codec=cfg.outer.codec_name if outers else ("fp32" if algo == "data-parallel" else "none"),
        workers=cfg.workers,
        steps=cfg.steps,
        inner_steps=H,
        params=n_params,
        eval_loss=curve[-1][1],
        eval_curve=curve,
        bytes_per_worker=bytes_sent,
        bytes_vs_data_parallel=bytes_sent / dp_bytes if dp_bytes else 0.0,
        tokens_per_worker=tokens,
        wall_s=wall,
        params_identical=len(digests) == 1,
    )
