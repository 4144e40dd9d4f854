#!/usr/bin/env python
"""State-sync benchmark: a joiner downloads the global state through groundswell's protocol,
next to a plain TCP copy of the same number of bytes between two local processes.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_state_sync.py [--params 2000000] [--repeats 3]
        [--warmup 1] [--no-breakdown] [--json]

Two worker processes (multiprocessing "spawn", one torch thread each), everything on 127.0.0.1:

- server: a `SwarmNode` attached to a small closed run context ("bench": allowlisted, the state
  readable by the allowlist only; an open run takes the same path), whose `state_provider`
  returns one cached `GlobalState(round=1, {"global_params", "momentum_buffer"} of P fp32 each,
  decision = a signed round-0 Decision)`; the node's real `_on_state` answers. As in production,
  the state is serialized and hashed once (`GlobalState.blob_and_digest`, cached), and each reply
  is a small signed `StateReply(round, digest, decision, size, ...)`. The blob then comes either
  sealed (AES-256-GCM, key in the reply) over a direct TCP connection to the server's
  `DirectServer` (one-time token in the reply; what every joiner that reaches the port gets) or as
  one raw length-prefixed trailer frame on the libp2p stream (the fallback where the port cannot
  be reached); neither has an envelope or a signature over the blob.
- client: a `SwarmNode` bootstrapped from the server's address, same context. One state download
  is what a joiner does: `peer.state_fetch.fetch_state` (the announced size checked against a
  limit before the blob is read; "p2p" row: it must come over the direct connection), or, for the
  "stream" row, `transport.request_bulk(..., StateRequest(0), ...)` with the trailer; then the
  BLAKE3 check of the blob against the signed digest (over the stream; the direct path's blob is
  authenticated by its sealing instead), and `GlobalState.tensors_from_blob`.
- TCP baseline: the server process sends the same blob (same byte count) over a fresh TCP
  connection on 127.0.0.1; the client receives it into a preallocated buffer.

Each method gets `--warmup` unmeasured runs, then `--repeats` measured ones, interleaved
round-robin over the methods (so a change in the machine's load hits all of them alike);
reported times are medians. MB/s is state bytes / time (MB = 10^6 bytes).

With the breakdown on (default), the same run also measures where the protocol's time goes:
server side (serialization (raw fp32 behind a header) and BLAKE3, once per state; sealing the small reply header,
per request), client side (unsealing the header, BLAKE3, mapping the tensors), and the bare p2pd stream
(one length-prefixed frame of the blob over a libp2p binary stream, no header, no hashing, no
serialization), read both with the protocol's `read_frame` (one `readexactly`) and with
`read_frame_into` (1 MiB reads into a preallocated buffer, as the trailer is read).

Prints a short report, or with --json one JSON object (params, state_bytes, p2p_s, tcp_s, ratio, stream_s,
stream_ratio,
p2p_mb_s, tcp_mb_s, plus the breakdown). Every process this script starts (the two workers and
their p2pd daemons) is ended before it returns, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers beside this script
from _procs import kill_if_p2pd, p2pd_pids_using
from _state_sync_worker import worker_main

os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch starts its thread pool (workers inherit it)
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

GOAL_RATIO = 2.0


# --- parent process ----------------------------------------------------------------------------
class BenchError(RuntimeError):
    """A worker failed or timed out; the message carries its traceback."""


class _Workers:
    """The server and client processes and the pipes to them."""

    def __init__(self, tmp: str, args: argparse.Namespace) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.tmp = tmp
        self.p2pd_pids: set[int] = set()
        self.conns: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        for role in ("server", "client"):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"bench-state-{role}", daemon=True,
                            args=(role, child, tmp, args.params, args.seed, args.verbose))
            p.start()
            child.close()
            self.conns[role], self.procs[role] = parent, p
        for role in ("server", "client"):
            self.recv(role, timeout_s=600)

    def recv(self, role: str, timeout_s: float) -> Any:
        conn, proc = self.conns[role], self.procs[role]
        deadline = time.monotonic() + timeout_s
        while True:
            if conn.poll(0.05):
                kind, value = conn.recv()
                if kind == "p2pd":
                    if value is not None:
                        self.p2pd_pids.add(int(value))
                    continue
                if kind == "error":
                    raise BenchError(f"{role}:\n{value}")
                return value
            if not proc.is_alive():
                raise BenchError(f"{role} exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise BenchError(f"{role} did not answer within {timeout_s:.0f}s")

    def call(self, role: str, cmd: str, timeout_s: float = 900, **kwargs: Any) -> Any:
        self.conns[role].send((cmd, kwargs))
        return self.recv(role, timeout_s)

    def shutdown(self) -> None:
        """End both workers and every p2pd this run started, also ones nobody reported."""
        for conn in self.conns.values():
            try:
                conn.send(("exit", {}))
            except (OSError, ValueError):  # that worker is gone already
                pass
        end = time.monotonic() + 30
        for p in self.procs.values():
            p.join(max(0.1, end - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns.values():
            conn.close()
        for pid in self.p2pd_pids | set(p2pd_pids_using(self.tmp)):
            kill_if_p2pd(pid)


def run_bench(args: argparse.Namespace, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Run the whole benchmark; returns the JSON-ready result."""
    tmp = tempfile.mkdtemp(prefix="gs-bench-state-")
    workers = None
    w, r = args.warmup, args.repeats
    try:
        progress(f"starting server and client ({args.params:,} params per tensor)")
        workers = _Workers(tmp, args)
        info = workers.call("server", "info")
        size = info["state_bytes"]

        port = workers.call("server", "tcp_listen")["port"]
        progress("starting the swarm nodes")
        members = [info["peer_id"], workers.call("client", "info")["peer_id"]]
        maddrs = workers.call("server", "p2p_start", timeout_s=120, members=members)["maddrs"]
        if not maddrs:
            raise BenchError("the server node has no 127.0.0.1 address")
        workers.call("client", "p2p_start", timeout_s=120, maddrs=maddrs[:1], members=members)
        time.sleep(args.settle)

        sid, digest, phash = info["peer_id"], info["digest"], info["params_hash"]
        methods: dict[str, tuple[str, dict]] = {
            "tcp": ("tcp", {"port": port, "size": size}),
            "p2p": ("p2p", {"server_id": sid, "digest": digest, "params_hash_expected": phash}),
            "stream": ("p2p", {"server_id": sid, "digest": digest, "params_hash_expected": phash, "direct": False}),
        }
        if args.breakdown:
            methods.update({
                "raw": ("raw", {"server_id": sid, "size": size}),
                "raw_chunked": ("raw", {"server_id": sid, "size": size, "chunked": True}),
            })
        runs: dict[str, dict] = {m: {"times": [], "first": None, "parts": []} for m in methods}
        progress(f"{size:,} state bytes; warm-up: {w} per method")
        for m, (cmd, kw) in methods.items():
            if w:
                runs[m]["first"] = workers.call("client", cmd, warmup=w, repeats=0, **kw)["first"]
        # Measured runs interleave (round-robin over methods), so a change in the machine's load
        # (other processes) hits every method alike.
        for i in range(r):
            progress(f"measured pass {i + 1}/{r}: {', '.join(methods)}")
            for m, (cmd, kw) in methods.items():
                res = workers.call("client", cmd, warmup=0, repeats=1, **kw)
                runs[m]["times"] += res["times"]
                runs[m]["parts"] += res.get("parts", [])
        workers.call("server", "tcp_stop")
        p2p, tcp = runs["p2p"], runs["tcp"]
        breakdown: dict[str, Any] = {}
        if args.breakdown:
            progress("serialization / hashing / signing costs")
            server_parts = workers.call("server", "breakdown", repeats=r)
            client_parts = workers.call("client", "breakdown", params=args.params, seed=args.seed, repeats=r)
            med = {m: statistics.median(v["times"]) for m, v in runs.items()}
            raw_s, rawc_s = med["raw"], med["raw_chunked"]
            breakdown = {
                **{f"client_{k}": statistics.median(pt[k] for pt in p2p["parts"])
                   for k in ("request_s", "hash_s", "load_s")},
                "raw_stream_s": raw_s, "raw_stream_mb_s": size / raw_s / 1e6,
                "raw_stream_chunked_s": rawc_s, "raw_stream_chunked_mb_s": size / rawc_s / 1e6,
                "server": server_parts, "client": client_parts,
                "raw_stream_all": runs["raw"]["times"], "raw_stream_chunked_all": runs["raw_chunked"]["times"],
            }
    finally:
        if workers is not None:
            workers.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    p2p_s, tcp_s = statistics.median(p2p["times"]), statistics.median(tcp["times"])
    stream_s = statistics.median(runs["stream"]["times"])
    result: dict[str, Any] = {
        "params": args.params, "state_bytes": size, "p2p_s": p2p_s, "tcp_s": tcp_s, "ratio": p2p_s / tcp_s,
        "stream_s": stream_s, "stream_ratio": stream_s / tcp_s, "stream_all": runs["stream"]["times"],
        "p2p_mb_s": size / p2p_s / 1e6, "tcp_mb_s": size / tcp_s / 1e6,
        "goal_within_2x_of_tcp": p2p_s / tcp_s <= GOAL_RATIO,
        "repeats": r, "warmup": w, "p2p_all": p2p["times"], "tcp_all": tcp["times"],
        "p2p_first_s": p2p["first"], "tcp_first_s": tcp["first"],
    }
    if breakdown:
        result["breakdown"] = breakdown
    return result


def format_report(res: dict) -> str:
    mb = res["state_bytes"] / 1e6
    lines = [
        f"State download, {res['params']:,} params x 2 tensors = {mb:.1f} MB on 127.0.0.1 "
        f"(median of {res['repeats']} after {res['warmup']} warm-up)",
        "",
        "| method | time (s) | MB/s | vs TCP |",
        "|---|---:|---:|---:|",
        f"| plain TCP | {res['tcp_s']:.3f} | {res['tcp_mb_s']:.0f} | 1.00x |",
        f"| groundswell get-state (signed header; sealed blob over direct TCP, AES-GCM + map) "
        f"| {res['p2p_s']:.3f} "
        f"| {res['p2p_mb_s']:.0f} | {res['ratio']:.2f}x |",
        f"| groundswell get-state, port unreachable (signed header + raw trailer over libp2p + BLAKE3 + map) "
        f"| {res['stream_s']:.3f} | {res['state_bytes'] / res['stream_s'] / 1e6:.0f} | {res['stream_ratio']:.2f}x |",
    ]
    b = res.get("breakdown")
    if b:
        t = res["tcp_s"]
        lines += [
            f"| bare p2pd stream (one frame, no header/hash/serialization) | {b['raw_stream_s']:.3f} "
            f"| {b['raw_stream_mb_s']:.0f} | {b['raw_stream_s'] / t:.2f}x |",
            f"| bare p2pd stream, read_frame_into (1 MiB reads, preallocated) | {b['raw_stream_chunked_s']:.3f} "
            f"| {b['raw_stream_chunked_mb_s']:.0f} | {b['raw_stream_chunked_s'] / t:.2f}x |",
            "",
            "Where get-state's time goes (medians, seconds):",
            f"- client: download {b['client_request_s']:.3f} (the reply, then the blob over the direct TCP "
            f"connection: transfer, unseal, BLAKE3 while it arrives), digest comparison {b['client_hash_s']:.3f} "
            f"(the hash was taken on arrival), load {b['client_load_s']:.3f}",
            "- server (serialize and BLAKE3 once per state, cached; seal_header per request): "
            + ", ".join(f"{k} {v:.3f}" for k, v in b["server"].items()),
            "- client, per reply: " + ", ".join(f"{k} {v:.3f}" for k, v in b["client"].items()),
        ]
    lines += ["", f"- state download within {GOAL_RATIO:.0f}x of plain TCP: "
              f"{'met' if res['goal_within_2x_of_tcp'] else 'NOT met'} ({res['ratio']:.2f}x)"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=2_000_000, help="elements of each of the two state tensors")
    parser.add_argument("--repeats", type=int, default=3, help="measured downloads per method")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured downloads per method before those")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds to let the DHT settle after start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="only the two headline numbers (skip the bare-stream and cost measurements)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--verbose", action="store_true", help="logs at INFO from the workers")
    args = parser.parse_args(argv)
    if args.params <= 0 or args.repeats < 1 or args.warmup < 0:
        parser.error("need --params > 0, --repeats >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run_bench(args, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else format_report(result), flush=True)
    return result


if __name__ == "__main__":
    main()
