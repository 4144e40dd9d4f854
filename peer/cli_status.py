"""`groundswell status`: the run as the DHT sees it, read by a passing node that serves nothing."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import typer

from .cli import _user_errors, app
from .status_view import print_status


@app.command()
@_user_errors
def status(
    bootstrap: str = typer.Argument(..., help="A bootstrap line (gs1:...)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The run as the DHT sees it: peers, rounds, parameter hashes."""
    from groundswell.protocol.identity import Identity

    from . import join_network  # (not at the top: it imports cli, which imports us)
    from .bootstrap import parse_bootstrap
    from .net_errors import NetworkError
    from .swarm import SwarmNode, reader_options

    boot = parse_bootstrap(bootstrap)
    ident = Identity.generate()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "id.key"
        ident.save(path)
        node = SwarmNode(ident, str(path), reader_options(boot.maddrs, boot.coordinator_id))
        node.start()
        try:
            _, manifest = join_network.fetch_manifest(node, boot.maddrs, boot.coordinator_id)
            node.call(node.watch_records(manifest.run.id), timeout_s=10)
            time.sleep(0.5)
            try:
                records = node.call(node.peer_records(manifest.run.id), timeout_s=30)
            except TimeoutError:
                raise NetworkError("the run's peer records could not be read from the DHT within 30 s; "
                                   "try again") from None
            now = time.time()  # (not after the node's shutdown, which may take seconds)
        finally:
            node.close()
    # A record's loss is 0 until its peer has evaluated (only the coordinator does, by default).
    rows = [{"peer": pid, "role": r.role, "round": r.round, "params_hash": r.params_hash, "trains": r.trains,
             "serves": r.serves, "reachability": r.reachability, "hole_punched": r.punched,
             "loss": r.loss if 0 < r.loss < float("inf") else None,
             "loss_round": r.loss_round if 0 < r.loss < float("inf") else None, "bytes_sent": r.bytes_sent,
             "refused_messages": r.rejected, "banning": r.banned, "scores": r.scores,
             "age_s": round(max(0.0, now - r.updated), 1)} for pid, r in sorted(records.items())]
    if as_json:
        # (the coordinator's peer id, from the bootstrap line: a record's role is its peer's own word)
        print(json.dumps({"run": manifest.run.id, "coordinator": boot.coordinator_id, "peers": rows}, indent=2))
        return
    print_status(manifest.run.id, rows, boot.coordinator_id)
