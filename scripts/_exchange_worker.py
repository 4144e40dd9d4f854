"""The peer side of scripts/bench_exchange.py: one worker process per peer, holding its tensor and
its node, running the rounds (gloo all-reduce, a codec's exchange, the p2pd floor) the parent asks
for over a pipe, and reporting each round's start and end (absolute `time.perf_counter()`:
CLOCK_MONOTONIC on Linux, one clock for all processes of the machine), mean hash and error."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Any

from _procs import quiet_close, serve_commands

BARRIER_TIMEOUT_S = 900.0

# --- helpers (both sides) ----------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensor_sha256(t: Any) -> str:
    """sha256 of a tensor's bytes, bit for bit."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def rel_error(got: Any, true: Any) -> float:
    """||got - true|| / ||true||, in fp64."""
    import torch

    true64 = true.to(torch.float64)
    denom = float(true64.norm())
    return float((got.to(torch.float64) - true64).norm()) / denom if denom > 0 else float("nan")


# --- worker process ----------------------------------------------------------------------------
class _Worker:
    """One peer: its tensor, its node (per codec), and the commands the parent sends it."""

    def __init__(self, rank: int, n: int, conn: Any, barrier: Any, identity_path: str, params: int, seed: int,
                 max_shards: int, deadline_s: float, slack_s: float, verbose: bool = False) -> None:
        import torch
        from groundswell.peer.bench_codecs import pseudo_gradient

        self.rank, self.n, self.conn, self.barrier = rank, n, conn, barrier
        self.identity_path, self.params = identity_path, params
        self.max_shards, self.deadline_s, self.slack_s = max_shards, deadline_s, slack_s
        self.verbose = verbose
        self.x = pseudo_gradient(params, seed + rank)
        self.true_mean = None
        if rank == 0:  # the true fp32 mean of all inputs (fp64 sum), for rel_error; outside any timing
            total = torch.zeros(params, dtype=torch.float64)
            for r in range(n):
                total += (self.x if r == rank else pseudo_gradient(params, seed + r)).to(torch.float64)
            self.true_mean = total.div_(n).to(torch.float32)
            del total
        self.node = None
        self.gloo_up = False

    def wait(self) -> None:
        self.barrier.wait(BARRIER_TIMEOUT_S)

    # gloo -------------------------------------------------------------------------------------
    def gloo_init(self, port: int) -> dict:
        """Join the gloo group the parent times next to every method; it stays up until `close`."""
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                world_size=self.n, timeout=datetime.timedelta(seconds=300))
        self.gloo_up = True
        return {}

    def gloo(self, warmup: int, repeats: int) -> dict:
        import torch
        import torch.distributed as dist

        assert self.gloo_up, "gloo_init first"
        rounds = []
        inv = torch.tensor(1.0 / self.n, dtype=torch.float32)
        for i in range(warmup + repeats):
            buf = self.x.clone()
            self.wait()
            t0 = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            buf.mul_(inv)
            t3 = time.perf_counter()
            rounds.append({"warmup": i < warmup, "t0": t0, "t3": t3, "sha": tensor_sha256(buf),
                           "rel_error": rel_error(buf, self.true_mean) if self.rank == 0 else None})
            del buf
        self.wait()
        return {"rounds": rounds}

    # swarm ------------------------------------------------------------------------------------
    def start(self, codec_name: str, run_id: str, ids: list[str], initial_peers: list[str],
              replicas: int | None = None) -> dict:
        from groundswell.compression import make_codec, segment_bounds, segment_size
        from groundswell.peer.run_state import RunContext
        from groundswell.peer.swarm import NodeOptions, SwarmNode
        from groundswell.protocol.context import contribution_bound
        from groundswell.protocol.identity import Identity

        identity = Identity.load(self.identity_path)
        assert identity.peer_id == ids[self.rank]
        self.ids = list(ids)
        self.segment = segment_size(self.params, self.max_shards)
        numels = tuple(b - a for a, b in segment_bounds(self.params, self.segment))
        self.codec = make_codec(codec_name)
        ctx = RunContext(run_id=run_id, min_peers=self.n, deadline_s=self.deadline_s, slack_s=self.slack_s,
                         max_shards=self.max_shards, segment_numels=numels, codec=self.codec,
                         max_payload_bytes=contribution_bound(self.codec, numels), allowlist=None,
                         replicas=replicas)
        self.node = SwarmNode(identity, self.identity_path,
                              NodeOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers))
        self.node.start()
        child = getattr(getattr(self.node, "p2p", None), "_child", None)
        self.conn.send(("p2pd", child.pid if child is not None else None))  # so the parent can always end it
        self.node.attach(ctx)
        self.ctx = ctx
        self.identity, self.run_id = identity, run_id
        return {"maddrs": [m for m in self.node.maddrs if "/ip4/127.0.0.1/" in m], "segments": len(numels)}

    def sign_genesis(self) -> bytes:
        """Round 0's plan, naming every peer: signed once every peer's node is up, as a real run's
        commits come after its members' joins (a server seals nothing of a round opened before it)."""
        from groundswell.protocol.envelope import seal
        from groundswell.protocol.schema import Decision

        decision = Decision(round=-1, attempt=0, status="commit", contributors=[], trainers=list(self.ids),
                            servers=list(self.ids), leader=self.identity.peer_id, sources=[], num_shards=0,
                            time=time.time())
        return seal(self.identity, self.run_id, decision)

    def begin(self, genesis: bytes) -> None:
        """Take round 0's plan."""
        self.node.book.add(genesis)

    def rounds(self, warmup: int, repeats: int) -> dict:
        import torch
        from groundswell.compression import decode_segments, encode_segments

        node, codec = self.node, self.codec
        assert node is not None
        timeout = 2 * self.deadline_s + 6 * self.slack_s + 60
        out = []
        # SparseLoCo's round includes its error feedback, as the optimizer does it: the update is
        # folded into the buffer (decay 0.95) before the top-k, and what was sent is decoded and
        # taken out of it once the mean is in (optim/sparseloco.py).
        error = torch.zeros_like(self.x) if codec.name == "sparseloco" else None
        time.sleep(0.2)
        sent0, recv0 = node.transport.bytes_sent, node.transport.bytes_received
        for r in range(warmup + repeats):
            self.wait()
            t0 = time.perf_counter()
            if error is not None:
                error.mul_(0.95).add_(self.x)
            payloads = encode_segments(codec, self.x if error is None else error, self.segment)
            segments = [p.to_bytes() for p in payloads]
            t1 = time.perf_counter()
            outcome = node.call(node.client.run_attempt(r, None, segments, trains=True, serves=True), timeout)
            t2 = time.perf_counter()
            d = outcome.decision
            if d is None or d.status != "commit" or len(d.contributors) != self.n:
                raise RuntimeError(f"round {r}: no full commit on peer {self.rank}: "
                                   f"{'no decision' if d is None else (d.status, len(d.contributors))}")
            mean = node.call(node.client.fetch_aggregate(outcome.signed), timeout)
            if error is not None:
                error.sub_(decode_segments(codec, payloads, self.params, self.segment))
            t3 = time.perf_counter()
            del payloads
            self.wait()  # everyone holds the mean: the checks below must not slow a peer still fetching
            sha = tensor_sha256(mean)
            err = rel_error(mean, self.true_mean) if self.rank == 0 else None
            exact = self._is_reference_mean(d, segments, mean)
            del mean, segments
            self.wait()
            time.sleep(0.2)  # let the last replies' counters land
            sent, recv = node.transport.bytes_sent, node.transport.bytes_received
            # t0 and t3 are absolute (CLOCK_MONOTONIC, shared by the processes of this machine): the
            # parent takes a round from the first peer's start to the last peer's end
            out.append({"warmup": r < warmup, "t0": t0, "t3": t3, "encode_s": t1 - t0, "exchange_s": t2 - t1,
                        "fetch_decode_s": t3 - t2, "sent": sent - sent0, "received": recv - recv0, "sha": sha,
                        "rel_error": err, "exact": exact, "delivered": outcome.delivered})
            sent0, recv0 = sent, recv
        return {"rounds": out}

    def _is_reference_mean(self, decision: Any, segments: list[bytes], mean: Any) -> bool | None:
        """Is `mean` bit for bit the protocol's robust mean of what every peer sent? Answered on
        rank 0 (None elsewhere), which gathers every peer's segments over gloo and recomputes the
        mean shard by shard with the run's own aggregation (clipping included) and, where
        aggregators ship a mean rather than the contributions, its re-encoding. Every peer holding
        the same mean (`sha`) says nothing of whether that mean is right. Outside the timed round."""
        import torch
        import torch.distributed as dist
        from groundswell.compression import robust_mean
        from groundswell.protocol.context import validate_segments
        from groundswell.protocol.plan import shard_bounds
        from groundswell.protocol.shards import ships_contributions

        gathered: list[Any] | None = [None] * self.n if self.rank == 0 else None
        dist.gather_object(segments, gathered, dst=0)
        if gathered is None:
            return None
        sent = dict(zip(self.ids, gathered))
        parts = []
        for first, stop in shard_bounds(len(segments), decision.num_shards):
            rows = [validate_segments(self.ctx, first, sent[c][first:stop]) for c in decision.contributors]
            means = robust_mean(self.codec, rows, self.ctx.robust)
            if not ships_contributions(self.ctx):
                means = [self.codec.decode(self.codec.encode(m), device="cpu") for m in means]
            parts += [m.reshape(-1) for m in means]
        return bool(torch.equal(torch.cat(parts), mean.reshape(-1).cpu()))

    def floor(self, warmup: int, repeats: int) -> dict:
        """Rounds of bare fp32 bytes over the started node's p2pd streams (see `_p2p_floor`)."""
        from _p2p_floor import Floor

        node = self.node
        assert node is not None
        floor = Floor(node.p2p, self.rank, self.n, memoryview(self.x.numpy()).cast("B"))
        node.call(floor.serve(), 30)
        out = []
        for r in range(warmup + repeats):
            self.wait()  # also: every peer serves the floor before anyone sends
            t0 = time.perf_counter()
            node.call(floor.round(self.ids, r, 600), 660)
            t3 = time.perf_counter()
            # sha None: the floor moves bytes without computing a mean, so there is nothing to compare
            out.append({"warmup": r < warmup, "t0": t0, "t3": t3, "sha": None, "rel_error": None,
                        "payload_sent": floor.sent[r], "received": floor.received[r],
                        "expected": floor.expected_bytes()})
        self.wait()  # nobody leaves while a slower peer still sends to it
        return {"rounds": out}

    def close_node(self) -> dict:
        """End this method's node (the gloo group stays for the next method)."""
        if self.node is not None:
            node, self.node = self.node, None
            quiet_close(node, self.verbose)
        return {}

    def close(self) -> dict:
        """End everything: the node and the gloo group (`serve_commands` calls this on the way out)."""
        self.close_node()
        if self.gloo_up:
            import torch.distributed as dist

            self.gloo_up = False
            dist.destroy_process_group()
        return {}


def worker_main(rank: int, n: int, conn: Any, barrier: Any, identity_path: str, params: int, seed: int,
                 max_shards: int, deadline_s: float, slack_s: float, verbose: bool) -> None:
    import logging

    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"[peer {rank}] %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    serve_commands(lambda: _Worker(rank, n, conn, barrier, identity_path, params, seed, max_shards, deadline_s,
                                   slack_s, verbose),
                   conn, f"peer {rank}", on_error=barrier.abort)  # the others must not wait for a failed peer
