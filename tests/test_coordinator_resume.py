"""A coordinator restarted on the same --state-dir resumes from its newest checkpoint."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from groundswell.peer.simulate import SimulateOptions, Simulation, run_simulation

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import ended_together, leftover_processes, simulate_and_reap

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_coordinator_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "sim"
    # the manifest's cadence would checkpoint never (but at genesis and on leaving); `launch
    # --checkpoint-every 1` makes the coordinator checkpoint every round anyway
    opts = SimulateOptions(peers=2, rounds=3, inner_steps=5, batch_size=4, deadline_s=20, slack_s=2, min_peers=2,
                           checkpoint_every=10**6, checkpoint_keep=4, coordinator_checkpoint_every=1, timeout_s=300)
    try:
        report = run_simulation(opts, out, progress=lambda m: None)
        _resumes_from_its_checkpoint(report, out, opts)
    finally:
        left = leftover_processes(out)
        for p in left:
            p.kill()
    assert not left


def _resumes_from_its_checkpoint(report: dict, out: Path, opts: SimulateOptions) -> None:
    assert report["rounds_completed"] == 3 and report["param_hash_agreement"]
    assert {"peer-0", "peer-1"} <= set(ended_together(report, 3))  # the volunteers ended on one hash
    rounds = [json.loads(line) for line in (out / "coordinator" / "events.jsonl").read_text().splitlines()]
    followed = [e["round"] for e in rounds if e["kind"] == "round"]
    last = [e for e in rounds if e["kind"] == "round"][-1]
    kept = {p.name for p in (out / "coordinator").glob("checkpoint-*.pt")}
    assert len(followed) >= 2 and {f"checkpoint-{r + 1:08d}.pt" for r in followed} <= kept, (followed, kept)
    assert (out / "coordinator" / "genesis.done").exists()  # were its checkpoints lost, a launch is refused
    with Simulation(out / "again", opts) as sim:
        sim.spawn("coordinator", ["launch", str(out / "run.toml"), "--state-dir", str(out / "coordinator"),
                                  "--listen", "/ip4/127.0.0.1/tcp/0", "--quiet", "--threads", "1"])
        deadline = time.time() + 120
        resumed = []
        while time.time() < deadline and not resumed:
            time.sleep(0.5)
            events = [json.loads(line) for line in (out / "coordinator" / "events.jsonl").read_text().splitlines()]
            resumed = [e for e in events if e["kind"] == "resume"]
    assert resumed, "the restarted coordinator did not resume"
    assert resumed[0]["round"] == last["round"] + 1
    assert resumed[0]["hash"] == last["hash"]  # the same global parameters as before the restart


def test_rounds_go_on_without_the_coordinator_and_a_joiner_bootstraps_from_a_volunteer(tmp_path):
    out = tmp_path / "sim"
    # The coordinator dies right after round 0 and stays away 15 s (plus its start-up); the late
    # joiner (after round 2) can then only bootstrap from the volunteers' addresses (it had synced
    # 13 s after the volunteers' start, the coordinator was back 18 s later, with 20 s away).
    # Enough rounds that the volunteers are still going when it is back: rounds of 5 steps took
    # ~0.5 s here, and 60 of them ended the run before the coordinator could resume; rounds of 20
    # steps took 1.2-2.1 s, and the coordinator was back about round 15-30 with 20 s away.
    opts = SimulateOptions(peers=3, rounds=40, inner_steps=20, batch_size=4, deadline_s=10, slack_s=2, min_peers=2,
                           checkpoint_every=5, kill_coordinator_at=0.1, restart_after=15, late_joiners=1,
                           timeout_s=360)
    report = simulate_and_reap(opts, out)
    t: dict[tuple[str, str], float] = {}
    for e in report["events"]:
        t.setdefault((e["kind"], e["peer"]), e["t"])  # the first of each
    killed, back = t[("kill-coordinator", "coordinator")], t[("resume", "coordinator")]
    while_down = [end for end in report["round_end_t"] if killed < end < back]
    assert len(while_down) >= 2, f"rounds while the coordinator was down: {while_down}"
    assert t[("join", "late-0")] < back and t[("sync", "late-0")] < back  # bootstrapped from a volunteer
    assert report["rejoin_s"], "the late joiner never contributed"
    coordinator = [json.loads(x) for x in (out / "coordinator" / "events.jsonl").read_text().splitlines()]
    resumed = [i for i, e in enumerate(coordinator) if e["kind"] == "resume"]
    assert resumed, "the coordinator did not come back"
    after = [e for e in coordinator[resumed[0]:] if e["kind"] in ("round", "sync")]
    assert after and max(e["round"] for e in after) > coordinator[resumed[0]]["round"] + 5, \
        "the restarted coordinator did not catch up with the volunteers"
    assert report["param_hash_agreement"] and report["divergent_rounds"] == []
    assert report["rounds_completed"] == opts.rounds
    ended_together(report, opts.rounds)
    assert report["lost_contributions"] == 0
