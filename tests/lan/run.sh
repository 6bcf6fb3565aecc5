#!/usr/bin/env bash
# The LAN harness: the ten daemons of configs/local.toml's topology (main, shadow, 8 workers), each in its own
# network namespace, joined by veth pairs to a bridge that lives in a namespace of its own, every link shaped
# with `tc tbf` (both directions), random loss with `iptables -m statistic` where asked. Addresses come from
# 10.77.0.0/24 and exist only inside these namespaces: nothing touches the host's network. A client namespace on
# the same bridge runs the requests.
#
#   tests/lan/run.sh                       runs the scenarios, ends with "N passed, N failed"
#   tests/lan/run.sh --up [--rate 1gbit] [--loss PERCENT]
#                                          brings the shaped cluster up, prints the grpc:/metrics: lines of
#                                          `odmoe cluster up`, and leaves it running
#   tests/lan/run.sh --down                takes it down (processes, namespaces, /dev/shm segments)
#
# Clients reach the cluster from the client namespace, e.g.
#   ip netns exec odmoe-lan-client build/bin/odmoe generate --endpoint 10.77.0.10:7100 --prompt "And God said" \
#       --max-new-tokens 32
#
# Scenarios (each a function scenario_NAME; run in the order of SCENARIOS below):
#   baseline    tokens through the 1 Gbit/s links equal the single-process engine's (odmoe generate --model)
#   idle        the cluster idle for ODMOE_LAN_IDLE_S seconds (default 120) logs no GOAWAY (keepalive pings
#               accepted by every server)
#   kill, stop, partition
#               SIGKILL / SIGSTOP / iptables DROP of one worker: main logs it down within 2 s (the time is
#               printed, from main's log line), a request in flight fails within 2.5 s of the fault and a new
#               one within 0.5 s of its arrival (main's log times), both naming the worker (client exit code
#               9), readiness turns NOT_SERVING; then the worker comes back (restart / SIGCONT / rules removed)
#               and a request gives the engine's tokens again
#
# Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), iproute2, iptables, the build (build/bin) and the demo model in
# ../shared/models (or ODMOE_LAN_MODEL). Bounded: the whole run stops after ODMOE_LAN_TIMEOUT_S seconds
# (default 600), every wait has its own limit, and everything is removed on exit, also on SIGINT/SIGTERM.
#
# Exit codes: 0 every scenario passed (--up/--down: done); 1 a scenario failed; 2 bad command line; 3 the build
# or the model is missing; 5 the cluster did not come up; 77 this machine does not permit network namespaces
# (or lacks ip/tc/iptables; one line says which); 124 the time limit was reached.
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
TOKENS=24
SCENARIOS=(baseline idle kill stop partition)

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

write_cluster_file() {
  local f=$STATE/cluster.toml
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
  mkdir -p "$STATE/logs"
  write_cluster_file
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

reference_tokens() {
  timeout 120 "$BIN/odmoe" generate --model "$MODEL" --prompt "$PROMPT" --max-new-tokens "$TOKENS" --ignore-eos \
    --json | tokens_of
}

# One request through the cluster from the client namespace: its JSON on stdout, its error on stderr. With a
# third argument, that is its request id (main's log lines about it carry "request_id=ID").
remote() {
  local max=$1 timeout_s=$2 id=${3:-}
  timeout "$timeout_s" ip netns exec "$(ns client)" "$BIN/odmoe" generate --endpoint "${IP[main]}:$GRPC_PORT" \
    --prompt "$PROMPT" --max-new-tokens "$max" --ignore-eos --json --timeout-ms $((timeout_s * 1000)) \
    ${id:+--request-id "$id"}
}

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
REFERENCE=""
pass() {
  PASSED=$((PASSED + 1))
  echo "PASS $*"
}
fail() {
  FAILED=$((FAILED + 1))
  echo "FAIL $*"
}

scenario_baseline() {
  local got
  got=$(remote "$TOKENS" 60 | tokens_of)
  if [ -n "$REFERENCE" ] && [ "$got" = "$REFERENCE" ]; then
    pass "baseline: $TOKENS tokens through 1 Gbit/s links equal the single-process engine's"
  else
    fail "baseline: cluster tokens [$got] differ from the single-process engine's [$REFERENCE]"
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

# Applies fault `kind` to the victim: kill | stop | partition.
fault_apply() {
  case $1 in
    kill)
      local pid
      pid=$(pid_of "$VICTIM")
      kill -KILL "$pid" || return 1
      { wait "$pid"; } 2>/dev/null # reaped here: no "Killed" line from bash; its status is 137
      return 0
      ;;
    stop) kill -STOP "$(pid_of "$VICTIM")" ;;
    partition)
      in_ns "$VICTIM" iptables -I INPUT -i eth0 -j DROP &&
        in_ns "$VICTIM" iptables -I OUTPUT -o eth0 -j DROP
      ;;
  esac
}

fault_clear() {
  case $1 in
    kill) start_node "$VICTIM" ;;
    stop) kill -CONT "$(pid_of "$VICTIM")" ;;
    partition)
      in_ns "$VICTIM" iptables -D INPUT -i eth0 -j DROP
      in_ns "$VICTIM" iptables -D OUTPUT -o eth0 -j DROP
      ;;
  esac
}

# One fault of the victim: detection time, the in-flight request and a new one failing fast naming it,
# readiness, recovery. Times are main's (its log lines' timestamps), not the client's: on a loaded machine a
# client process alone may take seconds to start.
detect() {
  local kind=$1 ok=1 why=""
  local offset out_dir run=$RANDOM
  offset=$(log_size)
  out_dir=$STATE/requests/$kind
  mkdir -p "$out_dir"
  # A long request in flight when the fault comes.
  local id_inflight=lan-$kind-$run-inflight id_new=lan-$kind-$run-new
  remote 1500 90 "$id_inflight" >"$out_dir/inflight.json" 2>"$out_dir/inflight.err" &
  local inflight=$!
  if ! wait_main_log "$offset" "request_id=$id_inflight request from" 30 >/dev/null; then
    fail "$kind: the request in flight did not reach main"
    kill "$inflight" 2>/dev/null
    return
  fi
  pause 0.5
  local t0
  t0=$(now)
  fault_apply "$kind" || {
    fail "$kind: could not apply the fault"
    return
  }
  local line detection="" t_inflight="" t_new=""
  if line=$(wait_main_log "$offset" "peer $VICTIM at .* is down" 10); then
    detection=$(elapsed "$t0" "$(line_time "$line")")
    less_than "$detection" 2.0 || {
      ok=0
      why+=" detection took ${detection} s;"
    }
  else
    ok=0
    why+=" main never logged $VICTIM down;"
  fi
  # The request in flight fails within 2.5 s of the fault, naming the worker.
  if line=$(wait_main_log "$offset" "request_id=$id_inflight finished: " 30); then
    t_inflight=$(elapsed "$t0" "$(line_time "$line")")
  fi
  wait "$inflight"
  local rc_inflight=$?
  if [ $rc_inflight -ne 9 ] || ! grep -q "$VICTIM" "$out_dir/inflight.err" || ! less_than "${t_inflight:-99}" 2.5; then
    ok=0
    why+=" request in flight: exit $rc_inflight, ended ${t_inflight:-?} s after the fault: $(head -c 300 "$out_dir/inflight.err");"
  fi
  # A new request fails at once, naming the worker.
  remote "$TOKENS" 60 "$id_new" >"$out_dir/new.json" 2>"$out_dir/new.err"
  local rc_new=$? arrived ended
  if arrived=$(wait_main_log "$offset" "request_id=$id_new request from" 1) &&
    ended=$(wait_main_log "$offset" "request_id=$id_new finished: " 1); then
    t_new=$(elapsed "$(line_time "$arrived")" "$(line_time "$ended")")
  fi
  if [ $rc_new -ne 9 ] || ! grep -q "$VICTIM" "$out_dir/new.err" || ! less_than "${t_new:-99}" 0.5; then
    ok=0
    why+=" new request: exit $rc_new, answered in ${t_new:-?} s: $(head -c 300 "$out_dir/new.err");"
  fi
  # Readiness follows.
  if ! wait_main_log "$offset" "not ready: .*$VICTIM" 2 >/dev/null; then
    ok=0
    why+=" main did not turn not ready;"
  fi
  # Recovery: the worker back, main ready again, the engine's tokens again.
  local offset2
  offset2=$(log_size)
  fault_clear "$kind"
  if ! wait_main_log "$offset2" "peer $VICTIM at .* is up" 60 >/dev/null ||
    ! wait_main_log "$offset2" "\] ready: " 10 >/dev/null; then
    ok=0
    why+=" $VICTIM did not come back;"
  else
    local got
    got=$(remote "$TOKENS" 60 2>>"$out_dir/after.err" | tokens_of)
    if [ "$got" != "$REFERENCE" ]; then
      ok=0
      why+=" after recovery the tokens differ: [$got];"
    fi
  fi
  local summary="detected in ${detection:-?} s; the request in flight failed ${t_inflight:-?} s after the fault (exit $rc_inflight), a new one was refused in ${t_new:-?} s (exit $rc_new), both naming $VICTIM"
  if [ $ok -eq 1 ]; then
    pass "$kind of $VICTIM: $summary; main not ready meanwhile; recovered with the engine's tokens"
  else
    fail "$kind of $VICTIM: $summary;$why"
  fi
}

scenario_kill() { detect kill; }
scenario_stop() { detect stop; }
scenario_partition() { detect partition; }

# --- main -----------------------------------------------------------------------------------------------

usage() {
  sed -n '8,14p' "$0" >&2
  exit 2
}

MODE=run
RATE=1gbit
LOSS=0
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

check_environment

if [ "$MODE" = down ]; then
  teardown
  log "down: daemons stopped, namespaces $PREFIX-* and /dev/shm/odmoe-$CLUSTER-* removed"
  exit 0
fi

ip netns list | grep -q "^$PREFIX-" && die 5 "namespaces $PREFIX-* exist already (a cluster is up?): run $0 --down first"
rm -rf "$STATE"
mkdir -p "$STATE/logs"

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

REFERENCE=$(reference_tokens)
[ -n "$REFERENCE" ] || die 3 "the single-process engine gave no tokens (odmoe generate --model $MODEL)"
net_up "$RATE" "$LOSS" || die 5 "could not build the network (ip/tc/iptables failed)"
cluster_up || die 5 "the cluster did not come up; logs in $STATE/logs"
log "cluster up in $((SECONDS - START)) s: ${#NODES[@]} daemons in namespaces $PREFIX-*, links ${RATE}"
for s in "${SCENARIOS[@]}"; do "scenario_$s"; done
echo "$PASSED passed, $FAILED failed ($((SECONDS - START)) s)"
[ "$FAILED" -eq 0 ]
