"""Transport refusals over real libp2p: oversized, garbage, forged, foreign-run and replayed requests."""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

import pytest
from groundswell.protocol.envelope import seal, unseal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Ack, DecisionReply, Join, ProtocolError
from groundswell.protocol.transport import PeerUnavailable, Transport

sys.path.insert(0, str(Path(__file__).parent))
from p2p_net import RUN, Net, _refused, _serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _send_raw(net: Net, handler: str, frame: bytes) -> bytes:
    """Send a's handler one raw length-prefixed frame from b; the reply frame, or b"" if a closed
    the stream without one (a handler keeps a stream it answered open until the caller closes)."""
    from hivemind.p2p import PeerID

    _, reader, writer = await net.b.call_binary_stream_handler(
        PeerID.from_base58(net.id_a.peer_id), net.ta._name(handler))
    try:
        writer.write(struct.pack(">Q", len(frame)) + frame)
        await writer.drain()
        async with asyncio.timeout(15):
            head = await reader.read(8)
            if not head:
                return b""
            head += await reader.readexactly(8 - len(head))
            return head + await reader.readexactly(struct.unpack(">Q", head)[0])
    finally:
        writer.close()


def test_oversized_frame_rejected_before_reading(net):
    calls = []

    async def small(sender: str, req: Join) -> Ack:
        calls.append(req)
        return Ack(True, "ok")

    _serve(net, net.ta, "small", Join, small, max_request=1024)
    key = "oversized:small"
    from hivemind.p2p import PeerID

    async def raw(declared: int, payload: bytes = b"") -> bytes:
        _, reader, writer = await net.b.call_binary_stream_handler(
            PeerID.from_base58(net.id_a.peer_id), net.ta._name("small"))
        try:
            writer.write(struct.pack(">Q", declared) + payload)
            await writer.drain()
            # the 2**40 bytes never come: only a server that refused without reading closes now
            return await asyncio.wait_for(reader.read(), 15)
        finally:
            writer.close()

    for n, declared in enumerate([1 << 40, (1 << 64) - 1, 1024 + 512 + 1], start=1):
        t0 = time.monotonic()
        assert net.run(raw(declared)) == b""  # closed with no reply
        assert time.monotonic() - t0 < 10.0
        assert net.ta.rejected[key] == n
    assert calls == []
    # the server still answers a normal request afterwards
    assert net.run(net.tb.request(net.id_a.peer_id, "small", Join(2, True, False), Ack, timeout_s=30)) == Ack(True, "ok")
    assert calls == [Join(2, True, False)]
    # a request whose signed envelope is over max_request is refused by the same handler
    with pytest.raises(PeerUnavailable):
        net.run(net.tb.request(net.id_a.peer_id, "small", DecisionReply(b"x" * 2000), Ack, timeout_s=30))
    assert net.ta.rejected[key] == 4 and len(calls) == 1


def test_garbage_and_foreign_envelopes_rejected_by_server(net):
    calls = []

    async def handler(sender: str, req: Join) -> Ack:
        calls.append(sender)
        return Ack(True, "ok")

    _serve(net, net.ta, "strict", Join, handler)

    def send(frame: bytes) -> Awaitable[bytes]:
        return _send_raw(net, "strict", frame)

    frames = [
        b"\x00garbage",
        seal(net.id_b, "run-y", Join(0, True, True)),  # right signer, wrong run
        seal(Identity.generate(), RUN, Join(0, True, True)),  # valid signature, but not the stream's peer
        seal(net.id_a, RUN, Join(0, True, True)),  # a's own key, replayed by b
        seal(net.id_b, RUN, Ack(True, "x")),  # right signer, wrong kind
    ]
    for n, frame in enumerate(frames, start=1):
        assert net.run(send(frame)) == b""
        assert _refused(net.ta, "strict") == n
    assert calls == []
    assert net.run(send(seal(net.id_b, RUN, Join(0, True, True)))) != b""  # the raw path itself works
    assert calls == [net.id_b.peer_id]


def test_request_signed_by_another_identity_is_refused(net):
    async def handler(sender: str, req: Join) -> Ack:
        return Ack(True, "ok")

    _serve(net, net.ta, "who", Join, handler)
    impostor = Transport(net.b, Identity.generate(), RUN)  # b's daemon, someone else's key
    with pytest.raises(PeerUnavailable):
        net.run(impostor.request(net.id_a.peer_id, "who", Join(0, True, True), Ack, timeout_s=30))
    assert net.ta.rejected["bad-signature:who"] == 1
    assert net.run(net.tb.request(net.id_a.peer_id, "who", Join(0, True, True), Ack, timeout_s=30)).ok


def test_reply_signed_by_another_identity_is_refused(net):
    impostor = Transport(net.a, Identity.generate(), RUN)  # a's daemon answers with someone else's key

    async def handler(sender: str, req: Join) -> Ack:
        return Ack(True, "signed by the wrong key")

    _serve(net, impostor, "forged-reply", Join, handler)
    with pytest.raises(PeerUnavailable, match="bad"):
        net.run(net.tb.request(net.id_a.peer_id, "forged-reply", Join(0, True, True), Ack, timeout_s=30))
    assert net.tb.rejected_replies["bad-signature:forged-reply"] == 1
    # the same check, directly: a validly signed envelope from another key is not the stream's peer
    reply = seal(impostor.identity, RUN, Ack(True, "x"))
    assert unseal(reply, RUN, Ack)[0] == impostor.identity.peer_id
    with pytest.raises(ProtocolError, match="sender"):
        unseal(reply, RUN, Ack, sender=net.id_a.peer_id)


def test_other_run_cannot_talk(net):
    async def handler(sender: str, req: Join) -> Ack:
        return Ack(True, "ok")

    _serve(net, net.ta, "run-check", Join, handler)
    other = Transport(net.b, net.id_b, "run-y")
    assert other._name("run-check") != net.tb._name("run-check")
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="protocols not supported"):
        net.run(other.request(net.id_a.peer_id, "run-check", Join(0, True, True), Ack, timeout_s=30))
    assert time.monotonic() - t0 < 10.0
    assert net.run(net.tb.request(net.id_a.peer_id, "run-check", Join(0, True, True), Ack, timeout_s=30)).ok


def test_a_replayed_or_stale_request_is_dropped_and_counted(net):
    calls = []

    async def handler(sender: str, req: Join) -> Ack:
        calls.append(req)
        return Ack(True, "ok")

    _serve(net, net.ta, "once", Join, handler)

    def send(frame: bytes) -> Awaitable[bytes]:
        return _send_raw(net, "once", frame)

    frame = seal(net.id_b, RUN, Join(5, True, True))
    assert net.run(send(frame)) != b""  # first time: answered
    assert net.run(send(frame)) == b""  # the same signed bytes again: dropped
    assert net.ta.rejected["replayed:once"] == 1 and len(calls) == 1
    # validly signed, but stamped ten minutes ago (a message captured and held back)
    import msgpack
    from groundswell.protocol.envelope import Envelope
    from groundswell.protocol.schema import PROTOCOL_VERSION, encode_message

    env = Envelope(RUN, net.id_b.peer_id, os.urandom(16), time.time() - 600, encode_message(Join(5, True, True)), b"")
    old = msgpack.packb([PROTOCOL_VERSION, RUN, env.sender, env.nonce, env.timestamp, env.body,
                         net.id_b.sign(env.signed_part())], use_bin_type=True)
    assert net.run(send(old)) == b""
    assert net.ta.rejected["stale-message:once"] == 1 and len(calls) == 1
    assert net.run(net.tb.request(net.id_a.peer_id, "once", Join(6, True, True), Ack, timeout_s=30)).ok


def test_a_request_for_a_round_ahead_of_ours_is_logged_as_information_not_a_warning(caplog):
    """A joiner still catching up refuses its peers' requests for the current round as a matter of
    course (a README check saw one as a WARN line in a plain `join`); other refusals stay warnings."""
    import logging
    from collections import Counter
    from types import SimpleNamespace

    from groundswell.protocol.transport import Transport

    t = object.__new__(Transport)
    t.guard = SimpleNamespace(rejected=Counter({"future-round:get-decision": 1, "bad-payload:contribute": 1}))
    caplog.set_level("INFO", logger="groundswell.protocol.transport")
    t._log_rejection("get-decision", "future-round", "12D3KooWpeer", "round 5 is too far ahead")
    t._log_rejection("contribute", "bad-payload", "12D3KooWpeer", "garbled")
    levels = {r.getMessage().split()[1]: r.levelno for r in caplog.records}  # (hivemind renames WARNING "WARN")
    assert levels == {"get-decision": logging.INFO, "contribute": logging.WARNING}
