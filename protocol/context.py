"""What the round protocol needs to know about the run and the peer, as one small interface.

The peer program (groundswell.peer) implements `RoundContext`; the protocol never reaches into
the trainer or the optimizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from groundswell.compression import Codec, CodecError, Payload, RobustOptions, wire_bound

from .digests import bulk_hasher
from .envelope import unseal
from .schema import Decision, ProtocolError


@dataclass(frozen=True)
class Membership:
    """Who a round is planned from: trainers contribute, servers take roles."""

    trainers: tuple[str, ...]
    servers: tuple[str, ...]


class RoundContext(Protocol):
    """Run settings and the peer's view of the run, as the protocol needs them."""

    run_id: str
    min_peers: int
    deadline_s: float
    slack_s: float
    max_shards: int
    segment_numels: tuple[int, ...]  # element count of each segment of the flat parameter vector
    codec: Codec
    max_payload_bytes: int  # a whole contribution's budget on the wire (`contribution_bound`)
    robust: RobustOptions  # norm clipping / trimmed mean applied to every aggregate
    verify_aggregates: bool  # dense codecs too: aggregates carry the signed contributions, not a mean
    replicas: int | None  # copies of each shard beyond the first; None: the codec's default (replica_count)

    def authorized(self, peer_id: str) -> bool:
        """May this peer contribute to the run?"""
        ...

    def may_serve(self, peer_id: str) -> bool:
        """May this peer take roles in the run (aggregate shards, lead attempts)?"""
        ...


@dataclass
class DecisionBook:
    """Committed decisions the peer knows, by round; the plan of round r comes from round r-1's.

    The genesis decision (round -1) comes with the run's state. A waiter can block until a
    round's decision is known."""

    run_id: str
    committed: dict[int, tuple[bytes, Decision]] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    keep: int = 16
    # Told of every commit recorded, whoever recorded it: the server wakes everyone waiting on
    # any attempt of that round (a long poll for attempt 0 ends when attempt 1 commits).
    on_commit: Callable[[int], None] | None = None

    def add(self, signed: bytes) -> Decision:
        """Verify (signature, run) and record a committed decision; returns it."""
        decision = self._verified(signed)
        known = self.committed.get(decision.round)
        if known is not None and known[0] != signed and known[1] != decision:
            # Two different commits for one round: keep the first; the caller re-syncs if needed.
            raise ProtocolError(f"conflicting decision for round {decision.round}")
        self.committed[decision.round] = (signed, decision)
        for old in [r for r in self.committed if r < decision.round - self.keep]:
            del self.committed[old]
        self._changed.set()
        self._changed = asyncio.Event()
        if self.on_commit is not None:
            self.on_commit(decision.round)
        return decision

    def supersede(self, signed: bytes) -> Decision:
        """Record a commit in place of a conflicting one (and drop every later commit, of the
        trajectory left): only for a state the coordinator vouches for, taken after this peer
        found its parameters differ from the run's (a split left it on the other side)."""
        decision = self._verified(signed)  # (before anything is dropped)
        for r in [r for r in self.committed if r >= decision.round]:
            del self.committed[r]
        return self.add(signed)

    def _verified(self, signed: bytes) -> Decision:
        """The commit `signed` holds, checked (signature, run, status, signed by its leader)."""
        leader, decision = unseal(signed, self.run_id, Decision)
        if decision.status != "commit":
            raise ProtocolError("only committed decisions are recorded")
        if leader != decision.leader:
            raise ProtocolError("decision is not signed by its leader")
        return decision

    def membership(self, round_id: int) -> Membership | None:
        """Membership round `round_id` is planned from, if its previous decision is known."""
        entry = self.committed.get(round_id - 1)
        if entry is None:
            return None
        return Membership(tuple(entry[1].trainers), tuple(entry[1].servers))

    def opened_at(self, round_id: int) -> float | None:
        """When round `round_id` opened (the time of the previous round's commit), if known."""
        entry = self.committed.get(round_id - 1)
        return None if entry is None else entry[1].time

    def decided(self, round_id: int) -> bool:
        """Whether round `round_id` is committed, as far as this book knows; also true of rounds
        older than its newest commit whose decisions it has since let go (rounds commit in order)."""
        return round_id in self.committed or round_id <= self.latest()

    def latest(self) -> int:
        """The newest committed round (-1: only genesis; -2: nothing)."""
        return max(self.committed, default=-2)

    async def wait_membership(self, round_id: int, timeout_s: float) -> Membership | None:
        """Wait up to `timeout_s` for the membership of `round_id`."""
        try:
            async with asyncio.timeout(timeout_s):
                while (m := self.membership(round_id)) is None:
                    await self._changed.wait()
                return m
        except TimeoutError:
            return None


def contribution_digest(first_segment: int, segments: list[bytes]) -> bytes:
    """16-byte digest of one contributor's shard: its first segment and every payload's bytes."""
    h = bulk_hasher()  # a 25 MB shard is hashed on receipt
    h.update(first_segment.to_bytes(8, "big", signed=True))
    for seg in segments:
        h.update(len(seg).to_bytes(8, "big"))
        h.update(seg)
    return h.digest()[:16]


def contribution_bound(codec: Codec, segment_numels: Sequence[int]) -> int:
    """The most bytes a whole contribution's payloads can take (`max_payload_bytes`): each
    segment's encoding, plus room for the message around each and around them all."""
    bounds = {n: wire_bound(codec, n) for n in set(segment_numels)}
    return sum(bounds[n] for n in segment_numels) + 64 * len(segment_numels) + 4096


def shard_payload_bound(ctx: RoundContext, first: int, stop: int) -> int:
    """The most bytes one contribution's (or one mean's) payloads of segments [first, stop) can
    take: their share of `max_payload_bytes`, plus each segment's envelope."""
    share, total = sum(ctx.segment_numels[first:stop]), max(1, sum(ctx.segment_numels))
    return -(-ctx.max_payload_bytes * share // total) + 64 * (stop - first) + 4096


def validate_segments(ctx: RoundContext, first: int, segments: list[bytes]) -> list[Payload]:
    """Strictly parse a run of segment payloads against the run's codec and segment shapes."""
    if first + len(segments) > len(ctx.segment_numels) or not segments:
        raise ProtocolError(f"segments {first}..{first + len(segments)} out of range", reason="bad-payload")
    out = []
    for i, data in enumerate(segments):
        numel = ctx.segment_numels[first + i]
        try:
            payload = Payload.from_bytes(data, max_bytes=ctx.max_payload_bytes, max_numel=numel, expect=ctx.codec)
        except CodecError as exc:
            reason = "non-finite" if "non-finite" in str(exc) or "finite" in str(exc) else "bad-payload"
            raise ProtocolError(f"segment {first + i}: {exc}", reason=reason) from None
        if payload.shape != (numel,):
            raise ProtocolError(f"segment {first + i} has shape {payload.shape}, expected ({numel},)",
                                reason="bad-payload")
        out.append(payload)
    return out
