"""Pseudo-gradient codecs: a tensor goes in, self-describing bytes come out.

Pure: no networking, no optimizer state; only torch, msgpack and numpy. `make_codec(name)`
builds a codec, `Payload.from_bytes(data)` strictly parses untrusted bytes (and picks the codec
from the payload, with range-checked params), `codec.decode` / `codec.aggregate` turn payloads
back into fp32 tensors.
"""

from .base import Codec, CodecError, Payload, all_finite, wire_bound
from .dense import DenseCodec
from .int8 import Int8Codec
from .registry import CODEC_NAMES, codec_for_payload, make_codec
from .robust import (
    RobustOptions,
    RobustStats,
    contribution_sq_norm,
    robust_mean,
    robust_weights,
    tree_sum_of_squares,
)
from .segments import (
    ALIGN,
    aggregate_segments,
    decode_segments,
    encode_segments,
    segment_bounds,
    segment_size,
)
from .sparseloco import SparseLoCoCodec

__all__ = [
    "ALIGN",
    "aggregate_segments",
    "all_finite",
    "decode_segments",
    "encode_segments",
    "segment_bounds",
    "segment_size",
    "CODEC_NAMES",
    "Codec",
    "CodecError",
    "DenseCodec",
    "Int8Codec",
    "Payload",
    "RobustOptions",
    "RobustStats",
    "contribution_sq_norm",
    "robust_mean",
    "robust_weights",
    "tree_sum_of_squares",
    "wire_bound",
    "SparseLoCoCodec",
    "codec_for_payload",
    "make_codec",
]
