#!/usr/bin/env python3
"""A run inside netlab: a coordinator and a volunteer on the public segment, three volunteers
behind home routers (two cone NATs, one symmetric), R rounds; prints what happened as JSON.

    python scripts/netlab_run.py [--rounds 5] [--out DIR] [--no-shaping]   (root; builds and removes the lab)

`scripts/netlab.py test --json` runs the same thing. Each volunteer probes its reachability at
start (a bootstrap peer dials it back), so the NAT'ed ones contribute without serving; at the end
each lists its libp2p connections, direct or through a relay. Volunteers behind NATs punch holes
to each other (`peer/holepunch.py`): `punches` lists every attempt, and a connection that came of
one is marked `hole_punched`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import netlab
from groundswell.peer.sim_report import read_events
from groundswell.peer.simulate import SimulateOptions, Simulation, manifest_toml

VOLUNTEERS = ("pub", "h1", "h2", "h3")


COMMON = ("--quiet", "--verbose", "--threads", "1")  # every process: protocol log in NAME.log


def start_coordinator(sim: Simulation, out: Path, listen: list[str]) -> str:
    """Launch OUT/run.toml's coordinator in the `coord` namespace; its bootstrap line once it is up."""
    sim.spawn("coordinator", ["launch", str(out / "run.toml"), "--state-dir", str(out / "coordinator"),
                              *listen, *COMMON], prefix=tuple(netlab.netns_exec_argv("coord", [])))
    boot_file = out / "coordinator" / "bootstrap.txt"
    deadline = time.time() + 120
    while not boot_file.exists():
        if time.time() > deadline or not sim.alive("coordinator"):
            raise RuntimeError(f"the coordinator did not start; see {out / 'coordinator.log'}")
        time.sleep(0.2)
    return boot_file.read_text().strip()


def run(rounds: int = 5, out: Path | None = None, timeout_s: float = 300, **lab_kwargs: object) -> dict:
    """Build the lab, run the swarm in it until every volunteer reached `rounds`, tear it down."""
    out = out or Path(tempfile.mkdtemp(prefix="netlab-run-"))
    opts = SimulateOptions(peers=len(VOLUNTEERS), rounds=rounds, inner_steps=30, batch_size=4, deadline_s=20,
                           slack_s=2, min_peers=2, checkpoint_every=rounds)
    with netlab.lab(**lab_kwargs) as info, Simulation(out, opts) as sim:
        (out / "run.toml").write_text(manifest_toml(opts))
        coord_ip = netlab.HOSTS["coord"][1]
        rtt = netlab.ping("h1", coord_ip, 5)[1]  # what the links give, as a volunteer behind NAT sees it
        boot = start_coordinator(sim, out, ["--listen", "/ip4/0.0.0.0/tcp/40000",
                                            "--announce", f"/ip4/{coord_ip}/tcp/40000"])
        timed_out = join_and_wait(sim, out, boot, VOLUNTEERS, rounds, timeout_s)
    return report(out, rounds, {**info.get("shaping", {}), "rtt_h1_coord_ms": rtt}, timed_out)


def join_and_wait(sim: Simulation, out: Path, boot: str, volunteers: tuple[str, ...], rounds: int,
                  timeout_s: float) -> list[str]:
    """Start each volunteer in its namespace, to leave once round `rounds` is applied; wait for
    them all to exit (at most `timeout_s`); those still running."""
    for name in volunteers:
        sim.spawn(name, ["join", boot, "--state-dir", str(out / name), "--until-round", str(rounds),
                         "--listen", "/ip4/0.0.0.0/tcp/0", *COMMON], prefix=tuple(netlab.netns_exec_argv(name, [])))
    end = time.time() + timeout_s
    while time.time() < end and any(sim.alive(v) for v in volunteers):
        time.sleep(0.5)
    return [v for v in volunteers if sim.alive(v)]


def report(out: Path, rounds: int, shaping: dict, timed_out: list[str],
           volunteers: tuple[str, ...] = VOLUNTEERS) -> dict:
    """The run's outcome from every process's event log."""
    logs = {name: read_events(out / name / "events.jsonl") for name in ("coordinator", *volunteers)}
    ids = {next((e["peer"] for e in evs if "peer" in e), ""): name for name, evs in logs.items()}
    hashes: dict[int, set[str]] = {}
    contributed: set[str] = set()
    for evs in logs.values():
        for e in evs:
            if e["kind"] == "round":
                hashes.setdefault(e["round"], set()).add(e["hash"])
                contributed |= {ids.get(c, c[-8:]) for c in e.get("contributors", [])}
    connections, reach, punches = [], {}, []
    for name in volunteers:
        last = [e for e in logs[name] if e["kind"] == "connections"]
        if last:
            reach[name] = last[-1]["reachability"]
            # peers it holds a punched connection with: dialled by it (an attempt that worked) or by
            # them (its punch target forwards their connection); either end's view counts
            punched = set(last[-1].get("punched", []))
            for a in last[-1].get("punches", []):
                punches.append({"a": name, "b": ids.get(a["peer"], a["peer"][-8:]), "ok": a["ok"], "s": a["s"],
                                "detail": a.get("address") or a.get("reason", "")})
                if a["ok"]:
                    punched.add(a["peer"])
            for pid, path in sorted(last[-1]["paths"].items()):
                row = {"a": name, "b": ids.get(pid, pid[-8:]), "path": path}
                if pid in punched and path == "direct":
                    row["hole_punched"] = True
                connections.append(row)
    return {
        "rounds_completed": len(hashes), "rounds_target": rounds,
        "param_hash_agreement": bool(hashes) and all(len(h) == 1 for h in hashes.values()),
        "contributed": sorted(contributed), "reachability": reach, "connections": connections,
        "punches": punches,
        "timed_out": timed_out, "link": shaping, "out": str(out),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-shaping", action="store_true")
    ap.add_argument("--json", action="store_true", help="(the output is always JSON)")
    a = ap.parse_args(argv)
    try:
        res = run(a.rounds, a.out, shaping=not a.no_shaping)
    except netlab.NetlabUnavailable as exc:
        print(f"netlab unavailable: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(res, indent=1))
    ok = res["rounds_completed"] >= a.rounds and res["param_hash_agreement"] and set(VOLUNTEERS) <= set(res["contributed"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
