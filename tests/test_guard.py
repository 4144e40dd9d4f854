"""Per-peer admission control: rate limits, stream limits, strikes and bans, replay and clock checks."""

from __future__ import annotations

import os

import pytest
from groundswell.protocol.guard import Guard, Limits
from groundswell.protocol.schema import ProtocolError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _guard(**limits) -> tuple[Guard, Clock, Clock]:
    mono, wall = Clock(), Clock()
    return Guard(Limits(**limits), clock=mono, wall=wall), mono, wall


def test_a_flood_is_rate_limited_then_banned_and_the_ban_expires():
    g, mono, _ = _guard(requests_per_s=10, strikes=5, ban_s=30)
    admitted = 0
    for _ in range(100):  # all at one instant: the burst allowance is 2 s worth = 20
        if g.admit("flooder", "join") is None:
            admitted += 1
            g.release("flooder")
    assert admitted == 20
    assert g.rejected["rate-limited:join"] == 5  # the fifth strike banned it...
    assert g.rejected["banned:join"] == 75  # ...and a banned peer is refused without further strikes
    assert "flooder" in g.bans() and g.bans_total == 1
    assert g.admit("honest", "join") is None  # other peers are not affected
    mono.t += 31
    assert g.bans() == {}
    assert g.admit("flooder", "join") is None  # tokens refilled, ban over


def test_sustained_rate_within_the_limit_is_never_refused():
    g, mono, _ = _guard(requests_per_s=10, strikes=1)
    for _ in range(1000):
        mono.t += 0.1
        assert g.admit("steady", "get-decision") is None
        g.release("steady")
    assert not g.rejected


def test_concurrent_streams_are_capped_per_peer():
    g, _, _ = _guard(max_streams=3, strikes=100)
    assert [g.admit("p", "contribute") for _ in range(4)] == [None, None, None, "too-many-streams"]
    g.release("p")
    assert g.admit("p", "contribute") is None
    assert g.admit("q", "contribute") is None


def test_streams_of_all_peers_together_are_capped_without_striking_anyone():
    """Found by a review: identities are free, and 32 streams each held one of our file
    descriptors apiece: ~32 identities ran a process with the usual 1024 out of them."""
    g, _, _ = _guard(max_streams=2, max_streams_total=5, strikes=1)
    assert [g.admit(f"sybil{i // 2}", "get-decision") for i in range(5)] == [None] * 5
    assert g.admit("honest", "contribute") == "busy" and g.rejected["busy:contribute"] == 1
    assert not g.bans() and g.streams == 5  # nobody was struck for the node being full
    g.release("sybil0")
    assert g.streams == 4 and g.admit("honest", "contribute") is None
    g.release("nobody")  # a stream never admitted does not free a place
    assert g.streams == 5
    # a unary call holds no descriptor of ours (the daemon's control connection carries it)
    assert g.admit("poller", "get-decision", stream=False) is None and g.streams == 5
    g.release("poller", stream=False)
    assert g.streams == 5


def test_replayed_and_badly_timed_messages_are_refused():
    g, _, wall = _guard(max_clock_skew_s=60)
    nonce = os.urandom(16)
    g.check_fresh(nonce, wall.t)
    with pytest.raises(ProtocolError) as err:
        g.check_fresh(nonce, wall.t)
    assert err.value.reason == "replayed"
    with pytest.raises(ProtocolError) as err:
        g.check_fresh(os.urandom(16), wall.t - 61)
    assert err.value.reason == "stale-message" and not err.value.strike  # (whose clock is off, we cannot tell)
    with pytest.raises(ProtocolError) as err:
        g.check_fresh(os.urandom(16), wall.t + 61)
    assert err.value.reason == "stale-message" and not err.value.strike
    with pytest.raises(ProtocolError):
        g.check_fresh(os.urandom(16), float("nan"))
    g.check_fresh(os.urandom(16), wall.t + 59)  # within the skew: fine
    # a nonce is forgotten only once its message would be refused as stale anyway
    wall.t += 200
    g.check_fresh(os.urandom(16), wall.t)
    assert nonce not in g._nonces
    with pytest.raises(ProtocolError):
        g.check_fresh(nonce, wall.t - 200)  # the old message itself is now stale


def test_the_nonce_cache_is_bounded():
    g, _, wall = _guard(max_nonces=100)
    for _ in range(1000):
        g.check_fresh(os.urandom(16), wall.t)
    assert len(g._nonces) <= 100


def test_protocol_violations_strike_but_stale_rounds_do_not():
    g, _, _ = _guard(strikes=3)
    for _ in range(10):
        g.reject("slow", "contribute", ProtocolError("ahead", reason="future-round", strike=False))
    assert g.bans() == {}
    for _ in range(3):
        g.reject("forger", "contribute", ProtocolError("bad signature", reason="bad-signature"))
    assert "forger" in g.bans()
    assert g.rejected["future-round:contribute"] == 10 and g.rejected["bad-signature:contribute"] == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_ban_is_published_in_the_peer_record_that_status_shows():
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from swarm_harness import Cluster

    c = Cluster(n=2)
    try:
        flooder = "12D3KooWQH5xAH2sSqpV37pBRoeqt1GnxNdTYhZjAZi8UKySbuqt"
        node = c.nodes[0]
        for _ in range(node.guard.limits.strikes):
            node.guard.strike(flooder)
        assert flooder in node.guard.bans()
        deadline = time.time() + 30
        while time.time() < deadline:
            records = c.nodes[1].call(c.nodes[1].peer_records(), timeout_s=10)
            mine = records.get(node.identity.peer_id)
            if mine is not None and mine.banned:
                break
            time.sleep(1)
        assert mine is not None and mine.banned == [flooder]
    finally:
        c.close()


def test_a_slow_upload_is_judged_by_when_its_stream_opened():
    g, _, wall = _guard(max_clock_skew_s=60)
    opened = wall.t
    wall.t += 300  # five minutes to receive a large contribution
    g.check_fresh(os.urandom(16), opened - 1, opened=opened)  # stamped when it was sent: fine
    with pytest.raises(ProtocolError):
        g.check_fresh(os.urandom(16), opened - 61, opened=opened)


def test_the_peer_table_forgets_idle_peers_with_a_bounded_scan_past_busy_ones(monkeypatch):
    from groundswell.protocol import guard as guard_mod

    monkeypatch.setattr(guard_mod, "MAX_PEERS", 50)
    monkeypatch.setattr(guard_mod, "IDLE_SCAN", 8)
    g, _, _ = _guard(max_streams=4)
    for i in range(50):
        g.admit(f"p{i}", "join")  # each holds one stream open
    for i in range(40, 50):
        g.release(f"p{i}")  # the ten most recent are idle
    g.admit("new1", "join")  # the 8 oldest are busy: looked at, sent to the back, nobody dropped
    assert len(g._peers) == 51 and list(g._peers)[:2] == ["p8", "p9"] and list(g._peers)[-2:] == ["p7", "new1"]
    for n in range(2, 6):  # each newcomer looks at 8 more busy peers: still no idle one in reach
        g.admit(f"new{n}", "join")
    assert len(g._peers) == 55 and all(f"p{i}" in g._peers for i in range(50))
    g.admit("new6", "join")  # the oldest now is p40, idle: forgotten
    assert len(g._peers) == 55 and "p40" not in g._peers
    for i in range(41, 50):
        g.admit(f"late{i}", "join")
    assert len(g._peers) == 55 and all(f"p{i}" not in g._peers for i in range(40, 50))  # idle ones, oldest first
    assert all(f"p{i}" in g._peers for i in range(40))  # the busy ones stay, however old


def test_a_banned_peer_is_not_washed_out_of_the_table_by_throwaway_identities(monkeypatch):
    # Found by a review: past MAX_PEERS the longest-idle peer was forgotten, bans included, so a
    # banned peer fell quiet while fresh identities made one request each, and came back clean.
    from groundswell.protocol import guard as guard_mod

    monkeypatch.setattr(guard_mod, "MAX_PEERS", 50)
    monkeypatch.setattr(guard_mod, "IDLE_SCAN", 8)
    g, _, _ = _guard(strikes=3, ban_s=600)
    for _ in range(3):
        g.strike("banned")
    g.strike("struck")
    assert "banned" in g.bans()
    for i in range(500):  # ten times the table, one request each
        if g.admit(f"throwaway{i}", "join") is None:
            g.release(f"throwaway{i}")
    assert "banned" in g.bans() and g.admit("banned", "join") is not None
    assert "struck" in g._peers and len(g._peers) <= 51
