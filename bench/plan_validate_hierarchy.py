#!/usr/bin/env python3
"""Compares `shardps_plan`'s host model (docs/plan.md, "Hosts, links and hierarchical
aggregation") with the emulated-host benchmark's results (scripts/bench-hierarchy.py writes
bench/results/hierarchy-*.json):

  {"when": .., "host": .., "model_bytes": ..,
   "runs": [{"hosts": H, "local_workers": L, "rate_mbit": .., "placement": "dedicated|colocated",
             "mode": "flat|hierarchical", "link_bytes_per_step": [...], "ratio_to_model": [...],
             "step_ms_median": .., "steps": .., "ok": true}, ...]}

For every run with "ok": true it runs `shardps_plan --predict` with the run's hosts, local
workers, link rate (rate_mbit x 1e6 / 8 bytes/s; none when 0 or absent), placement and mode, and
prints predicted | measured | error for
  * the step time (step_ms_median), and
  * the bytes per step on a worker host's link: the mean over the worker hosts (the first H
    entries of link_bytes_per_step, predicted and measured alike), and the busiest link when
    the measured list has as many entries as plan's (worker hosts, then dedicated server hosts),
each marked within or NOT within the 10% target. The workload comes, in this order, from the
run's own fields ("servers", "partition_bytes", "consistency", "staleness"), from the "workload"
of the details file beside it (hierarchy_details-<stamp>.json, or --details; its linreg trainer,
"ps_test_worker --model=linreg" with "dim" and "outputs", gives the model: W dim x outputs and
b outputs), then from the command line.

Without a linreg workload give --digits [--hidden N] or --model FILE (plan's model file); without
any, one tensor of model_bytes is assumed (fine for bytes when one partition holds it, rougher
for step times). The probe file
(shardps_plan --probe) and the compute per step (--compute-us) must be of the machine that ran
the benchmark. Exit 1 with --max-error X when any compared figure's |error| exceeds X.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.10


def parse_predict(out):
    """The --predict output: step, bound, link bytes per host, and the flat/hier sentence."""
    m = re.search(r"^predicted_step_us ([0-9.]+) .*\| (bound: [^;]*)", out, re.M)
    if not m:
        raise ValueError("no predicted_step_us line in:\n" + out)
    links = re.search(r"^link_bytes_per_step((?: [0-9.]+)*)$", out, re.M)
    cmp_ = re.search(r"^flat vs hierarchical: (.*)$", out, re.M)
    return {"step_us": float(m.group(1)), "bound": m.group(2),
            "link_bytes": [float(x) for x in links.group(1).split()] if links else [],
            "comparison": cmp_.group(1) if cmp_ else ""}


def err(pred, meas):
    return (pred - meas) / meas if meas else float("nan")


def mark(e):
    return "within" if abs(e) <= TARGET else "NOT within"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="bench/results/hierarchy-*.json")
    ap.add_argument("--build", default=os.environ.get("SHARDPS_BUILD_DIR", "build"))
    ap.add_argument("--plan", default="", help="shardps_plan binary (default BUILD/tools/...)")
    ap.add_argument("--probe-file", required=True, help="shardps_plan --probe output")
    ap.add_argument("--compute-us", type=float, required=True,
                    help="compute per step per worker, measured alone")
    ap.add_argument("--digits", action="store_true", help="the model: the digits MLP")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--model", default="", help="the model: plan's model file")
    ap.add_argument("--details", default="",
                    help="the benchmark's details file (default: hierarchy_details-<stamp>.json "
                         "beside the results, when there)")
    ap.add_argument("--servers", type=int, default=None, help="default: the details', else 1")
    ap.add_argument("--partition-bytes", type=int, default=None,
                    help="default: the details', else 4 MiB")
    ap.add_argument("--consistency", default=None, choices=["bsp", "ssp", "asp"],
                    help="default: the details', else bsp")
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--machines", type=int, default=1,
                    help="physical machines the emulated hosts share (their cores)")
    ap.add_argument("--cores", type=int, default=0)
    ap.add_argument("--link-duplex", default="full", choices=["full", "half"])
    ap.add_argument("--wire-overhead", type=float, default=None,
                    help="bytes below the transport per transport byte (plan's default if unset)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--net-cpu-ns-per-byte", type=float, default=None,
                    help="CPU per byte over a host link (default: the details' rate_check, "
                         "measured with iperf3 by bench-hierarchy.py; 0: not modelled)")
    ap.add_argument("--loopback-cpu-ns-per-byte", type=float, default=None,
                    help="the same within one host (default: the details' rate_check)")
    ap.add_argument("--out", default="", help="write the comparison as JSON here")
    ap.add_argument("--max-error", type=float, default=0)
    a = ap.parse_args(argv)

    build = a.build if os.path.isabs(a.build) else os.path.join(ROOT, a.build)
    plan = a.plan or os.path.join(build, "tools", "shardps_plan")
    if not os.access(plan, os.X_OK):
        sys.exit(f"missing {plan}: build the shardps_plan target first")
    with open(a.results) as f:
        res = json.load(f)
    model_bytes = float(res.get("model_bytes") or 0)
    runs = [r for r in res.get("runs", []) if r.get("ok", False)]
    skipped = len(res.get("runs", [])) - len(runs)
    if not runs:
        sys.exit(f"{a.results}: no run with \"ok\": true")

    details = a.details
    if not details:
        m = re.search(r"hierarchy-([0-9TZ]+)\.json$", a.results)
        guess = os.path.join(os.path.dirname(a.results),
                             f"hierarchy_details-{m.group(1)}.json") if m else ""
        details = guess if guess and os.path.exists(guess) else ""
    workload = {}
    rate_check = {}  # "1000" -> {"net_cpu_ns_per_byte": .., "loopback_cpu_ns_per_byte": ..}
    detail_runs = {}  # run directory's last part ("1000-2x2-dedicated-flat") -> its details
    if details:
        with open(details) as f:
            d = json.load(f)
        workload = d.get("workload", {})
        rate_check = d.get("rate_check", {})
        for x in d.get("runs", []):
            detail_runs[os.path.basename(x.get("run_dir", ""))] = x
        print(f"workload from {details}: {workload}")
    if a.servers is None:
        a.servers = int(workload.get("servers", 1))
    if a.partition_bytes is None:
        a.partition_bytes = int(workload.get("partition_bytes", 4 << 20))
    if a.consistency is None:
        a.consistency = workload.get("consistency", "bsp")
    tmp = tempfile.mkdtemp(prefix="plan-hier-")
    linreg = "--model=linreg" in workload.get("trainer", "") and "dim" in workload
    if a.digits:
        model_args = ["--digits", f"--hidden={a.hidden}"]
    elif a.model:
        model_args = ["--model=" + a.model]
    elif linreg:
        dim, outputs = int(workload["dim"]), int(workload["outputs"])
        path = os.path.join(tmp, "model.txt")
        with open(path, "w") as f:
            f.write(f"# ps_test_worker --model=linreg (tests/integration/ps_test_worker.cc)\n"
                    f"W {dim} {outputs}\nb {outputs}\n")
        model_args = ["--model=" + path]
        if model_bytes and abs((dim * outputs + outputs) * 4 - model_bytes) > 0.5:
            print(f"warning: linreg {dim} x {outputs} is {(dim * outputs + outputs) * 4} bytes, "
                  f"the results say {model_bytes:.0f}")
    else:
        if model_bytes <= 0 or int(model_bytes) % 4:
            sys.exit("give --digits or --model (the results have no usable model_bytes)")
        path = os.path.join(tmp, "model.txt")
        with open(path, "w") as f:
            f.write(f"# one tensor of the results' model_bytes ({int(model_bytes)})\n"
                    f"model {int(model_bytes) // 4}\n")
        model_args = ["--model=" + path]
        print(f"note: no --digits/--model: one tensor of {int(model_bytes)} bytes assumed")

    print(f"plan vs {a.results} (when {res.get('when', '?')}, host {res.get('host', '?')}, "
          f"model {model_bytes:.0f} B); probe {a.probe_file}, compute {a.compute_us:.0f} us; "
          f"{len(runs)} runs ({skipped} not ok, skipped)")
    rows = []
    for r in runs:
        H, L = int(r["hosts"]), int(r["local_workers"])
        rate = float(r.get("rate_mbit") or 0)
        hier = r["mode"] == "hierarchical"
        cmd = [plan, "--probe_file=" + a.probe_file, f"--compute_us={a.compute_us}",
               "--predict", f"--hosts={H}", f"--local_workers={L}",
               f"--servers={int(r.get('servers', a.servers))}",
               f"--partition_bytes={int(r.get('partition_bytes', a.partition_bytes))}",
               f"--mode={r.get('consistency', a.consistency)}",
               f"--staleness={int(r.get('staleness', a.staleness))}",
               f"--placement={r['placement']}", f"--hierarchical={'true' if hier else 'false'}",
               f"--machines={a.machines}", f"--link_duplex={a.link_duplex}",
               f"--batch={a.batch}"] + model_args
        if rate > 0:
            cmd.append(f"--link_Bps={rate * 1e6 / 8}")
        # The CPU a byte costs on this fabric: measured by bench-hierarchy.py's rate check with
        # iperf3 (not fitted to these runs), unless given.
        rc = rate_check.get("%g" % rate, rate_check.get(str(int(rate)), {}))
        net_ns = a.net_cpu_ns_per_byte if a.net_cpu_ns_per_byte is not None \
            else rc.get("net_cpu_ns_per_byte")
        loop_ns = a.loopback_cpu_ns_per_byte if a.loopback_cpu_ns_per_byte is not None \
            else rc.get("loopback_cpu_ns_per_byte")
        if net_ns:
            cmd.append(f"--net_cpu_ns_per_byte={net_ns}")
        if loop_ns:
            cmd.append(f"--loopback_cpu_ns_per_byte={loop_ns}")
        if a.cores:
            cmd.append(f"--cores={a.cores}")
        if a.wire_overhead is not None:
            cmd.append(f"--wire_overhead={a.wire_overhead}")
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
        if p.returncode != 0:
            sys.exit("shardps_plan --predict failed:\n" + " ".join(cmd) + "\n" + p.stdout)
        pred = parse_predict(p.stdout)
        meas_step = float(r["step_ms_median"]) * 1e3
        meas_links = [float(x) for x in r.get("link_bytes_per_step", [])]
        row = {"run": r, "name": f"{H}h x {L}l {r['mode']} {r['placement']} "
                                  f"{'%g Mbit/s' % rate if rate > 0 else 'unlimited'}",
               "predicted_step_us": pred["step_us"], "measured_step_us": meas_step,
               "step_error": err(pred["step_us"], meas_step), "bound": pred["bound"],
               "predicted_link_bytes": pred["link_bytes"], "measured_link_bytes": meas_links,
               "comparison": pred["comparison"]}
        if meas_links and pred["link_bytes"]:
            n = min(H, len(meas_links), len(pred["link_bytes"]))
            row["predicted_worker_link"] = statistics.mean(pred["link_bytes"][:n])
            row["measured_worker_link"] = statistics.mean(meas_links[:n])
            row["worker_link_error"] = err(row["predicted_worker_link"],
                                           row["measured_worker_link"])
            if len(meas_links) == len(pred["link_bytes"]):
                row["predicted_busiest_link"] = max(pred["link_bytes"])
                row["measured_busiest_link"] = max(meas_links)
                row["busiest_link_error"] = err(row["predicted_busiest_link"],
                                                row["measured_busiest_link"])
        # Dedicated servers' links, from the details ("server_link_bytes_per_step": {"s0": ..}),
        # against plan's server hosts (its entries after the H worker hosts): their mean.
        det = detail_runs.get(f"{rate:g}-{H}x{L}-{r['placement']}-{r['mode']}", {})
        srv = det.get("server_link_bytes_per_step", {})
        if r["placement"] == "dedicated" and srv and len(pred["link_bytes"]) > H:
            row["predicted_server_link"] = statistics.mean(pred["link_bytes"][H:])
            row["measured_server_link"] = statistics.mean(float(v) for v in srv.values())
            row["server_link_error"] = err(row["predicted_server_link"],
                                           row["measured_server_link"])
        rows.append(row)

    print()
    print("| run | predicted step (us) | measured step (us) | error | | worker link, "
          "predicted / measured (x model) | error | | busiest link error | | plan's bound |")
    print("|---|---:|---:|---:|---|---:|---:|---|---:|---|---|")
    errors = []
    for w in rows:
        e = w["step_error"]
        errors.append(e)
        line = (f"| {w['name']} | {w['predicted_step_us']:.0f} | {w['measured_step_us']:.0f} | "
                f"{e * 100:+.1f}% | {mark(e)} |")
        if "worker_link_error" in w:
            le = w["worker_link_error"]
            errors.append(le)
            mb = model_bytes or 1
            line += (f" {w['predicted_worker_link'] / mb:.2f} / {w['measured_worker_link'] / mb:.2f}"
                     f" | {le * 100:+.1f}% | {mark(le)} |")
        else:
            line += " - | - | |"
        if "busiest_link_error" in w:
            be = w["busiest_link_error"]
            errors.append(be)
            line += f" {be * 100:+.1f}% | {mark(be)} |"
        else:
            line += " - | |"
        line += f" {w['bound'][len('bound: '):]} |"
        print(line)
    step_err = [abs(w["step_error"]) for w in rows]
    link_err = [abs(w["worker_link_error"]) for w in rows if "worker_link_error" in w]
    print()
    print(f"step time: median |error| {statistics.median(step_err) * 100:.1f}%, max "
          f"{max(step_err) * 100:.1f}%, {sum(e <= TARGET for e in step_err)}/{len(step_err)} "
          f"within 10%")
    if link_err:
        print(f"worker link bytes: median |error| {statistics.median(link_err) * 100:.1f}%, max "
              f"{max(link_err) * 100:.1f}%, {sum(e <= TARGET for e in link_err)}/{len(link_err)} "
              f"within 10%")
    srv_rows = [w for w in rows if "server_link_error" in w]
    if srv_rows:
        print("dedicated server links (the details file), predicted / measured, x model bytes:")
        for w in srv_rows:
            e = w["server_link_error"]
            errors.append(e)
            mb = model_bytes or 1
            print(f"  {w['name']}: {w['predicted_server_link'] / mb:.2f} / "
                  f"{w['measured_server_link'] / mb:.2f}  {e * 100:+.1f}% {mark(e)}")
        se = [abs(w["server_link_error"]) for w in srv_rows]
        print(f"server link bytes: median |error| {statistics.median(se) * 100:.1f}%, max "
              f"{max(se) * 100:.1f}%, {sum(e <= TARGET for e in se)}/{len(se)} within 10%")
    # Flat against hierarchical, measured: for each (hosts, local workers, rate, placement)
    # with both modes, which was faster, and whether plan picks the same.
    pairs = {}
    for w in rows:
        r = w["run"]
        pairs.setdefault((r["hosts"], r["local_workers"], r.get("rate_mbit"), r["placement"]),
                         {})[r["mode"]] = w
    agree = 0
    total = 0
    for k, v in sorted(pairs.items(), key=lambda kv: str(kv[0])):
        if "flat" not in v or "hierarchical" not in v:
            continue
        total += 1
        meas_h = v["hierarchical"]["measured_step_us"] < v["flat"]["measured_step_us"]
        pred_h = v["hierarchical"]["predicted_step_us"] < v["flat"]["predicted_step_us"]
        agree += meas_h == pred_h
        print(f"{k[0]}h x {k[1]}l {k[3]} {k[2] or 'unlimited'} Mbit/s: measured "
              f"{'hierarchical' if meas_h else 'flat'} faster "
              f"({v['flat']['measured_step_us'] / v['hierarchical']['measured_step_us']:.2f}x "
              f"flat/hier), plan says {'hierarchical' if pred_h else 'flat'}"
              f"{'' if meas_h == pred_h else ' (DISAGREES)'}")
    if total:
        print(f"plan's choice of flat or hierarchical agrees with the measurement in "
              f"{agree}/{total} settings")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": a.results, "probe": a.probe_file, "compute_us": a.compute_us,
                       "rows": rows, "agree": agree, "pairs": total}, f, indent=1)
        print("wrote " + a.out)
    if a.max_error and any(abs(e) > a.max_error for e in errors):
        print(f"FAIL: an error above {a.max_error * 100:.0f}%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
