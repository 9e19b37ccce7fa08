#!/usr/bin/python3
"""Time-to-accuracy: a plain PyTorch script vs its DDP and ShardPS conversions (docs/python.md).

Runs, one after the other in this invocation, with the same epochs, seed and hyper-parameters:
  plain    examples/torch_cnn_digits.py, one process
  ddp      examples/torch_cnn_digits_ddp.py under torch.distributed.run, W processes, gloo (CPU)
  shardps  examples/torch_cnn_digits_shardps.py under python -m shardps.run, W workers and
           --servers shard servers (tcp, BSP)
Every process gets OMP_NUM_THREADS=1. The conversions keep the plain script's global batch
(--batch-size; each of the W workers takes batch-size/W of it, gradients averaged), so all
three do the same number of steps of the same size per epoch.

Prints a table: workers, epochs, seconds to reach --target test accuracy (rank 0's training
clock, which starts after set-up: process group / cluster join), training seconds in all, the
whole command's wall seconds (launcher, cluster start and stop, imports), final accuracy; then
the accuracy per epoch of each; then the size of each conversion: the sum over the hunks of
`diff -U0 plain converted` of max(lines added, lines removed) (a modified line counts once).

usage: scripts/bench-ddp.py [--workers 4] [--servers 2] [--epochs 10] [--target 0.95]
                            [--lr 0.05] [--batch-size 64] [--seed 1] [--timeout 180]
Env: SHARDPS_BUILD_DIR (default build): the shardps package is BUILD/python, the daemons
BUILD/server. Each run is bounded by --timeout (its whole process group is killed after it).
"""
import argparse
import datetime
import difflib
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("SHARDPS_BUILD_DIR", os.path.join(ROOT, "build"))
if not os.path.isabs(BUILD):
    BUILD = os.path.join(ROOT, BUILD)
EXAMPLES = os.path.join(ROOT, "examples")
PLAIN = os.path.join(EXAMPLES, "torch_cnn_digits.py")
DDP = os.path.join(EXAMPLES, "torch_cnn_digits_ddp.py")
SHARDPS = os.path.join(EXAMPLES, "torch_cnn_digits_shardps.py")
EPOCH_RE = re.compile(r"epoch=(\d+) test_accuracy=([0-9.]+) elapsed=([0-9.]+)")
FINAL_RE = re.compile(r"final: test_accuracy=([0-9.]+) seconds=([0-9.]+)")


def changed_lines(a_path, b_path):
    """(changed, added, removed): changed = sum over diff -U0 hunks of max(added, removed)."""
    with open(a_path) as f:
        a = f.read().splitlines()
    with open(b_path) as f:
        b = f.read().splitlines()
    changed = added = removed = 0
    hunk = [0, 0]  # removed, added in the current run of non-equal opcodes (one -U0 hunk)
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops + [("equal", 0, 0, 0, 0)]:
        if tag == "equal":
            changed += max(hunk)
            removed += hunk[0]
            added += hunk[1]
            hunk = [0, 0]
        else:
            hunk[0] += i2 - i1
            hunk[1] += j2 - j1
    return changed, added, removed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bounded(name, cmd, env, timeout, run_dir):
    """Runs cmd in its own process group, output (stdout+stderr) to RUN_DIR/NAME.log; kills
    the group after `timeout` s. Returns (status, wall seconds, output)."""
    log_path = os.path.join(run_dir, f"{name}.log")
    print(f"bench-ddp: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             start_new_session=True)
        try:
            status = p.wait(timeout)
        except subprocess.TimeoutExpired:
            status = 124
            print(f"bench-ddp: {name}: still running after {timeout:.0f} s; killed",
                  file=sys.stderr, flush=True)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher's children too
            except ProcessLookupError:
                pass
            p.wait()
    wall = time.monotonic() - t0
    with open(log_path) as f:
        out = f.read()
    if status != 0:
        print(f"bench-ddp: {name}: exit status {status}; the last lines of {log_path}:\n"
              + "\n".join(out.splitlines()[-15:]), file=sys.stderr, flush=True)
    return status, wall, out


def parse(out, target):
    epochs = [(int(e), float(a), float(s)) for e, a, s in EPOCH_RE.findall(out)]
    final = FINAL_RE.search(out)
    to_target = next((s for _, a, s in epochs if a >= target), None)
    return {"epochs": epochs, "to_target": to_target,
            "final_acc": float(final.group(1)) if final else None,
            "train_s": float(final.group(2)) if final else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4, help="DDP processes = ShardPS workers")
    ap.add_argument("--servers", type=int, default=2, help="ShardPS shard servers")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy to time")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transport", default="tcp", help="ShardPS data path (shardps.run)")
    ap.add_argument("--timeout", type=float, default=180.0, help="bound on each run (s)")
    ap.add_argument("--python", default="/usr/bin/python3", help="has torch and sklearn")
    ap.add_argument("--shardps-script", default=SHARDPS, help="the ShardPS variant to run")
    ap.add_argument("--shardps-run-arg", action="append", default=[],
                    help="extra argument for python -m shardps.run (repeat; use --x=y)")
    ap.add_argument("--only", default="plain,ddp,shardps", help="comma list of runs")
    a = ap.parse_args()
    if a.batch_size % a.workers:
        ap.error(f"--batch-size {a.batch_size} must be a multiple of --workers {a.workers}")
    run_dir = tempfile.mkdtemp(prefix="shardps-bench-ddp-")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel=os.environ.get(
        "GLOG_minloglevel", "1"))
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(BUILD, "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["SHARDPS_BUILD_DIR"] = BUILD
    common = ["--epochs", str(a.epochs), "--lr", repr(a.lr), "--batch-size", str(a.batch_size),
              "--seed", str(a.seed)]
    # torch.distributed.run's default --redirects 0 / --tee 0 cannot be parsed by torch 1.13 on
    # Python 3.11 (IntFlag no longer iterates the 0 member); 2 and 1 work with any version.
    runs = {
        "plain": (1, [a.python, PLAIN] + common),
        "ddp": (a.workers, [a.python, "-m", "torch.distributed.run", "--nproc_per_node",
                            str(a.workers), "--master_addr", "127.0.0.1", "--master_port",
                            str(free_port()), "--log_dir", os.path.join(run_dir, "ddp-logs"),
                            "--redirects", "2", "--tee", "1", DDP] + common),
        "shardps": (a.workers, [a.python, "-m", "shardps.run", "--servers", str(a.servers),
                                "--workers", str(a.workers), "--transport", a.transport,
                                "--timeout", str(round(a.timeout * 0.9, 1)), "--run-dir",
                                os.path.join(run_dir, "shardps")] + a.shardps_run_arg
                    + ["--", a.python, a.shardps_script] + common),
    }
    os.makedirs(os.path.join(run_dir, "shardps"))
    started = datetime.datetime.now().astimezone()
    results = {}
    for name in a.only.split(","):
        workers, cmd = runs[name]
        status, wall, out = run_bounded(name, cmd, env, a.timeout, run_dir)
        results[name] = dict(parse(out, a.target), workers=workers, status=status, wall=wall)

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"# scripts/bench-ddp.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {started:%Y-%m-%d %H:%M %Z}, {platform.node()}, {os.cpu_count()} cores; "
          f"global batch {a.batch_size}, lr {a.lr}, seed {a.seed}, OMP_NUM_THREADS=1; "
          f"ShardPS: {a.servers} servers, {a.transport}, BSP; logs in {run_dir}")
    print(f"| run | workers | epochs | s to acc {a.target} | train s | wall s | final acc "
          "| status |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['workers']} | {len(r['epochs'])} | {num(r['to_target'], '.2f')} "
              f"| {num(r['train_s'], '.2f')} | {r['wall']:.1f} | {num(r['final_acc'], '.4f')} "
              f"| {r['status']} |")
    print()
    print("| epoch | " + " | ".join(results) + " |")
    print("|---:|" + "---:|" * len(results))
    for e in range(1, a.epochs + 1):
        cells = []
        for r in results.values():
            hit = [(acc, s) for n, acc, s in r["epochs"] if n == e]
            cells.append(f"{hit[0][0]:.4f} @ {hit[0][1]:.2f} s" if hit else "-")
        print(f"| {e} | " + " | ".join(cells) + " |")
    print()
    print("conversion size (sum over diff -U0 hunks of max(added, removed)):")
    for path in (DDP, a.shardps_script):
        c, add, rem = changed_lines(PLAIN, path)
        print(f"  {os.path.relpath(path, ROOT)}: {c} changed lines (+{add} -{rem})")
    return 0 if all(r["status"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
