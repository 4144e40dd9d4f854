"""scripts/gpu_check.sh runs only when a GPU machine is at hand: its CPU dry run keeps it from rotting
in between (every step runs, the "GPU" side on the CPU), so a lent machine's minutes go to the GPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_gpu_check_script_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gc"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "cpu", "100000", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=400)
    finally:  # the peers' p2pd daemons run in process groups of their own: kill every descendant
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    for name in ("sparseloco", "int8", "fp16", "bf16", "fp32"):
        assert f"{name}: encode bytes identical True; decode identical True; aggregate identical True" in log
    assert (out / "bench-cpu-100000.json").exists() and (out / "train-local-cpu.json").exists()
    assert "[gpu_check] DiLoCo swarm done at" in log  # (every step's end, with the seconds since the start)
    assert "sparseloco swarm: the volunteers trained on {'cpu': ['cpu'], 'gpu': ['cpu']}" in log
    for algo in ("sparseloco", "diloco"):
        assert f"{algo} swarm check passed" in log
        assert "hashes agree across CPU volunteer, GPU volunteer and coordinator: True" in log
