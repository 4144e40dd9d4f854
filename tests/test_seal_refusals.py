"""Which seal refusals make a leader stand back (`CONTESTED`) rather than replace the source."""

from __future__ import annotations

import asyncio
import time
import types

from groundswell.protocol.aggregator import ALREADY_COMMITTED, CONTESTED
from groundswell.protocol.decision import Decider
from groundswell.protocol.envelope import seal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Ack, Decision


def _leader_whose_aggregators_answer(reason: str) -> tuple[Decider, bytes]:
    class Leader(Decider):
        def __init__(self) -> None:
            self.identity = Identity.generate()
            self.ctx = types.SimpleNamespace(run_id="r", codec=types.SimpleNamespace(name="fp32"), segment_numels=(250,),
                                             slack_s=1.0)

            async def request(peer, kind, msg, reply, timeout_s):
                return Ack(False, reason)

            self.transport = types.SimpleNamespace(request=request)

    leader = Leader()
    me = leader.identity.peer_id
    decision = Decision(3, 1, "commit", ["c1", "c2"], ["c1", "c2"], ["a1", me], me, ["a1"], 1, time.time(),
                        [b"d" * 16, b"e" * 16])
    return leader, seal(leader.identity, "r", decision)


def test_a_seal_refused_because_the_round_is_committed_makes_the_leader_stand_back():
    # Found by a review: two leaders of one attempt can both pass their claims (the first froze
    # across the close; the second's claim to it went unanswered, then it froze itself); the late
    # one's seals were refused with "round 3 is already committed", which it took for sources
    # failing: with every source refusing, it signed and announced a retry of a committed attempt.
    assert ALREADY_COMMITTED in CONTESTED
    leader, signed = _leader_whose_aggregators_answer(ALREADY_COMMITTED)
    unsealed, contested = asyncio.run(leader._seal_all(signed, ["a1"], [["a1"]]))
    assert unsealed == {"a1"} and contested


def test_a_source_that_simply_fails_is_replaced_not_stood_back_from():
    leader, signed = _leader_whose_aggregators_answer("no contributions of this attempt held here")
    unsealed, contested = asyncio.run(leader._seal_all(signed, ["a1"], [["a1"]]))
    assert unsealed == {"a1"} and not contested
