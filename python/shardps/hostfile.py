"""The hostfile mode of `python -m shardps.run`: a coordinator, shard servers and N copies of any
trainer command on the hosts of a role hostfile, each process in its own remote-shell session.

The grammar is scripts/launch-hostfile.sh's (documented in shardps.run's docstring):

    hostfile := line*
    line     := [HOST ROLE[:COUNT]... [ip=ADDR]] ['#' comment]
    ROLE     := coordinator (exactly one, count 1) | server | worker
    COUNT    := [1-9][0-9]*  (default 1)

Ranks follow the file: servers and workers are numbered in the order they appear. The
coordinator's address is its host's ip= (else the host name) and the port.

What travels where (plan() builds it, Launcher runs it):
  * argv of the remote-shell command (visible in `ps` on both hosts): the binary or trainer
    command, its flags, and the non-secret settings (SHARDPS_COORDINATOR, SHARDPS_RANK, ...).
  * the remote command's stdin: the cluster token on its first line, nothing else. The stdin
    stays open for the session's life; when it closes (the launcher ended, was killed, or its
    ssh connection dropped) the remote wrapper terminates its process. Every remote process
    also runs under `timeout`.

Thread-safety: none; the launcher is single-threaded.
"""
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time

DEFAULT_RSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"
# A remote process told to stop (SIGTERM) is killed with its process group this much later
# (`timeout -k`): the daemons do not always honour SIGTERM promptly (a server still waiting for
# its cluster to form, or rejoining a coordinator that is gone, keeps waiting).
KILL_AFTER_S = 5
ROLES = ("coordinator", "server", "worker")


class Terminated(KeyboardInterrupt):
    """Raised by shardps.run's SIGTERM handler, so that every session is ended first."""
    status = 143


class HostfileError(ValueError):
    """A hostfile that does not follow the grammar; the message starts with FILE:LINE: where
    the problem is on one line."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """One process the hostfile asks for: its role, host, ip= (None if not given) and the line
    that named it."""
    role: str
    host: str
    ip: object
    line: int


@dataclasses.dataclass
class Hostfile:
    coordinator: Slot
    servers: list  # of Slot, in file order (server rank order)
    workers: list  # of Slot, in file order (worker rank order)
    hosts: list    # distinct host names, in file order

    def address(self, port):
        """host:port that every member dials."""
        c = self.coordinator
        return f"{c.ip or c.host}:{port}"


def parse(text, name="hostfile"):
    """Parses hostfile text; raises HostfileError naming `name` and the line."""
    coordinator = None
    servers, workers, hosts = [], [], []
    for lineno, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{name}:{lineno}"
        host, rest = fields[0], fields[1:]
        if "=" in host or host.partition(":")[0] in ROLES or ":" in host and not _is_ipv6(host):
            raise HostfileError(f"{where}: '{host}' is not a host name (a line starts with the "
                                f"host, then its roles)")
        ip = None
        roles = []
        for tok in rest:
            if tok.startswith("ip="):
                if ip is not None:
                    raise HostfileError(f"{where}: ip= given twice for host {host}")
                ip = tok[3:]
                if not ip:
                    raise HostfileError(f"{where}: empty ip= for host {host}")
            else:
                roles.append(tok)
        if not roles:
            raise HostfileError(f"{where}: host {host} has no role (coordinator, server, worker)")
        if host not in hosts:
            hosts.append(host)
        for tok in roles:
            role, sep, count_s = tok.partition(":")
            if role not in ROLES:
                raise HostfileError(f"{where}: unknown role '{role}' (coordinator, server, "
                                    f"worker)")
            count = 1
            if sep:
                if not (count_s.isdigit() and count_s.isascii() and count_s[0] != "0"):
                    raise HostfileError(f"{where}: bad count in '{tok}' (a number >= 1)")
                count = int(count_s)
            slot = Slot(role, host, ip, lineno)
            if role == "coordinator":
                if count != 1:
                    raise HostfileError(f"{where}: exactly one coordinator (not {count})")
                if coordinator is not None:
                    raise HostfileError(f"{where}: exactly one coordinator (the first is on "
                                        f"line {coordinator.line})")
                coordinator = slot
            else:
                (servers if role == "server" else workers).extend([slot] * count)
    if coordinator is None:
        raise HostfileError(f"{name}: no coordinator")
    if not servers:
        raise HostfileError(f"{name}: no server")
    if not workers:
        raise HostfileError(f"{name}: no worker")
    return Hostfile(coordinator, servers, workers, hosts)


def _is_ipv6(host):
    return host.count(":") >= 2


def load(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise HostfileError(f"cannot read hostfile {path}: {e.strerror}") from None
    return parse(text, path)


def remote_command(cwd, exports, timeout_s, argv):
    """The command line given to the remote shell: `sh -c SCRIPT`. SCRIPT reads the token from
    the first line of stdin, exports it and `exports` (name, value pairs), and runs argv under
    `timeout` in `cwd`, with stdin from /dev/null. A watchdog reads the rest of stdin and
    terminates the process when it ends (the launcher closed it or died): SIGTERM, then
    SIGKILL to its process group KILL_AFTER_S later. The exit status is the process's (124: its
    timeout)."""
    q = shlex.quote
    parts = [f"cd {q(cwd)} || exit 126",
             "IFS= read -r SHARDPS_CLUSTER_TOKEN || exit 125",
             "export SHARDPS_CLUSTER_TOKEN"]
    parts += [f"export {k}={q(v)}" for k, v in exports]
    # A background job's stdin is /dev/null in a non-interactive shell: keep ours on fd 3.
    parts += ["exec 3<&0 </dev/null",
              f"timeout -k {KILL_AFTER_S} {q(str(int(timeout_s)))} {shlex.join(argv)} 3<&- &",
              "p=$!",
              "{ while read -r _ <&3; do :; done; kill -TERM $p; } 2>/dev/null &",
              "w=$!",
              "exec 3<&-",
              "wait $p 2>/dev/null",
              "s=$?",
              "kill $w 2>/dev/null",
              "exit $s"]
    script = parts[0]
    for prev, part in zip(parts, parts[1:]):  # "a &; b" is a syntax error: "a & b"
        script += (" " if prev.endswith("&") else "; ") + part
    return "sh -c " + q(script)


@dataclasses.dataclass
class Session:
    """One process to start: its name (coordinator, server-I, worker-R), the role, the host it
    runs on, its worker rank (-1 for daemons) and the remote command line."""
    name: str
    role: str
    host: str
    rank: int
    remote: str


def plan(hf, trainer, *, coordinator_bin, server_bin, port=7070, transport="tcp",
         consistency="bsp", staleness=0, optimizer="sgd", lr=0.1, partition_bytes=None,
         replicas=1, timeout_s=600, cwd=None, env=()):
    """The sessions of a job: the coordinator, the servers (ranks in file order) and the
    workers (SHARDPS_RANK in file order). `env`: (name, value) pairs exported to every
    process. Raises HostfileError for a hostfile that cannot run this job."""
    if transport == "shm" and len(hf.hosts) > 1:
        raise HostfileError("shm works within one host; the hostfile names "
                            f"{len(hf.hosts)} ({', '.join(hf.hosts)}): use tcp or verbs")
    if replicas == 2 and len(hf.servers) % 2:
        raise HostfileError(f"--replicas 2 needs an even number of servers (the first half "
                            f"primaries, the second their backups); the hostfile has "
                            f"{len(hf.servers)}")
    cwd = cwd or os.getcwd()
    groups = len(hf.servers) // replicas
    addr = hf.address(port)
    env = list(env)
    c = hf.coordinator
    coord_args = [coordinator_bin, f"--listen={c.ip or '0.0.0.0'}:{port}",
                  f"--num_servers={groups}", f"--num_workers={len(hf.workers)}",
                  f"--consistency={consistency}", f"--staleness={staleness}",
                  f"--replicas={replicas}", "--exit_when_done"]
    if transport != "auto":
        coord_args.append(f"--data_transport={transport}")
    if partition_bytes:
        coord_args.append(f"--partition_bytes={partition_bytes}")
    sessions = [Session("coordinator", "coordinator", c.host, -1,
                        remote_command(cwd, env, timeout_s, coord_args))]
    for i, s in enumerate(hf.servers):
        args = [server_bin, f"--coordinator={addr}", f"--transport={transport}",
                *([f"--bind_ip={s.ip}"] if s.ip else []), f"--rank={i}",
                f"--optimizer={optimizer}", f"--lr={lr!r}", "--exit_when_done"]
        sessions.append(Session(f"server-{i}", "server", s.host, -1,
                                remote_command(cwd, env, timeout_s, args)))
    local = {}
    for rank, w in enumerate(hf.workers):
        local_rank = local.get(w.host, 0)
        local[w.host] = local_rank + 1
        wenv = env + [("SHARDPS_COORDINATOR", addr), ("SHARDPS_RANK", str(rank)),
                      ("SHARDPS_LOCAL_RANK", str(local_rank)),
                      ("SHARDPS_NUM_WORKERS", str(len(hf.workers))),
                      ("SHARDPS_TRANSPORT", transport),
                      *([("SHARDPS_BIND_IP", w.ip)] if w.ip else [])]
        sessions.append(Session(f"worker-{rank}", "worker", w.host, rank,
                                remote_command(cwd, wenv, timeout_s, trainer)))
    return addr, sessions


def describe(rsh, session):
    """One dry-run line: the exact local command, the token shown as <cluster token>."""
    return (f"[{session.name}] {shlex.join([*rsh, session.host, session.remote])} "
            f"<<< '<cluster token>'")


def _log(msg):
    print(f"shardps.run: {msg}", file=sys.stderr, flush=True)


def _tail(path, lines=10):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class Launcher:
    """Runs the sessions of plan() through `rsh HOST COMMAND` (ssh, or a stand-in), one local
    process group per session. Worker 0's output goes to this process's stdout/stderr; every
    other session's to RUN_DIR/NAME.log. close() ends every session: it closes their stdins
    (each remote wrapper then terminates its process, killing it KILL_AFTER_S later), waits
    `grace` seconds for the sessions to end, then kills what is left of them here (their
    process groups: an ssh that hangs, or a stand-in)."""

    def __init__(self, rsh, token, run_dir):
        self.rsh = list(rsh)
        self.token = token
        self.run_dir = run_dir
        self.procs = {}  # name -> Popen, in start order

    def start(self, s):
        log = None
        if s.rank != 0:
            log = open(os.path.join(self.run_dir, f"{s.name}.log"), "ab")
        try:
            p = subprocess.Popen([*self.rsh, s.host, s.remote], stdin=subprocess.PIPE,
                                 stdout=log, stderr=subprocess.STDOUT if log else None,
                                 start_new_session=True)
        finally:
            if log:
                log.close()
        self.procs[s.name] = p
        try:  # the token is the first and only line; stdin stays open (the watchdog's EOF)
            p.stdin.write(self.token.encode() + b"\n")
            p.stdin.flush()
        except OSError:  # the session already ended: its status says why
            pass

    def close(self, grace=KILL_AFTER_S + 3.0):
        for p in self.procs.values():
            try:
                p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
            alive = [p for p in self.procs.values() if p.poll() is None]
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            for p in alive:
                try:
                    p.wait(wait_s)
                except subprocess.TimeoutExpired:
                    pass


def run(sessions, *, rsh, token, run_dir, timeout_s, replicas=1, exit_grace=15.0):
    """Starts `sessions`, waits for the workers, ends everything. Returns the first non-zero
    worker status; 124 if the workers did not finish within timeout_s; 1 if the coordinator (or
    a server without a backup) failed while the workers ran; 130/143 when interrupted."""
    launcher = Launcher(rsh, token, run_dir)
    workers = [s for s in sessions if s.role == "worker"]
    daemons = [s for s in sessions if s.role != "worker"]
    status = 0
    with open(os.path.join(run_dir, "commands.txt"), "w") as f:
        f.writelines(describe(rsh, s) + "\n" for s in sessions)
    try:
        for s in sessions:
            launcher.start(s)
        deadline = time.monotonic() + timeout_s
        pending = list(workers)
        reported = set()  # daemons whose death was reported
        while pending and status == 0:
            for s in list(pending):
                rc = launcher.procs[s.name].poll()
                if rc is None:
                    continue
                pending.remove(s)
                if rc != 0:
                    status = rc if rc > 0 else 128 - rc  # killed here by signal N: 128 + N
                    _log(f"worker {s.rank} (on {s.host}) exited with {rc}"
                         + ("" if s.rank == 0 else f"; its log: {run_dir}/{s.name}.log"))
                    break
            for s in daemons if status == 0 else ():
                rc = launcher.procs[s.name].poll()
                if rc in (None, 0) or s.name in reported:
                    continue
                reported.add(s.name)
                log = os.path.join(run_dir, f"{s.name}.log")
                if s.role == "coordinator" or replicas == 1:
                    _log(f"{s.name} (on {s.host}) exited with {rc} while the workers ran; "
                         f"the end of {log}:\n{_tail(log)}")
                    status = 1
                    break
                _log(f"{s.name} (on {s.host}) exited with {rc}; its group fails over to its "
                     f"other server ({log})")
            if status == 0 and pending and time.monotonic() > deadline:
                _log(f"the workers did not finish within {timeout_s:g} s")
                status = 124
            if status == 0 and pending:
                time.sleep(0.1)
        if status == 0:  # the daemons leave by themselves (--exit_when_done)
            end = time.monotonic() + exit_grace
            while (time.monotonic() < end
                   and any(launcher.procs[s.name].poll() is None for s in daemons)):
                time.sleep(0.1)
    except KeyboardInterrupt as e:  # Ctrl-C, or Terminated (SIGTERM) from shardps.run
        status = getattr(e, "status", 130)
    finally:
        launcher.close()
    return status
