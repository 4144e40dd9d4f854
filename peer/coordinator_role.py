"""The coordinator's program built on a `Participant` (`launch`): genesis or resume, then follow
every committed round (serving, never training), evaluate, checkpoint and serve the state."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from groundswell.protocol.client import RoundBehind
from groundswell.protocol.schema import ProtocolError
from groundswell.protocol.transport import PeerUnavailable

from .launch_checks import mark_genesis_saved, resumable
from .net_loop import Stopped
from .participant import Participant, genesis_decision
from .roles import StopFlag, write_defence_counts
from .run_state import GlobalState
from .volunteer_loop import RoundInfo

log = logging.getLogger(__name__)


def run_coordinator(p: Participant, *, stop: StopFlag, on_round: Callable[[RoundInfo], None] = lambda _: None,
                    checkpoint_every: int = 0) -> None:
    """Serve the run: genesis (or resume), then follow every committed round, checkpoint, serve state.
    `checkpoint_every`: rounds between the coordinator's checkpoints (0: the manifest's cadence)."""
    m = p.manifest
    resumed = p.load_checkpoint()
    if p.state_dir is not None:
        resumable(p.state_dir, resumed)  # (`launch` checked already, before it started anything)
    p.start_network()
    p.events.write("network", peer=p.identity.peer_id, maddrs=p.node.maddrs[:4],
                   **{f"{k}_s": round(v, 3) for k, v in p.node.startup_s.items()})
    if resumed is not None:
        p.node.record_decision(resumed["decision"])
        p.load_global(GlobalState(resumed["round"], resumed["tensors"], resumed["decision"]))
        p.events.write("resume", round=p.outer.round_id, hash=p.outer_hash(),
                       peer=p.identity.peer_id)
    else:
        p.node.record_decision(genesis_decision(p.identity, m.run.id))
        # On disk before it is served: a restart without it would sign another genesis (its own
        # time), a round 0 of another state than the one volunteers who took it meanwhile hold.
        if p.save_checkpoint(unpublished=True) is None:
            raise OSError(f"the run's first checkpoint could not be written to {p.state_dir} (see the log "
                               "line above); free space or choose another --state-dir, then launch again")
        p.snapshot()
    if p.state_dir is not None:
        mark_genesis_saved(p.state_dir)  # (also on a resume: state dirs of older versions have no mark)
    # Ctrl+C cuts any wait on the network short: the coordinator contributes nothing, so it leaves at
    # once, even mid-attempt (the volunteers re-pick any role it held, as when a peer dies).
    p.node.interrupt_calls_on(stop.event)
    try:
        saved = p.outer.round_id  # what our newest checkpoint holds
        _follow_rounds(p, stop, on_round, checkpoint_every or m.checkpoint.every_rounds, saved,
                       resumed=resumed is not None)
    except Stopped:
        pass
    finally:
        # Also when something above failed: the rounds applied since the last checkpoint are kept.
        p.node.interrupt_calls_on(None)
        write_defence_counts(p)
        p.save_checkpoint()


SENT_WINDOW_ROUNDS = 8  # the per-round bytes figure spans this many rounds (records lag a heartbeat)


class SentPerRound:
    """The volunteers' bytes sent per round, from the cumulative counts their records publish:
    over the last SENT_WINDOW_ROUNDS rounds, not the last one alone (records are republished
    every heartbeat, so one round's difference aliased: 0.2 kB one round, 139 kB another, for a
    steady 25-48 kB, a review found); the median over peers (each count is a peer's own word)."""

    def __init__(self) -> None:
        self._seen: deque[tuple[int, dict[str, int]]] = deque(maxlen=SENT_WINDOW_ROUNDS + 1)

    @property
    def latest(self) -> dict[str, int]:
        """The counts read last (peer -> bytes)."""
        return self._seen[-1][1] if self._seen else {}

    def update(self, round_after: int, sent: dict[str, int]) -> int:
        """Take the counts read once round `round_after - 1` was applied; the figure (0: none yet)."""
        per_peer: list[float] = []
        if self._seen:
            start, then = self._seen[0]
            rounds = max(1, round_after - start)
            # (a restarted peer's count starts again from 0: left out until the window has passed it)
            per_peer = [(b - then[pid]) / rounds for pid, b in sent.items() if pid in then and b >= then[pid]]
        self._seen.append((round_after, sent))
        return int(statistics.median(per_peer)) if per_peer else 0


def _follow_rounds(p: Participant, stop: StopFlag, on_round: Callable[[RoundInfo], None], checkpoint_every: int,
                   saved: int, resumed: bool = False) -> None:
    """The coordinator's rounds: take part in each attempt (it serves, never trains), apply every
    committed round, evaluate, checkpoint; until stopped. `saved`: the round our newest checkpoint
    holds; `resumed`: from it (the volunteers may have gone on without us: followed first, and
    said as any catching up is)."""
    m = p.manifest
    client = p.node.client
    assert client is not None
    traffic = SentPerRound()  # the volunteers' bytes per round, from their records
    t0 = time.perf_counter()  # when the round in progress began: its retries count in its time

    def follow_the_swarm() -> bool:
        """`_follow_the_swarm`, said to whoever watches; the next round's time starts after it."""
        nonlocal t0
        before, started = p.outer.round_id, time.perf_counter()
        moved = _follow_the_swarm(p)
        if moved:
            t0 = time.perf_counter()
            last = p.outer.round_id - 1
            rounds = f"round {before}" if last == before else f"rounds {before}-{last}"
            on_round(RoundInfo(p.outer.round_id, "caught-up", reason=f"{rounds} applied by the swarm meanwhile, "
                               f"taken in {t0 - started:.1f} s"))
        return moved
    if resumed:
        follow_the_swarm()
    while not stop:
        r = p.outer.round_id
        if r // checkpoint_every > saved // checkpoint_every and p.save_checkpoint() is not None:
            saved = r  # also after rounds we caught up on; a failed save is tried again next time
        try:
            p.node.call(client.run_attempt(r, None, None, trains=False, serves=True),
                        timeout_s=2 * m.round.deadline_s + 6 * m.round.slack_s + 60)
        except RoundBehind:
            if not follow_the_swarm():
                stop.event.wait(1.0)
            continue
        except (PeerUnavailable, TimeoutError) as exc:  # nothing decided in time: the next attempt
            log.warning("round %d: no decision reached this coordinator (%s)", r, exc or "timed out")
            continue
        committed = p.node.book.committed.get(r)  # type: ignore[union-attr]
        if committed is None:  # a retry or a silent leader: the next attempt (by the clock) rotates the roles
            try:  # tell whoever watches how many volunteers there are (a run filling up waits here)
                records = p.node.call(p.node.refresh_records(), timeout_s=30)
            except (PeerUnavailable, TimeoutError) as exc:
                log.info("peer records: %s", exc)
                continue
            volunteers = sum(1 for rec in records.values() if rec.role != "coordinator")
            ahead = sorted((rec.round for pid, rec in records.items() if pid != p.identity.peer_id), reverse=True)
            if ahead and ahead[(len(ahead) - 1) // 2] > r + 1:  # half the peers, not one record that says so
                # The swarm went on without us (our link was down, say): nobody decides round r
                # any more, so waiting for it would last for good. Catch up, or take the state.
                log.info("the swarm is past round %d: catching up", r)
                follow_the_swarm()
                continue
            on_round(RoundInfo(r, "retry", peers_online=volunteers,
                               reason=f"{volunteers} volunteer{'' if volunteers == 1 else 's'} online"
                                      + (f", {m.run.min_peers} needed" if volunteers < m.run.min_peers else "")))
            continue
        signed, d = committed
        try:
            mean = p.node.call(client.fetch_aggregate(signed), timeout_s=m.round.deadline_s * 4 + 60)
        except (PeerUnavailable, TimeoutError) as exc:
            # Every holder of a shard died before anyone else fetched it: the round's result lives
            # on only in the state of peers that applied it. Take that state (or wait for it).
            log.warning("aggregate of round %d unavailable (%s); taking the state of a peer past it", r, exc)
            if not follow_the_swarm():
                stop.event.wait(m.round.slack_s)
            continue
        p.outer.follow(r, mean)
        p.snapshot()
        evaluated = (r + 1) % m.eval.every_rounds == 0
        loss = p.eval_global() if evaluated else float("nan")
        try:
            records = p.node.call(p.node.refresh_records(), timeout_s=30)
        except (PeerUnavailable, TimeoutError) as exc:  # a DHT hiccup: no figure this round (not a stale one)
            log.info("peer records: %s", exc)
            records = None
        per_round = traffic.update(r + 1, {pid: rec.bytes_sent for pid, rec in records.items()
                                           if rec.role != "coordinator"}) if records is not None else 0
        info = RoundInfo(r, "applied", False, len(d.contributors), eval_loss=loss, round_s=time.perf_counter() - t0,
                         params_hash=p.outer_hash(),
                         # (this round's contributors were online too: a restarted one's record may lag)
                         peers_online=len(set(traffic.latest) | set(d.contributors) - {p.identity.peer_id}),
                         bytes_sent=per_round)
        t0 = time.perf_counter()
        if loss == loss:
            p.node.update_record(loss=loss, loss_round=r)
        # (sources: the shards' aggregators that served this round's aggregate; servers: the peers
        # given roles in the next round)
        p.events.write("round", round=r, contributors=list(d.contributors), attempt=d.attempt, leader=d.leader,
                       sources=sorted(set(d.sources)), servers=list(d.servers),
                       hash=info.params_hash, eval_loss=loss if evaluated else None, clipped=client.clipped.get(r, {}), shards=d.num_shards,
                       round_s=info.round_s, peer=p.identity.peer_id, role="coordinator",
                       sent_total=p.node.traffic()[0],  # a killed coordinator logs no total at exit
                       state_sent_total=p.node.state_sent())
        on_round(info)
        if p.outer.round_id // checkpoint_every > saved // checkpoint_every and p.save_checkpoint() is not None:
            saved = p.outer.round_id


def _follow_the_swarm(p: Participant) -> bool:
    """Bring a follower up to the swarm's newest round: apply the rounds peers still archive, or
    take the state of a peer that is ahead. Returns whether this peer moved forward."""
    before = p.outer.round_id
    try:
        p.catch_up()
    except (PeerUnavailable, RoundBehind, TimeoutError, ProtocolError) as exc:
        log.info("catch-up: %s", exc)
    try:
        records = p.node.call(p.node.refresh_records(), timeout_s=30)
    except (PeerUnavailable, TimeoutError) as exc:
        log.info("peer records: %s", exc)
        return p.outer.round_id > before
    # half the other peers, not one record that says so (a sybil's far-off round would have the
    # coordinator try a download, and follow no round meanwhile, at every call)
    others = sorted((r.round for pid, r in records.items() if pid != p.identity.peer_id), reverse=True)
    if others and others[(len(others) - 1) // 2] > p.outer.round_id:
        try:
            p.sync_state([], min_round=p.outer.round_id + 1)
        except (PeerUnavailable, TimeoutError, ProtocolError) as exc:
            log.info("no peer ahead served its state: %s", exc)
    return p.outer.round_id > before
