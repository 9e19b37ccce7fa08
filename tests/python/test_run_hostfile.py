"""Tests of `python -m shardps.run --hostfile` (shardps/hostfile.py) on this one host: the
remote shell is a stand-in (RSH below) that records its argv and runs the command here with an
environment as bare as a fresh ssh login's, so whatever a trainer gets came from the launcher's
command line or the session's stdin. Hosts are 127.0.0.1 and localhost, transport tcp.
Run by ctest with the other tests/python files (PYTHONPATH at BUILD/python)."""
import json
import os
import re
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

import shardps  # noqa: F401  (the package under test, from PYTHONPATH)
from shardps import hostfile

# ssh's contract: `RSH HOST COMMAND`, COMMAND run by the login shell, stdin passed through.
RSH = r"""#!/bin/sh
host=$1; shift
printf '%s\n' "$0 $host $*" >> "$(dirname "$0")/rsh-argv.log"
printf '%s\n' "$host" >> "$(dirname "$0")/rsh-hosts.log"
exec env -i PATH="$PATH" HOME="$HOME" FAKE_SSH_HOST="$host" sh -c "$*"
"""

# A trainer that takes every setting from the environment and reports what it got.
TRAINER = r"""
import json, os, sys, numpy as np, shardps
out = sys.argv[1]
env_rank = int(os.environ["SHARDPS_RANK"])
c = shardps.Client(setup_timeout_ms=60000, wait_timeout_ms=30000)
w = np.zeros(8, dtype=np.float32)
g = np.full(8, env_rank + 1, dtype=np.float32)  # rank-dependent: the servers average them
c.register("w", w, g)
c.start()
for _ in range(int(sys.argv[2])):
    c.step()
print("rank", c.rank, "w0", repr(float(w[0])), flush=True)
rec = {"rank": c.rank, "env_rank": env_rank, "w": [float(x) for x in w],
       "num_workers": os.environ["SHARDPS_NUM_WORKERS"],
       "local_rank": os.environ["SHARDPS_LOCAL_RANK"],
       "transport": os.environ["SHARDPS_TRANSPORT"], "host": os.environ["FAKE_SSH_HOST"],
       "cwd": os.getcwd()}
with open(os.path.join(out, "rank-%d.json" % env_rank), "w") as f:
    json.dump(rec, f)
c.close()
"""

# A trainer that does not use the cluster at all: it records its pid; rank 1 fails with 7
# once the others are up; the others sleep.
SLEEPER = r"""
import os, sys, time
out, rank = sys.argv[1], os.environ["SHARDPS_RANK"]
with open(os.path.join(out, "pid-%s" % rank), "w") as f:
    f.write(str(os.getpid()))
if rank == "1" and sys.argv[2] == "fail":
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out, "pid-%d" % r)) for r in (0, 2)):
        time.sleep(0.05)
    with open(os.path.join(out, "failed-at"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(7)
time.sleep(300)
"""

TOKEN = "f00dfeedc0ffee%018d" % int.from_bytes(os.urandom(7), "big")


def free_port():
    """A loopback port below Linux's ephemeral range (32768-60999) that binds now.

    The launcher is given the port before anything listens on it, so a port from bind(0) (an
    ephemeral one) could meanwhile become the local end of another test's connection; below
    that range only an explicit listener can take it."""
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "big"))
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def cmdlines():
    """pid -> argv bytes of every process this user can see."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read()
            except OSError:
                pass
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, marker, bound):
    """Waits up to `bound` seconds for `pids` and every process whose argv contains `marker` to
    be gone; returns the argv of those still there."""
    deadline = time.monotonic() + bound
    while True:
        left = {p: c for p, c in cmdlines().items() if marker in c and alive(p)}
        left.update({p: b"(trainer)" for p in pids if alive(p)})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class HostfileRun:
    """A temp dir with the stand-in rsh, a hostfile and the launcher's outputs."""

    def __init__(self, test, hostfile_text):
        self.test = test
        self.tmp = tempfile.TemporaryDirectory(prefix="shardps-hf-test-")
        self.dir = self.tmp.name
        self.out = os.path.join(self.dir, "out")
        self.run_dir = os.path.join(self.dir, "run")
        os.makedirs(self.out)
        self.rsh = os.path.join(self.dir, "rsh")
        with open(self.rsh, "w") as f:
            f.write(RSH)
        os.chmod(self.rsh, 0o755)
        self.hostfile = os.path.join(self.dir, "hosts")
        with open(self.hostfile, "w") as f:
            f.write(hostfile_text)
        self.port = free_port()
        self.marker = f"127.0.0.1:{self.port}".encode()

    def argv(self, *extra, trainer):
        return [sys.executable, "-m", "shardps.run", "--hostfile", self.hostfile,
                "--rsh", self.rsh, "--port", str(self.port), "--transport", "tcp",
                "--run-dir", self.run_dir, "--env", "PYTHONPATH",
                "--env", "GLOG_minloglevel=2", *extra, "--", *trainer]

    def start(self, *extra, trainer):
        env = dict(os.environ, SHARDPS_CLUSTER_TOKEN=TOKEN)
        for v in ("SHARDPS_COORDINATOR", "SHARDPS_RANK", "SHARDPS_NUM_WORKERS"):
            env.pop(v, None)
        self.stdout = open(os.path.join(self.dir, "launcher.out"), "w+")
        self.stderr = open(os.path.join(self.dir, "launcher.err"), "w+")
        return subprocess.Popen(self.argv(*extra, trainer=trainer), cwd=self.dir, env=env,
                                stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def finish(self, p, bound):
        """Waits for the launcher; returns (status, stdout, stderr)."""
        try:
            rc = p.wait(bound)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            self.test.fail(f"the launcher did not end within {bound} s: {self.read_err()}")
        return rc, self.read(self.stdout), self.read(self.stderr)

    def read_err(self):
        return self.read(self.stderr)

    @staticmethod
    def read(f):
        f.flush()
        f.seek(0)
        return f.read()

    def close(self):
        for f in (getattr(self, "stdout", None), getattr(self, "stderr", None)):
            if f:
                f.close()
        self.tmp.cleanup()

    def rsh_argv(self):
        with open(os.path.join(self.dir, "rsh-argv.log")) as f:
            return f.read()

    def pids(self, ranks, bound=60):
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            files = [os.path.join(self.out, f"pid-{r}") for r in ranks]
            if all(os.path.exists(f) and os.path.getsize(f) for f in files):
                return [int(open(f).read()) for f in files]
            time.sleep(0.1)
        self.test.fail(f"trainers {ranks} did not start: {self.read_err()}")


class HostfileTrainTest(unittest.TestCase):
    def test_trainer_copies_get_ranks_in_hostfile_order_and_train(self):
        steps, lr = 4, 0.25
        r = HostfileRun(self, "# host  roles                  ip\n"
                              "127.0.0.1  coordinator server:2  ip=127.0.0.1\n"
                              "\n"
                              "localhost  worker          # rank 0\n"
                              "127.0.0.1  worker:2        # ranks 1, 2\n")
        try:
            p = r.start("--optimizer", "sgd", "--lr", str(lr), "--timeout", "150",
                        trainer=[sys.executable, "-c", TRAINER, r.out, str(steps)])
            # While it runs: no process's argv may hold the token (ps on this "every host").
            seen_sessions, leaks = False, {}
            while p.poll() is None:
                for pid, argv in cmdlines().items():
                    if TOKEN.encode() in argv:
                        leaks[pid] = argv[:200]
                    seen_sessions |= b"SHARDPS_RANK" in argv and r.marker in argv
                time.sleep(0.2)
            rc, out, err = r.finish(p, 10)
            self.assertEqual(rc, 0, out + err)
            self.assertTrue(seen_sessions, "the argv scan never saw a worker session")
            self.assertEqual(leaks, {})

            recs = {}
            for name in os.listdir(r.out):
                with open(os.path.join(r.out, name)) as f:
                    rec = json.load(f)
                recs[rec["env_rank"]] = rec
            self.assertEqual(sorted(recs), [0, 1, 2])  # each rank once
            # Ranks follow the file: rank 0 on localhost, 1 and 2 on the next line's host.
            self.assertEqual([(recs[k]["rank"], recs[k]["host"], recs[k]["local_rank"])
                              for k in range(3)],
                             [(0, "localhost", "0"), (1, "127.0.0.1", "0"),
                              (2, "127.0.0.1", "1")])
            for rec in recs.values():
                self.assertEqual(rec["num_workers"], "3")
                self.assertEqual(rec["transport"], "tcp")
                self.assertEqual(os.path.realpath(rec["cwd"]), os.path.realpath(r.dir))
            # BSP: every step applies the average of gradients 1, 2, 3 (= 2) at lr 0.25.
            want = np.float32(0)
            for _ in range(steps):
                want = np.float32(want - np.float32(lr) * np.float32(2.0))
            ws = [recs[k]["w"] for k in range(3)]
            self.assertEqual(ws[0], ws[1])
            self.assertEqual(ws[0], ws[2])
            np.testing.assert_allclose(ws[0], [float(want)] * 8, rtol=1e-6)
            self.assertNotEqual(float(want), 0.0)

            # Rank 0 on the console, the others in the run dir.
            self.assertIn("rank 0 w0", out)
            self.assertNotIn("rank 1 w0", out)
            with open(os.path.join(r.run_dir, "worker-1.log")) as f:
                self.assertIn("rank 1 w0", f.read())
            self.assertFalse(os.path.exists(os.path.join(r.run_dir, "worker-0.log")))
            for name in ("coordinator", "server-0", "server-1", "worker-2"):
                self.assertTrue(os.path.exists(os.path.join(r.run_dir, name + ".log")), name)

            # One session per process, in hostfile order, and the token in none of their argv.
            argv = r.rsh_argv()
            self.assertNotIn(TOKEN, argv)
            with open(os.path.join(r.dir, "rsh-hosts.log")) as f:
                hosts = f.read().split()
            self.assertEqual(sorted(hosts), sorted(["127.0.0.1"] * 5 + ["localhost"]))
            self.assertNotIn(TOKEN, out + err)
            with open(os.path.join(r.run_dir, "commands.txt")) as f:
                self.assertNotIn(TOKEN, f.read())
            self.assertEqual(wait_gone([], r.marker, 10), {})
        finally:
            r.close()


class HostfileFailureTest(unittest.TestCase):
    HOSTS = "127.0.0.1 coordinator server worker ip=127.0.0.1\nlocalhost worker:2\n"

    def test_a_failing_trainer_ends_the_run_with_its_status_and_kills_the_rest(self):
        r = HostfileRun(self, self.HOSTS)
        try:
            p = r.start("--timeout", "120",
                        trainer=[sys.executable, "-c", SLEEPER, r.out, "fail"])
            rc, out, err = r.finish(p, 90)
            ended = time.time()
            self.assertEqual(rc, 7, out + err)
            self.assertIn("worker 1 (on localhost) exited with 7", err)
            with open(os.path.join(r.out, "failed-at")) as f:
                failed_at = float(f.read())
            self.assertLess(ended - failed_at, 15.0)  # the launcher ended soon after
            pids = r.pids([0, 2])
            # The other copies, the daemons and every session are gone within a bound.
            self.assertEqual(wait_gone(pids, r.marker, 5), {})
        finally:
            r.close()

    def test_timeout_bounds_the_run(self):
        r = HostfileRun(self, self.HOSTS)
        try:
            start = time.monotonic()
            p = r.start("--timeout", "6", trainer=[sys.executable, "-c", SLEEPER, r.out, "ok"])
            pids = r.pids([0, 1, 2])
            rc, out, err = r.finish(p, 60)
            self.assertEqual(rc, 124, out + err)
            self.assertIn("did not finish within 6 s", err)
            self.assertLess(time.monotonic() - start, 30)
            self.assertEqual(wait_gone(pids, r.marker, 5), {})
        finally:
            r.close()

    def test_a_killed_launcher_leaves_no_remote_process(self):
        # SIGKILL: no clean-up code runs; the sessions' stdin closes, and each remote wrapper
        # ends its process (what happens over ssh when the launcher or its link dies).
        r = HostfileRun(self, self.HOSTS)
        try:
            p = r.start("--timeout", "120", trainer=[sys.executable, "-c", SLEEPER, r.out, "ok"])
            pids = r.pids([0, 1, 2])
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            self.assertEqual(wait_gone(pids, r.marker, 10), {})
        finally:
            r.close()

    def test_a_failed_coordinator_fails_the_run(self):
        r = HostfileRun(self, self.HOSTS)
        busy = socket.socket()
        try:
            busy.bind(("127.0.0.1", r.port))  # the coordinator cannot listen there
            busy.listen(1)
            p = r.start("--timeout", "120", trainer=[sys.executable, "-c", SLEEPER, r.out, "ok"])
            rc, out, err = r.finish(p, 90)
            self.assertEqual(rc, 1, out + err)
            self.assertRegex(err, r"coordinator \(on 127\.0\.0\.1\) exited with [1-9]")
            self.assertEqual(wait_gone([], r.marker, 5), {})
        finally:
            busy.close()
            r.close()


class HostfileDryRunTest(unittest.TestCase):
    HOSTS = ("node1 coordinator server ip=10.0.0.1\n"
             "node2 worker:2\n"
             "node3 worker server ip=10.0.0.3  # a comment\n")

    def dry_run(self, hosts, *extra):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "hosts")
            with open(path, "w") as f:
                f.write(hosts)
            env = dict(os.environ, SHARDPS_CLUSTER_TOKEN=TOKEN)
            r = subprocess.run([sys.executable, "-m", "shardps.run", "--hostfile", path,
                                "--dry-run", "--rsh", "myssh -p 2222", *extra, "--", "python3",
                                "train.py", "--name", "a b"],
                               env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertNotIn(TOKEN, r.stdout + r.stderr)
        sessions = []
        for line in r.stdout.splitlines()[1:]:
            f = shlex.split(line)
            self.assertEqual(f[1:4], ["myssh", "-p", "2222"])
            self.assertEqual(f[-2:], ["<<<", "<cluster token>"])
            sh, dash_c, script = shlex.split(f[5])
            self.assertEqual((sh, dash_c), ("sh", "-c"))
            sessions.append((f[0], f[4], script))
        return sessions

    def test_prints_every_command_with_the_token_redacted(self):
        sessions = self.dry_run(self.HOSTS, "--port", "7171", "--env", "FOO=bar baz")
        self.assertEqual([(n, h) for n, h, _ in sessions],
                         [("[coordinator]", "node1"), ("[server-0]", "node1"),
                          ("[server-1]", "node3"), ("[worker-0]", "node2"),
                          ("[worker-1]", "node2"), ("[worker-2]", "node3")])
        scripts = [s for _, _, s in sessions]
        for s in scripts:
            # The token comes from stdin; every remote process runs under timeout.
            self.assertIn("IFS= read -r SHARDPS_CLUSTER_TOKEN", s)
            self.assertRegex(s, r"timeout -k 5 630 ")
            self.assertIn("export FOO='bar baz'", s)
        self.assertIn("--listen=10.0.0.1:7171", scripts[0])
        self.assertIn("--num_servers=2 --num_workers=3", scripts[0])
        for i, s in enumerate(scripts[1:3]):
            self.assertIn("--coordinator=10.0.0.1:7171", s)
            self.assertIn(f"--rank={i}", s)
            # The shared launch default (launch_defaults.env: SHARDPS_TRANSPORT=auto).
            self.assertIn("--transport=auto", s)
        self.assertIn("--bind_ip=10.0.0.1", scripts[1])
        self.assertIn("--bind_ip=10.0.0.3", scripts[2])
        for rank, s in enumerate(scripts[3:]):
            env = dict(re.findall(r"export (SHARDPS_\w+)=(\S+?);", s))
            want = {"SHARDPS_COORDINATOR": "10.0.0.1:7171", "SHARDPS_RANK": str(rank),
                    "SHARDPS_LOCAL_RANK": str([0, 1, 0][rank]),
                    "SHARDPS_NUM_WORKERS": "3", "SHARDPS_TRANSPORT": "auto"}
            if rank == 2:  # node3's ip=: the trainer's data-path address (verbs: its NIC)
                want["SHARDPS_BIND_IP"] = "10.0.0.3"
            self.assertEqual(env, want)
            self.assertIn("python3 train.py --name 'a b'", s)

    def test_coordinator_address_is_the_host_name_without_ip(self):
        sessions = self.dry_run("nodeA coordinator server\nnodeB worker\n", "--replicas", "1")
        self.assertIn("--listen=0.0.0.0:7070", sessions[0][2])
        self.assertIn("--coordinator=nodeA:7070", sessions[1][2])
        self.assertNotIn("--bind_ip", sessions[1][2])
        self.assertIn("export SHARDPS_COORDINATOR=nodeA:7070;", sessions[2][2])


class HostfileParseTest(unittest.TestCase):
    def test_grammar(self):
        hf = hostfile.parse("# comment\n\n  n1 coordinator server:2 ip=10.1.0.1  # c\n"
                            "n2 worker:2 server\nn1 worker\n", "hosts")
        self.assertEqual((hf.coordinator.host, hf.coordinator.ip), ("n1", "10.1.0.1"))
        self.assertEqual([(s.host, s.ip) for s in hf.servers],
                         [("n1", "10.1.0.1"), ("n1", "10.1.0.1"), ("n2", None)])
        self.assertEqual([w.host for w in hf.workers], ["n2", "n2", "n1"])
        self.assertEqual(hf.hosts, ["n1", "n2"])
        self.assertEqual(hf.address(7070), "10.1.0.1:7070")

    def test_errors_name_the_line(self):
        cases = [
            ("n1 coordinator server\nn2 wroker\n", r"^hosts:2: unknown role 'wroker'"),
            ("n1 coordinator server worker\nn2 coordinator\n",
             r"^hosts:2: exactly one coordinator \(the first is on line 1\)"),
            ("n1 coordinator:2 server worker\n", r"^hosts:1: exactly one coordinator"),
            ("n1 coordinator server worker:0\n", r"^hosts:1: bad count in 'worker:0'"),
            ("n1 coordinator server worker:two\n", r"^hosts:1: bad count in 'worker:two'"),
            ("# c\n\nn1 ip=10.0.0.1\n", r"^hosts:3: host n1 has no role"),
            ("n1 coordinator\nworker:2\n", r"^hosts:2: 'worker:2' is not a host name"),
            ("n1 coordinator server worker ip=1.2.3.4 ip=1.2.3.5\n",
             r"^hosts:1: ip= given twice"),
            ("n1 server worker\n", r"^hosts: no coordinator"),
            ("n1 coordinator worker\n", r"^hosts: no server"),
            ("n1 coordinator server\n", r"^hosts: no worker"),
        ]
        for text, pattern in cases:
            with self.subTest(text=text):
                with self.assertRaisesRegex(hostfile.HostfileError, pattern):
                    hostfile.parse(text, "hosts")

    def test_launcher_reports_the_line_and_starts_nothing(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "hosts")
            with open(path, "w") as f:
                f.write("n1 coordinator server\n# fine so far\nn2 worker:2 wroker\n")
            r = subprocess.run([sys.executable, "-m", "shardps.run", "--hostfile", path,
                                "--rsh", "/bin/false", "--", "true"],
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"{path}:3: unknown role 'wroker'", r.stderr)

    def test_jobs_the_hostfile_cannot_run_are_refused(self):
        hf = hostfile.parse("n1 coordinator server\nn2 worker\n")
        kw = dict(coordinator_bin="c", server_bin="s")
        with self.assertRaisesRegex(hostfile.HostfileError, "shm works within one host"):
            hostfile.plan(hf, ["t"], transport="shm", **kw)
        with self.assertRaisesRegex(hostfile.HostfileError, "even number of servers"):
            hostfile.plan(hf, ["t"], replicas=2, **kw)
        r = subprocess.run([sys.executable, "-m", "shardps.run", "--hostfile", "/nonexistent",
                            "--env", "SHARDPS_CLUSTER_TOKEN=x", "--", "true"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("the token travels on stdin", r.stderr)


if __name__ == "__main__":
    unittest.main()
