"""The wire form of a global state: named flat fp32 tensors as raw little-endian bytes behind a
small msgpack header, so a joiner maps them without a copy and no pickle is ever parsed.

Layout: 8-byte big-endian header length, the header `[1, [[name, "float32", numel], ...]]`, then
each tensor's bytes in header order, nothing after. Parsing is strict: the byte counts must add
up exactly, names are unique short strings, and only fp32 is accepted.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import torch
from groundswell.protocol.schema import ProtocolError

FORMAT_VERSION = 1
MAX_TENSORS = 16
MAX_HEADER = 4096
_LEN = struct.Struct(">Q")


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialize flat fp32 tensors (CPU copies are taken) into one blob."""
    items, parts = [], []
    for name, t in tensors.items():
        flat = t.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        items.append([name, "float32", flat.numel()])
        parts.append(flat.numpy().astype("<f4", copy=False))  # (joined as it is: no copy of its own first)
    header = msgpack.packb([FORMAT_VERSION, items], use_bin_type=True)
    return b"".join([_LEN.pack(len(header)), header, *parts])


def unpack_tensors(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a blob, as views of it where it is writable (a bytearray); ProtocolError
    for anything malformed."""
    view = memoryview(blob)
    if len(view) < _LEN.size:
        raise ProtocolError("state blob is too short")
    (hlen,) = _LEN.unpack(view[:_LEN.size])
    if hlen > MAX_HEADER or _LEN.size + hlen > len(view):
        raise ProtocolError("state blob header is malformed")
    try:
        header = msgpack.unpackb(view[_LEN.size:_LEN.size + hlen], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types on garbage
        raise ProtocolError(f"state blob header does not decode: {type(exc).__name__}") from None
    if (not isinstance(header, list) or len(header) != 2 or type(header[0]) is not int or header[0] != FORMAT_VERSION
            or not isinstance(header[1], list) or len(header[1]) > MAX_TENSORS):
        raise ProtocolError("state blob header is not a version-1 tensor list")
    offset, out = _LEN.size + hlen, {}
    for item in header[1]:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str) or len(item[0]) > 64
                or item[1] != "float32" or type(item[2]) is not int or item[2] < 0 or item[0] in out):
            raise ProtocolError("state blob lists a malformed, duplicate or non-fp32 tensor")
        end = offset + 4 * item[2]
        if end > len(view):
            raise ProtocolError("state blob is shorter than its header says")
        array = np.frombuffer(blob, dtype="<f4", count=item[2], offset=offset)
        out[item[0]] = torch.from_numpy(array if array.flags.writeable else array.copy())  # bytes: read-only
        offset = end
    if offset != len(view):
        raise ProtocolError("state blob has bytes after its tensors")
    return out
