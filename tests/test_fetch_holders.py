"""Whom a peer asks for a committed shard: any holder may hand on signed contributions (each is
checked against the commit's digests), but a dense mean only comes from those who computed it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
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
                                  max_payload_bytes=1000, slack_s=0.01)
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
    expected = ["source", "leader", "cand1", "cand2", "cand3", "applied1", "applied2"]
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
