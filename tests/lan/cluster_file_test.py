#!/usr/bin/env python3
"""Tests of tests/lan/cluster_file.py, the merge behind `tests/lan/run.sh --config FILE`: the TOML it writes reads
back as the same document, and configs/testbed-emulated.toml merged into a file like the harness's keeps the
harness's names and addresses and takes the rest from the testbed file, paths made absolute.

usage: cluster_file_test.py [PROJECT_ROOT]   (default: two folders up from here)
"""
import io
import os
import pathlib
import sys
import tempfile
import tomllib
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cluster_file  # noqa: E402

ROOT = pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE.parent.parent
TESTBED = ROOT / "configs" / "testbed-emulated.toml"
WORKERS = [f"worker{i}" for i in range(8)]


def harness_base(workers=WORKERS):
    """A document like the one tests/lan/run.sh writes (write_cluster_file)."""
    nodes = [{"name": "main", "role": "main", "address": "10.77.0.10:7100", "metrics_address": "10.77.0.10:7190",
              "http_address": "10.77.0.10:8000", "device": "cpu"},
             {"name": "shadow", "role": "shadow", "address": "10.77.0.11:7100", "metrics_address": "10.77.0.11:7190",
              "device": "cpu"}]
    for i, w in enumerate(workers):
        nodes.append({"name": w, "role": "worker", "address": f"10.77.0.{20 + i}:7100",
                      "metrics_address": f"10.77.0.{20 + i}:7190", "device": "mock-gpu", "gpu_budget_mb": 1024})
    return {"cluster": {"name": "lan", "epoch": 1, "group_size": 2, "rpc_timeout_ms": 30000,
                        "startup_timeout_ms": 60000},
            "model": {"path": "/models/demo"}, "shadow": {"mode": "shadow", "quant": "int8"}, "node": nodes}


def write(text):
    f = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    f.write(text)
    f.close()
    return f.name


class DumpsTest(unittest.TestCase):
    def test_round_trip(self):
        doc = {"top": 3,
               "cluster": {"name": "a b", "scale": 0.1, "big": 1e300, "neg": -2, "on": True, "off": False,
                           "files": ["x/y.toml", "z"], "empty": [], "inline": {"fp32": 35.6, "int8": 284}},
               "text": {"quote": 'say "hi"\\ \n\t\x01 é', "inf": float("inf")},
               "node": [{"name": "n1", "device": "timed:rtx3090"}, {"name": "n2"}]}
        self.assertEqual(tomllib.loads(cluster_file.dumps(doc, "a header\n\nline 3")), doc)

    def test_floats_stay_floats(self):
        back = tomllib.loads(cluster_file.dumps({"t": {"a": 1.0, "b": 2.5e-7, "c": 10}}))
        self.assertIsInstance(back["t"]["a"], float)
        self.assertEqual(back["t"]["b"], 2.5e-7)
        self.assertIsInstance(back["t"]["c"], int)

    def test_dates_are_refused(self):
        import datetime
        with self.assertRaises(cluster_file.MergeError):
            cluster_file.dumps({"t": {"when": datetime.date(2026, 1, 1)}})


class MergeTestbedTest(unittest.TestCase):
    def setUp(self):
        self.config = cluster_file.load(str(TESTBED))
        self.merged = cluster_file.merge(harness_base(), self.config, str(TESTBED))
        # What the daemons will read: the written text, read back.
        self.back = tomllib.loads(cluster_file.dumps(self.merged))

    def test_written_text_reads_back(self):
        self.assertEqual(self.back, self.merged)

    def test_harness_owns_names_and_addresses(self):
        base = harness_base()
        self.assertEqual(self.back["cluster"]["name"], "lan")
        self.assertEqual(len(self.back["node"]), 10)
        for mine, got in zip(base["node"], self.back["node"]):
            for key in cluster_file.OWNED_NODE_FIELDS:
                self.assertEqual(got.get(key), mine.get(key), f"{mine['name']} {key}")

    def test_cluster_settings_come_from_the_file(self):
        cluster = self.back["cluster"]
        for key in ("epoch", "group_size", "rpc_timeout_ms", "startup_timeout_ms", "prefill_minibatch_rows",
                    "time_scale"):
            self.assertEqual(cluster[key], self.config["cluster"][key], key)

    def test_paths_are_absolute_and_exist(self):
        cluster = self.back["cluster"]
        self.assertEqual(cluster["timing_model"], str(ROOT / "configs/models/mixtral-8x7b/config.json"))
        self.assertEqual(cluster["device_profiles"], [str(ROOT / "configs/profiles/rtx3090.toml")])
        for path in [cluster["timing_model"], *cluster["device_profiles"]]:
            self.assertTrue(os.path.isfile(path), path)
        self.assertEqual(self.back["model"]["path"], os.path.normpath(ROOT / "../shared/models/tiny-mixtral-kjv"))
        self.assertEqual(cluster_file.model_path(str(TESTBED), self.config), self.back["model"]["path"])

    def test_devices_and_budgets_by_role_and_order(self):
        by_name = {n["name"]: n for n in self.back["node"]}
        self.assertEqual(by_name["main"]["device"], "timed:rtx3090")
        self.assertEqual(by_name["shadow"]["device"], "timed:rtx3090x2")
        self.assertNotIn("gpu_budget_mb", by_name["main"])
        for w in WORKERS:
            self.assertEqual(by_name[w]["device"], "timed:rtx3090", w)
            self.assertEqual(by_name[w]["gpu_budget_mb"], 1024, w)

    def test_profiles_and_shadow_are_carried(self):
        self.assertEqual(self.back["device_profile"], self.config["device_profile"])
        self.assertEqual(self.back["shadow"], self.config["shadow"])

    def test_sections_in_reading_order(self):
        text = cluster_file.dumps(self.merged)
        starts = [text.index(s) for s in ("[cluster]", "[model]", "[shadow]", "[[device_profile]]", "[[node]]")]
        self.assertEqual(starts, sorted(starts))

    def test_model_override(self):
        merged = cluster_file.merge(harness_base(), self.config, str(TESTBED), model_override="/m/x")
        self.assertEqual(merged["model"], {"path": "/m/x"})


class MergeErrorsTest(unittest.TestCase):
    def merge_text(self, text):
        path = write(text)
        try:
            return cluster_file.merge(harness_base(), cluster_file.load(path), path), path
        finally:
            os.unlink(path)

    def test_other_topology_names_the_file_and_the_difference(self):
        text = TESTBED.read_text()
        cut = text.index('[[node]]\nname = "worker6"')
        path = write(text[:cut])
        try:
            with self.assertRaises(cluster_file.MergeError) as e:
                cluster_file.merge(harness_base(), cluster_file.load(path), path)
        finally:
            os.unlink(path)
        self.assertIn(path, str(e.exception))
        self.assertIn("1 main, 1 shadow, 6 workers", str(e.exception))
        self.assertIn("1 main, 1 shadow, 8 workers", str(e.exception))

    def test_tls_and_auth_are_refused(self):
        for section, text in (("[tls]", '[tls]\nca = "ca.pem"\n'), ("[auth]", '[auth]\ntoken_file = "t"\n')):
            with self.assertRaises(cluster_file.MergeError) as e:
                self.merge_text(text + TESTBED.read_text())
            self.assertIn(section, str(e.exception))

    def test_node_certificates_are_refused(self):
        text = TESTBED.read_text().replace('name = "worker3"\n', 'name = "worker3"\ncert = "w.pem"\n')
        with self.assertRaises(cluster_file.MergeError) as e:
            self.merge_text(text)
        self.assertIn("worker3", str(e.exception))

    def test_synthetic_model_is_refused(self):
        with self.assertRaises(cluster_file.MergeError) as e:
            cluster_file.model_path("f.toml", {"model": {"synthetic": "c.json"}})
        self.assertIn("synthetic", str(e.exception))

    def test_no_model_keeps_the_harness_model(self):
        base_doc = harness_base()
        config = tomllib.loads(cluster_file.dumps({**base_doc, "model": {}}))
        del config["model"]
        self.assertEqual(cluster_file.merge(base_doc, config, "x.toml")["model"], base_doc["model"])

    def test_bad_toml(self):
        path = write("[cluster\n")
        try:
            with self.assertRaises(cluster_file.MergeError) as e:
                cluster_file.load(path)
            self.assertIn("not valid TOML", str(e.exception))
        finally:
            os.unlink(path)


class MainTest(unittest.TestCase):
    def test_merge_command_writes_the_file(self):
        base = write(cluster_file.dumps(harness_base()))
        out, err = io.StringIO(), io.StringIO()
        try:
            with redirect_stdout(out), redirect_stderr(err):
                code = cluster_file.main(["merge", base, str(TESTBED)])
        finally:
            os.unlink(base)
        self.assertEqual(code, 0, err.getvalue())
        self.assertTrue(out.getvalue().startswith("# Generated by tests/lan/run.sh --config"))
        self.assertEqual(tomllib.loads(out.getvalue())["cluster"]["name"], "lan")

    def test_errors_exit_2_with_one_line(self):
        err = io.StringIO()
        with redirect_stderr(err):
            code = cluster_file.main(["merge", "/nonexistent/base.toml", str(TESTBED)])
        self.assertEqual(code, 2)
        self.assertTrue(err.getvalue().startswith("lan: /nonexistent/base.toml: cannot read"))


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
