"""Catching up: how far past this peer the swarm is, whom to ask for the decisions of the rounds
it missed, and the first decision they hand over. Peer records are self-signed: where the
coordinator's record says where the run is, records far past it (sybils, in an open run) are
nobody to ask, and fewer than half of the others are no reason to ask anyone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .state_trust import COORDINATOR_LAG_ROUNDS, UNCONFIRMED_LEAD, record_hashes

CATCH_UP_ASKS = 3  # peers asked at once for the decision of a round this peer catches up on


@dataclass(frozen=True)
class CatchUpView:
    """What the records say: the round to catch up to, the swarm's round (for "too far behind to
    catch up"), and the records that may be asked, with the (round, hash) pairs the coordinator vouches for."""

    target: int
    swarm_round: int
    records: dict[str, Any]
    vouched: frozenset[tuple[int, str]]


def catch_up_view(records: dict[str, Any], me: str, coordinator: str) -> CatchUpView:
    """`CatchUpView` of the peer records as read (ours and, unless we are it, the coordinator's among them)."""
    signer = records.get(coordinator) if coordinator != me else None
    ceiling = signer.round + UNCONFIRMED_LEAD if signer is not None else float("inf")
    records = {pid: r for pid, r in records.items() if r.round <= ceiling}
    # The round at least half of the other peers have reached: one record claiming a far-off
    # round must not send everyone re-syncing, nor a few make everyone ask them after each round.
    others = sorted((r.round for pid, r in records.items() if pid != me), reverse=True)
    swarm_round = others[(len(others) - 1) // 2] if others else 0
    if signer is None:  # (the coordinator away, or we are it): where at least half of the others are
        # (the furthest record was the target: one made-up record of round 2**40 had every peer ask
        # its silent signer after each round, and wait out a request for it; a review found)
        return CatchUpView(swarm_round, swarm_round, records, frozenset())
    # Up to where the coordinator is, or where most peers are (it may lag); and half the records,
    # made up, must not send us re-syncing: it lags by a heartbeat or two only.
    return CatchUpView(max(signer.round, swarm_round), min(swarm_round, signer.round + COORDINATOR_LAG_ROUNDS),
                       records, frozenset(record_hashes(signer).items()))


def holders_to_ask(view: CatchUpView, holders: list[str], coordinator: str) -> list[str]:
    """The few of a round's holders to ask: the coordinator, then the peers whose state it vouches for."""
    known = [p for p in holders if p in view.records]
    ranked = sorted(known, key=lambda p: (p != coordinator,
                                          (view.records[p].round, view.records[p].params_hash) not in view.vouched))
    return ranked[:CATCH_UP_ASKS]


async def first_decision(client: Any, peers: list[str], round_id: int) -> bytes:
    """The first signed decision of `round_id` any of `peers` hands over (asked at once: a silent
    one costs one request's timeout, not one each; the others are cancelled then), b"" if none."""
    tasks = [asyncio.ensure_future(client.ask_decision(peer, round_id, 0, 0.0)) for peer in peers]
    try:
        for answer in asyncio.as_completed(tasks):
            if signed := await answer:
                return signed
        return b""
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
