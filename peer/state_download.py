"""Downloading a global state: ask peers in order (the coordinator after a few failures, busy
ones again later), check each reply's size and decision before its blob is read, and take the
first state that passes `StateCheck` (see `state_trust`); and the sizes and time limits of a
state download."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from groundswell.protocol.schema import ProtocolError, StateReply
from groundswell.protocol.transport import PeerDead, PeerUnavailable, RequestTimedOut

from .run_state import GlobalState
from .state_fetch import direct_time, fetch_state
from .state_trust import ModelMismatch, NoNewerState, StateCheck

log = logging.getLogger(__name__)
COORDINATOR_AFTER_FAILURES = 2  # peers that failed to serve a state before the coordinator is asked next
BUSY_WAIT_S = 2.0  # a peer whose upload slots are taken is asked again this long after, doubling each time,
BUSY_WAIT_MAX_S = 30.0  # up to this, while a sync still has the time for one download after it


class StateTooSlow(PeerUnavailable):
    """Every failed download of the state ran out of its time with the blob under way: this
    peer's link is likely too slow for the run's state (retrying fails alike)."""


def state_budget(numel: int, momentum: bool = True) -> int:
    """The most bytes a state download may announce: the parameters (and DiLoCo's momentum) as
    fp32, plus room for the blob's header. It is allocated as announced, before the bytes arrive:
    a server must not make a joiner hold more than the state it needs anyway."""
    return 4 * numel * (2 if momentum else 1) + (1 << 20)


def _timed_bytes(numel: int) -> int:
    # what the timeouts are sized for: twice a DiLoCo state, so a slow link still gets the time
    return 16 * numel + (1 << 20)


def state_timeout_s(numel: int) -> float:
    """How long one peer may take to serve the state (twice a DiLoCo state at 20 MB/s, plus a minute)."""
    return 60 + _timed_bytes(numel) / 20e6


def state_reply_timeout_s(numel: int) -> float:
    """How long a peer may take to answer a state request before its blob (it serializes and
    hashes the state once per round, at 1 GB/s or better): a silent peer costs this, not the
    whole `state_timeout_s`."""
    return 30 + _timed_bytes(numel) / 1e9


def sync_timeout_s(numel: int) -> float:
    """How long a whole state sync may take: at least 10 minutes, and room for three peers' full
    timeouts and a few silent ones (a big model's state would otherwise never fit in a fixed
    budget)."""
    return max(600.0, 3 * state_timeout_s(numel) + 120)


def needed_rate(numel: int, size: int) -> float:
    """Bytes per second a joiner's link must carry to take a `size`-byte state from one peer in
    time, by the direct connection (which leaves the stream's share of the time unspent)."""
    return size / direct_time(state_timeout_s(numel), size)


def _too_slow(too_slow: dict[str, int], numel: int) -> StateTooSlow:
    size, given = max(too_slow.values()), state_timeout_s(numel)
    return StateTooSlow(f"the run's state ({size / 1e6:,.0f} MB) did not arrive within the {given:.0f} s a peer is "
                        f"given to send it, from {len(too_slow)} peer{'s' if len(too_slow) != 1 else ''}: joining "
                        f"this run takes about {8 * needed_rate(numel, size) / 1e6:.0f} Mbit/s of download or more")


async def download_state(node: Any, check: StateCheck, peers: list[str], min_round: int) -> tuple[GlobalState, str]:
    """The first state of round >= `min_round` one of `peers` (asked in order) serves that passes
    `check`, and how it came ("direct" or "stream"); a refused state is counted against its server."""
    budget = state_budget(check.numel, check.needs_momentum)

    def size_check(server: str) -> Callable[[StateReply], int]:
        def size(reply: StateReply) -> int:  # runs before a byte of the blob is read
            announced[server] = reply.size
            if reply.size > budget:
                # The run's own state, its hash says; only the coordinator's say-so tells us our
                # model is wrong (anyone can copy the hash it publishes into a reply that is all size).
                vouched = check.vouched(reply, server, node.cached_records)
                if vouched and server == check.coordinator:
                    other_model[server] = (f"the run's state is {reply.size} bytes, more than a model of ours can "
                                           f"have ({budget}): is our dataset (its vocabulary) the run's?")
                    raise ProtocolError(other_model[server], reason="other-model", strike=False)
                # (counted here, as a refused state is: the transport only counts the reply, strike dropped)
                node.guard.count(server, "state-reply", "oversized", strike=not vouched)
                raise ProtocolError(f"a state of {reply.size} bytes exceeds the limit of {budget}", reason="oversized",
                                    strike=not vouched)
            if reply.size and reply.round < min_round:  # an honest server answers size 0 instead
                node.guard.count(server, "state-reply", "stale-round", strike=False)
                raise ProtocolError(f"a state of round {reply.round}, older than the {min_round} asked for")
            if reply.size:  # both are in the signed reply: a state they refuse costs no download
                try:
                    check.check_decision(reply, vouched=check.vouched(reply, server, node.cached_records))
                    check.refuse_early(reply, server, node.cached_records)
                except ProtocolError as exc:  # counted as a refused state is (the transport only counts it)
                    node.guard.count(server, "state-reply", exc.reason, strike=exc.strike)
                    raise
            return reply.size
        return size

    queue, asked = list(dict.fromkeys(peers)), 0
    announced: dict[str, int] = {}  # server -> the size of the state its reply announced
    too_slow: dict[str, int] = {}  # server -> that size, where the blob was under way when its time ran out
    other_model: dict[str, str] = {}  # server -> why its state, the run's own, is of a model not ours
    behind: set[str] = set()  # answered: nothing of round >= min_round
    silent: set[str] = set()  # alive, or not known to be gone, but served nothing: may hold a newer state
    newer: set[str] = set()  # showed a state of round >= min_round (busy serving it, or one we refused)
    unconfirmed: set[str] = set()  # showed one past the coordinator's record that nobody confirms
    busy: dict[str, int] = {}  # peer -> how often it said its upload slots were taken
    retry_at: dict[str, float] = {}
    reply: StateReply | None = None
    blob: bytearray | memoryview | None = None
    # busy servers are asked again as long as one download would still fit in the sync's time
    patience_end = time.monotonic() + max(0.0, sync_timeout_s(check.numel) - state_timeout_s(check.numel))
    while queue:
        if asked == COORDINATOR_AFTER_FAILURES and check.coordinator in queue and check.coordinator not in busy:
            # (each peer asked so far failed, or we would have returned) Peers that copy the
            # coordinator's (round, hash) into their records are asked before it and may be
            # silent: after a few failures the coordinator itself is next.
            queue.remove(check.coordinator)
            queue.insert(0, check.coordinator)
        peer = queue.pop(0)
        if peer in retry_at and max(retry_at[peer], time.monotonic()) >= patience_end:
            continue  # the peers asked since took the time left: a download would not fit any more
        asked += 1
        if (wait := retry_at.get(peer, 0.0) - time.monotonic()) > 0:  # every peer ahead of it was asked meanwhile
            await asyncio.sleep(wait)
        silent.discard(peer)
        announced.pop(peer, None)
        # The last server's state, refused, must not stay alive while the next one's arrives: a
        # hostile first server would double the peak memory of a join (a whole state each).
        reply = blob = None
        started = time.monotonic()
        try:
            reply, blob, digest, via = await fetch_state(node, peer, min_round, size_check(peer),
                                                         timeout_s=state_timeout_s(check.numel),
                                                         reply_timeout_s=state_reply_timeout_s(check.numel))
        except PeerUnavailable as exc:
            log.info("state from %s: %s", peer[-8:], exc)
            if announced.get(peer) and isinstance(exc, RequestTimedOut) \
                    and time.monotonic() - started >= 0.9 * state_timeout_s(check.numel):
                # Its time ran out with the blob under way and no 1 MiB of it stalled (a stream
                # that stalls ends within TRAILER_STALL_S as the transport's PeerGone; a direct
                # one within direct.STALL_S, and the stream is asked): bytes kept coming, too
                # slowly. A server that stops sending, or never answers, says nothing of our link.
                too_slow[peer] = announced[peer]
                if time.monotonic() >= patience_end:
                    # no time left for another download: said as such here, not as the sync's end
                    # (its caller's timeout: "is the run still up?"). Not sooner: a busy server's
                    # uplink, shared by a wave of joiners, is slow too, and another may not be.
                    raise _too_slow(too_slow, check.numel)
            if peer in other_model:
                continue
            if not isinstance(exc, PeerDead):  # a dead peer's record lingers a while: it holds nothing
                silent.add(peer)
            continue
        if reply.busy and not blob:
            newer.add(peer)  # (a server asked for more than it holds answers "nothing newer", not "busy")
            busy[peer] = busy.get(peer, 0) + 1
            wait = min(BUSY_WAIT_MAX_S, BUSY_WAIT_S * 2 ** (busy[peer] - 1))
            if time.monotonic() + wait < patience_end:  # asked again once the others have been, later each time
                log.info("state from %s: busy uploading to others; asking again in %.0fs", peer[-8:], wait)
                retry_at[peer] = time.monotonic() + wait
                queue.append(peer)
            silent.add(peer)
            continue
        if not blob or reply.round < min_round:  # it answered: it has nothing that recent
            behind.add(peer)
            continue
        try:
            return await check.verify(reply, blob, digest, peer, node.refresh_records), via
        except ProtocolError as exc:  # a broken or hostile server: count it, ask the next peer
            blob = None  # (freed now, not when the next server's reply comes: see above)
            node.guard.count(peer, "state-reply", exc.reason, strike=exc.strike)
            # (its text: a record kept by a handler would keep `exc`, its traceback, and so the blob)
            log.warning("state from %s refused: %s", peer[-8:], str(exc))
            if exc.reason == "unconfirmed":
                # A state past the coordinator's record that nobody confirms (a coordinator
                # restarted from an older checkpoint, the volunteers gone on without it) is not
                # one we can take, nor a reason to give up ours: a restarted volunteer whose own
                # checkpoint was as new quit here, and the run stalled (found by a review).
                unconfirmed.add(peer)
                continue
            newer.add(peer)
            if exc.reason == "other-model":
                other_model[peer] = str(exc)
    # "Nothing newer" only when the answers say so, and no peer showed a newer state: the
    # coordinator's answer, or more peers' than those that may have been silent only for now
    # (slow, refusing a flood). Peers whose dial failed are gone: their records linger a while,
    # and they must not keep a restarted volunteer that is ahead of everyone online from
    # carrying on.
    if other_model:  # the run's own state (the coordinator vouches for it) does not fit our model: ours is wrong
        raise ModelMismatch(next(iter(other_model.values())))
    answered = behind | unconfirmed
    if answered and not newer and (check.coordinator in behind or len(answered) > len(silent)):
        raise NoNewerState(f"no peer holds a verifiable state of round {min_round} or later "
                           f"({len(behind)} answered with an older one or none"
                           + (f", {len(unconfirmed)} with one past the coordinator's record that no other peer "
                              "confirms" if unconfirmed else "") + ")")
    if too_slow and not behind and not newer - busy.keys() and not silent - too_slow.keys() - busy.keys():
        raise _too_slow(too_slow, check.numel)
    raise PeerUnavailable("no peer served a verifiable state"
                          + (f" ({len(silent)} did not answer, {len(newer)} had a newer one we could not "
                             f"take, {len(behind)} had nothing newer)" if behind else ""))
