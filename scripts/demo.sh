#!/usr/bin/env bash
# The first run on a fresh Debian machine: installs dependencies, builds, and generates text from the model
# shipped in models/demo-mixtral-kjv (no download). Arguments replace the default prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
prompt=${*:-"In the beginning God created the heaven and the earth."}
echo "prompt: $prompt"
build/bin/odmoe generate --model models/demo-mixtral-kjv --prompt "$prompt" --max-new-tokens 64
