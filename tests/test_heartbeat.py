"""A peer's DHT record is republished before it expires, even when stores are slow."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import types

import pytest
from groundswell.peer import records
from groundswell.peer.records import PeerRecords, PeerRecordValidator
from groundswell.protocol.guard import Guard
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import PeerRecord

pytestmark = pytest.mark.timeout(60)


class _SlowDht:
    """A DHT whose stores take `store_s` each (a hop to a dead peer waits out an RPC timeout)."""

    def __init__(self, store_s: float) -> None:
        self.store_s = store_s
        self.stores: list[tuple[float, float]] = []  # (when it began, when its record expires), loop time

    async def store(self, key, value, expiration_time, subkey=None) -> bool:
        from hivemind.utils import get_dht_time

        now = asyncio.get_running_loop().time()
        self.stores.append((now, now + expiration_time - get_dht_time()))
        await asyncio.sleep(self.store_s)
        return True


class _NoRejoin:
    async def maybe_rejoin(self, p2p, dht) -> None:
        return None


def _node(dht: _SlowDht) -> PeerRecords:
    node = PeerRecords()
    node.identity = Identity.generate()
    node.ctx = types.SimpleNamespace(run_id="heartbeat-test")
    node.dht, node.p2p, node.transport, node.server, node.puncher = dht, None, None, None, None
    node.guard, node.rejoiner, node.maddrs = Guard(), _NoRejoin(), []
    node.record_validator = PeerRecordValidator()
    node.record = PeerRecord(-1, "", "volunteer", True, True, [], "public", 0.0, 0, 0.0)
    return node


async def _beat_for(node: PeerRecords, seconds: float) -> None:
    task = asyncio.get_running_loop().create_task(node._heartbeat())
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("store_s", [0.0, 0.3, 5.0])
def test_every_record_is_replaced_before_it_expires(monkeypatch, store_s):
    # Scaled down 10x: heartbeats every 0.2 s, records living 0.6 s. A store that hangs (5 s here,
    # 25 heartbeats) used to space the next one out past the record's life.
    monkeypatch.setattr(records, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(records, "RECORD_TTL_S", 0.6)
    monkeypatch.setattr(records, "STORE_CUTOFF_S", 0.4)
    dht = _SlowDht(store_s)
    asyncio.run(_beat_for(_node(dht), 2.0))
    starts = [t for t, _ in dht.stores]
    assert len(starts) >= 4, f"only {len(starts)} stores in 2 s of heartbeats"
    for (_, expires), next_start in zip(dht.stores, starts[1:]):
        assert next_start < expires, "a record expired before the next heartbeat began storing its successor"
    # start to start, not end to start: a store that took 0.3 s did not add its time to the spacing
    # (their median: one gap stretched by a busy machine is no spacing; end to start gave 0.5 s each)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert statistics.median(gaps) < 0.45, gaps


def test_a_hung_records_lookup_is_given_up_so_later_refreshes_run(monkeypatch):
    # One lookup that never returned left the background refresh "under way" for good: the
    # cached records (holders, catch-up, punches) went stale for the rest of the run.
    monkeypatch.setattr(records, "LOOKUP_S", 0.2)
    node = _node(_SlowDht(0.0))
    lookups: list[int] = []
    cached = {"x": "rec"}
    node._cached_records = cached

    async def peer_records():
        lookups.append(1)
        await asyncio.sleep(3600)  # hung

    node.peer_records = peer_records

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await node.refresh_records()
        await node._refresh_quietly()  # gives up too, quietly

    asyncio.run(main())
    assert len(lookups) == 2 and node._cached_records is cached  # the cache stays as it was


def test_a_loss_that_cannot_be_published_leaves_its_round_as_it_was():
    node = _node(_SlowDht(0.0))
    node.update_record(loss=2.5, loss_round=4)
    node.update_record(loss=float("nan"), loss_round=9)  # diverged: records refuse non-finite floats
    assert (node.record.loss, node.record.loss_round) == (2.5, 4)


def test_the_checked_records_kept_are_bounded_in_bytes(monkeypatch):
    # A soak run found this cache the one thing growing (~15 MB, to its 4,096-record cap); a peer
    # may sign any number of distinct records filled to the schema's limits (~47 kB each)
    from groundswell.protocol.envelope import seal

    monkeypatch.setattr(records, "_verified", type(records._verified)())
    monkeypatch.setattr(records, "_verified_bytes", 0)
    monkeypatch.setattr(records, "VERIFIED_BYTES_KEPT", 64 << 10)
    me = Identity.generate()
    big = [f"/ip4/10.0.0.{i}/tcp/{40000 + i}/p2p/{me.peer_id}" for i in range(32)]
    signed = [seal(me, "r", PeerRecord(n, "f" * 64, "volunteer", True, True, big, "public", 0.0, 0, float(n)))
              for n in range(40)]
    for n, value in enumerate(signed):
        sender, rec = records.unseal_record(value, "r")
        assert sender == me.peer_id and rec.round == n
    assert 0 < records._verified_bytes <= 64 << 10 and len(records._verified) < 40
    assert records._verified_bytes == sum(size for _, _, size in records._verified.values())
    sender, rec = records.unseal_record(signed[-1], "r")  # a hit: what `unseal` gives
    assert sender == me.peer_id and rec.round == 39 and rec.maddrs == big


def test_a_record_counts_the_exchanges_bytes_not_a_state_served_over_a_stream():
    # Found by a review (2026-12-07): a state served to a joiner over a libp2p stream was counted
    # (one served over the direct port was not), and the live table's kB/round/peer jumped ~15x for
    # the rounds after a NAT'ed peer served a joiner.
    node = _node(_SlowDht(0.0))
    node.transport = types.SimpleNamespace(bytes_sent=1_000_000, trailer_bytes_sent=900_000)
    assert node._record_now().bytes_sent == 100_000
    node.transport = None
    assert node._record_now().bytes_sent == 0
