"""A leader's probes of the trainers it still waits for: one whose process died (a killed
volunteer) is not waited for until the close. `Leading._await_close` runs it beside its wait."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .tasks import gather_owned
from .transport import PeerDead, PeerUnavailable

log = logging.getLogger(__name__)
# Probed once enough others are in, if that many or fewer are still waited for, every slack; one
# that could not be reached at all this many times in a row is not waited for.
PROBED_TRAINERS = 16
DEAD_PROBES = 2


async def drop_dead_trainers(plan: Any, slot: Any, close_at: float, ctx: Any, me: str,
                             waiting_for: Callable[[], tuple[set[str], set[str]]],
                             probe: Callable[[str], Awaitable[PeerUnavailable | None]]) -> None:
    """Until the close: once `ctx.min_peers` trainers are complete, probe every slack those still
    expected that no aggregator holds anything of; one that no stream could be opened to
    `DEAD_PROBES` times in a row (its process and daemon are gone) goes into `slot.gone`, and the
    leader stops waiting for it. `waiting_for()`: (expected, complete) now.

    Without this a volunteer killed while training held every round it was in to its close (and a
    coordinator, a leader that trains nothing, to the same through its stand-ins). A slow, frozen
    or flood-limited one still answers or times out, and is waited for; one that merely failed to
    be dialled twice loses its place in this attempt only (it is told, and keeps its work, as any
    contributor left out)."""
    misses: dict[str, int] = {}
    while time.monotonic() + ctx.slack_s < close_at:
        await asyncio.sleep(ctx.slack_s)
        expected, complete = waiting_for()
        waiting = expected - complete
        if len(complete) < ctx.min_peers or not waiting or len(waiting) > PROBED_TRAINERS:
            continue
        started = {who for held in slot.have.values() for got in held.values() for who in got}
        silent = sorted(waiting - started - {me})  # (we cannot dial ourselves)
        answers = await gather_owned(probe(p) for p in silent)
        for peer, answer in zip(silent, answers, strict=True):
            misses[peer] = misses.get(peer, 0) + 1 if isinstance(answer, PeerDead) else 0
            if misses[peer] >= DEAD_PROBES and peer not in slot.gone:
                log.info("round %d attempt %d: trainer %s cannot be reached (gone): not waited for",
                         plan.round, plan.attempt, peer[-8:])
                slot.gone.add(peer)
                slot.poke()
