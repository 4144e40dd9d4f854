"""Where a round's shards go and what their aggregates are: the candidates a contribution's shard
is copied to, the digests a commit pins for a shard, and whether an aggregate is one mean or every
signed contribution. Shared by contributors, aggregators, leaders and fetchers."""

from __future__ import annotations

from typing import Any

from .schema import Decision

DENSE_MEAN_CODECS = ("fp32", "fp16", "bf16", "int8")  # the aggregate is the re-encoded mean
REPORTING_CANDIDATES = 4  # a shard and its replicas go to the first of its candidates that take them
MIN_ROOM = 64  # newcomers a shard of one attempt takes at least (see `newcomer_room`)
MAX_JOINS = 2048  # members one round may have (Decision lists hold at most 4096), with up to 16 shards


def max_members(max_shards: int) -> int:
    """Members one round may have: its commit pins a digest per contributor and shard, and must
    stay a control message (1 MiB): 2048 with up to 16 shards, fewer with more."""
    return MAX_JOINS * 16 // max(16, max_shards)


def newcomer_room(planned_trainers: int, max_shards: int) -> int:
    """Contributors one attempt takes besides its planned trainers: 4x their number (64 at least),
    and no more than a commit can still name (`max_members`). Aggregators hold that many per shard,
    and leaders wait for that many joiners: a joiner no aggregator would hold was waited for until
    the close (found by a review)."""
    return max(MIN_ROOM, min(4 * planned_trainers, max_members(max_shards) - planned_trainers))


def first_members(preferred: set[str], others: set[str], cap: int) -> list[str]:
    """At most `cap` peers, in id order: those of `preferred` first (as many as fit, lowest ids
    first), then `others`. A commit's lists must stay within `max_members`: the previous commit's
    trainers are expected without joining, so they and the round's joiners could be twice that."""
    chosen = sorted(preferred)[:cap]
    return sorted(chosen + sorted(others - preferred)[:cap - len(chosen)])


def decision_digests(decision: Decision, shard: int) -> list[bytes]:
    """The contribution digests a commit pins for one shard, in contributor order."""
    n = len(decision.contributors)
    return decision.digests[shard * n:(shard + 1) * n]


def replica_count(ctx: Any) -> int:
    """Copies of each shard a contributor makes besides the first: the run's `replicas` if it sets
    it, else two for sparse payloads (about 1/200 of fp32, so a third copy costs little and keeps a
    shard when two of its holders die in one round) and one for dense ones (each copy is the
    shard's full fp32/int8 size). With none, a source that dies before it seals costs a retry."""
    chosen = getattr(ctx, "replicas", None)
    if chosen is not None:
        return min(int(chosen), REPORTING_CANDIDATES - 1)
    return 1 if ctx.codec.name in DENSE_MEAN_CODECS else 2


def ships_contributions(ctx: Any) -> bool:
    """Does an aggregate carry every signed contribution (sparse codecs, or a run that verifies
    aggregates) rather than one mean computed by the aggregator?"""
    return ctx.codec.name not in DENSE_MEAN_CODECS or bool(getattr(ctx, "verify_aggregates", False))
