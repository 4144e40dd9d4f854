"""Ctrl+C at a terminal: it reaches the peer, not its p2pd daemon (which still ends with the peer);
a volunteer finishes its round over the network and leaves, a coordinator checkpoints and leaves;
`groundswell status` on that live run.
Real processes on 127.0.0.1; every one is killed by a fixture or context manager, even on failure."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from groundswell.peer.daemon import (
    SOCKET_DIR_PREFIX,
    adopt_p2pd_daemons,
    daemon_owns_group,
    reap_daemons,
    socket_dir,
    sweep_socket_dirs,
)
from groundswell.peer.simulate import SimulateOptions, Simulation

sys.path.insert(0, str(Path(__file__).parent))
from swarm_harness import QUIET, launch_coordinator, leftover_processes, read_events, wait_for

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not daemon_owns_group(), reason="p2pd gets its own process group only on Linux (prctl)"),
]

_HOST = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from hivemind.p2p import P2P
    from groundswell.peer.daemon import adopt_p2pd_daemons

    async def main():
        adopt_p2pd_daemons()
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        # a stand-in named p2pd with no pipes: the real one also dies of SIGPIPE once we are gone
        stand_in = await asyncio.subprocess.create_subprocess_exec(sys.argv[1], "120")
        other = await asyncio.subprocess.create_subprocess_exec("sleep", "120")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # after the spawns: they must not inherit it
        print(json.dumps({"group": os.getpgrp(), "daemon": p2p._child.pid, "stand_in": stand_in.pid,
                          "other": other.pid}), flush=True)
        await asyncio.sleep(120)

    asyncio.run(main())
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _stand_in(tmp_path: Path, program: str) -> Path:
    """A program named p2pd (a link to `program`), which the launcher treats as the daemon."""
    link = tmp_path / "bin" / "p2pd"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(shutil.which(program))  # type: ignore[arg-type]
    return link


@pytest.fixture
def host(tmp_path):
    """A process that starts p2pd, a stand-in p2pd and `sleep` on an adopting thread (in its own
    session); everything is killed afterwards."""
    proc = subprocess.Popen([sys.executable, "-c", _HOST, str(_stand_in(tmp_path, "sleep"))], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    pids: dict = {}
    try:
        pids = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        yield proc, pids
    finally:
        for pid in (proc.pid, *pids.values()):
            if pid and pid != pids.get("group"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(timeout=30)


def test_the_daemon_has_its_own_group_survives_ctrl_c_and_dies_with_its_parent(host):
    proc, pids = host
    assert os.getpgid(pids["daemon"]) != pids["group"], "p2pd is still in the peer's process group"
    assert os.getpgid(pids["stand_in"]) not in (pids["group"], os.getpgid(pids["daemon"]))
    assert os.getpgid(pids["other"]) == pids["group"], "a program other than p2pd was moved too"
    os.killpg(pids["group"], signal.SIGINT)  # what a terminal does on Ctrl+C
    time.sleep(1.0)
    assert _alive(pids["daemon"]), "a Ctrl+C to the peer's group ended its daemon"
    proc.kill()  # SIGKILL: the peer cannot shut its daemons down itself
    proc.wait(timeout=10)
    limit = time.time() + 10
    while (_alive(pids["daemon"]) or _alive(pids["stand_in"])) and time.time() < limit:
        time.sleep(0.1)
    assert not _alive(pids["stand_in"]), "a daemon outlived its killed parent (no parent-death signal)"
    assert not _alive(pids["daemon"]), "p2pd outlived its killed parent"


@pytest.mark.parametrize("program", ["false", "sleep"])
def test_reap_daemons_ends_and_waits_for_what_the_thread_started(tmp_path, program):
    # A daemon that failed to start ("false") must be reaped before its loop closes, and one that
    # was never shut down ("sleep") is ended; on a thread of its own, as a SwarmNode's.
    stand_in = _stand_in(tmp_path, program)
    pids: list[int] = []

    async def start_and_reap() -> int | None:
        adopt_p2pd_daemons()
        proc = await asyncio.subprocess.create_subprocess_exec(str(stand_in), "60")
        pids.append(proc.pid)
        assert proc.returncode is None
        await reap_daemons()
        return proc.returncode

    got: list = []
    thread = threading.Thread(target=lambda: got.append(asyncio.run(start_and_reap())))
    thread.start()
    try:
        thread.join(30)
        assert not thread.is_alive(), "reap_daemons did not return"
        # None: the loop closed before the exit was delivered. (asyncio reports 255 when another
        # waiter in this test process reaped the child first: still reaped, still delivered.)
        assert len(got) == 1 and got[0] is not None, got
        assert not _alive(pids[0])
        if program == "sleep":
            assert got[0] in (-signal.SIGTERM, 255), got
    finally:
        for pid in pids:  # a regression must not leave the stand-in running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_lets_a_volunteer_finish_its_round_and_the_coordinator_checkpoint(tmp_path):
    out = tmp_path / "sim"
    # Rounds of 200 steps (about 3 s of training here), so Ctrl+C lands while a peer trains and
    # its contribution still has to go over the network afterwards. (At 30 steps a p2pd killed
    # by the Ctrl+C sometimes lived just long enough to carry the round.)
    opts = SimulateOptions(peers=2, rounds=10**6, inner_steps=200, batch_size=4, deadline_s=20, slack_s=2, min_peers=2,
                           checkpoint_every=1000)
    common = QUIET
    try:
        with Simulation(out, opts) as sim:
            boot = launch_coordinator(sim, out, opts)
            for name in ("peer-0", "peer-1"):
                sim.spawn(name, ["join", boot.read_text().strip(), "--state-dir", str(out / name),
                                 "--listen", "/ip4/127.0.0.1/tcp/0", *common])
            rounds = lambda name: [e for e in read_events(out / name / "events.jsonl") if e["kind"] == "round"]
            wait_for(lambda: len(rounds("peer-0")) >= 2, 180, "two rounds")
            # `groundswell status` sees the run as the DHT does: the coordinator and both volunteers.
            res = subprocess.run([sys.executable, "-m", "groundswell.peer", "status", boot.read_text().strip(),
                                  "--json"], capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
            seen_by_dht = {row["role"]: row for row in json.loads(res.stdout)["peers"]}
            assert len(json.loads(res.stdout)["peers"]) == 3 and set(seen_by_dht) == {"coordinator", "volunteer"}
            assert seen_by_dht["volunteer"]["round"] >= 1 and seen_by_dht["coordinator"]["loss"] > 0
            assert seen_by_dht["volunteer"]["loss"] is None  # volunteers do not evaluate by default
            # Ctrl+C while the peer trains the next round (its 200 steps take seconds). Pressed
            # the instant a round was logged, it could land before the next round began (a CI run
            # under load): the peer then rightly left with no round to finish.
            seen = len(rounds("peer-0"))
            wait_for(lambda: len(rounds("peer-0")) > seen, 60, "the next round")
            time.sleep(1.0)
            pressed = time.time()
            sim.signal("peer-0", signal.SIGINT)
            peer0 = sim.procs["peer-0"].popen
            assert peer0 is not None and peer0.wait(timeout=120) == 0
            last = rounds("peer-0")[-1]
            assert last["t"] > pressed and last["included"], f"no round finished after Ctrl+C: {last}"
            # The other volunteer applied that very round, to the same parameters.
            wait_for(lambda: any(e["round"] == last["round"] for e in rounds("peer-1")), 60, "peer-1's round")
            twin = next(e for e in rounds("peer-1") if e["round"] == last["round"])
            assert twin["hash"] == last["hash"]
            wait_for(lambda: any(e["round"] == last["round"] for e in rounds("coordinator")), 60, "the coordinator's round")
            ours = next(e for e in rounds("coordinator") if e["round"] == last["round"])
            assert ours["hash"] == last["hash"]  # the coordinator too: all three hold the same parameters

            # Restarted on its state dir, it says it resumed (a review: its output was a fresh
            # join's); Ctrl+C twice then leaves at once, saying the state dir keeps its work.
            before = (out / "peer-0.log").read_text()
            assert "left the run cleanly; checkpoint:" in before and "resumed from" not in before
            sim.spawn("peer-0", ["join", boot.read_text().strip(), "--state-dir", str(out / "peer-0"),
                                 "--listen", "/ip4/127.0.0.1/tcp/0", *common], kind="restart")
            wait_for(lambda: "resumed from" in (out / "peer-0.log").read_text(), 120, "the restart's resume line")
            said = (out / "peer-0.log").read_text()[len(before):]
            assert f"resumed from {out / 'peer-0'}: its checkpoint at the start of round {last['round'] + 1}" in said, said
            sim.signal("peer-0", signal.SIGINT)
            # the second once the first was handled (two presses before it runs are one), and at
            # once: the first alone has it leave within a second, its round not under way yet
            seen, limit = len(before) + len(said), time.time() + 30
            while "stopping after this round" not in (out / "peer-0.log").read_text()[seen:]:
                assert time.time() < limit, "the first Ctrl+C was never handled"
                time.sleep(0.01)
            sim.signal("peer-0", signal.SIGINT)
            peer0 = sim.procs["peer-0"].popen
            assert peer0 is not None and peer0.wait(timeout=60) == 130
            said = " ".join((out / "peer-0.log").read_text()[len(before):].split())
            assert "left at once: " in said and "the same command resumes from there" in said, said
            assert "keeps its newest checkpoint (checkpoint-0" in said, said

            pressed = time.time()
            sim.signal("coordinator", signal.SIGINT)
            coordinator = sim.procs["coordinator"].popen
            assert coordinator is not None and coordinator.wait(timeout=60) == 0
            # It left promptly, between rounds or mid-attempt, instead of waiting for a round
            # that needs the volunteer that left (2.5 minutes with these settings).
            assert time.time() - pressed < 60
            log = (out / "coordinator.log").read_text() + (out / "peer-0.log").read_text()
            assert "Traceback" not in log
            checkpoints = sorted((out / "coordinator").glob("checkpoint-*.pt"))
            assert checkpoints and checkpoints[-1].name != "checkpoint-00000000.pt", \
                f"the coordinator saved no checkpoint past genesis: {checkpoints}"
            for name in ("coordinator", "peer-0"):  # they ended their daemons themselves
                assert not [p for p in leftover_processes(out / name) if p.is_running()], name
                pid = sim.procs[name].popen.pid  # type: ignore[union-attr]
                left = list(Path(tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}{pid}-*"))
                assert not left, f"{name} left {[list(p.iterdir()) for p in left]}"
    finally:
        for p in leftover_processes(out):
            p.kill()


def test_socket_folders_of_processes_that_are_gone_are_swept(tmp_path):
    # Folders of older versions (no lock in them) are judged by their pid.
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (gone.pid, alive.pid):
            (tmp_path / f"{SOCKET_DIR_PREFIX}{pid}").mkdir()
            (tmp_path / f"{SOCKET_DIR_PREFIX}{pid}" / "hivemind-p2pclient-x.sock").write_bytes(b"")
        (tmp_path / f"{SOCKET_DIR_PREFIX}notapid").mkdir()
        mine = socket_dir(tmp_path)  # sweeps, then makes this process's own
        assert mine.parent == tmp_path and mine.name.startswith(f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        assert mine.is_dir() and socket_dir(tmp_path) == mine  # one folder per process
        assert not (tmp_path / f"{SOCKET_DIR_PREFIX}{gone.pid}").exists()
        assert (tmp_path / f"{SOCKET_DIR_PREFIX}{alive.pid}").exists()
        assert (tmp_path / f"{SOCKET_DIR_PREFIX}notapid").exists()
        assert sweep_socket_dirs(tmp_path) == [] and mine.is_dir()  # our own is never swept
    finally:
        alive.kill()
        alive.wait()


_MAKE_SOCKET_DIR = """
import sys, time
from pathlib import Path
from groundswell.peer.daemon import socket_dir
print(socket_dir(Path(sys.argv[1])), flush=True)
time.sleep(60)
"""


def test_a_socket_folder_is_judged_by_its_lock_not_its_pid(tmp_path):
    # A live process's folder is kept even where its pid means nothing here (another pid
    # namespace sharing /tmp: named here as a pid that is gone), and a gone process's folder is
    # swept even where its pid now belongs to another program (named here as a live pid).
    holder = subprocess.Popen([sys.executable, "-c", _MAKE_SOCKET_DIR, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    gone = subprocess.Popen([sys.executable, "-c", _MAKE_SOCKET_DIR, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    alive = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        live_dir = Path(holder.stdout.readline().strip())
        stale_dir = Path(gone.stdout.readline().strip())
        assert (live_dir / ".lock").is_file() and (stale_dir / ".lock").is_file()
        gone.kill()
        gone.wait()
        # rename them so that their pids lie: the live one's names a gone process, the stale one's a live one
        live_named_dead = live_dir.rename(tmp_path / f"{SOCKET_DIR_PREFIX}{dead.pid}-aaaa")
        stale_named_alive = stale_dir.rename(tmp_path / f"{SOCKET_DIR_PREFIX}{alive.pid}-bbbb")
        assert sweep_socket_dirs(tmp_path) == [stale_named_alive]
        assert live_named_dead.is_dir() and not stale_named_alive.exists()
        holder.kill()
        holder.wait()
        assert sweep_socket_dirs(tmp_path) == [live_named_dead]  # gone now: its lock is free
        # a folder being made (no lock in it yet) is never judged by the pid in its name
        (tmp_path / f"{SOCKET_DIR_PREFIX}{dead.pid}-cccc").mkdir()
        assert sweep_socket_dirs(tmp_path) == []
    finally:
        for p in (holder, gone, alive):
            p.kill()
            p.wait()


def test_the_last_node_removes_the_socket_folder_and_lets_go_of_its_lock(tmp_path, monkeypatch):
    from groundswell.peer import daemon

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = socket_dir()
    assert mine.parent == tmp_path and (mine / ".lock").is_file()
    daemon._socket_users += 1  # as `with_private_sockets` counts a node
    daemon.release_private_sockets()
    assert not mine.exists() and tmp_path not in daemon._own_dirs
    again = socket_dir()  # a later node makes a new one
    assert again.is_dir() and again != mine
    (again / "p2pd-left-behind.sock").write_bytes(b"")  # a daemon still shutting down
    daemon._socket_users += 1
    daemon.release_private_sockets()
    assert again.is_dir() and sweep_socket_dirs(tmp_path) == []  # still ours: locked, not swept


def test_a_reap_cut_short_leaves_the_daemon_for_the_next_one(tmp_path):
    # A teardown cut short (a second Ctrl+C, a close's time limit) forgot every daemon at once: one
    # that ignored SIGTERM was never killed.
    stand_in = tmp_path / "bin" / "p2pd"
    stand_in.parent.mkdir()
    stand_in.write_text(f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        "print('up', flush=True)\ntime.sleep(60)\n")
    stand_in.chmod(0o755)
    pids: list[int] = []

    async def start_cut_short_then_reap() -> int | None:
        adopt_p2pd_daemons()
        proc = await asyncio.subprocess.create_subprocess_exec(str(stand_in), stdout=asyncio.subprocess.PIPE)
        pids.append(proc.pid)
        await proc.stdout.readline()  # its SIGTERM handler is in place
        try:
            async with asyncio.timeout(0.5):
                await reap_daemons(timeout_s=5.0)  # SIGTERM is ignored: cut short while it waits
        except TimeoutError:
            pass
        await reap_daemons(timeout_s=1.0)  # the next one ends it (SIGKILL)
        return proc.returncode

    got: list = []
    thread = threading.Thread(target=lambda: got.append(asyncio.run(start_cut_short_then_reap())))
    thread.start()
    try:
        thread.join(30)
        assert not thread.is_alive()
        alive = _alive(pids[0])
        assert not alive, f"the daemon outlived both reaps (returncode {got})"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
