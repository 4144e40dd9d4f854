"""Contributions whose outcome is not known yet: what is kept of each, how a checkpoint or a work
record stores them, and how one is settled late (did the round's commit count it?).

A contribution is unsettled when its round was settled without this peer learning whether the
commit counted it: no leader answered, its attempt was retried (a later attempt may still adopt
it), or the process stopped with it in flight. Its work stays ours until it is settled: counted,
it comes out of our error feedback; not counted, it goes out again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from groundswell.protocol.claims import EARLIER_ATTEMPTS_CLAIMED
from groundswell.protocol.envelope import unseal
from groundswell.protocol.schema import Decision, ProtocolError
from groundswell.protocol.tasks import gather_owned
from groundswell.protocol.transport import PeerUnavailable

from .catch_up import catch_up_view, holders_to_ask

if TYPE_CHECKING:
    from .swarm import SwarmNode

log = logging.getLogger(__name__)
# Contributions of unknown outcome kept open at most: a round's retried attempts a later claim may
# still adopt, and a couple of earlier rounds' (a checkpoint and a work record list as many).
KEEP_UNSETTLED = EARLIER_ATTEMPTS_CLAIMED + 2
ASK_HOLDERS = 3  # peers asked for a round's commit when checking a contribution's outcome late


@dataclass
class Unsettled:
    """A contribution whose round was settled without knowing whether a commit counted it."""

    round_id: int
    segments: list[bytes]  # the payloads as sent: a commit counts them if it pins their digests
    included: bool | None  # None: unknown until the round's commit is known here
    prepared: int  # `SwarmExchange.prepared` when it was contributed
    retried: bool = False  # its attempt was decided "retry" (see `SwarmExchange._outcome`)
    # What to take if the commit cannot be found or checked. True only for the last contribution a
    # crashed process sent, outcome unknown (see work_file): it most likely counted, and taking it
    # out loses at most its sent part, where keeping it would send that work a second time.
    if_unknown: bool = False
    # The signed commit of the round before, which this round was planned from (b"": not known):
    # checking the round's commit needs it, and a restart that took a later state lacks it.
    basis: bytes = b""


def unsettled_item(round_id: int, segments: list[bytes], decayed: int, included: bool | None = None,
                   retried: bool = False, presume: bool = False, basis: bytes = b"") -> dict[str, Any]:
    """An unsettled contribution as a checkpoint or work.pt stores it (`decayed`: contributions
    prepared after it, each of which decayed SparseLoCo's error feedback; `presume`: its
    `Unsettled.if_unknown`; `basis`: its `Unsettled.basis`)."""
    # (None, not b"": torch.load with weights_only refuses an empty bytes object)
    return {"round": round_id, "segments": list(segments), "decayed": decayed, "included": included,
            "retried": retried, "presume": presume, "basis": basis or None}


_ITEM_KEYS = {"round", "segments", "decayed", "included", "retried", "presume"}


def parse_unsettled(items: Any) -> list[dict[str, Any]]:
    """`unsettled_item`s read back from a file, checked strictly; ValueError if they are malformed."""
    if not isinstance(items, list | tuple):
        raise ValueError("the list of unsettled contributions is not a list")  # noqa: TRY004 (one error type for callers)
    parsed = []
    for i in items:
        # (files of versions before `basis` lack it: their contributions are checked as before)
        ok = isinstance(i, dict) and set(i) in (_ITEM_KEYS, _ITEM_KEYS | {"basis"}) \
            and type(i.get("basis")) in (type(None), bytes) and all(type(i[k]) is int and i[k] >= 0 for k in ("round", "decayed")) \
            and isinstance(i["segments"], list) and all(type(s) is bytes for s in i["segments"]) \
            and type(i["included"]) in (type(None), bool) \
            and type(i["retried"]) is bool and type(i["presume"]) is bool
        if not ok:
            raise ValueError("malformed list of unsettled contributions")
        parsed.append(unsettled_item(i["round"], i["segments"], i["decayed"], i["included"], i["retried"],
                                     i["presume"], i.get("basis") or b""))
    return parsed


def keep_newest(unsettled: list[Unsettled], limit: int = KEEP_UNSETTLED) -> None:
    """Trim `unsettled` (in place) to `limit`. A peer failing round after round keeps the newest
    few, forgetting retried ones first (a retry is its leader's word that the contribution is in
    nothing), then the oldest of unknown outcome; never one a commit is known (or, for a crashed
    process's last one, presumed) to have counted: forgotten, its work would stay ours and go out
    a second time."""
    while len(unsettled) > limit:
        dropped = next((u for u in unsettled if u.retried),
                       next((u for u in unsettled if u.included is None and not u.if_unknown), None))
        if dropped is None:  # all counted, or presumed so (`if_unknown`): each must come out of our work
            return
        unsettled.remove(dropped)
        (log.info if dropped.retried else log.warning)(
            "round %d: forgot a contribution whose outcome was not learned; its work stays ours", dropped.round_id)


async def commit_counts(node: SwarmNode, round_id: int, segments: list[bytes], basis: bytes = b"") -> bool | None:
    """Did round `round_id`'s commit count these segments? The commit is asked of a few peers
    that applied the round if this peer does not hold it (it took a later state meanwhile).
    Bounded by one request timeout (ask_decision answers b"" on any failure). `basis`: the
    contribution's `Unsettled.basis`. None: not known here (no holder had it, or it could not be
    checked). PeerUnavailable: every holder asked failed on the way (ask again later)."""
    book, client = node.book, node.client
    if book is None or client is None:
        return None
    # Asked of a few peers that applied the round, at once; a commit is checked against the plan
    # the round before's commit gives (still in the book unless the peer took a later state: then
    # the one our contribution was planned from, which we checked back then) and goes into the
    # book (ask_decision).
    if round_id not in book.committed:
        if basis and book.membership(round_id) is None:
            _add_basis(node, round_id, basis)
        # ranked as catch-up ranks them (the coordinator, then peers it vouches for; none whose
        # record claims a round far past the coordinator's): three made-up records first in the
        # cache left the outcome unknown, and a counted contribution's work went out again
        coordinator, records = node.options.coordinator or "", node.cached_records
        view = catch_up_view(records, node.identity.peer_id, coordinator)
        holders = node.holders(round_id)
        # (a holder whose record we have not read comes after those)
        ask = [*holders_to_ask(view, holders, coordinator), *(p for p in holders if p not in records)]
        ask = ask[:ASK_HOLDERS]
        if not records and not ask:
            # No record read yet (the first lookup after a restart timed out, say): nobody could
            # be picked to ask, which is no answer either. Taken for "not known here", a counted
            # contribution's work was kept and sent a second time (a review).
            raise PeerUnavailable(f"no peer records read yet to ask for round {round_id}'s commit")
        answered = await gather_owned(_asked(client, peer, round_id) for peer in ask)
        if round_id not in book.committed and ask and not any(answered):
            # Every ask failed on the way: that is no answer ("none" is one), and the check is
            # made again at the next settle. Taken for "not known here", a counted contribution's
            # work was kept and sent a second time. (Nobody to ask at all is "not known here": a
            # restart that took a later state, with no holder left.)
            raise PeerUnavailable(f"no holder of round {round_id} could be asked for its commit "
                                  f"({len(ask)} tried)")
    committed = book.committed.get(round_id)
    if committed is None:
        return None
    return await client.counts_ours(committed[1], segments)


async def _asked(client: Any, peer: str, round_id: int) -> bool:
    """Did `peer` answer (with the round's commit, without one, or with one we cannot check here:
    a later ask would get the same)?"""
    try:
        await client.ask_decision(peer, round_id, 0, 0.0, strict=True)
        return True
    except PeerUnavailable:
        return False
    except ProtocolError:
        return True


def _add_basis(node: SwarmNode, round_id: int, basis: bytes) -> None:
    """Put the commit round `round_id` was planned from back into the book (on the network loop)."""
    book = node.book
    assert book is not None
    try:  # (ours, from our own file: its signature and round are checked all the same)
        _, decision = unseal(basis, book.run_id, Decision)
        if decision.round != round_id - 1:
            raise ProtocolError(f"it is round {decision.round}'s")
        book.add(basis)
    except ProtocolError as exc:
        log.warning("round %d: the stored commit it was planned from is not usable: %s", round_id, exc)
