"""Whose work a volunteer's state dir holds: one peer's, in one run.

What a volunteer keeps there is bound to who sent it and where: its unsent work (error feedback),
its contributions whose outcome was still open, and checkpoints of one run's global state. A
restart under another identity would read a contribution the round counted under the old peer id
as "not counted" and send that work again, so the swarm would apply it twice; a run of another
coordinator that happens to share the run id would take the old run's checkpoint for its own. So
the first `join` writes `volunteer.json` (peer id, coordinator, run id) into the state dir, and a
later one that differs in any of them is refused before anything there is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ConfigError
from .state_files import write_atomically

VOLUNTEER_FILE = "volunteer.json"


def same_volunteer_as_before(state_dir: Path, peer_id: str, coordinator_id: str, run_id: str) -> None:
    """Bind `state_dir` to this peer, coordinator and run on first use; ConfigError if it is bound
    to others (or its binding is unreadable), naming what differs and what to do."""
    path = state_dir / VOLUNTEER_FILE
    want = {"peer_id": peer_id, "coordinator": coordinator_id, "run_id": run_id}
    if not path.exists():
        write_atomically(path, lambda f: f.write((json.dumps(want) + "\n").encode()))
        return
    try:
        have = json.loads(path.read_bytes()[:4096])
        if not isinstance(have, dict) or not all(isinstance(have.get(k), str) for k in want):
            raise ValueError("not a volunteer binding")
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{path} is unreadable ({exc}): move it away if this state dir is yours") from None
    if have["peer_id"] != peer_id:
        raise ConfigError(f"{state_dir} holds the work of peer {have['peer_id']}, not of this identity "
                          f"({peer_id}): join with that peer's --identity, or use another --state-dir")
    if (have["coordinator"], have["run_id"]) != (coordinator_id, run_id):
        raise ConfigError(f"{state_dir} holds run {have['run_id']!r} of coordinator {have['coordinator']}, not run "
                          f"{run_id!r} of {coordinator_id}: use another --state-dir for this run")
