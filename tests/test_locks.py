"""The locks that keep one process per state dir and identity cannot be turned against their user:
a lock file is never opened through a link (it is emptied on opening), and the identity locks'
folder in the shared temp directory must be this user's own private one."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest
from groundswell.peer.config import ConfigError
from groundswell.peer.locks import hold_exclusively, identity_lock_path, release_all


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    yield tmp_path
    release_all()


def test_a_lock_file_planted_as_a_link_is_refused_and_its_target_untouched(private_tmp):
    target = private_tmp / "checkpoint-00000100.pt"
    target.write_bytes(b"precious")
    lock = identity_lock_path("12D3KooWPlanted")
    lock.symlink_to(target)
    with pytest.raises(ConfigError, match="cannot lock the identity"):
        hold_exclusively(lock, "identity", private_tmp / "id.key")
    assert target.read_bytes() == b"precious"
    fifo = private_tmp / "state" / ".lock"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a file of this user"):
        hold_exclusively(fifo, "state dir", fifo.parent)


def test_an_identity_lock_folder_others_can_write_to_is_refused(private_tmp):
    folder = private_tmp / f"groundswell-locks-{os.getuid()}"
    folder.mkdir(mode=0o700)
    path = identity_lock_path("12D3KooWMine")  # ours and private: fine
    hold_exclusively(path, "identity", private_tmp / "id.key")
    os.chmod(folder, 0o777)  # as if another user had made it for us
    with pytest.raises(ConfigError, match="not a private folder of this user"):
        identity_lock_path("12D3KooWMine")


def test_the_daemons_socket_folder_must_be_ours_and_private(tmp_path):
    from groundswell.peer.daemon import SOCKET_DIR_PREFIX, socket_dir

    mine = socket_dir(tmp_path)
    assert mine.parent == tmp_path and mine.name.startswith(f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    os.chmod(mine, 0o777)  # made, or opened up, by someone else
    with pytest.raises(ConfigError, match="not a private folder"):
        socket_dir(tmp_path)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_filesystem_without_locks_is_named_in_one_line_and_the_lock_file_closed(private_tmp, monkeypatch, code):
    # Lustre (noflock), some NFS and FUSE mounts: a raw "[Errno 37] No locks available" named no
    # file, and its descriptor stayed open.
    import fcntl

    def no_locks(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    state = private_tmp / "state"
    state.mkdir()
    def open_on_the_lock() -> list[str]:  # (not a count: other tests' threads may close theirs meanwhile)
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == str(state / ".lock"):
                    found.append(fd)
            except OSError:  # closed meanwhile (listdir's own descriptor, say)
                pass
        return found

    with pytest.raises(ConfigError, match=r"state dir .*state/\.lock.* does not support file locks.*--state-dir "
                                          "on a local disk") as caught:
        hold_exclusively(state / ".lock", "state dir", state)
    assert "\n" not in str(caught.value)
    assert open_on_the_lock() == [], "the lock file's descriptor leaked"
    with pytest.raises(ConfigError, match="TMPDIR"):  # the identity locks live in the temp directory
        hold_exclusively(identity_lock_path("12D3KooWNoLocks"), "identity", private_tmp / "id.key")


def test_an_identity_is_also_locked_at_its_key_file_whatever_the_temp_folder(tmp_path, private_tmp):
    """The lock by peer id lives in the temp folder: a service with a private /tmp, or a cleaner
    that emptied it, let a second process run under the identity. The key file is locked too."""
    import subprocess
    import sys
    import textwrap

    from groundswell.peer.locks import hold_key_file
    from groundswell.protocol.identity import Identity

    key = tmp_path / "id.key"
    Identity.generate().save(key)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from groundswell.peer.locks import hold_key_file
        hold_key_file(Path({str(key)!r}))
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="is in use by another groundswell process"):
            hold_key_file(key)
    finally:
        holder.kill()
        holder.wait()
    hold_key_file(key)  # its holder gone, the lock went with it
    hold_key_file(key)  # (taken twice by one process: held once)
    assert key.read_bytes()  # read-only: the key is untouched


def test_the_temp_folders_lock_files_are_removed_at_exit_or_by_the_next_start(private_tmp):
    # Found by a review: every identity's and simulated process's lock file stayed in the temp
    # folder for good (2,188 after a few days of tests and simulations here).
    import subprocess
    import sys

    from groundswell.peer import locks

    mine = identity_lock_path("12D3KooWMine")
    hold_exclusively(mine, "identity", private_tmp / "id.key")
    release_all()  # (as at exit)
    assert not mine.exists()
    # a process that exits normally removes its own; one killed leaves its file for the next start
    code = ("import sys, tempfile, pathlib; tempfile.gettempdir = lambda: sys.argv[1]; "
            "from groundswell.peer.locks import hold_exclusively, identity_lock_path; "
            "hold_exclusively(identity_lock_path(sys.argv[2]), 'identity', pathlib.Path('id.key')); "
            "print('held', flush=True); sys.stdin.readline()")
    subprocess.run([sys.executable, "-c", code, str(private_tmp), "12D3KooWClean"], input=b"\n", check=True,
                   capture_output=True)
    assert not (mine.parent / "12D3KooWClean.lock").exists()
    held = subprocess.Popen([sys.executable, "-c", code, str(private_tmp), "12D3KooWHeld"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert held.stdout.readline() == b"held\n"
        stale = [mine.parent / f"12D3KooWStale{i}.lock" for i in range(3)]
        for path in stale:
            path.write_text("123\n")
        identity_lock_path("12D3KooWNext")  # the next start sweeps what nobody holds
        assert not any(p.exists() for p in stale)
        assert (mine.parent / "12D3KooWHeld.lock").exists()  # in use: kept, and still locked
        with pytest.raises(ConfigError, match="in use by another groundswell process"):
            hold_exclusively(mine.parent / "12D3KooWHeld.lock", "identity", private_tmp / "id.key")
    finally:
        held.kill()
        held.wait()
    assert locks.sweep_stale_locks(mine.parent) == 1  # the killed one's


def test_a_lock_file_removed_as_stale_while_it_was_being_taken_is_taken_anew(private_tmp, monkeypatch):
    # Between our open and our flock, another start's sweep may lock the file, find it free and
    # remove it: the lock we then take is on a file nobody else can find. We must take a new one.
    from groundswell.peer import locks

    path = identity_lock_path("12D3KooWRace")
    real, calls = locks._lock, []

    def swept_once(lock_path, *args):
        fd = real(lock_path, *args)
        calls.append(1)
        if len(calls) == 1:
            lock_path.unlink()  # (as `sweep_stale_locks` of another process would)
        return fd

    monkeypatch.setattr(locks, "_lock", swept_once)
    hold_exclusively(path, "identity", private_tmp / "id.key")
    assert len(calls) == 2 and path.exists()
    held = os.fstat(locks._HELD[str(path.resolve())])
    assert (held.st_dev, held.st_ino) == (os.stat(path).st_dev, os.stat(path).st_ino)


def test_a_lock_held_a_moment_by_another_starts_sweep_is_not_in_use(private_tmp):
    # Found by a review: a sweep holds each free file's lock for a moment, and a start hitting that
    # moment was refused as "in use by another groundswell process" (2 starts in 2,418 there).
    import fcntl
    import threading

    path = identity_lock_path("12D3KooWSwept")
    path.write_text("")
    sweeper = os.open(path, os.O_RDONLY)
    fcntl.flock(sweeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
    threading.Timer(0.008, lambda: os.close(sweeper)).start()  # (let go: here without removing it)
    hold_exclusively(path, "identity", private_tmp / "id.key")


def test_a_fifo_among_the_lock_files_does_not_hang_a_start(private_tmp):
    from groundswell.peer.locks import sweep_stale_locks

    folder = identity_lock_path("12D3KooWFirst").parent
    os.mkfifo(folder / "planted.lock")
    (folder / "stale.lock").write_text("1\n")
    assert sweep_stale_locks(folder) == 1  # the stale file; the FIFO is left (and did not block)
    assert (folder / "planted.lock").exists() and not (folder / "stale.lock").exists()
