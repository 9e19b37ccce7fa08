"""shardps.run: start a ShardPS cluster on this host and N copies of ANY trainer command.

    python -m shardps.run --servers 2 --workers 4 -- python train.py --epochs 3

Like torchrun, it needs nothing from the trainer's flags or output: each copy gets its settings
in the environment, which shardps.Client() (and the C++/C clients) read when not given:

    SHARDPS_COORDINATOR    the coordinator's address
    SHARDPS_CLUSTER_TOKEN  the cluster's secret (a fresh random one per run)
    SHARDPS_RANK           0..N-1 (also WORLD_SIZE-style: SHARDPS_NUM_WORKERS = N)
    SHARDPS_TRANSPORT      the data path (tcp, shm, verbs; --transport)

Rank 0's output goes to this console; every process's output is in the run directory. Every
process is killed on exit and the run is bounded by --timeout. The exit status is the first
non-zero status of a trainer copy, else 0. Binaries come from this package's build (or
SHARDPS_BUILD_DIR). Local only: for several hosts use scripts/mpirun.sh or the hostfile
launcher (docs/operations.md).
"""
import argparse
import os
import subprocess
import sys
import time

from .launch import LocalCluster


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m shardps.run",
        description="Start a local ShardPS cluster and N copies of a trainer command.")
    ap.add_argument("--servers", type=int, default=2, help="shard server groups (default 2)")
    ap.add_argument("--replicas", type=int, default=1, choices=[1, 2],
                    help="2: every group also has a backup server (default 1)")
    ap.add_argument("--spares", type=int, default=0,
                    help="spare servers that become a group's new backup after a failover")
    ap.add_argument("--workers", "--nproc", type=int, default=2, dest="workers",
                    help="copies of the trainer (default 2)")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm", "verbs", "auto"])
    ap.add_argument("--consistency", default="bsp", choices=["bsp", "ssp", "asp", "vsgd"])
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--optimizer", default="sgd", help="the servers' optimizer (default sgd)")
    ap.add_argument("--lr", type=float, default=0.1, help="the servers' learning rate")
    ap.add_argument("--partition-bytes", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on the run (seconds)")
    ap.add_argument("--run-dir", default=None, help="logs go here (default: a new temp dir)")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- then the trainer command, run once per worker")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no trainer command (put it after --)")
    if a.spares and a.replicas != 2:
        ap.error("--spares needs --replicas 2")
    cluster = LocalCluster(servers=a.servers, workers=a.workers, consistency=a.consistency,
                           staleness=a.staleness, optimizer=a.optimizer, lr=a.lr,
                           transport=a.transport, partition_bytes=a.partition_bytes,
                           run_dir=a.run_dir, replicas=a.replicas, spares=a.spares)
    print(f"shardps.run: coordinator at {cluster.address}; {a.servers} group(s) x {a.replicas} "
          f"replica(s), {a.spares} spare(s), {a.workers} worker(s), {a.transport}, "
          f"{a.consistency}; logs in {cluster.run_dir}", file=sys.stderr, flush=True)
    trainers = []
    status = 0
    try:
        for rank in range(a.workers):
            env = dict(os.environ, SHARDPS_COORDINATOR=cluster.address,
                       SHARDPS_CLUSTER_TOKEN=cluster.token, SHARDPS_RANK=str(rank),
                       SHARDPS_NUM_WORKERS=str(a.workers), SHARDPS_TRANSPORT=a.transport)
            if rank == 0:
                trainers.append(subprocess.Popen(cmd, env=env))
            else:
                with open(os.path.join(cluster.run_dir, f"worker-{rank}.log"), "ab") as log:
                    trainers.append(subprocess.Popen(cmd, env=env, stdout=log,
                                                     stderr=subprocess.STDOUT))
        deadline = time.monotonic() + a.timeout
        while any(t.poll() is None for t in trainers):
            for rank, t in enumerate(trainers):
                if t.poll() not in (None, 0) and status == 0:
                    status = t.returncode
                    print(f"shardps.run: worker {rank} exited with {t.returncode}",
                          file=sys.stderr, flush=True)
            if status != 0 or time.monotonic() > deadline:
                if status == 0:
                    print(f"shardps.run: the workers did not finish within {a.timeout} s",
                          file=sys.stderr, flush=True)
                    status = 124
                break
            time.sleep(0.1)
        for rank, t in enumerate(trainers):
            if t.poll() is not None and t.returncode != 0 and status == 0:
                status = t.returncode
                print(f"shardps.run: worker {rank} exited with {t.returncode}", file=sys.stderr)
    except KeyboardInterrupt:
        status = 130
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
                t.wait()
        cluster.close(grace=None if status == 0 else 0.0)
    print(f"shardps.run: {'done' if status == 0 else 'FAILED'} (status {status}); logs in "
          f"{cluster.run_dir}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
