#!/usr/bin/env python
"""Exchange-round benchmark: one swarm round per codec on loopback, next to a gloo all-reduce.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_exchange.py --peers 4 --params 25000000 \\
        [--codecs fp32,int8,sparseloco] [--repeats 3] [--warmup 1] [--json]

A `--codecs` entry may end in `@N` to run that codec with N replicas of each shard instead of the
run's default (1 for dense codecs, 2 for sparseloco): `fp32@0` measures what the copies cost.

N worker processes (multiprocessing "spawn", one torch thread each) each hold a seeded
pseudo-gradient of P elements. In the same run they do:

- for each codec, a fresh `SwarmNode` per process (hivemind libp2p on 127.0.0.1), a genesis
  decision signed by peer 0 that puts all N peers in round 0, then rounds 0, 1, ... of the real
  round protocol. A peer's part of a round runs from "I have my tensor" to "I hold the decoded
  mean": encode_segments + Payload.to_bytes + RoundClient.run_attempt (join, send shards, wait
  for the commit) + RoundClient.fetch_aggregate (fetch shards, aggregate / decode);
- right before each method (each codec and the floor, once its nodes are up and settled), the
  baseline: a dense fp32 `torch.distributed` gloo all_reduce (sum, then * 1/N) of their tensors,
  over one gloo group (tcp://127.0.0.1:<free port>) kept up for the whole run. Each method's
  `ratio_vs_gloo` divides by the gloo median measured next to it, so a burst of load from others
  on a shared machine moves both sides of a ratio instead of every ratio at once.

And, unless `--no-floor`, the p2pd floor (`_p2p_floor.py`): rounds of bare fp32 bytes between the
same processes over the same kind of node, every peer moving what a ring all-reduce moves
(2(N-1)/N x 4P bytes), with no encoding, checks, hashing or summing. What no dense fp32 exchange
on this transport can beat on this machine.

Every round starts on a multiprocessing Barrier. A round's time runs from the first peer's start
to the last peer's end (each peer reports absolute `time.perf_counter()` times, CLOCK_MONOTONIC
on Linux, one clock for all processes), so it includes how unevenly the peers leave the barrier;
the reported time is the median over `--repeats` measured rounds (after `--warmup` unmeasured
ones, which absorb connection set-up and first-call costs; each gloo measurement gets the same
warm-up). Bytes are the
round protocol's framed request/reply bytes (`Transport.bytes_sent/received`, libp2p's own
encryption and multiplexing overhead not included), averaged over peers. Each peer hashes its
mean (sha256): `identical` says every peer held bit-identical means in every round (null for
the floor, which computes no mean). `exact` says that mean was, bit for bit, the protocol's robust
mean (clipping included) of what every peer sent, recomputed by peer 0 from every peer's segments
after each round, outside its time (peers holding the same mean says nothing of its being right). `rel_error` is ||mean - true mean|| / ||true mean||, the true
mean taken in fp64 over the N inputs (for sparseloco, whose peers send their error feedback
buffers, not the inputs themselves, it only says how far one round's mean is from the inputs';
for dense codecs it includes what clipping to the median norm takes off). A goal counts as met only
if the method's and its gloo measurement's means were identical on every peer and the method's
`exact`.

The JSON also records how it was made (`run`: command line, git commit, CPU count, torch and
hivemind versions, OMP_WAIT_POLICY, UTC time).

Prints a Markdown table, or with --json one JSON object. Every process this script starts (the
workers and their p2pd daemons) is ended before it returns, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers beside this script
from _exchange_worker import free_port, worker_main
from _procs import kill_if_p2pd, p2pd_pids_using

OMP_WAIT_POLICY_AT_LAUNCH = os.environ.get("OMP_WAIT_POLICY")  # recorded: the line below overrides it
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch starts its thread pool (workers inherit it)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback only
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

DEFAULT_CODECS = ("fp32", "int8", "sparseloco")


# --- parent process ----------------------------------------------------------------------------
class BenchError(RuntimeError):
    """A worker failed or timed out; the message carries its traceback."""


class _Pool:
    """The N worker processes and the pipes to them."""

    def __init__(self, n: int, tmp: str, args: argparse.Namespace) -> None:
        import multiprocessing as mp

        from groundswell.protocol.identity import Identity

        self.mp = mp.get_context("spawn")
        self.tmp = tmp
        self.p2pd_pids: set[int] = set()
        self.ids: list[str] = []
        self.barrier = self.mp.Barrier(n)
        self.conns, self.procs = [], []
        for rank in range(n):
            path = os.path.join(tmp, f"peer-{rank}.key")
            identity = Identity.generate()
            identity.save(path)
            self.ids.append(identity.peer_id)
            parent, child = self.mp.Pipe()
            p = self.mp.Process(target=worker_main, name=f"bench-peer-{rank}", daemon=True,
                                args=(rank, n, child, self.barrier, path, args.params, args.seed, args.max_shards,
                                      args.deadline, args.slack, args.verbose))
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.recv(range(n), timeout_s=600)  # inputs ready

    def send(self, ranks: Sequence[int], cmd: str, **kwargs: Any) -> None:
        for r in ranks:
            self.conns[r].send((cmd, kwargs))

    def recv(self, ranks: Sequence[int], timeout_s: float) -> list[Any]:
        """One reply from each rank (p2pd pid notices are recorded on the way)."""
        deadline = time.monotonic() + timeout_s
        out: dict[int, Any] = {}
        errors = []
        pending = list(ranks)
        while pending:
            for r in list(pending):
                conn = self.conns[r]
                while conn.poll(0.05):
                    kind, value = conn.recv()
                    if kind == "p2pd":
                        if value is not None:
                            self.p2pd_pids.add(int(value))
                        continue
                    if kind == "error":
                        errors.append(f"peer {r}:\n{value}")
                        deadline = min(deadline, time.monotonic() + 30)  # the others fail soon after
                    out[r] = value
                    pending.remove(r)
                    break
                else:
                    if not self.procs[r].is_alive():
                        errors.append(f"peer {r} exited with code {self.procs[r].exitcode}")
                        pending.remove(r)
                        self.barrier.abort()
                        deadline = min(deadline, time.monotonic() + 30)
            if errors and not pending:
                break
            if time.monotonic() > deadline:
                errors.append(f"peers {pending} did not answer within {timeout_s:.0f}s")
                break
        if errors:
            self.barrier.abort()
            raise BenchError("\n".join(errors))
        return [out[r] for r in ranks]

    def call(self, ranks: Sequence[int], cmd: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        self.send(ranks, cmd, **kwargs)
        return self.recv(ranks, timeout_s)

    def shutdown(self) -> None:
        """End every worker and every p2pd this run started, also the ones nobody reported."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):  # that worker is gone already
                conn.send(("exit", {}))
        end = time.monotonic() + 30
        for p in self.procs:
            p.join(max(0.1, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        # p2pd daemons: the ones workers reported, plus any whose identity file lies in our tmp dir
        for pid in self.p2pd_pids | set(p2pd_pids_using(self.tmp)):
            kill_if_p2pd(pid)


def _summarize(per_peer: list[dict], n: int) -> dict:
    """Per round, the first peer's start to the last peer's end; median over measured rounds;
    identical means across peers (None where no peer computed a mean, as in the floor)."""
    rounds = list(zip(*(p["rounds"] for p in per_peer)))  # rounds[i] = the n peers' records of round i
    measured = [rs for rs in rounds if not rs[0]["warmup"]]
    shas = [rec["sha"] for rs in rounds for rec in rs]
    identical = None if any(sha is None for sha in shas) else all(len({rec["sha"] for rec in rs}) == 1
                                                                   for rs in rounds)
    # The peers' clocks are one (CLOCK_MONOTONIC): a round spans from whoever left the barrier
    # first to whoever finished last, not the slowest peer's own duration.
    totals = [max(rec["t3"] for rec in rs) - min(rec["t0"] for rec in rs) for rs in measured]
    errors = [rs[0]["rel_error"] for rs in measured if rs[0]["rel_error"] is not None]
    # rank 0's word that the mean was the protocol's robust mean of what was sent, every round
    # (warm-up included); None where nothing checks it (gloo, the floor)
    exact = None if "exact" not in rounds[0][0] else all(rs[0]["exact"] is True for rs in rounds)
    out = {"round_s": statistics.median(totals), "round_s_all": totals, "identical": identical, "exact": exact,
           "rel_error": statistics.median(errors) if errors else None}
    if "sent" in measured[0][0]:
        def med(key: str, reduce=lambda v: sum(v) / len(v)) -> float:
            return statistics.median(reduce([rec[key] for rec in rs]) for rs in measured)

        def last(key: str) -> float:  # the phases of the peer that finished last: they add up to its round
            return statistics.median(max(rs, key=lambda rec: rec["t3"])[key] for rs in measured)

        out.update(
            bytes_sent_per_peer=med("sent"),
            bytes_received_per_peer=med("received"),
            bytes_sent_max_peer=med("sent", max),
            encode_s=last("encode_s"),
            exchange_s=last("exchange_s"),  # its wait for the slowest peers' contributions included
            fetch_decode_s=last("fetch_decode_s"),
        )
    return out


def _exact(c: dict) -> str:
    """The table's word on whether the exchanged mean was the reference mean (see `exact`)."""
    return "" if c.get("exact") is None else (", exact" if c["exact"] else ", NOT exact")


def parse_method(entry: str) -> tuple[str, int | None]:
    """A `--codecs` entry: "fp32" (the run's default replicas) or "fp32@0" (0 replicas)."""
    name, _, replicas = entry.partition("@")
    if not replicas:
        return name, None
    if not replicas.isdigit() or int(replicas) > 3:
        raise BenchError(f"bad method {entry!r}: replicas after '@' must be 0..3")
    return name, int(replicas)


def _start_nodes(pool: _Pool, codec_name: str, replicas: int | None, args: argparse.Namespace) -> int:
    """A fresh node per worker for one method, all in round 0 of a new run; returns the segment count."""
    ranks = list(range(len(pool.ids)))
    run_id = f"bench-{codec_name}-{uuid.uuid4().hex[:8]}"
    first = pool.call([0], "start", timeout_s=120, codec_name=codec_name, run_id=run_id, ids=pool.ids,
                      initial_peers=[], replicas=replicas)[0]
    if not first["maddrs"]:
        raise BenchError("peer 0 has no 127.0.0.1 address")
    pool.call(ranks[1:], "start", timeout_s=120, codec_name=codec_name, run_id=run_id, ids=pool.ids,
              initial_peers=first["maddrs"][:1], replicas=replicas)
    genesis = pool.call([0], "sign_genesis", timeout_s=30)[0]  # once every node is up, as in a real run
    pool.call(ranks, "begin", timeout_s=30, genesis=genesis)
    time.sleep(args.settle)  # let the DHT settle
    return first["segments"]


def _gloo_then(pool: _Pool, cmd: str, timeout_s: float, args: argparse.Namespace) -> tuple[dict, list[Any]]:
    """gloo's rounds, then every worker's rounds of one method (`cmd`: "rounds" or "floor") right
    after them, then the method's nodes closed. Returns (gloo's summary, the method's per-peer records)."""
    ranks = list(range(len(pool.ids)))
    try:
        gloo = _summarize(pool.call(ranks, "gloo", timeout_s=900, warmup=args.warmup, repeats=args.repeats),
                          len(ranks))
        return gloo, pool.call(ranks, cmd, timeout_s=timeout_s, warmup=args.warmup, repeats=args.repeats)
    finally:
        pool.call(ranks, "close_node", timeout_s=120)


def _goal_ok(method: dict, gloo: dict) -> bool:
    """A goal's time counts only if the method's and its gloo measurement's rounds were correct."""
    return method["identical"] is True and method.get("exact") is not False and gloo["identical"] is True


def run_info(argv: Sequence[str]) -> dict:
    """How the numbers were made: enough to tell two result files' conditions apart."""
    import hivemind
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None  # not a git checkout, or no git
    return {"argv": [sys.argv[0], *argv], "git_commit": commit,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "hivemind": hivemind.__version__,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "omp_wait_policy_at_launch": OMP_WAIT_POLICY_AT_LAUNCH,
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run_bench(args: argparse.Namespace, progress=lambda m: None) -> dict:
    """Run the whole benchmark; returns the JSON-ready result."""
    n, params = args.peers, args.params
    tmp = tempfile.mkdtemp(prefix="gs-bench-exchange-")
    pool = None
    gloo_by_method: dict[str, dict] = {}
    gloo_records: list[tuple[float, bool | None, float | None]] = []  # (round_s, identical, rel_error)

    def next_gloo(name: str, gloo: dict) -> dict:
        gloo_by_method[name] = gloo
        gloo_records.extend((t, gloo["identical"], gloo["rel_error"]) for t in gloo["round_s_all"])
        progress(f"gloo all_reduce before {name}: {gloo['round_s']:.3f}s")
        return gloo

    try:
        progress(f"starting {n} peers with {params:,} parameters each")
        pool = _Pool(n, tmp, args)
        ranks = list(range(n))
        pool.call(ranks, "gloo_init", timeout_s=300, port=free_port())  # up until the workers end
        floor = None
        if args.floor:
            _start_nodes(pool, "fp32", None, args)
            progress(f"p2pd floor: running {args.warmup}+{args.repeats} rounds of bare fp32 bytes, after gloo's")
            gloo, per_peer = _gloo_then(pool, "floor", (args.warmup + args.repeats) * 700, args)
            gloo = next_gloo("p2pd_floor", gloo)
            if any(rec["received"] != rec["expected"] for p in per_peer for rec in p["rounds"]):
                raise BenchError("a peer of the floor measurement did not receive exactly its bytes")
            floor = _summarize(per_peer, n)
            floor["gloo_round_s"] = gloo["round_s"]
            floor["ratio_vs_gloo"] = floor["round_s"] / gloo["round_s"]
            floor["bytes_received_per_peer"] = statistics.mean(p["rounds"][0]["expected"] for p in per_peer)
            # payload bytes whose receiver acknowledged them (no stream headers), measured, per round
            floor["bytes_sent_per_peer"] = statistics.median(
                statistics.mean(rec["payload_sent"] for rec in rs)
                for rs in zip(*(p["rounds"] for p in per_peer)) if not rs[0]["warmup"])
            progress(f"p2pd floor: {floor['round_s']:.3f}s ({floor['ratio_vs_gloo']:.2f}x gloo)")
        codecs: dict[str, dict] = {}
        for name in args.codecs:
            codec_name, replicas = parse_method(name)
            segments = _start_nodes(pool, codec_name, replicas, args)
            progress(f"{name}: {segments} segments; running {args.warmup}+{args.repeats} rounds, after gloo's")
            gloo, per_peer = _gloo_then(pool, "rounds", (args.warmup + args.repeats) * 1200, args)
            gloo = next_gloo(name, gloo)
            res = _summarize(per_peer, n)
            res["gloo_round_s"] = gloo["round_s"]
            res["gloo_identical"] = gloo["identical"]
            res["ratio_vs_gloo"] = res["round_s"] / gloo["round_s"]
            codecs[name] = res
            progress(f"{name}: {res['round_s']:.3f}s ({res['ratio_vs_gloo']:.2f}x gloo)")
    finally:
        if pool is not None:
            pool.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    gloo_errors = [e for _, _, e in gloo_records if e is not None]
    result: dict[str, Any] = {
        "run": run_info(args.argv), "peers": n, "params": params,
        # every gloo round measured in this run (next to each method): what one figure for the
        # baseline can be; each ratio_vs_gloo uses its own method's gloo_round_s instead
        "gloo_allreduce_s": statistics.median(t for t, _, _ in gloo_records),
        "gloo": {"round_s_all": [t for t, _, _ in gloo_records],
                 "identical": all(ok is True for _, ok, _ in gloo_records),
                 "rel_error": statistics.median(gloo_errors) if gloo_errors else None,
                 "by_method": gloo_by_method},
        "repeats": args.repeats, "warmup": args.warmup, "max_shards": args.max_shards, "codecs": codecs,
        "p2pd_floor": floor,
    }
    goals = {}
    if "sparseloco" in codecs:
        sl = codecs["sparseloco"]
        goals["sparseloco_faster_than_gloo"] = (sl["round_s"] < sl["gloo_round_s"]
                                                and _goal_ok(sl, gloo_by_method["sparseloco"]))
    if "fp32" in codecs:
        fp = codecs["fp32"]
        goals["fp32_within_8x_of_gloo"] = fp["ratio_vs_gloo"] <= 8.0 and _goal_ok(fp, gloo_by_method["fp32"])
    result["goals"] = goals
    return result


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1000 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1000
    return str(b)


def format_table(result: dict) -> str:
    """The result as a Markdown table plus the goals."""
    g = result["gloo"]
    lines = [
        (f"Exchange round, {result['peers']} peers x {result['params']:,} params on 127.0.0.1 "
         f"(median of {result['repeats']} after {result['warmup']} warm-up; round = first peer's start to "
         f"last peer's end; gloo timed right before each method, and each ratio is to that gloo time)"),
        "",
        ("| method | round (s) | gloo before it (s) | vs gloo | encode (s) | exchange (s) | fetch+decode (s) "
         "| sent/peer | recv/peer | identical | rel. error |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|",
        (f"| gloo all_reduce (fp32), all its rounds | {result['gloo_allreduce_s']:.3f} | | | | | | | "
         f"| {'yes' if g['identical'] else 'NO'} | {g['rel_error']:.2e} |"),
    ]
    floor = result.get("p2pd_floor")
    if floor is not None:
        # payload bytes only (the codecs' columns count the round protocol's framing too)
        lines.append(f"| p2pd floor: bare fp32 bytes, no protocol | {floor['round_s']:.3f} | {floor['gloo_round_s']:.3f} "
                     f"| {floor['ratio_vs_gloo']:.2f}x | | | | {_fmt_bytes(floor['bytes_sent_per_peer'])} payload "
                     f"| {_fmt_bytes(floor['bytes_received_per_peer'])} payload | n/a | |")
    for name, c in result["codecs"].items():
        lines.append(
            f"| {name} | {c['round_s']:.3f} | {c['gloo_round_s']:.3f} | {c['ratio_vs_gloo']:.2f}x | {c['encode_s']:.3f} "
            f"| {c['exchange_s']:.3f} | {c['fetch_decode_s']:.3f} | {_fmt_bytes(c['bytes_sent_per_peer'])} "
            f"| {_fmt_bytes(c['bytes_received_per_peer'])} | {'yes' if c['identical'] else 'NO'}{_exact(c)} "
            f"| {c['rel_error']:.2e} |")
    names = {"sparseloco_faster_than_gloo": "sparseloco round faster than gloo's dense fp32 all-reduce",
             "fp32_within_8x_of_gloo": "fp32 round within 8x of gloo"}
    if result["goals"]:
        lines += ["", "Goals (met only where the method's and its gloo rounds' means were identical on every peer, "
                      "and the method's the protocol's robust mean of what was sent):"]
        for key, met in result["goals"].items():
            lines.append(f"- {names[key]}: {'met' if met else 'NOT met'}")
    run = result.get("run", {})
    lines += ["", f"`{' '.join(run.get('argv', []))}` at {run.get('git_commit')}, {run.get('cpu_count')} CPUs, "
                  f"torch {run.get('torch')}, hivemind {run.get('hivemind')}, {run.get('utc')}"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="number of peer processes (>= 2)")
    parser.add_argument("--params", type=int, default=25_000_000, help="elements of the exchanged tensor")
    parser.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="comma-separated codec names")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per method")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per method before those")
    parser.add_argument("--max-shards", type=int, default=16, help="RunContext.max_shards (segments <= this)")
    parser.add_argument("--deadline", type=float, default=120.0, help="round deadline_s")
    parser.add_argument("--slack", type=float, default=5.0, help="round slack_s")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to let the DHT settle after start")
    parser.add_argument("--seed", type=int, default=0, help="peer r's tensor uses seed + r")
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                        help="also time bare fp32 bytes over the same p2pd streams (the transport's floor)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--verbose", action="store_true", help="protocol logs at INFO from the workers")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in the result
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    from groundswell.compression import make_codec

    for c in args.codecs:
        try:
            make_codec(parse_method(c)[0])  # CodecError for unknown names, before anything starts
        except BenchError as exc:
            parser.error(str(exc))
    if args.peers < 2 or args.params <= 0 or args.repeats < 1 or args.warmup < 0 or not args.codecs:
        parser.error("need --peers >= 2, --params > 0, --repeats >= 1, --warmup >= 0 and at least one codec")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Command-line entry: run, print the table (or JSON), return the result."""
    args = parse_args(argv)
    result = run_bench(args, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return result


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_bench's cleanup


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    main()
