#!/usr/bin/env python3
"""bench/check_results.py DIR: checks the files bench/run.sh wrote to DIR; exits 1 naming every failure.

Checks: results.jsonl parses and every record carries section, model, config, hardware, commit and seed; commit
is this checkout's HEAD; every section is present unless summary.md lists it as skipped; token counts are
non-zero; every number is finite (ratios whose denominator is zero aside: none is allowed); the ratio records
match a recomputation from the workloads' and resident's raw token times; the cluster's tokens equal the resident
engine's for every prompt; summary.md, the CSV files and the
four plots exist, and each plot is a PNG (signature) that matplotlib reads back with a non-empty image.
"""
import csv
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402  (the same derivations the report used)

SECTIONS = report.SECTIONS
RESTART_SECTIONS = {"recall_per_token", "ablation", "alignment_grid"}
COMMON = ("section", "model", "config", "hardware", "commit", "seed")
PLOTS = {
    "recall_per_token.png": "recall_per_token",
    "ablation.png": "ablation",
    "alignment_heatmap.png": "alignment_grid",
    "latency_cdf.png": "workloads",
}
CSVS = ["workloads.csv", "requests.csv", "ratio.csv", "memory.csv", "recall_per_token.csv", "ablation.csv",
        "alignment_grid.csv", "stall.csv"]


def numbers(value, where):
    """Yields (path, number) for every number inside value."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield where, value
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from numbers(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from numbers(v, f"{where}.{k}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: bench/check_results.py DIR")
    d = sys.argv[1]
    errors = []

    def fail(msg):
        errors.append(msg)

    head = subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    path = os.path.join(d, "results.jsonl")
    if not os.path.exists(path):
        sys.exit(f"check_results: {path} is missing")
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                fail(f"results.jsonl:{n}: not JSON ({e})")
    with open(os.path.join(d, "raw", "meta.json")) as f:
        meta = json.load(f)
    summary_path = os.path.join(d, "summary.md")
    summary = open(summary_path).read() if os.path.exists(summary_path) else ""
    if not summary:
        fail("summary.md is missing or empty")

    stale = []  # records whose commit is not HEAD
    for i, r in enumerate(records, 1):
        where = f"results.jsonl:{i} ({r.get('section')})"
        for k in COMMON:
            if k not in r:
                fail(f"{where}: no '{k}' field")
        if r.get("commit") != head:
            stale.append(i)
        for p, x in numbers(r, "record"):
            if not math.isfinite(x):
                fail(f"{where}: {p} = {x} is not finite")
        for k in ("generated_tokens", "decode_tokens", "requests"):
            if k in r and not r[k] > 0:
                fail(f"{where}: {k} = {r[k]} (expected > 0)")
        if r.get("kind") == "request" and len(r.get("token_ms", [])) != r.get("generated_tokens"):
            fail(f"{where}: {len(r.get('token_ms', []))} token times for {r.get('generated_tokens')} tokens")

    if stale:
        fail(f"{len(stale)} record(s) (lines {stale[0]}..{stale[-1]}) carry a commit other than HEAD {head}")
    if not records:
        fail("results.jsonl has no records")
    present = {r.get("section") for r in records}
    skipped_text = " ".join(meta.get("skipped", []))
    for s in SECTIONS:
        if s in present:
            continue
        if s in skipped_text and "skipped" in summary:
            continue
        fail(f"section '{s}' is missing from results.jsonl and not listed as skipped")
    if meta.get("quick") and meta.get("mode", "").startswith("local"):
        for s in SECTIONS:
            if s not in present:
                fail(f"--quick on a local cluster must exercise every section; '{s}' is missing")

    # Ratios recomputed from the raw token times.
    reqs = {s: [r for r in records if r.get("section") == s and r.get("kind") == "request"]
            for s in ("workloads", "resident")}
    for r in (x for x in records if x.get("section") == "ratio"):
        def mean_of(section):
            sel = reqs[section] if r["pair"] == "average" else [x for x in reqs[section] if x["pair"] == r["pair"]]
            if r["pair"] == "average":
                per_pair = [report.aggregate([x for x in sel if x["pair"] == p])["decode_tokens_per_s_mean"]
                            for p in report.pairs_of(sel)]
                return report.mean(per_pair)
            return report.aggregate(sel)["decode_tokens_per_s_mean"]

        want = mean_of("workloads") / mean_of("resident")
        got = r["decode_tokens_per_s_mean_ratio"]
        if not math.isclose(want, got, rel_tol=1e-9):
            fail(f"ratio {r['pair']}: recorded {got}, recomputed from token times {want}")

    # The cluster computes exactly what the single-process engine does: the same tokens for the same prompt.
    for r in (x for x in records if x.get("section") == "tokens"):
        if r["identical"] != r["requests"]:
            fail(f"tokens: the cluster's differ from the resident engine's in {r['requests'] - r['identical']} of "
                 f"{r['requests']} requests ({', '.join(r['differing'])})")
    if reqs["workloads"] and reqs["resident"] and not any(x.get("section") == "tokens" for x in records):
        fail("no 'tokens' record: the workloads and the resident reference ran, so their tokens must be compared")

    for name in CSVS:
        p = os.path.join(d, name)
        if not os.path.exists(p):
            fail(f"{name} is missing")
            continue
        with open(p) as f:
            rows = list(csv.reader(f))
        if not rows or not rows[0]:
            fail(f"{name} has no header")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    for name, section in PLOTS.items():
        p = os.path.join(d, name)
        if section not in present:
            continue
        if not os.path.exists(p) or os.path.getsize(p) == 0:
            fail(f"{name} is missing or empty")
            continue
        with open(p, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                fail(f"{name} is not a PNG (signature)")
                continue
        try:
            img = mpimg.imread(p)
            if img.shape[0] < 10 or img.shape[1] < 10:
                fail(f"{name}: image of {img.shape} pixels")
        except Exception as e:  # noqa: BLE001 - any decoding failure is a finding
            fail(f"{name}: matplotlib cannot read it ({e})")

    counts = {s: sum(1 for r in records if r.get("section") == s) for s in SECTIONS}
    if errors:
        for e in errors:
            print(f"check_results: FAIL {e}", file=sys.stderr)
        sys.exit(1)
    print(f"check_results: OK, {len(records)} records ({', '.join(f'{s} {n}' for s, n in counts.items())}), "
          f"commit {head[:12]}")


if __name__ == "__main__":
    main()
