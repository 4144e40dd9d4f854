"""`SwarmExchange`: the optimizer's `Exchange` over the swarm's round protocol.

`contribute` starts an attempt on the network loop and returns at once (training may go on);
`collect` waits for it and turns the outcome into what the outer optimizer understands: a
`RoundResult` (commit), `RoundFailed` (retry or no decision: the round runs again as the next
attempt, nothing applied), or `NeedResync` (this peer lost track of the run and must download
the state before it contributes again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch
from groundswell.compression import Payload
from groundswell.optim import RoundFailed, RoundResult
from groundswell.protocol.claims import EARLIER_ATTEMPTS_CLAIMED
from groundswell.protocol.client import LEAVE_ATTEMPTS, AttemptResult, RoundBehind
from groundswell.protocol.schema import Decision
from groundswell.protocol.transport import PeerUnavailable

from .net_errors import NetworkError
from .swarm import SwarmNode
from .unsettled import KEEP_UNSETTLED, Unsettled, commit_counts, keep_newest, unsettled_item
from .uplink_watch import CLEAR_AFTER, UplinkWatch

log = logging.getLogger(__name__)


class NeedResync(RuntimeError):
    """The peer is behind or missed an aggregate nobody can provide: re-download the state."""


class SwarmExchange:
    """One peer's `Exchange` over the swarm."""

    def __init__(self, node: SwarmNode, *, serves: bool = True) -> None:
        self.node = node
        self.worker_id = node.identity.peer_id
        self.serves = serves
        self._future: Future | None = None
        self._round: int | None = None
        self._sent_before = 0
        self._received_before = 0
        self.last_decision: Decision | None = None
        self.last_signed: bytes = b""
        self._announced: Future | None = None
        self._announced_round = -1
        self._announce_tail: Future | None = None  # the announcement a contribution left to finish
        self._announce_tail_round = -1
        self.announce_next = False  # announce round r+1 as soon as round r is decided
        self.prepared = 0  # contributions handed to `contribute` so far
        self._segments: list[bytes] = []  # the contribution in flight, until `collect` has its outcome
        self.unsettled: list[Unsettled] = []  # see `take_unsettled`
        # what the last `collect` learned of its contribution: (counted? None: unknown, retried?)
        self.last_outcome: tuple[bool | None, bool] = (None, False)
        self.uplink = UplinkWatch()  # says when our contributions keep failing to get out

    @property
    def serving(self) -> bool:
        """Do we offer to aggregate and lead? Not while our uplink is found too slow (`UplinkWatch.slow`)."""
        return self.serves and not self.uplink.slow

    def contribute(self, round_id: int, payloads: Sequence[Payload]) -> None:
        """Start this peer's attempt at `round_id` with its segment payloads."""
        if self._future is not None:
            raise RuntimeError("contribute() twice without collect()")
        # An announcement still out is left to finish (it also asks the leaders of the round's
        # next attempts, which this contribution does not reach until they begin), kept until
        # the next contribution, which lets it go (a round later: it is moot by then).
        self._let_go(self._announce_tail, self._announce_tail_round)
        self._announce_tail, self._announce_tail_round = self._announced, self._announced_round
        self._announced = None
        client = self.node.client
        assert client is not None and self.node.transport is not None
        self._sent_before = self.node.transport.bytes_sent
        self._received_before = self.node.transport.bytes_received
        segments = [p.to_bytes() for p in payloads]
        self.prepared += 1
        # (in flight only once submitted: a node already down sends nothing, and a contribution
        # never sent must not be listed open and presumed counted, see `presume_counted`)
        self._future = self.node.submit(self._attempt(round_id, segments))
        self._segments = segments
        self._round = round_id

    async def _attempt(self, round_id: int, segments: list[bytes]
                       ) -> tuple[AttemptResult, torch.Tensor | PeerUnavailable | None, Future | None]:
        """The attempt and, once it commits, the aggregate too: fetched on the network loop as soon
        as the decision is known, so that with overlap training never waits for it. The next
        round is announced meanwhile (if `announce_next`): its future is returned, not awaited
        (a next-round leader that never answers held every peer's mean back a slack, a review found)."""
        client = self.node.client
        assert client is not None
        outcome = await client.run_attempt(round_id, None, segments, trains=True, serves=self.serving)
        d = outcome.decision
        if d is None or d.status != "commit" or d.round != round_id:
            return outcome, None, None

        async def fetch() -> torch.Tensor | PeerUnavailable:
            try:
                return await client.fetch_aggregate(outcome.signed)
            except PeerUnavailable as exc:
                return exc

        async def announce() -> None:
            try:
                await client.announce(round_id + 1, trains=True, serves=self.serving)
            except PeerUnavailable as exc:  # best effort: the next round's leaders simply do not wait for us
                log.warning("announcing round %d failed: %s", round_id + 1, exc)

        # (started before the fetch; `_outcome` keeps it, on the training thread: the caller's)
        try:
            announcing = self.node.submit(announce()) if self.announce_next else None
        except NetworkError:  # the node is going down: the outcome still stands (a review found it lost)
            announcing = None
        try:
            return outcome, await fetch(), announcing
        except BaseException:  # cancelled (the node went down, a second Ctrl+C): nobody would keep it
            if announcing is not None:
                announcing.cancel()
            raise

    def _unsettled(self, round_id: int, included: bool | None, retried: bool = False) -> None:
        if included is False:  # known to be in nothing: its work simply stays ours, nothing to settle
            return
        if retried:
            # A later attempt's leader may adopt the commit of any of the attempts its claim looks
            # back on (a retry's take-back that missed a fenced holder): each of those stays open.
            for old in [u for u in self.unsettled if u.retried and u.round_id == round_id][:1 - EARLIER_ATTEMPTS_CLAIMED]:
                self.unsettled.remove(old)
                log.info("round %d: a retried contribution no later attempt can adopt any more is forgotten; its "
                         "work stays ours", round_id)
        self.unsettled.append(Unsettled(round_id, self._segments, included, self.prepared, retried,
                                        basis=self.basis_for(round_id)))
        self._keep_newest()

    def presume_counted(self, round_id: int) -> None:
        """The contribution of `round_id` in flight when the node went down is open (listed if its
        outcome was not awaited yet) and `if_unknown`: taken out of our work should its commit not
        be found after a restart."""
        open_ = [u for u in self.unsettled if u.round_id == round_id and u.included is None and not u.retried]
        if not open_ and self._round == round_id and self._segments:
            self.unsettled.append(Unsettled(round_id, self._segments, None, self.prepared,
                                            basis=self.basis_for(round_id)))
            open_ = self.unsettled[-1:]
        # The newest only: the one in flight. An earlier attempt of the round left open (no leader
        # answered it) is in its commit only if that one is not, and a commit counts one of ours:
        # presuming both took a DiLoCo peer's work out twice after a restart (found by a review).
        for u in open_[-1:]:
            u.if_unknown = True

    def basis_for(self, round_id: int) -> bytes:
        """The signed commit round `round_id` was planned from (`Unsettled.basis`), b"" if not held.
        (Read from the training thread: one dict lookup, which the network loop's writes cannot tear.)"""
        book = self.node.book
        entry = None if book is None else book.committed.get(round_id - 1)
        return b"" if entry is None else entry[0]

    def _keep_newest(self, limit: int = KEEP_UNSETTLED) -> None:
        """Trim the unsettled contributions to the newest few (`unsettled.keep_newest`)."""
        keep_newest(self.unsettled, limit)

    def unsettled_work(self) -> list[dict[str, Any]]:
        """Each unsettled contribution as a checkpoint stores it (`unsettled_item`)."""
        return [unsettled_item(u.round_id, u.segments, self.prepared - u.prepared, u.included, u.retried,
                               u.if_unknown, u.basis) for u in self.unsettled]

    def restore_unsettled(self, items: Sequence[dict[str, Any]]) -> None:
        """Take over an earlier process's unsettled contributions (`unsettled_item`s, oldest first):
        each settles late, by digest, like one of ours. Not trimmed to the newest few here: the
        caller settles them at once, and one forgotten unsettled could be sent twice (a record
        lists its own contribution besides the few before it, even when its outcome is known)."""
        self.unsettled.extend(Unsettled(i["round"], list(i["segments"]), i["included"], self.prepared - i["decayed"],
                                        i["retried"], if_unknown=i["presume"], basis=i["basis"] or b"") for i in items)

    def take_unsettled(self, applied_below: int) -> list[Unsettled]:
        """The unsettled contributions of rounds the global parameters have taken (those below
        `applied_below`, the next round to run): their outcome is now fixed, one way or the other."""
        done = [u for u in self.unsettled if u.round_id < applied_below]
        self.unsettled = [u for u in self.unsettled if u.round_id >= applied_below]
        return done

    async def counts_ours(self, round_id: int, segments: list[bytes], basis: bytes = b"") -> bool | None:
        """Did round `round_id`'s commit count these segments (`unsettled.commit_counts`)? None: not known here."""
        return await commit_counts(self.node, round_id, segments, basis)

    def holds_commit(self, round_id: int) -> bool:
        """Is round `round_id`'s commit in our book (so `counts_ours` needs no request)?"""
        book = self.node.book
        return book is not None and round_id in book.committed

    def known_own_scaled(self, round_id: int) -> tuple[tuple[int, int, float], ...] | None:
        """`own_scaled` as far as this peer knows it without fetching (None: not known here)."""
        client = self.node.client
        return None if client is None else client.own_scaled.get(round_id)

    async def own_scaled(self, round_id: int) -> tuple[tuple[int, int, float], ...] | None:
        """Where round `round_id`'s mean took our contribution clipped (`RoundResult.scaled`), for
        one whose outcome was learned late. Known if this peer fetched the round's aggregate (on
        time or catching up); else the round's shards are fetched again to work it out (a dense
        mean's shards say it; sparse ones from the signed contributions, without the mean). None:
        not known here."""
        client, book = self.node.client, self.node.book
        if client is None or book is None:
            return None
        if round_id in client.own_scaled:
            return client.own_scaled[round_id]
        committed, ctx = book.committed.get(round_id), self.node.ctx
        if committed is None or ctx is None:
            return None
        if not ctx.robust.clip > 0:
            return ()  # nothing was clipped
        await client.note_own_scaled(committed[0])
        return client.own_scaled.get(round_id)

    def announce(self, round_id: int) -> None:
        """Ask to be waited for in `round_id` (best effort, in the background of training): the
        first round after start, at every attempt an earlier process's `leave` reached."""
        client = self.node.client
        assert client is not None
        self._drop_announce()  # (a retried first round announces again)
        self._announced_round = round_id
        self._announced = self.node.submit(client.announce(round_id, trains=True, serves=self.serving,
                                                           attempts=LEAVE_ATTEMPTS))

    def drop_announcements(self) -> None:
        """Cancel every announcement still out: before a leave, which a late join must not undo."""
        self._drop_announce()
        self._let_go(self._announce_tail, self._announce_tail_round)
        self._announce_tail = None

    def _drop_announce(self) -> None:
        """Let go of the announcement in flight: its failure, if it failed, is logged; one still
        running is cancelled (superseded: a contribution or a newer announcement is on its way)."""
        announced, self._announced = self._announced, None
        self._let_go(announced, self._announced_round)

    @staticmethod
    def _let_go(announced: Future | None, round_id: int) -> None:
        """Cancel an announcement if it still runs, else log its failure, if it failed."""
        if announced is None:
            return
        if not announced.done():
            announced.cancel()
        elif not announced.cancelled() and announced.exception() is not None:
            log.warning("announcing round %d failed: %s", round_id, announced.exception())

    def ready(self) -> bool:
        """Whether the attempt in flight has an outcome (and, on a commit, its aggregate): `collect`
        would not wait."""
        return self._future is not None and self._future.done()

    def collect(self, round_id: int) -> RoundResult:
        """Wait for the attempt's outcome (bounded by the round deadline plus slack)."""
        future, self._future = self._future, None
        self.last_outcome = (None, False)
        if future is None or round_id != self._round:
            raise RuntimeError("collect() without a matching contribute()")
        try:
            return self._outcome(future, round_id)
        finally:
            self._segments = []  # a whole contribution: not kept past its outcome (unless unsettled)

    def _result_unless_down(self, future: Future, round_id: int, limit: float) -> Any:
        """The attempt's result within `limit` seconds; NetworkError as soon as the node stopped by
        itself (its daemon died, say): the attempt would otherwise go on asking deaf peers until its
        bounds, a minute or two, while training went on for a peer nobody can reach."""
        end = time.monotonic() + limit
        try:
            # wait(), not result(timeout): a TimeoutError the attempt itself raised is its outcome,
            # not this wait's slice running out
            while not wait([future], timeout=max(0.0, min(1.0, end - time.monotonic()))).done:
                down = getattr(self.node, "down", None)
                if down is not None:
                    future.cancel()
                    self._unsettled(round_id, None)  # whether it counted is for a restart to settle
                    raise NetworkError(down)
                if time.monotonic() >= end:
                    raise TimeoutError(f"no outcome within {limit:.0f} s")
        except BaseException:  # a second Ctrl+C: the attempt must not run on, unowned, through the teardown
            future.cancel()
            raise
        try:
            return future.result()
        except NetworkError:  # the attempt itself found the node down: whether it counted is for a restart
            self._unsettled(round_id, None)
            raise

    def _outcome(self, future: Future, round_id: int) -> RoundResult:
        ctx = self.node.ctx
        assert ctx is not None and self.node.client is not None and self.node.transport is not None
        limit = 6 * ctx.deadline_s + 6 * ctx.slack_s + 120
        try:  # the attempt, then the aggregate's fetch (each bounded inside)
            outcome, mean, announcing = self._result_unless_down(future, round_id, limit)
            if announcing is not None:
                self._drop_announce()
                self._announced, self._announced_round = announcing, round_id + 1
        except RoundBehind as exc:  # raised before anything is sent
            self.last_outcome = (False, False)
            raise NeedResync(str(exc)) from None
        except TimeoutError:  # every bound inside failed: whether the round counted us is unknown
            future.cancel()
            self._unsettled(round_id, None)
            raise NeedResync(f"round {round_id}: no outcome within {limit:.0f} s") from None
        decision = outcome.decision
        if self._segments and not outcome.late:  # (a coordinator contributes nothing; late: our training's doing)
            was_serving = self.serving
            self.uplink.note(outcome.sends_cut > 0, outcome.included, sum(len(s) for s in self._segments), ctx.slack_s,
                             outcome.cut_to)
            if was_serving != self.serving:
                self.node.update_record(serves=self.serving)  # what `groundswell status` shows
            if was_serving and not self.serving:
                log.warning("this peer declines aggregator and leader roles until its contribution gets out whole in "
                            "%d attempts in a row: an aggregator sends its shard's aggregate to every peer over the "
                            "same uplink", CLEAR_AFTER)
            elif self.serving and not was_serving:
                log.warning("our contribution got out whole in each of the last %d attempts: this peer takes "
                            "aggregator and leader roles again", CLEAR_AFTER)
        if decision is None or decision.status != "commit":
            if decision is None:  # a leader may have committed it, and died before telling us
                self._unsettled(round_id, None)
                why = "no leader answered"
            else:  # the usual cause while a run fills up: fewer volunteers than min_peers
                # A commit of this attempt that its leader sealed, then took back with this retry,
                # may still be adopted by a later attempt if the take-back missed an aggregator:
                # whether the round counted this contribution is open until the round commits
                # (then it is settled by digest; almost always: not counted).
                self._unsettled(round_id, None, retried=True)
                self.last_outcome = (None, True)
                why = (f"the leader decided to retry: fewer than {ctx.min_peers} complete contributions "
                       "(the run's min_peers) arrived in time, or an aggregator failed")
            raise RoundFailed(f"round {round_id} attempt {outcome.attempt}: {why}")
        if decision.round != round_id:
            raise NeedResync(f"got the decision of round {decision.round} while at round {round_id}")
        self.last_outcome = (outcome.included, False)
        if isinstance(mean, PeerUnavailable):  # committed, its aggregate out of reach: the state will hold it
            self._unsettled(round_id, outcome.included)
            raise NeedResync(str(mean)) from None
        assert mean is not None
        self.last_decision, self.last_signed = decision, outcome.signed
        t = self.node.transport
        return RoundResult(
            round_id=round_id,
            mean=mean,
            contributors=tuple(decision.contributors),
            included=outcome.included,  # by digest: a commit may count what a crashed process of ours sent
            bytes_sent=t.bytes_sent - self._sent_before,
            bytes_received=t.bytes_received - self._received_before,
            # where the mean took our contribution clipped (noted by the fetch; a dense mean's shards say it)
            scaled=self.node.client.own_scaled.get(round_id, ()) if outcome.included else (),
        )
