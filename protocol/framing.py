"""Frames on a byte stream: an 8-byte big-endian length, then that many bytes. Lengths are
checked against the reader's budget before anything is read into memory."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from .schema import ProtocolError

_LEN = struct.Struct(">Q")
WRITE_PIECE = 1 << 20


async def write_frame(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> None:
    """Write one length-prefixed frame, a piece at a time: what the socket does not take at once
    is copied into the stream's buffer, so a large frame (a state, a dense contribution) written
    whole to a slow reader would hold a second copy of itself for as long as the reader takes."""
    writer.write(_LEN.pack(len(data)))
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_PIECE):
        writer.write(view[start:start + WRITE_PIECE])
        await writer.drain()
    if not len(view):
        await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, start_s: float | None = None,
                     on_length: Callable[[int], None] | None = None, min_rate: float | None = None) -> bytes:
    """Read one length-prefixed frame, refusing lengths over `max_bytes` before reading them;
    `start_s`: TimeoutError unless its length has arrived within that many seconds;
    `on_length(size)`: called once the length is known and before the body is read (it may
    raise); `min_rate` (bytes/s): TimeoutError unless the body arrives within `start_s` (or
    30 s) plus its size at that rate (a sender trickling a large body cannot hold it for long)."""
    async with asyncio.timeout(start_s):
        header = await reader.readexactly(_LEN.size)
    (size,) = _LEN.unpack(header)
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}", reason="oversized")
    if on_length is not None:
        on_length(size)
    if min_rate is None:
        return await reader.readexactly(size)
    async with asyncio.timeout((start_s or 30.0) + size / min_rate):
        return await reader.readexactly(size)


async def read_frame_into(reader: asyncio.StreamReader, max_bytes: int, chunk: int = 1 << 20,
                          hasher: Any = None) -> bytearray:
    """`read_frame` for bulk data: same length check first, then reads of `chunk` bytes into one
    preallocated buffer (one `readexactly` of a huge frame grows the reader's buffer to the whole
    frame and copies it out again); `hasher` (BLAKE3, or anything with `update`) is fed each piece as it arrives."""
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}", reason="oversized")
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        part = await reader.read(min(chunk, size - got))
        if not part:
            raise asyncio.IncompleteReadError(bytes(view[:got]), size)
        view[got:got + len(part)] = part
        got += len(part)
        if hasher is not None:
            hasher.update(part)
    return buf


async def read_until_eof(reader: asyncio.StreamReader) -> None:
    """Read and drop whatever the other side still sends, until it closes its end."""
    while await reader.read(1 << 16):
        pass
