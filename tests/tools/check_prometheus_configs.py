#!/usr/bin/env python3
"""Checks configs/prometheus/ and configs/grafana/ against odmoe itself: the files parse as YAML and have the shape
Prometheus expects; every alert has an expression, a duration, a severity and a summary; every odmoe_ metric an
expression names is one the daemons export (a name found in src/); prometheus.yml and testbed.yml scrape exactly
the metrics addresses of configs/local.toml and configs/testbed.toml, each in the job of its role; the Grafana
dashboard configs/grafana/odmoe.json is well formed (distinct panel ids, panels within the 24-column grid, every
query on the ${datasource} variable) and its queries name only exported metrics and defined variables.
(tests/ops/prometheus_rules.sh has promtool parse and evaluate the rules and parse the dashboard's queries.)

usage: check_prometheus_configs.py PROJECT_ROOT
"""
import json
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


def check_names(where, expr, exported, errors):
    for name in re.findall(r"\b(odmoe_[a-z0-9_]+)", expr):
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in exported and family not in exported:
            errors.append(f"{where}: expr names {name}, which no daemon exports")


# Grafana's own variables a query may use beside the dashboard's.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}


def dashboard_queries(path, rate_interval):
    """(panel, target, expr) of every query of the dashboard, with Grafana's variables given values Prometheus
    takes: $__rate_interval the range `rate_interval` ("1m"), $model every model. (prometheus_rules.sh and
    prometheus_live.py run them.)"""
    doc = json.loads(path.read_text())
    out = []
    for p in doc.get("panels", []):
        for t in p.get("targets", []):
            expr = t.get("expr", "").replace("$__rate_interval", rate_interval)
            out.append((p, t, expr.replace("${model}", ".*").replace("$model", ".*")))
    return out


def check_dashboard(path, exported, errors):
    doc = json.loads(path.read_text())
    variables = {v["name"] for v in doc.get("templating", {}).get("list", [])}
    if "datasource" not in variables:
        errors.append(f"{path}: no 'datasource' variable")
    ids = set()
    for p in doc.get("panels", []):
        where = f"{path}: panel {p.get('id')} ({p.get('title')})"
        if p.get("id") in ids:
            errors.append(f"{where}: id used twice")
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "hwxy") or g["x"] + g["w"] > 24:
            errors.append(f"{where}: gridPos {g} is not within the 24 columns")
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            errors.append(f"{where}: no query")
        for t in p.get("targets", []):
            if (t.get("datasource") or p.get("datasource") or {}).get("uid") != "${datasource}":
                errors.append(f"{where}: query {t.get('refId')} is not on the ${{datasource}} variable")
            expr = t.get("expr", "")
            if not expr.strip():
                errors.append(f"{where}: query {t.get('refId')} is empty")
            check_names(where, expr, exported, errors)
            for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr):
                if v not in variables and v not in GRAFANA_VARIABLES:
                    errors.append(f"{where}: query {t.get('refId')} uses ${v}, which the dashboard does not define")


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
            check_names(where, rule.get("expr", ""), exported, errors)


def check_scrape(path, cluster_file, errors):
    """`path` scrapes exactly the metrics addresses of `cluster_file`, each in the job of its node's role."""
    doc = yaml.safe_load(path.read_text())
    targets = set()
    for job in doc.get("scrape_configs") or []:
        for sc in job.get("static_configs") or []:
            targets.update((job.get("job_name"), t) for t in sc.get("targets") or [])
    for rule_file in doc.get("rule_files") or []:
        if not (path.parent / rule_file).exists():
            errors.append(f"{path}: rule file {rule_file} does not exist")
    cluster = tomllib.loads(cluster_file.read_text())
    wanted = {(f"odmoe-{n['role']}", n["metrics_address"]) for n in cluster["node"] if "metrics_address" in n}
    if targets != wanted:
        errors.append(f"{path}: (job, target)s {sorted(targets)} differ from {cluster_file.name}'s metrics addresses "
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
        check_scrape(root / "configs" / "prometheus" / "prometheus.yml", root / "configs" / "local.toml", errors)
        check_scrape(root / "configs" / "prometheus" / "testbed.yml", root / "configs" / "testbed.toml", errors)
        check_dashboard(root / "configs" / "grafana" / "odmoe.json", exported, errors)
    except yaml.YAMLError as e:
        errors.append(f"invalid YAML: {e}")
    except json.JSONDecodeError as e:
        errors.append(f"configs/grafana/odmoe.json: invalid JSON: {e}")
    for e in errors:
        print(e, file=sys.stderr)
    if not errors:
        print(f"configs/prometheus, configs/grafana: ok ({len(exported)} metric names exported)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
