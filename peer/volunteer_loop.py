"""What a volunteer does with a round's outcome, apart from the training before it: apply the
aggregate (or recover from a retry or a re-sync), settle contributions whose outcome was learned
late, checkpoint, and catch up with the swarm. `roles.run_volunteer` drives it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from groundswell.compression import CodecError, Payload
from groundswell.optim import RoundFailed, SparseLoCo, copy_into_parameters
from groundswell.protocol.client import RoundBehind
from groundswell.protocol.schema import ProtocolError
from groundswell.protocol.transport import PeerUnavailable

from .net_loop import Stopped
from .participant import Participant
from .stop_flag import StopFlag
from .swarm_exchange import NeedResync, SwarmExchange
from .work_file import WorkJournal
from .worker import InnerStats, InnerTrainer

log = logging.getLogger(__name__)


@dataclass
class RoundInfo:
    """What the UI shows after each round."""

    round: int
    status: str  # "applied", "retry", "resync"; the coordinator's "caught-up" (rounds taken from the swarm)
    included: bool = False
    contributors: int = 0
    train_loss: float = float("nan")
    eval_loss: float = float("nan")
    bytes_sent: int = 0
    round_s: float = 0.0
    tokens_per_s: float = 0.0
    params_hash: str = ""
    peers_online: int = 0
    reason: str = ""  # why a round was retried or re-synced, in words
    eval_round: int | None = None  # the round `eval_loss` was measured after, when not `round` (a peer's record)
    superseded: bool = False  # the commit counts what a crashed process of ours sent; our own work is kept


@dataclass
class VolunteerLoop:
    """What a volunteer does with a round's outcome, apart from the training that precedes it."""

    p: Participant
    exchange: SwarmExchange
    trainer: InnerTrainer
    bootstrap_peers: list[str]
    stop: StopFlag
    on_round: Callable[[RoundInfo], None]
    journal: WorkJournal = field(default_factory=lambda: WorkJournal(None, enabled=False))
    applied: int = 0
    failures: int = 0

    def settle(self, r: int, stats: InnerStats, t0: float, t_exchange: float) -> None:
        """Collect round r and apply it, or record why not (retry, re-sync) and recover."""
        p, m = self.p, self.p.manifest
        t_collect = time.perf_counter()
        try:
            try:
                result = self.exchange.collect(r)
            finally:
                self.journal.outcome(*self.exchange.last_outcome)
        except RoundFailed as exc:
            p.outer.apply(None)
            self.failures += 1
            p.events.write("retry", round=r, reason=str(exc), peer=p.identity.peer_id)
            self.on_round(RoundInfo(r, "retry", train_loss=stats.mean_loss, reason=str(exc)))
            # An attempt that failed at once (no leader reachable) would fail the same way right
            # away: back off, doubling up to a deadline, instead of spinning.
            backoff = min(m.round.deadline_s, m.round.slack_s * 2 ** min(self.failures - 1, 8))
            self.stop.event.wait(max(0.0, backoff - (time.perf_counter() - t_exchange)))
            # the swarm may have gone on without us (stopping: save what we hold now instead)
            self._unless_stopped("catch-up", catch_up_or_resync, p, self.bootstrap_peers)
            self.settle_late()
            return
        except NeedResync as exc:
            p.outer.apply(None)
            p.events.write("resync", round=r, reason=str(exc), peer=p.identity.peer_id)
            self.stop.event.wait(m.round.slack_s)  # do not hammer peers while the swarm sorts itself out
            self._unless_stopped("re-sync", resync, p, self.bootstrap_peers)
            self.settle_late()
            self.on_round(RoundInfo(r, "resync", train_loss=stats.mean_loss, reason=str(exc)))
            return
        blocked_s = time.perf_counter() - t_collect  # training stood still this long for the network
        p.outer.apply(result)
        p.snapshot()  # first: a network failure in settle_late saves this round's state, not the last one's
        self.settle_late()  # e.g. an earlier attempt of this round that a commit counted after all
        self.applied += 1
        self.failures = 0
        evaluate = m.eval.volunteers and (r + 1) % m.eval.every_rounds == 0
        eval_loss = p.eval_global() if evaluate else float("nan")
        shown_round, shown = (r, eval_loss) if evaluate else swarm_eval_loss(p)
        info = RoundInfo(r, "applied", result.included, len(result.contributors), stats.mean_loss,
                         shown, result.bytes_sent,
                         time.perf_counter() - t0, stats.tokens / max(stats.compute_s, 1e-9),
                         p.hash_history.get(p.outer.round_id) or p.outer_hash(),
                         eval_round=shown_round if shown_round != r else None,
                         superseded=p.identity.peer_id in result.contributors and not result.included)
        if evaluate:
            p.node.update_record(loss=eval_loss, loss_round=r)
        d = self.exchange.last_decision
        p.events.write("round", round=r, included=result.included, superseded=info.superseded,
                       contributors=list(result.contributors),
                       attempt=d.attempt if d else None, leader=d.leader if d else None, hash=info.params_hash,
                       bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
                       sent_total=p.node.traffic()[0], received_total=p.node.traffic()[1],
                       state_sent_total=p.node.state_sent(),
                       train_loss=stats.mean_loss, eval_loss=eval_loss if evaluate else None, round_s=info.round_s,
                       compute_s=stats.compute_s, blocked_s=blocked_s, peer=p.identity.peer_id)
        self.on_round(info)
        if (r + 1) % m.checkpoint.every_rounds == 0:
            self.checkpoint()
        # we just applied a round: rarely behind
        self._unless_stopped("catch-up", catch_up_or_resync, p, self.bootstrap_peers, fresh=False)

    def _unless_stopped(self, what: str, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Run a catch-up or re-sync unless we are stopping, and give it up (its network calls end
        with `Stopped`) once we are: a state download may take many minutes, and a Ctrl+C then
        waited for it, or a second press skipped the checkpoint and the departure. Nothing is
        half-applied: each round or state is taken whole once fetched, and the rest is left to
        the next start."""
        if self.stop:
            return
        self.p.node.interrupt_calls_on(self.stop.event)
        try:
            fn(*args, **kwargs)
        except Stopped:
            log.info("stopping: the %s is left for the next start", what)
        finally:
            self.p.node.interrupt_calls_on(None)


    def checkpoint(self) -> None:
        """Save the state with the contributions whose outcome is still open: each is settled late
        after a restart, so the checkpoint counts as settled (its work stays ours)."""
        self.p.save_checkpoint({"inner": self.trainer.state_dict(), "unsettled": self.exchange.unsettled_work()},
                               settled=True)

    def settle_late(self) -> None:
        """Our contributions whose outcome we did not know when their round was settled (kept as
        our work) are, once the global parameters are past their round, checked against that
        round's commit: one it counted is taken out of our work, or it would be sent again.
        Once we are stopping, only with what this peer holds (each request may take its timeout):
        one whose commit is not in our book stays open in the checkpoint written on the way out,
        for the next start; one whose clipping is not known here is taken out whole."""
        local = bool(self.stop)
        check_again: list = []
        items = self.exchange.take_unsettled(self.p.outer.round_id)
        settled = 0
        if not local:  # a stop pressed meanwhile ends the requests (each may take its timeout)
            self.p.node.interrupt_calls_on(self.stop.event)
        try:
            for item in items:
                if not self._settle_one(item, local):
                    check_again.append(item)
                settled += 1
        except UndecodableWork as exc:
            self._drop_unsent_work(exc)
            return
        except BaseException as exc:
            # (the node went down, say) what was not settled yet is still open: kept, in order,
            # or a checkpoint written on the way out would forget it, counted or not
            self.exchange.unsettled[:0] = check_again + items[settled:]
            if isinstance(exc, Stopped):
                log.info("stopping: %d contributions stay open for the next start", len(self.exchange.unsettled))
                return
            raise
        finally:
            self.p.node.interrupt_calls_on(None)
        if check_again:
            self.exchange.unsettled[:0] = check_again  # oldest first, as they were

    def _settle_one(self, item: Any, local: bool = False) -> bool:
        """Settle one contribution of a round the global parameters have taken (see `settle_late`);
        False if its check failed on the way, or needs the network and `local` (it is asked again
        at the next settle)."""
        p = self.p
        included = item.included
        if included is None and local and not self.exchange.holds_commit(item.round_id):
            return False
        if included is None:
            try:
                included = p.node.call(self.exchange.counts_ours(item.round_id, item.segments, item.basis),
                                       timeout_s=30)
            except (PeerUnavailable, TimeoutError, ProtocolError) as exc:
                # a failure on the way, not an answer: the commit may well have counted it, and
                # then its work must come out
                log.info("could not check round %d's commit for our contribution: %s", item.round_id, exc)
                return False
        if included is None and not item.if_unknown:  # its commit is not known here (we took a later state)
            log.warning("round %d: whether its commit counted our contribution is not known here; "
                        "the work stays ours", item.round_id)
            p.events.write("outcome-unknown", round=item.round_id, peer=p.identity.peer_id)
        elif included is None or included:
            # (DiLoCo takes a counted contribution's progress back whole: no need to fetch where it was clipped)
            scaled = (self._own_scaled(item.round_id, local) if included and isinstance(p.outer, SparseLoCo)
                      else ())
            try:  # segments read back from work.pt or a checkpoint, damaged past their digest's check
                numel = p.outer.global_params.numel()  # (a made-up file's segment claims no more than the model)
                payloads = [Payload.from_bytes(seg, expect=p.outer.codec, max_numel=numel) for seg in item.segments]
                p.outer.settle_late(payloads, self.exchange.prepared - item.prepared, scaled)
            except CodecError as exc:  # (settle_late decodes before it changes anything)
                raise UndecodableWork(item.round_id, exc) from exc
            if included is None:  # see Unsettled.if_unknown
                log.warning("round %d: whether its commit counted the contribution of our earlier process "
                            "is not known here; taken out of our work as counted", item.round_id)
                p.events.write("presumed-counted", round=item.round_id, peer=p.identity.peer_id)
            else:
                log.info("round %d counted our contribution after all: taken out of our work", item.round_id)
                p.events.write("included-late", round=item.round_id, peer=p.identity.peer_id)
        return True  # (EventLog.write handles its own failures: nothing after settling can raise)

    def _drop_unsent_work(self, exc: UndecodableWork) -> None:
        """A contribution that counted (or is presumed to) cannot be taken out of our work: its
        segments do not decode. Kept, that work would be sent a second time; so all our unsent
        work goes (what was sent and settled is in the global parameters: only unsent work is
        lost), and with it every open contribution, whose work it held."""
        p = self.p
        log.error("round %d: our stored contribution does not decode (%s): dropping our unsent work, which "
                  "may hold it, rather than send it twice; training goes on", exc.round_id, exc.cause)
        p.events.write("unsettled-corrupt", round=exc.round_id, error=str(exc.cause), peer=p.identity.peer_id)
        if isinstance(p.outer, SparseLoCo):
            p.outer.error = torch.zeros_like(p.outer.error)  # their work lives in the error feedback alone
        else:  # DiLoCo: in the local progress (see DiLoCo._absorb_late)
            copy_into_parameters(p.outer.global_params, p.outer.params)
        self.exchange.unsettled.clear()  # settled later against zero work, each would be taken out again

    def _own_scaled(self, round_id: int, local: bool = False) -> tuple[tuple[int, int, float], ...]:
        """Where the round's mean took our late-settled contribution clipped; that part stays in
        our work, as on time. Not known (its aggregate is out of reach): taken out whole, which
        never sends anything twice (it loses the clipped-off part). `local`: as this peer knows it,
        nothing fetched."""
        if local:
            return self.exchange.known_own_scaled(round_id) or ()
        try:
            scaled = self.p.node.call(self.exchange.own_scaled(round_id), timeout_s=60)
        except (PeerUnavailable, TimeoutError, ProtocolError) as exc:
            scaled, why = None, str(exc)
        else:
            why = "its aggregate is not known here"
        if scaled is None:
            log.info("round %d: where its mean clipped our contribution is not known (%s): taken out whole",
                     round_id, why)
            return ()
        return scaled


class UndecodableWork(Exception):
    """A stored contribution to settle late whose segments do not decode (see `_drop_unsent_work`)."""

    def __init__(self, round_id: int, cause: CodecError) -> None:
        super().__init__(f"round {round_id}: {cause}")
        self.round_id, self.cause = round_id, cause


def swarm_eval_loss(p: Participant) -> tuple[int | None, float]:
    """The held-out loss the coordinator published, for display (in an open run any other peer's
    record could show a made-up one); else the newest one a peer published (volunteers evaluate
    too). With the round it was measured after (`loss_round`: evaluations may be rounds apart,
    and records are read every few seconds)."""
    records = p.node.cached_records
    coordinator = records.get(p.coordinator_id)
    if coordinator is not None and coordinator.loss == coordinator.loss and coordinator.loss > 0:
        return coordinator.loss_round, coordinator.loss
    # (a loss of a round past the record's own is made up: it would always show, being the newest)
    losses = [(r.loss_round, r.loss) for r in records.values() if r.loss == r.loss and r.loss > 0
              and r.loss_round < r.round]
    return max(losses) if losses else (None, float("nan"))


def catch_up_or_resync(p: Participant, bootstrap_peers: list[str], fresh: bool = True) -> None:
    """Apply rounds the swarm committed without us; re-sync if that fails or our hash is off."""
    try:
        if p.catch_up(fresh=fresh):
            p.events.write("caught-up", round=p.outer.round_id, peer=p.identity.peer_id)
        if not p.agrees_with_swarm():
            p.events.write("hash-mismatch", round=p.outer.round_id, peer=p.identity.peer_id)
            resync(p, bootstrap_peers)
    except (PeerUnavailable, RoundBehind, TimeoutError, ProtocolError) as exc:
        log.info("catch-up failed (%s); re-syncing", exc)
        resync(p, bootstrap_peers)


def resync(p: Participant, bootstrap_peers: list[str]) -> None:
    """Fetch the run's state again after a failed catch-up; a failure here waits for the next round."""
    try:
        p.sync_state(bootstrap_peers, min_round=p.outer.round_id)
    except (PeerUnavailable, TimeoutError, ProtocolError) as exc:  # a bad state: try again later
        log.warning("re-sync failed (%s); will try again after the next round", exc)
