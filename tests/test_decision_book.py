"""DecisionBook: which signed decisions it accepts, conflicts it flags, and the membership it derives."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from groundswell.protocol.context import DecisionBook, Membership
from groundswell.protocol.envelope import seal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision, ProtocolError

sys.path.insert(0, str(Path(__file__).parent))
from schema_cases import EXAMPLES, OTHER, PEERS, RUN

# --- DecisionBook --------------------------------------------------------------------------------
LEADER = Identity.generate()


def _decision(round_id: int, leader: str = LEADER.peer_id, status: str = "commit", **changes) -> Decision:
    base = dict(round=round_id, attempt=0, status=status, contributors=PEERS[:2], trainers=PEERS[:3],
                servers=[leader, PEERS[0]], leader=leader, sources=[leader], num_shards=1)
    base.update(changes)
    return Decision(**base)


def test_decision_book_accepts_leader_signed_commit():
    book = DecisionBook(RUN)
    decision = _decision(4)
    signed = seal(LEADER, RUN, decision)
    assert book.add(signed) == decision
    assert book.committed[4] == (signed, decision)
    assert book.latest() == 4
    assert book.add(signed) == decision  # the same decision again is harmless
    assert len(book.committed) == 1


def test_decision_book_rejects_retry():
    book = DecisionBook(RUN)
    with pytest.raises(ProtocolError, match="commit"):
        book.add(seal(LEADER, RUN, _decision(4, status="retry")))
    assert book.committed == {} and book.latest() == -2


def test_decision_book_rejects_decision_not_signed_by_its_leader():
    book = DecisionBook(RUN)
    with pytest.raises(ProtocolError, match="leader"):  # LEADER signs a decision naming OTHER as leader
        book.add(seal(LEADER, RUN, _decision(4, leader=OTHER.peer_id)))
    with pytest.raises(ProtocolError, match="leader"):  # OTHER signs a decision naming LEADER as leader
        book.add(seal(OTHER, RUN, _decision(4)))
    assert book.committed == {}


def test_decision_book_rejects_another_run_and_garbage():
    book = DecisionBook(RUN)
    with pytest.raises(ProtocolError):
        book.add(seal(LEADER, "run-other", _decision(4)))
    with pytest.raises(ProtocolError):
        book.add(seal(LEADER, RUN, EXAMPLES["ack"]))
    with pytest.raises(ProtocolError):
        book.add(b"\x00garbage")
    assert book.committed == {}


def test_a_superseding_commit_replaces_the_conflicting_one_and_the_trajectory_after_it():
    # Found by a review: after a split a peer's book held the other side's commit of round 4, and
    # the run's state of round 5 (carrying the run's commit of round 4) could never go in: the
    # peer kept re-syncing and failing. A state the coordinator vouches for now supersedes it.
    book = DecisionBook(RUN)
    book.add(seal(LEADER, RUN, _decision(3)))
    book.add(seal(LEADER, RUN, _decision(4, contributors=PEERS[:1])))
    book.add(seal(LEADER, RUN, _decision(5)))  # of the trajectory left
    run_s = seal(OTHER, RUN, _decision(4, leader=OTHER.peer_id))
    with pytest.raises(ProtocolError, match="conflicting"):
        book.add(run_s)
    assert book.supersede(run_s) == _decision(4, leader=OTHER.peer_id)
    assert sorted(book.committed) == [3, 4] and book.committed[4][0] == run_s and book.latest() == 4
    with pytest.raises(ProtocolError):
        book.supersede(seal(LEADER, RUN, _decision(4, status="retry")))  # checked as `add` checks
    assert book.committed[4][0] == run_s


def test_decision_book_flags_conflicting_commit():
    book = DecisionBook(RUN)
    first = seal(LEADER, RUN, _decision(4))
    book.add(first)
    with pytest.raises(ProtocolError, match="conflicting"):
        book.add(seal(LEADER, RUN, _decision(4, contributors=PEERS[:1])))
    with pytest.raises(ProtocolError, match="conflicting"):  # another leader's commit for the same round
        book.add(seal(OTHER, RUN, _decision(4, leader=OTHER.peer_id)))
    assert book.committed[4][0] == first  # the first one is kept
    # the same decision re-signed (fresh nonce) is not a conflict
    assert book.add(seal(LEADER, RUN, _decision(4))) == _decision(4)
    book.add(seal(LEADER, RUN, _decision(5)))  # the next round is independent
    assert book.latest() == 5


def test_decision_book_membership_comes_from_previous_round():
    book = DecisionBook(RUN)
    assert book.membership(0) is None
    book.add(seal(LEADER, RUN, _decision(-1, trainers=PEERS[:1], servers=[LEADER.peer_id])))  # genesis
    assert book.membership(0) == Membership((PEERS[0],), (LEADER.peer_id,))
    assert book.membership(-1) is None and book.membership(1) is None
    book.add(seal(LEADER, RUN, _decision(0, trainers=PEERS[1:3], servers=[LEADER.peer_id, PEERS[3]])))
    assert book.membership(1) == Membership((PEERS[1], PEERS[2]), (LEADER.peer_id, PEERS[3]))
    assert book.membership(0) == Membership((PEERS[0],), (LEADER.peer_id,))


def test_decision_book_keeps_recent_rounds():
    book = DecisionBook(RUN, keep=2)
    for r in range(6):
        book.add(seal(LEADER, RUN, _decision(r)))
    assert sorted(book.committed) == [3, 4, 5]


def test_wait_membership_times_out_with_none():
    async def main():
        book = DecisionBook(RUN)
        book.add(seal(LEADER, RUN, _decision(2)))
        t0 = time.monotonic()
        got = await book.wait_membership(5, timeout_s=0.2)
        return got, time.monotonic() - t0

    got, elapsed = asyncio.run(main())
    assert got is None
    assert 0.15 <= elapsed < 2.0


def test_wait_membership_wakes_on_add():
    async def main():
        book = DecisionBook(RUN)
        book.add(seal(LEADER, RUN, _decision(2)))
        assert await book.wait_membership(3, timeout_s=0.01) is not None  # already known: immediate

        async def later():
            await asyncio.sleep(0.05)
            book.add(seal(LEADER, RUN, _decision(3)))  # an unrelated round first: the waiter keeps waiting
            await asyncio.sleep(0.05)
            book.add(seal(LEADER, RUN, _decision(4, trainers=PEERS[3:])))

        task = asyncio.create_task(later())
        t0 = time.monotonic()
        got = await book.wait_membership(5, timeout_s=5.0)
        await task
        return got, time.monotonic() - t0

    got, elapsed = asyncio.run(main())
    assert got == Membership((PEERS[3],), (LEADER.peer_id, PEERS[0]))
    assert elapsed < 2.0
