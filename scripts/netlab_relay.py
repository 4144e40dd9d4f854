#!/usr/bin/env python3
"""Can a volunteer behind a NAT be reached at all? A relay check in netlab.

    python scripts/netlab_relay.py [--timeout 360] [--no-shaping]   (root; builds and removes the lab)

In the lab of scripts/netlab.py: a relay peer in gs-coord (public, as a coordinator is), and
SwarmNodes started as `groundswell join` starts them in h1, h2 (cone NATs), h3 (symmetric NAT)
and pub (public). Each probes its reachability; found private, it restarts its daemon knowing
it, so that libp2p's autorelay reserves a slot on its bootstrap peer (the relay). Then h1
(private) and pub (public) each open a connection to h2 and to h3 through the relay, retrying
every 5 s until the target's reservation is there, and make one signed request on it
(`get-manifest`). Prints one JSON object: each node's reachability, and per pair whether it
worked, its libp2p path ("relay" or "direct"), seconds from the start until it first worked, and
the request's time. Training never needs this (NAT'ed volunteers only dial out); it is what lets
anyone open a stream to them at all. Every process and the lab are gone when it returns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import netlab

TARGETS = ("h2", "h3")
DIALERS = ("h1", "pub")
RELAY_IP, RELAY_PORT = netlab.HOSTS["coord"][1], 40000


def node(role: str, out: Path, timeout_s: float) -> int:
    """One lab process: the relay, a target (waits for `stop`) or a dialer (tries each target)."""
    from groundswell.peer.swarm import NodeOptions, SwarmNode
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import ManifestReply, ManifestRequest

    key = out / f"{role}.key"
    ident = Identity.load_or_generate(key)
    if role == "relay":
        opts = NodeOptions(host_maddrs=[f"/ip4/0.0.0.0/tcp/{RELAY_PORT}"], role="coordinator",
                           announce_maddrs=[f"/ip4/{RELAY_IP}/tcp/{RELAY_PORT}"], reachability="public")
    else:
        relay = (out / "relay.addr").read_text().strip()
        opts = NodeOptions(host_maddrs=["/ip4/0.0.0.0/tcp/0"], initial_peers=[relay])
    started = time.time()
    sn = SwarmNode(ident, str(key), opts)
    sn.start()
    try:
        (out / f"{role}.json").write_text(json.dumps({"id": ident.peer_id, "reachability": sn.reachability}))
        if role == "relay":
            (out / "relay.addr").write_text(f"/ip4/{RELAY_IP}/tcp/{RELAY_PORT}/p2p/{ident.peer_id}")
        if role not in DIALERS:
            while not (out / "stop").exists() and time.time() - started < timeout_s + 60:
                time.sleep(0.5)
            return 0
        relay = (out / "relay.addr").read_text().strip()
        pairs = []
        for target in TARGETS:
            while not (out / f"{target}.json").exists():
                time.sleep(0.5)
            tid = json.loads((out / f"{target}.json").read_text())["id"]
            row = {"a": role, "b": target, "ok": False, "path": None, "first_ok_s": None, "error": ""}
            while time.time() - started < timeout_s:
                try:
                    sn.call(sn.connect_via_relay(tid, relay), timeout_s=30)
                    t0 = time.time()
                    sn.call(sn.bootstrap_transport.request(tid, "get-manifest", ManifestRequest(), ManifestReply,
                                                           timeout_s=20), timeout_s=30)
                    row.update(ok=True, error="", request_s=round(time.time() - t0, 3),
                               first_ok_s=round(time.time() - started, 1),
                               path=sn.call(sn.connections(), timeout_s=10).get(tid))
                    break
                except Exception as exc:  # the relay has no reservation for it yet: try again
                    row["error"] = ((str(exc) or repr(exc)).splitlines() or [""])[-1][:200]
                    time.sleep(5)
            pairs.append(row)
        (out / f"{role}.pairs.json").write_text(json.dumps(pairs))
        return 0
    finally:
        sn.close()


def run(timeout_s: float = 360, shaping: bool = True, out: Path | None = None) -> dict:
    """Build the lab, run the relay check, tear everything down; the result as a dict.

    Logs and the nodes' throwaway keys go to `out` (a new temp folder if None, kept for reading)."""
    out = out or Path(tempfile.mkdtemp(prefix="netlab-relay-"))
    procs: list[subprocess.Popen] = []

    def spawn(role: str) -> None:
        argv = netlab.netns_exec_argv("coord" if role == "relay" else role, [
            sys.executable, __file__, "--node", role, "--out", str(out), "--timeout", str(timeout_s)])
        procs.append(subprocess.Popen(argv, stdout=open(out / f"{role}.log", "w"), stderr=subprocess.STDOUT))

    def wait_for(path: Path, limit: float) -> None:
        end = time.time() + limit
        while not path.exists():
            if time.time() > end or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{path.name} did not appear; logs in {out}")
            time.sleep(0.3)

    try:
        with netlab.lab(shaping=shaping) as info:
            spawn("relay")
            wait_for(out / "relay.addr", 120)
            for role in (*TARGETS, *DIALERS):
                spawn(role)
            for role in DIALERS:
                wait_for(out / f"{role}.pairs.json", timeout_s + 120)
            (out / "stop").write_text("")
            for p in procs:
                p.wait(timeout=60)
            reach = {r: json.loads((out / f"{r}.json").read_text())["reachability"] for r in (*TARGETS, *DIALERS)}
            pairs = [row for r in DIALERS for row in json.loads((out / f"{r}.pairs.json").read_text())]
            return {"reachability": reach, "pairs": pairs, "link": info.get("shaping", {}), "out": str(out)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=360.0, help="seconds each dialer keeps trying")
    ap.add_argument("--no-shaping", action="store_true")
    ap.add_argument("--node", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.node:
        return node(args.node, args.out, args.timeout)
    res = run(args.timeout, shaping=not args.no_shaping)
    print(json.dumps(res, indent=1))
    return 0 if all(p["ok"] for p in res["pairs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
