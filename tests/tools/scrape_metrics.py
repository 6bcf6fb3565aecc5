#!/usr/bin/env python3
"""Scrapes odmoe daemons' /metrics and parses them with a real parser (prometheus_client.parser).

usage: scrape_metrics.py URL [URL...]

Prints one JSON object: for each URL, the samples as {name: [{"labels": {...}, "value": v}, ...]} under
"samples" and the families' types under "types". Exits non-zero, with one line on stderr naming the URL, when
a scrape fails, the Content-Type is not Prometheus text 0.0.4, or the text does not parse (a family without
HELP or TYPE, a malformed line, a histogram whose buckets are not cumulative or lack le="+Inf").
"""
import json
import math
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def check_histogram(url, family):
    """Buckets cumulative, ending in +Inf, whose count equals _count, per label set."""
    series = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = json.dumps(labels, sort_keys=True)
        entry = series.setdefault(key, {"buckets": [], "count": None, "sum": None})
        if s.name.endswith("_bucket"):
            entry["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_count"):
            entry["count"] = s.value
        elif s.name.endswith("_sum"):
            entry["sum"] = s.value
    for key, e in series.items():
        b = e["buckets"]
        if not b or not math.isinf(b[-1][0]):
            raise ValueError(f"{url}: histogram {family.name}{key}: no le=\"+Inf\" bucket")
        if any(b[i][0] >= b[i + 1][0] or b[i][1] > b[i + 1][1] for i in range(len(b) - 1)):
            raise ValueError(f"{url}: histogram {family.name}{key}: buckets not ascending and cumulative")
        if e["count"] != b[-1][1] or e["sum"] is None:
            raise ValueError(f"{url}: histogram {family.name}{key}: _count differs from the +Inf bucket, or no _sum")


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        content_type = response.headers.get("Content-Type", "")
        text = response.read().decode("utf-8")
    if not content_type.startswith("text/plain; version=0.0.4"):
        raise ValueError(f"{url}: Content-Type '{content_type}', expected text/plain; version=0.0.4")
    helps = {line.split(" ")[2] for line in text.splitlines() if line.startswith("# HELP ")}
    types = {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    samples, kinds = {}, {}
    for family in text_string_to_metric_families(text):
        # The parser names a counter family without its _total; the exposition's HELP/TYPE lines carry it.
        exposed = family.name + "_total" if family.type == "counter" else family.name
        if exposed not in helps or exposed not in types:
            raise ValueError(f"{url}: family {exposed} lacks # HELP or # TYPE")
        if family.type == "histogram":
            check_histogram(url, family)
        kinds[exposed] = family.type
        for s in family.samples:
            samples.setdefault(s.name, []).append({"labels": dict(s.labels), "value": s.value})
    return {"samples": samples, "types": kinds}


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = {}
    for url in argv[1:]:
        try:
            out[url] = scrape(url)
        except Exception as e:  # one line naming the URL, whatever failed
            print(f"scrape_metrics: {url}: {e}", file=sys.stderr)
            return 1
    json.dump(out, sys.stdout, allow_nan=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
