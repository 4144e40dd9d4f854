"""The flag that stops a peer's loops: set by Ctrl+C (a signal handler) or another thread."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field


@dataclass
class StopFlag:
    """Set from a signal handler or another thread; loops check it between steps."""

    event: threading.Event = field(default_factory=threading.Event)
    signalled: bool = False
    _requests: queue.SimpleQueue | None = None  # see `set_from_signal`

    def set(self) -> None:
        """Set it (from any thread but in a signal handler: see `set_from_signal`)."""
        self.event.set()

    def arm_for_signals(self) -> None:
        """Start the thread `set_from_signal` hands the event to (call before installing handlers)."""
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            threading.Thread(target=self._set_when_asked, args=(self._requests,), name="stop-flag",
                             daemon=True).start()

    def set_from_signal(self) -> None:
        """Set it from a signal handler. The handler runs on the main thread, possibly while that
        thread holds the event's lock (entering or leaving `event.wait`) or another non-reentrant
        one (starting a thread): `Event.set` would wait for the lock forever. `SimpleQueue.put` is
        safe in a handler; the thread `arm_for_signals` started sets the event for us."""
        self.signalled = True  # seen at once by checks; the event wakes the waits
        assert self._requests is not None, "arm_for_signals() first"
        self._requests.put(True)

    def _set_when_asked(self, requests: queue.SimpleQueue) -> None:
        requests.get()
        self.event.set()

    def __bool__(self) -> bool:
        return self.signalled or self.event.is_set()
