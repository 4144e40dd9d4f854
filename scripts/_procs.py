"""Process plumbing shared by the benchmark scripts: end the p2pd daemons a run started, close a
node quietly, and run a worker process's command loop."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


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


def quiet_close(node: Any, verbose: bool) -> None:
    """Close a node. Closing cancels hivemind's stream callbacks, which asyncio reports at ERROR;
    the measurements are done by then, so that noise stays out of the output unless `verbose`."""
    import logging

    asyncio_log = logging.getLogger("asyncio")
    level = asyncio_log.level
    if not verbose:
        asyncio_log.setLevel(logging.CRITICAL)
    try:
        node.close()
    finally:
        asyncio_log.setLevel(level)


def serve_commands(make: Callable[[], Any], conn: Any, name: str, on_error: Callable[[], None] = lambda: None) -> None:
    """A benchmark worker process's loop: build the worker with `make`, then answer each
    (method, kwargs) the parent sends with ("ok", result) or ("error", traceback) until "exit";
    close the worker at the end. `on_error` runs before an error is reported (e.g. abort a barrier
    the other workers wait at)."""
    worker = None
    try:
        worker = make()
        conn.send(("ok", {}))
        while True:
            cmd, kwargs = conn.recv()
            if cmd == "exit":
                break
            try:
                conn.send(("ok", getattr(worker, cmd)(**kwargs)))
            except Exception:  # (Ctrl+C ends the worker: below)
                on_error()
                conn.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt):  # the parent is gone or interrupted us: just clean up
        pass
    except BaseException:
        on_error()
        with contextlib.suppress(OSError, ValueError):  # the parent may be gone already
            conn.send(("error", traceback.format_exc()))
    finally:
        if worker is not None:
            try:
                worker.close()
            except Exception as exc:
                print(f"[{name}] close failed: {exc!r}", file=sys.stderr, flush=True)
