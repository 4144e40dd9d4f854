"""How many peers a node uploads its state to at once over libp2p streams.

A state is the largest thing a run sends (a model's parameters, and DiLoCo's momentum), and in an
open run anyone may ask for it, under as many identities as they like, and read it slowly. So a
node uploads to at most `MAX_UPLOADS` peers at a time over streams, one upload per requester;
the others are told it is busy (a `StateReply` with `busy`), which a joiner takes as "ask again
later, or ask another peer", never as "this peer has nothing newer". Downloads over the direct
TCP port have their own bound (`protocol/direct.py`).

One slot is kept for peers that did real work: contributors named in the commits this node
holds (a volunteer coming back after a restart or an outage, usually). Sybils can take the other
slots by asking under fresh identities and reading slowly, but not that one.
"""

from __future__ import annotations

from collections.abc import Callable

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
