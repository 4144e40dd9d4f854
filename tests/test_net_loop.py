"""NetLoop: what the trainer's thread gives up on is over before it goes on."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from groundswell.peer.net_loop import NetLoop, Stopped


@pytest.fixture
def loop():
    node = NetLoop()
    node._thread.start()
    yield node
    node.stop_loop()


def test_a_call_given_up_on_returns_once_the_coroutine_unwound(loop):
    # It returned as soon as the cancellation was scheduled, while the coroutine's `finally` (a
    # record being written, say) still ran beside the caller.
    unwound: list[float] = []

    async def slow_cleanup() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.5)  # as a file write handed to a thread would
            unwound.append(time.monotonic())

    with pytest.raises(TimeoutError):
        loop.call(slow_cleanup(), timeout_s=0.2)
    assert unwound, "call returned while the coroutine was still unwinding"
    stop = threading.Event()
    loop.interrupt_calls_on(stop)
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(Stopped):
        loop.call(slow_cleanup())
    assert len(unwound) == 2


def test_a_call_under_way_ends_once_the_node_stops_by_itself():
    # The coordinator's wait for a round's decision (bounded at 96 s) went on after its daemon
    # died: only a Ctrl+C cut a call short. Now a node that stopped by itself ends it too, its
    # coroutine cancelled.
    class Node(NetLoop):
        down = False

        def _raise_if_down(self) -> None:
            if self.down:
                raise ConnectionError("the network stopped")

    node = Node()
    node._thread.start()
    cancelled: list[bool] = []

    async def wait_for_a_decision() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    try:
        threading.Timer(0.3, lambda: setattr(node, "down", True)).start()
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            node.call(wait_for_a_decision(), timeout_s=60)
        assert time.monotonic() - start < 5 and cancelled == [True]
    finally:
        node.stop_loop()


def test_closing_cancels_thread_jobs_still_queued(loop):
    # They ran to the end after the node closed, holding up the process's exit.
    ran: list[int] = []
    gate = threading.Event()

    def job(i: int) -> None:
        gate.wait(5)
        ran.append(i)

    async def queue_many() -> None:
        for i in range(64):  # more than the executor has threads
            asyncio.get_running_loop().run_in_executor(None, job, i)

    loop.call(queue_many(), timeout_s=10)
    loop.stop_loop()
    gate.set()
    time.sleep(0.5)
    assert len(ran) < 64, "every queued job ran after the loop closed"


def test_a_daemon_that_does_not_take_the_runs_handlers_is_one_line_not_a_traceback(monkeypatch):
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.swarm import SwarmNode

    node = SwarmNode.__new__(SwarmNode)

    async def stuck(ctx):
        await asyncio.sleep(3600)

    node._attach = stuck
    node.call = lambda coro, timeout_s=None: (coro.close(), (_ for _ in ()).throw(TimeoutError()))[1]
    with pytest.raises(NetworkError, match="did not take this run's handlers within 30 s"):
        node.attach(object())
