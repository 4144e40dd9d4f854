"""scripts/bench_p2p_requests.py end to end on a tiny case: both paths, two sizes, a few requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_p2p_requests_measures_both_paths(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the spawned server unpickles its target by module name
    import bench_p2p_requests

    result = bench_p2p_requests.main(["--sizes", "300,40000", "--requests", "5", "--json"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert sorted((r["size"], r["path"], r["round"]) for r in rows) == sorted(
        (size, path, rnd) for size in (300, 40000) for path in ("stream", "unary") for rnd in (0, 1))
    assert all(r["ms_per_request"] > 0 and r["cpu_ms_per_request"] >= 0 for r in rows)
    assert all(set(r["cpu_ms_by_process"]) == {"client", "client p2pd", "server p2pd", "server"} for r in rows)
