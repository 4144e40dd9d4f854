"""Per-peer limits on inbound traffic: request rate, concurrent streams, replay and clock checks,
and temporary bans for peers that keep breaking them or the protocol.

One `Guard` serves every transport of a node (bans are about peers, not runs). Everything is
bounded: the nonce cache by a maximum entry count, the per-peer tables by the number of peers
seen recently (idle ones are forgotten).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from .clock_offset import ClockOffsets
from .schema import ProtocolError

MAX_PEERS = 10_000  # peers whose counters are kept; beyond this the longest-idle is forgotten
IDLE_SCAN = 64  # at most this many of the oldest peers are looked at to find an idle one
SMALL_BODY = 64 << 10  # request bodies up to this size are not counted against the inbound budget (the transport's rule)


@dataclass(frozen=True)
class Limits:
    """What one remote peer may do; a peer with `strikes` violations in `ban_s` is banned `ban_s`."""

    requests_per_s: float = 50.0  # sustained; bursts of 2 s worth are fine
    max_streams: int = 32  # concurrent inbound streams
    # all peers together: each open stream holds one of our file descriptors (and identities are
    # free, so `max_streams` alone does not bound them)
    max_streams_total: int = 1024
    ban_s: float = 60.0
    strikes: int = 20
    max_clock_skew_s: float = 120.0  # a message stamped further from our clock is dropped
    max_nonces: int = 200_000  # replay cache entries (a nonce, its expiry, the dict's slot: ~34 MiB at most, measured)
    # Bytes of large request bodies received and not yet handled, all peers together and one peer
    # alone (at least four and one of the largest request a handler takes, see
    # `Guard.take_bytes`): a body is buffered whole before it is checked, so without this a few
    # identities sending full-size contributions slowly held gigabytes.
    max_inbound_bytes: int = 1 << 30
    max_inbound_bytes_per_peer: int = 1 << 27

    def __post_init__(self) -> None:
        if not (self.requests_per_s > 0 and self.max_streams >= 1 and self.max_streams_total >= 1 and self.ban_s >= 0 and self.strikes >= 1
                and self.max_clock_skew_s > 0 and self.max_nonces >= 1 and self.max_inbound_bytes >= 1
                and self.max_inbound_bytes_per_peer >= 1):
            raise ValueError(f"invalid limits: {self}")


@dataclass
class _PeerState:
    tokens: float
    refilled: float
    streams: int = 0
    inbound: int = 0  # bytes of large request bodies of this peer being read now
    strikes: deque = field(default_factory=deque)  # monotonic times of recent violations
    banned_until: float = 0.0


@dataclass
class _Waiter:
    """A `room_for` caller in line: woken (its future set) when it comes first and room may be there."""

    wake: asyncio.Future | None = None
    gone: bool = False


class Guard:
    """Admission control for inbound streams, and the counts of what was refused and why."""

    def __init__(self, limits: Limits | None = None, clock: "callable[[], float]" = time.monotonic,  # type: ignore[valid-type]
                 wall: "callable[[], float]" = time.time) -> None:  # type: ignore[valid-type]
        self.limits = limits or Limits()
        self._clock = clock
        self._wall = wall
        self._peers: OrderedDict[str, _PeerState] = OrderedDict()
        self._nonces: OrderedDict[bytes, float] = OrderedDict()  # nonce -> wall time it expires
        self.rejected: Counter[str] = Counter()  # "reason:handler" -> count
        self.inbound = 0  # bytes of large request bodies booked now, all peers together
        self._queue: deque[_Waiter] = deque()  # `room_for` callers waiting, in their order of arrival
        self.bans_total = 0
        self.streams = 0  # inbound streams admitted and not yet released, all peers together
        self.clock_offsets = ClockOffsets()  # fed by the transport with its verified small requests' stamps

    def _peer(self, peer: str) -> _PeerState:
        state = self._peers.get(peer)
        now = self._clock()
        if state is None:
            state = _PeerState(tokens=2 * self.limits.requests_per_s, refilled=now)
            self._peers[peer] = state
            if len(self._peers) > MAX_PEERS:  # forget the longest-idle peer (bans included: bounded memory)
                self._forget_one_idle(peer)
        self._peers.move_to_end(peer)
        return state

    def _forget_one_idle(self, newcomer: str) -> None:
        """Drop the least recently seen peer without an open stream, looking at no more than
        `IDLE_SCAN` of the oldest: peers with streams open go to the back (they are busy, not
        idle), so a table full of them costs each newcomer a bounded scan, not one over every
        peer. If none of those is idle the table grows by one; peers with open streams are bounded
        by the daemon's connections and `max_streams` each."""
        # A peer with a history (strikes, a ban) is forgotten only if none without one is idle:
        # else a banned peer fell quiet while throwaway identities made one request each, and its
        # ban was washed out of the table (a review). Of those, the one whose ban ends first goes.
        now, kept = self._clock(), []
        for _ in range(min(IDLE_SCAN, len(self._peers) - 1)):
            key, old = next(iter(self._peers.items()))
            if key == newcomer:
                break
            if old.streams == 0 and old.inbound == 0:
                if old.banned_until <= now and not old.strikes:
                    del self._peers[key]
                    return
                kept.append((old.banned_until > now, old.banned_until, len(old.strikes), key))
            self._peers.move_to_end(key)
        if kept:
            del self._peers[min(kept)[3]]

    def admit(self, peer: str, handler: str, stream: bool = True) -> str | None:
        """Take one request slot for `peer`; returns why not (and counts it), or None. `stream`:
        on a stream of its own (a unary call shares the daemon's control connection, so it holds
        no file descriptor of ours and is not counted against `max_streams_total`)."""
        state, now, lim = self._peer(peer), self._clock(), self.limits
        if state.banned_until > now:
            reason = "banned"
        elif state.streams >= lim.max_streams:
            reason = "too-many-streams"
        elif stream and self.streams >= lim.max_streams_total:
            reason = "busy"  # (no strike: it need not be this peer's doing)
        else:
            state.tokens = min(2 * lim.requests_per_s, state.tokens + (now - state.refilled) * lim.requests_per_s)
            state.refilled = now
            if state.tokens < 1:
                reason = "rate-limited"
            else:
                state.tokens -= 1
                state.streams += 1
                self.streams += stream
                return None
        self.rejected[f"{reason}:{handler}"] += 1
        if reason not in ("banned", "busy"):
            self.strike(peer)
        return reason

    def take_bytes(self, peer: str, size: int, largest: int) -> str | None:
        """Reserve room for `size` more bytes of request bodies from `peer` (to a handler taking
        up to `largest`), before they are read; returns why not (the caller counts it), or None.
        The budgets grow with the run's payloads: four of the largest in flight at once, and one
        for a single peer (an honest one sends us at most one contribution's worth at a time)."""
        state, lim = self._peer(peer), self.limits
        if state.inbound + size > max(lim.max_inbound_bytes_per_peer, largest):
            reason = "inbound-per-peer"  # (first: waiting for the node's room would not help)
        elif self.inbound + size > max(lim.max_inbound_bytes, 4 * largest):
            reason = "inbound-full"
        else:
            state.inbound += size
            self.inbound += size
            return None
        return reason

    async def room_for(self, peer: str, size: int, largest: int, wait_s: float) -> str | None:
        """`take_bytes`, waiting up to `wait_s` while the node's budget is full, first come first
        served (a small body does not overtake a large one); a peer over its own share is
        refused at once (an honest one never is). Each waiter is woken only when it is first in
        line: a release costs one wake-up, however many wait."""
        if self._over_share(peer, size, largest):
            return "inbound-per-peer"
        if self._head() is None and (why := self.take_bytes(peer, size, largest)) != "inbound-full":
            return why
        loop = asyncio.get_running_loop()
        deadline, me = loop.time() + wait_s, _Waiter()
        self._queue.append(me)
        try:
            while True:
                if self._over_share(peer, size, largest):
                    return "inbound-per-peer"
                if self._head() is me and (why := self.take_bytes(peer, size, largest)) != "inbound-full":
                    return why
                if (left := deadline - loop.time()) <= 0:
                    return "inbound-full"
                me.wake = loop.create_future()
                try:
                    async with asyncio.timeout(left):
                        await me.wake
                except TimeoutError:
                    pass
        finally:
            me.gone = True
            self._wake_head()  # the next in line may fit now

    def _over_share(self, peer: str, size: int, largest: int) -> bool:
        state = self._peers.get(peer)
        return state is not None and state.inbound + size > max(self.limits.max_inbound_bytes_per_peer, largest)

    def _head(self) -> _Waiter | None:
        while self._queue and self._queue[0].gone:  # (those gone leave lazily, when they come first)
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    def _wake_head(self) -> None:
        head = self._head()
        if head is not None and head.wake is not None and not head.wake.done():
            head.wake.set_result(None)

    def release_bytes(self, peer: str, size: int) -> None:
        """Bytes reserved by `take_bytes` have been read and handled (or will never be)."""
        if size <= 0:
            return
        self.inbound = max(0, self.inbound - size)
        state = self._peers.get(peer)
        if state is not None:
            state.inbound = max(0, state.inbound - size)
        self._wake_head()

    def release(self, peer: str, stream: bool = True) -> None:
        """A request admitted by `admit` (with the same `stream`) has ended."""
        state = self._peers.get(peer)
        if state is not None and state.streams > 0:
            state.streams -= 1
            self.streams -= stream

    def strike(self, peer: str) -> None:
        """Record one violation; enough of them within `ban_s` ban the peer for `ban_s`."""
        state, now = self._peer(peer), self._clock()
        state.strikes.append(now)
        while state.strikes and state.strikes[0] < now - max(self.limits.ban_s, 1.0):
            state.strikes.popleft()
        if len(state.strikes) >= self.limits.strikes and state.banned_until <= now:
            state.banned_until = now + self.limits.ban_s
            state.strikes.clear()
            self.bans_total += 1

    def reject(self, peer: str, handler: str, exc: ProtocolError) -> None:
        """Count a refused message; malformed or forged ones are also a strike against the sender."""
        self.count(peer, handler, exc.reason, exc.strike)

    def count(self, peer: str, handler: str, reason: str, strike: bool) -> None:
        """Count one refused message of `peer` under `reason` (and strike the peer if `strike`)."""
        self.rejected[f"{reason}:{handler}"] += 1
        if strike:
            self.strike(peer)

    def check_fresh(self, nonce: bytes, timestamp: float, opened: float | None = None) -> None:
        """Refuse a signed message stamped too far from our clock, or one seen before. `opened`:
        when its stream opened (a large upload may take longer than the skew to arrive)."""
        now, skew = self._wall(), self.limits.max_clock_skew_s
        earliest = (now if opened is None else min(now, opened)) - skew
        if not earliest <= timestamp <= now + skew:
            # no strike: whose clock is off cannot be told (ours, off, would have every honest peer banned)
            raise ProtocolError(f"message stamped {timestamp - now:+.0f} s from our clock (limit {skew:.0f} s)",
                                reason="stale-message", strike=False)
        if len(nonce) != 16:
            raise ProtocolError("a message nonce is 16 bytes", reason="malformed")
        while self._nonces:
            oldest, expires = next(iter(self._nonces.items()))
            if expires > now and len(self._nonces) < self.limits.max_nonces:
                break
            del self._nonces[oldest]
        if nonce in self._nonces:
            raise ProtocolError("replayed message (nonce seen before)", reason="replayed")
        # a nonce only needs remembering while its timestamp is still acceptable
        self._nonces[nonce] = max(now, timestamp) + skew

    def bans(self) -> dict[str, float]:
        """Peers banned now, with the seconds left."""
        now = self._clock()
        return {p: round(s.banned_until - now, 1) for p, s in self._peers.items() if s.banned_until > now}
