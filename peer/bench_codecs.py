"""Codec benchmark: bytes, compression ratio, throughput and error of every codec on one tensor.

Throughput is end to end: encode = tensor -> wire bytes, decode = untrusted wire bytes ->
validated fp32 tensor (`Payload.from_bytes` + `decode`). A plain reference SparseLoCo (torch.topk
per chunk, one byte per 2-bit code, int16 indices) runs in the same process on the same input, so
the reported speedups do not depend on the machine: each is the median ratio over back-to-back
pairs of the two (at least 5). Timings are medians of `repeats` runs after one warm-up run. On CPU, run with OMP_WAIT_POLICY=PASSIVE for numbers that match deployment.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import msgpack
import torch
from groundswell.compression import CODEC_NAMES, Payload, make_codec

from .config import ConfigError

_FIELDS = ("bytes", "ratio_vs_fp32", "encode_params_per_s", "decode_params_per_s", "rel_error")


def pseudo_gradient(params: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """A seeded pseudo-gradient-like vector: Gaussian scale mixture (heavier tails than randn), ~1e-3."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(params, generator=gen)
    x.mul_(torch.randn(params, generator=gen).mul_(0.5).exp_()).mul_(1e-3)
    return x.to(device)


def run_codec_bench(params: int, device: str = "cpu", repeats: int = 3, seed: int = 0) -> dict:
    """Benchmark every codec plus the reference SparseLoCo on `params` elements; JSON-ready dict."""
    if params <= 0 or repeats <= 0:
        raise ConfigError(f"--params and --repeats must be positive, got {params} and {repeats}")
    x = pseudo_gradient(params, seed, device)
    dev = torch.device(device)
    codecs: dict[str, dict] = {}
    seconds: dict[str, dict[str, float]] = {}
    for name in CODEC_NAMES:
        codec = make_codec(name)
        codecs[name], seconds[name] = _measure(
            x,
            repeats,
            dev,
            lambda t, c=codec: c.encode(t).to_bytes(),
            lambda b, c=codec: c.decode(Payload.from_bytes(b, expect=c), device=dev),
        )
    sl = make_codec("sparseloco")
    ref_encode, ref_decode = (lambda t: reference_encode(t, sl.chunk, sl.k)), (lambda b: reference_decode(b, device=dev))
    ref, ref_s = _measure(x, repeats, dev, ref_encode, ref_decode)
    ours = (lambda t: sl.encode(t).to_bytes()), (lambda b: sl.decode(Payload.from_bytes(b, expect=sl), device=dev))
    speedups = _paired_speedups(x, max(repeats, 5), dev, ours, (ref_encode, ref_decode))
    return {
        "params": params,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
        "repeats": repeats,
        "seed": seed,
        "codecs": codecs,
        "baseline": {
            "sparseloco_reference": ref,
            # medians of the reference's time over ours in back-to-back pairs (the blocks above are
            # timed minutes apart on a shared machine: their ratio moved 1.1x-1.6x run to run)
            "encode_speedup": speedups["encode"],
            "decode_speedup": speedups["decode"],
            "speedup_pairs": max(repeats, 5),
        },
        "seconds": {**seconds, "sparseloco_reference": ref_s},
    }


def format_codec_table(result: dict) -> str:
    """Markdown table of a `run_codec_bench` result."""
    n = result["params"]
    rows = list(result["codecs"].items())
    base = result.get("baseline")
    if base:
        rows.append(("sparseloco (reference)", base["sparseloco_reference"]))
    lines = [
        f"Codecs on {n:,} params ({result.get('device', '?')}, {result.get('threads', '?')} threads)",
        "",
        "| codec | bytes | ratio vs fp32 | bits/param | encode Mparam/s | decode Mparam/s | rel. error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        enc, dec = r["encode_params_per_s"] / 1e6, r["decode_params_per_s"] / 1e6
        lines.append(
            f"| {name} | {r['bytes']:,} | {r['ratio_vs_fp32']:.1f} | {8 * r['bytes'] / n:.3f} | "
            f"{enc:,.0f} | {dec:,.0f} | {r['rel_error']:.4f} |"
        )
    if base:
        speed = f"encode {_times(base['encode_speedup'])}, decode {_times(base['decode_speedup'])}"
        lines += ["", f"sparseloco vs reference: {speed}"]
    return "\n".join(lines)


def _measure(
    x: torch.Tensor,
    repeats: int,
    dev: torch.device,
    encode: Callable[[torch.Tensor], bytes],
    decode: Callable[[bytes], torch.Tensor],
) -> tuple[dict, dict[str, float]]:
    data = encode(x)  # warm-up run, also the one whose size and error are reported
    y = decode(data)
    err = float(
        torch.linalg.vector_norm((y.reshape(-1) - x.reshape(-1)).double())
        / torch.linalg.vector_norm(x.double())
    )
    del y
    enc_t, dec_t = [], []
    for _ in range(repeats):
        enc_t.append(_timed(lambda: encode(x), dev))
        dec_t.append(_timed(lambda: decode(data), dev))
    n = x.numel()
    enc, dec = statistics.median(enc_t), statistics.median(dec_t)
    stats = {
        "bytes": len(data),
        "ratio_vs_fp32": 4 * n / len(data),
        "encode_params_per_s": n / enc,
        "decode_params_per_s": n / dec,
        "rel_error": err,
    }
    assert tuple(stats) == _FIELDS
    return stats, {"encode": enc, "decode": dec}


def _paired_speedups(x: torch.Tensor, pairs: int, dev: torch.device,
                     ours: tuple[Callable[[torch.Tensor], bytes], Callable[[bytes], torch.Tensor]],
                     ref: tuple[Callable[[torch.Tensor], bytes], Callable[[bytes], torch.Tensor]]) -> dict[str, float]:
    """The reference's time over ours, encode and decode, as the median over `pairs` back-to-back
    pairs (which of the two goes first alternates): what slows the machine for a while slows both."""
    data_ours, data_ref = ours[0](x), ref[0](x)
    ratios: dict[str, list[float]] = {"encode": [], "decode": []}
    for i in range(pairs):
        for step, (a, b) in (("encode", (x, x)), ("decode", (data_ours, data_ref))):
            fns = ((ours[step == "decode"], a), (ref[step == "decode"], b))
            first, second = fns if i % 2 == 0 else fns[::-1]
            t_first = _timed(lambda f=first: f[0](f[1]), dev)
            t_second = _timed(lambda f=second: f[0](f[1]), dev)
            t_ours, t_ref = (t_first, t_second) if i % 2 == 0 else (t_second, t_first)
            ratios[step].append(t_ref / t_ours)
    return {step: statistics.median(r) for step, r in ratios.items()}


def _timed(fn: Callable[[], object], dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - start
    del out
    return elapsed


# --- reference SparseLoCo: the straightforward implementation the fast codec is measured against ---


def reference_encode(x: torch.Tensor, chunk: int, k: int) -> bytes:
    """Plain SparseLoCo: zero-pad, torch.topk per chunk, int16 indices, one byte per 2-bit code."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % chunk
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    rows = flat.view(-1, chunk)
    idx = torch.topk(rows.abs(), k, dim=1).indices
    vals = rows.gather(1, idx)
    mag = vals.abs()
    scale = mag.mean(1, keepdim=True)
    ratio = mag / scale.clamp(min=1e-30)
    high = ratio >= 1.0
    levels = torch.stack([ratio[~high].mean(), ratio[high].mean()]).nan_to_num(1.0)
    codes = (vals < 0).to(torch.uint8) * 2 + high.to(torch.uint8)
    obj = {
        "shape": list(x.shape),
        "chunk": chunk,
        "idx": idx.to(torch.int16).cpu().numpy().tobytes(),
        "code": codes.cpu().numpy().tobytes(),
        "scale": scale.half().cpu().numpy().tobytes(),
        "level": levels.float().cpu().numpy().tobytes(),
    }
    return msgpack.packb(obj, use_bin_type=True)


def reference_decode(data: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse of `reference_encode`: one scatter into a zero-padded dense tensor."""
    obj = msgpack.unpackb(data, raw=False)
    shape, chunk = obj["shape"], obj["chunk"]
    n = math.prod(shape)
    nrows = -(-n // chunk)
    idx = torch.frombuffer(bytearray(obj["idx"]), dtype=torch.int16).to(device).long().view(nrows, -1)
    codes = torch.frombuffer(bytearray(obj["code"]), dtype=torch.uint8).to(device).long().view(nrows, -1)
    scale = torch.frombuffer(bytearray(obj["scale"]), dtype=torch.float16).to(device).float().view(nrows, 1)
    lv = torch.frombuffer(bytearray(obj["level"]), dtype=torch.float32).to(device)
    table = torch.stack([lv[0], lv[1], -lv[0], -lv[1]])
    vals = table[codes] * scale
    out = torch.zeros(nrows, chunk, device=device)
    out.scatter_(1, idx, vals)
    return out.view(-1)[:n].view(shape)


def _times(speedup: float) -> str:
    """A speed ratio as people say it: "2.50x faster" or "5.00x slower", never "0.20x faster"."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower" if speedup > 0 else "n/a"
