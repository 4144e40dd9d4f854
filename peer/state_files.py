"""A peer's --state-dir and the files in it that must survive a crash or a power loss: written
atomically (temp file, fsync, rename, fsync of the directory), old checkpoints pruned without
ever touching the one just written, half-written files of a killed process removed at start;
the folder itself made private, and refused when another user may write in it."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import zipfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO, Any

from .config import ConfigError

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (POSIX: the directory entry needs its own fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[IO[bytes]], None], durable: bool = False,
                     mode: int = 0o600) -> None:
    """Write `path` through `write(file)` so that it holds either its old or its whole new content,
    even after a power loss; a failed or interrupted write leaves no temp file behind.
    torch.save reports a full disk as a RuntimeError from its zip writer: that is an OSError here.
    `durable`: an OSError also when the rename may not survive a power loss (its directory's fsync
    failed with EIO; other errors, EINVAL, EPERM..., are filesystems that never sync directories,
    each time alike): the new file is in place. `mode`: the new file's permissions (private
    unless a caller says otherwise: a result the user asked for with --out, say)."""
    # A name of its own: a worker thread still writing the same file (a contribution's record
    # whose attempt was given up on, its fsync slow) must not have its temp file taken over.
    tmp = path.with_name(f"{path.stem}.{secrets.token_hex(4)}.tmp")
    try:
        # 0600 from the start (before the rename): a closed run's weights are not for other local
        # users. Never through a link, never over an existing file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_BINARY", 0), 0o600)
        if mode != 0o600:
            os.chmod(tmp, mode)
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except RuntimeError as exc:
        full = _nearly_full(path.parent)  # measured before the partial file is discarded
        _discard(tmp)
        if full:  # torch's own words for it are "unexpected pos 704 vs 598"
            raise OSError(errno.ENOSPC, f"no space left on the disk of {path.parent} (writing {path.name})") from exc
        raise OSError(f"writing {path.name} failed: {exc}") from exc
    except BaseException:  # a second Ctrl+C, a MemoryError or a pickling error mid-write too
        _discard(tmp)
        raise
    # The new file is in place from here on: a failure now must not read as "not written" (callers
    # would then prune nothing, send nothing, or take contributed.json to name the attempt before).
    try:
        fsync_dir(path.parent)  # the rename itself survives a power loss
    except OSError as exc:  # some filesystems refuse fsync on a directory (EINVAL), or a one-off EIO
        if durable and exc.errno == errno.EIO:
            raise OSError(exc.errno, f"{path.name} was written, but its directory could not be synced "
                                     f"({exc.strerror or exc}): it may not survive a power loss") from exc
        _warn_not_durable(path, exc)


def _nearly_full(folder: Path) -> bool:
    """Has the filesystem holding `folder` less than 1 MiB free (unknown: no)?"""
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def _discard(tmp: Path) -> None:
    # A temp file that cannot be removed now is removed at the next start (Participant): its
    # OSError must not replace the error that stopped the write.
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


_WARNED: set[tuple[Path, int | None]] = set()  # (directory, errno) already warned about


def _warn_not_durable(path: Path, exc: OSError) -> None:
    # Once per directory and error: a filesystem that always refuses would repeat it every round.
    key = (path.parent, exc.errno)
    level = logging.DEBUG if key in _WARNED else logging.WARNING
    _WARNED.add(key)
    log.log(level, "%s was written, but its directory could not be synced (%s): the write may not "
            "survive a power loss", path.name, exc)


def checkpoint_path(state_dir: Path, round_id: int) -> Path:
    """Where the checkpoint of `round_id` goes (names sort by round)."""
    return state_dir / f"checkpoint-{round_id:08d}.pt"


def checkpoints_newest_first(state_dir: Path) -> list[Path]:
    """The checkpoints in `state_dir`, newest round first."""
    return sorted(state_dir.glob("checkpoint-*.pt"), reverse=True)


def prune_checkpoints(just_written: Path, keep: int, damaged: Collection[Path] = (),
                      unreadable: Collection[Path] = ()) -> None:
    """Keep `just_written` and the newest keep-1 readable ones before it. A file that sorts after
    it (an unreadable newer checkpoint this run resumed past) never counts towards `keep`:
    counting it deleted the checkpoint just written. An older one that is not whole, or that the
    loader found `damaged` (its digest), is deleted and does not count either: counting it deleted
    the last good one (the one resumed from). One that could not be read (the loader's
    `unreadable`: torch.load failed on a whole archive, or a read error here: EIO, EACCES) is no
    proof of damage: it is kept, but not counted."""
    older = sorted((p for p in just_written.parent.glob("checkpoint-*.pt") if p.name < just_written.name),
                   reverse=True)
    kept = 1
    for old in older:
        if kept >= keep:  # enough good ones newer than it
            _remove_old(old)
            continue
        whole = False if old in damaged else _whole(old)
        if whole and old in unreadable:
            whole = None  # an archive torch.load could not read now: kept, not counted
        if whole:
            kept += 1
        elif whole is False:
            _remove_old(old)


def _remove_old(path: Path) -> None:
    """Delete an old checkpoint; one that cannot be (EPERM, EBUSY) is left, with a warning: the
    one just written is on disk, and a cleanup that failed must not stop the run (it did)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not delete old checkpoint %s (%s); it is left", path, exc.strerror or exc)


def _whole(path: Path) -> bool | None:
    """Is `path` an archive torch.load can open? False if cut short or garbled by a crash or a
    full disk (torch.save writes zip archives); None on a read error (EIO, EACCES: no proof either
    way). Reads only the zip directory at its end, not the tensors: a flipped byte inside them is
    for the loader's digest to find."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, EOFError, ValueError):
        return False
    except OSError:
        return None


_WRITTEN_HERE = ("checkpoint-*", "work", "contributed", "outcome", "manifest", "bootstrap", "address", "known_peers",
                 "volunteer", "genesis")
# write_atomically's X.tmp (before) and X.RANDOM.tmp (8 hex digits, as `_OURS` checks: not another
# program's manifest.json.tmp), Identity.save's .identity.key.RANDOM.tmp
_OUR_TEMP_FILES = (*(f"{x}.tmp" for x in _WRITTEN_HERE), *(f"{x}.*.tmp" for x in _WRITTEN_HERE), ".*.key.*.tmp")
_OURS = re.compile(r"(checkpoint-\d+|work|contributed|outcome|manifest|bootstrap|address|known_peers|volunteer|genesis)"
                   r"(\.[0-9a-f]{8})?\.tmp|\..+\.key\..+\.tmp")


def remove_half_written(state_dir: Path) -> None:
    """Remove the half-written files a process killed mid-write left in `state_dir`
    (write_atomically's temp file for each file written there, Identity.save's
    .identity.key.*.tmp). No other groundswell process writes there (the CLI holds the state
    dir's lock, locks.py). Only our own names: a state dir may be a folder other programs write
    their *.tmp files in too."""
    for stale in [p for pattern in _OUR_TEMP_FILES for p in state_dir.glob(pattern) if _OURS.fullmatch(p.name)]:
        try:
            stale.unlink(missing_ok=True)
        except OSError:  # an unwritable state dir is reported when we first write to it
            pass


def load_torch_file(path: Path) -> Any:
    """`torch.load` (weights only, onto the CPU) of a file torch.save wrote; ValueError first if any
    of its zip entries is compressed, as torch.save never writes them: a made-up file's could
    inflate to any size in torch.load (a review's 98 KB file loaded as 100 MB)."""
    import torch

    try:
        with zipfile.ZipFile(path) as archive:
            packed = [info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED]
    except zipfile.BadZipFile as exc:
        raise ValueError(f"not an archive torch.save wrote ({exc})") from None
    if packed:
        raise ValueError(f"{packed[0][:80]} in it is compressed: not a file torch.save wrote")
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    size = path.stat().st_size
    distinct, listed = _tensor_bytes(loaded)
    if distinct > 4 * size + (64 << 20) or listed > 64 * size + (64 << 20):
        raise ValueError(f"its tensors span {max(distinct, listed):,} bytes, far more than the file's: not a checkpoint "
                         "groundswell wrote (a tensor expanded over a few bytes, or listed a great many times?)")
    return loaded


def _tensor_bytes(obj: Any) -> tuple[int, int]:
    """The bytes a loaded file's tensors take once each is made whole, each view counted once and
    as often as it is listed: the digest check makes each listed tensor whole and hashes it. A 2
    KB file held a tensor of 2**28 values on 4 bytes of storage, `expand`ed, and the check took
    1 GiB for it (a review, 2026-12-07); a file may list one tensor a million times for almost
    nothing, or nest a list in itself twice 40 times over. An honest one's views are within a
    few times its size (a model's small expanded buffers), and a model's state dict lists a
    shared block once per use (24 for a universal transformer's: a third review)."""
    import torch

    seen: set[tuple] = set()
    walked: dict[int, int] = {}  # a container met again (pickle shares them) -> its listed bytes
    distinct = 0

    def walk(item: Any) -> int:
        nonlocal distinct
        if isinstance(item, torch.Tensor):
            nbytes = item.numel() * item.element_size()
            view = (item.untyped_storage().data_ptr(), item.storage_offset(), tuple(item.shape), item.stride())
            if view not in seen:
                seen.add(view)
                distinct += nbytes
            return nbytes
        if not isinstance(item, (dict, list, tuple)):
            return 0
        if id(item) not in walked:
            walked[id(item)] = sum(map(walk, [*item.keys(), *item.values()] if isinstance(item, dict) else item))
        return walked[id(item)]

    try:
        listed = walk(obj)
    except RecursionError:  # nested deeper than Python recurses: the digest check refuses it as damaged
        return 0, 0
    return distinct, listed


def parse_json(text: str | bytes) -> Any:
    """`json.loads`, with nesting too deep for it (a hostile file: a RecursionError) a ValueError
    like every other malformed file, for the callers' one except."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def make_state_dir(state_dir: Path) -> None:
    """Create --state-dir, or say in one line, naming the flag, why it cannot be."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"--state-dir {state_dir} is a file, not a folder")
    parent = state_dir.absolute().parent
    above = next((p for p in state_dir.absolute().parents if p.exists() and not p.is_dir()), None)
    if above is not None:
        raise ConfigError(f"--state-dir {state_dir} cannot be created: {above} is a file, not a folder")
    if not state_dir.exists() and not parent.exists():  # one folder is made, not a whole mistyped path
        raise ConfigError(f"--state-dir {state_dir}: {parent} does not exist (a typo?): create it first")
    try:
        made = not state_dir.exists()
        state_dir.mkdir(mode=0o700, exist_ok=True)  # private: a closed run's weights
    except OSError as exc:  # a file above it, no permission, a read-only disk
        above = next((p for p in state_dir.parents if p.exists() and not p.is_dir()), None)
        why = f"{above} is a file, not a folder" if above is not None else exc.strerror or str(exc)
        raise ConfigError(f"--state-dir {state_dir} cannot be created: {why}") from None
    if made:  # its entry in the parent too: a genesis made durable in it must not lose its folder
        try:
            fsync_dir(parent)
        except OSError as exc:  # (a filesystem that refuses, a parent we may write but not read)
            _warn_not_durable(state_dir, exc)
    refuse_shared_state_dir(state_dir)


def refuse_shared_state_dir(state_dir: Path) -> None:
    """ConfigError if another local user may write in `state_dir` (an existing one too): such a
    user plants links where our files go, or a checkpoint of their choosing that a coordinator
    would resume from and serve (the default --state-dir is relative: started from /tmp, it is a
    folder anyone may have made first). That is a folder every user may write to, or another
    user's (its owner may). A group-writable one passes: umask 002 makes them so, for a group of
    the user alone on most systems. Root may use any folder (a container's, mounted from its host)."""
    if not hasattr(os, "getuid") or os.getuid() == 0:  # (not on POSIX; root is trusted with its folders)
        return
    for path in (state_dir.absolute(), *state_dir.absolute().parents):
        # A link another user made may point at a folder of ours now, which passes below, and at
        # one of theirs once we run: every file would then go there (found by a review).
        with contextlib.suppress(OSError):
            link = path.lstat()
            if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.getuid()):
                raise ConfigError(f"--state-dir {state_dir} goes through {path}, a link another user made (they may "
                                  "point it elsewhere at any time): use a folder of your own")
    st = state_dir.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"--state-dir {state_dir} is another user's: use a folder of your own")
    if st.st_mode & 0o002 and not st.st_mode & 0o1000:  # (a sticky one protects only existing names)
        raise ConfigError(f"--state-dir {state_dir} is writable by every user (mode {st.st_mode & 0o777:o}): "
                          f"use a folder only you can write to (chmod o-w {state_dir}; on a filesystem without "
                          "permissions, such as vfat, a folder on another disk)")
    if st.st_mode & 0o002:
        raise ConfigError(f"--state-dir {state_dir} is a shared folder (mode {st.st_mode & 0o7777:o}): use a folder "
                          "of your own in it")
