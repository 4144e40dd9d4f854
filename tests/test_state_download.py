"""Downloading a state from peers: what is refused before its blob is read, whom a joiner asks
next when servers fail or stay silent, and how long a sync may take. What makes a downloaded state
trusted: test_state_trust.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.protocol.schema import ProtocolError, StateReply
from test_state_trust import _served_state, make_participant


@pytest.fixture
def participant(tmp_path, corpus):
    return make_participant(tmp_path, corpus)


def test_a_state_the_coordinator_contradicts_is_refused_before_its_blob_is_downloaded(participant, monkeypatch):
    """Its signed reply names the parameter hash: a joiner compares it with the coordinator's
    published hash of that round before reading the blob (a model's whole state), and asks the
    next server instead."""
    from dataclasses import replace

    from groundswell.peer import state_download

    p, coord = participant, participant.coordinator_id
    reply, blob, digest, good = _served_state(p, round_id=5)
    from groundswell.protocol.envelope import seal, unseal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import Decision

    records = {coord: SimpleNamespace(round=6, params_hash="h6", earlier_hashes=[f"5:{good}"])}
    hostile = Identity.generate()
    _, decision = unseal(reply.decision, "unit", Decision)
    retry = seal(hostile, "unit", replace(decision, status="retry", leader=hostile.peer_id))
    served = {"liar": replace(reply, params_hash="e" * 16), "retrier": replace(reply, decision=retry), "honest": reply}
    downloaded: list[str] = []
    counted: list[tuple] = []

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        from groundswell.protocol.transport import PeerUnavailable

        try:  # the transport calls it before reading a byte of the blob, and counts a bad reply
            size(served[peer])
        except ProtocolError as exc:
            raise PeerUnavailable(f"{peer} sent a bad get-state reply: {exc}") from None
        downloaded.append(peer)
        return served[peer], blob, digest, "stream"

    async def refresh():
        return records

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records=records, refresh_records=refresh,
                           guard=SimpleNamespace(count=lambda *a, **k: counted.append((*a, k["strike"]))))
    state, _ = asyncio.run(state_download.download_state(node, p.state_check(), ["liar", "retrier", "honest"], 0))
    assert state.round == 5 and downloaded == ["honest"]
    # counted, and only the decision it signed for nothing is held against its server
    assert counted == [("liar", "state-reply", "disputed", False), ("retrier", "state-reply", "malformed", True)]
    # the same reply from the coordinator itself is its own word; with no word on round 5 it is
    # downloaded and judged by the swarm's records as before
    p.state_check().refuse_early(served["liar"], coord, records)
    p.state_check().refuse_early(served["liar"], "liar", {coord: SimpleNamespace(round=9, params_hash="h9")})
    with pytest.raises(ProtocolError, match="not the one the coordinator published") as err:
        p.state_check().refuse_early(served["liar"], "liar", records)
    assert not err.value.strike  # the coordinator's record may be the stale one


def test_after_two_servers_fail_the_coordinator_is_asked_next(participant, monkeypatch):
    """Anyone can copy the coordinator's (round, hash) into a record and be asked first, then
    stay silent: a joiner asks the coordinator once two servers failed."""
    from groundswell.peer import state_download
    from groundswell.protocol.transport import PeerUnavailable

    p, coord = participant, participant.coordinator_id
    reply, blob, digest, _ = _served_state(p, round_id=5)
    asked: list[str] = []

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        asked.append(peer)
        assert reply_timeout_s < timeout_s  # a silent peer costs the reply's timeout, not the blob's
        if peer.startswith("silent"):
            raise PeerUnavailable(f"{peer} did not answer get-state")
        size(reply)
        return reply, blob, digest, "stream"

    async def refresh():
        return {}

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records={}, refresh_records=refresh, guard=SimpleNamespace(count=lambda *a, **k: None))
    peers = ["silent1", "silent2", "silent3", coord, "b"]
    state, _ = asyncio.run(state_download.download_state(node, p.state_check(), peers, 0))
    assert state.round == 5 and asked == ["silent1", "silent2", coord]
    asked.clear()  # no coordinator among the servers: each is asked once, in order
    with pytest.raises(PeerUnavailable):
        asyncio.run(state_download.download_state(node, p.state_check(), ["silent0", "silent1", "silent2"], 0))
    assert asked == ["silent0", "silent1", "silent2"]


def test_a_refused_state_is_freed_before_the_next_server_is_asked(participant, monkeypatch):
    """Found by a review (peak_memory): the blob `verify` refused stayed referenced (the loop's
    local) while the next server's state downloaded, so a hostile first server doubled a join's
    peak memory (two whole states). No earlier blob may be alive when the next fetch starts."""
    import gc
    import weakref

    from groundswell.peer import state_download
    from groundswell.protocol.transport import PeerUnavailable

    class Blob(bytearray):  # (a bytearray that can be weakly referenced)
        pass

    p, coord = participant, participant.coordinator_id
    reply, blob, digest, good = _served_state(p, round_id=5)
    records = {coord: SimpleNamespace(round=5, params_hash=good, earlier_hashes=[])}
    fetched: dict[str, weakref.ref] = {}
    alive_at_start: dict[str, list[str]] = {}

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        gc.collect()
        alive_at_start[peer] = [k for k, ref in fetched.items() if ref() is not None]
        if peer == "gone":  # a server that fails: the refused state before it must be gone already
            raise PeerUnavailable(f"{peer} did not answer get-state")
        got = Blob(blob)
        if peer.startswith("liar"):  # bytes that are not what its signed reply names: refused
            got[-1] ^= 1
        fetched[peer] = weakref.ref(got)
        size(reply)
        return reply, got, digest if peer == "honest" else "0" * 64, "stream"

    async def refresh():
        return records

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records=records, refresh_records=refresh, guard=SimpleNamespace(count=lambda *a, **k: None))
    state, _ = asyncio.run(state_download.download_state(node, p.state_check(), ["liar1", "gone", "liar2", "honest"], 0))
    assert state.round == 5
    assert alive_at_start == {"liar1": [], "gone": [], "liar2": [], "honest": []}, alive_at_start


def test_a_big_models_state_sync_gets_time_in_proportion_to_its_size():
    from groundswell.peer.state_download import state_timeout_s, sync_timeout_s

    assert sync_timeout_s(25_000_000) == 600.0  # small states: the fixed ten minutes
    big = 1_000_000_000  # an 8 GB DiLoCo state: one peer alone may take longer than ten minutes
    assert state_timeout_s(big) > 600 and sync_timeout_s(big) >= 3 * state_timeout_s(big)


def test_peers_that_answer_with_nothing_as_recent_tell_a_sync_apart_from_an_unreachable_swarm(participant,
                                                                                             monkeypatch):
    from groundswell.peer import state_download, state_trust
    from groundswell.protocol.transport import PeerDead, PeerUnavailable

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        if peer.startswith("gone"):  # its dial failed: its record lingers, the process is gone
            raise PeerDead(f"{peer} unavailable for get-state")
        if peer.startswith("silent"):  # alive, or not known to be gone: it may hold a newer state
            raise PeerUnavailable(f"{peer} did not answer get-state within 30s")
        return StateReply(-1, "", b"", 0), bytearray(), "", "stream"  # what a server behind answers

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records={}, guard=SimpleNamespace(count=lambda *a, **k: None))

    def sync(peers):
        return asyncio.run(state_download.download_state(node, participant.state_check(), peers, 7))

    with pytest.raises(state_trust.NoNewerState, match="1 answered"):
        sync(["gone1", "behind", "gone2"])
    with pytest.raises(state_trust.NoNewerState, match="2 answered"):
        sync(["behind1", "silent1", "behind2"])
    for peers in (["gone1", "gone2"], ["silent1", "behind", "gone1"], ["silent1", "behind1", "silent2", "behind2"]):
        # one peer's "nothing newer" does not outweigh those that did not answer: the state they
        # may hold is not given up on (a volunteer would carry on from its own older checkpoint)
        with pytest.raises(PeerUnavailable) as err:
            sync(peers)
        assert not isinstance(err.value, state_trust.NoNewerState), peers
    # the coordinator's own answer is the run's word, whoever else is silent
    with pytest.raises(state_trust.NoNewerState):
        sync(["silent1", "silent2", participant.coordinator_id])


def test_a_state_refused_only_as_unconfirmed_past_the_coordinator_is_no_reason_to_give_up_ours(participant,
                                                                                                 monkeypatch):
    # Found by a review: the coordinator relaunched from an older checkpoint (round 203) while the
    # volunteers had gone on to 217; restarting, one carried on from its checkpoint, and the others
    # refused its state (no other peer confirms it, past the coordinator's record), counted that as
    # "a newer one we could not take", and quit: the run stalled with one volunteer.
    from groundswell.peer import state_download, state_trust
    from groundswell.protocol.transport import PeerUnavailable

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        if peer == "ahead":
            return StateReply(217, "h", b"signed", 8), bytearray(8), "d", "direct"
        return StateReply(-1, "", b"", 0), bytearray(), "", "stream"  # the coordinator, behind

    async def verify(reply, blob, digest, server, records):
        raise ProtocolError("state of round 217, which no other peer confirms, is past the coordinator's record "
                            "(203)", reason="unconfirmed", strike=False)

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records={}, guard=SimpleNamespace(count=lambda *a, **k: None),
                           refresh_records=lambda: None)
    check = participant.state_check()
    object.__setattr__(check, "verify", verify)  # (a frozen dataclass: its check stood in for)
    with pytest.raises(state_trust.NoNewerState, match="1 with one past the coordinator's record"):
        asyncio.run(state_download.download_state(node, check, ["ahead", participant.coordinator_id], 217))

    async def forged(reply, blob, digest, server, records):  # any other refusal still counts as newer
        raise ProtocolError("state failed its hash check")

    object.__setattr__(check, "verify", forged)
    with pytest.raises(PeerUnavailable) as err:
        asyncio.run(state_download.download_state(node, check, ["ahead", participant.coordinator_id], 217))
    assert not isinstance(err.value, state_trust.NoNewerState)


def test_a_state_too_slow_to_arrive_says_the_link_is_too_slow_not_the_run_down(participant, monkeypatch):
    # Found by a review: on an 8 Mbit/s download a `base` run's state never arrived within the time
    # a peer is given, and `join` said "is the run still up? Start again to retry", which failed alike
    from groundswell.peer import state_download
    from groundswell.protocol.transport import PeerGone, PeerUnavailable, RequestTimedOut

    reply, _blob, _digest, _ = _served_state(participant, round_id=5)
    monkeypatch.setattr(state_download, "state_timeout_s", lambda numel: 0.3)
    monkeypatch.setattr(state_download, "sync_timeout_s", lambda numel: 1.0)  # time for 3 downloads and a bit
    monkeypatch.setattr(state_download, "BUSY_WAIT_S", 0.01)
    monkeypatch.setattr(state_download, "BUSY_WAIT_MAX_S", 0.05)
    asked: list[str] = []

    async def fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        asked.append(peer)
        if peer == "busy":
            return StateReply(-1, "", b"", 0, busy=True), bytearray(), "", "stream"
        size(reply)  # announced, under way...
        if peer.startswith("stalls"):  # ...and ended soon: a stall, a dead server, not our link
            raise PeerGone(f"{peer}: the frame stalled for 20s after 0 bytes")
        await asyncio.sleep(timeout_s)
        if peer.startswith("stalled-late"):  # ...and out of time, but by a stall: not our link either
            raise PeerGone(f"{peer}: the frame stalled for 20s after 1048576 bytes")
        raise RequestTimedOut(f"{peer}: no state within {timeout_s:.0f}s")  # ...and out of time

    async def refresh():
        return {}

    node = SimpleNamespace(cached_records={}, refresh_records=refresh, guard=SimpleNamespace(count=lambda *a, **k: None))
    monkeypatch.setattr(state_download, "fetch_state", fetch)

    def sync(peers):
        asked.clear()
        return asyncio.run(state_download.download_state(node, participant.state_check(), peers, 0))

    with pytest.raises(state_download.StateTooSlow, match=r"did not arrive within the 0 s a peer is given to send "
                                                          r"it, from 2 peers: joining this run takes about \d+ Mbit/s"):
        sync(["slow", "busy", "slow2"])  # every peer asked, one of them busy
    # many peers: said once no other download fits in the sync's time (here after three), not left
    # to the sync's own timeout, which its caller says as "is the run still up?"
    with pytest.raises(state_download.StateTooSlow, match="from 3 peers"):
        sync(["slow1", "slow2", "slow3", "slow4", "slow5", "slow6"])
    assert asked == ["slow1", "slow2", "slow3"], asked
    # but not sooner: a slow coordinator (its uplink shared by a wave of joiners) is no verdict on ours
    with pytest.raises(state_download.StateTooSlow, match="from 2 peers"):
        sync([participant.coordinator_id, "slow1"])
    assert asked == [participant.coordinator_id, "slow1"]
    for peers in (["stalls1", "stalls2"], ["slow", "stalls"], ["stalled-late1", "stalled-late2"]):
        # a failure that was not the time running out with bytes still coming
        with pytest.raises(PeerUnavailable) as err:
            sync(peers)
        assert not isinstance(err.value, state_download.StateTooSlow), peers
    monkeypatch.undo()
    assert state_download.sync_timeout_s(10**9) > 3 * state_download.state_timeout_s(10**9)


def test_a_busy_server_is_asked_again_later_and_never_counts_as_having_nothing_newer(participant, monkeypatch):
    """A server whose upload slots are taken answers `busy`: a joiner asks the others, then it
    again, a little later each time, a bounded number of times; "busy" is not "nothing newer"."""
    from groundswell.peer import state_download, state_trust
    from groundswell.protocol.transport import PeerUnavailable

    reply, blob, digest, _ = _served_state(participant, round_id=5)
    asked: list[str] = []
    coord = participant.coordinator_id  # its state needs no records to confirm it
    free_after = {coord: 2, "always-busy": 1 << 30}

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        asked.append(peer)
        if asked.count(peer) <= free_after.get(peer, 0):
            return StateReply(-1, "", b"", 0, busy=True), bytearray(), "", "stream"
        if peer == "slow":  # takes longer than the sync's patience, then fails
            await asyncio.sleep(0.8)
            raise PeerUnavailable("slow did not answer get-state")
        if peer.startswith("behind") or (peer == coord and free_after[coord] == 0):
            return StateReply(-1, "", b"", 0), bytearray(), "", "stream"
        size(reply)
        return reply, blob, digest, "stream"

    async def refresh():
        return {}

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    monkeypatch.setattr(state_download, "BUSY_WAIT_S", 0.01)
    monkeypatch.setattr(state_download, "BUSY_WAIT_MAX_S", 0.05)
    # the patience: what is left of a sync after one download's time
    monkeypatch.setattr(state_download, "sync_timeout_s", lambda numel: state_download.state_timeout_s(numel) + 0.6)
    node = SimpleNamespace(cached_records={}, refresh_records=refresh, guard=SimpleNamespace(count=lambda *a, **k: None))

    def sync(peers):
        return asyncio.run(state_download.download_state(node, participant.state_check(), peers, 0))

    state, _ = sync([coord, "behind1"])
    assert state.round == 5 and asked == [coord, "behind1", coord, coord]
    asked.clear()
    started = time.monotonic()
    with pytest.raises(PeerUnavailable) as err:
        sync(["always-busy", "behind1"])
    assert not isinstance(err.value, state_trust.NoNewerState)
    # asked again and again (waits 0.01, 0.02, 0.04, then 0.05 s), until the patience ran out
    assert 5 <= asked.count("always-busy") <= 20 and asked.count("behind1") == 1
    assert time.monotonic() - started >= 0.5
    # a busy server holds a state as new as asked for (one that does not answers "nothing newer"):
    # however many others have nothing newer, even the coordinator, the sync is not given up as such
    for peers in (["behind1", "behind2", "behind3", "always-busy"], [coord, "always-busy"]):
        free_after[coord] = 0 if peers[0] == coord else 2
        with pytest.raises(PeerUnavailable) as err:
            sync(peers)
        assert not isinstance(err.value, state_trust.NoNewerState), peers
    # a busy peer is not asked again once the peers asked since took the time a download needs
    asked.clear()
    with pytest.raises(PeerUnavailable):
        sync(["always-busy", "slow"])
    assert asked == ["always-busy", "slow"]


@pytest.mark.parametrize("momentum", [True, False])
def test_a_state_announced_bigger_than_the_runs_state_is_refused_before_a_byte_is_allocated(participant,
                                                                                          monkeypatch, momentum):
    """The announced size is allocated before the bytes arrive: a server may announce no more than
    the state itself (the parameters, and DiLoCo's momentum), so a SparseLoCo joiner is not made
    to hold a DiLoCo-sized (or any larger) buffer for a trickle of bytes."""
    from dataclasses import replace

    from groundswell.peer import state_download
    from groundswell.protocol.transport import PeerUnavailable

    p = participant
    check = replace(p.state_check(), needs_momentum=momentum)
    reply, blob, _digest, _ = _served_state(p, momentum=momentum)
    numel = p.outer.global_params.numel()
    exact = 4 * numel * (2 if momentum else 1)
    assert exact < len(blob) <= state_download.state_budget(numel, momentum)  # the real state fits
    refused: list[str] = []

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        announced = replace(reply, size=exact + (1 << 20) + 1)  # a little more than the state could be
        try:
            size(announced)
        except ProtocolError as exc:
            refused.append(exc.reason)
            raise PeerUnavailable(f"{peer}: {exc}") from None
        raise AssertionError("an oversized announcement was let through to the download")

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    counted: list[tuple] = []
    node = SimpleNamespace(cached_records={}, guard=SimpleNamespace(count=lambda *a, **k: counted.append((*a, k))))
    with pytest.raises(PeerUnavailable):
        asyncio.run(state_download.download_state(node, check, ["server"], 0))
    assert refused == ["oversized"]
    # counted and struck against its server (a review found the transport dropped the strike)
    assert counted == [("server", "state-reply", "oversized", {"strike": True})]


@pytest.mark.parametrize("ours", ["larger", "smaller"])
def test_the_runs_own_state_of_another_model_size_says_it_is_ours_not_theirs(participant, monkeypatch, ours):
    """A joiner whose model was built for another vocabulary (its --data is not the run's dataset)
    says so in one line once a state the coordinator vouches for does not fit it (a larger one is
    refused by its size before it is downloaded). A state of the wrong size nobody vouches for is a
    bad state, struck as before: a hostile server must not make a joiner blame its own dataset."""
    from dataclasses import replace

    from groundswell.peer import state_download, state_trust

    coord = participant.coordinator_id
    reply, blob, digest, good = _served_state(participant, round_id=5)
    struck: dict[str, bool] = {}

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        try:
            size(reply)
        except ProtocolError as exc:  # as the transport reports (and counts) a reply refused by its size
            struck[peer] = exc.strike
            raise state_trust.PeerUnavailable(str(exc)) from None
        return reply, bytearray(blob), digest, "stream"

    records = {coord: SimpleNamespace(round=6, params_hash="h6", earlier_hashes=[f"5:{good}"])}

    async def refresh():
        return records

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records=records, refresh_records=refresh,
                           guard=SimpleNamespace(count=lambda peer, *a, strike, **k: struck.update({peer: strike})))
    numel = participant.outer.global_params.numel()
    check = replace(participant.state_check(), numel=numel + 7 if ours == "larger" else numel // 4)
    if ours == "smaller":  # a larger state than ours can be: refused by its announced size, unread
        # Only the coordinator's say-so (found by a review of the state trust: anyone can copy its
        # published hash into a reply that is all size, and the joiner quit blaming its dataset).
        with pytest.raises(state_trust.PeerUnavailable) as err:
            asyncio.run(state_download.download_state(node, check, ["a"], 0))
        assert not isinstance(err.value, state_trust.ModelMismatch) and struck == {"a": False}  # no strike either
        with pytest.raises(state_trust.ModelMismatch, match="is our dataset"):
            asyncio.run(state_download.download_state(node, check, [coord], 0))
    else:  # a smaller one is downloaded, and its tensors have the hash the coordinator published
        with pytest.raises(state_trust.ModelMismatch, match="is our dataset"):
            asyncio.run(state_download.download_state(node, check, ["a"], 0))
    assert not any(struck.values())
    # nobody vouches for it: a bad state, struck, and the sync fails as any other does
    records.clear()
    node.cached_records = {}
    with pytest.raises(state_trust.PeerUnavailable) as err:
        asyncio.run(state_download.download_state(node, check, ["a"], 0))
    assert not isinstance(err.value, state_trust.ModelMismatch)


def test_a_dht_failure_while_checking_a_state_of_another_size_strikes_no_server(participant, monkeypatch):
    """Found by a review: a failed read of the swarm's records, while finding out whether a state
    of another size than our model is the run's own, made that state "not vouched": a bad state,
    struck against an honest server, because our DHT read failed."""
    from dataclasses import replace

    from groundswell.peer import state_download, state_trust

    reply, blob, digest, _good = _served_state(participant, round_id=5)
    struck: dict[str, bool] = {}

    async def fake_fetch(node, peer, min_round, size, timeout_s, reply_timeout_s):
        size(reply)
        return reply, bytearray(blob), digest, "stream"

    async def refresh():
        raise RuntimeError("the DHT is down")

    monkeypatch.setattr(state_download, "fetch_state", fake_fetch)
    node = SimpleNamespace(cached_records={}, refresh_records=refresh,
                           guard=SimpleNamespace(count=lambda peer, *a, strike, **k: struck.update({peer: strike})))
    numel = participant.outer.global_params.numel()
    check = replace(participant.state_check(), numel=numel + 7)
    with pytest.raises(state_trust.PeerUnavailable) as err:
        asyncio.run(state_download.download_state(node, check, ["a"], 0))
    assert not isinstance(err.value, state_trust.ModelMismatch)
    assert struck == {"a": False}, struck
