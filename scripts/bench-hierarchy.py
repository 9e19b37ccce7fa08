#!/usr/bin/python3
"""Hierarchical aggregation on emulated hosts: bytes per host link per step, flat vs hierarchical.

Every emulated host is a network namespace joined by a veth pair to a Linux bridge in a "switch"
namespace; each host's link is shaped with tc tbf in both directions (egress of the host-side
end, eth0, and of the switch-side end) at --rates Mbit/s. The coordinator sits on the bridge
itself (switch namespace, unshaped; it carries only the control plane). Per configuration:

  hosts H x local workers L, rate, placement, mode
    placement dedicated   the 2 shard servers on 2 hosts of their own (shaped like the others)
              colocated   server i in host i's namespace, next to that host's workers
    mode      flat        every worker joins the coordinator (--num_workers = H*L)
              hierarchical  one shardps_aggregator per host (--num_workers = H); its L workers
                          get SHARDPS_AGGREGATOR=<socket> and SHARDPS_LOCAL_RANK=l

Workload: tests/integration/ps_test_worker --model=linreg (W: --dim x --outputs floats and
b: --outputs floats; default 1024 x 512 = 2.0 MiB), BSP over tcp, --batch 1 (compute is ~ms:
the step is communication), --steps per run. Every worker writes its completed-step count to a
progress file; when every worker has completed --warmup steps the harness reads each host's
eth0 counters (rx_bytes + tx_bytes, `ip -n NS -s -j link`) and the clock, and again when every
worker has completed steps - 3 (the window's ends are exact to about one step: a worker may
have begun its next step when the slowest one completes this one). Per configuration it reports

  link_bytes_per_step[h]  (rx + tx bytes of host h's eth0 over the window) / window steps
  ratio_to_model[h]       link_bytes_per_step[h] / model bytes (flat: expect ~2L, one push and
                          one pull of the whole model per local worker; hierarchical: ~2)
  step_ms_median          median over workers of (time between that worker completing the
                          window's first and last step) / window steps

Output: bench/results/hierarchy-<UTC stamp>.json (the schema below; `shardps plan` reads it),
bench/results/hierarchy_details-<UTC stamp>.json (everything else: per-worker step times,
server-link bytes, tc statistics, the link-rate check, logs), docs/hierarchy.png, and markdown
tables on stdout.

  {"when", "host", "model_bytes", "runs": [{"hosts", "local_workers", "rate_mbit", "placement",
   "mode", "link_bytes_per_step", "ratio_to_model", "step_ms_median", "steps", "ok"}]}

Before the runs, the achieved rate of one shaped link is measured once per rate with iperf3
(host 0 -> host 1, 2 s; skipped with a note when iperf3 is missing).

usage (root; /usr/bin/python3 for matplotlib):
  /usr/bin/python3 scripts/bench-hierarchy.py            # default grid (32 runs), 7-10 min
  /usr/bin/python3 scripts/bench-hierarchy.py --quick    # 8 runs, ~1 min
  /usr/bin/python3 scripts/bench-hierarchy.py --selftest # 2x2 flat (+ hierarchical), asserts
If build/worker/shardps_aggregator is missing, hierarchical runs are skipped ("hierarchical: not
built"). Every process runs under timeout -s KILL; the namespaces are deleted on every exit.
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NET = "10.79.0"  # hosts .1.., dedicated servers .101.., the bridge (coordinator) .254
SERVERS = 2


def sh(*cmd, timeout=20):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout.decode()


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def tbf_args(rate_mbit):
    """tc tbf parameters that reach the rate: the bucket holds max(128 KiB, 1 ms at the rate)
    (>= two 64 KiB GSO packets; tbf's watchdog is an hrtimer, so 1 ms needs no HZ tick), and the
    queue holds 20 ms at the rate (>= 1 MiB) before tail drop."""
    bps = rate_mbit * 1e6 / 8
    burst = max(128 * 1024, int(bps / 1000))
    limit = max(1 << 20, int(bps * 0.020))
    return ["rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


class Fabric:
    """A switch namespace with a bridge, and one namespace per emulated host joined to it by a veth
    pair whose two ends are shaped with tbf. Names carry our pid; close() kills whatever still runs
    in them and deletes them (with them the veths and qdiscs). Nothing touches the host's
    namespace. Called from the main thread only."""

    def __init__(self, names, rate_mbit):
        tag = os.getpid()
        self.sw = f"sps-hb-sw-{tag}"
        self.ns, self.ip, self.port = {}, {}, {}
        self.created = []
        self.rate_mbit = rate_mbit
        try:
            sh("ip", "netns", "add", self.sw)
            self.created.append(self.sw)
            sh("ip", "-n", self.sw, "link", "set", "lo", "up")
            sh("ip", "-n", self.sw, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.sw, "addr", "add", f"{NET}.254/24", "dev", "br0")
            sh("ip", "-n", self.sw, "link", "set", "br0", "up")
            for k, (name, ip) in enumerate(names):
                ns = f"sps-hb-{name}-{tag}"
                port = f"p{k}"
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
                self.ns[name], self.ip[name], self.port[name] = ns, ip, port
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                   "netns", self.sw)
                sh("ip", "-n", self.sw, "link", "set", port, "master", "br0")
                sh("ip", "-n", self.sw, "link", "set", port, "up")
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                for n, dev in ((ns, "eth0"), (self.sw, port)):
                    sh("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                       *tbf_args(rate_mbit))
        except Exception:
            self.close()
            raise

    def counters(self, names):
        """{name: rx_bytes + tx_bytes of its eth0}, all namespaces queried at once."""
        procs = {n: subprocess.Popen(["ip", "-n", self.ns[n], "-s", "-j", "link", "show", "dev",
                                      "eth0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for n in names}
        out = {}
        for n, p in procs.items():
            stdout, _ = p.communicate(timeout=20)
            s = json.loads(stdout)[0]["stats64"]
            out[n] = (s["rx"]["bytes"], s["tx"]["bytes"])
        return out

    def qdisc_stats(self, name):
        return {side: sh("ip", "netns", "exec", n, "tc", "-s", "qdisc", "show", "dev", dev).strip()
                for side, n, dev in (("host", self.ns[name], "eth0"),
                                     ("switch", self.sw, self.port[name]))}

    def close(self):
        for ns in reversed(self.created):
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                               timeout=20)
            for pid in r.stdout.split():  # only our processes run in our namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.created = []


def busy_jiffies():
    """The machine's non-idle CPU time so far (all cores), in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4]


def measure_rate(fabric, a, b, seconds=2, cpu=None):
    """iperf3 TCP goodput a -> b in Mbit/s (receiver side), or None when iperf3 is missing.
    With `cpu` (a dict): cpu["ns_per_byte"] = the machine's CPU time (ns of one core, every
    process and interrupt) per byte received during the transfer: what a byte costs through this
    fabric's stacks, veths, qdiscs and bridge (shardps_plan --net_cpu_ns_per_byte)."""
    if subprocess.run(["which", "iperf3"], capture_output=True).returncode != 0:
        return None
    server = subprocess.Popen(["ip", "netns", "exec", fabric.ns[b], "timeout", "-s", "KILL",
                               str(seconds + 15), "iperf3", "-s", "-1", "-B", fabric.ip[b]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        for _ in range(50):
            time.sleep(0.1)
            r = subprocess.run(["ip", "netns", "exec", fabric.ns[b], "ss", "-ltn"],
                               capture_output=True, text=True, timeout=10)
            if ":5201" in r.stdout:
                break
        j0 = busy_jiffies()
        r = subprocess.run(["ip", "netns", "exec", fabric.ns[a], "timeout", "-s", "KILL",
                            str(seconds + 10), "iperf3", "-c", fabric.ip[b], "-t", str(seconds),
                            "-J"], capture_output=True, text=True, timeout=seconds + 15)
        j1 = busy_jiffies()
        got = json.loads(r.stdout)["end"]["sum_received"]
        if cpu is not None and got.get("bytes"):
            cpu["ns_per_byte"] = (j1 - j0) / os.sysconf("SC_CLK_TCK") * 1e9 / got["bytes"]
        return got["bits_per_second"] / 1e6
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(timeout=5)


class Procs:
    """The processes of one run, each in its own session so that kill() takes the timeout wrapper
    and the binary together."""

    def __init__(self, run_dir):
        self.run_dir, self.procs = run_dir, []

    def start(self, name, cmd, ns, bound_s, env):
        full = ["ip", "netns", "exec", ns, "timeout", "-s", "KILL", str(bound_s)] + cmd
        with open(os.path.join(self.run_dir, name + ".log"), "w") as out:
            p = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, cwd=ROOT)
        self.procs.append((name, p))
        return p

    def dead(self):
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None and p.returncode]

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


def read_progress(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def run_one(args, fabric, hosts, L, placement, mode, run_dir):
    """One configuration on an already shaped fabric; returns (schema row, details)."""
    build = os.path.join(ROOT, args.build)
    os.makedirs(run_dir, exist_ok=True)
    token = secrets.token_hex(16)
    env = dict(os.environ, SHARDPS_CLUSTER_TOKEN=token)
    for k in ("SHARDPS_AGGREGATOR", "SHARDPS_LOCAL_RANK", "LOCAL_RANK"):
        env.pop(k, None)
    host_names = [f"h{i}" for i in range(hosts)]
    server_hosts = ([f"s{i}" for i in range(SERVERS)] if placement == "dedicated"
                    else host_names[:SERVERS])
    W = hosts * L
    steps = args.steps
    n1, n2 = args.warmup, steps - 3
    row = dict(hosts=hosts, local_workers=L, rate_mbit=fabric.rate_mbit, placement=placement,
               mode=mode, link_bytes_per_step=[], ratio_to_model=[], step_ms_median=None,
               steps=steps, ok=False)
    det = dict(run_dir=os.path.relpath(run_dir, ROOT), load_before=loadavg(), window=[n1, n2])
    bound = args.run_timeout
    P = Procs(run_dir)
    t_start = time.time()
    # Unix socket paths are limited to 107 bytes: the aggregators' go to a short temporary folder.
    sock_dir = tempfile.mkdtemp(prefix="sps-hb-")
    try:
        addr_file = os.path.join(run_dir, "coordinator.addr")
        coord = P.start("coordinator", [
            os.path.join(build, "server/shardps_coordinator"), f"--listen={NET}.254:0",
            f"--address_file={addr_file}", "--consistency=bsp", f"--num_servers={SERVERS}",
            f"--num_workers={W if mode == 'flat' else hosts}", "--exit_when_done",
            "--replicas=1", "--data_transport=tcp", f"--partition_bytes={args.partition_bytes}",
            f"--state_file={os.path.join(run_dir, 'coordinator.state')}"], fabric.sw, bound, env)
        deadline = time.time() + 20
        while not (os.path.exists(addr_file) and os.path.getsize(addr_file) > 0):
            if coord.poll() is not None or time.time() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.05)
        addr = open(addr_file).read().split()[0]
        for i, s in enumerate(server_hosts):
            P.start(f"server-{i}", [
                os.path.join(build, "server/shardps_server"), f"--coordinator={addr}",
                "--transport=tcp", f"--bind_ip={fabric.ip[s]}", "--optimizer=sgd",
                f"--lr={args.lr}", "--exit_when_done"], fabric.ns[s], bound, env)
        progress = []
        for h, name in enumerate(host_names):
            wenv = env
            if mode == "hierarchical":
                sock = os.path.join(sock_dir, f"agg-{h}.sock")
                P.start(f"aggregator-{h}", [
                    os.path.join(build, "worker/shardps_aggregator"), f"--socket={sock}",
                    f"--local_workers={L}", f"--coordinator={addr}", f"--cluster_token={token}",
                    "--transport=tcp", f"--bind_ip={fabric.ip[name]}", f"--rank={h}"],
                    fabric.ns[name], bound, env)
                deadline = time.time() + 20
                while not os.path.exists(sock):
                    if time.time() > deadline or P.dead():
                        raise RuntimeError(f"aggregator {h} did not listen on {sock}")
                    time.sleep(0.05)
            for l in range(L):
                if mode == "hierarchical":
                    wenv = dict(env, SHARDPS_AGGREGATOR=sock, SHARDPS_LOCAL_RANK=str(l))
                pf = os.path.join(run_dir, f"progress-{h}-{l}")
                progress.append(pf)
                P.start(f"worker-{h}-{l}", [
                    os.path.join(build, "tests/ps_test_worker"), "--mode=train",
                    "--model=linreg", f"--coordinator={addr}", f"--cluster_token={token}",
                    "--transport=tcp", f"--bind_ip={fabric.ip[name]}", f"--workers={W}",
                    f"--steps={steps}", "--batch=1", f"--dim={args.dim}",
                    f"--outputs={args.outputs}", f"--lr={args.lr}", f"--progress_file={pf}",
                    f"--out={os.path.join(run_dir, f'result-{h}-{l}')}",
                    f"--setup_timeout_ms={bound * 1000}", f"--wait_timeout_ms={bound * 1000}"],
                    fabric.ns[name], bound, wenv)
        watched = host_names + [s for s in server_hosts if s not in host_names]
        # Poll the progress files; note when each worker first completed n1 and n2 steps and
        # read the counters when the slowest worker did.
        t_at = {n1: [None] * W, n2: [None] * W}
        snap = {}
        deadline = time.time() + bound
        while len(snap) < 2:
            if time.time() > deadline:
                raise RuntimeError(f"no progress to step {n2} within {bound} s")
            bad = P.dead()
            if bad:
                raise RuntimeError(f"exited early: {bad}")
            now = time.time()
            prog = [read_progress(p) for p in progress]
            for n in (n1, n2):
                for w, v in enumerate(prog):
                    if v >= n and t_at[n][w] is None:
                        t_at[n][w] = now
                if n not in snap and min(prog) >= n:
                    snap[n] = (time.time(), fabric.counters(watched))
            time.sleep(0.01)
        workers = [p for n, p in P.procs if n.startswith("worker-")]
        deadline = time.time() + bound
        while any(p.poll() is None for p in workers) and time.time() < deadline:
            time.sleep(0.05)
        rcs = [p.poll() for p in workers]
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"worker exit statuses {rcs} (None: still running; 137: killed)")
        span = n2 - n1
        per_link = {n: (snap[n2][1][n][0] - snap[n1][1][n][0] + snap[n2][1][n][1] -
                        snap[n1][1][n][1]) / span for n in watched}
        row["link_bytes_per_step"] = [round(per_link[n]) for n in host_names]
        row["ratio_to_model"] = [round(per_link[n] / args.model_bytes, 3) for n in host_names]
        step_ms = [1e3 * (t_at[n2][w] - t_at[n1][w]) / span for w in range(W)]
        row["step_ms_median"] = round(statistics.median(step_ms), 2)
        row["ok"] = True
        det.update(step_ms_per_worker=[round(x, 2) for x in step_ms],
                   window_s=snap[n2][0] - snap[n1][0],
                   server_link_bytes_per_step={s: round(per_link[s]) for s in server_hosts},
                   client_counters_per_step=client_counters(run_dir, host_names, L, steps))
    except Exception as e:  # a failed run is data: recorded, the study goes on
        det["error"] = str(e)
    finally:
        P.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)
    det["wall_s"] = round(time.time() - t_start, 2)
    det["load_after"] = loadavg()
    return row, det


def client_counters(run_dir, host_names, L, steps):
    """Sum over workers of ps_test_worker's counters (whole run) per step: chunk pushes, pulls
    and pull retries (re-reads of a chunk that was torn or not yet at the wanted version)."""
    tot = {}
    for h in range(len(host_names)):
        for l in range(L):
            try:
                with open(os.path.join(run_dir, f"result-{h}-{l}")) as f:
                    kv = dict(line.split(" ", 1) for line in f.read().splitlines() if " " in line)
            except OSError:
                continue
            for k in ("pushes", "pulls", "pull_retries"):
                tot[k] = tot.get(k, 0) + int(kv.get(k, 0))
    return {k: round(v / steps, 2) for k, v in tot.items()}


def fmt_mb(x):
    return f"{x / 1e6:.2f}"


def markdown(runs, dets, model_bytes):
    lines = [f"model: {model_bytes} bytes ({model_bytes / 2**20:.2f} MiB); link bytes = rx + tx "
             "of each host's eth0 per step; ratio = that / model bytes", "",
             "| hosts x workers | rate Mbit/s | placement | mode | MB/step per host link | "
             "ratio to model | step ms (median) | link floor ms | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r, d in zip(runs, dets):
        floor = "–"
        if r["ok"]:
            mb = ", ".join(fmt_mb(x) for x in r["link_bytes_per_step"])
            ratio = ", ".join(f"{x:.2f}" for x in r["ratio_to_model"])
            ms = f"{r['step_ms_median']:.1f}"
            # The busiest shaped link (hosts' and dedicated servers'), half its rx + tx per
            # direction, at the link rate: the step time the links alone would allow.
            busiest = max(r["link_bytes_per_step"] +
                          list(d.get("server_link_bytes_per_step", {}).values()))
            floor = f"{1e3 * busiest / 2 / (r['rate_mbit'] * 1e6 / 8):.0f}"
        else:
            mb, ratio, ms = "failed", "–", "–"
        lines.append(f"| {r['hosts']} x {r['local_workers']} | {r['rate_mbit']} | "
                     f"{r['placement']} | {r['mode']} | {mb} | {ratio} | {ms} | {floor} | "
                     f"{d['load_before'][0]:.1f} |")
    return "\n".join(lines)


def plot(runs, model_bytes, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r["ok"]]
    placements = [p for p in ("dedicated", "colocated") if any(r["placement"] == p for r in ok)]
    rates = sorted({r["rate_mbit"] for r in ok})
    fig, axes = plt.subplots(2, len(placements) * len(rates), squeeze=False,
                             figsize=(4.6 * len(placements) * len(rates), 7.2))
    colors = {"flat": "tab:red", "hierarchical": "tab:blue"}
    for j, (placement, rate) in enumerate((p, r) for p in placements for r in rates):
        rs = [r for r in ok if r["placement"] == placement and r["rate_mbit"] == rate]
        cfgs = sorted({(r["hosts"], r["local_workers"]) for r in rs})
        modes = [m for m in ("flat", "hierarchical") if any(r["mode"] == m for r in rs)]
        width = 0.8 / max(1, len(modes))
        for k, mode in enumerate(modes):
            xs, mb, ms, lo, hi = [], [], [], [], []
            for i, cfg in enumerate(cfgs):
                r = next((r for r in rs if (r["hosts"], r["local_workers"]) == cfg and
                          r["mode"] == mode), None)
                if r is None:
                    continue
                xs.append(i + (k - (len(modes) - 1) / 2) * width)
                mb.append(statistics.mean(r["link_bytes_per_step"]) / 1e6)
                lo.append(mb[-1] - min(r["link_bytes_per_step"]) / 1e6)
                hi.append(max(r["link_bytes_per_step"]) / 1e6 - mb[-1])
                ms.append(r["step_ms_median"])
            axes[0][j].bar(xs, mb, width, yerr=[lo, hi], capsize=3, color=colors[mode],
                           label=mode)
            axes[1][j].bar(xs, ms, width, color=colors[mode], label=mode)
        labels = [f"{h}x{l}" for h, l in cfgs]
        for i in range(2):
            axes[i][j].set_xticks(range(len(cfgs)), labels)
            axes[i][j].grid(axis="y", alpha=0.3)
            axes[i][j].legend(fontsize=8)
        for h, l in cfgs:  # the expected flat volume, 2 L x model, as a tick
            i = cfgs.index((h, l))
            for y in (2 * l, 2):
                axes[0][j].hlines(y * model_bytes / 1e6, i - 0.45, i + 0.45, colors="black",
                                  linestyles="--", lw=1)
        axes[0][j].set_title(f"{placement}, {rate} Mbit/s", fontsize=10)
        axes[0][j].set_ylabel("MB/step per host link (mean, min-max)")
        axes[1][j].set_ylabel("step ms (median over workers)")
        axes[1][j].set_xlabel("hosts x local workers (dashed: 2L and 2 models)")
    fig.suptitle(f"ps_test_worker linreg, {model_bytes / 2**20:.2f} MiB model, BSP over tcp, "
                 "2 servers; emulated hosts (netns + tbf) on one 2-core machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--quick", action="store_true", help="2 hosts x {2,4} workers, 1000 Mbit/s")
    ap.add_argument("--selftest", action="store_true",
                    help="2 hosts x 2 workers, dedicated, 1000 Mbit/s, 20 steps, flat (and "
                    "hierarchical when the aggregator is built); asserts the counters moved and "
                    "the ratio is ~2L flat, ~2 hierarchical; writes nothing")
    ap.add_argument("--hosts", default="2,4")
    ap.add_argument("--local-workers", default="2,4")
    ap.add_argument("--rates", default="1000,10000", help="link rates, Mbit/s")
    ap.add_argument("--placements", default="dedicated,colocated")
    ap.add_argument("--modes", default="flat,hierarchical")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps before the window")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--outputs", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.001)
    ap.add_argument("--partition-bytes", type=int, default=256 * 1024)
    ap.add_argument("--run-timeout", type=int, default=90, help="bound on each process (s)")
    ap.add_argument("--no-rate-check", action="store_true")
    ap.add_argument("--build", default=os.environ.get("SHARDPS_BUILD_DIR", "build"))
    ap.add_argument("--out", default="", help="JSON path (default bench/results/"
                    "hierarchy-<stamp>.json)")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "hierarchy.png"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C: the run's processes are killed, the namespaces deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.hosts, args.local_workers, args.rates = "2", "2,4", "1000"
    if args.selftest:
        args.hosts, args.local_workers, args.rates = "2", "2", "1000"
        args.placements, args.steps, args.warmup = "dedicated", 20, 4
        args.no_plots = True
    hosts_list = [int(x) for x in args.hosts.split(",")]
    L_list = [int(x) for x in args.local_workers.split(",")]
    rates = [int(x) for x in args.rates.split(",")]
    placements = args.placements.split(",")
    modes = args.modes.split(",")
    for x, allowed in ((placements, ("dedicated", "colocated")),
                       (modes, ("flat", "hierarchical"))):
        bad = [v for v in x if v not in allowed]
        if bad:
            ap.error(f"unknown {bad}; choose from {list(allowed)}")
    if min(hosts_list) < SERVERS and "colocated" in placements:
        ap.error(f"colocated needs >= {SERVERS} hosts")
    if args.steps - 3 <= args.warmup:
        ap.error("--steps must exceed --warmup + 3")
    if os.geteuid() != 0:
        sys.exit("bench-hierarchy: needs root (ip netns, tc)")
    build = os.path.join(ROOT, args.build)
    for b in ("server/shardps_coordinator", "server/shardps_server",
              "tests/ps_test_worker"):
        if not os.path.exists(os.path.join(build, b)):
            sys.exit(f"bench-hierarchy: missing {args.build}/{b} (build shardps_server "
                     "shardps_coordinator_bin ps_test_worker)")
    have_agg = os.path.exists(os.path.join(build, "worker/shardps_aggregator"))
    if "hierarchical" in modes and not have_agg:
        print("bench-hierarchy: hierarchical: not built (no "
              f"{args.build}/worker/shardps_aggregator); running flat only", flush=True)
        modes = [m for m in modes if m != "hierarchical"]
    if not modes:
        sys.exit("bench-hierarchy: nothing to run")
    args.model_bytes = 4 * (args.dim * args.outputs + args.outputs)

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = args.out or os.path.join(ROOT, "bench/results", f"hierarchy-{stamp}.json")
    logs = os.path.join(build, "bench-hierarchy", stamp)
    details = dict(argv=sys.argv, stamp=stamp, cpus=os.cpu_count(), load_at_start=loadavg(),
                   cpu_model=next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                   if l.startswith("model name")), "?"),
                   kernel=os.uname().release,
                   git=subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip(),
                   workload=dict(trainer="ps_test_worker --model=linreg --batch=1", dim=args.dim,
                                 outputs=args.outputs, servers=SERVERS, transport="tcp",
                                 consistency="bsp", optimizer="sgd", lr=args.lr,
                                 partition_bytes=args.partition_bytes, warmup=args.warmup),
                   hierarchical_built=have_agg, rate_check={}, runs=[], qdisc={})
    runs = []
    configs = [(h, L, p, m) for h in hosts_list for L in L_list for p in placements
               for m in modes]
    print(f"bench-hierarchy: {len(configs)} config(s) x {len(rates)} rate(s), model "
          f"{args.model_bytes} bytes, {args.steps} steps (window {args.warmup}.."
          f"{args.steps - 3}); logs in {logs}", flush=True)
    for rate in rates:
        names = [(f"h{i}", f"{NET}.{i + 1}") for i in range(max(hosts_list))]
        if "dedicated" in placements:
            names += [(f"s{i}", f"{NET}.{101 + i}") for i in range(SERVERS)]
        fabric = Fabric(names, rate)
        try:
            if not args.no_rate_check and not args.selftest:
                net, loop = {}, {}
                got = measure_rate(fabric, "h0", "h1", cpu=net)
                measure_rate(fabric, "h0", "h0", cpu=loop)  # a server on its client's host
                details["rate_check"][str(rate)] = dict(
                    tbf=" ".join(tbf_args(rate)), iperf3_mbit=got and round(got, 1),
                    net_cpu_ns_per_byte=net.get("ns_per_byte"),
                    loopback_cpu_ns_per_byte=loop.get("ns_per_byte"))
                print(f"  link {rate} Mbit/s ({' '.join(tbf_args(rate))}): iperf3 h0->h1 " +
                      (f"{got:.0f} Mbit/s TCP goodput, {net.get('ns_per_byte', 0):.2f} ns of CPU a byte "
                       f"(loopback {loop.get('ns_per_byte', 0):.2f})" if got
                       else "skipped (no iperf3)"),
                      flush=True)
            for hosts, L, placement, mode in configs:
                run_dir = os.path.join(logs, f"{rate}-{hosts}x{L}-{placement}-{mode}")
                row, det = run_one(args, fabric, hosts, L, placement, mode, run_dir)
                runs.append(row)
                details["runs"].append(det)
                if row["ok"]:
                    print(f"  {hosts}x{L} {rate:>5} {placement:9} {mode:12}: "
                          f"MB/step/link {[fmt_mb(x) for x in row['link_bytes_per_step']]} "
                          f"ratio {row['ratio_to_model']} step {row['step_ms_median']:.1f} ms "
                          f"(wall {det['wall_s']:.1f} s, load {det['load_before'][0]:.2f})",
                          flush=True)
                else:
                    print(f"  {hosts}x{L} {rate:>5} {placement:9} {mode:12}: FAILED "
                          f"{det['error']} (logs {det['run_dir']})", flush=True)
            details["qdisc"][str(rate)] = fabric.qdisc_stats("h0")
        finally:
            fabric.close()
    md = markdown(runs, details["runs"], args.model_bytes)
    print(md)
    if args.selftest:
        return selftest_verdict(runs, details)
    doc = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": socket.gethostname(), "model_bytes": args.model_bytes, "runs": runs}
    details["load_at_end"] = loadavg()
    details["markdown"] = md
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    # Not hierarchy-*.json: readers of the schema above glob for that.
    base = os.path.basename(out)
    base = ("hierarchy_details-" + base[len("hierarchy-"):] if base.startswith("hierarchy-")
            else os.path.splitext(base)[0] + ".details.json")
    det_path = os.path.join(os.path.dirname(out), base)
    with open(det_path, "w") as f:
        json.dump(details, f, indent=1)
    wrote = [os.path.relpath(out, ROOT), os.path.relpath(det_path, ROOT)]
    if not args.no_plots and any(r["ok"] for r in runs):
        plot(runs, args.model_bytes, args.png)
        wrote.append(os.path.relpath(args.png, ROOT))
    print(f"bench-hierarchy: wrote {', '.join(wrote)}")
    return 0 if all(r["ok"] for r in runs) else 1


def selftest_verdict(runs, details):
    """Every run moved bytes on every host link, about 2 L models per step flat and 2 hierarchical
    (one push and one pull per trainer on the link): between 0.9x and 1.6x that. Above it: TCP/IP
    headers and ACKs (~6%), and BSP pulls that read a chunk before its version is ready (the first
    read takes header and data together; a trainer that is not the last to push reads the data
    again once it is) add up to one more model per trainer. Hierarchical must also be below flat."""
    problems = []
    for r, d in zip(runs, details["runs"]):
        if not r["ok"]:
            problems.append(f"run failed: {d.get('error')}")
            continue
        expect = 2 * (r["local_workers"] if r["mode"] == "flat" else 1)
        for h, (b, q) in enumerate(zip(r["link_bytes_per_step"], r["ratio_to_model"])):
            if b <= 0:
                problems.append(f"{r['mode']} host {h}: counters did not move")
            elif not 0.9 * expect <= q <= 1.6 * expect:
                problems.append(f"{r['mode']} host {h}: ratio {q} outside "
                                f"[{0.9 * expect:.1f}, {1.6 * expect:.1f}]")
        if not r["step_ms_median"] or r["step_ms_median"] <= 0:
            problems.append(f"{r['mode']}: no step time")
    by_mode = {r["mode"]: r for r in runs if r["ok"]}
    if len(by_mode) == 2 and (max(by_mode["hierarchical"]["link_bytes_per_step"]) >=
                              min(by_mode["flat"]["link_bytes_per_step"])):
        problems.append("hierarchical moved no fewer bytes per host link than flat")
    for d in details["runs"]:
        print(f"bench-hierarchy selftest: server links {d.get('server_link_bytes_per_step')} "
              f"bytes/step, clients {d.get('client_counters_per_step')} per step")
    for p in problems:
        print(f"bench-hierarchy selftest: FAIL {p}")
    if not problems:
        print("bench-hierarchy selftest: PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
