"""The leader's side of an attempt, up to its decision: take joins and aggregators' reports,
wait for every expected trainer or the close, claim the attempt (`claims.py`), then decide
(`decision.py`). A stand-in decides only if the leaders ahead of it stay silent past the close
plus a slack each. A leader that refused some of the attempt's reports (it was behind: restarted
and still catching up, say) and so lacks contributions its fellow leaders may know of, lets them
decide first: it goes last. `RoundServer` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from .aggregator import FUTURE_ROUNDS
from .envelope import unseal
from .have_reports import BEHIND
from .plan import RoundPlan, close_time
from .schema import Ack, Decision, DecisionReply, DecisionRequest, HaveReport, Join, ProtocolError
from .shards import REPORTING_CANDIDATES, max_members, newcomer_room
from .tasks import gather_owned
from .trainer_probes import drop_dead_trainers
from .transport import PeerDead, PeerGone, PeerUnavailable

if TYPE_CHECKING:
    from .server import _Attempt

log = logging.getLogger(__name__)
CATCH_UP_S = 0.5  # the most a leader waits for a shard's primary to catch up with its replica
MISSED_ATTEMPTS = 16  # attempts whose refused reports a leader remembers (the nearest rounds are kept)
MISSED_PER_ATTEMPT = 256  # (aggregator, shard) pairs remembered per attempt
REFUSALS_BELIEVED = 2  # aggregators that must report refusing a contribution before it is not waited for


class Leading:
    """Leading an attempt; needs the server's ctx, transport, book, identity, attempts, joins,
    plan(), _spawn(), _check_open(), _probe(), _claim(), _decide(), _learn() and verify_commit()."""

    ctx: Any
    transport: Any
    book: Any
    identity: Any
    attempts: Any
    joins: Any
    missed_reports: dict[tuple[int, int], set[tuple[str, int]]]  # (round, attempt) -> refused (aggregator, shard)
    behind_said: set[tuple[int, int]]  # attempts whose "behind" answer was logged
    later_claims: dict[int, int]  # round -> newest attempt whose claim we let pass (a fence)
    plan: Any
    _spawn: Any
    _check_open: Any
    _probe: Any
    _claim: Any
    _decide: Any
    _learn: Any
    verify_commit: Any

    async def _on_have(self, sender: str, msg: HaveReport) -> Ack:
        if self.book.decided(msg.round):  # nothing left to lead: no slot, no leading task for it
            return Ack(False, f"round {msg.round} is already decided")
        if msg.round > self.book.latest() + FUTURE_ROUNDS:  # we are behind (or it is far off): say so
            self.transport.guard.count(sender, "have", "future-round", strike=False)
            self._note_missed(sender, msg)
            return self._behind(msg)
        if self.book.opened_at(msg.round) is None:  # the previous commit is not known here: we are behind
            self._note_missed(sender, msg)  # (noted before the wait: the sender may give up first)
            # The sender can hand us that commit if it is the only one we lack (see `plan`), within
            # half a slack, so that it hears our answer before its request times out.
            if msg.round > self.book.latest() + 2 or \
                    await self.plan(msg.round, msg.attempt, self.ctx.slack_s / 2, ask=sender) is None:
                return self._behind(msg)
        self._check_open(msg.round, msg.attempt)  # an attempt that has not begun here: nothing of it missed yet
        plan = await self.plan(msg.round, msg.attempt, self.ctx.slack_s / 2, ask=sender)
        if plan is None:
            return self._behind(msg)
        # Only the aggregators contributors send a shard to may report on it: anyone else could
        # make itself the source of a shard and then build that shard's aggregate.
        if msg.shard >= plan.num_shards or sender not in plan.candidates(msg.shard)[:REPORTING_CANDIDATES]:
            self.transport.guard.count(sender, "have", "not-aggregator", strike=False)
            return Ack(False, "not an aggregator of this shard")
        slot = self.attempts[(msg.round, msg.attempt)]
        # Reports travel concurrently and may arrive out of order; an aggregator's set only grows.
        if len(msg.digests) != len(msg.contributors) or any(len(d) != 16 for d in msg.digests):
            # a commit pins them: one of another length would make it one nobody can verify
            raise ProtocolError("a have report needs one 16-byte digest per contributor")
        expected = set(plan.trainers) | set(self.joins[msg.round])  # nobody else can be in the commit
        held = slot.have[msg.shard].setdefault(sender, {})
        unexpected = 0
        for who, digest in zip(msg.contributors, msg.digests):
            if who in expected:
                held.setdefault(who, digest)  # an aggregator's report only grows; the first digest stays
            else:
                unexpected += 1
        for refused in msg.refused[:64]:
            if refused in expected:  # names of nobody: not kept
                slot.refused_reported.setdefault(refused, set()).add(sender)
        if slot.first_report is None:
            slot.first_report = time.monotonic()
        slot.poke()
        if not slot.leading:
            slot.leading = True
            self._spawn(self._lead_guarded(msg.round, msg.attempt))
        # Not ok: the aggregator reports this shard again with its next change, by when their
        # joins may have arrived (it repeats only what changed since an ok).
        return Ack(not unexpected, f"{unexpected} contributors not expected here (yet)" if unexpected else "")

    def _behind(self, msg: HaveReport) -> Ack:
        """Our answer to a report we cannot take yet; said in the log once per attempt."""
        key = (msg.round, msg.attempt)
        if key not in self.behind_said:
            self.behind_said = {k for k in self.behind_said if k[0] > self.book.latest()}
            if len(self.behind_said) < MISSED_ATTEMPTS:  # bounded: anyone may send reports for far-off rounds
                self.behind_said.add(key)
                log.info("round %d attempt %d: we are behind (we know round %d): its reports are refused until we "
                         "catch up", msg.round, msg.attempt, self.book.latest())
        return Ack(False, BEHIND)

    def _note_missed(self, sender: str, msg: HaveReport) -> None:
        """Remember a report we refused: unless its sender reports the shard again, we may lack
        what it holds when we lead the attempt (see `_reports_missed`). Bounded: the attempts of
        the nearest rounds are kept (anyone may send reports for far-off rounds)."""
        if msg.shard >= self.ctx.max_shards or not self.ctx.may_serve(sender):
            return  # no aggregator of any attempt
        latest = self.book.latest()
        for key in [k for k in self.missed_reports if k[0] <= latest]:
            del self.missed_reports[key]
        missed = self.missed_reports.setdefault((msg.round, msg.attempt), set())
        if len(missed) < MISSED_PER_ATTEMPT:
            missed.add((sender, msg.shard))
        while len(self.missed_reports) > MISSED_ATTEMPTS:
            del self.missed_reports[max(self.missed_reports)]

    def _reports_missed(self, plan: RoundPlan, slot: _Attempt) -> bool:
        """Did we refuse a report of this attempt that its aggregator has not sent again since,
        while some expected contributor is not complete here? Then a fellow leader may know of
        contributions we do not, and deciding first would leave them out."""
        missed = self.missed_reports.get((plan.round, plan.attempt), set())
        lost = any(shard < plan.num_shards and who in plan.candidates(shard)[:REPORTING_CANDIDATES]
                   and who not in slot.have.get(shard, {}) for who, shard in missed)  # only named aggregators count
        return lost and not self._expected(plan, slot) <= self._sources(plan, slot)[1]

    def _expected(self, plan: RoundPlan, slot: _Attempt) -> set[str]:
        """The contributors the attempt waits for: the plan's trainers and those that joined to
        train, less those that said they will not and those an aggregator found invalid."""
        joins = self.joins[plan.round]
        expected = set(plan.trainers) | {p for p, (trains, _) in joins.items() if trains}
        expected -= {p for p, (trains, _) in joins.items() if not trains}  # it left, or will not train this round
        expected -= slot.gone  # its process died (`trainer_probes.drop_dead_trainers`)
        # An invalid contribution will not become valid: not waited for, once two aggregators said
        # so (an honest refusal reaches two: every copy of a small shard, or each next candidate a
        # refused big one goes to). One's word alone let any hostile reporting candidate have a
        # leader close without a trainer it chose (found by a review).
        return expected - {p for p, by in slot.refused_reported.items() if len(by) >= REFUSALS_BELIEVED}

    async def _on_join(self, sender: str, msg: Join) -> Ack:
        if msg.trains and not self.ctx.authorized(sender):
            self.transport.guard.count(sender, "join", "unauthorized", strike=True)
            return Ack(False, "not allowed to contribute to this run")
        if (msg.serves or not msg.trains) and not self.ctx.may_serve(sender):
            # serving, it would lead attempts and build means; a leave (neither) is a member's: in a
            # closed run, strangers' leaves filled a round's join table, and then its own members'
            # joins were refused as "full" (found by a review)
            self.transport.guard.count(sender, "join", "unauthorized", strike=True)
            return Ack(False, "not allowed to serve this run" if msg.serves else "not a member of this run")
        if msg.round > self.book.latest() + FUTURE_ROUNDS:
            raise ProtocolError(f"join for round {msg.round} is too far ahead", reason="future-round", strike=False)
        if msg.round <= self.book.latest():  # moot (a late one, honestly): kept, joins of old rounds would pile up
            return Ack(False, f"round {msg.round} is already committed")
        cap = max_members(self.ctx.max_shards)
        joins = self.joins[msg.round]
        full = sender not in joins and len(joins) >= cap
        if full and self._room_to_make(msg.round, joins, sender) is None:
            # a decision lists every member: it must stay within the schema's bounds
            raise ProtocolError(f"round {msg.round} already has {cap} members", reason="full", strike=False)
        if msg.trains and (m := self.book.membership(msg.round)) is not None and sender not in m.trainers \
                and not joins.get(sender, (False, False))[0]:
            # no more trainers waited for than the aggregators hold (`newcomer_room`)
            planned = set(m.trainers)
            room = newcomer_room(len(planned), self.ctx.max_shards)
            if sum(trains and p not in planned for p, (trains, _) in joins.items()) >= room:
                raise ProtocolError(f"round {msg.round} already has {room} new trainers", reason="full", strike=False)
        if full:  # (only once this join is sure to be taken: a review saw one evicted for nothing)
            del joins[self._room_to_make(msg.round, joins, sender)]
        self.joins[msg.round][sender] = (msg.trains, msg.serves)
        for r in [r for r in self.joins if r < msg.round - 2]:
            del self.joins[r]
        return Ack(True, "")

    def _room_to_make(self, round_id: int, joins: dict[str, tuple[bool, bool]], sender: str) -> str | None:
        """Whose join a full round's table drops for `sender`: a planned member (a trainer or
        server of the round's membership) takes the place of the newest join of a peer the round
        does not plan (joins are free, and the members the last commit named must not be locked out
        by others that came first); None: nobody's (`sender` is not planned, or all are)."""
        m = self.book.membership(round_id)
        planned = set() if m is None else {*m.trainers, *m.servers}
        if sender not in planned:
            return None
        return next((p for p in reversed(joins) if p not in planned), None)

    def _sources(self, plan: RoundPlan, slot: _Attempt, exclude: frozenset[str] = frozenset()
                 ) -> tuple[list[str], set[str]]:
        sources, common = [], None
        # An aggregator that declined to serve on (its uplink is slow) is the source of a shard
        # only if no other holds as many of its contributions: the source serves the aggregate.
        declined = {p for p, (_, serves) in self.joins.get(plan.round, {}).items() if not serves}
        for shard in range(plan.num_shards):
            reports = {a: ids for a, ids in slot.have.get(shard, {}).items() if a not in exclude}
            if not reports:
                return [], set()
            rank = {p: i for i, p in enumerate(plan.candidates(shard))}
            best = min(reports, key=lambda a: (-len(reports[a]), a in declined, rank.get(a, 1 << 30), a))
            sources.append(best)
            common = set(reports[best]) if common is None else common & reports[best].keys()
        return sources, common or set()

    def _digests(self, slot: _Attempt, sources: list[str], contributors: list[str]) -> list[bytes]:
        """What a commit pins: each source's digest of each contribution, shard-major."""
        return [slot.have[shard][src][c] for shard, src in enumerate(sources) for c in contributors]

    async def _lead_guarded(self, round_id: int, attempt: int) -> None:
        try:
            await self._lead(round_id, attempt)
        except* (ProtocolError, PeerUnavailable) as group:  # a conflicting or forged commit elsewhere
            log.warning("leading round %d attempt %d stopped: %s", round_id, attempt, group.exceptions[0])
        except* Exception as group:  # a background task must never take the node down; say what broke
            log.error("leading round %d attempt %d failed: %r", round_id, attempt, group.exceptions[0],
                      exc_info=group)

    async def _lead(self, round_id: int, attempt: int) -> None:
        plan = await self.plan(round_id, attempt, self.ctx.deadline_s)
        me = self.identity.peer_id
        if plan is None or me not in plan.leaders:
            return
        rank = plan.leaders.index(me)
        slot = self.attempts[(round_id, attempt)]
        opened = self.book.opened_at(round_id) or 0.0
        close_wall = close_time(opened, attempt, self.ctx.deadline_s, self.ctx.slack_s)
        close_at = time.monotonic() + (close_wall - time.time())  # the slot's deadline, on our clock
        if time.monotonic() > close_at + (len(plan.leaders) + 1) * self.ctx.slack_s:
            # Past the last stand-in's turn, and past every contributor's wait for the decision:
            # a report that comes this late (withheld by a hostile aggregator) must not have us
            # decide an attempt long over, whose contributors sent their work on (found by a review).
            log.info("round %d attempt %d: a report came after the attempt was over; not led", round_id, attempt)
            return
        # The leader claims the attempt one slack before it closes, while it still waits for
        # contributions: a fellow leader that is frozen then costs no time after the close.
        # (Unless it lacks reports it could not take while behind: then once they are in.)
        started = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            early = tg.create_task(self._claim_at(plan, slot, close_at - self.ctx.slack_s, started, close_at)) \
                if rank == 0 else None
            closed_early = await self._await_close(plan, slot, close_at)
            if early is not None and not started.is_set():
                early.cancel()  # closed early, or still lacking reports: claim below, as stand-ins do
        if self.book.decided(round_id) and (early is None or early.cancelled()):
            return  # the round was decided (another attempt committed) while we waited: nothing to lead
        if early is not None and not early.cancelled() and early.result() is not None:
            if early.result():
                await self._decide_claimed(plan, slot)
            else:
                await self._claim_again(plan, slot, close_at)
            return
        order = list(plan.leaders)  # who decides first
        last = not closed_early and len(order) > 1 and self._reports_missed(plan, slot)
        if last:
            order = [p for p in order if p != me] + [me]
            rank = len(order) - 1
            log.info("round %d attempt %d: we refused reports while behind and lack contributions; our fellow "
                     "leaders decide first", round_id, attempt)
        if rank > 0 or time.monotonic() > close_at + self.ctx.slack_s:
            # Leader k decides only if leaders 0..k-1 stayed silent past the close + k * slack (or
            # are gone: not there at all, rather than slow); a leader that was frozen past its
            # window defers the same way.
            wake = close_at + rank * self.ctx.slack_s
            ahead, alive = await self._leaders_ahead(plan, order[:rank], wake, time.monotonic() >= close_at) \
                if rank > 0 else (0, 0)
            ahead_gone = rank > 0 and ahead == 0
            if last and not ahead_gone:
                ahead = rank  # our turn comes after every fellow's, not after the live ones' only
            if not (closed_early and rank > 0 and alive == 0):
                await asyncio.sleep(max(0.0, close_at + ahead * self.ctx.slack_s - time.monotonic()))
            # (else every trainer is in and every leader ahead of us is dead: nobody else decides
            # before the close, so we do now; a stopped coordinator cost each round its deadline.
            # Dead, not merely gone: a live leader's flood limit also closes a probe unanswered.)
            if slot.decision is not None or self.book.decided(round_id):
                return
            # Ask who may have decided: the leaders ahead of us that are not gone, and those behind
            # us whose turn has come too (only if we were late ourselves): the others wait longer
            # than we do, and a long poll at one of them would only hold us back.
            now = time.monotonic()
            others = [p for j, p in enumerate(order) if p != me and (
                (j < rank and not ahead_gone) or (j > rank and now >= close_at + j * self.ctx.slack_s))]
            replies = await gather_owned(self._ask(p, plan) for p in others)
            for signed in replies:
                if signed and await self._learn_from_fellow(plan, signed):
                    return
        if not await self.decide_exclusively(plan, slot) and self._refused_by_objections(plan, slot):
            # The claim after an early close, a stand-in's, a late first leader's: each was made
            # once, so an objection from an earlier attempt's leader still deciding left the
            # attempt undecided for good (found by a review): its fellows had granted it to us.
            await self._claim_again(plan, slot, close_at, time.monotonic() + self.ctx.slack_s)

    def _refused_by_objections(self, plan: RoundPlan, slot: _Attempt) -> bool:
        """Was our claim refused by others' objections alone, our own grant kept (nothing adopted,
        no later attempt claimed, nothing of ours in the way)? Then nobody else will decide."""
        return (slot.decision is None and not self.book.decided(plan.round)
                and slot.granted_to == self.identity.peer_id
                and self.later_claims.get(plan.round, -1) <= plan.attempt)

    async def _claim_again(self, plan: RoundPlan, slot: _Attempt, close_at: float, first_at: float = 0.0) -> None:
        """Our claim was refused (an earlier attempt's leader was still deciding, say). Our fellow
        leaders granted us the attempt and will not claim it themselves, so we ask again: at the
        close (or `first_at`, if later), then every slack while a stand-in could still have decided."""
        last = close_at + len(plan.leaders) * self.ctx.slack_s
        at = max(first_at or close_at, time.monotonic())
        while at <= last:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if slot.decision is not None or self.book.decided(plan.round):
                return
            if await self._claim(plan, slot):
                await self._decide_claimed(plan, slot)
                return
            at = time.monotonic() + self.ctx.slack_s

    async def _await_close(self, plan: RoundPlan, slot: _Attempt, close_at: float) -> bool:
        """Wait until every expected trainer is complete (and they are enough to commit: True), or
        the close (False). Trainers whose process died meanwhile are not waited for."""
        async with asyncio.TaskGroup() as tg:
            prober = tg.create_task(drop_dead_trainers(
                plan, slot, close_at, self.ctx, self.identity.peer_id,
                lambda: (self._expected(plan, slot), self._sources(plan, slot)[1]),
                lambda peer: self._probe(peer, plan, self.ctx.slack_s)))
            try:
                return await self._await_complete(plan, slot, close_at)
            finally:
                prober.cancel()

    async def _await_complete(self, plan: RoundPlan, slot: _Attempt, close_at: float) -> bool:
        while time.monotonic() < close_at and not self.book.decided(plan.round):  # (decided: nothing to wait for)
            expected = self._expected(plan, slot)
            _, complete = self._sources(plan, slot)
            if expected <= complete and len(complete) >= self.ctx.min_peers:
                await self._first_holders_catch_up(plan, slot, complete, min(close_at, time.monotonic() + CATCH_UP_S))
                return True
            if not await slot.wait_changed(close_at):
                return False
        return False

    async def _first_holders_catch_up(self, plan: RoundPlan, slot: _Attempt, complete: set[str],
                                      until: float) -> None:
        """Give each shard's primary aggregator a moment to report it holds `complete`.

        A replica's report can beat its primary's (even the primary's first report) by a few ms;
        sourcing a shard from the replica would pile two shards' aggregation on one peer, so the
        leader waits briefly for the primary. A dead primary costs this wait once per attempt."""
        def lagging() -> bool:
            for shard in range(plan.num_shards):
                reports = slot.have.get(shard, {})
                primary = plan.candidates(shard)[0]
                if primary not in reports or not complete <= reports[primary].keys():
                    return True
            return False

        while lagging() and await slot.wait_changed(until):
            pass

    async def _claim_at(self, plan: RoundPlan, slot: _Attempt, at: float, started: asyncio.Event,
                        until: float = 0.0) -> bool | None:
        """Claim the attempt at monotonic time `at` (cancelled only before `started` is set), or,
        while we lack reports we refused (see `_reports_missed`), once they are in, before
        `until`. None: not claimed by then."""
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        while self._reports_missed(plan, slot):
            if not await slot.wait_changed(until):
                return None
        started.set()
        return slot.decision is None and not self.book.decided(plan.round) and await self._claim(plan, slot)

    async def decide_exclusively(self, plan: RoundPlan, slot: _Attempt) -> bool:
        """Decide the attempt, unless it is decided, the round committed, or another leader claimed
        it; did our claim pass?"""
        if slot.decision is None and not self.book.decided(plan.round) and await self._claim(plan, slot):
            await self._decide_claimed(plan, slot)
            return True
        return False

    async def _decide_claimed(self, plan: RoundPlan, slot: _Attempt) -> None:
        try:
            await self._decide(plan, slot)
        finally:
            slot.deciding = slot.decision is not None  # stood back: no longer objects to later claims

    async def _leaders_ahead(self, plan: RoundPlan, ahead: list[str], until: float, closed: bool
                             ) -> tuple[int, int]:
        """How many of the leaders `ahead` of us are not gone (dial refused, protocol not served),
        as far as can be told before monotonic time `until`? A silent or slow one may still decide.
        And how many are not dead (no stream could be opened at all: `PeerDead`).

        `closed`: asked at the close, not at an early one. Then the first leader, which claims the
        attempt from its fellow leaders a slack before the close, counts as gone if its claim has
        not reached us: it is a slack late already (frozen, dead, or behind: it cannot plan the
        round). If it comes back and claims after all, the grants decide between us."""
        slot = self.attempts[(plan.round, plan.attempt)]

        async def gone(peer: str) -> tuple[bool, bool]:
            if closed and peer == plan.leaders[0] and peer not in slot.claimed_by:
                return True, False
            answer = await self._probe(peer, plan, self.ctx.slack_s)
            return isinstance(answer, PeerGone), isinstance(answer, PeerDead)

        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                found = await gather_owned(gone(p) for p in ahead)
                return sum(not g for g, _ in found), sum(not d for _, d in found)
        except TimeoutError:
            return len(ahead), len(ahead)

    async def _learn_from_fellow(self, plan: RoundPlan, signed: bytes) -> bool:
        """Take a fellow leader's answer: this attempt's decision, or the round's commit from
        another attempt (a peer answers with the round's commit whatever attempt is asked).
        False: nothing we can take (a forgery, say); we decide ourselves."""
        try:
            _, decision = unseal(signed, self.ctx.run_id, Decision)
            if decision.status == "commit" and decision.round == plan.round and decision.attempt != plan.attempt:
                await self.verify_commit(signed)
                self.book.add(signed)
                self.attempts[(plan.round, plan.attempt)].poke()
                return True
            await self._learn(plan, signed)
            return True
        except ProtocolError as exc:
            log.warning("round %d attempt %d: a fellow leader's answer was refused: %s", plan.round, plan.attempt, exc)
            return False

    async def _ask(self, peer: str, plan: RoundPlan) -> bytes:
        try:
            reply = await self.transport.request(peer, "get-decision", DecisionRequest(plan.round, plan.attempt,
                                                 self.ctx.slack_s / 2), DecisionReply, timeout_s=self.ctx.slack_s)
            return reply.decision
        except (PeerUnavailable, ProtocolError):
            return b""
