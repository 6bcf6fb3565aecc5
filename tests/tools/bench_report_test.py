#!/usr/bin/env python3
"""Tests of bench/report.py's `config` (the cluster file bench/run.sh starts, with its knobs: --workers,
--group-size, --align, --shadow-quant, ...) and `sweep` (bench/sweep.sh's tables from each run's records), on
configs/testbed-emulated.toml and configs/local.toml. No daemons: each case writes a file and reads it back
(python3's tomllib, 3.11+).

usage: bench_report_test.py [PROJECT_ROOT]   (default: two folders up from here)
"""
import csv
import io
import json
import pathlib
import sys
import tempfile
import tomllib
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = pathlib.Path(__file__).resolve().parent
ROOT = pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE.parent.parent
TESTBED = ROOT / "configs" / "testbed-emulated.toml"
LOCAL = ROOT / "configs" / "local.toml"
sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402

# A model folder holding only a config.json (top-k 2): config reads nothing else of it.
MODEL_CONFIG = {"num_experts_per_tok": 2, "num_hidden_layers": 8}


def run_report(*args):
    """report.py ARGS in this process: (exit code, stderr and the message it exited with)."""
    err = io.StringIO()
    argv, sys.argv = sys.argv, ["report.py", *args]
    code = 0
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            report.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            err.write(e.code)
    finally:
        sys.argv = argv
    return code, err.getvalue()


class ConfigTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)
        self.model = self.dir / "model"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps(MODEL_CONFIG))

    def tearDown(self):
        self.tmp.cleanup()

    def config(self, *flags, base=TESTBED, offset=300):
        """Runs report.py config; (exit code, stderr, the file written as a dict or None)."""
        out = self.dir / "cluster.toml"
        if out.exists():
            out.unlink()
        rc, err = run_report("config", "--base", str(base), "--out", str(out), "--port-offset", str(offset),
                             "--model", str(self.model), *flags)
        return rc, err, tomllib.loads(out.read_text()) if rc == 0 else None

    @staticmethod
    def workers(doc):
        return [n for n in doc["node"] if n["role"] == "worker"]

    def test_sixteen_workers_distinct_ports(self):
        rc, err, doc = self.config("--workers", "16")
        self.assertEqual(rc, 0, err)
        w = self.workers(doc)
        self.assertEqual([n["name"] for n in w], [f"worker{i}" for i in range(16)])
        self.assertEqual([n["address"] for n in w], [f"127.0.0.1:{17410 + i}" for i in range(16)])
        self.assertEqual([n["metrics_address"] for n in w], [f"127.0.0.1:{17510 + i}" for i in range(16)])
        addresses = [n[k] for n in doc["node"] for k in ("address", "metrics_address") if k in n]
        self.assertEqual(len(addresses), len(set(addresses)))
        # The template's other fields, main and the shadow as they were (ports moved).
        self.assertTrue(all(n["device"] == "timed:rtx3090" and n["gpu_budget_mb"] == 1024 for n in w))
        self.assertEqual([n["name"] for n in doc["node"][:2]], ["main", "shadow"])
        self.assertEqual(doc["node"][0]["address"], "127.0.0.1:17400")

    def test_four_workers_and_settings(self):
        rc, err, doc = self.config("--workers", "4", "--group-size", "4", "--align", "1,16", "--shadow-quant", "nf4",
                                   "--time-scale", "5", "--worker-device", "timed:rtx3080", "--shadow-mode", "none")
        self.assertEqual(rc, 0, err)
        self.assertEqual(len(self.workers(doc)), 4)
        self.assertEqual(doc["cluster"]["group_size"], 4)
        self.assertEqual(doc["cluster"]["time_scale"], 5.0)
        self.assertEqual((doc["shadow"]["align_token"], doc["shadow"]["align_kv"]), (1, 16))
        self.assertEqual((doc["shadow"]["quant"], doc["shadow"]["mode"]), ("nf4", "none"))
        self.assertTrue(all(n["device"] == "timed:rtx3080" for n in self.workers(doc)))
        self.assertTrue(any(p.endswith("rtx3080.toml") for p in doc["cluster"]["device_profiles"]))

    def test_local_keeps_comments_and_http(self):
        rc, err, doc = self.config("--workers", "6", "--align", "4,4", base=LOCAL)
        self.assertEqual(rc, 0, err)
        self.assertEqual(len(self.workers(doc)), 6)
        self.assertEqual(doc["node"][0]["http_address"], "127.0.0.1:7600")
        text = (self.dir / "cluster.toml").read_text()
        self.assertIn("align_token = 4           # T_tok", text)

    def test_workers_not_a_multiple_of_group_size(self):
        rc, err, _ = self.config("--workers", "3")
        self.assertNotEqual(rc, 0)
        self.assertIn("group_size 2 must divide the number of workers (3)", err)
        rc, err, _ = self.config("--workers", "8", "--group-size", "3")
        self.assertNotEqual(rc, 0)
        self.assertIn("group_size 3 must divide the number of workers (8)", err)

    def test_workers_colliding_with_another_port(self):
        rc, err, _ = self.config("--workers", "100")
        self.assertNotEqual(rc, 0)
        self.assertIn("is also node 'main' metrics_address", err)

    def test_bad_values(self):
        for flags, message in ((("--workers", "0"), "--workers must be >= 1"),
                               (("--align", "1"), "--align '1': expected T,KV"),
                               (("--group-size", "0"), "--group-size must be 1..1024")):
            rc, err, _ = self.config(*flags)
            self.assertNotEqual(rc, 0, flags)
            self.assertIn(message, err)

    def test_missing_table_named(self):
        base = self.dir / "no-shadow.toml"
        text = TESTBED.read_text()
        start = text.index("[shadow]")
        base.write_text(text[:start] + text[text.index("[[node]]", start):])
        rc, err, _ = self.config("--shadow-quant", "fp16", base=base)
        self.assertNotEqual(rc, 0)
        self.assertIn(f"{base}: --shadow-quant sets [shadow] quant, but the file has 0 [shadow] tables", err)


class SweepTest(unittest.TestCase):
    """report.py sweep on two made-up runs: figures come from their records, a failed run is a row that says so."""

    def test_rows_from_records(self):
        with tempfile.TemporaryDirectory() as tmp:
            d = pathlib.Path(tmp)
            run = d / "baseline"
            (run / "raw").mkdir(parents=True)
            meta = {"model": "m", "commit": "c", "seed": 1, "pairs": "16x32", "prompts": 2, "mode": "loopback",
                    "emulate": {"file": "f", "time_scale": 5.0, "running_layers": 8, "target_layers": 32,
                                "workers": 8, "group_size": 2, "worker_devices": ["timed:rtx3090"],
                                "shadow_mode": "shadow", "shadow_quant": "int8", "align_token": 1, "align_kv": 1}}
            (run / "raw" / "meta.json").write_text(json.dumps(meta))
            records = [
                {"section": "ratio", "pair": "average", "decode_tokens_per_s_mean_ratio": 0.25,
                 "decode_tokens_per_s_mean_on_demand": 5.0, "decode_tokens_per_s_mean_resident": 20.0},
                {"section": "workloads", "kind": "average", "pair": "average", "ttft_ms_mean": 900.0},
                {"section": "workloads", "kind": "request", "generated_tokens": 4, "recall": 1.0,
                 "timely_recall": 0.5, "recall_per_token": [1, 1, 1]},
                {"section": "workloads", "kind": "request", "generated_tokens": 2, "recall": 1.0,
                 "timely_recall": 1.0, "recall_per_token": [1]},
                {"section": "stall", "pair": "all", "groups": 4, "stall_ms_per_token": 10.0,
                 "stall_ms_per_layer_per_token": [8.0, 2.0], "loads_on_demand_per_token": 1.5,
                 "expert_load_ms": 70.0, "t_maxload_ms": 40.0, "t_m_ms": 1.0, "t_w_ms": 30.0, "io_bound": True},
                {"section": "calibration", "engine": "resident", "pair": "all", "ratio": 1.05, "passed": True,
                 "applies": True},
                {"section": "calibration", "engine": "cluster", "pair": "all", "ratio": 1.2, "passed": False,
                 "applies": False},
                {"section": "scaled", "engine": "workloads", "pair": "average", "decode_tokens_per_s_mean": 5.0,
                 "decode_tokens_per_s_high": 8.0, "ttft_ms_mean": 700.0},
                {"section": "scaled", "engine": "resident", "pair": "average", "decode_tokens_per_s_mean": 20.0,
                 "ttft_ms_mean": 100.0},
                {"section": "tokens", "pair": "all", "requests": 2, "identical": 2, "differing": []},
            ]
            (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (d / "runs.tsv").write_text("axis\tvalue\trun\tstatus\tseconds\n"
                                        "workers\t8\tbaseline\tok\t60\n"
                                        "workers\t16\tworkers-16\tfailed (exit 2; see x/run.log)\t3\n")
            rc, err = run_report("sweep", "--dir", str(d))
            self.assertEqual(rc, 0, err)
            with open(d / "sweep.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            self.assertEqual(len(rows), 2)
            ok, failed = rows
            self.assertEqual(float(ok["decode_ratio"]), 0.25)
            self.assertEqual(float(ok["timely_recall"]), (0.5 * 3 + 1.0 * 1) / 4)  # weighted by decode positions
            self.assertEqual(float(ok["stall_first_layer_ms_per_token"]), 8.0)
            self.assertEqual(ok["calibration_passed"], "True")
            self.assertEqual(ok["cluster_calibration_applies"], "False")
            self.assertEqual(float(ok["scaled_decode_ratio_low"]), 0.25)
            self.assertEqual(float(ok["scaled_decode_ratio_high"]), 0.4)
            self.assertEqual(ok["tokens_identical"], "2")
            self.assertEqual(failed["decode_ratio"], "")
            md = (d / "sweep.md").read_text()
            self.assertIn("| 8 | baseline | 25.00% | 25.00% to 40.00% | 5.00 to 8.00 / 20.00 |", md)
            self.assertIn("| 1.050x passed; 1.200x (n/a: prefetch) | 2/2 |", md)
            self.assertIn("**FAILED**: workers = 16 (workers-16): failed (exit 2; see x/run.log)", md)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
