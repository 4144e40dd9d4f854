"""A participant's checkpoints: written atomically after rounds, read back at start (the newest
whole one of this run and model), and pruned to the newest few. A mixin of `Participant`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from groundswell.protocol.envelope import unseal
from groundswell.protocol.schema import Decision, ProtocolError

from .checkpoint_check import (
    DIGEST_KEY,
    checkpoint_damage,
    checkpoint_digest,
    checkpoint_layout,
    digest_mismatch,
)
from .config import ConfigError
from .dht_rejoin import save_known_peers
from .state_files import (
    checkpoint_path,
    checkpoints_newest_first,
    load_torch_file,
    prune_checkpoints,
    write_atomically,
)
from .work_file import unreadable_marker_digest

log = logging.getLogger(__name__)
KNOWN_PEERS_FILE = "known_peers.json"  # where the run's peers were, kept with each checkpoint (see dht_rejoin)


class CheckpointMismatch(ConfigError):
    """The state dir holds a checkpoint of another run or model: a message for the user."""


class Checkpoints:
    """`save_checkpoint`, `load_checkpoint` and `preload_checkpoint` of a `Participant`, whose
    state dir, outer optimizer, snapshot, node, event log and bookkeeping they use."""

    state_dir: Path | None
    outer: Any
    manifest: Any
    node: Any
    events: Any
    identity: Any
    work_token: str
    last_checkpoint: Path | None
    last_save_failed: bool
    _snapshot: Any
    _preloaded: tuple[dict[str, Any] | None] | None
    _damaged: set[Path]
    _unreadable: set[Path]
    _global_state: Any
    _contributed_before: Any

    def save_checkpoint(self, extra: dict[str, Any] | None = None, settled: bool = False,
                        unpublished: bool = False) -> Path | None:
        """Atomically write the state (write to a temp file, fsync, rename); keep the newest few.
        A failure (disk full, read-only dir) is reported and training goes on from memory.
        `settled`: every contribution made so far has a known outcome taken into this state, or is
        listed in `extra["unsettled"]` to be settled late (the checkpoint then records the last
        one, and a restart keeps the work it holds). `unpublished`: the state as it is now, before
        any `snapshot` served it (a run's genesis must be on disk before anyone can take it)."""
        if self.state_dir is None or (self._snapshot is None and not unpublished):
            return None
        snap = self._global_state() if unpublished else self._snapshot
        if snap is None:
            return None
        if snap.round != self.outer.round_id and self.outer.pending is None:
            # A round applied since the last snapshot (the network failed in between, or a second
            # Ctrl+C): its parameters with the optimizer state of the round after would be a file
            # of two rounds, so the state is taken as it is now.
            snap = self._global_state()
            if snap is None or snap.round != self.outer.round_id:
                log.error("checkpoint not written: the state in hand is not of round %d", self.outer.round_id)
                return None
        path = checkpoint_path(self.state_dir, self.outer.round_id)
        state = {"round": snap.round, "peer": self.identity.peer_id, "tensors": snap.tensors, "decision": snap.decision,
                 "outer": self.outer.state_dict() if self.outer.pending is None else None, **(extra or {})}
        if settled and self.outer.pending is None:
            state["settled"] = self._contributed_before()  # what contributed.json says now
            damaged = unreadable_marker_digest(self.state_dir)
            if damaged is not None:  # seen damaged, and its work dropped, before this state was taken
                state["settled_unreadable"] = damaged
            state["work"] = self.work_token  # the newest work.pt written before it (see work_file)
        if self.outer.pending is None:
            # Local work not yet in anyone's hands (a left-out DiLoCo contribution, rebased; what
            # was trained while a round was exchanged): a restart resumes it instead of losing it.
            progress = (self.outer.local_vector() - self.outer.global_params).cpu()
            if bool(progress.any()):
                state["local_progress"] = progress
        state[DIGEST_KEY] = checkpoint_digest(state)  # a flipped byte loads; this does not match then
        try:
            # a genesis must survive a power loss before it is served (durable: else refused)
            write_atomically(path, lambda f: torch.save(state, f), durable=unpublished)
        except (OSError, MemoryError) as exc:  # MemoryError (torch.save's pickler): training goes on too
            why = str(exc) or type(exc).__name__  # a bare MemoryError() says nothing
            log.error("checkpoint not written (%s); training continues from memory", why)
            self.events.write("checkpoint-failed", error=why, peer=self.identity.peer_id)
            self.last_save_failed = True
            return None
        self._damaged.discard(path)  # written anew, whole: a damaged file of that name is gone
        self._unreadable.discard(path)
        prune_checkpoints(path, self.manifest.checkpoint.keep, damaged=self._damaged, unreadable=self._unreadable)
        save_known_peers(self.state_dir / KNOWN_PEERS_FILE, getattr(self.node, "rejoiner", None))
        self.last_checkpoint = path
        self.last_save_failed = False
        return path

    def preload_checkpoint(self) -> dict[str, Any] | None:
        """`load_checkpoint` now (before anything is written to the state dir: a checkpoint of
        another run is refused first); the next `load_checkpoint` returns what it found, as does this."""
        self._preloaded = (self.load_checkpoint(),)
        return self._preloaded[0]

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The newest readable checkpoint in the state dir (corrupt ones are reported, skipped);
        CheckpointMismatch if it belongs to another run or model (nothing is overwritten then)."""
        if self._preloaded is not None:
            found, self._preloaded = self._preloaded[0], None
            return found
        if self.state_dir is None:
            return None
        for path in checkpoints_newest_first(self.state_dir):
            try:
                state = load_torch_file(path)
            except Exception as exc:  # noqa: BLE001 (torch raises many types for a truncated or garbled file)
                log.error("checkpoint %s is unreadable (%s); trying an older one or the swarm", path.name, exc)
                # Not counted as a checkpoint kept, but not deleted either: a read error (EIO,
                # EACCES), memory running out or a torch too old for it may pass. (One whose
                # archive is cut short or garbled is deleted when pruning: that is no passing error.)
                self._unreadable.add(path)
                self.events.write("checkpoint-corrupt", path=str(path), peer=self.identity.peer_id)
                continue
            try:  # (a file nested deeper than Python recurses: a volunteer's copy may be anyone's)
                problem = digest_mismatch(state) or checkpoint_layout(state)
            except RecursionError:
                problem = "it is nested deeper than any checkpoint"
            if problem is None:
                self._check_fits(state, path)  # another run's or model's: refused, not skipped
                problem = checkpoint_damage(state, self.outer.global_params.numel())
            if problem is not None:
                log.error("checkpoint %s is damaged (%s); trying an older one or the swarm", path.name, problem)
                self._damaged.add(path)
                self.events.write("checkpoint-corrupt", path=str(path), error=problem, peer=self.identity.peer_id)
                continue
            if state.get("peer", self.identity.peer_id) != self.identity.peer_id:
                return self._global_part(state, path)
            return state
        return None

    def _global_part(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Only the global state of another peer's checkpoint (copied in, say, to spare a download):
        its unsent work (error feedback, local progress, open contributions) is that peer's to send,
        and taken here it was sent twice, once by each (a review, 2026-12-07); its inner state and
        data position are of that peer's data too."""
        log.warning("checkpoint %s was written by another peer (%s): only its global state is taken",
                    path.name, str(state["peer"])[-8:])
        self.events.write("checkpoint-foreign", path=str(path), writer=state["peer"], peer=self.identity.peer_id)
        outer = {k: v for k, v in state["outer"].items() if k != "error"} if isinstance(state.get("outer"), dict) \
            else state.get("outer")
        if isinstance(outer, dict) and outer.get("algorithm") == "sparseloco":  # a fresh one: no work of ours yet
            outer["error"] = torch.zeros_like(self.outer.global_params, device="cpu")
        return {k: v for k, v in state.items() if k in ("round", "tensors", "decision")} | {"outer": outer, "foreign": True}

    def _check_fits(self, state: dict[str, Any], path: Path) -> None:
        """CheckpointMismatch unless a checkpoint is of this run (its decision's envelope) and model."""
        where = f"{path.parent} holds a checkpoint ({path.name})"
        try:
            unseal(state["decision"], self.manifest.run.id, Decision)
        except ProtocolError as exc:
            raise CheckpointMismatch(f"{where} of another run or protocol version ({exc}): use another "
                                     "--state-dir for this one") from None
        except (KeyError, TypeError) as exc:
            raise CheckpointMismatch(f"{where} this version cannot read ({exc!r})") from None
        params = state.get("tensors", {}).get("global_params")
        want = self.outer.global_params.numel()
        if not isinstance(params, torch.Tensor) or params.numel() != want:
            have = f"{params.numel():,}" if isinstance(params, torch.Tensor) else "no"
            raise CheckpointMismatch(f"{where} with {have} parameters; this run's model has {want:,} (the "
                                     "manifest's model changed?): use another --state-dir")
