"""The miniature paper table: every algorithm on the same model, data, seed and step budget.

Rows: one worker alone; data-parallel (W x batch, gradients averaged every step); DiLoCo (H=20,
50); DiLoCo + int8; SparseLoCo (H=20, 50). Every row gets the same small learning-rate sweep,
a grid of multipliers on the learning rate that is its own (the outer lr for DiLoCo/SparseLoCo,
the inner AdamW lr for the baselines), run on a shorter budget; the best value then runs the
full budget. The sweep is part of the result, so the tuning is visible.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .config import DataSection, EvalSection, InnerSection, ModelSection, OuterSection, TrainLocalConfig

ROW_NAMES = (
    "1-worker", "data-parallel", "diloco-h20", "diloco-h50", "diloco-int8-h20", "sparseloco-h20", "sparseloco-h50",
)
LR_MULTIPLIERS = (0.5, 1.0, 2.0, 3.0)


@dataclass(frozen=True)
class Budget:
    """How long each run trains, and on what."""

    preset: str = "tiny"
    workers: int = 4
    steps: int = 1000  # inner steps per worker in the final runs
    sweep_steps: int = 200  # inner steps per worker in the learning-rate sweep
    batch_size: int = 8
    inner_lr: float = 3e-3
    warmup_steps: int = 50
    eval_batches: int = 16
    seed: int = 0


FULL = Budget()
QUICK = Budget(steps=100, sweep_steps=50, batch_size=8, eval_batches=4, warmup_steps=10)


def row_config(name: str, budget: Budget, steps: int, lr_multiplier: float = 1.0) -> TrainLocalConfig:
    """The config of one table row, with its own learning rate scaled by `lr_multiplier`."""
    algo = {"1-worker": "single", "data-parallel": "data-parallel"}.get(name, name.split("-")[0])
    h = 50 if name.endswith("h50") else 20
    codec = "int8" if "int8" in name else ""
    outer = OuterSection(algorithm=algo, inner_steps=h, codec=codec)  # type: ignore[arg-type]
    inner_lr = budget.inner_lr
    if algo in ("diloco", "sparseloco"):
        outer = dataclasses.replace(outer, lr=outer.lr_value * lr_multiplier)
    else:
        inner_lr *= lr_multiplier
    return TrainLocalConfig(
        workers=1 if algo == "single" else budget.workers,
        steps=steps,
        seed=budget.seed,
        name=name,
        model=ModelSection(spec=budget.preset),
        data=DataSection(batch_size=budget.batch_size),
        inner=InnerSection(lr=inner_lr, warmup_steps=min(budget.warmup_steps, steps // 4)),
        outer=outer,
        eval=EvalSection(batches=budget.eval_batches, every_rounds=1 << 20),
    )


def swept_lr(cfg: TrainLocalConfig) -> float:
    """The learning rate a row's sweep varies."""
    return cfg.outer.lr_value if cfg.outer.algorithm in ("diloco", "sparseloco") else cfg.inner.lr


_CORPUS = None


def _init_worker(threads: int) -> None:
    """One process of the table's pool: `threads` torch threads (0: torch's default)."""
    import torch

    if threads > 0:  # set_num_threads(0) raises: with --jobs 1 the pool broke before the first row
        torch.set_num_threads(threads)


def _run(cfg: TrainLocalConfig) -> dict:
    global _CORPUS
    from .data import load_corpus
    from .train_local import run_train_local

    if _CORPUS is None:
        _CORPUS = load_corpus(cfg.data.source)
    result = run_train_local(cfg, corpus=_CORPUS).as_dict()
    result["swept_lr"] = swept_lr(cfg)
    return result


def _sweep_run(cfg: TrainLocalConfig) -> dict:
    """`_run` for one sweep point: a learning rate that diverges (the sweep tries up to 3x) is
    ranked last, with no loss, and the sweep goes on (it used to end the whole table)."""
    try:
        return _run(cfg)
    except FloatingPointError as exc:
        return {"name": cfg.name, "swept_lr": swept_lr(cfg), "eval_loss": None, "steps": cfg.steps,
                "diverged": str(exc)}


def _rank(res: dict) -> float:
    """A sweep point's loss for ranking: a diverged or non-finite one comes last."""
    loss = res["eval_loss"]
    return loss if loss is not None and math.isfinite(loss) else math.inf


def run_mini_table(
    *, jobs: int = 1, quick: bool = False, budget: Budget | None = None, progress: Callable[[str], None] = print
) -> dict:
    """Sweep, then run every row at the full budget; returns the JSON-ready table."""
    budget = budget or (QUICK if quick else FULL)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # children inherit it before importing torch
    sweep_cfgs = [row_config(n, budget, budget.sweep_steps, m) for n in ROW_NAMES for m in LR_MULTIPLIERS]
    with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker, initargs=(1 if jobs > 1 else 0,)) as pool:
        sweep = []
        for res in pool.map(_sweep_run, sweep_cfgs):
            got = "diverged" if res["eval_loss"] is None else f"{res['eval_loss']:.4f}"
            progress(f"sweep {res['name']:<16} lr {res['swept_lr']:<8.4g} eval {got}")
            sweep.append(res)
        best = {}
        for name in ROW_NAMES:
            runs = [r for r in sweep if r["name"] == name]
            best[name] = min(range(len(runs)), key=lambda i: _rank(runs[i]))
        finals = [row_config(n, budget, budget.steps, LR_MULTIPLIERS[best[n]]) for n in ROW_NAMES]
        results = []
        for res in pool.map(_run, finals):
            progress(f"final {res['name']:<16} lr {res['swept_lr']:<8.4g} eval {res['eval_loss']:.4f} "
                     f"({res['wall_s']:.0f} s)")
            results.append(res)
    dp_bytes = next(r["bytes_per_worker"] for r in results if r["name"] == "data-parallel")
    rows = [
        {
            "name": r["name"],
            "eval_loss": r["eval_loss"],
            "bytes_per_worker": r["bytes_per_worker"],
            "bytes_vs_data_parallel": r["bytes_per_worker"] / dp_bytes if dp_bytes else 0.0,
            "lr": r["swept_lr"],
            "tokens_per_worker": r["tokens_per_worker"],
            "params_identical": r["params_identical"],
            "wall_s": r["wall_s"],
        }
        for r in results
    ]
    return {
        "budget": dataclasses.asdict(budget),
        "params": results[0]["params"],
        "lr_multipliers": list(LR_MULTIPLIERS),
        "rows": rows,
        "sweep": [
            {"name": r["name"], "lr": r["swept_lr"], "eval_loss": r["eval_loss"], "steps": r["steps"]} for r in sweep
        ],
    }


def format_table(result: dict) -> str:
    """Markdown table of a `run_mini_table` result."""
    b = result["budget"]
    lines = [
        f"{b['preset']} preset ({result['params']:,} params), {b['workers']} workers, {b['steps']} inner steps "
        f"per worker, batch {b['batch_size']}, seed {b['seed']}",
        "",
        "| row | held-out loss | bytes sent per worker | vs data-parallel fp32 | tuned lr |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ratio = r["bytes_vs_data_parallel"]
        ratio_s = "-" if r["bytes_per_worker"] == 0 else (f"1/{1 / ratio:,.0f}" if 0 < ratio < 1 else f"{ratio:.2f}")
        lines.append(
            f"| {r['name']} | {r['eval_loss']:.4f} | {r['bytes_per_worker'] / 1e6:,.2f} MB | {ratio_s} | {r['lr']:.4g} |"
        )
    return "\n".join(lines)
