"""An in-process network of `RoundServer`s for claim tests: a request calls the target's handler
directly (after a small delay), and a peer can be dead (its dial is refused)."""

from __future__ import annotations

import asyncio
import time

from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.peer.run_state import RunContext
from groundswell.protocol.context import DecisionBook, contribution_bound
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.plan import RoundPlan, make_plan
from groundswell.protocol.schema import Decision, ProtocolError
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import PeerDead, PeerGone, RequestTimedOut

RUN = "claims-net"
NUMEL = 4 * 4096


class Net:
    """Who is in the network, and who is dead."""

    def __init__(self, n: int = 4, deadline_s: float = 4.0, slack_s: float = 0.5) -> None:
        numels = tuple(b - a for a, b in segment_bounds(NUMEL, 4096))
        self.ctx = RunContext(RUN, 2, deadline_s, slack_s, 4, numels, make_codec("fp32"), contribution_bound(make_codec("fp32"), numels),
                              robust=RobustOptions(clip=0.0))
        identities = [Identity.generate() for _ in range(n)]
        self.ids = {i.peer_id: i for i in identities}
        self.pids = sorted(self.ids)
        opened = time.time() - (deadline_s + 3 * slack_s)  # attempt 1 of round 0 is open
        self.genesis = seal(self.ids[self.pids[0]], RUN, Decision(-1, 0, "commit", [], self.pids, self.pids,
                                                                  self.pids[0], [], 0, opened))
        self.servers: dict[str, RoundServer] = {}
        self.dead: set[str] = set()

    def plan(self, round_id: int, attempt: int) -> RoundPlan:
        """The plan every peer makes of this attempt."""
        return make_plan(RUN, round_id, attempt, self.pids, self.pids, len(self.ctx.segment_numels),
                         self.ctx.max_shards)

    async def start(self, tasks: asyncio.TaskGroup) -> dict[str, RoundServer]:
        """One server per peer, each knowing the genesis, all running long before the round."""
        for pid in self.pids:
            book = DecisionBook(RUN)
            book.add(self.genesis)
            server = RoundServer(self.ctx, _Transport(self, pid), book, self.ids[pid], tasks)
            server.started_at = time.time() - 3600
            server._loop = asyncio.get_running_loop()
            self.servers[pid] = server
        return self.servers


class _Transport:
    def __init__(self, net: Net, me: str) -> None:
        self.net, self.me = net, me
        self.guard = Guard(Limits(requests_per_s=1e6, max_streams=1000, strikes=10**9))

    async def serve(self, *args: object, **kwargs: object) -> None:
        return None

    async def request(self, peer: str, handler: str, msg: object, expect: object, *, timeout_s: float,
                      **kwargs: object) -> object:
        if peer in self.net.dead or peer not in self.net.servers:
            raise PeerDead(f"{peer[-8:]} is dead")
        server = self.net.servers[peer]
        fn = {"claim": server._on_claim, "get-decision": server._on_get_decision, "seal": server._on_seal,
              "have": server._on_have, "join": server._on_join}[handler]
        await asyncio.sleep(0.002)
        try:
            async with asyncio.timeout(timeout_s):
                return await fn(self.me, msg)
        except TimeoutError:
            raise RequestTimedOut(f"{peer[-8:]} timed out on {handler}") from None
        except ProtocolError as exc:
            raise PeerGone(f"{peer[-8:]} refused {handler}: {exc}") from None
