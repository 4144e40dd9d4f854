"""The volunteer's program built on a `Participant`: its train-and-exchange loop (`join`). The
coordinator's follow-and-serve loop (`launch`) is in `coordinator_role.py`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from groundswell.optim import SparseLoCo
from groundswell.protocol.transport import PeerUnavailable

from .byzantine import Attack
from .config import DataSection
from .net_errors import NetworkError
from .net_loop import Stopped
from .participant import Participant
from .resume import (
    restore_local_progress,
    restore_progress,
    resume_and_sync,
    torch_load_params,
    unsettled_from,
)
from .stop_flag import StopFlag
from .swarm_exchange import SwarmExchange
from .volunteer_loop import RoundInfo, VolunteerLoop
from .work_file import WorkJournal
from .worker import InnerStats, InnerTrainer

log = logging.getLogger(__name__)


def resume_summary(resumed: dict, now_round: int, unsettled: list[dict]) -> dict:
    """What a restart took from its state dir: {"checkpoint_round": the round of the checkpoint
    resumed from (None: none readable, only the work not yet sent), "settling": the rounds whose
    contributions the process before sent without learning their outcome (`unsettled`, as
    `unsettled_from` parsed them), "round": the round the peer is at now, after catching up}."""
    return {"checkpoint_round": None if resumed.get("work_only") else resumed.get("round"),
            "settling": sorted(int(i["round"]) for i in unsettled), "round": now_round}


def run_volunteer(p: Participant, bootstrap_peers: list[str], *, max_rounds: int | None, stop: StopFlag,
                  until_round: int | None = None,
                  on_round: Callable[[RoundInfo], None] = lambda _: None,
                  on_step: Callable[[int, float], None] | None = None, attack: Attack | None = None,
                  on_resume: Callable[[dict], None] = lambda _: None) -> None:
    """Sync, then train H steps, exchange, apply; until stopped or `max_rounds` rounds applied.
    `attack`: a simulated byzantine volunteer tampers with what it contributes; `on_resume` hears
    what a restart took from the state dir (see `resume_summary`), once the state is in."""
    m = p.manifest
    # The first torch optimizer a process builds imports torch._dynamo (1.2-1.6 s of CPU here, more
    # on a busy machine): done while the network starts and the state downloads, not after.
    warm = threading.Thread(target=_import_optimizer_machinery, name="warm-imports", daemon=True)
    warm.start()
    # Until we hold the state there is no round to finish: Ctrl+C ends a download (up to many
    # minutes for a large model) at once, and we leave with what is on disk.
    p.node.interrupt_calls_on(stop.event)
    try:
        p.start_network()
        p.events.write("network", peer=p.identity.peer_id, maddrs=p.node.maddrs[:4],
                       probed=p.node.options.reachability == "auto",  # (a new daemon after a crash: not again)
                       **{f"{k}_s": round(v, 3) for k, v in p.node.startup_s.items()})
        resumed = resume_and_sync(p, bootstrap_peers)
    except Stopped:
        log.info("stopped before the state was in: leaving with nothing to finish")
        p.events.write("stopped", before="sync", peer=p.identity.peer_id)
        return
    finally:
        p.node.interrupt_calls_on(None)
        warm.join()
    unsettled = unsettled_from(resumed) if resumed is not None else []  # (a malformed list: said, ignored)
    if resumed is not None:
        on_resume(resume_summary(resumed, p.outer.round_id, unsettled))
    if until_round is not None and p.outer.round_id >= until_round:  # said, not left to a silent exit
        log.warning("the run is at round %d already, past --until-round %d: leaving without training",
                    p.outer.round_id, until_round)
    trainer = resumed_trainer(p, resumed)
    if resumed is not None and resumed.get("inner_progress") is not None:
        restore_progress(p, trainer, resumed["inner_progress"])
    if resumed is not None:
        restore_local_progress(p, resumed)
    if resumed is None:  # so a crash before the first scheduled checkpoint resumes from disk, not a download
        p.save_checkpoint({"inner": trainer.state_dict()})
    journal = WorkJournal(p.state_dir, enabled=isinstance(p.outer, SparseLoCo))
    loop = VolunteerLoop(p, SwarmExchange(p.node, serves=p.node.options.serves), trainer, bootstrap_peers, stop,
                          on_round, journal)
    if unsettled:
        loop.exchange.restore_unsettled(unsettled)
    if resumed is not None and resumed.get("work_only"):
        # Restored from work.pt alone: on disk as a checkpoint too, with the contributions still
        # open (its error feedback holds them). Written without them, a restart from it after a
        # crash in the settlement below, its work.pt damaged, sent counted work a second time.
        loop.checkpoint()
    if unsettled:
        # the process before us sent these and stopped before their outcome: settled now, before
        # our first contribution, so that work a commit counted is not in it a second time
        loop.settle_late()

    def more() -> bool:
        return not stop and (max_rounds is None or loop.applied < max_rounds) and (
            until_round is None or p.outer.round_id < until_round)

    # overlap = 1: the round's exchange runs while the next H steps train (Streaming DiLoCo's
    # delayed outer step); the optimizer's rebase rule carries that progress over the update.
    in_flight: tuple[int, InnerStats, float, float] | None = None
    loop.exchange.announce_next = not m.outer.overlap  # with overlap we contribute right after a decision
    with _saved_if_the_network_fails(p, loop):
        while more():
            t0 = time.perf_counter()
            if in_flight is None and loop.applied == 0:
                loop.exchange.announce(p.outer.round_id)  # later rounds are announced as soon as the previous one is decided
            stats = trainer.run(m.outer.inner_steps, on_step)
            # t is the end; the block ran over [t - compute_s, t]; device: where the model's weights live
            # sent_total here too: a process killed before it applies a round still counts what it sent
            p.events.write("train", round=p.outer.round_id, steps=stats.steps, compute_s=stats.compute_s,
                           device=str(p.outer.params[0].device), sent_total=p.node.traffic()[0],
                           state_sent_total=p.node.state_sent(), peer=p.identity.peer_id)
            if in_flight is not None:
                extra = _train_while_waiting(trainer, loop.exchange, m.outer.inner_steps, stop, on_step)
                if extra is not None:
                    p.events.write("train", round=p.outer.round_id, steps=extra.steps, compute_s=extra.compute_s,
                                   extra=True, peer=p.identity.peer_id)
                    stats = _merged(stats, extra)
                loop.settle(*in_flight)
                in_flight = None
                if not more():
                    break
            r = p.outer.round_id
            payloads = p.outer.prepare()
            sent = attack.tamper(payloads) if attack is not None else payloads
            if isinstance(p.outer, SparseLoCo):  # on disk before contributed.json can name it (see work_file)
                record_work(p, journal, r, [x.to_bytes() for x in sent], loop.exchange.unsettled_work(),
                            trainer.progress_state(), loop.exchange.basis_for(r))
            loop.exchange.contribute(r, sent)
            in_flight = (r, stats, t0, time.perf_counter())
            if not m.outer.overlap:
                loop.settle(*in_flight)
                in_flight = None
        if in_flight is not None:  # stopping: the last contribution lands in an aggregate or is kept
            loop.settle(*in_flight)
    loop.checkpoint()  # first: a second Ctrl+C during the reports below must not cost the work
    loop.exchange.drop_announcements()  # (a join of the next round landing after our leave undid it)
    _announce_departure(p)
    try:  # which peers we reached directly and which through a relay, for the run's report
        p.events.write("connections", **p.node.call(_connection_report(p.node), timeout_s=10),
                       reachability=p.node.reachability, peer=p.identity.peer_id)
    except (PeerUnavailable, TimeoutError, RuntimeError) as exc:
        log.info("could not list connections: %s", exc)
    write_defence_counts(p)


def record_work(p: Participant, journal: WorkJournal, round_id: int, segments: list[bytes], earlier: list[dict],
                progress: dict, basis: bytes) -> None:
    """Write the record of the contribution about to be sent (work.pt; see work_file), and note
    whether it was written (`p.work_recorded`: unrecorded work is not sent, a crash would drop it;
    see `_remember_contribution`) and which record the next checkpoint names (`p.work_token`)."""
    token = journal.start()
    p.work_recorded = token is None or journal.record(round_id, p.outer.error, segments, earlier, progress,
                                                      basis=basis)
    if p.work_recorded:
        # Only a record on disk: a checkpoint naming one the disk refused took the work.pt before
        # it (older) for newer than itself, and a restart lost the work since (a review).
        p.work_token = token


def _announce_departure(p: Participant) -> None:
    """Tell the leaders of the round we would have contributed to next that we will not: they
    close it as soon as the others are in, not at its close. (Our record in the DHT is replaced
    by a "left" one when the node shuts down.)"""
    client = p.node.client
    if client is None:
        return
    try:
        p.node.call(client.leave(p.outer.round_id), timeout_s=2 * p.manifest.round.slack_s)
    except (PeerUnavailable, TimeoutError, RuntimeError) as exc:  # best effort: they stop waiting at the close
        log.info("could not tell the next round's leaders we are leaving: %r", exc)
    else:
        p.events.write("departure", round=p.outer.round_id, peer=p.identity.peer_id)


@contextlib.contextmanager
def _saved_if_the_network_fails(p: Participant, loop: VolunteerLoop) -> Iterator[None]:
    """If the network fails (the node went down), keep the rounds applied since the last
    checkpoint before the error goes up: our state is fine. Not on any other error, which may be
    our state's own (a NaN loss): nothing is saved over the last good checkpoint then.

    A contribution still out is settled as one whose outcome we never learned: its work stays
    ours, and the checkpoint lists it open, presumed counted should its commit not be found after
    the restart (as work.pt does for a crashed process's last one: counted twice would be worse
    than its part lost). Without that, a DiLoCo peer wrote no checkpoint here, and its restart
    dropped every round of work since the last one, its data position rewound. (SparseLoCo's
    work.pt holds that contribution already, and its journal is the restart's word on it.)"""
    try:
        yield
    except NetworkError:
        if p.outer.pending is not None and not isinstance(p.outer, SparseLoCo):
            r = p.outer.pending.round_id
            if r in p._contributed_before():  # it went out, or may have: settled after the restart
                loop.exchange.presume_counted(r)
            p.outer.apply(None)  # kept: whether a commit counted it is settled after the restart
        if p.outer.pending is None:
            loop.checkpoint()
        raise


async def _connection_report(node: Any) -> dict[str, Any]:
    """Our libp2p connections (direct or relayed) and hole punches, read on the network loop,
    whose tasks change them."""
    puncher = node.puncher
    return {"paths": await node.connections(),
            "punches": list(puncher.attempts) if puncher is not None else [],
            "punched": puncher.punched() if puncher is not None else []}


def _import_optimizer_machinery() -> None:
    try:
        import torch._dynamo  # noqa: F401  (what torch.optim's first optimizer would import)
    except Exception as exc:  # noqa: BLE001 (only a head start: the first optimizer imports it again if need be)
        log.debug("warming torch._dynamo up failed: %r", exc)


def _train_while_waiting(trainer: InnerTrainer, exchange: SwarmExchange, limit: int, stop: StopFlag,
                         on_step: Callable[[int, float], None] | None) -> InnerStats | None:
    """With overlap, when the round in flight is still out after our H steps (the other peers are
    slower, or the round is waiting out a dead peer), train on one step at a time, up to `limit`
    more, instead of standing still: this peer's next contribution then covers more inner steps.
    Beyond `limit`, the caller waits as before, so a stalled round cannot pull us far ahead."""
    done: list[InnerStats] = []
    while len(done) < limit and not stop and not exchange.ready():
        done.append(trainer.run(1, on_step))
    return _merged(*done) if done else None


def _merged(*parts: InnerStats) -> InnerStats:
    steps = sum(s.steps for s in parts)
    return InnerStats(steps, sum(s.mean_loss * s.steps for s in parts) / max(1, steps),
                      sum(s.tokens for s in parts), sum(s.compute_s for s in parts))


def write_defence_counts(p: Participant) -> None:
    """Log what this peer refused (by reason and handler) and whom it banned, for the run's report."""
    guard, (sent, received) = p.node.guard, p.node.traffic()
    # with this process's traffic in all (the round events' windows miss what it serves after them)
    p.events.write("defences", rejected=dict(guard.rejected), bans=guard.bans_total, peer=p.identity.peer_id,
                   sent_total=sent, received_total=received, state_sent_total=p.node.state_sent())


def resumed_trainer(p: Participant, resumed: dict | None) -> InnerTrainer:
    """The volunteer's inner trainer, with the checkpoint's inner state where it fits (else afresh)."""
    trainer = volunteer_trainer(p)
    if resumed is None or resumed.get("inner") is None:
        return trainer
    try:
        trainer.load_state_dict(resumed["inner"])
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, ArithmeticError) as exc:  # (made up)
        log.warning("inner state in the checkpoint does not fit (%s); starting the inner optimizer afresh", exc)
        trainer = volunteer_trainer(p)  # afresh indeed: not what of the old state loaded before it failed
        try:  # but where the data was: afresh, it would train its first batches again
            trainer.load_data_position(resumed["inner"])
        except (KeyError, ValueError, TypeError, AttributeError, ArithmeticError) as why:
            log.warning("nor does its data position (%s): training starts the data afresh", why)
    finally:  # the model's weights are the global state's, whatever of the inner state loaded before it failed
        torch_load_params(p)
    return trainer


def volunteer_trainer(p: Participant) -> InnerTrainer:
    """The inner trainer of a volunteer: its own seeded order of the whole training stream."""
    m = p.manifest
    return InnerTrainer(p.workload, p.corpus, DataSection(m.data.source, m.data.batch_size), m.inner,
                        total_steps=10**7, shard_index=0,
                        seed=_data_seed(m.run.seed, p.identity.peer_id) if p.data_seed is None else p.data_seed,
                        num_shards=1, device=p.device)


def _data_seed(run_seed: int, peer_id: str) -> int:
    """Each volunteer walks its own seeded order of the whole training stream. (It used to take
    1 of 1024 fixed shards: 1/1024 of the corpus, repeated every few inner steps, and two peers
    whose ids fell on one shard trained on the same batches.)"""
    import hashlib

    digest = hashlib.sha256(f"{run_seed}:{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
