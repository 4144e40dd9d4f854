#!/usr/bin/env python3
"""SparseLoCo's `prepare` on the training thread, with and without the encoder keeping its own
payload's entries (so the eager start's decode of what it just sent skips unpacking its bytes).

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_outer_step.py [--preset small] [--rounds 40]

One process, one torch thread; the two settings alternate round by round after one unmeasured
round (the first `prepare` pays first-call costs), and each line gives the medians over its rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from groundswell.compression import make_codec, segment_size
from groundswell.compression import sparseloco as sparseloco_codec
from groundswell.optim.exchange import RoundResult
from groundswell.optim.sparseloco import SparseLoCo, SparseLoCoConfig
from groundswell.peer.workload import build_workload


def main() -> None:
    """Print one line per top-k: median `prepare` time with and without the kept entries."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    params = list(build_workload(a.preset, 256, 0).model.parameters())
    numel = sum(p.numel() for p in params)
    for k in (64, 128):
        codec = make_codec("sparseloco", k=k)
        opt = SparseLoCo(params, codec, SparseLoCoConfig(lr=1.0, error_decay=0.9, eager=True),
                         segment_size(numel, 16))
        keep, build = codec._own.put, sparseloco_codec._decoded_entries
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(a.rounds + 1):  # round 0: first-call costs, not timed
            kept = i % 2 == 0
            # without: neither kept nor built (the entries are built as put's argument: a put that
            # drops them still paid for them, and the gain looked 35-60% larger than it is)
            codec._own.put = keep if kept else (lambda *_: None)
            sparseloco_codec._decoded_entries = build if kept else (lambda *_: None)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn_like(p) * 1e-3)  # some local progress to encode
            t = time.perf_counter()
            payloads = opt.prepare()
            if i > 0:
                times[kept].append(time.perf_counter() - t)
            opt.apply(RoundResult(round_id=opt.round_id, mean=opt.decode(payloads), included=True,
                                  contributors=("me",), bytes_sent=0, bytes_received=0))
        codec._own.put, sparseloco_codec._decoded_entries = keep, build

        def median_ms(v: list[float]) -> float:
            return statistics.median(v) * 1000

        print(f"{a.preset} ({numel:,} params), top-{k} of 4096: prepare {median_ms(times[True]):.1f} ms with the "
              f"kept entries (median of {len(times[True])}), {median_ms(times[False]):.1f} ms without "
              f"(median of {len(times[False])})")


if __name__ == "__main__":
    main()
