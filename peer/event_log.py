"""The append-only events.jsonl of a state dir: one JSON object a line, read by `simulate`,
`gpu_check.sh` and people."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class EventLog:
    """Append-only JSON lines a simulation (or a person) reads afterwards."""

    path: Path | None
    start: float = field(default_factory=time.time)

    failed: int = 0  # events that could not be written (a full disk, say): training goes on without them
    # Whether the file is known to end with a newline. A kill or a full disk can leave a last line
    # cut short; the next event would be glued to it and lost with it, so it starts a line of its own.
    _tail_whole: bool = field(default=False, repr=False)

    def write(self, kind: str, **fields: Any) -> None:
        """Append one event with a wall-clock timestamp; a failed write is logged (once) and counted."""
        if self.path is None:
            return
        line = json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n"
        try:
            with open(self.path, "ab+") as f:
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
