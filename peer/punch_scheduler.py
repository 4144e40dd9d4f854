"""Which peers behind NATs a volunteer punches holes to, and when (peer/holepunch.py punches)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from groundswell.peer import holepunch
from groundswell.peer.holepunch import MAX_REASON, DialFailed, PunchFailed, PunchTarget
from groundswell.peer.reachability import connection_paths

log = logging.getLogger(__name__)


class PunchScheduler:
    """A volunteer behind a NAT: get a direct connection to every other peer behind a NAT.

    Of each such pair the peer with the smaller id dials (two crossing attempts would each open
    the other's router to the wrong socket). A failed pair is tried again after RETRY_S, doubling
    up to MAX_RETRY_S: at least as long as a router keeps the failed SYN's mapping (Linux:
    120 s), which would otherwise let the next punch through to the dialer's daemon instead."""

    RETRY_S = 150.0
    MAX_RETRY_S = 1800.0
    PER_PASS = 4  # attempts running at once, at most (each can take ~20 s)
    PER_PASS_UNPROVEN = 2  # of them, to peers no commit we hold names: records are free to publish
    MAX_PAIRS = 4096  # pairs whose backoff is remembered (records are free: their number is not bounded)

    def __init__(self, me: str, rendezvous: list[str], p2p: Any, transport: Any,
                 records: Any, target: PunchTarget | None = None) -> None:
        self.me = me
        self.rendezvous = rendezvous  # bootstrap peer ids, in order of preference
        self.p2p = p2p
        self.transport = transport
        self.records = records  # () -> {peer id: PeerRecord}, the node's cached view
        self.target = target  # our side of punches others dial, if we take invites
        self.attempts: deque[dict[str, Any]] = deque(maxlen=256)  # {peer, ok, s, address | reason}
        self.direct: set[str] = set()  # peers we punched to whose connection is still direct
        self.announce: Any = None  # (peer, address) -> None, called at the first punch that works
        self.proven: Callable[[str], bool] = lambda peer: False  # did it do the run's work? (DhtRejoiner)
        self.rng = random.Random()  # the order unproven peers are tried in (seeded by tests)
        self.scopes: frozenset[str] | None = None  # where a rendezvous may have us dial (`dialable_scopes`)
        self._fails: dict[str, int] = {}
        self._next: dict[str, float] = {}
        self._trying: set[str] = set()  # peers an attempt is running to

    def punched(self) -> list[str]:
        """Peers we hold a connection with that a hole punch made, dialled by us or by them."""
        return sorted(self.direct | (self.target.live if self.target is not None else set()))

    async def run(self, every_s: float = 5.0) -> None:
        """Forever: every `every_s`, start the pairs that are due (an error skips one pass).

        Each attempt is a task of this scheduler's own group, so a slow one (a symmetric NAT's
        dial takes ~10 s to time out) holds up neither the next pass nor the other pairs."""
        async with asyncio.TaskGroup() as attempts:
            while True:
                try:
                    await self.start_due(attempts)
                except Exception as exc:  # the daemon's control socket failing, say: next pass
                    log.info("hole punching pass failed: %r", exc)
                await asyncio.sleep(every_s)

    async def once(self) -> None:
        """Try each due pair once, at the same time, and wait until every attempt has ended."""
        async with asyncio.TaskGroup() as attempts:
            await self.start_due(attempts)

    async def start_due(self, attempts: asyncio.TaskGroup) -> None:
        """Start, in `attempts`, a punch to each pair that is due and not being tried already."""
        known = set(self.direct)  # an attempt may add a peer while we wait for the list: not dropped
        async with asyncio.timeout(holepunch.DIAL_TIMEOUT_S):  # a hung daemon skips this pass, not every later one
            paths = connection_paths(await self.p2p.list_peers())
        self.direct -= {p for p in known if paths.get(p) != "direct"}
        records = self.records()
        now = time.monotonic()
        self._forget_old(now)
        due = [peer for peer, rec in sorted(records.items())
               if peer > self.me and rec.reachability == "private" and paths.get(peer) != "direct"
               and now >= self._next.get(peer, 0.0) and peer not in self._trying]
        # Proven peers first, then a random few of the others: taken in id order, sybil records
        # with ids just above ours had every slot, every pass (found by a review).
        unproven = [peer for peer in due if not self.proven(peer)]
        room = max(0, self.PER_PASS_UNPROVEN - sum(not self.proven(peer) for peer in self._trying))
        picked = sorted(self.rng.sample(unproven, min(room, len(unproven))))
        chosen = [peer for peer in due if self.proven(peer)] + picked
        for peer in chosen[:max(0, self.PER_PASS - len(self._trying))]:
            self._trying.add(peer)
            attempts.create_task(self._attempt_once(peer))

    def _forget_old(self, now: float) -> None:
        """Forget pairs whose retry came due over MAX_RETRY_S ago, and the oldest past MAX_PAIRS.
        Not by their absence from the records: one read without a peer's record (it froze for a
        record's life, or the lookup found nothing during a link blip) cleared its backoff, or
        every pair's, and the failed pairs were all punched again at the next pass (a review)."""
        for peer in [p for p, due in self._next.items() if now - due > self.MAX_RETRY_S]:
            del self._next[peer]
            self._fails.pop(peer, None)
        for peer in sorted(self._next, key=self._next.__getitem__)[:max(0, len(self._next) - self.MAX_PAIRS)]:
            del self._next[peer]
            self._fails.pop(peer, None)

    async def _attempt_once(self, peer: str) -> None:
        """`attempt`, marked as running while it runs; an error in it fails this pair, not the group."""
        try:
            await self.attempt(peer)
        except Exception as exc:  # noqa: BLE001 (announcing a punch failed, say: this pair fails, not the group)
            log.info("hole punch to %s ended in an error: %r", peer[-8:], exc)
        finally:
            self._trying.discard(peer)

    async def attempt(self, peer: str) -> bool:
        """One hole punch to `peer`, through each rendezvous peer until one works; recorded."""
        t0 = time.monotonic()
        reasons = []
        for rdv in self.rendezvous:
            try:
                address = await holepunch.punch_through(self.p2p, self.transport, rdv, peer, scopes=self.scopes)
            except DialFailed as exc:  # the target punched for us and we missed it: wait for the retry
                reasons.append(str(exc))
                break
            except PunchFailed as exc:  # this rendezvous could not introduce us: ask the next one
                reasons.append(str(exc))
                continue
            except Exception as exc:  # the daemon's control socket, say: a failed attempt, backed off
                reasons.append(f"{rdv[-8:]}: {exc!r}"[:MAX_REASON])
                continue
            self._fails.pop(peer, None)
            self.direct.add(peer)
            self._next[peer] = time.monotonic() + 30.0  # look again if the connection drops
            self.attempts.append({"peer": peer, "ok": True, "s": round(time.monotonic() - t0, 3),
                                  "address": address})
            log.info("hole punch to %s: direct connection at %s", peer[-8:], address)
            if self.announce is not None:
                self.announce, announce = None, self.announce
                announce(peer, address)
            return True
        fails = self._fails[peer] = self._fails.get(peer, 0) + 1
        self._next[peer] = time.monotonic() + min(self.RETRY_S * 2 ** min(fails - 1, 8), self.MAX_RETRY_S)
        reason = "; ".join(reasons) or "no rendezvous peer"
        self.attempts.append({"peer": peer, "ok": False, "s": round(time.monotonic() - t0, 3), "reason": reason})
        log.info("hole punch to %s failed: %s", peer[-8:], reason)
        return False
