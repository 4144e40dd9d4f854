"""How hivemind's p2pd daemon is started: in its own process group, and tied to our life.

hivemind starts p2pd as a plain child, in our process group. A terminal sends Ctrl+C (SIGINT) to
the whole foreground group, so the daemon died at the first press, while the peer was still
finishing its round ("stopping after this round"): the round could not finish, and the
coordinator hung until the second press. On Linux the daemon now gets its own process group, so
Ctrl+C reaches only us, and a parent-death signal (prctl PR_SET_PDEATHSIG), so that it still
ends when we do, even on SIGKILL. Elsewhere (no prctl) the daemon stays in our group, as before:
an orphaned daemon would be worse than an early one.

The death signal follows the *thread* that started the daemon: our network thread, which shuts
the daemon down before it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
_installed = False
_lock = threading.Lock()
# The daemons each event loop started: hivemind does not wait for one that failed to start, and
# a loop closed before its exit is reaped logs an asyncio warning at the user.
_started: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = weakref.WeakKeyDictionary()


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # resolved here: the child, between fork and exec, only calls it


def daemon_owns_group() -> bool:
    """Whether p2pd daemons started from now on get their own process group (Linux only)."""
    return _PRCTL is not None


def _die_with_parent(parent: int) -> Callable[[], None]:
    def preexec() -> None:  # in the child, between fork and exec: no imports, no locks
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # type: ignore[misc]
        if os.getppid() != parent:  # the parent died before the line above: follow it now
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def install_p2pd_launcher() -> None:
    """From now on, p2pd daemons hivemind starts run in their own process group and get SIGTERM
    when the thread that started them ends (idempotent; a no-op where prctl is missing)."""
    global _installed
    if _PRCTL is None:
        return
    with _lock:
        if _installed:
            return
        original = asyncio.subprocess.create_subprocess_exec

        async def create_subprocess_exec(program: Any, *args: Any, **kwargs: Any) -> Any:
            # Only hivemind's daemon is affected; any other program starts as asked.
            if os.path.basename(str(program)) != "p2pd" or "preexec_fn" in kwargs:
                return await original(program, *args, **kwargs)
            kwargs.setdefault("process_group", 0)
            kwargs["preexec_fn"] = _die_with_parent(os.getpid())
            proc = await original(program, *args, **kwargs)
            _started.setdefault(asyncio.get_running_loop(), []).append(proc)
            return proc

        asyncio.subprocess.create_subprocess_exec = create_subprocess_exec  # type: ignore[assignment]
        _installed = True


async def reap_daemons(timeout_s: float = 2.0) -> None:
    """End and wait for every daemon this event loop started; call once the loop's node has shut
    its daemon down (hivemind waits for those, not for one that failed to start)."""
    for proc in _started.pop(asyncio.get_running_loop(), []):
        for end in (proc.terminate, proc.kill):
            if proc.returncode is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                end()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout_s)
