#!/usr/bin/env bash
# Builds (if needed) and runs the whole test suite. Extra arguments go to ctest (e.g. -L unit, -R golden).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
bash scripts/build.sh
ctest --test-dir "$build" --output-on-failure -j "$jobs" "$@"
