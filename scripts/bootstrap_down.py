"""How long a volunteer restarted while its whole bootstrap line is down takes to be back in the run.

Every volunteer joins with the coordinator's line only (as `groundswell join <line>` is used);
after a few rounds the coordinator goes away for good, killed (p2pd then refuses the dial at once)
or, with --blackhole (root, iptables), its port drops every packet (a machine gone off the
network: p2pd's dial hangs until its dial timeout, or hivemind's 15 s start-up wait); then one
volunteer is killed and started again with the same command, or (--daemon) only its p2pd is
killed, and it starts a new one itself. Printed, and written as JSON to --out: the
seconds from that restart to its network's start (and where they went), to the round it first
contributed to, and whether the volunteers ended on the same parameters.

    OMP_WAIT_POLICY=PASSIVE python scripts/bootstrap_down.py --peers 3 --out /tmp/bd.json [--blackhole] [--daemon]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from groundswell.peer.simulate import SimulateOptions, Simulation, manifest_toml

QUIET = ["--quiet", "--verbose", "--threads", "1"]


def events(path: Path) -> list[dict]:
    """A peer's events.jsonl (none yet: empty)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(pred, timeout_s: float, what: str) -> None:
    """Poll `pred`; RuntimeError naming `what` after `timeout_s`."""
    limit = time.time() + timeout_s
    while not pred():
        if time.time() > limit:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def blackhole(port: int, on: bool) -> None:
    """Drop (or stop dropping) every TCP packet to 127.0.0.1:`port`."""
    subprocess.run(["iptables", "-A" if on else "-D", "INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port),
                    "-j", "DROP"], check=True)


def run(peers: int, use_blackhole: bool, daemon_only: bool, out_dir: Path) -> dict:
    """The scenario once; its figures."""
    opts = SimulateOptions(peers=peers, rounds=10**6, inner_steps=20, batch_size=4, deadline_s=10, slack_s=2,
                           min_peers=2, checkpoint_every=1)
    names = [f"peer-{i}" for i in range(peers)]
    with Simulation(out_dir, opts) as sim:
        (out_dir / "run.toml").write_text(manifest_toml(opts))
        sim.spawn("coordinator", ["launch", str(out_dir / "run.toml"), "--state-dir", str(out_dir / "coordinator"),
                                  "--listen", "/ip4/127.0.0.1/tcp/0", *QUIET])
        boot = out_dir / "coordinator" / "bootstrap.txt"
        wait_for(boot.exists, 120, "the coordinator")
        line = boot.read_text().strip()
        join = {n: ["join", line, "--state-dir", str(out_dir / n), "--listen", "/ip4/127.0.0.1/tcp/0", *QUIET]
                for n in names}
        for n in names:
            sim.spawn(n, join[n])
        rounds = lambda n: [e for e in events(out_dir / n / "events.jsonl") if e["kind"] == "round"]  # noqa: E731
        victim = names[-1]
        wait_for(lambda: len(rounds(victim)) >= 3 and (out_dir / victim / "known_peers.json").exists(), 240,
                 "three rounds")
        port = int(line.split("@", 1)[1].split("/tcp/", 1)[1].split("/", 1)[0])
        if use_blackhole:
            blackhole(port, True)
        else:
            sim.signal("coordinator", signal.SIGKILL)
        try:
            if daemon_only:
                last = rounds(victim)[-1]["round"]
                seen = len(events(out_dir / victim / "events.jsonl"))
                started = time.time()
                if not sim.crash_daemon(victim):
                    raise RuntimeError(f"{victim}'s p2pd was not found")
            else:
                sim.signal(victim, signal.SIGKILL)
                sim.procs[victim].popen.wait(timeout=30)  # type: ignore[union-attr]
                last = rounds(victim)[-1]["round"]
                seen = len(events(out_dir / victim / "events.jsonl"))
                started = time.time()
                sim.spawn(victim, join[victim], kind="restart")
            wait_for(lambda: any(e["round"] > last and e.get("included") for e in rounds(victim)), 300,
                     "a round with the restarted volunteer's work")
            new = events(out_dir / victim / "events.jsonl")[seen:]
            network = next(e for e in new if e["kind"] == ("network-restart" if daemon_only else "network"))
            counted = next(e for e in new if e["kind"] == "round" and e.get("included"))
            wait_for(lambda: all(any(e["round"] == counted["round"] for e in rounds(n)) for n in names), 60,
                     "every volunteer's copy of that round")
            hashes = {n: next(e["hash"] for e in rounds(n) if e["round"] == counted["round"]) for n in names}
            log = (out_dir / f"{victim}.log").read_text()
            return {"peers": peers, "coordinator": "blackholed" if use_blackhole else "killed",
                    "volunteer": "daemon killed" if daemon_only else "process killed and started again",
                    "network_up_s": round(network["t"] - started, 1),
                    "startup_s": {k: network[k] for k in ("p2pd_s", "probe_s", "dht_s") if k in network},
                    "counted_s": round(counted["t"] - started, 1), "counted_round": counted["round"],
                    "hashes_agree": len(set(hashes.values())) == 1,
                    "entered_through_proven": "no bootstrap peer answered" in log,
                    "reachability": "public" if "reachable: public" in log.rsplit("joined run", 1)[-1] else "private"}
        finally:
            if use_blackhole:
                blackhole(port, False)


def main() -> None:
    """Run the scenario; print and write its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--blackhole", action="store_true", help="drop the coordinator's packets instead of killing it")
    ap.add_argument("--daemon", action="store_true", help="kill the volunteer's p2pd, not its process")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the figures")
    ap.add_argument("--keep", type=Path, default=None, help="a new folder to keep the run's logs and state dirs in")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(a.peers, a.blackhole, a.daemon, a.keep or Path(tmp) / "sim")
    print(json.dumps(result, indent=1))
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
