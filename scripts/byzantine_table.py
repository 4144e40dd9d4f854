"""The byzantine table: clean runs, then each attack with clipping, clipping + scoring, and no defences.

    OMP_WAIT_POLICY=PASSIVE python scripts/byzantine_table.py --out byz-runs --json scripts/results/byzantine.json

Every run is `groundswell simulate` with the same seed, peers, rounds and preset (each peer
process uses one torch thread); runs whose report.json exists are reused, so an interrupted
table can be resumed. Prints a markdown table: attack, clean loss, attacked loss under each
defence setting, and what the aggregators refused or the leaders' scoring dropped.
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
    ap.add_argument("--modes", default="on,score,off", help="on: norm clipping; score: clipping + scoring; off: none")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)  # (each simulation makes only its own folder in it)
    base = dict(peers=args.peers, rounds=args.rounds, inner_steps=args.inner_steps, preset=args.preset,
                algorithm=args.algorithm, min_peers=max(2, args.peers // 2), deadline_s=60.0, seed=0,
                timeout_s=3600.0)
    modes = {"on": {}, "score": {"scoring": True}, "off": {"defences": False}}
    chosen = args.modes.split(",")
    clean = {m: run(args.out / ("clean" if m == "on" else f"clean-{m}"), SimulateOptions(**base, **modes[m]))
             for m in chosen}
    rows = []
    for attack in args.attacks.split(","):
        row: dict = {"attack": attack}
        for m in chosen:
            rep = run(args.out / f"{attack}-{m}", SimulateOptions(**base, byzantine=args.byzantine, attack=attack,
                                                                 **modes[m]))
            row[m] = {"loss": rep["final_eval_loss"], "rounds": rep["rounds_completed"],
                      "hashes_agree": rep["param_hash_agreement"], "refused": rep["rejected_contributions"],
                      "dropped_by_scoring": rep.get("dropped_by_scoring", {}), "clipped_shards": rep.get("clipped_shards", {})}
        rows.append(row)

    def fmt(x: float | None, ref: float | None = None) -> str:
        if x is None or x != x:  # noqa: PLR0124 (NaN)
            return "n/a"
        return f"{x:.3f}" + (f" ({(x / ref - 1) * 100:+.1f}%)" if ref else "")

    names = {"on": "clipping", "score": "clipping + scoring", "off": "no defences"}
    ref = clean.get("on", {}).get("final_eval_loss")
    heads = [f"attacked, {names[m]}" for m in chosen]
    print(f"| attack ({args.byzantine} of {args.peers} peers) | clean loss | " + " | ".join(heads) + " | refused / dropped |")
    print("|---" * (3 + len(chosen)) + "|")
    for r in rows:
        notes = []
        for m in chosen:
            refused = ", ".join(f"{k} {v}" for k, v in sorted(r[m]["refused"].items()))
            dropped = sum(r[m]["dropped_by_scoring"].values())
            if refused:
                notes.append(f"{m}: refused {refused}")
            if dropped:
                notes.append(f"{m}: {dropped} contributions dropped by scoring")
        print(f"| {r['attack']} | {fmt(ref)} | " + " | ".join(fmt(r[m]["loss"], ref) for m in chosen)
              + f" | {'; '.join(notes) or '-'} |")
    for m in chosen:
        if m != "on":
            print(f"\nclean run, {names[m]}: {fmt(clean[m]['final_eval_loss'], ref)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {**base, "byzantine": args.byzantine},
                                         "clean": {m: c["final_eval_loss"] for m, c in clean.items()},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
