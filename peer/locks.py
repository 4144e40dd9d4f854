"""One process per state dir and per identity: an advisory lock held for the process's lifetime.

Two `join`s on one state dir would overwrite each other's checkpoints; two processes with one
identity are one libp2p peer id at two addresses, which the DHT and the streams cannot tell
apart. The lock is `flock` on a small file (released by the kernel when the process exits, even
on `kill -9`), so a stale lock file from a crash never blocks a restart. The files of the temp
folder's (identities, simulation outputs) are removed at exit, and those a `kill -9` left by the
next process to lock one there.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

from .config import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX (Windows): no locks are taken
    fcntl = None  # type: ignore[assignment]

_HELD: dict[str, int] = {}  # lock path -> open descriptor, kept open until the process exits
_REMOVE_AT_EXIT: set[str] = set()  # the lock paths of `_HELD` in the temp folder, removed at exit
_atexit_set = False
_LOCKS_FOLDER = "groundswell-locks-"  # the identity locks' folder in the temp directory, then the uid
_BUSY_TRIES = 4  # a lock found held is tried again this many times in all (about 30 ms)
SWEEP_LIMIT = 256  # stale lock files removed at most per start (each costs a few microseconds)
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}  # flock's "no locks here"


def identity_lock_path(peer_id: str) -> Path:
    """Where the lock of an identity lives: a per-user folder in the temp directory."""
    return private_lock_path(peer_id)


def private_lock_path(name: str) -> Path:
    """The lock file `name` in this user's private locks folder in the temp directory."""
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"{_LOCKS_FOLDER}{os.getuid() if hasattr(os, 'getuid') else 0}"
    make_private_dir(folder)
    sweep_stale_locks(folder)
    return folder / f"{name}.lock"


def sweep_stale_locks(folder: Path, limit: int = SWEEP_LIMIT) -> int:
    """Remove up to `limit` lock files of `folder` that no process holds; how many went. Each
    process removes its own at exit, but not after a `kill -9` (a simulation's churn leaves one per
    killed process: thousands, in a long study). Taken before removal, like `hold_exclusively`'s,
    which finds the file it locked gone then and takes a fresh one: never two holders."""
    if fcntl is None:  # pragma: no cover - not on POSIX
        return 0
    removed = 0
    try:
        names = [e.name for e in os.scandir(folder) if e.name.endswith(".lock")]
    except OSError:
        return 0
    for name in names:
        path = folder / name
        if removed >= limit:
            break
        if str(path.resolve()) in _HELD:
            continue
        try:  # (non-blocking: a FIFO named *.lock must not hang every start)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # gone meanwhile, or a link (left for `hold_exclusively` to refuse)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if stat.S_ISREG(os.fstat(fd).st_mode) and _same_file(fd, path):
                path.unlink()
                removed += 1
        except OSError:  # held: in use
            pass
        finally:
            os.close(fd)
    return removed


def _same_file(fd: int, path: Path) -> bool:
    """Is `path` still the file open as `fd` (not removed, nor replaced by a new one)?"""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def make_private_dir(folder: Path) -> None:
    """Make `folder` (mode 0700) unless it exists; ConfigError unless it is then this user's own
    private folder. In a shared temp directory another user may have made it first, to plant
    links in it (a lock file is emptied on opening) or sockets, or to hold our locks."""
    folder.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if hasattr(os, "getuid") and (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077):
        raise ConfigError(f"{folder} is not a private folder of this user (another user made it?): remove it, "
                          "or set TMPDIR to a folder of your own")


def hold_exclusively(lock_path: Path, what: str, subject: Path, hint: str = "give this one its own --state-dir") -> None:
    """Take the lock at `lock_path` for this process (again: no-op); ConfigError naming the
    holder's pid if another process holds it. No-op where `fcntl` is missing (Windows)."""
    if fcntl is None:  # pragma: no cover - not on POSIX
        return
    key = str(lock_path.resolve())
    if key in _HELD:
        return
    for _ in range(8):  # a lock file removed as stale (`sweep_stale_locks`) while we took it: again
        fd = _lock(lock_path, what, subject, hint)
        if _same_file(fd, lock_path):
            break
        os.close(fd)
    else:
        raise ConfigError(f"cannot lock the {what} {subject}: {lock_path} keeps being removed")
    try:  # our pid, for the message another process gets
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as exc:  # a full disk: the lock is released and the file named (no fd left locked)
        os.close(fd)
        raise ConfigError(f"cannot lock the {what} {subject} ({lock_path}: {exc.strerror or exc})") from None
    _HELD[key] = fd
    if lock_path.parent.name.startswith(_LOCKS_FOLDER):  # the temp folder's: removed at exit
        _REMOVE_AT_EXIT.add(key)
        if not _atexit_set:
            _remove_at_exit()


def _lock(lock_path: Path, what: str, subject: Path, hint: str) -> int:
    """Open `lock_path` and take its lock: the descriptor, or ConfigError saying why not."""
    try:  # never through a link: the file is emptied once locked
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:  # a read-only or foreign folder, a planted link: say so in one line
        raise ConfigError(f"cannot lock the {what} {subject} ({lock_path}: {exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        os.close(fd)
        raise ConfigError(f"cannot lock the {what} {subject}: {lock_path} is not a file of this user; remove it")
    for attempt in range(_BUSY_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            # Another start's `sweep_stale_locks` holds a free file's lock for a moment (then it
            # is gone, and the caller takes a new one): a holder only if it stays held.
            if attempt + 1 < _BUSY_TRIES and _same_file(fd, lock_path):
                time.sleep(0.005 * (attempt + 1))
                continue
            if not _same_file(fd, lock_path):
                return fd  # swept: `hold_exclusively` sees the file gone and takes a new one
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"the {what} {subject} is in use by another groundswell process (pid {holder}); "
                              f"stop it, or {hint}") from None
        except OSError as exc:  # Lustre (noflock), some NFS and FUSE mounts: ENOLCK, ENOSYS, EOPNOTSUPP
            os.close(fd)
            raise ConfigError(_no_lock_message(lock_path, what, subject, exc)) from None
    return fd


def hold_key_file(path: Path) -> None:
    """Also lock the identity's key file itself (read-only, best effort): the lock by peer id lives
    in the temp directory, which a cleaner may empty or a service may have a private copy of; the
    key file is the same file for every process that loads it. ConfigError if another process
    holds it; nothing where the filesystem has no locks (the lock by peer id still holds)."""
    if fcntl is None:  # pragma: no cover - not on POSIX
        return
    key = f"key:{path.resolve()}"
    if key in _HELD:
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # (a link: it was read through it already; the lock by peer id covers it)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"the identity {path} is in use by another groundswell process; stop it, or give "
                          "this one its own --identity") from None
    except OSError:  # no locks on this filesystem
        os.close(fd)
        return
    _HELD[key] = fd


def _no_lock_message(lock_path: Path, what: str, subject: Path, exc: OSError) -> str:
    """The one line for a lock `flock` refused with `exc`: the file, and a folder to use instead."""
    if exc.errno not in _NO_LOCKS:
        return f"cannot lock the {what} {subject} ({lock_path}: {exc.strerror or exc})"
    # The identity locks live in the temp directory (identity_lock_path), whatever --state-dir is.
    elsewhere = ("set TMPDIR to a folder on a local disk" if lock_path.parent.name.startswith(_LOCKS_FOLDER)
                 else "use a --state-dir on a local disk")
    return (f"cannot lock the {what} {subject}: the filesystem of {lock_path} does not support file locks "
            f"({exc.strerror or exc}); {elsewhere}")


def release_all() -> None:
    """Let go of every lock this process holds, removing those of the temp folder (at exit; tests)."""
    for key, fd in _HELD.items():
        # removed while still held, and only if it is still our file (one something else removed
        # meanwhile may have been made anew and locked by another process)
        if key in _REMOVE_AT_EXIT and _same_file(fd, Path(key)):
            try:
                os.unlink(key)
            except OSError:
                pass
        os.close(fd)
    _HELD.clear()
    _REMOVE_AT_EXIT.clear()


def _remove_at_exit() -> None:
    """Have `release_all` run at this process's exit (once)."""
    global _atexit_set
    import atexit

    atexit.register(release_all)
    _atexit_set = True
