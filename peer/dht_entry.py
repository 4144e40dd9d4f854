"""Entering the run's DHT at start: through the bootstrap peers, pinged again while they are
busy, and with every one of them down or silent, through the run's proven peers the node knew
(the coordinator, peers named in commits: `DhtRejoiner.proven_targets`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from groundswell.protocol.tasks import gather_owned

from .dht_rejoin import DhtRejoiner

log = logging.getLogger(__name__)

BOOTSTRAP_S = 25.0  # how long a start pings its bootstrap peers before it gives up


async def enter_dht(dht: Any, initial_peers: Sequence[str], within_s: float | None = None,
                    pause_s: float = 2.0, coordinator: str = "") -> list[str]:
    """Ping the bootstrap peers into `dht`'s routing table (validated: hivemind's checks of the
    clock and of our reachability raise as in its own bootstrap) and look up our neighbours.
    hivemind pings once, for 3 s: a bootstrap peer busy for a moment (applying a round on a small
    machine) failed our start. Here the pings are repeated for `within_s`; RuntimeError with
    hivemind's words if none ever answers; the ids of those that let us in. A refusal (our clock
    too far off, or we cannot be reached back) ends the start if `coordinator` refused, or if no
    more peers let us in than refused us; otherwise it is one peer's word (its own clock may be
    off) and the others decide."""
    from hivemind.p2p import PeerID

    from .bootstrap import peer_id_of

    within_s = BOOTSTRAP_S if within_s is None else within_s
    protocol = dht.protocol
    peers = {peer_id_of(m): PeerID.from_base58(peer_id_of(m)) for m in initial_peers}
    refused: dict[str, BaseException] = {}
    answered: set[str] = set()
    give_up = time.monotonic() + within_s
    while True:
        asking = [pid for pid in peers if pid not in refused and pid not in answered]
        # each ping is bounded by the DHT's own request timeout (3 s); gathered, none is left behind
        answers = await asyncio.gather(*(protocol.call_ping(peers[pid], validate=True, strict=True) for pid in asking),
                                       return_exceptions=True)
        for pid, answer in zip(asking, answers):
            if isinstance(answer, BaseException):
                refused[pid] = answer
            elif answer is not None:
                answered.add(pid)
        if coordinator in refused:
            raise refused[coordinator]
        if answered and len(answered) > len(refused):
            if refused:
                log.warning("a bootstrap peer refused us (%s); more of them let us in", next(iter(refused.values())))
            break
        if refused and len(refused) + len(answered) == len(peers):  # all have spoken: no majority lets us in
            raise next(iter(refused.values()))
        if time.monotonic() + pause_s >= give_up:
            if refused:
                raise next(iter(refused.values()))
            raise RuntimeError(f"DHTNode bootstrap failed: none of the initial_peers responded to a ping "
                               f"in {within_s:g} s")
        log.warning("the bootstrap peers' DHT did not answer; asking again")
        await asyncio.sleep(pause_s)
    try:  # (hivemind bounds this step by its bootstrap timeout too; here, what is left of ours)
        async with asyncio.timeout(max(give_up - time.monotonic(), 3.0)):
            await dht.find_nearest_nodes([dht.node_id])
    except TimeoutError:
        log.info("looking up our DHT neighbours took too long; going on")
    return [pid for pid in peers if pid in answered]


async def dial_known(p2p: Any, targets: Sequence[tuple[str, list[str]]], timeout_s: float = 5.0) -> list[str]:
    """Open libp2p connections to `targets` (peer id, plain addresses), all at once, each bounded;
    the ids of those that connected (one that does not costs only itself)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def dial(pid: str, addrs: list[str]) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await p2p._client.connect(PeerID.from_base58(pid), [Multiaddr(a) for a in addrs])
            return True
        except Exception as exc:  # noqa: BLE001 (down, unreachable, or a malformed file entry)
            log.info("dialling known peer %s: %r", pid[-8:], exc)
            return False

    connected = await gather_owned(dial(pid, addrs) for pid, addrs in targets)
    return [pid for (pid, _), ok in zip(targets, connected) if ok]


async def enter_dht_through_proven(p2p: Any, dht: Any, rejoiner: DhtRejoiner, coordinator: str = "",
                                   give_up_at: float = math.inf) -> list[str]:
    """Enter the DHT through the proven peers `rejoiner` keeps (the coordinator, peers named in
    commits: from the state dir's known_peers.json, or a stopped node's memory), for a start whose
    bootstrap peers are all down: a volunteer restarted while the coordinator, often its only
    bootstrap peer, was away stayed out of a run that went on without it. The ids of those that
    answered, or NetworkError if none lets us in (by `give_up_at`, monotonic: BOOTSTRAP_S at most).
    They are not made bootstrap peers: those become relays and punch inviters."""
    from .net_errors import NetworkError

    targets = rejoiner.proven_targets()
    if not targets:
        raise NetworkError("none of the bootstrap peers answered, and no peer of the run is known from before "
                           "(known_peers.json): is the run up, and is the address right?")
    log.warning("no bootstrap peer answered: entering the run's DHT through %d peer(s) known from before",
                len(targets))
    await dial_known(p2p, targets)
    try:
        return await enter_dht(dht, [f"{addrs[0]}/p2p/{pid}" for pid, addrs in targets], _within(give_up_at),
                               coordinator=coordinator)
    except RuntimeError as exc:
        if "none of the initial_peers responded" not in str(exc):  # a refusal (our clock...): its own words
            raise
        raise NetworkError(f"none of the bootstrap peers answered, nor any of the {len(targets)} peer(s) of the run "
                           f"known from before ({exc}): is the run up? Start again in a moment") from None


async def enter_run_dht(p2p: Any, dht: Any, rejoiner: DhtRejoiner, initial_peers: Sequence[str], coordinator: str,
                        bootstrap_down: bool, bootstrap_silent: bool, give_up_at: float) -> list[str]:
    """A start's entry into the run's DHT (none: the first peer of a run, alone so far): through
    the bootstrap peers, else (`bootstrap_down`: p2pd reached none of them; or their DHT did not
    answer within BOOTSTRAP_S) through the proven peers, each step within what is left until
    `give_up_at` (monotonic; the start's own limit). With `bootstrap_silent` (connected, but
    no dial-back probe answered: frozen?) both are pinged together, and the wait for the silent
    ones does not come first. The proven peers it entered through (empty: a bootstrap peer let
    it in)."""
    if bootstrap_down:
        return await enter_dht_through_proven(p2p, dht, rejoiner, coordinator, give_up_at)
    if not initial_peers:
        return []
    bootstrap = [str(m).rpartition("/p2p/")[2] for m in initial_peers]
    proven = rejoiner.proven_targets()
    if bootstrap_silent and proven:
        connected = set(await dial_known(p2p, proven))
        with_proven = [*initial_peers, *(f"{addrs[0]}/p2p/{pid}" for pid, addrs in proven if pid in connected)]
        answered = await enter_dht(dht, with_proven, _within(give_up_at), coordinator=coordinator)
        return [] if set(answered) & set(bootstrap) else answered
    try:
        await enter_dht(dht, initial_peers, _within(give_up_at), coordinator=coordinator)
    except RuntimeError as exc:  # connected, but no DHT answer (a frozen coordinator)
        if "none of the initial_peers responded" not in str(exc) or not proven:
            raise
        return await enter_dht_through_proven(p2p, dht, rejoiner, coordinator, give_up_at)
    return []


def _within(give_up_at: float) -> float:
    """BOOTSTRAP_S, or what is left until `give_up_at` if less (2 s at least: one ping round)."""
    return max(min(BOOTSTRAP_S, give_up_at - time.monotonic()), 2.0)
