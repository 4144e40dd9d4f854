"""Large request bodies are buffered whole before they are checked: their bytes are budgeted per
node and per peer before they are read, a body must keep arriving, and a closed run's stranger is
refused before a byte of its contribution is read."""

from __future__ import annotations

import asyncio
import struct
import sys
import time
from pathlib import Path

import pytest
from groundswell.protocol import transport as transport_module
from groundswell.protocol.guard import SMALL_BODY, Guard, Limits
from groundswell.protocol.schema import Ack, Join

sys.path.insert(0, str(Path(__file__).parent))
from p2p_net import _serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MIB = 1 << 20


def test_the_guard_budgets_large_bodies_per_node_and_per_peer():
    g = Guard(Limits(max_inbound_bytes=4 * MIB, max_inbound_bytes_per_peer=2 * MIB))
    assert g.take_bytes("a", SMALL_BODY, MIB) is None and g.inbound == 0  # control messages are free
    assert g.take_bytes("a", MIB, MIB) is None
    assert g.take_bytes("a", MIB, MIB) is None
    assert g.take_bytes("a", MIB, MIB) == "inbound-per-peer"  # a third: over a's 2 MiB
    assert g.take_bytes("b", MIB, MIB) is None and g.take_bytes("c", MIB, MIB) is None
    assert g.take_bytes("d", MIB, MIB) == "inbound-full"  # 4 MiB in flight already
    g.release_bytes("a", MIB)
    assert g.take_bytes("d", MIB, MIB) is None and g.inbound == 4 * MIB
    # a run with large payloads gets room for four of them, and one per peer, whatever the limits
    assert g.take_bytes("e", 64 * MIB, 64 * MIB) is None
    assert g.take_bytes("e", 64 * MIB, 64 * MIB) == "inbound-per-peer"


async def _announce(net, handler: str, size: int, send: int):
    """Open a stream to a's `handler` from b, announce a `size`-byte body and send `send` bytes of it."""
    from hivemind.p2p import PeerID

    _, reader, writer = await net.b.call_binary_stream_handler(PeerID.from_base58(net.id_a.peer_id),
                                                               net.ta._name(handler))
    writer.write(struct.pack(">Q", size) + b"\0" * send)
    await writer.drain()
    return reader, writer


async def _closed_within(reader, seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            return await reader.read() == b""
    except TimeoutError:
        return False


def test_a_second_large_body_from_one_peer_over_its_budget_is_refused_before_it_is_read(net):
    async def echo(sender: str, req: Join) -> Ack:
        return Ack(True, "ok")

    _serve(net, net.ta, "budgeted", Join, echo, max_request=MIB)
    old_limits = net.ta.guard.limits
    net.ta.guard.limits = Limits(max_inbound_bytes=8 * MIB, max_inbound_bytes_per_peer=MIB)

    async def scenario() -> tuple[bool, bool]:
        r1, w1 = await _announce(net, "budgeted", MIB, MIB // 2)  # held half-sent
        await asyncio.sleep(0.5)
        r2, w2 = await _announce(net, "budgeted", MIB, 0)
        refused = await _closed_within(r2, 10)  # closed unread, not left waiting for its body
        held = not await _closed_within(r1, 1)  # the first is still being read
        w1.close()
        w2.close()
        return refused, held

    try:
        refused, held = net.run(scenario())
        assert refused and held
        assert net.ta.rejected["inbound-per-peer:budgeted"] == 1, dict(net.ta.rejected)
        deadline = time.monotonic() + 10
        while net.ta.guard.inbound and time.monotonic() < deadline:  # the first one's bytes come back
            net.run(asyncio.sleep(0.1))
        assert net.ta.guard.inbound == 0
    finally:
        net.ta.guard.limits = old_limits


def test_a_body_trickled_slower_than_the_floor_rate_is_cut_off(net, monkeypatch):
    async def echo(sender: str, req: Join) -> Ack:
        return Ack(True, "ok")

    _serve(net, net.ta, "trickle", Join, echo, max_request=MIB)
    monkeypatch.setattr(transport_module, "REQUEST_START_S", 1.0)
    monkeypatch.setattr(transport_module, "MIN_BODY_RATE", float(MIB))  # 1 s + 1 s for the body

    async def scenario() -> bool:
        reader, writer = await _announce(net, "trickle", MIB, 1000)
        try:
            return await _closed_within(reader, 10)  # the handler's own timeout is 600 s
        finally:
            writer.close()

    t0 = time.monotonic()
    assert net.run(scenario()) and time.monotonic() - t0 < 8


def test_a_refused_peer_is_turned_away_before_its_body_is_read(net):
    async def echo(sender: str, req: Join) -> Ack:
        return Ack(True, "ok")

    _serve(net, net.ta, "members-only", Join, echo, max_request=MIB,
           admit=lambda remote: None if remote == "nobody" else "unauthorized")

    async def scenario() -> bool:
        reader, writer = await _announce(net, "members-only", MIB, 0)
        try:
            return await _closed_within(reader, 5)
        finally:
            writer.close()

    assert net.run(scenario())
    assert net.ta.rejected["unauthorized:members-only"] == 1 and net.ta.guard.inbound == 0
