"""A volunteer restarted while every peer of its bootstrap line (here the coordinator, as a
`groundswell join <coordinator's line>` names it) is down gets back into the run through the
peers it knew, and trains on with them. Real processes on 127.0.0.1, killed even on failure."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from groundswell.peer.simulate import SimulateOptions, Simulation

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import QUIET, launch_coordinator, leftover_processes, read_events, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_volunteer_restarted_while_the_coordinator_is_down_gets_back_in_through_the_peers_it_knew(tmp_path):
    out = tmp_path / "sim"
    opts = SimulateOptions(peers=2, rounds=10**6, inner_steps=20, batch_size=4, deadline_s=10, slack_s=2, min_peers=2,
                           checkpoint_every=1)
    common = QUIET
    try:
        with Simulation(out, opts) as sim:
            boot = launch_coordinator(sim, out, opts)
            line = boot.read_text().strip()  # the coordinator's addresses only, as a volunteer is told
            join = {name: ["join", line, "--state-dir", str(out / name), "--listen", "/ip4/127.0.0.1/tcp/0", *common]
                    for name in ("peer-0", "peer-1")}
            for name, args in join.items():
                sim.spawn(name, args)
            rounds = lambda name: [e for e in read_events(out / name / "events.jsonl") if e["kind"] == "round"]

            def knows_peer_0() -> bool:  # peer-1 keeps peer-0 among its proven peers (named in commits)
                try:
                    known = json.loads((out / "peer-1" / "known_peers.json").read_text())
                except (OSError, ValueError):
                    return False
                peer_0 = next((e["peer"] for e in read_events(out / "peer-0" / "events.jsonl") if "peer" in e), None)
                return peer_0 is not None and peer_0 in known.get("proven", {})

            wait_for(lambda: len(rounds("peer-1")) >= 2 and knows_peer_0(), 180, "two rounds, peer-0 proven")
            sim.signal("coordinator", signal.SIGKILL)  # and it stays down
            sim.signal("peer-1", signal.SIGKILL)
            sim.procs["peer-1"].popen.wait(timeout=30)  # type: ignore[union-attr]
            before = rounds("peer-1")[-1]["round"]
            said_before = len((out / "peer-1.log").read_text())
            sim.spawn("peer-1", join["peer-1"], kind="restart")
            wait_for(lambda: any(e["round"] > before for e in rounds("peer-1")[-3:]), 150,
                  "a round of the restarted peer-1")
            said = (out / "peer-1.log").read_text()[said_before:]
            assert "no bootstrap peer answered: in the run through" in said, said  # (what join prints)
            after = next(e for e in rounds("peer-1") if e["round"] > before)
            assert after["included"], after  # its work counted, not only the aggregate applied
            wait_for(lambda: any(e["round"] == after["round"] for e in rounds("peer-0")), 60, "peer-0's round")
            twin = next(e for e in rounds("peer-0") if e["round"] == after["round"])
            assert twin["hash"] == after["hash"]  # both hold the same parameters
            assert sim.alive("peer-0") and sim.alive("peer-1")
    finally:
        for p in leftover_processes(out):
            p.kill()
