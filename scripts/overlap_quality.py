#!/usr/bin/env python3
"""What the delayed outer step (outer.overlap = 1) costs in held-out loss, in one process.

    OMP_WAIT_POLICY=PASSIVE python scripts/overlap_quality.py [--steps 200] [--workers 2] [-H 10]

Runs train-local (tiny preset, same seed) blocking and overlapped, for DiLoCo-int8 and SparseLoCo
(overlapped with and without the eager start, see optim/sparseloco.py), and prints JSON rows
{algorithm, codec, overlap, eager, eval_loss}.
"""

from __future__ import annotations

import argparse
import json

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("-H", "--inner-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sparse-outer-lr", type=float, default=0.0, help="SparseLoCo's outer lr (0: its default, 1.0)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    corpus = load_corpus("stdlib")
    rows = []
    # SparseLoCo overlapped twice: training on from the raw local progress, and from the eager start
    for algorithm, codec, overlap, eager in (("diloco", "int8", 0, False), ("diloco", "int8", 1, False),
                                             ("sparseloco", "", 0, False), ("sparseloco", "", 1, False),
                                             ("sparseloco", "", 1, True)):
        cfg = TrainLocalConfig(
            workers=a.workers, steps=a.steps, seed=a.seed, model=ModelSection("tiny"), data=DataSection(batch_size=8),
            inner=InnerSection(lr=3e-3, warmup_steps=5),
            outer=OuterSection(algorithm=algorithm, inner_steps=a.inner_steps, codec=codec, overlap=overlap,
                               eager=eager, lr=a.sparse_outer_lr if algorithm == "sparseloco" else 0.0),
            eval=EvalSection(batches=2, batch_size=8),
        )
        r = run_train_local(cfg, corpus=corpus)
        rows.append({"algorithm": algorithm, "codec": r.codec, "overlap": overlap, "eager": eager,
                     "eval_loss": round(r.eval_loss, 4), "params_identical": r.params_identical})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
