#!/usr/bin/env bash
# Installs every Debian package odmoe needs to build and test. Idempotent and quiet on success:
# packages already present are skipped without touching apt.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev
  libabsl-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  nlohmann-json3-dev libtomlplusplus-dev
  libicu-dev
  clang-14 libclang-rt-14-dev
  python3
  libsystemd-dev
  libcpp-httplib-dev
  python3-prometheus-client
  python3-yaml
  python3-jsonschema
  docker-compose
  python3-matplotlib
  curl
  iproute2
  iptables
)
# The OpenAI SDK tests (tests/http/js) need Node.js >= 18 and npm: Debian's, unless a node is already installed
# (e.g. from NodeSource, whose package replaces Debian's npm).
if ! command -v node >/dev/null; then
  packages+=(nodejs npm)
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  log=$(mktemp)
  if ! { $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-deps: failed to install: ${missing[*]}" >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
fi

# Prometheus and promtool, its rule checker and rule unit tester (tests/ops/prometheus_rules.sh, prometheus_live.py),
# from Debian's prometheus package unpacked into .tools/bin: installing the package would also start a server.
root=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$root/.tools/bin/promtool" ] || [ ! -x "$root/.tools/bin/prometheus" ]; then
  tmp=$(mktemp -d)
  fetch() { (cd "$tmp" && apt-get download -q prometheus) >"$tmp/log" 2>&1; }
  if { fetch || { $sudo apt-get update -q >/dev/null 2>&1 && fetch; }; } && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"; then
    install -D -m 0755 "$tmp/x/usr/bin/promtool" "$root/.tools/bin/promtool"
    install -D -m 0755 "$tmp/x/usr/bin/prometheus" "$root/.tools/bin/prometheus"
  else
    # Not fatal: the build does not need it, and the test that does says it is missing.
    echo "install-deps: could not fetch Debian's prometheus package: $(tail -1 "$tmp/log")" >&2
  fi
  rm -rf "$tmp"
fi
