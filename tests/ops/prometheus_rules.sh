#!/usr/bin/env bash
# Checks configs/prometheus/ with promtool, Prometheus's own checker:
#  - `promtool check config` on prometheus.yml and testbed.yml, and the rule file they load (PromQL parsed,
#    templates too);
#  - `promtool test rules` on tests/ops/odmoe-alerts.test.yml: every alert evaluated against series that show its
#    fault (the alerts it fires, their labels and their text); fails when an alert has no test in which it fires;
#  - the queries of configs/grafana/odmoe.json, parsed as recording rules.
# promtool: $PROMTOOL, else .tools/bin/promtool (scripts/install-deps.sh fetches it), else the PATH's; exit 77
# (skipped) without one.
# usage: prometheus_rules.sh SOURCE_DIR
set -euo pipefail
src=$1
promtool=${PROMTOOL:-}
[ -n "$promtool" ] || { [ -x "$src/.tools/bin/promtool" ] && promtool=$src/.tools/bin/promtool; } || promtool=$(command -v promtool || true)
if [ -z "$promtool" ]; then
  echo "prometheus_rules: no promtool (scripts/install-deps.sh fetches it into .tools/bin)"
  exit 77
fi
"$promtool" check config "$src/configs/prometheus/prometheus.yml" "$src/configs/prometheus/testbed.yml"
(cd "$src/tests/ops" && "$promtool" test rules odmoe-alerts.test.yml)
# The Grafana dashboard's queries, as recording rules (Grafana's variables given values), parsed by promtool.
queries=$(mktemp --suffix=.yml)
trap 'rm -f "$queries"' EXIT
python3 - "$src" "$queries" <<'PY'
import pathlib, sys
import yaml
src, out = pathlib.Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(src / "tests/tools"))
from check_prometheus_configs import dashboard_queries
rules = [{"record": f"dashboard_panel_{p['id']}_{t['refId']}", "expr": expr}
         for p, t, expr in dashboard_queries(src / "configs/grafana/odmoe.json", "1m")]
pathlib.Path(out).write_text(yaml.safe_dump({"groups": [{"name": "configs/grafana/odmoe.json", "rules": rules}]}))
PY
"$promtool" check rules "$queries"
python3 - "$src" <<'PY'
import pathlib, sys
import yaml
src = pathlib.Path(sys.argv[1])
rules = yaml.safe_load((src / "configs/prometheus/odmoe-alerts.yml").read_text())
alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
tests = yaml.safe_load((src / "tests/ops/odmoe-alerts.test.yml").read_text())
fired = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
untested = sorted(alerts - fired)
if untested:
    print("prometheus_rules: no test in tests/ops/odmoe-alerts.test.yml fires " + ", ".join(untested))
    sys.exit(1)
print(f"prometheus_rules: each of the {len(alerts)} alerts fires in a test")
PY
