"""A volunteer restarting from its own checkpoint: the global state it had, the swarm's newer one,
and the work it had not sent yet (SparseLoCo's error feedback, local progress), which it takes
back unless the process before it may have sent that work already."""

from __future__ import annotations

import logging
from typing import Any

import torch
from groundswell.compression import all_finite
from groundswell.optim import SparseLoCo, copy_into_parameters
from groundswell.protocol.client import RoundBehind
from groundswell.protocol.schema import ProtocolError
from groundswell.protocol.shards import ships_contributions
from groundswell.protocol.transport import PeerUnavailable

from .catch_up import catch_up_view
from .config import ConfigError
from .net_errors import NetworkError
from .participant import Participant
from .run_state import GlobalState
from .state_download import StateTooSlow
from .state_trust import ModelMismatch, NoNewerState
from .unsettled import parse_unsettled
from .work_file import (
    CONTRIBUTED_FILE,
    WORK_FILE,
    contribution_unknown,
    read_contributed,
    read_work,
    resumable_work,
    unreadable_marker_digest,
)

log = logging.getLogger(__name__)


def resume_and_sync(p: Participant, bootstrap_peers: list[str]) -> dict | None:
    """Resume from our own checkpoint if there is one, then bring the state up to the swarm's;
    returns the checkpoint (None: a fresh start)."""
    resumed = p.load_checkpoint()
    loaded = resumed is not None and resumed.get("outer") is not None
    if resumed is None:  # no checkpoint, or none readable: work.pt may still hold work not sent yet
        resumed = _work_without_a_checkpoint(p)
    if loaded:
        p.load_global(GlobalState(resumed["round"], resumed["tensors"], resumed["decision"]))
        record = _work_record(p)
        unsettled = None
        if record is not None:
            # the newest record, whichever state we take: our checkpoints name it, so that a
            # later restart knows they are newer than it (see work_file.resumable_work)
            p.work_token = record.token
            unsettled = resumable_work(record, p.state_dir, resumed.get("settled"), resumed.get("work"))
        if record is not None and unsettled is not None:  # newer than the checkpoint: as of our last contribution
            p.outer.error = record.error.to(p.outer.global_params.device)
            resumed.pop("local_progress", None)  # trained before that contribution: in its error feedback
            resumed["inner_progress"] = record.progress  # and the batches it was trained on are behind us
            resumed["unsettled"] = unsettled
            p.events.write("work-restored", round=record.round_id, unsettled=[i["round"] for i in unsettled],
                           peer=p.identity.peer_id)
        elif not _unsent_work_is_ours(p, resumed):
            resumed.pop("local_progress", None)
            resumed.pop("unsettled", None)  # their work is not ours any more either
        elif resumed["outer"].get("algorithm") == "sparseloco":  # our own error feedback: work not yet sent
            p.outer.error = resumed["outer"]["error"].to(p.outer.global_params.device)
        p.events.write("resume", round=p.outer.round_id, peer=p.identity.peer_id)
    if loaded and not resumed.get("foreign") and _caught_up_from_checkpoint(p):
        return resumed  # (another peer's checkpoint, maybe made up: checked against a downloaded state)
    try:
        p.sync_state(bootstrap_peers, min_round=p.outer.round_id if loaded else -1)
    except NoNewerState as exc:
        if not loaded:
            raise NetworkError(f"no peer has the run's state yet ({exc}); start again in a moment") from None
        # Every peer that answered is behind our checkpoint (a coordinator restarted from an
        # older one, say): the run goes on from here, and our state is the one others take.
        log.warning("%s: carrying on from our checkpoint of round %d", exc, p.outer.round_id)
        p.events.write("resume-ahead", round=p.outer.round_id, peer=p.identity.peer_id)
    except ModelMismatch as exc:
        raise ConfigError(f"{exc}; join with --data naming a copy of the run's own dataset") from None
    except StateTooSlow as exc:  # not the run's fault, and starting again fails alike
        raise NetworkError(f"{exc}; this link seems slower (see \"What a volunteer's link needs\" in peer/README.md)") from None
    except (PeerUnavailable, TimeoutError, ProtocolError) as exc:  # ProtocolError: the state's decision raced our book
        raise NetworkError(f"could not download the run's state from any peer ({exc or 'timed out'}); "
                           "is the run still up? Start again to retry") from None
    return resumed


def _caught_up_from_checkpoint(p: Participant) -> bool:
    """Bring the checkpoint's state up to the swarm's with the aggregates of the rounds since (peers
    keep the last few): True if that got it to where the coordinator's record (else most peers')
    says the run is, with its hashes compared and agreeing; False (a state download then)
    otherwise, or where those aggregates would come to more bytes than the state. A restart used
    to download the whole state every time, though its own was current or a round behind (a
    review, 2026-12-07: ~800 MB at 100m, for a few aggregates' worth)."""
    me = p.identity.peer_id
    try:
        view = catch_up_view(p.fresh_records(), me, p.coordinator_id)
        if not any(pid != me for pid in view.records):
            return False  # nobody's record to tell where the run is
        rounds, state = max(0, view.target - p.outer.round_id), _state_bytes(p)
        if rounds * _aggregate_bytes(p, view) > state:
            log.info("%d rounds of aggregates would come to more than the state (%d MB): downloading it",
                     rounds, state >> 20)
            return False
        applied = p.catch_up(fresh=False)
        if p.outer.round_id < view.target:
            return False  # rounds no peer could give us
        if not p.agrees_with_swarm(vacuous=False):
            if not p.agrees_with_swarm():  # (else: no record shares a round with ours, nothing compared)
                p.events.write("hash-mismatch", round=p.outer.round_id, peer=me)
            return False
    except (PeerUnavailable, RoundBehind, TimeoutError, ProtocolError) as exc:
        log.info("could not catch up from our checkpoint (%s); downloading the state", exc)
        return False
    # ("sync": where the peer took the run's state, for the simulation's reports and driver)
    p.events.write("sync", round=p.outer.round_id, hash=p.outer_hash(), via="catch-up", rounds=applied, peer=me)
    return True


def _state_bytes(p: Participant) -> int:
    """What a state download of this run carries: fp32 parameters, and DiLoCo's momentum."""
    return 4 * p.outer.global_params.numel() * (1 if isinstance(p.outer, SparseLoCo) else 2)


def _aggregate_bytes(p: Participant, view: Any) -> int:
    """The most one round's aggregate can take: one mean, or, where aggregates carry the signed
    contributions (sparse codecs), one per peer training now."""
    trainers = sum(1 for r in view.records.values() if getattr(r, "trains", False))
    return p.ctx.max_payload_bytes * (max(trainers, 1) if ships_contributions(p.ctx) else 1)


def _work_record(p: Participant):
    """work.pt's record of our newest contribution (SparseLoCo with a state dir; None if none, or
    unusable: reported)."""
    if not isinstance(p.outer, SparseLoCo) or p.state_dir is None:
        return None
    work_path = str(p.state_dir / WORK_FILE)
    return read_work(p.state_dir, p.outer.global_params.numel(), lambda why: p.events.write(
        "work-corrupt", path=work_path, error=why, peer=p.identity.peer_id))


def _work_without_a_checkpoint(p: Participant) -> dict | None:
    """With no readable checkpoint, the work a record holds that matches contributed.json: its error
    feedback (put back now: a state download keeps it), where training was, and the contributions to
    settle late, as a `resumed` dict with no state of its own (`work_only`); None if there is none.
    Without this, a volunteer whose checkpoints were all damaged lost its unsent work and trained
    its batches again, which counted them twice."""
    record = _work_record(p)
    if record is None:
        return None
    unsettled = resumable_work(record, p.state_dir, None, None)
    if unsettled is None:
        return None
    p.work_token = record.token
    p.outer.error = record.error.to(p.outer.global_params.device)
    p.events.write("work-restored", round=record.round_id, unsettled=[i["round"] for i in unsettled],
                   checkpoint=None, peer=p.identity.peer_id)
    return {"work_only": True, "round": record.round_id, "inner_progress": record.progress, "unsettled": unsettled}


def unsettled_from(resumed: dict) -> list[dict[str, Any]]:
    """The contributions of unknown outcome a checkpoint or work record lists (`unsettled_item`s;
    a malformed list is reported and ignored)."""
    try:
        return parse_unsettled(resumed.get("unsettled") or [])
    except ValueError as exc:
        log.warning("the checkpoint's %s; ignoring it", exc)
        return []


def _unsent_work_is_ours(p: Participant, resumed: dict) -> bool:
    """May the work a checkpoint holds that was not sent yet (SparseLoCo's error feedback, local
    progress) be sent now? Not if the process before us contributed after that checkpoint: what it
    sent came out of that work and may be in the swarm's parameters already, and sending it again
    would count it twice. Dropping it loses only what had not been sent."""
    holds_work = "local_progress" in resumed or resumed["outer"].get("algorithm") == "sparseloco" \
        or bool(resumed.get("unsettled"))
    if holds_work and p.state_dir is not None and contribution_unknown(read_contributed(p.state_dir)):
        damaged = unreadable_marker_digest(p.state_dir)  # (None if its bytes cannot be read either)
        if damaged is not None and resumed.get("settled_unreadable") == damaged:
            # written after a restart saw this very file damaged and dropped the work before it:
            # what it holds was made since, and nothing went out since (that rewrites the file)
            log.info("%s is unreadable as the checkpoint of round %d found it: its work is kept",
                     CONTRIBUTED_FILE, resumed["round"])
            return True
        # contributed.json is damaged: whatever went out since the checkpoint cannot be told apart
        # from what did not, so none of it is sent again (sent twice, it would count twice).
        p.events.write("unsent-work-dropped", round=resumed["round"], contributed=None, peer=p.identity.peer_id)
        log.warning("the unsent work of the round-%d checkpoint is dropped: %s cannot be read, so it may "
                    "have gone out already", resumed["round"], CONTRIBUTED_FILE)
        return False
    contributed = p._contributed_before()
    sent_since = [r for r in contributed if r >= resumed["round"]]
    if not sent_since or not holds_work:
        return True
    if contributed and resumed.get("settled") == contributed:
        # Written after that contribution's outcome was known and taken into the state (a retry,
        # the usual last round of a Ctrl+C while a run fills up): its work is still ours.
        return True
    p.events.write("unsent-work-dropped", round=resumed["round"], contributed=sent_since[0], peer=p.identity.peer_id)
    log.warning("the unsent work of the round-%d checkpoint is dropped: round %d was contributed since",
                resumed["round"], sent_since[0])
    return False


def restore_progress(p: Participant, trainer: Any, progress: dict) -> bool:
    """Move the inner trainer (loaded from an older checkpoint) on to where the work record says
    training was: the data position and schedule of our last contribution, whose batches are in
    the error feedback restored from it (trained again, they would count twice). False if the
    record's progress does not fit (then training goes on from the checkpoint's position)."""
    try:
        trainer.load_progress_state(progress)
    except (KeyError, ValueError, TypeError) as exc:
        log.warning("the work record's training position does not fit (%s); going on from the checkpoint's", exc)
        return False
    p.events.write("progress-restored", step=trainer.step, peer=p.identity.peer_id)
    return True


def restore_local_progress(p: Participant, resumed: dict) -> bool:
    """Put a checkpoint's local progress back on top of the global parameters; False if it has none
    (or none that fits this model)."""
    progress = resumed.get("local_progress")
    if not isinstance(progress, torch.Tensor) or progress.shape != p.outer.global_params.shape \
            or progress.dtype != torch.float32 or not all_finite(progress):
        return False
    copy_into_parameters(p.outer.global_params + progress.to(p.outer.global_params.device), p.outer.params)
    p.events.write("local-progress-restored", round=p.outer.round_id, norm=float(progress.norm()),
                   peer=p.identity.peer_id)
    return True


def torch_load_params(p: Participant) -> None:
    """After restoring the inner state, the model's parameters restart from the global ones."""
    copy_into_parameters(p.outer.global_params, p.outer.params)
