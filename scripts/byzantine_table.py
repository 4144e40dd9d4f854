"""The byzantine table: a clean run, then each attack with defences on and off, all else equal.

    OMP_WAIT_POLICY=PASSIVE python scripts/byzantine_table.py --out byz-runs --json scripts/results/byzantine.json

Every run is `groundswell simulate` with the same seed, peers, rounds and preset (each peer
process uses one torch thread); runs whose report.json exists are reused, so an interrupted
table can be resumed. Prints a markdown table: attack, clean loss, attacked loss with defences,
attacked loss with defences off, and what the aggregators refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from groundswell.peer.byzantine import ATTACKS
from groundswell.peer.simulate import SimulateOptions, run_simulation


def run(out: Path, opts: SimulateOptions) -> dict:
    """One simulation's report (reused if it already finished)."""
    report = out / "report.json"
    if report.exists():
        return json.loads(report.read_text())
    print(f"running {out.name} ...", file=sys.stderr, flush=True)
    return run_simulation(opts, out, progress=lambda m: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("byz-runs"))
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--byzantine", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--algorithm", default="sparseloco")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    base = dict(peers=args.peers, rounds=args.rounds, inner_steps=args.inner_steps, preset=args.preset,
                algorithm=args.algorithm, min_peers=max(2, args.peers // 2), deadline_s=60.0, seed=0,
                timeout_s=3600.0)
    clean = run(args.out / "clean", SimulateOptions(**base))
    rows = []
    for attack in args.attacks.split(","):
        on = run(args.out / f"{attack}-on", SimulateOptions(**base, byzantine=args.byzantine, attack=attack))
        off = run(args.out / f"{attack}-off", SimulateOptions(**base, byzantine=args.byzantine, attack=attack,
                                                              defences=False))
        rows.append({"attack": attack, "clean": clean["final_eval_loss"], "defended": on["final_eval_loss"],
                     "undefended": off["final_eval_loss"], "rounds": [on["rounds_completed"], off["rounds_completed"]],
                     "hashes_agree": [on["param_hash_agreement"], off["param_hash_agreement"]],
                     "rejected_defended": on["rejected_contributions"], "rejected_undefended": off["rejected_contributions"]})
    print(f"| attack ({args.byzantine} of {args.peers} peers) | clean loss | attacked, defences on | "
          "attacked, defences off | refused by aggregators (on) |")
    print("|---|---|---|---|---|")

    def fmt(x: float | None) -> str:
        return "n/a" if x is None or x != x else f"{x:.3f}"

    for r in rows:
        gap = "" if r["defended"] is None or r["clean"] is None else f" ({(r['defended'] / r['clean'] - 1) * 100:+.1f}%)"
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected_defended"].items())) or "none"
        print(f"| {r['attack']} | {fmt(r['clean'])} | {fmt(r['defended'])}{gap} | {fmt(r['undefended'])} | {refused} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {**base, "byzantine": args.byzantine}, "clean": clean["final_eval_loss"],
                                         "clean_rounds": clean["rounds_completed"], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
