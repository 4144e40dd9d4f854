"""A coordinator restarted on the same --state-dir resumes from its newest checkpoint."""

from __future__ import annotations

import json
import time

import pytest

from groundswell.peer.simulate import Simulation, SimulateOptions, run_simulation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_coordinator_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "sim"
    opts = SimulateOptions(peers=2, rounds=3, inner_steps=5, batch_size=4, deadline_s=20, slack_s=2, min_peers=2,
                           checkpoint_every=1, timeout_s=300)
    report = run_simulation(opts, out, progress=lambda m: None)
    assert report["rounds_completed"] == 3 and report["param_hash_agreement"]
    rounds = [json.loads(line) for line in (out / "coordinator" / "events.jsonl").read_text().splitlines()]
    last = [e for e in rounds if e["kind"] == "round"][-1]
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
