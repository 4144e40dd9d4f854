#!/usr/bin/env python3
"""bench_wan: compute utilization and held-out loss at equal wall time, over netlab's shaped links.

    sudo OMP_WAIT_POLICY=PASSIVE python scripts/bench_wan.py [--wall 90] [--preset small] [--json]

Three runs of 4 training peers each, one after the other, in the same lab (scripts/netlab.py;
every access link 50 Mbit/s, 0.1% loss; 40 ms delay where the kernel has sch_netem):
  sparseloco-overlap  groundswell, SparseLoCo, outer.overlap = 1 (a public volunteer + 3 behind NATs)
  diloco-int8         groundswell, DiLoCo with the int8 codec, no overlap (same hosts)
  ddp-gloo            plain data parallel: fp32 gradients all-reduced every step with
                      torch.distributed gloo (4 public hosts: gloo needs inbound connections)
With --cpu-per-peer C, every training process (with its p2pd daemon) runs in its own cgroup capped
at C CPUs (cgroup v1 cpu controller), so that each behaves as a volunteer's own machine: without
it, the 4 peers share this machine's cores, and whatever CPU a peer leaves idle while it waits for
the network speeds up the others. The coordinator is not capped.
Each run gets --wall seconds from its first step: a swarm run from the moment the first
volunteer starts its first block of inner steps (a volunteer that syncs later loses that time, as
it would in a real run; all work before the end counts), ddp from the barrier all ranks pass
before their first step. Utilization is time in forward, backward and the inner optimizer inside
that window (mean over peers); the loss is the held-out loss of the parameters the run agreed on
when the window closed, evaluated after the run (groundswell: the coordinator's checkpoint of
the last round completed in time, checked against that round's parameter hash; ddp: rank 0's
model after the last step every rank finished in time, a step that ends later being dropped).
ddp's bytes are computed (steps x the ring all-reduce's 2(N-1)/N x 4P bytes), not measured:
`bytes_per_peer_computed` says so. Before 2026-12-02 the coordinator evaluated every round
during the run, on the CPU the volunteers train on. One torch thread per process. Every
run warms its inner lr up over the same --warmup steps (50): before 2026-12-02 the swarm runs
took simulate's min(50, 2 H), 20 steps for SparseLoCo at H = 10 against DiLoCo's 50 at H = 30,
which alone moved the in-process comparison by more than the gap it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import netlab
from groundswell.peer.sim_report import read_events

SWARM_HOSTS = ("pub", "h1", "h2", "h3")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
DDP_HOSTS = ("coord", "pub", "pub2", "pub3")
PORT = 29500


@contextlib.contextmanager
def cpu_slices(names: tuple[str, ...], cpus: float):
    """One cgroup per name, capped at `cpus` CPUs; yields {name: argv prefix that runs a command
    inside it} ({} when `cpus` is 0). The groups are removed afterwards (once their processes
    are gone)."""
    if cpus <= 0:
        yield {}
        return
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        raise netlab.NetlabUnavailable(f"--cpu-per-peer needs the cgroup v1 cpu controller at {CGROUP_CPU}")
    root = CGROUP_CPU / f"groundswell-bench-{os.getpid()}"
    root.mkdir()
    made = []
    try:
        for name in names:
            d = root / name
            d.mkdir()
            made.append(d)
            period = int((d / "cpu.cfs_period_us").read_text())
            (d / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        # the shell moves itself into the group and execs the command: it and its children stay there
        yield {d.name: ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh"] for d in made}
    finally:
        for d in [*made, root]:
            for _ in range(50):  # processes leave a group a moment after they exit
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.2)


def swarm_run(name: str, out: Path, wall: float, preset: str, algorithm: str, codec: str, overlap: int,
              inner_steps: int, outer_lr: float | None = None, topk: int = 0, cpus: float = 0.0,
              error_decay: float = -1.0, warmup: int = -1, curve_points: int = 0) -> dict:
    """A coordinator and 4 volunteers for `wall` seconds of training; the figures from their logs."""
    from groundswell.peer.simulate import SimulateOptions, Simulation, manifest_toml

    opts = SimulateOptions(peers=4, rounds=10**6, preset=preset, algorithm=algorithm, codec=codec, overlap=overlap,
                           inner_steps=inner_steps, outer_lr=outer_lr, topk=topk or None,  # 0: the run's default
                           error_decay=None if error_decay < 0 else error_decay,  # < 0: the run's default
                           warmup_steps=None if warmup < 0 else warmup, batch_size=8, deadline_s=60, slack_s=5, min_peers=2,
                           # Nobody evaluates or checkpoints on the clock but the coordinator, which keeps
                           # every round's state for the evaluation after the run (below).
                           checkpoint_every=10**6, checkpoint_keep=10**6, eval_every=10**6)
    out.mkdir(parents=True)
    with cpu_slices(SWARM_HOSTS, cpus) as slices, Simulation(out, opts) as sim:
        (out / "run.toml").write_text(manifest_toml(opts))
        common = ["--quiet", "--verbose", "--threads", "1"]
        coord_ip = netlab.HOSTS["coord"][1]
        sim.spawn("coordinator", ["launch", str(out / "run.toml"), "--state-dir", str(out / "coordinator"),
                                  "--listen", "/ip4/0.0.0.0/tcp/40000", "--announce",
                                  f"/ip4/{coord_ip}/tcp/40000", "--checkpoint-every", "1", *common],
                  prefix=tuple(netlab.netns_exec_argv("coord", [])))
        boot = out / "coordinator" / "bootstrap.txt"
        limit = time.time() + 120
        while not boot.exists():
            if time.time() > limit:
                raise RuntimeError(f"{name}: the coordinator did not start")
            time.sleep(0.2)
        for host in SWARM_HOSTS:
            sim.spawn(host, ["join", boot.read_text().strip(), "--state-dir", str(out / host), "--listen",
                             "/ip4/0.0.0.0/tcp/0", *common],
                      prefix=(*slices.get(host, []), *netlab.netns_exec_argv(host, [])))
        start = None
        limit = time.time() + 300
        while start is None or time.time() < start + wall:
            # (a block in progress is not logged yet: start can only move earlier, never past the window)
            start = _first_block_start(out) or start
            if time.time() > limit and start is None:
                raise RuntimeError(f"{name}: the volunteers did not start")
            time.sleep(0.5)
        for host in SWARM_HOSTS:  # leave as a person would: the block in progress ends and is logged
            sim.signal(host, signal.SIGINT)
        limit = time.time() + 120
        while time.time() < limit and any(sim.alive(h) for h in SWARM_HOSTS):
            time.sleep(0.5)
    # the earliest block, now that every block in progress when we stopped is logged too
    start = _first_block_start(out) or start
    stop = start + wall
    utilization, sent = [], []
    for host in SWARM_HOSTS:
        events = read_events(out / host / "events.jsonl")
        # training time inside [start, stop]: each block ran over [t - compute_s, t]
        busy = sum(max(0.0, min(e["t"], stop) - max(e["t"] - e["compute_s"], start))
                   for e in events if e["kind"] == "train")
        utilization.append(busy / wall)
        sent.append(sum(e["bytes_sent"] for e in events if e["kind"] == "round" and e["t"] <= stop))
    followed = [e for e in read_events(out / "coordinator" / "events.jsonl") if e["kind"] == "round" and e["t"] <= stop]
    res = {"name": name, "compute_utilization": round(sum(utilization) / len(utilization), 4),
           "eval_loss": _eval_checkpoint(out / "coordinator", followed[-1], preset) if followed else None,
           "wall_s": wall,
           "rounds": len(followed), "bytes_per_peer": int(sum(sent) / len(sent)), "out": str(out)}
    if curve_points and followed:  # [seconds since training started, round, held-out loss], after the run
        step = max(1, -(-len(followed) // curve_points))
        picked = followed[::-1][::step][::-1]  # always includes the last round
        res["loss_curve"] = [[round(e["t"] - start, 1), e["round"], _eval_checkpoint(out / "coordinator", e, preset)]
                             for e in picked]
    return res


def _first_block_start(out: Path) -> float | None:
    """When the first volunteer started training: the earliest start of any logged block of inner
    steps (a "train" event is written at the block's end, t, and its compute_s is the block's
    wall time, so the block ran over [t - compute_s, t]). Timing the swarm from the last peer's
    sync instead would hand it the work its early peers did before that, which ddp's ranks, all
    starting after a barrier, do not get."""
    starts = [e["t"] - e["compute_s"] for h in SWARM_HOSTS for e in read_events(out / h / "events.jsonl")
              if e["kind"] == "train"]
    return min(starts, default=None)


def time_to_loss(curve: list[list[float]], target: float) -> float | None:
    """Seconds into the run at which a loss curve first reached `target` (None if it never did)."""
    return next((t for t, _, loss in curve if loss <= target), None)


def _eval_checkpoint(state_dir: Path, last_round: dict, preset: str) -> float:
    """Held-out loss of the global parameters after `last_round` (the coordinator's "round" event),
    from the checkpoint the coordinator wrote then; evaluated after the run, on the same held-out
    batches as the ddp run, so that no evaluation takes CPU from the volunteers while they train
    (the coordinator would otherwise evaluate every round: 1.5 s of CPU each on the small preset,
    a share that grows with the number of rounds)."""
    import torch
    from groundswell.optim import copy_into_parameters
    from groundswell.peer.batches import evaluate, heldout_batches
    from groundswell.peer.data import load_corpus
    from groundswell.peer.run_state import state_hash
    from groundswell.peer.workload import build_workload

    torch.set_num_threads(1)
    path = state_dir / f"checkpoint-{last_round['round'] + 1:08d}.pt"
    saved = torch.load(path, weights_only=True, map_location="cpu")
    tensors = saved["tensors"]
    params = tensors["global_params"]
    if state_hash(saved["decision"], params, tensors.get("momentum_buffer")) != last_round["hash"]:  # what the round event names
        raise RuntimeError(f"{path} does not hold the parameters of round {last_round['round']}")
    corpus = load_corpus("stdlib")
    wl = build_workload(preset, corpus.vocab_size, 0)
    copy_into_parameters(params, list(wl.model.parameters()))
    return evaluate(wl.model, wl.loss_fn, heldout_batches(corpus, wl.block_size, 16, 4))


def ddp_worker(rank: int, world: int, master: str, wall: float, preset: str, out: Path,
               warmup: int = -1) -> None:
    """One rank of plain data-parallel training (run inside a namespace by `ddp_run`)."""
    import torch
    import torch.distributed as dist
    from groundswell.optim.schedule import warmup_cosine_scheduler
    from groundswell.peer.batches import ShardSampler, evaluate, heldout_batches
    from groundswell.peer.config import InnerSection
    from groundswell.peer.data import load_corpus
    from groundswell.peer.workload import build_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    corpus = load_corpus("stdlib")
    wl = build_workload(preset, corpus.vocab_size, 0)
    inner = InnerSection() if warmup < 0 else InnerSection(warmup_steps=warmup)  # < 0: the default, 50
    params = list(wl.model.parameters())
    opt = torch.optim.AdamW(params, lr=inner.lr, betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay)
    sched = warmup_cosine_scheduler(opt, 10**7, inner.warmup_steps, inner.min_lr_ratio)
    sampler = ShardSampler(corpus, wl.block_size, 8, 0, rank, world)
    # The model after the last step every rank finished inside the window: what rank 0 evaluates,
    # as the swarm runs are scored on the last round completed in time. (A step is seconds over
    # the shaped links: stopping after the step that crosses the window would give ddp that much more.)
    kept = [p.detach().clone() for p in params] if rank == 0 else []
    dist.barrier()
    start, compute, steps = time.perf_counter(), 0.0, 0
    end = start + wall

    def in_window(t0: float, t1: float) -> float:
        return max(0.0, min(t1, end) - max(t0, start))

    while True:
        t = time.perf_counter()
        x, y = sampler.next_batch()
        loss = wl.loss_fn(wl.model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        compute += in_window(t, time.perf_counter())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        t = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        opt.step()
        sched.step()
        compute += in_window(t, time.perf_counter())
        late = torch.tensor([1.0 if time.perf_counter() > end else 0.0])
        dist.all_reduce(late, op=dist.ReduceOp.MAX)  # every rank decides the same about this step
        if late.item():
            break  # this step ended after the window on some rank: it does not count
        steps += 1
        with torch.no_grad():
            for k, p in zip(kept, params):
                k.copy_(p)
    elapsed = time.perf_counter() - start
    numel = flat.numel()
    result = {"rank": rank, "compute_s": compute, "wall_s": wall, "ran_s": elapsed, "steps": steps,
              "bytes": int(steps * 2 * (world - 1) / world * 4 * numel)}
    if rank == 0:
        with torch.no_grad():
            for k, p in zip(kept, params):
                p.copy_(k)
        result["eval_loss"] = evaluate(wl.model, wl.loss_fn, heldout_batches(corpus, wl.block_size, 16, 4))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def ddp_run(out: Path, wall: float, preset: str, cpus: float = 0.0, warmup: int = -1) -> dict:
    """4 gloo ranks on the 4 public hosts for `wall` seconds."""
    out.mkdir(parents=True)
    with cpu_slices(DDP_HOSTS, cpus) as slices:
        return _ddp_ranks(out, wall, preset, slices, warmup)


def _ddp_ranks(out: Path, wall: float, preset: str, slices: dict[str, list[str]], warmup: int) -> dict:
    from groundswell.peer.config import InnerSection

    master = netlab.HOSTS[DDP_HOSTS[0]][1]
    # gloo would otherwise advertise the address the host name resolves to, outside the namespace.
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
    procs = []
    try:
        for rank, host in enumerate(DDP_HOSTS):
            argv = [sys.executable, __file__, "--ddp-worker", str(rank), "--master", master, "--wall", str(wall),
                    "--preset", preset, "--out", str(out), "--warmup", str(warmup)]
            procs.append(subprocess.Popen([*slices.get(host, []), *netlab.netns_exec_argv(host, argv)], env=env,
                                          stdout=open(out / f"rank{rank}.log", "wb"), stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=wall + 180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(DDP_HOSTS))]
    return {"name": "ddp-gloo", "compute_utilization": round(sum(r["compute_s"] / r["wall_s"] for r in ranks) / 4, 4),
            "eval_loss": ranks[0]["eval_loss"], "wall_s": round(ranks[0]["wall_s"], 1),
            "ran_s": round(max(r["ran_s"] for r in ranks), 1),  # until the dropped step that crossed the window ended
            "steps": ranks[0]["steps"], "bytes_per_peer": ranks[0]["bytes"],
            "bytes_per_peer_computed": True,  # steps x 2(N-1)/N x 4P, not counted on the wire
            "out": str(out),
            "warmup_steps": InnerSection().warmup_steps if warmup < 0 else warmup}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wall", type=float, default=90.0, help="training seconds per run")
    ap.add_argument("--preset", default="small")
    ap.add_argument("-H", "--inner-steps", type=int, default=30)
    ap.add_argument("--sparse-inner-steps", type=int, default=None,
                    help="H of the sparseloco run (default: -H); top-k sends a small part of each update, so "
                         "it wants more, shorter rounds than DiLoCo")
    ap.add_argument("--sparse-outer-lr", type=float, default=None,
                    help="outer lr of the sparseloco run (default: the manifest's, 1.0)")
    ap.add_argument("--sparse-topk", type=int, default=0,
                    help="values kept per 4096-chunk in the sparseloco run (default: the manifest's, 64)")
    ap.add_argument("--sparse-error-decay", type=float, default=-1.0,
                    help="error-feedback decay of run (a) [default: the manifest's, 0.95]")
    ap.add_argument("--warmup", type=int, default=50,
                    help="inner lr warmup steps, the same for every run; -1: each swarm run takes simulate's "
                         "min(50, 2 H) and ddp 50, as in the runs before 2026-12-02")
    ap.add_argument("--cpu-per-peer", type=float, default=0.0,
                    help="cap each training process (and its p2pd) at this many CPUs, as if on its own machine "
                         "(0: they share the machine's cores)")
    ap.add_argument("--curve", type=int, default=0,
                    help="also evaluate up to this many of each swarm run's round checkpoints after the run "
                         "(loss_curve), and report when each swarm run reached ddp's final loss")
    ap.add_argument("--runs", default="sparseloco-overlap,diloco-int8,ddp-gloo", help="which runs, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--rate-mbit", type=float, default=50.0)
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--loss-pct", type=float, default=0.1)
    ap.add_argument("--ddp-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ddp_worker is not None:
        ddp_worker(a.ddp_worker, len(DDP_HOSTS), a.master, a.wall, a.preset, a.out, a.warmup)
        return 0
    out = a.out or Path(tempfile.mkdtemp(prefix="bench-wan-"))
    runs = []
    try:
        with netlab.lab(rate_mbit=a.rate_mbit, delay_ms=a.delay_ms, loss_pct=a.loss_pct) as info:
            chosen = set(a.runs.split(","))
            sparse_h = a.sparse_inner_steps or a.inner_steps
            for name, algorithm, codec, overlap, h, lr, k in (
                    ("sparseloco-overlap", "sparseloco", "", 1, sparse_h, a.sparse_outer_lr, a.sparse_topk),
                    ("diloco-int8", "diloco", "int8", 0, a.inner_steps, None, 0)):
                if name in chosen:
                    decay = a.sparse_error_decay if algorithm == "sparseloco" else -1.0
                    runs.append(swarm_run(name, out / name, a.wall, a.preset, algorithm, codec, overlap, h, lr, k,
                                          a.cpu_per_peer, decay, a.warmup, a.curve))
                    runs[-1].update(inner_steps=h, outer_lr=lr, **({"topk": k} if k else {}),
                                    warmup_steps=a.warmup if a.warmup >= 0 else min(50, 2 * h),
                                    **({"error_decay": decay} if decay >= 0 else {}))
                    if not a.json:
                        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            if "ddp-gloo" in chosen:
                runs.append(ddp_run(out / "ddp-gloo", a.wall, a.preset, a.cpu_per_peer, max(-1, a.warmup)))
                for r in runs[:-1]:  # how much sooner each swarm run got where ddp ended
                    if "loss_curve" in r:
                        r["time_to_ddp_loss_s"] = time_to_loss(r["loss_curve"], runs[-1]["eval_loss"])
    except netlab.NetlabUnavailable as exc:
        print(f"netlab unavailable: {exc}", file=sys.stderr)
        return 3
    print(json.dumps({"link": info["shaping"], "preset": a.preset, "inner_steps": a.inner_steps,
                      "cpu_per_peer": a.cpu_per_peer or None, "runs": runs},
                     indent=None if a.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
