"""Codec names -> codec instances, from local options or from an (untrusted) payload's params."""

from __future__ import annotations

from collections.abc import Callable

from .base import Codec, CodecError, Payload
from .dense import DenseCodec
from .int8 import Int8Codec, check_int8_options
from .sparseloco import SparseLoCoCodec, check_sparseloco_options

CODEC_NAMES: tuple[str, ...] = ("sparseloco", "int8", "fp16", "bf16", "fp32")

_OPTIONS: dict[str, frozenset[str]] = {
    "sparseloco": frozenset({"chunk", "k"}),
    "int8": frozenset({"block"}),
    "fp16": frozenset(),
    "bf16": frozenset(),
    "fp32": frozenset(),
}


def _build(name: str, options: dict[str, object]) -> Codec:
    if name == "sparseloco":
        return SparseLoCoCodec(**options)  # type: ignore[arg-type]
    if name == "int8":
        return Int8Codec(**options)  # type: ignore[arg-type]
    return DenseCodec(name)


def make_codec(name: str, **options: object) -> Codec:
    """Build a codec by name: sparseloco(chunk=4096, k=64), int8(block=128), fp16, bf16, fp32."""
    if name not in _OPTIONS:
        raise CodecError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    unknown = set(options) - _OPTIONS[name]
    if unknown:
        raise CodecError(
            f"codec {name!r} takes no option(s) {sorted(unknown)}; it knows {sorted(_OPTIONS[name])}"
        )
    return _build(name, options)


_PARAM_CHECKS: dict[str, Callable[[dict], None]] = {
    "sparseloco": lambda p: check_sparseloco_options(p.get("chunk"), p.get("k")),
    "int8": lambda p: check_int8_options(p.get("block")),
}


def codec_for_payload(payload: Payload) -> Codec:
    """The codec a payload names, built from its params after range checks (CodecError if bad)."""
    name = payload.codec
    if name not in _OPTIONS:
        raise CodecError(f"unknown codec {name!r}; this peer knows {', '.join(CODEC_NAMES)}")
    expected = _OPTIONS[name]
    if set(payload.params) != expected:
        raise CodecError(
            f"{name} payload params must be exactly {sorted(expected)}, got {sorted(payload.params)}"
        )
    check = _PARAM_CHECKS.get(name)
    if check is not None:
        check(payload.params)  # types and ranges, before any codec sizes buffers from them
    return _build(name, dict(payload.params))
