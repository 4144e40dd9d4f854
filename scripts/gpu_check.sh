#!/usr/bin/env bash
# Exercise the CUDA path in a few minutes whenever a GPU machine is at hand:
#   1. the codec bench on CUDA and on the CPU, and a bit-for-bit comparison of decoded results;
#   2. a short train-local run on CUDA;
#   3. a 2-peer swarm on 127.0.0.1 in which one volunteer trains on CUDA.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]     (needs the package installed, or PYTHONPATH set)
set -euo pipefail
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
python - <<'PY' 2>&1 | tee "$OUT/codecs.txt"
import json, torch
from groundswell.compression import make_codec
from groundswell.peer.bench_codecs import run_codec_bench, format_codec_table
assert torch.cuda.is_available(), "no CUDA device"
x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
for name in ("sparseloco", "int8", "fp16", "bf16", "fp32"):
    codec = make_codec(name)
    cpu, gpu = codec.encode(x), codec.encode(x.cuda())
    same_bytes = cpu.to_bytes() == gpu.to_bytes()
    dec_cpu, dec_gpu = codec.decode(cpu), codec.decode(cpu, device="cuda").cpu()
    agg_cpu, agg_gpu = codec.aggregate([cpu, gpu, cpu]), codec.aggregate([cpu, gpu, cpu], device="cuda").cpu()
    print(f"{name}: encode bytes identical {same_bytes}; decode identical {torch.equal(dec_cpu, dec_gpu)}; "
          f"aggregate identical {torch.equal(agg_cpu, agg_gpu)}; max |diff| {float((dec_cpu - dec_gpu).abs().max()):.3g}")
for n in (25_000_000, 100_000_000):
    for device in ("cuda", "cpu"):
        r = run_codec_bench(n, device=device, repeats=3)
        print(f"\n{device}, {n:,} params"); print(format_codec_table(r))
        json.dump(r, open(f"{__import__('os').environ.get('OUT', 'gpu-check')}/bench-{device}-{n}.json", "w"))
PY
groundswell train-local --workers 2 --steps 40 -H 10 --model small --device cuda --algorithm sparseloco \
  --out "$OUT/train-local-cuda.json" 2>&1 | tail -3
# Swarm: coordinator + one CPU peer + one CUDA peer, 3 rounds.
rm -rf "$OUT/swarm" && mkdir -p "$OUT/swarm"
cat > "$OUT/swarm/run.toml" <<'TOML'
[run]
id = "gpu-check"
open = true
min_peers = 2
[model]
spec = "small"
[data]
batch_size = 8
[outer]
algorithm = "sparseloco"
inner_steps = 10
[round]
deadline_s = 60.0
[eval]
batches = 2
TOML
groundswell launch "$OUT/swarm/run.toml" --listen /ip4/127.0.0.1/tcp/0 --state-dir "$OUT/swarm/coord" --quiet &
COORD=$!
trap 'kill $COORD 2>/dev/null || true' EXIT
for _ in $(seq 60); do [ -f "$OUT/swarm/coord/bootstrap.txt" ] && break; sleep 1; done
BOOT=$(cat "$OUT/swarm/coord/bootstrap.txt")
groundswell join "$BOOT" --listen /ip4/127.0.0.1/tcp/0 --state-dir "$OUT/swarm/cpu" --max-rounds 3 --quiet &
CPU=$!
groundswell join "$BOOT" --listen /ip4/127.0.0.1/tcp/0 --state-dir "$OUT/swarm/cuda" --max-rounds 3 --device cuda
wait $CPU
python - "$OUT/swarm" <<'PY'
import json, sys, pathlib
root = pathlib.Path(sys.argv[1])
rounds = {}
for name in ("cpu", "cuda", "coord"):
    for line in (root / name / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "round":
            rounds.setdefault(e["round"], set()).add(e["hash"])
print("per-round parameter hashes agree across CPU peer, CUDA peer and coordinator:",
      all(len(h) == 1 for h in rounds.values()), sorted(rounds))
PY
