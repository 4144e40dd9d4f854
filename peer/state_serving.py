"""Serving the run manifest and the global state to joiners, and how many peers a node uploads
its state to at once over libp2p streams.

A state is the largest thing a run sends (a model's parameters, and DiLoCo's momentum), and in an
open run anyone may ask for it, under as many identities as they like, and read it slowly. So a
node uploads to at most `MAX_UPLOADS` peers at a time over streams, one upload per requester;
the others are told it is busy (a `StateReply` with `busy`), which a joiner takes as "ask again
later, or ask another peer", never as "this peer has nothing newer". Downloads over the direct
TCP port have their own bound (`protocol/direct.py`); a request for one is answered busy too
when every ticket open to its requester is out.

One slot is kept for peers that did real work: contributors named in the commits this node
holds (a volunteer coming back after a restart or an outage, usually). Sybils can take the other
slots by asking under fresh identities and reading slowly, but not that one; likewise a share of
the direct port's tickets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from groundswell.protocol.schema import ManifestReply, ManifestRequest, StateReply, StateRequest
from groundswell.protocol.transport import WithTrailer

MAX_UPLOADS = 4  # a home uplink shared by more is slower for every joiner than taking turns
KEPT_FOR_CONTRIBUTORS = 1  # of those, slots only peers named in our commits as contributors may take


class UploadSlots:
    """At most `total` uploads at once, at most one per requester; `kept` of them only for
    requesters the caller vouches for."""

    def __init__(self, total: int = MAX_UPLOADS, kept: int = KEPT_FOR_CONTRIBUTORS) -> None:
        if total < 1 or not 0 <= kept < total:
            raise ValueError(f"upload slots must be at least 1, fewer of them kept, got {total} and {kept}")
        self.total, self.kept = total, kept
        self._holders: dict[str, tuple[int, bool]] = {}  # requester -> its upload's ticket, vouched for
        self._next = 0
        self.refused = 0  # requests answered "busy"

    @property
    def in_use(self) -> int:
        """Uploads running now."""
        return len(self._holders)

    def take(self, peer: str, vouched: bool = False) -> Callable[[], None] | None:
        """A slot for `peer`'s upload and the function that frees it (idempotent), or None if
        every slot open to it is taken (`vouched`: the kept ones are open to it too) or `peer`
        already has one."""
        strangers = sum(not v for _, v in self._holders.values())
        if peer in self._holders or len(self._holders) >= self.total or (
                not vouched and strangers >= self.total - self.kept):
            self.refused += 1
            return None
        self._next += 1
        ticket = self._holders[peer] = (self._next, vouched)

        def release() -> None:
            if self._holders.get(peer) == ticket:
                del self._holders[peer]

        return release


class StateServing:
    """The manifest and state handlers of `SwarmNode`, which mixes this in; needs its ctx, guard,
    book, direct, uploads, signed_manifest and state_provider."""

    ctx: Any
    guard: Any
    book: Any
    direct: Any
    uploads: UploadSlots
    state_building: asyncio.Lock
    signed_manifest: bytes
    state_provider: Callable[[], Any]

    async def _on_manifest(self, sender: str, msg: ManifestRequest) -> ManifestReply:
        return ManifestReply(self.signed_manifest)

    async def _on_state(self, sender: str, msg: StateRequest) -> StateReply | WithTrailer:
        if self.ctx is not None and not self.ctx.may_read_state(sender):
            self.guard.count(sender, "get-state", "unauthorized", strike=True)
            return StateReply(-1, "", b"", 0)
        state = self.state_provider()
        if state is None or state.round < msg.min_round:
            return StateReply(-1, "", b"", 0)
        direct = msg.direct and self.direct is not None  # the direct port bounds its own downloads
        vouched = self._contributed(sender)
        release = None if direct else self.uploads.take(sender, vouched=vouched)
        if not direct and release is None:
            self.guard.count(sender, "get-state", "busy", strike=False)
            return StateReply(-1, "", b"", 0, busy=True)
        try:
            # once per round, shared by every joiner; off the loop: packing and hashing a big model's
            # state takes seconds, which heartbeats and round messages must not wait for. One build
            # at a time, the other requesters waiting on the loop: each waiting in a worker thread
            # of its own (a joiner's each, anyone's in an open run) held up the round's work there.
            if not state.built():
                async with self.state_building:
                    if not state.built():  # (built while we waited our turn)
                        await asyncio.to_thread(state.build)
            blob, digest = state.blob_and_digest()
            params_hash = state.state_digest()
        except BaseException:
            if release is not None:
                release()
            raise
        # The signed reply carries the blob's size and BLAKE3 digest; the blob follows as a raw
        # trailer (its upload slot freed once it is written), or, if asked, sealed over a direct
        # TCP connection (the key is in this reply, which only the requester can read: a closed
        # run's state stays among its readers).
        if direct:
            offered = self.direct.offer(blob, sender, vouched=vouched)
            if offered is not None:
                token, key = offered
                return WithTrailer(StateReply(state.round, digest, state.decision, len(blob), self.direct.port,
                                              token, key, params_hash=params_hash), b"")
            # Its tickets are all out (pushing one out would flush a joiner's): over the stream
            # then, if an upload slot is free (the joiner takes a trailer as readily), else busy.
            release = self.uploads.take(sender, vouched=vouched)
            if release is None:
                self.guard.count(sender, "get-state", "busy", strike=False)
                return StateReply(-1, "", b"", 0, busy=True)
        return WithTrailer(StateReply(state.round, digest, state.decision, len(blob), params_hash=params_hash),
                           blob, release)

    def _contributed(self, peer: str) -> bool:
        """Is `peer` a contributor in one of the commits our book holds (it did real work)?"""
        book = self.book
        return book is not None and any(peer in decision.contributors for _, decision in book.committed.values())
