#!/usr/bin/env bash
# Runs the whole test suite of an existing build (build/ unless BUILD_DIR says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=$(nproc 2>/dev/null || echo 2)
[ "$jobs" -gt 2 ] && jobs=2
ctest --test-dir "$build" --output-on-failure -j "$jobs" "$@"
