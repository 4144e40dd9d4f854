#!/usr/bin/env python
"""The miniature paper table (same as `groundswell train-local --table`).

    OMP_WAIT_POLICY=PASSIVE python scripts/mini_table.py --jobs 2 --out mini_table.json

Rows run in `--jobs` processes with one torch thread each. Prints Markdown; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from groundswell.peer.mini_table import format_table, run_mini_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="processes to run rows in (one torch thread each)")
    parser.add_argument("--quick", action="store_true", help="a short smoke-test budget")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args()
    result = run_mini_table(jobs=args.jobs, quick=args.quick, progress=lambda m: print(m, flush=True))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(format_table(result))


if __name__ == "__main__":
    main()
