"""What a DHT node stores for others, bounded. hivemind's storage takes any key, any number of
entries and any expiration: records cost an open run's sybils nothing, so one key's entries
pushed every lookup answer for the run's records past p2pd's 4 MiB reply cap (31 records of the
schema's largest, signed an hour ahead), or cost a reader seconds of signature checks an answer
(14,000 small ones), and keys nobody reads filled a storer's memory (a review, 2026-12-07).

Once a node watches a run (`PeerRecordValidator.watch`) it stores only that run's records key,
holds it to MAX_ENTRIES entries and MAX_KEY_BYTES bytes, and refuses entries that expire further
ahead of its clock than the run's clock skew allows. When the key is full, a newcomer takes the
place of the entry that ranks lowest below it: peers the node knows did the run's work (named
in commits it holds), the coordinator and itself rank above everyone else; then an entry that
expires sooner (an honest record lives RECORD_TTL_S past its signing) above one that expires
later; then a smaller one above a larger one. So sybils cannot push a known peer's record out,
and what they add lives only as long as they keep storing it again."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)

MAX_ENTRIES = 2048  # records kept under a run's key (a round's join table holds as many peers)
MAX_KEY_BYTES = 3 << 20  # their values' bytes together: an answer stays under p2pd's 4 MiB reply cap


class StoragePolicy(Protocol):
    """What the storage guard asks of the node's record validator."""

    def watching(self) -> bool:
        """Does the node watch a run (and so store nothing else)?"""

    def future_limit_s(self, key: bytes) -> float | None:
        """How far past our clock an entry of this key may expire (None: not a watched key)."""

    def known(self, peer_id: str) -> bool:
        """Is this peer one the node knows did the run's work (or the coordinator, or itself)?"""


def _rank(known: bool, expiration: float, size: int) -> tuple[bool, float, int]:
    """Higher ranks stay: known peers, then sooner expirations, then smaller values."""
    return known, -expiration, -size


def _rebuild(storage: Any, store_subkey: Callable[..., bool], key_id: Any, keep: list[tuple[Any, bytes, float]]) -> None:
    """Store `keep` again as the key's whole dictionary: deleting an entry in place left the key's
    own expiration at the deleted one's (hivemind keeps the latest ever stored)."""
    del storage[key_id]
    for subkey, value, expiration in keep:
        store_subkey(key_id, subkey, value, expiration)


def admit(storage: Any, store_subkey: Callable[..., bool], policy: StoragePolicy, key_id: Any, subkey: Any,
          value: bytes, expiration: float, now: float) -> bool:
    """May this entry be stored under `key_id`? Makes room for it (see the module's docstring)
    when it outranks what it displaces; False refuses it."""
    from hivemind.dht.storage import DictionaryDHTValue

    limit = policy.future_limit_s(key_id.to_bytes())
    if limit is None:
        return not policy.watching()  # a key of no run we are in: kept only before we watch one
    if expiration > now + limit or len(value) > MAX_KEY_BYTES or not isinstance(subkey, str):
        return False
    found = storage.get(key_id)
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return True  # (a plain value under a watched key is dropped when watching starts)
    entries = [(k, item.value, item.expiration_time) for k, item in found.value.items()]
    mine = next((e for e in entries if e[0] == subkey), None)
    if mine is not None and mine[2] >= expiration:
        return True  # hivemind refuses it as older than what it holds
    others = [e for e in entries if e[0] != subkey]
    room_entries = len(others) + 1 - MAX_ENTRIES
    room_bytes = sum(len(e[1]) for e in others) + len(value) - MAX_KEY_BYTES
    if room_entries <= 0 and room_bytes <= 0:
        return True
    ours = _rank(policy.known(subkey), expiration, len(value))
    ranked = sorted(others, key=lambda e: _rank(policy.known(e[0]), e[2], len(e[1])))
    dropped = 0
    while room_entries > 0 or room_bytes > 0:
        if dropped == len(ranked) or _rank(policy.known(ranked[dropped][0]), ranked[dropped][2],
                                           len(ranked[dropped][1])) >= ours:
            return False  # everything left ranks at least as high: the newcomer is the one left out
        room_entries -= 1
        room_bytes -= len(ranked[dropped][1])
        dropped += 1
    log.info("a run's records key is full: %d entries dropped for a newer one", dropped)
    _rebuild(storage, store_subkey, key_id, ranked[dropped:] + ([mine] if mine is not None else []))
    return True


def guard_record_storage(protocol: Any, policy: StoragePolicy, clock: Callable[[], float] = time.time) -> None:
    """Hold what `protocol` (a hivemind DHTProtocol) stores, in its storage and in its cache
    (others may store into either), to `admit`."""
    for storage in (protocol.storage, protocol.cache):
        store, store_subkey = storage.store, storage.store_subkey

        def guarded_store(key_id: Any, value: Any, expiration_time: float, subkey: Any = None, *,
                          _store: Callable[..., bool] = store, _storage: Any = storage) -> bool:
            if subkey is not None:
                return _storage.store_subkey(key_id, subkey, value, expiration_time)
            if policy.watching():  # a plain value: nothing of a run we are in is one
                return False
            return _store(key_id, value, expiration_time)

        def guarded_store_subkey(key_id: Any, subkey: Any, value: Any, expiration_time: float, *,
                                 _store_subkey: Callable[..., bool] = store_subkey, _storage: Any = storage) -> bool:
            if not isinstance(value, bytes) or not admit(_storage, _store_subkey, policy, key_id, subkey, value,
                                                         expiration_time, clock()):
                return False
            return _store_subkey(key_id, subkey, value, expiration_time)

        storage.store, storage.store_subkey = guarded_store, guarded_store_subkey
