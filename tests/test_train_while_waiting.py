"""With overlap, a peer whose round is still out after its H steps trains on (up to H more steps)
instead of standing still; the extra steps count toward its next contribution."""

from __future__ import annotations

import time

from groundswell.peer.roles import StopFlag, _merged, _train_while_waiting
from groundswell.peer.worker import InnerStats


class _Trainer:
    def __init__(self, on_call=lambda n: None) -> None:
        self.calls = 0
        self.on_call = on_call

    def run(self, num_steps, on_step=None):
        self.calls += 1
        self.on_call(self.calls)
        return InnerStats(num_steps, float(self.calls), 10 * num_steps, 0.5 * num_steps)


class _Exchange:
    def __init__(self, ready_after: int | None, trainer: _Trainer) -> None:
        self.ready_after, self.trainer = ready_after, trainer

    def ready(self) -> bool:
        return self.ready_after is not None and self.trainer.calls >= self.ready_after


def test_trains_until_the_round_is_in_and_no_longer():
    t = _Trainer()
    extra = _train_while_waiting(t, _Exchange(3, t), limit=10, stop=StopFlag(), on_step=None)
    assert t.calls == 3 and extra == InnerStats(3, 2.0, 30, 1.5)  # mean of losses 1, 2, 3


def test_a_round_already_in_costs_no_step():
    t = _Trainer()
    assert _train_while_waiting(t, _Exchange(0, t), limit=10, stop=StopFlag(), on_step=None) is None
    assert t.calls == 0


def test_a_stalled_round_gets_at_most_limit_extra_steps():
    t = _Trainer()
    extra = _train_while_waiting(t, _Exchange(None, t), limit=4, stop=StopFlag(), on_step=None)
    assert t.calls == 4 and extra is not None and extra.steps == 4


def test_stopping_ends_the_extra_steps():
    stop = StopFlag()
    t = _Trainer(on_call=lambda n: stop.set() if n == 2 else None)
    extra = _train_while_waiting(t, _Exchange(None, t), limit=10, stop=stop, on_step=None)
    assert t.calls == 2 and extra is not None and extra.steps == 2


def test_merged_stats_weight_losses_by_steps():
    m = _merged(InnerStats(10, 2.0, 100, 5.0), InnerStats(2, 5.0, 20, 1.0))
    assert m == InnerStats(12, 2.5, 120, 6.0)


def test_the_exchange_is_ready_only_once_its_attempt_has_an_outcome():
    from concurrent.futures import Future

    from groundswell.peer.swarm_exchange import SwarmExchange

    ex = SwarmExchange.__new__(SwarmExchange)  # no node needed to ask about the future
    ex._future = None
    assert not ex.ready()  # nothing in flight
    ex._future = Future()
    assert not ex.ready()
    ex._future.set_result(("outcome", None, None))
    assert ex.ready()


def test_a_retried_round_says_why_in_words():
    from concurrent.futures import Future
    from types import SimpleNamespace

    import pytest
    from groundswell.optim import RoundFailed
    from groundswell.peer.swarm_exchange import SwarmExchange
    from groundswell.protocol.client import AttemptResult
    from groundswell.protocol.schema import Decision

    ex = SwarmExchange(SimpleNamespace(identity=SimpleNamespace(peer_id="me"), client=object(), transport=object(),
                                       book=None,
                                       ctx=SimpleNamespace(deadline_s=1.0, slack_s=0.1, min_peers=3)))
    retry = Decision(4, 1, "retry", [], ["a"], ["a"], "a", [], 1, 0.0)
    for decision, words in ((retry, "fewer than 3 complete contributions (the run's min_peers)"),
                            (None, "no leader answered")):
        ex._round, ex._future = 4, Future()
        ex._future.set_result((AttemptResult(decision, b"", 1, True), None, None))
        with pytest.raises(RoundFailed, match=r"round 4 attempt 1: .*" + words.replace("(", r"\(").replace(")", r"\)")):
            ex.collect(4)
    # neither outcome is final yet: a later attempt may adopt a commit the retry took back, and
    # with no leader's answer, whether a commit counted us is not known (both settle by digest)
    assert [(u.round_id, u.included, u.retried) for u in ex.unsettled] == [(4, None, True), (4, None, False)]


def _waiting_exchange():
    """A SwarmExchange of a fake node (`down` None) with round 4's attempt in flight (a bare Future)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from groundswell.peer.swarm_exchange import SwarmExchange

    node = SimpleNamespace(identity=SimpleNamespace(peer_id="me"), client=object(), transport=object(), down=None, book=None,
                           ctx=SimpleNamespace(deadline_s=10.0, slack_s=1.0, min_peers=2))
    ex = SwarmExchange(node)
    ex._round, ex._future = 4, Future()
    return node, ex


def _collect_in_a_thread(ex):
    """Start `ex.collect(4)` in a thread; (the thread, the list its exception lands in)."""
    import threading

    raised: list[BaseException] = []

    def collect():
        try:
            ex.collect(4)
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    waiter = threading.Thread(target=collect, daemon=True)
    waiter.start()
    return waiter, raised


def test_a_node_that_went_down_ends_the_wait_for_its_attempt_at_once():
    # Its daemon died mid-attempt: the attempt would go on asking deaf peers until its own bounds
    # (a minute or two), training on meanwhile as a peer nobody can reach.
    from groundswell.peer.net_errors import NetworkError

    node, ex = _waiting_exchange()
    waiter, raised = _collect_in_a_thread(ex)
    time.sleep(0.3)
    node.down = "the network stopped (daemon died); start again to rejoin the run"
    waiter.join(5)
    assert not waiter.is_alive(), "still waiting for an attempt of a node that is down"
    assert isinstance(raised[0], NetworkError) and "daemon died" in str(raised[0])
    assert [(u.round_id, u.included) for u in ex.unsettled] == [(4, None)]  # a restart settles it


def test_a_second_ctrl_c_while_waiting_for_an_attempt_cancels_it(monkeypatch):
    # It would otherwise run on, owned by nobody, through the node's teardown: still sending
    # shards after our "left" record went out.
    import pytest
    from groundswell.peer import swarm_exchange

    def pressed(futures, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(swarm_exchange, "wait", pressed)
    _, ex = _waiting_exchange()
    future = ex._future
    with pytest.raises(KeyboardInterrupt):
        ex.collect(4)
    assert future.cancelled()


def test_an_attempt_that_timed_out_itself_is_its_outcome_at_once():
    # A TimeoutError the attempt raised is not the wait's slice running out: taken for one, the
    # wait spun on it until its whole limit (minutes)
    from groundswell.peer.swarm_exchange import NeedResync

    _, ex = _waiting_exchange()
    ex._future.set_exception(TimeoutError("the attempt's own bound"))
    waiter, raised = _collect_in_a_thread(ex)
    waiter.join(5)
    assert not waiter.is_alive(), "still waiting on an attempt that has its outcome"
    assert isinstance(raised[0], NeedResync) and "no outcome" in str(raised[0])
