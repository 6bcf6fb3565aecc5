#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ (clang-14, -fsanitize=fuzzer,address,undefined; the build is
# scripts/sanitize.sh asan's build-asan/, so CI compiles odmoe under ASan once) and runs each one for a fixed
# number of executions, starting from its seeds (fuzz/corpus/<target>/) and every input that ever crashed it
# (fuzz/regressions/<target>/). Fails on any crash, sanitizer report, leak, timeout or out-of-memory.
#
#   scripts/fuzz.sh [target...]      default: every target
#
# Env: FUZZ_RUNS (executions per target, default 100000), JOBS (targets fuzzed at once, default nproc),
# BUILD_DIR (default build-asan), FUZZ_SEED (libFuzzer -seed, default 1: CI runs are reproducible).
# A crashing input is saved as fuzz/regressions/<target>/crash-<sha1> (printed in hex in the log too): keep it
# in the repository with the fix, and ctest replays it from then on (test fuzz_regressions.<target>).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-asan}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
runs=${FUZZ_RUNS:-100000}
seed=${FUZZ_SEED:-1}

all_targets=(safetensors_fuzzer model_config_fuzzer cluster_config_fuzzer tokenizer_fuzzer hf_tokenizer_fuzzer rpc_tensor_fuzzer
  worker_request_fuzzer prefetch_request_fuzzer generate_request_fuzzer follow_message_fuzzer
  openai_request_fuzzer json_schema_fuzzer)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")

BUILD_DIR=$build SANITIZE_TARGETS="${targets[*]}" bash scripts/sanitize.sh asan

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:halt_on_error=1:strict_string_checks=1:print_summary=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
logs="$build/fuzz-logs"
mkdir -p "$logs"

# Runs one target; prints one summary line, or the log's tail and the crashing input on failure.
fuzz_one() {
  local t=$1
  local work="$build/fuzz-corpus/$t"  # new coverage goes here, never into the repository's seeds
  mkdir -p "$work" "fuzz/regressions/$t"
  local start=$SECONDS
  if "$build/fuzz/$t" -runs="$runs" -seed="$seed" -timeout=25 -rss_limit_mb=2560 -max_len=8192 \
      -print_final_stats=1 -artifact_prefix="fuzz/regressions/$t/" \
      "$work" "fuzz/corpus/$t" "fuzz/regressions/$t" >"$logs/$t.log" 2>&1; then
    local execs
    execs=$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$logs/$t.log" | grep -o '[0-9]*$' || echo "?")
    echo "fuzz: $t: ok, $execs executions in $((SECONDS - start)) s"
  else
    echo "fuzz: $t: FAILED after $((SECONDS - start)) s; the end of $logs/$t.log:"
    tail -n 60 "$logs/$t.log"
    for f in $(grep -o "fuzz/regressions/$t/[a-z]*-[0-9a-f]*" "$logs/$t.log" | sort -u); do
      [ -f "$f" ] || continue
      echo "fuzz: $t: crashing input $f ($(stat -c %s "$f") bytes), hex:"
      od -An -tx1 -v "$f" | head -n 64
    done
    return 1
  fi
}
export -f fuzz_one
export build runs seed logs

printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} bash -c 'fuzz_one "$@"' _ {} || {
  echo "fuzz: FAILED (a crashing input is kept under fuzz/regressions/<target>/; see above)" >&2
  exit 1
}
echo "fuzz: all ${#targets[@]} targets passed $runs executions each"
