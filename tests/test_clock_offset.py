"""Our clock's offset from the other peers', from their requests' stamps (protocol/clock_offset.py),
and the warning a peer logs while it is off."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from groundswell.peer.records import CLOCK_WARN_EVERY_S, PeerRecords
from groundswell.protocol.clock_offset import (
    MAX_PEERS,
    SAMPLE_LIFE_S,
    SAMPLES_PER_PEER,
    ClockOffsets,
    skew_warning,
)


def test_no_estimate_from_fewer_than_two_peers():
    offsets = ClockOffsets()
    assert offsets.ours() is None
    offsets.note("a", -2.5)
    offsets.note("a", -2.4)
    assert offsets.ours() is None


def test_each_peers_least_delayed_sample_and_the_median_across_peers():
    offsets = ClockOffsets()
    # their stamps are 2.5 s behind our clock (we are 2.5 s ahead); delays only lower a sample
    for peer, delays in {"a": [0.3, 0.01, 1.5], "b": [0.02, 0.8], "c": [0.05]}.items():
        for delay in delays:
            offsets.note(peer, -2.5 - delay)
    offsets.note("liar", 1000.0)  # one peer's made-up stamps do not move the median
    skew, peers = offsets.ours()
    assert peers == 4 and abs(skew - 2.51) < 1e-9  # a, b, c and the liar: of the middle two, the nearer zero


def test_one_peer_of_two_off_does_not_make_us_look_off():
    # seen live: a coordinator beside a volunteer 2.5 s ahead and one on time warned that its own
    # clock was 1.2 s behind (the mean of the two)
    offsets = ClockOffsets()
    offsets.note("skewed", 2.5)
    offsets.note("on-time", -0.02)
    assert offsets.ours() == (0.02, 2)


def test_peers_not_heard_from_lately_no_longer_count():
    # (a review: samples of peers that had left counted for good)
    clock = {"wall": 1000.0, "mono": 0.0}
    offsets = ClockOffsets(wall=lambda: clock["wall"], mono=lambda: clock["mono"])
    offsets.note("gone-1", -3.0)
    offsets.note("gone-2", -3.0)
    assert offsets.ours() == (3.0, 2)
    clock["wall"] += SAMPLE_LIFE_S + 1
    clock["mono"] += SAMPLE_LIFE_S + 1
    assert offsets.ours() is None
    offsets.note("here-1", 0.0)
    offsets.note("here-2", -0.1)
    assert offsets.ours() == (0.0, 2)


def test_a_step_of_our_own_clock_clears_the_samples_taken_against_the_old_one():
    # the user, warned, sets the clock: the old samples would keep the warning up until each
    # peer had sent 8 new requests (a review)
    clock = {"wall": 1000.0, "mono": 0.0}
    offsets = ClockOffsets(wall=lambda: clock["wall"], mono=lambda: clock["mono"])
    offsets.note("a", 3.0)
    offsets.note("b", 3.1)
    assert offsets.ours() == (-3.0, 2)  # we are 3 s behind
    clock["wall"] += 3.0  # network time turned on
    assert offsets.ours() is None
    offsets.note("a", 0.01)
    offsets.note("b", -0.02)
    assert offsets.ours() == (-0.01, 2)


def test_samples_and_peers_kept_are_bounded():
    offsets = ClockOffsets()
    for i in range(MAX_PEERS + 10):
        for _ in range(SAMPLES_PER_PEER + 5):
            offsets.note(f"p{i}", 0.0)
    assert len(offsets._samples) == MAX_PEERS and "p0" not in offsets._samples
    assert all(len(s) == SAMPLES_PER_PEER for s in offsets._samples.values())


def test_the_warning_says_which_way_and_how_far():
    assert skew_warning(None, 1.0) is None and skew_warning((0.9, 5), 1.0) is None
    ahead = skew_warning((2.5, 5), 1.0)
    assert "2.5 s ahead of the other peers' (from 5 peers' messages)" in ahead and "less time to train" in ahead
    behind = skew_warning((-1.6, 3), 1.0)
    assert "1.6 s behind" in behind and "network time" in behind


def test_a_peer_off_the_others_clock_warns_and_not_every_heartbeat(caplog):
    offsets = ClockOffsets()
    node = SimpleNamespace(guard=SimpleNamespace(clock_offsets=offsets), _clock_warned_at=None)
    check = PeerRecords._check_clock
    with caplog.at_level(logging.WARNING, logger="groundswell.peer.records"):
        check(node, 100.0)  # no estimate yet: nothing
        offsets.note("a", -3.0)
        offsets.note("b", -2.9)
        check(node, 102.0)
        check(node, 104.0)  # said once, not every heartbeat
        check(node, 102.0 + CLOCK_WARN_EVERY_S)  # and again while it lasts
    said = [r.getMessage() for r in caplog.records if "clock seems" in r.getMessage()]
    assert len(said) == 2 and "2.9 s ahead" in said[0], said
