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


def harden_unary_calls(p2p: Any) -> None:
    """Install `_LivePendingCalls` in a `hivemind.P2P`'s daemon client (once; pending calls kept)."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    calls = getattr(control, "_pending_calls", None)
    if isinstance(calls, dict) and not isinstance(calls, _LivePendingCalls):
        control._pending_calls = _LivePendingCalls(calls)
