#!/usr/bin/env bash
# Makes the TLS material of a cluster with openssl: a CA (once per folder) and one certificate per node (or
# client), each signed by the CA with its name as SAN (DNS:NAME, which the nodes check: src/rpc/security.h).
#
#   scripts/make-certs.sh [--out DIR] [--days N] [--expired] [--new-ca] NAME[=HOST,HOST...] ...
#
#   --out DIR   where to write (default ./tls): ca.crt, ca.key, NAME.crt, NAME.key (keys mode 600)
#   --days N    validity of the certificates made now (default 825); the CA gets 3650 days
#   --expired   certificates whose validity ended yesterday (for tests: peers must refuse them)
#   --new-ca    make a new CA even if DIR already holds one (certificates of the old one stop working)
#   NAME=HOSTS  extra SANs: IP addresses (IP:) or host names (DNS:), for clients that dial by host name
#
# Example, the ten-node testbed (configs/testbed.toml) and one operator:
#   scripts/make-certs.sh --out /etc/odmoe/tls main shadow worker{0..7} operator
# then copy ca.crt and each node's NAME.crt/NAME.key to its host (the CA key stays off the cluster).
set -euo pipefail

out=tls
days=825
expired=0
new_ca=0
names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --days) days=${2:?--days needs a number}; shift 2 ;;
    --expired) expired=1; shift ;;
    --new-ca) new_ca=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "make-certs.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) names+=("$1"); shift ;;
  esac
done
if ! [[ "$days" =~ ^[1-9][0-9]*$ ]]; then
  echo "make-certs.sh: --days must be a positive number, got '$days'" >&2
  exit 2
fi
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }

mkdir -p "$out"
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$new_ca" = 1 ] || [ ! -f "$out/ca.crt" ] || [ ! -f "$out/ca.key" ]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$out/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$out/ca.key" -sha256 -days 3650 -subj "/CN=odmoe cluster CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$out/ca.crt"
  chmod 644 "$out/ca.crt"
  echo "make-certs.sh: CA $out/ca.crt"
fi

# `openssl ca` (rather than `x509 -req`) so that the validity window can lie in the past (--expired).
touch "$work/index.txt"
cat >"$work/ca.cnf" <<EOF
[ca]
default_ca = odmoe
[odmoe]
database = $work/index.txt
new_certs_dir = $work
certificate = $out/ca.crt
private_key = $out/ca.key
default_md = sha256
policy = anything
unique_subject = no
copy_extensions = none
rand_serial = yes
[anything]
commonName = supplied
EOF

for spec in "${names[@]}"; do
  name=${spec%%=*}
  hosts=""
  [ "$spec" != "$name" ] && hosts=${spec#*=}
  if ! [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
    echo "make-certs.sh: '$name' is not a node name (letters, digits, '.', '_', '-')" >&2
    exit 2
  fi
  san="DNS:$name"
  IFS=, read -r -a extra <<<"$hosts"
  for h in "${extra[@]}"; do
    [ -z "$h" ] && continue
    if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
  done
  openssl ecparam -name prime256v1 -genkey -noout -out "$out/$name.key" 2>/dev/null
  openssl req -new -key "$out/$name.key" -subj "/CN=$name" -out "$work/$name.csr"
  cat >"$work/$name.ext" <<EOF
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = $san
EOF
  if [ "$expired" = 1 ]; then
    when=(-startdate "$(date -u -d '-3 days' +%Y%m%d%H%M%SZ)" -enddate "$(date -u -d '-1 day' +%Y%m%d%H%M%SZ)")
  else
    when=(-startdate "$(date -u -d '-1 hour' +%Y%m%d%H%M%SZ)" -days "$days")
  fi
  openssl ca -batch -config "$work/ca.cnf" -notext -extfile "$work/$name.ext" "${when[@]}" \
    -in "$work/$name.csr" -out "$out/$name.crt" 2>"$work/ca.log" || { cat "$work/ca.log" >&2; exit 1; }
  chmod 644 "$out/$name.crt"
  echo "make-certs.sh: $out/$name.crt ($san$([ "$expired" = 1 ] && echo ', expired'))"
done
