#!/usr/bin/env bash
# Multi-host test on one machine: a tcp cluster spread over three network namespaces.
#
#   ns A (10.77.0.1): shardps_coordinator + shardps_server rank 0
#   ns B (10.77.0.2): shardps_server rank 1
#   ns C (10.77.0.3): ps_test_worker rank 0 and rank 1
#   ns BR:            bridge br0, one veth to each of A, B, C (no address)
#
# Every veth is created inside the bridge namespace with its peer moved straight into A, B or C,
# so nothing is ever added to the host's namespace, and the 10.77.0.0/24 addresses exist only in
# A, B and C: the host's interfaces and routes are never touched. Namespace and process names
# carry this script's pid so concurrent runs do not collide.
#
# Passes when both workers finish and their weights equal a standalone run with the same total
# batch (ps_test_worker --mode=compare; tolerance derived there), and when ns C's veth carried
# at least the gradients the workers pushed (the data path crossed namespaces). Then a server
# in ns B is cut off (its link down): it must be declared dead as unreachable before its lease.
#
# Usage: netns_cluster_test.sh COORDINATOR_BIN SERVER_BIN PS_TEST_WORKER_BIN
# Exit: 0 pass, 1 fail, 77 skip (not root, or network namespaces unavailable).
set -u -o pipefail

readonly SKIP=77
readonly STEPS=15
readonly WORKERS=2
readonly LR=0.1
readonly TOKEN="netns-test-$$"
readonly BOUND_S=60   # every process and wait is bounded by this

if [[ $# -ne 3 ]]; then
  echo "usage: $0 COORDINATOR_BIN SERVER_BIN PS_TEST_WORKER_BIN" >&2
  exit 2
fi
COORD_BIN=$1
SERVER_BIN=$2
WORKER_BIN=$3
for b in "$COORD_BIN" "$SERVER_BIN" "$WORKER_BIN"; do
  [[ -x $b ]] || { echo "FAIL: $b is not an executable" >&2; exit 1; }
done

if [[ $(id -u) -ne 0 ]]; then
  echo "SKIP: network namespaces need root"
  exit $SKIP
fi
if ! command -v ip >/dev/null || ! ip netns list >/dev/null 2>&1; then
  echo "SKIP: 'ip netns' is unavailable"
  exit $SKIP
fi

readonly NS_A="shardps-a-$$" NS_B="shardps-b-$$" NS_C="shardps-c-$$" NS_BR="shardps-br-$$"
readonly ALL_NS=("$NS_A" "$NS_B" "$NS_C" "$NS_BR")
TMP=$(mktemp -d "${TMPDIR:-/tmp}/shardps-netns-XXXXXX")
CREATED_NS=()
FAILED=1

cleanup() {
  local ns pid
  # Kill (by pid) every process still running in our namespaces: only this test starts any.
  for ns in "${CREATED_NS[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
  wait 2>/dev/null
  # Deleting a namespace destroys the veth ends and the bridge inside it.
  for ns in "${CREATED_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  if [[ $FAILED -ne 0 ]]; then
    for f in "$TMP"/*.log; do
      [[ -f $f ]] || continue
      echo "----- $(basename "$f")"
      tail -n 30 "$f"
    done
    echo "logs kept in $TMP"
  else
    rm -rf "$TMP"
  fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

in_ns() {  # in_ns NS CMD...: bounded command inside a namespace
  local ns=$1
  shift
  timeout -s KILL "$BOUND_S" ip netns exec "$ns" "$@"
}

# --- Namespaces and links --------------------------------------------------------------------
for ns in "${ALL_NS[@]}"; do
  if ! ip netns add "$ns" 2>"$TMP/netns.err"; then
    if [[ ${#CREATED_NS[@]} -eq 0 ]]; then
      echo "SKIP: cannot create a network namespace: $(cat "$TMP/netns.err")"
      FAILED=0
      exit $SKIP
    fi
    fail "ip netns add $ns: $(cat "$TMP/netns.err")"
  fi
  CREATED_NS+=("$ns")
  ip -n "$ns" link set lo up || fail "lo up in $ns"
done
ip -n "$NS_BR" link add br0 type bridge || fail "bridge in $NS_BR"
ip -n "$NS_BR" link set br0 up || fail "br0 up"
declare -A ADDR=(["$NS_A"]=10.77.0.1 ["$NS_B"]=10.77.0.2 ["$NS_C"]=10.77.0.3)
i=0
for ns in "$NS_A" "$NS_B" "$NS_C"; do
  port="p$i"
  ip -n "$NS_BR" link add "$port" type veth peer name eth0 netns "$ns" || fail "veth for $ns"
  ip -n "$NS_BR" link set "$port" master br0 || fail "$port into br0"
  ip -n "$NS_BR" link set "$port" up || fail "$port up"
  ip -n "$ns" addr add "${ADDR[$ns]}/24" dev eth0 || fail "address in $ns"
  ip -n "$ns" link set eth0 up || fail "eth0 up in $ns"
  i=$((i + 1))
done

wait_file() {  # wait_file PATH PID: until PATH is non-empty, PID exits, or BOUND_S passes
  local deadline=$((SECONDS + BOUND_S))
  while [[ ! -s $1 ]]; do
    kill -0 "$2" 2>/dev/null || return 1
    ((SECONDS < deadline)) || return 1
    sleep 0.05
  done
}

# --- The cluster -----------------------------------------------------------------------------
in_ns "$NS_A" "$COORD_BIN" --listen=10.77.0.1:0 --address_file="$TMP/coordinator.addr" \
  --cluster_token="$TOKEN" --consistency=bsp --num_servers=2 --num_workers=$WORKERS \
  --heartbeat_interval_ms=100 --heartbeat_timeout_ms=2000 --data_transport=tcp \
  --partition_bytes=1024 >"$TMP/coordinator.log" 2>&1 &
COORD_PID=$!
wait_file "$TMP/coordinator.addr" $COORD_PID || fail "the coordinator did not start"
COORD=$(head -n1 "$TMP/coordinator.addr")
[[ $COORD == 10.77.0.1:* ]] || fail "the coordinator listens on '$COORD', not 10.77.0.1"

in_ns "$NS_A" "$SERVER_BIN" --coordinator="$COORD" --cluster_token="$TOKEN" --transport=tcp \
  --bind_ip=10.77.0.1 --rank=0 --lr=$LR >"$TMP/server0.log" 2>&1 &
in_ns "$NS_B" "$SERVER_BIN" --coordinator="$COORD" --cluster_token="$TOKEN" --transport=tcp \
  --bind_ip=10.77.0.2 --rank=1 --lr=$LR >"$TMP/server1.log" 2>&1 &

tx_before=$(ip netns exec "$NS_C" cat /sys/class/net/eth0/statistics/tx_bytes)
WORKER_PIDS=()
for r in $(seq 0 $((WORKERS - 1))); do
  in_ns "$NS_C" "$WORKER_BIN" --coordinator="$COORD" --cluster_token="$TOKEN" --transport=tcp \
    --bind_ip=10.77.0.3 --rank="$r" --workers=$WORKERS --steps=$STEPS --lr=$LR \
    --out="$TMP/worker$r.out" >"$TMP/worker$r.log" 2>&1 &
  WORKER_PIDS+=($!)
done
# The reference needs no network: it runs in the host namespace, outside the cluster.
timeout -s KILL "$BOUND_S" "$WORKER_BIN" --standalone --workers=$WORKERS --steps=$STEPS \
  --lr=$LR --out="$TMP/standalone.out" >"$TMP/standalone.log" 2>&1 || fail "standalone run"

for r in "${!WORKER_PIDS[@]}"; do
  wait "${WORKER_PIDS[$r]}"  # bounded: each worker runs under timeout
  rc=$?
  [[ $rc -eq 0 ]] || fail "worker $r exited with $rc (137: killed at the ${BOUND_S} s bound)"
done
tx_after=$(ip netns exec "$NS_C" cat /sys/class/net/eth0/statistics/tx_bytes)

# --- Checks ----------------------------------------------------------------------------------
"$WORKER_BIN" --mode=compare --reference="$TMP/standalone.out" \
  --results="$TMP/worker0.out,$TMP/worker1.out" || fail "weights differ from the standalone run"
for r in 0 1; do
  grep -qx "transport tcp" "$TMP/worker$r.out" || fail "worker $r did not use tcp"
done
# Each worker pushed STEPS x (64 x 8 + 8) floats through ns C's only link.
min_tx=$((WORKERS * STEPS * (64 * 8 + 8) * 4))
sent=$((tx_after - tx_before))
((sent >= min_tx)) || fail "ns C sent $sent bytes over its veth, fewer than the $min_tx of gradients"
for s in 0 1; do
  grep -q "worker 0 connected" "$TMP/server$s.log" || fail "server $s never saw worker 0"
done

echo "PASS: 2 servers in 2 namespaces, 2 workers in a third; $sent bytes left ns C;" \
  "weights match the standalone run"

# --- A host cut off: suspected, probed, unreachable before its lease -------------------------
# A second coordinator (heartbeat timeout 1 s, lease 10 s: far from the ~1.5 s it tests, so a
# loaded host's jitter cannot let the lease win) in ns A and a server in ns B; then ns
# B's link goes down. ns B's kernel acknowledges nothing any more, so the coordinator must
# declare the server dead as "unreachable" once its probes stay unacknowledged (~1.5 s), not
# wait for the lease (docs/fault-tolerance.md, "Liveness").
in_ns "$NS_A" "$COORD_BIN" --listen=10.77.0.1:0 --address_file="$TMP/coordinator2.addr" \
  --cluster_token="$TOKEN" --num_servers=1 --num_workers=1 --heartbeat_interval_ms=100 \
  --heartbeat_timeout_ms=1000 --lease_ms=10000 --data_transport=tcp >"$TMP/coordinator2.log" 2>&1 &
COORD2_PID=$!
wait_file "$TMP/coordinator2.addr" $COORD2_PID || fail "the second coordinator did not start"
COORD2=$(head -n1 "$TMP/coordinator2.addr")
in_ns "$NS_B" "$SERVER_BIN" --coordinator="$COORD2" --cluster_token="$TOKEN" --transport=tcp \
  --bind_ip=10.77.0.2 --rank=0 >"$TMP/server-cut.log" 2>&1 &
deadline=$((SECONDS + BOUND_S))
until grep -q "joined as server" "$TMP/coordinator2.log"; do
  ((SECONDS < deadline)) || fail "the server in ns B never joined the second coordinator"
  sleep 0.05
done
sleep 1  # a second of heartbeats for its detector
ip -n "$NS_B" link set eth0 down || fail "link down in ns B"
t0=$(date +%s%N)
deadline=$((SECONDS + 25))
until grep -qE ": unreachable|its lease \(" "$TMP/coordinator2.log"; do
  ((SECONDS < deadline)) || fail "the cut-off server was not declared dead within 25 s"
  sleep 0.01
done
# Measured to the coordinator's own log timestamp (local time, as date's), not to when this
# shell's polling noticed it: a loaded CI host may not run this loop for seconds.
line=$(grep -m1 -E ": unreachable|its lease \(" "$TMP/coordinator2.log")
stamp=$(sed -E 's/^[IWEF]([0-9]{4})([0-9]{2})([0-9]{2}) ([0-9:.]+) .*/\1-\2-\3 \4/' <<<"$line")
t1=$(date -d "$stamp" +%s%N 2>/dev/null) || t1=$(date +%s%N)
cut_ms=$(((t1 - t0) / 1000000))
grep -q ": unreachable" "$TMP/coordinator2.log" ||
  fail "the cut-off server was declared dead by its lease, not as unreachable"
((cut_ms < 10000)) || fail "declared unreachable after $cut_ms ms, not before its 10 s lease"
echo "PASS: a server whose host was cut off was declared unreachable after $cut_ms ms" \
  "(suspicion floor 1000 ms, lease 10000 ms)"
FAILED=0
exit 0
