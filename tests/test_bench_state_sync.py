"""scripts/bench_state_sync.py end to end on a small state: two processes with real p2pd daemons,
a closed run (allowlist, state readable by members only), the state sealed over direct TCP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_state_sync_closed_run_small(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the spawned workers import the script by name
    import bench_state_sync
    params = 300_000
    result = bench_state_sync.main(["--params", str(params), "--repeats", "1", "--warmup", "0", "--no-breakdown",
                                    "--settle", "0.2", "--json"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    # the "p2p" row raises unless the state came over the direct connection; each download is
    # checked against the signed digest and the parameter hash inside the client worker
    assert result["state_bytes"] > 8 * params
    assert result["p2p_s"] > 0 and result["tcp_s"] > 0 and result["stream_s"] > 0
    assert result["ratio"] == pytest.approx(result["p2p_s"] / result["tcp_s"])
    assert result["goal_within_2x_of_tcp"] is (result["ratio"] <= 2)
