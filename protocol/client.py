"""The contributing half of the round protocol: send shards, learn the decision, fetch aggregates.

One call of `run_attempt` is one attempt of one round from a contributor's side; it never waits
past deadline + a few slacks. `fetch_aggregate` assembles the committed mean from the shards'
sources (or from any peer that already holds them) and checks every shard was built under the
same signed decision, so either every peer that completes the round applies the same bytes, or
the round does not complete here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from groundswell.compression import Payload, RobustStats, robust_mean

from .aggregator import REPORTING_CANDIDATES, decision_digests, replica_count, ships_contributions
from .context import DecisionBook, contribution_digest, validate_segments
from .plan import RoundPlan, attempt_for, close_time
from .schema import (
    MAX_SMALL,
    Ack,
    AggregateRequest,
    AggregateShard,
    ContributionsRequest,
    Decision,
    DecisionReply,
    DecisionRequest,
    Join,
    ProtocolError,
    ShardContribution,
)
from .server import RoundServer
from .transport import PeerUnavailable, unseal

log = logging.getLogger(__name__)
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


class RoundClient:
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
        self.on_contribute: Callable[[int, int], None] | None = None
        self.clipped: dict[int, dict[str, int]] = {}  # round -> contributor -> shards the robust mean clipped it in
        # (round, shard) -> (commit, shard, its checked contributions): each is parsed once
        self._rows: dict[tuple[int, int], tuple[bytes, AggregateShard, list[list[Payload]]]] = {}

    def current_attempt(self, round_id: int) -> int | None:
        """The attempt of `round_id` a contribution made now belongs to (None: round unknown)."""
        opened = self.book.opened_at(round_id)
        if opened is None:
            return None
        return attempt_for(time.time(), opened, self.ctx.deadline_s, self.ctx.slack_s)

    async def announce(self, round_id: int, *, trains: bool, serves: bool) -> None:
        """Tell the leaders of `round_id`'s open attempt that we will contribute, before training:
        they then wait for us (up to the deadline) instead of closing early without us, which
        would leave a peer slower than the others out of every round."""
        attempt = self.current_attempt(round_id)
        plan = None if attempt is None else await self.server.plan(round_id, attempt, wait_s=0)
        if plan is not None:
            join = Join(round_id, trains, serves)
            await asyncio.gather(*(self._tell(p, "join", join) for p in plan.leaders))

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
        await asyncio.gather(*(self._tell(p, "join", join) for p in plan.leaders))
        delivered = False
        if segments is not None:
            self.contributed[round_id] = max(attempt, self.contributed.get(round_id, -1))
            for old in [r for r in self.contributed if r < round_id - 2]:
                del self.contributed[old]
            if self.on_contribute is not None:
                self.on_contribute(round_id, self.contributed[round_id])
            sent = await asyncio.gather(*(self._send_shard(plan, s, segments) for s in range(plan.num_shards)))
            delivered = all(sent)
        decision, signed = await self._await_decision(plan)
        if decision is not None and decision.status == "retry":
            self.retried[round_id] = max(attempt, self.retried.get(round_id, -1))
        included = await self._counts_ours(decision, segments)
        return AttemptResult(decision, signed, attempt, delivered, included)

    async def _counts_ours(self, decision: Decision | None, segments: list[bytes] | None) -> bool:
        """Does a commit count the contribution we sent (its pinned digests are ours, in every shard)?"""
        if decision is None or decision.status != "commit" or segments is None or self.me not in decision.contributors:
            return False
        plan = await self.server.plan(decision.round, decision.attempt, wait_s=0)
        if plan is None or plan.num_shards != decision.num_shards:
            return True  # cannot check here: the commit names us
        mine = decision.contributors.index(self.me)
        return all(decision_digests(decision, shard)[mine] == contribution_digest(first, segments[first:stop])
                   for shard, (first, stop) in enumerate(plan.shard_segments))

    async def _tell(self, peer: str, handler: str, msg: Join) -> None:
        if peer == self.me:
            await self.server._on_join(peer, msg)
            return
        try:
            await self.transport.request(peer, handler, msg, Ack, timeout_s=self.ctx.slack_s)
        except PeerUnavailable as exc:
            log.info("%s to %s failed: %s", handler, peer[-8:], exc)

    async def _send_shard(self, plan: RoundPlan, shard: int, segments: list[bytes]) -> bool:
        first, stop = plan.shard_segments[shard]
        msg = ShardContribution(plan.round, plan.attempt, shard, first, segments[first:stop])
        size = sum(len(s) for s in msg.segments)
        # A dead aggregator fails fast (dial error); a frozen one costs this timeout, sized for the
        # payload at a modest 5 MB/s, before the next candidate gets the shard.
        timeout = 2 * self.ctx.slack_s + size / 5e6
        unreachable: set[str] = set()
        for peer in plan.candidates(shard)[:REPORTING_CANDIDATES]:
            try:
                if peer == self.me:
                    ack = await self.server._on_contribute(peer, msg)
                else:
                    ack = await self.transport.request(peer, "contribute", msg, Ack, timeout_s=timeout)
            except (PeerUnavailable, ProtocolError) as exc:
                log.info("shard %d to %s failed: %s", shard, peer[-8:], exc)
                unreachable.add(peer)
                continue
            if ack.ok:
                await self._replicate(plan, shard, msg, {peer} | unreachable, timeout)
                return True
            log.info("shard %d refused by %s: %s", shard, peer[-8:], ack.reason)
            if "closed" in ack.reason or "sealed" in ack.reason:
                return False
        return False

    async def _replicate(self, plan: RoundPlan, shard: int, msg: ShardContribution, skip: set[str],
                         timeout: float) -> None:
        """Give `replica_count` more aggregators a copy of the shard, so the leader can replace a
        source that dies or freezes before it seals (best effort: the contribution already
        counts). The replicas are the first of the shard's reporting candidates, other than the
        holder, that take it: the same peers for every contributor while the same peers are alive.
        `skip`: the holder and the candidates that just failed to take the shard."""
        wanted = replica_count(self.ctx)
        for peer in plan.candidates(shard)[:REPORTING_CANDIDATES]:
            if peer in skip:
                continue
            try:
                if peer == self.me:
                    ack = await self.server._on_contribute(peer, msg)
                else:
                    ack = await self.transport.request(peer, "contribute", msg, Ack, timeout_s=timeout)
            except (PeerUnavailable, ProtocolError) as exc:
                log.info("replica of shard %d to %s failed: %s", shard, peer[-8:], exc)
                continue
            if "closed" in ack.reason or "sealed" in ack.reason:
                return
            wanted -= ack.ok
            if wanted == 0:
                return

    async def _await_decision(self, plan: RoundPlan) -> tuple[Decision | None, bytes]:
        # Ask the leader and the backup at once: the backup answers only if it had to decide
        # (leader silent past deadline + slack), so the first non-empty answer is the decision.
        wait = self.ctx.deadline_s + (len(plan.leaders) + 1) * self.ctx.slack_s
        # A leader that does not answer at all (its process just died) is asked again until the
        # last stand-in would have decided: it may be restarted by then, and be the one deciding.
        opened = self.book.opened_at(plan.round)
        until = time.time() + wait
        if opened is not None:
            latest = close_time(opened, plan.attempt, self.ctx.deadline_s, self.ctx.slack_s)
            until = min(until, latest + (len(plan.leaders) + 1) * self.ctx.slack_s)
        asks = [asyncio.ensure_future(self._poll_decision(p, plan, until, wait)) for p in plan.leaders]
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
        signed = await self.ask_decision(peer, plan.round, plan.attempt, wait_s)
        while not signed and (left := until - time.time()) > REASK_S:
            await asyncio.sleep(REASK_S)
            signed = await self.ask_decision(peer, plan.round, plan.attempt, max(0.0, left - REASK_S))
        return signed

    async def ask_decision(self, peer: str, round_id: int, attempt: int, wait_s: float) -> bytes:
        """A signed decision for round/attempt from one peer, or b"" (and it is recorded if a commit)."""
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
            elif decision.attempt != attempt:
                return b""
            return reply.decision
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("decision of round %d from %s: %s", round_id, peer[-8:], exc)
            return b""

    async def fetch_aggregate(self, signed: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
        """The committed mean of a round as one flat fp32 vector; raises PeerUnavailable if some
        shard cannot be had from anyone, or the commit does not check out (the caller then
        re-syncs the full state): whatever peers send, this never raises anything else."""
        try:
            return await self._fetch_aggregate(signed, device)
        except PeerUnavailable:
            raise
        except Exception as exc:  # ProtocolError, CodecError, or a bug a hostile input found: not applied
            log.warning("aggregate not applied: %r", exc)
            raise PeerUnavailable(f"the round's aggregate could not be assembled: {exc}") from None

    async def hold_aggregate(self, signed: bytes) -> None:
        """Fetch and check every shard of a commit (archived here), without computing the mean:
        what a leader needs in hand before it announces. Raises like `fetch_aggregate`."""
        try:
            await self._hold(signed)
        except PeerUnavailable:
            raise
        except Exception as exc:  # ProtocolError, CodecError, or a bug a hostile input found
            log.warning("aggregate not held: %r", exc)
            raise PeerUnavailable(f"the round's aggregate could not be gathered: {exc}") from None

    async def _hold(self, signed: bytes) -> tuple[Decision, RoundPlan, list[AggregateShard]]:
        decision = await self.server.verify_commit(signed)
        plan = await self.server.plan(decision.round, decision.attempt, wait_s=0)
        if plan is None or plan.num_shards != decision.num_shards:
            raise PeerUnavailable(f"cannot plan round {decision.round}: its membership is not known here")
        shards = await asyncio.gather(*(self._fetch_shard(decision, signed, plan, s) for s in range(plan.num_shards)))
        return decision, plan, list(shards)

    async def _fetch_aggregate(self, signed: bytes, device: torch.device | str) -> torch.Tensor:
        decision, plan, shards = await self._hold(signed)
        numels = self.ctx.segment_numels
        out = torch.empty(sum(numels), dtype=torch.float32)
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        codec = self.ctx.codec
        clipped: dict[str, int] = {}  # contributor -> shards in which its norm was clipped
        for shard, agg in enumerate(shards):
            first, stop = plan.shard_segments[shard]
            if agg.mode == "mean":
                values = [codec.decode(p) for p in validate_segments(self.ctx, first, agg.parts)]
                for who in agg.clipped:
                    clipped[who] = clipped.get(who, 0) + 1
            else:  # every contributor's signed request: rows[c][i] is contributor c's segment first + i
                rows = self._checked_rows(decision, signed, shard, first, stop, agg)
                stats = RobustStats()
                values = robust_mean(codec, rows, self.ctx.robust, stats)
                for c in stats.clipped:
                    clipped[decision.contributors[c]] = clipped.get(decision.contributors[c], 0) + 1
            for seg, value in zip(range(first, stop), values):
                out[offsets[seg]:offsets[seg + 1]] = value
        self.clipped[decision.round] = clipped
        for old in [r for r in self.clipped if r < decision.round - 16]:
            del self.clipped[old]
        return out.to(device)

    async def gather_contributions(self, plan: RoundPlan, sources: list[str], contributors: list[str],
                                   digests: list[bytes]) -> dict[str, torch.Tensor]:
        """Each contributor's own decoded update, from the signed contributions the shards' sources
        hold (the leader scores them one by one before it decides)."""
        probe = Decision(plan.round, plan.attempt, "probe", list(contributors), [], [], self.me, list(sources),
                         plan.num_shards, 0.0, list(digests))
        offsets = [0]
        for n in self.ctx.segment_numels:
            offsets.append(offsets[-1] + n)
        out = {c: torch.empty(offsets[-1], dtype=torch.float32) for c in contributors}
        budget = self.ctx.max_payload_bytes * max(1, len(contributors)) + MAX_SMALL

        async def one(shard: int) -> None:
            first, stop = plan.shard_segments[shard]
            if sources[shard] == self.me:
                agg = self.server.local_contributions(plan.round, plan.attempt, shard, list(contributors))
            else:
                agg = await self.transport.request(
                    sources[shard], "get-contributions",
                    ContributionsRequest(plan.round, plan.attempt, shard, list(contributors)), AggregateShard,
                    timeout_s=2 * self.ctx.slack_s + budget / 20e6, max_reply=budget)
            if agg.mode != "signed":
                raise PeerUnavailable(f"the source of shard {shard} did not hand over its contributions")
            for contributor, row in zip(contributors, self._contributions(probe, shard, first, stop, agg)):
                for i, payload in enumerate(row):
                    out[contributor][offsets[first + i]:offsets[first + i + 1]] = self.ctx.codec.decode(payload)

        await asyncio.gather(*(one(s) for s in range(plan.num_shards)))
        return out

    def _checked_rows(self, decision: Decision, signed: bytes, shard: int, first: int, stop: int,
                      agg: AggregateShard) -> list[list[Payload]]:
        """`_contributions` of a shard of a commit, checked and parsed once per shard object."""
        key = (decision.round, shard)
        hit = self._rows.get(key)
        if hit is not None and hit[0] == signed and hit[1] is agg:
            return hit[2]
        rows = self._contributions(decision, shard, first, stop, agg)
        self._rows[key] = (signed, agg, rows)
        for old in [k for k in self._rows if k[0] < decision.round - 1]:
            del self._rows[old]
        return rows

    def _contributions(self, decision: Decision, shard: int, first: int, stop: int, agg: AggregateShard
                       ) -> list[list[Payload]]:
        """The shard's contributions in decision order, each checked: signed by that contributor,
        for this round, attempt and shard, and well-formed; ProtocolError otherwise."""
        rows: list[list[Payload]] = []
        budget = self.ctx.max_payload_bytes + MAX_SMALL
        pinned = decision_digests(decision, shard)
        if len(pinned) != len(decision.contributors) or len(agg.parts) != len(pinned):
            raise ProtocolError(f"shard {shard}: {len(agg.parts)} contributions for {len(pinned)} pinned",
                                reason="forged-aggregate")
        for who, envelope in zip(decision.contributors, agg.parts, strict=True):
            sender, msg = unseal(envelope, self.ctx.run_id, ShardContribution, max_bytes=budget)
            if sender != who:
                raise ProtocolError(f"shard {shard}: a contribution of {who[-8:]} signed by {sender[-8:]}",
                                    reason="forged-aggregate")
            if (msg.round, msg.attempt, msg.shard, msg.first_segment, len(msg.segments)) != (
                    decision.round, decision.attempt, shard, first, stop - first):
                raise ProtocolError(f"shard {shard}: {who[-8:]}'s contribution is for another slot",
                                    reason="forged-aggregate")
            if contribution_digest(msg.first_segment, msg.segments) != pinned[len(rows)]:
                raise ProtocolError(f"shard {shard}: {who[-8:]}'s contribution is not the one the commit pins",
                                    reason="forged-aggregate")
            rows.append(validate_segments(self.ctx, first, msg.segments))
        return rows

    async def _fetch_shard(self, decision: Decision, signed: bytes, plan: RoundPlan, shard: int) -> AggregateShard:
        key = (decision.round, shard)
        if key in self.server.aggregates and self.server.aggregates[key].decision == signed:
            return self.server.aggregates[key]
        first, stop = plan.shard_segments[shard]
        expected_parts = len(decision.contributors) if ships_contributions(self.ctx) else stop - first
        budget = self.ctx.max_payload_bytes * max(1, len(decision.contributors)) + MAX_SMALL
        timeout = 2 * self.ctx.slack_s + budget / 20e6
        # The shard's source first, then the leader (it gathered every shard before announcing),
        # then the shard's replicas (sealed too), then anyone who has applied the round. A holder
        # that has not answered within `hedge` (it may have frozen after the seal) gets company:
        # the next one is asked too, and the first good answer wins.
        hedge = max(1.0, self.ctx.slack_s / 4) + budget / 20e6
        queue = [p for p in dict.fromkeys([decision.sources[shard], decision.leader, *plan.candidates(shard)[:3],
                                           *self.holders(decision.round)]) if p != self.me]

        async def ask(peer: str) -> AggregateShard | None:
            try:
                agg = await self.transport.request(peer, "get-aggregate", AggregateRequest(decision.round, shard,
                                                   self.ctx.slack_s), AggregateShard, timeout_s=timeout,
                                                   max_reply=budget)
            except PeerUnavailable as exc:
                log.info("aggregate %s from %s: %s", key, peer[-8:], exc)
                return None
            if agg.decision != signed or agg.shard != shard or len(agg.parts) != expected_parts:
                log.info("aggregate %s from %s does not match the decision", key, peer[-8:])
                return None
            try:  # a holder that forged or altered a contribution is caught here, and the next one asked
                if agg.mode != ("signed" if ships_contributions(self.ctx) else "mean"):
                    raise ProtocolError(f"aggregate mode {agg.mode!r} is not this run's")
                if agg.mode == "signed":
                    self._checked_rows(decision, signed, shard, first, stop, agg)
                else:
                    validate_segments(self.ctx, first, agg.parts)
            except ProtocolError as exc:
                self.transport.guard.count(peer, "aggregate-reply", exc.reason, strike=exc.strike)
                log.warning("aggregate %s from %s refused: %s", key, peer[-8:], exc)
                return None
            return agg

        asking: set[asyncio.Future] = set()  # owned here: whatever is still running is cancelled below
        try:
            while queue or asking:  # each time the wait runs out or an answer is no good: one holder more
                if queue:
                    asking.add(asyncio.ensure_future(ask(queue.pop(0))))
                done, asking = await asyncio.wait(asking, timeout=hedge if queue else None,
                                                  return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if (agg := task.result()) is not None:
                        self.server.archive(decision.round, shard, agg)
                        return agg
        finally:
            for task in asking:
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)
        raise PeerUnavailable(f"no peer could provide shard {shard} of round {decision.round}")
