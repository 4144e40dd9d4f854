"""A few real swarm nodes (each with its own p2pd) in one test process, for round-protocol tests."""

from __future__ import annotations

import concurrent.futures
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds
from groundswell.compression.segments import encode_segments
from groundswell.peer.run_state import RunContext
from groundswell.peer.swarm import NodeOptions, SwarmNode
from groundswell.protocol.context import contribution_bound
from groundswell.protocol.envelope import seal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision


@dataclass
class Cluster:
    """N attached nodes sharing a genesis decision where every node trains and serves."""

    n: int
    codec_name: str = "fp32"
    numel: int = 5 * 4096 + 123
    segment: int = 4096
    max_shards: int = 4
    min_peers: int = 2
    deadline_s: float = 9.0
    slack_s: float = 1.0
    robust: RobustOptions = field(default_factory=lambda: RobustOptions(clip=0.0))  # plain mean unless a test asks
    verify_aggregates: bool = False
    replicas: int | None = None
    servers: tuple[int, ...] | None = None  # the nodes round 0's membership names as servers (default: all)
    nodes: list[SwarmNode] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    _thaws: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.codec = make_codec(self.codec_name, **({"chunk": 4096, "k": 64} if self.codec_name == "sparseloco" else {}))
        numels = tuple(b - a for a, b in segment_bounds(self.numel, self.segment))
        self.ctx = RunContext("test-run", self.min_peers, self.deadline_s, self.slack_s, self.max_shards, numels,
                              self.codec, contribution_bound(self.codec, numels), robust=self.robust,
                              verify_aggregates=self.verify_aggregates, replicas=self.replicas)
        try:
            for i in range(self.n):
                ident = Identity.generate()
                path = Path(self._tmp.name) / f"id{i}.key"
                ident.save(path)
                boot = self.nodes[0].maddrs[:1] if self.nodes else []
                node = SwarmNode(ident, str(path), NodeOptions(initial_peers=boot))
                node.start()
                self.nodes.append(node)
                self.ids.append(ident.peer_id)
            for node in self.nodes:
                node.attach(self.ctx)
            genesis = seal(self.nodes[0].identity, self.ctx.run_id,
                           Decision(-1, 0, "commit", [], list(self.ids),
                                    list(self.ids) if self.servers is None else [self.ids[i] for i in self.servers],
                                    self.ids[0], [], 0, time.time()))
            for node in self.nodes:
                self.add_decision(node, genesis)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def add_decision(node: SwarmNode, signed: bytes) -> None:
        """Record a signed decision in a node's book, on its own loop."""
        async def add() -> None:
            node.book.add(signed)  # type: ignore[union-attr]

        node.call(add(), timeout_s=10)

    def segments(self, x: torch.Tensor) -> list[bytes]:
        """A vector's contribution bytes."""
        return [p.to_bytes() for p in encode_segments(self.codec, x, self.segment)]

    def sent(self, x: torch.Tensor) -> torch.Tensor:
        """What a contributor's segments of `x` decode to (the values an aggregate averages)."""
        from groundswell.compression import Payload

        return torch.cat([self.codec.decode(Payload.from_bytes(b)) for b in self.segments(x)])

    def attempt(self, round_id: int, inputs: dict[int, torch.Tensor | None], attempt: int = 0,
                wait_s: float = 120) -> dict[int, object]:
        """Run one attempt concurrently on the given nodes (None: join without contributing)."""
        futures = {
            i: self.nodes[i].submit(self.nodes[i].client.run_attempt(  # type: ignore[union-attr]
                round_id, attempt, self.segments(x) if x is not None else None, trains=True, serves=True))
            for i, x in inputs.items()
        }
        concurrent.futures.wait(list(futures.values()), timeout=wait_s)
        return {i: f.result(timeout=1) for i, f in futures.items()}

    def fetch(self, i: int, signed: bytes) -> torch.Tensor:
        """Node i's view of a committed round's mean."""
        node = self.nodes[i]
        return node.call(node.client.fetch_aggregate(signed), timeout_s=120)  # type: ignore[union-attr]

    def freeze(self, i: int, at_most_s: float) -> Callable[[], None]:
        """Block node i's event loop until the returned thaw is called or `at_most_s` has passed:
        its daemon keeps the sockets open and takes bytes, but nothing answers (a closed laptop lid)."""
        thawed = threading.Event()
        self._thaws.append(thawed.set)
        self.nodes[i]._loop.call_soon_threadsafe(thawed.wait, at_most_s)
        return thawed.set

    def close(self) -> None:
        """Close every node (and its p2pd), and remove the keys' folder; the first failure is raised
        once all that is done, so one node that fails to close leaks none of the others."""
        errors: list[Exception] = []
        for thaw in self._thaws:  # a frozen node would hold its close up for the rest of its freeze
            thaw()
        try:
            for node in self.nodes:
                try:
                    node.close()
                except Exception as exc:  # noqa: BLE001 - the other nodes must still be closed
                    errors.append(exc)
        finally:
            self._tmp.cleanup()
        if errors:
            raise errors[0]


@dataclass
class TwoLeaders:
    """Round 0 of a 4-node cluster with attempt 0 running: its first leader (`l0`, server `s0`)
    holds 3 contributions (one node only joins, so nobody closes early), and `l1` leads attempt 1."""

    plan0: Any
    plan1: Any
    l0: int
    l1: int
    s0: Any
    s1: Any
    runs: list


def attempt_0_with_two_leaders(c: Cluster, seed: int) -> TwoLeaders:
    """Start round 0's attempt 0 on every node of `c` (4 nodes) and wait until its leader holds 3
    contributions (see `TwoLeaders`)."""
    from groundswell.protocol.plan import make_plan

    plan0, plan1 = (make_plan(c.ctx.run_id, 0, a, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
                    for a in (0, 1))
    l0 = c.ids.index(plan0.leaders[0])
    l1 = next(c.ids.index(p) for p in plan1.leaders if c.ids.index(p) != l0)
    s0, s1 = c.nodes[l0].server, c.nodes[l1].server
    xs = inputs(4, c.numel, seed)
    idle = next(i for i in range(4) if i not in (l0, l1))
    runs = [c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == idle else c.segments(xs[i]),
                                                             trains=True, serves=True)) for i in range(4)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(s0._sources(plan0, s0.attempts[(0, 0)])[1]) < 3:
        time.sleep(0.1)
    return TwoLeaders(plan0, plan1, l0, l1, s0, s1, runs)


_SEP = r"\s,:;=\"'"  # what may stand around a path in a command line (`--out=P`, `a,P`)


def mentions(cmdline: list[str], out: Path) -> bool:
    """Does a command line name `out` or a path inside it (not a sibling such as `out`2, nor
    another folder whose path ends like it)?"""
    pattern = rf"(?<![^{_SEP}]){re.escape(str(out))}(?![^/{_SEP}])"
    return re.search(pattern, " ".join(cmdline)) is not None


def leftover_processes(out: Path) -> list:
    """Processes whose command line mentions `out`: what a simulation left running (should be none)."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if mentions(p.info["cmdline"] or [], out)]


def read_events(path: Path) -> list[dict]:
    """A peer's events.jsonl (none yet: empty)."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `pred` every 0.2 s; AssertionError naming `what` if it is not true within `timeout_s`."""
    limit = time.time() + timeout_s
    while not pred():
        if time.time() > limit:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


QUIET = ["--quiet", "--verbose", "--threads", "1"]  # a test's peers: protocol log in NAME.log, one thread


def launch_coordinator(sim: Any, out: Path, opts: Any) -> Path:
    """`groundswell launch` of `opts`' manifest as `sim`'s "coordinator"; its bootstrap.txt, once written."""
    from groundswell.peer.simulate import manifest_toml

    (out / "run.toml").write_text(manifest_toml(opts))
    sim.spawn("coordinator", ["launch", str(out / "run.toml"), "--state-dir", str(out / "coordinator"),
                              "--listen", "/ip4/127.0.0.1/tcp/0", *QUIET])
    boot = out / "coordinator" / "bootstrap.txt"
    wait_for(boot.exists, 120, "the coordinator")
    return boot


def simulate_and_reap(opts: Any, out: Path) -> dict:
    """`run_simulation` quietly; every process it left behind is killed, even when it raised,
    and then said (a simulation must leave none)."""
    from groundswell.peer.simulate import run_simulation

    try:
        return run_simulation(opts, out, progress=lambda m: None)
    finally:
        left = leftover_processes(out)
        for p in left:
            p.kill()
        assert not left, f"the simulation left processes behind: {left}"


def inputs(n: int, numel: int, seed: int) -> dict[int, torch.Tensor]:
    """n seeded random vectors of `numel` values, one per node."""
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(numel, generator=g) for i in range(n)}


def ended_together(report: dict, rounds: int) -> dict[str, str]:
    """The processes of a simulation that ended at the newest round two or more of them reached,
    name -> hash, after checking they hold one hash and that round is the run's last. (A lone
    process may be a round ahead, or one killed or lagging a round behind: the others stopped.)"""
    final = report["final_round_by_process"]
    reached: dict[int, int] = {}
    for r, _ in final.values():
        reached[r] = reached.get(r, 0) + 1
    top = max((r for r, n in reached.items() if n >= 2), default=None)
    assert top is not None and top >= rounds - 1, final
    at_top = {name: digest for name, (r, digest) in final.items() if r == top}
    assert len(set(at_top.values())) == 1, f"processes ended at round {top} with different parameters: {final}"
    return at_top
