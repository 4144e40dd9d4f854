"""A checkpoint's own check of its contents: a BLAKE3 digest written inside it, and the shape and
finiteness of what a restart would train on.

`torch.load` notices a truncated or garbled file, not a flipped byte inside a tensor's data: that
loads, with one value changed (a NaN, if an exponent bit flipped), and a coordinator would serve
it to every joiner. So a checkpoint carries a digest of everything in it, and one that does not
match is skipped like an unreadable one (the next older one, or the swarm, takes its place).
Checkpoints written before the digest existed are still read, checked for shape and NaN alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from blake3 import blake3
from groundswell.compression import all_finite

DIGEST_KEY = "digest"


def checkpoint_digest(state: Mapping[str, Any]) -> str:
    """BLAKE3 (hex) of a checkpoint's contents, the digest key itself left out: every tensor's
    dtype, shape and bytes and every other value's type and repr, dicts in key order."""
    h = blake3()
    _feed(h, {k: v for k, v in state.items() if k != DIGEST_KEY})
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)};".encode())
        h.update(t.view(torch.uint8).numpy())
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)};".encode())
        for key in sorted(obj, key=repr):
            _feed(h, key)
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)};".encode())
        for item in obj:
            _feed(h, item)
    elif isinstance(obj, (bytes, bytearray)):
        h.update(f"B{len(obj)};".encode())
        h.update(obj)
    else:
        text = f"{type(obj).__name__}:{obj!r}"
        h.update(f"S{len(text)};{text}".encode())


# Every key a checkpoint of this program has held: one written before checkpoints carried a digest
# holds no other, so a file with none and another key is a digest whose name a flipped bit changed.
CHECKPOINT_KEYS = frozenset({"round", "tensors", "decision", "outer", "inner", "unsettled", "settled", "work",
                             "local_progress", "peer", DIGEST_KEY})


def digest_mismatch(state: Any) -> str | None:
    """Why a loaded checkpoint is damaged by its own digest (None: it matches, or it is of a
    version that wrote none)."""
    if not isinstance(state, dict):
        return "not a checkpoint"
    digest = state.get(DIGEST_KEY)
    if digest is None:
        strange = sorted(str(k) for k in state if k not in CHECKPOINT_KEYS)
        return f"it has no digest, and keys no checkpoint has ({', '.join(strange)[:80]})" if strange else None
    if digest != checkpoint_digest(state):
        return "its contents do not match its digest"
    return None


def checkpoint_layout(state: dict[str, Any]) -> str | None:
    """Why a checkpoint's values are not of the types this program writes (None: they are). The
    digest is no key: a checkpoint copied in from elsewhere (a volunteer's) may be made up whole,
    and one with a round that is a string or an optimizer state that is a list was taken half."""
    kinds = {"round": (int,), "peer": (str,), "tensors": (dict,), "decision": (bytes,), "outer": (dict, type(None)),
             "inner": (dict, type(None)), "unsettled": (list,), "work": (str, type(None)),
             "local_progress": (torch.Tensor,)}
    for key, allowed in kinds.items():
        if key in state and type(state[key]) not in allowed:
            return f"its {key} is a {type(state[key]).__name__}"
    if "round" not in state or state["round"] < 0:
        return "it has no round number"
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.get("tensors", {}).items()):
        return "its tensors are not named tensors"
    outer = state.get("outer")
    if isinstance(outer, dict) and outer.get("algorithm") == "sparseloco" and "error" not in outer:
        return "its SparseLoCo state has no error feedback"  # (taken, it was a KeyError at resume)
    return None


def checkpoint_damage(state: dict[str, Any], numel: int) -> str | None:
    """Why a checkpoint of this run and model must not be used (None: it may): parameters, error
    feedback, momentum or local progress that are not finite fp32 vectors of the model's size."""
    tensors = state.get("tensors")
    outer = state.get("outer")
    vectors = {"global parameters": tensors.get("global_params") if isinstance(tensors, dict) else None,
               "error feedback": outer.get("error") if isinstance(outer, dict) else None,
               "momentum": tensors.get("momentum_buffer") if isinstance(tensors, dict) else None,
               "local progress": state.get("local_progress")}
    for name, value in vectors.items():
        if value is None and name != "global parameters":
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or tuple(value.shape) != (numel,):
            return f"its {name} are not a vector of {numel:,} fp32 values"  # (a (10, 1) one failed later)
        if not all_finite(value):
            return f"its {name} are not all finite"
    return None
