"""What a coordinator sees in its terminal while its run waits for volunteers."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)
ROOT = Path(__file__).resolve().parents[1]


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl+C the coordinator's process group; kill it if it has not left within 30 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_live_table_says_a_round_waits_for_volunteers(tmp_path):
    manifest = (ROOT / "scripts" / "example_run.toml").read_text()
    manifest = manifest.replace("deadline_s = 30.0", "deadline_s = 8.0").replace("slack_s = 5.0", "slack_s = 2.0")
    assert "deadline_s = 8.0" in manifest and "slack_s = 2.0" in manifest
    (tmp_path / "run.toml").write_text(manifest)
    leader, follower = pty.openpty()  # a terminal, so rich draws the live table
    proc = subprocess.Popen([sys.executable, "-m", "groundswell.peer", "launch", str(tmp_path / "run.toml"),
                             "--state-dir", str(tmp_path / "c"), "--listen", "/ip4/127.0.0.1/tcp/0"],
                            stdin=follower, stdout=follower, stderr=follower, start_new_session=True,
                            env={**os.environ, "COLUMNS": "120"})
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline and b"volunteers online" not in seen:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(leader, 65536)
                except OSError:  # the child closed the terminal
                    break
    finally:
        _stop(proc)
        os.close(leader)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    assert "round 0 again: 0 volunteers online, 2 needed" in " ".join(text.split()), text[-2000:]


def test_a_held_out_loss_not_published_yet_reads_as_a_dash_not_nan():
    from groundswell.peer.round_view import loss_text

    assert loss_text(float("nan")) == "-"
    assert loss_text(4.53781) == "4.5378"


def _launch_into_a_file(tmp_path: Path, log: Path, until: bytes) -> str:
    """Launch the example run (short rounds) with its output going to `log`, wait until it
    prints `until`, and return what it had printed then (then Ctrl+C it)."""
    manifest = (ROOT / "scripts" / "example_run.toml").read_text()
    manifest = manifest.replace("deadline_s = 30.0", "deadline_s = 8.0").replace("slack_s = 5.0", "slack_s = 2.0")
    (tmp_path / "run.toml").write_text(manifest)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "groundswell.peer", "launch", str(tmp_path / "run.toml"),
                                 "--state-dir", str(tmp_path / "c"), "--listen", "/ip4/127.0.0.1/tcp/0"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline and until not in log.read_bytes():
            time.sleep(0.5)
        return log.read_text(errors="replace")  # read while it runs, not what it prints on the way out
    finally:
        _stop(proc)


def test_without_a_terminal_each_round_is_a_line_as_it_happens(tmp_path):
    # Under nohup, systemd or `2>log`, a live table draws nothing until the process ends.
    log = tmp_path / "launch.log"
    text = _launch_into_a_file(tmp_path, log, b"round 0: runs again")
    assert "round 0: runs again (0 volunteers online, 2 needed)" in text, text[-2000:]
    # and a line is never broken at 80 columns (rich's width without a terminal): scripts grep them
    assert re.search(r"^run \S+ coordinated by 12D3KooW\w{40,}$", text, re.MULTILINE), text[:2000]
    # on the way out it says where the run's state is, and a launch on it says it resumes from there
    saved = tmp_path / "c" / "checkpoint-00000000.pt"
    assert f"stopped; the run's state is in {saved}" in log.read_text(errors="replace"), log.read_text()[-2000:]
    _launch_into_a_file(tmp_path, log, b"coordinated by")
    assert f"resuming run example-tiny from its checkpoint at the start of round 0 in {tmp_path / 'c'}" in log.read_text(), \
        log.read_text()[-2000:]


def test_a_round_line_says_what_the_tables_row_says():
    from types import SimpleNamespace

    from groundswell.peer.round_view import round_line

    info = SimpleNamespace(round=3, status="applied", contributors=4, peers_online=5, eval_loss=2.5,
                           bytes_sent=48_600, round_s=3.21, reason="")
    assert round_line(info) == ("round 3: applied, 4 contributors, 5 peers online, held-out loss 2.5000, "
                                 "48.6 kB/round/peer, 3.2 s")
    assert "loss" not in round_line(SimpleNamespace(**{**vars(info), "eval_loss": float("nan")}))
    assert "1 contributor, 1 peer online" in round_line(SimpleNamespace(**{**vars(info), "contributors": 1,
                                                                           "peers_online": 1}))


def test_a_volunteers_round_line_names_the_round_a_published_loss_was_measured_after():
    """A volunteer shows the coordinator's loss from its record, read every few seconds: often a
    round or more old (a README check saw 3.5356 repeated for rounds 5-7)."""
    from types import SimpleNamespace

    from groundswell.peer.round_view import of_round
    from groundswell.peer.volunteer_loop import swarm_eval_loss as _swarm_eval_loss

    # The record names the round its loss was measured after: with eval.every_rounds = 5 the
    # coordinator runs round 9 with the loss of round 4 (it was shown as "(round 8)").
    records = {"coord": SimpleNamespace(round=9, loss=3.5, loss_round=4),
               "v": SimpleNamespace(round=9, loss=2.0, loss_round=8), "w": SimpleNamespace(round=10, loss=2.2, loss_round=7),
               "liar": SimpleNamespace(round=9, loss=0.1, loss_round=1 << 40)}
    p = SimpleNamespace(node=SimpleNamespace(cached_records=records), coordinator_id="coord")
    assert _swarm_eval_loss(p) == (4, 3.5)  # the coordinator's
    p.coordinator_id = "gone"
    assert _swarm_eval_loss(p) == (8, 2.0)  # else the one measured after the newest round
    p.node.cached_records = {}
    assert _swarm_eval_loss(p)[0] is None
    assert of_round(SimpleNamespace(eval_round=5, eval_loss=3.5)) == " (round 5)"
    assert of_round(SimpleNamespace(eval_round=None, eval_loss=3.5)) == ""
    assert of_round(SimpleNamespace(eval_round=5, eval_loss=float("nan"))) == ""


def test_a_restarted_volunteer_is_not_told_its_work_was_left_out_when_its_previous_process_counted():
    # Found by a review: after a restart mid-round the commit named us for what our killed process
    # sent, and the line said "NOT in aggregate" (this process's own work is kept for later).
    from types import SimpleNamespace

    from groundswell.peer.round_view import in_aggregate

    assert in_aggregate(SimpleNamespace(included=True, superseded=False)) == "in aggregate"
    assert in_aggregate(SimpleNamespace(included=False, superseded=True)) == "earlier work of ours in aggregate"
    assert in_aggregate(SimpleNamespace(included=False, superseded=False)) == "NOT in aggregate"


def test_the_bytes_per_round_figure_spans_rounds_so_lagging_records_do_not_alias_it():
    # Found by a review: records are republished every heartbeat, so one round's difference of a
    # volunteer's cumulative count swung from 0.2 kB to 139 kB for a steady 25-48 kB per round.
    from groundswell.peer.coordinator_role import SENT_WINDOW_ROUNDS, SentPerRound

    traffic = SentPerRound()
    figures = []
    for r in range(1, 30):
        lag = 29_000 if r % 2 else 0  # a record a heartbeat old every other round
        figures.append(traffic.update(r, {"a": 30_000 * r - lag, "b": 30_000 * r - lag}))
    assert figures[0] == 0  # nothing to compare with yet
    assert all(abs(f - 30_000) < 29_000 / SENT_WINDOW_ROUNDS + 1 for f in figures[SENT_WINDOW_ROUNDS:])
    restarted = traffic.update(30, {"a": 30_000 * 30, "b": 5_000})  # b restarted: its count began again
    assert abs(restarted - 30_000) < 29_000 / SENT_WINDOW_ROUNDS + 1 and set(traffic.latest) == {"a", "b"}


def test_a_coordinator_that_catches_up_says_so(monkeypatch):
    """Found by a review: a coordinator back after 171 s of catching up showed its first round as
    "applied ... 170.9 s", the catch-up presented as one round's time, and nothing else said it."""
    from types import SimpleNamespace

    from groundswell.peer import coordinator_role
    from groundswell.peer.round_view import round_line
    from groundswell.peer.stop_flag import StopFlag
    from groundswell.protocol.client import RoundBehind

    stop = StopFlag()
    outer = SimpleNamespace(round_id=10)
    calls = []

    def call(coro, timeout_s):
        calls.append(1)
        if len(calls) > 1:
            stop.set()
        raise RoundBehind("the swarm is ahead")

    def follow(p):  # the catch-up: 40 rounds taken from the swarm, in (here) 0.2 s
        time.sleep(0.2)
        moved = outer.round_id == 10
        outer.round_id = 50
        return moved

    monkeypatch.setattr(coordinator_role, "_follow_the_swarm", follow)
    m = SimpleNamespace(round=SimpleNamespace(deadline_s=10.0, slack_s=1.0), eval=SimpleNamespace(every_rounds=1))
    p = SimpleNamespace(manifest=m, outer=outer, node=SimpleNamespace(client=SimpleNamespace(
        run_attempt=lambda *a, **k: None), call=call))
    seen = []
    coordinator_role._follow_rounds(p, stop, seen.append, checkpoint_every=10**9, saved=10)
    assert [i.status for i in seen] == ["caught-up"], seen
    assert round_line(seen[0]).startswith("caught up to round 50: rounds 10-49 applied by the swarm meanwhile, "
                                          "taken in 0."), round_line(seen[0])


def test_a_resumed_coordinator_says_it_caught_up_with_the_swarm(monkeypatch):
    """Found by a review: the first catching up of a coordinator resumed from its checkpoint,
    unlike any later one, was not said (the live table's first row jumped many rounds)."""
    from types import SimpleNamespace

    from groundswell.peer import coordinator_role
    from groundswell.peer.round_view import round_line
    from groundswell.peer.stop_flag import StopFlag

    stop = StopFlag()
    outer = SimpleNamespace(round_id=10)

    def follow(p):  # the swarm went on without us: 40 rounds taken
        outer.round_id = 50
        return True

    def call(coro, timeout_s):
        stop.set()
        raise TimeoutError

    monkeypatch.setattr(coordinator_role, "_follow_the_swarm", follow)
    monkeypatch.setattr(coordinator_role, "write_defence_counts", lambda p: None)
    m = SimpleNamespace(round=SimpleNamespace(deadline_s=10.0, slack_s=1.0), eval=SimpleNamespace(every_rounds=1),
                        checkpoint=SimpleNamespace(every_rounds=10**9))
    node = SimpleNamespace(maddrs=[], startup_s={}, record_decision=lambda d: None, interrupt_calls_on=lambda e: None,
                           client=SimpleNamespace(run_attempt=lambda *a, **k: None), call=call)
    p = SimpleNamespace(manifest=m, load_checkpoint=lambda: {"round": 10, "tensors": {}, "decision": b""},
                        state_dir=None, start_network=lambda: None, events=SimpleNamespace(write=lambda *a, **k: None),
                        node=node, outer=outer, outer_hash=lambda: "", identity=SimpleNamespace(peer_id="c"),
                        save_checkpoint=lambda *a, **k: None, load_global=lambda state: None)
    seen = []
    coordinator_role.run_coordinator(p, stop=stop, on_round=seen.append)
    assert [round_line(i) for i in seen][:1] == ["caught up to round 50: rounds 10-49 applied by the swarm "
                                                 f"meanwhile, taken in {seen[0].reason.split('taken in ')[1]}"]
