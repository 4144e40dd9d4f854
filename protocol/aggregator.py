"""The aggregator half of the round server: hold contributions, report who is complete to the
attempt's leaders, build a shard's aggregate when a leader seals, and serve aggregates.

Everything a contribution makes this peer hold is bounded: rounds and attempts no honest peer
could be at yet are refused, and a shard of one attempt holds a bounded number of senders.
`RoundServer` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from groundswell.compression import Payload, RobustStats, contribution_sq_norm, robust_mean

from .context import contribution_digest, validate_segments
from .envelope import seal, unseal
from .have_reports import HaveReporter
from .plan import attempt_for
from .schema import (
    Ack,
    AggregateRequest,
    AggregateShard,
    ContributionsRequest,
    Decision,
    ProtocolError,
    Seal,
    ShardContribution,
)
from .shards import (
    DENSE_MEAN_CODECS,
    REPORTING_CANDIDATES,
    decision_digests,
    newcomer_room,
    ships_contributions,
)
from .transport import Presealed

log = logging.getLogger(__name__)
FUTURE_ROUNDS = 3  # contributions and joins further ahead of our newest commit are dropped
REFUSED_KEPT = 256  # senders of invalid contributions remembered per attempt, besides the planned trainers
# Contributions held for this many attempts of a round before the newest: claims look 4 back, and a
# stand-in that scores contributions and replaces a failed source may still be deciding one 5 back.
KEEP_ATTEMPTS = 6
MAX_SEALS_PER_LEADER = 8  # distinct commits of one attempt one leader may have us build (an honest one: <= 4)
SEALED_BY_ANOTHER = "this attempt is already sealed under another leader's decision"
LATER_ATTEMPT_CLAIMED = "a later attempt of this round was claimed here"
COMMITTED_OTHERWISE = "the round is already committed otherwise"
ALREADY_COMMITTED = "the round is already committed"
BEGAN_BEFORE_START = "this attempt began before this peer (re)started"
FENCED_OFF = (LATER_ATTEMPT_CLAIMED, COMMITTED_OTHERWISE)  # confirm refusals that make a leader stand back
# Seal refusals that make a leader stand back. ALREADY_COMMITTED too (found by a review): a leader
# that passed its claim while another decided the attempt took it for one source failing, and
# with every source refusing so, signed and announced a retry of an attempt that had committed.
CONTESTED = (SEALED_BY_ANOTHER, LATER_ATTEMPT_CLAIMED, ALREADY_COMMITTED)


class Aggregator(HaveReporter):
    """The aggregator role; needs the server's ctx, transport, book, identity, attempts, plan(),
    archive(), _spawn() and _on_have()."""

    ctx: Any
    transport: Any
    book: Any
    identity: Any
    attempts: Any
    aggregates: Any
    _archived: Any
    later_claims: Any  # round -> newest attempt whose claim this peer let pass (see Claims)
    started_at: float  # wall-clock time this server was made (see `_seal_refusal`)

    def _check_open(self, round_id: int, attempt: int) -> None:
        """Refuse (without holding anything) a round or attempt no honest peer could be at yet:
        every accepted one costs memory until the round is archived."""
        latest = self.book.latest()
        if round_id > latest + FUTURE_ROUNDS:  # nobody honest is that far ahead of us
            raise ProtocolError(f"round {round_id} is too far ahead (we know round {latest})", reason="future-round",
                                strike=False)
        opened = self.book.opened_at(round_id)
        newest = 2 if opened is None else attempt_for(time.time() + 2 * self.ctx.slack_s, opened, self.ctx.deadline_s,
                                                      self.ctx.slack_s) + 1
        if attempt > newest:
            raise ProtocolError(f"attempt {attempt} of round {round_id} has not begun", reason="future-round",
                                strike=False)

    async def _on_contribute(self, sender: str, msg: ShardContribution, envelope: bytes = b"") -> Ack:
        """Hold a contributor's shard; `envelope` is its signed request, kept to ship it on verifiably."""
        if not envelope:
            if sender != self.identity.peer_id:
                raise ProtocolError("a contribution must come with its signed envelope")
            envelope = seal(self.identity, self.ctx.run_id, msg)  # our own, handed over in-process
        if not self.ctx.authorized(sender):
            self.transport.guard.count(sender, "contribute", "unauthorized", strike=True)
            return Ack(False, "not allowed to contribute to this run")
        if msg.round in self.book.committed or msg.round <= self.book.latest():
            self.transport.guard.count(sender, "contribute", "stale-round", strike=False)  # a straggler, usually
            return Ack(False, f"round {msg.round} is closed")
        self._check_open(msg.round, msg.attempt)
        if msg.shard >= self.ctx.max_shards:
            raise ProtocolError(f"shard {msg.shard} does not exist", reason="bad-payload")
        # Not an attempt `_free_old_attempts` has let go: filled newest first, attempts long past
        # were each held again, and a round retried N times held N attempts' contributions, not
        # KEEP_ATTEMPTS (a review). Honest contributors send only to the attempt of their clock.
        newest = max((a for (r, a), held in self.attempts.items() if r == msg.round and held.contributions),
                     default=msg.attempt)
        if msg.attempt < newest - KEEP_ATTEMPTS:
            self.transport.guard.count(sender, "contribute", "stale-attempt", strike=False)
            return Ack(False, f"attempt {msg.attempt} of round {msg.round} is long over")
        slot = self.attempts[(msg.round, msg.attempt)]
        membership = self.book.membership(msg.round)
        trainers = frozenset(membership.trainers) if membership else frozenset()
        room = newcomer_room(len(trainers), self.ctx.max_shards)

        def full() -> bool:
            """Many fresh identities must not fill our memory: a shard holds a bounded number of
            senders that are not the round's planned trainers, and those, bounded by their own
            number, always find a place (fresh identities cannot crowd the round's own peers out)."""
            held = slot.contributions.get(msg.shard, {})
            return sender not in held and sender not in trainers and sum(s not in trainers for s in held) >= room

        if full():
            raise ProtocolError(f"shard {msg.shard} already holds {room} contributions of newcomers",
                                reason="slot-full", strike=False)

        def settled() -> Ack | None:
            if slot.sealed is not None:
                return Ack(False, f"round {msg.round} attempt {msg.attempt} is sealed")
            known = slot.contributions.get(msg.shard, {}).get(sender)
            if known is not None:  # first write wins: a contributor cannot swap what it sent
                if known[3] == contribution_digest(msg.first_segment, msg.segments):
                    return Ack(True, "")
                raise ProtocolError(f"a second, different contribution to shard {msg.shard}", reason="equivocation")
            if full():  # again after each await: others landed meanwhile
                raise ProtocolError(f"shard {msg.shard} already holds {room} contributions of newcomers",
                                    reason="slot-full", strike=False)
            return None

        if (early := settled()) is not None:
            return early
        plan = await self.plan(msg.round, msg.attempt, min(1.0, self.ctx.slack_s), ask=sender)
        if plan is None:  # behind (catching up): we could not report it, so do not hold it
            return Ack(False, f"round {msg.round - 1} is not known here yet")
        trainers = frozenset(plan.trainers)  # (the round's membership may have come in while we waited)
        if (early := settled()) is not None:  # sealed, or another copy from the sender landed, while we waited
            return early
        if (msg.shard >= plan.num_shards or (
                msg.first_segment, msg.first_segment + len(msg.segments)) != plan.shard_segments[msg.shard]
                or self.identity.peer_id not in plan.candidates(msg.shard)[:REPORTING_CANDIDATES]):
            raise ProtocolError(f"shard {msg.shard} does not span segments {msg.first_segment}.."
                                f"{msg.first_segment + len(msg.segments)} in this round", reason="bad-payload")
        try:  # parsed and checked in a worker thread: a dense shard of a large model takes a while
            rows, sq_norm = await asyncio.to_thread(self._checked_contribution, msg)
        except ProtocolError:  # counted and dropped by the transport; the leaders hear of it
            if sender in trainers or len(slot.refused) < REFUSED_KEPT:  # (identities are free: bounded)
                slot.refused.add(sender)
            self._report(msg.round, msg.attempt)
            raise
        if (early := settled()) is not None:  # sealed, or another copy from the sender landed, meanwhile
            return early
        slot.contributions[msg.shard][sender] = (msg.first_segment, msg.segments, envelope,
                                                 contribution_digest(msg.first_segment, msg.segments))
        self._free_old_attempts(msg.round, msg.attempt)
        if self.ctx.codec.name not in DENSE_MEAN_CODECS:  # small: kept, so our fetch of the commit parses none again
            slot.parsed[(msg.shard, sender)] = rows
        if sq_norm is not None:
            slot.sq_norms[(msg.shard, sender)] = sq_norm
        self._report(msg.round, msg.attempt)
        if not slot.refresh:
            slot.refresh = True
            self._spawn(self._refresh_have(msg.round, msg.attempt))
        return Ack(True, "")

    def _checked_contribution(self, msg: ShardContribution) -> tuple[list[Payload], float | None]:
        """A contribution's parsed segments and, where the mean clips dense contributions, its
        squared norm: worked out on arrival, while the network is the bottleneck, not at the seal."""
        rows = validate_segments(self.ctx, msg.first_segment, msg.segments)
        return rows, contribution_sq_norm(self.ctx.codec, rows) if self._clips_dense() else None

    def _free_old_attempts(self, round_id: int, attempt: int) -> None:
        """Drop the contributions held for attempts of the round more than `KEEP_ATTEMPTS` before
        `attempt`, unless we sealed a commit of one: a round retried for a long time would
        otherwise hold every attempt's until it commits. No leader is still deciding one that old
        (see `KEEP_ATTEMPTS`), and a late seal of one is refused for what it misses, as any seal is."""
        for (r, a), held in list(self.attempts.items()):
            if r == round_id and a < attempt - KEEP_ATTEMPTS and held.sealed is None and held.contributions:
                held.contributions.clear()
                held.parsed.clear()
                held.sq_norms.clear()

    async def _on_seal(self, sender: str, msg: Seal) -> Ack:
        leader, decision = unseal(msg.decision, self.ctx.run_id, Decision)
        if leader != sender or decision.leader != sender or decision.status not in ("commit", "retry"):
            return Ack(False, "a seal must be a decision signed by the sending leader")
        if msg.confirm:
            return self._confirm_seal(decision, msg.decision)  # type: ignore[attr-defined]
        committed = self.book.committed.get(decision.round)
        if committed is not None and committed[0] != msg.decision:
            return Ack(False, ALREADY_COMMITTED)
        self._check_open(decision.round, decision.attempt)
        plan = await self.plan(decision.round, decision.attempt, self.ctx.slack_s, ask=sender)
        if plan is None or sender not in plan.leaders:
            if plan is not None:  # (we can tell: counted, as any refused message is)
                self.transport.guard.count(sender, "seal", "not-leader", strike=False)
            return Ack(False, "sender does not lead this attempt")
        slot = self.attempts[(decision.round, decision.attempt)]
        if decision.status == "retry":
            return self._void(decision, slot)
        async with slot.sealing:  # one seal of an attempt at a time: a retransmission waits for the first's build
            if (refusal := self._seal_refusal(decision, msg.decision, slot)) is not None:
                return refusal
            if slot.sealed == msg.decision:
                return Ack(True, "")  # the same seal again (a retransmission): built already, not rebuilt
            if slot.seals_built.get(decision.leader, 0) >= MAX_SEALS_PER_LEADER:
                # An honest leader re-seals only to replace a failed source, a few times at most;
                # each seal rebuilds every shard we source (seconds of a dense model's means), so
                # one leader's endless variants (another `time` each) would keep us building.
                return Ack(False, f"more than {MAX_SEALS_PER_LEADER} commits of this attempt from one leader")
            slot.seals_built[decision.leader] = slot.seals_built.get(decision.leader, 0) + 1
            # The commit's shape (digests per contribution and shard, sources among the candidates,
            # contributors) as any peer checks it when it is announced: a leader's seal is held to it
            # first, or a short digest list would let contributions we do not hold through.
            await self.verify_commit(msg.decision)
            mine = [s for s, src in enumerate(decision.sources) if src == self.identity.peer_id]
            # A replica builds its copy too, so the commit outlives its source and its leader.
            spare = [s for s in sorted(slot.contributions) if s < plan.num_shards and s not in mine]
            jobs, complete = [], []
            for shard in mine + spare:
                first, stop = plan.shard_segments[shard]
                held = slot.contributions.get(shard, {})
                pinned = decision_digests(decision, shard)
                missing = [c for c, dg in zip(decision.contributors, pinned, strict=True)
                           if c not in held or held[c][0] != first or len(held[c][1]) != stop - first
                           or held[c][3] != dg]
                if missing and shard in mine:
                    return Ack(False, f"shard {shard}: missing contributions from {len(missing)} peers")
                if not missing and shard in mine:
                    jobs.append(self._held_job(decision, slot, shard, first))
                elif not missing:
                    complete.append(shard)
            # Built off the network loop (a dense shard of a large model takes seconds), so this
            # peer's handlers and heartbeat go on meanwhile; what they changed is checked again after.
            built = await asyncio.to_thread(self._build_jobs, msg.decision, jobs)
            if (refusal := self._seal_refusal(decision, msg.decision, slot)) is not None:
                return refusal
            slot.sealed = msg.decision  # not in the book yet: the leader announces it once it holds every shard
            for shard, agg in built.items():
                self.archive(decision.round, shard, agg)
        if complete:  # the replica's copies: after the ack, so the leader does not wait for them
            self._spawn(self._build_spares(msg.decision, decision, slot, complete, plan))
        return Ack(True, "")

    def _seal_refusal(self, decision: Decision, signed: bytes, slot: Any) -> Ack | None:
        """Why this peer must not seal `signed` now (None: it may): checked before a seal's build
        and again after it, since claims, commits and other seals land while it builds."""
        committed = self.book.committed.get(decision.round)
        if committed is not None and committed[0] != signed:
            return Ack(False, ALREADY_COMMITTED)
        if self._before_our_start(decision.round, decision.attempt):
            # A restarted peer has forgotten the fences later claims put on this attempt here and
            # any seal it gave of it (both in memory): sealed now, a leader that a later attempt's
            # claimer fenced off, or a second leader of the attempt, could commit the round too.
            # (Its leader takes the shard's next candidate, as for a failed source.)
            return Ack(False, BEGAN_BEFORE_START)
        if decision.leader in slot.voided_by:  # (checked after a build too: nothing runs between that and the seal)
            # Its retry overtook this seal (sent before it, answered late): the commit was taken
            # back, and its contributors were told "retry"; sealed now, a later leader could adopt
            # it. A set: a fellow leader's retry once replaced the name, and the seal went through.
            return Ack(False, "this leader took its commits of the attempt back")
        if self.later_claims.get(decision.round, -1) > decision.attempt and slot.sealed != signed:
            # We let a later attempt's leader decide, having seen no seal of this one: a leader
            # that froze or stalled while deciding this attempt must not commit the round too.
            return Ack(False, LATER_ATTEMPT_CLAIMED)
        if slot.sealed is not None and slot.sealed != signed:
            # The same leader may re-seal (it replaced a failed source before announcing anything);
            # another leader may not: that is how two leaders of one attempt are kept apart.
            _, earlier = unseal(slot.sealed, self.ctx.run_id, Decision)
            if earlier.leader != decision.leader:
                return Ack(False, SEALED_BY_ANOTHER)
        return None

    def _before_our_start(self, round_id: int, attempt: int) -> bool:
        """Could a previous process of ours have sealed, or been fenced in, this attempt? Only if the
        round opened before this server was made (a first process is named in a round's plan only
        by a commit that came after its join), and only for an attempt the previous process could
        take by then (`_check_open`'s bound: early closes and retries run ahead of the clock)."""
        opened = self.book.opened_at(round_id)
        if opened is None:
            return True  # (cannot happen once planned: refused, to be safe)
        if opened >= self.started_at:
            return False
        ctx = self.ctx
        return attempt <= attempt_for(self.started_at + 2 * ctx.slack_s, opened, ctx.deadline_s, ctx.slack_s) + 1

    async def _build_spares(self, signed: bytes, decision: Decision, slot: Any, shards: list[int], plan: Any) -> None:
        """Build a replica's copies of sealed shards, one at a time, while the seal still stands
        (a retry from the same leader voids it) and nobody handed us the shard meanwhile."""
        try:
            for shard in shards:
                if slot.sealed != signed or not self._may_replace(decision, signed, shard):
                    continue
                first, _ = plan.shard_segments[shard]
                job = self._held_job(decision, slot, shard, first)
                built = await asyncio.to_thread(self._build_jobs, signed, [job])  # off the loop, as a seal's
                if slot.sealed == signed and self._may_replace(decision, signed, shard):  # still, after the build
                    self.archive(decision.round, shard, built[shard])
        except Exception as exc:  # a background task must never take the node down
            log.error("replica copy of round %d not built: %r", decision.round, exc, exc_info=exc)

    def _may_replace(self, decision: Decision, signed: bytes, shard: int) -> bool:
        """May a replica build its copy of `shard` under this seal? Not if the round committed
        otherwise, nor over a copy of this commit (handed to us meanwhile) or of another attempt's
        commit; a copy of an earlier seal of the same attempt, which its leader re-sourced, yes."""
        committed = self.book.committed.get(decision.round)
        if committed is not None and committed[0] != signed:
            return False
        held = self.aggregates.get((decision.round, shard))
        if held is None:
            return True
        if held.decision == signed:
            return False
        # A copy of an earlier seal of this attempt, or of an earlier attempt's commit that this
        # peer kept (fenced, its take-back refused) and that the round did not commit.
        _, earlier = unseal(held.decision, self.ctx.run_id, Decision)
        return earlier.attempt <= decision.attempt

    def _clips_dense(self) -> bool:
        """Does this run's aggregate clip dense contributions to the median norm (so each one's
        norm is needed at the seal)?"""
        return not ships_contributions(self.ctx) and self.ctx.robust.clip > 0

    def _held_job(self, decision: Decision, slot: Any, shard: int, first: int) -> tuple:
        """What `_build_jobs` needs for a shard, taken from the slot on the network loop (its
        dicts change there while the build runs in a thread)."""
        held = slot.contributions[shard]
        norms = [slot.sq_norms.get((shard, c)) for c in decision.contributors]
        return shard, [held[c] for c in decision.contributors], first, None if None in norms else norms

    def _build_jobs(self, signed: bytes, jobs: list[tuple]) -> dict[int, AggregateShard]:
        """The aggregate of each job's shard (run in a worker thread: pure tensor work)."""
        return {shard: self._build(signed, shard, held, first, norms) for shard, held, first, norms in jobs}

    def _void(self, retry: Decision, slot: Any) -> Ack:
        """A leader that sealed a commit here and then decided retry takes the commit back: it was
        never announced (the leader could not gather it), so later claimers must not be handed it."""
        if slot.sealed is None:
            slot.voided_by.add(retry.leader)  # a seal of its still on the way is refused when it lands
            return Ack(True, "")
        _, sealed = unseal(slot.sealed, self.ctx.run_id, Decision)
        if sealed.leader != retry.leader:
            return Ack(False, SEALED_BY_ANOTHER)
        if self.later_claims.get(retry.round, -1) > retry.attempt:
            # A later attempt's leader fenced this attempt off here and was handed our seal: it may
            # have adopted the commit (it holds its aggregate then), so the copies stay here.
            return Ack(False, LATER_ATTEMPT_CLAIMED)
        for key in [k for k, agg in self.aggregates.items() if k[0] == retry.round and agg.decision == slot.sealed]:
            del self.aggregates[key]
        slot.sealed = None
        slot.voided_by.add(retry.leader)
        return Ack(True, "")

    def _build(self, signed: bytes, shard: int, held: list[tuple[int, list[bytes], bytes]], first: int,
               sq_norms: list[float] | None = None) -> AggregateShard:
        codec = self.ctx.codec
        if ships_contributions(self.ctx):
            # every contributor's own signed request: receivers check each signature and average
            # (robustly) themselves, so no aggregator can forge or alter anyone's contribution
            return AggregateShard(signed, shard, "signed", [envelope for _, _, envelope, _ in held])
        rows = [validate_segments(self.ctx, first, segs) for _, segs, _, _ in held]
        stats = RobustStats()
        means = robust_mean(codec, rows, self.ctx.robust, stats, sq_norms)
        _, decision = unseal(signed, self.ctx.run_id, Decision)
        clipped = [decision.contributors[c] for c in sorted(stats.clipped)]
        weights = [stats.weights[c] for c in sorted(stats.clipped)]
        return AggregateShard(signed, shard, "mean", [codec.encode(m).to_bytes() for m in means], clipped, weights)

    def held_rows(self, round_id: int, attempt: int, shard: int, who: str, digest: bytes) -> list[Payload] | None:
        """The parsed segments of `who`'s contribution to a shard that this peer took as an
        aggregator, if its digest is `digest` (so its bytes are those a commit pins); else None."""
        slot = self.attempts.get((round_id, attempt))
        held = slot.contributions.get(shard, {}).get(who) if slot is not None else None
        if held is None or held[3] != digest:
            return None
        return slot.parsed.get((shard, who))

    def local_contributions(self, round_id: int, attempt: int, shard: int, contributors: list[str]) -> AggregateShard:
        """The signed contributions this peer holds for a shard of an attempt ("none" unless all)."""
        slot = self.attempts.get((round_id, attempt))
        held = slot.contributions.get(shard, {}) if slot is not None else {}
        if not contributors or any(c not in held for c in contributors):
            return AggregateShard(b"", shard, "none", [])
        return AggregateShard(b"", shard, "signed", [held[c][2] for c in contributors])

    async def _on_get_contributions(self, sender: str, msg: ContributionsRequest) -> AggregateShard:
        self._check_open(msg.round, msg.attempt)  # (before planning: anyone may ask, of any attempt)
        plan = await self.plan(msg.round, msg.attempt, 0.0)
        if plan is None or sender not in plan.leaders:  # only the attempt's leaders score
            return AggregateShard(b"", msg.shard, "none", [])
        if msg.contributors != sorted(set(msg.contributors)):  # as a commit lists them; repeats would multiply the reply
            raise ProtocolError("contributors must be distinct and sorted")
        return self.local_contributions(msg.round, msg.attempt, msg.shard, msg.contributors)

    async def _on_get_aggregate(self, sender: str, msg: AggregateRequest) -> AggregateShard | Presealed:
        deadline = time.monotonic() + min(msg.wait_s, self.ctx.deadline_s + self.ctx.slack_s)
        while (agg := self.aggregates.get((msg.round, msg.shard))) is None:
            remaining = deadline - time.monotonic()
            # A round older than our newest commit that we do not hold will not come (evicted, or
            # never ours): "none" at once. A peer catching up asks holder after holder, and a
            # slack's wait at each made it crawl for minutes before it took the state instead.
            if remaining <= 0 or msg.round < self.book.latest():
                return AggregateShard(b"", msg.shard, "none", [])
            waiter = self._archived
            try:
                async with asyncio.timeout(remaining):
                    await waiter.wait()
            except TimeoutError:
                pass
        return await self._sealed_aggregate((msg.round, msg.shard), agg)

    async def _sealed_aggregate(self, key: tuple[int, int], agg: AggregateShard) -> Presealed:
        """The aggregate shard sealed once, however many peers ask for it (each of the others
        does, right after the commit; sealing a dense shard copies and hashes all of it). Kept for
        the newest two rounds asked for; an older round's sealing is shared while any reply of it
        is being sent. Sealed one at a time, off the event loop: anyone may ask for any kept
        round, and a flood of asks for old ones would otherwise seal a copy per ask, on the loop.
        The newest two rounds have a lane of their own: asks for old rounds, queued first, held
        up the first ask for a round just committed, which every peer needs at once (a review)."""
        hit = self._cached_seal(key, agg)
        if hit is not None:
            return hit
        async with self._sealing_fresh if key[0] >= self.book.latest() - 1 else self._sealing:
            hit = self._cached_seal(key, agg)  # (sealed while we waited our turn)
            if hit is not None:
                return hit
            hit = Presealed(await asyncio.to_thread(seal, self.identity, self.ctx.run_id, agg), of=agg)
        self._sealed_shared[key] = hit
        newest = max((r for r, _ in self._sealed), default=key[0])
        if key[0] >= newest - 1:
            self._sealed[key] = hit
            for old in [k for k in self._sealed if k[0] < max(newest, key[0]) - 1]:
                del self._sealed[old]
        return hit

    def _cached_seal(self, key: tuple[int, int], agg: AggregateShard) -> Presealed | None:
        hit = self._sealed.get(key) or self._sealed_shared.get(key)
        return hit if hit is not None and hit.of is agg else None  # (an aggregate replaced since, after a retry)
