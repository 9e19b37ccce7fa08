#!/usr/bin/python3
"""Staleness under heterogeneity: time to accuracy and final test error per consistency mode.

Runs every (model, scenario, seed, mode) as its own local ShardPS cluster (1 coordinator,
--servers shard servers, --workers digits_trainer workers, tcp), parses the workers'
time-stamped 'eval:' lines (digits_trainer --eval_every) and writes
  bench/results/staleness-<stamp>.json    every run's curves, timings and the summary
  docs/staleness-curves.png               test accuracy vs wall time per mode (mean
                                          over seeds, min/max band), one panel per model x
                                          scenario
  docs/staleness-tta.png                  time to the target accuracy per mode (median, min/max)
and prints the markdown tables (also stored in the JSON under "markdown").

Scenarios:
  slow-worker  rank W-1 computes 3x slower (digits_trainer --slowdown 3 --slowdown_rank W-1: after
               its gradient computation (wall time c, plus --compute_delay_ms d) it sleeps
               2 x (c + d) each step).
  slow-server  one of the shard servers runs in its own network namespace, joined to the
               namespace of everything else by a veth pair whose two ends are rate-limited
               with tc tbf (both directions); the rest talk over that namespace's addresses.
               Nothing is added to the host's namespace. Needs root and 'ip netns'.
Definitions (docs/staleness.md):
  t = 0           the earliest worker's first step (its step-0 eval line, wall clock)
  curve           every worker's evals merged in time order: each is of the weights it just
                  pulled, the newest version meeting the mode's bound (a step function; held
                  after the job's end in the plots)
  time to target  the first eval, by any worker, with accuracy >= target
  final error     1 - test accuracy of the worker that finished last, at its end (every push
                  of the job is in the weights it pulled last)
  steps/s         all workers' steps / (last worker's end - t0)

usage: /usr/bin/python3 scripts/bench-staleness.py [--quick] [--seeds N] [--models digits,wide]
         [--scenarios slow-worker,slow-server] [--modes bsp,ssp1,ssp2,ssp4,asp,vsgd] [...]
Every process runs under timeout -s KILL (--run-timeout); a run that fails is recorded as failed
and the study goes on.
"""
import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each model: trainer flags, server learning rate, chunk size, target accuracy, tc rate of the
# throttled server's link. Epochs are chosen so a BSP run in either scenario lasts ~5-10 s on
# the 2-core development host (the whole of one model x scenario x 5 seeds x 6 modes < 8 min).
MODELS = {
    # The main job's MLP 64-64-10 (4,810 parameters). Its real compute is ~0.3 ms per step, far
    # below a step's communication, so every worker also sleeps 5 ms of simulated compute
    # (--compute_delay_ms); the slowed worker's compute phase is then 3 x (c + 5 ms).
    "digits": dict(hidden=64, compute_delay_ms=5.0, epochs=12, batch_size=32, eval_every=4,
                   lr=0.2, partition_bytes=8192, target=0.95, throttle="16mbit"),
    # MLP 64-1024-10 (76,810 parameters, 300 KiB): real compute ~3-4 ms per step and 16x the
    # bytes per push and pull; no simulated compute.
    "wide": dict(hidden=1024, compute_delay_ms=0.0, epochs=12, batch_size=32, eval_every=10,
                 lr=0.1, partition_bytes=65536, target=0.95, throttle="160mbit"),
}
ALL_MODES = ["bsp", "ssp1", "ssp2", "ssp4", "asp", "vsgd"]
SCENARIOS = ["slow-worker", "slow-server"]

EVAL_RE = re.compile(r"^eval: rank (\d+) step (\d+) t=([\d.]+) unix=([\d.]+) acc=([\d.]+)$", re.M)
TIMING_RE = re.compile(
    r"^timing: rank (\d+) steps (\d+) elapsed ([\d.]+) s compute ([\d.]+) ms delay ([\d.]+) ms "
    r"slowdown ([\d.]+) ms \(factor ([\d.]+)\) step ([\d.]+) ms eval ([\d.]+) s "
    r"pull_retries ([\d.]+)$", re.M)
FINAL_RE = re.compile(r"^final: .*$", re.M)


def mode_args(mode, vsgd_staleness):
    """(coordinator --consistency, --staleness) of a mode name."""
    if mode.startswith("ssp"):
        return "ssp", int(mode[3:])
    if mode == "vsgd":
        return "vsgd", vsgd_staleness
    return mode, 0


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   timeout=20)


def rate_bytes_per_s(rate):
    """tc's rate syntax as bytes per second: 16mbit, 500kbit, 1gbit, 2mbps."""
    m = re.fullmatch(r"([\d.]+)([kmg]?)(bit|bps)", rate.lower())
    if not m:
        raise RuntimeError(f"throttle rate '{rate}' is not like 16mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
    return int(float(m[1]) * scale / (8 if m[3] == "bit" else 1))


class Throttle:
    """Two network namespaces joined by one veth pair, both ends shaped with tc tbf.

    'main' holds the coordinator, the unthrottled server(s) and the workers (10.78.0.1); 'slow'
    holds the throttled server (10.78.0.2). Names carry our pid; deleting the namespaces (close)
    removes the veth pair and every qdisc with them. Nothing touches the host's namespace.
    """

    def __init__(self, rate):
        tag = os.getpid()
        self.main, self.slow = f"sps-stale-m-{tag}", f"sps-stale-s-{tag}"
        self.main_ip, self.slow_ip = "10.78.0.1", "10.78.0.2"
        self.rate = rate
        self.created = []
        try:
            for ns in (self.main, self.slow):
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.main, "link", "add", "vm", "type", "veth", "peer", "name", "vs",
               "netns", self.slow)
            for ns, dev, ip in ((self.main, "vm", self.main_ip), (self.slow, "vs", self.slow_ip)):
                sh("ip", "-n", ns, "addr", "add", ip + "/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                # burst: 10 ms at the rate (>= one timer tick at any HZ), at least 64 KiB.
                burst = max(64 * 1024, rate_bytes_per_s(rate) // 100)
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", str(burst), "latency", "200ms")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            err = getattr(e, "stderr", b"") or b""
            self.close()
            raise RuntimeError(f"{' '.join(e.cmd)}: {err.decode(errors='replace').strip()}")

    def qdisc_stats(self):
        out = {}
        for ns, dev in ((self.main, "vm"), (self.slow, "vs")):
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev",
                                dev], capture_output=True, text=True, timeout=20)
            out[f"{ns}:{dev}"] = r.stdout.strip()
        return out

    def close(self):
        for ns in self.created:
            # Only our runs start processes in our namespaces; any left over are killed by pid.
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                               timeout=20)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.created = []


class Cluster:
    """The processes of one run; every one in its own session so that kill() takes its timeout
    wrapper and the binary together."""

    def __init__(self, run_dir, env):
        self.run_dir, self.env, self.procs = run_dir, env, []

    def start(self, name, cmd, ns, bound_s):
        prefix = ["ip", "netns", "exec", ns] if ns else []
        full = prefix + ["timeout", "-s", "KILL", str(bound_s)] + cmd
        out = open(os.path.join(self.run_dir, name + ".log"), "w")
        p = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                             start_new_session=True, cwd=ROOT)
        out.close()
        self.procs.append((name, p))
        return p

    def kill(self):
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _, p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def run_one(args, model_name, scenario, mode, seed, throttle, run_dir):
    m = MODELS[model_name]
    build = os.path.join(ROOT, args.build)
    os.makedirs(run_dir, exist_ok=True)
    consistency, staleness = mode_args(mode, args.vsgd_staleness)
    env = dict(os.environ, SHARDPS_CLUSTER_TOKEN=secrets.token_hex(16))
    c = Cluster(run_dir, env)
    main_ns = throttle.main if throttle else None
    ip = throttle.main_ip if throttle else "127.0.0.1"
    bound = args.run_timeout
    result = dict(model=model_name, scenario=scenario, mode=mode, seed=seed,
                  consistency=consistency, staleness=staleness, load_before=loadavg(),
                  run_dir=os.path.relpath(run_dir, ROOT), ok=False)
    t_start = time.time()
    try:
        addr_file = os.path.join(run_dir, "coordinator.addr")
        coord = c.start("coordinator", [
            os.path.join(build, "server/shardps_coordinator"), f"--listen={ip}:0",
            f"--address_file={addr_file}", f"--consistency={consistency}",
            f"--staleness={staleness}", f"--num_servers={args.servers}",
            f"--num_workers={args.workers}", "--exit_when_done", "--replicas=1",
            f"--state_file={os.path.join(run_dir, 'coordinator.state')}",
            "--data_transport=tcp", f"--partition_bytes={m['partition_bytes']}"], main_ns, bound)
        deadline = time.time() + 20
        while not (os.path.exists(addr_file) and os.path.getsize(addr_file) > 0):
            if coord.poll() is not None or time.time() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.05)
        addr = open(addr_file).read().split()[0]
        for i in range(args.servers):
            throttled = throttle is not None and i == args.servers - 1
            c.start(f"server-{i}", [
                os.path.join(build, "server/shardps_server"), f"--coordinator={addr}",
                "--transport=tcp", f"--bind_ip={throttle.slow_ip if throttled else ip}",
                "--optimizer=momentum", f"--lr={m['lr']}", "--exit_when_done"],
                throttle.slow if throttled else main_ns, bound)
        workers = []
        for i in range(args.workers):
            cmd = [os.path.join(build, "examples/digits_trainer"), f"--coordinator={addr}",
                   "--transport=tcp", f"--bind_ip={ip}",
                   f"--data={os.path.join(build, 'data/digits_train.bin')}",
                   f"--hidden={m['hidden']}", f"--epochs={m['epochs']}",
                   f"--batch_size={m['batch_size']}", f"--seed={seed}", "--log_every=0",
                   f"--eval_every={m['eval_every']}",
                   f"--compute_delay_ms={m['compute_delay_ms']}", f"--wait_timeout_s={bound}"]
            if scenario == "slow-worker":
                cmd += [f"--slowdown={args.slowdown}", f"--slowdown_rank={args.workers - 1}"]
            workers.append(c.start(f"worker-{i}", cmd, main_ns, bound))
        deadline = time.time() + bound
        while any(p.poll() is None for p in workers) and time.time() < deadline:
            time.sleep(0.05)
        rcs = [p.poll() for p in workers]
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"worker exit statuses {rcs} (None: still running at {bound} s; "
                               "137: killed by the bound)")
        result.update(parse_run(run_dir, args.workers, m["target"]))
        result["ok"] = True
    except Exception as e:  # a failed run is data: recorded, the study goes on
        result["error"] = str(e)
    finally:
        c.kill()
    result["wall_s"] = time.time() - t_start
    return result


def parse_run(run_dir, workers, target):
    evals, timing, final = {}, {}, None
    for i in range(workers):
        text = open(os.path.join(run_dir, f"worker-{i}.log")).read()
        for mt in EVAL_RE.finditer(text):
            evals.setdefault(int(mt[1]), []).append((int(mt[2]), float(mt[4]), float(mt[5])))
        for mt in TIMING_RE.finditer(text):
            timing[int(mt[1])] = dict(zip(
                ["steps", "elapsed_s", "compute_ms", "delay_ms", "slowdown_ms", "factor",
                 "step_ms", "eval_s", "pull_retries_per_step"],
                [float(x) for x in mt.groups()[1:]]))
        f = FINAL_RE.search(text)
        final = f[0] if f else final
    if sorted(evals) != list(range(workers)) or sorted(timing) != list(range(workers)):
        raise RuntimeError(f"eval/timing lines from ranks {sorted(evals)}/{sorted(timing)}")
    t0 = min(e[0][1] for e in evals.values())
    ends = {r: e[-1][1] - t0 for r, e in evals.items()}
    last = max(ends, key=ends.get)
    # Every eval is of weights a worker just pulled: the newest published version that met the
    # mode's bound, so the merged evals of all workers trace the servers' model over time (and
    # go on after rank 0 is done, which in ASP/SSP can be long before the slowed worker).
    curve = sorted((round(u - t0, 4), acc, r, step) for r, e in evals.items()
                   for step, u, acc in e)
    tta = next((t for t, acc, _, _ in curve if acc >= target), None)
    job_s = ends[last]
    total_steps = sum(t["steps"] for t in timing.values())
    return dict(t0_unix=t0, curve=curve, end_s=ends, last_rank=last,
                final_acc=evals[last][-1][2], final_acc_rank0=evals[0][-1][2],
                time_to_target_s=tta, job_s=job_s, steps_per_s=total_steps / job_s,
                timing=timing, final_line=final,
                evals={r: [(s, round(u - t0, 4), a) for s, u, a in e] for r, e in evals.items()})


def summarize(runs, modes, target_of):
    """{(model, scenario): {mode: row}} over the runs that finished."""
    out = {}
    for r in runs:
        out.setdefault((r["model"], r["scenario"]), {}).setdefault(r["mode"], []).append(r)
    table = {}
    for key, by_mode in out.items():
        rows = {}
        for mode in modes:
            rs = by_mode.get(mode, [])
            ok = [r for r in rs if r["ok"]]
            reached = [r["time_to_target_s"] for r in ok if r["time_to_target_s"] is not None]
            errs = [100 * (1 - r["final_acc"]) for r in ok]
            rows[mode] = dict(
                runs=len(rs), ok=len(ok), reached=len(reached), target=target_of[key[0]],
                tta_median_s=statistics.median(reached) if reached else None,
                tta_min_s=min(reached) if reached else None,
                tta_max_s=max(reached) if reached else None,
                err_mean=statistics.mean(errs) if errs else None,
                err_sd=statistics.stdev(errs) if len(errs) > 1 else 0.0 if errs else None,
                steps_per_s=statistics.mean(r["steps_per_s"] for r in ok) if ok else None,
                job_s=statistics.mean(r["job_s"] for r in ok) if ok else None)
        table[key] = rows
    return table


def fmt(x, spec, none="–"):
    return none if x is None else format(x, spec)


def markdown(table, modes, vsgd_staleness):
    lines = []
    for (model, scenario), rows in sorted(table.items()):
        target = next(iter(rows.values()))["target"]
        lines += [f"#### {model}, {scenario}", "",
                  f"| mode | time to {target:.2f} (median s, min–max) | seeds reached | "
                  "final test error % (mean ± sd) | steps/s (all workers) | job s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for mode in modes:
            r = rows.get(mode)
            if not r:
                continue
            name = f"vsgd (s={vsgd_staleness})" if mode == "vsgd" else mode
            tta = ("–" if r["tta_median_s"] is None else
                   f"{r['tta_median_s']:.2f} ({r['tta_min_s']:.2f}–{r['tta_max_s']:.2f})")
            err = ("–" if r["err_mean"] is None else f"{r['err_mean']:.2f} ± {r['err_sd']:.2f}")
            failed = "" if r["ok"] == r["runs"] else f" ({r['runs'] - r['ok']} failed)"
            lines.append(f"| {name} | {tta} | {r['reached']}/{r['ok']}{failed} | {err} | "
                         f"{fmt(r['steps_per_s'], '.0f')} | {fmt(r['job_s'], '.2f')} |")
        ssp = rows.get(f"ssp{vsgd_staleness}")
        v = rows.get("vsgd")
        if ssp and v and ssp["err_mean"] and v["err_mean"] is not None:
            speed = (ssp["tta_median_s"] / v["tta_median_s"]
                     if ssp["tta_median_s"] and v["tta_median_s"] else None)
            lines += ["", f"VSGD vs SSP(s={vsgd_staleness}): time to target "
                      f"{fmt(speed, '.2f')}x (SSP / VSGD; > 1: VSGD faster), steps/s "
                      f"{v['steps_per_s'] / ssp['steps_per_s']:.2f}x, final error "
                      f"{100 * v['err_mean'] / ssp['err_mean']:.0f}% of SSP's."]
        lines.append("")
    return "\n".join(lines)


def plot(runs, table, modes, docs_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = sorted(table)
    models = sorted({k[0] for k in keys})
    scenarios = [s for s in SCENARIOS if any(k[1] == s for k in keys)]
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(ALL_MODES)}
    fig, axes = plt.subplots(len(models), len(scenarios), squeeze=False,
                             figsize=(6.5 * len(scenarios), 4.2 * len(models)))
    for i, model in enumerate(models):
        for j, scenario in enumerate(scenarios):
            ax = axes[i][j]
            rs = [r for r in runs if r["ok"] and r["model"] == model and r["scenario"] == scenario]
            if not rs:
                ax.set_visible(False)
                continue
            horizon = max(r["job_s"] for r in rs)
            grid = np.linspace(0, horizon, 300)
            for mode in modes:
                curves = []
                for r in (r for r in rs if r["mode"] == mode):
                    t = np.array([p[0] for p in r["curve"]])
                    a = np.array([p[1] for p in r["curve"]])
                    # Step function: the latest eval at or before each grid time (held after end).
                    idx = np.searchsorted(t, grid, side="right") - 1
                    curves.append(np.where(idx >= 0, a[np.clip(idx, 0, None)], np.nan))
                if not curves:
                    continue
                c = np.array(curves)
                ax.plot(grid, np.nanmean(c, axis=0), color=colors[mode], label=mode, lw=1.5)
                ax.fill_between(grid, np.nanmin(c, axis=0), np.nanmax(c, axis=0),
                                color=colors[mode], alpha=0.15, lw=0)
            target = MODELS[model]["target"]
            ax.axhline(target, color="gray", ls=":", lw=1)
            ax.set_ylim(0.5, 1.0)
            ax.set_xlabel("wall time since the first step (s)")
            ax.set_ylabel("test accuracy (latest eval, any worker)")
            ax.set_title(f"{model}, {scenario} (mean over seeds, min/max band)")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    curves_png = os.path.join(docs_dir, "staleness-curves.png")
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(keys), squeeze=False, figsize=(4.2 * len(keys), 3.6))
    for ax, key in zip(axes[0], keys):
        rows = table[key]
        ms = [m for m in modes if m in rows]
        med = [rows[m]["tta_median_s"] or 0 for m in ms]
        lo = [med[k] - (rows[m]["tta_min_s"] or 0) for k, m in enumerate(ms)]
        hi = [(rows[m]["tta_max_s"] or 0) - med[k] for k, m in enumerate(ms)]
        ax.bar(ms, med, yerr=[lo, hi], color=[colors[m] for m in ms], capsize=3)
        for k, m in enumerate(ms):
            ax.text(k, med[k], f"{rows[m]['reached']}/{rows[m]['ok']}", ha="center",
                    va="bottom", fontsize=7)
        ax.set_title(f"{key[0]}, {key[1]}: time to {MODELS[key[0]]['target']:.2f}", fontsize=9)
        ax.set_ylabel("s (median over seeds reaching it)")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    tta_png = os.path.join(docs_dir, "staleness-tta.png")
    fig.savefig(tta_png, dpi=110)
    plt.close(fig)
    return [os.path.relpath(p, ROOT) for p in (curves_png, tta_png)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 seed, modes bsp,ssp2,asp,vsgd, model digits")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--models", default="digits,wide")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=3.0, help="slow-worker: compute factor")
    ap.add_argument("--throttle", default="", help="slow-server: tc rate for every model "
                    "(default: per model, e.g. 16mbit for digits)")
    ap.add_argument("--vsgd-staleness", type=int, default=4, help="VSGD's SSP bound s")
    ap.add_argument("--epochs", type=int, default=0, help="override every model's epochs")
    ap.add_argument("--run-timeout", type=int, default=40, help="bound on each process (s)")
    ap.add_argument("--build", default=os.environ.get("SHARDPS_BUILD_DIR", "build"))
    ap.add_argument("--out", default="", help="JSON path (default bench/results/"
                    "staleness-<stamp>.json)")
    ap.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"), help="where the PNGs go")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C: every run's processes are killed, the namespaces deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.seeds, args.modes = 1, "bsp,ssp2,asp,vsgd"
        if args.models == "digits,wide":
            args.models = "digits"
    models = args.models.split(",")
    scenarios = args.scenarios.split(",")
    modes = args.modes.split(",")
    for x, allowed in ((models, MODELS), (scenarios, SCENARIOS), (modes, ALL_MODES)):
        bad = [v for v in x if v not in allowed]
        if bad:
            ap.error(f"unknown {bad}; choose from {list(allowed)}")
    if args.epochs:
        for m in MODELS.values():
            m["epochs"] = args.epochs
    build = os.path.join(ROOT, args.build)
    for b in ("server/shardps_coordinator", "server/shardps_server", "examples/digits_trainer",
              "data/digits_train.bin", "data/digits_test.bin"):
        if not os.path.exists(os.path.join(build, b)):
            sys.exit(f"bench-staleness: missing {args.build}/{b} (build digits_trainer "
                     "shardps_server shardps_coordinator_bin; export the data: scripts/run.sh)")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(ROOT, "bench/results", f"staleness-{stamp}.json")
    logs = os.path.join(build, "bench-staleness", stamp)
    meta = dict(stamp=stamp, argv=sys.argv, workers=args.workers, servers=args.servers,
                slowdown=args.slowdown, vsgd_staleness=args.vsgd_staleness, transport="tcp",
                optimizer="momentum (0.9)", replicas=1, models=MODELS, modes=modes,
                cpus=os.cpu_count(), load_at_start=loadavg(),
                cpu_model=next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                if l.startswith("model name")), "?"),
                git=subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                   capture_output=True, text=True).stdout.strip())
    runs, blocks = [], []
    print(f"bench-staleness: {len(models)} model(s) x {len(scenarios)} scenario(s) x "
          f"{args.seeds} seed(s) x {len(modes)} mode(s); logs in {logs}", flush=True)
    for scenario in scenarios:
        for model in models:
            throttle = None
            block = dict(model=model, scenario=scenario, load_before=loadavg(), t=time.time())
            if scenario == "slow-server":
                rate = args.throttle or MODELS[model]["throttle"]
                try:
                    throttle = Throttle(rate)
                except RuntimeError as e:
                    print(f"bench-staleness: slow-server unavailable: {e}", flush=True)
                    block["error"] = str(e)
                    blocks.append(block)
                    continue
                block["throttle"] = rate
            try:
                for seed in range(1, args.seeds + 1):
                    for mode in modes:  # modes interleaved, so load drift hits them alike
                        run_dir = os.path.join(logs, f"{model}-{scenario}-{mode}-seed{seed}")
                        r = run_one(args, model, scenario, mode, seed, throttle, run_dir)
                        r["load_after"] = loadavg()
                        runs.append(r)
                        if r["ok"]:
                            print(f"  {model:6} {scenario:11} {mode:5} seed {seed}: "
                                  f"tta {fmt(r['time_to_target_s'], '.2f')} s, final acc "
                                  f"{r['final_acc']:.4f} (rank {r['last_rank']} last), "
                                  f"{r['steps_per_s']:.0f} steps/s, job {r['job_s']:.2f} s, "
                                  f"load {r['load_before'][0]:.2f}", flush=True)
                        else:
                            print(f"  {model:6} {scenario:11} {mode:5} seed {seed}: FAILED "
                                  f"{r['error']} (logs {r['run_dir']})", flush=True)
                if throttle:
                    block["qdisc"] = throttle.qdisc_stats()
            finally:
                if throttle:
                    throttle.close()
            block["minutes"] = (time.time() - block.pop("t")) / 60
            block["load_after"] = loadavg()
            blocks.append(block)
    table = summarize(runs, modes, {m: MODELS[m]["target"] for m in MODELS})
    md = markdown(table, modes, args.vsgd_staleness)
    meta["load_at_end"] = loadavg()
    os.makedirs(os.path.dirname(out), exist_ok=True)

    def save(pngs):  # first without the plots, so a plotting error loses no data
        with open(out, "w") as f:
            json.dump(dict(meta=meta, blocks=blocks, plots=pngs, markdown=md,
                           summary={f"{k[0]}/{k[1]}": v for k, v in table.items()}, runs=runs),
                      f, separators=(",", ":"))  # compact: every eval line of every run
    save([])
    pngs = [] if args.no_plots or not any(r["ok"] for r in runs) else plot(
        runs, table, modes, args.docs_dir)
    save(pngs)
    print(md)
    for b in blocks:
        print(f"block {b['model']}/{b['scenario']}: {b.get('minutes', 0):.1f} min, load "
              f"{b['load_before']} -> {b.get('load_after')}" +
              (f", throttle {b['throttle']}" if "throttle" in b else "") +
              (f", ERROR {b['error']}" if "error" in b else ""))
    print(f"bench-staleness: wrote {os.path.relpath(out, ROOT)}" +
          (f", {', '.join(pngs)}" if pngs else ""))
    return 0 if all(r["ok"] for r in runs) and not any("error" in b for b in blocks) else 1


if __name__ == "__main__":
    sys.exit(main())
