"""A fix to hivemind's daemon client, installed on every node's `hivemind.P2P`."""

from __future__ import annotations

from typing import Any


class _LivePendingCalls(dict):
    """hivemind's table of a daemon client's pending unary calls, in which a call whose future is
    already done counts as absent.

    A call that times out has its future cancelled at once, but leaves the table only when its
    task runs again. hivemind's reader checks `call_id in table` before setting the result; a reply
    that lands in that window (a reply and a timeout in the same loop turn: after a freeze, under
    load) made it set the result of a cancelled future, which raised and ended the reader for
    good, and every later unary call of the node, ours and the DHT's, went unanswered. A churn
    test reproduced it: a peer thawed from an 8 s freeze never heard another reply."""

    def __contains__(self, call_id: object) -> bool:
        fut = self.get(call_id)
        return fut is not None and not fut.done()


class _SelfCleaningTasks(dict):
    """hivemind's table of a daemon client's running unary handlers, from which a task leaves
    once it is done, however it ended.

    hivemind removes a call's task only at the end of its handler. A caller that sends a request
    and closes its stream at once has the daemon forward the request and its cancel back to back;
    read in one go, the task is cancelled before its first step, the handler never runs (so our
    guard never sees the call: no rate limit, no strike) and the entry stays for good. A review
    leaked 2,000 of them (2.7 MiB) in one read; any peer could repeat it without end."""

    def __setitem__(self, call_id: Any, task: Any) -> None:
        super().__setitem__(call_id, task)
        task.add_done_callback(lambda done, key=call_id: self.pop(key) if self.get(key) is done else None)


def harden_unary_calls(p2p: Any) -> None:
    """Install `_LivePendingCalls` and `_SelfCleaningTasks` in a `hivemind.P2P`'s daemon client
    (once; what they hold kept)."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    calls = getattr(control, "_pending_calls", None)
    if isinstance(calls, dict) and not isinstance(calls, _LivePendingCalls):
        control._pending_calls = _LivePendingCalls(calls)
    tasks = getattr(control, "_handler_tasks", None)
    if isinstance(tasks, dict) and not isinstance(tasks, _SelfCleaningTasks):
        control._handler_tasks = _SelfCleaningTasks()
        for call_id, task in tasks.items():
            control._handler_tasks[call_id] = task
