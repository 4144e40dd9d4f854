#!/usr/bin/env python3
"""netlab: a tiny NAT'ed "internet" built from Linux network namespaces, for testing peers.

Topology (every namespace has ``lo`` up; nothing in the root namespace is touched):

    gs-inet   bridge br0, 10.99.0.1/24 (the public internet core, no forwarding)
    gs-coord  10.99.0.10   public host         gs-pub  10.99.0.11   public host
    gs-pub2   10.99.0.12   public host         gs-pub3 10.99.0.13   public host
    gs-r1     WAN 10.99.0.21, LAN 192.168.1.1  -> gs-h1 192.168.1.2  (MASQUERADE, cone-like)
    gs-r2     WAN 10.99.0.22, LAN 192.168.2.1  -> gs-h2 192.168.2.2  (MASQUERADE, cone-like)
    gs-r3     WAN 10.99.0.23, LAN 192.168.3.1  -> gs-h3 192.168.3.2  (MASQUERADE --random-fully, symmetric)

Routers drop everything entering from the WAN unless it is ESTABLISHED,RELATED (FORWARD and INPUT).
Shaping applies to the access links (public host / router WAN <-> core): the node's egress gets
``netem delay+loss`` with a ``tbf`` child, the core's egress towards the node gets ``tbf``; so each
one-way trip crosses one delay (RTT ~= 2*delay_ms) and up- and download are both capped at rate_mbit.
Kernels without sch_netem (this one): each access link is cut in two inside gs-inet (``w-NODE`` and
``x-NODE``) and scripts/delayline.py, a userspace netem, carries frames across, delaying and
dropping those going from the node to the core; tbf caps the rate as before.

CLI:  netlab.py up [--rate-mbit R] [--delay-ms D] [--loss-pct P] [--link ROLE:KEY=V,...] [--no-shaping]
      | down | status
      | check | test [--json] | exec NAME -- CMD...   (NAME is a namespace such as gs-h1 or a role such as h1)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

CORE = "gs-inet"
HOSTS: dict[str, tuple[str, str]] = {
    "inet": (CORE, "10.99.0.1"),
    "coord": ("gs-coord", "10.99.0.10"), "pub": ("gs-pub", "10.99.0.11"),
    "pub2": ("gs-pub2", "10.99.0.12"), "pub3": ("gs-pub3", "10.99.0.13"),
    "r1": ("gs-r1", "10.99.0.21"), "r2": ("gs-r2", "10.99.0.22"), "r3": ("gs-r3", "10.99.0.23"),
    "h1": ("gs-h1", "192.168.1.2"), "h2": ("gs-h2", "192.168.2.2"), "h3": ("gs-h3", "192.168.3.2"),
}
PUBLIC = ("coord", "pub", "pub2", "pub3")
ROUTERS: dict[str, tuple[str, int, bool]] = {"r1": ("h1", 1, False), "r2": ("h2", 2, False),
                                             "r3": ("h3", 3, True)}  # router: (host, lan#, random-fully)
ROUTER_OF = {h: r for r, (h, _, _) in ROUTERS.items()}
NAMESPACES = [ns for ns, _ in HOSTS.values()]
UPLINK = {**{p: "eth0" for p in PUBLIC}, **{r: "wan0" for r in ROUTERS}}  # access-link device per role
TCP_TIMEOUT = 2.0
FIREWALL = """-P FORWARD DROP
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -i lan0 -o wan0 -j ACCEPT
-A INPUT -i wan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A INPUT -i wan0 -p icmp -j ACCEPT
-A INPUT -i wan0 -j DROP"""  # router rules besides the MASQUERADE one


class NetlabError(RuntimeError):
    """A command needed to build or inspect the lab failed."""


class NetlabUnavailable(NetlabError):
    """Network namespaces cannot be used here (not root, missing tools, ``ip netns add`` refused)."""


def ns_of(name: str) -> str:
    """Namespace for a role ('h1') or a namespace name ('gs-h1')."""
    if name in HOSTS or name in NAMESPACES:
        return HOSTS[name][0] if name in HOSTS else name
    raise NetlabError(f"unknown lab node {name!r}; known: {', '.join(HOSTS)}")


def netns_exec_argv(name: str, argv: list[str]) -> list[str]:
    """argv that runs ``argv`` inside the namespace of role/namespace ``name``."""
    return ["ip", "netns", "exec", ns_of(name), *argv]


def _run(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and p.returncode != 0:
        raise NetlabError(f"{' '.join(argv)} -> rc {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


def _nx(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", "netns", "exec", ns, *argv], check=check)


def _ip(ns: str, *args: str) -> None:
    _run(["ip", "-n", ns, *args])


def existing_namespaces() -> list[str]:
    """Lab namespaces that currently exist."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    present = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [ns for ns in NAMESPACES if ns in present]


def down(kill_procs: bool = True) -> list[str]:
    """Remove every lab namespace (tolerates a half-built lab); returns the names removed."""
    removed = []
    for ns in existing_namespaces():
        if kill_procs:  # processes left inside would otherwise keep the (now nameless) namespace alive
            for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), 9)
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    if left := existing_namespaces():
        raise NetlabError(f"could not remove namespaces: {left}")
    return removed


def _preflight(shaping: bool) -> None:
    if os.geteuid() != 0:
        raise NetlabUnavailable("netlab needs root (CAP_NET_ADMIN) to create network namespaces")
    for tool in ["ip", "iptables"] + (["tc"] if shaping else []):
        if shutil.which(tool) is None:
            raise NetlabUnavailable(f"required tool {tool!r} not found in PATH")


def _addr_up(ns: str, dev: str, cidr: str, gw: str | None = None) -> None:
    _ip(ns, "addr", "add", cidr, "dev", dev)
    _ip(ns, "link", "set", dev, "up")
    if gw:
        _ip(ns, "route", "add", "default", "via", gw, "dev", dev)


def _tbf(ns: str, dev: str, rate_mbit: float, parent: list[str]) -> None:
    burst = max(16000, int(rate_mbit * 1e6 / 8 / 100))  # >= 10 ms worth of bytes
    _nx(ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{rate_mbit:g}mbit",
        "burst", str(burst), "latency", "50ms")


def _netem_available() -> bool:
    """Whether this kernel has sch_netem (tried on the core namespace's loopback)."""
    ok = _nx(CORE, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False).returncode == 0
    if ok:
        _nx(CORE, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return ok


@dataclass(frozen=True)
class LinkShape:
    """One access link's figures: rates each way (0: no limit), delay and loss on the way out
    (node -> core) and, `rdelay_ms`/`rloss_pct`, on the way in. The lab's default link delays one
    way only, so a round trip between two shaped nodes crosses two delays."""

    up_mbit: float = 50.0
    down_mbit: float = 50.0
    delay_ms: float = 40.0
    loss_pct: float = 0.1
    rdelay_ms: float = 0.0
    rloss_pct: float = 0.0

    @property
    def impaired(self) -> bool:
        """Does the link delay or lose anything, either way?"""
        return max(self.delay_ms, self.loss_pct, self.rdelay_ms, self.rloss_pct) > 0

    def check(self, role: str) -> None:
        """Raise NetlabError on a figure no link can have."""
        if min(self.up_mbit, self.down_mbit, self.delay_ms, self.rdelay_ms) < 0 or not (
                0 <= self.loss_pct < 100 and 0 <= self.rloss_pct < 100):
            raise NetlabError(f"link {role}: rates and delays must be >= 0 and losses in [0, 100): {self}")


def parse_link_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``ROLE:key=value,...`` (keys: LinkShape's fields) -> (role, overrides); raises NetlabError."""
    role, _, body = spec.partition(":")
    if role not in UPLINK:
        raise NetlabError(f"--link {spec!r}: no access link {role!r}; known: {', '.join(UPLINK)}")
    fields = set(LinkShape.__dataclass_fields__)
    out: dict[str, float] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if key not in fields or not eq:
            raise NetlabError(f"--link {spec!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        try:
            out[key] = float(value)
        except ValueError:
            raise NetlabError(f"--link {spec!r}: {value!r} is not a number") from None
    return role, out


def link_shapes(rate_mbit: float, delay_ms: float, loss_pct: float,
                links: dict[str, dict[str, float]] | None) -> dict[str, LinkShape]:
    """Every access link's shape: the lab's defaults, then each role's overrides."""
    base = LinkShape(rate_mbit, rate_mbit, delay_ms, loss_pct)
    unknown = set(links or {}) - set(UPLINK)
    if unknown:
        raise NetlabError(f"no access link {', '.join(sorted(unknown))}; known: {', '.join(UPLINK)}")
    shapes = {role: replace(base, **(links or {}).get(role, {})) for role in UPLINK}
    for role, shape in shapes.items():
        shape.check(role)
    return shapes


def _start_delayline(shapes: dict[str, LinkShape]) -> None:
    """Run scripts/delayline.py in the core namespace over every cut access link; wait until ready.

    It belongs to the lab: ``down()`` kills every process in the lab's namespaces, this one too.
    """
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
    links = [f"w-{role}:x-{role}:{s.delay_ms:g}:{s.loss_pct:g}:{s.rdelay_ms:g}:{s.rloss_pct:g}"
             for role, s in shapes.items()]
    p = subprocess.Popen(["ip", "netns", "exec", CORE, sys.executable, script, "--delay-ms", "0", *links],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if p.stdout is None or p.stdout.readline().strip() != "ready":
        p.kill()
        raise NetlabError(f"delayline did not start: {p.communicate()[1].strip()}")
    p.stdout.close()  # it prints nothing more; errors go to its stderr pipe, which nobody needs


def _netem(ns: str, dev: str, delay_ms: float, loss_pct: float) -> None:
    _nx(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms",
        "loss", f"{loss_pct:g}%", "limit", "100000")


def _shape(shapes: dict[str, LinkShape], netem: bool, base: LinkShape) -> dict[str, Any]:
    """Shape every access link; returns what was actually applied."""
    for role, dev in UPLINK.items():
        ns, s = HOSTS[role][0], shapes[role]
        out_impaired, in_impaired = s.delay_ms > 0 or s.loss_pct > 0, s.rdelay_ms > 0 or s.rloss_pct > 0
        if netem and out_impaired:
            _netem(ns, dev, s.delay_ms, s.loss_pct)
        if netem and in_impaired:
            _netem(CORE, f"c-{role}", s.rdelay_ms, s.rloss_pct)
        if s.up_mbit > 0:
            _tbf(ns, dev, s.up_mbit, ["parent", "1:1", "handle", "10:"] if netem and out_impaired else ["root"])
        if s.down_mbit > 0:
            _tbf(CORE, f"c-{role}", s.down_mbit,
                 ["parent", "1:1", "handle", "10:"] if netem and in_impaired else ["root"])
    impaired = any(s.impaired for s in shapes.values())
    if impaired and not netem:
        _start_delayline(shapes)
    rated = any(s.up_mbit > 0 or s.down_mbit > 0 for s in shapes.values())
    mode = "+".join(["netem" if netem else "delayline"] * impaired + ["tbf"] * rated) or "off"
    out: dict[str, Any] = {"mode": mode, "rate_mbit": base.up_mbit, "delay_ms": base.delay_ms,
                           "loss_pct": base.loss_pct}
    if odd := {role: asdict(s) for role, s in shapes.items() if s != base}:
        out["links"] = odd
    return out


def up(rate_mbit: float = 50.0, delay_ms: float = 40.0, loss_pct: float = 0.1,
       shaping: bool = True, links: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """(Re)build the lab from scratch; raises NetlabUnavailable if namespaces cannot be made.
    `links` overrides single access links' figures: {"pub3": {"up_mbit": 1, "rdelay_ms": 100}}."""
    shapes = link_shapes(rate_mbit, delay_ms, loss_pct, links)
    _preflight(shaping)
    down()
    try:
        for ns in NAMESPACES:
            p = _run(["ip", "netns", "add", ns], check=False)
            if p.returncode != 0:
                raise NetlabUnavailable(f"ip netns add {ns} failed: {p.stderr.strip()}")
            _ip(ns, "link", "set", "lo", "up")
        _ip(CORE, "link", "add", "br0", "type", "bridge")
        _addr_up(CORE, "br0", "10.99.0.1/24")
        netem = shaping and _netem_available()
        cut = shaping and not netem and any(s.impaired for s in shapes.values())  # delayline splices each link
        for role, dev in UPLINK.items():
            ns, ip = HOSTS[role]
            near = f"w-{role}" if cut else f"c-{role}"
            _ip(CORE, "link", "add", near, "type", "veth", "peer", "name", dev, "netns", ns)
            if cut:
                _ip(CORE, "link", "add", f"x-{role}", "type", "veth", "peer", "name", f"c-{role}")
                for end in (near, f"x-{role}"):
                    _ip(CORE, "link", "set", end, "up")
            _ip(CORE, "link", "set", f"c-{role}", "master", "br0", "up")
            _addr_up(ns, dev, f"{ip}/24", "10.99.0.1")
        for router, (host, n, symmetric) in ROUTERS.items():
            rns, hns = HOSTS[router][0], HOSTS[host][0]
            _ip(rns, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", hns)
            _addr_up(rns, "lan0", f"192.168.{n}.1/24")
            _addr_up(hns, "eth0", f"{HOSTS[host][1]}/24", f"192.168.{n}.1")
            _nx(rns, sys.executable, "-c", "open('/proc/sys/net/ipv4/ip_forward', 'w').write('1')")
            masq = "-t nat -A POSTROUTING -o wan0 -j MASQUERADE" + (" --random-fully" if symmetric else "")
            for rule in [masq, *FIREWALL.splitlines()]:
                _nx(rns, "iptables", *rule.split())
        shaped = _shape(shapes, netem, LinkShape(rate_mbit, rate_mbit, delay_ms, loss_pct)) if shaping else {"mode": "off"}
    except BaseException:
        with contextlib.suppress(Exception):
            down()
        raise
    return {"namespaces": NAMESPACES, "hosts": HOSTS, "shaping": shaped}


@contextlib.contextmanager
def lab(**kwargs: Any) -> Iterator[dict[str, Any]]:
    """``with lab(rate_mbit=..., ...) as info:`` builds the lab and always tears it down."""
    try:
        yield up(**kwargs)
    finally:
        down()


def status() -> dict[str, Any]:
    """Existing lab namespaces with their IPv4 addresses and non-default qdiscs."""
    out: dict[str, Any] = {}
    for ns in existing_namespaces():
        links = json.loads(_run(["ip", "-j", "-n", ns, "addr", "show"]).stdout or "[]")
        qd = _nx(ns, "tc", "qdisc", "show", check=False).stdout.splitlines()
        out[ns] = {"addrs": [f"{l['ifname']} {a['local']}/{a['prefixlen']}" for l in links
                             for a in l.get("addr_info", []) if a.get("family") == "inet"],
                   "qdiscs": [q.strip() for q in qd if "noqueue" not in q]}
    return out


def ping(src: str, dst_ip: str, count: int = 3) -> tuple[bool, dict[str, float] | None]:
    """ping from lab node ``src``: (all answered, round-trip min/avg/max/mdev in ms or None)."""
    p = _run(netns_exec_argv(src, ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-W", "1", dst_ip]),
             check=False)
    m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", p.stdout)
    rtt = dict(zip(["min", "avg", "max", "mdev"], map(float, m.groups()))) if m else None
    return p.returncode == 0, rtt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pu = sub.add_parser("up", help="(re)build the lab")
    pu.add_argument("--rate-mbit", type=float, default=50.0)
    pu.add_argument("--delay-ms", type=float, default=40.0)
    pu.add_argument("--loss-pct", type=float, default=0.1)
    pu.add_argument("--no-shaping", action="store_true")
    pu.add_argument("--link", action="append", default=[], metavar="ROLE:KEY=VALUE,...",
                    help="one access link's own figures, e.g. pub3:up_mbit=1,delay_ms=130,rdelay_ms=110,rloss_pct=2 "
                         "(keys: up_mbit down_mbit delay_ms loss_pct rdelay_ms rloss_pct; a rate of 0: no limit); repeatable")
    for name, text in [("down", "remove every lab namespace"), ("status", "namespaces and addresses as JSON"),
                       ("check", "connectivity self-test, JSON"),
                       ("test", "a 5-round groundswell run across the NATs, JSON (see netlab_run.py)")]:
        sub.add_parser(name, help=text)
    pe = sub.add_parser("exec", help="run a command in a namespace: exec NAME -- CMD...")
    pe.add_argument("name")
    pe.add_argument("argv", nargs=argparse.REMAINDER)
    if argv[:1] == ["test"]:  # its own options (--rounds, --json, ...) belong to netlab_run
        import netlab_run

        return netlab_run.main(argv[1:])
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            links = dict(parse_link_spec(spec) for spec in a.link)
            info = up(a.rate_mbit, a.delay_ms, a.loss_pct, shaping=not a.no_shaping, links=links)
            print(json.dumps({"up": info["namespaces"], "shaping": info["shaping"]}, indent=1))
        elif a.cmd == "down":
            print(json.dumps({"removed": down()}))
        elif a.cmd == "status":
            print(json.dumps(status(), indent=1))
        elif a.cmd == "check":
            import netlab_check

            res = netlab_check.check()
            print(json.dumps(res, indent=1))
            return 0 if res["ok"] else 1
        elif a.cmd == "exec":
            cmd = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
            if not cmd:
                ap.error("exec needs a command after --")
            os.execvp("ip", netns_exec_argv(a.name, cmd))
    except NetlabError as e:
        print(f"netlab: {type(e).__name__}: {e}", file=sys.stderr)
        return 3 if isinstance(e, NetlabUnavailable) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
