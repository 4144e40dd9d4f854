"""The `Exchange` interface between an outer optimizer and whatever moves the bytes.

A round has two halves so that a peer may keep computing while the network works (and so that a
single-threaded driver can run several workers in lockstep): `contribute` hands over this worker's
encoded pseudo-gradient for round r and returns at once; `collect` blocks until the round's
aggregate is known and says exactly which contributions it contains. A round that cannot be
completed raises `RoundFailed`; it is never applied half-done.

`InProcessHub` is the exchange for workers living in one process (``groundswell train-local``);
the swarm exchange over libp2p lives in ``groundswell.peer`` and satisfies the same protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from groundswell.compression import ALIGN, Codec, Payload, aggregate_segments


class RoundFailed(RuntimeError):
    """The round could not be completed (too few contributions, timeout); nothing was applied."""


@dataclass(frozen=True)
class RoundResult:
    """The aggregate of one round as seen by one worker."""

    round_id: int
    mean: torch.Tensor  # mean of the included contributions, decoded, flat fp32
    contributors: tuple[str, ...]  # ids whose contributions are in `mean`, sorted
    included: bool  # is this worker's own contribution in `mean`?
    bytes_sent: int  # bytes this worker put on the wire for this round
    bytes_received: int  # bytes this worker took off the wire for this round
    # Where this worker's contribution entered `mean` scaled down (norm clipping): flat ranges
    # [start, stop) of the parameter vector and the factor, < 1. Empty: whole, wherever included.
    scaled: tuple[tuple[int, int, float], ...] = ()


class Exchange(Protocol):
    """Moves one worker's contribution for a round and returns the round's aggregate."""

    worker_id: str

    def contribute(self, round_id: int, payloads: Sequence[Payload]) -> None:
        """Submit this worker's contribution (one payload per segment) for `round_id`; does not
        block on peers."""
        ...

    def collect(self, round_id: int) -> RoundResult:
        """Block until round `round_id` is aggregated; raise `RoundFailed` if it cannot be."""
        ...


@dataclass
class _RoundSlot:
    payloads: dict[str, list[bytes]]
    result: tuple[torch.Tensor, tuple[str, ...]] | RoundFailed | None = None
    collected: int = 0


class InProcessHub:
    """All-gather exchange for workers in one process: every worker receives every contribution.

    Contributions travel as bytes through `Payload.to_bytes` / strict `from_bytes`, so byte counts
    are real wire sizes and the decoding path is the same one the network uses. `drop` lets tests
    and simulations exclude a worker's contribution from a round to exercise the "not included"
    path; `min_contributors` mirrors the swarm's quorum rule.
    """

    def __init__(
        self,
        codec: Codec,
        worker_ids: Iterable[str],
        *,
        min_contributors: int = 1,
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
    ) -> None:
        self.codec = codec
        self.worker_ids = tuple(worker_ids)
        if len(set(self.worker_ids)) != len(self.worker_ids) or not self.worker_ids:
            raise ValueError("worker ids must be unique and non-empty")
        self.min_contributors = min_contributors
        self.timeout_s = timeout_s
        self.device = device
        self.drop: set[tuple[int, str]] = set()
        self._rounds: dict[int, _RoundSlot] = {}  # the open attempt of each round
        self._mine: dict[tuple[str, int], _RoundSlot] = {}  # (worker, round) -> the attempt it contributed to
        self._cond = threading.Condition()

    def endpoint(self, worker_id: str) -> "InProcessExchange":
        """The `Exchange` a given worker uses."""
        if worker_id not in self.worker_ids:
            raise KeyError(f"unknown worker {worker_id!r}")
        return InProcessExchange(self, worker_id)

    def _contribute(self, worker_id: str, round_id: int, payloads: Sequence[Payload]) -> int:
        data = [p.to_bytes() for p in payloads]
        with self._cond:
            slot = self._rounds.setdefault(round_id, _RoundSlot(payloads={}))
            if slot.result is not None:
                raise RoundFailed(f"round {round_id} is already aggregated; contribution too late")
            if worker_id in slot.payloads:
                raise ValueError(f"worker {worker_id} contributed twice to round {round_id}")
            slot.payloads[worker_id] = data
            self._mine[(worker_id, round_id)] = slot
            self._cond.notify_all()
        return sum(len(b) for b in data)

    def _collect(self, worker_id: str, round_id: int) -> tuple[torch.Tensor, tuple[str, ...], int]:
        with self._cond:
            slot = self._mine.pop((worker_id, round_id), None)
            if slot is None:
                raise RoundFailed(f"round {round_id}: worker {worker_id} did not contribute to it")
            ready = self._cond.wait_for(
                lambda: slot.result is not None or len(slot.payloads) == len(self.worker_ids),
                timeout=self.timeout_s,
            )
            if not ready:
                # The attempt is void for everyone in it: kept, its payloads would go into the
                # aggregate a late worker builds while their owners retry them (counted twice), and
                # a retry would be refused as a second contribution. Its other waiters fail now
                # too (else each would void the next attempt in turn when its own wait ran out);
                # a contribution from now on opens a new attempt.
                slot.result = RoundFailed(f"round {round_id}: not every worker contributed within {self.timeout_s}s")
                slot.payloads.clear()
                if self._rounds.get(round_id) is slot:
                    del self._rounds[round_id]
                self._cond.notify_all()
            if slot.result is None:
                try:
                    slot.result = self._aggregate(round_id, slot.payloads)
                except RoundFailed as exc:
                    slot.result = exc  # every worker of this round must see the same failure
                except ValueError as exc:  # (CodecError too) contributions that do not add up: none applied
                    slot.result = RoundFailed(f"round {round_id}: the contributions do not aggregate: {exc}")
            received = sum(len(b) for w, parts in slot.payloads.items() if w != worker_id for b in parts)
            slot.collected += 1
            result = slot.result
            if slot.collected == len(self.worker_ids) and self._rounds.get(round_id) is slot:
                del self._rounds[round_id]  # every worker has its copy; free the payload bytes
        if isinstance(result, RoundFailed):
            raise RoundFailed(str(result))
        return result[0], result[1], received

    def _aggregate(self, round_id: int, payloads: dict[str, list[bytes]]) -> tuple[torch.Tensor, tuple[str, ...]]:
        included = tuple(sorted(w for w in payloads if (round_id, w) not in self.drop))
        if len(included) < self.min_contributors:
            raise RoundFailed(
                f"round {round_id}: {len(included)} contributions, fewer than the {self.min_contributors} required"
            )
        parsed = [[Payload.from_bytes(b, expect=self.codec) for b in payloads[w]] for w in included]
        numel = sum(p.numel for p in parsed[0])
        segment = parsed[0][0].numel if len(parsed[0]) > 1 else max(numel, 1)
        return aggregate_segments(self.codec, parsed, numel, _round_up(segment), device=self.device), included


class InProcessExchange:
    """One worker's view of an `InProcessHub`."""

    def __init__(self, hub: InProcessHub, worker_id: str) -> None:
        self.hub = hub
        self.worker_id = worker_id
        self._sent: dict[int, int] = {}

    def contribute(self, round_id: int, payloads: Sequence[Payload]) -> None:
        """Submit this worker's contribution for `round_id`."""
        self._sent[round_id] = self.hub._contribute(self.worker_id, round_id, payloads)

    def collect(self, round_id: int) -> RoundResult:
        """Wait for the round's aggregate (every worker must have contributed)."""
        sent = self._sent.pop(round_id, 0)
        mean, contributors, received = self.hub._collect(self.worker_id, round_id)
        return RoundResult(
            round_id=round_id,
            mean=mean,
            contributors=contributors,
            included=self.worker_id in contributors,
            bytes_sent=sent,
            bytes_received=received,
        )


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
