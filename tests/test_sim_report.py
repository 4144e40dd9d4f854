"""The simulation driver's bookkeeping, without a swarm: report.json from event logs, the exit
status of `groundswell simulate`, and that no process it starts outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from groundswell.peer.cli import app
from groundswell.peer.sim_procs import Simulation
from groundswell.peer.sim_report import build_report, fault_summary
from groundswell.peer.simulate import SimulateOptions, _addresses, _rounds_done
from typer.testing import CliRunner

pytestmark = pytest.mark.timeout(120)


def _write(out: Path, name: str, events: list[dict]) -> None:
    (out / name).mkdir(parents=True, exist_ok=True)
    with open(out / name / "events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def _round(t: float, r: int, peer: str, sent_total: int | None = None, window: int = 10) -> dict:
    e = {"t": t, "kind": "round", "round": r, "hash": f"h{r}", "contributors": ["P", "Q"], "included": True,
         "peer": peer, "bytes_sent": window}
    if sent_total is not None:
        e["sent_total"] = sent_total
    return e


def test_bytes_per_round_count_what_a_peer_sends_after_its_last_round_and_before_a_restart(tmp_path):
    # peer-0: 100 bytes by round 0, 250 by round 1, then serves the slower peer-1 (400 in all at
    # exit). peer-1: killed after round 0 with 80 sent, restarted (a new process: counters from
    # 0), 60 more by round 1. Four rounds applied, 400 + 80 + 60 bytes sent: 135 a round. The
    # round windows alone (10 each) miss what is served after them.
    _write(tmp_path, "peer-0", [{"t": 0.0, "kind": "network", "peer": "P"}, _round(1.0, 0, "P", 100),
                                _round(2.0, 1, "P", 250),
                                {"t": 3.0, "kind": "defences", "rejected": {}, "peer": "P", "sent_total": 400,
                                 "state_sent_total": 120}])
    _write(tmp_path, "peer-1", [{"t": 0.0, "kind": "network", "peer": "Q"}, _round(1.0, 0, "Q", 80),
                                {"t": 1.5, "kind": "network", "peer": "Q"}, _round(2.5, 1, "Q", 60)])
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C", 10**9), _round(2.0, 1, "C", 10**9)])
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=2), [], wall_s=3.0, t0=0.0)
    assert report["bytes_sent_per_peer_per_round"] == 135.0
    assert report["state_bytes_sent_per_peer_per_round"] == 30.0  # of which states served (120 over 4 rounds)
    # logs of an older version (no totals): the windows' mean, as before
    old = tmp_path / "old"
    _write(old, "peer-0", [_round(1.0, 0, "P", window=30), _round(2.0, 1, "P", window=50)])
    older = build_report(old, SimulateOptions(peers=1, rounds=2), [], 3.0, t0=0.0)
    assert older["bytes_sent_per_peer_per_round"] == 40.0 and older["state_bytes_sent_per_peer_per_round"] is None
    from groundswell.peer.cli_simulate import state_share

    assert state_share(report) == " (of which 0.0 kB states served to joiners)" and state_share(older) == ""


def test_a_round_nobody_logged_keeps_its_place(tmp_path):
    # Round 1 happened (round 2 builds on it), but every process that applied it died before
    # logging it: 3 rounds completed, round 1's entries unknown rather than shifted.
    _write(tmp_path, "coordinator", [{"t": 0.5, "kind": "sync", "peer": "C"}, _round(1.0, 0, "C"),
                                     _round(5.0, 2, "C")])
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), [], wall_s=6.0, t0=0.0)
    assert report["rounds_completed"] == 3
    assert report["round_end_t"] == [1.0, None, 5.0]
    assert report["round_times_s"] == [0.5, None, None]
    assert len(report["eval_loss_by_round"]) == 3
    assert report["crashed"] == []
    report["events"].append({"t": 2.0, "kind": "kill", "peer": "peer-0"})
    assert "longest round 0.5 s" in fault_summary(report)


def test_crashed_processes_are_named_in_the_report(tmp_path):
    driver = [{"t": 1.0, "kind": "spawn", "peer": "peer-1"}, {"t": 9.0, "kind": "crash", "peer": "peer-1"}]
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C")])
    assert build_report(tmp_path, SimulateOptions(peers=2, rounds=1), driver, 9.0, t0=0.0)["crashed"] == ["peer-1"]


def test_rounds_done_reads_each_log_once_and_never_goes_back(tmp_path):
    seen: dict = {}
    assert _rounds_done(tmp_path, seen) == -1
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P")])
    assert _rounds_done(tmp_path, seen) == 1
    # many events after the last round (a tail of 20 lines would lose it), and half a line
    _write(tmp_path, "peer-0", [{"t": 3.0 + i, "kind": "train", "round": 9} for i in range(50)])
    with open(tmp_path / "peer-0" / "events.jsonl", "a") as f:
        f.write('{"t": 60, "kind": "round", "round": 7')
    assert _rounds_done(tmp_path, seen) == 1
    with open(tmp_path / "peer-0" / "events.jsonl", "a") as f:
        f.write(', "hash": "h"}\n')
    assert _rounds_done(tmp_path, seen) == 7
    assert _rounds_done(tmp_path) == 7  # without a cache: the whole log


def test_addresses_skip_a_file_being_written(tmp_path):
    for name, text in (("a", "/ip4/1/tcp/1/p2p/A\n/ip4/2/tcp/1/p2p/A\n"), ("b", ""), ("c", "\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "address.txt").write_text(text)
    assert _addresses(sorted(tmp_path.glob("*/address.txt"))) == ["/ip4/1/tcp/1/p2p/A"]
    assert _addresses([tmp_path / "missing" / "address.txt"]) == []


def test_simulate_exits_nonzero_when_the_run_failed(tmp_path, monkeypatch):
    from groundswell.peer import simulate

    base = {"rounds_completed": 3, "rounds_target": 3, "peers": 2, "codec": "sparseloco",
            "eval_loss_by_round": [5.0, 4.0, 3.0], "bytes_sent_per_peer_per_round": 1e3,
            "dense_fp32_ring_bytes_per_peer_per_round": 1e6, "param_hash_agreement": True, "divergent_rounds": [],
            "wall_s": 10.0, "crashed": [], "events": []}
    cases = [({}, 0, "3/3 rounds"), ({"crashed": ["peer-1"]}, 1, "peer-1 exited with an error"),
             ({"rounds_completed": 2}, 1, "only 2 of 3 rounds"),
             ({"divergent_rounds": [1], "param_hash_agreement": False}, 1, "hashes differ in rounds [1]"),
             ({"hashless_rounds": [1], "param_hash_agreement": False}, 1,
              "no process reported a parameter hash in rounds [1]"),
             ({"unhashed": [{"round": 2, "peer": "peer-1"}], "param_hash_agreement": False}, 1,
              "no parameter hash logged by peer-1 in round 2")]
    for change, code, said in cases:
        monkeypatch.setattr(simulate, "run_simulation", lambda opts, out, progress, r=dict(base, **change): r)
        res = CliRunner().invoke(app, ["simulate", "--peers", "2", "--rounds", "3", "--out", str(tmp_path / "s")])
        assert res.exit_code == code, res.output
        assert said in " ".join(res.output.split()), res.output


def test_a_process_that_fails_is_a_crash_and_one_we_killed_is_not(tmp_path):
    with Simulation(tmp_path, SimulateOptions(peers=1, rounds=1)) as sim:
        sim.spawn("peer-0", ["no-such-command"])  # typer: usage error, exit status 2
        sim.spawn("peer-1", ["simulate", "--help"])  # exits 0
        sim.procs["peer-0"].popen.wait(timeout=60)
        sim.procs["peer-1"].popen.wait(timeout=60)
        assert sim.crashed("peer-0") == 2 and sim.crashed("peer-1") is None
        sleeper = sim.spawn("peer-2", ["simulate", "--help"])
        sleeper.popen.wait(timeout=60)
        sim.signalled["peer-2"] = signal.SIGKILL  # a status the injected fault explains is not a crash
        sleeper.popen.returncode = -signal.SIGKILL
        assert sim.crashed("peer-2") is None
        sim.spawn("peer-0", ["simulate", "--help"])  # a restart replaces the name; the old one is reaped on exit
        assert len(sim._replaced) == 1
    assert all(p.log is None for p in [*sim.procs.values(), *sim._replaced])


def test_a_killed_driver_takes_its_children_with_it(tmp_path):
    # The driver dies without running its cleanup (SIGKILL): the kernel's parent-death signal
    # still ends what it started.
    script = (
        "import subprocess, sys, time\n"
        "from groundswell.peer.daemon import die_with_us\n"
        "child = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_us(), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(driver.stdout.readline())
        os.kill(child, 0)  # running
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            try:
                with open(f"/proc/{child}/stat") as f:  # a zombie waits for init to reap it: it is gone
                    if f.read().split(") ", 1)[1].startswith("Z"):
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the child outlived the driver")
    finally:
        _end(driver, child)


def test_a_round_applied_in_catching_up_counts_in_the_hash_agreement(tmp_path):
    # peer-1 missed round 1 and applied it while catching up, with other parameters than the
    # rest (then found its hash off and re-synced): the run did diverge in round 1.
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P")])
    _write(tmp_path, "peer-1", [_round(1.0, 0, "Q"), {"t": 2.5, "kind": "follow", "round": 1, "hash": "other"},
                                {"t": 2.6, "kind": "hash-mismatch", "round": 2, "peer": "Q"}])
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=2), [], wall_s=3.0, t0=0.0)
    assert report["divergent_rounds"] == [1] and report["param_hash_agreement"] is False
    assert report["hash_mismatches"] == 1
    assert not any(e["kind"] == "follow" for e in report["events"])


def test_the_coordinators_loss_of_a_round_it_caught_up_on_is_in_the_loss_curve(tmp_path):
    # The coordinator applied round 1 while catching up and evaluated it there (it used to skip
    # such rounds): the report's loss curve has no hole at round 1.
    _write(tmp_path, "coordinator", [dict(_round(1.0, 0, "C"), eval_loss=3.0),
                                     {"t": 2.5, "kind": "follow", "round": 1, "hash": "h1", "eval_loss": 2.75,
                                      "peer": "C"}])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P")])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=2), [], wall_s=3.0, t0=0.0)
    assert report["eval_loss_by_round"] == [3.0, 2.75] and report["final_eval_loss"] == 2.75


def test_a_round_known_only_from_catching_up_counts_as_completed(tmp_path):
    # Round 2 was applied by the volunteers in the exchange but logged, before they left, only by
    # a peer that caught up on it: the run reached its target (it used to read as 2 of 3 rounds).
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P"),
                                {"t": 3.0, "kind": "follow", "round": 2, "hash": "h2", "peer": "P"}])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), [], wall_s=3.0, t0=0.0)
    assert report["rounds_completed"] == 3 and report["param_hash_agreement"] is True
    assert report["round_end_t"] == [1.0, 2.0, 3.0]
    assert _rounds_done(tmp_path) == 2
    # where each process ended: the coordinator stopped a round short of its volunteer
    assert report["final_round_by_process"] == {"coordinator": [1, "h1"], "peer-0": [2, "h2"]}


def test_a_process_that_ended_on_a_downloaded_state_ended_where_its_round_left_the_swarm(tmp_path):
    # peer-0 restarted and took the state of round 3 (what round 2 left), then the run stopped
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C"), _round(3.0, 2, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), {"t": 3.5, "kind": "sync", "round": 3, "hash": "h2", "peer": "P"}])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), [], wall_s=4.0, t0=0.0)
    assert report["final_round_by_process"] == {"coordinator": [2, "h2"], "peer-0": [2, "h2"]}


def _ev(t: float, kind: str, r: int, peer: str, **extra) -> dict:
    return {"t": t, "kind": kind, "round": r, "peer": peer, "bytes_sent": 10, **extra}


def test_contributions_settled_without_their_commit_count_as_lost_or_applied_twice(tmp_path):
    # Commits: round 0 counted P, Q, R; round 1 P alone; round 2 P, Q, S.
    _write(tmp_path, "coordinator", [_ev(1.0, "round", 0, "C", hash="h0", contributors=["P", "Q", "R"]),
                                     _ev(2.0, "round", 1, "C", hash="h1", contributors=["P"]),
                                     _ev(3.0, "round", 2, "C", hash="h2", contributors=["P", "Q", "S"])])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P"), _round(3.0, 2, "P")])
    # Q took later states and settled its contributions without their commits: round 0's work kept
    # though counted (applied twice; logged again by its restart, still one), round 1's taken out
    # though not counted (never applied), round 2's taken out and counted (right).
    _write(tmp_path, "peer-1", [_ev(3.5, "outcome-unknown", 0, "Q"), _ev(3.6, "outcome-unknown", 0, "Q"),
                                _ev(3.7, "presumed-counted", 1, "Q"), _ev(3.8, "presumed-counted", 2, "Q"),
                                _ev(3.9, "outcome-unknown", 9, "Q")])  # round 9's commit is in no log: unknown
    # R: round 0 counted what its crashed process sent (superseded: not lost); round 1's work kept,
    # and not counted (right)
    _write(tmp_path, "peer-2", [_ev(1.0, "round", 0, "R", hash="h0", contributors=["P", "Q", "R"], included=False,
                                    superseded=True), _ev(3.5, "outcome-unknown", 1, "R")])
    # S: counted in round 2, and thought not (applied twice), as counted before
    _write(tmp_path, "peer-3", [_ev(3.1, "round", 2, "S", hash="h2", contributors=["P", "Q", "S"], included=False)])
    report = build_report(tmp_path, SimulateOptions(peers=4, rounds=3), [], wall_s=4.0, t0=0.0)
    assert report["lost_contributions"] == 3  # Q's rounds 0 and 1, S's round 2
    assert report["double_counted_contributions"] == 2  # Q's round 0, S's round 2
    assert report["presumed_lost_contributions"] == 1  # Q's round 1: presumed counted, by design
    report["events"].append({"t": 2.0, "kind": "kill", "peer": "peer-1"})
    assert "lost contributions 3 (2 applied twice) (1 presumed counted by a restart" in fault_summary(report)


def test_hash_checked_rounds_count_rounds_two_processes_reported(tmp_path):
    # rounds 0 and 1: the coordinator and peer-0; round 2: the coordinator alone; round 3: peer-1
    # alone, twice (a round, then a catch-up of its restart): one process, nothing compared
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C"), _round(3.0, 2, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P")])
    _write(tmp_path, "peer-1", [_round(4.0, 3, "Q"), {"t": 4.5, "kind": "follow", "round": 3, "hash": "h3"}])
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=4), [], wall_s=5.0, t0=0.0)
    assert report["param_hash_agreement"] is True and report["hash_checked_rounds"] == 2
    # which rounds nothing compared is said, in the report and in the line a researcher reads
    assert report["unchecked_rounds"] == [2, 3]
    from groundswell.peer.cli_simulate import hash_checks

    assert hash_checks(report) == (" (compared in 2 rounds; not in rounds 2, 3, which fewer than two processes "
                                   "reported)")


def test_a_peer_that_finished_a_round_without_a_hash_makes_the_agreement_false(tmp_path):
    # peer-0 logged round 1 with no hash (""), in the round and in a catch-up: not a second hash
    # (no divergence), but nothing says it agreed either. It read as agreement (found by a review).
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), dict(_round(2.0, 1, "P"), hash=""),
                                {"t": 2.5, "kind": "follow", "round": 1, "hash": ""}])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=2), [], wall_s=3.0, t0=0.0)
    assert report["param_hash_agreement"] is False and report["unhashed"] == [{"round": 1, "peer": "peer-0"}]
    assert report["divergent_rounds"] == [] and report["hash_checked_rounds"] == 1  # round 1: the coordinator's alone
    from groundswell.peer.cli_simulate import hash_checks

    assert hash_checks(report) == (" (compared in 1 round; not in round 1, which fewer than two processes "
                                   "reported; 1 finished a round without one)")


def test_a_completed_round_no_process_reported_a_hash_for_makes_the_agreement_false(tmp_path):
    # Round 1 happened (round 2 builds on it) but no log holds a hash of it: nothing compared it,
    # and the agreement read as true (found by a review). Round 2, one process alone: vacuously fine.
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(5.0, 2, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P")])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), [], wall_s=6.0, t0=0.0)
    assert report["param_hash_agreement"] is False
    assert report["rounds_completed"] == 3 and report["divergent_rounds"] == [] and report["unhashed"] == []
    assert report["hashless_rounds"] == [1] and report["unchecked_rounds"] == [1, 2]
    from groundswell.peer.cli_simulate import hash_checks

    assert hash_checks(report) == (" (compared in 1 round; not in rounds 1, 2, which fewer than two processes "
                                   "reported; no process reported one in round 1)")
    # a round logged without any hash is as hashless; with round 1 logged, all agree again
    _write(tmp_path, "peer-0", [dict(_round(2.0, 1, "P"), hash="")])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), [], wall_s=6.0, t0=0.0)
    assert report["hashless_rounds"] == [1] and report["param_hash_agreement"] is False
    _write(tmp_path, "coordinator", [{"t": 2.5, "kind": "follow", "round": 1, "hash": "h1"}])
    _write(tmp_path, "peer-1", [_round(2.0, 1, "Q")])
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), [], wall_s=6.0, t0=0.0)
    assert report["hashless_rounds"] == [] and report["unhashed"] == [{"round": 1, "peer": "peer-0"}]
    (tmp_path / "peer-0" / "events.jsonl").unlink()
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), [], wall_s=6.0, t0=0.0)
    assert report["param_hash_agreement"] is True and report["unchecked_rounds"] == [0, 2]


def test_rounds_in_a_rotated_event_log_are_in_the_report(tmp_path):
    # Past 64 MB events.jsonl is renamed events.jsonl.1 (event_log.py): the report read only the
    # newer part, losing rounds 0 and 1, and dividing a whole run's bytes by 2 rounds, not 4.
    _write(tmp_path, "coordinator", [dict(_round(1.0 + r, r, "C"), eval_loss=5.0 - r) for r in range(4)])
    _write(tmp_path, "peer-0", [{"t": 0.0, "kind": "network", "peer": "P"}, {"t": 0.5, "kind": "sync", "peer": "P"},
                                _round(1.0, 0, "P", 100), _round(2.0, 1, "P", 200)])
    (tmp_path / "peer-0" / "events.jsonl").rename(tmp_path / "peer-0" / "events.jsonl.1")
    with open(tmp_path / "peer-0" / "events.jsonl.1", "a") as f:
        f.write('{"t": 2.1, "kind": "trai')  # a line a kill cut short: not glued to the next file's first
    _write(tmp_path, "peer-0", [_round(3.0, 2, "P", 300), _round(4.0, 3, "P", 400)])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=4), [], wall_s=5.0, t0=0.0)
    assert report["bytes_sent_per_peer_per_round"] == 100.0  # 400 bytes over 4 rounds
    assert report["round_times_s"] == [0.5, 1.0, 1.0, 1.0]
    assert report["hash_checked_rounds"] == 4 and report["unchecked_rounds"] == []
    assert report["final_round_by_process"]["peer-0"] == [3, "h3"]


def test_a_coordinator_catch_up_whose_loss_diverged_is_reported_as_diverged(tmp_path):
    # The coordinator applied round 1 in catching up and its evaluation was NaN: the loss was
    # dropped without a word (a round event's is listed; found by a review).
    _write(tmp_path, "coordinator", [dict(_round(1.0, 0, "C"), eval_loss=3.0),
                                     {"t": 2.5, "kind": "follow", "round": 1, "hash": "h1", "eval_loss": "NaN",
                                      "peer": "C"}])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(2.0, 1, "P")])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=2), [], wall_s=3.0, t0=0.0)
    assert report["eval_nonfinite_rounds"] == [1] and report["eval_loss_by_round"] == [3.0, None]
    assert report["final_eval_round"] == 0


def test_a_round_known_only_from_a_late_catch_up_takes_no_negative_time(tmp_path):
    # Round 1 is known only from peer-0's catch-up at 6 s, after round 2 ended at 3 s: round 2
    # took -3 s. For timing a round ends no earlier than the one before it; round_end_t is as logged.
    _write(tmp_path, "coordinator", [{"t": 0.5, "kind": "sync", "peer": "C"}, _round(1.0, 0, "C"),
                                     _round(3.0, 2, "C"), _round(7.0, 3, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), {"t": 6.0, "kind": "follow", "round": 1, "hash": "h1"}])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=4), [], wall_s=8.0, t0=0.0)
    assert report["round_end_t"] == [1.0, 6.0, 3.0, 7.0]
    assert report["round_times_s"] == [0.5, 5.0, 0.0, 1.0]


def test_the_report_gives_the_seed_and_the_faults(tmp_path):
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C")])
    opts = SimulateOptions(peers=3, rounds=3, seed=7, kill_every=30, restart_after=5)
    report = build_report(tmp_path, opts, [], 2.0, t0=0.0)
    assert report["seed"] == 7
    assert report["faults"] == {"kill_every": 30, "restart_after": 5, "freeze_every": 0.0, "freeze_for": 10.0,
                                "leave_every": 0.0, "late_joiners": 0, "kill_coordinator_at": 0.0,
                                "crash_daemon_every": 0.0}


def test_rejoin_waits_for_the_restarted_process_own_counted_round(tmp_path):
    # peer-1 (Q) killed at 2 s, restarted at 4 s: round 1's commit (5 s) names Q for what its killed
    # process sent (superseded); its restart's own work is first counted in round 2 (7 s).
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(5.0, 1, "C"), _round(7.0, 2, "C")])
    _write(tmp_path, "peer-1", [_round(1.0, 0, "Q"), dict(_round(5.0, 1, "Q"), included=False, superseded=True),
                                _round(7.0, 2, "Q")])
    driver = [{"t": 2.0, "kind": "kill", "peer": "peer-1"}, {"t": 4.0, "kind": "restart", "peer": "peer-1"}]
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), driver, wall_s=8.0, t0=0.0)
    assert report["rejoin_s"] == [3.0]


def test_recovery_takes_the_earliest_round_end_after_the_fault(tmp_path):
    # Killed at 2 s; round 2 ended at 3 s, round 1 is known only from peer-0's catch-up at 6 s
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(3.0, 2, "C")])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), {"t": 6.0, "kind": "follow", "round": 1, "hash": "h1"}])
    _write(tmp_path, "peer-1", [{"t": 0.5, "kind": "network", "peer": "R"}])
    driver = [{"t": 2.0, "kind": "kill", "peer": "peer-1"}]
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), driver, wall_s=7.0, t0=0.0)
    assert report["recovery_s"] == [1.0] and report["recovery_excluding_s"] == [1.0]


def test_timed_out_says_whether_the_driver_timeout_stopped_the_run(tmp_path):
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C")])
    opts = SimulateOptions(peers=1, rounds=2)
    assert build_report(tmp_path, opts, [], 2.0, t0=0.0)["timed_out"] is False
    driver = [{"t": 1.5, "kind": "timed-out", "peer": "driver"}]
    assert build_report(tmp_path, opts, driver, 2.0, t0=0.0)["timed_out"] is True


def test_a_killed_driver_takes_a_frozen_child_with_it(tmp_path):
    # The churn froze a peer (SIGSTOP, its p2pd too) when the driver died without its cleanup: a
    # parent-death SIGTERM would stay pending, and the peer stopped, for good; SIGKILL is not held.
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from groundswell.peer.sim_procs import Simulation\n"
        "sim = Simulation(Path(sys.argv[1]), None)\n"
        "proc = sim.spawn('peer-0', [], prefix=('sh', '-c', 'exec sleep 300', 'sh'))  # as a peer is spawned\n"
        "print(proc.popen.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(driver.stdout.readline())
        os.kill(child, signal.SIGSTOP)
        deadline = time.time() + 30
        while _state(child) != "T":  # stopped
            assert time.time() < deadline, "the child never stopped"
            time.sleep(0.05)
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and _state(child) not in ("Z", None):  # a zombie waits for init: gone
            time.sleep(0.1)
        if _state(child) not in ("Z", None):
            pytest.fail("the frozen child outlived the driver")
    finally:
        _end(driver, child)


def _end(driver: subprocess.Popen, child: int | None) -> None:
    """Kill and reap the driver, and kill its child if it is still there (even when the test failed)."""
    driver.kill()
    driver.wait(timeout=30)
    if child is not None and _state(child) not in ("Z", None):
        os.kill(child, signal.SIGKILL)  # SIGKILL ends a stopped process too


def _state(pid: int) -> str | None:
    """A process's state letter in /proc (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def test_a_restart_killed_again_before_it_was_counted_never_rejoined(tmp_path):
    # Found by a review: peer-1 restarted at 4 s, killed again at 6 s before any commit counted
    # it, restarted at 8 s and counted at 11 s. The first restart was credited with the second's
    # round (7 s); it never rejoined, and says so.
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(5.0, 1, "C"), _round(11.0, 2, "C")])
    _write(tmp_path, "peer-1", [_round(1.0, 0, "Q"), _round(11.0, 2, "Q")])
    driver = [{"t": 2.0, "kind": "kill", "peer": "peer-1"}, {"t": 4.0, "kind": "restart", "peer": "peer-1"},
              {"t": 6.0, "kind": "kill", "peer": "peer-1"}, {"t": 8.0, "kind": "restart", "peer": "peer-1"}]
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), driver, wall_s=12.0, t0=0.0)
    assert report["rejoin_s"] == [3.0] and report["never_rejoined"] == 1
    assert "rejoin mean/max 3.0 / 3.0 s (1 never rejoined)" in fault_summary(report)


def test_a_fault_asked_for_that_never_happened_is_counted_and_said(tmp_path):
    # Found by a review: faults wait for round 0 and stop before the last round, so a short run
    # could end before `--kill-coordinator-at` fired, and the report still read as if it had.
    from groundswell.peer.sim_report import faults_missed

    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C")])
    driver = [{"t": 1.5, "kind": "kill", "peer": "peer-0"}]
    opts = SimulateOptions(peers=3, rounds=3, kill_every=1.0, kill_coordinator_at=30.0, timeout_s=60)
    report = build_report(tmp_path, opts, driver, wall_s=3.0, t0=0.0)
    assert report["faults_fired"] == {"kill": 1, "freeze": 0, "leave": 0, "join": 0, "kill-coordinator": 0,
                                      "daemon-crash": 0}
    assert faults_missed(report) == ["--kill-coordinator-at"]


def test_faults_due_that_took_nobody_are_counted_and_said(tmp_path):
    from groundswell.peer.sim_report import fault_summary

    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C")])
    driver = [{"t": 1.5, "kind": "kill", "peer": "peer-0"}, {"t": 2.0, "kind": "kill-held-back", "peer": "driver"},
              {"t": 2.5, "kind": "kill-held-back", "peer": "driver"}, {"t": 2.5, "kind": "freeze-held-back", "peer": "driver"}]
    opts = SimulateOptions(peers=3, rounds=3, kill_every=0.5, freeze_every=1.0, timeout_s=60)
    report = build_report(tmp_path, opts, driver, wall_s=3.0, t0=0.0)
    assert report["faults_fired"]["kill"] == 1 and report["faults_fired"]["freeze"] == 0
    assert report["faults_held_back"] == {"kill": 2, "freeze": 1, "leave": 0, "daemon-crash": 0}
    assert fault_summary(report).startswith("1 kill (2 kills, 1 freeze held back: no more than --min-peers peers up);")


def test_a_restarted_coordinator_is_no_rejoin_that_never_happened(tmp_path):
    # The coordinator contributes nothing, so its rounds never say "included": its restart after
    # --kill-coordinator-at was counted as a peer that never rejoined (review).
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(6.0, 1, "C")])
    driver = [{"t": 2.0, "kind": "kill-coordinator", "peer": "coordinator"},
              {"t": 4.0, "kind": "restart", "peer": "coordinator"}]
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=2), driver, wall_s=7.0, t0=0.0)
    assert report["rejoin_s"] == [] and report["never_rejoined"] == 0


def test_faults_no_round_measured_are_counted_not_dropped(tmp_path):
    # Killed at 2 s and at 6 s; the last round ended at 3 s and left peer-1 (R) in: the second
    # kill has no recovery at all, neither has a round without R after the first.
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), dict(_round(3.0, 1, "C"), contributors=["P", "R"])])
    _write(tmp_path, "peer-1", [{"t": 0.5, "kind": "network", "peer": "R"}])
    driver = [{"t": 2.0, "kind": "kill", "peer": "peer-1"}, {"t": 6.0, "kind": "kill", "peer": "peer-1"}]
    report = build_report(tmp_path, SimulateOptions(peers=2, rounds=3), driver, wall_s=7.0, t0=0.0)
    assert report["recovery_s"] == [1.0] and report["recovery_excluding_s"] == []
    assert report["recovery_unmeasured"] == {"recovery": 1, "recovery_excluding": 2}
    assert "faults left out: 1 with no round after and 2 with no round without the peer after" in fault_summary(report)


def test_compute_utilization_leaves_out_time_frozen_or_dead(tmp_path):
    # peer-0 synced at 0 s, trained 2 s of compute by 10 s, frozen from 2 to 6 s by the driver:
    # 2 s over the 6 s it could run, not over 10 s. A kill at 7 s restarted at 8 s takes 1 s more.
    train = [{"t": t, "kind": "train", "compute_s": 0.5} for t in (1.0, 7.0, 9.0, 10.0)]
    _write(tmp_path, "peer-0", [{"t": 0.0, "kind": "sync", "round": 0, "hash": "h0"}, *train])
    driver = [{"t": 2.0, "kind": "freeze", "peer": "peer-0"}, {"t": 6.0, "kind": "thaw", "peer": "peer-0"},
              {"t": 7.0, "kind": "kill", "peer": "peer-0"}, {"t": 8.0, "kind": "restart", "peer": "peer-0"}]
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=1), driver, wall_s=11.0, t0=0.0)
    assert report["compute_utilization"] == round(2.0 / 5.0, 4)
    assert build_report(tmp_path, SimulateOptions(peers=1, rounds=1), [], 11.0, t0=0.0)[
        "compute_utilization"] == round(2.0 / 10.0, 4)


def test_the_driver_keeps_an_ignored_hangup_ignored(tmp_path):
    # Under `nohup` SIGHUP is ignored: closing the terminal must not tear the run down. SIGTERM
    # (not ignored) still reaches the driver's cleanup.
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Simulation(tmp_path, None):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_the_driver_sweeps_the_socket_folders_of_the_processes_it_killed(tmp_path, monkeypatch):
    import tempfile

    from groundswell.peer.daemon import SOCKET_DIR_PREFIX

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    stale = root / f"{SOCKET_DIR_PREFIX}4194303-0badcafe"  # a killed process's: its lock held by nobody
    stale.mkdir(mode=0o700)
    (stale / ".lock").touch()
    with Simulation(tmp_path / "sim", None):
        pass
    assert not stale.exists()


def test_a_peer_killed_outright_takes_its_daemon_with_it_even_one_deaf_to_sigterm(tmp_path):
    # A peer's p2pd gets SIGKILL when the peer dies without shutting it down: a SIGTERM is held
    # back by a stop (a frozen peer's group) and can be ignored; this stand-in daemon ignores it.
    daemon = tmp_path / "p2pd"
    daemon.write_text(f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('ready', flush=True)\ntime.sleep(300)\n")
    daemon.chmod(0o755)
    script = (
        "import asyncio, sys\n"
        "from groundswell.peer.daemon import adopt_p2pd_daemons\n"
        "adopt_p2pd_daemons()\n"
        "async def main():\n"
        # (called as hivemind calls it: asyncio.create_subprocess_exec is another name, not patched)
        "    proc = await asyncio.subprocess.create_subprocess_exec(sys.argv[1], stdout=asyncio.subprocess.PIPE)\n"
        "    await proc.stdout.readline()\n"
        "    print(proc.pid, flush=True)\n"
        "    await asyncio.sleep(300)\n"
        "asyncio.run(main())\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", script, str(daemon)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(peer.stdout.readline())
        assert _state(child) not in ("Z", None)
        peer.kill()
        peer.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and _state(child) not in ("Z", None):
            time.sleep(0.1)
        if _state(child) not in ("Z", None):
            pytest.fail("the daemon outlived its peer")
    finally:
        _end(peer, child)


def test_bytes_nobody_measured_are_none_not_zero(tmp_path):
    # Found by a review: a run where only the coordinator applied a round reported 0 bytes sent
    # per volunteer, a figure nobody measured; and the summary line then must not fail on None.
    from groundswell.peer.cli_simulate import kilobytes

    _write(tmp_path, "coordinator", [_round(1.0, 0, "C", 5.0)])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=1), [], wall_s=2.0, t0=0.0)
    assert report["rounds_completed"] == 1
    assert report["bytes_sent_per_peer_per_round"] is None and report["state_bytes_sent_per_peer_per_round"] is None
    assert kilobytes(None) == "-" and kilobytes(48_700) == "48.7"
