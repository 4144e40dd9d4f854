"""`groundswell simulate`: a coordinator and N volunteer processes on 127.0.0.1 (real p2pd, real
streams), a run of R rounds, and `report.json` built from every process's event log.

Each process is started in its own session so that the whole tree (including its p2pd) can be
killed; `Simulation` (sim_procs.py) is a context manager that kills everything it started, whatever happens.
Faults (kill, freeze, late joiners) are scheduled events of the same loop: see `Fault`.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

from .config import ConfigError, check_device
from .sim_options import LATE_JOIN_ROUND, SimulateOptions, check_manifest, manifest_toml
from .sim_procs import Simulation, complete_lines
from .sim_report import build_report, report_json
from .state_files import remove_half_written
from .workload import check_workload_spec


def fault_victims(live: Sequence[str], frozen: Collection[str], going: Collection[str], min_peers: int,
                  synced: Collection[str] | None = None) -> list[str]:
    """The volunteers a fault may pick: running, not frozen, not already told to end (killed but
    not reaped yet, or leaving); none unless more than `min_peers` of them have also taken the
    run's state since they started (`synced`; None: all have), so that no fault, nor several in
    one pass of the driver, leaves fewer than `min_peers` able to make a round. (A process still
    starting was counted as able: with kills every 5 s and start-ups of 6, a CI run's round 2
    waited 98 s for two peers up at once.)"""
    pool = [v for v in live if v not in frozen and v not in going]
    able = [v for v in pool if synced is None or v in synced]
    return pool if len(able) > min_peers else []


def fault_pick(seed: int, kind: str, k: int, pool: Sequence[str], roster: Sequence[str]) -> str:
    """The victim of the `k`-th fault of `kind` (counted whether or not it fired): the first peer
    of `pool` in an order of the whole `roster` (every volunteer the run can have) drawn for that
    fault alone. Another kind of fault, or a pass with too few peers to pick from, changes whom
    a fault takes only when the peer it would take is frozen, down or gone then (a choice among
    the pool, as before, moved with every change of the pool)."""
    order = random.Random(f"{seed}:{kind}:{k}").sample(list(roster), len(roster))
    return next(v for v in order if v in pool)


def sim_data_seed(seed: int, name: str) -> int:
    """A simulated volunteer's data order seed, from the simulation's seed and the peer's name."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"sim-data:{seed}:{name}".encode()).digest()[:8], "big") >> 1


PROCESS_FLOOR_BYTES = 560 << 20  # each simulated process with a `tiny` model (a review measured 538 MB RSS)


def check_memory(processes: int, available: int | None = None) -> None:
    """Refuse a simulation whose processes cannot all fit in the memory this machine has free
    (`--peers 100000` started volunteers until a review stopped it)."""
    if available is None:
        try:
            with open("/proc/meminfo") as f:
                available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return  # not Linux, or not said: nothing to check against
    needed = processes * PROCESS_FLOOR_BYTES
    if needed > available:
        raise ConfigError(f"{processes} processes need at least {needed / 2**30:.1f} GiB ({PROCESS_FLOOR_BYTES >> 20} MiB "
                          f"each), and {available / 2**30:.1f} GiB is available: fewer --peers "
                          "or --late-joiners")


def faults_due(done: int, rounds: int) -> bool:
    """May faults (kills, freezes, leaves, late joins, the coordinator's kill) happen now? From
    once round 0 is applied (`done`: the newest round applied) until the last round is under way:
    a fault in the last round would leave it, and the coordinator's final evaluation, to chance."""
    return 0 <= done and done + 2 < rounds


def nobody_left(done: int, late_started: bool, any_alive: bool, restart_pending: bool) -> bool:
    """No volunteer runs and none can come: no restart is due, and late joiners are not about to
    start (were they yet to, they never could: only volunteers make round LATE_JOIN_ROUND happen)."""
    late_due = not late_started and done >= LATE_JOIN_ROUND
    return not any_alive and not restart_pending and not late_due


def live_addresses(out: Path, up: Callable[[str], bool]) -> list[str]:
    """The first address of each process in `out` that `up` says runs: a dead peer's address.txt
    stays behind, and a restarted peer given only those could not join while the coordinator is down."""
    return _addresses(path for path in sorted(out.glob("*/address.txt")) if up(path.parent.name))


def _addresses(files: Iterable[Path]) -> list[str]:
    """The first address in each peer's address.txt (one being written, or empty, is skipped)."""
    out = []
    for path in files:
        with contextlib.suppress(OSError):
            if lines := path.read_text().split():
                out.append(lines[0])
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rounds_done(out: Path, seen: dict[Path, tuple[int, int]] | None = None) -> int:
    """The newest round any process has applied (-1: none yet). `seen` (path -> bytes read, best
    round there) lets a caller polling in a loop read only what each log gained since."""
    seen = {} if seen is None else seen
    for path in out.glob("*/events.jsonl"):
        done, best = seen.get(path, (0, -1))
        complete, done = complete_lines(path, done)
        for line in complete.splitlines():
            if b'"kind": "round"' in line or b'"kind": "follow"' in line:  # applied, or caught up on
                try:
                    best = max(best, json.loads(line)["round"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
        seen[path] = (done, best)
    return max((best for _, best in seen.values()), default=-1)


class SimulationError(RuntimeError):
    """A simulation could not run (a process did not start): a message for the user."""


# What a simulation writes in its --out folder (see `run_simulation` and `Simulation.spawn`),
# starting with the marker that says a simulation made the folder.
MARKER = ".groundswell-simulation"
_OUTPUT = re.compile(r"(coordinator|(peer|late)-\d+)(\.log)?|report\.json|loss\.png|run\.toml|\.groundswell-simulation")


def hold_output(out: Path) -> None:
    """One simulation per output folder, for this process's lifetime: a second one's clearing
    deleted the first's files under it, and the first stalled (found by a review)."""
    import hashlib

    from .locks import hold_exclusively, private_lock_path

    name = "simulation-" + hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:24]
    hold_exclusively(private_lock_path(name), "output folder", out, "give this one its own --out")


def clear_output(out: Path) -> None:
    """Make `out` ready for a new simulation and mark it as one's: an earlier simulation's files
    are removed (its processes would read the old bootstrap address, and its event logs would
    mix into the new report). A folder that is not empty is emptied only if an earlier simulation
    marked it and holds nothing a simulation does not write: a real coordinator's state folder
    (its identity key, its checkpoints) is never taken for a simulated one."""
    if out.exists() and not out.is_dir():
        raise SimulationError(f"--out {out} is a file, not a folder")
    entries = sorted(out.iterdir()) if out.exists() else []
    foreign = [e.name for e in entries if not _OUTPUT.fullmatch(e.name)]
    if entries and (foreign or not (out / MARKER).is_file()):
        what = f"files a simulation does not write ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})" \
            if foreign else "files, but no mark of an earlier simulation"
        raise SimulationError(f"--out {out} holds {what}: choose an empty or new folder")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    parent = out.absolute().parent
    if not out.exists() and not parent.exists() and not any(p.exists() and not p.is_dir() for p in parent.parents):
        # one folder is made, not a whole mistyped path (as join's and launch's --state-dir)
        raise SimulationError(f"--out {out}: {parent} does not exist (a typo?): create it first")
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:  # a file above it, no permission, a read-only disk: said naming the flag
        above = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        why = f"{above} is a file, not a folder" if above is not None else exc.strerror or str(exc)
        raise SimulationError(f"--out {out} cannot be created: {why}") from None
    (out / MARKER).write_text("made by groundswell simulate; it empties this folder when run into it again\n")


def tidy_output(out: Path) -> None:
    """Remove the half-written files that processes killed mid-write (a fault, the timeout) left in
    their state dirs: a restart would have removed its own, but none comes after the run."""
    for entry in out.iterdir():
        if entry.is_dir() and not entry.is_symlink() and _OUTPUT.fullmatch(entry.name):
            remove_half_written(entry)


def _wait_for_coordinator(out: Path, sim: Simulation, end: float) -> str:
    """The coordinator's bootstrap line once it has written it; "" if the run's --timeout (`end`)
    came first; SimulationError if it ended, or is not up after 120 s."""
    boot_file = out / "coordinator" / "bootstrap.txt"
    wait_until = time.time() + 120
    while not boot_file.exists():
        if time.time() > end:
            return ""
        if time.time() > wait_until or not sim.alive("coordinator"):
            raise SimulationError(f"the coordinator did not start{_first_error(out / 'coordinator.log')}; "
                                  f"see {out / 'coordinator.log'}")
        time.sleep(0.2)
    return boot_file.read_text().strip()


def _first_error(log_path: Path) -> str:
    """": <the first `error:` line of a process's log>", or "" if it has none."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for i, line in enumerate(lines):
        if line.startswith("error:"):  # rich wraps long lines: take the continuation too
            tail = [line[len("error:"):].strip()]
            for more in lines[i + 1:i + 4]:
                if not more.strip() or more.startswith(("error:", "20")):
                    break
                tail.append(more.strip())
            return ": " + " ".join(tail)
    return ""


def run_simulation(opts: SimulateOptions, out: Path, progress: Callable[[str], None] = print) -> dict:
    """Run a coordinator and volunteers (with the scheduled faults) until round `opts.rounds`."""
    # A bad option is one ConfigError (or WorkloadError) line here, before any process starts.
    check_manifest(opts)
    if opts.cuda_peers:  # its volunteers would each fail alike once started
        try:
            check_device("cuda", probe=False)  # (each CUDA peer probes its own)
        except ConfigError:
            raise ConfigError(f"--cuda-peers {opts.cuda_peers} needs a CUDA device, and torch sees none") from None
    check_workload_spec(opts.preset)
    check_memory(opts.peers + opts.late_joiners + 1)
    hold_output(out)
    clear_output(out)
    start = time.time()
    with Simulation(out, opts) as sim:
        (out / "run.toml").write_text(manifest_toml(opts))
        common = ["--quiet", "--verbose", "--threads", "1"]  # protocol log in NAME.log, for post-mortems
        coord_listen = f"/ip4/127.0.0.1/tcp/{_free_port()}"  # fixed, so a restarted coordinator is found again
        coord_args = ["launch", str(out / "run.toml"), "--state-dir", str(out / "coordinator"), "--listen",
                      coord_listen, "--checkpoint-every", str(opts.coordinator_checkpoint_every), *common]
        boot = ""  # the coordinator's line, once it is up (read in the try below)

        def up(name: str) -> bool:  # running, and not told to end: a peer to bootstrap from
            return sim.alive(name) and not sim.going(name)

        def join_args(name: str) -> list[str]:
            # Bootstrap from the coordinator and from any volunteer already up: any live peer will do.
            extra = live_addresses(out, up)
            head, _, maddrs = boot.partition("@")
            line = f"{head}@{','.join(dict.fromkeys([*maddrs.split(','), *extra[:3]]))}"
            attack = ["--attack", opts.attack] if name in opts.byzantine_peers() else []
            if name in [f"peer-{i}" for i in range(opts.cuda_peers)]:
                attack += ["--device", "cuda"]
            if ":" in opts.preset:  # the researcher named the model code: the volunteers may run it
                attack.append("--allow-model-code")
            # Each volunteer's data order from the seed and its name, not its (fresh, random) peer
            # id: the same --seed then replays the same batches (a review saw one peer's run differ).
            order = ["--data-seed", str(sim_data_seed(opts.seed, name))]
            return ["join", line, "--state-dir", str(out / name), "--until-round", str(opts.rounds),
                    "--listen", "/ip4/127.0.0.1/tcp/0", *order, *attack, *common]

        volunteers = [f"peer-{i}" for i in range(opts.peers)]
        roster = [*volunteers, *(f"late-{i}" for i in range(opts.late_joiners))]  # (fault_pick's order)
        frozen: dict[str, float] = {}  # name -> thaw time
        pending: list[tuple[float, str, str]] = []  # (time, action, name)
        next_kill = opts.kill_every or float("inf")
        next_freeze = opts.freeze_every or float("inf")
        next_leave = opts.leave_every or float("inf")
        next_crash = opts.crash_daemon_every or float("inf")
        late_done = opts.late_joiners == 0
        coord_killed = opts.kill_coordinator_at <= 0
        end = start + opts.timeout_s  # (from the start: the coordinator's own start-up counts too)
        last_sample = 0.0
        finished_at, stragglers_told = 0.0, False
        seen: dict[Path, tuple[int, int]] = {}

        def victims() -> list[str]:
            live = [v for v in volunteers if sim.alive(v)]
            return fault_victims(live, frozen, {v for v in live if sim.going(v)}, opts.min_peers,
                                 {v for v in live if sim.synced(v)})

        drawn = {"kill": 0, "freeze": 0, "leave": 0, "daemon-crash": 0}  # faults of each kind due so far

        def pick(kind: str, coordinator: bool = False) -> str | None:
            k, drawn[kind] = drawn[kind], drawn[kind] + 1  # counted though none fires: see `fault_pick`
            pool = victims() + ["coordinator"] * (coordinator and up("coordinator"))
            if not pool:  # too few peers up: report.json's `faults_held_back` counts these
                sim.event(f"{kind}-held-back", "driver")
                return None
            return fault_pick(opts.seed, kind, k, pool, [*roster, "coordinator"] if coordinator else roster)

        def note_ended(names: Sequence[str], exits: bool = True) -> None:
            for name in names:  # stamped when first seen gone, not when the run ends
                if (code := sim.note_end(name, exit_event=exits and name != "coordinator")) is not None:
                    progress(f"{name} exited with status {code}; see {out / (name + '.log')}")

        interrupted = False
        try:  # (from the coordinator's start: a Ctrl+C while it starts still gets a report)
            sim.spawn("coordinator", coord_args)
            boot = _wait_for_coordinator(out, sim, end)  # "": not up by --timeout (a timed-out run)
            if boot:
                progress(f"coordinator up: {boot[:60]}...")
                for name in volunteers:
                    sim.spawn(name, join_args(name))
            while boot and time.time() < end:
                now = time.time() - sim.t0
                note_ended(["coordinator", *volunteers])
                if now - last_sample > 1.0:
                    sim.sample_rss()
                    last_sample = now
                done = _rounds_done(out, seen)
                if done + 1 >= opts.rounds and not any(sim.alive(v) for v in volunteers):
                    break
                late_over = late_done or not faults_due(done, opts.rounds)  # started, or never will
                if nobody_left(done, late_over, any(sim.alive(v) for v in volunteers),
                               any(action == "restart" and name != "coordinator" for _, action, name in pending)):
                    sim.event("all-volunteers-gone", "driver")  # nobody left to finish the run: do not wait it out
                    break
                if done + 1 >= opts.rounds:
                    # A straggler still short of the target once the others left cannot finish alone:
                    # after a grace period it is asked to leave (SIGINT), as a person would.
                    finished_at = finished_at or now
                    if now - finished_at > 2 * opts.deadline_s + 6 * opts.slack_s and not stragglers_told:
                        stragglers_told = True
                        for v in volunteers:
                            if sim.alive(v):
                                sim.signal(v, signal.SIGCONT)
                                sim.signal(v, signal.SIGINT)
                                sim.event("straggler-stopped", v)
                                if frozen.pop(v, None) is not None:  # thawed here: no thaw to come
                                    pending[:] = [p for p in pending if p[1:] != ("thaw", v)]
                                    sim.event("thaw", v)
                for when, action, name in [p for p in pending if p[0] <= now]:
                    pending.remove((when, action, name))
                    if action == "thaw":
                        sim.signal(name, signal.SIGCONT)
                        frozen.pop(name, None)
                        sim.event("thaw", name)
                    elif action == "restart" and done + 1 < opts.rounds:
                        note_ended([name])  # the old process's end, stamped before its name is reused
                        if sim.alive(name):  # killed, not reaped yet: it may hold its locks and port
                            pending.append((now + 0.25, "restart", name))
                            continue
                        # the old process's address (its port) must not be handed out as the new one's
                        (out / name / "address.txt").unlink(missing_ok=True)
                        sim.spawn(name, coord_args if name == "coordinator" else join_args(name), kind="restart")
                if faults_due(done, opts.rounds):
                    if now >= next_kill:
                        next_kill = now + opts.kill_every  # no burst of catch-up faults after a stall
                        if (name := pick("kill")) is not None:
                            sim.signal(name, signal.SIGKILL)
                            sim.event("kill", name)
                            if opts.restart_after:
                                pending.append((now + opts.restart_after, "restart", name))
                    if now >= next_freeze:
                        next_freeze = now + opts.freeze_every
                        if (name := pick("freeze")) is not None:
                            sim.signal(name, signal.SIGSTOP)
                            frozen[name] = now + opts.freeze_for
                            sim.event("freeze", name)
                            pending.append((now + opts.freeze_for, "thaw", name))
                    if now >= next_leave:
                        next_leave = now + opts.leave_every
                        if (name := pick("leave")) is not None:
                            sim.signal(name, signal.SIGINT)
                            sim.event("leave", name)
                    if now >= next_crash:
                        next_crash = now + opts.crash_daemon_every
                        if (name := pick("daemon-crash", coordinator=True)) is not None and sim.crash_daemon(name):
                            sim.event("daemon-crash", name)  # the peer starts a new daemon: no restart here
                    if not late_done and done >= LATE_JOIN_ROUND:
                        late_done = True
                        for i in range(opts.late_joiners):
                            name = f"late-{i}"
                            volunteers.append(name)
                            sim.spawn(name, join_args(name), kind="join")
                    if not coord_killed and now >= opts.kill_coordinator_at:
                        coord_killed = True
                        sim.signal("coordinator", signal.SIGKILL)
                        sim.event("kill-coordinator", "coordinator")
                        pending.append((now + (opts.restart_after or 5.0), "restart", "coordinator"))
                        live = live_addresses(out, up)  # the volunteers up now (the coordinator writes none)
                        coord_args = [*coord_args[:-len(common)], *[x for m in live[:3] for x in ("--peer", m)], *common]
                time.sleep(0.25)
            else:
                sim.event("timed-out", "driver")  # report.json's `timed_out`, said in the CLI's summary
        except KeyboardInterrupt:  # Ctrl+C, SIGTERM or SIGHUP: a report of the run so far, then out
            interrupted = True
            sim.event("interrupted", "driver")  # report.json's `interrupted`; logs after it are left out
            progress("interrupted: writing the report of the run so far (press Ctrl+C again to stop at once)")
        note_ended(["coordinator", *volunteers])
        for name in list(frozen):
            sim.signal(name, signal.SIGCONT)
        for v in volunteers:
            if sim.alive(v):  # still running when the run was stopped
                sim.event("interrupted" if interrupted else "timeout", v)
        if sim.alive("coordinator") and not interrupted:  # (interrupted: whoever pressed Ctrl+C waits for no one)
            sim.signal("coordinator", signal.SIGINT)
            try:
                progress("stopping: the coordinator saves its checkpoint (up to 60 s; Ctrl+C skips the wait)")
                sim.procs["coordinator"].popen.wait(timeout=60)  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:  # the first Ctrl+C (or SIGTERM) here: the report all the same, now
                # The run had ended: this skips the wait, as the line above offers, and interrupts
                # nothing (as `interrupted` it made a finished run exit 130, unchecked: a review).
                sim.event("stop-wait-skipped", "driver")
                progress("not waiting for the coordinator: writing the report (its last checkpoint may be "
                         "missing; press Ctrl+C again to stop at once)")
        # the coordinator told to stop, and volunteers still running at the timeout that ended meanwhile
        note_ended(["coordinator", *volunteers], exits=False)
        wall = time.time() - start
        try:
            report = build_report(out, opts, sim.events, wall, t0=sim.t0, rss=sim.peak_rss)
        except KeyboardInterrupt:  # the first Ctrl+C (or SIGTERM) once the run is over: it is written all the same
            progress("writing the report all the same (press Ctrl+C again to stop at once)")
            report = build_report(out, opts, sim.events, wall, t0=sim.t0, rss=sim.peak_rss)
    (out / "report.json").write_text(report_json(report))  # first: a SIGTERM now ends us at once
    tidy_output(out)  # (every process is gone: the with block's exit killed the ones still running)
    try:
        from .plots import plot_loss

        plot_loss(report, out / "loss.png")
    except ImportError as exc:  # matplotlib is optional
        progress(f"no loss.png: {exc}")
    return report
