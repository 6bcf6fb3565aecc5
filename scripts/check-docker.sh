#!/usr/bin/env bash
# Checks docker/Dockerfile and docker/compose.yaml without a Docker engine (none runs in CI):
#  - `docker-compose config` (Debian's docker-compose 1.29) parses and validates the compose file;
#  - every file or folder the Dockerfile COPYs from the build context exists in the repository, and every
#    COPY --from names an earlier stage;
#  - every package an `apt-get install` of the Dockerfile names, and every package of scripts/install-deps.sh
#    (which the build stage runs), exists for this Debian release (`apt-cache show`);
#  - the programs the build stage installs are targets of the CMake build, and the programs CMD, ENTRYPOINT and
#    every compose service run are among them;
#  - each compose service runs the daemon of its node's role with a --config the image holds, and its name is the
#    host of that node's address in the cluster file (Docker's network resolves service names); its healthcheck
#    asks `odmoe cluster status` about that node of that file.
# Usage: scripts/check-docker.sh [--self-test]
#   --self-test also breaks copies of the files in the ways above and checks that each is caught.
# Exit 0: all good; 1: a problem (each printed on stderr); 77: docker-compose or apt-cache is not installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
for tool in docker-compose apt-cache python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "check-docker: $tool is not installed (skipped; scripts/install-deps.sh installs it)" >&2
    exit 77
  fi
done

# What apt-cache and docker-compose answered, kept across the checks of one run (each call takes seconds).
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT

# check DOCKERFILE COMPOSE: prints the problems, returns 1 when there is one.
check() {
  local dockerfile=$1 compose=$2 key
  key=$(sha256sum "$root/$compose" | cut -c1-16)
  if [ ! -f "$cache/compose-$key.yaml" ]; then
    if ! (cd "$root" && docker-compose -f "$compose" config >"$cache/compose-$key.new" 2>"$cache/compose-$key.err"); then
      echo "check-docker: $compose: docker-compose config failed: $(cat "$cache/compose-$key.err")" >&2
      return 1
    fi
    mv "$cache/compose-$key.new" "$cache/compose-$key.yaml"
  fi
  CONFIG_YAML_FILE="$cache/compose-$key.yaml" APT_KNOWN="$cache/apt-known" python3 - "$root" "$dockerfile" "$compose" <<'PY'
import json, os, re, shlex, subprocess, sys, tomllib
import yaml

root, dockerfile, compose = sys.argv[1:4]
problems = []

def bad(msg):
    problems.append(msg)

# Dockerfile instructions: comments dropped, continuation lines joined.
lines, current = [], ""
with open(os.path.join(root, dockerfile)) as f:
    for raw in f:
        line = raw.rstrip("\n")
        if not current and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            lines.append(current.strip())
        current = ""
if current.strip():
    lines.append(current.strip())

def args_of(rest):
    rest = rest.strip()
    if rest.startswith("["):
        return json.loads(rest)
    return shlex.split(rest)

stages, packages, installed, final_cmds, copied_to = [], [], set(), [], set()
stage_packages = {}  # stage index -> the packages its apt-get installs
args = {}
for line in lines:
    op, _, rest = line.partition(" ")
    op = op.upper()
    if op == "ARG":
        name, _, value = rest.partition("=")
        args[name.strip()] = value.strip()
    elif op == "FROM":
        words = rest.split()
        stages.append(words[2] if len(words) >= 3 and words[1].upper() == "AS" else None)
    elif op == "COPY":
        words = args_of(rest)
        from_stage = None
        while words and words[0].startswith("--"):
            if words[0].startswith("--from="):
                from_stage = words[0].split("=", 1)[1]
            words = words[1:]
        if len(words) < 2:
            bad(f"{dockerfile}: COPY needs a source and a destination: {line}")
            continue
        *sources, dest = words
        copied_to.add(dest.rstrip("/"))
        for s in sources:
            copied_to.add(os.path.join(dest, os.path.basename(s.rstrip("/"))))
        if from_stage is not None:
            if from_stage not in [s for s in stages[:-1] if s]:
                bad(f"{dockerfile}: COPY --from={from_stage}: no earlier stage of that name")
            continue
        for s in sources:
            if not os.path.exists(os.path.join(root, s)):
                bad(f"{dockerfile}: COPY {s}: not in the build context ({root}/{s} does not exist)")
    elif op == "RUN":
        for command in re.split(r"&&|;|\|\|", rest):
            words = shlex.split(command)
            if "apt-get" in words and "install" in words:
                after = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
                packages += after
                stage_packages.setdefault(len(stages) - 1, []).extend(after)
            if words[:1] == ["bash"] and len(words) > 1 and not os.path.exists(os.path.join(root, words[1])):
                bad(f"{dockerfile}: RUN bash {words[1]}: no such script in the repository")
            if words[:1] == ["install"]:
                for w in words[1:]:
                    if w.startswith("build/bin/"):
                        installed.add(w[len("build/bin/"):])
    elif op in ("CMD", "ENTRYPOINT"):
        final_cmds.append((op, args_of(rest)))

# The packages of install-deps.sh (the build stage runs it).
deps = open(os.path.join(root, "scripts/install-deps.sh")).read()
m = re.search(r"packages=\((.*?)\)", deps, re.S)
if m:
    packages += [w for line in m.group(1).splitlines() for w in line.split("#", 1)[0].split()]
else:
    bad("scripts/install-deps.sh: no packages=( ... ) list found")
# One apt-cache call for the packages not known yet (it answers with a record per package it has; it exits 0
# even when some are missing, so the answer's Package: fields are what counts).
known_file = os.environ["APT_KNOWN"]
known = set(open(known_file).read().split()) if os.path.exists(known_file) else set()
wanted = sorted(set(packages))
unknown = [p for p in wanted if p not in known]
if unknown:
    out = subprocess.run(["apt-cache", "show", "--no-all-versions"] + unknown, capture_output=True, text=True).stdout
    known |= set(re.findall(r"^Package: (\S+)$", out, re.M))
    with open(known_file, "w") as f:
        f.write("\n".join(sorted(known)))
for p in wanted:
    if p not in known:
        bad(f"{dockerfile}: package {p}: not found by apt-cache show (not a package of this Debian release)")

# Programs: the CMake targets, what the build installs, what the image runs.
targets = set()
for dirpath, _, files in [w for top in ("src", "bench") for w in os.walk(os.path.join(root, top))]:
    if "CMakeLists.txt" in files:
        targets |= set(re.findall(r"add_executable\(\s*([\w.-]+)", open(os.path.join(dirpath, "CMakeLists.txt")).read()))
if not installed:
    bad(f"{dockerfile}: no `install ... build/bin/PROGRAM ...` found: the image holds no program")
for p in sorted(installed - targets):
    bad(f"{dockerfile}: installs build/bin/{p}, which no add_executable in src/ builds")
for op, argv in final_cmds:
    if not argv or argv[0] not in installed:
        bad(f"{dockerfile}: {op} runs {argv[:1]}, not a program the build installs ({sorted(installed)})")

# The runtime stage provides every shared library the programs load: with a local build (build/bin, or
# $ODMOE_BIN), each library `ldd` finds belongs to a package the last stage installs, one they depend on, or one
# of Debian's required packages (in every base image).
bin_dir = os.environ.get("ODMOE_BIN") or os.path.join(root, "build/bin")
programs = [os.path.join(bin_dir, p) for p in sorted(installed) if os.path.exists(os.path.join(bin_dir, p))]
runtime = stage_packages.get(len(stages) - 1, [])
cache_dir = os.path.dirname(os.environ["APT_KNOWN"])

def cached(name, compute):
    """compute() once per run of this script (the answers of ldd, dpkg and apt-cache take seconds each)."""
    path = os.path.join(cache_dir, re.sub(r"[^\w.-]", "_", name)[:200] + ".json")
    if os.path.exists(path):
        return json.load(open(path))
    value = compute()
    json.dump(value, open(path, "w"))
    return value

def library_owners():
    libs = set()
    for prog in programs:
        out = subprocess.run(["ldd", prog], capture_output=True, text=True).stdout
        libs |= set(re.findall(r"=> (/\S+)", out))
    # The CUDA runtime comes with a CUDA RUNTIME_BASE image, not from Debian.
    libs = {l for l in libs if not l.startswith("/usr/local/cuda")}
    # One dpkg -S for every spelling of every path (the database may list /lib or /usr/lib, the link or its target).
    spellings = {}
    for lib in libs:
        for path in {lib, os.path.realpath(lib)}:
            for variant in {path, re.sub(r"^/usr/lib/", "/lib/", path), re.sub(r"^/lib/", "/usr/lib/", path)}:
                spellings[variant] = lib
    out = subprocess.run(["dpkg", "-S"] + sorted(spellings), capture_output=True, text=True).stdout
    owners = {}
    for line in out.splitlines():
        pkg, _, path = line.partition(": ")
        if path in spellings:
            owners[spellings[path]] = pkg.split(":", 1)[0]
    return {"libs": sorted(libs), "owners": owners}

def runtime_provides(runtime):
    depends = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                              "--no-breaks", "--no-replaces", "--no-enhances", "--no-pre-depends"] + runtime,
                             capture_output=True, text=True).stdout
    return sorted(set(runtime) | set(re.findall(r"^(?:\s+Depends: )?<?([\w.+-]+)>?$", depends, re.M)))

def required_of(packages):
    required = []
    shown = subprocess.run(["apt-cache", "show", "--no-all-versions"] + packages, capture_output=True, text=True).stdout
    for record in shown.split("\n\n"):
        m = re.search(r"^Package: (\S+)$", record, re.M)
        if m and re.search(r"^Priority: required$", record, re.M):
            required.append(m.group(1))
    return required

if programs and runtime:
    found = cached("owners " + " ".join(programs), library_owners)
    libs, owners = set(found["libs"]), found["owners"]
    provided = set(cached("provides " + " ".join(sorted(runtime)), lambda: runtime_provides(runtime)))
    needed = sorted(set(owners.values()) - provided)
    required = set(cached("required " + " ".join(needed), lambda: required_of(needed))) if needed else set()
    for pkg in needed:
        if pkg not in required:
            libs_of = sorted(os.path.basename(l) for l, o in owners.items() if o == pkg)
            bad(f"{dockerfile}: the programs load {', '.join(libs_of)} of package {pkg}, which the runtime stage does not install")
    for lib in sorted(libs - set(owners)):
        bad(f"{dockerfile}: the programs load {lib}, which no Debian package provides")

# Compose services.
config = yaml.safe_load(open(os.environ["CONFIG_YAML_FILE"]))
services = config.get("services", {})
built = {s.get("image") for s in services.values() if "build" in s}
programs_of_role = {"main": "odmoe-main", "shadow": "odmoe-shadow", "worker": "odmoe-worker"}
clusters = {}
for name, s in services.items():
    if "build" not in s and s.get("image") not in built:
        bad(f"{compose}: service {name}: image {s.get('image')} is not the one a service builds ({built})")
    argv = s.get("command") or []
    if isinstance(argv, str):
        argv = shlex.split(argv)
    if not argv or argv[0] not in installed:
        bad(f"{compose}: service {name}: runs {argv[:1]}, not a program the image installs")
        continue
    if argv[0] not in programs_of_role.values():
        continue
    flags = dict(zip(argv[1::2], argv[2::2]))
    cfg, node = flags.get("--config"), flags.get("--node")
    if cfg not in copied_to:
        bad(f"{compose}: service {name}: --config {cfg} is not a file the Dockerfile COPYs into the image")
        continue
    check_argv = (s.get("healthcheck") or {}).get("test") or []
    if check_argv[:1] == ["CMD"]:
        check_argv = check_argv[1:]
    if check_argv != ["odmoe", "cluster", "status", "--config", cfg, "--node", node]:
        bad(f"{compose}: service {name}: its healthcheck must be odmoe cluster status --config {cfg} --node {node}, "
            f"not {check_argv}")
    # The image's cluster file is the repository file COPYed to that path.
    source = None
    for line in lines:
        if line.upper().startswith("COPY ") and "--from" not in line:
            *srcs, dest = args_of(line[5:])
            if dest.rstrip("/") == cfg and len(srcs) == 1:
                source = srcs[0]
    if source is None:
        bad(f"{compose}: service {name}: cannot tell which repository file becomes {cfg}")
        continue
    if source not in clusters:
        with open(os.path.join(root, source), "rb") as f:
            clusters[source] = {n["name"]: n for n in tomllib.load(f).get("node", [])}
    n = clusters[source].get(node)
    if n is None:
        bad(f"{compose}: service {name}: --node {node} is not a node of {source}")
        continue
    if programs_of_role.get(n.get("role")) != argv[0]:
        bad(f"{compose}: service {name}: runs {argv[0]} for node {node}, whose role is {n.get('role')}")
    host = n.get("address", "").rsplit(":", 1)[0]
    if host != name:
        bad(f"{compose}: service {name}: node {node} has address {n.get('address')}; its host must be the service name")
for source, nodes in clusters.items():
    served = {flags for flags in nodes}
    running = set()
    for s in services.values():
        argv = s.get("command") or []
        if "--node" in argv:
            running.add(argv[argv.index("--node") + 1])
    for missing in sorted(served - running):
        bad(f"{compose}: node {missing} of {source} has no service")

for p in problems:
    print("check-docker: " + p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY
}

check docker/Dockerfile docker/compose.yaml
echo "check-docker: docker/Dockerfile and docker/compose.yaml are consistent"

if [ "${1:-}" = "--self-test" ]; then
  # Each broken copy must be caught.
  tmp=$(mktemp -d "$root/docker/.self-test.XXXXXX")
  trap 'rm -rf "$tmp" "$cache"' EXIT
  rel=${tmp#"$root"/}
  # expect_failure WHAT PATTERN: the check fails, and its message matches PATTERN (the intended reason).
  expect_failure() {
    local what=$1 pattern=$2
    if check "$rel/Dockerfile" "$rel/compose.yaml" 2>"$tmp/err"; then
      echo "check-docker: self-test: a Dockerfile/compose file with $what passed the check" >&2
      exit 1
    fi
    if ! grep -q -- "$pattern" "$tmp/err"; then
      echo "check-docker: self-test: $what failed for another reason than expected ($pattern):" >&2
      cat "$tmp/err" >&2
      exit 1
    fi
  }
  reset() { cp docker/Dockerfile docker/compose.yaml "$tmp/"; sed -i 's|context: \.\.$|context: ../..|' "$tmp/compose.yaml"; }
  cd "$root"
  reset; check "$rel/Dockerfile" "$rel/compose.yaml"  # the copy itself passes
  reset; sed -i 's|^COPY kernels/ kernels/|COPY kernelz/ kernels/|' "$tmp/Dockerfile"; expect_failure "a missing COPY source" "COPY kernelz/: not in the build context"
  reset; sed -i 's| libfmt9 | libfmt9-no-such-package |' "$tmp/Dockerfile"; expect_failure "an unknown package" "package libfmt9-no-such-package: not found"
  reset; sed -i 's|^CMD \["odmoe",|CMD ["odmoe-nothing",|' "$tmp/Dockerfile"; expect_failure "a CMD program the build does not install" "CMD runs \['odmoe-nothing'\]"
  reset; sed -i 's|"--node", "worker3"|"--node", "worker9"|' "$tmp/compose.yaml"; expect_failure "a service for an unknown node" "node worker3 of docker/cluster.toml has no service"
  reset; sed -i 's|^services:|services:\n  broken: {image: odmoe:latest, ports: ["not a port"]}|' "$tmp/compose.yaml"; expect_failure "an invalid compose file" "docker-compose config failed"
  reset; sed -i 's|"--node", "worker3"\]}|"--node", "worker2"]}|' "$tmp/compose.yaml"; expect_failure "a healthcheck of another node" "service worker3: its healthcheck must be"
  n=6
  if [ -x "$root/build/bin/odmoe-main" ] || [ -n "${ODMOE_BIN:-}" ]; then
    reset; sed -i 's| libtomlplusplus3 | |' "$tmp/Dockerfile"; expect_failure "a runtime library missing" "package libtomlplusplus3, which the runtime stage does not install"
    n=7
  fi
  echo "check-docker: self-test: $n broken variants caught"
fi
