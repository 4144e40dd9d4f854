"""Process cleanup shared by the benchmark scripts: find and end the p2pd daemons a run started."""

from __future__ import annotations

import os
import signal
import time


def cmdline(pid: int) -> str:
    """A process's command line, or "" if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def p2pd_pids_using(tmp: str) -> list[int]:
    """p2pd processes whose identity file is in `tmp` (so they are this run's, nobody else's)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmd = cmdline(int(entry))
            if "p2pd" in cmd and f"-id={tmp}{os.sep}" in cmd:
                pids.append(int(entry))
    return pids


def kill_if_p2pd(pid: int) -> None:
    """SIGTERM (then SIGKILL) a pid, but only while it is still a p2pd."""
    if "p2pd" not in cmdline(pid):
        return  # already gone (or the pid was reused by something else)
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            if "p2pd" not in cmdline(pid):
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
