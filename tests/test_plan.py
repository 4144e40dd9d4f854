"""Round plans: a pure, order-independent function of (run, round, attempt, membership, model size)."""

from __future__ import annotations

import itertools
import os
import random

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from groundswell.protocol.plan import RoundPlan, make_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RUN = "run-plan"
SERVERS = [f"12D3KooWserver{i:03d}" for i in range(40)]
TRAINERS = [f"12D3KooWtrainer{i:03d}" for i in range(12)]
PROPS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _plan(servers=SERVERS[:8], trainers=TRAINERS, round_id=5, attempt=0, num_segments=20, max_shards=16,
          run_id=RUN) -> RoundPlan:
    return make_plan(run_id, round_id, attempt, servers, trainers, num_segments, max_shards)


def _check_invariants(plan: RoundPlan, servers, trainers, num_segments: int, max_shards: int) -> None:
    distinct = set(servers)
    assert plan.num_shards == min(len(distinct), max_shards, num_segments)
    assert len(plan.shard_segments) == plan.num_shards == len(plan.aggregators)
    # shards are contiguous, cover every segment exactly once, and differ in size by at most one
    assert plan.shard_segments[0][0] == 0 and plan.shard_segments[-1][1] == num_segments
    for (_, stop), (start, _) in zip(plan.shard_segments, plan.shard_segments[1:]):
        assert stop == start
    sizes = [stop - start for start, stop in plan.shard_segments]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sum(sizes) == num_segments
    covered = [i for start, stop in plan.shard_segments for i in range(start, stop)]
    assert covered == list(range(num_segments))
    # roles
    assert sorted(plan.order) == sorted(distinct)
    assert len(set(plan.aggregators)) == len(plan.aggregators)  # one shard per aggregator
    assert set(plan.aggregators) <= distinct
    assert plan.aggregators == plan.order[: plan.num_shards]
    assert plan.leader == plan.order[0] and plan.leader in distinct
    assert plan.backup_leader in distinct
    assert (plan.backup_leader != plan.leader) == (len(distinct) > 1)
    assert plan.trainers == tuple(sorted(set(trainers)))
    for s in range(plan.num_shards):
        cands = plan.candidates(s)
        assert cands[0] == plan.aggregators[s]
        assert len(cands) == len(set(cands)) == len(distinct) and set(cands) == distinct
        assert s in plan.shards_of(plan.aggregators[s])
    assert sum(len(plan.shards_of(p)) for p in distinct) == plan.num_shards


def test_deterministic():
    a, b = _plan(), _plan()
    assert a == b
    assert a.num_shards == 8 and a.shard_segments[0] == (0, 3) and a.shard_segments[-1] == (18, 20)


def test_independent_of_server_and_trainer_order():
    base = _plan()
    rng = random.Random(0)
    for _ in range(20):
        servers, trainers = SERVERS[:8], list(TRAINERS)
        rng.shuffle(servers)
        rng.shuffle(trainers)
        assert _plan(servers=servers, trainers=trainers) == base
        assert _plan(servers=tuple(servers), trainers=tuple(trainers)) == base
    assert _plan(servers=SERVERS[:8] + SERVERS[:3]) == base  # duplicates do not count twice


@PROPS
@given(
    servers=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=40),
    trainers=st.lists(st.sampled_from(TRAINERS + SERVERS[:5]), max_size=12),
    round_id=st.integers(-1, 1 << 40),
    attempt=st.integers(0, 1 << 20),
    num_segments=st.integers(1, 300),
    max_shards=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
)
def test_invariants_and_order_independence(servers, trainers, round_id, attempt, num_segments, max_shards, seed):
    plan = make_plan(RUN, round_id, attempt, servers, trainers, num_segments, max_shards)
    _check_invariants(plan, servers, trainers, num_segments, max_shards)
    shuffled = list(servers)
    random.Random(seed).shuffle(shuffled)
    assert make_plan(RUN, round_id, attempt, shuffled, trainers[::-1], num_segments, max_shards) == plan


@pytest.mark.parametrize("n_servers,max_shards,num_segments,expected", [
    (1, 16, 100, 1), (8, 16, 100, 8), (8, 4, 100, 4), (8, 16, 3, 3), (40, 40, 40, 40), (3, 1, 1, 1),
])
def test_num_shards(n_servers, max_shards, num_segments, expected):
    plan = _plan(servers=SERVERS[:n_servers], num_segments=num_segments, max_shards=max_shards)
    assert plan.num_shards == expected
    _check_invariants(plan, SERVERS[:n_servers], TRAINERS, num_segments, max_shards)


def test_uneven_split_puts_the_extra_segments_first():
    plan = _plan(servers=SERVERS[:4], num_segments=10, max_shards=4)
    assert plan.shard_segments == ((0, 3), (3, 6), (6, 8), (8, 10))


def test_new_attempt_reshuffles_roles():
    servers = SERVERS[:10]
    plans = [_plan(servers=servers, attempt=a) for a in range(12)]
    for prev, nxt in itertools.pairwise(plans):
        assert prev.order != nxt.order  # 1 in 10! chance of a spurious failure
    leaders = {p.leader for p in plans}
    assert len(leaders) >= 3  # 12 attempts over 10 servers: the lead moves around
    assert plans[0].leader != plans[1].leader or plans[1].leader != plans[2].leader
    # every attempt is itself reproducible
    assert [_plan(servers=servers[::-1], attempt=a) for a in range(12)] == plans


def test_round_and_run_change_the_order():
    servers = SERVERS[:10]
    base = _plan(servers=servers)
    assert _plan(servers=servers, round_id=6).order != base.order
    assert _plan(servers=servers, run_id="another-run").order != base.order
    assert {_plan(servers=servers, round_id=r).leader for r in range(12)} != {base.leader}


def test_leader_spread_is_fair():
    """Over many rounds every server leads sometimes; no server is structurally favoured."""
    servers = SERVERS[:5]
    counts = {s: 0 for s in servers}
    for r in range(500):
        counts[_plan(servers=servers, round_id=r).leader] += 1
    assert min(counts.values()) > 50  # expected 100 each


def test_candidates():
    plan = _plan(servers=SERVERS[:6], num_segments=4, max_shards=4)
    assert plan.num_shards == 4
    for s in range(plan.num_shards):
        cands = plan.candidates(s)
        assert cands[0] == plan.aggregators[s]
        assert sorted(cands) == sorted(SERVERS[:6])
        assert cands == list(plan.order[s:] + plan.order[:s])  # rank order after the primary, wrapping
    single = _plan(servers=SERVERS[:1])
    assert single.candidates(0) == [SERVERS[0]] and single.backup_leader == single.leader == SERVERS[0]


def test_no_servers_is_an_error():
    with pytest.raises(ValueError):
        _plan(servers=[])
    with pytest.raises(ValueError):
        _plan(servers=())
    with pytest.raises(ValueError):
        _plan(num_segments=0)
    with pytest.raises(ValueError):
        _plan(max_shards=0)
    with pytest.raises(ValueError):
        _plan(num_segments=-3)


def test_servers_need_not_train():
    plan = _plan(servers=SERVERS[:3], trainers=[])
    assert plan.trainers == () and plan.num_shards == 3


def test_attempt_slots_follow_the_clock_from_the_previous_commit():
    from groundswell.protocol.plan import attempt_for, close_time, slot_width

    opened, deadline, slack = 1000.0, 30.0, 5.0
    # Attempt 0 closes a slack before the deadline, so that a stand-in, which waits a slack for a
    # silent leader, still decides by the deadline; contributions are due a slack before the close.
    assert close_time(opened, 0, deadline, slack) == opened + deadline - slack
    assert attempt_for(opened, opened, deadline, slack) == 0
    assert attempt_for(opened + deadline - 2 * slack - 0.1, opened, deadline, slack) == 0
    # too close to attempt 0's close to be counted in it: the next slot
    assert attempt_for(opened + deadline - 2 * slack + 0.1, opened, deadline, slack) == 1
    for a in range(5):
        t = close_time(opened, a, deadline, slack)
        assert attempt_for(t - slack - 0.01, opened, deadline, slack) == a
        assert close_time(opened, a + 1, deadline, slack) - t == slot_width(deadline, slack)
    assert attempt_for(opened - 100, opened, deadline, slack) == 0  # a clock behind the leader's
