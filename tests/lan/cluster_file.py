#!/usr/bin/env python3
"""The LAN harness's cluster file from another cluster file (tests/lan/run.sh --config FILE).

The harness owns the cluster's name, every node's name, role and addresses (10.77.0.x in its namespaces); FILE
gives everything else: the [cluster] settings (timing_model, time_scale, device_profiles, group_size, ...),
inline [[device_profile]] tables, [shadow], [model], and each node's device, gpu_budget_mb and threads. Nodes are
matched by role and order (FILE's first worker is the harness's worker0, ...), so FILE must have the harness's
topology. Paths in FILE are relative to FILE's folder; the result holds them absolute, as it lives elsewhere.

usage:
  cluster_file.py merge BASE FILE [--model DIR]   BASE (the harness's own file) with FILE's settings, on stdout;
                                                  --model DIR: [model] path = DIR whatever FILE says
  cluster_file.py model FILE                      FILE's [model] path, absolute (nothing if it has none)
Exit codes: 0 done; 2 FILE cannot be used (one line on stderr says why).
"""
import math
import os
import sys
import tomllib

# Node fields the harness writes itself; FILE's are replaced.
OWNED_NODE_FIELDS = ("name", "role", "address", "metrics_address", "http_address")
# [cluster] fields that hold a path (or a list of paths) relative to the file.
CLUSTER_PATHS = ("timing_model", "device_profiles")
ROLES = ("main", "shadow", "worker")


class MergeError(Exception):
    """FILE cannot be carried into the harness's cluster file; the message says why."""


# --- writing TOML (tomllib only reads) ---------------------------------------------------------------------


def toml_value(v, where):
    """One TOML value: strings, integers, floats, booleans, arrays and inline tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # shortest text that reads back as the same float; has '.', 'e' or both
    if isinstance(v, str):
        out = []
        for ch in v:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ch == "\n":
                out.append("\\n")
            elif ch == "\t":
                out.append("\\t")
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x, where) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(x, where)}" for k, x in v.items()) + " }"
    raise MergeError(f"{where}: a value of type {type(v).__name__} cannot be written back ({v!r})")


def toml_key(k):
    if k and all(c.isalnum() or c in "-_" for c in k) and k.isascii():
        return k
    return toml_value(k, k)


def dumps(doc, header=""):
    """The document `doc` (as tomllib gives it) as TOML text: top-level values first, then [tables], then
    [[arrays of tables]]; tables nested in a table are written inline."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    scalars = {k: v for k, v in doc.items() if not is_table(v) and not is_table_array(v)}
    for k, v in scalars.items():
        lines.append(f"{toml_key(k)} = {toml_value(v, k)}")
    for k, v in doc.items():
        if is_table(v):
            lines += ["", f"[{toml_key(k)}]"] + [f"{toml_key(f)} = {toml_value(x, f'[{k}] {f}')}" for f, x in v.items()]
    for k, v in doc.items():
        if is_table_array(v):
            for t in v:
                lines += ["", f"[[{toml_key(k)}]]"]
                lines += [f"{toml_key(f)} = {toml_value(x, f'[[{k}]] {f}')}" for f, x in t.items()]
    return "\n".join(lines) + "\n"


def is_table(v):
    return isinstance(v, dict)


def is_table_array(v):
    return isinstance(v, list) and len(v) > 0 and all(isinstance(t, dict) for t in v)


# --- merging -----------------------------------------------------------------------------------------------


def load(path):
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise MergeError(f"{path}: cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise MergeError(f"{path}: not valid TOML: {e}") from e


def resolve(path, base_dir):
    return os.path.normpath(os.path.join(base_dir, path))


def nodes_by_role(doc, path):
    nodes = doc.get("node", [])
    if not is_table_array(nodes):
        raise MergeError(f"{path}: no [[node]] tables")
    by_role = {role: [] for role in ROLES}
    for i, n in enumerate(nodes):
        role = n.get("role")
        if role not in by_role:
            raise MergeError(f"{path}: node {n.get('name', i)}: role {role!r} (expected main, shadow or worker)")
        by_role[role].append(n)
    return by_role


def topology(by_role):
    return ", ".join(f"{len(by_role[r])} {r}{'s' if r == 'worker' and len(by_role[r]) != 1 else ''}" for r in ROLES)


def model_path(config_path, doc):
    """FILE's [model] path, absolute; None when it has none."""
    model = doc.get("model", {})
    if "synthetic" in model:
        raise MergeError(f"{config_path}: [model] synthetic: the LAN harness compares with the single-process "
                         "engine on a model folder; give [model] path (or set ODMOE_LAN_MODEL)")
    if "path" not in model:
        return None
    return resolve(model["path"], os.path.dirname(os.path.abspath(config_path)))


def merge(base, config, config_path, model_override=None):
    """`base` (the harness's document) with the settings of `config` (the document of file `config_path`)."""
    config_dir = os.path.dirname(os.path.abspath(config_path))
    for section in ("tls", "auth"):
        if section in config:
            raise MergeError(f"{config_path}: [{section}]: the LAN harness does not carry TLS or tokens (its nodes' "
                             "addresses are 10.77.0.x and its clients send no token); remove it for the LAN run")

    base_nodes = nodes_by_role(base, "the harness's cluster file")
    file_nodes = nodes_by_role(config, config_path)
    if any(len(base_nodes[r]) != len(file_nodes[r]) for r in ROLES):
        raise MergeError(f"{config_path}: has {topology(file_nodes)}; the LAN harness runs {topology(base_nodes)} "
                         "(configs/local.toml's topology), matched by role and order")

    out = {}
    cluster = dict(config.get("cluster", {}))
    cluster["name"] = base["cluster"]["name"]
    if "timing_model" in cluster:
        cluster["timing_model"] = resolve(cluster["timing_model"], config_dir)
    if "device_profiles" in cluster:
        files = cluster["device_profiles"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise MergeError(f"{config_path}: [cluster] device_profiles: expected a list of profile file paths")
        cluster["device_profiles"] = [resolve(f, config_dir) for f in files]
    out["cluster"] = {"name": cluster.pop("name"), **cluster}

    if model_override is not None:
        out["model"] = {"path": model_override}
    elif (path := model_path(config_path, config)) is not None:
        out["model"] = {**config["model"], "path": path}
    else:
        out["model"] = base["model"]

    # Whatever else FILE holds ([shadow], [[device_profile]], ...) goes through as it is (the daemons check it).
    for key, value in config.items():
        if key not in ("cluster", "model", "node"):
            out[key] = value

    nodes = []
    for role in ROLES:
        for mine, theirs in zip(base_nodes[role], file_nodes[role]):
            for key in ("cert", "key"):
                if key in theirs:
                    raise MergeError(f"{config_path}: node {theirs.get('name')}: '{key}': the LAN harness does not "
                                     "carry TLS; remove it for the LAN run")
            node = {k: mine[k] for k in OWNED_NODE_FIELDS if k in mine}
            node.update({k: v for k, v in theirs.items() if k not in OWNED_NODE_FIELDS})
            nodes.append(node)
    # In the base's order (main, shadow, worker0..): the harness starts and names them so.
    order = {n["name"]: i for i, n in enumerate(base["node"])}
    out["node"] = sorted(nodes, key=lambda n: order[n["name"]])
    return out


def main(argv):
    try:
        if len(argv) >= 3 and argv[0] == "merge":
            model_override = None
            rest = argv[3:]
            if rest[:1] == ["--model"] and len(rest) == 2:
                model_override = os.path.abspath(rest[1])
            elif rest:
                raise MergeError(f"unexpected arguments {rest}\n{__doc__}")
            base_path, config_path = argv[1], argv[2]
            merged = merge(load(base_path), load(config_path), config_path, model_override)
            header = (f"Generated by tests/lan/run.sh --config {config_path}: that file's settings, devices and "
                      "model\non the LAN harness's names and addresses (one network namespace per node).")
            sys.stdout.write(dumps(merged, header))
            return 0
        if len(argv) == 2 and argv[0] == "model":
            path = model_path(argv[1], load(argv[1]))
            if path is not None:
                print(path)
            return 0
        sys.stderr.write(__doc__)
        return 2
    except MergeError as e:
        print(f"lan: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
