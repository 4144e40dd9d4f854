"""Peers behind NATs train with public ones, in a lab of network namespaces (scripts/netlab.py).

Needs root and `ip netns` (and iptables for the NATs); skipped, saying why, where those are missing.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import netlab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_volunteers_behind_nats_contribute_to_every_round(tmp_path):
    import netlab_run

    if os.geteuid() != 0:
        pytest.skip("netlab needs root to create network namespaces")
    if shutil.which("ping") is None:
        pytest.skip("netlab's round-trip check needs ping (apt-get install iputils-ping)")
    try:
        res = netlab_run.run(rounds=8, out=tmp_path / "run", timeout_s=300, shaping=True)
    except netlab.NetlabUnavailable as exc:
        pytest.skip(f"network namespaces unavailable here: {exc}")
    assert netlab.existing_namespaces() == [], "the lab was not torn down"
    assert res["timed_out"] == []
    # the links carry the default 40 ms one-way delay (netem, or scripts/delayline.py without it)
    assert res["link"]["delay_ms"] == 40 and res["link"]["rtt_h1_coord_ms"]["min"] >= 76, res["link"]
    assert res["rounds_completed"] >= 8 and res["param_hash_agreement"]
    assert set(netlab_run.VOLUNTEERS) <= set(res["contributed"]), res["contributed"]
    # the dial-back probe told each NAT'ed host it is private, the public volunteer that it is public
    assert res["reachability"] == {"pub": "public", "h1": "private", "h2": "private", "h3": "private"}
    reached = {(c["a"], c["b"]) for c in res["connections"]}
    assert {("h1", "coordinator"), ("h2", "coordinator"), ("h3", "coordinator")} <= reached
    assert all(c["path"] in ("direct", "relay") for c in res["connections"])
    # h1 and h2 sit behind cone NATs: one punched a hole to the other (peer/punch_scheduler.py) and the
    # two hold a direct connection; h3's symmetric NAT defeats every punch
    punched = {frozenset((c["a"], c["b"])) for c in res["connections"] if c.get("hole_punched")}
    assert punched == {frozenset(("h1", "h2"))}, (res["connections"], res["punches"])
    assert not any(p["ok"] for p in res["punches"] if "h3" in (p["a"], p["b"])), res["punches"]


@pytest.mark.timeout(420)
def test_a_volunteer_behind_nat_is_reachable_through_the_relay(tmp_path):
    # Training never needs it (NAT'ed volunteers only dial out), but a peer behind a cone or a
    # symmetric NAT must still be reachable: it holds a reservation on its bootstrap peer's relay.
    import netlab_relay

    if os.geteuid() != 0:
        pytest.skip("netlab needs root to create network namespaces")
    try:
        res = netlab_relay.run(timeout_s=240, out=tmp_path)
    except netlab.NetlabUnavailable as exc:
        pytest.skip(f"network namespaces unavailable here: {exc}")
    assert netlab.existing_namespaces() == [], "the lab was not torn down"
    assert res["reachability"] == {"h1": "private", "h2": "private", "h3": "private", "pub": "public"}
    rows = {(p["a"], p["b"]): p for p in res["pairs"]}
    assert all(p["ok"] for p in res["pairs"]), res["pairs"]
    # without a hole punch (this script makes none) two NAT'ed peers meet through the relay
    assert rows[("h1", "h2")]["path"] == "relay" and rows[("h1", "h3")]["path"] == "relay"
    # their bootstrap peer is their only relay, so they hold a slot within seconds, not after
    # autorelay's 3-minute wait for 4 candidates (205 s in a run before peer/daemon.py's fix)
    assert all(p["first_ok_s"] < 90 for p in res["pairs"]), res["pairs"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", ["pub3", "coord"])
def test_a_peer_whose_link_went_down_for_a_while_is_back(tmp_path, victim):
    # A volunteer is back in aggregates; the coordinator follows rounds again.
    import netlab_outage

    if os.geteuid() != 0:
        pytest.skip("netlab needs root to create network namespaces")
    if shutil.which("ping") is None:
        pytest.skip("netlab's round-trip check needs ping (apt-get install iputils-ping)")
    try:
        res = netlab_outage.run(down_at=25, down_for=20, after=45, out=tmp_path / "run", victim=victim)
    except netlab.NetlabUnavailable as exc:
        pytest.skip(f"network namespaces unavailable here: {exc}")
    assert netlab.existing_namespaces() == [], "the lab was not torn down"
    assert res["timed_out"] == [] and res["param_hash_agreement"], res
    assert res["victim_included_again_after_s"] is not None, res
