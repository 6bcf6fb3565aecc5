#!/usr/bin/env python3
"""Checks configs/prometheus/ against odmoe itself: both files parse as YAML and have the shape Prometheus
expects; every alert has an expression, a duration, a severity and a summary; every odmoe_ metric an expression
names is one the daemons export (a name found in src/); prometheus.yml scrapes exactly the metrics addresses of
configs/local.toml. (tests/ops/prometheus_rules.sh has promtool parse and evaluate the rules.)

usage: check_prometheus_configs.py PROJECT_ROOT
"""
import pathlib
import re
import sys
import tomllib

import yaml

DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
SEVERITIES = {"warning", "critical"}


def exported_names(root):
    """Metric family names in the sources (string literals "odmoe_...")."""
    names = set()
    for path in (root / "src").rglob("*.cc"):
        names.update(re.findall(r'"(odmoe_[a-z0-9_]+)"', path.read_text()))
    return names


def check_rules(path, exported, errors):
    doc = yaml.safe_load(path.read_text())
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not groups:
        errors.append(f"{path}: no 'groups'")
        return
    seen = set()
    for g in groups:
        for i, rule in enumerate(g.get("rules") or []):
            where = f"{path}: group '{g.get('name')}' rule {i} ({rule.get('alert')})"
            for key in ("alert", "expr"):
                if not isinstance(rule.get(key), str) or not rule[key].strip():
                    errors.append(f"{where}: '{key}' missing")
            if rule.get("alert") in seen:
                errors.append(f"{where}: alert name used twice")
            seen.add(rule.get("alert"))
            if "for" in rule and not DURATION.match(str(rule["for"])):
                errors.append(f"{where}: 'for' is not a duration: {rule['for']}")
            if (rule.get("labels") or {}).get("severity") not in SEVERITIES:
                errors.append(f"{where}: labels.severity must be one of {sorted(SEVERITIES)}")
            if not (rule.get("annotations") or {}).get("summary"):
                errors.append(f"{where}: annotations.summary missing")
            for name in re.findall(r"\b(odmoe_[a-z0-9_]+)", rule.get("expr", "")):
                family = re.sub(r"_(bucket|sum|count)$", "", name)
                if name not in exported and family not in exported:
                    errors.append(f"{where}: expr names {name}, which no daemon exports")


def check_scrape(path, root, errors):
    doc = yaml.safe_load(path.read_text())
    targets = set()
    for job in doc.get("scrape_configs") or []:
        for sc in job.get("static_configs") or []:
            targets.update(sc.get("targets") or [])
    for rule_file in doc.get("rule_files") or []:
        if not (path.parent / rule_file).exists():
            errors.append(f"{path}: rule file {rule_file} does not exist")
    local = tomllib.loads((root / "configs" / "local.toml").read_text())
    wanted = {n["metrics_address"] for n in local["node"] if "metrics_address" in n}
    if targets != wanted:
        errors.append(f"{path}: targets {sorted(targets)} differ from configs/local.toml's metrics addresses "
                      f"{sorted(wanted)}")


def main(argv):
    if len(argv) != 2:
        print("usage: check_prometheus_configs.py PROJECT_ROOT", file=sys.stderr)
        return 2
    root = pathlib.Path(argv[1])
    errors = []
    exported = exported_names(root)
    try:
        check_rules(root / "configs" / "prometheus" / "odmoe-alerts.yml", exported, errors)
        check_scrape(root / "configs" / "prometheus" / "prometheus.yml", root, errors)
    except yaml.YAMLError as e:
        errors.append(f"invalid YAML: {e}")
    for e in errors:
        print(e, file=sys.stderr)
    if not errors:
        print(f"configs/prometheus: ok ({len(exported)} metric names exported)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
