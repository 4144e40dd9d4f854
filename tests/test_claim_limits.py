"""Two small rules of the claim path, without a network: how old a commit a claim adopts, and when
a replica may build its copy of a shard over one it already holds."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.protocol.aggregator import Aggregator
from groundswell.protocol.claims import EARLIER_ATTEMPTS_CLAIMED, Claims
from groundswell.protocol.envelope import seal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision

RUN = "claim-limits"


@pytest.fixture(scope="module")
def leader() -> Identity:
    return Identity.generate()


def _commit(leader: Identity, attempt: int, round_id: int = 7) -> bytes:
    return seal(leader, RUN, Decision(round_id, attempt, "commit", [leader.peer_id], [leader.peer_id],
                                      [leader.peer_id], leader.peer_id, [leader.peer_id], 1, time.time()))


class _Claimer(Claims):
    """Just what `_adopt` touches: gathering always works, and the book takes what it is given."""

    def __init__(self) -> None:
        self.ctx = SimpleNamespace(run_id=RUN, slack_s=1.0)
        self.unobtainable, self.whole_tries = {}, {}
        self.gathered: list[bytes] = []
        self.added: list[bytes] = []
        self.book = SimpleNamespace(add=self.added.append)
        self.attempts = {}

    async def verify_commit(self, signed: bytes) -> None:
        return None

    async def _hold_all(self, signed: bytes, window: float | None) -> bool:
        self.gathered.append(signed)
        return True


@pytest.mark.parametrize("age, adopted", [(1, True), (EARLIER_ATTEMPTS_CLAIMED, True),
                                          (EARLIER_ATTEMPTS_CLAIMED + 1, False)])
def test_a_claim_adopts_no_commit_older_than_the_attempts_contributors_keep_open(leader, age, adopted):
    # A contributor keeps a retried contribution open (to settle it by digest) for the attempts a
    # claim fences off, no further back: adopting an older commit would count its work twice.
    attempt = EARLIER_ATTEMPTS_CLAIMED + 2
    plan = SimpleNamespace(round=7, attempt=attempt)
    claimer = _Claimer()
    claimer.attempts[(7, attempt)] = SimpleNamespace(poke=lambda: None, decision=None)
    old = _commit(leader, attempt - age)
    stood_back = asyncio.run(claimer._adopt(plan, old, final=True, fenced=True))
    assert stood_back is adopted
    assert claimer.added == ([old] if adopted else [])
    assert claimer.gathered == ([old] if adopted else []), "an over-age commit was gathered anyway"


class _Replica(Aggregator):
    """Just what `_may_replace` touches."""

    def __init__(self, committed: dict, held: dict) -> None:
        self.ctx = SimpleNamespace(run_id=RUN)
        self.book = SimpleNamespace(committed=committed)
        self.aggregates = held


def _held(signed: bytes) -> SimpleNamespace:
    return SimpleNamespace(decision=signed)


def test_a_replica_replaces_only_an_earlier_seals_copy_of_a_round_not_committed_otherwise(leader):
    first, reseal, later = _commit(leader, 1), _commit(leader, 1), _commit(leader, 2)
    assert first != reseal  # a re-seal of the same attempt (a replaced source) is another commit
    decision = Decision(7, 1, "commit", [], [], [], leader.peer_id, [], 1, 0.0)

    def may(held: dict, committed: dict | None = None, signed: bytes = reseal) -> bool:
        return _Replica(committed or {}, held)._may_replace(decision, signed, 0)

    assert may({})  # nothing held yet
    assert may({(7, 0): _held(first)})  # the re-seal replaces the first seal's copy
    assert may({(7, 0): _held(_commit(leader, 0))})  # a kept copy of an earlier attempt gives way
    assert not may({(7, 0): _held(reseal)}), "rebuilt a copy already held"
    assert not may({(7, 0): _held(later)}), "an earlier attempt's seal replaced a later attempt's copy"
    assert not may({}, committed={7: (later, None)}), "built a copy for a round committed otherwise"
    assert may({(7, 0): _held(first)}, committed={7: (reseal, None)})


def test_a_late_hedged_parse_of_a_shard_does_not_replace_the_one_cached_first(leader):
    # Two holders' copies of one shard of a commit may both be fetched (a hedge) and parsed in
    # threads; the copy parsed first is the one the fetch uses, and it must stay the cached one.
    import threading

    from groundswell.protocol.fetch import AggregateFetcher

    class _Fetcher(AggregateFetcher):
        def __init__(self) -> None:
            self._rows, self._rows_lock, self.parsed = {}, threading.Lock(), []

        def _contributions(self, decision, shard, first, stop, agg):
            self.parsed.append(agg)
            return [[agg]]

    signed = _commit(leader, 0)
    decision = Decision(7, 0, "commit", [], [], [], leader.peer_id, [], 1, 0.0)
    fetcher, first_copy, second_copy = _Fetcher(), object(), object()
    assert fetcher._checked_rows(decision, signed, 0, 0, 1, first_copy) == [[first_copy]]
    assert fetcher._checked_rows(decision, signed, 0, 0, 1, second_copy) == [[second_copy]]
    assert fetcher._checked_rows(decision, signed, 0, 0, 1, first_copy) == [[first_copy]]
    assert fetcher.parsed == [first_copy, second_copy], "the first copy's parse was pushed out of the cache"
    # another round's commit moves in, and rounds two behind are let go
    later = Decision(9, 0, "commit", [], [], [], leader.peer_id, [], 1, 0.0)
    fetcher._checked_rows(later, _commit(leader, 0, round_id=9), 0, 0, 1, object())
    assert set(fetcher._rows) == {(9, 0)}
