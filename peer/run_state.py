"""What a run is to a peer: its round context (from the verified manifest), the global state a
joiner downloads, and the hash of the shared outer state peers publish every round."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from groundswell.compression import Codec, RobustOptions
from groundswell.protocol.digests import bulk_hasher
from groundswell.protocol.envelope import sealed_message
from groundswell.protocol.guard import Limits
from groundswell.protocol.schema import Decision

from .state_blob import pack_tensors, unpack_tensors


def _raw(vector: torch.Tensor) -> memoryview:
    return memoryview(vector.detach().cpu().contiguous().numpy()).cast("B")


def params_hash(vector: torch.Tensor) -> str:
    """Short BLAKE3 hash of a flat parameter vector, bit for bit."""
    return bulk_hasher().update(_raw(vector)).hexdigest()[:16]


def state_hash(decision: bytes, global_params: torch.Tensor, momentum: torch.Tensor | None = None) -> str:
    """The hash peers publish every round: of the outer state every peer shares, bit for bit. That
    is the global parameters, for DiLoCo the outer momentum buffer (the same on every peer, as it
    only ever sees the same aggregates), so a wrong momentum is caught like wrong parameters, and
    the commit of the round before (`decision`, signed: its message, not its envelope), which the
    next round is planned from: a server handing out the true tensors with a commit of its own
    making (itself as the only leader, say) is caught like a wrong tensor. SparseLoCo's error
    feedback is each peer's own, not shared state."""
    hasher = bulk_hasher().update(_raw(global_params))
    if momentum is not None:
        hasher.update(b"\0momentum_buffer\0").update(_raw(momentum))
    hasher.update(b"\0decision\0").update(sealed_message(decision, Decision))
    # All 256 bits (64 hex digits; 16, until protocol 18): the decision is hashed last, so a
    # leader could vary its commit's time over one hashed copy of the parameters, and find two
    # states of one 64-bit hash in ~2^32 short hashes (a review): the coordinator's word for the
    # true state would then vouch for a poisoned one.
    return hasher.hexdigest()


@dataclass
class RunContext:
    """The `RoundContext` of one run, built from the verified manifest."""

    run_id: str
    min_peers: int
    deadline_s: float
    slack_s: float
    max_shards: int
    segment_numels: tuple[int, ...]
    codec: Codec
    max_payload_bytes: int
    allowlist: frozenset[str] | None = None  # None: open run
    robust: RobustOptions = field(default_factory=RobustOptions)
    limits: Limits = field(default_factory=Limits)
    state_readers: frozenset[str] | None = None  # None: anyone may download the state
    verify_aggregates: bool = False  # dense codecs: ship signed contributions, not the aggregator's mean
    replicas: int | None = None  # copies of each shard beyond the first; None: 1 for dense codecs, 2 for sparse
    coordinator: str = ""  # its peer id: in a closed run it serves whether or not the allowlist names it

    def authorized(self, peer_id: str) -> bool:
        """Open runs take anyone; allowlisted runs only listed peer ids."""
        return self.allowlist is None or peer_id in self.allowlist

    def may_serve(self, peer_id: str) -> bool:
        """May this peer take roles? In a closed run only its listed peers and its coordinator:
        a leader signs commits and an aggregator builds means, which strangers must not."""
        return self.authorized(peer_id) or (bool(self.coordinator) and peer_id == self.coordinator)

    def may_read_state(self, peer_id: str) -> bool:
        """May this peer download the run's state?"""
        return self.state_readers is None or peer_id in self.state_readers


@dataclass
class GlobalState:
    """What a joiner downloads: the next round, the outer optimizer's shared state, the plan."""

    round: int
    tensors: dict[str, torch.Tensor]  # "global_params" and any shared outer state (momentum)
    decision: bytes  # signed decision of round - 1
    _blob: tuple[bytes, str] | None = None  # serialized once, on the first request of this round
    _state_hash: str = ""  # likewise
    # Its decision conflicts with the commit our book holds, and the coordinator vouches for the
    # state: taken, the book's commit (and what followed it) is replaced by this one.
    supersedes: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def to_blob(self) -> bytes:
        """Serialize the tensors (raw fp32 behind a small header, see `state_blob`)."""
        return pack_tensors(self.tensors)

    def blob_and_digest(self) -> tuple[bytes, str]:
        """The serialized state and its BLAKE3 digest (hex), computed once per snapshot (joiners
        share it); thread-safe, so a server can build it off its network loop."""
        with self._lock:
            if self._blob is None:
                blob = self.to_blob()
                self._blob = (blob, bulk_hasher().update(blob).hexdigest())
            return self._blob

    def build(self) -> None:
        """Compute the blob, its digest and the state hash now (a server does so off its loop)."""
        self.blob_and_digest()
        self.state_digest()

    def built(self) -> bool:
        """Are the blob and the state hash computed already (`build` would return at once)?"""
        return self._blob is not None and bool(self._state_hash)

    def state_digest(self) -> str:
        """`state_hash` of the state (parameters, momentum if any, decision), computed once per snapshot."""
        if not self._state_hash:
            self._state_hash = state_hash(self.decision, self.tensors["global_params"],
                                          self.tensors.get("momentum_buffer"))
        return self._state_hash

    @staticmethod
    def tensors_from_blob(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
        """The tensors of a blob (views of it if it is a bytearray); ProtocolError if malformed."""
        return unpack_tensors(blob)
