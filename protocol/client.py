"""The contributing half of the round protocol: send shards, learn the decision, fetch aggregates.

One call of `run_attempt` is one attempt of one round from a contributor's side; it never waits
past the deadline + a few slacks. Fetching the committed aggregate (`fetch_aggregate`) lives in
`fetch.py`, mixed in here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from groundswell.compression import Payload

from .context import DecisionBook, contribution_digest
from .envelope import unseal
from .fetch import AggregateFetcher
from .framing import SendProgress
from .plan import RoundPlan, attempt_for, close_time, shard_bounds
from .schema import (
    Ack,
    AggregateShard,
    Decision,
    DecisionReply,
    DecisionRequest,
    Join,
    ProtocolError,
)
from .server import RoundServer
from .shard_send import ShardSender
from .shards import decision_digests
from .tasks import gather_owned
from .transport import PeerUnavailable

log = logging.getLogger(__name__)
LEAVE_ATTEMPTS = 3  # a leave reaches the leaders of the open attempt and the two after it
CATCH_UP_ANNOUNCES = 3  # rounds an announcement moves on by, each time a leader says the round is already committed
REASK_S = 1.0  # how often a leader that failed to answer is asked again for the decision


class RoundBehind(RuntimeError):
    """This peer does not know the previous round's decision: it must catch up first."""


@dataclass(frozen=True)
class AttemptResult:
    """What one attempt ended in, from this contributor's side."""

    decision: Decision | None  # None: no leader answered in time
    signed: bytes
    attempt: int
    delivered: bool  # did every shard of our contribution reach an aggregator?
    # Is the contribution we sent this time the one the commit counts? A commit that names us but
    # pins other digests counts one that an earlier process of ours sent before a crash.
    included: bool = False
    late: bool = False  # our shards went out after the attempt's close by our clock (training ran late)
    # sends of our shards that timed out after a slack or more of sending: the mark of an uplink
    # too slow for the contribution (see `_offer`), and the aggregators they went to (one alone
    # may be the slow end: its downlink, its CPU)
    sends_cut: int = 0
    cut_to: frozenset[str] = frozenset()


class RoundClient(AggregateFetcher, ShardSender):
    """Runs attempts for one peer, using its `RoundServer` for plans and the archive."""

    def __init__(self, server: RoundServer, holders: Callable[[int], Sequence[str]]) -> None:
        self.server = server
        self.ctx = server.ctx
        self.transport = server.transport
        self.book: DecisionBook = server.book
        self.me = server.identity.peer_id
        self.holders = holders  # peers believed to hold a round's aggregate (from the DHT)
        self.retried: dict[int, int] = {}  # round -> newest attempt decided "retry"
        # round -> newest attempt this identity sent a contribution to (the peer restores it after a
        # restart and `on_contribute` persists it): an attempt never gets two different contributions
        # from one peer, which aggregators refuse as equivocation.
        self.contributed: dict[int, int] = {}
        self.sends_cut = 0  # see `AttemptResult.sends_cut`: in all attempts so far
        self.cut_to: dict[tuple[int, int], set[str]] = {}  # (round, attempt) -> `AttemptResult.cut_to`
        # False: it could not be recorded durably, and nothing is sent (after a crash, a restart
        # from an older checkpoint would not know this work went out, and send it again)
        self.on_contribute: Callable[[int, int], bool] | None = None
        self.clipped: dict[int, dict[str, int]] = {}  # round -> contributor -> shards the robust mean clipped it in
        # round -> where our own contribution entered the mean scaled down by clipping: (start, stop, factor)
        self.own_scaled: dict[int, tuple[tuple[int, int, float], ...]] = {}
        # (round, shard) -> (commit, shard, its checked contributions): each is parsed once
        self._rows: dict[tuple[int, int], tuple[bytes, AggregateShard, list[list[Payload]]]] = {}
        self._rows_lock = threading.Lock()

    def current_attempt(self, round_id: int) -> int | None:
        """The attempt of `round_id` a contribution made now belongs to (None: round unknown)."""
        opened = self.book.opened_at(round_id)
        if opened is None:
            return None
        return attempt_for(time.time(), opened, self.ctx.deadline_s, self.ctx.slack_s)

    async def announce(self, round_id: int, *, trains: bool, serves: bool, attempts: int = 1) -> None:
        """Tell the leaders of `round_id`'s open attempt (and of the next `attempts - 1`) that we
        will contribute, before training: they then wait for us (up to the close) instead of
        closing early without us, which would leave a peer slower than the others out of every
        round. A peer starting up covers `LEAVE_ATTEMPTS`: a `leave` of its earlier process may
        still stand at any of them."""
        for _ in range(1 + CATCH_UP_ANNOUNCES):
            join = Join(round_id, trains, serves)
            leaders = await self._leaders(round_id, attempts)
            refusals = await gather_owned(self._tell(p, "join", join) for p in leaders)
            # A leader that says the round is already committed tells us we are behind (a joiner
            # whose state download ended after the next commit): the commit it holds, checked,
            # goes into our book, and the round after it is announced instead. Before (found by a
            # review), nobody waited for such a joiner, its contributions came after each close,
            # and it stayed a round behind, counted in nothing, for as long as rounds were quick.
            committed = [p for p, why in zip(leaders, refusals) if why is not None and "already committed" in why]
            if not committed or not await self._learn_commit(committed, round_id):
                return
            round_id += 1

    async def _learn_commit(self, peers: list[str], round_id: int) -> bool:
        """Ask `peers` (all at once: one slow or hostile one must not hold the round up by a slack
        each) for the commit of `round_id`; does our book hold it now? Each answer is checked
        (`ask_decision`): none can plant a commit."""
        attempt = self.current_attempt(round_id)
        await gather_owned(self.ask_decision(p, round_id, attempt if attempt is not None else 0, 0.0) for p in peers)
        return round_id in self.book.committed

    async def leave(self, round_id: int) -> None:
        """Tell the leaders of `round_id`'s open attempt, and of the next few, that we will not
        contribute to it (we are leaving the run): they then close it once the others are in,
        instead of waiting for us up to the close."""
        leave = Join(round_id, trains=False, serves=False)
        await gather_owned(self._tell(p, "join", leave) for p in await self._leaders(round_id, LEAVE_ATTEMPTS))

    async def _leaders(self, round_id: int, attempts: int) -> list[str]:
        """The leaders of `round_id`'s open attempt and the `attempts - 1` after it (none if the
        round before is not known here)."""
        attempt = self.current_attempt(round_id)
        leaders: set[str] = set()
        for a in range(attempt, attempt + attempts) if attempt is not None else ():
            plan = await self.server.plan(round_id, a, wait_s=0)
            leaders.update(plan.leaders if plan is not None else ())
        return sorted(leaders)

    async def run_attempt(self, round_id: int, attempt: int | None, segments: list[bytes] | None, *, trains: bool,
                          serves: bool) -> AttemptResult:
        """Join, contribute (if `segments`), and wait for the attempt's decision. `attempt=None`:
        the attempt whose slot is open now."""
        if attempt is None:
            attempt = self.current_attempt(round_id)
            if attempt is not None:  # an attempt already decided "retry" is over, whatever the clock says
                attempt = max(attempt, self.retried.get(round_id, -1) + 1)
                if segments is not None:  # and one we sent a contribution to takes no second one
                    attempt = max(attempt, self.contributed.get(round_id, -1) + 1)
        plan = None if attempt is None else await self.server.plan(round_id, attempt, wait_s=self.ctx.slack_s)
        if plan is None or attempt is None:
            raise RoundBehind(f"the decision of round {round_id - 1} is not known here")
        join = Join(round_id, trains, serves)
        # The joins run alongside the shards: a frozen stand-in leader would otherwise hold every
        # contribution back by a slack (the join's timeout). Only a newcomer waits for its joins:
        # leaders refuse reports naming a contributor they do not expect yet.
        joins = [asyncio.ensure_future(self._tell(p, "join", join)) for p in plan.leaders]
        delivered = late = False
        cut = 0
        try:
            if segments is not None:
                if self.me not in plan.trainers:
                    await asyncio.wait(joins)
                self.contributed[round_id] = max(attempt, self.contributed.get(round_id, -1))
                for book in (self.contributed, self.retried):  # (never pruned, `retried` grew for good)
                    for old in [r for r in book if r < round_id - 2]:
                        del book[old]
                # in a worker thread: the record is fsynced before anything is sent, which on a slow
                # disk would stall every handler and heartbeat of this node for as long
                if self.on_contribute is not None and not await asyncio.to_thread(
                        self.on_contribute, round_id, self.contributed[round_id]):
                    log.warning("round %d: our contribution could not be recorded, so it is not sent; the work "
                                "stays ours", round_id)
                else:
                    late, cut_before = self._attempt_over(plan), self.sends_cut
                    watch: list[SendProgress] = []  # every big copy's progress, each judged against the others
                    sent = await gather_owned(self._send_shard(plan, s, segments, watch)
                                              for s in range(plan.num_shards))
                    delivered, cut = all(sent), self.sends_cut - cut_before
            decision, signed = await self._await_decision(plan)
        finally:  # a join still out once the attempt is decided is moot
            for task in joins:
                task.cancel()
            await asyncio.gather(*joins, return_exceptions=True)
        if decision is not None and decision.status == "retry":
            self.retried[round_id] = max(attempt, self.retried.get(round_id, -1))
            for old in [r for r in self.retried if r < round_id - 2]:  # (also here: the coordinator sends
                del self.retried[old]  # no segments, and its table grew by each retried round, a review found)
        included = await self.counts_ours(decision, segments)
        cut_to = frozenset(self.cut_to.pop((round_id, attempt), ()))
        for key in [k for k in self.cut_to if k[0] < round_id - 2]:  # (attempts given up on)
            del self.cut_to[key]
        return AttemptResult(decision, signed, attempt, delivered, included, late, cut, cut_to)

    async def counts_ours(self, decision: Decision | None, segments: list[bytes] | None) -> bool:
        """Does a commit count the contribution we sent (its pinned digests are ours, in every shard)?
        The commit's shard count fixes each shard's segments, so this needs no plan: a peer that
        restarted, or jumped rounds ahead, checks an old commit as well as one on time."""
        if decision is None or decision.status != "commit" or segments is None or self.me not in decision.contributors:
            return False
        try:
            bounds = shard_bounds(len(segments), decision.num_shards)
        except ValueError:  # not a split of segments like ours: it cannot pin them
            return False
        mine = decision.contributors.index(self.me)
        for shard, (first, stop) in enumerate(bounds):
            pinned = decision_digests(decision, shard)
            if len(pinned) <= mine or pinned[mine] != contribution_digest(first, segments[first:stop]):
                return False
        return True

    async def _tell(self, peer: str, handler: str, msg: Join) -> str | None:
        """Send a join (or a leave); the leader's reason if it refused it, else None."""
        if peer == self.me:
            try:
                ack = await self.server._on_join(peer, msg)
            except ProtocolError as exc:  # e.g. the round is full: we are not a member of it
                log.warning("%s refused by ourselves: %s", handler, exc)
                return None
            return None if ack.ok else ack.reason
        try:
            # on a stream: a join that reached the leader counts even if our wait ran out first
            # (a unary one would be dropped unhandled), and nothing retries it
            ack = await self.transport.request(peer, handler, msg, Ack, timeout_s=self.ctx.slack_s, unary=False)
        except PeerUnavailable as exc:
            log.info("%s to %s failed: %s", handler, peer[-8:], exc)
            return None
        if not ack.ok:
            log.info("%s for round %d refused by %s: %s", handler, msg.round, peer[-8:], ack.reason)
        return None if ack.ok else ack.reason

    async def _await_decision(self, plan: RoundPlan) -> tuple[Decision | None, bytes]:
        # Ask the leader and the backup at once: the backup answers only if it had to decide
        # (leader silent past the close + slack), so the first non-empty answer is the decision.
        wait = self.ctx.deadline_s + (len(plan.leaders) + 1) * self.ctx.slack_s
        # A leader that does not answer at all (its process just died) is asked again until the
        # last stand-in would have decided: it may be restarted by then, and be the one deciding.
        opened = self.book.opened_at(plan.round)
        until = time.time() + wait
        if opened is not None:
            latest = close_time(opened, plan.attempt, self.ctx.deadline_s, self.ctx.slack_s)
            until = min(until, latest + (len(plan.leaders) + 1) * self.ctx.slack_s)
        # Our own book too: it may learn the round's commit another way (another attempt's leader,
        # a peer that sent us work, a claim), and then this poll is over.
        asks = [asyncio.ensure_future(self._poll_decision(p, plan, until, wait))
                for p in dict.fromkeys([*plan.leaders, self.me])]
        try:
            for next_done in asyncio.as_completed(asks):
                signed = await next_done
                if signed:
                    _, decision = unseal(signed, self.ctx.run_id, Decision)
                    return decision, signed
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        return None, b""

    async def _poll_decision(self, peer: str, plan: RoundPlan, until: float, wait_s: float) -> bytes:
        """Ask `peer` for the attempt's decision (a long poll of up to `wait_s`); if it fails fast,
        ask again every `REASK_S` until `until` (wall clock)."""
        # The first long poll too ends by `until`: a contributor that came late to its attempt
        # would otherwise wait out the whole `wait_s` on a silent leader and miss the next one.
        signed = await self.ask_decision(peer, plan.round, plan.attempt, min(wait_s, max(0.0, until - time.time())),
                                         plan)
        while not signed and (left := until - time.time()) > REASK_S:
            await asyncio.sleep(REASK_S)
            signed = await self.ask_decision(peer, plan.round, plan.attempt, max(0.0, left - REASK_S), plan)
        return signed

    async def ask_decision(self, peer: str, round_id: int, attempt: int, wait_s: float,
                           plan: RoundPlan | None = None, strict: bool = False) -> bytes:
        """A signed decision for round/attempt from one peer, or b"" (and it is recorded if a commit).
        A "retry" counts only with the attempt's `plan`, signed by one of its leaders. `strict`: a
        failure on the way (no answer, a bad one) raises rather than reads as "none"."""
        try:
            if peer == self.me:
                reply = await self.server._on_get_decision(peer, DecisionRequest(round_id, attempt, wait_s))
            else:
                reply = await self.transport.request(peer, "get-decision", DecisionRequest(round_id, attempt, wait_s),
                                                     DecisionReply, timeout_s=wait_s + self.ctx.slack_s)
            if not reply.decision:
                return b""
            leader, decision = unseal(reply.decision, self.ctx.run_id, Decision)
            if leader != decision.leader or decision.round != round_id:
                raise ProtocolError("decision not signed by its leader, or for another round")
            if decision.status == "commit":
                await self.server.verify_commit(reply.decision)  # a forged commit is refused here
                self.book.add(reply.decision)
            elif decision.attempt != attempt or plan is None or not self.server.is_retry_of(plan, leader, decision):
                return b""
            return reply.decision
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("decision of round %d from %s: %s", round_id, peer[-8:], exc)
            if isinstance(exc, ProtocolError) and peer != self.me:
                # A bad answer: counted, never struck: polls repeat every second, and a peer on the
                # other side of a real split answers each with its side's commit (a review saw such
                # a peer banned within 20 s, which would hinder the re-sync that heals the split).
                self.transport.guard.count(peer, "decision-reply", exc.reason, strike=False)
            if strict:
                raise
            return b""
