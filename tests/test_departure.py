"""Leaving a run: a peer that stops says so (the next round's leaders stop waiting for it, its
DHT record is withdrawn), and a node shuts down in bounded time even when its daemon is frozen,
and notices when its daemon dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from groundswell.peer.net_errors import NetworkError
from groundswell.peer.swarm import NodeOptions, SwarmNode
from groundswell.protocol.identity import Identity

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_the_next_rounds_leaders_do_not_wait_for_a_trainer_that_left(make_cluster):
    # All three are round 0's trainers; the leaders would wait for the third up to the close
    # (29 s here). It leaves instead: they commit once the other two are in.
    c = make_cluster(3, deadline_s=30.0, slack_s=1.0)
    leaver = c.nodes[2]
    leaver.call(leaver.client.leave(0), timeout_s=10)  # type: ignore[union-attr]
    xs = inputs(2, c.numel, seed=5)
    t0 = time.monotonic()
    results = c.attempt(0, {0: xs[0], 1: xs[1]})
    took = time.monotonic() - t0
    decisions = {i: r.decision for i, r in results.items()}
    assert all(d is not None and d.status == "commit" for d in decisions.values()), decisions
    assert sorted(decisions[0].contributors) == sorted(c.ids[:2]) and decisions[0] == decisions[1]
    assert took < 15, f"the round waited {took:.1f} s for a trainer that had left"
    means = [c.fetch(i, results[i].signed) for i in (0, 1)]
    assert torch.equal(means[0], means[1])  # both hold the identical aggregate
    assert torch.allclose(means[0], (c.sent(xs[0]) + c.sent(xs[1])) / 2, atol=1e-6)


def test_a_node_that_closes_cleanly_withdraws_its_record_at_once(make_cluster):
    c = make_cluster(2)
    watcher, leaver = c.nodes
    deadline = time.monotonic() + 30
    while leaver.identity.peer_id not in watcher.call(watcher.peer_records(), timeout_s=10):
        assert time.monotonic() < deadline, "the leaver's record never appeared"
        time.sleep(0.5)
    leaver.close()
    # its last heartbeat's record would live 6 s more; the "left" one replaces it
    assert leaver.identity.peer_id not in watcher.call(watcher.peer_records(), timeout_s=10)


@pytest.fixture
def lone_node():
    tmp = tempfile.TemporaryDirectory()
    ident = Identity.generate()
    ident.save(Path(tmp.name) / "id.key")
    node = SwarmNode(ident, str(Path(tmp.name) / "id.key"), NodeOptions())
    node.start()
    child = node.p2p._child
    yield node, child
    if child.returncode is None:  # the old code left it behind, stopped
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(child.pid, sig)
            except ProcessLookupError:
                pass
    node.close()
    tmp.cleanup()


def test_closing_a_node_whose_daemon_is_frozen_ends_in_time_and_kills_the_daemon(lone_node):
    node, child = lone_node
    os.kill(child.pid, signal.SIGSTOP)  # hivemind waits for its answers without a timeout
    t0 = time.monotonic()
    node.close()
    took = time.monotonic() - t0
    assert child.returncode is not None, "the frozen daemon outlived its node"
    assert took < 19, f"closing took {took:.1f} s"


def test_a_node_whose_daemon_dies_says_so_instead_of_timing_out_forever(lone_node):
    node, child = lone_node
    os.kill(child.pid, signal.SIGKILL)  # out of memory, say

    async def nothing() -> None:
        return None

    deadline = time.monotonic() + 15
    while True:
        try:
            node.call(nothing(), timeout_s=5)
        except NetworkError as exc:
            assert "daemon exited" in str(exc)
            break
        assert time.monotonic() < deadline, "the node never noticed its daemon was gone"
        time.sleep(0.2)


def test_ctrl_c_while_the_main_thread_holds_the_stop_flags_lock_does_not_hang(monkeypatch):
    # A signal handler runs on the main thread, maybe while it is entering or leaving
    # `stop.event.wait()` and holds the event's (non-reentrant) lock: setting the event there
    # would wait for that lock forever.
    from groundswell.peer import cli_swarm

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # leave this process's handlers alone
    handlers = []
    monkeypatch.setattr(cli_swarm.signal, "signal", lambda sig, h: handlers.append(h))
    stop = cli_swarm._stop_on_signals()
    press = threading.Thread(target=handlers[0], args=(signal.SIGINT, None), daemon=True)
    with stop.event._cond:  # as the main thread does inside Event.wait
        press.start()
        press.join(timeout=3)
        assert not press.is_alive(), "the handler blocked on the stop flag's lock"
        assert stop  # seen at once, before the event itself can be set
    assert stop.event.wait(5)  # and the waits wake once the lock is free


def test_ctrl_c_landing_inside_a_write_to_the_console_still_stops_the_peer(monkeypatch):
    # The handler runs on the main thread, maybe inside its own print to the same stream (stdout
    # piped to a slow reader): its message then fails with "reentrant call", which used to skip
    # setting the flag and reach the round as a traceback, with no final checkpoint.
    from groundswell.peer import cli_swarm

    handlers = []
    monkeypatch.setattr(cli_swarm.signal, "signal", lambda sig, h: handlers.append(h))

    def reentrant(*args, **kwargs):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

    monkeypatch.setattr(cli_swarm.console, "print", reentrant)
    stop = cli_swarm._stop_on_signals()
    handlers[0](signal.SIGINT, None)  # raises nothing
    assert stop and stop.event.wait(5)


def test_ctrl_c_with_the_console_piped_to_a_reader_that_died_still_stops_the_peer_cleanly():
    # `join ... 2>&1 | tee log`: Ctrl+C ends tee too, and the first press's notice hits a closed
    # pipe. rich's default then raised SystemExit on the main thread (and pointed stdout at
    # /dev/null): the peer left at once, its last round and checkpoint skipped. In a child
    # process, since the old behaviour rewires the process's stdout.
    script = (
        "import signal\n"
        "from groundswell.peer import cli_swarm\n"
        "class Closed:\n"
        "    def write(self, text): raise BrokenPipeError(32, 'Broken pipe')\n"
        "    def flush(self): raise BrokenPipeError(32, 'Broken pipe')\n"
        "    def isatty(self): return False\n"
        "cli_swarm.console.file = Closed()\n"
        "handlers = []\n"
        "cli_swarm.signal.signal = lambda sig, h: handlers.append(h)\n"
        "stop = cli_swarm._stop_on_signals()\n"
        "handlers[0](signal.SIGINT, None)\n"
        "cli_swarm.console.print('a round line, later')\n"
        "print('stopping cleanly' if stop else 'not stopped', flush=True)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "stopping cleanly", (res.returncode, res.stdout, res.stderr)


def test_a_peer_back_after_leaving_is_a_member_again_at_every_leader_its_leave_reached(make_cluster):
    # Leaders differ per attempt with more servers than leaders: the restarted peer's announce
    # must reach each leader its leave reached, or a retried attempt's leader would close
    # without it while it still trains.
    from groundswell.protocol.client import LEAVE_ATTEMPTS

    c = make_cluster(6, deadline_s=30.0, slack_s=1.0)
    peer = c.nodes[5]
    client = peer.client
    peer.call(client.leave(0), timeout_s=15)
    peer.call(client.announce(0, trains=True, serves=True, attempts=LEAVE_ATTEMPTS), timeout_s=15)
    plans = [peer.call(peer.server.plan(0, a, wait_s=0), timeout_s=5)
             for a in range(client.current_attempt(0), client.current_attempt(0) + LEAVE_ATTEMPTS)]
    leaders = {leader for plan in plans for leader in plan.leaders}
    assert len(leaders) > len(plans[0].leaders)  # the attempts do have other leaders
    by_id = dict(zip(c.ids, c.nodes))
    for leader in leaders:
        joins = by_id[leader].call(_joins(by_id[leader], 0), timeout_s=5)
        assert joins.get(peer.identity.peer_id) == (True, True), f"{leader[-6:]} still holds the leave"


async def _joins(node, round_id):
    return dict(node.server.joins[round_id])


def test_a_ctrl_c_during_start_up_cancels_it_and_kills_the_daemon_at_once(monkeypatch):
    # The reachability probe stands for any slow start-up step (a DHT bootstrap to peers that do
    # not answer, say). Closing used to wait 20 s for the start-up to end on its own.
    tmp = tempfile.TemporaryDirectory()
    ident = Identity.generate()
    ident.save(Path(tmp.name) / "id.key")
    node = SwarmNode(ident, str(Path(tmp.name) / "id.key"), NodeOptions())
    probing = threading.Event()
    pressed: list[float] = []

    async def probe_forever() -> str:
        probing.set()
        await asyncio.sleep(3600)
        return "public"

    class CtrlC:  # what `start` waits on: the Ctrl+C comes once the daemon is up and probing
        def wait(self, timeout: float | None = None) -> bool:
            assert probing.wait(60), "start-up never reached the probe"
            pressed.append(time.monotonic())
            raise KeyboardInterrupt

        def is_set(self) -> bool:
            return False

        def set(self) -> None:
            pass

    monkeypatch.setattr(node, "_find_reachability", probe_forever)
    monkeypatch.setattr(node, "_ready", CtrlC())
    try:
        with pytest.raises(KeyboardInterrupt):
            node.start()
        took = time.monotonic() - pressed[0]
        assert node.p2p._child.returncode is not None, "the daemon outlived the cancelled start-up"
        assert node._loop.is_closed()
        assert took < 10, f"leaving took {took:.1f} s after the Ctrl+C"
    finally:
        if node.p2p is not None and node.p2p._child.returncode is None:
            node.p2p._child.kill()
        node.close()
        tmp.cleanup()
