"""Who does what in a round: a pure function of (round, attempt, membership, model size).

Every peer that applied the same previous decision computes the same plan, with no messages:
the shards (contiguous runs of the codec-aligned segments), the aggregator of each shard and
the leader. Roles go to `servers` (peers that accept inbound connections); a fresh attempt
reshuffles them, so a retry after a failure puts different peers in charge.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundPlan:
    """Roles for one attempt of one round."""

    round: int
    attempt: int
    leader: str
    leaders: tuple[str, ...]  # leader k takes over if leaders 0..k-1 are silent past the close + k * slack
    order: tuple[str, ...]  # all servers in this attempt's rank order
    aggregators: tuple[str, ...]  # aggregator of shard s
    shard_segments: tuple[tuple[int, int], ...]  # [first, stop) segment indices of shard s
    trainers: tuple[str, ...]  # peers expected to contribute

    @property
    def num_shards(self) -> int:
        """Number of shards in this attempt."""
        return len(self.aggregators)

    @property
    def backup_leader(self) -> str:
        """The first stand-in leader."""
        return self.leaders[1] if len(self.leaders) > 1 else self.leaders[0]

    def candidates(self, shard: int) -> list[str]:
        """Aggregators to try for a shard, primary first, then the other servers in rank order."""
        primary = self.aggregators[shard]
        return [primary] + [p for p in self.order[shard + 1:] + self.order[:shard] if p != primary]

    def shards_of(self, peer_id: str) -> list[int]:
        """The shards this peer aggregates."""
        return [s for s, a in enumerate(self.aggregators) if a == peer_id]


def slot_width(deadline_s: float, slack_s: float) -> float:
    """Seconds between the openings of two attempts of a round: deadline, decision, takeover."""
    return deadline_s + 3 * slack_s


def close_offset(deadline_s: float, slack_s: float) -> float:
    """Seconds from an attempt's opening to its close, when its leader decides at the latest.

    One slack before the deadline: a leader that fails at the close is replaced by its first
    stand-in a slack later, so even then the round is decided at its deadline, not after it."""
    return deadline_s - slack_s


def attempt_for(now: float, opened_at: float, deadline_s: float, slack_s: float) -> int:
    """The attempt a contribution made at `now` belongs to: the first whose close is still at
    least one slack away. Every peer derives it from the previous commit's time, so peers that
    restart, stall or join mid-round agree on it without talking."""
    width = slot_width(deadline_s, slack_s)
    return max(0, math.ceil((now + slack_s - opened_at - close_offset(deadline_s, slack_s)) / width))


def close_time(opened_at: float, attempt: int, deadline_s: float, slack_s: float) -> float:
    """Wall-clock time at which the leader of `attempt` decides at the latest (its close)."""
    return opened_at + attempt * slot_width(deadline_s, slack_s) + close_offset(deadline_s, slack_s)


def _rank(run_id: str, round_id: int, attempt: int, peer: str) -> bytes:
    return hashlib.blake2b(f"{run_id}/{round_id}/{attempt}/{peer}".encode(), digest_size=16).digest()


def shard_bounds(num_segments: int, num_shards: int) -> tuple[tuple[int, int], ...]:
    """[first, stop) segment indices of each of `num_shards` shards: contiguous, sizes differing by
    at most one. A commit's `num_shards` alone fixes them, so a contributor can check a commit
    against what it sent without the round's plan."""
    if not 0 < num_shards <= num_segments:
        raise ValueError(f"{num_shards} shards of {num_segments} segments")
    base, extra = divmod(num_segments, num_shards)
    bounds, start = [], 0
    for s in range(num_shards):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def make_plan(
    run_id: str,
    round_id: int,
    attempt: int,
    servers: Sequence[str],
    trainers: Sequence[str],
    num_segments: int,
    max_shards: int,
) -> RoundPlan:
    """The plan of round/attempt; raises ValueError when no peer can serve."""
    if not servers:
        raise ValueError("no peer can serve this round")
    if num_segments <= 0 or max_shards <= 0:
        raise ValueError("num_segments and max_shards must be positive")
    order = sorted(set(servers), key=lambda p: _rank(run_id, round_id, attempt, p))
    num_shards = min(len(order), max_shards, num_segments)
    return RoundPlan(
        round=round_id,
        attempt=attempt,
        leader=order[0],
        leaders=tuple(order[:3]),
        order=tuple(order),
        aggregators=tuple(order[:num_shards]),
        shard_segments=shard_bounds(num_segments, num_shards),
        trainers=tuple(sorted(set(trainers))),
    )
