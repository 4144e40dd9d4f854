"""events.jsonl is rotated by size: a long run keeps at most about two caps of it on disk, and a
short run (under the cap) keeps every event in the one file its readers open."""

from __future__ import annotations

import json
import math
import os

import pytest
from groundswell.peer import event_log
from groundswell.peer.event_log import EventLog
from groundswell.peer.sim_report import read_events


def test_the_event_log_is_rotated_past_its_cap_and_keeps_one_older_file(tmp_path, monkeypatch):
    # It grew forever: with peers x rounds of events, about 1 GB a month on a big run.
    monkeypatch.setattr(event_log, "ROTATE_BYTES", 400)
    path, older = tmp_path / "events.jsonl", tmp_path / "events.jsonl.1"
    log = EventLog(path)
    for r in range(100):
        log.write("round", round=r)
    assert older.exists(), "events.jsonl was never rotated"
    line = len(path.read_text().splitlines()[0]) + 1
    assert path.stat().st_size < 400 + line and older.stat().st_size < 400 + line
    kept = [e["round"] for e in read_events(older) + read_events(path)]
    assert kept == list(range(kept[0], 100)) and kept[0] > 0  # the newest, in order, none lost at a rotation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    assert log.failed == 0


def test_a_short_run_keeps_every_event_in_one_file(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for r in range(50):
        log.write("round", round=r)
    assert [e["round"] for e in read_events(path)] == list(range(50))
    assert not (tmp_path / "events.jsonl.1").exists()


def test_the_event_log_is_private_like_the_state_dirs_other_files(tmp_path):
    # (a README check found it 0644 under umask 022: the only file of the state dir that was)
    old = os.umask(0o022)
    try:
        path = tmp_path / "events.jsonl"
        EventLog(path).write("start")
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_threads_writing_at_once_rotate_only_full_files(tmp_path, monkeypatch):
    # The trainer, the network loop and worker threads all write; two crossing the cap at once
    # both rotated, the second replacing the first's rotated file with a nearly empty one.
    import threading
    import time

    monkeypatch.setattr(event_log, "ROTATE_BYTES", 2000)
    rotated: list[int] = []
    real_replace = os.replace

    def replace(src, dst):
        time.sleep(0.002)  # widens the window another thread could slip into
        rotated.append(os.stat(src).st_size)
        real_replace(src, dst)

    monkeypatch.setattr(event_log.os, "replace", replace)
    log = EventLog(tmp_path / "events.jsonl")
    threads = [threading.Thread(target=lambda n=n: [log.write("e", n=n, i=i) for i in range(300)]) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert rotated and min(rotated) >= 2000, rotated


def test_every_line_is_strict_json_and_a_nonfinite_value_keeps_its_name(tmp_path):
    # other tools' parsers (JavaScript's, jq's) refuse a bare NaN or Infinity
    log = EventLog(tmp_path / "events.jsonl")
    log.write("round", round=3, eval_loss=None, train_loss=float("nan"),
              clipped={"a": float("inf")}, losses=[1.5, float("-inf")], shape=(2, 3))
    line = (tmp_path / "events.jsonl").read_text()
    strict = json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in {line}"))
    assert strict["eval_loss"] is None and strict["train_loss"] == "NaN"
    assert strict["clipped"] == {"a": "Infinity"} and strict["losses"] == [1.5, "-Infinity"]
    assert strict["shape"] == [2, 3] and strict["round"] == 3 and strict["kind"] == "round"
    assert math.isinf(event_log.NONFINITE[strict["losses"][1]]) and log.failed == 0
