"""Files in a state dir are written whole or not at all: an interrupted write leaves no temp file
(and a restart removes any a killed process left), and a directory that refuses fsync after the
rename does not turn a file that is in place into one "not written"."""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat

import pytest
import torch
from groundswell.peer.run_state import GlobalState
from groundswell.peer.state_files import write_atomically
from test_resume import _factory


def _refuse_directory_fsync(monkeypatch) -> list[int]:
    """os.fsync raises EINVAL for a directory, as some filesystems do; returns the refused fds."""
    real, refused = os.fsync, []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return refused


def _events(p) -> list[dict]:
    return [json.loads(line) for line in (p.state_dir / "events.jsonl").read_text().splitlines()]


def _at_round(p, round_id: int):
    from groundswell.peer.participant import genesis_decision

    p.outer.round_id = round_id
    p._snapshot = GlobalState(round_id, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))
    return p


def test_a_file_whose_directory_refuses_fsync_is_written(tmp_path, monkeypatch, caplog):
    path = tmp_path / "contributed.json"
    path.write_bytes(b"old")
    refused = _refuse_directory_fsync(monkeypatch)
    write_atomically(path, lambda f: f.write(b"new"))  # returns: the new file is in place
    assert refused and path.read_bytes() == b"new"
    assert not list(tmp_path.glob("*.tmp"))
    assert "may not survive a power loss" in caplog.text


def test_a_checkpoint_whose_directory_refuses_fsync_counts_and_older_ones_are_pruned(tmp_path, corpus,
                                                                                     monkeypatch):
    # It used to be "not written": checkpoints piled up, never pruned, on such a filesystem.
    p = _at_round(_factory(tmp_path, corpus, checkpoint={"keep": 1})(), 1)
    first = p.save_checkpoint()
    assert first is not None
    _refuse_directory_fsync(monkeypatch)
    second = _at_round(p, 2).save_checkpoint()
    assert second is not None and second.exists() and not first.exists()
    assert p.load_checkpoint()["round"] == 2


@pytest.mark.parametrize("error", [KeyboardInterrupt(), MemoryError(), pickle.PicklingError("a lambda")])
def test_an_interrupted_write_leaves_no_temp_file_and_the_old_file_whole(tmp_path, error):
    path = tmp_path / "work.pt"
    path.write_bytes(b"old")

    def write(f) -> None:
        f.write(b"half of it")
        raise error  # a second Ctrl+C, memory running out, torch.save failing to pickle

    with pytest.raises(type(error)):
        write_atomically(path, write)
    assert path.read_bytes() == b"old"
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("free, words", [(4096, "no space left on the disk of"),
                                         (10 << 30, "writing work.pt failed: unexpected pos 704 vs 598")])
def test_torch_running_out_of_disk_is_said_in_plain_words(tmp_path, monkeypatch, free, words):
    # torch.save's zip writer says a full disk as "[enforce fail at inline_container.cc:672] .
    # unexpected pos 704 vs 598"; that was the whole message a coordinator saw.
    import errno
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(1 << 40, (1 << 40) - free, free))
    path = tmp_path / "work.pt"
    path.write_bytes(b"old")

    def torch_save(f) -> None:
        f.write(b"part of it")
        raise RuntimeError("unexpected pos 704 vs 598")

    with pytest.raises(OSError, match=words) as caught:
        write_atomically(path, torch_save)
    assert (caught.value.errno == errno.ENOSPC) == (free < 1 << 20)
    assert path.read_bytes() == b"old" and not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_that_runs_out_of_memory_is_reported_and_training_goes_on(tmp_path, corpus, monkeypatch):
    p = _at_round(_factory(tmp_path, corpus)(), 3)
    saved = p.save_checkpoint()
    before = saved.read_bytes()

    def out_of_memory(state, f) -> None:
        f.write(b"part of a checkpoint")
        raise MemoryError

    monkeypatch.setattr(torch, "save", out_of_memory)
    assert _at_round(p, 4).save_checkpoint() is None  # reported, not raised
    assert saved.read_bytes() == before
    assert not list(p.state_dir.glob("*.tmp"))
    assert any(e["kind"] == "checkpoint-failed" and e["error"] == "MemoryError" for e in _events(p))


def test_a_restart_removes_every_half_written_file_a_killed_process_left(tmp_path, corpus):
    participant = _factory(tmp_path, corpus)
    state = participant().state_dir
    stale = ["manifest.tmp", "bootstrap.tmp", "address.tmp", "contributed.tmp", "work.tmp", "outcome.tmp",
             "checkpoint-00000009.tmp", "volunteer.tmp", "genesis.tmp", "known_peers.tmp",
             ".identity.key.x1y2.tmp",  # Identity.save's
             "work.1a2b3c4d.tmp", "contributed.00ff00ff.tmp", "checkpoint-00000009.1a2b3c4d.tmp"]  # named as now
    for name in stale:
        (state / name).write_bytes(b"half")
    (state / "manifest.signed").write_bytes(b"kept")
    others = ["notes.tmp", "manifest.json.tmp", "work.docx.tmp"]  # a state dir may be a shared folder
    for name in others:
        (state / name).write_bytes(b"another program's")
    participant()
    assert sorted(p.name for p in state.glob("*.tmp")) == sorted(others), "a restart leaves half-written files behind"
    assert (state / "manifest.signed").read_bytes() == b"kept"


def test_pruning_keeps_the_good_checkpoint_a_run_resumed_from_past_unreadable_newer_ones(tmp_path, corpus):
    # 490 and 500 unreadable (a crash, a full disk), the run resumed from 480 and synced on to 510:
    # counting the two towards keep=3 deleted 480, the last checkpoint that loads but the new one.
    p = _at_round(_factory(tmp_path, corpus, checkpoint={"keep": 3})(), 480)
    good = p.save_checkpoint()
    (p.state_dir / "checkpoint-00000490.pt").write_bytes(good.read_bytes()[:200])  # truncated
    (p.state_dir / "checkpoint-00000500.pt").write_bytes(b"garbled")
    assert p.load_checkpoint()["round"] == 480
    assert _at_round(p, 510).save_checkpoint() is not None
    assert good.exists(), "pruning deleted the newest checkpoint that loads"
    assert sorted(f.name for f in p.state_dir.glob("checkpoint-*.pt")) == ["checkpoint-00000480.pt",
                                                                           "checkpoint-00000510.pt"]


@pytest.mark.parametrize("failing", ["save", "digest"])
def test_a_work_record_that_runs_out_of_memory_is_reported_not_raised(tmp_path, monkeypatch, caplog, failing):
    # A MemoryError escaped write_work mid-round as a traceback; save_checkpoint reports the same.
    from groundswell.peer import work_file
    from groundswell.peer.unsettled import unsettled_item

    record = work_file.WorkRecord("t1", None, 3, torch.ones(8), unsettled_item(3, [b"own"], 0), [])
    assert work_file.write_work(tmp_path, record)
    before = (tmp_path / "work.pt").read_bytes()

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    if failing == "save":
        monkeypatch.setattr(torch, "save", out_of_memory)
    else:
        monkeypatch.setattr(work_file, "checkpoint_digest", out_of_memory)
    assert work_file.write_work(tmp_path, record) is False
    assert (tmp_path / "work.pt").read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))
    assert "MemoryError" in caplog.text


def test_state_files_and_a_new_state_dir_are_private_to_their_user(tmp_path, corpus):
    # A closed run's weights were world-readable (0644 files, 0755 state dir under umask 022).
    from groundswell.peer.state_files import make_state_dir

    old = os.umask(0o022)
    try:
        path = tmp_path / "checkpoint-00000001.pt"
        write_atomically(path, lambda f: f.write(b"weights"))
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
        p = _factory(tmp_path, corpus)()
        assert stat.S_IMODE(p.state_dir.stat().st_mode) == 0o700
        (tmp_path / "cli").mkdir()
        make_state_dir(tmp_path / "cli" / "state")
        assert stat.S_IMODE((tmp_path / "cli" / "state").stat().st_mode) == 0o700
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o755)  # a folder the user made and opened up: left as it is
        make_state_dir(mine)
        assert stat.S_IMODE(mine.stat().st_mode) == 0o755
    finally:
        os.umask(old)


def test_two_writers_of_one_file_do_not_share_a_temp_file(tmp_path):
    # Found by a review: a contribution's record written by a worker thread whose attempt was given
    # up on (its fsync slow) and the next one's shared contributed.tmp: the second removed the
    # first's temp file mid-write, and the first's rename then failed or installed the wrong record.
    path = tmp_path / "contributed.json"

    def outer(f) -> None:
        f.write(b"first")
        write_atomically(path, lambda g: g.write(b"second"))  # another thread, meanwhile

    write_atomically(path, outer)
    assert path.read_bytes() == b"first"  # each rename whole; the last one wins
    assert not list(tmp_path.glob("*.tmp"))


def test_a_genesis_whose_directory_fsync_fails_is_not_taken_as_saved(tmp_path, corpus, monkeypatch):
    # Found by a review: the run's first checkpoint must survive a power loss before it is served
    # (a coordinator restarted without it signs another genesis); a directory fsync failing with
    # EIO was only a warning, and the launch went on.
    from groundswell.peer.participant import genesis_decision

    p = _factory(tmp_path, corpus)()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    from types import SimpleNamespace

    p.node = SimpleNamespace(book=SimpleNamespace(committed={-1: (genesis_decision(p.identity, "unit"), None)}))
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert p.save_checkpoint(unpublished=True) is None
    p._snapshot = p._global_state()
    assert p.save_checkpoint() is not None  # any later one: a warning, as before


def test_a_state_dir_whose_parent_is_missing_is_refused_not_made_whole(tmp_path):
    # Found by a review: `--state-dir /nonexistent/dir/x` (a typo) built the whole tree and trained
    # there, where `keygen nodir/x.key` says to create the folder first.
    from groundswell.peer.config import ConfigError
    from groundswell.peer.state_files import make_state_dir

    with pytest.raises(ConfigError, match="does not exist .*create it first"):
        make_state_dir(tmp_path / "typo" / "x")
    assert not (tmp_path / "typo").exists()


def test_state_files_nested_deeper_than_python_recurses_are_malformed_not_a_traceback(tmp_path):
    # Found by a review: json.loads raises RecursionError on such a file, which the readers did
    # not catch (a state dir copied in from a volunteer, or planted, may hold anything)
    from groundswell.peer import work_file
    from groundswell.peer.config import ConfigError
    from groundswell.peer.dht_rejoin import load_known_peers
    from groundswell.peer.volunteer_dir import VOLUNTEER_FILE, check_volunteer_peer

    deep = "[" * 2000 + "]" * 2000
    for name in (work_file.CONTRIBUTED_FILE, work_file.OUTCOME_FILE, VOLUNTEER_FILE, "known_peers.json"):
        (tmp_path / name).write_text(deep)
    assert work_file.read_contributed(tmp_path) is work_file.UNREADABLE
    assert work_file._with_outcome({"included": None}, tmp_path, "t")["included"] is None
    with pytest.raises(ConfigError, match="nested too deeply"):
        check_volunteer_peer(tmp_path, "peer")
    assert load_known_peers(tmp_path / "known_peers.json").proven == []


def test_an_old_checkpoint_that_cannot_be_deleted_is_left_and_the_run_goes_on(tmp_path, corpus, monkeypatch):
    # (EPERM on an immutable file, EBUSY on NFS): the unlink's error escaped save_checkpoint after
    # the new checkpoint was written, and the volunteer or coordinator exited (a review, 2026-12-07).
    p = _at_round(_factory(tmp_path, corpus, checkpoint={"keep": 1})(), 1)
    old = p.save_checkpoint()
    real = type(old).unlink

    def unlink(self, missing_ok=False):
        if self == old:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(type(old), "unlink", unlink)
    new = _at_round(p, 2).save_checkpoint()
    assert new is not None and new.exists() and old.exists()
    assert p.last_checkpoint == new and not p.last_save_failed


def test_a_new_state_dirs_own_entry_is_made_durable(tmp_path, monkeypatch):
    # A genesis is made durable before it is served; the folder holding it must be too (on XFS or
    # btrfs a power loss could lose the new state dir's entry in its parent, genesis and all).
    from groundswell.peer.state_files import make_state_dir

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    make_state_dir(tmp_path / "new")
    assert str(tmp_path) in synced
    synced.clear()
    make_state_dir(tmp_path / "new")  # (one that exists is left as it is)
    assert synced == []
    # a filesystem that refuses to sync a directory (EINVAL) still gets its state dir, with a warning
    _refuse_directory_fsync(monkeypatch)
    make_state_dir(tmp_path / "other")
    assert (tmp_path / "other").is_dir()
