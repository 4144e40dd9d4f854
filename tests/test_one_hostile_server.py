"""What one hostile server says is its word alone: a refusal must not stop an honest contributor
from giving its work to the honest holders of a shard, and a commit it signs as an attempt's
leader must not hand it the next round's roles."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.protocol.client import RoundClient
from groundswell.protocol.plan import make_plan
from groundswell.protocol.schema import Ack
from groundswell.protocol.shard_send import PARALLEL_COPIES_BYTES

pytestmark = pytest.mark.timeout(60)
SERVERS = [f"server-{i}" for i in range(6)]


class _Transport:
    """Honest candidates take the shard; the hostile one says the attempt is closed."""

    def __init__(self, hostile: str) -> None:
        self.hostile, self.took, self.asked = hostile, [], []

    async def request(self, peer, handler, msg, expect, timeout_s, **kwargs):
        if handler == "get-decision":  # a ping before a big shard: everyone answers
            return SimpleNamespace(decision=b"")
        self.asked.append(peer)
        if peer == self.hostile:
            return Ack(False, f"round {msg.round} is closed")
        await asyncio.sleep(0.01)
        self.took.append(peer)
        return Ack(True, "")


def _client(codec: str, opened_at: float) -> tuple[RoundClient, object, _Transport]:
    plan = make_plan("run", 5, 0, SERVERS, ["me"], 4, 1)
    transport = _Transport(hostile=plan.candidates(0)[0])  # the shard's first candidate
    client = object.__new__(RoundClient)
    client.me, client.transport = "me", transport
    client.ctx = SimpleNamespace(slack_s=2.0, deadline_s=30.0, replicas=None, codec=SimpleNamespace(name=codec))
    client.book = SimpleNamespace(committed={}, latest=lambda: 4, opened_at=lambda round_id: opened_at)
    return client, plan, transport


@pytest.mark.parametrize("codec, size", [("sparseloco", 400), ("fp32", PARALLEL_COPIES_BYTES + 4)])
def test_a_hostile_first_candidates_closed_does_not_stop_the_shard_reaching_honest_ones(codec, size):
    # It used to: the contributor stopped at "closed", cancelled the copies on their way, and with
    # one hostile server among six no attempt could commit.
    client, plan, transport = _client(codec, opened_at=time.time())
    delivered = asyncio.run(client._send_shard(plan, 0, [b"x" * (size // 4)] * 4))
    assert delivered and transport.took and transport.hostile not in transport.took


def test_a_closed_attempt_by_our_own_clock_is_not_offered_to_every_candidate():
    # The honest use of "closed": past the attempt's close by our book, the shard goes no further.
    client, plan, transport = _client("fp32", opened_at=time.time() - 3600)
    delivered = asyncio.run(client._send_shard(plan, 0, [b"x" * (PARALLEL_COPIES_BYTES // 4 + 1)] * 4))
    assert not delivered and transport.asked == [transport.hostile]


def test_an_honest_closed_that_names_a_commit_stops_a_big_shard_at_once():
    # The other side of the change above: our book lagging, an honest aggregator's "closed" is
    # checked by asking it for the commit; once that lands in our book, no other candidate gets
    # the whole shard (a review measured four full uploads of it without this).
    client, plan, transport = _client("fp32", opened_at=time.time())
    committed = client.book.committed
    asked = []

    async def ask_decision(peer, round_id, attempt, wait_s, plan=None):
        asked.append(peer)
        committed[round_id] = (b"a signed commit", None)  # what a verified answer adds to our book
        return b"a signed commit"

    client.ask_decision = ask_decision
    delivered = asyncio.run(client._send_shard(plan, 0, [b"x" * (PARALLEL_COPIES_BYTES // 4 + 1)] * 4))
    assert not delivered and transport.asked == [transport.hostile] and asked == [transport.hostile]


def _commit_of(next_trainers, next_servers):
    """A server's book at round 0 and a commit of round 0 by one of its leaders (hostile), naming
    `next_trainers` / `next_servers` ("self": the leader; "sources"; "contributors"; "others": all
    but the leader) for round 1."""
    from groundswell.protocol.context import DecisionBook
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import Decision
    from groundswell.protocol.server import RoundServer

    ids = [Identity.generate() for _ in range(6)]
    by_id = {i.peer_id: i for i in ids}
    peers = sorted(by_id)
    book = DecisionBook("run")
    book.add(seal(ids[0], "run", Decision(-1, 0, "commit", [], peers, peers, ids[0].peer_id, [], 0,
                                          time.time() - 5, [])))
    server = object.__new__(RoundServer)
    server.book, server._learning, server.identity, server._plans = book, set(), ids[1], {}
    server.ctx = SimpleNamespace(run_id="run", min_peers=2, deadline_s=30.0, slack_s=2.0, max_shards=4,
                                 segment_numels=(4096,) * 8, limits=SimpleNamespace(max_clock_skew_s=120.0),
                                 authorized=lambda p: True, may_serve=lambda p: True)
    plan = make_plan("run", 0, 0, peers, peers, 8, 4)
    hostile = plan.leaders[0]
    contributors = sorted(peers[:3])
    sources = [plan.candidates(s)[0] for s in range(plan.num_shards)]
    named = {"self": [hostile], "sources": sources, "contributors": contributors,
             "others": [p for p in peers if p != hostile]}
    trainers = sorted({p for part in next_trainers for p in named[part]})
    servers = sorted({p for part in next_servers for p in named[part]})
    decision = Decision(0, 0, "commit", contributors, trainers, servers, hostile, sources, plan.num_shards,
                        time.time(), [b"\0" * 16] * (plan.num_shards * len(contributors)))
    return server, seal(by_id[hostile], "run", decision)


@pytest.mark.parametrize("next_trainers, next_servers", [
    (["self"], ["self"]),  # the capture a review found: every later role its own
    (["self"], ["self", "sources"]),  # its contributors dropped from training
    (["contributors"], ["self"]),  # the sources it sealed with dropped from serving
    (["contributors"], ["others"]),  # itself left out: not what any honest leader signs
])
def test_a_commit_whose_next_membership_drops_what_it_must_keep_is_refused(next_trainers, next_servers):
    from groundswell.protocol.schema import ProtocolError

    server, signed = _commit_of(next_trainers, next_servers)
    with pytest.raises(ProtocolError, match="next membership"):
        asyncio.run(server.verify_commit(signed))


def test_a_commit_that_keeps_its_contributors_leader_and_sources_passes():
    server, signed = _commit_of(["contributors"], ["self", "sources"])
    assert asyncio.run(server.verify_commit(signed)).round == 0
