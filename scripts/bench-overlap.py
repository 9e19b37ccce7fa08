#!/usr/bin/python3
"""Overlap benchmark (issue item 3): per-step time of one model trained by 2 workers on 2 shard
servers over tcp, each worker with torch.set_num_threads(1), for

  (a) compute alone   forward + backward, no communication (both workers still run at once,
                      so they compete for the CPUs as in the other rows)
  (b) non-overlapped  shardps.torch.DistributedOptimizer: push all, clock, pull all, in step()
  (c) overlapped      shardps.overlap.BucketedSync: buckets pushed from backward hooks, pulls
                      awaited by forward pre-hooks, for each --bucket-kib

and the fraction of communication hidden, ((b) - (c)) / ((b) - (a)). "exposed ms" is the time
per step the worker spent blocked in the client (b: inside step(); c: in push/clock/pull/wait,
i.e. the pre-hooks' waits and finish_step).

    PYTHONPATH=build/python SHARDPS_BUILD_DIR=build scripts/bench-overlap.py
    scripts/bench-overlap.py --model transformer --bucket-kib 256,1024 --steps 15

Each configuration runs --repeats times, interleaved with the others (the host's load drifts);
a row reports the median and the minimum over repeats of the workers' median step (on a shared
host the minimum is the run least disturbed by other work). "CPU ms" adds up the CPU time of
the workers and of the coordinator and servers per step: on 2 CPUs, 2 single-threaded workers
already keep both busy, so the communication's CPU work (the servers' apply, tcp copies,
polling) has no idle CPU to hide in. Every run is bounded (--run-timeout), and the whole bench
by --timeout.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

nn = torch.nn


# ---- models ----

class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.sc = None
        if stride != 1 or cin != cout:
            self.sc = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = self.b2(self.c2(h))
        return torch.relu(h + (x if self.sc is None else self.sc(x)))


def resnet(width=32):
    """A ResNet-14 for 3x32x32 (3 stages of 2 basic blocks): 0.70 M parameters, 2.7 MiB."""
    w = width
    return nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                         Block(w, w, 1), Block(w, w, 1), Block(w, 2 * w, 2),
                         Block(2 * w, 2 * w, 1), Block(2 * w, 4 * w, 2), Block(4 * w, 4 * w, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10))


class Transformer(nn.Module):
    """A 4-layer transformer encoder (d=128, 4 heads, ff 512) on synthetic sequences:
    0.79 M parameters, 3.0 MiB."""

    def __init__(self, d=128, layers=4):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def make(model, batch, rank):
    torch.manual_seed(0)
    m = resnet() if model == "resnet" else Transformer()
    g = torch.Generator().manual_seed(100 + rank)
    if model == "resnet":
        x = torch.randn(batch, 3, 32, 32, generator=g)
    else:
        x = torch.randn(batch, 32, 128, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return m, x, y


# ---- one worker ----

class TimedClient:
    """Delegates to a shardps.Client, adding up the time spent in the calls that block."""

    def __init__(self, c):
        self._c, self.blocked = c, 0.0

    def _timed(self, fn, *a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.blocked += time.perf_counter() - t

    def push(self, name):
        return self._timed(self._c.push, name)

    def pull(self, name):
        return self._timed(self._c.pull, name)

    def wait(self, h):
        return self._timed(self._c.wait, h)

    def clock(self):
        return self._timed(self._c.clock)

    def __getattr__(self, a):
        return getattr(self._c, a)


def worker(a):
    import shardps
    torch.set_num_threads(1)
    model, x, y = make(a.model, a.batch, a.rank)
    loss_fn = nn.functional.cross_entropy
    client, closers = None, []
    if a.mode == "compute":
        def step():
            model.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            return 0.0
    elif a.mode == "plain":
        import shardps.torch as spt
        opt = spt.DistributedOptimizer(model, client=shardps.Client(
            bind_ip="127.0.0.1", setup_timeout_ms=60000, wait_timeout_ms=30000))
        closers.append(opt.close)

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            t = time.perf_counter()
            opt.step()
            return time.perf_counter() - t
    else:
        from shardps.overlap import BucketedSync
        raw = shardps.Client(bind_ip="127.0.0.1", setup_timeout_ms=60000, wait_timeout_ms=30000)
        client = TimedClient(raw)
        sync = BucketedSync(client, model.named_parameters(), bucket_bytes=a.bucket_kib * 1024)
        sync.register()
        raw.start()
        sync.install(model)
        closers += [sync.close, raw.close]

        def step():
            b0 = client.blocked
            sync.zero_grad()
            loss_fn(model(x), y).backward()
            sync.finish_step()
            return client.blocked - b0

    for _ in range(a.warmup):
        step()
    # The coordinator's and servers' CPU (rank 0 samples them), and this process's (all its
    # threads: the tcp progress thread included), over the measured steps.
    pids = [int(q) for q in os.environ.get("BENCH_DAEMON_PIDS", "").split(",") if q]
    d0 = sum(_cpu_s(q) for q in pids) if a.rank == 0 else 0.0
    c0 = time.process_time()
    step_times, exposed = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        exposed.append(step())
        step_times.append(time.perf_counter() - t)
    cpu_ms = 1000 * (time.process_time() - c0) / a.steps
    daemon_ms = 1000 * (sum(_cpu_s(q) for q in pids) - d0) / a.steps if a.rank == 0 else 0.0
    for close in closers:
        close()
    print("RESULT " + json.dumps({
        "rank": a.rank, "step_ms": 1000 * statistics.median(step_times),
        "exposed_ms": 1000 * statistics.median(exposed), "cpu_ms": cpu_ms,
        "daemon_cpu_ms": daemon_ms,
        "params": sum(p.numel() for p in model.parameters())}), flush=True)


# ---- the driver ----

def run_config(a, mode, bucket_kib):
    import shardps.launch
    from shardps.overlap import partition_bytes_for
    cl = None
    env = dict(os.environ, GLOG_minloglevel="2", OMP_NUM_THREADS="1")
    if mode != "compute":
        part = a.partition_bytes
        if part is None and mode == "overlap":
            part = partition_bytes_for(bucket_kib * 1024, a.servers)
        cl = shardps.launch.LocalCluster(servers=a.servers, workers=a.workers, lr=0.01,
                                         optimizer="sgd", transport="tcp",
                                         partition_bytes=part, grace=2.0)
        env.update(SHARDPS_COORDINATOR=cl.address, SHARDPS_CLUSTER_TOKEN=cl.token,
                   SHARDPS_TRANSPORT="tcp",
                   BENCH_DAEMON_PIDS=",".join(str(q.pid) for q in getattr(cl, "_procs", [])))
    try:
        procs = []
        for r in range(a.workers):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode,
                   "--rank", str(r), "--model", a.model, "--batch", str(a.batch),
                   "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--bucket-kib", str(bucket_kib or 0)]
            procs.append(subprocess.Popen(cmd, env=dict(env, SHARDPS_RANK=str(r)),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        results, end = [], time.monotonic() + a.run_timeout
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"{mode}: a worker ran past {a.run_timeout} s")
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"{mode}: worker failed (rc {p.returncode}):\n{out[-3000:]}")
            results.append(json.loads(lines[-1][7:]))
    finally:
        if cl is not None:
            cl.close()
    return (statistics.mean(r["step_ms"] for r in results),
            statistics.mean(r["exposed_ms"] for r in results),
            sum(r["cpu_ms"] for r in results) + results[0]["daemon_cpu_ms"],
            results[0]["params"])


def _cpu_s(pid):
    """utime + stime of a live process, in seconds (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("resnet", "transformer"), default="resnet")
    p.add_argument("--batch", type=int, default=None, help="per worker (resnet 8, transformer 8)")
    p.add_argument("--bucket-kib", default="256,1024,4096")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--partition-bytes", type=int, default=None,
                   help="the coordinator's --partition_bytes (default: its own 4 MiB for (b); "
                        "bucket/servers for (c), so every bucket is split over the servers)")
    p.add_argument("--run-timeout", type=float, default=180.0)
    p.add_argument("--timeout", type=float, default=1200.0, help="the whole bench")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="compute", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.batch is None:
        a.batch = 8
    if a.worker:
        a.bucket_kib = int(a.bucket_kib)
        return worker(a)
    buckets = [int(b) for b in a.bucket_kib.split(",") if b]
    configs = [("compute", 0), ("plain", 0)] + [("overlap", b) for b in buckets]
    got = {c: [] for c in configs}
    deadline = time.monotonic() + a.timeout
    params, loads = 0, [os.getloadavg()[0]]
    for rep in range(a.repeats):
        for c in configs:
            if time.monotonic() > deadline:
                print(f"# --timeout {a.timeout} s reached: fewer repeats", file=sys.stderr)
                break
            step, exposed, cpu, params = run_config(a, *c)
            got[c].append((step, exposed, cpu))
            loads.append(os.getloadavg()[0])
            print(f"# repeat {rep} {c[0]}{' %d KiB' % c[1] if c[1] else ''}: {step:.1f} ms/step, "
                  f"{exposed:.1f} ms exposed, {cpu:.1f} CPU ms/step", file=sys.stderr, flush=True)
    med = {c: tuple(statistics.median(r[i] for r in v) for i in range(3))
           for c, v in got.items() if v}
    low = {c: min(r[0] for r in v) for c, v in got.items() if v}
    cores = os.cpu_count()
    print(f"model {a.model} ({params / 1e6:.2f} M parameters, {params * 4 / 2**20:.1f} MiB), "
          f"batch {a.batch} per worker, {a.workers} workers x {a.servers} servers, tcp, "
          f"1 torch thread per worker, {cores} CPUs; {a.repeats} runs x {a.steps} steps "
          f"each; {time.strftime('%Y-%m-%d %H:%M %Z')}, 1-min load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(f"{'':<34}{'ms/step':>17}{'hidden':>16}")
    print(f"{'configuration':<34}{'median':>9}{'min':>8}{'median':>9}{'min':>7}"
          f"{'exposed ms':>12}{'CPU ms':>8}{'CPUs busy':>11}")

    def hidden(t, a_, b_):
        return f"{(b_ - t) / (b_ - a_):.0%}" if b_ > a_ else "n/a"

    for c in configs:
        if c not in med:
            continue
        step, exposed, cpu = med[c]
        label = {"compute": "(a) compute alone", "plain": "(b) non-overlapped step"}.get(
            c[0], f"(c) overlapped, {c[1]} KiB buckets")
        hm = hl = ""
        if c[0] == "overlap":
            hm = hidden(step, med[("compute", 0)][0], med[("plain", 0)][0])
            hl = hidden(low[c], low[("compute", 0)], low[("plain", 0)])
        print(f"{label:<34}{step:>9.1f}{low[c]:>8.1f}{hm:>9}{hl:>7}{exposed:>12.1f}{cpu:>8.0f}"
              f"{cpu / step:>11.2f}")
    print("hidden = ((b) - (c)) / ((b) - (a)), from the medians and from the minima over runs "
          "(the minima are the runs least disturbed by other load on the host); exposed: time "
          "blocked in the client per step (median); CPU ms: all workers' and daemons' CPU time "
          "per step (median); CPUs busy = CPU ms / median ms per step.")


if __name__ == "__main__":
    main()
