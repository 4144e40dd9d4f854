"""netlab's per-link figures (`--link ROLE:KEY=VALUE,...`) and delayline's per-link, two-way
delays: the parsing here (no root needed); the shaped lab itself in tests/test_netlab.py."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import delayline
import netlab


def test_a_link_spec_names_a_role_and_its_figures() -> None:
    assert netlab.parse_link_spec("pub3:up_mbit=1,rdelay_ms=110,rloss_pct=2") == (
        "pub3", {"up_mbit": 1.0, "rdelay_ms": 110.0, "rloss_pct": 2.0})
    assert netlab.parse_link_spec("r1:") == ("r1", {})


@pytest.mark.parametrize("spec, words", [
    ("pub9:up_mbit=1", "no access link 'pub9'"),
    ("h1:up_mbit=1", "no access link 'h1'"),  # a NAT'ed host's access link is its router's
    ("pub3:upmbit=1", "'upmbit=1' is not KEY=VALUE"),
    ("pub3:up_mbit", "'up_mbit' is not KEY=VALUE"),
    ("pub3:up_mbit=fast", "'fast' is not a number"),
])
def test_a_bad_link_spec_is_refused_saying_why(spec: str, words: str) -> None:
    with pytest.raises(netlab.NetlabError, match=words):
        netlab.parse_link_spec(spec)


def test_overrides_change_one_link_and_leave_the_others_at_the_lab_defaults() -> None:
    shapes = netlab.link_shapes(50, 20, 0.1, {"pub3": {"up_mbit": 1, "rdelay_ms": 110}})
    assert set(shapes) == set(netlab.UPLINK)
    assert shapes["pub3"] == netlab.LinkShape(up_mbit=1, down_mbit=50, delay_ms=20, loss_pct=0.1, rdelay_ms=110)
    assert all(s == netlab.LinkShape(50, 50, 20, 0.1) for role, s in shapes.items() if role != "pub3")
    assert not netlab.LinkShape(50, 50, 0, 0).impaired and netlab.LinkShape(50, 50, 0, 0, rloss_pct=1).impaired


@pytest.mark.parametrize("bad", [{"loss_pct": 100}, {"rloss_pct": -1}, {"up_mbit": -1}, {"rdelay_ms": -5}])
def test_a_figure_no_link_can_have_is_refused(bad: dict) -> None:
    with pytest.raises(netlab.NetlabError, match="link pub"):
        netlab.link_shapes(50, 20, 0.1, {"pub": bad})
    with pytest.raises(netlab.NetlabError, match="no access link"):
        netlab.link_shapes(50, 20, 0.1, {"nowhere": {}})


def test_delayline_links_take_the_default_one_way_or_their_own_figures_both_ways() -> None:
    assert delayline.parse_link("w-a:x-a", 40, 0.1) == ("w-a", "x-a", 0.04, 0.001, 0.0, 0.0)
    assert delayline.parse_link("w-a:x-a:130:2:110:1", 40, 0.1) == ("w-a", "x-a", 0.13, 0.02, 0.11, 0.01)
    for bad in ("w-a", "w-a:x-a:1:2", "w-a:x-a:-1:0:0:0", "w-a:x-a:1:100:0:0", "w-a:x-a:1:0:0:x"):
        with pytest.raises(ValueError):
            delayline.parse_link(bad, 40, 0.1)


class _Port:
    """A stand-in for a raw socket: frames to read, frames sent."""

    def __init__(self, frames: list[bytes] | None = None) -> None:
        self.frames, self.sent = list(frames or []), []

    def recv(self, _: int) -> bytes:
        if not self.frames:
            raise BlockingIOError
        return self.frames.pop(0)

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)


def test_each_way_of_a_link_holds_its_own_frames_for_its_own_delay(monkeypatch) -> None:
    frame = delayline.VNET_HDR.pack(0, 0, 0, 0, 0, 0) + b"x" * 60
    now = [100.0]
    monkeypatch.setattr(delayline.time, "monotonic", lambda: now[0])
    counts = delayline.collections.Counter()
    near, far = _Port([frame]), _Port([frame, frame])
    out = delayline._Way(near, far, 0.05, 0.0, random.Random(0), counts)
    back = delayline._Way(far, near, 0.0, 0.0, random.Random(0), counts)
    out.on_input()
    back.on_input()
    assert near.sent == [frame, frame] and far.sent == []  # no delay back: passed on at once
    assert out.release(100.04) == pytest.approx(100.05) and far.sent == []
    assert out.release(100.05) is None and far.sent == [frame]
    lossy = delayline._Way(_Port([frame] * 200), _Port(), 0.0, 0.5, random.Random(1), counts)
    lossy.on_input()
    assert 60 < counts["lost"] < 140 and len(lossy.dst.sent) == 200 - counts["lost"]
