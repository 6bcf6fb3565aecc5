#!/usr/bin/env bash
# The LAN harness: the ten daemons of configs/local.toml's topology (main, shadow, 8 workers), each in its own
# network namespace, joined by veth pairs to a bridge that lives in a namespace of its own, every link shaped
# with `tc tbf` (both directions), random loss with `iptables -m statistic` where asked. Addresses come from
# 10.77.0.0/24 and exist only inside these namespaces: nothing touches the host's network. A client namespace on
# the same bridge runs the requests.
#
#   tests/lan/run.sh                       runs the scenarios, ends with "N passed, N failed"
#   tests/lan/run.sh --up [--config FILE] [--rate 1gbit] [--loss PERCENT]
#                                          brings the shaped cluster up, prints the grpc:/metrics: lines of
#                                          `odmoe cluster up`, and leaves it running
#   tests/lan/run.sh --down                takes it down (processes, namespaces, /dev/shm segments)
#
# --config FILE runs another cluster file's cluster on these links, e.g. configs/testbed-emulated.toml (timed
# devices at Mixtral-8x7B's shapes): the harness keeps its names and addresses and takes everything else from
# FILE: the [cluster] settings but the name (device_profiles, timing_model, time_scale, group_size, ...),
# [[device_profile]] tables, [shadow], [model] (ODMOE_LAN_MODEL overrides it) and each node's device,
# gpu_budget_mb and threads, matched by role and order (main, shadow, worker0..7); FILE must have 1 main,
# 1 shadow and 8 workers. tests/lan/cluster_file.py does the merge (python3 with tomllib, 3.11+; the harness
# reads the clients' JSON with python3 already); paths in FILE are made absolute. Without --config the
# workers run on mock-gpu and main and the shadow on cpu, with the demo model. The scenarios take --config too,
# but their time limits were chosen for mock-gpu workers.
#
# Clients reach the cluster from the client namespace, e.g.
#   ip netns exec odmoe-lan-client build/bin/odmoe generate --endpoint 10.77.0.10:7100 --prompt "And God said" \
#       --max-new-tokens 32
#
# Scenarios (each a function scenario_NAME; run in the order of SCENARIOS below). Every request is sent once
# (no client retries) and must give the single-process engine's tokens (odmoe generate --model):
#   baseline    a short and a long request through the 1 Gbit/s links, and one with a long prompt: the engine's
#               tokens; their times are what the faulted requests are compared with
#   idle        the cluster idle for ODMOE_LAN_IDLE_S seconds (default 120) logs no GOAWAY (keepalive pings
#               accepted by every server)
#   kill        SIGKILL of a worker during decode, restarted 10 s later: it rejoins
#   prefill     SIGKILL of a worker during the prefill of a long prompt, restarted at once
#   shadow      SIGKILL of the shadow during decode (on-demand loads meanwhile), restarted: it follows again
#   shadow_stop SIGSTOP of the shadow for 10 s during decode: main's stream to it is cancelled, not stalled
#   stop        SIGSTOP of a worker for 20 s, then SIGCONT
#   partition   iptables DROP of a worker's link for 20 s, then healed
#   loss        1% random loss on every link during a long request
# For each fault the script prints the detection time (main's log line "peer NAME ... is down", from the fault;
# a scenario fails above 2 s) and the faulted request's extra latency over its fault-free run; the request in
# flight must complete with the engine's tokens, its calls re-issued (stats.calls_reissued > 0 for a worker),
# and the node must rejoin (main's "worker NAME rejoined" / "peer shadow ... is up").
#
# Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), iproute2, iptables, the build (build/bin) and the demo model in
# ../shared/models (or ODMOE_LAN_MODEL). Bounded: the whole run stops after ODMOE_LAN_TIMEOUT_S seconds
# (default 600), every wait has its own limit, and everything is removed on exit, also on SIGINT/SIGTERM.
#
# Exit codes: 0 every scenario passed (--up/--down: done); 1 a scenario failed; 2 bad command line (or a
# --config FILE the harness cannot run); 3 the build or the model is missing (or python3 lacks tomllib, for
# --config); 5 the cluster did not come up; 77 this machine does not permit network namespaces (or lacks
# ip/tc/iptables; one line says which); 124 the time limit was reached.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${ODMOE_BIN:-$ROOT/build/bin}
MODEL=${ODMOE_LAN_MODEL:-$ROOT/../shared/models/demo-mixtral-kjv}
PREFIX=${ODMOE_LAN_PREFIX:-odmoe-lan}
STATE=${ODMOE_LAN_DIR:-/tmp/odmoe-lan}
IDLE_S=${ODMOE_LAN_IDLE_S:-120}
TIMEOUT_S=${ODMOE_LAN_TIMEOUT_S:-600}
SUBNET=10.77.0
GRPC_PORT=7100
METRICS_PORT=7190
HTTP_PORT=8000  # main's OpenAI API
CLUSTER=lan  # the cluster's name: /dev/shm/odmoe-lan-e1-* are its workers' segments
VICTIM=worker3
PROMPT="And God said"
TOKENS=24        # a short request
LONG_TOKENS=400  # the request in flight when a fault comes (seconds through the cluster)
# A long prompt (token ids of the demo model's 4096): its prefill is under way when the prefill fault comes.
PREFILL_IDS=$(seq -s, 5 7 4000 | cut -d, -f1-480)
PREFILL_TOKENS=8
SCENARIOS=(baseline idle kill prefill shadow shadow_stop stop partition loss)

NODES=(main shadow worker0 worker1 worker2 worker3 worker4 worker5 worker6 worker7)
declare -A IP=([client]=$SUBNET.2 [main]=$SUBNET.10 [shadow]=$SUBNET.11)
for w in 0 1 2 3 4 5 6 7; do IP[worker$w]=$SUBNET.$((20 + w)); done

log() { echo "lan: $*"; }
die() {
  local code=$1
  shift
  echo "lan: $*" >&2
  exit "$code"
}
ns() { echo "$PREFIX-$1"; }
in_ns() {
  local node=$1
  shift
  ip netns exec "$(ns "$node")" "$@"
}
role_of() {
  case $1 in
    main) echo main ;;
    shadow) echo shadow ;;
    *) echo worker ;;
  esac
}
now() { date +%s.%N; }
# sleep that lets the traps run (bash defers a trap until its foreground command ends).
pause() {
  sleep "$1" &
  wait $!
}
# Seconds between two `now` values, with millisecond precision.
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }
less_than() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }

# --- the network ----------------------------------------------------------------------------------------

check_environment() {
  for tool in ip tc iptables; do
    command -v "$tool" >/dev/null || die 77 "cannot run: '$tool' is not installed (iproute2, iptables)"
  done
  local probe err
  probe="$PREFIX-probe-$$"
  if ! err=$(ip netns add "$probe" 2>&1); then
    die 77 "cannot run: network namespaces are not permitted here (ip netns add: ${err:-failed}); run as root"
  fi
  ip netns del "$probe" 2>/dev/null
  [ -x "$BIN/odmoe-main" ] || die 3 "no build in $BIN (run: bash scripts/build.sh)"
  [ -f "$MODEL/config.json" ] || die 3 "no model at $MODEL (set ODMOE_LAN_MODEL)"
}

# Both directions of the link of `node` limited to `rate`: the node's egress (its eth0) and its ingress (the
# bridge's port towards it). tbf's burst must hold at least rate / HZ; 512 KiB does up to ~4 Gbit/s at HZ=1000.
shape() {
  local node=$1 rate=$2 port=$3
  in_ns "$node" tc qdisc replace dev eth0 root tbf rate "$rate" burst 512kb latency 50ms || return 1
  in_ns br tc qdisc replace dev "$port" root tbf rate "$rate" burst 512kb latency 50ms || return 1
}

net_up() {
  local rate=$1 loss=$2 i=0
  ip netns add "$(ns br)" || return 1
  in_ns br ip link set lo up
  in_ns br ip link add br0 type bridge || return 1
  in_ns br ip link set br0 up
  for node in client "${NODES[@]}"; do
    local port="p$i"
    ip netns add "$(ns "$node")" || return 1
    in_ns "$node" ip link set lo up
    ip link add "$port" netns "$(ns br)" type veth peer name eth0 netns "$(ns "$node")" || return 1
    in_ns br ip link set "$port" master br0 up || return 1
    in_ns "$node" ip addr add "${IP[$node]}/24" dev eth0 || return 1
    in_ns "$node" ip link set eth0 up || return 1
    shape "$node" "$rate" "$port" || return 1
    if [ "$loss" != 0 ]; then
      local p
      p=$(awk -v l="$loss" 'BEGIN { printf "%.4f", l / 100 }')
      in_ns "$node" iptables -A INPUT -i eth0 -m statistic --mode random --probability "$p" -j DROP || return 1
    fi
    i=$((i + 1))
  done
}

net_down() {
  for node in client "${NODES[@]}" br; do ip netns del "$(ns "$node")" 2>/dev/null; done
  return 0
}

# --- the cluster ----------------------------------------------------------------------------------------

# Writes STATE/cluster.toml: the harness's own, or with --config, FILE's settings on the harness's names and
# addresses (one line on stderr says why FILE cannot be used).
write_cluster_file() {
  if [ -n "$CONFIG" ]; then
    harness_cluster_file "$STATE/cluster.base.toml" || return 1
    python3 "$ROOT/tests/lan/cluster_file.py" merge "$STATE/cluster.base.toml" "$CONFIG" \
      ${ODMOE_LAN_MODEL:+--model "$MODEL"} >"$STATE/cluster.merged.toml" || return 1
    mv "$STATE/cluster.merged.toml" "$STATE/cluster.toml"
  else
    harness_cluster_file "$STATE/cluster.toml"
  fi
}

harness_cluster_file() {
  local f=$1
  {
    echo "# Generated by tests/lan/run.sh: configs/local.toml's topology, one network namespace per node."
    echo "[cluster]"
    echo "name = \"$CLUSTER\""
    echo "epoch = 1"
    echo "group_size = 2"
    echo "rpc_timeout_ms = 30000"
    echo "startup_timeout_ms = 60000"
    echo "[model]"
    echo "path = \"$MODEL\""
    echo "[shadow]"
    echo "mode = \"shadow\""
    echo "quant = \"int8\""
    for node in "${NODES[@]}"; do
      echo
      echo "[[node]]"
      echo "name = \"$node\""
      echo "role = \"$(role_of "$node")\""
      echo "address = \"${IP[$node]}:$GRPC_PORT\""
      echo "metrics_address = \"${IP[$node]}:$METRICS_PORT\""
      if [ "$node" = main ]; then echo "http_address = \"${IP[$node]}:$HTTP_PORT\""; fi
      if [ "$(role_of "$node")" = worker ]; then
        echo "device = \"mock-gpu\""
        echo "gpu_budget_mb = 1024"
      else
        echo "device = \"cpu\""
      fi
    done
  } >"$f"
}

# Starts the daemon of `node` in its namespace, appending to its log; its pid goes to STATE/NODE.pid.
start_node() {
  local node=$1
  ip netns exec "$(ns "$node")" "$BIN/odmoe-$(role_of "$node")" --config "$STATE/cluster.toml" --node "$node" \
    >>"$STATE/logs/$node.log" 2>&1 </dev/null &
  echo $! >"$STATE/$node.pid"
}

pid_of() { cat "$STATE/$1.pid" 2>/dev/null; }

# `odmoe cluster status` from the client namespace: 0 when every node is live and ready.
all_ready() { timeout 20 ip netns exec "$(ns client)" "$BIN/odmoe" cluster status --config "$STATE/cluster.toml" >/dev/null 2>&1; }

cluster_up() {
  for node in "${NODES[@]}"; do start_node "$node"; done
  local give_up=$((SECONDS + 180))
  until all_ready; do
    for node in "${NODES[@]}"; do
      kill -0 "$(pid_of "$node")" 2>/dev/null || {
        tail -n 5 "$STATE/logs/$node.log" >&2
        return 1
      }
    done
    [ $SECONDS -lt $give_up ] || return 1
    sleep 0.5
  done
}

print_endpoints() {
  echo "cluster '$CLUSTER' up in network namespaces $PREFIX-*: ${#NODES[@]} nodes serving; logs in $STATE/logs"
  [ -n "$CONFIG" ] && echo "settings, devices and model from $CONFIG (cluster file: $STATE/cluster.toml)"
  echo "grpc: ${IP[main]}:$GRPC_PORT"
  echo "http: ${IP[main]}:$HTTP_PORT"
  for node in "${NODES[@]}"; do echo "metrics: $node http://${IP[$node]}:$METRICS_PORT/metrics"; done
  echo "clients: ip netns exec $(ns client) $BIN/odmoe generate --endpoint ${IP[main]}:$GRPC_PORT ..."
}

# Stops every daemon (SIGCONT first: a stopped process keeps SIGTERM pending), then what is left.
cluster_down() {
  local pids=()
  for node in "${NODES[@]}"; do
    local pid
    pid=$(pid_of "$node") || continue
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && pids+=("$pid")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    kill -CONT "${pids[@]}" 2>/dev/null
    kill -TERM "${pids[@]}" 2>/dev/null
    local give_up=$((SECONDS + 10))
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $give_up ]; do sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null
    done
  fi
  # Daemons restarted by hand, and the shared segments nobody holds any more.
  [ -f "$STATE/cluster.toml" ] && timeout 30 "$BIN/odmoe" cluster down --config "$STATE/cluster.toml" >/dev/null 2>&1
  rm -f /dev/shm/odmoe-"$CLUSTER"-e*
  rm -f "$STATE"/*.pid
}

teardown() {
  cluster_down
  net_down
}

# --- requests -------------------------------------------------------------------------------------------

# The tokens of a JSON answer of `odmoe generate --json` (comma-separated), or nothing.
tokens_of() { python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["tokens"])))' 2>/dev/null; }

# The single-process engine's tokens for a request: `text` (the prompt) or `ids` (prompt ids), and its length.
engine_tokens() {
  local how=$1 prompt=$2 max=$3 flag=--prompt
  [ "$how" = ids ] && flag=--prompt-ids
  timeout 300 "$BIN/odmoe" generate --model "$MODEL" "$flag" "$prompt" --max-new-tokens "$max" --ignore-eos \
    --json | tokens_of
}

# One request through the cluster from the client namespace: its JSON on stdout, its error on stderr.
#   remote MAX TIMEOUT_S [ID [IDS]]: the text prompt, or prompt ids IDS; ID (optional) is its request id (main's
#   log lines about it carry "request_id=ID").
remote() {
  local max=$1 timeout_s=$2 id=${3:-} ids=${4:-}
  local prompt=(--prompt "$PROMPT")
  [ -n "$ids" ] && prompt=(--prompt-ids "$ids")
  timeout "$timeout_s" ip netns exec "$(ns client)" "$BIN/odmoe" generate --endpoint "${IP[main]}:$GRPC_PORT" \
    "${prompt[@]}" --max-new-tokens "$max" --ignore-eos --json --timeout-ms $((timeout_s * 1000)) \
    ${id:+--request-id "$id"}
}

# A field of the stats of a JSON answer (file), or nothing.
stat_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["stats"][sys.argv[2]])' "$1" "$2" 2>/dev/null; }

# Waits up to `limit` seconds for a line matching `pattern` in main's log after byte `offset`; prints it.
wait_main_log() {
  local offset=$1 pattern=$2 limit=$3 give_up line
  give_up=$(awk -v s="$(now)" -v l="$limit" 'BEGIN { printf "%.3f", s + l }')
  while less_than "$(now)" "$give_up"; do
    line=$(tail -c +"$((offset + 1))" "$STATE/logs/main.log" | grep -m1 -E "$pattern")
    [ -n "$line" ] && {
      echo "$line"
      return 0
    }
    sleep 0.05
  done
  return 1
}

# The time of a text log line "[2026-11-25 11:48:45.123] ..." (UTC) in seconds since the epoch.
line_time() { date -u -d "$(sed -E 's/^\[([0-9-]+ [0-9:.]+)\].*/\1/' <<<"$1")" +%s.%N; }

log_size() { stat -c %s "$STATE/logs/main.log"; }

# --- scenarios ------------------------------------------------------------------------------------------

PASSED=0
FAILED=0
pass() {
  PASSED=$((PASSED + 1))
  echo "PASS $*"
}
fail() {
  FAILED=$((FAILED + 1))
  echo "FAIL $*"
}

# The requests of the failover scenarios and their fault-free times (set by baseline).
declare -A REF=() BASE_MS=()

# Runs request `kind` (short | long | prefill) with id `id`, JSON into `out`, error into `err`; returns its exit
# code.
run_request() {
  local kind=$1 id=$2 out=$3 err=$4
  case $kind in
    short) remote "$TOKENS" 60 "$id" >"$out" 2>"$err" ;;
    long) remote "$LONG_TOKENS" 120 "$id" >"$out" 2>"$err" ;;
    prefill) remote "$PREFILL_TOKENS" 120 "$id" "$PREFILL_IDS" >"$out" 2>"$err" ;;
  esac
}

scenario_baseline() {
  local ok=1 why="" times=""
  # The long request twice: the second, warm, run is the fault-free time (the first pays the workers' first
  # loads from host memory).
  for kind in short long long prefill; do
    local out=$STATE/requests/baseline-$kind.json
    mkdir -p "$STATE/requests"
    run_request "$kind" "lan-baseline-$kind-$RANDOM" "$out" "$out.err"
    local got
    got=$(tokens_of <"$out")
    if [ -z "${REF[$kind]}" ] || [ "$got" != "${REF[$kind]}" ]; then
      ok=0
      why+=" $kind: cluster tokens [$(head -c 200 <<<"$got")] differ from the engine's: $(head -c 300 "$out.err");"
    fi
    BASE_MS[$kind]=$(stat_of "$out" total_ms)
    times+=" $kind ${BASE_MS[$kind]%.*} ms;"
  done
  if [ $ok -eq 1 ]; then
    pass "baseline: $TOKENS and $LONG_TOKENS tokens, and $PREFILL_TOKENS after a prompt of $(($(tr -cd , <<<"$PREFILL_IDS" | wc -c) + 1)) ids, through 1 Gbit/s links: the single-process engine's tokens;$times"
  else
    fail "baseline:$why"
  fi
}

scenario_idle() {
  local before
  before=$(cat "$STATE"/logs/*.log | grep -ci goaway)
  log "idle for $IDLE_S s"
  pause "$IDLE_S"
  local after
  after=$(cat "$STATE"/logs/*.log | grep -ci goaway)
  if [ "$after" -eq "$before" ] && all_ready; then
    pass "idle: $IDLE_S s idle, no GOAWAY logged by any node, every node still ready"
  else
    fail "idle: $((after - before)) GOAWAY lines logged in $IDLE_S s idle (or a node not ready):"
    grep -hi goaway "$STATE"/logs/*.log | tail -n 3
  fi
}

# Applies fault `kind` (kill | stop | partition) to node `target`.
fault_apply() {
  local kind=$1 target=$2
  case $kind in
    kill)
      local pid
      pid=$(pid_of "$target")
      kill -KILL "$pid" || return 1
      { wait "$pid"; } 2>/dev/null # reaped here: no "Killed" line from bash; its status is 137
      return 0
      ;;
    stop) kill -STOP "$(pid_of "$target")" ;;
    partition)
      in_ns "$target" iptables -I INPUT -i eth0 -j DROP &&
        in_ns "$target" iptables -I OUTPUT -o eth0 -j DROP
      ;;
  esac
}

fault_clear() {
  local kind=$1 target=$2
  case $kind in
    kill) start_node "$target" ;;
    stop) kill -CONT "$(pid_of "$target")" ;;
    partition)
      in_ns "$target" iptables -D INPUT -i eth0 -j DROP
      in_ns "$target" iptables -D OUTPUT -o eth0 -j DROP
      ;;
  esac
}

# One fault during a request: `name` (the scenario), `kind` (kill | stop | partition) of node `target` during
# request `request` (long | prefill), lifted `hold` seconds after it came. The request completes with the
# engine's tokens; main detects the fault within 2 s; the node rejoins and the next request is exact again.
# Times are main's (its log lines' timestamps), not the client's: on a loaded machine a client process alone
# may take seconds to start.
failover() {
  local name=$1 kind=$2 target=$3 request=$4 hold=$5 ok=1 why=""
  local offset dir id
  offset=$(log_size)
  dir=$STATE/requests/$name
  id=lan-$name-$RANDOM
  mkdir -p "$dir"
  run_request "$request" "$id" "$dir/faulted.json" "$dir/faulted.err" &
  local inflight=$!
  if ! wait_main_log "$offset" "request_id=$id request from" 30 >/dev/null; then
    fail "$name: the request did not reach main"
    kill "$inflight" 2>/dev/null
    return
  fi
  [ "$request" = long ] && pause 0.5  # into decode (the short text prompt's prefill is over at once)
  local t0
  t0=$(now)
  fault_apply "$kind" "$target" || {
    fail "$name: could not apply the fault"
    return
  }
  local line detection=""
  if line=$(wait_main_log "$offset" "peer $target at .* is down" 10); then
    detection=$(elapsed "$t0" "$(line_time "$line")")
    less_than "$detection" 2.0 || {
      ok=0
      why+=" detection took ${detection} s;"
    }
  else
    ok=0
    why+=" main never logged $target down;"
  fi
  wait "$inflight"
  local rc=$? got reissued extra=""
  got=$(tokens_of <"$dir/faulted.json")
  reissued=$(stat_of "$dir/faulted.json" calls_reissued)
  if [ $rc -ne 0 ] || [ "$got" != "${REF[$request]}" ]; then
    ok=0
    why+=" the request in flight: exit $rc, tokens differ: $(head -c 300 "$dir/faulted.err");"
  else
    extra=$(awk -v a="$(stat_of "$dir/faulted.json" total_ms)" -v b="${BASE_MS[$request]}" \
      'BEGIN { printf "in %.0f ms (fault-free %.0f ms, %+.0f ms)", a, b, a - b }')
  fi
  if [ "$(role_of "$target")" = worker ] && [ "${reissued:-0}" = 0 ]; then
    ok=0
    why+=" no call was re-issued (the fault missed the request?);"
  fi
  # Lift the fault `hold` seconds after it came; the node rejoins.
  local left
  left=$(awk -v t0="$t0" -v h="$hold" -v n="$(now)" 'BEGIN { d = t0 + h - n; printf "%.3f", (d > 0 ? d : 0) }')
  pause "$left"
  local offset2 back="peer $target at .* is up"
  offset2=$(log_size)
  [ "$(role_of "$target")" = worker ] && back="worker $target rejoined"
  fault_clear "$kind" "$target"
  if ! wait_main_log "$offset2" "$back" 60 >/dev/null; then
    ok=0
    why+=" $target did not rejoin;"
  else
    run_request short "$id-after" "$dir/after.json" "$dir/after.err"
    if [ "$(tokens_of <"$dir/after.json")" != "${REF[short]}" ]; then
      ok=0
      why+=" after it rejoined the tokens differ: $(head -c 300 "$dir/after.err");"
    fi
    if [ "$(role_of "$target")" = shadow ] && [ "$(stat_of "$dir/after.json" predictions_received)" = 0 ]; then
      ok=0
      why+=" the shadow predicted nothing after its restart;"
    fi
  fi
  local summary="$kind of $target during the $request request: detected in ${detection:-?} s; the request completed with the engine's tokens ${extra:-?}, ${reissued:-0} calls re-issued; lifted after $hold s, $target rejoined"
  if [ $ok -eq 1 ]; then
    pass "$name: $summary"
  else
    fail "$name: $summary;$why"
  fi
}

scenario_kill() { failover kill kill "$VICTIM" long 10; }
scenario_prefill() { failover prefill kill worker5 prefill 0; }
scenario_shadow() { failover shadow kill shadow long 0; }
scenario_shadow_stop() { failover shadow_stop stop shadow long 10; }
scenario_stop() { failover stop stop "$VICTIM" long 20; }
scenario_partition() { failover partition partition worker6 long 20; }

# 1% random loss on every link (each namespace drops 1% of what it receives) during a long request.
scenario_loss() {
  local dir=$STATE/requests/loss offset changes
  mkdir -p "$dir"
  offset=$(log_size)
  for node in client "${NODES[@]}"; do
    in_ns "$node" iptables -I INPUT -i eth0 -m statistic --mode random --probability 0.01 -j DROP
  done
  run_request long "lan-loss-$RANDOM" "$dir/faulted.json" "$dir/faulted.err"
  local rc=$?
  for node in client "${NODES[@]}"; do
    in_ns "$node" iptables -D INPUT -i eth0 -m statistic --mode random --probability 0.01 -j DROP
  done
  changes=$(tail -c +"$((offset + 1))" "$STATE/logs/main.log" | grep -c "membership epoch")
  local extra
  extra=$(awk -v a="$(stat_of "$dir/faulted.json" total_ms)" -v b="${BASE_MS[long]}" \
    'BEGIN { printf "in %.0f ms (fault-free %.0f ms, %+.0f ms)", a, b, a - b }')
  if [ $rc -eq 0 ] && [ "$(tokens_of <"$dir/faulted.json")" = "${REF[long]}" ]; then
    pass "loss: 1% on every link during the long request: the engine's tokens $extra; detection: no node lost ($changes membership changes)"
  else
    fail "loss: exit $rc, tokens differ: $(head -c 300 "$dir/faulted.err")"
  fi
}

# --- main -----------------------------------------------------------------------------------------------

usage() {
  sed -n '8,22p' "$0" >&2
  exit 2
}

MODE=run
RATE=1gbit
LOSS=0
CONFIG=""
while [ $# -gt 0 ]; do
  case $1 in
    --up) MODE=up ;;
    --down) MODE=down ;;
    --rate)
      [ $# -ge 2 ] || usage
      RATE=$2
      shift
      ;;
    --loss)
      [ $# -ge 2 ] || usage
      LOSS=$2
      shift
      ;;
    --config)
      [ $# -ge 2 ] || usage
      CONFIG=$2
      shift
      ;;
    -h | --help) usage ;;
    *)
      echo "lan: unknown argument '$1'" >&2
      usage
      ;;
  esac
  shift
done
[[ $RATE =~ ^[0-9]+(k|m|g)?bit$ ]] || die 2 "--rate '$RATE': expected e.g. 1gbit, 100mbit"
[[ $LOSS =~ ^[0-9]+(\.[0-9]+)?$ ]] || die 2 "--loss '$LOSS': expected a percentage, e.g. 0.5"
if [ -n "$CONFIG" ]; then
  [ "$MODE" != down ] || die 2 "--config goes with --up or the scenarios, not --down"
  [ -f "$CONFIG" ] || die 2 "--config '$CONFIG': no such file"
  python3 -c 'import tomllib' 2>/dev/null || die 3 "--config needs python3 with tomllib (3.11 or later)"
  if [ -z "${ODMOE_LAN_MODEL:-}" ]; then
    config_model=$(python3 "$ROOT/tests/lan/cluster_file.py" model "$CONFIG") || exit 2
    [ -n "$config_model" ] && MODEL=$config_model
  fi
fi

check_environment

if [ "$MODE" = down ]; then
  teardown
  log "down: daemons stopped, namespaces $PREFIX-* and /dev/shm/odmoe-$CLUSTER-* removed"
  exit 0
fi

ip netns list | grep -q "^$PREFIX-" && die 5 "namespaces $PREFIX-* exist already (a cluster is up?): run $0 --down first"
rm -rf "$STATE"
mkdir -p "$STATE/logs"
write_cluster_file || die 2 "no cluster file written${CONFIG:+ from $CONFIG}"

if [ "$MODE" = up ]; then
  trap 'teardown; exit 130' INT TERM
  net_up "$RATE" "$LOSS" || {
    teardown
    die 5 "could not build the network (ip/tc/iptables failed)"
  }
  cluster_up || {
    teardown
    die 5 "the cluster did not come up; logs in $STATE/logs"
  }
  trap - INT TERM
  print_endpoints
  exit 0
fi

# The scenarios, bounded in time and cleaned up whatever happens.
START=$SECONDS
( sleep "$TIMEOUT_S" && kill -TERM $$ ) 2>/dev/null &
WATCHDOG=$!
on_exit() {
  local code=$?
  pkill -P "$WATCHDOG" 2>/dev/null  # its sleep
  kill "$WATCHDOG" 2>/dev/null
  teardown
  exit $code
}
trap on_exit EXIT
trap 'echo "lan: interrupted"; exit 130' INT
trap 'echo "lan: stopped at the time limit (${TIMEOUT_S} s) or by SIGTERM"; exit 124' TERM

REF[short]=$(engine_tokens text "$PROMPT" "$TOKENS")
REF[long]=$(engine_tokens text "$PROMPT" "$LONG_TOKENS")
REF[prefill]=$(engine_tokens ids "$PREFILL_IDS" "$PREFILL_TOKENS")
[ -n "${REF[short]}" ] && [ -n "${REF[long]}" ] && [ -n "${REF[prefill]}" ] ||
  die 3 "the single-process engine gave no tokens (odmoe generate --model $MODEL)"
net_up "$RATE" "$LOSS" || die 5 "could not build the network (ip/tc/iptables failed)"
cluster_up || die 5 "the cluster did not come up; logs in $STATE/logs"
log "cluster up in $((SECONDS - START)) s: ${#NODES[@]} daemons in namespaces $PREFIX-*, links ${RATE}"
for s in "${SCENARIOS[@]}"; do "scenario_$s"; done
echo "$PASSED passed, $FAILED failed ($((SECONDS - START)) s)"
[ "$FAILED" -eq 0 ]
