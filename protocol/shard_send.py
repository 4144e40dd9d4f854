"""Sending a contribution's shards to their aggregators: each shard to its candidates in turn
until `replica_count` + 1 of them hold it, hedged so that a frozen, silent or slow candidate
costs little. `RoundClient` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .claims import ping
from .context import DecisionBook
from .framing import WRITE_PIECE, SendProgress
from .plan import RoundPlan, close_time
from .schema import Ack, ProtocolError, ShardContribution
from .shards import REPORTING_CANDIDATES, replica_count
from .transport import PeerGone, PeerUnavailable, RequestTimedOut

log = logging.getLogger(__name__)
# A shard up to this size goes to all its copies' aggregators at once (sparse shards are ~1/200
# of fp32); a bigger one to one at a time.
PARALLEL_COPIES_BYTES = 256 << 10
UPLINK_ASSUMED = 5e6  # bytes/s: the contributor's uplink a contribution's times are sized by


class ShardSender:
    """The sending half of the client; needs the client's server, ctx, transport, me, book,
    sends_cut, cut_to and ask_decision."""

    server: Any
    ctx: Any
    transport: Any
    me: str
    book: DecisionBook
    sends_cut: int
    cut_to: dict[tuple[int, int], set[str]]
    ask_decision: Callable[..., Awaitable[bytes]]  # (peer, round, attempt, wait_s): a checked decision, or b""

    async def _send_shard(self, plan: RoundPlan, shard: int, segments: list[bytes],
                          watch: list[SendProgress] | None = None) -> bool:
        """Give the shard to its aggregator and `replica_count` replicas, the first of its reporting
        candidates that take it (the same peers for every contributor while they are alive, so the
        leader finds whole replicas); True if at least one took it.

        A frozen candidate never answers: if no copy lands within a hedge, the next candidate is
        tried too, so it costs the hedge, not the request timeout (which, at the default round
        timing, is the whole attempt). Small (sparse) shards go to every copy's peer at once; a big
        one goes to one peer at a time, and a frozen peer is told by a ping (see `_pinged_offer`);
        a big copy that goes out far slower than the contribution's others, stalls, or is never
        acked (`copy_lags`) is passed over once while it runs on. `watch`: the progress of every
        big copy of the contribution (shared by its shards' calls)."""
        first, stop = plan.shard_segments[shard]
        msg = ShardContribution(plan.round, plan.attempt, shard, first, segments[first:stop])
        size = sum(len(s) for s in msg.segments)
        copies = 1 + max(0, replica_count(self.ctx))
        small = size <= PARALLEL_COPIES_BYTES
        # A live aggregator at a modest 5 MB/s; a big shard shares our uplink with every other
        # shard of the contribution (all go at once), so it gets the time of all of them: sized
        # for itself alone, each was cut off and sent again elsewhere on a 6 MB/s uplink that
        # could have carried the whole contribution in time (a review's model: none delivered).
        total = size if small else sum(len(s) for s in segments)
        timeout = 2 * self.ctx.slack_s + total / UPLINK_ASSUMED
        at_once = copies if small else 1
        # A big shard is not hedged by the clock: every shard of a contribution goes at once, and
        # each hedge would add a copy of each to a slow uplink until none lands in time. Its copy
        # is watched instead (a tick at a time), and one that lags (`copy_lags`) gets company.
        hedge = max(1.0, self.ctx.slack_s / 2) if small else min(1.0, self.ctx.slack_s / 2)
        watch = watch if watch is not None else []  # every big copy of this contribution, to compare with
        offer = self._offer if small else self._pinged_offer
        queue = list(plan.candidates(shard)[:REPORTING_CANDIDATES])
        held, stalled, launched, passed_over = 0, False, 0, False
        asking: set[asyncio.Future[str]] = set()  # owned here: whatever still runs is cancelled below
        progress: dict[asyncio.Future[str], SendProgress] = {}
        lagging: set[asyncio.Future[str]] = set()  # a big copy passed over, still running
        try:
            while held < copies and (queue or asking):
                if queue and launched and self._attempt_over(plan):
                    queue.clear()  # past the close by our clock: no candidate more, the decision is due
                    continue
                if queue and (stalled or len(asking - lagging) < min(at_once, copies - held)):
                    launched += 1
                    peer = queue.pop(0)
                    if small:
                        task = asyncio.ensure_future(offer(peer, msg, timeout))
                    else:
                        progress_of = SendProgress()
                        watch.append(progress_of)
                        task = asyncio.ensure_future(offer(peer, msg, timeout, progress_of))
                        progress[task] = progress_of
                    asking.add(task)
                    stalled = False
                    continue
                if held and (stalled or not asking - lagging):
                    break  # delivered; the copies still on their way had their hedge
                done, asking = await asyncio.wait(asking, timeout=hedge, return_when=asyncio.FIRST_COMPLETED)
                lagging -= done
                stalled = small and not done
                for task in [] if small else [t for t in asking if t not in lagging]:
                    why = copy_lags(progress[task], watch, self.ctx.slack_s)
                    # Slow next to the others: one copy more per shard at most (each shares our
                    # uplink). Never acked, or stalled while others moved: the receiver's doing.
                    if why in ("no ack", "stalled") or (why == "slow" and not passed_over):
                        lagging.add(task)
                        passed_over |= why == "slow"
                for task in done:
                    if task in progress:
                        watch.remove(progress.pop(task))
                    verdict = task.result()
                    if verdict == "closed" and self._attempt_over(plan):
                        return held > 0
                    held += verdict == "ok"  # a "closed" we cannot confirm is one candidate's failure
        finally:
            for task in asking:
                task.cancel()
                if task in progress:
                    watch.remove(progress.pop(task))
            await asyncio.gather(*asking, return_exceptions=True)
        return held > 0

    def _attempt_over(self, plan: RoundPlan) -> bool:
        """Does our own book say the attempt is over (its round decided, or its close passed by our
        clock)? An aggregator's "closed" is its own words: a hostile first candidate said it to
        every contributor, which then sent the shard to nobody else, and no attempt could commit."""
        if self._round_decided(plan.round):
            return True
        opened = self.book.opened_at(plan.round)
        return opened is not None and time.time() >= close_time(opened, plan.attempt, self.ctx.deadline_s,
                                                                self.ctx.slack_s)

    def _round_decided(self, round_id: int) -> bool:
        return round_id in self.book.committed or round_id <= self.book.latest()

    async def _pinged_offer(self, peer: str, msg: ShardContribution, timeout: float,
                            progress: SendProgress | None = None) -> str:
        """`_offer`, after a ping: a frozen aggregator's daemon still takes the bytes, so the
        transfer alone would wait out its whole timeout (two slacks and more: past the attempt's
        close). One that does not answer a ping within a slack is passed over ("failed") and the
        shard goes to the next candidate. The ping goes first, ahead of our own bulk bytes on the
        connection, and a transfer once started is never cut short: a live aggregator behind a
        slow link is not mistaken for a frozen one halfway through. Costs one round trip."""
        if peer != self.me and not await self._answers(peer, msg.round, msg.attempt, self.ctx.slack_s):
            log.info("shard %d to %s: no answer to a ping within %.1fs (frozen?); trying the next aggregator",
                     msg.shard, peer[-8:], self.ctx.slack_s)
            return "failed"
        return await self._offer(peer, msg, timeout, progress)

    async def _answers(self, peer: str, round_id: int, attempt: int, within: float) -> bool:
        """Does `peer` answer a request at all within `within` seconds? A refusal is an answer
        (the transport raises PeerGone for it), and so is a dead peer's failed dial, which the
        transfer then finds out for itself."""
        failure = await ping(self.transport, peer, round_id, attempt, within)
        return failure is None or isinstance(failure, PeerGone)

    async def _offer(self, peer: str, msg: ShardContribution, timeout: float,
                     progress: SendProgress | None = None) -> str:
        """Send one shard to one aggregator: "ok", "closed" (it says the attempt is over), or "failed".
        `progress`: kept up to date as the shard goes out (not for our own aggregator)."""
        started = time.monotonic()
        try:
            if peer == self.me:
                ack = await self.server._on_contribute(peer, msg)
            elif progress is not None:
                ack = await self.transport.request(peer, "contribute", msg, Ack, timeout_s=timeout, progress=progress)
            else:
                ack = await self.transport.request(peer, "contribute", msg, Ack, timeout_s=timeout)
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("shard %d to %s failed: %s", msg.shard, peer[-8:], exc)
            # Not done within our own time for it (two slacks and more): what a slow uplink does.
            # A stream the aggregator closed is not counted: its body-rate rule does that to a slow
            # sender, but so does a refusal after its 10 s wait for room, or a crash.
            if isinstance(exc, RequestTimedOut) and time.monotonic() - started >= self.ctx.slack_s:
                self.sends_cut += 1
                self.cut_to.setdefault((msg.round, msg.attempt), set()).add(peer)
            return "failed"
        if ack.ok:
            return "ok"
        log.info("shard %d refused by %s: %s", msg.shard, peer[-8:], ack.reason)
        if "closed" not in ack.reason and "sealed" not in ack.reason:
            return "failed"
        if peer != self.me and not self._round_decided(msg.round):
            # Its word alone (see `_attempt_over`): the commit it speaks of, if it holds one, is
            # checked and lands in our book; without one, a lagging book of ours would send a big
            # shard to every candidate after an honest close.
            await self.ask_decision(peer, msg.round, msg.attempt, 0.0)
        return "closed"


def copy_lags(progress: SendProgress, watch: list[SendProgress], slack: float) -> str | None:
    """Why a big copy goes out too slowly to be waited on alone, if it does ("no ack", "stalled",
    "slow"; else None). Judged against what our uplink carries for the contribution's other
    copies, never against an assumed rate: copies that are all slow alike are our own uplink's
    doing, and a copy more would only slow every one (a review's model: with a fixed yardstick,
    an honest 2.5 MB/s uplink sent four copies of each shard and delivered none). A copy lags:
    - "no ack": its whole body went out and no ack came within two slacks plus what its last
      piece, still in buffers on the way, takes at its own rate (an honest aggregator acks once
      it checked it);
    - "stalled": it moved nothing for two slacks and for three pieces' time at the rate the
      uplink carries each of the others, while they moved (alone, for two slacks);
    - "slow": two slacks in, it has sent under a quarter of what the other copies send on average.
    Rates are taken over a slack at least: a copy just opened, whose first piece went straight
    into buffers, would otherwise show ~1 GB/s and make every other copy "slow" (the next review).
    A copy that held the shard alone, never cut short, kept it from every aggregator past the
    attempt's close: a hostile first candidate that answered the ping and then never acked (or
    stopped reading) could have every attempt of a dense run retried (found by a review)."""
    if progress.opened is None or progress.moved is None:
        return None  # still dialling: the transport's timeout and the ping bound that
    now = time.monotonic()
    if progress.finished is not None:
        own_rate = progress.written / max(progress.finished - progress.opened, slack)
        return "no ack" if now - progress.finished >= 2 * slack + WRITE_PIECE / max(own_rate, 1.0) else None
    others = [p for p in watch if p is not progress and p.opened is not None]
    elapsed = now - progress.opened
    if others:
        # what the uplink carries each of the others, on average since the first of them opened
        span = max(now - p.opened for p in others)
        per_copy = sum(p.written for p in others) / max(span, slack) / len(others)
        # (two slacks: an aggregator short of room for a body holds it back a while, honestly)
        limit = max(2 * slack, 3 * WRITE_PIECE / max(per_copy, 1.0))
        if now - progress.moved >= limit and any(p.moved is not None and p.moved > progress.moved for p in others):
            return "stalled"
        rates = [p.written / max((p.finished or now) - p.opened, slack) for p in others]
        slow = elapsed >= 2 * slack and progress.written / elapsed < 0.25 * sum(rates) / len(rates)
        return "slow" if slow else None
    # alone: nothing to compare with; a piece that has not drained for two slacks is under ~100 KB/s
    return "stalled" if now - progress.moved >= max(2 * slack, 3 * WRITE_PIECE / UPLINK_ASSUMED) else None
