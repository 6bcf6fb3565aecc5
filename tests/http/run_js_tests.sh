#!/usr/bin/env bash
# The OpenAI JavaScript SDK tests (tests/http/js/openai_sdk.test.mjs) as one ctest: installs the SDK at the
# version pinned in package-lock.json (`npm ci` into tests/http/js/node_modules, git-ignored; again only when the
# lockfile changes) and runs `node --test` against a loopback cluster the test brings up itself.
# Usage: run_js_tests.sh SOURCE_DIR BINARY_DIR SHARED_DIR. Exit 77 (skipped) without Node.js 18 or later.
set -euo pipefail
src=$1 bin=$2 shared=$3
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "skipped: node and npm are not installed (scripts/install-deps.sh installs them)"
  exit 77
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 18 ]; then
  echo "skipped: node $(node --version) is older than 18"
  exit 77
fi
if [ ! -f "$shared/models/tiny-mixtral-kjv/config.json" ]; then
  echo "skipped: $shared/models/tiny-mixtral-kjv is missing"
  exit 77
fi
cd "$src/tests/http/js"
if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --prefer-offline --no-audit --no-fund || {
    echo "npm ci failed in $PWD (the SDK comes from the npm registry: is it reachable?)" >&2
    exit 1
  }
fi
export ODMOE_BINARY_DIR=$bin ODMOE_SHARED_DIR=$shared
exec node --test openai_sdk.test.mjs
