#!/usr/bin/env bash
# Starts a ShardPS cluster on this host and runs a trainer on it: 1 coordinator (port 0,
# --address_file), N shard servers, M workers. Every process logs to its own file under the
# run directory; rank 0's progress is streamed to the console. Every process is tracked and
# killed on exit, and every wait is bounded.
#
# usage: scripts/launch-local.sh [options] [-- TRAINER ARGS...]
#   --servers N            shard server groups (default 2)
#   --replicas R           1, or 2: every group also gets a backup server (N*R server processes;
#                          docs/fault-tolerance.md) (default 1)
#   --spares K             K spare servers (shardps_server --spare; needs --replicas 2): after a
#                          failover, a spare becomes the group's new backup (default 0)
#   --checkpoint-dir DIR   periodic checkpoints go here (with --checkpoint-every K clocks)
#   --workers M            workers (default 2)
#   --local-workers L      host aggregation (docs/hierarchical.md): the M workers form M/L
#                          emulated hosts of L, each under one shardps_aggregator that pushes
#                          and pulls for them (default 1: flat, every worker joins itself)
#   --transport T          verbs, tcp, shm or auto (default $SHARDPS_TRANSPORT, else auto)
#   --consistency C        bsp, ssp, asp or vsgd (default bsp)
#   --staleness S          SSP/VSGD staleness bound (default 0)
#   --optimizer O          servers' optimizer: sgd, momentum, adam (default momentum)
#   --lr X                 servers' learning rate (default 0.2)
#   --partition-bytes B    coordinator's chunk size (default: the coordinator's, 4 MiB)
#   --bind-ip IP           data and control address (default 127.0.0.1)
#   --server-bind-ip IP    data address of the servers (default: --bind-ip); with two rxe
#                          devices on one host, put servers and workers on different ones
#   --trainer PATH         trainer binary (default BUILD/examples/digits_trainer)
#   --run-dir DIR          logs go here (default BUILD/runs/<time>-<pid>)
#   --timeout SEC          bound on the whole training (default 600)
#   --coordinator-arg A, --server-arg A   extra flag for those processes (repeatable)
#   --quiet                do not stream progress (the final line is still printed)
# Env: SHARDPS_BUILD_DIR (default build), SHARDPS_DATA_DIR (default BUILD/data),
#      SHARDPS_CLUSTER_TOKEN (default: a random one for this run), SHARDPS_TRANSPORT.
# The trainer gets --coordinator, --transport, --bind_ip and --data first, so TRAINER ARGS
# override them. Exit status: 0 only if every process did its job and a "final:" line appeared.
# Defaults: python/shardps/launch_defaults.env, shared by every launcher (an environment variable
# of the same name, e.g. SHARDPS_WORKERS=4, overrides it; a flag overrides both).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${SHARDPS_BUILD_DIR:-build}
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"

# shellcheck source=defaults.sh
. "$ROOT/scripts/defaults.sh"  # the shared launch defaults (python/shardps/launch_defaults.env)
replicas=$SHARDPS_REPLICAS spares=0 checkpoint_dir= checkpoint_every=
servers=$SHARDPS_SERVERS workers=$SHARDPS_WORKERS transport=$SHARDPS_TRANSPORT
consistency=$SHARDPS_CONSISTENCY staleness=$SHARDPS_STALENESS optimizer=$SHARDPS_OPTIMIZER
lr=$SHARDPS_LR partition_bytes="" bind_ip=$SHARDPS_BIND_IP server_bind_ip="" trainer="" run_dir=""
timeout_s=$SHARDPS_TIMEOUT_S quiet=0 local_workers=1
coord_extra=() server_extra=() trainer_args=()
die() { echo "launch-local: $*" >&2; exit 2; }
while (($#)); do
  case $1 in
    --servers) servers=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --spares) spares=$2; shift 2 ;;
    --checkpoint-dir) checkpoint_dir=$2; shift 2 ;;
    --checkpoint-every) checkpoint_every=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --local-workers) local_workers=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --consistency) consistency=$2; shift 2 ;;
    --staleness) staleness=$2; shift 2 ;;
    --optimizer) optimizer=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --partition-bytes) partition_bytes=$2; shift 2 ;;
    --bind-ip) bind_ip=$2; shift 2 ;;
    --server-bind-ip) server_bind_ip=$2; shift 2 ;;
    --trainer) trainer=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --coordinator-arg) coord_extra+=("$2"); shift 2 ;;
    --server-arg) server_extra+=("$2"); shift 2 ;;
    --quiet) quiet=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown option '$1' (--help)" ;;
  esac
done
[[ $servers =~ ^[1-9][0-9]*$ && $workers =~ ^[1-9][0-9]*$ ]] || die "--servers/--workers must be >= 1"
[[ $replicas =~ ^[12]$ ]] || die "--replicas must be 1 or 2"
[[ $spares =~ ^[0-9]+$ ]] || die "--spares must be a number"
((spares == 0 || replicas == 2)) || die "--spares needs --replicas 2 (a spare becomes a backup)"
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds"
case $transport in verbs|tcp|shm|auto) ;; *) die "--transport must be verbs, tcp, shm or auto" ;; esac
case $consistency in
  bsp|asp) ;;
  ssp|vsgd) [[ $staleness =~ ^[0-9]+$ ]] || die "--staleness must be a number" ;;
  *) die "--consistency must be bsp, ssp, asp or vsgd" ;;
esac

COORD="$BUILD/server/shardps_coordinator"
SERVER="$BUILD/server/shardps_server"
trainer=${trainer:-$BUILD/examples/digits_trainer}
for b in "$COORD" "$SERVER" "$trainer"; do
  [[ -x $b ]] || die "missing $b: build first (scripts/build.sh, or SHARDPS_BUILD_DIR=...)"
done
DATA_DIR=${SHARDPS_DATA_DIR:-$BUILD/data}
run_dir=${run_dir:-$BUILD/runs/$(date +%Y%m%d-%H%M%S)-$$}
mkdir -p "$run_dir"
run_dir=$(cd "$run_dir" && pwd)

# The token reaches the processes through the environment, never through argv (ps shows argv).
if [[ -z ${SHARDPS_CLUSTER_TOKEN:-} ]]; then
  SHARDPS_CLUSTER_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
fi
export SHARDPS_CLUSTER_TOKEN

# --- process tracking: everything started here is killed on exit --------------------------------
pids=()
cleanup() {
  local rc=$? p alive
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 30); do  # up to 3 s for a clean exit
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
alive() { kill -0 "$1" 2>/dev/null; }
show_logs() {  # the tail of every stderr log, for a failure report
  local f
  for f in "$run_dir"/*.log; do
    [[ $f == */worker-*.log && $f != *.stderr.log ]] && continue
    echo "----- ${f#"$run_dir"/} (last 15 lines) -----" >&2
    tail -n 15 "$f" >&2 || true
  done
}

echo "launch-local: $servers server group(s) x $replicas replica(s), $spares spare(s), $workers worker(s)," \
     "transport $transport, consistency" \
     "$consistency$([[ $consistency == ssp || $consistency == vsgd ]] && echo "(s=$staleness)")," \
     "optimizer $optimizer lr $lr; logs in $run_dir"

# With host aggregation the coordinator's workers are the aggregators (one per emulated host).
[[ $local_workers =~ ^[1-9][0-9]*$ ]] || die "--local-workers must be a positive integer"
((workers % local_workers == 0)) || die "--workers ($workers) must be a multiple of --local-workers ($local_workers)"
cluster_workers=$((workers / local_workers))
((local_workers == 1)) || echo "launch-local: host aggregation: $cluster_workers host(s) x" \
  "$local_workers local workers, one shardps_aggregator each"

# --- coordinator ---------------------------------------------------------------------------------
coord_args=(--listen="$bind_ip:0" --address_file="$run_dir/coordinator.addr"
            --consistency="$consistency" --staleness="$staleness"
            --num_servers="$servers" --num_workers="$cluster_workers" --exit_when_done
            --replicas="$replicas" --state_file="$run_dir/coordinator.state")
[[ -z $checkpoint_dir ]] || coord_args+=(--checkpoint_dir="$checkpoint_dir"
                                         --checkpoint_every="${checkpoint_every:-10}")
# A transport asked for by name is enforced cluster-wide: a member that opened another is refused.
[[ $transport == auto ]] || coord_args+=(--data_transport="$transport")
[[ -z $partition_bytes ]] || coord_args+=(--partition_bytes="$partition_bytes")
"$COORD" "${coord_args[@]}" ${coord_extra[@]+"${coord_extra[@]}"} \
  >"$run_dir/coordinator.log" 2>&1 &
coord_pid=$!
pids+=("$coord_pid")
for _ in $(seq 200); do  # 20 s
  [[ -s $run_dir/coordinator.addr ]] && break
  alive "$coord_pid" || { show_logs; die "the coordinator exited during start-up"; }
  sleep 0.1
done
[[ -s $run_dir/coordinator.addr ]] || { show_logs; die "the coordinator did not listen within 20 s"; }
addr=$(<"$run_dir/coordinator.addr")
echo "launch-local: coordinator at $addr (pid $coord_pid)"

# --- servers -------------------------------------------------------------------------------------
server_pids=()
for ((i = 0; i < servers * replicas; i++)); do
  "$SERVER" --coordinator="$addr" --transport="$transport" --bind_ip="${server_bind_ip:-$bind_ip}" \
    --optimizer="$optimizer" --lr="$lr" --exit_when_done \
    ${server_extra[@]+"${server_extra[@]}"} >"$run_dir/server-$i.log" 2>&1 &
  server_pids+=($!)
  pids+=($!)
done

spare_pids=()
for ((i = 0; i < spares; i++)); do
  "$SERVER" --coordinator="$addr" --transport="$transport" --bind_ip="${server_bind_ip:-$bind_ip}" \
    --optimizer="$optimizer" --lr="$lr" --exit_when_done --spare \
    ${server_extra[@]+"${server_extra[@]}"} >"$run_dir/spare-$i.log" 2>&1 &
  spare_pids+=($!)
  pids+=($!)
done

# --- host aggregators (--local-workers > 1) --------------------------------------------------------
agg_pids=()
if ((local_workers > 1)); then
  for ((h = 0; h < cluster_workers; h++)); do
    "$BUILD/worker/shardps_aggregator" --socket="@shardps-$$-$h" --local_workers="$local_workers" \
      --coordinator="$addr" --transport="$transport" --bind_ip="$bind_ip" --rank="$h" \
      >"$run_dir/aggregator-$h.log" 2>&1 &
    agg_pids+=($!)
    pids+=($!)
  done
fi

# --- workers -------------------------------------------------------------------------------------
worker_pids=()
for ((i = 0; i < workers; i++)); do
  agg_env=()
  ((local_workers == 1)) ||
    agg_env=(SHARDPS_AGGREGATOR="@shardps-$$-$((i / local_workers))"
             SHARDPS_LOCAL_RANK=$((i % local_workers)))
  env ${agg_env[@]+"${agg_env[@]}"} \
    "$trainer" --coordinator="$addr" --transport="$transport" --bind_ip="$bind_ip" \
    --data="$DATA_DIR/digits_train.bin" ${trainer_args[@]+"${trainer_args[@]}"} \
    >"$run_dir/worker-$i.log" 2>"$run_dir/worker-$i.stderr.log" &
  worker_pids+=($!)
  pids+=($!)
done
if ((!quiet)); then
  tail -q -n +1 -F "$run_dir"/worker-*[0-9].log 2>/dev/null &
  tail_pid=$!
  pids+=("$tail_pid")
fi

# --- wait for the workers, bounded; a dead server or coordinator fails the run at once ----------
# A coordinator or server that exited with status 0 left cleanly (--exit_when_done: every
# worker has left the cluster, though a worker process may still be shutting down, e.g. a
# Python interpreter); only a non-zero exit is a death.
deadline=$((SECONDS + timeout_s))
failed=""
declare -A exited=()
reported=()
died() {  # died PID: true if PID is gone with a non-zero status
  alive "$1" && return 1
  if [[ -z ${exited[$1]:-} ]]; then
    local rc=0
    wait "$1" 2>/dev/null || rc=$?
    exited[$1]=$rc
  fi
  ((exited[$1] != 0))
}
while :; do
  running=0
  for p in "${worker_pids[@]}"; do alive "$p" && running=1; done
  ((running)) || break
  died "$coord_pid" && { failed="the coordinator died (exit status ${exited[$coord_pid]})"; break; }
  for p in ${agg_pids[@]+"${agg_pids[@]}"}; do
    died "$p" && { failed="a host aggregator (pid $p) died (exit status ${exited[$p]})"; break 2; }
  done
  for ((i = 0; i < servers * replicas; i++)); do
    if died "${server_pids[i]}"; then
      if ((replicas > 1)); then  # its group fails over to the backup; training goes on
        if [[ -z ${reported[i]:-} ]]; then
          echo "launch-local: server $i (pid ${server_pids[i]}) died (exit status" \
               "${exited[${server_pids[i]}]}); its group fails over to its backup" >&2
          reported[i]=1
        fi
      else
        failed="server $i (pid ${server_pids[i]}) died"
        break 2
      fi
    fi
  done
  ((SECONDS < deadline)) || { failed="the workers did not finish within ${timeout_s} s"; break; }
  sleep 0.2
done
worker_rc=0
if [[ -z $failed ]]; then
  for ((i = 0; i < workers; i++)); do
    rc=0
    wait "${worker_pids[i]}" || rc=$?
    ((rc == 0)) || { echo "launch-local: worker $i exited with $rc" >&2; worker_rc=$rc; }
  done
fi
if ((!quiet)); then
  sleep 0.5  # let tail print the last lines
  kill "$tail_pid" 2>/dev/null || true
fi

# --- the servers and the coordinator leave by themselves (--exit_when_done), bounded -------------
if [[ -z $failed ]]; then
  for _ in $(seq 150); do  # 15 s
    running=0
    for p in "$coord_pid" "${server_pids[@]}" ${spare_pids[@]+"${spare_pids[@]}"}; do
      alive "$p" && running=1
    done
    ((running)) || break
    sleep 0.1
  done
  for p in "$coord_pid" "${server_pids[@]}" ${spare_pids[@]+"${spare_pids[@]}"}; do
    alive "$p" && echo "launch-local: pid $p did not exit by itself; stopping it" >&2
  done
fi

final=$(grep -h '^final:' "$run_dir"/worker-*[0-9].log || true)
if [[ -n $failed ]] || ((worker_rc != 0)) || [[ -z $final ]]; then
  show_logs
  why=${failed:-}
  ((worker_rc == 0)) || why="${why:+$why; }a worker exited with status $worker_rc"
  [[ -n $final ]] || why="${why:+$why; }no final line from rank 0"
  echo "launch-local: FAILED: $why" >&2
  echo "launch-local: logs in $run_dir" >&2
  exit 1
fi
why=$(grep -h -m1 'transport: auto picked' "$run_dir/server-0.log" 2>/dev/null | sed 's/.*transport: //' || true)
[[ -z $why ]] || echo "launch-local: transport: $why"
echo "launch-local: $final"
echo "launch-local: logs in $run_dir"
