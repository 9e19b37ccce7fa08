#!/usr/bin/env python3
"""Validates `shardps_plan`'s predictions against real runs (scripts/bench-plan.sh runs this).

1. probe: shardps_plan --probe (link alpha/beta/op cost, loaded round trips, update throughput)
2. compute: digits_trainer --standalone --workers 1 (step minus the local update = compute;
   the least of 5 runs)
2b. measurements: every calibration and validation configuration, --reps runs each (median),
   the runs interleaved in rounds (each round every configuration once, starting at a different
   place) so that a slow period of the shared host hits all configurations alike
3. calibration: ASP and BSP runs of 2 servers x 4 workers (4 MiB) and 3 x 4 (4 KiB), and an ASP
   run of 1 x 4 (4 KiB), fit the exchange, wait and per-operation CPU by least squares
   (shardps_plan --calibrate_file); they are left out of the error figures
4. per configuration: predicted step (shardps_plan --predict) vs measured step (the digits
   trainer on a local cluster via scripts/launch-local.sh, its "final:" line), error
5. median and max absolute error over the held-out configurations; the configuration the model
   recommends among all measured ones with the job's worker count (calibration ones included),
   and how far its measured throughput is from the best measured one of the same set.
Writes bench/results/plan-<stamp>.json. Exit 1 if --max-median-error is given and exceeded.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout, env=None):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout


def parse_cfg(s):
    # "S:W:PARTITION:MODE[:STALENESS]", e.g. 2:4:4194304:ssp:1
    f = s.split(":")
    return {"servers": int(f[0]), "workers": int(f[1]), "partition": int(f[2]), "mode": f[3],
            "staleness": int(f[4]) if len(f) > 4 else 0}


def name(c):
    p = c["partition"]
    ps = f"{p >> 20}M" if p >= 1 << 20 else f"{p >> 10}K"
    m = c["mode"] + (f"(s={c['staleness']})" if c["mode"] == "ssp" else "")
    return f"{c['servers']}s x {c['workers']}w, {ps}, {m}"


# Validation grid (held out) and calibration configurations (fitted; not in the grid).
FULL = ["1:4:4194304:bsp", "2:4:4194304:bsp", "3:4:4194304:bsp", "4:4:4194304:bsp",
        "1:4:4096:bsp", "2:4:4096:bsp", "4:4:4096:bsp",
        "1:4:4194304:asp", "2:4:4194304:asp", "4:4:4194304:asp",
        "1:4:4194304:ssp:1", "2:4:4194304:ssp:2", "2:4:4096:ssp:1",
        "1:1:4194304:bsp", "1:2:4194304:bsp", "2:2:4194304:bsp", "1:3:4194304:bsp",
        "2:6:4194304:bsp", "1:8:4194304:bsp"]
CALIBRATION = ["2:4:4194304:asp", "2:4:4194304:bsp", "3:4:4096:asp", "3:4:4096:bsp",
               "1:4:4096:asp"]
CALIBRATION_QUICK = ["2:4:4194304:asp", "2:4:4194304:bsp"]
QUICK = ["1:4:4194304:bsp", "1:4:4194304:asp", "1:1:4194304:bsp", "2:2:4194304:bsp"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("SHARDPS_BUILD_DIR", "build"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", default="", help="comma-separated S:W:PART:MODE[:S] list")
    ap.add_argument("--epochs", type=int, default=0)
    ap.add_argument("--reps", type=int, default=0, help="runs per configuration (median)")
    ap.add_argument("--probe-file", default="")
    ap.add_argument("--compute-us", type=float, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--max-median-error", type=float, default=0)
    ap.add_argument("--no-calibrate", action="store_true",
                    help="use the probe's own exchange CPU estimate (no calibration runs)")
    a = ap.parse_args()
    build = a.build if os.path.isabs(a.build) else os.path.join(ROOT, a.build)
    plan = os.path.join(build, "tools", "shardps_plan")
    trainer = os.path.join(build, "examples", "digits_trainer")
    data = os.environ.get("SHARDPS_DATA_DIR", os.path.join(build, "data"))
    epochs = a.epochs or (8 if a.quick else 30)
    reps = a.reps or (1 if a.quick else 5)
    cfgs = [parse_cfg(s) for s in (a.configs.split(",") if a.configs else
                                   (QUICK if a.quick else FULL))]
    for b in (plan, trainer, os.path.join(build, "server", "shardps_server"),
              os.path.join(build, "server", "shardps_coordinator")):
        if not os.access(b, os.X_OK):
            sys.exit(f"missing {b}: build shardps_plan digits_trainer shardps_server "
                     f"shardps_coordinator_bin first")
    if not os.path.exists(os.path.join(data, "digits_train.bin")):
        print(f"SKIP: no {data}/digits_train.bin (scripts/export_digits.py --out {data})")
        return 77
    stamp = datetime.datetime.utcnow().strftime("%Y%m%dT%H%M%SZ")
    work = os.path.join(build, "plan-work-" + stamp)
    os.makedirs(work, exist_ok=True)

    probe = a.probe_file
    if not probe:
        probe = os.path.join(work, "probe.json")
        rc, out = run([plan, "--probe", "--probe_out=" + probe,
                       "--probe_seconds=" + ("0.15" if a.quick else "0.3"),
                       "--probe_clients=" + ("5" if a.quick else "9")], 120)
        if rc != 0:
            sys.exit("probe failed:\n" + out)
    compute = a.compute_us
    if not compute:
        vals = []
        for _ in range(5):
            rc, out = run([trainer, "--standalone", "--workers=1", "--epochs=5", "--log_every=0",
                           "--data=" + os.path.join(data, "digits_train.bin")], 60)
            m = re.search(r"step ([0-9.]+) ms \(in Step\(\) ([0-9.]+) ms\)", out)
            if rc != 0 or not m:
                sys.exit("standalone trainer failed:\n" + out)
            vals.append((float(m.group(1)) - float(m.group(2))) * 1e3)
        compute = min(vals)  # noise on a shared host only adds
    print(f"plan validation: probe {probe}, compute {compute:.0f} us/step, {epochs} epochs, "
          f"{reps} run(s) per configuration")

    def measure_once(c, run_dir):
        mode = c["mode"]
        cmd = [os.path.join(ROOT, "scripts", "launch-local.sh"), "--servers", str(c["servers"]),
               "--workers", str(c["workers"]), "--transport", "tcp", "--consistency", mode,
               "--staleness", str(c["staleness"]), "--partition-bytes", str(c["partition"]),
               "--quiet", "--timeout", "120", "--run-dir", run_dir, "--",
               f"--epochs={epochs}", "--batch_size=32", "--log_every=0"]
        rc, out = run(cmd, 150, env)
        m = re.search(r"final:.* step ([0-9.]+) ms", out)
        if rc != 0 or not m:
            # One retry: a cluster start-up on this shared host occasionally loses a tcp
            # connection (see the run directory); a second failure is fatal.
            print(f"  ({name(c)}: run failed with rc {rc}, retrying once; logs in {run_dir})",
                  flush=True)
            retries.append(name(c))
            cmd[cmd.index("--run-dir") + 1] += "-retry"
            rc, out = run(cmd, 150, env)
            m = re.search(r"final:.* step ([0-9.]+) ms", out)
        if rc != 0 or not m:
            sys.exit(f"run {name(c)} failed (rc {rc}):\n" + out[-3000:])
        return float(m.group(1)) * 1e3

    def predict(c, probe_file):
        rc, out = run([plan, "--probe_file=" + probe_file, "--digits", f"--compute_us={compute}",
                       "--predict", f"--servers={c['servers']}", f"--workers={c['workers']}",
                       f"--partition_bytes={c['partition']}", f"--mode={c['mode']}",
                       f"--staleness={c['staleness']}"], 30)
        m = re.search(r"predicted_step_us ([0-9.]+).*\| (bound: .*)$", out, re.M)
        if rc != 0 or not m:
            sys.exit("shardps_plan --predict failed:\n" + out)
        return float(m.group(1)), m.group(2)

    retries = []
    env = dict(os.environ, SHARDPS_BUILD_DIR=build)
    # Calibration (docs/plan.md): the calibration configurations' median steps fit the exchange
    # CPU and the wait CPU by least squares (shardps_plan --calibrate_file); they are left out of
    # the error figures (a validation configuration that is also a calibration one is dropped).
    cal_cfgs = [] if a.no_calibrate else [parse_cfg(s) for s in
                                          (CALIBRATION_QUICK if a.quick else CALIBRATION)]
    cal_names = {name(c) for c in cal_cfgs}
    cfgs = [c for c in cfgs if name(c) not in cal_names]
    # Measurement schedule: repetitions are interleaved (every configuration once per round,
    # each round starting at a different place in the list) so that a slow period of this
    # shared host hits all configurations alike rather than all runs of one.
    cal_reps = max(3, reps)  # one bad run must not decide the calibration
    plan_runs = [(c, f"cal{i}", cal_reps) for i, c in enumerate(cal_cfgs)] + \
                [(c, str(i), reps) for i, c in enumerate(cfgs)]
    meas = {tag: [] for _, tag, _ in plan_runs}
    rounds = max(n for _, _, n in plan_runs)
    for rnd in range(rounds):
        todo = [x for x in plan_runs if x[2] > rnd]
        k = (rnd * len(todo)) // rounds
        todo = todo[k:] + todo[:k]
        print(f"  round {rnd + 1}/{rounds}: {len(todo)} runs", flush=True)
        for c, tag, _ in todo:
            meas[tag].append(measure_once(c, os.path.join(work, f"run-{tag}-{rnd}")))

    calibration = []
    cal_fit = "none (--no-calibrate): the probe's own estimates"
    if cal_cfgs:
        cal_file = os.path.join(work, "calibration.txt")
        with open(cal_file, "w") as f:
            f.write("# servers workers partition_bytes mode staleness median_step_us\n")
            for i, c in enumerate(cal_cfgs):
                step = statistics.median(meas[f"cal{i}"])
                f.write(f"{c['servers']} {c['workers']} {c['partition']} {c['mode']} "
                        f"{c['staleness']} {step}\n")
        rc, out = run([plan, "--probe_file=" + probe, "--digits", f"--compute_us={compute}",
                       "--calibrate_file=" + cal_file, "--predict",
                       "--probe_out=" + os.path.join(work, "probe-cal.json")], 30)
        if rc != 0:
            # The knobs keep the probe's own estimates (logged, and stored in the JSON).
            cal_fit = "failed: " + out.strip()
            print(f"  calibration: {out.strip()}; keeping the probe's estimates", flush=True)
        else:
            probe = os.path.join(work, "probe-cal.json")
            cal_fit = out.splitlines()[0]
            print(f"  {cal_fit}", flush=True)
        for i, c in enumerate(cal_cfgs):
            m = meas[f"cal{i}"]
            step = statistics.median(m)
            pred, why = predict(c, probe)
            calibration.append({"config": c, "name": name(c), "measured_us": step,
                                "measured_runs_us": m, "predicted_us": pred, "why": why,
                                "error": (pred - step) / step,
                                "spread": (max(m) - min(m)) / step,
                                "predicted_samples_per_s": c["workers"] * 32 / pred * 1e6,
                                "measured_samples_per_s": c["workers"] * 32 / step * 1e6})
            print(f"  calibration {name(c):26s} predicted {pred:8.0f} us  measured {step:8.0f} us"
                  f"  (fitted, not held out)", flush=True)

    rows = []
    for i, c in enumerate(cfgs):
        pred, why = predict(c, probe)
        m = meas[str(i)]
        measured = statistics.median(m)
        err = (pred - measured) / measured
        spread = (max(m) - min(m)) / measured  # this host's run-to-run noise
        rows.append({"config": c, "name": name(c), "predicted_us": pred, "measured_us": measured,
                     "measured_runs_us": m, "error": err, "spread": spread, "why": why,
                     "predicted_samples_per_s": c["workers"] * 32 / pred * 1e6,
                     "measured_samples_per_s": c["workers"] * 32 / measured * 1e6})
        print(f"  {name(c):32s} predicted {pred:8.0f} us  measured {measured:8.0f} us  "
              f"error {err * 100:+6.1f}%", flush=True)

    abs_err = [abs(r["error"]) for r in rows]
    med, worst = statistics.median(abs_err), max(abs_err)
    # Recommendation among the configurations run with the fixed worker count of the job (the
    # most common worker count in the list): the highest predicted samples/s. The candidates are
    # every measured configuration with that worker count, the calibration ones included (with
    # the model's prediction after calibration, like the others), and the best measured one is
    # taken over the same set.
    wmain = statistics.mode([r["config"]["workers"] for r in rows])
    cand = [r for r in rows + calibration if r["config"]["workers"] == wmain]
    rec = max(cand, key=lambda r: r["predicted_samples_per_s"])
    best = max(cand, key=lambda r: r["measured_samples_per_s"])
    gap = 1 - rec["measured_samples_per_s"] / best["measured_samples_per_s"]

    print()
    print("| configuration | predicted step (us) | measured step (us), median | runs (us) | "
          "run spread | error |")
    print("|---|---:|---:|---|---:|---:|")
    for r in rows:
        runs = " / ".join(f"{x:.0f}" for x in r["measured_runs_us"])
        print(f"| {r['name']} | {r['predicted_us']:.0f} | {r['measured_us']:.0f} | {runs} | "
              f"{r['spread'] * 100:.0f}% | {r['error'] * 100:+.1f}% |")
    for r in calibration:
        runs = " / ".join(f"{x:.0f}" for x in r["measured_runs_us"])
        print(f"| {r['name']} (calibration, fitted) | {r['predicted_us']:.0f} | "
              f"{r['measured_us']:.0f} | {runs} | {r['spread'] * 100:.0f}% | "
              f"{r['error'] * 100:+.1f}% |")
    print()
    print("calibration: " + cal_fit)
    spread_med = statistics.median(r["spread"] for r in rows)
    print(f"median absolute error {med * 100:.1f}%, max {worst * 100:.1f}% over {len(rows)} "
          f"configurations (median run-to-run spread, (max - min) / median: "
          f"{spread_med * 100:.0f}%)")
    print(f"recommended ({wmain} workers, {len(cand)} measured candidates incl. calibration): "
          f"{rec['name']}, measured "
          f"{rec['measured_samples_per_s']:.0f} samples/s; best measured: {best['name']}, "
          f"{best['measured_samples_per_s']:.0f} samples/s; gap {gap * 100:.1f}% "
          f"({'within' if gap <= 0.05 else 'NOT within'} 5%)")
    out = a.out or os.path.join(ROOT, "bench", "results", f"plan-{stamp}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": {"stamp": stamp, "quick": a.quick, "epochs": epochs, "reps": reps,
                            "compute_us": compute, "probe": json.load(open(probe)),
                            "calibration": calibration, "calibration_fit": cal_fit,
                            "schedule": "interleaved rounds"},
                   "rows": rows, "median_abs_error": med, "max_abs_error": worst,
                   "median_run_spread": spread_med,
                   "recommended": rec["name"], "best_measured": best["name"],
                   "recommended_gap": gap,
                   "recommendation_candidates": [r["name"] for r in cand], "retried_runs": retries}, f, indent=1)
    print("wrote " + out)
    if a.max_median_error and med > a.max_median_error:
        print(f"FAIL: median absolute error {med * 100:.1f}% > {a.max_median_error * 100:.0f}%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
