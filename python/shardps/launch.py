"""LocalCluster: a coordinator and shard servers on this host, for tests and experiments.

    with shardps.launch.LocalCluster(servers=2, workers=1, consistency="ssp", staleness=1,
                                     optimizer="sgd", lr=0.1) as cluster:
        c = shardps.Client(cluster.address, cluster_token=cluster.token, transport="tcp")

Every process is started with its output in a log file under `run_dir`, and killed on exit.
The binaries come from this build (BUILD_DIR of _build_info) unless build_dir= is given.
"""
import os
import secrets
import subprocess
import tempfile
import time

from . import _build_info


class LocalCluster:
    def __init__(self, servers=2, workers=1, consistency="bsp", staleness=0, optimizer="sgd",
                 lr=0.1, transport="tcp", partition_bytes=None, build_dir=None, run_dir=None,
                 extra_server_args=(), timeout=20.0, grace=5.0, replicas=1, spares=0):
        self.build_dir = build_dir or os.environ.get("SHARDPS_BUILD_DIR") or _build_info.BUILD_DIR
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="shardps-local-")
        os.makedirs(self.run_dir, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.transport = transport
        self.grace = grace
        self._procs = []
        coord = os.path.join(self.build_dir, "server", "shardps_coordinator")
        server = os.path.join(self.build_dir, "server", "shardps_server")
        for b in (coord, server):
            if not os.access(b, os.X_OK):
                raise FileNotFoundError(f"{b} is missing: build first")
        addr_file = os.path.join(self.run_dir, "coordinator.addr")
        env = dict(os.environ, SHARDPS_CLUSTER_TOKEN=self.token)
        args = [coord, "--listen=127.0.0.1:0", f"--address_file={addr_file}",
                f"--consistency={consistency}", f"--staleness={staleness}",
                f"--num_servers={servers}", f"--num_workers={workers}", "--exit_when_done",
                f"--replicas={replicas}"]
        if transport != "auto":
            args.append(f"--data_transport={transport}")
        if partition_bytes:
            args.append(f"--partition_bytes={partition_bytes}")
        try:
            self._spawn(args, "coordinator.log", env)
            deadline = time.monotonic() + timeout
            while not (os.path.exists(addr_file) and os.path.getsize(addr_file) > 0):
                if self._procs[0].poll() is not None:
                    raise RuntimeError(f"the coordinator exited; see {self.run_dir}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the coordinator did not listen within {timeout} s")
                time.sleep(0.05)
            with open(addr_file) as f:
                self.address = f.read().strip()
            # Ranks servers..2*servers-1 are the backups (replicas=2); spares wait for a group
            # that loses its backup (docs/fault-tolerance.md).
            for i in range(servers * replicas + spares):
                spare = i >= servers * replicas
                self._spawn([server, f"--coordinator={self.address}", f"--transport={transport}",
                             "--bind_ip=127.0.0.1", f"--rank={-1 if spare else i}",
                             f"--optimizer={optimizer}", f"--lr={lr!r}", "--exit_when_done",
                             *(["--spare"] if spare else []), *extra_server_args],
                            f"spare-{i}.log" if spare else f"server-{i}.log", env)
        except BaseException:
            self.close()
            raise

    def _spawn(self, args, log_name, env):
        with open(os.path.join(self.run_dir, log_name), "ab") as log:
            self._procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                env=env))

    def close(self, grace=None):
        """Waits up to `grace` seconds for the processes to leave (--exit_when_done), then
        kills what is left."""
        deadline = time.monotonic() + (self.grace if grace is None else grace)
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(grace=None if exc[0] is None else 0.0)
