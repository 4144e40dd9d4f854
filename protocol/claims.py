"""Claims: one decider per attempt, and no second commit of a round.

Before a leader decides an attempt it grants the attempt to itself, then asks its fellow leaders
(and the leaders of the round's earlier attempts) for it. See protocol/README.md for the rules
and why two leaders cannot both pass; `RoundServer` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .plan import RoundPlan
from .schema import Claim, ClaimReply, Decision, ProtocolError
from .transport import PeerUnavailable, unseal

if TYPE_CHECKING:
    from .server import _Attempt

log = logging.getLogger(__name__)


class Claims:
    """The claim half of the leader; needs the server's identity, transport, book, plan() and attempts."""

    identity: Any
    transport: Any
    book: Any
    ctx: Any
    attempts: Any
    plan: Callable[[int, int, float], Awaitable[RoundPlan | None]]  # RoundServer.plan
    _hold_all: Callable[[bytes], Awaitable[bool]]  # RoundServer._hold_all: gather a commit's aggregate

    async def _claim(self, plan: RoundPlan, slot: "_Attempt") -> bool:
        """May this leader decide? Not if it (or a fellow leader it asked) already let another
        leader decide this attempt, nor if anyone asked knows a commit of the round (it is adopted).

        A leader grants itself before it asks, so of two leaders that both ask, at least one is
        refused by the other; a frozen or dead leader cannot object (liveness over a stall), which
        leaves a split possible only under a real network partition, where hash checks re-sync."""
        me = self.identity.peer_id
        if slot.granted_to not in (None, me):
            return False
        slot.granted_to = me
        # Earlier attempts' leaders and aggregators too: a leader that committed an earlier attempt
        # and died (or froze) before anyone asked leaves its commit with the peers it sealed.
        witnesses = list(plan.leaders)
        for earlier in range(max(0, plan.attempt - 4), plan.attempt):
            old = await self.plan(plan.round, earlier, 0)
            witnesses += [*old.leaders, *old.aggregators] if old else []
        others = [p for p in dict.fromkeys(witnesses) if p != me][:24]
        replies = await asyncio.gather(*(self._ask_claim(p, plan) for p in others))
        objected = False
        for reply in replies:
            if reply is None or reply.ok:
                continue
            if not reply.decision:
                objected = True  # that leader let another one decide this attempt
            elif await self._adopt(plan, reply.decision):
                return False
        # A lower-ranked leader's claim may have taken our grant while we waited: then we yield.
        if objected or slot.granted_to != me or slot.decision is not None:
            return False
        slot.deciding = True
        return True

    async def _ask_claim(self, peer: str, plan: RoundPlan) -> ClaimReply | None:
        try:
            return await self.transport.request(peer, "claim", Claim(plan.round, plan.attempt), ClaimReply,
                                                timeout_s=self.ctx.slack_s)
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("claim of round %d attempt %d at %s: %s", plan.round, plan.attempt, peer[-8:], exc)
            return None

    async def _adopt(self, plan: RoundPlan, signed: bytes) -> bool:
        """Take a decision a witness returned; True: stand back. A commit is taken only once its
        whole aggregate is in hand (an earlier attempt's that cannot be had stops nobody)."""
        try:
            _, decision = unseal(signed, self.ctx.run_id, Decision)
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
            if not await self._hold_all(signed):
                log.warning("round %d: attempt %d's commit exists but its aggregate cannot be had", plan.round,
                            decision.attempt)
                return decision.attempt == plan.attempt  # that leader may still be gathering it
            try:
                self.book.add(signed)
            except ProtocolError as exc:
                log.warning("round %d: %s", plan.round, exc)
        elif decision.attempt == plan.attempt:
            self.attempts[(plan.round, plan.attempt)].decision = signed
        else:
            return False  # a retry of an earlier attempt says nothing about this one
        self.attempts[(plan.round, plan.attempt)].poke()
        return True

    async def _on_claim(self, sender: str, msg: Claim) -> ClaimReply:
        if msg.round in self.book.committed:
            return ClaimReply(False, self.book.committed[msg.round][0])
        for (r, a), held in list(self.attempts.items()):
            if r == msg.round and a < msg.attempt and held.sealed is not None:
                return ClaimReply(False, held.sealed)  # an earlier attempt's commit we built shards for
        known = self.attempts.get((msg.round, msg.attempt))
        if known is not None and known.decision is not None:
            return ClaimReply(False, known.decision)
        self._check_open(msg.round, msg.attempt)  # type: ignore[attr-defined]
        plan = await self.plan(msg.round, msg.attempt, self.ctx.slack_s)
        if plan is None or sender not in plan.leaders:
            return ClaimReply(False, b"")
        slot = self.attempts[(msg.round, msg.attempt)]  # only a leader of the attempt makes us keep one
        if slot.decision is not None:
            return ClaimReply(False, slot.decision)
        me = self.identity.peer_id
        if me not in plan.leaders:
            return ClaimReply(True, b"")  # an earlier attempt's leader: no say in this one
        # Two leaders that claim at once would refuse each other; the lower rank wins unless the
        # other is already deciding. (Safety does not rest on this tie-break: of two claimers, each
        # granted itself before asking the other, and one that gave its grant away stands back.)
        rank = plan.leaders.index
        holder = slot.granted_to
        if holder is None or (holder != me and rank(sender) < rank(holder)) or (
                holder == me and not slot.deciding and rank(sender) < rank(me)):
            slot.granted_to = sender
        return ClaimReply(slot.granted_to == sender, b"")
