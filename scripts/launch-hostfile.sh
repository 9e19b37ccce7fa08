#!/usr/bin/env bash
# Launches a ShardPS job over ssh on the hosts of a hostfile, without MPI. Every ssh session is
# tracked and killed on exit; every remote process runs under `timeout`; the cluster token
# travels on ssh's stdin, never on a command line.
#
# Hostfile: one host per line, then its roles; `#` starts a comment.
#   HOST  ROLE[:COUNT]...  [ip=ADDR]
#   node1 coordinator server            # ROLE: coordinator (exactly one), server, worker
#   node2 server worker:2   ip=10.0.0.2 # ip=: --bind_ip of that host's processes (verbs NIC)
#   node3 worker:2
# The coordinator's host (its ip= if given) is the address everyone dials.
#
# usage: scripts/launch-hostfile.sh --hostfile FILE [options] [-- TRAINER ARGS...]
#   --transport T        verbs, tcp or auto (default $SHARDPS_TRANSPORT, else auto); shm only
#                        when every role is on one host
#   --consistency C, --staleness S, --optimizer O, --lr X   as scripts/launch-local.sh
#   --port P             coordinator port (default 7070)
#   --remote-root DIR    the ShardPS checkout on every host (default: this one's path)
#   --run-dir DIR        local logs, one per process (default BUILD/runs/<time>-<pid>)
#   --timeout SEC        bound on the job and on every remote process (default 600)
#   --ssh CMD            ssh command (default "ssh -o BatchMode=yes -o ConnectTimeout=10")
#   --dry-run            print the commands, run nothing
# Env: SHARDPS_BUILD_DIR (relative to --remote-root, default build), SHARDPS_DATA_DIR (default
#      BUILD/data, same path on every host), SHARDPS_CLUSTER_TOKEN (default: random).
# Exit status: 0 trained; 1 a worker failed or the job timed out; 2 bad usage or hostfile;
# 3 the coordinator exited at start (its log's tail is printed: e.g. --port is taken).
# Defaults: python/shardps/launch_defaults.env, shared by every launcher (an environment variable
# of the same name, e.g. SHARDPS_WORKERS=4, overrides it; a flag overrides both).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_REL=${SHARDPS_BUILD_DIR:-build}

# shellcheck source=defaults.sh
. "$ROOT/scripts/defaults.sh"  # the shared launch defaults (python/shardps/launch_defaults.env)
hostfile="" transport=$SHARDPS_TRANSPORT consistency=$SHARDPS_CONSISTENCY
staleness=$SHARDPS_STALENESS optimizer=$SHARDPS_OPTIMIZER lr=$SHARDPS_LR port=$SHARDPS_PORT
remote_root=$ROOT run_dir="" timeout_s=$SHARDPS_TIMEOUT_S dry_run=0
ssh_cmd="ssh -o BatchMode=yes -o ConnectTimeout=10"
trainer_args=()
die() { echo "launch-hostfile: $*" >&2; exit 2; }
while (($#)); do
  case $1 in
    --hostfile) hostfile=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --consistency) consistency=$2; shift 2 ;;
    --staleness) staleness=$2; shift 2 ;;
    --optimizer) optimizer=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --remote-root) remote_root=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --ssh) ssh_cmd=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown option '$1' (--help)" ;;
  esac
done
[[ -n $hostfile ]] || die "--hostfile is required (--help)"
[[ -r $hostfile ]] || die "cannot read $hostfile"
case $transport in verbs|tcp|shm|auto) ;; *) die "--transport must be verbs, tcp, shm or auto" ;; esac
[[ $BUILD_REL == /* ]] && BUILD=$BUILD_REL || BUILD="$remote_root/$BUILD_REL"
DATA_DIR=${SHARDPS_DATA_DIR:-$BUILD/data}

# --- parse the hostfile into one entry per process: "role host bind_ip" --------------------------
procs=()
coord_host="" coord_ip="" hosts_seen=()
lineno=0
while IFS= read -r line || [[ -n $line ]]; do
  lineno=$((lineno + 1))
  line=${line%%#*}
  read -r -a f <<<"$line"
  ((${#f[@]})) || continue
  host=${f[0]} ip=""
  for tok in "${f[@]:1}"; do [[ $tok == ip=* ]] && ip=${tok#ip=}; done
  ((${#f[@]} > 1)) || die "$hostfile:$lineno: host $host has no role"
  hosts_seen+=("$host")
  for tok in "${f[@]:1}"; do
    [[ $tok == ip=* ]] && continue
    role=${tok%%:*} count=1
    [[ $tok == *:* ]] && count=${tok#*:}
    [[ $count =~ ^[1-9][0-9]*$ ]] || die "$hostfile:$lineno: bad count in '$tok'"
    case $role in
      coordinator)
        [[ -z $coord_host && $count == 1 ]] || die "$hostfile:$lineno: exactly one coordinator"
        coord_host=$host coord_ip=$ip ;;
      server|worker)
        for ((k = 0; k < count; k++)); do procs+=("$role $host ${ip:--}"); done ;;
      *) die "$hostfile:$lineno: unknown role '$role' (coordinator, server, worker)" ;;
    esac
  done
done <"$hostfile"
[[ -n $coord_host ]] || die "no coordinator in $hostfile"
n_servers=0 n_workers=0
for p in "${procs[@]}"; do
  case $p in server*) n_servers=$((n_servers + 1)) ;; worker*) n_workers=$((n_workers + 1)) ;; esac
done
((n_servers && n_workers)) || die "$hostfile names no server or no worker"
distinct=$(printf '%s\n' "${hosts_seen[@]}" | sort -u | wc -l)
[[ $transport != shm || $distinct == 1 ]] || die "shm works within one host; use tcp or verbs"
addr="${coord_ip:-$coord_host}:$port"

if [[ -z ${SHARDPS_CLUSTER_TOKEN:-} ]]; then
  SHARDPS_CLUSTER_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
fi

# The remote command: read the token from stdin, then exec the binary under timeout.
remote() {  # remote BIN ARGS... -> one shell-quoted command line
  local q
  q=$(printf '%q ' "$@")
  printf 'cd %q && IFS= read -r SHARDPS_CLUSTER_TOKEN && export SHARDPS_CLUSTER_TOKEN && exec timeout %q %s' \
    "$remote_root" "$timeout_s" "${q% }"
}
names=() hosts=() cmds=()
add() { names+=("$1"); hosts+=("$2"); cmds+=("$3"); }
coord_args=(--listen="${coord_ip:-0.0.0.0}:$port" --num_servers="$n_servers"
            --num_workers="$n_workers" --consistency="$consistency" --staleness="$staleness"
            --exit_when_done)
[[ $transport == auto ]] || coord_args+=(--data_transport="$transport")
add coordinator "$coord_host" "$(remote "$BUILD/server/shardps_coordinator" "${coord_args[@]}")"
si=0 wi=0
for p in "${procs[@]}"; do
  read -r role host ip <<<"$p"
  bind=()
  [[ $ip == - ]] || bind=(--bind_ip="$ip")
  if [[ $role == server ]]; then
    add "server-$si" "$host" "$(remote "$BUILD/server/shardps_server" --coordinator="$addr" \
      --transport="$transport" ${bind[@]+"${bind[@]}"} --optimizer="$optimizer" --lr="$lr" \
      --exit_when_done)"
    si=$((si + 1))
  else
    add "worker-$wi" "$host" "$(remote "$BUILD/examples/digits_trainer" --coordinator="$addr" \
      --transport="$transport" ${bind[@]+"${bind[@]}"} --data="$DATA_DIR/digits_train.bin" \
      ${trainer_args[@]+"${trainer_args[@]}"})"
    wi=$((wi + 1))
  fi
done

echo "launch-hostfile: coordinator $addr, $n_servers server(s), $n_workers worker(s)" \
     "on $distinct host(s), transport $transport, consistency $consistency"
if ((dry_run)); then
  for i in "${!cmds[@]}"; do
    echo "[${names[i]}] $ssh_cmd ${hosts[i]} '${cmds[i]//\'/\'\\\'\'}' <<< '<cluster token>'"
  done
  exit 0
fi

run_dir=${run_dir:-$ROOT/$BUILD_REL/runs/$(date +%Y%m%d-%H%M%S)-$$}
mkdir -p "$run_dir"
pids=()
cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  # Killing ssh ends the remote side with SIGHUP at the latest when its timeout expires.
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
worker_pids=() worker_logs=()
for i in "${!cmds[@]}"; do
  # shellcheck disable=SC2086  # $ssh_cmd is a command with options
  $ssh_cmd "${hosts[i]}" "${cmds[i]}" <<<"$SHARDPS_CLUSTER_TOKEN" >"$run_dir/${names[i]}.log" 2>&1 &
  pids+=($!)
  if [[ ${names[i]} == worker-* ]]; then worker_pids+=($!); worker_logs+=("$run_dir/${names[i]}.log"); fi
  if [[ ${names[i]} == coordinator ]]; then
    sleep 1  # members retry it anyway
    # A coordinator that cannot listen (the port is taken, a wrong ip) ends at once; say so
    # now instead of letting every member retry it for 10-30 s.
    if ! kill -0 "${pids[0]}" 2>/dev/null; then
      echo "launch-hostfile: the coordinator on ${hosts[i]} exited at start:" >&2
      tail -n 5 "$run_dir/coordinator.log" >&2
      exit 3
    fi
  fi
done
echo "launch-hostfile: logs in $run_dir"
deadline=$((SECONDS + timeout_s))
rc=0
for p in "${worker_pids[@]}"; do
  while kill -0 "$p" 2>/dev/null; do
    ((SECONDS < deadline)) || { echo "launch-hostfile: timed out after ${timeout_s} s" >&2; exit 1; }
    sleep 0.5
  done
  wait "$p" || rc=$?
done
# Servers and the coordinator leave by themselves once the workers are gone (--exit_when_done).
for _ in $(seq 150); do  # 15 s
  running=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && running=1; done
  ((running)) || break
  sleep 0.1
done
final=$(grep -h -o 'final: .*' "${worker_logs[@]}" | head -n 1 || true)
if ((rc)) || [[ -z $final ]]; then
  echo "launch-hostfile: FAILED (worker exit status $rc); logs in $run_dir" >&2
  exit 1
fi
echo "launch-hostfile: $final"
