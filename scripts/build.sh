#!/usr/bin/env bash
# Installs the Debian packages odmoe needs (once), configures and builds into build/ (or $BUILD_DIR).
# Idempotent: a second run only rebuilds what changed. Extra arguments go to CMake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
bash scripts/install-deps.sh
if [ ! -f "$build/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >"${TMPDIR:-/tmp}/odmoe-configure.log" 2>&1 || {
    cat "${TMPDIR:-/tmp}/odmoe-configure.log" >&2
    exit 1
  }
fi
cmake --build "$build" -j "$jobs"
