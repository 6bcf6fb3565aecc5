#!/usr/bin/env bash
# The first run on a fresh Debian machine: installs dependencies, builds, brings up the local cluster of
# configs/local.toml (main, shadow and 8 workers on loopback) with the model shipped in
# models/demo-mixtral-kjv (no download), generates text through it, and stops the cluster again.
# Arguments replace the default prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
prompt=${*:-"In the beginning God created the heaven and the earth."}
config=configs/local.toml

up=$(build/bin/odmoe cluster up --config "$config")
echo "$up"
trap 'build/bin/odmoe cluster down --config "$config"' EXIT
endpoint=$(sed -n 's/^grpc: //p' <<<"$up")

echo "prompt: $prompt"
build/bin/odmoe generate --endpoint "$endpoint" --prompt "$prompt" --max-new-tokens 64
