"""Peer records in the DHT: each node publishes a signed record (round, parameter hash, role,
reachability, bytes sent, bans, peers reached by a hole punch) every heartbeat, and reads everyone's, verified. `SwarmNode`
mixes this in."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from concurrent.futures import Future
from typing import Any

from groundswell.protocol.envelope import seal, unseal
from groundswell.protocol.schema import PeerRecord, ProtocolError

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
RECORD_TTL_S = 3 * HEARTBEAT_S  # a record outlives two missed heartbeats
STORE_CUTOFF_S = RECORD_TTL_S - HEARTBEAT_S  # a heartbeat's store is given up after this (from its start)
REJOIN_S = 30.0  # re-entering the DHT: dials (5 s each), pings and a lookup; it only runs when stores reach nobody
LEFT = "left"  # the role of a record a peer leaves behind when it leaves cleanly


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
    puncher: Any
    record: PeerRecord
    _cached_records: dict[str, PeerRecord]
    _refreshing: Future | None
    rejected_records: int
    submit: Any

    def update_record(self, **changes: Any) -> None:
        """Change fields of the record the heartbeat publishes."""
        if "loss" in changes and not math.isfinite(changes["loss"]):
            del changes["loss"]  # records refuse non-finite floats: a diverged loss would hide the whole record
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
        from hivemind.utils import get_dht_time

        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            rec = self.record
            rec = PeerRecord(rec.round, rec.params_hash, rec.role, rec.trains, rec.serves, self.maddrs[:8],
                             rec.reachability, rec.loss, self.transport.bytes_sent if self.transport else 0, time.time(),
                             sorted(self.guard.bans())[:32], sum(self.guard.rejected.values()), self._latest_scores(),
                             self.puncher.punched()[:64] if self.puncher is not None else [], rec.earlier_hashes[:16])
            signed = seal(self.identity, self.ctx.run_id, rec)
            try:  # (only when the routing table is empty, when a store would reach nobody anyway)
                async with asyncio.timeout(REJOIN_S):
                    await self.rejoiner.maybe_rejoin(self.p2p, self.dht)
            except Exception as exc:  # best effort (a TimeoutError too): the next heartbeat tries again
                log.info("re-entering the DHT failed: %r", exc)
            try:
                async with asyncio.timeout(max(0.1, STORE_CUTOFF_S - (loop.time() - started))):
                    stored = await self.dht.store(self.records_key(self.ctx.run_id), signed,
                                                  get_dht_time() + RECORD_TTL_S, subkey=self.identity.peer_id)
                if not stored:
                    log.info("heartbeat store was refused or reached nobody; the next heartbeat tries again")
            except Exception as exc:  # the DHT being briefly unreachable (or slow: TimeoutError) is normal under churn
                log.info("heartbeat store failed: %r", exc)
            await asyncio.sleep(max(0.0, HEARTBEAT_S - (loop.time() - started)))

    async def _withdraw_record(self) -> None:
        """Replace our record with a "left" one (it lives as long as a heartbeat's would): others
        stop counting us among the run's peers, serving states or holding rounds at once, not
        only once our last record expires."""
        from hivemind.utils import get_dht_time

        gone = PeerRecord(self.record.round, "", LEFT, False, False, [], self.record.reachability, 0.0, 0, time.time())
        await self.dht.store(self.records_key(self.ctx.run_id), seal(self.identity, self.ctx.run_id, gone),
                             get_dht_time() + RECORD_TTL_S, subkey=self.identity.peer_id)

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
        for subkey, item in found.value.items():
            try:
                sender, rec = unseal(item.value, run_id, PeerRecord)
                if sender == subkey and rec.role != LEFT:
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
        """Refresh the cached view of peer records."""
        self._cached_records = await self.peer_records()
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
