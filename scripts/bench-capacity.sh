#!/usr/bin/env bash
# Capacity-weighted sharding (docs/plan.md, "Sharding from the probe"): 2 shard servers in two
# network namespaces, server 1's link throttled with tc (tbf), the digits trainer's workers in a
# third namespace; the same job runs with byte-balanced sharding and with
# --server_capacity=1,W (W = throttled rate / unthrottled rate, measured here with the plan
# probe's bandwidth figure when given, else --weight). Prints, for both: each server's bytes/s
# over its veth, the busiest server's bytes/s, and the step time.
#
#   ns A (10.78.0.1): coordinator + server 0      ns B (10.78.0.2): server 1 (throttled)
#   ns C (10.78.0.3): the workers                 ns BR: bridge, one veth to each
#
# usage: scripts/bench-capacity.sh [--rate 100mbit] [--weight 0.1] [--hidden 1024]
#                                  [--epochs 5] [--workers 2] [--partition 16384]
# Root only (network namespaces, tc). Bounded: every process runs under `timeout`; namespaces
# and processes are removed on exit. Exit 77 when it cannot run here.
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${SHARDPS_BUILD_DIR:-build}
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"
rate=100mbit weight=0.1 hidden=1024 epochs=5 workers=2 partition=16384 bound=50
while (($#)); do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --weight) weight=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --partition) partition=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-capacity: unknown option $1" >&2; exit 2 ;;
  esac
done
COORD="$BUILD/server/shardps_coordinator" SERVER="$BUILD/server/shardps_server"
TRAINER="$BUILD/examples/digits_trainer" DATA=${SHARDPS_DATA_DIR:-$BUILD/data}
for b in "$COORD" "$SERVER" "$TRAINER"; do
  [[ -x $b ]] || { echo "bench-capacity: missing $b (build first)" >&2; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { echo "SKIP: needs root (namespaces, tc)"; exit 77; }
command -v tc >/dev/null || { echo "SKIP: no tc (apt-get install iproute2)"; exit 77; }

NS_A="spcap-a-$$" NS_B="spcap-b-$$" NS_C="spcap-c-$$" NS_BR="spcap-br-$$"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/shardps-capacity-XXXXXX")
CREATED=()
cleanup() {
  local ns pid
  for ns in "${CREATED[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
  wait 2>/dev/null
  for ns in "${CREATED[@]}"; do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
die() { echo "bench-capacity: $*" >&2; for f in "$TMP"/*.log; do [[ -f $f ]] && { echo "--- $f"; tail -n 20 "$f"; }; done; exit 1; }

for ns in "$NS_A" "$NS_B" "$NS_C" "$NS_BR"; do
  ip netns add "$ns" 2>/dev/null || { echo "SKIP: cannot create network namespaces"; exit 77; }
  CREATED+=("$ns")
  ip -n "$ns" link set lo up
done
ip -n "$NS_BR" link add br0 type bridge && ip -n "$NS_BR" link set br0 up || die "bridge"
declare -A ADDR=(["$NS_A"]=10.78.0.1 ["$NS_B"]=10.78.0.2 ["$NS_C"]=10.78.0.3)
i=0
for ns in "$NS_A" "$NS_B" "$NS_C"; do
  ip -n "$NS_BR" link add "p$i" type veth peer name eth0 netns "$ns" || die "veth $ns"
  ip -n "$NS_BR" link set "p$i" master br0 && ip -n "$NS_BR" link set "p$i" up || die "port"
  ip -n "$ns" addr add "${ADDR[$ns]}/24" dev eth0 && ip -n "$ns" link set eth0 up || die "addr"
  i=$((i + 1))
done
# Throttle server 1 both ways: its own egress (pull replies) and the bridge port towards it
# (pushes).
for dev in "$NS_B eth0" "$NS_BR p1"; do
  set -- $dev
  tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst 32kbit latency 50ms ||
    die "tc on $2 in $1"
done

bytes() { ip netns exec "$1" sh -c 'echo $(( $(cat /sys/class/net/eth0/statistics/rx_bytes) + $(cat /sys/class/net/eth0/statistics/tx_bytes) ))'; }

run_case() {  # run_case LABEL CAPACITY: prints "LABEL b0 b1 seconds step_ms"
  local label=$1 cap=$2 token coord pids=() r rc
  token="cap-$$-$label"
  rm -f "$TMP/coordinator.addr"
  timeout -s KILL $bound ip netns exec "$NS_A" "$COORD" --listen=10.78.0.1:0 \
    --address_file="$TMP/coordinator.addr" --cluster_token="$token" --consistency=bsp \
    --num_servers=2 --num_workers="$workers" --data_transport=tcp --partition_bytes="$partition" \
    --exit_when_done ${cap:+--server_capacity=$cap} >"$TMP/coord-$label.log" 2>&1 &
  for _ in $(seq 200); do [[ -s $TMP/coordinator.addr ]] && break; sleep 0.05; done
  [[ -s $TMP/coordinator.addr ]] || die "coordinator did not start"
  coord=$(head -n1 "$TMP/coordinator.addr")
  timeout -s KILL $bound ip netns exec "$NS_A" "$SERVER" --coordinator="$coord" \
    --cluster_token="$token" --transport=tcp --bind_ip=10.78.0.1 --rank=0 --exit_when_done \
    >"$TMP/server0-$label.log" 2>&1 &
  timeout -s KILL $bound ip netns exec "$NS_B" "$SERVER" --coordinator="$coord" \
    --cluster_token="$token" --transport=tcp --bind_ip=10.78.0.2 --rank=1 --exit_when_done \
    >"$TMP/server1-$label.log" 2>&1 &
  local a0 b0 t0 a1 b1 t1
  a0=$(bytes "$NS_A"); b0=$(bytes "$NS_B"); t0=$(date +%s.%N)
  for r in $(seq 0 $((workers - 1))); do
    timeout -s KILL $bound ip netns exec "$NS_C" "$TRAINER" --coordinator="$coord" \
      --cluster_token="$token" --transport=tcp --bind_ip=10.78.0.3 --rank="$r" \
      --data="$DATA/digits_train.bin" --hidden="$hidden" --epochs="$epochs" --log_every=0 \
      >"$TMP/worker$r-$label.log" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}"; rc=$?
    ((rc == 0)) || die "$label: worker $r exited with $rc"
  done
  a1=$(bytes "$NS_A"); b1=$(bytes "$NS_B"); t1=$(date +%s.%N)
  local step
  step=$(sed -n 's/.*final:.* step \([0-9.]*\) ms.*/\1/p' "$TMP/worker0-$label.log")
  [[ -n $step ]] || die "$label: no final line"
  echo "$label $((a1 - a0)) $((b1 - b0)) $(echo "$t1 - $t0" | bc -l) $step"
  wait 2>/dev/null  # coordinator and servers exit when the workers are done
}

echo "bench-capacity: server 1 throttled to $rate (tbf, both directions); $workers workers," \
     "MLP 64x$hidden x10, partition $partition B, $epochs epochs, tcp, bsp"
results=()
results+=("$(run_case balanced "")") || exit 1
results+=("$(run_case weighted "1,$weight")") || exit 1
printf '| sharding | server 0 MB/s | server 1 (throttled) MB/s | busiest server MB/s | server 1 share of bytes | step ms |\n'
printf '|---|---:|---:|---:|---:|---:|\n'
for line in "${results[@]}"; do
  set -- $line
  awk -v l="$1" -v a="$2" -v b="$3" -v t="$4" -v s="$5" -v w="$weight" 'BEGIN {
    ra = a / t / 1e6; rb = b / t / 1e6; busiest = ra > rb ? ra : rb;
    printf "| %s | %.1f | %.1f | %.1f | %.1f%% | %.2f |\n",
      (l == "weighted" ? "weighted 1," w : "byte-balanced"), ra, rb, busiest, 100 * b / (a + b), s }'
done
