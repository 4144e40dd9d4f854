"""Peer records in the DHT: each node publishes a signed record (round, parameter hash, role,
reachability, bytes sent, bans, peers reached by a hole punch) every heartbeat, and reads everyone's, verified. `SwarmNode`
mixes this in."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from groundswell.compression.wire_bounds import count_objects
from groundswell.protocol.clock_offset import skew_warning
from groundswell.protocol.envelope import seal, unseal
from groundswell.protocol.schema import PeerRecord, ProtocolError

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
RECORD_TTL_S = 3 * HEARTBEAT_S  # a record outlives two missed heartbeats
CLOCK_WARN_S = 1.0  # our clock this far off the other peers' is worth a warning (see protocol/clock_offset.py)
CLOCK_WARN_EVERY_S = 600.0  # and it is repeated this often while it lasts
STORE_CUTOFF_S = RECORD_TTL_S - HEARTBEAT_S  # a heartbeat's store is given up after this (from its start)
EXPIRY_SLACK_S = 1.0  # (a record's expiration is its own time plus RECORD_TTL_S, exactly)
# A stored record may expire at most this far ahead of a storer's clock, unless the run's manifest
# allows less skew: the largest clock skew a manifest allows (an hour) plus a record's life.
# Honest records expire RECORD_TTL_S after they are signed.
FUTURE_RECORD_S = 3600.0 + RECORD_TTL_S
LOOKUP_S = 30.0  # a lookup of the run's records is given up after this (a hung one blocked every later refresh)
REJOIN_S = 30.0  # re-entering the DHT: dials (5 s each), pings and a lookup; it only runs when stores reach nobody
LEFT = "left"  # the role of a record a peer leaves behind when it leaves cleanly


def expires_at(rec: PeerRecord) -> float:
    """When a record leaves the DHT: RECORD_TTL_S after the time it carries, signed."""
    return rec.updated + RECORD_TTL_S


VERIFIED_KEPT = 4096  # records whose signature check is remembered (by their bytes' digest)
# ...and at most about this many bytes of memory together (signed bytes plus ITEM_COST a list
# item): a soak run's records took ~2.2 kB each (~9 MB at the cap), but an open run's peer may
# sign any number of distinct records filled to the schema's limits (~47 kB each: ~180 MiB at
# 4,096), and a record of many short strings takes ~16x its signed size decoded.
VERIFIED_BYTES_KEPT = 8 << 20
ITEM_COST = 64  # charged per list item of a record besides its signed bytes (a Python str's overhead, roughly)
_verified: OrderedDict[bytes, tuple[str, PeerRecord, int]] = OrderedDict()
_verified_bytes = 0  # the cost (as VERIFIED_BYTES_KEPT counts it) of `_verified`'s records, together
_verified_lock = threading.Lock()


def unseal_record(value: bytes, run_id: str) -> tuple[str, PeerRecord]:
    """`unseal` of a stored peer record, remembered: hivemind checks every storer's whole answer
    and `peer_records` checks each entry again, so each lookup verified the same signatures
    (storers + 1) times, on the node's one event loop (~0.2-0.35 ms each: ~1 s a refresh at
    1,000 peers). Only records that check out are remembered; ProtocolError as `unseal`."""
    global _verified_bytes
    key = hashlib.blake2b(run_id.encode() + b"\0" + value, digest_size=16).digest()  # (checked for this run only)
    with _verified_lock:
        hit = _verified.get(key)
        if hit is not None:
            _verified.move_to_end(key)
            return hit[0], hit[1]
    sender, rec = unseal(value, run_id, PeerRecord)
    with _verified_lock:
        if key not in _verified:
            cost = len(value) + ITEM_COST * sum(len(v) for v in vars(rec).values() if isinstance(v, list))
            _verified[key] = (sender, rec, cost)
            _verified_bytes += cost
        while len(_verified) > VERIFIED_KEPT or _verified_bytes > VERIFIED_BYTES_KEPT:
            _verified_bytes -= _verified.popitem(last=False)[1][2]
    return sender, rec


def lives_as_signed(rec: PeerRecord, expiration: float) -> bool:
    """Does a stored record expire when its signed time says? hivemind's DHT keeps, per subkey,
    the value that expires last, so anyone could store one of our old records again with an
    expiration years away: the record would then shadow every later heartbeat for good (a
    coordinator frozen at one round, a live peer hidden behind its "left" record)."""
    return expiration <= expires_at(rec) + EXPIRY_SLACK_S


@dataclasses.dataclass(frozen=True)
class _Record:
    """What hivemind's DHTRecord holds (its key id, subkey and value as bytes, the expiration)."""

    key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float


def guard_find_answers(protocol: Any) -> None:
    """Hold every DHT lookup answer `protocol` (a hivemind DHTProtocol) receives to what it holds:
    a dictionary's overall expiration becomes the latest of its entries' (None if it has none),
    and a value whose expiration is not finite counts as not found. hivemind takes an answer's
    overall expiration as sent, and a lookup of the newest value ends at the first answer that
    expires at infinity: one hostile DHT node answering so, with no records or only made-up
    ones, hid every peer's record from the reader (a review)."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.timed_storage import ValueWithExpiration

    ask = protocol.call_find

    async def call_find(peer: Any, keys: Any) -> Any:
        found = await ask(peer, keys)
        if not found:
            return found
        held = {}
        for key, (value, nearest) in found.items():
            if value is not None and isinstance(value.value, DictionaryDHTValue):
                latest = max((item.expiration_time for _, item in value.value.items()), default=None)
                value = None if latest is None or not math.isfinite(latest) else \
                    ValueWithExpiration(value.value, min(value.expiration_time, latest))
                if value is not None:
                    value.value.latest_expiration_time = value.expiration_time
            elif value is not None and not math.isfinite(value.expiration_time):
                value = None
            held[key] = (value, nearest)
        return held

    protocol.call_find = call_find


_STR_HEADS = frozenset([*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB])  # fixstr, str 8/16/32
_BIN_HEADS = frozenset([0xC4, 0xC5, 0xC6])  # bin 8/16/32


def _one_scalar(data: bytes, heads: frozenset[int]) -> None:
    """ValueError unless `data` is exactly one msgpack object of a kind whose first byte is in `heads`."""
    if not data or data[0] not in heads:
        raise ValueError("not the msgpack kind a peer record holds")
    count_objects(data, 1)


class PeerRecordValidator:
    """Refuses, on every DHT store and lookup answer, a run's peer record that is not signed by
    the peer it is stored under or that would outlive its signed time (see `lives_as_signed`).
    hivemind's `RecordValidatorBase` in all but name (it is not imported before the node needs
    it: the CLI starts without hivemind); it signs nothing, so values pass through unchanged."""

    priority = 0

    def __init__(self, known: Callable[[str], bool] = lambda peer_id: False) -> None:
        self._runs: dict[bytes, str] = {}  # DHT key id of a run's records -> run id
        self._future_s: dict[bytes, float] = {}  # ...-> how far ahead of our clock its entries may expire
        self.known = known  # (`peer/record_storage.py`: peers whose records a full key keeps first)

    def watch(self, run_id: str, dht: Any = None, max_clock_skew_s: float = FUTURE_RECORD_S - RECORD_TTL_S) -> None:
        """Check the records of `run_id` from now on, and drop the ones `dht` (a DHTNode) took in
        before: hivemind refuses a whole answer for a key if one of its entries fails, so an entry
        stored while we were not yet checking would hide every record this node serves. Stored
        records may expire up to `max_clock_skew_s` plus a record's life ahead of our clock."""
        from hivemind.dht.routing import DHTID
        from hivemind.utils.serializer import MSGPackSerializer

        key = DHTID.generate(source=PeerRecords.records_key(run_id)).to_bytes()
        self._runs[key] = run_id
        self._future_s[key] = min(max_clock_skew_s + RECORD_TTL_S, FUTURE_RECORD_S)
        self._keep_only(dht, key, lambda k, v, e: self.validate(_Record(key, MSGPackSerializer.dumps(k), v, e)))

    def watching(self) -> bool:
        """Does this node check some run's records (and so store nothing else)?"""
        return bool(self._runs)

    def future_limit_s(self, key: bytes) -> float | None:
        """How far ahead of our clock a stored entry of `key` may expire (None: no run's key)."""
        return self._future_s.get(key)

    def prune_far_future(self, dht: Any) -> None:
        """Drop from `dht`'s storage the run records that expire further past our clock than
        `future_limit_s` (stores after `watch` refuse them: `peer/record_storage.py`). Not a rule of `validate`: that one also judges lookup answers, and hivemind refuses
        a whole answer for one entry it refuses, so a record dated just under a storer's limit would
        hide every record from a reader whose clock is a little behind (readers drop such records
        one by one). As a storer we keep none: a batch of records dated hours ahead, stored once,
        pushed the run key's answers past p2pd's 4 MiB reply cap for as long (found by a review)."""
        now = time.time()
        for key, ahead in list(self._future_s.items()):
            self._keep_only(dht, key, lambda k, v, e, ahead=ahead: e <= now + ahead)

    @staticmethod
    def _keep_only(dht: Any, key: bytes, keep: Any) -> None:
        """Store again, whole, a run key's entries in `dht`'s storage and cache that `keep(subkey,
        value, expiration)` accepts, if it refuses any (the key's own expiration was the refused
        entry's)."""
        from hivemind.dht.routing import DHTID
        from hivemind.dht.storage import DictionaryDHTValue

        protocol = getattr(dht, "protocol", None)
        key_id = DHTID.from_bytes(key)
        for storage in (getattr(protocol, "storage", None), getattr(protocol, "cache", None)):
            found = storage.get(key_id) if storage is not None else None
            if found is None:
                continue
            if not isinstance(found.value, DictionaryDHTValue):
                # A plain value under a run's records key is nobody's record: stored before we
                # checked the key, it refused every record stored after it, and was the answer
                # to every lookup here (a review).
                del storage[key_id]
                continue
            entries = list(found.value.items())
            good = [(k, v, e) for k, (v, e) in entries if keep(k, v, e)]
            if len(good) < len(entries):
                del storage[key_id]
                guard = getattr(storage, "record_guard", None)  # (peer/record_storage.py)
                if guard is not None:
                    guard.restore(storage, key_id, good)
                    continue
                for subkey, value, expiration in good:
                    storage.store(key_id, value, expiration, subkey=subkey)

    def validate(self, record: Any) -> bool:
        """Is this DHT record (key, subkey, value, expiration) acceptable?"""
        from hivemind.utils.serializer import MSGPackSerializer

        run_id = self._runs.get(record.key)
        if run_id is None:
            return True  # not a peer record of a run we are in
        try:
            # One str and one bin, checked before msgpack builds anything: anyone may store under
            # the run's key, and 4 MiB of nested empty arrays took 2 s and 289 MB of the event
            # loop to decode (a review, 2026-12-07). An ext type would run hivemind's decoders.
            _one_scalar(record.subkey, _STR_HEADS)
            _one_scalar(record.value, _BIN_HEADS)
            subkey = MSGPackSerializer.loads(record.subkey)
            sender, rec = unseal_record(MSGPackSerializer.loads(record.value), run_id)
        except Exception:  # (msgpack's errors, ProtocolError, TypeError): not a record at all
            return False
        # (No rule of our clock here: hivemind refuses a lookup's whole answer for one entry this
        # refuses, so a record dated just within a storer's skew would hide every record from a
        # reader whose clock is a little behind. Readers drop far-future records one by one, and
        # storers drop them from their storage: `prune_far_future`.)
        return sender == subkey and lives_as_signed(rec, record.expiration_time)

    def sign_value(self, record: Any) -> bytes:
        """The value as stored (nothing added)."""
        return record.value

    def strip_value(self, record: Any) -> bytes:
        """The value as read (nothing to take off)."""
        return record.value

    def merge_with(self, other: Any) -> bool:
        """Never merged into another validator (hivemind's CompositeValidator asks)."""
        return False


class PeerRecords:
    """The DHT records half of `SwarmNode`; needs its identity, ctx, dht, p2p, transport, guard,
    server, maddrs, rejoiner, puncher, record, _cached_records, _refreshing and submit()."""

    identity: Any
    ctx: Any
    dht: Any
    p2p: Any
    transport: Any
    guard: Any
    server: Any
    maddrs: list[str]
    rejoiner: Any
    _clock_warned_at: float | None = None  # loop time of the last clock warning (`_check_clock`)
    puncher: Any
    record: PeerRecord
    _cached_records: dict[str, PeerRecord]
    _refreshing: Future | None
    rejected_records: int
    record_validator: Any
    submit: Any
    _last_signed: float = 0.0  # the time our newest record carries (see `_signed_time`)

    def _signed_time(self) -> float:
        """The time our next record carries: never before the last one's. hivemind keeps, per
        peer, the value that expires last, so after our clock stepped back by D every storer
        refused our newer records for D seconds (others saw a stale round and hash meanwhile)."""
        now = max(time.time(), self._last_signed + 1e-3)
        self._last_signed = now
        return now

    def update_record(self, **changes: Any) -> None:
        """Change fields of the record the heartbeat publishes."""
        if "loss" in changes and not math.isfinite(changes["loss"]):
            del changes["loss"]  # records refuse non-finite floats: a diverged loss would hide the whole record
            changes.pop("loss_round", None)  # (the loss shown stays the one of its own round)
        self.record = dataclasses.replace(self.record, **changes)

    @staticmethod
    def records_key(run_id: str) -> str:
        """The DHT key under which a run's peers publish their records."""
        return f"groundswell/{run_id}/peers"

    async def _heartbeat(self) -> None:
        """Publish our record every HEARTBEAT_S, start to start. A slow store (a DHT hop to a dead
        peer waits out hivemind's RPC timeout) is cut off once the next one is due and the record
        before would be past half its life, so stores never space out beyond its lifetime (others
        would drop us for a moment), as they did when each waited for the last to finish."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:  # (only when the routing table is empty, when a store would reach nobody anyway)
                async with asyncio.timeout(REJOIN_S):
                    await self.rejoiner.maybe_rejoin(self.p2p, self.dht)
            except Exception as exc:  # best effort (a TimeoutError too): the next heartbeat tries again
                log.info("re-entering the DHT failed: %r", exc)
            try:
                self.record_validator.prune_far_future(self.dht)
            except Exception as exc:  # noqa: BLE001 (hivemind's storage internals): the next heartbeat tries again
                log.info("pruning far-future records failed: %r", exc)
            self._check_clock(loop.time())
            stored_from = loop.time()  # (after a re-entry of several seconds the store still gets its time)
            rec = self._record_now()
            signed = seal(self.identity, self.ctx.run_id, rec)
            try:
                async with asyncio.timeout(max(0.1, STORE_CUTOFF_S - (loop.time() - stored_from))):
                    stored = await self.dht.store(self.records_key(self.ctx.run_id), signed, expires_at(rec),
                                                  subkey=self.identity.peer_id)
                if not stored:
                    log.info("heartbeat store was refused or reached nobody; the next heartbeat tries again")
            except Exception as exc:  # the DHT being briefly unreachable (or slow: TimeoutError) is normal under churn
                log.info("heartbeat store failed: %r", exc)
            await asyncio.sleep(max(0.0, HEARTBEAT_S - (loop.time() - started)))

    def _record_now(self) -> PeerRecord:
        """Our record as it is to be published now."""
        rec = self.record
        # The exchange's bytes: a state served to a joiner over a stream (its trailer) is left out,
        # as one served over the direct port always was; counted, it made the live table's
        # kB/round/peer jump ~15x for the rounds after a NAT'ed peer served a joiner (a review).
        sent = self.transport.bytes_sent - self.transport.trailer_bytes_sent if self.transport else 0
        return PeerRecord(rec.round, rec.params_hash, rec.role, rec.trains, rec.serves, self.maddrs[:8],
                          rec.reachability, rec.loss, sent, self._signed_time(),
                          sorted(self.guard.bans())[:32], sum(self.guard.rejected.values()), self._latest_scores(),
                          self.puncher.punched()[:64] if self.puncher is not None else [], rec.earlier_hashes[:16],
                          rec.loss_round)

    def _check_clock(self, now: float) -> None:
        """Warn (at most every CLOCK_WARN_EVERY_S) while our clock is off the other peers' by more
        than CLOCK_WARN_S: rounds follow the clock, and the start's check was against one peer."""
        warning = skew_warning(self.guard.clock_offsets.ours(), CLOCK_WARN_S)
        last = self._clock_warned_at
        if warning is not None and (last is None or now - last >= CLOCK_WARN_EVERY_S):
            self._clock_warned_at = now
            log.warning(warning)

    async def _withdraw_record(self) -> None:
        """Replace our record with a "left" one (it lives as long as a heartbeat's would): others
        stop counting us among the run's peers, serving states or holding rounds at once, not
        only once our last record expires."""
        gone = PeerRecord(self.record.round, "", LEFT, False, False, [], self.record.reachability, 0.0, 0,
                          self._signed_time())
        await self.dht.store(self.records_key(self.ctx.run_id), seal(self.identity, self.ctx.run_id, gone),
                             expires_at(gone), subkey=self.identity.peer_id)

    def _latest_scores(self) -> list[str]:
        """"peer=score" for the newest round this peer scored contributions in (as a leader)."""
        scores = self.server.scores if self.server is not None else {}
        if not scores:
            return []
        r = max(scores)
        return [f"{who}={s:+.4f}" for who, s in sorted(scores[r].items())][:64]

    async def peer_records(self, run_id: str | None = None) -> dict[str, PeerRecord]:
        """Every live peer's signed record, verified (bad ones are dropped and counted)."""
        run_id = run_id or self.ctx.run_id  # type: ignore[union-attr]
        found = await self.dht.get(self.records_key(run_id), latest=True)
        out: dict[str, PeerRecord] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        skew = self.ctx.limits.max_clock_skew_s if self.ctx is not None else 120.0
        for subkey, item in found.value.items():
            try:
                sender, rec = unseal_record(item.value, run_id)
                if sender != subkey or not lives_as_signed(rec, item.expiration_time):
                    raise ProtocolError("a record stored under another peer's name, or to outlive its time")
                if rec.updated > time.time() + skew:  # it would never expire, and shadow the signer's later ones
                    raise ProtocolError(f"a record signed {rec.updated - time.time():.0f} s ahead of our clock")
                if rec.role != LEFT:
                    out[sender] = rec
            except (ProtocolError, TypeError) as exc:
                self.rejected_records += 1
                log.info("dropped a peer record: %s", exc)
        return out

    def holders(self, round_id: int) -> list[str]:
        """Peers whose last record says they applied `round_id` (best effort, from the cache)."""
        return [p for p, r in self._cached_records.items() if r.round > round_id and p != self.identity.peer_id]

    @property
    def cached_records(self) -> dict[str, PeerRecord]:
        """The peer records as the last refresh read them (no DHT lookup)."""
        return self._cached_records

    async def refresh_records(self) -> dict[str, PeerRecord]:
        """Refresh the cached view of peer records (TimeoutError past LOOKUP_S: the cache stays)."""
        async with asyncio.timeout(LOOKUP_S):
            records = await self.peer_records()
        self._cached_records = records
        book = getattr(self, "book", None)
        if book is not None:  # peers named in the commits we hold did the run's work (see DhtRejoiner)
            self.rejoiner.vouch({p for _, d in list(book.committed.values()) for p in (*d.contributors, d.leader)})
        self.rejoiner.remember((pid, rec.maddrs) for pid, rec in self._cached_records.items())
        return self._cached_records

    def refresh_in_background(self) -> None:
        """Start refreshing the cached records unless a refresh is under way; nobody waits for it
        (the node owns the future; `close` cancels it)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = self.submit(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh_records()
        except Exception as exc:  # a DHT hiccup: the cache stays as it was, the next refresh retries
            log.info("refreshing peer records failed: %r", exc)
