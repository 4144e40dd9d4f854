"""The simulation driver's decisions and bookkeeping, without starting a process: whom a fault may
pick, when nobody is left, whom a restarted peer bootstraps from, report.json's loss and byte
figures, the summary line, and the harness's cleanup."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from groundswell.peer import sim_procs
from groundswell.peer.cli import app
from groundswell.peer.config import ConfigError
from groundswell.peer.event_log import EventLog
from groundswell.peer.sim_procs import Proc, Simulation
from groundswell.peer.sim_report import build_report, report_json
from groundswell.peer.simulate import SimulateOptions, fault_victims, faults_due, live_addresses, nobody_left
from swarm_harness import Cluster, leftover_processes
from typer.testing import CliRunner

pytestmark = pytest.mark.timeout(120)


class _Running:
    """A Popen stand-in for a process that has not been reaped yet."""

    pid = 999_999_999
    returncode = None

    def poll(self) -> int | None:
        return self.returncode


def test_a_peer_told_to_end_is_no_fault_victim_and_counts_no_more():
    # --peers 3 --min-peers 2, kill and leave due in the same pass: A is killed (not reaped yet,
    # so still alive); the leave must not take B, which would leave C alone, below min_peers.
    live = ["A", "B", "C"]
    assert fault_victims(live, frozen={}, going=set(), min_peers=2) == live
    assert fault_victims(live, frozen={}, going={"A"}, min_peers=2) == []
    # with room for a second fault, neither the dying nor a frozen peer is picked
    assert fault_victims(["A", "B", "C", "D", "E"], frozen={"B": 9.0}, going={"A"}, min_peers=2) == ["C", "D", "E"]


def test_a_peer_still_starting_counts_as_down_for_the_faults_floor():
    # --peers 4 --min-peers 2: D restarted and has not taken the state yet; killing one of the
    # three up would leave two able to make a round (allowed), then no more until D is up
    live = ["A", "B", "C", "D"]
    assert fault_victims(live, frozen={}, going=set(), min_peers=2, synced={"A", "B", "C"}) == live
    assert fault_victims(live, frozen={}, going={"A"}, min_peers=2, synced={"A", "B", "C"}) == []
    assert fault_victims(live, frozen={}, going={"A"}, min_peers=2, synced={"A", "B", "C", "D"}) == ["B", "C", "D"]


def test_a_process_is_synced_only_once_its_own_log_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(sim_procs.subprocess, "Popen", lambda *a, **k: _Ending(None))
    monkeypatch.setattr(Simulation, "_signal_machine", staticmethod(lambda proc, sig: None))
    log = tmp_path / "peer-0" / "events.jsonl"
    log.parent.mkdir()
    log.write_text(json.dumps({"t": 1, "kind": "sync", "round": 0}) + "\n")  # the process before's
    with Simulation(tmp_path, SimulateOptions()) as sim:
        sim.spawn("peer-0", ["join"], kind="restart")
        assert not sim.synced("peer-0") and not sim.synced("peer-9")
        with open(log, "a") as f:
            f.write(json.dumps({"t": 2, "kind": "sync-refused"}) + '\n{"t": 3, "kind": "sy')  # and half a line
        assert not sim.synced("peer-0")
        with open(log, "a") as f:
            f.write('nc", "round": 4}\n')
        assert sim.synced("peer-0")
        sim.spawn("peer-0", ["join"], kind="restart")
        assert not sim.synced("peer-0")
        with open(log, "a") as f:  # nobody had a newer state than its checkpoint: it goes on from that
            f.write(json.dumps({"t": 4, "kind": "resume-ahead", "round": 3}) + "\n")
        assert sim.synced("peer-0")
        sim.spawn("peer-0", ["join"], kind="restart")
        log.write_text(json.dumps({"t": 5, "kind": "sync", "round": 5}) + "\n")  # rotated: a new, shorter file
        assert sim.synced("peer-0")


def test_a_sigint_after_a_sigkill_keeps_the_kill_recorded(tmp_path, monkeypatch):
    sent: list[int] = []
    monkeypatch.setattr(Simulation, "_signal_machine", staticmethod(lambda proc, sig: sent.append(sig)))
    monkeypatch.setattr(sim_procs.os, "killpg", lambda pid, sig: sent.append(sig))
    sim = Simulation(tmp_path, SimulateOptions())
    popen = _Running()
    sim.procs["peer-0"] = Proc("peer-0", [], tmp_path / "peer-0", popen=popen)
    assert not sim.going("peer-0")
    sim.signal("peer-0", signal.SIGKILL)
    sim.signal("peer-0", signal.SIGINT)  # e.g. told to leave before the kill was reaped
    assert sent == [signal.SIGKILL, signal.SIGINT] and sim.going("peer-0")
    popen.returncode = -signal.SIGKILL
    assert sim.crashed("peer-0") is None  # the kill we injected, not a crash


class _Ending(_Running):
    """A stand-in process that ends at `dies_at` (None: runs until told to end)."""

    def __init__(self, dies_at: float | None) -> None:
        self.dies_at = dies_at

    def poll(self) -> int | None:
        return 1 if self.dies_at is not None and time.time() >= self.dies_at else None

    def wait(self, timeout: float | None = None) -> int:
        self.dies_at = time.time()
        return 1


class _FakeSimulation(Simulation):
    """A Simulation whose processes are stand-ins: nothing starts. A signalled one ends a second
    later (not reaped at once, like a real one); with `die_after`, volunteers end on their own."""

    die_after: float | None = None
    dying: tuple[str, ...] | None = None  # the volunteers that end on their own (None: all of them)
    restarts_sync: bool = True  # a restarted stand-in logs at once that it took the state (False: never)

    def spawn(self, name: str, args: list[str], kind: str = "spawn", prefix: tuple[str, ...] = ()) -> Proc:
        if kind == "restart" and (self.out / name / "address.txt").exists():
            self.event("stale-address", name)  # the old process's: the driver could hand it out as the new one's
        dies = self.die_after and name != "coordinator" and (self.dying is None or name in self.dying)
        popen = _Ending(time.time() + self.die_after if dies else None)
        self.procs[name] = proc = Proc(name, args, self.out / name, popen=popen)
        self.signalled.pop(name, None)
        self.event(kind, name)
        proc.state_dir.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # (as `Simulation.spawn`: the earlier process's lines are not this one's)
            proc.events_read = (proc.state_dir / "events.jsonl").stat().st_size
        if name != "coordinator" and (kind != "restart" or self.restarts_sync):
            with open(proc.state_dir / "events.jsonl", "a") as f:  # up at once: a fault's victim may be
                f.write(json.dumps({"t": time.time(), "kind": "sync", "round": 0}) + "\n")
        if name == "coordinator":
            (proc.state_dir / "bootstrap.txt").write_text("gs1:C@/ip4/127.0.0.1/tcp/1/p2p/C\n")
        elif kind != "restart":  # a restarted stand-in has not written its own yet
            (proc.state_dir / "address.txt").write_text(f"/ip4/127.0.0.1/tcp/{len(self.events)}/p2p/{name}\n")
        return proc

    def signal(self, name: str, sig: int) -> None:
        super().signal(name, sig)
        popen = self.procs[name].popen
        if sig in (signal.SIGKILL, signal.SIGINT) and popen.dies_at is None:
            popen.dies_at = time.time() + 1.0

    def sample_rss(self) -> None:
        pass


def _fake_run(tmp_path: Path, monkeypatch, opts: SimulateOptions, rounds_done: int | Callable | None = None,
              die_after: float | None = None, dying: tuple[str, ...] | None = None,
              restarts_sync: bool = True) -> tuple[list[dict], float]:
    """run_simulation's loop over stand-in processes: the driver's events, and its wall time."""
    from groundswell.peer import plots, simulate

    monkeypatch.setattr(Simulation, "_signal_machine", staticmethod(lambda proc, sig: None))
    monkeypatch.setattr(sim_procs.os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(simulate, "Simulation", lambda out, o: _FakeSimulation(out, o))
    monkeypatch.setattr(_FakeSimulation, "die_after", die_after)
    monkeypatch.setattr(_FakeSimulation, "dying", dying)
    monkeypatch.setattr(_FakeSimulation, "restarts_sync", restarts_sync)
    monkeypatch.setattr(simulate, "_rounds_done", rounds_done if callable(rounds_done) else lambda out, seen=None: rounds_done)
    monkeypatch.setattr(simulate, "build_report", lambda out, opts, events, wall, t0, rss: {"events": events})
    monkeypatch.setattr(plots, "plot_loss", lambda report, path: None)
    start = time.time()
    report = simulate.run_simulation(opts, tmp_path / "sim", progress=lambda m: None)
    return report["events"], time.time() - start


def test_faults_due_in_one_pass_never_stall_the_run(tmp_path, monkeypatch):
    # kill, freeze and leave all due at 0.5 s with 3 peers and min_peers 2: only one may fire
    opts = SimulateOptions(peers=3, rounds=10, kill_every=0.5, freeze_every=0.5, leave_every=0.5, timeout_s=2.0)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)
    faults = [e for e in events if e["kind"] in ("kill", "freeze", "leave")]
    assert [e["kind"] for e in faults] == ["kill"], events


def test_adding_another_kind_of_fault_does_not_change_whom_the_kills_take(tmp_path, monkeypatch):
    # Kills and freezes due in the same passes; a freeze ends before the next kill, so each kill
    # picks among the same peers with or without freezes. One generator for all faults made the
    # freezes' draws shift every later kill's.
    def kills(**more: float) -> list[str]:
        opts = SimulateOptions(peers=8, rounds=10, seed=3, kill_every=0.5, timeout_s=3.0, **more)
        events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)
        return [e["peer"] for e in events if e["kind"] == "kill"]

    alone, frozen_too = kills(), kills(freeze_every=0.5, freeze_for=0.1)
    n = min(len(alone), len(frozen_too))  # a slow pass may leave the last kill out of one run
    assert n >= 3 and alone[:n] == frozen_too[:n], (alone, frozen_too)


def test_a_killed_peer_restarts_only_once_its_old_process_ended(tmp_path, monkeypatch):
    # restart due 0.1 s after the kill; a killed stand-in ends a second later. Restarted earlier,
    # the new process could find the old one's locks held, and the old one's exit went unrecorded.
    opts = SimulateOptions(peers=3, rounds=10, kill_every=0.5, restart_after=0.1, timeout_s=2.5)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)
    restarts = [i for i, e in enumerate(events) if e["kind"] == "restart"]
    assert restarts, events
    for i in restarts:
        name = events[i]["peer"]
        killed = max(j for j in range(i) if events[j]["peer"] == name and events[j]["kind"] == "kill")
        assert any(e["peer"] == name and e["kind"] == "exit" for e in events[killed:i]), events
        assert events[i]["t"] - events[killed]["t"] >= 0.9, events


def test_kills_wait_for_restarted_peers_to_be_up_before_taking_more(tmp_path, monkeypatch):
    # --peers 4 --min-peers 2, a kill due every 0.3 s, restarts that never take the state: two
    # kills leave two peers up and the restarted two starting, and no kill comes after them
    opts = SimulateOptions(peers=4, rounds=10, kill_every=0.3, restart_after=0.1, timeout_s=3.0)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0, restarts_sync=False)
    kinds = [e["kind"] for e in events]
    assert kinds.count("kill") == 2 and kinds.count("kill-held-back") >= 3, events  # (counted, not silent)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)  # restarts up at once: kills go on
    assert [e["kind"] for e in events].count("kill") >= 3, events


def test_a_restarted_peer_is_not_handed_its_dead_process_address(tmp_path, monkeypatch):
    # the old process's address.txt (its port) would be read as the new one's until it writes its own
    opts = SimulateOptions(peers=3, rounds=10, kill_every=0.5, restart_after=0.1, timeout_s=2.5)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)
    assert any(e["kind"] == "restart" for e in events), events
    assert not any(e["kind"] == "stale-address" for e in events), events


@pytest.mark.parametrize(("opts", "said"), [
    ({"kill_every": 60, "timeout_s": 60}, ("--kill-every must be shorter than --timeout (60 s): with 60 s it would "
                                           "never kill one")),
    ({"freeze_every": 90, "timeout_s": 60}, "--freeze-every must be shorter than --timeout (60 s)"),
    ({"leave_every": 61, "timeout_s": 60}, "--leave-every must be shorter than --timeout (60 s)"),
    ({"kill_coordinator_at": 60, "timeout_s": 60}, ("--kill-coordinator-at must be before --timeout (60 s): with 60 s "
                                                    "it would never kill the coordinator")),
    ({"freeze_every": 10, "freeze_for": 0}, "--freeze-for must be more than 0 seconds, got 0"),
])
def test_faults_that_could_never_fire_are_refused(opts, said):
    from groundswell.peer.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(said)):
        SimulateOptions(peers=3, **opts)
    SimulateOptions(peers=3, kill_every=59, freeze_every=59, leave_every=59, kill_coordinator_at=59, timeout_s=60)


def test_a_control_character_in_an_option_is_one_line_not_a_traceback(tmp_path):
    from groundswell.peer.config import ConfigError
    from groundswell.peer.sim_options import check_manifest

    with pytest.raises(ConfigError, match=r"--preset must not hold control characters"):
        check_manifest(SimulateOptions(preset="a\x7fb"))
    res = CliRunner().invoke(app, ["simulate", "--codec", "fp\x7f32", "--out", str(tmp_path / "s")])
    assert res.exit_code != 0 and "--codec must not hold control characters" in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception


def test_the_run_ends_when_every_volunteer_is_gone_before_late_joiners_could_start(tmp_path, monkeypatch):
    opts = SimulateOptions(peers=2, rounds=10, late_joiners=2, timeout_s=20.0)
    events, wall = _fake_run(tmp_path, monkeypatch, opts, rounds_done=1, die_after=0.3)
    assert any(e["kind"] == "all-volunteers-gone" for e in events) and wall < 10, events


def test_a_process_that_ends_is_stamped_when_the_driver_first_sees_it_gone(tmp_path, monkeypatch):
    # peer-0 fails at 0.3 s; the run goes on until its timeout (2 s), then waits for the coordinator
    opts = SimulateOptions(peers=3, rounds=10, timeout_s=2.0)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0, die_after=0.3, dying=("peer-0",))
    ended = {e["kind"]: e["t"] for e in events if e["peer"] == "peer-0" and e["kind"] in ("exit", "crash")}
    assert set(ended) == {"exit", "crash"} and max(ended.values()) < 1.5, events  # (stamped at the end: >= 2 s)
    assert sum(e["kind"] == "exit" for e in events) == 1, events  # the others were running at the end


def test_a_run_the_timeout_stops_says_so(tmp_path, monkeypatch):
    opts = SimulateOptions(peers=3, rounds=10, timeout_s=1.0)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)
    assert [e["peer"] for e in events if e["kind"] == "timed-out"] == ["driver"], events
    assert sorted(e["peer"] for e in events if e["kind"] == "timeout") == ["peer-0", "peer-1", "peer-2"]
    # a run that ends by itself does not
    events, _ = _fake_run(tmp_path, monkeypatch, SimulateOptions(peers=2, rounds=10, late_joiners=2, timeout_s=20.0),
                          rounds_done=1, die_after=0.3)
    assert not any(e["kind"] in ("timed-out", "timeout") for e in events), events


def test_the_timeout_is_a_flag_and_the_summary_says_when_it_stopped_the_run(tmp_path, monkeypatch):
    from groundswell.peer import simulate

    seen = []

    def run(opts, out, progress):
        seen.append(opts.timeout_s)
        return dict(_BASE, rounds_completed=2, eval_loss_by_round=[5.0, 4.0], timed_out=True, hash_checked_rounds=2)

    monkeypatch.setattr(simulate, "run_simulation", run)
    res = CliRunner().invoke(app, ["simulate", "--peers", "2", "--rounds", "3", "--timeout", "60",
                                   "--out", str(tmp_path / "s")])
    said = " ".join(res.output.split())
    assert seen == [60.0] and res.exit_code == 1, res.output  # 2 of 3 rounds: failed, as before
    assert "stopped by the timeout: the run was still going after 60 s (--timeout)" in said, res.output
    assert "hashes agree: True (compared in 2 rounds)" in said, res.output


def test_no_volunteer_left_ends_the_run_unless_one_can_still_come():
    # every volunteer died before round 2: late joiners could never start, do not wait 1800 s
    assert nobody_left(done=1, late_started=False, any_alive=False, restart_pending=False)
    assert not nobody_left(done=2, late_started=False, any_alive=False, restart_pending=False)  # they start now
    assert not nobody_left(done=1, late_started=False, any_alive=False, restart_pending=True)
    assert not nobody_left(done=5, late_started=True, any_alive=True, restart_pending=False)


def test_a_restarted_peer_bootstraps_only_from_live_peers(tmp_path):
    for name in ("peer-0", "peer-1", "peer-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "address.txt").write_text(f"/ip4/127.0.0.1/tcp/1/p2p/{name}\n")
    assert live_addresses(tmp_path, lambda name: name != "peer-1") == [
        "/ip4/127.0.0.1/tcp/1/p2p/peer-0", "/ip4/127.0.0.1/tcp/1/p2p/peer-2"]


def test_a_process_that_cannot_start_leaves_no_open_log(tmp_path, monkeypatch):
    opened = []

    def recording_open(*args, **kwargs):
        opened.append(open(*args, **kwargs))  # noqa: SIM115 - the test checks spawn closes it
        return opened[-1]

    def no_popen(*args, **kwargs):
        raise OSError("no such interpreter")

    monkeypatch.setattr(sim_procs, "open", recording_open, raising=False)
    monkeypatch.setattr(sim_procs.subprocess, "Popen", no_popen)
    sim = Simulation(tmp_path, SimulateOptions())
    with pytest.raises(OSError, match="no such interpreter"):
        sim.spawn("peer-0", ["join"])
    assert len(opened) == 1 and opened[0].closed and "peer-0" not in sim.procs


def _write(out: Path, name: str, events: list[dict]) -> None:
    """Log the events as the peers do (`EventLog`: strict JSON, a non-finite loss by name)."""
    (out / name).mkdir(parents=True, exist_ok=True)
    log = EventLog(out / name / "events.jsonl")
    for e in events:
        fields = dict(e)
        log.write(fields.pop("kind"), **fields)  # the event's own "t" replaces the log's clock


def _write_old(out: Path, name: str, events: list[dict]) -> None:
    """Log the events as earlier versions did: bare NaN and Infinity, NaN also for "not evaluated"."""
    (out / name).mkdir(parents=True, exist_ok=True)
    with open(out / name / "events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def _round(t: float, r: int, peer: str, loss: float | None = None, sent_total: int | None = None) -> dict:
    e = {"t": t, "kind": "round", "round": r, "hash": f"h{r}", "contributors": ["P"], "included": True,
         "peer": peer, "bytes_sent": 10, "eval_loss": loss}
    return e if sent_total is None else dict(e, sent_total=sent_total)


@pytest.mark.parametrize("write", [_write, _write_old])
def test_a_diverged_loss_is_reported_as_such_and_the_report_is_strict_json(tmp_path, write):
    # The coordinator evaluates every round: 5.0, 4.0, then NaN and inf (diverged). The volunteer
    # evaluates none (not evaluated, not diverged: null, or NaN in an older log).
    write(tmp_path, "coordinator", [_round(1.0, 0, "C", 5.0), _round(2.0, 1, "C", 4.0),
                                    _round(3.0, 2, "C", math.nan), _round(4.0, 3, "C", math.inf)])
    write(tmp_path, "peer-0", [_round(1.0 + r, r, "P", None if write is _write else math.nan) for r in range(4)])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=4), [], wall_s=5.0, t0=0.0)
    assert report["final_eval_loss"] == 4.0 and report["final_eval_round"] == 1
    assert report["eval_nonfinite_rounds"] == [2, 3]
    assert report["eval_loss_by_round"] == [5.0, 4.0, None, None]
    assert json.loads(report_json(report))["eval_nonfinite_rounds"] == [2, 3]  # no Infinity in the file
    with pytest.raises(ValueError):
        report_json({"final_eval_loss": math.inf})


def test_a_diverged_volunteer_loss_counts_whatever_the_round(tmp_path):
    # A volunteer that evaluates (an [eval] volunteers run) and finds inf off the coordinator's
    # evaluation rounds: diverged all the same (the log names it; null would be "not evaluated").
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C", 3.5)])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P", math.inf), _round(2.0, 1, "P", 3.5)])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=2, eval_every=2), [], wall_s=3.0, t0=0.0)
    assert report["eval_nonfinite_rounds"] == [0] and report["eval_loss_by_round"] == [None, 3.5]


def test_the_final_loss_names_its_round_and_a_round_not_evaluated_is_not_diverged(tmp_path):
    # evaluated every 2 rounds: round 1 is, round 2 (the last) is not
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C"), _round(2.0, 1, "C", 3.5), _round(3.0, 2, "C")])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3, eval_every=2), [], wall_s=4.0, t0=0.0)
    assert report["rounds_completed"] == 3 and report["final_eval_round"] == 1
    assert report["final_eval_loss"] == 3.5 and report["eval_nonfinite_rounds"] == []


def test_the_coordinators_bytes_are_reported_across_its_restarts(tmp_path):
    # Killed after round 1 with 300 bytes sent (no total at exit), restarted, 120 sent by its exit:
    # 420 bytes over 3 rounds. The volunteers' figure leaves it out, as before.
    _write(tmp_path, "coordinator", [{"t": 0.0, "kind": "network", "peer": "C"}, _round(1.0, 0, "C", sent_total=100),
                                     _round(2.0, 1, "C", sent_total=300), {"t": 2.5, "kind": "network", "peer": "C"},
                                     _round(3.0, 2, "C", sent_total=50),
                                     {"t": 4.0, "kind": "defences", "rejected": {}, "peer": "C", "sent_total": 120}])
    _write(tmp_path, "peer-0", [_round(1.0 + r, r, "P", sent_total=30 * (r + 1)) for r in range(3)])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), [], wall_s=5.0, t0=0.0)
    assert report["coordinator_bytes_sent_per_round"] == 140.0
    assert report["bytes_sent_per_peer_per_round"] == 30.0


_BASE = {"rounds_completed": 3, "rounds_target": 3, "peers": 2, "codec": "sparseloco",
         "eval_loss_by_round": [5.0, 4.0, 3.0], "final_eval_round": 2, "eval_nonfinite_rounds": [],
         "bytes_sent_per_peer_per_round": 1e3, "dense_fp32_ring_bytes_per_peer_per_round": 1e6,
         "param_hash_agreement": True, "divergent_rounds": [], "wall_s": 10.0, "crashed": [], "events": []}


def test_the_summary_says_what_the_loss_is(tmp_path, monkeypatch):
    from groundswell.peer import simulate

    cases = [
        ({}, "held-out loss 5.000 -> 3.000; 1.0 kB"),
        # rounds completed, none evaluated: not "no round completed"
        ({"eval_loss_by_round": [None] * 3, "final_eval_round": None},
         "3/3 rounds, 2 peers, sparseloco: no held-out loss evaluated"),
        ({"eval_loss_by_round": [5.0, None, None], "final_eval_round": 0, "eval_nonfinite_rounds": [1, 2]},
         "held-out loss 5.000 at round 0 (the last completed: 2), diverged (not finite in 2 rounds from round 1)"),
        ({"eval_loss_by_round": [None] * 3, "final_eval_round": None, "eval_nonfinite_rounds": [0, 1, 2]},
         "sparseloco: held-out loss diverged (not finite in 3 rounds from round 0)"),
        ({"rounds_completed": 0, "eval_loss_by_round": [], "final_eval_round": None}, "no round completed"),
    ]
    for change, said in cases:
        report = dict(_BASE, **change)
        monkeypatch.setattr(simulate, "run_simulation", lambda opts, out, progress, r=report: r)
        res = CliRunner().invoke(app, ["simulate", "--peers", "2", "--rounds", "3", "--out", str(tmp_path / "s")])
        assert said in " ".join(res.output.split()), res.output
        assert ("no round completed" in res.output) == (report["rounds_completed"] == 0), res.output


def test_the_summary_reads_a_report_without_the_new_keys():
    from groundswell.peer.cli_simulate import loss_summary

    old = {k: v for k, v in _BASE.items() if k not in ("final_eval_round", "eval_nonfinite_rounds")}
    assert loss_summary(dict(old, eval_loss_by_round=[5.0, 4.0, None])) == \
        "held-out loss 5.000 -> 4.000 at round 1 (the last completed: 2)"


def test_closing_a_cluster_closes_every_node_though_one_fails():
    closed: list[int] = []

    class Node:
        def __init__(self, i: int) -> None:
            self.i = i

        def close(self) -> None:
            if self.i == 0:
                raise RuntimeError("p2pd would not stop")
            closed.append(self.i)

    cluster = object.__new__(Cluster)  # no real nodes: only what close() touches
    cluster.nodes = [Node(0), Node(1), Node(2)]
    cluster._thaws = []
    cluster._tmp = tempfile.TemporaryDirectory()
    with pytest.raises(RuntimeError, match="would not stop"):
        cluster.close()
    assert closed == [1, 2] and not Path(cluster._tmp.name).exists()


def test_leftover_processes_match_the_folder_not_a_sibling(tmp_path, monkeypatch):
    import psutil

    class P:
        def __init__(self, *cmdline: str) -> None:
            self.info = {"cmdline": list(cmdline)}

    out = tmp_path / "s"
    procs = [P("python", "-m", "groundswell.peer", "join", "--state-dir", f"{out}/peer-0"), P("p2pd", f"--out={out}"),
             P("python", "--state-dir", f"{out}2/peer-0"), P("python", f"{out}-old"), P("bash"), P()]
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter(procs))
    assert leftover_processes(out) == procs[:2]


def test_cuda_peers_start_the_first_volunteers_with_device_cuda(tmp_path, monkeypatch):
    # The GPU check: a simulate whose first K volunteers train and encode on CUDA.
    from groundswell.peer import simulate

    spawned: dict[str, list[str]] = {}
    real_spawn = _FakeSimulation.spawn

    def spawn(self, name, args, kind="spawn", prefix=()):
        spawned.setdefault(name, args)
        return real_spawn(self, name, args, kind, prefix)

    monkeypatch.setattr(_FakeSimulation, "spawn", spawn)
    monkeypatch.setattr(simulate, "check_device", lambda device, probe=True: None)  # as on a GPU machine
    _fake_run(tmp_path, monkeypatch, SimulateOptions(peers=3, rounds=2, cuda_peers=2, timeout_s=0.5), rounds_done=2)
    on_gpu = {name for name, args in spawned.items() if "--device" in args and args[args.index("--device") + 1] == "cuda"}
    assert on_gpu == {"peer-0", "peer-1"}


def test_cuda_peers_without_a_gpu_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    import torch
    from groundswell.peer.config import ConfigError
    from groundswell.peer.simulate import run_simulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--cuda-peers 1 needs a CUDA device"):
        run_simulation(SimulateOptions(peers=2, rounds=2, cuda_peers=1), tmp_path / "sim", progress=lambda m: None)
    assert not (tmp_path / "sim").exists()
    with pytest.raises(ConfigError, match="--cuda-peers must be between 0 and --peers"):
        SimulateOptions(peers=2, cuda_peers=3)


def test_a_score_that_is_not_finite_counts_as_dropped_in_the_report(tmp_path):
    # A leader's scoring gives NaN for a contribution that broke the probe loss: harmful, dropped.
    # The event log now writes it as "NaN", which the report compared with a float and crashed
    # (found by a review of that change).
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C", 5.0),
                                     {"t": 1.5, "kind": "scores", "round": 0, "threshold": 0.05,
                                      "scores": {"P": math.nan, "Q": 0.01, "R": math.inf}, "peer": "C"}])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P")])
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=1), [], wall_s=2.0, t0=0.0)
    assert report["dropped_by_scoring"] == {"R": 1, "peer-0": 1}


def test_a_faults_victim_depends_on_the_pool_only_when_its_peer_is_out_of_it():
    # Found by a review: a choice among the pool moved with every change of the pool, so a run
    # with freezes added killed other peers than the same seed without them (one kill took late-0
    # instead of peer-0 because peer-2 was frozen), against what the README said.
    from groundswell.peer.simulate import fault_pick

    roster = [f"peer-{i}" for i in range(6)] + ["late-0", "late-1"]
    for k in range(20):
        alone = fault_pick(3, "kill", k, roster, roster)
        others = [v for v in roster if v != alone]
        # another peer frozen or down: the same victim
        for missing in others:
            assert fault_pick(3, "kill", k, [v for v in roster if v != missing], roster) == alone
        # the victim itself out of the pool: another, and still one of the pool
        assert fault_pick(3, "kill", k, others, roster) in others
    assert len({fault_pick(3, "kill", k, roster, roster) for k in range(20)}) > 3  # (not one peer always)


def test_rounds_logged_after_the_timeout_are_not_in_the_report(tmp_path):
    # Found by a review: at the timeout the driver stops the coordinator, but volunteers still
    # running are ended only after the report is built; a run that timed out at round 1 of 3
    # could then report 3 rounds completed (and exit 0).
    _write(tmp_path, "coordinator", [_round(1.0, 0, "C", 5.0)])
    _write(tmp_path, "peer-0", [_round(1.0, 0, "P"), _round(7.0, 1, "P"), _round(9.0, 2, "P")])
    timed_out = [{"t": 5.0, "kind": "timed-out", "peer": "driver"}]
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), timed_out, wall_s=10.0, t0=0.0)
    assert report["timed_out"] and report["rounds_completed"] == 1
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), [], wall_s=10.0, t0=0.0)
    assert report["rounds_completed"] == 3
    # and so with Ctrl+C: the report holds the run until it was pressed
    interrupted = [{"t": 8.0, "kind": "interrupted", "peer": "driver"}]
    report = build_report(tmp_path, SimulateOptions(peers=1, rounds=3), interrupted, wall_s=10.0, t0=0.0)
    assert report["interrupted"] and not report["timed_out"] and report["rounds_completed"] == 2


def test_faults_start_after_round_0_and_stop_before_the_last_round_is_under_way():
    # A review found a coordinator killed while the last round was under way: its restart came
    # after the run ended, and the run had no final held-out loss. As the help says: never then.
    assert not faults_due(done=-1, rounds=5)  # round 0 not applied yet
    assert faults_due(done=0, rounds=5) and faults_due(done=2, rounds=5)
    assert not faults_due(done=3, rounds=5)  # round 4, the last, is under way
    assert not faults_due(done=4, rounds=5)


def test_each_volunteer_walks_the_same_data_order_in_every_run_of_a_seed(tmp_path, monkeypatch):
    # Found by a review: a volunteer's data order came from its peer id, fresh and random in each
    # simulation, so one peer's fault-free run gave another loss with the same --seed.
    seen: list[tuple[str, str]] = []
    real = _FakeSimulation.spawn

    def spawn(self, name, args, kind="spawn", prefix=()):
        if name != "coordinator":
            seen.append((name, args[args.index("--data-seed") + 1]))
        return real(self, name, args, kind, prefix)

    monkeypatch.setattr(_FakeSimulation, "spawn", spawn)

    def orders(seed: int) -> dict[str, str]:
        seen.clear()
        _fake_run(tmp_path, monkeypatch, SimulateOptions(peers=3, rounds=3, seed=seed, timeout_s=0.5), rounds_done=3)
        return dict(seen)

    first = orders(5)
    assert sorted(first) == ["peer-0", "peer-1", "peer-2"] and len(set(first.values())) == 3
    assert orders(5) == first
    assert set(orders(6).values()).isdisjoint(first.values())


def test_a_simulation_that_cannot_fit_in_memory_is_refused_before_anything_starts(tmp_path):
    from groundswell.peer.simulate import PROCESS_FLOOR_BYTES, check_memory

    check_memory(5, available=5 * PROCESS_FLOOR_BYTES)
    with pytest.raises(ConfigError, match=r"100001 processes need at least .* GiB is available: fewer --peers"):
        check_memory(100_001, available=24 << 30)
    res = CliRunner().invoke(app, ["simulate", "--peers", "100000", "--out", str(tmp_path / "sim")])
    assert res.exit_code == 2 and "Traceback" not in res.output and "fewer --peers" in res.output, res.output
    assert not (tmp_path / "sim").exists()


def test_a_second_simulation_into_a_running_ones_folder_is_refused(tmp_path):
    # Found by a review: the second one's clearing deleted the running one's files, which stalled
    import subprocess
    import sys

    out = tmp_path / "sim"
    holder = subprocess.Popen([sys.executable, "-c", ("import sys, time; from pathlib import Path; "
                               "from groundswell.peer.simulate import hold_output; hold_output(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(60)"), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = CliRunner().invoke(app, ["simulate", "--peers", "2", "--rounds", "1", "--out", str(out)])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert f"in use by another groundswell process (pid {holder.pid})" in " ".join(res.output.split()), res.output
        assert "its own --out" in " ".join(res.output.split())
    finally:
        holder.kill()
        holder.wait()


def test_ctrl_c_while_the_coordinator_saves_its_checkpoint_still_writes_the_report(tmp_path, monkeypatch):
    # Found by a review: one Ctrl+C (or an outer `timeout`'s SIGTERM) in the wait for the stopping
    # coordinator, after the run's own --timeout, ended `simulate` with no report.json at all
    pressed = []
    wait_one = _Ending.wait

    def pressed_while_waiting(self, timeout=None):
        if not pressed:  # once: the kills on the way out wait too
            pressed.append(timeout)
            raise KeyboardInterrupt
        return wait_one(self, timeout)

    monkeypatch.setattr(_Ending, "wait", pressed_while_waiting)
    opts = SimulateOptions(peers=2, rounds=10, timeout_s=1.0)
    try:
        events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=0)
    except KeyboardInterrupt:
        pytest.fail("Ctrl+C in the coordinator's wait went through run_simulation, with no report written")
    kinds = [e["kind"] for e in events if e["peer"] == "driver"]
    # the wait skipped, as offered: the timeout stopped the run, Ctrl+C did not
    assert kinds[-2:] == ["timed-out", "stop-wait-skipped"] and pressed == [60], events
    assert (tmp_path / "sim" / "report.json").exists()


def test_ctrl_c_at_the_final_stopping_wait_is_no_interruption_of_a_finished_run(tmp_path, monkeypatch):
    # Found by a review: every round done, Ctrl+C skipping the wait for the coordinator's checkpoint
    # (as the line offers) made the run `interrupted`: the CLI exited 130 before any check, a run
    # with divergent rounds or a crashed peer included.
    pressed = []
    wait_one = _Ending.wait

    def pressed_while_waiting(self, timeout=None):
        if not pressed:
            pressed.append(timeout)
            raise KeyboardInterrupt
        return wait_one(self, timeout)

    monkeypatch.setattr(_Ending, "wait", pressed_while_waiting)
    opts = SimulateOptions(peers=2, rounds=3, timeout_s=30.0)
    events, _ = _fake_run(tmp_path, monkeypatch, opts, rounds_done=2, die_after=0.3)
    kinds = [e["kind"] for e in events if e["peer"] == "driver"]
    assert pressed == [60] and "stop-wait-skipped" in kinds, events
    assert not any(e["kind"] in ("interrupted", "timed-out", "timeout") for e in events), events


def test_an_interrupted_run_that_failed_a_check_exits_1(tmp_path, monkeypatch):
    # The checks come first: what the run did before Ctrl+C failed (exit 1); fewer rounds than asked
    # for fails only where the timeout, not Ctrl+C, cut the run short.
    from groundswell.peer import simulate

    interrupted = dict(_BASE, rounds_completed=2, eval_loss_by_round=[5.0, 4.0], interrupted=True, wall_s=12.0)
    cases = [({"divergent_rounds": [1], "param_hash_agreement": False}, "parameter hashes differ in rounds [1]"),
             ({"crashed": ["peer-1"]}, "peer-1 exited with an error"),
             ({"unhashed": [{"round": 1, "peer": "peer-0"}]}, "no parameter hash logged by peer-0 in round 1"),
             ({"timed_out": True}, "only 2 of 3 rounds completed")]
    for change, said in cases:
        monkeypatch.setattr(simulate, "run_simulation", lambda opts, out, progress, r=dict(interrupted, **change): r)
        res = CliRunner().invoke(app, ["simulate", "--peers", "2", "--rounds", "3", "--out", str(tmp_path / "s")])
        text = " ".join(res.output.split())
        assert res.exit_code == 1 and f"simulation failed: {said}" in text, res.output
        assert "interrupted after 12 s" in text, res.output


def test_ctrl_c_writes_the_report_of_the_run_so_far_without_waiting_for_the_coordinator(tmp_path, monkeypatch):
    # Found by a review: Ctrl+C ended `simulate` with no report.json at all, after minutes of a run.
    calls = []

    def rounds_done(out, seen=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return 1

    told = []
    signal_one = _FakeSimulation.signal
    monkeypatch.setattr(_FakeSimulation, "signal", lambda self, name, sig: (told.append((name, sig)),
                                                                            signal_one(self, name, sig)))
    opts = SimulateOptions(peers=3, rounds=10, timeout_s=30.0)
    try:
        events, wall = _fake_run(tmp_path, monkeypatch, opts, rounds_done=rounds_done)
    except KeyboardInterrupt:  # (raised on: pytest itself would stop on it)
        pytest.fail("Ctrl+C went through run_simulation, with no report written")
    assert ("coordinator", signal.SIGINT) not in told, told  # not asked to stop and waited for (up to 60 s)
    assert next(e["peer"] for e in events if e["kind"] == "interrupted") == "driver", events
    assert sorted(e["peer"] for e in events if e["kind"] == "interrupted")[1:] == ["peer-0", "peer-1", "peer-2"]
    assert not any(e["kind"] in ("timed-out", "timeout") for e in events), events
    assert wall < 10
    assert (tmp_path / "sim" / "report.json").exists()


def test_ctrl_c_while_the_coordinator_starts_still_writes_the_report(tmp_path, monkeypatch):
    # Found by a review: Ctrl+C (or SIGTERM) in the first seconds, while the coordinator started,
    # ended `simulate` with no report.json (and the folder's old one already cleared)
    from groundswell.peer import simulate

    def pressed(out, sim, end):
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate, "_wait_for_coordinator", pressed)
    try:
        events, _ = _fake_run(tmp_path, monkeypatch, SimulateOptions(peers=2, rounds=5, timeout_s=30.0), rounds_done=0)
    except KeyboardInterrupt:
        pytest.fail("Ctrl+C while the coordinator started went through run_simulation, with no report written")
    assert [e["peer"] for e in events if e["kind"] == "interrupted"] == ["driver"], events
    assert not any(e["kind"] == "spawn" and e["peer"] != "coordinator" for e in events), events
    assert (tmp_path / "sim" / "report.json").exists()


def test_a_timeout_before_the_coordinator_is_up_is_a_timed_out_run(tmp_path, monkeypatch):
    from groundswell.peer import simulate

    class Starting:  # a coordinator still starting: alive, no bootstrap line yet
        def alive(self, name):
            return True

    (tmp_path / "coordinator").mkdir()
    t = time.time()
    assert simulate._wait_for_coordinator(tmp_path, Starting(), end=t + 0.5) == ""  # by --timeout, not 120 s
    assert time.time() - t < 5
    (tmp_path / "coordinator" / "bootstrap.txt").write_text("gs1:C@/ip4/127.0.0.1/tcp/1/p2p/C\n")
    assert simulate._wait_for_coordinator(tmp_path, Starting(), end=t) == "gs1:C@/ip4/127.0.0.1/tcp/1/p2p/C"
    monkeypatch.setattr(simulate, "_wait_for_coordinator", lambda out, sim, end: "")
    (tmp_path / "run").mkdir()
    events, _ = _fake_run(tmp_path / "run", monkeypatch, SimulateOptions(peers=2, rounds=5, timeout_s=1.0),
                          rounds_done=0)
    assert [e["peer"] for e in events if e["kind"] == "timed-out"] == ["driver"], events
    assert not any(e["kind"] == "spawn" and e["peer"] != "coordinator" for e in events), events


def test_ctrl_c_while_the_report_of_a_finished_run_is_built_still_writes_it(tmp_path, monkeypatch):
    # (a review: a first Ctrl+C there, with a big model to count, lost the report of a whole run)
    from groundswell.peer import simulate

    built = []

    def build(out, opts, events, wall, t0, rss):
        built.append(1)
        if len(built) == 1:
            raise KeyboardInterrupt
        return {"events": events}

    opts = SimulateOptions(peers=2, rounds=3, timeout_s=30.0)
    _fake_run(tmp_path, monkeypatch, opts, rounds_done=2, die_after=0.3)  # (installs its stand-ins)
    monkeypatch.setattr(simulate, "build_report", build)
    try:
        simulate.run_simulation(opts, tmp_path / "sim", progress=lambda m: None)
    except KeyboardInterrupt:
        pytest.fail("a first Ctrl+C while the report was built went through run_simulation")
    assert built == [1, 1] and (tmp_path / "sim" / "report.json").exists()


def test_an_interrupted_run_says_so_and_exits_130(tmp_path, monkeypatch):
    from groundswell.peer import simulate

    monkeypatch.setattr(simulate, "run_simulation", lambda opts, out, progress: dict(
        _BASE, rounds_completed=2, eval_loss_by_round=[5.0, 4.0], interrupted=True, hash_checked_rounds=2, wall_s=12.0))
    res = CliRunner().invoke(app, ["simulate", "--peers", "2", "--rounds", "3", "--out", str(tmp_path / "s")])
    said = " ".join(res.output.split())
    assert res.exit_code == 130, res.output
    assert "interrupted after 12 s:" in said and "covers the run until then" in said, res.output
    assert "simulation failed" not in said, res.output
