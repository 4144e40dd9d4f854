"""The serving half of the round protocol: aggregator, leader, and the archive of past rounds.

Aggregator (`aggregator.py`, mixed in): holds contributors' shard payloads for an attempt, reports who is complete to the
attempt's leader and backup leader (`have_reports.py`), and on a commit `Seal` builds its shard's aggregate over
exactly the decided contributors (refusing if it lacks any: wholly in or wholly out).
Leader: waits until every expected trainer is complete in every shard, or the close (a slack
before the deadline); picks
one source aggregator per shard; commits if at least `min_peers` contributors are complete in
all sources and every source sealed, else decides "retry". The backup leader decides only if
the leader stays silent past the close + slack (the deadline); with scoring on, it drops contributions whose
update alone worsens a probe loss and decides again (waiting and scheduling: `leading.py`;
claims: `claims.py`; the decision itself: `decision.py`; all mixed in).
Archive: committed decisions (in the `DecisionBook`) and aggregate shards of recent rounds, so
stragglers and joiners can catch up from any peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from groundswell.compression import Payload

from .aggregator import Aggregator
from .claims import Claims
from .context import DecisionBook, Membership, RoundContext
from .decision import Decider
from .envelope import unseal
from .identity import Identity
from .leading import Leading
from .plan import RoundPlan, attempt_for, make_plan
from .schema import (
    MAX_SMALL,
    AggregateRequest,
    AggregateShard,
    Claim,
    ContributionsRequest,
    Decision,
    DecisionReply,
    DecisionRequest,
    HaveReport,
    Join,
    ProtocolError,
    Seal,
    ShardContribution,
)
from .shards import REPORTING_CANDIDATES
from .transport import PeerUnavailable, Presealed, Transport

log = logging.getLogger(__name__)
PLANS_KEPT = 64  # attempts' plans remembered (`RoundServer.plan`)


def check_commit_members(ctx: RoundContext, leader: str, d: Decision) -> None:
    """The checks on a commit that need no plan of its round: at least `min_peers` distinct,
    allowed, sorted contributors; a next membership that keeps them (trainers), its leader and
    sources (servers), all allowed; one 16-byte digest per contribution and shard. ProtocolError
    ("forged-decision") otherwise. Also for a commit that comes with a state, whose round's plan
    a joiner cannot know."""
    if (d.contributors != sorted(set(d.contributors)) or len(d.contributors) < ctx.min_peers
            or not all(ctx.authorized(c) for c in d.contributors)):
        raise ProtocolError("a commit needs min_peers distinct, allowed, sorted contributors",
                            reason="forged-decision")
    # The next round's membership is this commit's word alone (every later plan is drawn from it):
    # a leader may add joiners and drop the silent, but never its own contributors (trainers),
    # itself or the sources it sealed with (servers). Before, `servers = trainers = [itself]`
    # passed, and one hostile leader held every role of every later round.
    if (d.trainers != sorted(set(d.trainers)) or d.servers != sorted(set(d.servers))
            or not set(d.contributors) <= set(d.trainers) or leader not in d.servers
            or not set(d.sources) <= set(d.servers) or not all(ctx.authorized(t) for t in d.trainers)
            or not all(ctx.may_serve(x) for x in d.servers)):
        raise ProtocolError("a commit's next membership must list, sorted and allowed, its contributors as "
                            "trainers and its leader and sources as servers", reason="forged-decision")
    if len(d.digests) != d.num_shards * len(d.contributors) or any(len(x) != 16 for x in d.digests):
        raise ProtocolError("a commit pins one 16-byte digest per contribution and shard", reason="forged-decision")


@dataclass
class _Attempt:
    """Everything this peer holds for one attempt of one round."""

    contributions: dict[int, dict[str, tuple[int, list[bytes], bytes]]] = field(
        default_factory=lambda: defaultdict(dict))  # shard -> sender -> (first segment, segments, signed request)
    refused: set[str] = field(default_factory=set)  # as an aggregator: senders of invalid contributions
    sq_norms: dict[tuple[int, str], float] = field(default_factory=dict)  # (shard, sender) -> squared norm (dense, clipped)
    parsed: dict[tuple[int, str], list[Payload]] = field(default_factory=dict)  # (shard, sender) -> checked segments (sparse)
    refresh: bool = False  # as an aggregator: our reports are sent again one slack before the close
    report_pending: bool = False  # as an aggregator: a launch of report tasks is waiting for the plan
    reporting: set[str] = field(default_factory=set)  # ... leaders a report task is running for
    report_again: set[str] = field(default_factory=set)  # ... and something changed since it started: once more
    report_all: bool = False  # ... the next launch repeats what leaders were already told (the refresh)
    report_everything: set[str] = field(default_factory=set)  # ... leaders whose next report repeats everything
    # as an aggregator: (leader, shard) -> (contributors, refused) that leader has acknowledged
    told: dict[tuple[str, int], tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    # as a leader: contributor -> the aggregators that reported refusing its contribution as invalid
    refused_reported: dict[str, set[str]] = field(default_factory=dict)
    # shard -> aggregator -> contributor -> digest of the contribution it holds
    have: dict[int, dict[str, dict[str, bytes]]] = field(default_factory=lambda: defaultdict(dict))
    first_report: float | None = None
    gone: set[str] = field(default_factory=set)  # as a leader: expected trainers found dead, not waited for
    decision: bytes | None = None  # signed decision of this attempt (as leader, or learned)
    sealed: bytes | None = None  # the commit this peer sealed as an aggregator
    confirmed: bytes | None = None  # ... the one its leader confirmed before announcing it: final for later claimers
    voided_by: set[str] = field(default_factory=set)  # as an aggregator: leaders that took their commits back
    seals_built: dict[str, int] = field(default_factory=dict)  # as an aggregator: leader -> distinct seals built
    sealing: asyncio.Lock = field(default_factory=asyncio.Lock)  # as an aggregator: one seal is built at a time
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    leading: bool = False
    granted_to: str | None = None  # the one leader this peer lets decide the attempt (itself included)
    claimed_by: set[str] = field(default_factory=set)  # fellow leaders whose claim of the attempt reached us
    deciding: bool = False  # this peer passed its claim and is deciding: it no longer yields

    def poke(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_changed(self, until: float) -> bool:
        """Wait until something in this attempt changes (True) or the monotonic time `until` (False)."""
        waiter = self.changed
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                await waiter.wait()
            return True
        except TimeoutError:
            return False


class RoundServer(Aggregator, Leading, Claims, Decider):
    """Serves the round protocol for one peer; every background task belongs to its TaskGroup."""

    def __init__(self, ctx: RoundContext, transport: Transport, book: DecisionBook, identity: Identity,
                 tasks: asyncio.TaskGroup) -> None:
        self.ctx = ctx
        self.transport = transport
        self.book = book
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(); commits may be recorded from other threads
        book.on_commit = self._poke_round
        self.identity = identity
        self.tasks = tasks
        self.attempts: dict[tuple[int, int], _Attempt] = defaultdict(_Attempt)
        self.joins: dict[int, dict[str, tuple[bool, bool]]] = defaultdict(dict)
        self.missed_reports: dict[tuple[int, int], set[tuple[str, int]]] = {}  # see `Leading._note_missed`
        self.behind_said: set[tuple[int, int]] = set()  # see `Leading._behind`
        self.aggregates: dict[tuple[int, int], AggregateShard] = {}
        self._sealed: dict[tuple[int, int], Presealed] = {}  # see `_sealed_aggregate`
        self._sealed_shared: weakref.WeakValueDictionary[tuple[int, int], Presealed] = weakref.WeakValueDictionary()
        self._sealing = asyncio.Lock()
        self._sealing_fresh = asyncio.Lock()  # (the newest two rounds': see `_sealed_aggregate`)
        self.later_claims: dict[int, int] = {}  # round -> newest attempt whose claim we let pass (a fence)
        # Fences and seals live in memory: a restarted process has forgotten those its previous
        # one held, so it seals nothing of an attempt that began before it (`_seal_refusal`).
        self.started_at = time.time()
        self.unobtainable: dict[bytes, tuple[int, bool]] = {}  # see `Claims.unobtainable`
        self.whole_tries: dict[tuple[int, int, str], int] = {}  # see `Claims.whole_tries`
        self._learning: set[int] = set()  # rounds whose commit we are asking a peer for (`_learn_previous`)
        self._plans: OrderedDict[tuple[int, int, Membership], RoundPlan] = OrderedDict()  # see `plan`
        self._archived = asyncio.Event()
        self.keep_rounds = 8
        # Set by the peer: fetch (and archive) every shard of a signed commit. A leader holds the
        # whole aggregate before it announces a commit, so the death of one aggregator right
        # after sealing cannot make a committed round unobtainable.
        self.prefetch: Callable[[bytes], Awaitable[Any]] | None = None
        # Optional contribution scoring (aggregates of signed contributions): before it decides, the
        # leader fetches the contributions, the peer scores each one alone (probe loss after minus
        # before), and those above `score_threshold` are left out of the decision.
        self.individual: Callable[[RoundPlan, list[str], list[str], list[bytes]], Awaitable[dict[str, Any]]] | None = None
        self.score: Callable[[int, dict[str, Any]], Awaitable[dict[str, float]]] | None = None
        self.score_threshold = 0.0
        self.scores: dict[int, dict[str, float]] = {}  # round -> contributor -> score, as this leader found

    async def start(self) -> None:
        """Register every handler on the transport."""
        self._loop = asyncio.get_running_loop()
        big = self.ctx.max_payload_bytes + MAX_SMALL
        t = self.transport
        # A closed run's stranger is refused before its (large) body is read, not after.
        await t.serve("contribute", ShardContribution, self._on_contribute, max_request=big, with_envelope=True,
                      admit=lambda remote: None if self.ctx.authorized(remote) else "unauthorized")
        await t.serve("have", HaveReport, self._on_have)
        await t.serve("join", Join, self._on_join)
        await t.serve("get-decision", DecisionRequest, self._on_get_decision)
        # Only a peer that may lead attempts can seal: a stranger's seal in a closed run is refused
        # before its body (up to a megabyte of commit to decode) is read.
        await t.serve("seal", Seal, self._on_seal,
                      admit=lambda remote: None if self.ctx.may_serve(remote) else "unauthorized")
        await t.serve("claim", Claim, self._on_claim)
        await t.serve("get-aggregate", AggregateRequest, self._on_get_aggregate)
        await t.serve("get-contributions", ContributionsRequest, self._on_get_contributions)

    # --- helpers ------------------------------------------------------------------------------
    async def plan(self, round_id: int, attempt: int, wait_s: float, ask: str | None = None) -> RoundPlan | None:
        """This attempt's plan, once the previous round's decision is known here. `ask`: a peer
        that sent us a request for this attempt, so it knows that decision: if it is the only one
        we lack, we get it from that peer at once instead of waiting for our own poll to learn it
        (a peer busy applying a round, like the coordinator in short rounds, lags one behind)."""
        if ask is not None and wait_s > 0 and self.book.membership(round_id) is None:
            started = time.monotonic()  # within the caller's wait: a claimer times out on our answer
            await self._learn_previous(round_id, ask, wait_s)
            wait_s = max(0.0, wait_s - (time.monotonic() - started))
        m = await self.book.wait_membership(round_id, wait_s)
        if m is None or not m.servers:
            return None
        # Remembered: every request of an attempt needs its plan, and making one ranks every
        # server (2.4 ms at 2,048 of them), which anyone's requests cost us each time (a review).
        key = (round_id, attempt, m)
        if (plan := self._plans.get(key)) is None:
            plan = make_plan(self.ctx.run_id, round_id, attempt, m.servers, m.trainers,
                             len(self.ctx.segment_numels), self.ctx.max_shards)
            self._plans[key] = plan
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        return plan

    def _poke_round(self, round_id: int) -> None:
        """Wake whatever waits on an attempt of `round_id` (the round was just committed)."""
        try:
            on_loop = self._loop is None or asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if not on_loop and self._loop is not None:  # a participant adopting a state records its commit from its thread
            try:
                self._loop.call_soon_threadsafe(self._poke_round, round_id)
            except RuntimeError:  # the node has closed: nobody waits any more
                pass
            return
        for (r, _), slot in list(self.attempts.items()):
            if r == round_id:
                slot.poke()

    async def _learn_previous(self, round_id: int, peer: str, wait_s: float) -> None:
        """Get the commit of round `round_id - 1` from `peer` (once at a time), if it is the one we lack."""
        previous = round_id - 1
        if peer == self.identity.peer_id or self.book.membership(previous) is None or previous in self._learning:
            return  # further behind: catching up is the participant's job
        self._learning.add(previous)
        try:
            reply = await self.transport.request(peer, "get-decision", DecisionRequest(previous, 0, 0.0), DecisionReply,
                                                 timeout_s=min(wait_s, self.ctx.slack_s / 2))
            if reply.decision:
                d = await self.verify_commit(reply.decision)
                if d.round != previous:
                    raise ProtocolError(f"asked for round {previous}'s commit, got round {d.round}'s",
                                        reason="forged-decision")
                self.book.add(reply.decision)
                log.info("learned round %d's commit from %s, who asked about round %d", previous, peer[-8:], round_id)
        except ProtocolError as exc:  # a bad commit: counted (and struck if it can only be forged)
            self.transport.guard.count(peer, "decision-reply", exc.reason, strike=exc.strike)
            log.warning("round %d's commit from %s refused: %s", previous, peer[-8:], exc)
        except PeerUnavailable as exc:  # our own poll still learns it, later
            log.info("round %d's commit from %s: %s", previous, peer[-8:], exc)
        finally:
            self._learning.discard(previous)

    def archive(self, round_id: int, shard: int, agg: AggregateShard | None) -> None:
        """Keep an aggregate shard of a committed round to serve to peers that catch up (None: one
        nobody will ask us for), and let go of what is older."""
        if agg is not None:
            self.aggregates[(round_id, shard)] = agg
        for key in [k for k in self.aggregates if k[0] < round_id - self.keep_rounds]:
            del self.aggregates[key]
        for key in [k for k in self.attempts if k[0] < round_id - 1]:
            del self.attempts[key]
        for r in [r for r in self.later_claims if r < round_id - 1]:
            del self.later_claims[r]
        for signed in [x for x, (r, _) in self.unobtainable.items() if r < round_id - 1]:
            del self.unobtainable[signed]
        for key in [k for k in self.whole_tries if k[0] < round_id - 1]:
            del self.whole_tries[key]
        self._archived.set()
        self._archived = asyncio.Event()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task of the server's group (dropped, not leaked, once it is closing)."""
        try:
            self.tasks.create_task(coro)
        except RuntimeError:  # the node is shutting down: the task group takes no new work
            coro.close()

    # --- decisions --------------------------------------------------------------------------
    async def verify_commit(self, signed: bytes, wait_s: float = 0.0) -> Decision:
        """A signed commit, checked against its attempt's plan: signed by one of the attempt's
        leaders, at least `min_peers` distinct allowed contributors (sorted), and one source per
        shard among that shard's aggregators. ProtocolError otherwise (unverifiable: no strike)."""
        leader, d = unseal(signed, self.ctx.run_id, Decision)
        if d.status != "commit" or leader != d.leader:
            raise ProtocolError("not a commit signed by its leader", reason="forged-decision")
        if d.round < 0:
            raise ProtocolError("genesis comes only with the run's state", reason="forged-decision")
        plan = await self.plan(d.round, d.attempt, wait_s)
        if plan is None:
            raise ProtocolError(f"round {d.round - 1} is not known here: cannot check this commit",
                                reason="unverifiable", strike=False)
        if leader not in plan.leaders:
            raise ProtocolError(f"{leader[-8:]} does not lead round {d.round} attempt {d.attempt}",
                                reason="forged-decision")
        opened = self.book.opened_at(d.round)
        if opened is not None and d.attempt > attempt_for(time.time() + 2 * self.ctx.slack_s, opened,
                                                          self.ctx.deadline_s, self.ctx.slack_s) + 1:
            # The bound `_check_open` puts on everything else: a leader of a far-off attempt (roles
            # reshuffle each attempt, so anyone leads one) must not commit the round in advance.
            raise ProtocolError(f"round {d.round} attempt {d.attempt} has not begun", reason="forged-decision",
                                strike=False)  # or our clock is behind
        check_commit_members(self.ctx, leader, d)
        # Its time opens the next round: every later attempt number is counted from it. Leaders'
        # clocks may differ by the allowed skew, no more: a time far off would stall the run.
        skew = self.ctx.limits.max_clock_skew_s
        if not (opened is None or opened - skew <= d.time) or d.time > time.time() + skew:
            raise ProtocolError(f"a commit's time must lie between its round's opening and now (within "
                                f"{skew:g} s)", reason="forged-decision", strike=opened is not None)
        if d.num_shards != plan.num_shards or len(d.sources) != plan.num_shards or any(
                src not in plan.candidates(s)[:REPORTING_CANDIDATES] for s, src in enumerate(d.sources)):
            raise ProtocolError("a commit's sources must be its shards' aggregators", reason="forged-decision")
        return d

    @staticmethod
    def is_retry_of(plan: RoundPlan, signer: str, decision: Decision) -> bool:
        """Is this the attempt's "retry", signed by one of the attempt's own leaders? Anyone can
        sign a retry naming themselves: taken from anyone else, it would end an attempt for all."""
        return (decision.status == "retry" and (decision.round, decision.attempt) == (plan.round, plan.attempt)
                and signer == decision.leader and decision.leader in plan.leaders)

    async def _learn(self, plan: RoundPlan, signed: bytes) -> None:
        leader, decision = unseal(signed, self.ctx.run_id, Decision)
        if (decision.round, decision.attempt) != (plan.round, plan.attempt) or leader != decision.leader:
            raise ProtocolError("decision for another round, or not signed by its leader")
        if decision.status == "commit":
            await self.verify_commit(signed)
        elif not self.is_retry_of(plan, leader, decision):
            raise ProtocolError("a retry must come from one of the attempt's leaders", reason="forged-decision")
        self.attempts[(plan.round, plan.attempt)].decision = signed
        if decision.status == "commit":
            self.book.add(signed)
        self.attempts[(plan.round, plan.attempt)].poke()

    async def _on_get_decision(self, sender: str, msg: DecisionRequest) -> DecisionReply:
        deadline = time.monotonic() + min(msg.wait_s, self.ctx.deadline_s + 5 * self.ctx.slack_s)
        if msg.round not in self.book.committed and self.book.decided(msg.round):
            return DecisionReply(b"")  # long over and forgotten here: nothing to wait for (the asker re-syncs)
        if msg.round in self.book.committed:  # without making a slot: any attempt number would
            return DecisionReply(self.book.committed[msg.round][0])
        if (msg.round, msg.attempt) not in self.attempts:
            self._check_open(msg.round, msg.attempt)  # a reader must not make us keep slots for any round
        slot = self.attempts[(msg.round, msg.attempt)]
        while True:
            if msg.round in self.book.committed:
                return DecisionReply(self.book.committed[msg.round][0])
            if slot.decision is not None:
                return DecisionReply(slot.decision)
            if deadline <= time.monotonic():
                return DecisionReply(b"")
            await slot.wait_changed(deadline)
