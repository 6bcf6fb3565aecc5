# Sourced by the ctest scripts that run Node.js programs (tests/http/run_js_tests.sh,
# tests/model/run_tokenizer_oracle.sh).

# Exits 77 (ctest: skipped) unless node 18 or later and npm are installed.
require_node() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "skipped: node and npm are not installed (scripts/install-deps.sh installs them)"
    exit 77
  fi
  local major
  major=$(node -p 'process.versions.node.split(".")[0]')
  if [ "$major" -lt 18 ]; then
    echo "skipped: node $(node --version) is older than 18"
    exit 77
  fi
}

# Installs the packages pinned in DIR/package-lock.json into DIR/node_modules (git-ignored), again only when the
# lockfile changes. WHAT names them in the error when the npm registry cannot be reached.
npm_ci_pinned() {
  local dir=$1 what=$2
  local installed=$dir/node_modules/.package-lock.json
  if [ ! -f "$installed" ] || [ "$dir/package-lock.json" -nt "$installed" ]; then
    (cd "$dir" && npm ci --prefer-offline --no-audit --no-fund) || {
      echo "npm ci failed in $dir ($what comes from the npm registry: is it reachable?)" >&2
      exit 1
    }
  fi
}
