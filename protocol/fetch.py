"""Fetching a committed round's aggregate: every shard from its source, the leader, the shard's
replicas or any peer that applied the round (hedged, so a frozen holder costs little), each
checked against the signed commit, so that either every peer that completes the round applies
the same bytes or the round does not complete here. `RoundClient` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch
from groundswell.compression import CodecError, Payload, RobustStats, robust_mean, robust_weights

from .context import contribution_digest, shard_payload_bound, validate_segments
from .digests import bulk_hasher
from .envelope import unseal
from .plan import RoundPlan
from .schema import (
    MAX_SMALL,
    AggregateRequest,
    AggregateShard,
    ContributionsRequest,
    Decision,
    ProtocolError,
    ShardContribution,
)
from .shards import REPORTING_CANDIDATES, decision_digests, ships_contributions
from .transport import PeerUnavailable, ShardsUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ASKING = 3  # holders asked for one shard at once (see `_fetch_shard`)


class AggregateFetcher:
    """The fetching half of the client; needs the client's server, ctx, transport, me, holders,
    clipped, own_scaled, _rows and _rows_lock."""

    server: Any
    ctx: Any
    transport: Any
    me: str
    holders: Callable[[int], Sequence[str]]
    clipped: dict[int, dict[str, int]]
    own_scaled: dict[int, tuple[tuple[int, int, float], ...]]
    _rows: dict[tuple[int, int], tuple[bytes, AggregateShard, list[list[Payload]]]]
    _rows_lock: threading.Lock

    async def fetch_aggregate(self, signed: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
        """The committed mean of a round as one flat fp32 vector; raises PeerUnavailable if some
        shard cannot be had from anyone, or the commit does not check out (the caller then
        re-syncs the full state): whatever peers send, this never raises anything else."""
        return await _refusing_peer_faults(self._fetch_aggregate(signed, device),
                                           "the round's aggregate could not be assembled")

    async def hold_aggregate(self, signed: bytes) -> None:
        """Fetch and check every shard of a commit (archived where others would ask us for it),
        without computing the mean: what a leader needs in hand before it announces. Raises like
        `fetch_aggregate`."""
        await _refusing_peer_faults(self._hold(signed), "the round's aggregate could not be gathered")

    async def note_own_scaled(self, signed: bytes) -> None:
        """Work out where a commit's mean took our contribution clipped (into `own_scaled`, as a
        fetch notes it) from its shards (a dense mean's say; the signed contributions, without
        computing the mean): what a contribution settled late needs. Raises like `fetch_aggregate`."""
        found = await _refusing_peer_faults(self._own_scaled(signed), "the round's contributions could not be gathered")
        self.own_scaled.update(found)
        newest = max(self.own_scaled, default=0)
        for old in [r for r in self.own_scaled if r < newest - 16]:  # (as a fetch prunes it)
            del self.own_scaled[old]

    async def _own_scaled(self, signed: bytes) -> dict[int, tuple[tuple[int, int, float], ...]]:
        decision, plan, shards = await self._hold(signed)
        return await asyncio.to_thread(self._scaled_in, decision, signed, plan, shards)  # parses every contribution

    def _scaled_in(self, decision: Decision, signed: bytes, plan: RoundPlan, shards: list[AggregateShard]
                   ) -> dict[int, tuple[tuple[int, int, float], ...]]:
        """`_own_scaled`'s answer from the commit's shards in hand (run in a worker thread)."""
        offsets = _offsets(self.ctx.segment_numels)
        mine = decision.contributors.index(self.me) if self.me in decision.contributors else -1
        scaled: list[tuple[int, int, float]] = []
        for shard, agg in enumerate(shards):
            first, stop = plan.shard_segments[shard]
            if agg.mode == "mean":  # its aggregators' word (they made the mean)
                if (weight := _dense_weight(agg, self.me)) is not None:
                    scaled.append((offsets[first], offsets[stop], weight))
                continue
            if mine < 0:
                continue
            weight = robust_weights(self.ctx.codec, self._checked_rows(decision, signed, shard, first, stop, agg),
                                    self.ctx.robust)[mine]
            if weight < 1.0:
                scaled.append((offsets[first], offsets[stop], weight))
        return {decision.round: tuple(scaled)}

    async def _hold(self, signed: bytes) -> tuple[Decision, RoundPlan, list[AggregateShard]]:
        decision = await self.server.verify_commit(signed)
        plan = await self.server.plan(decision.round, decision.attempt, wait_s=0)
        if plan is None or plan.num_shards != decision.num_shards:
            raise PeerUnavailable(f"cannot plan round {decision.round}: its membership is not known here")
        # Every shard to the end, each fetch owned here: the caller learns all that are missing.
        got = await asyncio.gather(*(self._fetch_shard(decision, signed, plan, s) for s in range(plan.num_shards)),
                                   return_exceptions=True)
        for result in got:
            if isinstance(result, BaseException) and not isinstance(result, PeerUnavailable):
                raise result
        missing = [s for s, result in enumerate(got) if isinstance(result, PeerUnavailable)]
        if missing:
            raise ShardsUnavailable(decision.round, missing)
        return decision, plan, [r for r in got if isinstance(r, AggregateShard)]

    async def _fetch_aggregate(self, signed: bytes, device: torch.device | str) -> torch.Tensor:
        decision, plan, shards = await self._hold(signed)
        # Checking, decoding and summing every shard takes seconds for a large dense model: off
        # the network loop, so this peer's handlers and heartbeat go on meanwhile.
        out, clipped, scaled = await asyncio.to_thread(self._assemble, decision, signed, plan, shards)
        self.clipped[decision.round] = clipped
        self.own_scaled[decision.round] = tuple(scaled)
        for book in (self.clipped, self.own_scaled):
            for old in [r for r in book if r < decision.round - 16]:
                del book[old]
        return out.to(device)

    def _assemble(self, decision: Decision, signed: bytes, plan: RoundPlan, shards: list[AggregateShard]
                  ) -> tuple[torch.Tensor, dict[str, int], list[tuple[int, int, float]]]:
        """The commit's mean as one flat fp32 vector, who was clipped in how many shards, and
        where our contribution entered the mean scaled (pure tensor work: run in a worker thread)."""
        out = torch.empty(sum(self.ctx.segment_numels), dtype=torch.float32)
        offsets = _offsets(self.ctx.segment_numels)
        codec = self.ctx.codec
        clipped: dict[str, int] = {}  # contributor -> shards in which its norm was clipped
        mine = decision.contributors.index(self.me) if self.me in decision.contributors else -1
        scaled: list[tuple[int, int, float]] = []  # where our contribution entered the mean clipped
        for shard, agg in enumerate(shards):
            first, stop = plan.shard_segments[shard]
            if agg.mode == "mean":
                values = [codec.decode(p) for p in validate_segments(self.ctx, first, agg.parts)]
                for who in agg.clipped:
                    clipped[who] = clipped.get(who, 0) + 1
                if (weight := _dense_weight(agg, self.me)) is not None:
                    scaled.append((offsets[first], offsets[stop], weight))
                for seg, value in zip(range(first, stop), values):
                    out[offsets[seg]:offsets[seg + 1]] = value
            else:  # every contributor's signed request: rows[c][i] is contributor c's segment first + i
                stats = RobustStats()
                # written straight into `out`: a second copy of the whole vector costs more than the sum
                robust_mean(codec, self._checked_rows(decision, signed, shard, first, stop, agg), self.ctx.robust, stats,
                            out=[out[offsets[seg]:offsets[seg + 1]] for seg in range(first, stop)])
                for c in stats.clipped:
                    clipped[decision.contributors[c]] = clipped.get(decision.contributors[c], 0) + 1
                if mine in stats.weights:
                    scaled.append((offsets[first], offsets[stop], stats.weights[mine]))
        return out, clipped, scaled

    async def gather_contributions(self, plan: RoundPlan, sources: list[str], contributors: list[str],
                                   digests: list[bytes]) -> dict[str, torch.Tensor]:
        """Each contributor's own decoded update, from the signed contributions the shards' sources
        hold (the leader scores them one by one before it decides)."""
        probe = Decision(plan.round, plan.attempt, "probe", list(contributors), [], [], self.me, list(sources),
                         plan.num_shards, 0.0, list(digests))
        offsets = _offsets(self.ctx.segment_numels)
        out = {c: torch.empty(offsets[-1], dtype=torch.float32) for c in contributors}
        # Every shard comes down at once: each request is given the time of the whole download (a
        # shard's own share timed out at 100m parameters and 64 contributors on a 100 Mbit/s link
        # once budgets were sized by the codec, and the round went unscored; a review, 2026-12-07).
        whole = sum(shard_payload_bound(self.ctx, a, b) for a, b in plan.shard_segments) * max(1, len(contributors))

        async def one(shard: int) -> None:
            first, stop = plan.shard_segments[shard]
            # each contributor's share of this shard, not the whole model per contributor
            budget = shard_payload_bound(self.ctx, first, stop) * max(1, len(contributors)) + MAX_SMALL
            if sources[shard] == self.me:
                agg = self.server.local_contributions(plan.round, plan.attempt, shard, list(contributors))
            else:
                agg = await self.transport.request(
                    sources[shard], "get-contributions",
                    ContributionsRequest(plan.round, plan.attempt, shard, list(contributors)), AggregateShard,
                    timeout_s=2 * self.ctx.slack_s + whole / 20e6, max_reply=budget)
            if agg.mode != "signed":
                raise PeerUnavailable(f"the source of shard {shard} did not hand over its contributions")
            def decode() -> None:  # in a worker thread: N contributions of a shard are a lot of tensor work
                rows = self._contributions(probe, shard, first, stop, agg)
                for contributor, row in zip(contributors, rows):
                    for i, payload in enumerate(row):
                        out[contributor][offsets[first + i]:offsets[first + i + 1]] = self.ctx.codec.decode(payload)

            await asyncio.to_thread(decode)

        # One shard failing fails them all: the others' downloads (N contributions each) are
        # cancelled, not left running against the leader's downlink while it commits.
        tasks = [asyncio.ensure_future(one(s)) for s in range(plan.num_shards)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return out

    def _checked_rows(self, decision: Decision, signed: bytes, shard: int, first: int, stop: int,
                      agg: AggregateShard) -> list[list[Payload]]:
        """`_contributions` of a shard of a commit, checked and parsed once per shard object."""
        key = (decision.round, shard)
        with self._rows_lock:  # worker threads check shards while the network loop fetches others
            hit = self._rows.get(key)
        if hit is not None and hit[0] == signed and hit[1] is agg:
            return hit[2]
        rows = self._contributions(decision, shard, first, stop, agg)
        with self._rows_lock:
            if key not in self._rows or self._rows[key][0] != signed:  # a hedged holder's parse lands late: kept first
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
            # One we took as an aggregator is the same bytes (the digest pins them): parsed already.
            held = self.server.held_rows(decision.round, decision.attempt, shard, who, pinned[len(rows)])
            rows.append(held if held is not None else validate_segments(self.ctx, first, msg.segments))
        return rows

    async def _fetch_shard(self, decision: Decision, signed: bytes, plan: RoundPlan, shard: int) -> AggregateShard:
        key = (decision.round, shard)
        if key in self.server.aggregates and self.server.aggregates[key].decision == signed:
            return self.server.aggregates[key]
        first, stop = plan.shard_segments[shard]
        expected_parts = len(decision.contributors) if ships_contributions(self.ctx) else stop - first
        # What an honest reply of this shard can be: one mean of its segments, or each
        # contributor's share of them (sized as a whole contribution per shard, a 16-shard run's
        # hedge before asking the next holder was 16x too long: 83 s at 16 peers on 25M values).
        per_shard = shard_payload_bound(self.ctx, first, stop)
        budget = per_shard * (max(1, len(decision.contributors)) if ships_contributions(self.ctx) else 1) + MAX_SMALL
        # The request's own bound: the holder serves this shard to every peer of the round at
        # once, at a modest 5 MB/s (a frozen holder costs the hedge below, not this).
        timeout = 2 * self.ctx.slack_s + budget * max(1, len(decision.contributors)) / 5e6
        # The shard's source first, then the leader (it gathered every shard before announcing),
        # then the shard's replicas (sealed too), then anyone who has applied the round. A holder
        # that has not answered within `hedge` (it may have frozen after the seal) gets company:
        # the next one is asked too, and the first good answer wins.
        # Every shard of the commit comes down at once, so a holder's shard is due in the time of
        # the whole download, not its own share's: with budgets sized by the codec, a sparse
        # shard's own share (~0.4 s at 100m parameters and 64 contributors) asked each shard's
        # next holders well before an honest first one could finish (a review, 2026-12-07).
        together = sum(shard_payload_bound(self.ctx, a, b) for a, b in plan.shard_segments) \
            * (max(1, len(decision.contributors)) if ships_contributions(self.ctx) else 1)
        hedge = max(1.0, self.ctx.slack_s / 4) + together / 20e6
        # A mean (dense codecs) is the word of whoever computed it, unlike signed contributions,
        # which any holder can hand on unaltered: it is taken only from the shard's source, the
        # leader and the shard's candidates (its replicas are among them), never from a peer
        # that merely says it applied the round (in an open run, anyone).
        if ships_contributions(self.ctx):
            holders = [*plan.candidates(shard)[:REPORTING_CANDIDATES], *self.holders(decision.round)]
        else:
            holders = plan.candidates(shard)[:REPORTING_CANDIDATES]
        queue = [p for p in dict.fromkeys([decision.sources[shard], decision.leader, *holders]) if p != self.me]

        async def ask(peer: str) -> AggregateShard | None:
            try:
                agg = await self.transport.request(peer, "get-aggregate", AggregateRequest(decision.round, shard,
                                                   self.ctx.slack_s), AggregateShard, timeout_s=timeout,
                                                   max_reply=budget)
            except PeerUnavailable as exc:
                log.info("aggregate %s from %s: %s", key, peer[-8:], exc)
                return None
            if agg.mode == "none" and not agg.decision:  # (a round it never held, or no longer keeps)
                log.info("aggregate %s: %s does not hold it", key, peer[-8:])
                return None
            if agg.decision != signed or agg.shard != shard or len(agg.parts) != expected_parts:
                log.info("aggregate %s from %s does not match the decision", key, peer[-8:])
                return None
            try:  # a holder that forged or altered a contribution is caught here, and the next one asked
                if agg.mode != ("signed" if ships_contributions(self.ctx) else "mean"):
                    raise ProtocolError(f"aggregate mode {agg.mode!r} is not this run's")
                if agg.mode == "signed":  # (parsing a shard's payloads: in a worker thread)
                    await asyncio.to_thread(self._checked_rows, decision, signed, shard, first, stop, agg)
                else:
                    await asyncio.to_thread(validate_segments, self.ctx, first, agg.parts)
                    if len(agg.weights) != len(agg.clipped) or len(set(agg.clipped)) != len(agg.clipped) \
                            or not set(agg.clipped) <= set(decision.contributors):
                        raise ProtocolError("a mean's clipped contributors and their factors do not match")
            except ProtocolError as exc:
                self.transport.guard.count(peer, "aggregate-reply", exc.reason, strike=exc.strike)
                log.warning("aggregate %s from %s refused: %s", key, peer[-8:], exc)
                return None
            return agg

        # A mean from the source (which computed it) or the leader (which signed the commit and
        # gathered it from the sources) is taken on its word; one from another candidate once a
        # second holder sent the same bytes, or, when neither the source nor the leader can
        # answer (a commit outlives them on its replicas), if no other holder left contradicts
        # it. Taken from the first to answer, a hostile candidate's made-up mean was applied by
        # all (found by a review). Honest holders agree bit for bit (compression/robust.py).
        signed_mode = ships_contributions(self.ctx)  # (signed contributions are checked one by one)
        trusted = {decision.sources[shard], decision.leader}
        trusted_left = trusted & set(queue)  # those that may still answer
        seen: dict[bytes, tuple[set[str], AggregateShard]] = {}  # a candidate's mean's digest -> who sent it
        asking: dict[asyncio.Future, str] = {}  # owned here: whatever is still running is cancelled below
        taken: AggregateShard | None = None
        try:
            while (queue or asking) and taken is None:  # each time the wait runs out or an answer is no good: one more
                if queue and len(asking) < MAX_ASKING:
                    peer = queue.pop(0)
                    asking[asyncio.ensure_future(ask(peer))] = peer
                # (at most MAX_ASKING at once: a hedge shorter than an honest dense transfer asked
                # holder after holder for the whole shard, ~5x the download traffic, and holders
                # from the DHT, sybils in an open run, one more each hedge up to the 330 s bound)
                done, _ = await asyncio.wait(asking, timeout=hedge if queue and len(asking) < MAX_ASKING
                                             else None, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    peer = asking.pop(task)
                    if (agg := task.result()) is None:
                        trusted_left.discard(peer)
                    elif signed_mode or peer in trusted:
                        taken = agg
                        break
                    else:
                        holders_of, _ = seen.setdefault(await asyncio.to_thread(_mean_digest, agg), (set(), agg))
                        holders_of.add(peer)
                        if len(holders_of) >= 2:
                            taken = agg
                            break
                        log.info("aggregate %s from %s: a candidate's mean, taken once another holder sends the "
                                 "same", key, peer[-8:])
        finally:
            for task in asking:
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)
        if taken is None and not trusted_left and seen:
            if len(seen) == 1:  # one candidate's mean, and nobody left to say otherwise
                taken = next(iter(seen.values()))[1]
            else:
                log.warning("aggregate %s: the shard's candidates sent different means, and neither its source nor "
                            "the leader answered", key)
        if taken is not None:
            self.server.archive(decision.round, shard, taken if self._serves_shard(decision, plan, shard) else None)
            return taken
        raise PeerUnavailable(f"no peer could provide shard {shard} of round {decision.round}")


    def _serves_shard(self, decision: Decision, plan: RoundPlan, shard: int) -> bool:
        """Would another peer ever ask us for this fetched shard? Signed contributions: anyone
        who applied the round may be asked. A dense mean: only its source, the leader and the
        shard's candidates are (see `_fetch_shard`); kept by anyone else, it would be 9 rounds of
        full-size means (36 bytes per parameter in fp32) that nobody reads."""
        return ships_contributions(self.ctx) or self.me in (
            decision.sources[shard], decision.leader, *plan.candidates(shard)[:REPORTING_CANDIDATES])


def _mean_digest(agg: AggregateShard) -> bytes:
    """What two holders of a dense mean must agree on: its segments, and whom it clipped by how much."""
    hasher = bulk_hasher()
    for part in agg.parts:
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    hasher.update(repr((agg.clipped, agg.weights)).encode())
    return hasher.digest()


async def _refusing_peer_faults(work: Awaitable[T], failed: str) -> T:
    """Await `work`; whatever other peers' bytes made it fail with becomes PeerUnavailable(failed),
    so a caller that gets anything else knows it is its own trouble (memory) or a cancellation."""
    try:
        return await work
    except PeerUnavailable:
        raise
    except Exception as exc:  # ProtocolError, CodecError, or a bug a hostile input found: not used
        if _out_of_memory(exc):  # ours to report, not the peers' doing
            raise
        log.warning("%s: %r", failed, exc, exc_info=_unexpected(exc))
        raise PeerUnavailable(f"{failed}: {exc}") from None


# (torch.OutOfMemoryError is new in torch 2.5; named in an except clause, an older torch turned
# every refused shard into an AttributeError)
_DEVICE_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _out_of_memory(exc: BaseException) -> bool:
    """Is `exc` memory running out here: Python's, a device's, or torch's CPU allocator's (a
    RuntimeError)?"""
    return isinstance(exc, (MemoryError, _DEVICE_OOM)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def _unexpected(exc: Exception) -> Exception | None:
    """`exc` when it is not one of the errors hostile bytes are refused with (then its traceback
    is worth a log line: a bug of ours that some input found), else None."""
    return None if isinstance(exc, (ProtocolError, CodecError)) else exc


def _dense_weight(agg: AggregateShard, me: str) -> float | None:
    """The factor a dense mean's shard took our contribution in with, if it clipped it."""
    if me not in agg.clipped:
        return None
    weight = agg.weights[agg.clipped.index(me)]
    return weight if weight < 1.0 else None


def _offsets(numels: Sequence[int]) -> list[int]:
    """Where each segment starts in the flat vector, and where the last one ends."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    return offsets
