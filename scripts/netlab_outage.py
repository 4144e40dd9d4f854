#!/usr/bin/env python3
"""A volunteer loses its network for a while (Wi-Fi gone, cable pulled) in the middle of a run.

    python scripts/netlab_outage.py [--down-at 40] [--down-after-rounds N] [--down-for 30] [--after 45]
                                    [--settle S] [--out DIR]   (root)

In netlab (shaped links): a coordinator and three public volunteers; `pub3`'s link goes down
`--down-at` seconds after the volunteers start (or, with `--down-after-rounds N`, once it has been
in N rounds, if that comes first), for `--down-for` seconds; `--after` seconds after
it is back (or, with `--settle S`, S seconds after the victim is back in the rounds, if that
comes first), every volunteer leaves (SIGINT). Prints JSON: the outage
window, pub3's attempts to re-enter the DHT once its routing table was empty (`peer/dht_rejoin.py`), how
long after the link came back pub3 was in an aggregate again, the other volunteers' longest round
during the outage, and whether every round's parameter hashes agreed.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import netlab
from groundswell.peer.sim_report import read_events
from groundswell.peer.simulate import SimulateOptions, Simulation, manifest_toml
from netlab_run import COMMON, report, start_coordinator

VOLUNTEERS = ("pub", "pub2", "pub3")
NAMES = {"coord": "coordinator", **{v: v for v in VOLUNTEERS}}  # netlab host -> process name


def _link(name: str, state: str) -> None:
    subprocess.run(netlab.netns_exec_argv(name, ["ip", "link", "set", "eth0", state]), check=True, timeout=10)


def run(down_at: float = 40, down_for: float = 30, after: float = 45, out: Path | None = None,
        timeout_s: float = 120, victim: str = "pub3", settle: float | None = None,
        down_after_rounds: int | None = None) -> dict:
    """Build the lab, run the swarm with one outage, tear the lab down; the outcome as a dict.
    `down_after_rounds`: the link goes down as soon as the victim has been in that many rounds,
    if that comes before `down_at`. `settle`: end as soon as the victim is back and that many
    seconds more have passed (the others' rounds go on meanwhile), rather than `after` seconds
    after the link came back."""
    out = out or Path(tempfile.mkdtemp(prefix="netlab-outage-"))
    rounds = 10**6  # the run ends by the clock: `after` seconds after the link is back
    opts = SimulateOptions(peers=len(VOLUNTEERS), rounds=rounds, inner_steps=20, batch_size=4, deadline_s=12,
                           slack_s=2, min_peers=2, checkpoint_every=rounds)
    with netlab.lab(), Simulation(out, opts) as sim:  # shaped links: 50 Mbit/s, 40 ms, 0.1% loss
        (out / "run.toml").write_text(manifest_toml(opts))
        boot = start_coordinator(sim, out, ["--listen", f"/ip4/{netlab.HOSTS['coord'][1]}/tcp/40000"])
        for name in VOLUNTEERS:
            ip = netlab.HOSTS[name][1]
            sim.spawn(name, ["join", boot, "--state-dir", str(out / name), "--until-round", str(rounds),
                             "--listen", f"/ip4/{ip}/tcp/40001", *COMMON],
                      prefix=tuple(netlab.netns_exec_argv(name, [])))
        start = time.time()
        while time.time() < start + down_at:
            if down_after_rounds is not None and len(_rounds_in(out, NAMES[victim], start)) >= down_after_rounds:
                break
            time.sleep(0.5)
        _link(victim, "down")
        down_t = time.time()
        time.sleep(down_for)
        _link(victim, "up")
        up_t = time.time()
        while time.time() < up_t + after:  # then everyone leaves cleanly (Ctrl+C), as at the end of a session
            if settle is not None and (back := _back_at(out, NAMES[victim], up_t)) is not None \
                    and time.time() >= back + settle:
                break
            time.sleep(1.0)
        for name in VOLUNTEERS:
            sim.signal(name, signal.SIGINT)
        end = time.time() + timeout_s
        while time.time() < end and any(sim.alive(v) for v in VOLUNTEERS):
            time.sleep(0.5)
        timed_out = [v for v in VOLUNTEERS if sim.alive(v)]
    return outcome(out, down_t, up_t, timed_out, NAMES[victim])


def _rounds_in(out: Path, name: str, since: float) -> list[float]:
    """When process `name` was in a round after `since`: a volunteer's contribution in an
    aggregate, the coordinator following a round."""
    path = out / name / "events.jsonl"
    if not path.exists():
        return []
    return [e["t"] for e in read_events(path) if e["kind"] == "round" and e["t"] > since
            and (e.get("included") or name == "coordinator")]


def _back_at(out: Path, name: str, up_t: float) -> float | None:
    """When process `name` was back after the link came up at `up_t`; None if not yet."""
    back = _rounds_in(out, name, up_t)
    return back[0] if back else None


def outcome(out: Path, down_t: float, up_t: float, timed_out: list[str], name: str = "pub3") -> dict:
    """What the outage cost, from the event logs and the victim's (process `name`) protocol log."""
    base = report(out, 0, {}, timed_out, VOLUNTEERS)
    victim = read_events(out / name / "events.jsonl")
    others = [e for other in VOLUNTEERS if other != name for e in read_events(out / other / "events.jsonl")
              if e["kind"] == "round" and down_t <= e["t"] <= up_t + 30]
    rejoins = re.findall(r"routing table was empty: (\d+) of (\d+) known peers answered",
                         (out / f"{name}.log").read_text(errors="replace"))
    return {
        "rounds_completed": base["rounds_completed"],
        "param_hash_agreement": base["param_hash_agreement"], "timed_out": timed_out,
        "outage_s": round(up_t - down_t, 1),
        "victim_rounds_before_outage": len([t for t in _rounds_in(out, name, 0.0) if t < down_t]),
        # Each time the victim found its DHT routing table empty: (peers that answered, peers tried).
        # Traffic from the others may refill it first, once the link is back; then there is no attempt after.
        "victim_rejoin_attempts": [[int(n), int(m)] for n, m in rejoins],
        "victim": name,
        "victim_included_again_after_s": round(back - up_t, 1) if (back := _back_at(out, name, up_t)) else None,
        "victim_events_after_link_up": [e["kind"] for e in victim if e["t"] > up_t][:6],
        "others_longest_round_s": round(max((e["round_s"] for e in others), default=0.0), 1),
        "out": str(out),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--down-at", type=float, default=40)
    ap.add_argument("--down-after-rounds", type=int, default=None,
                    help="down once the victim has been in this many rounds, if before --down-at")
    ap.add_argument("--down-for", type=float, default=30)
    ap.add_argument("--after", type=float, default=45)
    ap.add_argument("--victim", choices=sorted(NAMES), default="pub3", help="whose link goes down")
    ap.add_argument("--settle", type=float, default=None, help="end this long after the victim is back")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        res = run(a.down_at, a.down_for, a.after, a.out, victim=a.victim, settle=a.settle,
                  down_after_rounds=a.down_after_rounds)
    except netlab.NetlabUnavailable as exc:
        print(f"netlab unavailable: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(res, indent=1))
    return 0 if res["param_hash_agreement"] and res["victim_included_again_after_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
