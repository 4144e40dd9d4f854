"""A leader whose round the swarm decided long ago stands back instead of deciding it.

Seen in a live run with 0.6 s rounds and a 30 s deadline: a stand-in leader waits until its
attempt's close, ~45 rounds later; by then its decision book has let go of the round's plan, and
the leader went on to decide it anyway (and failed with an AttributeError)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from groundswell.protocol.context import DecisionBook
from groundswell.protocol.envelope import seal
from groundswell.protocol.schema import Decision

sys.path.insert(0, str(Path(__file__).parent))
from inproc_harness import RUN, make_target

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def target():
    yield from make_target()


def _commit(target, round_id: int) -> bytes:
    me = target.me.peer_id
    servers = [me, *(p.peer_id for p in target.peers[:3])]
    return seal(target.me, RUN, Decision(round_id, 0, "commit", servers[:2], servers, servers, me, [me], 1,
                                         time.time(), [b"\x00" * 32] * 2))


def test_the_book_counts_rounds_it_let_go_of_as_decided():
    book = DecisionBook(RUN)
    assert not book.decided(0)
    # (signatures are checked by add(); these tests only need its pruning)
    book.committed.update({r: (b"", None) for r in range(3, 6)})  # type: ignore[misc]
    assert book.decided(0) and book.decided(5) and not book.decided(6)


def test_a_stand_in_leader_stands_back_from_a_round_decided_long_ago(target, caplog):
    server, book = target.server, target.server.book
    plan = target.loop.run_until_complete(server.plan(0, 0, 0.1))
    assert plan is not None
    server._check_open(0, 0)
    slot = server.attempts[(0, 0)]
    for r in range(book.keep + 3):  # the swarm goes on; the book lets go of round 0's plan
        book.add(_commit(target, r))
    assert book.membership(0) is None and book.decided(0)
    before = dict(book.committed)
    caplog.set_level("INFO", logger="groundswell.protocol")
    target.loop.run_until_complete(server._decide(plan, slot))  # used to raise AttributeError
    assert slot.decision is None and book.committed == before
    assert any("decided meanwhile; standing back" in r.getMessage() for r in caplog.records)
    assert not target.loop.run_until_complete(server._claim_at(plan, slot, time.monotonic(), _event(target)))


def _event(target):
    import asyncio

    async def make() -> asyncio.Event:
        return asyncio.Event()

    return target.loop.run_until_complete(make())


def test_contributions_of_attempts_retried_long_ago_are_freed_unless_we_sealed_one(target):
    # A round retried for a long time held every attempt's contributions until it committed.
    from groundswell.protocol.aggregator import KEEP_ATTEMPTS

    server = target.server

    def hold(round_id: int, attempt: int) -> None:
        slot = server.attempts[(round_id, attempt)]
        slot.contributions[0]["x"] = (0, [b"p" * 10], b"signed", b"d" * 16)
        slot.parsed[(0, "x")] = []
        slot.sq_norms[(0, "x")] = 1.0

    newest = KEEP_ATTEMPTS + 2
    for a in range(newest + 1):
        hold(0, a)
    hold(1, 0)
    server.attempts[(0, 1)].sealed = b"a commit we sealed"  # its aggregate may still be asked for
    server._free_old_attempts(0, newest)
    kept = [a for a in range(newest + 1) if server.attempts[(0, a)].contributions]
    assert kept == [1, *range(newest - KEEP_ATTEMPTS, newest + 1)]
    assert not server.attempts[(0, 0)].parsed and not server.attempts[(0, 0)].sq_norms
    assert server.attempts[(1, 0)].contributions  # another round's are not touched
