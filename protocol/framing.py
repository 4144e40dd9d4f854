"""Frames on a byte stream: an 8-byte big-endian length, then that many bytes. Lengths are
checked against the reader's budget before anything is read into memory."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .schema import ProtocolError

_LEN = struct.Struct(">Q")
WRITE_PIECE = 1 << 20


def close_stream(writer: asyncio.StreamWriter) -> None:
    """Close our end of a stream now. With bytes still unsent (the other end stopped reading, so
    p2pd stopped reading ours), a plain close() keeps the socket, and those bytes, until they are
    sent: for good, found by a review (60 streams whose callers never read left 60 descriptors and
    47 MiB behind); and a raw socket its owner closes right after leaves a stale registration with
    the event loop that breaks whatever socket next gets its descriptor number (a hole punch's
    forward). abort() drops the bytes and unregisters."""
    transport = getattr(writer, "transport", None)  # (a stand-in writer, in tests, may have none)
    if transport is not None and transport.get_write_buffer_size():
        transport.abort()
    else:
        writer.close()


@dataclass(eq=False)  # (each one is its own: kept in lists and removed by identity)
class SendProgress:
    """How far a request's frame has gone out, kept up to date as its pieces drain (monotonic
    times): its sender can tell a receiver that stopped reading, or never answers, from a slow
    link while the request still runs (`RoundClient._send_shard`)."""

    size: int = 0
    written: int = 0  # bytes the stream took (some may still sit in buffers on the way)
    opened: float | None = None  # the stream is open
    moved: float | None = None  # the last piece drained
    finished: float | None = None  # the whole frame drained; the reply is awaited


async def write_frame(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview,
                      progress: SendProgress | None = None) -> None:
    """Write one length-prefixed frame, a piece at a time: what the socket does not take at once
    is copied into the stream's buffer, so a large frame (a state, a dense contribution) written
    whole to a slow reader would hold a second copy of itself for as long as the reader takes."""
    writer.write(_LEN.pack(len(data)))
    view = memoryview(data).cast("B")
    if progress is not None:
        progress.size, progress.moved = len(view), time.monotonic()
    for start in range(0, len(view), WRITE_PIECE):
        writer.write(view[start:start + WRITE_PIECE])
        await writer.drain()
        if progress is not None:
            progress.written, progress.moved = min(len(view), start + WRITE_PIECE), time.monotonic()
    if not len(view):
        await writer.drain()
    if progress is not None:
        progress.finished = time.monotonic()


# A large frame's reader is held to half the rate that would finish it in its time, once past its
# first seconds (as the direct state port holds its readers, `protocol/direct.py`).
PACED_GRACE_S = 20.0
PACED_SHARE = 0.5


async def write_frame_paced(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview,
                            within_s: float) -> None:
    """`write_frame`, cut off (TimeoutError) once a reader past its first PACED_GRACE_S has taken
    less than PACED_SHARE of what it would have at the rate that finishes within `within_s`. A
    reader taking a piece now and then, just fast enough never to time out a piece, held a state
    upload's slot (and that state, however old) for the whole of its time: a stranger's slow
    reads under fresh identities could keep every slot."""
    loop = asyncio.get_running_loop()
    writer.write(_LEN.pack(len(data)))
    view = memoryview(data).cast("B")
    began, floor = loop.time(), PACED_SHARE * len(view) / max(within_s, 1e-3)  # bytes/s
    for start in range(0, len(view), WRITE_PIECE):
        end = min(start + WRITE_PIECE, len(view))
        writer.write(view[start:end])
        # The reader must have taken this piece (but for the buffers) by the time the pace allows,
        # checked while waiting: checked between pieces only, a reader taking a few bytes a
        # second kept a MiB piece's drain, and the stream, waiting for the whole timeout.
        try:
            async with asyncio.timeout_at(began + max(PACED_GRACE_S, end / max(floor, 1e-9))):
                await writer.drain()
        except TimeoutError:
            raise TimeoutError(f"reader too slow: under {end} bytes in {loop.time() - began:.0f} s") from None
    if not len(view):
        await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, start_s: float | None = None) -> bytes:
    """Read one length-prefixed frame, refusing lengths over `max_bytes` before reading them;
    `start_s`: TimeoutError unless its length has arrived within that many seconds."""
    async with asyncio.timeout(start_s):
        header = await reader.readexactly(_LEN.size)
    (size,) = _LEN.unpack(header)
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}", reason="oversized")
    return await reader.readexactly(size)


async def read_frame_paced(reader: asyncio.StreamReader, max_bytes: int, start_s: float,
                           admit: Callable[[int], Awaitable[None]], min_rate: float, stall_s: float,
                           piece: int = 256 << 10) -> bytes:
    """`read_frame` for requests that may be large. Once the body's first piece has come (within
    `start_s` and `stall_s`), `admit(size)` is awaited: it books the whole body, waiting for room
    or raising; a length announced with nothing behind it books nothing. From the booking on, the
    body must keep up `min_rate` bytes/s after a grace of `stall_s`, and a piece must come within
    `stall_s`, else TimeoutError: holding a booking costs sending about as much as it books."""
    async with asyncio.timeout(start_s):
        header = await reader.readexactly(_LEN.size)
    (size,) = _LEN.unpack(header)
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}", reason="oversized")
    loop = asyncio.get_running_loop()
    first = min(piece, size)
    async with asyncio.timeout(min(start_s, stall_s)):
        pieces = [await reader.readexactly(first)] if size else []
    if size:
        await admit(size)
    booked, got = loop.time(), first if size else 0
    while got < size:
        n = min(piece, size - got)
        async with asyncio.timeout_at(min(booked + stall_s + (got - first + n) / min_rate, loop.time() + stall_s)):
            pieces.append(await reader.readexactly(n))
        got += n
    return b"".join(pieces)  # (bytes, as `read_frame` returns: one copy, as readexactly makes)


# A bulk trailer's reader (a joiner reading a state blob) gives up once the length, or a whole
# chunk of the body, has not come for this long: as the direct state path (`direct.STALL_S`). A
# server that sent its signed reply and then nothing used to cost the joiner its whole time for
# that server (80 s at 25M parameters), and the joiner then blamed its own link as too slow.
TRAILER_STALL_S = 20.0


class FrameStalled(ConnectionError):
    """A frame's sender stopped sending (nothing, or less than a chunk, for the reader's stall
    bound): a ConnectionError, as the direct path's stall is, not a timeout of the whole read."""


async def read_frame_into(reader: asyncio.StreamReader, max_bytes: int, chunk: int = 1 << 20,
                          hasher: Any = None, stall_s: float | None = None) -> bytearray:
    """`read_frame` for bulk data: same length check first, then reads of `chunk` bytes into one
    preallocated buffer (one `readexactly` of a huge frame grows the reader's buffer to the whole
    frame and copies it out again); `hasher` (BLAKE3, or anything with `update`) is fed each piece as it arrives.
    `stall_s`: the length, and then each whole `chunk`, must come within that many seconds, else
    `FrameStalled` (whole chunks: a byte now and then must not keep a stalled read going)."""
    loop = asyncio.get_running_loop()
    got = -1  # (the length not read yet)
    try:
        async with asyncio.timeout(stall_s) as stall:  # (None: no bound)
            (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if size > max_bytes:
                raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes}", reason="oversized")
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                if stall_s is not None:
                    stall.reschedule(loop.time() + stall_s)
                end = min(got + chunk, size)
                while got < end:
                    part = await reader.read(end - got)
                    if not part:  # (not the bytes so far as its `partial`: a copy of up to a whole state)
                        ended = asyncio.IncompleteReadError(b"", size)
                        ended.args = (f"{got} bytes read on a total of {size} expected bytes",)
                        raise ended
                    view[got:got + len(part)] = part
                    got += len(part)
                    if hasher is not None:
                        hasher.update(part)
    except TimeoutError:
        if not stall.expired():  # an enclosing timeout's: not a stall of ours
            raise
        raise FrameStalled(f"the frame stalled for {stall_s:g}s "
                           + ("before its length" if got < 0 else f"after {got} bytes")) from None
    return buf


async def read_until_eof(reader: asyncio.StreamReader) -> None:
    """Read and drop whatever the other side still sends, until it closes its end."""
    while await reader.read(1 << 16):
        pass
