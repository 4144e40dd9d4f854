"""Whose work a volunteer's state dir holds: one peer's, in one run.

What a volunteer keeps there is bound to who sent it and where: its unsent work (error feedback),
its contributions whose outcome was still open, and checkpoints of one run's global state. A
restart under another identity would read a contribution the round counted under the old peer id
as "not counted" and send that work again, so the swarm would apply it twice; a run of another
coordinator that happens to share the run id would take the old run's checkpoint for its own. So
the first `join` writes `volunteer.json` (peer id, coordinator, run id) into the state dir, once
the checkpoint there (if any) is accepted for the run, and a later one that differs in any of them
is refused before anything there is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ConfigError
from .state_files import parse_json, write_atomically

VOLUNTEER_FILE = "volunteer.json"


def check_volunteer_dir(state_dir: Path, peer_id: str, coordinator_id: str, run_id: str,
                        manifest: str = "") -> bool:
    """ConfigError if `state_dir` is bound to another peer, coordinator, run or launch of the run
    (`manifest`: the signed manifest's digest; or its binding is unreadable), naming what differs
    and what to do; True if it is bound to none yet, or bound by an older version that recorded
    no manifest (then `bind_volunteer_dir` once its checkpoint is accepted)."""
    have = _binding(state_dir)
    if have is None:
        _check_unbound(state_dir, peer_id)
        return True
    _check_peer(state_dir, have, peer_id)
    if (have["coordinator"], have["run_id"]) != (coordinator_id, run_id):
        raise ConfigError(f"{state_dir} holds run {have['run_id']!r} of coordinator {have['coordinator']}, not run "
                          f"{run_id!r} of {coordinator_id}: use another --state-dir for this run")
    if manifest and have.get("manifest", manifest) != manifest:
        # A coordinator resuming its run signs the same manifest again; another one under the same
        # run id and key is a new launch (a new genesis, other settings): our checkpoint is not of it.
        raise ConfigError(f"{state_dir} holds the work of another launch of run {run_id!r} (its coordinator's "
                          "manifest changed since: started anew, or with other settings): use another --state-dir "
                          f"(keeping this peer's key with --identity {state_dir / 'identity.key'})")
    return bool(manifest) and not isinstance(have.get("manifest"), str)


def bound_launch(state_dir: Path, coordinator_id: str) -> str | None:
    """The launch (manifest digest; "" if the binding predates them) `state_dir` is bound to if it
    is a run of `coordinator_id` (its known peers are that run's), else None."""
    have = _binding(state_dir)
    if have is None or have["coordinator"] != coordinator_id:
        return None
    return have.get("manifest") if isinstance(have.get("manifest"), str) else ""


def bind_volunteer_dir(state_dir: Path, peer_id: str, coordinator_id: str, run_id: str, manifest: str = "") -> None:
    """Write the binding (after the state dir's checkpoint was accepted for this run: a join
    refused for another run's checkpoint must not bind the folder to itself)."""
    binding = {**dict(zip(_KEYS, (peer_id, coordinator_id, run_id))), **({"manifest": manifest} if manifest else {})}
    write_atomically(state_dir / VOLUNTEER_FILE, lambda f: f.write((json.dumps(binding) + "\n").encode()))


def not_a_coordinator_dir(state_dir: Path) -> None:
    """Refuse a coordinator's state dir (it holds the run's signed manifest): the volunteer's
    checkpoints would be pruned in among the coordinator's, and the coordinator could no longer
    resume there (a volunteer's dir is refused to `launch`)."""
    if (state_dir / "manifest.signed").exists():
        raise ConfigError(f"{state_dir} is a coordinator's state dir (manifest.signed): join with another --state-dir")


def check_volunteer_identity(state_dir: Path, identity_given: bool) -> None:
    """Before the identity is read (or made): a dir bound to a peer whose identity.key is gone is
    refused unless --identity names one, rather than making a new key there and starting the
    network only to refuse it afterwards."""
    have = _binding(state_dir)
    if have is not None and not identity_given and not (state_dir / "identity.key").exists():
        raise ConfigError(f"{state_dir} holds the work of peer {have['peer_id']}, but its identity.key is gone: "
                          "join with that peer's --identity, or use another --state-dir")


def check_volunteer_peer(state_dir: Path, peer_id: str) -> None:
    """The peer half of `check_volunteer_dir`, before the network starts."""
    have = _binding(state_dir)
    if have is not None:
        _check_peer(state_dir, have, peer_id)


def _binding(state_dir: Path) -> dict[str, str] | None:
    """The dir's binding (None: unbound); ConfigError if it is unreadable."""
    path = state_dir / VOLUNTEER_FILE
    if not path.exists():
        return None
    try:
        have = parse_json(path.read_bytes()[:4096])
        if not isinstance(have, dict) or not all(isinstance(have.get(k), str) for k in _KEYS):
            raise ValueError("not a volunteer binding")
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{path} is unreadable ({exc}): move it away if this state dir is yours") from None
    return have


def _check_peer(state_dir: Path, have: dict[str, str], peer_id: str) -> None:
    if have["peer_id"] != peer_id:
        raise ConfigError(f"{state_dir} holds the work of peer {have['peer_id']}, not of this identity "
                          f"({peer_id}): join with that peer's --identity, or use another --state-dir")


_KEYS = ("peer_id", "coordinator", "run_id")


def _check_unbound(state_dir: Path, peer_id: str) -> None:
    """A folder an older version left unbound: its unsent work is its own identity's, if it holds any."""
    from groundswell.protocol.identity import Identity, IdentityError

    from .work_file import CONTRIBUTED_FILE, WORK_FILE

    own = state_dir / "identity.key"
    if not own.exists() or not any((state_dir / name).exists() for name in (WORK_FILE, CONTRIBUTED_FILE)):
        return
    try:
        theirs = Identity.load(own).peer_id
    except (IdentityError, OSError, ValueError):
        return  # not readable: nothing to compare with (the join itself says what is wrong with it)
    if theirs != peer_id:
        raise ConfigError(f"{state_dir} holds the work of peer {theirs} (its identity.key), not of this identity "
                          f"({peer_id}): join without --identity, or use another --state-dir")
