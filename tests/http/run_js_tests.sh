#!/usr/bin/env bash
# The OpenAI JavaScript SDK tests (tests/http/js/openai_sdk.test.mjs) as one ctest: installs the SDK at the
# version pinned in package-lock.json (`npm ci` into tests/http/js/node_modules, git-ignored; again only when the
# lockfile changes) and runs `node --test` against a loopback cluster the test brings up itself.
# Usage: run_js_tests.sh SOURCE_DIR BINARY_DIR SHARED_DIR. Exit 77 (skipped) without Node.js 18 or later.
set -euo pipefail
src=$1 bin=$2 shared=$3
source "$src/tests/node_support.sh"
require_node
if [ ! -f "$shared/models/tiny-mixtral-kjv/config.json" ]; then
  echo "skipped: $shared/models/tiny-mixtral-kjv is missing"
  exit 77
fi
npm_ci_pinned "$src/tests/http/js" "the SDK"
cd "$src/tests/http/js"
export ODMOE_BINARY_DIR=$bin ODMOE_SHARED_DIR=$shared
exec node --test openai_sdk.test.mjs
