"""What a DHT node stores for others is bounded (peer/record_storage.py).

Found by a review (2026-12-07): records cost an open run's sybils nothing, and hivemind's storage
took any number of entries under the run's one records key, expiring up to an hour ahead: 31
records of the schema's largest size pushed every answer past p2pd's 4 MiB reply cap, hiding
every peer's record. Keys of no run filled a storer's memory the same way."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.peer import record_storage
from groundswell.peer.record_storage import MAX_ENTRIES, MAX_KEY_BYTES, guard_record_storage
from groundswell.peer.records import PeerRecords, PeerRecordValidator, expires_at
from groundswell.protocol.envelope import seal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import PeerRecord

RUN = "run"
REPLY_CAP = 4 << 20  # p2pd's largest reply


def _key():
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=PeerRecords.records_key(RUN))


def _node(known: tuple[str, ...] = (), skew_s: float = 120.0) -> SimpleNamespace:
    from hivemind.dht.storage import DHTLocalStorage

    validator = PeerRecordValidator(lambda pid: pid in known)
    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage())
    guard_record_storage(protocol, validator)
    validator.watch(RUN, SimpleNamespace(protocol=protocol), skew_s)
    return SimpleNamespace(protocol=protocol, validator=validator)


def _held(storage) -> dict[str, bytes]:
    found = storage.get(_key())
    return {} if found is None else {k: item.value for k, item in found.value.items()}


def _answer_bytes(storage) -> int:
    from hivemind.utils.serializer import MSGPackSerializer

    return len(MSGPackSerializer.dumps(storage.get(_key()).value))


@pytest.mark.parametrize("where", ["storage", "cache"])
def test_large_records_signed_far_ahead_no_longer_fill_an_answer_past_the_reply_cap(where):
    node = _node()
    storage = getattr(node.protocol, where)
    now = time.time()
    for i in range(60):  # 60 x 100 kB, each expiring as late as the run's skew lets it
        storage.store(_key(), bytes(100_000), now + 120.0, subkey=f"sybil-{i}")
    held = _held(storage)
    assert 0 < len(held) < 60 and sum(map(len, held.values())) <= MAX_KEY_BYTES
    assert _answer_bytes(storage) < REPLY_CAP
    # An honest record (it expires a record's life after its signing) still gets in.
    assert storage.store(_key(), b"honest", now + 6.0, subkey="honest")
    held = _held(storage)
    assert "honest" in held and sum(map(len, held.values())) <= MAX_KEY_BYTES


def test_a_full_key_keeps_the_records_of_peers_known_to_have_done_the_runs_work():
    node = _node(known=("worker",))
    storage = node.protocol.storage
    now = time.time()
    for i in range(MAX_ENTRIES):
        assert storage.store(_key(), b"x" * 40, now + 50.0, subkey=f"sybil-{i}")
    assert storage.store(_key(), b"work", now + 60.0, subkey="worker")  # displaces one stranger
    held = _held(storage)
    assert len(held) == MAX_ENTRIES and "worker" in held
    # Strangers storing records that expire sooner cannot push it out again.
    for i in range(200):
        storage.store(_key(), b"y", now + 40.0, subkey=f"later-{i}")
    held = _held(storage)
    assert len(held) == MAX_ENTRIES and held["worker"] == b"work"
    # A stranger that ranks lowest (its record expires latest) is the one left out.
    assert not storage.store(_key(), b"z" * 40, now + 100.0, subkey="late")
    assert "late" not in _held(storage)
    # The key's own expiration is that of what it holds, not of what was dropped.
    assert storage.get(_key()).expiration_time <= now + 60.0


def test_a_record_replacing_its_own_older_one_needs_no_room():
    node = _node()
    storage = node.protocol.storage
    now = time.time()
    for i in range(MAX_ENTRIES):
        storage.store(_key(), b"x", now + 5.0, subkey=f"peer-{i}")
    assert storage.store(_key(), b"newer", now + 6.0, subkey="peer-7")
    held = _held(storage)
    assert len(held) == MAX_ENTRIES and held["peer-7"] == b"newer"


def test_entries_may_expire_only_as_far_ahead_as_the_runs_clock_skew_allows():
    node = _node(skew_s=30.0)
    storage = node.protocol.storage
    now = time.time()
    assert storage.store(_key(), b"a", now + 30.0, subkey="within")
    assert not storage.store(_key(), b"b", now + 120.0, subkey="beyond")
    assert sorted(_held(storage)) == ["within"]
    wide = _node(skew_s=3600.0)  # the largest a manifest allows (status readers assume it)
    assert wide.protocol.storage.store(_key(), b"b", now + 3000.0, subkey="beyond")


def test_a_node_watching_a_run_stores_no_other_key():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    validator = PeerRecordValidator()
    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage())
    guard_record_storage(protocol, validator)
    other = DHTID.generate(source="someone/else")
    expiration = time.time() + 60
    assert protocol.storage.store(other, b"before", expiration)  # (not in a run yet: hivemind's rules)
    validator.watch(RUN, SimpleNamespace(protocol=protocol))
    for where in (protocol.storage, protocol.cache):
        assert not where.store(DHTID.generate(source="junk"), bytes(1 << 20), expiration)
        assert not where.store(DHTID.generate(source="junk"), bytes(10), expiration, subkey="s")
        assert not where.store(_key(), b"plain", expiration)  # a plain value under the run's key


def _signed(identity: Identity) -> tuple[bytes, float]:
    from hivemind.utils.serializer import MSGPackSerializer

    rec = PeerRecord(3, "h" * 64, "volunteer", True, True, [], "public", 1.0, 0, time.time())
    return MSGPackSerializer.dumps(seal(identity, RUN, rec)), expires_at(rec)


def test_hiveminds_own_store_handler_is_held_to_the_cap(monkeypatch):
    # (DHTProtocol.rpc_store as hivemind runs it on a store request from another node)
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.proto import dht_pb2
    from hivemind.utils.serializer import MSGPackSerializer

    monkeypatch.setattr(record_storage, "MAX_ENTRIES", 2)
    node = _node()
    protocol = object.__new__(DHTProtocol)
    protocol.record_validator, protocol.serializer = node.validator, MSGPackSerializer
    protocol.node_info = dht_pb2.NodeInfo()
    protocol.storage, protocol.cache = node.protocol.storage, node.protocol.cache
    identities = [Identity.generate() for _ in range(3)]
    values = [_signed(i) for i in identities]
    request = dht_pb2.StoreRequest(
        keys=[_key().to_bytes()] * 3, subkeys=[MSGPackSerializer.dumps(i.peer_id) for i in identities],
        values=[v for v, _ in values], expiration_time=[e + 0.001 * n for n, (_, e) in enumerate(values)],
        in_cache=[False] * 3)
    response = asyncio.run(protocol.rpc_store(request, None))
    assert list(response.store_ok) == [True, True, False]  # the third (expiring latest) is left out
    assert sorted(_held(protocol.storage)) == sorted(i.peer_id for i in identities[:2])


# --- found by a second review of the limits (2026-12-07) ------------------------------------------


def test_expired_entries_are_refused_and_push_nobody_out():
    # (ranked by expiration, an expired record outranked every stranger: one 48 kB store evicted
    # 21 honest records and stored nothing)
    node = _node()
    storage = node.protocol.storage
    now = time.time()
    for i in range(MAX_ENTRIES):
        storage.store(_key(), b"x", now + 60.0, subkey=f"peer-{i}")
    assert not storage.store(_key(), bytes(48_000), now - 1.0, subkey="expired")
    assert len(_held(storage)) == MAX_ENTRIES


def test_strangers_keep_their_places_first_come_whatever_their_expiration():
    # (a backdated record, expiring sooner, evicted an honest stranger already in the key)
    node = _node()
    storage = node.protocol.storage
    now = time.time()
    for i in range(MAX_ENTRIES):
        assert storage.store(_key(), b"x", now + 60.0, subkey=f"peer-{i:04d}")
    assert not storage.store(_key(), b"b", now + 1.0, subkey="backdated")
    assert storage.store(_key(), b"again", now + 65.0, subkey="peer-0007")  # a heartbeat keeps its place
    held = _held(storage)
    assert len(held) == MAX_ENTRIES and held["peer-0007"] == b"again" and "backdated" not in held


def test_a_known_peer_displaces_the_newest_stranger_in_place():
    # (each store to a full key sorted it and rebuilt it whole: ~16 ms a store, driven by anyone)
    node = _node(known=("worker",))
    storage = node.protocol.storage
    now = time.time()
    for i in range(MAX_ENTRIES):
        storage.store(_key(), b"x", now + 60.0, subkey=f"peer-{i:04d}")
    before = storage.get(_key()).value
    assert storage.store(_key(), b"w", now + 60.0, subkey="worker")
    held = _held(storage)
    assert storage.get(_key()).value is before  # (not rebuilt)
    assert "worker" in held and f"peer-{MAX_ENTRIES - 1:04d}" not in held and "peer-0000" in held


def test_before_watching_a_run_a_node_keeps_few_keys_each_within_the_limits():
    from groundswell.peer.record_storage import MAX_OTHER_KEYS
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    validator = PeerRecordValidator()
    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage())
    guard_record_storage(protocol, validator)
    expiration = time.time() + 60
    stored = [protocol.storage.store(DHTID.generate(source=f"k{i}"), b"v", expiration) for i in range(40)]
    assert sum(stored) == MAX_OTHER_KEYS
    key = DHTID.generate(source="k0")
    for i in range(MAX_ENTRIES + 50):
        protocol.storage.store(key, b"x", expiration + 1, subkey=f"s{i}")  # (later: replaces the plain value)
    assert stored[0] is True and len(protocol.storage.get(key).value.data) <= MAX_ENTRIES


def test_a_full_storage_is_not_walked_at_every_store():
    # Found by a review: the notes of arrival were pruned whenever they passed a fixed size, which
    # a storage of 16 full keys of no run (32,768 live entries) always passes: every store then
    # walked the whole storage (11-16 ms each, on the event loop)
    from groundswell.peer.record_storage import MAX_OTHER_KEYS
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage())
    guard_record_storage(protocol, PeerRecordValidator())
    expiration = time.time() + 600
    keys = [DHTID.generate(source=f"k{i}") for i in range(5)]  # (8,740 live entries: past the old fixed size)
    assert len(keys) * (MAX_ENTRIES - 300) > 4 * (MAX_ENTRIES + MAX_OTHER_KEYS)
    for key in keys:
        for i in range(MAX_ENTRIES - 300):
            protocol.storage.store(key, b"x", expiration, subkey=f"s{i}")
    walks = []
    items = protocol.storage.items
    protocol.storage.items = lambda: (walks.append(1), items())[1]
    for i in range(500):  # newcomers, with room for them
        assert protocol.storage.store(keys[i % len(keys)], b"y", expiration + 1, subkey=f"new{i}")
    assert len(walks) <= 1, len(walks)
    assert all(len(protocol.storage.get(key).value.data) <= MAX_ENTRIES for key in keys)


def test_watching_a_run_drops_bad_entries_and_holds_the_key_to_its_limits_in_one_pass(monkeypatch):
    # (the key was stored again entry by entry through the limits: 4,000 entries took 53 s here)
    from hivemind.dht.storage import DHTLocalStorage

    monkeypatch.setattr(record_storage, "MAX_ENTRIES", 100)
    validator = PeerRecordValidator()
    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage())
    guard_record_storage(protocol, validator)
    identities = [Identity.generate() for _ in range(5)]
    for identity in identities:
        value, expiration = _signed(identity)
        assert protocol.storage.store(_key(), value, expiration, subkey=identity.peer_id)
    raw = type(protocol.storage).store_subkey  # (stored before the limits were lowered, say)
    for i in range(150):
        raw(protocol.storage, _key(), f"junk-{i}", b"not a record", time.time() + 60)
    validator.watch(RUN, SimpleNamespace(protocol=protocol))
    assert sorted(_held(protocol.storage)) == sorted(i.peer_id for i in identities)


def test_commit_members_are_the_peers_named_in_the_books_commits():
    from groundswell.peer.record_storage import CommitMembers

    def decision(n: int) -> SimpleNamespace:
        return SimpleNamespace(contributors=[f"c{n}"], trainers=[f"t{n}"], servers=[f"s{n}"], leader=f"l{n}")

    book = SimpleNamespace(committed={1: (b"", decision(1))})
    members = CommitMembers()
    assert members.of(book) == {"c1", "t1", "s1", "l1"} and members.of(None) == frozenset()
    book.committed[2] = (b"", decision(2))
    assert "l2" in members.of(book) and "c1" in members.of(book)
