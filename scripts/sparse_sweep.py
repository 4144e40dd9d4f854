#!/usr/bin/env python3
"""SparseLoCo settings against DiLoCo-int8 at equal inner steps, in one process (no network).

    OMP_WAIT_POLICY=PASSIVE python scripts/sparse_sweep.py [--preset small] [--steps 150] [--workers 4] [NAME ...]

Runs train-local (same seed, data and inner optimizer for every row) for DiLoCo-int8 with H = 30
(bench_wan's run (b)) and SparseLoCo variants (overlapped with the eager start, as bench_wan's run
(a)), and prints one JSON row per setting: {name, eval_loss, seconds}. With no NAME, all settings.
Warmup follows `groundswell simulate`, min(50, 2 H) inner steps, unless a setting names its own. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from groundswell.peer.config import (
    DataSection,
    EvalSection,
    InnerSection,
    ModelSection,
    OuterSection,
    TrainLocalConfig,
)
from groundswell.peer.data import load_corpus
from groundswell.peer.train_local import run_train_local

SETTINGS = {
    "diloco-int8-H30": dict(algorithm="diloco", codec="int8", inner_steps=30, overlap=0),
    "diloco-int8-H30-sgd": dict(algorithm="diloco", codec="int8", inner_steps=30, overlap=0, lr=1.0, momentum=0.0),
    "sparse-H10-lr2": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=2.0),
    "sparse-H10-lr1": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0),
    "sparse-H10-lr4": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=4.0),
    "sparse-H5-lr2": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=2.0),
    "sparse-H2-lr2": dict(algorithm="sparseloco", inner_steps=2, overlap=1, eager=True, lr=2.0),
    # Denser top-k, still >= 100x smaller than fp32 (k = 128 of 4096: 112x at 25M parameters).
    "sparse-H10-lr2-k128": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=2.0, topk=128),
    "sparse-H5-lr2-k128": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=2.0, topk=128),
    "sparse-H10-lr1-k128": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=128),
    "sparse-H10-lr1.5-k128": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.5, topk=128),
    "sparse-H5-lr1-k128": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=1.0, topk=128),
    "sparse-H5-lr1.5-k128": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=1.5, topk=128),
    "sparse-H10-lr1-k96": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=96),
    # Error-feedback decay: 0.95 (Covenant-72B) forgets 5% of what was not sent each round.
    "sparse-H10-lr1-k128-ef1": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=128, error_decay=1.0),
    "sparse-H10-lr1-k128-ef0.9": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9),
    "sparse-H5-lr1-k128-ef1": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=1.0, topk=128, error_decay=1.0),
    "sparse-H10-lr1-k128-ef0.8": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.8),
    "sparse-H5-lr1-k128-ef0.9": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9),
    "sparse-H10-lr1-k128-ef0.6": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.6),
    "sparse-H5-lr1-k128-ef0.7": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.7),
    # Shorter blocks: in process, more rounds is what SparseLoCo gains most from at this length of run.
    "sparse-H2-lr1-k128-ef0.9": dict(algorithm="sparseloco", inner_steps=2, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9),
    "sparse-H3-lr1-k128-ef0.9": dict(algorithm="sparseloco", inner_steps=3, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9),
    "sparse-H1-lr1-k128-ef0.9": dict(algorithm="sparseloco", inner_steps=1, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9),
    "sparse-H2-lr0.7-k128-ef0.9": dict(algorithm="sparseloco", inner_steps=2, overlap=1, eager=True, lr=0.7, topk=128, error_decay=0.9),
    # The inner warmup follows H (min(50, 2 H)): DiLoCo-H30 warms up over 50 steps, SparseLoCo-H5 over 10.
    "sparse-H5-lr1-k128-ef0.9-wu50": dict(algorithm="sparseloco", inner_steps=5, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9, warmup=50),
    "sparse-H2-lr1-k128-ef0.9-wu50": dict(algorithm="sparseloco", inner_steps=2, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9, warmup=50),
    "sparse-H10-lr1-k128-ef0.9-wu50": dict(algorithm="sparseloco", inner_steps=10, overlap=1, eager=True, lr=1.0, topk=128, error_decay=0.9, warmup=50),
    "diloco-int8-H30-wu20": dict(algorithm="diloco", codec="int8", inner_steps=30, overlap=0, warmup=20),
}


def main() -> None:
    """Run the chosen settings and print a JSON row for each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", choices=[[], *SETTINGS], metavar="NAME", help=", ".join(SETTINGS))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    corpus = load_corpus("stdlib")
    for name in a.names or list(SETTINGS):
        outer = dict(SETTINGS[name])
        warmup = outer.pop("warmup", min(50, 2 * int(outer["inner_steps"])))
        started = time.time()
        cfg = TrainLocalConfig(
            workers=a.workers, steps=a.steps, seed=a.seed, model=ModelSection(a.preset), data=DataSection(batch_size=8),
            inner=InnerSection(lr=3e-3, warmup_steps=warmup),
            outer=OuterSection(**outer), eval=EvalSection(batches=4, batch_size=8),
        )
        r = run_train_local(cfg, corpus=corpus)
        print(json.dumps({"name": name, "eval_loss": round(r.eval_loss, 4), "seconds": round(time.time() - started),
                          "params_identical": r.params_identical}), flush=True)


if __name__ == "__main__":
    main()
