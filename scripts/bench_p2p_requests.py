#!/usr/bin/env python
"""Cost of one small request/reply over hivemind's p2pd: a binary stream per request against a
unary call on the daemon's persistent connection, by message size.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_p2p_requests.py [--sizes 300,65536,262144] \\
        [--requests 100] [--json]

Two processes on 127.0.0.1, each with its own p2pd. The server echoes every request, and the
client checks every reply equals what it sent (a wrong echo fails the run). For each size
and path the client sends `--requests` sequential requests (after 10 unmeasured ones) and reports
the wall time per request and the CPU time per request of the four processes involved (client,
client daemon, server daemon, server), read from /proc. The paths alternate twice, so a drift of
the machine shows as a difference between the two rounds. This is what `protocol/transport.py`'s
UNARY_MAX_REQUEST rests on. Both daemons and the server are stopped before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from typing import Any

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
WARMUP = 10


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve(info: Any, done: Any) -> None:
    from hivemind.p2p import P2P

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    try:
        async def on_stream(_: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = int.from_bytes(await reader.readexactly(4), "big")
            data = await reader.readexactly(n)
            writer.write(len(data).to_bytes(4, "big") + data)
            await writer.drain()
            await reader.read()  # until the caller closes
            writer.close()

        async def on_unary(data: bytes, _: Any) -> bytes:
            return data

        await p2p.add_binary_stream_handler("echo", on_stream)
        await p2p._client.add_unary_handler("echo-unary", on_unary)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        info.put((p2p.peer_id.to_base58(), maddrs, p2p._child.pid, os.getpid()))
        while not done.is_set():
            await asyncio.sleep(0.05)
    finally:
        await p2p.shutdown()


def _server_main(info: Any, done: Any) -> None:
    asyncio.run(_serve(info, done))


def _check_echo(path: str, reply: bytes, msg: bytes) -> None:
    """A request only counts if it made the round trip intact (a compare costs microseconds, a request milliseconds)."""
    if reply != msg:
        raise RuntimeError(f"{path} echo of {len(msg)} bytes came back as {len(reply)} different bytes")


async def _measure(server: tuple, sizes: list[int], requests: int) -> list[dict]:
    from hivemind.p2p import P2P, PeerID

    peer_id, maddrs, server_daemon, server_pid = server
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs, nat_port_map=False)
    try:
        peer = PeerID.from_base58(peer_id)
        pids = {"client": os.getpid(), "client p2pd": p2p._child.pid, "server p2pd": server_daemon,
                "server": server_pid}
        rows = []
        for size in sizes:
            msg = os.urandom(size)

            async def stream_call() -> None:
                _, reader, writer = await p2p.call_binary_stream_handler(peer, "echo")
                writer.write(len(msg).to_bytes(4, "big") + msg)
                await writer.drain()
                reply = await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))
                writer.close()
                _check_echo("stream", reply, msg)

            async def unary_call() -> None:
                _check_echo("unary", await p2p._client.call_unary_handler(peer, "echo-unary", msg), msg)

            for rnd in range(2):
                for path, call in (("stream", stream_call), ("unary", unary_call)):
                    for _ in range(WARMUP):
                        await call()
                    before = {k: cpu_s(p) for k, p in pids.items()}
                    t0 = time.perf_counter()
                    for _ in range(requests):
                        await call()
                    wall = time.perf_counter() - t0
                    cpu = {k: (cpu_s(p) - before[k]) / requests * 1e3 for k, p in pids.items()}
                    rows.append({"size": size, "path": path, "round": rnd, "ms_per_request": wall / requests * 1e3,
                                 "cpu_ms_per_request": sum(cpu.values()), "cpu_ms_by_process": cpu})
        return rows
    finally:
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table (or JSON) and return {"requests", "rows"}."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="300,65536,262144", help="request (and reply) sizes in bytes")
    ap.add_argument("--requests", type=int, default=100, help="measured requests per size, path and round")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    info, done = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_server_main, args=(info, done), daemon=True)
    server.start()
    try:
        rows = asyncio.run(_measure(info.get(timeout=120), sizes, args.requests))
    finally:
        done.set()
        server.join(30)
        if server.is_alive():
            server.kill()
    result = {"requests": args.requests, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return result
    print("| size | path | round | ms per request | CPU ms per request (4 processes) |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']:,} | {r['path']} | {r['round']} | {r['ms_per_request']:.2f} | {r['cpu_ms_per_request']:.2f} |")
    return result


if __name__ == "__main__":
    main()
