#!/usr/bin/env bash
# Exercise the CUDA path in a few minutes whenever a GPU machine is at hand:
#   1. every codec on CUDA and on the CPU: identical wire bytes (sparseloco: identical selection,
#      see below), decodes and aggregates;
#   2. the codec bench on CUDA and on the CPU (JSON per size and device);
#   3. a short train-local run on CUDA, whose workers must end with identical parameters, and a
#      2-peer simulate with one volunteer on CUDA (`--cuda-peers 1`), whose hashes must agree;
#   4. a 3-round swarm on 127.0.0.1 (coordinator on CUDA, one CPU volunteer, one CUDA volunteer), with
#      SparseLoCo and then DiLoCo, whose per-round parameter hashes must agree across all three,
#      with the CUDA volunteer's contribution included in every round after its first, and its
#      model shown to have lived on the GPU (its process's CUDA allocator peak, below).
# Usage: bash scripts/gpu_check.sh [OUT_DIR] [DEVICE] [BENCH_SIZES] [MODEL]
#   DEVICE defaults to cuda; `cpu` dry-runs the whole script on a machine without a GPU (the
#   "GPU" side then runs on the CPU too). BENCH_SIZES defaults to "25000000 100000000"; MODEL
#   (the preset of train-local and the swarm) to small (tests/test_gpu_check_script.py's CPU dry
#   run takes tiny: the same steps, in about 50 s instead of 97-150 s on a 2-core machine).
# Needs the package installed (or on PYTHONPATH). Exits non-zero on any mismatch, on any step
# past its own time bound (each is killed then: `timeout -k`), and, on a GPU, when the whole took
# over 5 minutes (each step's end is printed with the seconds since the start).
set -euo pipefail
OUT=${1:-gpu-check}
DEVICE=${2:-cuda}
SIZES=${3:-25000000 100000000}
MODEL=${4:-small}
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
# the three swarm processes share the machine's cores: 4 torch threads each where there are 12 cores or more
THREADS=$(( $(nproc) >= 12 ? 4 : 1 ))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
LIMIT_S=300  # the whole script's goal: under 5 minutes
step_done() { echo "[gpu_check] $1 done at ${SECONDS} s"; }
# each step bounded, and killed (-k) if it does not stop on the first TERM: launch and join take
# it for "stop after this round", and a hang must not eat a lent machine's minutes
bounded() { local s=$1; shift; timeout -k 10 "$s" "$@"; }

bounded 180 python3 - "$OUT" "$DEVICE" $SIZES <<'PY' 2>&1 | tee "$OUT/codecs.txt"
import json, sys, torch
from groundswell.compression import make_codec, CODEC_NAMES
from groundswell.peer.bench_codecs import run_codec_bench, format_codec_table
out, dev, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
if dev.startswith("cuda"):
    assert torch.cuda.is_available(), "no CUDA device"
    print("torch", torch.__version__, "on", torch.cuda.get_device_name(dev))
x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
mismatches = []
for name in CODEC_NAMES:
    codec = make_codec(name)
    cpu, gpu = codec.encode(x), codec.encode(x.to(dev))
    same_bytes = cpu.to_bytes() == gpu.to_bytes()
    dec_cpu, dec_gpu = codec.decode(cpu), codec.decode(cpu, device=dev).cpu()
    agg_cpu, agg_gpu = codec.aggregate([cpu, gpu, cpu]), codec.aggregate([cpu, gpu, cpu], device=dev).cpu()
    same_dec, same_agg = torch.equal(dec_cpu, dec_gpu), torch.equal(agg_cpu, agg_gpu)
    line = (f"{name}: encode bytes identical {same_bytes}; decode identical {same_dec}; aggregate identical {same_agg}; "
            f"max |decode diff| {float((dec_cpu - dec_gpu).abs().max()):.3g}")
    # What must hold of the encodings. Dense casts and int8's block max, true division and
    # rounding are exact on every device: their bytes must match. SparseLoCo's selection (the
    # canonical top-k) must match too, but its bf16 scales (an fp64 mean) and fp32 levels (fp32
    # per-chunk sums) are reductions whose order differs on CUDA, so they may differ in a last
    # bit (tests/test_codecs.py allows it too); that changes nobody's result, since every peer
    # decodes the same bytes, which the decode and aggregate checks cover.
    if name == "sparseloco":
        same_wire = cpu.buffers["idx"] == gpu.buffers["idx"]
        line += f"; selection (idx) identical {same_wire}"
    else:
        same_wire = same_bytes
    print(line)
    if not (same_wire and same_dec and same_agg):
        mismatches.append(name)
for n in sizes:
    results = {}
    for device in (dev, "cpu"):
        r = results[device] = run_codec_bench(n, device=device, repeats=3)
        print(f"\n{device}, {n:,} params"); print(format_codec_table(r))
        with open(f"{out}/bench-{device.replace(':', '')}-{n}.json", "w") as f:
            json.dump(r, f, indent=1)
    # the same input on both devices: the same sizes on the wire, the same error (sparseloco's
    # scales may differ in a last bit, see above: its error within a millionth)
    for name, here in results[dev]["codecs"].items():
        there = results["cpu"]["codecs"][name]
        if here["bytes"] != there["bytes"] or abs(here["rel_error"] - there["rel_error"]) > 1e-6 * max(1.0, there["rel_error"]):
            print(f"{name} at {n:,}: {dev} {here['bytes']} bytes, error {here['rel_error']:.9f}; "
                  f"cpu {there['bytes']} bytes, error {there['rel_error']:.9f}")
            mismatches.append(f"{name} (bench, {n:,})")
if mismatches:
    sys.exit(f"CPU and {dev} results differ for: {', '.join(mismatches)}")
PY
step_done "codecs on $DEVICE and the CPU"

bounded 90 groundswell train-local --workers 2 --steps 40 -H 10 --model "$MODEL" --device "$DEVICE" \
  --algorithm sparseloco --out "$OUT/train-local-$DEVICE.json" 2>&1 | tail -3
# train-local exits 0 whatever its workers hold at the end: the check is its JSON's params_identical
python3 - "$OUT/train-local-$DEVICE.json" <<'PY'
import json, sys
identical = json.load(open(sys.argv[1])).get("params_identical")
print(f"train-local: workers' parameters identical at the end: {identical}")
if identical is not True:
    sys.exit("train-local check FAILED: the workers' parameters differ")
PY
step_done "train-local on $DEVICE"

# A 2-peer simulate with one volunteer on the GPU (`--cuda-peers 1`; none in a CPU dry run): it
# exits non-zero unless every round completed with every peer's parameter hash agreeing.
CUDA_PEERS=$([ "$DEVICE" = cpu ] && echo 0 || echo 1)
bounded 120 groundswell simulate --peers 2 --rounds 3 --preset "$MODEL" -H 10 --batch-size 8 --deadline 60 \
  --cuda-peers "$CUDA_PEERS" --timeout 100 --out "$OUT/simulate" 2>&1 | tail -2
python3 - "$OUT/simulate" "$CUDA_PEERS" <<'PY'
import json, pathlib, sys
root, cuda_peers = pathlib.Path(sys.argv[1]), int(sys.argv[2])
r = json.loads((root / "report.json").read_text())
# where each volunteer's model lived while it trained (its "train" events say)
devices = {name: sorted({e["device"].split(":")[0] for e in map(json.loads, (root / name / "events.jsonl").read_text().splitlines())
                         if e.get("kind") == "train" and "device" in e}) for name in ("peer-0", "peer-1")}
want = {"peer-0": ["cuda"] if cuda_peers else ["cpu"], "peer-1": ["cpu"]}
ok = r["rounds_completed"] == 3 and r["param_hash_agreement"] and devices == want
print(f"simulate, {cuda_peers} CUDA peer(s): {r['rounds_completed']}/3 rounds, hashes agree "
      f"{r['param_hash_agreement']}, volunteers trained on {devices}")
if not ok:
    sys.exit("simulate check FAILED")
PY
step_done "simulate with $CUDA_PEERS CUDA peer(s)"

# The "GPU" volunteer runs the `groundswell` CLI under this wrapper, which writes on exit what its
# process's torch CUDA allocator handed out. Nothing on the CPU path allocates CUDA memory, so a
# peak of at least the model's fp32 parameter bytes shows that the model itself lived on the GPU
# (a log line or a faster compute time could come from something else).
cat > "$OUT/join_cuda_report.py" <<'PY'
import atexit, json, sys

report_path = sys.argv[1]


def report() -> None:
    import torch

    used = torch.cuda.is_initialized()
    # every device's peak, so that --device cuda:N is seen whatever the current device is
    peaks = [torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())] if used else [0]
    top = max(range(len(peaks)), key=peaks.__getitem__)
    with open(report_path, "w") as f:
        json.dump({"cuda_initialized": used, "max_memory_allocated": peaks[top],
                   "device_name": torch.cuda.get_device_name(top) if used else None}, f)


atexit.register(report)  # also when the CLI ends with SystemExit, as click does
sys.argv = ["groundswell", *sys.argv[2:]]
from groundswell.peer.entry import main

main()
PY

# Swarm: coordinator + one CPU volunteer + one volunteer on DEVICE, 3 rounds, once per outer algorithm.
PIDS=()
# (TERM first, as a person's Ctrl+C; then KILL: a peer takes TERM for "stop after this round")
trap '[ ${#PIDS[@]} -gt 0 ] && { kill "${PIDS[@]}" 2>/dev/null; sleep 5; kill -9 "${PIDS[@]}" 2>/dev/null; } || true' EXIT
swarm_check() {
  local algo=$1 dir="$OUT/swarm-$1"
  rm -rf "$dir" && mkdir -p "$dir"
  cat > "$dir/run.toml" <<TOML
[run]
id = "gpu-check-$algo"
open = true
min_peers = 2
[model]
spec = "$MODEL"
[data]
batch_size = 8
[outer]
algorithm = "$algo"
inner_steps = 10
[round]
deadline_s = 60.0
[eval]
batches = 2
TOML
  # (the coordinator under the allocator report too: it applies rounds and evaluates on DEVICE)
  python3 "$OUT/join_cuda_report.py" "$dir/coord-cuda.json" launch "$dir/run.toml" --threads $THREADS \
    --listen /ip4/127.0.0.1/tcp/0 --device "$DEVICE" --state-dir "$dir/coord" --quiet > "$dir/coord.log" 2>&1 &
  local coord=$!
  PIDS+=($coord)
  for _ in $(seq 60); do [ -f "$dir/coord/bootstrap.txt" ] && break; kill -0 $coord 2>/dev/null || break; sleep 1; done
  local boot
  boot=$(cat "$dir/coord/bootstrap.txt")
  # --until-round, not --max-rounds: a round one of them took by catching up would not count
  # towards its own 3, and it would wait for good for a round nobody else trains. Bounded: a
  # hang must not eat a lent machine's minutes (timeout exits 124, which fails the script).
  # (timeout itself in the background, not a function's subshell: the trap's kill then reaches it)
  timeout -k 10 90 groundswell join "$boot" --threads $THREADS --listen /ip4/127.0.0.1/tcp/0 \
    --state-dir "$dir/cpu" --until-round 3 --quiet > "$dir/cpu.log" 2>&1 &
  local cpu=$!
  PIDS+=($cpu)
  bounded 90 python3 "$OUT/join_cuda_report.py" "$dir/gpu-cuda.json" join "$boot" --threads $THREADS \
    --listen /ip4/127.0.0.1/tcp/0 --state-dir "$dir/gpu" --until-round 3 --device "$DEVICE" --quiet > "$dir/gpu.log" 2>&1
  wait $cpu
  kill $coord 2>/dev/null || true
  # (a coordinator saving its checkpoint takes a moment; one that does not stop is killed)
  for _ in $(seq 30); do kill -0 $coord 2>/dev/null || break; sleep 1; done
  kill -9 $coord 2>/dev/null || true
  wait $coord 2>/dev/null || true
  python3 - "$dir" "$algo" "$DEVICE" "$MODEL" <<'PY'
import json, sys, pathlib, statistics
root, algo, device, model = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
hashes, included, compute, trained_on = {}, {}, {}, {}
for name in ("cpu", "gpu", "coord"):
    for line in (root / name / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "train" and "device" in e:  # where the volunteer's model lived while it trained
            trained_on.setdefault(name, set()).add(e["device"].split(":")[0])
        if e["kind"] == "round":
            hashes.setdefault(e["round"], {})[name] = e["hash"]
            if name != "coord":
                included.setdefault(name, {})[e["round"]] = e["included"]
                compute.setdefault(name, []).append(e["compute_s"])
both = [r for r, h in hashes.items() if {"cpu", "gpu"} <= set(h)]
# every round both volunteers finished, with the coordinator's hash beside theirs (a round it only
# caught up on logs no "round" event) and no empty one (a hash not known yet agrees with nothing)
agree = bool(both) and all({"cpu", "gpu", "coord"} <= set(hashes[r]) and "" not in hashes[r].values()
                           and len(set(hashes[r].values())) == 1 for r in both)
# its first round may start while the round is already under way; every later one must count it
gpu_rounds = sorted(included.get("gpu", {}))
gpu_later_included = len(gpu_rounds) >= 2 and all(included["gpu"][r] for r in gpu_rounds[1:])
print(f"{algo} swarm: rounds seen {sorted(hashes)}; rounds both volunteers finished {sorted(both)}; "
      f"hashes agree across CPU volunteer, GPU volunteer and coordinator: {agree}; "
      f"contributions included {included}; GPU volunteer included in every round after its first: "
      f"{gpu_later_included}; median compute s per round "
      f"{ {k: round(statistics.median(v), 2) for k, v in compute.items()} }")
on_cuda = trained_on.get("gpu") == {device.split(":")[0]} and trained_on.get("cpu") == {"cpu"}
print(f"{algo} swarm: the volunteers trained on {dict((k, sorted(v)) for k, v in trained_on.items())}")
for who, report in (("GPU volunteer", "gpu-cuda.json"), ("coordinator", "coord-cuda.json")):
    path = root / report
    if not path.exists():  # the coordinator is killed at the end: its report is written on the way out
        print(f"{algo} swarm: no CUDA report from the {who}")
        on_cuda = on_cuda and not device.startswith("cuda")
        continue
    cuda = json.loads(path.read_text())
    if device.startswith("cuda"):
        from groundswell.peer.model import GPT, preset_config

        param_bytes = 4 * sum(p.numel() for p in GPT(preset_config(model)).parameters())  # run.toml's model
        ran = cuda["cuda_initialized"] and cuda["max_memory_allocated"] >= param_bytes
        on_cuda = on_cuda and ran
        print(f"{algo} swarm: {who}'s CUDA allocator peak {cuda['max_memory_allocated'] / 1e6:.1f} MB on "
              f"{cuda['device_name']} (the model's parameters: {param_bytes / 1e6:.1f} MB): ran on CUDA {ran}")
    else:
        print(f"{algo} swarm: the {who} ran on {device} (dry run): CUDA report {cuda}")
if not agree or len(both) < 3 or not gpu_later_included or not on_cuda:
    sys.exit(f"{algo} swarm check FAILED")
print(f"{algo} swarm check passed")
PY
}
swarm_check sparseloco
step_done "SparseLoCo swarm"
swarm_check diloco
step_done "DiLoCo swarm"
if [ "$DEVICE" != cpu ] && [ "$SECONDS" -gt "$LIMIT_S" ]; then  # (a CPU dry run is no GPU machine's time)
  echo "gpu_check took ${SECONDS} s: over its ${LIMIT_S} s goal" >&2
  exit 1
fi
