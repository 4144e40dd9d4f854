"""An old signed peer record stored again with a far-off expiration neither hides nor freezes its
peer: hivemind's DHT keeps, per subkey, the value that expires last."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import Cluster

pytestmark = pytest.mark.timeout(120)


async def _replay(node, key: str, subkey: str, value: bytes, expiration: float) -> bool:
    return await node.dht.store(key, value, expiration, subkey=subkey)


async def _raw(node, key: str, subkey: str):
    found = await node.dht.get(key, latest=True)
    return found.value[subkey]


def test_a_replayed_record_with_a_far_expiration_is_refused_and_the_peer_stays_current():
    from hivemind.utils import get_dht_time

    cluster = Cluster(2)
    try:
        a, b = cluster.nodes
        key, b_id = a.records_key(cluster.ctx.run_id), b.identity.peer_id
        b.update_record(round=5)
        deadline = time.monotonic() + 30
        while (seen := a.call(a.refresh_records(), 10).get(b_id)) is None or seen.round != 5:
            assert time.monotonic() < deadline, "b's record never showed round 5"
            time.sleep(0.5)
        old = a.call(_raw(a, key, b_id), 10).value  # b's signed record saying round 5
        # Anyone may store those bytes again, to expire in 11 days: every DHT node refuses it.
        assert not a.call(_replay(a, key, b_id, old, get_dht_time() + 1e6), 10)
        b.update_record(round=6)  # b's later heartbeats must still get through
        deadline = time.monotonic() + 30
        while (seen := a.call(a.refresh_records(), 10).get(b_id)) is None or seen.round != 6:
            assert time.monotonic() < deadline, "b's record stayed frozen at round 5"
            time.sleep(0.5)
    finally:
        cluster.close()


def test_a_record_expiring_past_its_signed_time_is_refused_by_the_validator_and_the_reader():
    from groundswell.peer.records import RECORD_TTL_S, PeerRecordValidator, expires_at, lives_as_signed
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import PeerRecord
    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    me, other = Identity.generate(), Identity.generate()
    rec = PeerRecord(3, "h", "volunteer", True, True, [], "public", 1.0, 0, 1000.0)
    assert expires_at(rec) == 1000.0 + RECORD_TTL_S
    assert lives_as_signed(rec, expires_at(rec)) and not lives_as_signed(rec, expires_at(rec) + 60)
    validator = PeerRecordValidator()
    validator.watch("run")
    key = DHTID.generate(source="groundswell/run/peers").to_bytes()

    def record(subkey: str, value: bytes, expiration: float):
        return SimpleNamespace(key=key, subkey=MSGPackSerializer.dumps(subkey), value=MSGPackSerializer.dumps(value),
                               expiration_time=expiration)

    signed = seal(me, "run", rec)
    assert validator.validate(record(me.peer_id, signed, expires_at(rec)))
    assert not validator.validate(record(me.peer_id, signed, expires_at(rec) + 60))  # a replay kept alive
    assert not validator.validate(record(other.peer_id, signed, expires_at(rec)))  # under another's name
    assert not validator.validate(record(me.peer_id, b"junk", expires_at(rec)))
    assert not validator.validate(record(me.peer_id, seal(me, "other-run", rec), expires_at(rec)))
    other_key = SimpleNamespace(key=DHTID.generate(source="x").to_bytes(), subkey=b"", value=b"", expiration_time=0)
    assert validator.validate(other_key)  # not a run this node is in: not ours to judge
    # The validator applies no rule of its own clock: hivemind drops a lookup's whole answer for
    # one entry it refuses, and a record dated just inside a storer's limit would then hide every
    # record from a reader whose clock is a little behind (found by two reviews). Readers drop it;
    # storers prune it (below).
    later = PeerRecord(3, "h", "volunteer", True, True, [], "public", 1.0, 0, time.time() + 3650 * 86400.0)
    assert validator.validate(record(me.peer_id, seal(me, "run", later), expires_at(later)))
    # Anyone may store under the run's key: 4 MiB of nested empty arrays, as a value or a subkey,
    # took 2 s and 289 MB of the event loop to decode before anything was checked (a review)
    bomb = b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20)
    decoded = []
    loads = MSGPackSerializer.loads
    MSGPackSerializer.loads = staticmethod(lambda data: (decoded.append(len(data)), loads(data))[1])
    try:
        assert not validator.validate(SimpleNamespace(key=key, subkey=MSGPackSerializer.dumps(me.peer_id), value=bomb,
                                                      expiration_time=expires_at(rec)))
        assert not validator.validate(SimpleNamespace(key=key, subkey=bomb, value=MSGPackSerializer.dumps(signed),
                                                      expiration_time=expires_at(rec)))
        assert validator.validate(record(me.peer_id, signed, expires_at(rec)))
    finally:
        MSGPackSerializer.loads = loads
    assert len(bomb) not in decoded and len(decoded) == 2, decoded  # refused on its headers: nothing built
    from groundswell.peer import records

    for kind, data in (("bin", MSGPackSerializer.dumps(signed)), ("str", MSGPackSerializer.dumps(me.peer_id))):
        records._one_scalar(data, records._BIN_HEADS if kind == "bin" else records._STR_HEADS)  # honest: one each
    with pytest.raises(ValueError):
        records._one_scalar(MSGPackSerializer.dumps(signed) + b"\x00", records._BIN_HEADS)  # trailing bytes


def test_a_storer_drops_records_dated_far_ahead_from_its_storage():
    # Found by a review: a record dated years ahead was kept by every storer for years; a batch of
    # them, stored once, pushed the run key's answers past p2pd's 4 MiB reply cap for good. Each
    # heartbeat now prunes, from the node's own storage and cache, records expiring more than an
    # hour (the largest clock skew a manifest allows) plus a record's life past its clock.
    from groundswell.peer.records import FUTURE_RECORD_S, PeerRecordValidator
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    validator = PeerRecordValidator()
    validator.watch("run")
    key = DHTID.generate(source="groundswell/run/peers")
    storage, cache = DHTLocalStorage(), DHTLocalStorage()
    now = time.time()
    for store in (storage, cache):
        store.store(key, b"near", now + 60, subkey="near")
        store.store(key, b"soon-ish", now + FUTURE_RECORD_S - 60, subkey="skewed")
        store.store(key, b"far", now + 3650 * 86400.0, subkey="far")
    validator.prune_far_future(SimpleNamespace(protocol=SimpleNamespace(storage=storage, cache=cache)))
    for store in (storage, cache):
        assert sorted(k for k, _ in store.get(key).value.items()) == ["near", "skewed"]


def test_a_reader_drops_a_record_signed_far_ahead_of_its_clock_and_keeps_the_others():
    """Found by a review of the state trust: a record signed years ahead never expired, so it
    stood for a peer (a sybil's vote, a far-off round) long after any process behind it."""
    import asyncio

    from groundswell.peer.records import PeerRecords, expires_at
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.guard import Limits
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import PeerRecord

    ids = [Identity.generate() for _ in range(3)]
    aheads = [0.0, 60.0, 3650 * 86400.0]  # now, a clock a minute fast (within the 120 s skew), ten years
    entries = {}
    for ident, ahead in zip(ids, aheads):
        rec = PeerRecord(3, "h", "volunteer", True, True, [], "public", 1.0, 0, time.time() + ahead)
        entries[ident.peer_id] = SimpleNamespace(value=seal(ident, "run", rec), expiration_time=expires_at(rec))

    async def get(key, latest=True):
        return SimpleNamespace(value=entries)

    reader = SimpleNamespace(dht=SimpleNamespace(get=get), ctx=SimpleNamespace(run_id="run", limits=Limits()),
                             records_key=PeerRecords.records_key, rejected_records=0)
    seen = asyncio.run(PeerRecords.peer_records(reader))
    assert set(seen) == {ids[0].peer_id, ids[1].peer_id} and reader.rejected_records == 1


async def _stored_subkeys(node, key: str) -> dict:
    from hivemind.dht.routing import DHTID

    found = node.dht.protocol.storage.get(DHTID.generate(source=key))
    return {} if found is None else {k: e for k, (_, e) in found.value.items()}


def test_records_a_node_took_in_before_it_checked_them_are_dropped_when_it_starts_to():
    """hivemind refuses a whole answer for a key if one entry fails validation: a bad entry stored
    before the node watched its run (while a volunteer fetched the manifest) would hide every
    record the node serves."""
    from groundswell.peer.records import PeerRecordValidator
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time
    from hivemind.utils.serializer import MSGPackSerializer

    cluster = Cluster(2)
    try:
        a, b = cluster.nodes
        key, b_id = a.records_key(cluster.ctx.run_id), b.identity.peer_id
        deadline = time.monotonic() + 30
        while b_id not in a.call(_stored_subkeys(a, key), 10):
            assert time.monotonic() < deadline, "a never stored b's record"
            time.sleep(0.5)
        old = a.call(_raw(a, key, b_id), 10).value

        async def plant() -> None:  # what a node that did not check yet would have taken in
            storage = a.dht.protocol.storage  # (hivemind's own store: a's guard refuses them now)
            assert not storage.store(DHTID.generate(source=key), MSGPackSerializer.dumps(old), get_dht_time() + 1e6,
                                     subkey=b_id)  # (peer/record_storage.py: past the run's clock skew)
            for subkey in ("X" * 8, b_id):
                type(storage).store_subkey(storage, DHTID.generate(source=key), subkey, MSGPackSerializer.dumps(old),
                                           get_dht_time() + 1e6)

        a.call(plant(), 10)
        assert "X" * 8 in a.call(_stored_subkeys(a, key), 10)
        validator = PeerRecordValidator()
        a.call(_watch(validator, cluster.ctx.run_id, a), 10)
        left = a.call(_stored_subkeys(a, key), 10)
        assert all(e < get_dht_time() + 60 for e in left.values()), left  # the far-future entries are gone
        assert a.identity.peer_id in left  # a's own honest record stays
        assert a.call(_key_expiration(a, key), 10) < get_dht_time() + 60  # and the key no longer lives as long as they did
    finally:
        cluster.close()


async def _watch(validator, run_id: str, node) -> None:
    validator.watch(run_id, node.dht)


async def _key_expiration(node, key: str) -> float:
    from hivemind.dht.routing import DHTID

    return node.dht.protocol.storage.get(DHTID.generate(source=key)).expiration_time


def test_our_records_never_carry_an_earlier_time_than_the_last_one(monkeypatch):
    # Found by a review: after our clock stepped back by D, every storer kept our record signed
    # before the step (it expires last) and refused the newer ones for D seconds: others saw a
    # stale round and hash meanwhile.
    from groundswell.peer import records
    from groundswell.peer.records import PeerRecords

    node = PeerRecords.__new__(PeerRecords)
    clock = iter([1000.0, 940.0, 1100.0])
    monkeypatch.setattr(records.time, "time", lambda: next(clock))
    assert node._signed_time() == 1000.0
    assert node._signed_time() == pytest.approx(1000.001)  # the clock stepped back 60 s
    assert node._signed_time() == 1100.0


def test_a_records_signature_is_checked_once_per_run_however_often_it_is_read(monkeypatch):
    # Found by a review: every lookup answer's records were signature-checked by the validator
    # and again by the reader, on the node's one event loop (~1 s a refresh at 1,000 peers).
    from groundswell.peer import records
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import PeerRecord, ProtocolError

    me = Identity.generate()
    signed = seal(me, "run-a", PeerRecord(3, "h", "volunteer", True, True, [], "public", 1.0, 0, time.time()))
    calls = []
    real = records.unseal
    monkeypatch.setattr(records, "unseal", lambda *a: calls.append(a[1]) or real(*a))
    for _ in range(5):
        assert records.unseal_record(signed, "run-a")[0] == me.peer_id
    assert calls == ["run-a"]
    with pytest.raises(ProtocolError):  # remembered for its own run only: another run checks it, and refuses it
        records.unseal_record(signed, "run-b")
    with pytest.raises(ProtocolError):  # a bad one is not remembered as good
        records.unseal_record(signed[:-1] + bytes([signed[-1] ^ 1]), "run-a")
