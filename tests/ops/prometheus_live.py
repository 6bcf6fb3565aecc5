#!/usr/bin/env python3
"""A real Prometheus (Debian's, unpacked into .tools/bin by scripts/install-deps.sh) scrapes a loopback odmoe
cluster (main with its HTTP API, the shadow, two mock-GPU workers) while it serves requests, with the alert rules
of configs/prometheus/odmoe-alerts.yml loaded. Then:
  - every query of the Grafana dashboard configs/grafana/odmoe.json runs without error, and every panel shows data
    (but those listed in QUIET, which a healthy cluster leaves empty);
  - every alert rule evaluates without error on the cluster's real series (a label mismatch in a division, a
    many-to-many match, would show here and nowhere else).

usage: prometheus_live.py SOURCE_DIR BUILD_DIR   (exit 77, skipped, without a prometheus binary)
"""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
from check_prometheus_configs import dashboard_queries  # noqa: E402

# Panels a healthy cluster serving a few requests leaves empty, and why. None: even "Membership changes" shows the
# workers joining as main first reaches them.
QUIET = {}
RATE_WINDOW = "15s"  # $__rate_interval: several 1 s scrapes


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http(url, body=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def query(base, expr):
    _, body = http(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    return json.loads(body)


def wait_for(what, cond, timeout_s):
    give_up = time.time() + timeout_s
    while time.time() < give_up:
        try:
            if cond():
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"gave up waiting for {what} after {timeout_s} s")


def cluster_file(model, p):
    node = lambda name, role, grpc, metrics, extra="": (
        f'[[node]]\nname = "{name}"\nrole = "{role}"\naddress = "127.0.0.1:{grpc}"\n'
        f'metrics_address = "127.0.0.1:{metrics}"\n{extra}')
    return "".join([
        '[cluster]\nname = "prometheus-live"\ngroup_size = 2\nrpc_timeout_ms = 30000\nstartup_timeout_ms = 60000\n',
        f'[model]\npath = "{model}"\n',
        '[shadow]\nmode = "shadow"\nquant = "int8"\n',
        node("main", "main", p[0], p[1], f'http_address = "127.0.0.1:{p[1]}"\ndevice = "cpu"\n'),
        node("shadow", "shadow", p[2], p[3], 'device = "cpu"\n'),
        node("w0", "worker", p[4], p[5], 'device = "mock-gpu"\ngpu_budget_mb = 256\n'),
        node("w1", "worker", p[6], p[7], 'device = "mock-gpu"\ngpu_budget_mb = 256\n'),
    ])


def prometheus_file(rules, p):
    job = lambda name, targets: (f"  - job_name: {name}\n    static_configs:\n      - targets: "
                                 + json.dumps([f"127.0.0.1:{t}" for t in targets]) + "\n")
    return ("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules}\nscrape_configs:\n"
            + job("odmoe-main", [p[1]]) + job("odmoe-shadow", [p[3]]) + job("odmoe-worker", [p[5], p[7]]))


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, build = pathlib.Path(argv[1]).resolve(), pathlib.Path(argv[2]).resolve()
    prometheus = os.environ.get("PROMETHEUS") or (str(src / ".tools/bin/prometheus")
                                                  if (src / ".tools/bin/prometheus").exists()
                                                  else shutil.which("prometheus"))
    if not prometheus:
        print("prometheus_live: no prometheus binary (scripts/install-deps.sh unpacks one into .tools/bin)")
        return 77
    odmoe = str(build / "bin" / "odmoe")
    failures = []
    with tempfile.TemporaryDirectory(prefix="odmoe-prometheus-") as tmp:
        tmp = pathlib.Path(tmp)
        p = free_ports(9)
        (tmp / "cluster.toml").write_text(cluster_file(src / "models/demo-mixtral-kjv", p))
        cluster = ["--config", str(tmp / "cluster.toml"), "--run-dir", str(tmp / "run")]
        up = subprocess.run([odmoe, "cluster", "up", *cluster], capture_output=True, text=True)
        if up.returncode != 0:
            print(f"prometheus_live: cluster up failed ({up.returncode}):\n{up.stdout}{up.stderr}")
            return 1
        server = None
        try:
            (tmp / "prometheus.yml").write_text(prometheus_file(src / "configs/prometheus/odmoe-alerts.yml", p))
            base = f"http://127.0.0.1:{p[8]}"
            server = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{p[8]}"],
                                      stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT)
            wait_for("Prometheus ready", lambda: http(f"{base}/-/ready")[0] == 200, 60)
            # Requests for the latency, token and prediction series: over several scrapes, so that rates have them.
            api = f"http://127.0.0.1:{p[1]}"
            for i in range(6):
                status, body = http(f"{api}/v1/completions",
                                    {"prompt": "And God said", "max_tokens": 8, "temperature": 0, "seed": i})
                assert status == 200, body
                time.sleep(1)
            wait_for("four targets up", lambda: sum(
                float(r["value"][1]) for r in query(base, 'up{job=~"odmoe-.*"}')["data"]["result"]) == 4, 30)
            time.sleep(3)  # the last requests' counters scraped twice

            shown = {}  # series per panel title, in the dashboard's order (rows have no queries)
            for panel, t, expr in dashboard_queries(src / "configs/grafana/odmoe.json", RATE_WINDOW):
                shown.setdefault(panel["title"], 0)
                answer = query(base, expr)
                if answer.get("status") != "success":
                    failures.append(f"panel '{panel['title']}' query {t['refId']}: {answer.get('error')}")
                    continue
                shown[panel["title"]] += len(answer["data"]["result"])
            for title, series in shown.items():
                print(f"panel '{title}': {series} series")
                if series == 0 and title not in QUIET:
                    failures.append(f"panel '{title}' shows nothing on a cluster serving requests")
                if series > 0 and title in QUIET:
                    failures.append(f"panel '{title}' is listed as quiet but shows {series} series")

            def rules_evaluated():
                groups = json.loads(http(f"{base}/api/v1/rules")[1])["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else None
            wait_for("every rule evaluated", rules_evaluated, 30)
            rules = rules_evaluated()
            for r in rules:
                if r["health"] != "ok":
                    failures.append(f"alert {r['name']}: {r['health']}: {r.get('lastError')}")
            active = [f"{r['name']} ({r['state']})" for r in rules if r.get("state") not in (None, "inactive")]
            print(f"{len(rules)} alert rules evaluated without error; not inactive: {', '.join(active) or 'none'}")
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
            subprocess.run([odmoe, "cluster", "down", *cluster], capture_output=True)
            if failures and (tmp / "prometheus.log").exists():
                print((tmp / "prometheus.log").read_text()[-3000:])
    for f in failures:
        print("prometheus_live: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
