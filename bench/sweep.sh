#!/usr/bin/env bash
# bench/sweep.sh: the emulated testbed's sweeps (issue 28): bench/run.sh --emulate once per setting, one axis at a
# time around a baseline, then one table per axis (bench/report.py sweep).
#
#   bench/sweep.sh --emulate FILE --out DIR [--time-scale S] [--pairs LIST] [--prompts N] [--lan]
#                  [--only AXIS,...] [--port-offset N]
#
# The baseline is FILE as it is (configs/testbed-emulated.toml: 8 RTX 3090 workers in groups of 2, INT8 shadow,
# token and KV aligned every step, 1 Gbit/s with --lan); each axis changes one setting of it (in brackets what
# the baseline of that file has; a value equal to the baseline's reuses the baseline run, DIR/AXIS-VALUE a link to
# it):
#   workers         4, [8], 16       --workers N (group size as FILE's)
#   group_size      1, [2], 4        --group-size G (workers as FILE's)
#   align           [1,1], 1,4, 1,16, 4,4   --align T,KV: fig. 10's line (token period 1, KV 1..16; the paper's
#                                    RTX 3080 optimum is 1,4) and a corner of fig. 9's grid
#   shadow_quant    fp16, [int8], nf4   --shadow-quant Q
#   worker_profile  [rtx3090], rtx3080  --worker-device timed:PROFILE (fig. 10)
#   shadow_mode     [shadow], none   --shadow-mode (none: ablation case 6, load after routing)
#   link_rate       100mbit, [1gbit], 10gbit   --link-rate (--lan only; the modelled rate, which bench/run.sh
#                                    shapes at RATE / time scale of wall-clock time)
# --only AXIS,... runs those axes (default: all; link_rate only with --lan, the workers axis only without it: the
# LAN harness has 8 workers). Defaults: --time-scale 5, --pairs 16x32, --prompts 2 (about a minute per run on
# 2 cores). --lan needs root (tests/lan/run.sh) and one LAN cluster at a time.
#
# Writes DIR/NAME/ (bench/run.sh's output of each run, its console output in DIR/NAME/run.log), DIR/runs.tsv
# (axis, value, run folder, status, seconds), DIR/skipped.txt (axes not run and why), and through
# bench/report.py sweep DIR/sweep.csv, DIR/sweep.md and DIR/sweep_AXIS.png. A failed run does not stop the sweep:
# its row says failed with its log, and the script exits 1 at the end (2: bad command line).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

die() {
  echo "bench/sweep.sh: $*" >&2
  exit 2
}

AXES=(workers group_size align shadow_quant worker_profile shadow_mode link_rate)
emulate="" out="" time_scale=5 pairs=16x32 prompts=2 lan=0 only="" port_offset=""
while [ $# -gt 0 ]; do
  case "$1" in
    --emulate) emulate=${2:?--emulate needs FILE}; shift ;;
    --out) out=${2:?--out needs DIR}; shift ;;
    --time-scale) time_scale=${2:?--time-scale needs S}; shift ;;
    --pairs) pairs=${2:?--pairs needs LIST}; shift ;;
    --prompts) prompts=${2:?--prompts needs N}; shift ;;
    --lan) lan=1 ;;
    --only) only=${2:?--only needs AXIS,...}; shift ;;
    --port-offset) port_offset=${2:?--port-offset needs N}; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
[ -n "$emulate" ] || die "--emulate FILE is required"
[ -f "$emulate" ] || die "--emulate $emulate: no such file"
[ -n "$out" ] || die "--out DIR is required"
selected=("${AXES[@]}")
if [ -n "$only" ]; then
  IFS=, read -r -a selected <<<"$only"
  for a in "${selected[@]}"; do
    [[ " ${AXES[*]} " == *" $a "* ]] || die "--only: unknown axis '$a' (axes: ${AXES[*]})"
  done
fi
emulate=$(cd "$(dirname "$emulate")" && pwd)/$(basename "$emulate")
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
"$PY" -c 'import tomllib' 2>/dev/null || PY=/usr/bin/python3
"$PY" -c 'import tomllib' 2>/dev/null || die "$PY has no tomllib (Python 3.11+ needed to read $emulate)"

# FILE's own value on each axis: the baseline's row of every table.
declare -A base
while IFS='=' read -r k v; do base[$k]=$v; done < <("$PY" - "$emulate" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
nodes = doc.get("node", [])
workers = [n for n in nodes if n.get("role") == "worker"]
shadow = doc.get("shadow", {})
has_shadow = any(n.get("role") == "shadow" for n in nodes)
device = workers[0].get("device", "cpu") if workers else "cpu"
print(f"workers={len(workers)}")
print(f"group_size={doc.get('cluster', {}).get('group_size', 0)}")
print(f"align={shadow.get('align_token', 1)},{shadow.get('align_kv', 1)}")
print(f"shadow_quant={shadow.get('quant', 'int8')}")
print(f"worker_profile={device.split(':', 1)[1] if device.startswith('timed:') else device}")
print(f"shadow_mode={shadow.get('mode', 'shadow' if has_shadow else 'none')}")
print("link_rate=1gbit")  # bench/run.sh --lan's rate
EOF
)

values_of() {
  case $1 in
    workers) echo "4 8 16" ;;
    group_size) echo "1 2 4" ;;
    align) echo "1,1 1,4 1,16 4,4" ;;
    shadow_quant) echo "fp16 int8 nf4" ;;
    worker_profile) echo "rtx3090 rtx3080" ;;
    shadow_mode) echo "shadow none" ;;
    link_rate) echo "100mbit 1gbit 10gbit" ;;
  esac
}
flags_of() {  # flags_of AXIS VALUE: bench/run.sh's flags for that setting
  case $1 in
    workers) echo "--workers $2" ;;
    group_size) echo "--group-size $2" ;;
    align) echo "--align $2" ;;
    shadow_quant) echo "--shadow-quant $2" ;;
    worker_profile) echo "--worker-device timed:$2" ;;
    shadow_mode) echo "--shadow-mode $2" ;;
    link_rate) echo "--link-rate $2" ;;
  esac
}

common=(--emulate "$emulate" --time-scale "$time_scale" --pairs "$pairs" --prompts "$prompts")
[ "$lan" -eq 1 ] && common+=(--lan)
[ -n "$port_offset" ] && common+=(--port-offset "$port_offset")
log() { echo "== bench/sweep.sh: $* ($SECONDS s)"; }

child=""
stop() {  # the run in flight takes its cluster down on TERM (bench/run.sh's trap)
  local rc=$1
  trap - INT TERM
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null || true
    wait "$child" 2>/dev/null || true
  fi
  exit "$rc"
}
trap 'stop 130' INT
trap 'stop 143' TERM

: >"$out/skipped.txt"
printf 'axis\tvalue\trun\tstatus\tseconds\n' >"$out/runs.tsv"
declare -A status seconds
failed=0
run_one() {  # run_one NAME FLAGS...: bench/run.sh into DIR/NAME (console output in DIR/NAME/run.log)
  local name=$1 start=$SECONDS rc=0
  shift
  rm -rf "${out:?}/$name"
  mkdir -p "$out/$name"
  log "$name: bench/run.sh ${*:-(FILE as it is)}"
  # In the background and waited for, so that an interrupt reaches it (as TERM) and it takes its cluster down.
  bash "$ROOT/bench/run.sh" "${common[@]}" "$@" --out "$out/$name" >"$out/$name/run.log" 2>&1 &
  child=$!
  wait "$child" || rc=$?
  child=""
  seconds[$name]=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    status[$name]=ok
  else
    status[$name]="failed (exit $rc; see $out/$name/run.log)"
    failed=$((failed + 1))
    log "$name FAILED (exit $rc): $(tail -n 1 "$out/$name/run.log")"
  fi
}

axes=()
for a in "${selected[@]}"; do
  if [ "$a" = link_rate ] && [ "$lan" -eq 0 ]; then
    echo "link_rate: needs --lan (the loopback cluster has no shaped links; the LAN harness needs root)" \
      >>"$out/skipped.txt"
  elif [ "$a" = workers ] && [ "$lan" -eq 1 ]; then
    echo "workers: the LAN harness runs exactly 8 workers (tests/lan/run.sh)" >>"$out/skipped.txt"
  else
    axes+=("$a")
  fi
done

if [ ${#axes[@]} -gt 0 ]; then
  run_one baseline
  for a in "${axes[@]}"; do
    vals=$(values_of "$a")
    [[ " $vals " == *" ${base[$a]} "* ]] || vals="${base[$a]} $vals"  # FILE's own value is a row too
    for v in $vals; do
      name="$a-${v//,/_}"
      if [ "$v" = "${base[$a]}" ]; then
        ln -sfn baseline "$out/$name"
        printf '%s\t%s\t%s\t%s\t%s\n' "$a" "$v" baseline "${status[baseline]}" "${seconds[baseline]}" >>"$out/runs.tsv"
        continue
      fi
      # shellcheck disable=SC2046  # flags_of's words are the flags
      run_one "$name" $(flags_of "$a" "$v")
      printf '%s\t%s\t%s\t%s\t%s\n' "$a" "$v" "$name" "${status[$name]}" "${seconds[$name]}" >>"$out/runs.tsv"
    done
  done
fi

log "report"
if ! "$PY" -c 'import matplotlib' 2>/dev/null && [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3; fi
"$PY" "$ROOT/bench/report.py" sweep --dir "$out" || die "bench/report.py sweep --dir $out failed"
log "done: $out/sweep.md ($failed failed run(s))"
[ "$failed" -eq 0 ] || exit 1
