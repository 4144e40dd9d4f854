"""A DHT lookup answer is held to what it holds (peer/records.py: guard_find_answers).

Found by a review: hivemind takes an answer's overall expiration as sent, and a lookup of the
newest value ends at the first answer that expires at infinity, so one hostile DHT node answering
so (with no records) hid every peer's record from the reader. These run hivemind's own lookup
(DHTNode.get_many_by_id, DHTProtocol.call_find, its search state) over a fake transport."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.peer.records import PeerRecords, PeerRecordValidator, expires_at, guard_find_answers
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import PeerRecord

RUN = "run"


def _signed(identity: Identity, round_id: int) -> tuple[bytes, float]:
    rec = PeerRecord(round_id, "h" * 64, "volunteer", True, True, [], "public", 1.0, 0, time.time())
    return seal(identity, RUN, rec), expires_at(rec)


async def _lookup(guarded: bool, hostile_expiration: float) -> int:
    from hivemind.dht.node import Blacklist, DHTNode
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils.serializer import MSGPackSerializer

    key_id = DHTID.generate(source=PeerRecords.records_key(RUN))
    honest = DHTLocalStorage()
    for identity in (Identity.generate() for _ in range(3)):
        value, expiration = _signed(identity, 7)
        honest.store(key_id, MSGPackSerializer.dumps(value), expiration, subkey=identity.peer_id)
    storers = [(DHTID.generate(), PeerID.from_base58(Identity.generate().peer_id)) for _ in range(4)]
    hostile = storers[0][1]

    class _Stub:
        def __init__(self, peer: PeerID) -> None:
            self.peer = peer

        async def rpc_find(self, request: dht_pb2.FindRequest, timeout: float | None = None) -> dht_pb2.FindResponse:
            if self.peer == hostile:  # first, and with nothing in it
                return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
                    type=dht_pb2.FOUND_DICTIONARY, value=MSGPackSerializer.dumps(DictionaryDHTValue()),
                    expiration_time=hostile_expiration)])
            await asyncio.sleep(0.01)
            item = honest.get(key_id)
            return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
                type=dht_pb2.FOUND_DICTIONARY, value=MSGPackSerializer.dumps(item.value),
                expiration_time=item.expiration_time)])

    async def _nothing(*args: object, **kwargs: object) -> None:
        return None

    validator = PeerRecordValidator()
    validator.watch(RUN)
    protocol = object.__new__(DHTProtocol)
    protocol.record_validator, protocol.serializer = validator, MSGPackSerializer
    protocol.rpc_semaphore, protocol.wait_timeout, protocol.bucket_size = asyncio.Semaphore(16), 3, 20
    protocol.node_info = dht_pb2.NodeInfo()
    protocol.get_stub = _Stub
    protocol.update_routing_table = _nothing
    protocol.storage, protocol.cache = DHTLocalStorage(), DHTLocalStorage()
    protocol.routing_table = SimpleNamespace(get_nearest_neighbors=lambda key, k, exclude=None: storers,
                                             get=lambda **kw: None)
    if guarded:
        guard_find_answers(protocol)
    node = object.__new__(DHTNode)
    node.protocol, node.node_id, node.num_workers, node.chunk_size = protocol, DHTID.generate(), 4, 16
    node.reuse_get_requests, node.blacklist, node.is_alive = False, Blacklist(5.0, 2.0), True
    node.cache_locally, node.cache_nearest, node.cache_refresh_before_expiry = False, 0, 0
    reader = SimpleNamespace(dht=node, ctx=SimpleNamespace(run_id=RUN, limits=Limits()),
                             records_key=PeerRecords.records_key, rejected_records=0)
    return len(await PeerRecords.peer_records(reader))


@pytest.mark.parametrize("expiration", [float("inf"), float("nan")])
def test_one_hostile_answer_expiring_at_infinity_hides_no_record(expiration):
    assert asyncio.run(_lookup(guarded=True, hostile_expiration=expiration)) == 3


def test_unguarded_the_same_answer_hid_every_record():
    # (what the guard is for: hivemind's lookup as it is)
    assert asyncio.run(_lookup(guarded=False, hostile_expiration=float("inf"))) == 0


def test_an_answers_expiration_is_its_latest_entrys_and_one_with_none_is_not_found():
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.timed_storage import ValueWithExpiration

    now = time.time()
    two = DictionaryDHTValue()
    two.store("a", b"x", now + 100)
    two.store("b", b"y", now + 200)
    answers = {"k1": (ValueWithExpiration(two, float("inf")), {}),
               "k2": (ValueWithExpiration(DictionaryDHTValue(), now + 50), {}),
               "k3": (ValueWithExpiration(b"plain", float("inf")), {}), "k4": (ValueWithExpiration(b"plain", now + 80), {}),
               "k5": (None, {})}

    async def call_find(peer: object, keys: object) -> dict:
        return answers

    protocol = SimpleNamespace(call_find=call_find)
    guard_find_answers(protocol)
    held = asyncio.run(protocol.call_find("peer", list(answers)))
    assert held["k1"][0].expiration_time == now + 200 and held["k2"][0] is None and held["k3"][0] is None
    assert held["k4"][0].expiration_time == now + 80 and held["k5"][0] is None


def test_a_plain_value_stored_under_the_run_key_before_it_was_checked_is_dropped():
    # Found by a review: anyone could store a plain (not dictionary) value under the run's records
    # key while a node had not fetched the manifest yet; it then refused every record stored
    # after it and was the answer to every lookup there, hiding the run from that node.
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils.serializer import MSGPackSerializer

    key_id = DHTID.generate(source=PeerRecords.records_key(RUN))
    storage, cache = DHTLocalStorage(), DHTLocalStorage()
    for where in (storage, cache):
        assert where.store(key_id, MSGPackSerializer.dumps(b"junk"), time.time() + 30 * 86400)
    dht = SimpleNamespace(protocol=SimpleNamespace(storage=storage, cache=cache))
    PeerRecordValidator().watch(RUN, dht)
    assert storage.get(key_id) is None and cache.get(key_id) is None
    identity = Identity.generate()
    value, expiration = _signed(identity, 3)
    assert storage.store(key_id, MSGPackSerializer.dumps(value), expiration, subkey=identity.peer_id)
