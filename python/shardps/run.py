"""shardps.run: start a ShardPS cluster and N copies of ANY trainer command, on this host or on
the hosts of a hostfile.

    python -m shardps.run --servers 2 --workers 4 -- python train.py --epochs 3
    python -m shardps.run --hostfile hosts --transport tcp -- python train.py --epochs 3

Like torchrun, it needs nothing from the trainer's flags or output: each copy gets its settings
in the environment, which shardps.Client() (and the C++/C clients) read when not given:

    SHARDPS_COORDINATOR    the coordinator's address
    SHARDPS_CLUSTER_TOKEN  the cluster's secret (never on a command line)
    SHARDPS_RANK           0..N-1 (also WORLD_SIZE-style: SHARDPS_NUM_WORKERS = N)
    SHARDPS_LOCAL_RANK     the copy's index among the copies on its host
    SHARDPS_TRANSPORT      the data path (tcp, shm, verbs; --transport)

Rank 0's output goes to this console, every other process's to the run directory
(worker-R.log, coordinator.log, server-I.log). Every process is killed on exit (also on Ctrl-C
and SIGTERM) and on the first failing copy, and the run is bounded by --timeout. The exit
status is the first non-zero status of a trainer copy; 124 when the copies did not finish in
time; 1 when the coordinator (or, with --replicas 1, a server) failed while they ran; 2 for a
usage or hostfile error.

Local (no --hostfile): --servers groups (x --replicas, plus --spares) and --workers copies on
this host; a fresh random token; binaries from this package's build (or SHARDPS_BUILD_DIR).

Hostfile (--hostfile FILE): the grammar of scripts/launch-hostfile.sh, one host per line,
`#` starts a comment:

    # HOST  ROLE[:COUNT]...          [ip=ADDR]
    node1   coordinator server
    node2   server worker:2          ip=10.0.0.2
    node3   worker:2

  ROLE is coordinator (exactly one), server or worker; COUNT (default 1) starts that many.
  ip=ADDR is the --bind_ip of that host's servers (the NIC for verbs) and, on the
  coordinator's line, the address it listens on. Everyone dials the coordinator at its ip=
  (else its host name) and --port (default 7070). Server ranks and worker ranks
  (SHARDPS_RANK) follow the file's order: above, worker 0 and 1 run on node2, 2 and 3 on
  node3. With --replicas 2 the first half of the servers are the primaries, the second half
  their backups (put them on other hosts). An error names the file and line.

  Each process runs in its own `RSH HOST COMMAND` session (--rsh, default
  `ssh -o BatchMode=yes -o ConnectTimeout=10`), in --remote-cwd (default: this directory; the
  trainer, the build and the data must be at the same paths on every host), under
  `timeout` (--timeout + 30 s). The cluster token is the first line of the session's stdin
  (SHARDPS_CLUSTER_TOKEN from this environment, else a random one), never in an argv. The
  stdin stays open: when it closes (this launcher ended or died, or the connection broke) the
  remote side terminates its process. Nothing else of this environment travels: --env NAME
  (this host's value) or --env NAME=VALUE exports a variable to every remote process, on its
  command line (so never a secret). The daemons are this package's build's paths
  (--remote-build DIR: DIR/server/shardps_coordinator, ...). --dry-run prints the commands
  (the token shown as <cluster token>) and starts nothing.
"""
import argparse
import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from . import daemons
from . import defaults as defaults_mod
from . import hostfile as hostfile_mod
from .launch import LocalCluster


def _parser():
    d = defaults_mod.load()  # launch_defaults.env: the defaults every launcher shares
    ap = argparse.ArgumentParser(
        prog="python -m shardps.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hostfile", default=None,
                    help="run on the hosts of this role hostfile (grammar above) over --rsh")
    ap.add_argument("--servers", type=int, default=None,
                    help=f"local: shard server groups (default {d['SHARDPS_SERVERS']})")
    ap.add_argument("--replicas", type=int, default=int(d["SHARDPS_REPLICAS"]), choices=[1, 2],
                    help="2: every group also has a backup server (default %(default)s)")
    ap.add_argument("--spares", type=int, default=None,
                    help="local: spare servers that become a group's new backup after a failover")
    ap.add_argument("--workers", "--nproc", type=int, default=None, dest="workers",
                    help=f"local: copies of the trainer (default {d['SHARDPS_WORKERS']})")
    ap.add_argument("--transport", default=d["SHARDPS_TRANSPORT"],
                    choices=["tcp", "shm", "verbs", "auto"], help="(default %(default)s)")
    ap.add_argument("--consistency", default=d["SHARDPS_CONSISTENCY"],
                    choices=["bsp", "ssp", "asp", "vsgd"], help="(default %(default)s)")
    ap.add_argument("--staleness", type=int, default=int(d["SHARDPS_STALENESS"]))
    ap.add_argument("--optimizer", default=d["SHARDPS_OPTIMIZER"],
                    help="the servers' optimizer for tensors without their own rule "
                         "(default %(default)s)")
    ap.add_argument("--lr", type=float, default=float(d["SHARDPS_LR"]),
                    help="the servers' learning rate (default %(default)s)")
    ap.add_argument("--partition-bytes", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=float(d["SHARDPS_TIMEOUT_S"]),
                    help="bound on the run (seconds, default %(default)s)")
    ap.add_argument("--run-dir", default=None, help="logs go here (default: a new temp dir)")
    ap.add_argument("--port", type=int, default=None,
                    help=f"hostfile: the coordinator's port (default {d['SHARDPS_PORT']})")
    ap.add_argument("--rsh", default=None,
                    help=f"hostfile: remote shell, run as RSH HOST COMMAND "
                         f"(default '{hostfile_mod.DEFAULT_RSH}')")
    ap.add_argument("--remote-cwd", default=None,
                    help="hostfile: directory the remote processes run in (default: this one)")
    ap.add_argument("--remote-build", default=None,
                    help="hostfile: build directory with server/shardps_{coordinator,server} "
                         "on every host (default: this package's)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                    help="hostfile: export this variable to every remote process (repeatable)")
    ap.add_argument("--dry-run", action="store_true",
                    help="hostfile: print the commands, start nothing")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- then the trainer command, run once per worker")
    return ap


def main(argv=None):
    ap = _parser()
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no trainer command (put it after --)")
    if a.timeout <= 0:
        ap.error("--timeout must be > 0")

    def on_term(signum, frame):
        raise hostfile_mod.Terminated()

    signal.signal(signal.SIGTERM, on_term)
    if a.hostfile:
        return _main_hostfile(ap, a, cmd)
    return _main_local(ap, a, cmd)


def _main_local(ap, a, cmd):
    for flag, v in (("--port", a.port), ("--rsh", a.rsh), ("--remote-cwd", a.remote_cwd),
                    ("--remote-build", a.remote_build), ("--env", a.env or None),
                    ("--dry-run", a.dry_run or None)):
        if v is not None:
            ap.error(f"{flag} is for --hostfile")
    servers = defaults_mod.get("SHARDPS_SERVERS", int) if a.servers is None else a.servers
    workers = defaults_mod.get("SHARDPS_WORKERS", int) if a.workers is None else a.workers
    spares = a.spares or 0
    if spares and a.replicas != 2:
        ap.error("--spares needs --replicas 2")
    cluster = LocalCluster(servers=servers, workers=workers, consistency=a.consistency,
                           staleness=a.staleness, optimizer=a.optimizer, lr=a.lr,
                           transport=a.transport, partition_bytes=a.partition_bytes,
                           run_dir=a.run_dir, replicas=a.replicas, spares=spares)
    print(f"shardps.run: coordinator at {cluster.address}; {servers} group(s) x {a.replicas} "
          f"replica(s), {spares} spare(s), {workers} worker(s), {a.transport}, "
          f"{a.consistency}; logs in {cluster.run_dir}", file=sys.stderr, flush=True)
    trainers = []
    status = 0
    try:
        for rank in range(workers):
            env = dict(os.environ, SHARDPS_COORDINATOR=cluster.address,
                       SHARDPS_CLUSTER_TOKEN=cluster.token, SHARDPS_RANK=str(rank),
                       SHARDPS_LOCAL_RANK=str(rank), SHARDPS_NUM_WORKERS=str(workers),
                       SHARDPS_TRANSPORT=a.transport)
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
    except KeyboardInterrupt as e:  # Ctrl-C, or hostfile.Terminated (SIGTERM)
        status = getattr(e, "status", 130)
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
                t.wait()
        cluster.close(grace=None if status == 0 else 0.0)
    print(f"shardps.run: {'done' if status == 0 else 'FAILED'} (status {status}); logs in "
          f"{cluster.run_dir}", file=sys.stderr, flush=True)
    return status


def _main_hostfile(ap, a, cmd):
    for flag, v in (("--servers", a.servers), ("--workers", a.workers), ("--spares", a.spares)):
        if v is not None:
            ap.error(f"{flag}: with --hostfile the hostfile says how many")
    env = []
    for item in a.env:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            ap.error(f"--env {item}: not a variable name")
        if name == "SHARDPS_CLUSTER_TOKEN":
            ap.error("--env SHARDPS_CLUSTER_TOKEN: the token travels on stdin, never on a "
                     "command line (set it in this environment)")
        if not sep:
            if name not in os.environ:
                ap.error(f"--env {name}: not set here (give --env {name}=VALUE)")
            value = os.environ[name]
        env.append((name, value))
    try:
        rsh = shlex.split(a.rsh if a.rsh is not None else hostfile_mod.DEFAULT_RSH)
    except ValueError as e:
        ap.error(f"--rsh: {e}")
    if not rsh:
        ap.error("--rsh is empty")
    if a.remote_build:
        bins = [os.path.join(a.remote_build, "server", b)
                for b in ("shardps_coordinator", "shardps_server")]
    else:
        bins = [daemons.path("shardps_coordinator"), daemons.path("shardps_server")]
    port = defaults_mod.get("SHARDPS_PORT", int) if a.port is None else a.port
    try:
        hf = hostfile_mod.load(a.hostfile)
        addr, sessions = hostfile_mod.plan(
            hf, cmd, coordinator_bin=bins[0], server_bin=bins[1], port=port,
            transport=a.transport, consistency=a.consistency, staleness=a.staleness,
            optimizer=a.optimizer, lr=a.lr, partition_bytes=a.partition_bytes,
            replicas=a.replicas, timeout_s=math.ceil(a.timeout) + 30,
            cwd=os.path.abspath(a.remote_cwd or os.getcwd()), env=env)
    except hostfile_mod.HostfileError as e:
        print(f"shardps.run: {e}", file=sys.stderr)
        return 2
    summary = (f"coordinator at {addr}; {len(hf.servers)} server(s) ({a.replicas} per group), "
               f"{len(hf.workers)} worker(s) on {len(hf.hosts)} host(s), {a.transport}, "
               f"{a.consistency}")
    if a.dry_run:
        print(f"shardps.run: {summary}")
        for s in sessions:
            print(hostfile_mod.describe(rsh, s))
        return 0
    token = os.environ.get("SHARDPS_CLUSTER_TOKEN") or secrets.token_hex(16)
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="shardps-run-")
    os.makedirs(run_dir, exist_ok=True)
    print(f"shardps.run: {summary}; logs in {run_dir}", file=sys.stderr, flush=True)
    try:
        status = hostfile_mod.run(sessions, rsh=rsh, token=token, run_dir=run_dir,
                                  timeout_s=a.timeout, replicas=a.replicas)
    except OSError as e:  # the remote shell itself could not start
        print(f"shardps.run: cannot run {shlex.join(rsh)}: {e}", file=sys.stderr)
        status = 127
    print(f"shardps.run: {'done' if status == 0 else 'FAILED'} (status {status}); logs in "
          f"{run_dir}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
