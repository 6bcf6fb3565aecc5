#!/usr/bin/env bash
# bench/run.sh: the OD-MoE evaluation (paper section 4) in one command, machine-readable, with plots.
#
#   bench/run.sh [--quick] [--model DIR | --synthetic CONFIG --layers N] [--endpoint HOST:PORT]
#                [--lan [--link-rate RATE]] [--config FILE] [--prompts N] [--pairs LIST] [--seed S]
#                [--backend cpu|cuda] [--port-offset N] --out DIR
#   bench/run.sh --emulate FILE [--lan [--link-rate RATE]] [--time-scale S] [--worker-device SPEC]
#                [--shadow-mode shadow|random|none] [--early-departure] [--workers N] [--group-size G]
#                [--align T,KV] [--shadow-quant fp16|int8|nf4] [--quick] [--model DIR] [--prompts N]
#                [--pairs LIST] [--seed S] --out DIR
#
# --emulate FILE (e.g. configs/testbed-emulated.toml): the cluster of FILE, whose nodes are timed devices
# (device = "timed:PROFILE", src/backend/timed_device.h), and the fully-resident reference on the device of
# FILE's main node (the same profile and [cluster] timing_model, every expert resident: no loads). Only the
# workloads, resident, ratio and stall sections run (the others restart the cluster per setting). The model
# defaults to ../shared/models/tiny-mixtral-kjv (real routing); --time-scale S replaces FILE's time_scale,
# --worker-device SPEC every worker's device (e.g. timed:rtx3080, the paper's fig. 10) and --shadow-mode the
# [shadow] mode (none: ablation case 6, no prediction), --early-departure sets [shadow] early_departure.
# --workers N gives the cluster exactly N workers (worker0.., copies of FILE's first worker, its ports + i; N a
# multiple of the group size), --group-size G sets [cluster] group_size, --align T,KV [shadow] align_token and
# align_kv (decode steps; 0: never), --shadow-quant [shadow] quant (bench/report.py config writes them and checks
# the combination; bench/sweep.sh runs one setting per axis). With --lan the cluster runs in the LAN harness
# (tests/lan/run.sh --up --config) at 1 Gbit/s or --link-rate, divided by the time scale, so hidden states,
# predictions and alignment, padded to the timing model's bytes, pay transfer time. summary.md then also gives
# the decode figures at the timing model's layer count (a range; see report.py scaled_records), whether the
# cluster's tokens equal the reference's, and the calibration checks: measured decode time per token against
# the profiles' modelled critical path, within 10%, for the reference and, with --shadow-mode none, the cluster.
#
# Writes DIR/results.jsonl (one record per figure, each with section, model, config, hardware, commit, seed),
# DIR/summary.md (laid out like the paper's Table 2, the paper's figures beside ours), DIR/*.csv and DIR/*.png;
# the benchmarks' raw JSON lines stay in DIR/raw/, their logs in DIR/logs/.
#
# Sections: workloads (the cluster, the paper's four (input, output) pairs), resident (the same on the
# fully-resident single-process engine) and ratio, memory, recall_per_token (FP16/INT8/NF4 shadows, aligned and
# unaligned), ablation (the six cases), alignment_grid, stall. See the README's "Benchmarks" section.
#
# The cluster: by default this script starts one from --config (configs/local.toml: 1 main, 1 shadow, 8 workers
# on loopback) with its ports moved by --port-offset, and takes it down on exit, interrupt included.
# --endpoint HOST:PORT uses a running cluster instead, and --lan the LAN harness (tests/lan/run.sh --up at
# 1 Gbit/s, --link-rate RATE another rate, e.g. 100mbit or 10gbit; with --emulate the rate of the modelled
# testbed, shaped at RATE / time_scale of wall-clock time as the devices are; its topology is 8 workers); both
# skip the sections that restart the cluster (recall_per_token, ablation, alignment_grid) and summary.md says
# so. With --endpoint the resident reference runs only when --model or --synthetic is given.
# --quick: the demo model on the CPU, 2 prompts and short outputs; every section in a few minutes. --pairs LIST
# (e.g. 16x32,128x8: input x output tokens) replaces the workload pairs of either.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${ODMOE_BIN:-$ROOT/build/bin}

die() {
  echo "bench/run.sh: $*" >&2
  exit 2
}

quick=0 model="" synthetic="" layers=0 endpoint="" lan=0 out="" prompts="" seed=1 backend=cpu
config="$ROOT/configs/local.toml" port_offset=300 model_given=0 emulate="" time_scale="" worker_device="" shadow_mode="" early_departure=0
workers="" group_size="" align="" shadow_quant="" link_rate="" pairs_given=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --model) model=${2:?--model needs DIR}; model_given=1; shift ;;
    --synthetic) synthetic=${2:?--synthetic needs CONFIG}; model_given=1; shift ;;
    --layers) layers=${2:?--layers needs N}; shift ;;
    --endpoint) endpoint=${2:?--endpoint needs HOST:PORT}; shift ;;
    --lan) lan=1 ;;
    --config) config=${2:?--config needs FILE}; shift ;;
    --prompts) prompts=${2:?--prompts needs N}; shift ;;
    --seed) seed=${2:?--seed needs S}; shift ;;
    --backend) backend=${2:?--backend needs a backend}; shift ;;
    --port-offset) port_offset=${2:?--port-offset needs N}; shift ;;
    --emulate) emulate=${2:?--emulate needs FILE}; shift ;;
    --time-scale) time_scale=${2:?--time-scale needs S}; shift ;;
    --worker-device) worker_device=${2:?--worker-device needs SPEC}; shift ;;
    --shadow-mode) shadow_mode=${2:?--shadow-mode needs shadow, random or none}; shift ;;
    --early-departure) early_departure=1 ;;
    --workers) workers=${2:?--workers needs N}; shift ;;
    --group-size) group_size=${2:?--group-size needs G}; shift ;;
    --align) align=${2:?--align needs T,KV}; shift ;;
    --shadow-quant) shadow_quant=${2:?--shadow-quant needs fp16, int8 or nf4}; shift ;;
    --link-rate) link_rate=${2:?--link-rate needs RATE}; shift ;;
    --pairs) pairs_given=${2:?--pairs needs LIST}; shift ;;
    --out) out=${2:?--out needs DIR}; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
[ -n "$out" ] || die "--out DIR is required"
[ -n "$model" ] && [ -n "$synthetic" ] && die "give one of --model and --synthetic, not both"
[ -n "$endpoint" ] && [ "$lan" -eq 1 ] && die "give one of --endpoint and --lan, not both"
[ -n "$synthetic" ] && [ "$layers" -lt 1 ] && die "--synthetic needs --layers N (N >= 1)"
[ -z "$synthetic" ] && [ "$layers" -ne 0 ] && die "--layers needs --synthetic"
if [ -n "$emulate" ]; then
  [ -n "$endpoint" ] && die "give one of --emulate and --endpoint, not both"
  [ "$backend" = cpu ] || die "--emulate runs the reference on FILE's main device: no --backend"
  [ -n "$synthetic" ] && die "--emulate needs a trained model (--model DIR): its routing is what is emulated"
  [ -f "$emulate" ] || die "--emulate $emulate: no such file"
  config=$emulate
  [ -z "$model" ] && model="$ROOT/../shared/models/tiny-mixtral-kjv"
else
  [ -z "$time_scale$worker_device$shadow_mode$workers$group_size$align$shadow_quant" ] &&
    [ "$early_departure" -eq 0 ] ||
    die "--time-scale, --worker-device, --shadow-mode, --early-departure, --workers, --group-size, --align and" \
      "--shadow-quant go with --emulate"
fi
[[ -z "$workers" || $workers =~ ^[1-9][0-9]*$ ]] || die "--workers '$workers': expected a count >= 1"
[[ -z "$group_size" || $group_size =~ ^[1-9][0-9]*$ ]] || die "--group-size '$group_size': expected a size >= 1"
[[ -z "$align" || $align =~ ^[0-9]+,[0-9]+$ ]] || die "--align '$align': expected T,KV (decode steps, 0: never)"
case "$shadow_quant" in
  "" | fp16 | int8 | nf4) ;;
  *) die "--shadow-quant '$shadow_quant': expected fp16, int8 or nf4" ;;
esac
if [ -n "$link_rate" ]; then
  [ "$lan" -eq 1 ] || die "--link-rate goes with --lan (the loopback cluster has no shaped links)"
  [[ $link_rate =~ ^[0-9]+(k|m|g)?bit$ ]] || die "--link-rate '$link_rate': expected e.g. 100mbit, 1gbit, 10gbit"
fi
# The LAN harness has configs/local.toml's topology (tests/lan/run.sh: main, shadow, worker0..7).
[ "$lan" -eq 1 ] && [ -n "$workers" ] && [ "$workers" != 8 ] &&
  die "--workers $workers: the LAN harness runs exactly 8 workers (tests/lan/run.sh); drop --lan or --workers"
[[ -z "$pairs_given" || $pairs_given =~ ^[0-9]+x[0-9]+(,[0-9]+x[0-9]+)*$ ]] ||
  die "--pairs '$pairs_given': expected INPUTxOUTPUT,... (e.g. 16x32,128x8)"
lan_rate=${link_rate:-1gbit}
[ -z "$model" ] && [ -z "$synthetic" ] && model="$ROOT/models/demo-mixtral-kjv"
[ -n "$model" ] && { [ -f "$model/config.json" ] || die "--model $model: no config.json there"; }
[ -n "$synthetic" ] && { [ -e "$synthetic" ] || die "--synthetic $synthetic: no such file"; }
[ -f "$config" ] || die "--config $config: no such file"
# The Python with matplotlib: python3-matplotlib is Debian's, for /usr/bin/python3 (another python3 may come
# first on PATH); $PYTHON overrides.
PY=${PYTHON:-python3}
if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
  [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import matplotlib' 2>/dev/null && PY=/usr/bin/python3 ||
    die "$PY has no matplotlib: install python3-matplotlib (scripts/install-deps.sh) or set PYTHON"
fi
for b in odmoe odmoe-bench; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing: build first (bash scripts/build.sh)"
done

if [ "$quick" -eq 1 ]; then
  pairs=16x8,16x32,128x8,128x32 pred_tokens=32 grid=1,4 prompts=${prompts:-2}
else
  pairs=16x64,16x256,128x64,128x256 pred_tokens=256 grid=1,2,4,8,16 prompts=${prompts:-3}
fi
[ -n "$pairs_given" ] && pairs=$pairs_given

mkdir -p "$out/raw" "$out/logs"
out=$(cd "$out" && pwd)
rm -f "$out"/raw/*.jsonl "$out"/raw/*.json "$out"/*.png "$out"/*.csv "$out"/results.jsonl "$out"/summary.md
commit=$(git -C "$ROOT" rev-parse HEAD)
dirty=0
[ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] || dirty=1
if [ -n "$model" ]; then
  model=$(cd "$model" && pwd)
  model_args=(--model "$model")
  model_label=$model
else
  synthetic=$(cd "$(dirname "$synthetic")" && pwd)/$(basename "$synthetic")
  model_args=(--synthetic "$synthetic" --layers "$layers")
  model_label="synthetic:$synthetic layers=$layers seed=$seed"
fi
log() { echo "== bench/run.sh: $* ($SECONDS s)"; }

# The cluster config the bench starts clusters from: the ports moved, the model written in.
cluster_config="$out/cluster.toml"
scale_args=()
[ -n "$time_scale" ] && scale_args+=(--time-scale "$time_scale")
[ -n "$worker_device" ] && scale_args+=(--worker-device "$worker_device")
[ -n "$shadow_mode" ] && scale_args+=(--shadow-mode "$shadow_mode")
[ "$early_departure" -eq 1 ] && scale_args+=(--early-departure)
[ -n "$workers" ] && scale_args+=(--workers "$workers")
[ -n "$group_size" ] && scale_args+=(--group-size "$group_size")
[ -n "$align" ] && scale_args+=(--align "$align")
[ -n "$shadow_quant" ] && scale_args+=(--shadow-quant "$shadow_quant")
if [ -n "$model" ]; then
  "$PY" "$ROOT/bench/report.py" config --base "$config" --out "$cluster_config" --port-offset "$port_offset" \
    --model "$model" "${scale_args[@]+"${scale_args[@]}"}"
else
  "$PY" "$ROOT/bench/report.py" config --base "$config" --out "$cluster_config" --port-offset "$port_offset" \
    --synthetic "$synthetic" --layers "$layers" --seed "$seed"
fi

# What runs the cluster, and how to take it down (on exit and on interrupt).
mode=local cluster_up=0 skipped=() in_client=()
take_down() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$cluster_up" -eq 1 ]; then
    if [ "$mode" = lan ]; then
      bash "$ROOT/tests/lan/run.sh" --down >>"$out/logs/cluster.log" 2>&1 ||
        echo "bench/run.sh: tests/lan/run.sh --down failed (see $out/logs/cluster.log)" >&2
    else
      "$BIN/odmoe" cluster down --config "$cluster_config" --run-dir "$out/run" >>"$out/logs/cluster.log" 2>&1 || true
    fi
  fi
  # A prediction run interrupted between its own `cluster up` and `cluster down`.
  if [ -d "$out/run-prediction" ]; then
    "$BIN/odmoe" cluster down --config "$cluster_config" --run-dir "$out/run-prediction" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap take_down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

metrics=()
parse_up() {  # the `grpc: HOST:PORT` and `metrics: NODE URL` lines of a cluster start
  endpoint=$(sed -n 's/^grpc: //p' "$1" | tail -n 1)
  [ -n "$endpoint" ] || die "no 'grpc: HOST:PORT' line in the output of $2 (see $1)"
  while read -r name url; do metrics+=("$name=$url"); done < <(sed -n 's/^metrics: //p' "$1")
}
if [ "$lan" -eq 1 ]; then
  mode=lan
  [ -f "$ROOT/tests/lan/run.sh" ] || die "--lan needs the LAN harness tests/lan/run.sh, which this checkout lacks"
  tc_rate=$lan_rate
  if [ -n "$emulate" ]; then
    # The devices run time_scale times slower than modelled, so the links must too: tc shapes wall-clock time.
    tc_rate=$("$PY" - "$cluster_config" "$lan_rate" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    scale = float(tomllib.load(f)["cluster"].get("time_scale", 1.0))
value, unit = re.fullmatch(r"([0-9]+)(k|m|g)?bit", sys.argv[2]).groups()
print(f"{max(1, round(int(value) * {None: 1e-3, 'k': 1, 'm': 1e3, 'g': 1e6}[unit] / scale))}kbit")
EOF
)
  fi
  lan_args=(--up --rate "$tc_rate")
  # Emulated: the harness takes the file's settings, devices and model (tests/lan/run.sh --config).
  [ -n "$emulate" ] && lan_args+=(--config "$cluster_config")
  log "starting the LAN cluster (tests/lan/run.sh ${lan_args[*]})"
  cluster_up=1
  bash "$ROOT/tests/lan/run.sh" "${lan_args[@]}" >"$out/logs/lan-up.log" 2>&1 ||
    die "tests/lan/run.sh ${lan_args[*]} failed (see $out/logs/lan-up.log)"
  parse_up "$out/logs/lan-up.log" "tests/lan/run.sh --up"
  # The cluster's addresses exist only inside the harness's namespaces: clients run in its client namespace.
  in_client=(ip netns exec odmoe-lan-client)
elif [ -n "$endpoint" ]; then
  mode=endpoint
else
  log "starting the cluster of $cluster_config"
  cluster_up=1
  "$BIN/odmoe" cluster up --config "$cluster_config" --run-dir "$out/run" >"$out/logs/cluster-up.log" 2>&1 ||
    die "odmoe cluster up failed (see $out/logs/cluster-up.log and $out/run)"
  parse_up "$out/logs/cluster-up.log" "odmoe cluster up"
fi
if [ "$mode" != local ]; then
  msg="recall_per_token, ablation and alignment_grid: they restart the cluster per setting, which bench/run.sh"
  skipped+=("$msg does not do to a cluster it did not start (--$mode)")
fi

bench() {  # bench NAME ARGS...: odmoe-bench with its JSON lines in raw/NAME.jsonl and its output in logs/
  local name=$1
  shift
  log "odmoe-bench $1 -> raw/$name.jsonl"
  "${in_client[@]+"${in_client[@]}"}" "$BIN/odmoe-bench" "$@" --json "$out/raw/$name.jsonl" >"$out/logs/$name.log" 2>&1 ||
    die "odmoe-bench $* failed (see $out/logs/$name.log)"
}

work_args=("${model_args[@]}" --seed "$seed" --pairs "$pairs" --prompts "$prompts"
  --prompt-text "$ROOT/bench/prompts.txt")
bench workload_cluster workload --endpoint "$endpoint" "${work_args[@]}"
if [ ${#metrics[@]} -gt 0 ]; then
  log "GPU memory of every node (Prometheus)"
  "${in_client[@]+"${in_client[@]}"}" "$PY" "$ROOT/bench/report.py" memory --out "$out/raw/memory_cluster.json" \
    "${metrics[@]}"
fi
if [ "$cluster_up" -eq 1 ] && [ "$mode" = local ]; then
  "$BIN/odmoe" cluster down --config "$cluster_config" --run-dir "$out/run" >>"$out/logs/cluster.log" 2>&1
  cluster_up=0
fi

if [ -n "$emulate" ]; then
  bench workload_resident workload --resident --config "$cluster_config" "${work_args[@]}"
elif [ "$mode" != endpoint ] || [ "$model_given" -eq 1 ]; then
  bench workload_resident workload --resident --backend "$backend" "${work_args[@]}"
else
  msg="resident and ratio: --endpoint without --model or --synthetic (the resident reference runs locally only"
  skipped+=("$msg when the model is given)")
fi

# The HF Transformers peer (bench/peers/hf_transformers.py: same shapes, random bf16 weights), where a GPU is.
if nvidia-smi -L >/dev/null 2>&1 && "$PY" -c 'import torch, transformers' 2>/dev/null; then
  peer_config=${synthetic:-$model/config.json}
  log "HF Transformers peer -> raw/peer.jsonl"
  "$PY" "$ROOT/bench/peers/hf_transformers.py" --config "$peer_config" --layers "$layers" --seed "$seed" \
    --pairs "$pairs" --repeat "$prompts" >"$out/logs/peer.log" 2>&1 ||
    die "bench/peers/hf_transformers.py failed (see $out/logs/peer.log)"
  grep '^{' "$out/logs/peer.log" >"$out/raw/peer.jsonl"
else
  skipped+=("the HF Transformers peer column: it needs a GPU (nvidia-smi) and torch + transformers for $PY")
fi

if [ -n "$emulate" ]; then
  skipped+=("recall_per_token, ablation and alignment_grid: --emulate runs the workloads only (on timed devices each setting would take a cluster restart and minutes)")
elif [ "$mode" = local ]; then
  "$BIN/odmoe-bench" workload --write-prompts "$out/raw/prompts.json" "${model_args[@]}" --seed "$seed" \
    --pairs "$pairs" --prompts "$prompts" --prompt-text "$ROOT/bench/prompts.txt" >/dev/null
  pred=(prediction --config "$cluster_config" --prompts "$out/raw/prompts.json" --max-new-tokens "$pred_tokens"
    --run-dir "$out/run-prediction")
  for q in fp16 int8 nf4; do
    bench "recall_$q" "${pred[@]}" --cases 1,4 --shadow-quant "$q"
  done
  bench ablation "${pred[@]}" --cases 1,2,3,4,5,6
  bench grid "${pred[@]}" --cases none --grid "$grid"
fi

: >"$out/raw/skipped.txt"
for s in "${skipped[@]+"${skipped[@]}"}"; do echo "$s" >>"$out/raw/skipped.txt"; done
META_EMULATE=$emulate META_CLUSTER_CONFIG=$cluster_config META_LAN_RATE=$lan_rate META_TC_RATE=${tc_rate:-} \
  META_MODEL=$model_label META_CONFIG=$config META_COMMIT=$commit META_SEED=$seed META_MODE=$mode \
  META_ENDPOINT=$endpoint META_QUICK=$quick META_PROMPTS=$prompts META_PAIRS=$pairs META_DIRTY=$dirty \
  "$PY" - "$out/raw" <<'EOF'
import json, os, sys
raw = sys.argv[1]
e = os.environ
with open(os.path.join(raw, "workload_cluster.jsonl")) as f:
    source = json.loads(f.readline()).get("prompt_source", "?")
mode = e["META_MODE"]
mode = {"local": "a cluster bench/run.sh started", "endpoint": f"the running cluster at {e['META_ENDPOINT']}",
        "lan": f"the LAN harness (tests/lan/run.sh, links at {e['META_LAN_RATE']}"
               + (f", shaped at {e['META_TC_RATE']} of wall-clock time"
                  if e["META_TC_RATE"] != e["META_LAN_RATE"] else "")
               + f"), main at {e['META_ENDPOINT']}"}[mode]
with open(os.path.join(raw, "skipped.txt")) as f:
    skipped = [line.strip() for line in f if line.strip()]
meta = {"model": e["META_MODEL"], "config": e["META_CONFIG"] if e["META_MODE"] == "local" else "(its own)",
        "commit": e["META_COMMIT"], "tree_dirty": e["META_DIRTY"] == "1",
        "seed": int(e["META_SEED"]), "mode": mode + (", --quick" if e["META_QUICK"] == "1" else ""),
        "quick": e["META_QUICK"] == "1", "prompts": int(e["META_PROMPTS"]), "pairs": e["META_PAIRS"],
        "prompt_source": source, "skipped": skipped}
if e["META_MODE"] == "lan":
    meta["lan_rate"] = e["META_LAN_RATE"]
    meta["lan_tc_rate"] = e["META_TC_RATE"]
if e["META_EMULATE"]:
    import re, tomllib
    with open(e["META_CLUSTER_CONFIG"], "rb") as f:
        cluster = tomllib.load(f)["cluster"]
    timing = cluster.get("timing_model", "")
    target_layers = None
    if timing:
        path = timing if timing.endswith(".json") else os.path.join(timing, "config.json")
        with open(path) as f:
            target_layers = json.load(f)["num_hidden_layers"]
    with open(os.path.join(e["META_MODEL"], "config.json")) as f:
        running_layers = json.load(f)["num_hidden_layers"]
    meta["emulate"] = {"file": e["META_EMULATE"], "time_scale": cluster.get("time_scale", 1.0),
                       "timing_model": timing, "target_layers": target_layers, "running_layers": running_layers}
    # The settings the cluster ran with, as written (bench/report.py config: FILE and the flags).
    with open(e["META_CLUSTER_CONFIG"], "rb") as f:
        doc = tomllib.load(f)
    shadow = doc.get("shadow", {})
    workers = [n for n in doc.get("node", []) if n.get("role") == "worker"]
    meta["emulate"].update({"workers": len(workers), "group_size": cluster.get("group_size", 0),
                            "worker_devices": sorted({n.get("device", "cpu") for n in workers}),
                            "shadow_mode": shadow.get("mode"), "shadow_quant": shadow.get("quant"),
                            "align_token": shadow.get("align_token"), "align_kv": shadow.get("align_kv"),
                            "early_departure": shadow.get("early_departure", False)})
with open(os.path.join(raw, "meta.json"), "w") as f:
    json.dump(meta, f, indent=1)
EOF
log "report"
"$PY" "$ROOT/bench/report.py" report --dir "$out"
log "done: $out/summary.md"
