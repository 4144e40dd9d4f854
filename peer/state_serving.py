"""How many peers a node uploads its state to at once over libp2p streams.

A state is the largest thing a run sends (a model's parameters, and DiLoCo's momentum), and in an
open run anyone may ask for it, under as many identities as they like, and read it slowly. So a
node uploads to at most `MAX_UPLOADS` peers at a time over streams, one upload per requester;
the others are told it is busy (a `StateReply` with `busy`), which a joiner takes as "ask again
later, or ask another peer", never as "this peer has nothing newer". Downloads over the direct
TCP port have their own bound (`protocol/direct.py`).
"""

from __future__ import annotations

from collections.abc import Callable

MAX_UPLOADS = 4  # a home uplink shared by more is slower for every joiner than taking turns


class UploadSlots:
    """At most `total` uploads at once, at most one per requester."""

    def __init__(self, total: int = MAX_UPLOADS) -> None:
        if total < 1:
            raise ValueError(f"upload slots must be at least 1, got {total}")
        self.total = total
        self._holders: dict[str, int] = {}  # requester -> its upload's ticket
        self._next = 0
        self.refused = 0  # requests answered "busy"

    @property
    def in_use(self) -> int:
        """Uploads running now."""
        return len(self._holders)

    def take(self, peer: str) -> Callable[[], None] | None:
        """A slot for `peer`'s upload and the function that frees it (idempotent), or None if
        every slot is taken or `peer` already has one."""
        if peer in self._holders or len(self._holders) >= self.total:
            self.refused += 1
            return None
        self._next += 1
        ticket = self._holders[peer] = self._next

        def release() -> None:
            if self._holders.get(peer) == ticket:
                del self._holders[peer]

        return release
