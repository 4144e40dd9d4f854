"""Bulk replies over real libp2p daemons: a state blob follows its signed reply as a raw trailer,
its announced size enforced, with a timeout of its own, whole even to a slow reader; an upload's
slot is freed once its trailer is written or cannot be."""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import time
from pathlib import Path

import pytest
from blake3 import blake3
from groundswell.peer.state_serving import UploadSlots
from groundswell.protocol.schema import ProtocolError, StateReply, StateRequest
from groundswell.protocol.transport import PeerUnavailable, WithTrailer

sys.path.insert(0, str(Path(__file__).parent))
from p2p_net import RUN, _serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _fetch(net, handler: str, limit: int = 1 << 30, **kwargs):
    """b asks a's `handler` for a bulk reply, refusing one announced over `limit` bytes."""
    def size(reply: StateReply) -> int:
        if reply.size > limit:
            raise ProtocolError("too large", reason="oversized")
        return reply.size

    return net.run(net.tb.request_bulk(net.id_a.peer_id, handler, StateRequest(0), StateReply, timeout_s=30,
                                       trailer_size=size, **kwargs))


def test_a_bulk_trailer_arrives_whole_and_its_announced_size_is_enforced(net):
    # The state blob follows its signed reply as a raw frame: the reply announces its size, and
    # the requester refuses a different or too large one before reading it.
    blob = os.urandom(3 << 20)  # several 1 MiB reads
    announced = {"size": len(blob)}

    async def state(sender: str, msg: StateRequest) -> WithTrailer:
        return WithTrailer(StateReply(1, "d" * 64, b"", announced["size"]), blob)

    _serve(net, net.ta, "bulk", StateRequest, state, trailer=True)
    reply, got, digest = _fetch(net, "bulk")
    assert reply.size == len(got) and bytes(got) == blob and digest == blake3(blob).hexdigest()
    # the trailer is counted apart too (a churn run's state uploads, next to its exchange)
    assert net.ta.trailer_bytes_sent == len(blob) + 8 and net.ta.bytes_sent > len(blob) + 8  # (8: its length)
    with pytest.raises(PeerUnavailable, match="too large"):
        _fetch(net, "bulk", limit=len(blob) - 1)
    for wrong in (len(blob) - 1, len(blob) + 1):  # a trailer longer or shorter than announced
        announced["size"] = wrong
        with pytest.raises(PeerUnavailable):
            _fetch(net, "bulk")


def test_a_bulk_reply_has_its_own_timeout_and_the_trailer_the_time_its_size_gets(net):
    # A joiner gives a state's reply a short timeout (a silent peer costs little) and its blob the
    # time its announced size needs: the reply's timeout must not cut the blob short.
    blob = os.urandom(1 << 20)

    async def state(sender: str, msg: StateRequest) -> WithTrailer:
        return WithTrailer(StateReply(1, "d" * 64, b"", len(blob)), blob)

    _serve(net, net.ta, "timed-bulk", StateRequest, state, trailer=True)

    def size(reply: StateReply) -> int:
        time.sleep(1.5)  # the reply's timeout runs out here, before the blob is read
        return reply.size

    def fetch(**kw):
        return net.run(net.tb.request_bulk(net.id_a.peer_id, "timed-bulk", StateRequest(0), StateReply,
                                           timeout_s=1.0, trailer_size=size, **kw))

    with pytest.raises(PeerUnavailable, match="did not answer"):
        fetch()
    _, got, _ = fetch(trailer_timeout_s=lambda n: 30.0 if n == len(blob) else 0.0)
    assert bytes(got) == blob


def test_a_slow_reader_still_gets_the_whole_trailer(net):
    # The handler has written everything before this caller reads the trailer; p2pd resets a
    # stream whose handler hangs up first, which would drop what the caller's daemon still holds.
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.framing import read_frame, read_frame_into
    from hivemind.p2p import PeerID

    blob = os.urandom(4 << 20)

    async def state(sender: str, msg: StateRequest) -> WithTrailer:
        return WithTrailer(StateReply(1, "d" * 64, b"", len(blob)), blob)

    _serve(net, net.ta, "slow-bulk", StateRequest, state, trailer=True)

    async def fetch_slowly() -> bytearray:
        _, reader, writer = await net.b.call_binary_stream_handler(
            PeerID.from_base58(net.id_a.peer_id), net.ta._name("slow-bulk"))
        try:
            writer.write(struct.pack(">Q", len(data := seal(net.id_b, RUN, StateRequest(0)))) + data)
            await writer.drain()
            await read_frame(reader, 1 << 20)
            await asyncio.sleep(1.5)  # the handler is done writing long before this
            return await read_frame_into(reader, len(blob))
        finally:
            writer.close()

    for _ in range(3):
        assert bytes(net.run(fetch_slowly())) == blob


def test_the_transport_frees_an_upload_once_its_trailer_is_written_or_cannot_be(net):
    blob = os.urandom(2 << 20)
    released: list[int] = []
    slots = UploadSlots(total=1, kept=0)

    async def state(sender: str, msg: StateRequest) -> WithTrailer | StateReply:
        release = slots.take(sender)
        if release is None:
            return StateReply(-1, "", b"", 0, busy=True)

        def free() -> None:
            released.append(len(released))
            release()

        return WithTrailer(StateReply(1, "d" * 64, b"", len(blob)), blob, free)

    _serve(net, net.ta, "slotted", StateRequest, state, trailer=True)

    def freed(count: int) -> bool:  # both ends run on the test's loop: it runs while we wait
        end = time.monotonic() + 20
        while time.monotonic() < end and len(released) < count:
            net.run(asyncio.sleep(0.05))
        return len(released) == count and slots.in_use == 0

    reply, got, _ = _fetch(net, "slotted")
    assert bytes(got) == blob and not reply.busy and freed(1)
    with pytest.raises(PeerUnavailable, match="too large"):  # the caller hangs up before the trailer
        _fetch(net, "slotted", limit=len(blob) - 1)
    assert freed(2)
    reply, got, _ = _fetch(net, "slotted")  # the slot is free again: served whole
    assert bytes(got) == blob and freed(3)


def test_an_upload_slot_is_freed_once_the_trailer_is_written_though_the_requester_keeps_its_stream_open(net):
    """A requester that read the whole state and then kept its stream open used to hold its
    upload slot for the handler's whole timeout: three of them held every stranger's slot."""
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.framing import read_frame, read_frame_into
    from hivemind.p2p import PeerID

    blob = os.urandom(1 << 20)
    released: list[bool] = []

    async def state(sender: str, msg: StateRequest) -> WithTrailer:
        return WithTrailer(StateReply(1, "d" * 64, b"", len(blob)), blob, lambda: released.append(True))

    _serve(net, net.ta, "held-open", StateRequest, state, trailer=True)

    async def fetch_and_hold() -> bool:
        _, reader, writer = await net.b.call_binary_stream_handler(
            PeerID.from_base58(net.id_a.peer_id), net.ta._name("held-open"))
        try:
            writer.write(struct.pack(">Q", len(data := seal(net.id_b, RUN, StateRequest(0)))) + data)
            await writer.drain()
            await read_frame(reader, 1 << 20)
            assert bytes(await read_frame_into(reader, len(blob))) == blob
            end = time.monotonic() + 10
            while not released and time.monotonic() < end:  # the stream stays open all along
                await asyncio.sleep(0.05)
            return bool(released)
        finally:
            writer.close()

    assert net.run(fetch_and_hold()), "the slot was held until the requester closed its stream"


def test_bulk_hashes_are_blake3():
    # the published BLAKE3 test vector for the empty input: envelopes, contribution digests and
    # state blobs all hash with it, so a peer using another hash fails every check
    from groundswell.protocol.digests import bulk_digest, bulk_hasher

    empty = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert bulk_digest(b"").hex() == empty and bulk_hasher().hexdigest() == empty
    assert bulk_hasher().update(b"ab").update(b"c").digest() == bulk_digest(b"abc") != bulk_digest(b"abd")
