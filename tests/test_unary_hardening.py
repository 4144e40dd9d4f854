"""hivemind's unary-call machinery against a hostile caller (found by a review of the transport):
a call cancelled before its handler starts must not stay in hivemind's table, and a unary request
bigger than any honest caller sends is refused with a strike."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from groundswell.peer.reachability import _varint
from groundswell.protocol.envelope import seal
from groundswell.protocol.failures import Refused
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Ack, Join
from groundswell.protocol.transport import UNARY_MAX_REQUEST, Transport
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.proto import p2pd_pb2


def _node():
    """A transport on a daemon client with no daemon: its unary handlers, driven by hand."""
    control = ControlClient(None, _initialized_with_create=True)

    class Client:
        def __init__(self) -> None:
            self.control = control

        async def add_unary_handler(self, proto, fn) -> None:
            control.unary_handlers[proto] = fn

    class P2P:
        _client = Client()

        async def add_binary_stream_handler(self, name, fn) -> None:
            pass

    return control, P2P


@pytest.mark.parametrize("hardened", [True, False])
def test_unary_calls_cancelled_before_their_handler_starts_leave_no_task_behind(hardened):
    async def scenario() -> tuple[int, int]:
        control, p2p = _node()
        me, caller = Identity.generate(), Identity.generate()
        transport = Transport(p2p(), me, "run")  # (installs the fix on the node's daemon client)
        if not hardened:
            control._handler_tasks = {}  # hivemind 1.1.12 as shipped
        ran = []

        async def on_join(sender, req):
            ran.append(sender)
            return Ack(True, "")

        await transport.serve("join", Join, on_join)
        proto = transport._unary_name("join")
        pid = PeerID.from_base58(caller.peer_id).to_bytes()
        data = seal(caller, "run", Join(0, True, True))
        buf = bytearray()
        for _ in range(200):  # a request and its cancel back to back, as a caller that hangs up at once
            call_id = uuid.uuid4().bytes
            for msg in (p2pd_pb2.PersistentConnectionResponse(
                            callId=call_id, requestHandling=p2pd_pb2.CallUnaryRequest(peer=pid, proto=proto, data=data)),
                        p2pd_pb2.PersistentConnectionResponse(callId=call_id, cancel=p2pd_pb2.Cancel())):
                raw = msg.SerializeToString()
                buf += _varint(len(raw)) + raw
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(buf))
        reader.feed_eof()
        await control._read_from_persistent_conn(reader)
        for _ in range(5):
            await asyncio.sleep(0)
        return len(control._handler_tasks), len(ran)

    left, ran = asyncio.run(scenario())
    assert ran == 0  # cancelled before they ran: the guard never saw them
    if hardened:
        assert left == 0
    else:  # hivemind 1.1.12 as shipped keeps every one of them
        assert left == 200


def test_a_unary_request_bigger_than_an_honest_caller_sends_is_refused_with_a_strike():
    async def scenario():
        control, p2p = _node()
        me, caller = Identity.generate(), Identity.generate()
        transport = Transport(p2p(), me, "run")
        answered = []

        async def on_join(sender, req):
            answered.append(sender)
            return Ack(True, "")

        await transport.serve("join", Join, on_join, max_request=1 << 20)
        handler = control.unary_handlers[transport._unary_name("join")]
        remote = PeerID.from_base58(caller.peer_id)
        honest = seal(caller, "run", Join(0, True, True))
        await handler(honest, remote)
        padded = honest + b"\0" * (UNARY_MAX_REQUEST + 1 - len(honest))  # (never sent as a unary call)
        with pytest.raises(Refused):
            await handler(padded, remote)
        return answered, transport.guard, caller.peer_id

    answered, guard, caller = asyncio.run(scenario())
    assert len(answered) == 1
    assert guard.rejected["oversized:join"] == 1 and len(guard._peers[caller].strikes) == 1
