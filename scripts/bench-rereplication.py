#!/usr/bin/python3
"""Re-replication benchmark (docs/fault-tolerance.md, "Redundancy restored").

A 2-group x 2-replica cluster with one spare trains a linear model of DIM x OUTPUTS floats
(momentum, BSP) with ps_test_worker. Group 0's primary is SIGKILLed mid-run; its backup is
promoted and the spare becomes the group's new backup, copying the primary's snapshot with
one-sided reads while training goes on. Prints the snapshot size, the primary's time to take it,
the spare's copy time, the records held during the copy, and the mean step time before the
kill, from the kill until the spare is in sync, and after it (the step-time impact).

usage: scripts/bench-rereplication.py [--transport tcp|shm] [--dim N] [--outputs N]
                                      [--steps N] [--kill-at N] [--workers N]
Env: SHARDPS_BUILD_DIR (default build). Every process is killed on exit; every wait is bounded.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("SHARDPS_BUILD_DIR", os.path.join(ROOT, "build"))
if not os.path.isabs(BUILD):
    BUILD = os.path.join(ROOT, BUILD)
TOKEN = "bench-rereplication-token"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm", "verbs"])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--outputs", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--kill-at", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bind-ip", default="127.0.0.1")
    ap.add_argument("--timeout", type=float, default=240.0)
    a = ap.parse_args()
    run = tempfile.mkdtemp(prefix="shardps-rerepl-")
    procs = []

    def spawn(argv, log):
        f = open(os.path.join(run, log), "w")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def log_of(name):
        try:
            with open(os.path.join(run, name)) as f:
                return f.read()
        except OSError:
            return ""

    def wait_for(pred, bound, what):
        until = time.monotonic() + bound
        while time.monotonic() < until:
            v = pred()
            if v:
                return v
            time.sleep(0.002)
        raise SystemExit("bench-rereplication: timed out waiting for " + what + "; logs in " + run)

    try:
        addr_file = os.path.join(run, "coordinator.addr")
        spawn([os.path.join(BUILD, "server", "shardps_coordinator"), "--listen=%s:0" % a.bind_ip,
               "--address_file=" + addr_file, "--cluster_token=" + TOKEN, "--consistency=bsp",
               "--num_servers=2", "--replicas=2", "--num_workers=%d" % a.workers,
               "--data_transport=" + a.transport], "coordinator.log")
        addr = wait_for(lambda: open(addr_file).read().strip() if os.path.exists(addr_file)
                        and os.path.getsize(addr_file) else None, 20, "the coordinator")
        server = [os.path.join(BUILD, "server", "shardps_server"), "--coordinator=" + addr,
                  "--cluster_token=" + TOKEN, "--transport=" + a.transport,
                  "--bind_ip=" + a.bind_ip, "--optimizer=momentum", "--lr=0.01"]
        servers = [spawn(server + ["--rank=%d" % r], "server%d.log" % r) for r in range(4)]
        spawn(server + ["--spare"], "spare.log")
        for r in range(a.workers):
            spawn([os.path.join(BUILD, "tests", "ps_test_worker"), "--coordinator=" + addr,
                   "--cluster_token=" + TOKEN, "--transport=" + a.transport,
                   "--bind_ip=" + a.bind_ip, "--rank=%d" % r, "--workers=%d" % a.workers,
                   "--lr=0.01", "--dim=%d" % a.dim, "--outputs=%d" % a.outputs,
                   "--steps=%d" % a.steps, "--out=" + os.path.join(run, "worker%d.out" % r),
                   "--progress_file=" + os.path.join(run, "progress%d" % r),
                   "--setup_timeout_ms=60000", "--wait_timeout_ms=30000"], "worker%d.log" % r)

        times = {}  # step -> when rank 0 reported it done
        progress = os.path.join(run, "progress0")
        kill_t = sync_t = None
        deadline = time.monotonic() + a.timeout
        while time.monotonic() < deadline:
            try:
                step = int(open(progress).read().strip() or 0)
            except (OSError, ValueError):
                step = 0
            now = time.monotonic()
            for s in range(max(times.keys(), default=0) + 1, step + 1):
                times[s] = now
            if kill_t is None and step >= a.kill_at:
                servers[0].send_signal(signal.SIGKILL)
                kill_t, kill_step = now, step
            if kill_t is not None and sync_t is None and "IN SYNC" in log_of("spare.log"):
                sync_t, sync_step = now, step
            if step >= a.steps:
                break
            time.sleep(0.001)
        if step < a.steps or sync_t is None:
            raise SystemExit("bench-rereplication: the run did not finish (step %d, sync %s); "
                             "logs in %s" % (step, sync_t is not None, run))

        def mean_ms(lo, hi):  # mean step time of steps (lo, hi]
            lo, hi = max(lo, 1), min(hi, a.steps)
            return (times[hi] - times[lo]) * 1000.0 / (hi - lo) if hi > lo else float("nan")

        spare = log_of("spare.log")
        primary = log_of("server2.log")
        m = re.search(r"snapshot of (\d+) bytes copied and restored in (\d+) ms; (\d+) records", spare)
        t = re.search(r"snapshot of (\d+) bytes taken in (\d+) us", primary)
        model_mb = a.dim * a.outputs * 4 / 1e6
        print("bench-rereplication: %s, model %.1f MB (W %dx%d + b), 2 groups x 2 replicas + 1 "
              "spare, %d workers, momentum, BSP" % (a.transport, model_mb, a.dim, a.outputs,
                                                     a.workers))
        if t:
            print("  snapshot (group 0, weights + momentum): %d bytes, taken by the promoted "
                  "primary in %.1f ms" % (int(t.group(1)), int(t.group(2)) / 1000.0))
        if m:
            print("  spare: copied with one-sided reads and restored in %s ms; %s records held "
                  "meanwhile" % (m.group(2), m.group(3)))
        print("  kill -> spare in sync: %.0f ms (steps %d -> %d)" % ((sync_t - kill_t) * 1000,
                                                                    kill_step, sync_step))
        before = mean_ms(kill_step - 40, kill_step - 1)
        during = mean_ms(kill_step - 1, sync_step + 1)
        after = mean_ms(sync_step + 5, sync_step + 45)
        print("  mean step time: before the kill %.2f ms; kill..sync (failover + copy) %.2f ms; "
              "after the sync %.2f ms (%.2fx before)" % (before, during, after, after / before))
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
