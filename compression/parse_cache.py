"""A small cache of parsed sparse payloads, keyed by the identity of their immutable buffers: the
network thread validates a payload by parsing it, and the trainer thread's decode reuses that parse."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .base import Payload


class ParseCache:
    """Parses (CPU positions, values) by payload buffer identity: consumed when used, oldest
    dropped past a budget, which counts the parses and the payload bytes the keys keep alive."""

    def __init__(self, max_bytes: int, max_items: int) -> None:
        self.max_bytes, self.max_items = max_bytes, max_items
        self._items: OrderedDict[tuple[int, ...], tuple[tuple, tuple[torch.Tensor, torch.Tensor], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the trainer thread decodes while the network thread validates

    def put(self, payload: Payload, parsed: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep `parsed` for the next `take` of this very payload (a bytearray-backed one: never)."""
        key = _cache_key(payload)
        if key is None:
            return
        ids = tuple(map(id, key))
        size = _nbytes(parsed) + sum(len(b) for b in key[:4])
        with self._lock:
            if ids in self._items:
                self._pop(ids)
            self._items[ids] = (key, parsed, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._items) > self.max_items:
                self._pop(next(iter(self._items)))

    def take(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept parse of this very payload, removed from the cache; None if there is none."""
        key = _cache_key(payload)
        if key is None:
            return None
        ids = tuple(map(id, key))
        with self._lock:
            entry = self._pop(ids) if ids in self._items else None
        # the kept key holds the very objects, so an id cannot have been reused meanwhile
        if entry is None or not all(a is b for a, b in zip(key, entry[0], strict=True)):
            return None
        return entry[1]

    def _pop(self, ids: tuple[int, ...]) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor], int]:
        entry = self._items.pop(ids)
        self._bytes -= entry[2]
        return entry


def _nbytes(parsed: tuple[torch.Tensor, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parsed)


def _cache_key(payload: Payload) -> tuple | None:
    """Identity key of a payload's content: its immutable bytes objects, shape and params."""
    bufs = tuple(payload.buffers.get(n) for n in ("idx", "code", "scale", "level"))
    if not all(type(b) is bytes for b in bufs):  # a bytearray could change behind our back
        return None
    # ints are compared by identity too, so intern-free values just miss the cache, never hit wrongly
    return (*bufs, payload.shape, payload.params.get("chunk"), payload.params.get("k"))
