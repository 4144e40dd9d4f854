"""A decision poll answered with a commit that cannot be right is counted against its sender (and
struck where only a forger sends one), as `_learn_previous` counts the same; it was only logged
(found by a review of the wire boundary)."""

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace

from groundswell.compression import RobustOptions, make_codec
from groundswell.peer.run_state import RunContext
from groundswell.protocol.client import RoundClient
from groundswell.protocol.context import DecisionBook
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision, DecisionReply
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import Transport

RUN = "replies"


class _OneReplyP2P:
    """Every stream we open is answered with `reply` (a signed envelope), then closed."""

    def __init__(self) -> None:
        self.reply = b""

    async def add_binary_stream_handler(self, *a) -> None:
        pass

    async def call_binary_stream_handler(self, peer, name):
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">Q", len(self.reply)) + self.reply)
        reader.feed_eof()
        writer = SimpleNamespace(write=lambda b: None, drain=lambda: asyncio.sleep(0), close=lambda: None)
        return SimpleNamespace(addr=""), reader, writer


def test_a_forged_commit_answered_to_a_decision_poll_is_counted_and_struck():
    me, bad, other = Identity.generate(), Identity.generate(), Identity.generate()

    async def main() -> None:
        guard, p2p = Guard(Limits()), _OneReplyP2P()
        ctx = RunContext(RUN, 1, 30.0, 2.0, 1, (4096,), make_codec("sparseloco"), 1 << 20, None, RobustOptions(),
                         Limits())
        book = DecisionBook(RUN)
        async with asyncio.TaskGroup() as tg:
            server = RoundServer(ctx, Transport(p2p, me, RUN, guard), book, me, tg)
            book.add(seal(me, RUN, Decision(-1, 0, "commit", [], [me.peer_id], [me.peer_id, other.peer_id],
                                            me.peer_id, [], 0, time.time())))
            client = RoundClient(server, holders=lambda r: [])
            # `bad` leads nothing in round 0 (not a server of it): its commit can only be forged
            forged = seal(bad, RUN, Decision(0, 0, "commit", [bad.peer_id], [bad.peer_id], [bad.peer_id], bad.peer_id,
                                             [bad.peer_id], 1, time.time(), [b"x" * 16]))
            p2p.reply = seal(bad, RUN, DecisionReply(forged))
            assert await client.ask_decision(bad.peer_id, 0, 0, 0.0) == b""
            assert 0 not in book.committed
            counted = {k: v for k, v in guard.rejected.items() if k.endswith(":decision-reply")}
            assert sum(counted.values()) == 1, dict(guard.rejected)
            # never struck: a peer across a real split answers every poll (once a second) with its side's commit
            for _ in range(30):
                await client.ask_decision(bad.peer_id, 0, 0, 0.0)
            assert bad.peer_id not in guard.bans() and not guard._peer(bad.peer_id).strikes

    asyncio.run(main())
