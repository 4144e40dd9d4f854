"""How hivemind's p2pd daemon is started: in its own process group, and tied to our life.

hivemind starts p2pd as a plain child, in our process group. A terminal sends Ctrl+C (SIGINT) to
the whole foreground group, so the daemon died at the first press, while the peer was still
finishing its round ("stopping after this round"): the round could not finish, and the
coordinator hung until the second press. On Linux the daemon now gets its own process group, so
Ctrl+C reaches only us, and a parent-death signal (prctl PR_SET_PDEATHSIG), so that it still
ends when we do, even on SIGKILL. Elsewhere (no prctl) the daemon stays in our group, as before:
an orphaned daemon would be worse than an early one.

Its unix sockets go in a folder of this process's own (`socket_dir`), not loose in the temp
folder: a peer killed with SIGKILL cannot remove its socket files, and the next start removes the
folders of processes that are gone (hivemind's files piled up by the thousand in /tmp).

The death signal follows the *thread* that started the daemon (asyncio forks on its event-loop
thread), so only threads that ask for it get it (`adopt_p2pd_daemons`): a `SwarmNode`'s network
thread, which lives until it has shut its daemon down. Any other thread starts p2pd as hivemind
does. (A `preexec_fn` makes Python fork rather than vfork; the function itself only calls the
prctl resolved at import, with no imports or locks between fork and exec.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .locks import make_private_dir
from .net_errors import DaemonExited

log = logging.getLogger(__name__)


OPEN_FILES_WANTED = 1 << 16


class DaemonOutput:
    """What p2pd printed that is not one of its JSON log records: its start-up lines and, if it
    crashes, Go's "panic:", "fatal error:" or "SIGQUIT: quit" and the lines after it. hivemind logs those at DEBUG
    only, so a churn run's daemon that exited with code 2 left nothing to say why."""

    FATAL_LINES = 12  # of a crash: the message, then the first lines of its goroutine's trace

    def __init__(self) -> None:
        self.recent: collections.deque[str] = collections.deque(maxlen=8)
        self.fatal: list[str] = []

    def keep(self, line: str) -> None:
        """Note one line of the daemon's output."""
        if '"logger"' in line:
            return
        if self.fatal and len(self.fatal) < self.FATAL_LINES:
            self.fatal.append(line)
        elif not self.fatal and re.match(r"(panic: |fatal error: |SIG[A-Z]+: )", line):
            self.fatal.append(line)
        self.recent.append(line)

    def last_words(self) -> list[str]:
        """What to show once the daemon has exited: the crash if there was one, else its last lines."""
        return self.fatal or list(self.recent)[-4:]


DAEMON_OUTPUT = DaemonOutput()  # (every daemon of this process: one, but for a restart's)


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files towards its hard limit (at most `wanted`),
    before the daemon starts (it inherits it); returns the soft limit now in force. Every inbound
    stream holds a file descriptor here and one in p2pd: the usual soft limit of 1024 would run out
    long before the guard's cap on streams (and then checkpoint writes fail too)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    # (macOS reports an unlimited hard limit but refuses more than its kernel's per-process
    # maximum, 10240 by default: then that)
    for ask in dict.fromkeys((target, min(target, 10240))):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ask, hard))
            return ask
        except (ValueError, OSError) as exc:
            why = exc
    log.warning("could not raise the open-file limit from %d: %s", soft, why)
    return soft

_PR_SET_PDEATHSIG = 1
_patched = False
_socket_users = 0  # live nodes of this process using socket_dir()
_lock = threading.Lock()
# Per thread: whether it adopts the daemons it starts, and the ones it started (hivemind does not
# wait for a daemon that failed to start; one reaped after its loop closed warns the user).
_local = threading.local()


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # resolved here: the child, between fork and exec, only calls it


def daemon_owns_group() -> bool:
    """Whether adopted p2pd daemons get their own process group here (Linux only)."""
    return _PRCTL is not None


def _die_with_parent(parent: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    def preexec() -> None:  # in the child, between fork and exec: no imports, no locks
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)  # type: ignore[misc]
        if os.getppid() != parent:  # the parent died before the line above: do not start at all
            os._exit(1)  # (not a signal: the parent's Python handlers are still installed here)

    return preexec


def die_with_us(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has a child get `sig` when this thread ends (None where prctl is missing)."""
    return _die_with_parent(os.getpid(), sig) if _PRCTL is not None else None


def adopt_p2pd_daemons() -> None:
    """From now on, p2pd daemons hivemind starts *on this thread* run in their own process group
    and get SIGKILL when this thread ends (a no-op where prctl is missing). Call it on a thread
    that outlives its daemons, and `reap_daemons` on it once they are shut down."""
    global _patched
    if _PRCTL is None:
        return
    _local.adopt = True
    _local.started = getattr(_local, "started", [])
    with _lock:
        if _patched:
            return
        original = asyncio.subprocess.create_subprocess_exec

        async def create_subprocess_exec(program: Any, *args: Any, **kwargs: Any) -> Any:
            # Only hivemind's daemon, and only on adopting threads; anything else starts as asked.
            if (not getattr(_local, "adopt", False) or os.path.basename(str(program)) != "p2pd"
                    or "preexec_fn" in kwargs):
                return await original(program, *args, **kwargs)
            kwargs.setdefault("process_group", 0)
            # SIGKILL: a stop (a frozen peer's whole group) holds a SIGTERM back, and a daemon whose
            # peer is gone has nothing to close gracefully (its socket folder is swept by lock).
            kwargs["preexec_fn"] = _die_with_parent(os.getpid(), signal.SIGKILL)
            proc = await original(program, *args, **kwargs)
            _local.started.append(proc)
            return proc

        asyncio.subprocess.create_subprocess_exec = create_subprocess_exec  # type: ignore[assignment]
        _patched = True


async def reap_daemons(timeout_s: float = 2.0) -> None:
    """End and wait for every daemon this thread adopted; call once its node has shut its daemon
    down (hivemind waits for that one, not for one that failed to start)."""
    procs = getattr(_local, "started", [])
    for proc in list(procs):
        for end in (proc.terminate, proc.kill):
            if proc.returncode is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                end()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout_s)
        # forgotten only once reaped (or past help): a teardown cut short (a second Ctrl+C, a
        # close's time limit) leaves the rest listed, for the next reap to end
        with contextlib.suppress(ValueError):
            procs.remove(proc)


SOCKET_DIR_PREFIX = "groundswell-p2p-"


def socket_dir(root: Path | None = None) -> Path:
    """This process's folder for its daemons' unix sockets (made here, private to the user); the
    folders of processes that are gone are removed first.

    The folder holds a `.lock` this process keeps locked (`flock`, released by the kernel even on
    `kill -9`): a folder whose lock can be taken is stale, whatever its pid says. A pid alone
    misleads both ways: a stale folder's pid reused by another program kept it forever, and a live
    folder of a process in another pid namespace (a container sharing /tmp) looked stale and was
    removed under its daemon. Its name adds a random part to the pid for the same reason."""
    root = Path(tempfile.gettempdir()) if root is None else root
    own = _own_dirs.get(root)
    if own is not None and own[0].is_dir():
        make_private_dir(own[0])  # still ours, and still private
        return own[0]
    if own is not None and own[1] is not None:  # our folder went (a cleaner emptied /tmp): its lock with it
        os.close(own[1])
    sweep_socket_dirs(root)
    path = root / f"{SOCKET_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    make_private_dir(path)  # the daemons' control sockets: nobody else's folder
    _own_dirs[root] = (path, _lock_folder(path))
    return path


_own_dirs: dict[Path, tuple[Path, int | None]] = {}  # temp root -> our socket folder there, its lock's fd


def _lock_folder(path: Path) -> int | None:
    """Lock `path/.lock` for this process's lifetime; None where the filesystem has no locks.
    Locked under a temporary name first: a sweeper never sees an unlocked `.lock` in a live folder."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX: judged by pid alone
        return None
    tmp = path / f".lock-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path / ".lock")
    except OSError:  # no locks on this filesystem: judged by pid alone
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return fd


def sweep_socket_dirs(root: Path) -> list[Path]:
    """Remove the socket folders of processes that no longer run; returns what was removed."""
    mine = {own for own, _ in _own_dirs.values()}
    removed = []
    for path in root.glob(f"{SOCKET_DIR_PREFIX}*"):
        if path in mine or not _stale(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _stale(path: Path) -> bool:
    """Is this socket folder a gone process's? By its lock where it has one, else by its pid."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not path.is_dir() or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return False  # not ours to judge (another user's folder cannot be removed anyway)
    try:
        import fcntl

        fd = os.open(path / ".lock", os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except (ImportError, OSError):  # no lock: an older version's folder (by its pid), or one being made
        pid = path.name[len(SOCKET_DIR_PREFIX):]  # (made now: PID-RANDOM, never judged by a pid)
        return pid.isdigit() and int(pid) != os.getpid() and not _pid_exists(int(pid))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # nobody holds it: its process is gone (the lock is dropped with the fd below)
    except OSError:  # held (BlockingIOError), or no locks here: leave it
        return False
    finally:
        os.close(fd)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    return True


def with_private_sockets(p2p_class: Any) -> Any:
    """hivemind's P2P class, its unix sockets in `socket_dir()` (where the path is short enough)
    and its autorelay on static relays (`static_relay_args`). Each call must be paired with
    `release_private_sockets()`."""
    global _socket_users
    with _lock:
        prefix = f"/unix{socket_dir()}/"
        _socket_users += 1
    log_line = p2p_class._log_p2pd_message

    def keep_and_log(line: str) -> None:
        DAEMON_OUTPUT.keep(line)
        log_line(line)

    attrs: dict[str, Any] = {"_make_process_args": staticmethod(static_relay_args(p2p_class._make_process_args)),
                             "_log_p2pd_message": staticmethod(keep_and_log)}
    if len(prefix) <= 60:  # unix socket paths are limited to ~104 bytes; leave room for the names
        attrs["_UNIX_SOCKET_PREFIX"] = prefix
    return type(p2p_class.__name__, (p2p_class,), attrs)


def static_relay_args(make_args: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """hivemind's p2pd command-line builder, with relay discovery off when trusted relays are named.

    With discovery on (p2pd's default, and hivemind has no way to turn it off), go-libp2p's
    autorelay waits for 4 relay candidates, or 3 minutes, before it asks any relay for a slot;
    a run's NAT'ed volunteer has one or two (its bootstrap peers), so it was unreachable for its
    first ~3.4 minutes. With static relays alone the wait is for those few, so the slot comes
    within seconds."""

    def process_args(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_args(*args, **kwargs)

    return process_args


def release_private_sockets() -> None:
    """One user of `socket_dir()` is done; the last one removes the (by then empty) folder."""
    global _socket_users
    with _lock:
        _socket_users -= 1
        if _socket_users <= 0:
            _socket_users = 0
            _remove_own_dir(Path(tempfile.gettempdir()))


def _remove_own_dir(root: Path) -> None:
    """Remove our socket folder in `root` if nothing but its lock is left in it; otherwise (a
    daemon still shutting down) it stays locked, and is swept once this process is gone."""
    own = _own_dirs.get(root)
    if own is None:
        return
    path, fd = own
    try:
        if {p.name for p in path.iterdir()} - {".lock"}:
            return
        with contextlib.suppress(FileNotFoundError):
            (path / ".lock").unlink()
        path.rmdir()
    except OSError:
        return
    del _own_dirs[root]
    if fd is not None:
        os.close(fd)


TEARDOWN_S = 4.0  # one shutdown step (the DHT, the daemon) of a node; a frozen daemon answers never


async def bounded(step: Callable[[], Awaitable[object]], what: str, timeout_s: float = TEARDOWN_S) -> None:
    """Run one shutdown step, giving up after `timeout_s`: hivemind waits for its daemon's answer
    without a timeout (a frozen or dead daemon's never comes), and what comes after (killing that
    daemon) must still run. Failures are logged: shutting down, nothing else is left to decide."""
    try:
        async with asyncio.timeout(timeout_s):
            await step()
    except Exception as exc:  # noqa: BLE001
        log.warning("shutting down the %s: %r", what, exc)


def daemon_exited(p2p: object) -> bool:
    """Whether `p2p`'s daemon process has exited: a dead daemon answers no shutdown call."""
    child = getattr(p2p, "_child", None)
    return child is not None and child.returncode is not None


async def watch_daemon(p2p: object) -> None:
    """Return never while `p2p`'s daemon runs; raise DaemonExited once it has exited (killed for
    memory, say): the node is deaf and dumb then, and must say so rather than loop on timeouts."""
    child = getattr(p2p, "_child", None)  # hivemind's handle on the daemon process
    if child is None:  # an in-process stand-in, or a daemon we did not start
        await asyncio.Event().wait()
    code = await child.wait()
    await asyncio.sleep(0.2)  # hivemind's reader takes in the daemon's last lines
    if said := DAEMON_OUTPUT.last_words():
        log.error("the libp2p daemon exited (code %s); its last output:\n%s", code, "\n".join(said))
    raise DaemonExited(f"the libp2p daemon exited (code {code})")
