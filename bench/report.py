#!/usr/bin/env python3
"""bench/report.py: turns the raw JSON lines of bench/run.sh's benchmarks into its outputs.

  report.py config --base FILE --out FILE --port-offset N (--model DIR | --synthetic CFG --layers N --seed S)
                   [--time-scale S] [--worker-device SPEC] [--shadow-mode M] [--early-departure] [--workers N]
                   [--group-size G] [--align T,KV] [--shadow-quant Q]
      Writes a copy of the cluster config FILE with every 127.0.0.1 port moved by N and its [model] section
      replaced (absolute paths), so that the bench's cluster never collides with another on this machine; the
      other flags change one setting each (--workers N: worker0..N-1, copies of FILE's first worker with its
      ports + i), and the result is checked against the cluster file's rules (group size, distinct addresses).
  report.py memory --out FILE URL...
      Scrapes odmoe_gpu_memory_peak_bytes from each node's Prometheus text ("NAME=http://.../metrics"); writes
      nothing (a warning) when a node does not answer, and the report falls back to the request stats.
  report.py report --dir DIR
      Reads DIR/raw/*.jsonl and DIR/raw/meta.json (written by run.sh) and writes DIR/results.jsonl,
      DIR/summary.md, DIR/*.csv and DIR/*.png.
  report.py sweep --dir DIR
      Reads DIR/runs.tsv (written by bench/sweep.sh) and each run's results.jsonl and raw/meta.json; writes
      DIR/sweep.csv (one row per run), DIR/sweep.md (a table per axis) and DIR/sweep_AXIS.png.

Every record of results.jsonl carries section, model, config, hardware, commit and seed, and its raw figures;
every derived figure (percentiles, tokens/s, ratios) is computed here from raw ones (token arrival times, byte
and load counts), never copied from a benchmark's own summary. Standard library plus matplotlib (plots).
"""
import argparse
import csv
import json
import math
import os
import platform
import re
import subprocess
import sys
import textwrap
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {
    1: "token + KV alignment",
    2: "token alignment only",
    3: "KV alignment only",
    4: "no alignment",
    5: "random prefetch",
    6: "load after routing",
}
SECTIONS = ["workloads", "resident", "ratio", "memory", "recall_per_token", "ablation", "alignment_grid", "stall"]


# ---------------------------------------------------------------------------------------------- helpers


def read_jsonl(path):
    """The JSON objects of a file of JSON lines; [] when the file does not exist."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"report.py: {path}:{n}: not JSON: {e}")
    return out


def percentile(values, q):
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def mean(values):
    return sum(values) / len(values) if values else float("nan")


def dist(values, prefix):
    """mean / p50 / p90 / p99 of values as {prefix_mean: ..., ...}."""
    return {
        f"{prefix}_mean": mean(values),
        f"{prefix}_p50": percentile(values, 50),
        f"{prefix}_p90": percentile(values, 90),
        f"{prefix}_p99": percentile(values, 99),
    }


def ratio(a, b):
    return a / b if b else float("nan")


def hardware():
    """The machine in words: CPU model and count, memory, GPUs (nvidia-smi) where present."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    gpus = []
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            gpus = [g.strip() for g in r.stdout.splitlines() if g.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gb": mem_gb, "gpus": gpus, "os": platform.platform()}


# ---------------------------------------------------------------------------------------------- config / memory


def config_error(args, message):
    sys.exit(f"report.py config: {args.base}: {message}")


def set_table_key(args, text, table, key, value, flag):
    """Sets `key = value` (a TOML literal) in the one [table] of the cluster file's text: replaces the key's line
    (keeping its comment) or adds the line under the table's header. Exits naming the flag when the file has no
    such table, or two, or the key twice in it."""
    headers = list(re.finditer(rf"(?m)^\[{re.escape(table)}\][ \t]*(?:#.*)?$", text))
    if len(headers) != 1:
        config_error(args, f"{flag} sets [{table}] {key}, but the file has {len(headers)} [{table}] tables "
                     "(needs exactly one)")
    start = headers[0].end()
    nxt = re.compile(r"(?m)^[ \t]*\[").search(text, start)
    end = nxt.start() if nxt else len(text)
    body, n = re.subn(rf"(?m)^([ \t]*{re.escape(key)}[ \t]*=[ \t]*)[^#\n]*?([ \t]*#.*)?$",
                      lambda m: f"{m.group(1)}{value}{m.group(2) or ''}", text[start:end])
    if n > 1:
        config_error(args, f"{flag}: [{table}] sets {key} {n} times")
    if n == 0:
        body = f"\n{key} = {value}" + body
    return text[:start] + body + text[end:]


def node_segments(text):
    """The text cut at its table headers: [(start, end, is_worker_node)], in order, covering all of it."""
    starts = [0] + [m.start() for m in re.finditer(r"(?m)^[ \t]*\[", text)]
    starts = sorted(set(starts))
    out = []
    for i, a in enumerate(starts):
        b = starts[i + 1] if i + 1 < len(starts) else len(text)
        seg = text[a:b]
        is_worker = bool(re.match(r"[ \t]*\[\[node\]\]", seg)) and bool(
            re.search(r'(?m)^[ \t]*role[ \t]*=[ \t]*"worker"', seg))
        out.append((a, b, is_worker))
    return out


def split_tail(seg):
    """A table's text -> (its header and key lines, the blank and comment lines after the last key line)."""
    lines = seg.splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), default=0)
    return "".join(lines[:last + 1]), "".join(lines[last + 1:])


def set_workers(args, text, count):
    """Exactly `count` worker [[node]] tables, made from the file's first as template: worker0..worker{count-1}, the
    template's address and metrics_address ports + i. The others are dropped; main and the shadow stay."""
    segs = node_segments(text)
    workers = [s for s in segs if s[2]]
    if not workers:
        config_error(args, "--workers needs a worker [[node]] table (role = \"worker\") to copy")
    template, first_tail = split_tail(text[workers[0][0]:workers[0][1]])
    for key in ("cert", "key"):
        if re.search(rf"(?m)^[ \t]*{key}[ \t]*=", template):
            config_error(args, f"--workers: the first worker has '{key}' (TLS): every node needs its own certificate, "
                         "which --workers cannot make")

    def port_of(key):
        m = re.search(rf'(?m)^[ \t]*{key}[ \t]*=[ \t]*"([^"]*):(\d+)"', template)
        return (m.group(1), int(m.group(2))) if m else None

    address, metrics = port_of("address"), port_of("metrics_address")
    if address is None:
        config_error(args, "--workers: the first worker [[node]] has no 'address = \"HOST:PORT\"' line")
    if not re.search(r'(?m)^[ \t]*name[ \t]*=', template):
        config_error(args, "--workers: the first worker [[node]] has no 'name = ...' line")
    blocks = []
    for i in range(count):
        b = re.sub(r'(?m)^([ \t]*name[ \t]*=[ \t]*)"[^"]*"', rf'\g<1>"worker{i}"', template)
        for key, hp in (("address", address), ("metrics_address", metrics)):
            if hp:
                b = re.sub(rf'(?m)^([ \t]*{key}[ \t]*=[ \t]*)"[^"]*"', rf'\g<1>"{hp[0]}:{hp[1] + i}"', b)
        blocks.append(b if b.endswith("\n") else b + "\n")
    out = []
    for a, b, is_worker in segs:
        if not is_worker:
            out.append(text[a:b])
        elif a == workers[0][0]:
            out.append("\n".join(blocks) + (first_tail or "\n"))
        else:  # a later worker: dropped, but a comment after it (about what follows) stays
            tail = split_tail(text[a:b])[1]
            if "#" in tail:
                out.append(tail)
    return "".join(out)


def check_cluster(args, text):
    """The rules of src/common/cluster_config.cc that the knobs can break, checked on the file written, so that
    a bad combination fails here, naming the knobs, rather than in the daemons: group_size divides the number of
    workers, every address and metrics_address distinct, ports 1..65535, node names distinct."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the daemons check it
        return
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        config_error(args, f"the file written is not valid TOML ({e})")
    nodes = doc.get("node", [])
    workers = [n for n in nodes if n.get("role") == "worker"]
    group = doc.get("cluster", {}).get("group_size", 0)
    source = "[cluster] group_size"
    if not group:  # 0 or absent: the model's top-k (src/common/placement.h, DefaultGroupSize)
        cfg = args.model or args.synthetic
        path = cfg if cfg.endswith(".json") else os.path.join(cfg, "config.json")
        try:
            with open(path) as f:
                group = max(1, int(json.load(f).get("num_experts_per_tok", 1)))
            source = f"the group size (the model's top-k, {path}, as [cluster] group_size is 0 or absent)"
        except (OSError, ValueError):
            group = 0
    if group and (group > len(workers) or len(workers) % group):
        config_error(args, f"{source} {group} must divide the number of workers ({len(workers)}); "
                     "choose --workers N as a multiple of --group-size G")
    names, taken = set(), {}  # address -> "node 'x' FIELD"
    for n in nodes:
        name = n.get("name", "?")
        if name in names:
            config_error(args, f"node name '{name}' is used twice")
        names.add(name)
        for key in ("address", "metrics_address", "http_address"):
            a = n.get(key)
            if not a:
                continue
            port = a.rsplit(":", 1)[-1]
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                config_error(args, f"node '{name}': {key} '{a}': port must be 1..65535 (--workers or --port-offset "
                             "moved it there)")
            if key == "http_address" and a == n.get("metrics_address"):
                continue  # main's HTTP API may share its metrics server
            if a in taken:
                config_error(args, f"node '{name}': {key} '{a}' is also {taken[a]} (--workers N gives worker i the "
                             "first worker's ports + i: choose fewer workers or move the other node)")
            taken[a] = f"node '{name}' {key}"


def cmd_config(args):
    with open(args.base) as f:
        text = f.read()

    if args.workers is not None:  # before the ports move, so that every port moves once
        if args.workers < 1:
            config_error(args, f"--workers must be >= 1, got {args.workers}")
        text = set_workers(args, text, args.workers)

    def shift(m):
        return f"127.0.0.1:{int(m.group(1)) + args.port_offset}"

    text = re.sub(r"127\.0\.0\.1:(\d+)", shift, text)
    # The paths the file gives relative to itself, made absolute: the copy lives elsewhere.
    base = os.path.dirname(os.path.abspath(args.base))

    def absolute(m):
        return f'"{os.path.normpath(os.path.join(base, m.group(1)))}"'

    def paths(m):
        return m.group(1) + re.sub(r'"([^"/][^"]*)"', absolute, m.group(2))

    text = re.sub(r"(?m)^(\s*(?:timing_model|device_profiles)\s*=\s*)(.*)$", paths, text)
    if args.worker_device:  # every worker node's device line
        blocks = re.split(r"(?m)^(?=\[\[node\]\])", text)
        for i, b in enumerate(blocks):
            if re.search(r'(?m)^role\s*=\s*"worker"', b):
                b, n = re.subn(r'(?m)^device\s*=.*$', f'device = "{args.worker_device}"', b)
                blocks[i] = b if n == 1 else b.rstrip("\n") + f'\ndevice = "{args.worker_device}"\n\n'
        text = "".join(blocks)
        # A shipped profile the file does not load yet (configs/profiles/NAME.toml) joins its device_profiles.
        name = args.worker_device.split(":", 1)[1] if args.worker_device.startswith("timed:") else ""
        shipped = os.path.join(HERE, "..", "configs", "profiles", f"{name}.toml")
        if name and os.path.exists(shipped) and not re.search(rf'(?m)^name\s*=\s*"{re.escape(name)}"', text):
            shipped = os.path.normpath(shipped)
            text, n = re.subn(r"(?m)^(device_profiles\s*=\s*\[)(.*)\]\s*$",
                              lambda m: f'{m.group(1)}{m.group(2)}{", " if m.group(2).strip() else ""}"{shipped}"]',
                              text)
            if n != 1:
                config_error(args, f"--worker-device {args.worker_device} needs a one-line [cluster] "
                             "device_profiles = [...] to add the profile to")
    if args.shadow_mode:
        text = set_table_key(args, text, "shadow", "mode", f'"{args.shadow_mode}"', "--shadow-mode")
    if args.early_departure:
        text = set_table_key(args, text, "shadow", "early_departure", "true", "--early-departure")
    if args.shadow_quant:
        text = set_table_key(args, text, "shadow", "quant", f'"{args.shadow_quant}"', "--shadow-quant")
    if args.align:
        m = re.fullmatch(r"(\d+),(\d+)", args.align)
        if not m or max(int(m.group(1)), int(m.group(2))) > 1000000:
            config_error(args, f"--align '{args.align}': expected T,KV, two periods in decode steps 0..1000000 "
                         "(0: never), e.g. 1,4")
        text = set_table_key(args, text, "shadow", "align_token", str(int(m.group(1))), "--align")
        text = set_table_key(args, text, "shadow", "align_kv", str(int(m.group(2))), "--align")
    if args.time_scale is not None:
        text = set_table_key(args, text, "cluster", "time_scale", repr(float(args.time_scale)), "--time-scale")
    if args.group_size is not None:
        if not 1 <= args.group_size <= 1024:
            config_error(args, f"--group-size must be 1..1024, got {args.group_size}")
        text = set_table_key(args, text, "cluster", "group_size", str(args.group_size), "--group-size")
    if args.model:
        model = f'[model]\npath = "{os.path.abspath(args.model)}"\n'
    else:
        model = (f'[model]\nsynthetic = "{os.path.abspath(args.synthetic)}"\nlayers = {args.layers}\n'
                 f"seed = {args.seed}\n")
    # The [model] table: its header and the key lines after it, up to a blank line, a comment or a table.
    new, n = re.subn(r"(?m)^\[model\]\n(?:[^\[#\n].*\n)*", model, text)
    if n != 1:
        config_error(args, "expected one [model] table")
    check_cluster(args, new)
    with open(args.out, "w") as f:
        f.write(new)


def cmd_memory(args):
    nodes = []
    for spec in args.urls:
        name, _, url = spec.partition("=")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read().decode()
        except OSError as e:  # the report then falls back to the workers' figures in the request stats
            print(f"report.py memory: {name}: {url}: {e}; no per-node memory from metrics", file=sys.stderr)
            return
        values = {}
        for line in body.splitlines():
            for metric in ("odmoe_gpu_memory_peak_bytes", "odmoe_gpu_memory_budget_bytes"):
                if line.startswith(metric + " ") or line.startswith(metric + "{"):
                    values[metric] = float(line.rsplit(None, 1)[1])
        if "odmoe_gpu_memory_peak_bytes" not in values:
            print(f"report.py memory: {name}: {url} has no odmoe_gpu_memory_peak_bytes", file=sys.stderr)
            return
        nodes.append({"node": name, "metrics_url": url, "peak_bytes": values["odmoe_gpu_memory_peak_bytes"],
                      "budget_bytes": values.get("odmoe_gpu_memory_budget_bytes", 0)})
    with open(args.out, "w") as f:
        json.dump({"nodes": nodes}, f)


# ---------------------------------------------------------------------------------------------- report


def request_figures(r):
    """Raw figures of one workload request -> the derived ones (from token arrival times)."""
    t = r["token_ms"]
    n = len(t)
    itl = [b - a for a, b in zip(t, t[1:])]
    decode_s = (t[-1] - t[0]) / 1000.0 if n > 1 else 0.0
    return {
        "ttft_ms": t[0] if n else float("nan"),
        "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else float("nan"),
        "output_tokens_per_s": n / (r["total_ms"] / 1000.0) if r["total_ms"] > 0 else float("nan"),
        "itl_ms": itl,
    }


def aggregate(requests):
    """One pair's (or all pairs') requests -> distribution of TTFT, decode and output tokens/s, ITL."""
    figs = [request_figures(r) for r in requests]
    itl = [x for f in figs for x in f["itl_ms"]]
    out = {"requests": len(requests), "generated_tokens": sum(r["generated_tokens"] for r in requests)}
    out.update(dist([f["ttft_ms"] for f in figs], "ttft_ms"))
    out.update(dist([f["decode_tokens_per_s"] for f in figs], "decode_tokens_per_s"))
    out.update(dist([f["output_tokens_per_s"] for f in figs], "output_tokens_per_s"))
    out["itl_ms_p50"] = percentile(itl, 50)
    out["itl_ms_p99"] = percentile(itl, 99)
    return out


def pairs_of(requests):
    seen = []
    for r in requests:
        if r["pair"] not in seen:
            seen.append(r["pair"])
    return seen


def workload_records(section, requests, common):
    recs = []
    for r in requests:
        f = request_figures(r)
        rec = dict(common, section=section, kind="request")
        rec.update({k: v for k, v in r.items() if k not in ("bench", "model")})
        rec.update({k: f[k] for k in ("ttft_ms", "decode_tokens_per_s", "output_tokens_per_s")})
        recs.append(rec)
    for p in pairs_of(requests):
        sel = [r for r in requests if r["pair"] == p]
        rec = dict(common, section=section, kind="pair", pair=p, input_tokens=sel[0]["input_tokens"],
                   output_tokens=sel[0]["output_tokens"])
        rec.update(aggregate(sel))
        recs.append(rec)
    if requests:
        # The paper's "Average": the mean over the pairs of each pair's mean.
        pair_recs = [x for x in recs if x["kind"] == "pair"]
        rec = dict(common, section=section, kind="average", pair="average", pairs=len(pair_recs))
        for key in ("ttft_ms_mean", "decode_tokens_per_s_mean", "output_tokens_per_s_mean"):
            rec[key] = mean([x[key] for x in pair_recs])
        recs.append(rec)
    return recs


def calibration_records(common, emulate, resident_reqs, cluster_reqs):
    """The calibration checks of an emulated run (issue 28): measured decode time per token against what the
    device profiles predict for the critical path, within 10%.

    - resident: the reference's measured time against its device's modelled busy time (one stream of ops and
      copies: its critical path).
    - cluster: the cluster's measured time against eq. 1's terms as the profiles model them, per decode layer:
      main's device busy time (t_M's work, the layer's send and sum) plus the slowest worker call's (its loads
      and compute: t_W). That sum is the critical path only when nothing overlaps, i.e. every load follows
      routing ([shadow] mode = "none"); with prediction on, loads run ahead and the check does not apply.
    """
    measured, modeled = [], []
    for r in resident_reqs:
        t = r.get("token_ms", [])
        if r.get("modeled_decode_ms") is not None and len(t) > 1:
            measured.append((t[-1] - t[0]) / (len(t) - 1))
            modeled.append(r["modeled_decode_ms"] / (len(t) - 1))
    res = dict(common, section="calibration", engine="resident", pair="all", time_scale=emulate["time_scale"],
               requests=len(measured), measured_ms_per_token=mean(measured) if measured else None,
               modeled_ms_per_token=mean(modeled) if modeled else None, applies=True)
    res["ratio"] = ratio(res["measured_ms_per_token"], res["modeled_ms_per_token"]) if measured else None
    res["passed"] = res["ratio"] is not None and abs(res["ratio"] - 1) <= 0.10

    measured, modeled, per_layer = [], [], []
    for r in cluster_reqs:
        t = r.get("token_ms", [])
        layers = len(r.get("measured_ms_per_layer", []))
        if not r.get("modeled_layers") or len(t) < 2 or not layers:
            continue
        modeled_layer = (r["modeled_main_ms"] + r["modeled_worker_ms"]) / r["modeled_layers"]
        measured.append((t[-1] - t[0]) / (len(t) - 1))
        modeled.append(modeled_layer * layers)
        per_layer.append((r["measured_layers_ms"] / r["modeled_layers"], r["modeled_main_ms"] / r["modeled_layers"],
                          r["modeled_worker_ms"] / r["modeled_layers"]))
    modes = sorted({r.get("prediction", "?") for r in cluster_reqs})
    clu = dict(common, section="calibration", engine="cluster", pair="all", time_scale=emulate["time_scale"],
               requests=len(measured), prediction=",".join(modes), applies=modes == ["none"],
               measured_ms_per_token=mean(measured) if measured else None,
               modeled_ms_per_token=mean(modeled) if modeled else None,
               measured_ms_per_layer=mean([x[0] for x in per_layer]) if per_layer else None,
               modeled_main_ms_per_layer=mean([x[1] for x in per_layer]) if per_layer else None,
               modeled_worker_ms_per_layer=mean([x[2] for x in per_layer]) if per_layer else None)
    clu["ratio"] = ratio(clu["measured_ms_per_token"], clu["modeled_ms_per_token"]) if measured else None
    clu["passed"] = clu["applies"] and clu["ratio"] is not None and abs(clu["ratio"] - 1) <= 0.10
    return [res, clu]


def scaled_records(common, emulate, agg, cluster_reqs, stall):
    """Decode and TTFT in real time (modelled durations / time_scale) at the timing model's depth.

    The resident engine's time per token is scaled by target / running layers. The cluster's has no one scale:
    - linear: its time per token x target / running layers, as if the running model's token repeated; this
      repeats the first sparse layer's share too (the work between positions, and a late-departing shadow's
      unpredicted first layer), which a deeper model has once per token: a low estimate of throughput;
    - high: the larger of (a) the first sparse layer's share kept and the other layers' scaled, and (b) the
      workers' host links: top_k loads per sparse layer at the measured load time, shared by the workers. At the
      running depth, later layers' loads overlap the first layer's stall; at the target's they need not, and the
      links bound them.
    TTFT (prefill, every layer) is scaled by target / running layers.
    """
    target, running = emulate.get("target_layers"), emulate["running_layers"]
    if not target:
        return []
    scale = float(emulate["time_scale"])
    out = []
    for section in ("workloads", "resident"):
        a = agg.get((section, "average"))
        if not a:
            continue
        rec = dict(common, section="scaled", engine=section, pair="average", target_layers=target,
                   linear_factor=target / running,
                   decode_tokens_per_s_mean=a["decode_tokens_per_s_mean"] * scale * running / target,
                   ttft_ms_mean=a["ttft_ms_mean"] * (target / running) / scale)
        sparse = max((len(r.get("measured_ms_per_layer", [])) for r in cluster_reqs), default=0)
        if section == "workloads" and sparse > 1 and stall:
            per_layer = [0.0] * sparse
            for r in cluster_reqs:
                for i, ms in enumerate(r.get("measured_ms_per_layer", [])):
                    per_layer[i] += ms
            target_sparse = target * sparse / running  # the target's sparse layers (the running model's share)
            token_ms = 1000.0 / a["decode_tokens_per_s_mean"]  # emulated time per token at the running depth
            layers_ms = token_ms * (per_layer[0] + sum(per_layer[1:]) * (target_sparse - 1) / (sparse - 1)) / sum(
                per_layer)
            workers = max(len(r.get("workers", [])) for r in cluster_reqs)
            link_ms = emulate["top_k"] * target_sparse * stall["expert_load_ms"] / workers
            rec.update(first_layer_share=per_layer[0] / sum(per_layer), layers_ms_per_token=layers_ms / scale,
                       link_ms_per_token=link_ms / scale, workers=workers,
                       decode_tokens_per_s_high=1000.0 * scale / max(layers_ms, link_ms),
                       high_bound="host links" if link_ms > layers_ms else "layers")
        out.append(rec)
    return out


def fmt(x, digits=2):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:.{digits}f}"


def write_csv(path, rows, fields):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()})


def plots(d, results, paper):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    # Recall vs decode token index (fig. 3).
    recall = [r for r in results if r["section"] == "recall_per_token"]
    if recall:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in recall:
            ys = [100 * y for y in r["recall_per_token"]]
            ax.plot(range(1, len(ys) + 1), ys, label=f"{r['shadow_quant'].upper()}, {r['alignment']}")
        ax.set_xlabel("decode token index")
        ax.set_ylabel("recall (%)")
        ax.set_title("Expert-selection recall per token (OD-MoE fig. 3)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "recall_per_token.png"), dpi=100)
        plt.close(fig)
        made.append("recall_per_token.png")
    # Tokens/s per ablation case (fig. 8), the paper's beside.
    abl = sorted([r for r in results if r["section"] == "ablation"], key=lambda r: r["ablation_case"])
    if abl:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r["ablation_case"] for r in abl]
        ax.bar([x - 0.2 for x in xs], [r["decode_tokens_per_s"] for r in abl], width=0.4, label="ours")
        ax2 = ax.twinx()
        ax2.bar([x + 0.2 for x in xs], [paper["ablation_decode_tokens_per_s"][str(x)] for x in xs], width=0.4,
                color="tab:orange", label="paper (right axis)")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x}\n" + textwrap.fill(CASES[x], 12) for x in xs], fontsize=7)
        ax.set_ylabel("decode tokens/s (ours)")
        ax2.set_ylabel("decode tokens/s (paper)")
        ax.set_title("Decode speed per ablation case (OD-MoE fig. 8)")
        fig.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "ablation.png"), dpi=100)
        plt.close(fig)
        made.append("ablation.png")
    # Alignment heatmap (figs. 9-10).
    grid = [r for r in results if r["section"] == "alignment_grid"]
    if grid:
        ts = sorted({r["align_token"] for r in grid})
        ks = sorted({r["align_kv"] for r in grid})
        m = [[float("nan")] * len(ks) for _ in ts]
        for r in grid:
            m[ts.index(r["align_token"])][ks.index(r["align_kv"])] = r["decode_tokens_per_s"]
        fig, ax = plt.subplots(figsize=(5, 4))
        im = ax.imshow(m, cmap="viridis", origin="lower")
        ax.set_xticks(range(len(ks)))
        ax.set_xticklabels(ks)
        ax.set_yticks(range(len(ts)))
        ax.set_yticklabels(ts)
        ax.set_xlabel("KV alignment period")
        ax.set_ylabel("token alignment period")
        for i in range(len(ts)):
            for j in range(len(ks)):
                ax.text(j, i, fmt(m[i][j], 1), ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, label="decode tokens/s")
        ax.set_title("Decode tokens/s per alignment period (figs. 9-10)")
        fig.tight_layout()
        fig.savefig(os.path.join(d, "alignment_heatmap.png"), dpi=100)
        plt.close(fig)
        made.append("alignment_heatmap.png")
    # Latency CDF: inter-token latency of every request, on-demand and resident.
    fig, ax = plt.subplots(figsize=(7, 4))
    drew = False
    for section, label in (("workloads", "on-demand cluster"), ("resident", "resident engine")):
        itl = sorted(x for r in results if r["section"] == section and r.get("kind") == "request"
                     for x in request_figures(r)["itl_ms"])
        if itl:
            ax.plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], label=label)
            drew = True
    if drew:
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("fraction of tokens")
        ax.set_title("Inter-token latency CDF, all workloads")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "latency_cdf.png"), dpi=100)
        made.append("latency_cdf.png")
    plt.close(fig)
    return made


def cmd_report(args):
    d = args.dir
    raw = os.path.join(d, "raw")
    with open(os.path.join(raw, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(HERE, "paper_figures.json")) as f:
        paper = json.load(f)
    common = {"model": meta["model"], "config": meta["config"], "hardware": hardware(), "commit": meta["commit"],
              "seed": meta["seed"]}
    results = []

    cluster_reqs = [r for r in read_jsonl(os.path.join(raw, "workload_cluster.jsonl")) if r.get("kind") != "memory"]
    resident_all = read_jsonl(os.path.join(raw, "workload_resident.jsonl"))
    resident_reqs = [r for r in resident_all if r.get("kind") != "memory"]
    results += workload_records("workloads", cluster_reqs, common)
    results += workload_records("resident", resident_reqs, common)

    # Ratios on-demand / resident, recomputed from the two sections' pair records.
    agg = {(r["section"], r["pair"]): r for r in results if r.get("kind") in ("pair", "average")}
    for p in pairs_of(cluster_reqs) + (["average"] if cluster_reqs else []):
        c, s = agg.get(("workloads", p)), agg.get(("resident", p))
        if not c or not s:
            continue
        rec = dict(common, section="ratio", pair=p)
        for key in ("decode_tokens_per_s_mean", "output_tokens_per_s_mean", "ttft_ms_mean"):
            rec[f"{key}_on_demand"] = c[key]
            rec[f"{key}_resident"] = s[key]
            rec[f"{key}_ratio"] = ratio(c[key], s[key])
        rec["paper_decode_ratio"] = paper["decode_ratio"] if p == "average" else None
        results.append(rec)

    # Exactness: each request's tokens on the cluster against the resident engine's for the same prompt.
    resident_tokens = {(r["pair"], r["prompt_index"]): r["tokens"] for r in resident_reqs if "tokens" in r}
    same = [(r["pair"], r["prompt_index"]) for r in cluster_reqs
            if resident_tokens.get((r["pair"], r["prompt_index"])) == r.get("tokens")]
    compared = [(r["pair"], r["prompt_index"]) for r in cluster_reqs
                if (r["pair"], r["prompt_index"]) in resident_tokens]
    if compared:
        results.append(dict(common, section="tokens", pair="all", requests=len(compared), identical=len(same),
                            differing=[f"{p} prompt {i}" for p, i in compared if (p, i) not in same]))

    # Emulation (bench/run.sh --emulate): the calibration checks, and decode throughput at the timing model's
    # layer count.
    emulate = meta.get("emulate")
    if emulate:
        with open(os.path.join(meta["model"], "config.json")) as f:
            emulate["top_k"] = json.load(f)["num_experts_per_tok"]
        results += calibration_records(common, emulate, resident_reqs, cluster_reqs)

    # The HF Transformers peer (GPU only): its medians per pair, as it reports them.
    for r in read_jsonl(os.path.join(raw, "peer.jsonl")):
        if r.get("kind") == "pair":
            results.append(dict(common, section="peer", kind="pair", pair=f"{r['prompt_tokens']}x{r['output_tokens']}",
                                **{k: v for k, v in r.items() if k not in ("bench", "kind")}))
        elif r.get("kind") == "memory":
            results.append(dict(common, section="peer", kind="memory", peak_bytes=r["peak_device_bytes"]))

    # Memory: every node of the cluster (Prometheus peak, else the workers' own figure in request stats), then
    # the resident engine's device.
    mem_path = os.path.join(raw, "memory_cluster.json")
    nodes = []
    if os.path.exists(mem_path):
        with open(mem_path) as f:
            nodes = json.load(f)["nodes"]
        source = "each node's Prometheus odmoe_gpu_memory_peak_bytes"
    else:
        peak = {}
        for r in cluster_reqs:
            for w in r.get("workers", []):
                peak[w["node"]] = max(peak.get(w["node"], 0), w["gpu_peak_bytes"])
        nodes = [{"node": n, "peak_bytes": b} for n, b in sorted(peak.items())]
        source = "request stats (workers only: main's and the shadow's are not reachable from an endpoint)"
    for n in nodes:
        results.append(dict(common, section="memory", engine="cluster", kind="node", node=n["node"],
                            peak_bytes=n["peak_bytes"], budget_bytes=n.get("budget_bytes"), source=source))
    if nodes:
        results.append(dict(common, section="memory", engine="cluster", kind="total", nodes=len(nodes),
                            peak_bytes=sum(n["peak_bytes"] for n in nodes), source=source))
    for m in (r for r in resident_all if r.get("kind") == "memory"):
        for kind in ("node", "total"):
            results.append(dict(common, section="memory", engine="resident", kind=kind, node="resident",
                                nodes=1, peak_bytes=m["peak_device_bytes"],
                                weights_device_bytes=m["weights_device_bytes"], device=m["device"],
                                source="engine device"))

    # Recall per token (fig. 3): case 1 (aligned) and case 4 (unaligned) per shadow quantization.
    for q in ("fp16", "int8", "nf4"):
        for r in read_jsonl(os.path.join(raw, f"recall_{q}.jsonl")):
            rec = dict(common, section="recall_per_token", shadow_quant=q,
                       alignment="aligned" if r["ablation_case"] == 1 else "unaligned")
            rec.update({k: v for k, v in r.items() if k not in ("bench", "shadow_quant", "config")})
            rec["recall_mean_of_tokens"] = mean(r["recall_per_token"])
            results.append(rec)
    for name, section in (("ablation", "ablation"), ("grid", "alignment_grid")):
        for r in read_jsonl(os.path.join(raw, f"{name}.jsonl")):
            rec = dict(common, section=section)
            rec.update({k: v for k, v in r.items() if k not in ("bench", "config")})
            if section == "ablation":
                rec["case_name"] = CASES[r["ablation_case"]]
                rec["paper_decode_tokens_per_s"] = paper["ablation_decode_tokens_per_s"][str(r["ablation_case"])]
            results.append(rec)

    # Stall (eq. 1) from the on-demand workloads: per pair and over all.
    for p in pairs_of(cluster_reqs) + (["all"] if cluster_reqs else []):
        sel = [r for r in cluster_reqs if p in (r["pair"], "all")]
        steps = sum(max(0, r["generated_tokens"] - 1) for r in sel)
        layers = max(len(r["stall_ms_per_layer"]) for r in sel)
        per_layer = [sum(r["stall_ms_per_layer"][i] for r in sel if i < len(r["stall_ms_per_layer"])) for i in
                     range(layers)]
        decode_bytes = sum(max(0, r["bytes_loaded"] - r["prefill_bytes_loaded"]) for r in sel)
        load = mean([r["expert_load_ms"] for r in sel])
        maxload = mean([r["t_maxload_ms"] for r in sel])
        rec = dict(common, section="stall", pair=p, requests=len(sel), decode_tokens=steps,
                   stall_ms_total=sum(r["stall_ms"] for r in sel), stall_ms_per_layer_total=per_layer,
                   decode_loads_on_demand=sum(r["decode_loads_on_demand"] for r in sel),
                   decode_bytes_loaded=decode_bytes, alignment_bytes=sum(r["alignment_bytes"] for r in sel),
                   t_m_ms=mean([r["t_m_ms"] for r in sel]), t_w_ms=mean([r["t_w_ms"] for r in sel]),
                   expert_load_ms=load, t_maxload_ms=maxload, groups=sel[0]["groups"])
        rec["recall"], rec["timely_recall"] = weighted_recall(sel, "recall"), weighted_recall(sel, "timely_recall")
        rec["stall_ms_per_token"] = ratio(rec["stall_ms_total"], steps)
        rec["stall_ms_per_layer_per_token"] = [ratio(x, steps) for x in per_layer]
        rec["loads_on_demand_per_token"] = ratio(rec["decode_loads_on_demand"], steps)
        rec["bytes_loaded_per_token"] = ratio(decode_bytes, steps)
        rec["alignment_bytes_per_token"] = ratio(rec["alignment_bytes"], steps)
        rec["io_bound"] = load > maxload
        rec["verdict"] = (f"I/O-bound: an expert load takes {fmt(load, 3)} ms > t_maxload {fmt(maxload, 3)} ms"
                          if load > maxload else
                          f"loads hidden: an expert load takes {fmt(load, 3)} ms <= t_maxload {fmt(maxload, 3)} ms")
        if all(r.get("prediction") == "none" for r in sel):  # eq. 1 assumes loads start ahead of routing
            rec["verdict"] = (f"no prediction: every load ({fmt(load, 3)} ms each) follows routing, inside t_W, "
                              "so eq. 1's bound does not apply")
        results.append(rec)

    if emulate:  # after the stall records: the scaling takes the measured load time
        stall_all = next((r for r in results if r["section"] == "stall" and r["pair"] == "all"), None)
        results += scaled_records(common, emulate, agg, cluster_reqs, stall_all)

    with open(os.path.join(d, "results.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r, allow_nan=True) + "\n")

    # CSV files.
    wl_fields = ["section", "pair", "requests", "generated_tokens", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90",
                 "ttft_ms_p99", "decode_tokens_per_s_mean", "decode_tokens_per_s_p50", "decode_tokens_per_s_p90",
                 "decode_tokens_per_s_p99", "output_tokens_per_s_mean", "output_tokens_per_s_p50",
                 "output_tokens_per_s_p90", "output_tokens_per_s_p99", "itl_ms_p50", "itl_ms_p99"]
    write_csv(os.path.join(d, "workloads.csv"),
              [r for r in results if r["section"] in ("workloads", "resident") and r["kind"] in ("pair", "average")],
              wl_fields)
    write_csv(os.path.join(d, "requests.csv"),
              [r for r in results if r["section"] in ("workloads", "resident") and r["kind"] == "request"],
              ["section", "pair", "prompt_index", "generated_tokens", "ttft_ms", "decode_tokens_per_s",
               "output_tokens_per_s", "total_ms"])
    write_csv(os.path.join(d, "ratio.csv"), [r for r in results if r["section"] == "ratio"],
              ["pair", "decode_tokens_per_s_mean_on_demand", "decode_tokens_per_s_mean_resident",
               "decode_tokens_per_s_mean_ratio", "output_tokens_per_s_mean_ratio", "ttft_ms_mean_ratio"])
    write_csv(os.path.join(d, "memory.csv"), [r for r in results if r["section"] == "memory"],
              ["engine", "kind", "node", "peak_bytes", "budget_bytes", "source"])
    rpt = [r for r in results if r["section"] == "recall_per_token"]
    with open(os.path.join(d, "recall_per_token.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["token_index"] + [f"{r['shadow_quant']}_{r['alignment']}" for r in rpt])
        longest = max((len(r["recall_per_token"]) for r in rpt), default=0)
        for i in range(longest):
            w.writerow([i + 1] + [r["recall_per_token"][i] if i < len(r["recall_per_token"]) else "" for r in rpt])
    pred_fields = ["ablation_case", "align_token", "align_kv", "decode_tokens", "decode_tokens_per_s", "recall",
                   "timely_recall", "loads_on_demand_per_token", "stall_ms_per_token", "t_maxload_ms",
                   "expert_load_ms"]
    write_csv(os.path.join(d, "ablation.csv"), [r for r in results if r["section"] == "ablation"],
              ["case_name"] + pred_fields + ["paper_decode_tokens_per_s"])
    write_csv(os.path.join(d, "alignment_grid.csv"), [r for r in results if r["section"] == "alignment_grid"],
              pred_fields)
    write_csv(os.path.join(d, "stall.csv"), [r for r in results if r["section"] == "stall"],
              ["pair", "decode_tokens", "recall", "timely_recall", "stall_ms_per_token", "stall_ms_per_layer_per_token",
               "loads_on_demand_per_token", "bytes_loaded_per_token", "alignment_bytes_per_token", "t_m_ms",
               "t_w_ms", "expert_load_ms", "t_maxload_ms", "io_bound"])

    made = plots(d, results, paper)
    write_summary(d, meta, common, results, paper, made)


def write_summary(d, meta, common, results, paper, made):
    L = []
    hw = common["hardware"]
    L.append("# OD-MoE benchmark summary\n")
    L.append(f"- model: `{meta['model']}`; cluster config: `{meta['config']}`; run on {meta['mode']}")
    L.append(f"- commit `{meta['commit']}`" + (" (with uncommitted changes)" if meta.get("tree_dirty") else "")
             + f", seed {meta['seed']}, {meta['prompts']} prompt(s) per workload "
             f"({meta.get('prompt_source', '?')})")
    L.append(f"- hardware: {hw['cpu']} x {hw['cpus']}, {hw['memory_gb']} GB"
             + (f", GPUs: {'; '.join(hw['gpus'])}" if hw["gpus"] else ", no GPU"))
    L.append(f"- paper: {paper['source']}")
    for s in meta.get("skipped", []):
        L.append(f"- **skipped**: {s}")
    L.append("")

    agg = {(r["section"], r["pair"]): r for r in results if r.get("kind") in ("pair", "average")}
    pairs = [r["pair"] for r in results if r["section"] == "workloads" and r.get("kind") == "pair"]
    pairs_res = [r["pair"] for r in results if r["section"] == "resident" and r.get("kind") == "pair"]
    for p in pairs_res:
        if p not in pairs:
            pairs.append(p)
    paper_pairs = paper["pairs"]
    L.append("## Table 2 (i): inference speed\n")
    L.append("Ours: mean over the prompts (decode: p50 / p99 of the per-request tokens/s in brackets). Paper: "
             "Mixtral-8x7B, whose pairs are (16, 64), (16, 256), (128, 64), (128, 256); ours are listed in the same "
             "order"
             + ("" if pairs == paper_pairs else f" ({', '.join(pairs)}: --quick or --pairs chose them)") + ".\n")
    peer = {r["pair"]: r for r in results if r["section"] == "peer" and r.get("kind") == "pair"}
    L.append("| Metric | (input, output) | Resident (ours) | Transformers (paper) | OD-MoE (ours) | OD-MoE (paper) |"
             + (" HF Transformers (ours, median) |" if peer else ""))
    L.append("|---|---|---|---|---|---|" + ("---|" if peer else ""))
    for metric, key, name, digits in (("TTFT (ms)", "ttft_ms_mean", "ttft_ms", 2),
                                      ("Decoding throughput (token/s)", "decode_tokens_per_s_mean",
                                       "decode_tokens_per_s", 2),
                                      ("Output throughput (token/s)", "output_tokens_per_s_mean",
                                       "output_tokens_per_s", 2)):
        for i, p in enumerate(pairs + ["average"]):
            pp = "average" if p == "average" else (paper_pairs[i] if i < len(paper_pairs) else None)
            res, ours = agg.get(("resident", p)), agg.get(("workloads", p))

            def cell(r):
                if not r:
                    return "-"
                s = fmt(r[key], digits)
                if key == "decode_tokens_per_s_mean" and p != "average":
                    s += f" ({fmt(r['decode_tokens_per_s_p50'], digits)} / {fmt(r['decode_tokens_per_s_p99'], digits)})"
                return s

            label = "Average" if p == "average" else f"({p.replace('x', ', ')})"
            L.append(f"| {metric if i == 0 else ''} | {label} | {cell(res)} | "
                     f"{fmt(paper[name]['resident'].get(pp)) if pp else '-'} | {cell(ours)} | "
                     f"{fmt(paper[name]['odmoe'].get(pp)) if pp else '-'} |"
                     + (f" {fmt(peer[p].get(name)) if p in peer and name in peer[p] else '-'} |" if peer else ""))
    L.append("")
    L.append("Tail latency (the paper shows none): TTFT p50 / p90 / p99 and inter-token latency p50 / p99, ms.\n")
    L.append("| Engine | (input, output) | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 |")
    L.append("|---|---|---|---|---|---|---|")
    for section, name in (("workloads", "OD-MoE (ours)"), ("resident", "Resident (ours)")):
        for p in pairs:
            r = agg.get((section, p))
            if r:
                L.append(f"| {name} | ({p.replace('x', ', ')}) | {fmt(r['ttft_ms_p50'])} | {fmt(r['ttft_ms_p90'])} | "
                         f"{fmt(r['ttft_ms_p99'])} | {fmt(r['itl_ms_p50'], 3)} | {fmt(r['itl_ms_p99'], 3)} |")
    L.append("")
    tok = next((r for r in results if r["section"] == "tokens"), None)
    if tok:
        L.append(f"**Tokens: the cluster's equal the resident engine's in {tok['identical']} of {tok['requests']} "
                 "requests**" + (f" (differing: {', '.join(tok['differing'])})" if tok["differing"] else "") + ".\n")
    ratio_avg = next((r for r in results if r["section"] == "ratio" and r["pair"] == "average"), None)
    if ratio_avg:
        L.append(f"**On-demand / resident decode throughput: {100 * ratio_avg['decode_tokens_per_s_mean_ratio']:.2f}%** "
                 f"(paper: {100 * paper['decode_ratio']:.2f}%); output throughput "
                 f"{100 * ratio_avg['output_tokens_per_s_mean_ratio']:.2f}%, TTFT "
                 f"{ratio_avg['ttft_ms_mean_ratio']:.2f}x the resident's.\n")

    emulate = meta.get("emulate")
    if emulate:
        L.append("## Emulated testbed\n")
        L.append(f"Every node a timed device of `{emulate['file']}` (src/backend/timed_device.h), charged at the shapes "
                 f"of `{emulate['timing_model'] or 'the running model'}`, time scale {emulate['time_scale']}; the "
                 f"model computed has {emulate['running_layers']} layers, the timing model "
                 f"{emulate['target_layers'] or '-'}.\n")
        scaled = {r["engine"]: r for r in results if r["section"] == "scaled"}
        if scaled:
            w, res = scaled.get("workloads"), scaled.get("resident")
            L.append(f"In real time (divided by the time scale) at the timing model's {emulate['target_layers']} layers "
                     f"(paper, Mixtral-8x7B on the RTX 3090 testbed: "
                     f"{fmt(paper['decode_tokens_per_s']['odmoe'].get('average'))} tokens/s on demand, "
                     f"{fmt(paper['decode_tokens_per_s']['resident'].get('average'))} resident):\n")
            if res:
                L.append(f"- fully resident: decode {fmt(res['decode_tokens_per_s_mean'])} tokens/s (time per token x "
                         f"{fmt(res['linear_factor'], 3)}), TTFT {fmt(res['ttft_ms_mean'])} ms")
            if w:
                line = (f"- on demand: decode {fmt(w['decode_tokens_per_s_mean'])} tokens/s with the time per token x "
                        f"{fmt(w['linear_factor'], 3)}")
                if "decode_tokens_per_s_high" in w:
                    line += (f"; {fmt(w['decode_tokens_per_s_high'])} tokens/s with the first sparse layer's "
                             f"{fmt(100 * w['first_layer_share'], 1)}% of it kept once and the other layers' scaled "
                             f"({fmt(w['layers_ms_per_token'], 1)} ms/token) or the {w['workers']} workers' host links "
                             f"({fmt(w['link_ms_per_token'], 1)} ms/token for top-{emulate['top_k']} loads of every "
                             f"layer), whichever takes longer: the {w['high_bound']}")
                L.append(line + f"; TTFT {fmt(w['ttft_ms_mean'])} ms")
                if res:
                    figures = [w["decode_tokens_per_s_mean"],
                               w.get("decode_tokens_per_s_high", w["decode_tokens_per_s_mean"])]
                    lo, hi = (100 * x / res["decode_tokens_per_s_mean"] for x in sorted(figures))
                    L.append(f"- **on demand / resident at {emulate['target_layers']} layers: "
                             + (f"{fmt(lo)}% to {fmt(hi)}%**" if hi - lo >= 0.005 else f"{fmt(lo)}%**")
                             + " (the two estimates above)")
            L.append("")
        for cal in (r for r in results if r["section"] == "calibration"):
            name = "the fully-resident reference" if cal["engine"] == "resident" else "the cluster"
            if cal["ratio"] is None:
                L.append(f"**Calibration of {name}: no figures** (no modelled time reported).\n")
                continue
            what = (f"{fmt(cal['measured_ms_per_token'], 3)} ms/token measured against "
                    f"{fmt(cal['modeled_ms_per_token'], 3)} ms/token modelled ({fmt(cal['ratio'], 3)}x) over "
                    f"{cal['requests']} request(s)")
            if cal["engine"] == "cluster":
                what += (f"; per decode layer {fmt(cal['measured_ms_per_layer'], 3)} ms measured, modelled "
                         f"{fmt(cal['modeled_main_ms_per_layer'], 3)} ms main + "
                         f"{fmt(cal['modeled_worker_ms_per_layer'], 3)} ms slowest worker call")
            if not cal["applies"]:
                L.append(f"Calibration of {name}: does not apply (prediction {cal['prediction']}: loads run ahead "
                         f"of routing, so the modelled terms overlap; run with --shadow-mode none): {what}.\n")
            else:
                L.append(f"**Calibration of {name}: {'passed' if cal['passed'] else 'FAILED'}** (within 10% passes): "
                         f"{what}.\n")

    L.append("## Table 2 (ii): GPU memory\n")
    L.append("| Engine | Node | Peak (MiB) | Paper (GB) |")
    L.append("|---|---|---|---|")
    pm = paper["gpu_memory_gb"]
    for r in (x for x in results if x["section"] == "memory"):
        if r["engine"] == "resident" and r["kind"] == "node":
            continue
        node = "total" if r["kind"] == "total" else r["node"]
        if r["engine"] == "resident":
            pg = pm["resident"]
        elif r["kind"] == "total":
            pg = pm["odmoe"]
        else:
            pg = pm["main"] if node == "main" else pm["shadow"] if node == "shadow" else pm["worker"]
        L.append(f"| {'resident' if r['engine'] == 'resident' else 'OD-MoE'} | {node} | "
                 f"{fmt(r['peak_bytes'] / 2**20, 1)} | {pg} |")
    sources = sorted({r["source"] for r in results if r["section"] == "memory" and r["engine"] == "cluster"})
    if sources:
        L.append(f"\nOD-MoE rows: {'; '.join(sources)}.")
    L.append("")

    rpt = [r for r in results if r["section"] == "recall_per_token"]
    if rpt:
        L.append("## Expert-prediction recall (fig. 3)\n")
        L.append("| Shadow | Alignment | Decode tokens | Recall (ours) | Timely recall | Recall, paper (aligned) |")
        L.append("|---|---|---|---|---|---|")
        for r in rpt:
            paper_r = paper["recall_aligned"][r["shadow_quant"]] if r["alignment"] == "aligned" else None
            L.append(f"| {r['shadow_quant'].upper()} | {r['alignment']} | {r['decode_tokens']} | "
                     f"{fmt(100 * r['recall'])}% | {fmt(100 * r['timely_recall'])}% | "
                     f"{fmt(100 * paper_r) + '%' if paper_r else '-'} |")
        L.append("")
    abl = sorted([r for r in results if r["section"] == "ablation"], key=lambda r: r["ablation_case"])
    if abl:
        L.append("## Ablation (fig. 8)\n")
        L.append("| Case | Setting | Decode tok/s (ours) | Recall | On-demand loads/token | Stall ms/token | "
                 "Paper tok/s |")
        L.append("|---|---|---|---|---|---|---|")
        for r in abl:
            L.append(f"| {r['ablation_case']} | {r['case_name']} | {fmt(r['decode_tokens_per_s'])} | "
                     f"{fmt(100 * r['recall'])}% | {fmt(r['loads_on_demand_per_token'])} | "
                     f"{fmt(r['stall_ms_per_token'], 3)} | {fmt(r['paper_decode_tokens_per_s'], 3)} |")
        L.append("")
    grid = [r for r in results if r["section"] == "alignment_grid"]
    if grid:
        best = max(grid, key=lambda r: r["decode_tokens_per_s"])
        pb = paper["alignment_grid_best"]
        L.append("## Alignment periods (figs. 9-10)\n")
        L.append(f"Best: token period {best['align_token']}, KV period {best['align_kv']}, "
                 f"{fmt(best['decode_tokens_per_s'])} tokens/s (paper, RTX 3090 workers: token {pb['align_token']}, "
                 f"KV {pb['align_kv']}, {pb['decode_tokens_per_s']} tokens/s). See alignment_grid.csv and "
                 "alignment_heatmap.png.\n")
    stall = next((r for r in results if r["section"] == "stall" and r["pair"] == "all"), None)
    if stall:
        L.append("## Stall and eq. 1\n")
        L.append(f"Over {stall['decode_tokens']} decode tokens of the workloads: stall "
                 f"{fmt(stall['stall_ms_per_token'], 3)} ms/token, {fmt(stall['loads_on_demand_per_token'], 3)} "
                 f"on-demand loads/token, {fmt(stall['bytes_loaded_per_token'] / 2**20, 2)} MiB loaded/token, "
                 f"{fmt(stall['alignment_bytes_per_token'] / 1024, 2)} KiB of K/V alignment/token; t_M "
                 f"{fmt(stall['t_m_ms'], 3)} ms, t_W {fmt(stall['t_w_ms'], 3)} ms, {stall['groups']} groups; the "
                 f"shadow's recall {fmt(100 * stall['recall']) if stall.get('recall') is not None else '-'}%, timely "
                 f"{fmt(100 * stall['timely_recall']) if stall.get('timely_recall') is not None else '-'}%. "
                 f"Eq. 1: {stall['verdict']}.\n")
        L.append("Stall per sparse layer (ms/token): "
                 + ", ".join(fmt(x, 3) for x in stall["stall_ms_per_layer_per_token"]) + "\n")
    L.append("## Files\n")
    L.append("results.jsonl (every record), workloads.csv, requests.csv, ratio.csv, memory.csv, "
             "recall_per_token.csv, ablation.csv, alignment_grid.csv, stall.csv; plots: " + ", ".join(made) + ".")
    with open(os.path.join(d, "summary.md"), "w") as f:
        f.write("\n".join(L) + "\n")


# ---------------------------------------------------------------------------------------------- sweep

SWEEP_FIELDS = ["axis", "value", "run", "status", "seconds", "workers", "group_size", "groups", "shadow_mode",
                "shadow_quant", "align", "worker_devices", "link", "decode_ratio", "decode_tokens_per_s_on_demand",
                "decode_tokens_per_s_resident", "scaled_decode_tokens_per_s_on_demand",
                "scaled_decode_tokens_per_s_on_demand_high", "scaled_decode_tokens_per_s_resident",
                "scaled_decode_ratio_low", "scaled_decode_ratio_high", "ttft_ms_on_demand", "scaled_ttft_ms_on_demand",
                "recall",
                "timely_recall", "stall_ms_per_token", "stall_first_layer_ms_per_token", "loads_on_demand_per_token",
                "expert_load_ms", "t_maxload_ms", "t_m_ms", "t_w_ms", "io_bound", "calibration_ratio",
                "calibration_passed", "cluster_calibration_ratio", "cluster_calibration_passed",
                "cluster_calibration_applies", "tokens_identical", "tokens_compared"]
AXIS_TITLES = {"workers": "Workers", "group_size": "Group size", "align": "Alignment periods (token, KV)",
               "shadow_quant": "Shadow quantization", "worker_profile": "Worker profile (fig. 10)",
               "shadow_mode": "Prediction (shadow / none: ablation case 6)", "link_rate": "Link rate (LAN harness)"}


def weighted_recall(requests, key):
    """A recall over several requests: each request's figure weighted by its decode positions (the length of its
    recall_per_token), which is the pooled ratio of counts (timely or correct / (positions x sparse layers x k));
    None when the requests carry no such figure."""
    pairs = [(r[key], len(r.get("recall_per_token") or []) or max(0, r["generated_tokens"] - 1))
             for r in requests if r.get(key) is not None]
    total = sum(w for _, w in pairs)
    return sum(x * w for x, w in pairs) / total if total else None


def sweep_row(d, axis, value, run, status, seconds):
    """One run of a sweep -> its row of sweep.csv, every figure from the run's records (results.jsonl, meta.json)."""
    row = {"axis": axis, "value": value, "run": run, "status": status, "seconds": seconds}
    if status != "ok":
        return row
    rd = os.path.join(d, run)
    results = read_jsonl(os.path.join(rd, "results.jsonl"))
    if not results:
        row["status"] = f"no results.jsonl in {rd}"
        return row
    with open(os.path.join(rd, "raw", "meta.json")) as f:
        meta = json.load(f)
    em = meta.get("emulate", {})
    row.update(workers=em.get("workers"), group_size=em.get("group_size"), shadow_mode=em.get("shadow_mode"),
               shadow_quant=em.get("shadow_quant"), worker_devices=" ".join(em.get("worker_devices", [])),
               align=f"{em.get('align_token')},{em.get('align_kv')}", link=meta.get("lan_rate", "loopback"))

    def find(section, **match):
        return next((r for r in results if r["section"] == section and all(r.get(k) == v for k, v in match.items())),
                    None)

    rat = find("ratio", pair="average")
    if rat:
        row.update(decode_ratio=rat["decode_tokens_per_s_mean_ratio"],
                   decode_tokens_per_s_on_demand=rat["decode_tokens_per_s_mean_on_demand"],
                   decode_tokens_per_s_resident=rat["decode_tokens_per_s_mean_resident"])
    for engine, suffix in (("workloads", "on_demand"), ("resident", "resident")):
        sc = find("scaled", engine=engine)
        if sc:
            row[f"scaled_decode_tokens_per_s_{suffix}"] = sc.get("decode_tokens_per_s_mean")
            if engine == "workloads":
                row["scaled_ttft_ms_on_demand"] = sc.get("ttft_ms_mean")
                row["scaled_decode_tokens_per_s_on_demand_high"] = sc.get("decode_tokens_per_s_high",
                                                                          sc.get("decode_tokens_per_s_mean"))
    if row.get("scaled_decode_tokens_per_s_on_demand") and row.get("scaled_decode_tokens_per_s_resident"):
        low, high = sorted([row["scaled_decode_tokens_per_s_on_demand"],
                            row["scaled_decode_tokens_per_s_on_demand_high"]])
        row.update(scaled_decode_ratio_low=low / row["scaled_decode_tokens_per_s_resident"],
                   scaled_decode_ratio_high=high / row["scaled_decode_tokens_per_s_resident"])
    avg = find("workloads", kind="average")
    if avg:
        row["ttft_ms_on_demand"] = avg["ttft_ms_mean"]
    requests = [r for r in results if r["section"] == "workloads" and r.get("kind") == "request"]
    row["recall"] = weighted_recall(requests, "recall")
    row["timely_recall"] = weighted_recall(requests, "timely_recall")
    st = find("stall", pair="all")
    if st:
        per_layer = st["stall_ms_per_layer_per_token"]
        row.update(groups=st["groups"], stall_ms_per_token=st["stall_ms_per_token"],
                   stall_first_layer_ms_per_token=per_layer[0] if per_layer else None,
                   loads_on_demand_per_token=st["loads_on_demand_per_token"], expert_load_ms=st["expert_load_ms"],
                   t_maxload_ms=st["t_maxload_ms"], t_m_ms=st["t_m_ms"], t_w_ms=st["t_w_ms"], io_bound=st["io_bound"])
    cal = find("calibration", engine="resident")
    if cal:
        row.update(calibration_ratio=cal["ratio"], calibration_passed=cal["passed"])
    cal = find("calibration", engine="cluster")
    if cal:
        row.update(cluster_calibration_ratio=cal["ratio"], cluster_calibration_passed=cal["passed"],
                   cluster_calibration_applies=cal["applies"])
    tok = find("tokens")
    if tok:
        row.update(tokens_identical=tok["identical"], tokens_compared=tok["requests"])
    row["_meta"] = meta
    return row


def sweep_plot(d, axis, rows):
    """Bars of the on-demand / resident decode ratio per value of one axis; False when there is no matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ys = [100 * r["decode_ratio"] if r.get("decode_ratio") is not None else 0.0 for r in rows]
    ax.bar(xs, ys, color=["tab:blue" if r.get("decode_ratio") is not None else "lightgray" for r in rows])
    for x, y, r in zip(xs, ys, rows):
        ax.text(x, y, f"{y:.1f}%" if r.get("decode_ratio") is not None else "failed", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["value"] for r in rows])
    ax.set_xlabel(AXIS_TITLES.get(axis, axis))
    ax.set_ylabel("on-demand / resident decode (%)")
    ax.set_title(f"On-demand / resident decode throughput: {AXIS_TITLES.get(axis, axis)}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(d, f"sweep_{axis}.png"), dpi=100)
    plt.close(fig)
    return True


def cmd_sweep(args):
    d = args.dir
    runs_path = os.path.join(d, "runs.tsv")
    if not os.path.exists(runs_path):
        sys.exit(f"report.py sweep: no {runs_path} (bench/sweep.sh writes it)")
    with open(runs_path, newline="") as f:
        runs = list(csv.DictReader(f, delimiter="\t"))
    rows = [sweep_row(d, r["axis"], r["value"], r["run"], r["status"], int(r["seconds"] or 0)) for r in runs]
    write_csv(os.path.join(d, "sweep.csv"), rows, SWEEP_FIELDS)
    skipped = []
    if os.path.exists(os.path.join(d, "skipped.txt")):
        with open(os.path.join(d, "skipped.txt")) as f:
            skipped = [line.strip() for line in f if line.strip()]

    L = ["# OD-MoE emulated testbed: sweeps\n"]
    meta = next((r["_meta"] for r in rows if "_meta" in r), None)
    if meta:
        em = meta.get("emulate", {})
        L.append(f"- cluster file `{em.get('file')}`, time scale {em.get('time_scale')}, model `{meta['model']}` "
                 f"({em.get('running_layers')} layers; timing model {em.get('target_layers')} layers); pairs "
                 f"{meta['pairs']}, {meta['prompts']} prompt(s) each, seed {meta['seed']}")
        L.append(f"- commit `{meta['commit']}`" + (" (with uncommitted changes)" if meta.get("tree_dirty") else "")
                 + f"; run on {meta['mode']}")
    L.append("- one setting changed per axis from the baseline (the cluster file as it is); a row whose run is "
             "`baseline` is that run. Ratio: on-demand / fully-resident decode tokens/s (the mean over the pairs of "
             "each pair's mean), at the running model's layers; at the target's, a range: the time per token scaled by "
             "target / running layers (low), and the first sparse layer kept once with the others scaled or the "
             "workers' host links, whichever binds (high; see each run's summary.md). Real time: divided by the time "
             "scale, at the timing model's layers. Calibration: measured against modelled decode time per token, "
             "the resident reference's and the cluster's (n/a where prefetched loads overlap: shadow on). Recall and "
             "timely recall: the shadow's expert predictions over every decode position and sparse layer (timely: "
             "loaded when main asked). Stall: main's wait for on-demand loads per decode token (first: the first "
             "sparse layer). Eq. 1: an expert load's time against t_maxload. Stall, load times and TTFT are measured "
             "on the emulated cluster (stretched by the time scale, at the running model's layers); in brackets "
             "after TTFT, real time at the timing model's layers.")
    for s in skipped:
        L.append(f"- **skipped**: {s}")
    for r in rows:
        if r["status"] != "ok":
            L.append(f"- **FAILED**: {r['axis']} = {r['value']} ({r['run']}): {r['status']}")
    L.append("")
    made = []
    for axis in dict.fromkeys(r["axis"] for r in rows):
        sel = [r for r in rows if r["axis"] == axis]
        L.append(f"## {AXIS_TITLES.get(axis, axis)}\n")
        if axis == "link_rate" and meta:
            ts = meta.get("emulate", {}).get("time_scale")
            L.append(f"Each rate is the modelled testbed's: bench/run.sh shapes RATE / {ts} of wall-clock time, as the "
                     f"devices run {ts}x slower than modelled. tests/lan/run.sh's tbf burst (512 KiB) holds shaped "
                     "rates up to about 4 Gbit/s at HZ=1000.\n")
        L.append("| Value | Run | Ratio | Ratio at the target's layers | Decode tok/s on demand / resident (real time) "
                 "| TTFT ms (real time) | Recall / timely | Stall ms/token (first layer) | On-demand loads/token | "
                 "Load vs t_maxload ms (eq. 1) | Groups | Calibration: resident; cluster | Tokens equal | Run s |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sel:
            if r["status"] != "ok":
                L.append(f"| {r['value']} | {r['run']} | **failed** | {r['status']} |" + " |" * 9
                         + f" {r['seconds']} |")
                continue

            def pct(x):
                return f"{fmt(100 * x)}%" if x is not None else "-"

            io = r.get("io_bound")
            verdict = ("after routing" if r.get("shadow_mode") == "none" else "-" if io is None else
                       "I/O-bound" if io else "hidden")
            cal = ("-" if r.get("calibration_ratio") is None else
                   f"{fmt(r['calibration_ratio'], 3)}x {'passed' if r['calibration_passed'] else 'FAILED'}")
            if r.get("cluster_calibration_ratio") is not None:
                cal += (f"; {fmt(r['cluster_calibration_ratio'], 3)}x "
                        + (("passed" if r["cluster_calibration_passed"] else "FAILED")
                           if r["cluster_calibration_applies"] else "(n/a: prefetch)"))
            low, high = r.get("scaled_decode_ratio_low"), r.get("scaled_decode_ratio_high")
            scaled_ratio = "-" if low is None else pct(low) if pct(low) == pct(high) else f"{pct(low)} to {pct(high)}"
            od_low = r.get("scaled_decode_tokens_per_s_on_demand")
            od_high = r.get("scaled_decode_tokens_per_s_on_demand_high")
            od = (fmt(od_low) if od_high is None or fmt(od_high) == fmt(od_low) else
                  f"{fmt(min(od_low, od_high))} to {fmt(max(od_low, od_high))}")
            tokens = "-" if r.get("tokens_compared") is None else f"{r['tokens_identical']}/{r['tokens_compared']}"
            L.append(f"| {r['value']} | {r['run']} | {pct(r.get('decode_ratio'))} | {scaled_ratio} | "
                     f"{od} / "
                     f"{fmt(r.get('scaled_decode_tokens_per_s_resident'))} | "
                     f"{fmt(r.get('ttft_ms_on_demand'), 1)} ({fmt(r.get('scaled_ttft_ms_on_demand'), 1)}) | "
                     f"{pct(r.get('recall'))} / {pct(r.get('timely_recall'))} | "
                     f"{fmt(r.get('stall_ms_per_token'), 1)} ({fmt(r.get('stall_first_layer_ms_per_token'), 1)}) | "
                     f"{fmt(r.get('loads_on_demand_per_token'))} | {fmt(r.get('expert_load_ms'), 1)} vs "
                     f"{fmt(r.get('t_maxload_ms'), 1)} ({verdict}) | "
                     f"{r.get('groups', '-')} | "
                     f"{cal} | {tokens} | "
                     f"{r['seconds']} |")
        L.append("")
        if sweep_plot(d, axis, sel):
            made.append(f"sweep_{axis}.png")
            L.append(f"![{axis}](sweep_{axis}.png)\n")
    L.append("Files: sweep.csv (every figure per run), runs.tsv, each run's folder (summary.md, results.jsonl)"
             + (f"; plots: {', '.join(made)}." if made else "; no plots (no matplotlib)."))
    with open(os.path.join(d, "sweep.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print(f"report.py sweep: {len(rows)} row(s) -> {os.path.join(d, 'sweep.md')}, sweep.csv")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("--base", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--port-offset", type=int, default=0)
    c.add_argument("--model")
    c.add_argument("--synthetic")
    c.add_argument("--layers", type=int, default=0)
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--time-scale", type=float)
    c.add_argument("--worker-device")
    c.add_argument("--shadow-mode", choices=["shadow", "random", "none"])
    c.add_argument("--early-departure", action="store_true")
    c.add_argument("--workers", type=int)
    c.add_argument("--group-size", type=int)
    c.add_argument("--align")
    c.add_argument("--shadow-quant", choices=["fp16", "int8", "nf4", "none"])
    m = sub.add_parser("memory")
    m.add_argument("--out", required=True)
    m.add_argument("urls", nargs="*")
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    w = sub.add_parser("sweep")
    w.add_argument("--dir", required=True)
    args = ap.parse_args()
    if args.cmd == "config":
        if bool(args.model) == bool(args.synthetic):
            sys.exit("report.py config: give exactly one of --model and --synthetic")
        cmd_config(args)
    elif args.cmd == "memory":
        cmd_memory(args)
    elif args.cmd == "sweep":
        cmd_sweep(args)
    else:
        cmd_report(args)


if __name__ == "__main__":
    main()
