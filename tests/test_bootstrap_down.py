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
    # Three volunteers: the restarted one's reachability then has two proven peers' verdicts. (With
    # two, one peer's word is no verdict: taken for private, it serves no role, and a round of a
    # two-volunteer run without its coordinator took 6 attempts, 59 s, in 1 of 7 runs here.)
    opts = SimulateOptions(peers=3, rounds=10**6, inner_steps=20, batch_size=4, deadline_s=10, slack_s=2, min_peers=2,
                           checkpoint_every=1)
    common = QUIET
    try:
        with Simulation(out, opts) as sim:
            boot = launch_coordinator(sim, out, opts)
            line = boot.read_text().strip()  # the coordinator's addresses only, as a volunteer is told
            join = {name: ["join", line, "--state-dir", str(out / name), "--listen", "/ip4/127.0.0.1/tcp/0", *common]
                    for name in ("peer-0", "peer-1", "peer-2")}
            for name, args in join.items():
                sim.spawn(name, args)
            rounds = lambda name: [e for e in read_events(out / name / "events.jsonl") if e["kind"] == "round"]

            def knows_the_others() -> bool:  # peer-1 keeps peer-0 and peer-2 among its proven peers (named in commits)
                try:
                    known = json.loads((out / "peer-1" / "known_peers.json").read_text())
                except (OSError, ValueError):
                    return False
                ids = [next((e["peer"] for e in read_events(out / n / "events.jsonl") if "peer" in e), None)
                       for n in ("peer-0", "peer-2")]
                return all(pid is not None and pid in known.get("proven", {}) for pid in ids)

            wait_for(lambda: len(rounds("peer-1")) >= 2 and knows_the_others(), 180, "two rounds, the others proven")
            sim.signal("coordinator", signal.SIGKILL)  # and it stays down
            sim.signal("peer-1", signal.SIGKILL)
            sim.procs["peer-1"].popen.wait(timeout=30)  # type: ignore[union-attr]
            before = rounds("peer-1")[-1]["round"]
            said_before = len((out / "peer-1.log").read_text())
            sim.spawn("peer-1", join["peer-1"], kind="restart")
            # (the other two go on meanwhile: the first round it applies may have begun without it)
            wait_for(lambda: any(e["round"] > before and e["included"] for e in rounds("peer-1")), 150,
                     "a round with the restarted peer-1's work")
            said = (out / "peer-1.log").read_text()[said_before:]
            assert "no bootstrap peer answered: in the run through" in said, said  # (what join prints)
            assert "reachable: public" in said, said  # two proven peers' dial-backs in the coordinator's place
            after = next(e for e in rounds("peer-1") if e["round"] > before and e["included"])
            for other in ("peer-0", "peer-2"):
                wait_for(lambda: any(e["round"] == after["round"] for e in rounds(other)), 60, f"{other}'s round")
                twin = next(e for e in rounds(other) if e["round"] == after["round"])
                assert twin["hash"] == after["hash"]  # all hold the same parameters
            assert all(sim.alive(n) for n in ("peer-0", "peer-1", "peer-2"))
    finally:
        for p in leftover_processes(out):
            p.kill()
