"""Two real libp2p daemons (p2pd) on 127.0.0.1 for the transport tests, and helpers to drive them.

Both daemons run with `nat_port_map=False` (no UPnP/NAT-PMP probing of the LAN) and listen on
loopback only; every p2pd started here is stopped in the fixture's `finally`, and any that
survives `shutdown()` is killed by pid. The `net` fixture itself is in tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from groundswell.protocol.identity import Identity
from groundswell.protocol.transport import Transport

RUN = "run-x"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _p2pd_children() -> set[int]:
    """Pids of p2pd processes that are children of this test process."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == me and comm.startswith("p2pd"):
            out.add(int(entry))
    return out


@dataclass
class Net:
    loop: asyncio.AbstractEventLoop
    a: Any  # P2P, the server side in most tests
    b: Any  # P2P, bootstrapped from a
    id_a: Identity
    id_b: Identity
    ta: Transport
    tb: Transport

    def run(self, coro: Awaitable, timeout: float = 60.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))


def open_net(tmp_path_factory) -> Iterator[Net]:
    """The body of the module-scoped `net` fixture: a serves, b is bootstrapped from a."""
    from hivemind.p2p import P2P

    tmp = tmp_path_factory.mktemp("p2p")
    loop = asyncio.new_event_loop()
    before = _p2pd_children()
    started: list[Any] = []
    try:
        id_a, id_b = Identity.generate(), Identity.generate()
        id_a.save(tmp / "a.key")
        id_b.save(tmp / "b.key")

        async def create(path, **kwargs):
            p2p = await P2P.create(host_maddrs=LOOPBACK, nat_port_map=False, identity_path=str(path),
                                   check_if_identity_free=False, **kwargs)
            started.append(p2p)
            return p2p

        a = loop.run_until_complete(asyncio.wait_for(create(tmp / "a.key"), 60))
        maddrs = loop.run_until_complete(a.get_visible_maddrs())
        assert maddrs and all(str(m).startswith("/ip4/127.0.0.1/") for m in maddrs)
        b = loop.run_until_complete(asyncio.wait_for(create(tmp / "b.key", initial_peers=maddrs), 60))
        yield Net(loop, a, b, id_a, id_b, Transport(a, id_a, RUN), Transport(b, id_b, RUN))
    finally:
        try:
            for p2p in started:
                with suppress(Exception):
                    loop.run_until_complete(asyncio.wait_for(p2p.shutdown(), 15))
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                with suppress(Exception):
                    loop.run_until_complete(asyncio.wait(pending, timeout=5))
        finally:
            for pid in _p2pd_children() - before:  # whatever shutdown() missed, by pid
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            loop.close()


def _refused(transport: Transport, handler: str) -> int:
    """Inbound requests of `handler` refused for any reason."""
    return sum(n for key, n in transport.rejected.items() if key.endswith(":" + handler))


def _serve(net: Net, transport: Transport, name: str, expect: Any,
           fn: Callable[[str, Any], Awaitable[Any]], **kwargs) -> None:
    net.run(transport.serve(name, expect, fn, **kwargs))
