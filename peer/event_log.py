"""The append-only events.jsonl of a state dir: one JSON object a line, read by `simulate`,
`gpu_check.sh` and people.

Past ROTATE_BYTES it is renamed events.jsonl.1 (replacing the one before) and a new file starts,
so a long run keeps at most about two caps of it; a short run (every simulation, every test)
never reaches the cap and keeps all its events in events.jsonl. Older events: events.jsonl.1.

Every line is strict JSON (other tools' parsers refuse a bare NaN): a float that is NaN or
infinite (a diverged loss) is written as the string "NaN", "Infinity" or "-Infinity"; a value
that was not measured (a round not evaluated) is null.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
ROTATE_BYTES = 64 << 20  # a big run wrote ~1 GB a month into one file (peers x rounds of events)


@dataclass
class EventLog:
    """Append-only JSON lines a simulation (or a person) reads afterwards."""

    path: Path | None
    start: float = field(default_factory=time.time)

    failed: int = 0  # events that could not be written (a full disk, say): training goes on without them
    # Whether the file is known to end with a newline. A kill or a full disk can leave a last line
    # cut short; the next event would be glued to it and lost with it, so it starts a line of its own.
    _tail_whole: bool = field(default=False, repr=False)
    # The trainer, the network loop and worker threads all write events: two crossing the cap at
    # once would both rotate, the second replacing the first's rotated file.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def write(self, kind: str, **fields: Any) -> None:
        """Append one event with a wall-clock timestamp; a failed write is logged (once) and counted."""
        if self.path is None:
            return
        line = json.dumps(_strict({"t": time.time(), "kind": kind, **fields}), allow_nan=False) + "\n"
        with self._lock:
            self._append(line)

    def _append(self, line: str) -> None:
        assert self.path is not None
        self._rotate_if_full()
        try:
            with open(self.path, "ab+", opener=_private) as f:
                if not self._tail_whole and f.seek(0, 2) > 0:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        line = "\n" + line
                f.write(line.encode())
            self._tail_whole = True
        except OSError as exc:
            self._tail_whole = False  # part of the line may have reached the disk
            self.failed += 1
            if self.failed == 1:
                log.error("cannot write the event log %s (%s): events are dropped until it works again",
                          self.path, exc)

    def _rotate_if_full(self) -> None:
        """Rename a file past ROTATE_BYTES to events.jsonl.1; one that cannot be renamed grows on
        (an event dropped for the sake of disk space would be worse)."""
        assert self.path is not None
        try:
            if self.path.stat().st_size < ROTATE_BYTES:
                return
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        except OSError:  # not there yet (FileNotFoundError), or a folder that refuses the rename
            return
        self._tail_whole = True  # the next event starts a new, empty file


NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}  # as written, and back


def _strict(value: Any) -> Any:
    """`value` with every non-finite float replaced by its name in NONFINITE (dicts, lists, tuples)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _private(path: str, flags: int) -> int:
    """Open (create) as 0600, like the state dir's other files: events name the peers of a run.
    Never through a link (one planted where the log goes would have us append wherever it points)."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)
