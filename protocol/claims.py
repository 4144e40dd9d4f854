"""Claims: one decider per attempt, and no second commit of a round.

Before a leader decides an attempt it grants the attempt to itself, then asks its fellow leaders
(and the leaders of the round's earlier attempts) for it. See protocol/README.md for the rules
and why two leaders cannot both pass; `RoundServer` mixes this in.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .aggregator import COMMITTED_OTHERWISE, LATER_ATTEMPT_CLAIMED
from .envelope import unseal
from .plan import RoundPlan
from .schema import Ack, Claim, ClaimReply, Decision, DecisionReply, DecisionRequest, ProtocolError
from .shards import REPORTING_CANDIDATES
from .tasks import gather_owned
from .transport import PeerDead, PeerUnavailable

if TYPE_CHECKING:
    from .server import _Attempt

log = logging.getLogger(__name__)

# A claim fences off (and may adopt a commit of) this many attempts of the round before its own.
EARLIER_ATTEMPTS_CLAIMED = 4
# An earlier attempt's leader's final commits get the whole window to gather this many times (per
# claimer), then two slacks: a re-seal after a stale first commit still gets its turn.
WHOLE_TRIES = 2
# At most this long (and half a slack, so a claimer waiting on our answer is not timed out) to
# find out whether a grant's holder is dead; a refused dial is quick.
PROBE_S = 2.0


async def ping(transport: Any, peer: str, round_id: int, attempt: int, timeout_s: float) -> PeerUnavailable | None:
    """Ask `peer` once, without waiting, for an attempt's decision: None if it answered in time,
    else why not: `PeerDead` (nothing could be opened), `PeerGone` (it refused or closed the
    request unanswered: there, but saying no), or a plain `PeerUnavailable` (too slow, or a bad
    answer)."""
    try:
        await transport.request(peer, "get-decision", DecisionRequest(round_id, attempt, 0.0), DecisionReply,
                                timeout_s=timeout_s)
        return None
    except PeerUnavailable as exc:
        return exc
    except ProtocolError as exc:
        return PeerUnavailable(str(exc))


def _decision_time(signed: bytes, run_id: str) -> float:
    """The time a signed decision carries (0 if it is not one: it is refused when adopted)."""
    try:
        return unseal(signed, run_id, Decision)[1].time
    except ProtocolError:
        return 0.0


class Claims:
    """The claim half of the leader; needs the server's identity, transport, book, plan() and attempts."""

    identity: Any
    transport: Any
    book: Any
    ctx: Any
    attempts: Any
    later_claims: dict[int, int]  # round -> newest attempt whose claim this peer let pass
    # earlier attempts' commits whose aggregate a claim could not gather -> (round, tried for the whole window)
    unobtainable: dict[bytes, tuple[int, bool]]
    whole_tries: dict[tuple[int, int, str], int]  # (round, attempt, leader) -> whole windows its commits had
    plan: Callable[..., Awaitable[RoundPlan | None]]  # RoundServer.plan
    _hold_all: Callable[[bytes, float | None], Awaitable[bool]]  # RoundServer._hold_all: gather a commit's aggregate

    async def _claim(self, plan: RoundPlan, slot: _Attempt) -> bool:
        """May this leader decide? Not if it (or a fellow leader it asked) already let another
        leader decide this attempt, nor if anyone asked knows a commit of the round (it is adopted).

        A leader grants itself before it asks, so of two leaders that both ask, at least one is
        refused by the other. A frozen or dead leader cannot object (liveness over a stall), so a
        later attempt's claim also fences the earlier attempts off at every peer their leaders
        could seal: a leader that wakes from a freeze mid-decision finds its seals refused and
        stands back. A split is left possible only if the later leader reached none of the
        sealed peers (a real network partition with peers on both sides: a leader must have a
        seal from another peer to commit, `Decider._witnesses`), where hash checks re-sync one side."""
        me = self.identity.peer_id
        await self._revoke_if_dead(plan, slot)
        if (slot.granted_to not in (None, me) or self.later_claims.get(plan.round, -1) > plan.attempt
                or self._deciding_before(plan.round, plan.attempt)):
            return False
        slot.granted_to = me
        # Ask in two steps. First the fellow leaders and the earlier attempts' leaders: one of
        # those that is deciding objects, and then nobody has been fenced off on our account.
        # Then every peer an earlier attempt's leader could seal (a shard's first candidates): a
        # leader that committed an earlier attempt and died or froze before anyone asked left its
        # commit with them (we adopt it); otherwise each fences that attempt off (see `_on_claim`).
        # Newest first: the group is capped, and the attempt just before ours matters most.
        earlier = [p for a in range(plan.attempt - 1, max(0, plan.attempt - EARLIER_ATTEMPTS_CLAIMED) - 1, -1)
                   if (p := await self.plan(plan.round, a, 0)) is not None]
        leaders = [*plan.leaders, *(x for old in earlier for x in old.leaders)]
        holders = [x for old in earlier for s in range(old.num_shards)
                   for x in old.candidates(s)[:REPORTING_CANDIDATES]]
        ours: list[tuple[bytes, bool]] = []
        for fence, group in ((False, leaders), (True, [*leaders, *holders])):
            if fence:
                if not earlier:
                    break  # attempt 0: nothing to fence off
                if self._deciding_before(plan.round, plan.attempt):
                    return False  # we began deciding an earlier attempt ourselves meanwhile
                # We may be one of those aggregators too: fenced off here from now on (no await
                # in between), and a commit we sealed before is tried as a witness's would be,
                # once the others are fenced too (its leader may re-seal at those until then).
                self.later_claims[plan.round] = max(self.later_claims.get(plan.round, -1), plan.attempt)
                ours = self._seals_before(plan.round, plan.attempt)
            others = [x for x in dict.fromkeys(group) if x != me][:32]
            replies = await gather_owned(self._ask_claim(x, plan, fence) for x in others)
            objected = any(r is not None and not r.ok and not r.decision for r in replies)
            if objected and not fence:
                # A leader deciding an earlier attempt, or one that let another claimer have
                # ours: heard before anything is adopted. Adopted first, a commit a replier called
                # final, on its word alone, was taken over the objection of its leader, which still
                # replaced it by another and announced that (a review). In the fenced step the
                # earlier leaders can no longer confirm where we fenced, and objections there (a
                # peer catching up, which cannot note a fence) stop the claim only after adoption.
                return False
            witnessed: dict[bytes, list[Any]] = {s: [f, 1] for s, f in ours} if fence else {}  # each tried once
            for r in replies:
                if r is not None and not r.ok and r.decision:
                    seen = witnessed.setdefault(r.decision, [False, 0])
                    seen[0], seen[1] = seen[0] or r.final, seen[1] + 1
            # Final ones first, then those more peers hold, then the newest: a holder that missed
            # its leader's re-seal still hands the older seal, and may call it final.
            for signed, (final, _) in sorted(witnessed.items(), key=lambda w: (not w[1][0], -w[1][1],
                                                                            -_decision_time(w[0], self.ctx.run_id))):
                if await self._adopt(plan, signed, final, fenced=fence):
                    return False
            if objected:
                return False
        # A lower-ranked leader's claim may have taken our grant while we waited, or we let a
        # later attempt's leader pass (our own slot was not deciding yet): then we yield.
        if (slot.granted_to != me or slot.decision is not None
                or self.later_claims.get(plan.round, -1) > plan.attempt):
            return False
        slot.deciding = True
        return True

    async def _revoke_if_dead(self, plan: RoundPlan, slot: _Attempt, claimer: str | None = None) -> None:
        """Take our grant back from a fellow leader whose process is gone.

        A leader that passed its claim and then died holds its fellow leaders' grants: nobody
        else could decide the attempt, and the round lost a whole slot. Its process is gone when
        no stream to it can be opened (`PeerDead`: dial refused, protocol not served); a new
        process under its name has no memory of the claim, so cannot be halfway through a
        decision. A slow, frozen or refusing holder keeps the grant. `claimer`: only on behalf of
        a leader ranked behind the holder (one ranked ahead gets the grant anyway)."""
        me, holder = self.identity.peer_id, slot.granted_to
        if holder in (None, me, claimer) or holder not in plan.leaders or (
                claimer is not None and plan.leaders.index(claimer) < plan.leaders.index(holder)):
            return
        failure = await self._probe(holder, plan, min(self.ctx.slack_s / 2, PROBE_S))
        if isinstance(failure, PeerDead) and slot.granted_to == holder and slot.decision is None:
            log.info("round %d attempt %d: %s held our grant and is gone (%s): taken back", plan.round,
                     plan.attempt, holder[-8:], failure)
            slot.granted_to = None

    async def _probe(self, peer: str, plan: RoundPlan, timeout_s: float) -> PeerUnavailable | None:
        """`ping` a peer about the plan's attempt."""
        return await ping(self.transport, peer, plan.round, plan.attempt, timeout_s)

    def _deciding_before(self, round_id: int, attempt: int) -> bool:
        """Is this peer, as a leader, deciding an earlier attempt of the round right now?"""
        return any(r == round_id and a < attempt and held.deciding and held.decision is None
                   for (r, a), held in list(self.attempts.items()))

    async def _ask_claim(self, peer: str, plan: RoundPlan, fence: bool = False) -> ClaimReply | None:
        try:
            return await self.transport.request(peer, "claim", Claim(plan.round, plan.attempt, fence), ClaimReply,
                                                timeout_s=self.ctx.slack_s)
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("claim of round %d attempt %d at %s: %s", plan.round, plan.attempt, peer[-8:], exc)
            return None

    async def _adopt(self, plan: RoundPlan, signed: bytes, final: bool = False, fenced: bool = True) -> bool:
        """Take a decision a witness returned; True: stand back. A commit is taken only once its
        whole aggregate is in hand; an earlier attempt's that cannot be had stops nobody. One
        that is `final` (announced, or confirmed by its leader) gets the whole window to gather:
        its leader holds the aggregate. (Standing back for good over one that cannot be had was
        weighed and left out: `final` is the replier's word, and a hostile replier could then
        hold every later attempt back.) An earlier attempt's commit that is not final is taken
        only once its holders are `fenced` (the claim's second step): until then its leader may
        still re-seal the attempt otherwise (a failed source replaced) and announce that."""
        try:
            signer, decision = unseal(signed, self.ctx.run_id, Decision)
            if decision.round != plan.round:
                raise ProtocolError("decision for another round")
        except ProtocolError as exc:  # a forged or foreign decision stops nobody
            log.warning("claim reply carried an unusable decision: %s", exc)
            return False
        if decision.status == "commit":
            try:
                await self.verify_commit(signed)  # type: ignore[attr-defined]
            except ProtocolError as exc:
                log.warning("claim reply carried a commit that does not check out: %s", exc)
                return False
            earlier = decision.attempt < plan.attempt
            if decision.attempt < plan.attempt - EARLIER_ATTEMPTS_CLAIMED:
                # Older than any attempt a claim fences: its contributors no longer keep that work
                # open (they settle it by digest only that far back), so it would count twice.
                return False
            if earlier and not final and not fenced:
                return False  # the fenced step hands it over again, once its leader can no longer re-seal
            whole = not earlier or final
            # The whole window at most WHOLE_TRIES times per leader of an earlier attempt, then
            # two slacks: a hostile leader signed a fresh commit (a new `time`) for every reply,
            # and each cost a claim step the whole window (a review: every claim took two). Not
            # once per leader: its stale first commit would hide its re-seal (a second review).
            leader_key = (decision.round, decision.attempt, signer)
            if whole and earlier and self.whole_tries.get(leader_key, 0) >= WHOLE_TRIES:
                whole = False
            tried = self.unobtainable.get(signed)
            if tried is not None and (tried[1] or not whole):
                return False  # tried already, by an earlier claim of ours, for as long as this one would
            # An earlier attempt's commit that its holders can hand over comes at once; one that
            # cannot be had stops nobody, so do not spend the attempt's window trying (unless it
            # is final: then this claim is most likely a leader's answer arriving late).
            if not await self._hold_all(signed, None if whole else 2 * self.ctx.slack_s):
                log.warning("round %d: attempt %d's commit exists but its aggregate cannot be had%s", plan.round,
                            decision.attempt, " (it is final)" if final else "")
                if not earlier:
                    return True  # that leader may still be gathering it
                self.unobtainable[signed] = (plan.round, whole)
                if whole:
                    self.whole_tries[leader_key] = self.whole_tries.get(leader_key, 0) + 1
                return False
            try:
                self.book.add(signed)
            except ProtocolError as exc:
                log.warning("round %d: %s", plan.round, exc)
        elif self.is_retry_of(plan, signer, decision):  # type: ignore[attr-defined]
            self.attempts[(plan.round, plan.attempt)].decision = signed
        else:
            # A retry of an earlier attempt says nothing about this one; one signed by anyone but
            # this attempt's leaders would let any witness stop every attempt it is asked about.
            if decision.attempt == plan.attempt:
                log.warning("claim reply carried a retry not signed by a leader of round %d attempt %d",
                            plan.round, plan.attempt)
            return False
        self.attempts[(plan.round, plan.attempt)].poke()
        return True

    def _seals_before(self, round_id: int, attempt: int) -> list[tuple[bytes, bool]]:
        """The commits of the round's earlier attempts this peer sealed as an aggregator (or a
        witness), each with whether its leader confirmed it (final): final ones first, then the
        newest first (a claim reply carries the first)."""
        seals = [(held.sealed, held.confirmed == held.sealed) for (r, a), held in sorted(self.attempts.items(), reverse=True)
                 if r == round_id and a < attempt and held.sealed is not None]
        return sorted(seals, key=lambda s: not s[1])  # stable: newest first within each

    def _confirm_seal(self, decision: Decision, signed: bytes) -> Ack:
        """The leader of a commit sealed here asks, before it announces it, whether a later
        attempt's claim fenced it off here since. Then that attempt's leader may commit the round
        otherwise (it could not gather this commit), and the leader stands back. If not, the seal
        is confirmed: a later claimer is told it is final (see `_adopt`). No await in here: a
        fence (`_on_claim`) lands wholly before or wholly after."""
        committed = self.book.committed.get(decision.round)
        if committed is not None:
            return Ack(True, "") if committed[0] == signed else Ack(False, COMMITTED_OTHERWISE)
        slot = self.attempts.get((decision.round, decision.attempt))
        if decision.status != "commit" or slot is None or slot.sealed != signed:
            return Ack(False, "that commit is not sealed here")
        if self.later_claims.get(decision.round, -1) > decision.attempt:
            return Ack(False, LATER_ATTEMPT_CLAIMED)
        slot.confirmed = signed
        return Ack(True, "")

    async def _on_claim(self, sender: str, msg: Claim) -> ClaimReply:
        if msg.round in self.book.committed:
            return ClaimReply(False, self.book.committed[msg.round][0], True)
        if self._deciding_before(msg.round, msg.attempt):
            # We are deciding an earlier attempt: we object, even where we hold its seal (a
            # leader is usually a holder of its own commit). Handing that seal over instead let
            # the claimer try to gather it while we still were, and fence us off when it could not.
            return ClaimReply(False, b"")
        seals = self._seals_before(msg.round, msg.attempt)  # earlier attempts' commits we sealed
        if seals and all(final for _, final in seals):
            return ClaimReply(False, *seals[0])  # confirmed by its leader: the round's commit
        # (An unconfirmed one is handed over below, after our grant: answered at once, it let two
        # leaders of an attempt that both held it pass their claims, and a split followed.)
        known = self.attempts.get((msg.round, msg.attempt))
        if known is not None and known.decision is not None and not seals:
            return ClaimReply(False, known.decision)
        try:
            self._check_open(msg.round, msg.attempt)  # type: ignore[attr-defined]
        except ProtocolError:
            if seals:  # handed over all the same, as before; no fence noted for a claim we cannot place
                return ClaimReply(False, *seals[0])
            raise
        # Within half a slack, so that the claimer hears our answer before its request times out.
        plan = await self.plan(msg.round, msg.attempt, self.ctx.slack_s / 2, ask=sender)
        if plan is None:
            # We are behind: we cannot plan this round, so we neither lead it nor granted it to
            # anyone. No objection (it used to be one, and a leader that was catching up could
            # keep every stand-in from deciding). A fence still gets one: we cannot check who
            # sends it, and it would make us refuse the earlier attempts once we catch up.
            return ClaimReply(False, *seals[0]) if seals else ClaimReply(not msg.fence, b"")
        if sender not in plan.leaders:
            return ClaimReply(False, *seals[0]) if seals else ClaimReply(False, b"")
        # Across attempts, the first to reach this peer wins: a leader of an earlier attempt that
        # is deciding objects; otherwise that earlier attempt is fenced off here (no claim, no
        # seal of it passes any more), so of a stalled leader and its successor at most one
        # commits wherever both ask this peer.
        if self._deciding_before(msg.round, msg.attempt) or self.later_claims.get(msg.round, -1) > msg.attempt:
            return ClaimReply(False, b"")
        if msg.round in self.book.committed:
            return ClaimReply(False, self.book.committed[msg.round][0], True)
        # A commit we sealed (perhaps while we planned): the claimer tries to adopt it, once we
        # granted it the attempt (below). An unconfirmed one is fenced off here all the same (no
        # await since the check above): its leader, slow to answer the claim while it gathers the
        # aggregate, say, asks us before it announces, and stands back, since this claimer may
        # commit the round otherwise if it cannot gather this commit. A confirmed one is final
        # (and handed over first), but a fence still counts against any other seal we hold unconfirmed.
        seals = self._seals_before(msg.round, msg.attempt)
        if seals and all(final for _, final in seals):
            return ClaimReply(False, *seals[0])
        if msg.fence:
            self.later_claims[msg.round] = max(self.later_claims.get(msg.round, -1), msg.attempt)
        slot = self.attempts[(msg.round, msg.attempt)]  # only a leader of the attempt makes us keep one
        slot.claimed_by.add(sender)
        if slot.decision is not None:
            return ClaimReply(False, slot.decision)
        me = self.identity.peer_id
        if me not in plan.leaders:  # an earlier attempt's leader: no say in this one
            return ClaimReply(False, *seals[0]) if seals else ClaimReply(True, b"")
        # Two leaders that claim at once would refuse each other; the lower rank wins unless the
        # other is already deciding. (Safety does not rest on this tie-break: of two claimers, each
        # granted itself before asking the other, and one that gave its grant away stands back.)
        rank = plan.leaders.index
        await self._revoke_if_dead(plan, slot, claimer=sender)
        if msg.round in self.book.committed:  # (again after the probe: all of these may change meanwhile)
            return ClaimReply(False, self.book.committed[msg.round][0], True)
        if slot.decision is not None:
            return ClaimReply(False, slot.decision)
        if self._deciding_before(msg.round, msg.attempt) or self.later_claims.get(msg.round, -1) > msg.attempt:
            return ClaimReply(False, b"")
        holder = slot.granted_to
        if holder is None or (holder != me and rank(sender) < rank(holder)) or (
                holder == me and not slot.deciding and rank(sender) < rank(me)):
            slot.granted_to = sender
        if slot.granted_to != sender:
            return ClaimReply(False, b"")  # an objection, whatever seals we hold
        seals = self._seals_before(msg.round, msg.attempt)  # (again: one may have landed while we probed)
        return ClaimReply(False, *seals[0]) if seals else ClaimReply(True, b"")
