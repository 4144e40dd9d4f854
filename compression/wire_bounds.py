"""Counting the objects in untrusted msgpack bytes before msgpack builds them.

msgpack's own limits cap each container's length, not how many containers there are: a byte of
nested empty array becomes a ~64-byte Python list, so a 19 MB frame of them took 1.3 GB and 4 s
to decode, before any type check could refuse it. `count_objects` walks the encoding's headers
only (a str, bin or ext is skipped by its length, nothing is built) and refuses more than
`limit` objects, a truncated or reserved encoding, or bytes after the object; bytes that pass
are then decoded by msgpack in C into at most `limit` Python objects.
"""

from __future__ import annotations

_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,  # nil, bools, numbers
          0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # ..., fixext
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin and str: width of the length that follows
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # ext: a length, then a type byte, then the data
_ARRAY = {0xDC: 2, 0xDD: 4}
_MAP = {0xDE: 2, 0xDF: 4}


def count_objects(data: bytes | bytearray | memoryview, limit: int) -> int:
    """The number of msgpack objects (containers and scalars) in `data`, which must hold exactly
    one top-level object; ValueError past `limit` objects or for a malformed encoding."""
    end = len(data)
    pos, pending, seen = 0, 1, 0
    while pending:
        if pos >= end:
            raise ValueError("msgpack data is cut short")
        b = data[pos]
        pending -= 1
        seen += 1
        if b <= 0x7F or b >= 0xE0:  # fixints
            pos += 1
            continue
        if b <= 0x8F:  # fixmap
            children, pos = 2 * (b & 0x0F), pos + 1
        elif b <= 0x9F:  # fixarray
            children, pos = b & 0x0F, pos + 1
        elif b <= 0xBF:  # fixstr
            pos += 1 + (b & 0x1F)
            continue
        elif b in _FIXED:
            pos += _FIXED[b]
            continue
        elif b in _SIZED or b in _EXT:
            width = _SIZED.get(b) or _EXT[b]
            length = int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            pos += 1 + width + (b in _EXT) + length
            continue
        elif b in _ARRAY or b in _MAP:
            width = _ARRAY.get(b) or _MAP[b]
            children = int.from_bytes(data[pos + 1:pos + 1 + width], "big") * (2 if b in _MAP else 1)
            pos += 1 + width
        else:
            raise ValueError(f"msgpack byte 0x{b:02x} is reserved")
        pending += children
        if seen + pending > limit:
            raise ValueError(f"msgpack data holds more than {limit} objects")
    if pos != end:
        raise ValueError("msgpack data is cut short" if pos > end else f"{end - pos} bytes after the msgpack object")
    return seen
