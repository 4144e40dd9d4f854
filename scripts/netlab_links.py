#!/usr/bin/env python3
"""A run inside netlab with some access links shaped apart from the rest: a coordinator and
public volunteers (`pub`, `pub2`, `pub3` by default), R rounds; prints, as JSON, what each
volunteer got out of it (rounds applied, rounds its contribution was in, uplink warnings) and the
run's pace as the coordinator saw it.

    python scripts/netlab_links.py --link pub3:up_mbit=1 --algorithm diloco --rounds 20 --out DIR
        [--rate-mbit 50 --delay-ms 40 --loss-pct 0.1] [--preset tiny] [-H 20] [--deadline 30]
        [--volunteers pub,pub2,pub3,h1]                     (root; builds and removes the lab)

`--link ROLE:KEY=VALUE,...` is netlab's (`scripts/netlab.py up --help`): `up_mbit`,
`down_mbit`, `delay_ms` (node -> core), `loss_pct`, `rdelay_ms` (core -> node), `rloss_pct`. The
default links delay one way only, so two default nodes are 2 x `--delay-ms` apart; give a shaped
link `rdelay_ms` too for a path that is slow both ways. Volunteers run with `--verbose`: their
protocol logs are OUT/NAME.log, their events OUT/NAME/events.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import netlab
from groundswell.peer.sim_report import read_events
from groundswell.peer.simulate import SimulateOptions, Simulation, manifest_toml
from netlab_run import join_and_wait, report, start_coordinator

UPLINK_WARNING = "the likely cause is this computer's uplink"


def run(opts: SimulateOptions, volunteers: tuple[str, ...], out: Path, timeout_s: float,
        **lab_kwargs: object) -> dict:
    """Build the lab, run the swarm until every volunteer applied `opts.rounds` rounds (or the
    timeout), tear it down; the outcome."""
    started = time.time()
    with netlab.lab(**lab_kwargs) as info, Simulation(out, opts) as sim:
        (out / "run.toml").write_text(manifest_toml(opts))
        coord_ip = netlab.HOSTS["coord"][1]
        rtt = {name: netlab.ping(name, coord_ip, 5)[1] for name in volunteers}
        boot = start_coordinator(sim, out, ["--listen", "/ip4/0.0.0.0/tcp/40000",
                                            "--announce", f"/ip4/{coord_ip}/tcp/40000"])
        timed_out = join_and_wait(sim, out, boot, volunteers, opts.rounds, timeout_s)
    res = report(out, opts.rounds, {**info.get("shaping", {}), "rtt_to_coord_ms": rtt}, timed_out, volunteers)
    res.update(per_volunteer(out, volunteers))
    res["wall_s"] = round(time.time() - started, 1)
    return res


def per_volunteer(out: Path, volunteers: tuple[str, ...]) -> dict:
    """Each volunteer's rounds and inclusion, and the coordinator's round pace, from the logs."""
    logs = {name: read_events(out / name / "events.jsonl") for name in ("coordinator", *volunteers)}
    ids = {name: next((e["peer"] for e in evs if "peer" in e), "") for name, evs in logs.items()}
    coord_rounds = {e["round"]: e for e in logs["coordinator"] if e["kind"] == "round"}
    times = [coord_rounds[r]["t"] for r in sorted(coord_rounds)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    rows = {}
    for name in volunteers:
        applied = sorted({e["round"] for e in logs[name] if e["kind"] in ("round", "follow")})
        # rounds it could have been in: those the coordinator applied after the volunteer's first
        eligible = [r for r in coord_rounds if applied and r > applied[0]]
        log_path = out / f"{name}.log"
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        rows[name] = {"applied": len(applied),
                      "included": sum(ids[name] in coord_rounds[r].get("contributors", []) for r in eligible),
                      "eligible": len(eligible),
                      # rounds whose aggregate it served a shard of, and rounds it was given roles after
                      "source_in": sum(ids[name] in e.get("sources", []) for e in coord_rounds.values()),
                      "server_after": sum(ids[name] in e.get("servers", []) for e in coord_rounds.values()),
                      "declined_roles": text.count("declines aggregator and leader roles"),
                      "uplink_warnings": text.count(UPLINK_WARNING)}
    return {"volunteers": rows, "coordinator_rounds": len(coord_rounds),
            "round_gap_s_median": round(statistics.median(gaps), 2) if gaps else None,
            "round_gap_s_max": round(max(gaps), 2) if gaps else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link", action="append", default=[], metavar="ROLE:KEY=VALUE,...")
    ap.add_argument("--rate-mbit", type=float, default=50.0)
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--loss-pct", type=float, default=0.1)
    ap.add_argument("--volunteers", default="pub,pub2,pub3")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--algorithm", default="sparseloco", choices=["sparseloco", "diloco"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-H", "--inner-steps", type=int, default=20)
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--slack", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    volunteers = tuple(v for v in a.volunteers.split(",") if v)
    try:
        unknown = [v for v in volunteers if v not in netlab.HOSTS or v in netlab.ROUTERS or v in ("inet", "coord")]
        if unknown or not volunteers:
            raise netlab.NetlabError(f"--volunteers: {', '.join(unknown) or 'none given'}; "
                                     "choose among pub, pub2, pub3, h1, h2, h3")
        links = dict(netlab.parse_link_spec(spec) for spec in a.link)
        opts = SimulateOptions(peers=len(volunteers), rounds=a.rounds, preset=a.preset, algorithm=a.algorithm,
                               inner_steps=a.inner_steps, deadline_s=a.deadline, slack_s=a.slack, min_peers=2,
                               checkpoint_every=a.rounds)
        out = a.out or Path(tempfile.mkdtemp(prefix="netlab-links-"))
        out.mkdir(parents=True, exist_ok=True)
        res = run(opts, volunteers, out, a.timeout, rate_mbit=a.rate_mbit, delay_ms=a.delay_ms,
                  loss_pct=a.loss_pct, links=links)
    except netlab.NetlabUnavailable as exc:
        print(f"netlab unavailable: {exc}", file=sys.stderr)
        return 3
    except netlab.NetlabError as exc:
        print(f"netlab_links: {exc}", file=sys.stderr)
        return 2
    res["argv"] = ["scripts/netlab_links.py", *(sys.argv[1:] if argv is None else argv)]
    (out / "links.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0 if res["param_hash_agreement"] and not res["timed_out"] else 1


if __name__ == "__main__":
    sys.exit(main())
