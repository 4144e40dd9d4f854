"""`python -m groundswell.peer` runs the `groundswell` CLI (used to spawn simulated peers)."""

from .cli import main

main()
