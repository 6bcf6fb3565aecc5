#!/usr/bin/env bash
# Checks the systemd units of configs/systemd/ with `systemd-analyze verify`, the programs installed where the
# units name them: `cmake --install` into a temporary root at /opt/odmoe, the units in its /etc/systemd/system,
# and `systemd-analyze verify --root=` on each (the worker template as an instance). Fails on a non-zero exit
# and on any line verify prints (an unknown key is only a warning there). Exit 77 (skipped) without
# systemd-analyze.
# usage: verify_systemd_units.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2
# TimeoutStopSec must cover the drain of configs/testbed.toml's [cluster] shutdown_timeout_ms (10000 when
# unset) plus 5 s for the rest of the stop, or systemd kills a daemon whose calls are still finishing.
drain_ms=$(sed -n 's/^shutdown_timeout_ms *= *\([0-9]*\).*/\1/p' "$src/configs/testbed.toml")
drain_ms=${drain_ms:-10000}
for unit in "$src"/configs/systemd/*.service; do
  stop_s=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s$/\1/p' "$unit")
  if [ -z "$stop_s" ] || [ $((stop_s * 1000)) -lt $((drain_ms + 5000)) ]; then
    echo "$(basename "$unit"): TimeoutStopSec=${stop_s:-?}s does not cover shutdown_timeout_ms = $drain_ms + 5 s"
    exit 1
  fi
done
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIP: systemd-analyze is not installed (Debian package systemd); the units were not checked"
  exit 77
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
cmake --install "$build" --prefix "$root/opt/odmoe" >"$root/install.log" 2>&1 || { cat "$root/install.log"; exit 1; }
mkdir -p "$root/etc/systemd/system" "$root/usr/lib/systemd/system"
cp "$src"/configs/systemd/*.service "$root/etc/systemd/system/"
# The targets the units order themselves against, from this machine (without their .wants folders).
for t in /usr/lib/systemd/system/*.target; do cp -L "$t" "$root/usr/lib/systemd/system/"; done
status=0
# What operators rely on (README, Operations), beyond what verify checks.
required=("Type=notify" "WatchdogSec=" "Restart=on-failure" "StartLimitIntervalSec=" "StartLimitBurst="
  "TimeoutStartSec=" "EnvironmentFile=-/etc/default/odmoe" "User=odmoe" "LimitMEMLOCK=infinity"
  "DeviceAllow=char-nvidia" "RemoveIPC=no")
# Settings that would hide the GPU, break CUDA's JIT or remove the workers' shared memory.
forbidden='^(PrivateDevices|MemoryDenyWriteExecute|DynamicUser|PrivateIPC)=(yes|true|1|on)'
for unit in "$src"/configs/systemd/*.service; do
  name=$(basename "$unit")
  for key in "${required[@]}"; do
    grep -q "^$key" "$unit" || { echo "$name: no $key"; status=1; }
  done
  if grep -Eq "$forbidden" "$unit"; then
    echo "$name: $(grep -E "$forbidden" "$unit")"
    status=1
  fi
  [[ $name == *@.service ]] && name=${name/@.service/@worker0.service}
  for program in $(sed -n 's|^ExecStart=\([^ ]*\).*|\1|p' "$unit"); do
    [ -x "$root$program" ] || { echo "$name: $program is not installed by cmake --install"; status=1; }
  done
  out=$(systemd-analyze verify --root="$root" "$name" 2>&1) || { echo "$name: systemd-analyze verify failed"; status=1; }
  if [ -n "$out" ]; then
    echo "$name:"
    echo "$out"
    status=1
  else
    echo "$name: verified"
  fi
done
exit $status
