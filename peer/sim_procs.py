"""The processes of a simulation: each started in a session of its own, so that its whole tree
(its p2pd included) can be signalled or killed; `Simulation` kills everything it started on exit,
whatever happens (SIGTERM included)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .daemon import die_with_us, sweep_socket_dirs

if TYPE_CHECKING:
    from .sim_options import SimulateOptions


def complete_lines(path: Path, offset: int) -> tuple[bytes, int]:
    """The whole lines a log gained past `offset` (a line still being written is read next time)
    and the offset after them; from its start if it shrank (rotated: peer/event_log.py), none
    if it cannot be read (not written yet)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset:
                offset = 0
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return b"", offset
    complete = chunk[:chunk.rfind(b"\n") + 1]
    return complete, offset + len(complete)


@dataclass
class Proc:
    """One simulated process."""

    name: str
    args: list[str]
    state_dir: Path
    popen: subprocess.Popen | None = None
    log: object = None
    ended: bool = False  # its end is recorded (`Simulation.note_end`)
    events_read: int = 0  # bytes of its state dir's events.jsonl read (from where it stood at the start)
    synced: bool = False  # a `sync` line was found there past that point


@dataclass
class Simulation:
    """Owns every process of a simulation; kills them all on exit."""

    out: Path
    opts: SimulateOptions
    events: list[dict] = field(default_factory=list)
    procs: dict[str, Proc] = field(default_factory=dict)
    t0: float = field(default_factory=time.time)
    peak_rss: dict[str, float] = field(default_factory=dict)
    _replaced: list[Proc] = field(default_factory=list)  # earlier processes of a restarted name

    signalled: dict[str, int] = field(default_factory=dict)  # name -> the last fault signal the driver sent

    def __enter__(self) -> "Simulation":
        self.out.mkdir(parents=True, exist_ok=True)
        # A SIGTERM (e.g. from `timeout`) or SIGHUP (the terminal closed) must still reach
        # __exit__ and kill every process. Were the driver killed outright, its children get
        # SIGKILL from the kernel (parent-death signal, see `die_with_driver`).
        # A signal already ignored stays so: under `nohup` the terminal's hangup must not end the run.
        self._old = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
                     if signal.getsignal(sig) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc: object) -> None:
        # A second Ctrl+C or SIGTERM while we kill must not leave the rest running.
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            for proc in [*self.procs.values(), *self._replaced]:
                try:
                    self._kill(proc)
                except Exception as exc:  # e.g. one that would not die: the others still must
                    print(f"could not stop {proc.name}: {exc!r}", file=sys.stderr)
        finally:
            for sig, old in held.items():
                signal.signal(sig, old)
            for sig, old in self._old.items():
                signal.signal(sig, old)
        # The socket folders of the processes killed here (and by faults): each process removes
        # its own on a clean exit only, and a later one's start-up would sweep them much later.
        sweep_socket_dirs(Path(tempfile.gettempdir()))

    def event(self, kind: str, peer: str) -> None:
        """Record a driver-side event (spawn, exit, fault)."""
        self.events.append({"t": round(time.time() - self.t0, 3), "kind": kind, "peer": peer})

    def crashed(self, name: str) -> int | None:
        """The exit status of a process that ended on its own with an error (None: it did not)."""
        proc = self.procs.get(name)
        code = proc.popen.poll() if proc is not None and proc.popen is not None else None
        if code is None or code == 0:
            return None
        sent = self.signalled.get(name)
        if sent == signal.SIGKILL and code == -signal.SIGKILL:
            return None  # the fault we injected
        if sent == signal.SIGINT and code in (130, -signal.SIGINT):
            return None  # told to leave, and it did
        return code

    def note_end(self, name: str, exit_event: bool = True) -> int | None:
        """Record this process's end (`exit`; `crash` too for an error) once, when first seen; a crash's status."""
        proc = self.procs.get(name)
        if proc is None or proc.ended or proc.popen is None or proc.popen.poll() is None:
            return None
        proc.ended = True
        if exit_event:
            self.event("exit", name)
        if (code := self.crashed(name)) is not None:  # ended with an error nobody injected
            self.event("crash", name)
        return code

    def alive(self, name: str) -> bool:
        """Is this process running (or frozen)?"""
        proc = self.procs.get(name)
        return proc is not None and proc.popen is not None and proc.popen.poll() is None

    def going(self, name: str) -> bool:
        """Was this process told to end (SIGKILL or SIGINT) since it was last started? It may still
        run: a killed one until it is reaped, one told to leave until its round settles."""
        return name in self.signalled  # `spawn` forgets what the name's earlier process was sent

    def synced(self, name: str) -> bool:
        """Has this process, since it started, taken the run's state (a `sync` or `resume-ahead`
        line in its events log)? Until then it makes no round: it counts as down for the faults' floor."""
        proc = self.procs.get(name)
        if proc is None or proc.synced:
            return proc is not None
        complete, proc.events_read = complete_lines(proc.state_dir / "events.jsonl", proc.events_read)
        # state downloaded, or none newer than its own checkpoint anywhere (it goes on from that)
        proc.synced = b'"kind": "sync"' in complete or b'"kind": "resume-ahead"' in complete
        return proc.synced

    def sample_rss(self) -> None:
        """Track each process's peak resident memory, its p2pd included."""
        import psutil

        for name, proc in self.procs.items():
            if not self.alive(name):
                continue
            try:
                root = psutil.Process(proc.popen.pid)  # type: ignore[union-attr]
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                continue
            self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), total / 2**20)

    def spawn(self, name: str, args: list[str], kind: str = "spawn", prefix: tuple[str, ...] = ()) -> Proc:
        """Start `groundswell ARGS` as its own process group, logging to OUT/NAME.log; `prefix`
        wraps the command (e.g. `ip netns exec NS`, which execs it in place)."""
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        proc = Proc(name, args, self.out / name)
        with contextlib.suppress(OSError):  # (the earlier process's lines are not this one's)
            proc.events_read = (proc.state_dir / "events.jsonl").stat().st_size
        proc.log = log = open(self.out / f"{name}.log", "ab")
        try:
            with _sigint_not_ignored():
                proc.popen = subprocess.Popen([*prefix, sys.executable, "-m", "groundswell.peer", *args],
                                              stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True, preexec_fn=die_with_driver())
        except BaseException:
            log.close()  # not in `procs`: `__exit__` would never close it
            raise
        if (old := self.procs.get(name)) is not None:
            self._replaced.append(old)  # killed already; reaped and its log closed on exit
        self.procs[name] = proc
        self.signalled.pop(name, None)
        self.event(kind, name)
        return proc

    def _kill(self, proc: Proc) -> None:
        if proc.popen is not None and proc.popen.poll() is None:
            self._signal_machine(proc, signal.SIGKILL)
            proc.popen.wait(timeout=30)
        if proc.log is not None:
            proc.log.close()  # type: ignore[attr-defined]
            proc.log = None

    def signal(self, name: str, sig: int) -> None:
        """Send a signal as the fault it stands for. SIGINT is a person's Ctrl+C: it reaches the
        peer's process group, as a terminal's would (the peer's p2pd runs in a group of its own
        and lives on while the peer finishes its round). SIGKILL, SIGSTOP and SIGCONT stand for a
        crashed or stalled machine: they reach the daemon too."""
        proc = self.procs[name]
        if proc.popen is None or proc.popen.poll() is not None:
            return
        # A SIGINT after a SIGKILL (e.g. to a straggler not reaped yet) does not make the injected
        # kill read as a leave, nor the kill's exit status as a crash.
        if sig == signal.SIGKILL or (sig == signal.SIGINT and self.signalled.get(name) != signal.SIGKILL):
            self.signalled[name] = sig
        if sig == signal.SIGINT:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, sig)
        else:
            self._signal_machine(proc, sig)

    def crash_daemon(self, name: str) -> bool:
        """SIGKILL the libp2p daemon(s) of a running peer, not the peer (a Go panic, the OOM
        killer): whether one was found."""
        import psutil

        proc = self.procs[name]
        if proc.popen is None or proc.popen.poll() is not None:
            return False
        try:
            daemons = [k for k in psutil.Process(proc.popen.pid).children(recursive=True) if k.name() == "p2pd"]
        except psutil.Error:
            return False
        for daemon in daemons:
            with contextlib.suppress(psutil.Error):
                daemon.kill()
        return bool(daemons)

    @staticmethod
    def _signal_machine(proc: Proc, sig: int) -> None:
        """Signal a peer's process group and the groups of all its descendants (its p2pd)."""
        import psutil

        assert proc.popen is not None
        try:
            kids = psutil.Process(proc.popen.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        groups = [proc.popen.pid]  # the peer's own group first (it was started in a new session)
        for kid in kids:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                group = os.getpgid(kid.pid)
                if group not in groups and group != os.getpgrp():  # never our own group
                    groups.append(group)
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)


def die_with_driver() -> Callable[[], None] | None:
    """A `preexec_fn` that has a child get SIGKILL when this thread ends (None where prctl is missing).
    SIGKILL, not SIGTERM: a peer the churn froze (SIGSTOP) would keep a SIGTERM pending, and stay
    stopped for good. These are simulation processes: the polite stops are the driver's."""
    return die_with_us(signal.SIGKILL)


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """Children started inside get SIGINT at its default, as from a terminal. A simulation run
    from a background job (`cmd &` in a script: POSIX shells ignore SIGINT there) would otherwise
    hand that "ignore" to every peer and its p2pd, and a simulated Ctrl+C would not be one."""
    try:
        ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # reset to SIG_DFL by exec
    except ValueError:  # not the main thread: leave it as it is
        ignored = False
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
