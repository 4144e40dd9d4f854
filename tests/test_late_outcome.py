"""A contribution whose outcome a volunteer did not learn in time (its leader died after
committing, the aggregate could not be fetched) is checked against the round's commit once the
volunteer is past that round, and taken out of its work if the commit counted it."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from groundswell.compression import make_codec
from groundswell.optim import RoundFailed, SparseLoCo, SparseLoCoConfig
from groundswell.peer.stop_flag import StopFlag
from groundswell.peer.swarm_exchange import NeedResync, SwarmExchange
from groundswell.peer.unsettled import Unsettled
from groundswell.peer.volunteer_loop import VolunteerLoop as _VolunteerLoop
from groundswell.protocol.client import AttemptResult
from groundswell.protocol.transport import PeerUnavailable


class _Node:
    """What `SwarmExchange` uses of a node; `outcome` is what the attempt on the network gave."""

    def __init__(self, outcome) -> None:
        self.identity = SimpleNamespace(peer_id="me")
        self.ctx = SimpleNamespace(deadline_s=1.0, slack_s=0.1, min_peers=2)
        self.client = SimpleNamespace()
        self.transport = SimpleNamespace(bytes_sent=0, bytes_received=0)
        self.book = SimpleNamespace(committed={})
        self.outcome = outcome

    def submit(self, coro) -> Future:
        coro.close()  # the network is not there: the attempt "ran" and gave `outcome`
        fut: Future = Future()
        fut.set_result(self.outcome)
        return fut


def _payloads(n: int = 8192):
    outer = SparseLoCo([torch.nn.Parameter(torch.zeros(n))], make_codec("sparseloco"), SparseLoCoConfig(eager=False))
    return outer.encode(torch.randn(n))


@pytest.mark.parametrize("outcome,raised,included", [
    ((AttemptResult(None, b"", 0, True, False), None, None), RoundFailed, None),  # no leader answered
    ((AttemptResult(SimpleNamespace(status="commit", round=0, contributors=["me"]), b"s", 0, True, True),
      PeerUnavailable("no holder"), None), NeedResync, True),  # committed with us, aggregate out of reach
])
def test_a_round_settled_without_its_outcome_is_remembered(outcome, raised, included):
    ex = SwarmExchange(_Node(outcome))
    payloads = _payloads()
    ex.contribute(0, payloads)
    with pytest.raises(raised):
        ex.collect(0)
    assert [(u.round_id, u.included, u.prepared) for u in ex.unsettled] == [(0, included, 1)]
    assert ex.last_outcome == (included, False)  # what work_file notes for a restart
    assert ex.unsettled[0].segments == [p.to_bytes() for p in payloads]
    assert ex._segments == []  # the contribution in flight is not kept past its outcome
    assert ex.take_unsettled(0) == []  # round 0 not applied yet: its outcome may still come
    assert len(ex.take_unsettled(1)) == 1 and ex.unsettled == []


def test_a_contribution_a_commit_counted_is_never_forgotten_for_newer_ones_it_did_not():
    """Round 0 commits with us in it, but its aggregate is out of reach (a link down): the loop
    tries round 0 again and again, each new contribution known to be in nothing (the commit pins
    the first one) and its aggregate still out of reach. The counted one used to be dropped as the
    oldest after four such tries: its work then stayed ours and went out a second time."""
    commit = SimpleNamespace(status="commit", round=0, contributors=["me"])
    node = _Node((AttemptResult(commit, b"s", 0, True, True), PeerUnavailable("no holder"), None))
    ex = SwarmExchange(node)
    counted = _payloads()
    ex.contribute(0, counted)
    with pytest.raises(NeedResync):
        ex.collect(0)
    node.outcome = (AttemptResult(commit, b"s", 1, True, False), PeerUnavailable("no holder"), None)
    for _ in range(6):
        ex.contribute(0, _payloads())
        with pytest.raises(NeedResync):
            ex.collect(0)
    # the counted one is kept; the others are in nothing, their work simply stays ours
    assert [(u.round_id, u.included) for u in ex.unsettled] == [(0, True)]
    assert ex.unsettled[0].segments == [p.to_bytes() for p in counted]
    # and however many counted ones pile up, the cap forgets none of them
    ex.unsettled = ex.unsettled * 6
    ex._keep_newest()
    assert len(ex.unsettled) == 6


def test_a_retried_contribution_stays_open_until_its_round_commits():
    """A leader's retry takes back the commit it sealed, but a take-back that misses an
    aggregator lets a later attempt adopt that commit: the contribution's outcome is open until
    the round's commit is known (then it is settled by digest). As many retried attempts of a
    round are kept as a later claim looks back on (a review found only the newest two kept, while
    a claim may adopt the commit of any of the four before it: the work went out twice)."""
    from groundswell.protocol.claims import EARLIER_ATTEMPTS_CLAIMED

    retry = SimpleNamespace(status="retry", round=0, contributors=[])
    ex = SwarmExchange(_Node((AttemptResult(retry, b"", 0, True, False), None, None)))
    sent = []
    tries = EARLIER_ATTEMPTS_CLAIMED + 2
    for _ in range(tries):
        payloads = _payloads()
        sent.append([p.to_bytes() for p in payloads])
        ex.contribute(0, payloads)
        with pytest.raises(RoundFailed):
            ex.collect(0)
    kept = EARLIER_ATTEMPTS_CLAIMED
    assert [(u.round_id, u.included, u.retried, u.prepared) for u in ex.unsettled] == [
        (0, None, True, n) for n in range(tries - kept + 1, tries + 1)]
    assert [u.segments for u in ex.unsettled] == sent[-kept:]
    assert ex.last_outcome == (None, True)
    assert [(i["round"], i["segments"], i["decayed"], i["retried"]) for i in ex.unsettled_work()] == [
        (0, sent[tries - kept + n], kept - 1 - n, True) for n in range(kept)]
    assert ex.take_unsettled(0) == []  # the round is still open


def _loop(counted, scaled=()):
    """A volunteer loop whose outer optimizer holds an error feedback of ones, and whose exchange
    has one unsettled contribution of round 0; `counted`: what round 0's commit says of it;
    `scaled`: where its mean took it clipped (an exception: finding out failed)."""
    n = 8192
    outer = SparseLoCo([torch.nn.Parameter(torch.zeros(n))], make_codec("sparseloco"),
                       SparseLoCoConfig(error_decay=0.5, eager=False))
    payloads = outer.encode(torch.randn(n))
    outer.round_id = 1  # past round 0: the global parameters took its commit
    outer.error = torch.ones(n)
    events: list[str] = []

    class Exchange:
        prepared = 3

        def __init__(self):
            self.unsettled = []

        def take_unsettled(self, below):
            return [Unsettled(0, [p.to_bytes() for p in payloads], counted if isinstance(counted, bool) else None, 2)]

        async def counts_ours(self, round_id, segments, basis=b""):
            if isinstance(counted, Exception):
                raise counted
            return counted

        async def own_scaled(self, round_id):
            assert round_id == 0
            if isinstance(scaled, Exception):
                raise scaled
            return scaled

    p = SimpleNamespace(outer=outer, identity=SimpleNamespace(peer_id="me"),
                        node=SimpleNamespace(call=lambda coro, timeout_s: asyncio.run(coro),
                                             interrupt_calls_on=lambda stop: None),
                        events=SimpleNamespace(write=lambda kind, **kw: events.append(kind)))
    loop = _VolunteerLoop(p, Exchange(), None, [], StopFlag(), None)  # type: ignore[arg-type]
    return loop, outer, outer.decode(payloads), events


def test_a_contribution_a_commit_counted_after_all_is_taken_out_of_the_error_feedback():
    loop, outer, sent, events = _loop(True)
    loop.settle_late()
    # one contribution was prepared after it (3 - 2): the error feedback decayed it once
    assert torch.allclose(outer.error, 1 - 0.5 * sent)
    assert events == ["included-late"]


@pytest.mark.parametrize("scaled", [((0, 4096, 0.25),), None, PeerUnavailable("no holder"), TimeoutError()])
def test_a_contribution_counted_late_keeps_the_part_norm_clipping_took_off(scaled):
    """As on time: what the mean took leaves the error feedback, the part clipping scaled away
    stays. Where that is not known (the aggregate is out of reach) it is taken out whole, which
    loses the clipped part but never sends anything twice."""
    loop, outer, sent, events = _loop(True, scaled)
    loop.settle_late()
    taken = sent.clone()
    if isinstance(scaled, tuple):
        taken[:4096] *= 0.25
    assert torch.allclose(outer.error, 1 - 0.5 * taken)
    assert events == ["included-late"] and loop.exchange.unsettled == []


def test_a_late_settle_takes_out_what_an_on_time_settle_would():
    """The late path (`settle_late` with the round's clip factors) leaves the error feedback the
    on-time path (`apply` with `RoundResult.scaled`) would have left."""
    from groundswell.optim import RoundResult

    n, scaled = 8192, ((0, 4096, 0.3), (4096, 8192, 0.7))
    errors = []
    for late in (False, True):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.zeros(n))
        outer = SparseLoCo([param], make_codec("sparseloco"), SparseLoCoConfig(eager=False))
        with torch.no_grad():
            param.add_(torch.randn(n))
        payloads = outer.prepare()
        mean = torch.zeros(n)  # the same step either way: only the error feedback differs
        if late:
            outer.apply(None)
            outer.follow(0, mean)
            outer.settle_late(payloads, 0, scaled)
        else:
            outer.apply(RoundResult(round_id=0, mean=mean, contributors=("me",), included=True, bytes_sent=0, bytes_received=0, scaled=scaled))
        errors.append(outer.error.clone())
    assert not torch.equal(errors[0], torch.zeros(n))
    assert torch.equal(errors[0], errors[1])


@pytest.mark.parametrize("codec,clip,known,fetched,expected", [
    ("sparseloco", 1.0, {5: ((0, 8, 0.5),)}, False, ((0, 8, 0.5),)),  # noted when the aggregate came
    ("sparseloco", 1.0, {}, True, ((8, 16, 0.25),)),  # not fetched here yet: worked out from the contributions
    ("sparseloco", 0.0, {}, False, ()),  # no clipping in this run
    ("fp32", 1.0, {}, True, ((8, 16, 0.25),)),  # a dense mean's shards say it
])
def test_where_the_mean_clipped_a_late_contribution_is_found_out(codec, clip, known, fetched, expected):
    fetches: list[bytes] = []

    async def note_own_scaled(signed):
        fetches.append(signed)
        client.own_scaled[5] = ((8, 16, 0.25),)  # as the real client notes it

    node = _Node(None)
    node.ctx = SimpleNamespace(codec=SimpleNamespace(name=codec), robust=SimpleNamespace(clip=clip),
                               verify_aggregates=False)
    node.book = SimpleNamespace(committed={5: (b"signed", SimpleNamespace(round=5))})
    client = node.client = SimpleNamespace(own_scaled=dict(known), note_own_scaled=note_own_scaled)
    ex = SwarmExchange(node)  # type: ignore[arg-type]
    assert asyncio.run(ex.own_scaled(5)) == expected
    assert fetches == ([b"signed"] if fetched else [])
    node.book.committed.clear()
    assert asyncio.run(ex.own_scaled(6)) is None  # its commit is not known here


@pytest.mark.parametrize("counted,event", [(False, []), (None, ["outcome-unknown"])])
def test_a_contribution_no_commit_is_known_to_count_stays_ours(counted, event):
    loop, outer, _, events = _loop(counted)
    loop.settle_late()
    assert torch.equal(outer.error, torch.ones_like(outer.error))
    assert events == event
    assert loop.exchange.unsettled == []  # settled: it is not asked about again


@pytest.mark.parametrize("failure", [PeerUnavailable("x"), TimeoutError()])
def test_a_contribution_whose_check_failed_on_the_way_is_checked_again_later(failure):
    # A timeout is not an answer: taken as "unknown", the work stayed ours for good, and went out
    # a second time if the commit had counted it.
    loop, outer, _, events = _loop(failure)
    loop.settle_late()
    assert torch.equal(outer.error, torch.ones_like(outer.error)) and events == []
    assert [(u.round_id, u.included) for u in loop.exchange.unsettled] == [(0, None)]


@pytest.mark.parametrize("sent,num_shards,expected", [
    ([b"a", b"b", b"c"], 2, True), ([b"a", b"X", b"c"], 2, False),  # one shard's digest is not ours
    ([b"a", b"b", b"c"], 4, False),  # not a split of three segments: it cannot pin ours
])
def test_a_commit_is_checked_by_its_digests_without_the_rounds_plan(sent, num_shards, expected):
    """Several contributions of ours may exist for one round (one per attempt), and a restarted or
    re-synced peer does not know old rounds' plans: the commit's shard count fixes each shard's
    segments, so its pinned digests say which contribution it counts."""
    from groundswell.protocol.client import RoundClient
    from groundswell.protocol.context import contribution_digest

    ours = [b"a", b"b", b"c"]  # two shards: segments [0, 2) and [2, 3)
    pinned = [b"\0" * 32, contribution_digest(0, ours[0:2]), b"\0" * 32, contribution_digest(2, ours[2:3])]
    client = object.__new__(RoundClient)
    client.me = "me"
    commit = SimpleNamespace(status="commit", contributors=["other", "me"], round=3, attempt=1,
                             num_shards=num_shards, digests=pinned)
    assert asyncio.run(client.counts_ours(commit, sent)) is expected


@pytest.mark.parametrize("holding,expected", [({"b"}, True), (set(), None)])
def test_a_commit_this_peer_does_not_hold_is_asked_of_the_peers_that_applied_the_round(holding, expected):
    asked: list[str] = []
    book = SimpleNamespace(committed={})

    async def ask_decision(peer, round_id, attempt, wait_s, strict=False):
        asked.append((peer, round_id))
        if peer in holding:  # a checked commit goes into the book, as the real client does
            book.committed[round_id] = (b"signed", SimpleNamespace(round=round_id))
            return b"signed"
        return b""

    async def counts_ours(decision, segments):
        assert decision.round == 5
        return True

    node = _Node(None)
    node.book = book
    node.client = SimpleNamespace(ask_decision=ask_decision, counts_ours=counts_ours)
    node.holders = lambda round_id: ["a", "b", "c", "d", "e"]
    # the coordinator C at round 7 vouches for b's state (round 6); x, y and z claim rounds far past C's
    record = lambda r, h="": SimpleNamespace(round=r, params_hash=h)  # noqa: E731
    coordinator = SimpleNamespace(round=7, params_hash="hc", earlier_hashes=["6:hb"])
    node.cached_records = {"C": coordinator, "a": record(6), "b": record(6, "hb"), "c": record(6), "d": record(6),
                           "e": record(6), "x": record(1 << 40), "y": record(1 << 40), "z": record(1 << 40)}
    node.options = SimpleNamespace(coordinator="C")
    node.holders = lambda round_id: ["x", "y", "z", "a", "b", "c", "d", "e"]  # the made-up ones first
    ex = SwarmExchange(node)  # type: ignore[arg-type]
    assert asyncio.run(ex.counts_ours(5, [b"x"])) is expected
    assert len(asked) == 3 and ("b", 5) in asked  # a few holders at most, at once, the vouched one first
    assert not {p for p, _ in asked} & {"x", "y", "z"}  # none whose record claims a round far past C's
    asked.clear()
    if expected:
        asyncio.run(ex.counts_ours(5, [b"x"]))
        assert asked == []  # held now: nobody is asked again


@pytest.mark.parametrize("failure", ["retry", "resync"])
def test_a_stopping_volunteer_does_not_download_the_state_before_it_saves(monkeypatch, failure):
    """Ctrl+C during a round that then failed: the volunteer saves what it holds and leaves, instead
    of first catching up or re-syncing (a state download may take minutes; a second Ctrl+C would
    then skip the final checkpoint)."""
    from groundswell.peer import volunteer_loop
    from groundswell.peer.roles import StopFlag
    from groundswell.peer.swarm_exchange import NeedResync

    synced: list[str] = []
    monkeypatch.setattr(volunteer_loop, "catch_up_or_resync", lambda p, peers, fresh=True: synced.append("catch-up"))
    monkeypatch.setattr(volunteer_loop, "resync", lambda p, peers: synced.append("resync"))

    class Exchange:
        last_outcome = (None, False)

        def __init__(self):
            self.unsettled: list = []

        def collect(self, r):
            raise RoundFailed("no leader answered") if failure == "retry" else NeedResync("behind")

        def take_unsettled(self, below):
            return []

    manifest = SimpleNamespace(round=SimpleNamespace(deadline_s=0.01, slack_s=0.01))
    p = SimpleNamespace(manifest=manifest, outer=SimpleNamespace(apply=lambda r: None, round_id=0),
                        identity=SimpleNamespace(peer_id="me"), events=SimpleNamespace(write=lambda *a, **k: None),
                        node=SimpleNamespace(interrupt_calls_on=lambda stop: None))
    stats = SimpleNamespace(mean_loss=1.0)
    for stopping in (True, False):
        stop = StopFlag()
        if stopping:
            stop.set()
        loop = _VolunteerLoop(p, Exchange(), None, [], stop, lambda info: None)  # type: ignore[arg-type]
        synced.clear()
        loop.settle(0, stats, 0.0, 0.0)
        assert synced == ([] if stopping else ["catch-up" if failure == "retry" else "resync"])


@pytest.mark.parametrize("error,pending,saved", [
    ("network", None, True),  # the node went down: the rounds applied since the last checkpoint are kept
    ("other", None, False),  # maybe our state's own fault (a NaN loss): the last good checkpoint stays
])
def test_a_volunteer_whose_network_fails_saves_what_it_holds_first(error, pending, saved):
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.roles import _saved_if_the_network_fails

    checkpoints: list[int] = []
    p = SimpleNamespace(outer=SimpleNamespace(pending=pending))
    loop = SimpleNamespace(checkpoint=lambda: checkpoints.append(1))
    raised = NetworkError("the network stopped") if error == "network" else FloatingPointError("nan loss")
    with pytest.raises(type(raised)), _saved_if_the_network_fails(p, loop):
        raise raised
    assert checkpoints == ([1] if saved else [])


def test_contributions_still_open_when_the_network_fails_mid_settle_are_kept_in_order():
    # The node went down while a commit was being checked: what was not settled stays open (a
    # checkpoint written on the way out lists it), or a counted one's work would go out again.
    from groundswell.peer.net_errors import NetworkError

    loop, outer, _, events = _loop(NetworkError("the network stopped"))
    with pytest.raises(NetworkError):
        loop.settle_late()
    assert [(u.round_id, u.included) for u in loop.exchange.unsettled] == [(0, None)]
    assert torch.equal(outer.error, torch.ones_like(outer.error)) and events == []


def test_a_crashed_processs_last_contribution_presumed_counted_is_never_forgotten():
    """The last contribution a crashed process sent is taken out of our work when its commit
    cannot be checked (it most likely counted): the cap must not drop it as if it had not."""
    from groundswell.peer.unsettled import KEEP_UNSETTLED, unsettled_item

    ex = SwarmExchange(_Node(None))
    last = KEEP_UNSETTLED + 3  # more than the cap after the presumed one
    ex.restore_unsettled([unsettled_item(1, [b"last"], 5, presume=True)]
                         + [unsettled_item(r, [bytes([r])], last - r) for r in range(2, last + 1)])
    ex._keep_newest()
    assert [(u.round_id, u.if_unknown) for u in ex.unsettled] == [(1, True)] + [
        (r, False) for r in range(last - KEEP_UNSETTLED + 2, last + 1)]


@pytest.mark.parametrize("counted", [True, None])  # None: presumed counted (a crashed process's last)
def test_a_stored_contribution_that_does_not_decode_drops_our_unsent_work_not_the_peer(counted):
    """A segment read back from a damaged record or checkpoint does not decode: its work cannot
    be taken out of the error feedback, and kept it would be sent twice. The error feedback goes
    (and every open contribution with it, or each would be taken out of nothing later); the peer
    carries on. It used to stop with the CodecError."""
    for segment in (b"\x93garbled", None):  # None: a whole segment claiming more values than the model has
        loop, outer, _, events = _loop(counted)
        if segment is None:
            n = outer.global_params.numel()
            segment = outer.codec.encode(torch.randn(n + 4096)).to_bytes()  # (refused before it is parsed)
        loop.exchange.take_unsettled = lambda below, s=segment: [Unsettled(0, [s], counted, 2, if_unknown=True)]
        loop.exchange.unsettled = [Unsettled(4, [b"later"], None, 3)]  # open, its round not past yet
        loop.settle_late()
        assert torch.equal(outer.error, torch.zeros_like(outer.error))
        assert events == ["unsettled-corrupt"] and loop.exchange.unsettled == []


def test_an_announcement_superseded_is_cancelled_and_one_that_failed_is_reported(caplog):
    """A retried first round announces again: the announcement before it was overwritten, still
    running (nobody owned it) or failed (its error never seen). Now a newer announcement cancels
    the one still out."""
    submitted: list[Future] = []

    class Node(_Node):
        def submit(self, coro) -> Future:
            coro.close()
            fut: Future = Future()
            submitted.append(fut)
            return fut

    node = Node(None)
    node.client = SimpleNamespace(announce=lambda *a, **kw: asyncio.sleep(0))
    ex = SwarmExchange(node)
    ex.announce(0)
    ex.announce(0)
    assert submitted[0].cancelled() and not submitted[1].cancelled()
    submitted[1].set_running_or_notify_cancel()
    submitted[1].set_exception(PeerUnavailable("no leader answered"))
    caplog.set_level("WARNING", logger="groundswell.peer.swarm_exchange")
    ex.announce(0)
    assert "announcing round 0 failed: no leader answered" in caplog.text
    node.outcome = (AttemptResult(None, b"", 0, True, False), None)
    # the contribution leaves an announcement still out to finish: it also asks the leaders of the
    # round's later attempts, which the contribution does not reach until they begin (review)
    ex.contribute(0, _payloads())
    assert not submitted[2].cancelled() and ex._announced is None


@pytest.mark.parametrize("counted", [True, None])
def test_once_stopping_late_contributions_are_settled_with_what_the_peer_holds(counted):
    # A check may wait out a request timeout, so none is made on the way out; but one the book can
    # answer is settled (left open, a commit counted and dropped from the books before the next
    # start would make its work go out twice). One that needs the network stays open for the
    # next start; clipping not known here takes the contribution out whole.
    from groundswell.peer.stop_flag import StopFlag

    loop, outer, sent, events = _loop(counted, PeerUnavailable("must not be asked"))
    asked: list[str] = []
    real_counts = loop.exchange.counts_ours

    async def counts_ours(round_id, segments, basis=b""):
        asked.append("counts_ours")
        return await real_counts(round_id, segments, basis)

    loop.exchange.counts_ours = counts_ours
    loop.exchange.holds_commit = lambda round_id: False  # a later state was taken: not in our book
    loop.exchange.known_own_scaled = lambda round_id: None
    loop.stop = StopFlag()
    loop.stop.set()
    loop.settle_late()
    assert asked == []
    if counted:  # known: taken out of the error feedback (whole: clipping unknown here)
        assert torch.allclose(outer.error, 1 - 0.5 * sent) and events == ["included-late"]
    else:  # needs the network: still open, the work untouched
        assert torch.equal(outer.error, torch.ones_like(outer.error)) and events == []
        assert len(loop.exchange.unsettled) == 1


def test_ctrl_c_ends_the_state_download_at_once(monkeypatch):
    # Until the state is in there is no round to finish; the first Ctrl+C used to wait out the
    # download (its timeout is many minutes for a large model).
    import threading
    import time

    from groundswell.peer import roles
    from groundswell.peer.net_loop import NetLoop
    from groundswell.peer.stop_flag import StopFlag

    node = NetLoop()
    node._thread.start()
    events: list[str] = []
    p = SimpleNamespace(node=node, start_network=lambda: None, identity=SimpleNamespace(peer_id="me"), manifest=None,
                        events=SimpleNamespace(write=lambda kind, **kw: events.append(kind)))
    node.startup_s, node.maddrs, node.options = {}, [], SimpleNamespace(reachability="auto")
    monkeypatch.setattr(roles, "resume_and_sync", lambda p, peers: p.node.call(asyncio.sleep(30), timeout_s=60))
    stop = StopFlag()
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            roles.run_volunteer(p, [], max_rounds=None, stop=stop)
        except BaseException as exc:  # noqa: BLE001 (shown by the assert below)
            failed.append(exc)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        time.sleep(0.5)
        stop.set()
        assert done.wait(10), "Ctrl+C waited for the download"
        assert failed == []
        assert events == ["network", "stopped"]
        assert node._interrupt is None  # later calls (the checkpoint, the departure) are not cut short
    finally:
        thread.join(40)
        node.stop_loop()


def test_a_run_already_past_until_round_is_said_before_anything_trains(monkeypatch, caplog):
    # It downloaded the state, then left with "left the run cleanly" and nothing else (a CLI audit).
    import threading

    from groundswell.peer import roles
    from groundswell.peer.net_loop import NetLoop
    from groundswell.peer.stop_flag import StopFlag

    node = NetLoop()
    node.startup_s, node.maddrs, node.options = {}, [], SimpleNamespace(reachability="auto")
    p = SimpleNamespace(node=node, start_network=lambda: None, identity=SimpleNamespace(peer_id="me"), manifest=None,
                        events=SimpleNamespace(write=lambda kind, **kw: None), outer=SimpleNamespace(round_id=104))
    monkeypatch.setattr(roles, "resume_and_sync", lambda p, peers: None)
    monkeypatch.setattr(threading.Thread, "start", lambda self: None)  # (no optimizer imports to warm)
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: None)

    class Trained(Exception):
        pass

    def trainer(p):
        raise Trained

    monkeypatch.setattr(roles, "volunteer_trainer", trainer)
    try:
        with pytest.raises(Trained):
            roles.run_volunteer(p, [], max_rounds=None, stop=StopFlag(), until_round=5)
        assert "the run is at round 104 already, past --until-round 5" in caplog.text
        caplog.clear()
        p.outer.round_id = 4
        with pytest.raises(Trained):
            roles.run_volunteer(p, [], max_rounds=None, stop=StopFlag(), until_round=5)
        assert "until-round" not in caplog.text
    finally:
        node.stop_loop()  # (its descriptors, closed now rather than by the collector in another test)


@pytest.mark.parametrize("work_only", [True, False])
def test_a_state_restored_from_work_pt_alone_is_checkpointed_with_its_open_contributions(monkeypatch, work_only):
    # Found by a review of the state files: restored from work.pt alone (every checkpoint
    # damaged), the volunteer wrote its first checkpoint without the contributions still open,
    # which its error feedback holds; a restart from it after a crash during their settlement
    # (work.pt damaged meanwhile) sent counted work a second time. Now they are restored first
    # and the checkpoint lists them, before the settlement begins.
    import threading

    from groundswell.peer import roles
    from groundswell.peer.net_loop import NetLoop
    from groundswell.peer.stop_flag import StopFlag
    from groundswell.peer.unsettled import unsettled_item

    calls: list[str] = []
    node = NetLoop()
    node.startup_s, node.client, node.maddrs = {}, None, []
    node.options = SimpleNamespace(serves=True, reachability="auto")
    node.call = lambda coro, timeout_s=None: (coro.close(), (_ for _ in ()).throw(RuntimeError("offline")))
    p = SimpleNamespace(node=node, start_network=lambda: None, identity=SimpleNamespace(peer_id="me"),
                        manifest=SimpleNamespace(outer=SimpleNamespace(overlap=0)), state_dir=None,
                        events=SimpleNamespace(write=lambda kind, **kw: None), outer=SimpleNamespace(round_id=4),
                        save_checkpoint=lambda extra=None, **kw: calls.append("checkpoint without the open ones"))
    item = unsettled_item(3, [b"segment"], 0)
    resumed = {"work_only": True, "round": 3, "inner_progress": None, "unsettled": [item]} if work_only else \
        {"round": 3, "outer": {}, "unsettled": [item]}
    monkeypatch.setattr(roles, "resume_and_sync", lambda p, peers: resumed)
    monkeypatch.setattr(roles, "restore_local_progress", lambda p, resumed: None)
    monkeypatch.setattr(roles, "write_defence_counts", lambda p: None)
    monkeypatch.setattr(roles, "volunteer_trainer", lambda p: SimpleNamespace(state_dict=lambda: {}))
    monkeypatch.setattr(threading.Thread, "start", lambda self: None)
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: None)

    class Exchange:
        announce_next = False

        def __init__(self, node, serves):
            pass

        def restore_unsettled(self, items):
            calls.append(f"restored {[i['round'] for i in items]}")

        def drop_announcements(self):
            pass

    class Loop:
        def __init__(self, p, exchange, *args):
            self.exchange, self.applied = exchange, 0

        def checkpoint(self):
            calls.append("checkpoint with the open ones")

        def settle_late(self):
            calls.append("settled")

    monkeypatch.setattr(roles, "SwarmExchange", Exchange)
    monkeypatch.setattr(roles, "VolunteerLoop", Loop)
    stop = StopFlag()
    stop.set()  # no round: what happens between the restore and the first round is the point
    try:
        roles.run_volunteer(p, [], max_rounds=None, stop=stop)
    finally:
        node.stop_loop()
    if work_only:
        assert calls[:3] == ["restored [3]", "checkpoint with the open ones", "settled"], calls
    else:  # a checkpoint was loaded: it is on disk already, and lists them itself
        assert calls[:2] == ["restored [3]", "settled"], calls
    assert "checkpoint without the open ones" not in calls


@pytest.mark.parametrize("where", ["collect", "elsewhere", "before-sending"])
def test_a_diloco_volunteer_whose_node_dies_with_a_contribution_out_keeps_its_work_and_saves(where):
    # Found by a review: the guard wrote no checkpoint while a contribution was out, and the
    # restart, from an older checkpoint, dropped every round of work since (contributed.json
    # named a later round). Now the contribution is settled as unknown (its work kept), listed
    # open and presumed counted should its commit not be found, and the checkpoint is written.
    from concurrent.futures import Future

    from groundswell.compression import make_codec
    from groundswell.optim import DiLoCo, DiLoCoConfig
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.roles import _saved_if_the_network_fails

    class Node(_Node):
        down = None

        def submit(self, coro):
            coro.close()
            return Future()  # never answered: the daemon died

    node = Node(None)
    ex = SwarmExchange(node)
    w = torch.nn.Parameter(torch.zeros(64))
    outer = DiLoCo([w], make_codec("fp32"), DiLoCoConfig())
    outer.round_id = 15
    with torch.no_grad():
        w.add_(0.01)  # H inner steps of local work
    ex.contribute(15, outer.prepare())
    contributed = {} if where == "before-sending" else {15: 0}
    saved: list[int] = []
    p = SimpleNamespace(outer=outer, _contributed_before=lambda: contributed)
    loop = SimpleNamespace(checkpoint=lambda: saved.append(outer.round_id), exchange=ex)
    node.down = "the network stopped"
    with pytest.raises(NetworkError), _saved_if_the_network_fails(p, loop):
        if where == "collect":
            ex.collect(15)
        raise NetworkError("the network stopped")
    assert saved == [15] and outer.pending is None
    assert torch.allclose(w.detach(), torch.full((64,), 0.01))  # the work is still ours
    if where == "before-sending":
        assert ex.unsettled == []  # nothing went out: nothing to settle
    else:
        assert [(u.round_id, u.included, u.if_unknown) for u in ex.unsettled] == [(15, None, True)]
        assert ex.unsettled[0].segments  # what was sent, to be checked against the commit's digests


def test_asks_that_all_failed_are_no_answer_and_the_check_is_made_again():
    # Found by a review: a holder that could not be reached (a timeout, a refused dial) read as a
    # holder saying "none": the outcome was taken for unknown, the contribution forgotten and its
    # work kept, though its commit may have counted it (sent twice). Now that raises, and the
    # settle asks again next time (nobody to ask at all still reads as "not known here").
    from groundswell.protocol.transport import PeerUnavailable

    book = SimpleNamespace(committed={}, membership=lambda r: object())

    async def ask_decision(peer, round_id, attempt, wait_s, strict=False):
        assert strict
        raise PeerUnavailable(f"{peer}: timed out")

    node = _Node(None)
    node.book = book
    node.client = SimpleNamespace(ask_decision=ask_decision)
    node.cached_records = {p: SimpleNamespace(round=6, params_hash="") for p in "abc"}
    node.options = SimpleNamespace(coordinator="")
    node.holders = lambda round_id: ["a", "b", "c"]
    ex = SwarmExchange(node)  # type: ignore[arg-type]
    with pytest.raises(PeerUnavailable, match="no holder of round 5 could be asked"):
        asyncio.run(ex.counts_ours(5, [b"x"]))
    node.holders = lambda round_id: []
    assert asyncio.run(ex.counts_ours(5, [b"x"])) is None
    # a holder that answered with a commit we cannot check here ("unverifiable": no basis) did
    # answer, and a later ask would get the same: "not known here", not asked again forever
    from groundswell.protocol.schema import ProtocolError

    async def unverifiable(peer, round_id, attempt, wait_s, strict=False):
        raise ProtocolError("the commit of round 5 is unverifiable here")

    node.client = SimpleNamespace(ask_decision=unverifiable)
    node.holders = lambda round_id: ["a", "b", "c"]
    assert asyncio.run(ex.counts_ours(5, [b"x"])) is None
    # No records read yet (a restart's first lookup timed out): nobody could be picked, and that
    # is no answer either (a review: it read as "not known here", and counted work went out again)
    node.cached_records, node.holders = {}, lambda round_id: []
    with pytest.raises(PeerUnavailable, match="no peer records read yet"):
        asyncio.run(ex.counts_ours(5, [b"x"]))


def test_a_contribution_the_node_was_down_to_send_is_never_presumed_counted():
    # Found by a review: contribute() noted the contribution as in flight before handing it to a
    # node that was already down; the network-failure guard then listed that never-sent work as
    # open and presumed counted (contributed.json named its round, from an earlier attempt).
    from groundswell.compression import make_codec
    from groundswell.optim import DiLoCo, DiLoCoConfig
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.roles import _saved_if_the_network_fails

    class Down(_Node):
        def submit(self, coro):
            coro.close()
            raise NetworkError("the network stopped")

    ex = SwarmExchange(Down(None))
    w = torch.nn.Parameter(torch.zeros(64))
    outer = DiLoCo([w], make_codec("fp32"), DiLoCoConfig())
    outer.round_id = 7
    with torch.no_grad():
        w.add_(0.01)
    saved: list[int] = []
    p = SimpleNamespace(outer=outer, _contributed_before=lambda: {7: 0})  # an earlier attempt of round 7 went out
    loop = SimpleNamespace(checkpoint=lambda: saved.append(1), exchange=ex)
    with pytest.raises(NetworkError), _saved_if_the_network_fails(p, loop):
        ex.contribute(7, outer.prepare())
    assert ex.unsettled == [] and saved == [1] and outer.pending is None
    assert torch.allclose(w.detach(), torch.full((64,), 0.01))  # the work is still ours


def test_only_the_contribution_in_flight_is_presumed_counted_when_the_node_goes_down():
    # Found by a review: an earlier attempt of the round left open (no leader answered it) was
    # presumed counted too, and after a restart that could not find the commit, DiLoCo took both
    # out of its work: a commit counts at most one contribution of ours.
    from groundswell.peer.unsettled import Unsettled

    ex = SwarmExchange(_Node(None))
    ex.unsettled = [Unsettled(7, [b"attempt 0"], None, 1), Unsettled(7, [b"attempt 1"], None, 2)]
    ex.presume_counted(7)
    assert [(u.segments, u.if_unknown) for u in ex.unsettled] == [([b"attempt 0"], False), ([b"attempt 1"], True)]


def test_a_commit_learned_as_the_node_goes_down_is_still_the_attempts_outcome():
    # Found by a review: the next round's announcement, submitted once the commit was in, raised
    # NetworkError (the node had just stopped), which discarded the commit and `included`; the
    # counted work was then checkpointed as unsent, and a restart sent it again.
    import threading

    from groundswell.optim import DiLoCo, DiLoCoConfig
    from groundswell.peer.net_errors import NetworkError

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    class Node:
        def __init__(self) -> None:
            self.identity = SimpleNamespace(peer_id="me")
            self.ctx = SimpleNamespace(deadline_s=1.0, slack_s=0.1, min_peers=2)
            self.transport = SimpleNamespace(bytes_sent=0, bytes_received=0)
            self.book = SimpleNamespace(committed={})
            self.down = None
            node = self

            class Client:
                own_scaled: dict = {}

                async def run_attempt(self, r, a, segments, trains, serves):
                    node.down = "the network stopped (p2pd exited)"  # as the attempt ends
                    commit = SimpleNamespace(status="commit", round=r, contributors=["me"], attempt=0)
                    return AttemptResult(commit, b"signed", 0, True, included=True)

                async def fetch_aggregate(self, signed):
                    return torch.zeros(256)

                async def announce(self, *args, **kwargs) -> None:
                    return None

            self.client = Client()

        def submit(self, coro):  # as SwarmNode.submit: NetworkError once the node stopped by itself
            if self.down is not None:
                coro.close()
                raise NetworkError(self.down)
            return asyncio.run_coroutine_threadsafe(coro, loop)

    try:
        w = torch.nn.Parameter(torch.zeros(256))
        outer = DiLoCo([w], make_codec("fp32"), DiLoCoConfig())
        ex = SwarmExchange(Node())
        ex.announce_next = True
        with torch.no_grad():
            w.add_(0.5)
        ex.contribute(0, outer.prepare())
        result = ex.collect(0)
        assert result.included and ex.unsettled == []
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

