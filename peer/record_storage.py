"""What a DHT node stores for others, bounded. hivemind's storage takes any key, any number of
entries and any expiration: records cost an open run's sybils nothing, so one key's entries
pushed every lookup answer for the run's records past p2pd's 4 MiB reply cap (31 records of the
schema's largest, signed an hour ahead), or cost a reader seconds of signature checks an answer
(14,000 small ones), and keys nobody reads filled a storer's memory (a review, 2026-12-07).

Every key is held to MAX_ENTRIES entries and MAX_KEY_BYTES bytes of values, and entries that have
expired already are refused. Once a node watches a run (`PeerRecordValidator.watch`) it stores
only that run's records key, and refuses entries expiring further ahead of its clock than the
run's clock skew allows; before, it keeps at most MAX_OTHER_KEYS keys. When a key is full, a
newcomer takes the place of the entry that ranks lowest below it: peers the node knows did the
run's work (named in commits it holds), the coordinator and itself rank above everyone else, and
among the others the first to arrive ranks highest (an entry stored again keeps its place). So
sybils cannot push a known peer's record out, nor an earlier stranger's, and each newcomer costs
the storer one pass over the key (a second review: ranked by expiration, backdated or expired
records pushed honest ones out, and each store to a full key sorted and rebuilt it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

MAX_ENTRIES = 2048  # records kept under a key (a round's join table holds as many peers)
# Their values' bytes together: an answer, with each entry's peer id and expiration, stays under
# p2pd's 4 MiB reply cap. ~1,600 records of the 2.2 kB a soak run's took.
MAX_KEY_BYTES = 3584 << 10
MAX_OTHER_KEYS = 16  # keys of no run a node keeps while it watches none (it fetches the manifest)


class StoragePolicy(Protocol):
    """What the storage guard asks of the node's record validator."""

    def watching(self) -> bool:
        """Does the node watch a run (and so store nothing else)?"""

    def future_limit_s(self, key: bytes) -> float | None:
        """How far past our clock an entry of this key may expire (None: not a watched key)."""

    def known(self, peer_id: str) -> bool:
        """Is this peer one the node knows did the run's work (or the coordinator, or itself)?"""


class RecordStorageGuard:
    """The limits on one hivemind DHTProtocol's storage and cache (see the module's docstring)."""

    def __init__(self, policy: StoragePolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy, self.clock = policy, clock
        self._arrived: dict[tuple[Any, Any], int] = {}  # (storage's id, key, subkey) -> order of arrival
        self._next = 0
        self._kept = 0  # notes left by the last time the forgotten ones were dropped
        self._raw: dict[int, Callable[..., bool]] = {}  # id(storage) -> hivemind's own store_subkey

    def install(self, protocol: Any) -> None:
        """Hold what `protocol` stores, in its storage and in its cache (others may store into either)."""
        for storage in (protocol.storage, protocol.cache):
            store, store_subkey = storage.store, storage.store_subkey
            self._raw[id(storage)] = store_subkey

            def guarded_store(key_id: Any, value: Any, expiration_time: float, subkey: Any = None, *,
                              _store: Callable[..., bool] = store, _storage: Any = storage) -> bool:
                if subkey is not None:
                    return _storage.store_subkey(key_id, subkey, value, expiration_time)
                if self.policy.watching() or not self._key_room(_storage, key_id):
                    return False  # (a plain value: nothing of a run we are in is one)
                return _store(key_id, value, expiration_time)

            def guarded_store_subkey(key_id: Any, subkey: Any, value: Any, expiration_time: float, *,
                                     _store_subkey: Callable[..., bool] = store_subkey, _storage: Any = storage) -> bool:
                if not isinstance(value, bytes) or not self.admit(_storage, key_id, subkey, value, expiration_time):
                    return False
                return _store_subkey(key_id, subkey, value, expiration_time)

            storage.store, storage.store_subkey = guarded_store, guarded_store_subkey
            storage.record_guard = self  # (`PeerRecordValidator._keep_only` re-stores through `restore`)

    def restore(self, storage: Any, key_id: Any, entries: list[tuple[Any, bytes, float]]) -> None:
        """Store `entries` again under `key_id`, as they were (no limit checked), then hold the key
        to its limits once: re-stored one by one through `admit`, a key of thousands took tens of
        seconds (a second review)."""
        raw = self._raw.get(id(storage), storage.store_subkey)
        for subkey, value, expiration in entries:
            raw(key_id, subkey, value, expiration)
        self._trim(storage, key_id, 0, 0)

    def _key_room(self, storage: Any, key_id: Any) -> bool:
        """May a key of no run be stored? Only while we watch none, and up to MAX_OTHER_KEYS."""
        return storage.get(key_id) is not None or len(storage) < MAX_OTHER_KEYS

    def _rank(self, storage: Any, key_id: Any, subkey: Any) -> tuple[bool, int]:
        """Higher ranks stay: known peers, then the earliest to arrive."""
        order = self._arrived.get((id(storage), key_id, subkey), self._next)
        return isinstance(subkey, str) and self.policy.known(subkey), -order

    def admit(self, storage: Any, key_id: Any, subkey: Any, value: bytes, expiration: float) -> bool:
        """May this entry be stored under `key_id`? Makes room for it when it outranks what it
        displaces; False refuses it."""
        from hivemind.dht.storage import DictionaryDHTValue

        now = self.clock()
        limit = self.policy.future_limit_s(key_id.to_bytes())
        if limit is None and (self.policy.watching() or not self._key_room(storage, key_id)):
            return False  # a key of no run we are in
        if expiration <= now or (limit is not None and expiration > now + limit) or len(value) > MAX_KEY_BYTES:
            return False
        found = storage.get(key_id)
        if found is None or not isinstance(found.value, DictionaryDHTValue):
            self._arrive(storage, key_id, subkey)
            return True  # (a plain value under a watched key is dropped when watching starts)
        held = found.value.data
        mine = held.get(subkey)
        if mine is not None and mine.expiration_time >= expiration:
            return True  # hivemind refuses it as older than what it holds
        over_entries = len(held) - (mine is not None) + 1 - MAX_ENTRIES
        over_bytes = sum(len(item.value) for item in held.values()) + len(value) - MAX_KEY_BYTES
        if mine is not None:
            over_bytes -= len(mine.value)
        if (over_entries > 0 or over_bytes > 0) and not self._trim(storage, key_id, over_entries, over_bytes,
                                                                    self._rank(storage, key_id, subkey), subkey):
            return False
        self._arrive(storage, key_id, subkey)
        return True

    def _trim(self, storage: Any, key_id: Any, over_entries: int, over_bytes: int,
              ranked_at: tuple[bool, int] | None = None, keep: Any = None) -> bool:
        """Drop, lowest first, entries of `key_id` ranking below `ranked_at` (any, if None) until
        `over_entries` more and `over_bytes` more are gone, and the key is within its limits;
        False, dropping nothing, if that cannot be done."""
        from hivemind.dht.storage import DictionaryDHTValue

        found = storage.get(key_id)
        if found is None or not isinstance(found.value, DictionaryDHTValue):
            return True
        held = found.value.data
        over_entries = max(over_entries, len(held) - MAX_ENTRIES)
        over_bytes = max(over_bytes, sum(len(item.value) for item in held.values()) - MAX_KEY_BYTES)
        if over_entries <= 0 and over_bytes <= 0:
            return True
        below = [(self._rank(storage, key_id, k), k) for k in held if k != keep]
        if ranked_at is not None:
            below = [b for b in below if b[0] < ranked_at]
        below.sort()
        dropped = []
        for _, k in below:
            if over_entries <= 0 and over_bytes <= 0:
                break
            dropped.append(k)
            over_entries -= 1
            over_bytes -= len(held[k].value)
        if over_entries > 0 or over_bytes > 0:
            return False  # everything left ranks at least as high: the newcomer is the one left out
        for k in dropped:  # (in place: the key's own expiration may stay a dropped one's, which
            del found.value[k]  # readers hold to the entries they get: `records.guard_find_answers`)
            self._arrived.pop((id(storage), key_id, k), None)
        log.info("a DHT key is full: %d entries dropped for a newer one", len(dropped))
        return True

    def _arrive(self, storage: Any, key_id: Any, subkey: Any) -> None:
        """Note an entry's first arrival (one stored again keeps its place)."""
        if self._arrived.setdefault((id(storage), key_id, subkey), self._next) == self._next:
            self._next += 1
        # Forget those this storage no longer holds, once the notes have doubled since the last
        # time: against a fixed size, a storage holding more live entries than it (16 keys of no
        # run yet, 32,768) was walked at every store, 11-16 ms each on the event loop (a review).
        if len(self._arrived) > max(4 * (MAX_ENTRIES + MAX_OTHER_KEYS), 2 * self._kept):
            live = {(id(storage), k, sub) for k, v in storage.items() for sub in getattr(v.value, "data", {})}
            self._arrived = {a: n for a, n in self._arrived.items() if a[0] != id(storage) or a in live}
            self._kept = len(self._arrived)


def guard_record_storage(protocol: Any, policy: StoragePolicy, clock: Callable[[], float] = time.time) -> None:
    """Hold what `protocol` (a hivemind DHTProtocol) stores to the limits of `RecordStorageGuard`."""
    RecordStorageGuard(policy, clock).install(protocol)


class CommitMembers:
    """Peers named in the commits a book holds (contributors, trainers, servers, leaders): the
    peers a node knows did the run's work. Worked out again only when the book changes."""

    def __init__(self) -> None:
        self._seen: tuple[int, int] | None = None
        self._members: frozenset[str] = frozenset()

    def of(self, book: Any) -> frozenset[str]:
        """The members of `book`'s commits (a DecisionBook; None: nobody)."""
        if book is None:
            return frozenset()
        committed = book.committed
        mark = (max(committed, default=-2), len(committed))
        if mark != self._seen:
            members: set[str] = set()
            for _, d in list(committed.values()):
                members.update(d.contributors, d.trainers, d.servers, (d.leader,))
            self._seen, self._members = mark, frozenset(members)
        return self._members
