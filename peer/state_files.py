"""Files in a peer's --state-dir that must survive a crash or a power loss: written atomically
(temp file, fsync, rename, fsync of the directory), old checkpoints pruned without ever touching
the one just written."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (POSIX: the directory entry needs its own fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` through `write(file)` so that it holds either its old or its whole new content,
    even after a power loss; OSError (disk full, read-only dir) leaves no temp file behind.
    torch.save reports a full disk as a RuntimeError from its zip writer: that is an OSError here."""
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself survives a power loss
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    except RuntimeError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(f"writing {path.name} failed: {exc}") from exc


def checkpoint_path(state_dir: Path, round_id: int) -> Path:
    """Where the checkpoint of `round_id` goes (names sort by round)."""
    return state_dir / f"checkpoint-{round_id:08d}.pt"


def checkpoints_newest_first(state_dir: Path) -> list[Path]:
    """The checkpoints in `state_dir`, newest round first."""
    return sorted(state_dir.glob("checkpoint-*.pt"), reverse=True)


def prune_checkpoints(just_written: Path, keep: int) -> None:
    """Keep `just_written` and the newest keep-1 before it. A file that sorts after it (an
    unreadable newer checkpoint this run resumed past) never counts towards `keep`: counting it
    deleted the checkpoint just written."""
    older = sorted(p for p in just_written.parent.glob("checkpoint-*.pt") if p.name < just_written.name)
    for old in older[: max(0, len(older) - (keep - 1))]:
        old.unlink(missing_ok=True)
