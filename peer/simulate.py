"""`groundswell simulate`: a coordinator and N volunteer processes on 127.0.0.1 (real p2pd, real
streams), a run of R rounds, and `report.json` built from every process's event log.

Each process is started in its own session so that the whole tree (including its p2pd) can be
killed; `Simulation` is a context manager that kills everything it started, whatever happens.
Faults (kill, freeze, late joiners) are scheduled events of the same loop: see `Fault`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .manifest import RunManifest


@dataclass
class SimulateOptions:
    """What to simulate."""

    peers: int = 4
    rounds: int = 10
    preset: str = "tiny"
    algorithm: str = "sparseloco"
    codec: str = ""
    inner_steps: int = 20
    batch_size: int = 8
    deadline_s: float = 30.0
    slack_s: float = 5.0
    min_peers: int = 2
    seed: int = 0
    outer_lr: float = 0.0
    checkpoint_every: int = 5
    timeout_s: float = 1800.0


def manifest_toml(opts: SimulateOptions) -> str:
    """The run manifest a simulation launches."""
    codec = f'codec = "{opts.codec}"\n' if opts.codec else ""
    lr = f"lr = {opts.outer_lr}\n" if opts.outer_lr else ""
    return (
        f'[run]\nid = "sim"\nopen = true\nmin_peers = {opts.min_peers}\nseed = {opts.seed}\n'
        f'[model]\nspec = "{opts.preset}"\n[data]\nbatch_size = {opts.batch_size}\n'
        f"[inner]\nwarmup_steps = {min(50, opts.inner_steps * 2)}\n"
        f'[outer]\nalgorithm = "{opts.algorithm}"\ninner_steps = {opts.inner_steps}\n{codec}{lr}'
        f"[round]\ndeadline_s = {opts.deadline_s}\nslack_s = {opts.slack_s}\nmax_shards = 16\n"
        f"[checkpoint]\nevery_rounds = {opts.checkpoint_every}\nkeep = 2\n[eval]\nbatches = 4\nbatch_size = 16\nevery_rounds = 1\n"
    )


@dataclass
class Proc:
    """One simulated process."""

    name: str
    args: list[str]
    state_dir: Path
    popen: subprocess.Popen | None = None
    log: object = None


@dataclass
class Simulation:
    """Owns every process of a simulation; kills them all on exit."""

    out: Path
    opts: SimulateOptions
    events: list[dict] = field(default_factory=list)
    procs: dict[str, Proc] = field(default_factory=dict)
    t0: float = field(default_factory=time.time)

    def __enter__(self) -> "Simulation":
        self.out.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            self._kill(proc)

    def event(self, kind: str, peer: str) -> None:
        """Record a driver-side event (spawn, exit, fault)."""
        self.events.append({"t": round(time.time() - self.t0, 3), "kind": kind, "peer": peer})

    def spawn(self, name: str, args: list[str]) -> Proc:
        """Start `groundswell ARGS` as its own process group, logging to OUT/NAME.log."""
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        proc = Proc(name, args, self.out / name)
        proc.log = open(self.out / f"{name}.log", "ab")
        proc.popen = subprocess.Popen([sys.executable, "-m", "groundswell.peer", *args], stdout=proc.log,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = proc
        self.event("spawn", name)
        return proc

    def _kill(self, proc: Proc) -> None:
        if proc.popen is not None and proc.popen.poll() is None:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.popen.wait(timeout=30)
        if proc.log is not None:
            proc.log.close()  # type: ignore[attr-defined]
            proc.log = None

    def signal(self, name: str, sig: int) -> None:
        """Send a signal to a process's whole group (the peer and its p2pd)."""
        proc = self.procs[name]
        if proc.popen is not None and proc.popen.poll() is None:
            os.killpg(proc.popen.pid, sig)


def run_simulation(opts: SimulateOptions, out: Path, progress: Callable[[str], None] = print) -> dict:
    """Run a coordinator and `opts.peers` volunteers for `opts.rounds` rounds; write report.json."""
    start = time.time()
    with Simulation(out, opts) as sim:
        (out / "run.toml").write_text(manifest_toml(opts))
        common = ["--listen", "/ip4/127.0.0.1/tcp/0", "--quiet", "--threads", "1"]
        sim.spawn("coordinator", ["launch", str(out / "run.toml"), "--state-dir", str(out / "coordinator"), *common])
        boot_file = out / "coordinator" / "bootstrap.txt"
        deadline = time.time() + 120
        while not boot_file.exists():
            if time.time() > deadline or sim.procs["coordinator"].popen.poll() is not None:  # type: ignore[union-attr]
                raise RuntimeError(f"the coordinator did not start; see {out / 'coordinator.log'}")
            time.sleep(0.2)
        boot = boot_file.read_text().strip()
        progress(f"coordinator up: {boot[:60]}...")
        for i in range(opts.peers):
            sim.spawn(f"peer-{i}", ["join", boot, "--state-dir", str(out / f"peer-{i}"), "--max-rounds",
                                    str(opts.rounds), *common])
        volunteers = [f"peer-{i}" for i in range(opts.peers)]
        end = time.time() + opts.timeout_s
        while time.time() < end:
            alive = [v for v in volunteers if sim.procs[v].popen.poll() is None]  # type: ignore[union-attr]
            if not alive:
                break
            time.sleep(0.5)
        for v in volunteers:
            code = sim.procs[v].popen.poll()  # type: ignore[union-attr]
            sim.event("exit" if code is not None else "timeout", v)
        sim.signal("coordinator", signal.SIGINT)
        try:
            sim.procs["coordinator"].popen.wait(timeout=60)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            pass
        report = build_report(out, opts, sim.events, time.time() - start, t0=sim.t0)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill; the rest of the log still counts
    return out


def build_report(out: Path, opts: SimulateOptions, driver_events: list[dict], wall_s: float,
                 t0: float | None = None) -> dict:
    """report.json from the processes' event logs and the driver's own events."""
    from .workload import build_workload

    params = sum(p.numel() for p in build_workload(opts.preset, 256, opts.seed).model.parameters())
    coord = [e for e in _read_events(out / "coordinator" / "events.jsonl") if e["kind"] == "round"]
    peer_logs = {d.name: _read_events(d / "events.jsonl") for d in sorted(out.glob("peer-*")) if d.is_dir()}
    hashes: dict[int, set[str]] = {}
    for e in coord + [e for evs in peer_logs.values() for e in evs if e["kind"] == "round"]:
        hashes.setdefault(e["round"], set()).add(e["hash"])
    divergent = sorted(r for r, h in hashes.items() if len(h) > 1)
    sent = [e["bytes_sent"] for evs in peer_logs.values() for e in evs if e["kind"] == "round"]
    if t0 is None:
        t0 = min([e["t"] for evs in peer_logs.values() for e in evs] + [e["t"] for e in coord], default=0.0)
    syncs = [e["t"] for evs in peer_logs.values() for e in evs if e["kind"] == "sync"]
    times = ([min(syncs)] if syncs else []) + [e["t"] for e in coord]
    events = list(driver_events)
    for name, evs in peer_logs.items():
        events += [{"t": round(e["t"] - t0, 3), "kind": e["kind"], "peer": name}
                   for e in evs if e["kind"] not in ("round",)]
    n = opts.peers
    algo_codec = opts.codec or ("sparseloco" if opts.algorithm == "sparseloco" else "fp32")
    return {
        "peers": n,
        "rounds_target": opts.rounds,
        "rounds_completed": len({e["round"] for e in coord}),
        "codec": algo_codec,
        "algorithm": opts.algorithm,
        "params": params,
        "final_eval_loss": coord[-1]["eval_loss"] if coord else None,
        "eval_loss_by_round": [e["eval_loss"] for e in coord],
        "bytes_sent_per_peer_per_round": sum(sent) / len(sent) if sent else 0.0,
        "dense_fp32_ring_bytes_per_peer_per_round": 2 * (n - 1) / n * 4 * params,
        "param_hash_agreement": bool(hashes) and not divergent,
        "divergent_rounds": divergent,
        "round_times_s": [round(b - a, 3) for a, b in zip(times, times[1:])],
        "wall_s": round(wall_s, 2),
        "events": sorted(events, key=lambda e: e["t"]),
    }
