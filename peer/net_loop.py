"""The network loop of a peer: an asyncio loop on a thread of its own, and how the trainer's
thread uses it. `call` runs a coroutine there and waits for it (cancelled if the wait ends
first, so nothing given up on runs on unowned); `submit` starts one and hands back its future."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
UNWIND_S = 2.0  # how long `call` waits for a coroutine it gave up on to run its `finally` blocks


class Stopped(Exception):
    """The stop flag given to `NetLoop.interrupt_calls_on` was set during a `call`."""


class NetLoop:
    """Owns the event loop and its thread; `SwarmNode` runs everything of the network on it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_quiet_cancelled)
        # Our own executor for `asyncio.to_thread`: closing cancels the jobs still queued in it
        # (the loop's default one ran them all first, holding up the process's exit).
        self._executor = ThreadPoolExecutor(thread_name_prefix="groundswell-work")
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="groundswell-net", daemon=True)
        self._interrupt: threading.Event | None = None  # see interrupt_calls_on

    def interrupt_calls_on(self, stop: threading.Event | None) -> None:
        """From now on every `call` raises `Stopped` once `stop` is set (None: no longer)."""
        self._interrupt = stop

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run a coroutine on the network loop and wait for its result (from the trainer thread).
        If the wait ends first (a timeout, `Stopped` once the `interrupt_calls_on` event is set,
        `_raise_if_down` raising, Ctrl+C) the coroutine is cancelled: nothing given up on runs on
        unowned."""
        stop = self._interrupt
        unwound = threading.Event()

        async def owned() -> T:
            try:
                return await coro
            finally:
                unwound.set()

        fut = asyncio.run_coroutine_threadsafe(owned(), self._loop)
        try:
            end = None if timeout_s is None else time.monotonic() + timeout_s
            while not fut.done():
                if stop is not None and stop.is_set():
                    raise Stopped("stopped while waiting on the network")
                self._raise_if_down()
                left = 0.2 if end is None else min(0.2, end - time.monotonic())
                if left <= 0:
                    raise TimeoutError()
                futures_wait([fut], timeout=left)
            return fut.result()
        except BaseException as exc:
            # The cancellation reaches the coroutine on the loop's thread: wait (bounded) until its
            # `finally` blocks ran, so the caller never goes on beside them (a record being written).
            # Not for a second Ctrl+C (KeyboardInterrupt): that one means leave now.
            if fut.cancel() and self._loop.is_running() and not isinstance(exc, KeyboardInterrupt):
                unwound.wait(UNWIND_S)
            raise

    def _raise_if_down(self) -> None:
        """(A subclass's) raise if what the loop serves stopped by itself: a `call` waiting on it
        ends then, not at its timeout."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        """Start a coroutine on the network loop; the returned future is the caller's to await."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def stop_loop(self) -> None:
        """Cancel what still runs on the loop, stop it, join its thread and close it."""
        if self._loop.is_running():
            # Requests started by the trainer thread (and hivemind's own readers) are not in the
            # node's TaskGroup; cancel and await them so nothing runs on a closed loop.
            try:
                asyncio.run_coroutine_threadsafe(_cancel_stragglers(), self._loop).result(timeout=10)
            except Exception as exc:
                log.warning("network shutdown: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.ident is not None:  # started (closing a node that never started is fine)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._executor.shutdown(wait=False, cancel_futures=True)  # a job running now still ends on its own
            self._loop.close()


def _quiet_cancelled(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The node loop's exception handler: asyncio's stream callback asks a handler task that was
    cancelled (on shutdown, or by hivemind) for its exception, which raises CancelledError; that is
    a cancellation, not an error, and users leaving a run used to see a traceback per open stream."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


async def _cancel_stragglers() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
