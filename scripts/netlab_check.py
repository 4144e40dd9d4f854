#!/usr/bin/env python3
"""netlab's connectivity self-test (`netlab.py check`): pings, TCP and UDP probes between lab nodes
that show the NATs and firewalls behave as designed (cone vs symmetric mappings included).

    python scripts/netlab_check.py _probe MODE ARGS...   (the probe helpers check() runs in namespaces)
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from netlab import (
    HOSTS,
    NAMESPACES,
    PUBLIC,
    TCP_TIMEOUT,
    NetlabError,
    _ip,
    _run,
    existing_namespaces,
    netns_exec_argv,
    ping,
)


def _probe_main(mode: str, args: list[str]) -> int:
    """Tiny socket helpers that check() runs inside namespaces; servers print 'ready' first."""
    import socket
    udp = mode.startswith("udp")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    if mode in ("tcp-listen", "udp-echo"):  # PORT TIMEOUT: tell each client the address seen
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", int(args[0])))
        s.settimeout(float(args[1]))
        if not udp:
            s.listen(1)
        print("ready", flush=True)
        try:
            while True:
                if udp:
                    addr = s.recvfrom(64)[1]
                    s.sendto(f"{addr[0]}:{addr[1]}".encode(), addr)
                    continue
                c, addr = s.accept()
                c.recv(16)
                c.sendall(f"{addr[0]}:{addr[1]}".encode())
                print(f"accepted {addr[0]}:{addr[1]}", flush=True)
                return 0
        except OSError:
            print("no-connection", flush=True)
            return 1
    if mode == "tcp-connect":  # HOST PORT: print the address the server saw
        try:
            s.settimeout(TCP_TIMEOUT)
            s.connect((args[0], int(args[1])))
            s.sendall(b"hi")
            print(s.recv(64).decode(), flush=True)
            return 0
        except OSError as e:
            print(f"error {type(e).__name__}", flush=True)
            return 1
    # udp-probe HOST:PORT...: from one local port, ask each echo server what it sees
    s.bind(("0.0.0.0", random.randint(20000, 60000)))
    s.settimeout(0.5)
    seen: list[str | None] = []
    for host, port in (t.split(":") for t in args):
        seen.append(None)
        for _ in range(4):  # tolerate emulated loss
            s.sendto(b"?", (host, int(port)))
            with contextlib.suppress(OSError):
                seen[-1] = s.recvfrom(64)[0].decode()
                break
    print(json.dumps(seen), flush=True)
    return 0


def _helper(name: str, mode: str, *args: str) -> list[str]:
    return netns_exec_argv(name, [sys.executable, os.path.abspath(__file__), "_probe", mode, *args])


def _with_servers(servers: list[list[str]], client: list[str]) -> tuple[list[str], str]:
    """Start probe servers, wait until they listen, run the client; return all their outputs."""
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for a in servers]
    try:
        if any(p.stdout is None or p.stdout.readline().strip() != "ready" for p in procs):
            raise NetlabError("probe server failed to start")
        cli = _run(client, check=False).stdout.strip()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        return [p.stdout.read().strip() if p.poll() is not None and p.stdout else "" for p in procs], cli
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def check() -> dict[str, Any]:
    """Connectivity self-test of a running lab; ``result['ok']`` is True when all expectations hold."""
    if existing_namespaces() != NAMESPACES:
        raise NetlabError("lab is not (fully) up; run `netlab.py up` first")
    if shutil.which("ping") is None:
        raise NetlabError("ping not found (apt-get install iputils-ping)")
    ip = {r: a for r, (_, a) in HOSTS.items()}
    r: dict[str, Any] = {}
    for host, dst in [("h1", "coord"), ("h2", "pub"), ("h3", "coord")]:
        r[f"{host}_ping_{dst}"] = ping(host, ip[dst], 2)[0]
    r["coord_ping_h1_lan_blocked"] = not ping("coord", ip["h1"], 2)[0]
    port = str(random.randint(20000, 60000))
    listen_h1 = _helper("h1", "tcp-listen", port, str(TCP_TIMEOUT + 1))

    def blocked(res: tuple[list[str], str]) -> bool:
        return res[1].startswith("error") and not res[0][0].startswith("accepted")
    # unsolicited TCP to r1's WAN address, on the port h1 listens on: must time out
    res = _with_servers([listen_h1], _helper("coord", "tcp-connect", ip["r1"], port))
    r["coord_tcp_to_r1_wan_blocked"], r["coord_tcp_to_r1_wan_result"] = blocked(res), res[1]
    # even with a route through r1, the stateful firewall keeps the LAN closed
    _ip("gs-coord", "route", "add", "192.168.1.0/24", "via", ip["r1"])
    try:
        res = _with_servers([listen_h1], _helper("coord", "tcp-connect", ip["h1"], port))
    finally:
        _ip("gs-coord", "route", "del", "192.168.1.0/24", "via", ip["r1"])
    r["coord_tcp_to_h1_lan_via_r1_blocked"] = blocked(res)
    # connection initiated from inside: return traffic flows, coord sees r1's WAN address
    res = _with_servers([_helper("coord", "tcp-listen", port, "5")],
                        _helper("h1", "tcp-connect", ip["coord"], port))
    r["h1_tcp_to_coord_established"] = res[0][0].startswith("accepted") and not res[1].startswith("error")
    r["h1_seen_by_coord_as"] = res[1]
    # UDP mapping behaviour: one local port towards two servers (cone: same public port; r3: not)
    for host in ("h1", "h3"):
        res = _with_servers([_helper(s, "udp-echo", port, "2") for s in PUBLIC],
                            _helper(host, "udp-probe", *(f"{ip[s]}:{port}" for s in PUBLIC)))
        seen = json.loads(res[1] or "[null, null]")
        ports = {m.split(":")[1] for m in seen if m}
        r[f"{host}_udp_mapping"] = {"coord": seen[0], "pub": seen[1],
                                    "endpoint_independent": len(ports) == 1 if all(seen) else None}
    ok, r["rtt_h1_coord_ms"] = ping("h1", ip["coord"], 5)
    flags = [v for k, v in r.items() if k.endswith(("_coord", "_pub", "_blocked", "_established"))]
    r["ok"] = ok and all(flags) and r["h1_seen_by_coord_as"].startswith(ip["r1"] + ":") \
        and r["h1_udp_mapping"]["endpoint_independent"] is True \
        and r["h3_udp_mapping"]["endpoint_independent"] is False
    return r


if __name__ == "__main__":
    if sys.argv[1:2] != ["_probe"] or len(sys.argv) < 3:
        sys.exit("usage: netlab_check.py _probe MODE ARGS...   (for a lab self-test: netlab.py check)")
    sys.exit(_probe_main(sys.argv[2], sys.argv[3:]))
