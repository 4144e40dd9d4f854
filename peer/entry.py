"""The `groundswell` console script: the CLI, whose imports (torch, hivemind) take a second or two,
loaded inside a Ctrl+C handler, so an early Ctrl+C ends in one line, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    """Console-script entry point: `groundswell.peer.cli.main`, an interrupted start said in one line."""
    try:
        from .cli import main as run_cli
    except KeyboardInterrupt:  # pressed while torch and the commands were still being imported
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    run_cli()
