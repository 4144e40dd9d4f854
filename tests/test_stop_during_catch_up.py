"""A Ctrl+C while a volunteer catches up, re-syncs or settles late work ends those network waits
at once (found by a review: a state download of up to 10 minutes ran to its end first, and a
second press skipped the checkpoint and the departure)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from groundswell.peer import volunteer_loop
from groundswell.peer.net_loop import NetLoop
from groundswell.peer.stop_flag import StopFlag
from groundswell.peer.volunteer_loop import VolunteerLoop


@pytest.fixture
def node():
    n = NetLoop()
    n._thread.start()
    yield n
    n.stop_loop()


async def _download_forever() -> None:
    await asyncio.sleep(3600)


def _loop(node: NetLoop, stop: StopFlag) -> VolunteerLoop:
    p = SimpleNamespace(node=node)
    return VolunteerLoop(p, SimpleNamespace(), None, [], stop, lambda info: None, None)


def test_a_stop_during_a_catch_up_ends_its_network_wait(node, monkeypatch):
    calls: list[str] = []

    def catch_up_or_resync(p, peers, fresh=True):
        calls.append("catch-up")
        p.node.call(_download_forever(), timeout_s=600)  # a state download from slow peers

    monkeypatch.setattr(volunteer_loop, "catch_up_or_resync", catch_up_or_resync)
    stop = StopFlag()
    loop = _loop(node, stop)
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    loop._unless_stopped("catch-up", volunteer_loop.catch_up_or_resync, loop.p, [])
    assert time.monotonic() - start < 10 and calls == ["catch-up"]
    assert node._interrupt is None  # later calls (the checkpoint's, the departure's) are not interrupted
    loop._unless_stopped("catch-up", volunteer_loop.catch_up_or_resync, loop.p, [])
    assert calls == ["catch-up"]  # once stopping, not begun at all


def test_a_stop_while_settling_late_work_keeps_the_rest_open(node):
    stop = StopFlag()
    loop = _loop(node, stop)
    items = [SimpleNamespace(round_id=r) for r in range(3)]
    unsettled: list = []
    loop.exchange = SimpleNamespace(take_unsettled=lambda round_id: list(items), unsettled=unsettled)
    loop.p.outer = SimpleNamespace(round_id=5)
    asked: list[int] = []

    def settle_one(item, local=False):
        asked.append(item.round_id)
        if item.round_id == 1:
            stop.set()
            node.call(_download_forever(), timeout_s=600)  # a commit asked of slow peers
        return True

    loop._settle_one = settle_one
    start = time.monotonic()
    loop.settle_late()
    assert time.monotonic() - start < 10
    assert asked == [0, 1] and [i.round_id for i in unsettled] == [1, 2]  # kept, in order, for the checkpoint
    assert node._interrupt is None
