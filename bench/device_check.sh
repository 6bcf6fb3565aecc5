#!/usr/bin/env bash
# The checks that need a real GPU, in one short run: the CUDA kernel / device / golden tests, then
# `odmoe-bench kernels` and `odmoe-bench engine` (16 Mixtral-8x7B layers, synthetic weights) on the CUDA backend.
#
#   usage: bench/device_check.sh PACK OUTDIR
#
# PACK is a tar.xz made here from `../shared/tools/bundle.sh DIR build/tests/kernels_test build/bin/odmoe-bench`
# (and build/bin/gemv_sweep, built for sm_90) plus DIR/shared/models/<the small checkpoints>; it
# is unpacked to /tmp/odmoe-dev. Every step has its own time limit, so one that hangs leaves the others' figures.
# Logs and JSON lines go to OUTDIR.
set -u
pack=${1:?usage: device_check.sh PACK OUTDIR}
out=${2:?usage: device_check.sh PACK OUTDIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
dev=/tmp/odmoe-dev
mkdir -p "$dev" "$out"
tar xJf "$pack" -C "$dev" || exit 1
export LD_LIBRARY_PATH=$dev/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# The tests look for the checkpoints at the path baked in at build time (ODMOE_SHARED_DIR = /work/main/../shared).
if [ ! -e /work/shared ]; then mkdir -p /work/main && ln -s "$dev/shared" /work/shared; fi

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tee "$out/gpu.txt"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
}

step kernels_test 150 "$dev/bin/kernels_test" --gtest_brief=1
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|actual|error" "$out/kernels_test.log" | head -60
step bench_kernels 100 "$dev/bin/odmoe-bench" kernels --backend cuda --json "$out/kernels.json"
tail -12 "$out/bench_kernels.log"
# Every one-token GEMV variant (rows per warp, ring depth; INT8 / NF4 candidates with 16-byte code loads too) on a
# decode's shapes, where the pack has the sweep.
if [ -x "$dev/bin/gemv_sweep" ]; then
  step gemv_sweep 120 "$dev/bin/gemv_sweep"
  cat "$out/gemv_sweep.log"
fi
step bench_engine 180 "$dev/bin/odmoe-bench" engine --synthetic "$repo/configs/models/mixtral-8x7b" --layers 16 \
  --backend cuda --pairs 16x64,128x256 --repeat 3 --json "$out/engine.json"
tail -8 "$out/bench_engine.log"
# The same decode op by op (no graphs): what replaying each step as one graph launch gains.
step bench_engine_nographs 180 "$dev/bin/odmoe-bench" engine --synthetic "$repo/configs/models/mixtral-8x7b" \
  --layers 16 --backend cuda --pairs 16x64,128x256 --repeat 3 --graphs off --json "$out/engine_nographs.json"
tail -4 "$out/bench_engine_nographs.log"

# Nsight Compute, where the machine has it: why the NF4 GEMV runs where it does, and the GPU time of each kernel
# of one decode token of the engine run above (taken well inside the decode) against its wall time. A token's
# launches are the engine bench's count (graph kernels included), unless NCU_LAUNCHES says.
launches_per_token='import json, sys
print(next(round(r["launches_per_token"]) for r in map(json.loads, open(sys.argv[1])) if "launches_per_token" in r))'
ncu_launches=${NCU_LAUNCHES:-$(python3 -c "$launches_per_token" "$out/engine.json" 2>/dev/null || echo 403)}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  step ncu_nf4 90 "$ncu" --kernel-name regex:GemvNf4Kernel --launch-skip 4 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    "$dev/bin/odmoe-bench" kernels --backend cuda --contexts 1024 --iters 20
  grep -E "Duration|Throughput|Occupancy|Registers|Stall|Cycles Per|Block Limit|Waves|L1|L2 Hit" "$out/ncu_nf4.log" | head -40
  step ncu_engine 150 "$ncu" --launch-skip 1500 --launch-count "$ncu_launches" --metrics gpu__time_duration.sum \
    --csv --print-units base "$dev/bin/odmoe-bench" engine --synthetic "$repo/configs/models/mixtral-8x7b" \
    --layers 16 --backend cuda --pairs 16x64 --repeat 1
  python3 - "$out/ncu_engine.log" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
at = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Value" in r)
head = rows[at]; name_i = head.index("Kernel Name"); val_i = head.index("Metric Value")
total = collections.defaultdict(float); count = collections.Counter()
for r in rows[at + 1:]:
    if len(r) != len(head): continue
    try: v = float(r[val_i].replace(",", ""))
    except ValueError: continue
    k = r[name_i].split("(")[0].split("<")[0].split("::")[-1]; total[k] += v / 1e3; count[k] += 1
print(f"GPU time of {sum(count.values())} launches: {sum(total.values()):.1f} us")
for k, v in sorted(total.items(), key=lambda kv: -kv[1]): print(f"  {v:9.1f} us {count[k]:5d} x {k}")
PY
fi
cat "$out/summary.txt"
