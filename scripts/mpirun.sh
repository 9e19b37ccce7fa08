#!/usr/bin/env bash
# Runs a ShardPS job as ONE Open MPI MPMD command: the coordinator, the shard servers and the
# digits trainers are the three app contexts of a single mpirun, e.g. on this host:
#
#   mpirun --allow-run-as-root --oversubscribe -x SHARDPS_CLUSTER_TOKEN -x GLOG_minloglevel \
#     -np 1 build/server/shardps_coordinator --listen=127.0.0.1:PORT --num_servers=2 \
#           --num_workers=4 --consistency=bsp --staleness=0 --exit_when_done : \
#     -np 2 build/server/shardps_server --coordinator=127.0.0.1:PORT --transport=auto \
#           --bind_ip=127.0.0.1 --optimizer=momentum --lr=0.2 --exit_when_done : \
#     -np 4 build/examples/digits_trainer --coordinator=127.0.0.1:PORT --transport=auto \
#           --bind_ip=127.0.0.1 --data=build/data/digits_train.bin --epochs=15
#
# MPI only launches the processes: ranks come from the coordinator (a worker asks for MPI's
# rank, granted when free), and the data path is ShardPS's own. Members retry the coordinator while it
# starts; --exit_when_done makes servers and coordinator leave once the workers are done, so
# mpirun returns.
#
# usage: scripts/mpirun.sh [options] [-- TRAINER ARGS...]
#   --servers N, --workers M     default 2 and 2
#   --transport T                verbs, tcp, shm, auto (default $SHARDPS_TRANSPORT, else auto)
#   --consistency C, --staleness S, --optimizer O, --lr X   as scripts/launch-local.sh
#   --hostfile FILE              Open MPI hostfile (several hosts): the coordinator (MPI rank 0,
#                                first slot) runs on the first host, whose name the others dial;
#                                the build and data must be at the same path on every host
#   --port P                     coordinator port (default: a free one here; 7070 with --hostfile)
#   --timeout SEC                bound on the whole job (default 600)
#   --trainer PATH               worker program (default BUILD/examples/digits_trainer; e.g.
#                                examples/torch_digits.py with --mpi-arg -x --mpi-arg PYTHONPATH)
#   --dry-run                    print the command, run nothing
#   --mpi-arg A                  extra mpirun argument (repeatable)
# Env: SHARDPS_BUILD_DIR, SHARDPS_DATA_DIR, SHARDPS_CLUSTER_TOKEN (default: random),
#      GLOG_minloglevel (default 2: errors only; the normal teardown logs warnings).
# Defaults: python/shardps/launch_defaults.env, shared by every launcher (an environment variable
# of the same name, e.g. SHARDPS_WORKERS=4, overrides it; a flag overrides both).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${SHARDPS_BUILD_DIR:-build}
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"
DATA_DIR=${SHARDPS_DATA_DIR:-$BUILD/data}

# shellcheck source=defaults.sh
. "$ROOT/scripts/defaults.sh"  # the shared launch defaults (python/shardps/launch_defaults.env)
servers=$SHARDPS_SERVERS workers=$SHARDPS_WORKERS transport=$SHARDPS_TRANSPORT
consistency=$SHARDPS_CONSISTENCY staleness=$SHARDPS_STALENESS optimizer=$SHARDPS_OPTIMIZER
lr=$SHARDPS_LR hostfile="" port="" timeout_s=$SHARDPS_TIMEOUT_S dry_run=0 trainer_bin=""
mpi_extra=() trainer_args=()
die() { echo "mpirun.sh: $*" >&2; exit 2; }
while (($#)); do
  case $1 in
    --servers) servers=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --consistency) consistency=$2; shift 2 ;;
    --staleness) staleness=$2; shift 2 ;;
    --optimizer) optimizer=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --trainer) trainer_bin=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --mpi-arg) mpi_extra+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown option '$1' (--help)" ;;
  esac
done
[[ $servers =~ ^[1-9][0-9]*$ && $workers =~ ^[1-9][0-9]*$ ]] || die "--servers/--workers must be >= 1"
case $transport in verbs|tcp|shm|auto) ;; *) die "--transport must be verbs, tcp, shm or auto" ;; esac
command -v mpirun >/dev/null || die "mpirun not found (apt-get install openmpi-bin: scripts/deps.sh)"

if [[ -n $hostfile ]]; then
  [[ -r $hostfile ]] || die "cannot read hostfile $hostfile"
  [[ $transport != shm ]] || die "shm works within one host only; use --transport tcp or verbs"
  # The first host of the hostfile (comments and blank lines skipped).
  coord_host=$(sed -e 's/#.*//' "$hostfile" | awk 'NF { print $1; exit }')
  [[ -n $coord_host ]] || die "no host in $hostfile"
  port=${port:-7070}
  listen="0.0.0.0:$port"
  bind=()  # each host advertises its own name; --bind_ip would be wrong on the others
  placement=(--hostfile "$hostfile")
else
  coord_host=127.0.0.1
  if [[ -z $port ]]; then  # a port nobody listens on here (other jobs share this machine)
    for _ in $(seq 50); do
      p=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768-60999)
      if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then port=$p; break; fi
    done
    [[ -n $port ]] || die "found no free port"
  fi
  listen="127.0.0.1:$port"
  bind=(--bind_ip=127.0.0.1)
  placement=(--host "localhost:$((1 + servers + workers))")
fi
addr="$coord_host:$port"

if [[ -z ${SHARDPS_CLUSTER_TOKEN:-} ]]; then
  SHARDPS_CLUSTER_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
fi
export SHARDPS_CLUSTER_TOKEN
export GLOG_minloglevel=${GLOG_minloglevel:-2}

coord=("$BUILD/server/shardps_coordinator" --listen="$listen" --num_servers="$servers"
       --num_workers="$workers" --consistency="$consistency" --staleness="$staleness"
       --exit_when_done)
[[ $transport == auto ]] || coord+=(--data_transport="$transport")
server=("$BUILD/server/shardps_server" --coordinator="$addr" --transport="$transport"
        ${bind[@]+"${bind[@]}"} --optimizer="$optimizer" --lr="$lr" --exit_when_done)
trainer=("${trainer_bin:-$BUILD/examples/digits_trainer}" --coordinator="$addr" --transport="$transport"
         ${bind[@]+"${bind[@]}"} --data="$DATA_DIR/digits_train.bin"
         ${trainer_args[@]+"${trainer_args[@]}"})
cmd=(mpirun --allow-run-as-root --oversubscribe "${placement[@]}"
     -x SHARDPS_CLUSTER_TOKEN -x GLOG_minloglevel ${mpi_extra[@]+"${mpi_extra[@]}"}
     -np 1 "${coord[@]}" : -np "$servers" "${server[@]}" : -np "$workers" "${trainer[@]}")

echo "mpirun.sh: ${cmd[*]}"
((dry_run)) && exit 0
for b in "${coord[0]}" "${server[0]}" "${trainer[0]}"; do
  [[ -x $b ]] || die "missing $b: build first (scripts/build.sh)"
done
[[ -s $DATA_DIR/digits_train.bin ]] ||
  die "no data in $DATA_DIR: /usr/bin/python3 scripts/export_digits.py --out $DATA_DIR"

log=$(mktemp "${TMPDIR:-/tmp}/shardps-mpirun.XXXXXX")
mpi_pid=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n $mpi_pid ]] && kill -0 "$mpi_pid" 2>/dev/null; then
    kill -TERM "$mpi_pid" 2>/dev/null || true  # mpirun forwards it to every rank
    for _ in $(seq 50); do kill -0 "$mpi_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$mpi_pid" 2>/dev/null || true
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Bounded: timeout sends TERM to mpirun (which stops every rank), KILL 10 s later.
timeout --kill-after=10 "$timeout_s" "${cmd[@]}" > >(tee "$log") 2>&1 &
mpi_pid=$!
rc=0
wait "$mpi_pid" || rc=$?
mpi_pid=""
sleep 0.2  # tee flushes
final=$(grep -o 'final: .*' "$log" | head -n 1 || true)
rm -f "$log"
if ((rc != 0)) || [[ -z $final ]]; then
  echo "mpirun.sh: FAILED (mpirun exit status $rc${final:+}${final:-, no final line})" >&2
  exit $((rc ? rc : 1))
fi
echo "mpirun.sh: $final"
