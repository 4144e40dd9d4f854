"""Whom a peer asks for a committed shard: any holder may hand on signed contributions (each is
checked against the commit's digests), but a dense mean only comes from those who computed it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.compression import make_codec, wire_bound
from groundswell.protocol.context import contribution_bound, shard_payload_bound
from groundswell.protocol.fetch import AggregateFetcher
from groundswell.protocol.schema import Decision
from groundswell.protocol.transport import PeerUnavailable


def _asked(codec: str, verify_aggregates: bool = False) -> list[str]:
    """The peers asked, in order, for shard 0 of a commit when nobody answers."""
    asked: list[str] = []

    class _Transport:
        async def request(self, peer, handler, msg, expect, **kw):
            asked.append(peer)
            raise PeerUnavailable(f"{peer} is gone")

    fetcher = AggregateFetcher()
    fetcher.me, fetcher.transport = "me", _Transport()
    fetcher.server = SimpleNamespace(aggregates={})
    fetcher.holders = lambda round_id: ["applied1", "applied2", "cand1"]
    fetcher.ctx = SimpleNamespace(codec=SimpleNamespace(name=codec), verify_aggregates=verify_aggregates,
                                  max_payload_bytes=1000, slack_s=0.01, segment_numels=(250,))
    plan = SimpleNamespace(shard_segments=[(0, 1)], candidates=lambda shard: ["cand1", "cand2", "cand3", "cand4",
                                                                              "cand5"])
    decision = Decision(round=7, attempt=0, status="commit", contributors=["a", "b"], trainers=[], servers=[],
                        leader="leader", sources=["source"], num_shards=1)
    with pytest.raises(PeerUnavailable, match="no peer could provide shard 0"):
        asyncio.run(fetcher._fetch_shard(decision, b"signed", plan, 0))
    return asked


def test_a_dense_mean_is_asked_only_of_the_source_the_leader_and_the_shards_candidates():
    assert _asked("fp32") == ["source", "leader", "cand1", "cand2", "cand3", "cand4"]
    assert _asked("int8") == ["source", "leader", "cand1", "cand2", "cand3", "cand4"]


def test_signed_contributions_are_asked_of_any_peer_that_applied_the_round_too():
    # (all four reporting candidates: a review found a replica placed at the fourth never asked)
    expected = ["source", "leader", "cand1", "cand2", "cand3", "cand4", "applied1", "applied2"]
    assert _asked("sparseloco") == expected
    assert _asked("fp32", verify_aggregates=True) == expected


@pytest.mark.parametrize("codec,verify_aggregates,kept_by", [
    ("fp32", False, {"source", "leader", "cand1", "cand2", "cand3", "cand4"}),  # those asked for a mean
    ("int8", False, {"source", "leader", "cand1", "cand2", "cand3", "cand4"}),
    ("sparseloco", False, None),  # anyone who applied the round may be asked: everyone keeps it
    ("fp32", True, None),
])
def test_a_fetched_shard_is_kept_only_by_peers_that_would_be_asked_for_it(codec, verify_aggregates, kept_by):
    # A dense mean kept by every peer that fetched it was 9 rounds of full-size means (36 bytes per
    # parameter) that nobody would ever read.
    fetcher = AggregateFetcher()
    fetcher.ctx = SimpleNamespace(codec=SimpleNamespace(name=codec), verify_aggregates=verify_aggregates)
    plan = SimpleNamespace(candidates=lambda shard: ["cand1", "cand2", "cand3", "cand4", "cand5"])
    decision = Decision(round=7, attempt=0, status="commit", contributors=["a", "b"], trainers=[], servers=[],
                        leader="leader", sources=["source"], num_shards=1)
    for me in ["source", "leader", "cand1", "cand4", "cand5", "a", "other"]:
        fetcher.me = me
        assert fetcher._serves_shard(decision, plan, 0) == (kept_by is None or me in kept_by), me


@pytest.mark.parametrize("error, ours", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 4000000000 bytes"), True),
    (MemoryError(), True),
    (ValueError("a bad shard"), False),
])
def test_memory_running_out_here_is_not_blamed_on_the_peers(monkeypatch, error, ours):
    # Found by a review of the device path: torch's CPU allocator raises a RuntimeError, which was
    # taken for a peer's bad bytes (retried elsewhere, not reported); and naming
    # torch.OutOfMemoryError (torch >= 2.5) in the except clause made an older torch turn every
    # refused shard into an AttributeError.
    import torch
    from groundswell.protocol import fetch

    monkeypatch.delattr(torch, "OutOfMemoryError", raising=False)  # as on torch 2.2 to 2.4

    async def work():
        raise error

    with pytest.raises(type(error) if ours else PeerUnavailable):
        asyncio.run(fetch._refusing_peer_faults(work(), "shard 3 of round 7"))


@pytest.mark.parametrize("codec,contributors,expected", [
    ("fp32", 16, 1),  # one mean of the shard's segments, whoever contributed
    ("sparseloco", 16, 16),  # each contributor's share of them
])
def test_a_shards_reply_is_bounded_by_that_shard_not_by_the_whole_model(codec, contributors, expected):
    # Found by a review: the bound (and with it the wait before asking the next holder, and the
    # timeout) was the whole model's fp32 size times the contributors, for each of 16 shards: a
    # frozen source held every fetcher 83 s at 16 peers on 25M values.
    from groundswell.protocol.schema import MAX_SMALL

    limits: list[int] = []

    class _Transport:
        async def request(self, peer, handler, msg, expect, **kw):
            limits.append(kw["max_reply"])
            raise PeerUnavailable(f"{peer} is gone")

    numels = (4096,) * 16  # 16 segments, 16 shards of one each
    fetcher = AggregateFetcher()
    fetcher.me, fetcher.transport = "me", _Transport()
    fetcher.server = SimpleNamespace(aggregates={})
    fetcher.holders = lambda round_id: []
    fetcher.ctx = SimpleNamespace(codec=make_codec(codec), verify_aggregates=False, slack_s=0.01,
                                  max_payload_bytes=contribution_bound(make_codec(codec), numels), segment_numels=numels)
    plan = SimpleNamespace(shard_segments=[(i, i + 1) for i in range(16)], candidates=lambda shard: ["c1"])
    decision = Decision(round=7, attempt=0, status="commit", contributors=[f"p{i:02d}" for i in range(contributors)],
                        trainers=[], servers=[], leader="leader", sources=["source"] * 16, num_shards=16)
    with pytest.raises(PeerUnavailable):
        asyncio.run(fetcher._fetch_shard(decision, b"signed", plan, 3))
    one_shard = shard_payload_bound(fetcher.ctx, 3, 4)  # its values as the codec sends them, its envelopes
    assert limits and all(limit == expected * one_shard + MAX_SMALL for limit in limits)
    # (sized by the run's codec: a sparse shard's bound was its values in fp32, ~200x too loose)
    assert one_shard <= wire_bound(make_codec(codec), 4096) + 64 + 4096 + -(-(64 * 16 + 4096) // 16)


def test_a_round_older_than_our_newest_commit_that_we_do_not_hold_gets_none_at_once():
    # Found by a review: a holder waited the asker's whole wait (a slack) before saying it had
    # nothing, even for a round it had let go of long ago; a peer catching up 9-16 rounds behind
    # asked holder after holder and crawled for minutes before it took the state instead.
    import time

    from groundswell.protocol.aggregator import Aggregator
    from groundswell.protocol.schema import AggregateRequest

    server = SimpleNamespace(ctx=SimpleNamespace(deadline_s=30.0, slack_s=5.0), aggregates={},
                             _archived=asyncio.Event(), book=SimpleNamespace(latest=lambda: 100))
    start = time.monotonic()
    reply = asyncio.run(Aggregator._on_get_aggregate(server, "asker", AggregateRequest(88, 0, 5.0)))
    assert reply.mode == "none" and time.monotonic() - start < 1.0
    # the newest round still gets the wait: its aggregate may be archived any moment
    start = time.monotonic()
    reply = asyncio.run(Aggregator._on_get_aggregate(server, "asker", AggregateRequest(101, 0, 0.3)))
    assert reply.mode == "none" and time.monotonic() - start >= 0.3


def test_a_leader_that_gathered_some_shards_in_time_fails_only_the_others_sources():
    # Found by a review: a gather that timed out reported every shard unheld, so the leader took
    # every source for failed (and re-sourced or retried) over one frozen shard.
    from groundswell.protocol.decision import Decider
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity

    me = Identity.generate()
    decision = Decision(round=7, attempt=0, status="commit", contributors=["a", "b"], trainers=[], servers=[],
                        leader=me.peer_id, sources=["s0", "s1", "s2"], num_shards=3)
    signed = seal(me, "run", decision)

    async def slow_prefetch(signed_commit):
        await asyncio.sleep(10)

    held = SimpleNamespace(decision=signed)
    leader = SimpleNamespace(prefetch=slow_prefetch, ctx=SimpleNamespace(run_id="run", deadline_s=1.0, slack_s=0.1),
                             aggregates={(7, 0): held, (7, 2): held, (6, 1): held})
    unheld = asyncio.run(Decider._unheld_shards(leader, signed, 0.2))
    assert unheld == {1}


def test_a_shard_is_asked_of_at_most_three_holders_at_once():
    # Found by a review (2026-12-07): the hedge, shorter than an honest dense transfer, asked one
    # holder more each time it ran out, so every fetcher asked five holders for each whole shard
    # within seconds, and holders from the DHT (sybils in an open run) one more each hedge.
    from groundswell.protocol.fetch import MAX_ASKING

    at_once: set[str] = set()
    peak = [0]

    class _Trickling:
        async def request(self, peer, handler, msg, expect, **kw):
            at_once.add(peer)
            peak[0] = max(peak[0], len(at_once))
            try:
                await asyncio.sleep(3600)  # sending, slowly
            finally:
                at_once.discard(peer)

    fetcher = AggregateFetcher()
    fetcher.me, fetcher.transport = "me", _Trickling()
    fetcher.server = SimpleNamespace(aggregates={})
    fetcher.holders = lambda round_id: [f"applied{i}" for i in range(10)]
    fetcher.ctx = SimpleNamespace(codec=SimpleNamespace(name="sparseloco"), verify_aggregates=False,
                                  max_payload_bytes=1000, slack_s=0.01, segment_numels=(250,))
    plan = SimpleNamespace(shard_segments=[(0, 1)], candidates=lambda shard: ["cand1", "cand2", "cand3", "cand4"])
    decision = Decision(round=7, attempt=0, status="commit", contributors=["a", "b"], trainers=[], servers=[],
                        leader="leader", sources=["source"], num_shards=1)

    async def go() -> None:
        with pytest.raises(TimeoutError):  # (a hedge is at least a second: four and more would be asked by now)
            await asyncio.wait_for(fetcher._fetch_shard(decision, b"signed", plan, 0), 4.5)

    asyncio.run(go())
    assert peak[0] == MAX_ASKING == 3 and not at_once


def _mean_fetch(answers: dict[str, tuple[float, bytes]]) -> tuple[object, list[str]]:
    """Fetch shard 0 of a dense commit where each holder in `answers` sends a mean (after its
    delay) and the others are gone; (the shard taken or the error, the holders asked)."""
    from groundswell.compression import make_codec
    from groundswell.protocol.schema import AggregateShard

    codec = make_codec("fp32")
    asked: list[str] = []

    class _Transport:
        async def request(self, peer, handler, msg, expect, **kw):
            asked.append(peer)
            if peer not in answers:
                raise PeerUnavailable(f"{peer} is gone")
            delay, part = answers[peer]
            await asyncio.sleep(delay)
            return AggregateShard(b"signed", 0, "mean", [part])

    fetcher = AggregateFetcher()
    fetcher.me, fetcher.transport = "me", _Transport()
    fetcher.server = SimpleNamespace(aggregates={}, archive=lambda *args: None)
    fetcher.holders = lambda round_id: []
    fetcher.ctx = SimpleNamespace(codec=codec, verify_aggregates=False, max_payload_bytes=4 * 256 + 4096,
                                  slack_s=0.01, segment_numels=(256,), robust=None)
    plan = SimpleNamespace(shard_segments=[(0, 1)], candidates=lambda shard: ["cand1", "cand2", "cand3", "cand4"])
    decision = Decision(round=7, attempt=0, status="commit", contributors=["a", "b"], trainers=[], servers=[],
                        leader="leader", sources=["source"], num_shards=1)
    try:
        return asyncio.run(fetcher._fetch_shard(decision, b"signed", plan, 0)), asked
    except PeerUnavailable as exc:
        return exc, asked


def test_a_candidates_made_up_mean_is_not_taken_on_its_word_alone():
    # Found by a review: a dense mean was taken from the first of its holders to answer, so with
    # the source and the leader slow or gone, a hostile candidate that answered first had its
    # made-up mean applied by every peer. A candidate's mean is now taken once a second holder
    # sent the same bytes; the source's or the leader's on its word.
    import torch
    from groundswell.compression import make_codec

    codec = make_codec("fp32")
    honest = codec.encode(torch.ones(256)).to_bytes()
    made_up = codec.encode(torch.full((256,), 1e3)).to_bytes()
    got, _ = _mean_fetch({"cand1": (0.0, made_up), "cand2": (0.05, honest), "cand3": (0.1, honest)})
    assert not isinstance(got, Exception) and got.parts == [honest]
    got, _ = _mean_fetch({"cand1": (0.0, made_up), "cand2": (0.05, honest)})  # no second word for either
    assert isinstance(got, PeerUnavailable)
    got, _ = _mean_fetch({"cand1": (0.0, made_up), "leader": (0.5, honest)})  # the leader's is its own word
    assert not isinstance(got, Exception) and got.parts == [honest]
    # With the source and the leader gone, a commit outlives them on a replica: its mean alone,
    # uncontradicted by any holder left, is taken (a limit: a hostile replica then decides)
    got, _ = _mean_fetch({"cand2": (0.0, honest)})
    assert not isinstance(got, Exception) and got.parts == [honest]


def test_the_next_holder_is_asked_only_once_the_whole_commit_could_have_come_down():
    # Every shard of a commit comes down at once, so a first holder is given the time of the whole
    # download before the next one is asked. Sized by its own shard's share (1/16 of it here), the
    # hedge asked each shard's next holders while honest first ones were still sending: once budgets
    # were sized by the codec, ~3x a big sparse commit's download (a review, 2026-12-07).
    asked: dict[str, float] = {}

    class _Transport:
        async def request(self, peer, handler, msg, expect, **kw):
            asked[peer] = time.monotonic() - start
            await asyncio.sleep(2.5 if peer == "source" else 0)  # the source is slow, then gives up
            raise PeerUnavailable(f"{peer} is gone")

    numels = (4096,) * 16
    fetcher = AggregateFetcher()
    fetcher.me, fetcher.transport = "me", _Transport()
    fetcher.server = SimpleNamespace(aggregates={})
    fetcher.holders = lambda round_id: []
    # 20 MB of commit in all: a second at the 20 MB/s the hedge allows for, 1/16 of one per shard
    fetcher.ctx = SimpleNamespace(codec=make_codec("fp32"), verify_aggregates=False, slack_s=0.01,
                                  max_payload_bytes=20_000_000, segment_numels=numels)
    plan = SimpleNamespace(shard_segments=[(i, i + 1) for i in range(16)], candidates=lambda shard: ["c1"])
    decision = Decision(round=7, attempt=0, status="commit", contributors=["a", "b"], trainers=[], servers=[],
                        leader="leader", sources=["source"] * 16, num_shards=16)
    start = time.monotonic()
    with pytest.raises(PeerUnavailable):
        asyncio.run(fetcher._fetch_shard(decision, b"signed", plan, 3))
    assert set(asked) == {"source", "leader", "c1"}
    assert 1.9 < asked["leader"] < 2.4, asked  # max(1 s, slack / 4) plus the whole commit's second
