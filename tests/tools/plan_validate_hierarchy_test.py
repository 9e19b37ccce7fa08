"""bench/plan_validate_hierarchy.py against a SYNTHETIC results file written here (made up by
this test, in the schema of scripts/bench-hierarchy.py; no measurement): the runs' flags reach
shardps_plan (rate_mbit -> --link_Bps, placement, mode), plan's bytes per link match the figures
derived by hand in docs/plan.md, and the table's errors and 10% marks are right.
ctest runs it (tools.plan_validate_hierarchy) with SHARDPS_PLAN = the built shardps_plan."""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "plan_validate_hierarchy.py")
PLAN = os.environ.get("SHARDPS_PLAN", os.path.join(ROOT, "build", "tools", "shardps_plan"))

# The fixed costs of tests/unit/plan_test.cc (FixedCosts), as a probe file.
PROBE = {"pairs": [{"from": "a", "to": "b", "transport": "tcp",
                    "write": {"alpha_us": 20, "beta_Bps": 1e9, "op_us": 10},
                    "read": {"alpha_us": 20, "beta_Bps": 1e9, "op_us": 10}}],
         "host": {"cores": 2, "apply_Bps": 1e9, "add_Bps": 4e9,
                  "spin_rtt_us": [20, 40, 60, 80, 100],
                  "pair_step_us": [100, 100, 150, 200, 250], "pair_step4_us": [232, 662.5]}}
B = 1048576  # one 1 MiB tensor: one chunk on one server
PAIR = 2 * B + 776  # one client's transport bytes per step with that server (docs/plan.md)
WIRE = 1  # plan's default: no bytes below the transport counted


class PlanValidateHierarchyTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="plan-hier-test-")
        self.probe = os.path.join(self.dir, "probe.json")
        with open(self.probe, "w") as f:
            json.dump(PROBE, f)

    def predict(self, hier):
        out = subprocess.run(
            [PLAN, "--probe_file=" + self.probe, "--compute_us=200", "--predict", "--hosts=2",
             "--local_workers=4", "--servers=1", "--mode=asp", "--placement=dedicated",
             f"--hierarchical={'true' if hier else 'false'}", "--link_Bps=125000000",
             "--model=" + self.model], stdout=subprocess.PIPE, text=True, check=True).stdout
        step = float(re.search(r"^predicted_step_us ([0-9.]+)", out, re.M).group(1))
        links = [float(x) for x in
                 re.search(r"^link_bytes_per_step (.*)$", out, re.M).group(1).split()]
        return step, links

    def test_compares_steps_and_bytes(self):
        self.model = os.path.join(self.dir, "model.txt")
        with open(self.model, "w") as f:
            f.write("w 262144\n")
        flat_step, flat_links = self.predict(False)
        hier_step, hier_links = self.predict(True)
        # Hand-derived (docs/plan.md): flat, a worker host carries its 4 workers' pairs, the
        # server host all 8; hierarchical, one aggregator's pair per worker host.
        self.assertAlmostEqual(flat_links[0], 4 * PAIR * WIRE, delta=1)
        self.assertAlmostEqual(flat_links[2], 8 * PAIR * WIRE, delta=1)
        self.assertAlmostEqual(hier_links[0], PAIR * WIRE, delta=1)
        self.assertLess(hier_step, flat_step)
        # SYNTHETIC measurements: flat's step 5% above plan's, its worker hosts' links 5% below
        # and its server host's as predicted (the busiest link: +0.0%); hierarchical's
        # step 1.3 x flat's predicted step (so far off: "NOT within"), its bytes as predicted. In
        # this made-up file flat is measured faster: plan's choice (hierarchical) must be
        # reported as disagreeing.
        synthetic = {
            "when": "SYNTHETIC (tests/tools/plan_validate_hierarchy_test.py)", "host": "none",
            "model_bytes": B,
            "runs": [
                {"hosts": 2, "local_workers": 4, "rate_mbit": 1000, "placement": "dedicated",
                 "mode": "flat", "consistency": "asp",
                 "link_bytes_per_step": [x / 1.05 for x in flat_links[:2]] + flat_links[2:],
                 "ratio_to_model": [x / 1.05 / B for x in flat_links[:2]] +
                                   [x / B for x in flat_links[2:]],
                 "step_ms_median": flat_step * 1.05 / 1e3, "steps": 100, "ok": True},
                {"hosts": 2, "local_workers": 4, "rate_mbit": 1000, "placement": "dedicated",
                 "mode": "hierarchical", "consistency": "asp", "link_bytes_per_step": hier_links,
                 "ratio_to_model": [x / B for x in hier_links],
                 "step_ms_median": flat_step * 1.3 / 1e3, "steps": 100, "ok": True},
                {"hosts": 2, "local_workers": 4, "rate_mbit": 1000, "placement": "dedicated",
                 "mode": "flat", "ok": False}]}
        hier_meas = flat_step * 1.3
        results = os.path.join(self.dir, "hierarchy-synthetic.json")
        with open(results, "w") as f:
            json.dump(synthetic, f)
        out_json = os.path.join(self.dir, "cmp.json")
        p = subprocess.run([sys.executable, SCRIPT, results, "--plan", PLAN, "--probe-file",
                            self.probe, "--compute-us", "200", "--model", self.model,
                            "--out", out_json, "--max-error", "0.2"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(p.stdout)
        self.assertEqual(p.returncode, 1, "an error above 20% must fail --max-error 0.2")
        self.assertIn("2 runs (1 not ok, skipped)", p.stdout)
        flat_row = re.search(r"^\| 2h x 4l flat dedicated 1000 Mbit/s \|.*$", p.stdout, re.M)
        hier_row = re.search(r"^\| 2h x 4l hierarchical dedicated 1000 Mbit/s \|.*$", p.stdout,
                             re.M)
        self.assertIsNotNone(flat_row)
        self.assertIsNotNone(hier_row)
        # (pred - meas) / meas: 1 / 1.05 - 1 = -4.8% (step), 1.05 - 1 = +5.0% (bytes).
        self.assertIn("| -4.8% | within |", flat_row.group(0))
        self.assertIn("| +5.0% | within | +0.0% | within |", flat_row.group(0))
        hier_err = (hier_step - hier_meas) / hier_meas * 100
        self.assertIn(f"| {hier_err:+.1f}% | NOT within |", hier_row.group(0))
        self.assertIn("| +0.0% | within |", hier_row.group(0))
        self.assertIn("measured flat faster", p.stdout)
        self.assertIn("plan says hierarchical (DISAGREES)", p.stdout)
        self.assertIn("agrees with the measurement in 0/1 settings", p.stdout)
        with open(out_json) as f:
            cmp_ = json.load(f)
        self.assertAlmostEqual(cmp_["rows"][0]["worker_link_error"], 0.05, places=9)
        self.assertAlmostEqual(cmp_["rows"][0]["step_error"], 1 / 1.05 - 1, places=9)

    def test_reads_the_workload_from_the_details_file(self):
        # SYNTHETIC pair of files as scripts/bench-hierarchy.py names them: the details' linreg
        # workload (W 512 x 512, b 512: 1050624 bytes, two chunks on one server, ASP) must reach
        # shardps_plan. Flat 2 x 4, dedicated: a worker host carries 4 clients x (2 B + 1464)
        # (docs/plan.md: 688 per chunk + 88 per server) = 8.01 x model bytes.
        model_bytes = (512 * 512 + 512) * 4
        ratio = 4 * (2 * model_bytes + 2 * 688 + 88) / model_bytes
        results = os.path.join(self.dir, "hierarchy-20990101T000000Z.json")
        with open(results, "w") as f:
            json.dump({"when": "SYNTHETIC", "host": "none", "model_bytes": model_bytes, "runs": [
                {"hosts": 2, "local_workers": 4, "rate_mbit": 0, "placement": "dedicated",
                 "mode": "flat", "link_bytes_per_step": [ratio * model_bytes] * 2,
                 "ratio_to_model": [ratio] * 2, "step_ms_median": 1.0, "steps": 10,
                 "ok": True}]}, f)
        with open(os.path.join(self.dir, "hierarchy_details-20990101T000000Z.json"), "w") as f:
            # The server host's link: all 8 clients' pairs (16.01 x model bytes).
            json.dump({"workload": {"trainer": "ps_test_worker --model=linreg --batch=1",
                                    "dim": 512, "outputs": 512, "servers": 1,
                                    "partition_bytes": 4194304, "consistency": "asp"},
                       "runs": [{"run_dir": "build/x/0-2x4-dedicated-flat",
                                 "server_link_bytes_per_step": {"s0": 2 * ratio * model_bytes}}]},
                      f)
        p = subprocess.run([sys.executable, SCRIPT, results, "--plan", PLAN, "--probe-file",
                            self.probe, "--compute-us", "200"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(p.stdout)
        self.assertEqual(p.returncode, 0)
        self.assertIn("workload from ", p.stdout)
        self.assertNotIn("warning", p.stdout)
        self.assertIn(f"| {ratio:.2f} / {ratio:.2f} | +0.0% | within |", p.stdout)
        self.assertAlmostEqual(ratio, 8.0056, places=3)
        self.assertIn(f"2h x 4l flat dedicated unlimited: {2 * ratio:.2f} / {2 * ratio:.2f}  "
                      f"+0.0% within", p.stdout)
        self.assertIn("server link bytes: median |error| 0.0%", p.stdout)


if __name__ == "__main__":
    unittest.main()
