#!/usr/bin/env bash
# ctest scripts.launch_hostfile: scripts/launch-hostfile.sh cannot reach real hosts here, so
#   1. --dry-run on a 3-host hostfile must print one ssh command per process, with the right
#      hosts, role counts, coordinator address, --bind_ip from ip=, and no token;
#   2. a real run through a fake ssh (runs the remote command locally, ignoring the host) on a
#      one-host hostfile must train (1 coordinator, 1 server, 2 workers, tcp, 1 epoch) and print
#      rank 0's final line. Step 2 skips (77) without python3-sklearn, as the data need it.
# usage: launch_hostfile_test.sh BUILD_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$(cd "${1:?usage: launch_hostfile_test.sh BUILD_DIR}" && pwd)
T=$(mktemp -d "${TMPDIR:-/tmp}/shardps-hostfile.XXXXXX")
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cat >"$T/hosts" <<'H'
# host  roles
node1 coordinator server      # the coordinator's host
node2 server worker:2 ip=10.0.0.2
node3 worker:2
H
export SHARDPS_CLUSTER_TOKEN=not-to-be-printed
out=$(SHARDPS_BUILD_DIR="$BUILD" "$ROOT/scripts/launch-hostfile.sh" --hostfile "$T/hosts" \
        --transport tcp --port 7123 --dry-run -- --epochs 3)
echo "$out"
count() { grep -c -- "$1" <<<"$out" || true; }
[[ $(count '^\[coordinator\] .* node1 .*shardps_coordinator --listen=0.0.0.0:7123 --num_servers=2 --num_workers=4') == 1 ]] ||
  fail "coordinator command"
[[ $(count '^\[server-[01]\] .*shardps_server --coordinator=node1:7123 --transport=tcp') == 2 ]] ||
  fail "two server commands"
[[ $(count '^\[worker-[0-3]\] .*digits_trainer --coordinator=node1:7123 --transport=tcp') == 4 ]] ||
  fail "four worker commands"
[[ $(count ' node2 .*--bind_ip=10.0.0.2') == 3 ]] || fail "ip= of node2 on its 3 processes"
[[ $(count ' node3 .*digits_trainer') == 2 ]] || fail "two workers on node3"
[[ $(count '--data_transport=tcp') == 1 ]] || fail "the coordinator enforces the transport"
[[ $(count 'not-to-be-printed') == 0 ]] || fail "the token appears in the output"
# Malformed hostfiles are refused.
printf 'node1 server worker\n' >"$T/bad1"
printf 'node1 coordinator coordinator server worker\n' >"$T/bad2"
printf 'node1 coordinator serverx worker\n' >"$T/bad3"
for b in bad1 bad2 bad3; do
  if "$ROOT/scripts/launch-hostfile.sh" --hostfile "$T/$b" --dry-run >/dev/null 2>&1; then
    fail "hostfile $b was accepted"
  fi
done
echo "dry-run: PASS"

PY=${SHARDPS_PYTHON:-/usr/bin/python3}
if ! "$PY" -c 'import sklearn' 2>/dev/null; then
  echo "SKIP: the fake-ssh run needs the digits data (python3-sklearn missing for $PY)"
  exit 77
fi
[[ -s $BUILD/data/digits_train.bin ]] || timeout 60 "$PY" "$ROOT/scripts/export_digits.py" --out "$BUILD/data"
cat >"$T/fake-ssh" <<'S'
#!/usr/bin/env bash
# fake ssh: skips options and the host, runs the command here (stdin passes through).
while [[ $1 == -* ]]; do [[ $1 == -o ]] && shift; shift; done
shift
exec bash -c "$1"
S
chmod +x "$T/fake-ssh"
printf 'localhost coordinator server worker:2 ip=127.0.0.1\n' >"$T/local"
# The port is fixed before the run starts (as on real hosts), so another process may hold it:
# a listener, or the local end of a connection. It is drawn below Linux's ephemeral range
# (32768-60999, where every other test's connections get their ports), and a run whose
# coordinator could not bind it (exit 3, "Address already in use") is retried on another port.
for attempt in 1 2 3; do
  port=$((20000 + RANDOM % 12000))
  rc=0
  out=$(SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$BUILD/data" timeout 80 \
          "$ROOT/scripts/launch-hostfile.sh" --hostfile "$T/local" --transport tcp --port "$port" \
          --ssh "$T/fake-ssh" --timeout 60 --run-dir "$T/run" -- --epochs 1 --log_every 0 2>&1) ||
    rc=$?
  if ((rc == 3)) && grep -q 'Address already in use' <<<"$out"; then
    echo "port $port is taken (attempt $attempt); another port"
    rm -rf "$T/run"
    continue
  fi
  break
done
if ((rc)); then
  echo "$out"; tail -n 20 "$T"/run/*.log; fail "the fake-ssh run failed (exit $rc)"
fi
echo "$out"
grep -q '^launch-hostfile: final: test accuracy 0\.[0-9]* after 22 steps' <<<"$out" ||
  fail "no final line from the fake-ssh run"
echo "fake-ssh run: PASS"
