#!/usr/bin/env bash
# ctest slurm.digits: scripts/slurm/shardps.sbatch under a real Slurm (Debian's slurm-wlm 22.05)
# on this one host. Installs slurm-wlm and munge if missing, writes a munge key, slurm.conf and
# cgroup.conf for this host into a temp dir (one node "localhost" at 127.0.0.1 with 8 CPUs,
# proctrack/linuxproc, task/none, no cgroups, no accounting, free loopback ports), starts munged,
# slurmctld and slurmd in the foreground as children of this script (no systemd), waits for the
# node to be idle, submits the digits job (coordinator + 2 servers + 2 workers) with
# `sbatch --wait`, and asserts on the results: the job's state COMPLETED with exit code 0:0,
# rank 0's "final:" line with test accuracy >= 0.9, a log for the coordinator, each server and
# each worker, and every worker's own held-out accuracy line. Then a job whose trainer fails
# (/bin/false) must end FAILED at once (its coordinator and servers stopped by the script, not by
# a bound). Every daemon and job is stopped on exit. Skips (77) only without root or when a
# component cannot be installed or started, saying which.
#
# usage: tests/slurm/slurm_test.sh [--keep]   (--keep: leave the temp dir for inspection)
# Env: SHARDPS_BUILD_DIR (default ROOT/build; needs shardps_coordinator, shardps_server and
#      examples/digits_trainer built), SHARDPS_DATA_DIR (default BUILD/data),
#      SLURM_TEST_EPOCHS (default 15), SLURM_TEST_TIMEOUT_S (bound on the job, default 420).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${SHARDPS_BUILD_DIR:-build}
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"
DATA_DIR=${SHARDPS_DATA_DIR:-$BUILD/data}
EPOCHS=${SLURM_TEST_EPOCHS:-15}
JOB_TIMEOUT=${SLURM_TEST_TIMEOUT_S:-420}
keep=0
[[ ${1:-} == --keep ]] && keep=1

say() { echo "slurm_test: $*"; }
skip() { echo "slurm_test: SKIP: $*"; exit 77; }
fail() { echo "slurm_test: FAIL: $*" >&2; exit 1; }

# --- prerequisites -------------------------------------------------------------------------------
for b in server/shardps_coordinator server/shardps_server examples/digits_trainer; do
  [[ -x $BUILD/$b ]] || fail "missing $BUILD/$b (build shardps_coordinator_bin shardps_server digits_trainer)"
done
[[ $(id -u) -eq 0 ]] || skip "needs root: it starts munged, slurmctld and slurmd"
missing=()
for p in slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  { timeout 300 apt-get update -q && timeout 600 apt-get install -y -q --no-install-recommends \
      "${missing[@]}"; } >/tmp/slurm_test-apt.$$.log 2>&1 ||
    { tail -n 5 /tmp/slurm_test-apt.$$.log; skip "apt-get install ${missing[*]} failed (log above)"; }
  rm -f /tmp/slurm_test-apt.$$.log
fi
for c in munged slurmctld slurmd sbatch sinfo scontrol squeue scancel srun; do
  command -v "$c" >/dev/null || skip "$c not found after installing slurm-wlm and munge"
done
if [[ ! -s $DATA_DIR/digits_train.bin ]]; then
  timeout 120 /usr/bin/python3 "$ROOT/scripts/export_digits.py" --out "$DATA_DIR" >/dev/null ||
    skip "no digits data in $DATA_DIR and scripts/export_digits.py failed (python3-sklearn)"
fi

# --- temp dir, ports, config ---------------------------------------------------------------------
T=$(mktemp -d /tmp/shardps-slurm.XXXXXX)
chmod 0700 "$T"
pids=()
cleanup() {
  local rc=$? p alive
  trap - EXIT INT TERM
  # Jobs first (slurmd's slurmstepd kills their processes), then the daemons, newest first.
  if [[ -n ${SLURM_CONF:-} ]] && ((${#pids[@]} >= 3)); then
    timeout 10 scancel --quiet --full --user=root 2>/dev/null || true
    for _ in $(seq 100); do  # 10 s for the job's steps to end
      [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && break
      sleep 0.1
    done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  for _ in $(seq 100); do  # 10 s
    alive=0
    for p in ${pids[@]+"${pids[@]}"}; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for p in ${pids[@]+"${pids[@]}"}; do kill -KILL "$p" 2>/dev/null || true; done
  if ((rc != 0 && rc != 77)); then
    for f in "$T"/slurmctld.log "$T"/slurmd.log; do
      [[ -s $f ]] && { echo "----- $f (last 20 lines) -----" >&2; tail -n 20 "$f" >&2; }
    done
  fi
  if ((keep)); then say "kept $T"; else rm -rf "$T"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

used_ports=" "
free_port() {  # a loopback port nobody listens on, not handed out before
  local p
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 12000))  # below the ephemeral range (32768-60999)
    [[ $used_ports == *" $p "* ]] && continue
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then used_ports+="$p "; echo "$p"; return; fi
  done
  fail "found no free port"
}
ctld_port=$(free_port)
slurmd_port=$(free_port)
srun_lo=$(free_port)

mkdir -p "$T/state" "$T/spool" "$T/munge" "$T/jobs"
chmod 0700 "$T/munge"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 0600 "$T/munge/munge.key"
cat >"$T/slurm.conf" <<EOF
# One host, made by tests/slurm/slurm_test.sh: no systemd, no cgroups, no accounting.
ClusterName=shardpstest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SrunPortRange=$srun_lo-$((srun_lo + 50))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$T/munge/munge.socket
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
InactiveLimit=0
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=shardps Nodes=localhost Default=YES MaxTime=60 State=UP
EOF
cat >"$T/cgroup.conf" <<EOF
# No cgroups: proctrack/linuxproc and task/none do not use them.
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
export SLURM_CONF="$T/slurm.conf"

# --- daemons -------------------------------------------------------------------------------------
munged -F -f --key-file="$T/munge/munge.key" --socket="$T/munge/munge.socket" \
  --pid-file="$T/munge/munged.pid" --log-file="$T/munge/munged.log" \
  --seed-file="$T/munge/munged.seed" >"$T/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $T/munge/munge.socket ]] && break; sleep 0.1; done
[[ -S $T/munge/munge.socket ]] || { cat "$T/munged.out" "$T/munge/munged.log" 2>/dev/null; skip "munged did not start (log above)"; }
munge -S "$T/munge/munge.socket" -n | unmunge -S "$T/munge/munge.socket" >/dev/null ||
  skip "munge/unmunge round trip through $T/munge/munge.socket failed"

slurmctld -D -i -f "$SLURM_CONF" >"$T/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -N localhost -f "$SLURM_CONF" >"$T/slurmd.out" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 120); do  # 60 s for the node to register and go idle
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { tail -n 20 "$T"/slurm*.out "$T"/slurm*.log 2>/dev/null; skip "a Slurm daemon exited during start-up (logs above)"; }
  done
  state=$(timeout 5 sinfo -h -N -o %T 2>/dev/null || true)
  [[ $state == idle ]] && break
  sleep 0.5
done
[[ $state == idle ]] || skip "the node did not become idle within 60 s (sinfo says '${state:-nothing}')"
say "slurm up: $(sinfo -h -N -o '%N %T cpus=%c') (slurmctld :$ctld_port, slurmd :$slurmd_port)"

# --- the job -------------------------------------------------------------------------------------
run_dir="$T/jobs/run"
out="$T/jobs/job.out"
start=$SECONDS
sbatch_rc=0
# Env overrides of the launch defaults: a free coordinator port (0), 2 servers without backups;
# the workers are the tasks left (5 - 1 - 2), so SHARDPS_WORKERS must not be set.
(cd "$ROOT" && env -u SHARDPS_WORKERS SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA_DIR" \
   SHARDPS_PORT=0 SHARDPS_SERVERS=2 SHARDPS_REPLICAS=1 GLOG_minloglevel=0 \
   timeout $((JOB_TIMEOUT + 60)) sbatch --wait --parsable -N 1 -n 5 --time=10 \
     --output="$out" "$ROOT/scripts/slurm/shardps.sbatch" --run-dir "$run_dir" \
     --timeout "$JOB_TIMEOUT" -- --epochs "$EPOCHS" --batch_size 32 --log_every 22) \
  >"$T/jobs/sbatch.out" 2>&1 || sbatch_rc=$?
job=$(grep -m1 -o '^[0-9]\+' "$T/jobs/sbatch.out" || true)
say "sbatch --wait returned $sbatch_rc after $((SECONDS - start)) s: $(tr '\n' ' ' <"$T/jobs/sbatch.out")"
[[ -n $job ]] || fail "sbatch printed no job id"
echo "----- job output ($out) -----"
cat "$out" 2>/dev/null || true
echo "-----"

# --- assertions on the results -------------------------------------------------------------------
line=$(timeout 10 scontrol -o show job "$job" 2>/dev/null || true)
say "scontrol: $(grep -o 'JobId=[0-9]* JobName=[^ ]*' <<<"$line") $(grep -o 'JobState=[A-Z_]* Reason=[^ ]*' <<<"$line") $(grep -o ' ExitCode=[0-9:]*' <<<"$line") $(grep -o 'RunTime=[^ ]*' <<<"$line") $(grep -o 'NodeList=[^ ]*' <<<"$line" | head -n 1)"
job_state=$(grep -o 'JobState=[A-Z_]*' <<<"$line" | cut -d= -f2)
exit_code=$(grep -o ' ExitCode=[0-9:]*' <<<"$line" | head -n 1 | cut -d= -f2)
errors=0
check() {  # check DESCRIPTION CONDITION...
  local what=$1
  shift
  if "$@"; then say "ok: $what"; else echo "slurm_test: FAIL: $what" >&2; errors=$((errors + 1)); fi
}
check "sbatch --wait exited 0 (was $sbatch_rc)" test "$sbatch_rc" -eq 0
check "job state COMPLETED (was ${job_state:-unknown})" test "$job_state" = COMPLETED
check "job exit code 0:0 (was ${exit_code:-unknown})" test "$exit_code" = 0:0
final=$(grep -h '^final:' "$run_dir"/worker-*[0-9].log 2>/dev/null || true)
acc=$(sed -n 's/^final: test accuracy \([0-9.]*\) .*/\1/p' <<<"$final" | head -n 1)
say "trainer: ${final:-no final line}"
check "exactly one final line (rank 0)" test "$(grep -c '^final:' <<<"$final")" -eq 1
check "test accuracy ${acc:-none} >= 0.9" awk -v a="${acc:-0}" 'BEGIN { exit !(a >= 0.9) }'
check "the job's output repeats the final line" grep -q 'shardps.sbatch: final: test accuracy' "$out"
check "coordinator log" test -s "$run_dir/coordinator.log"
for i in 0 1; do check "server-$i log" test -s "$run_dir/server-$i.log"; done
check "no third server log" test ! -e "$run_dir/server-2.log"
for i in 0 1; do
  check "worker-$i log (task $i of the workers' step)" test -s "$run_dir/worker-$i.log"
  # Task i asks for rank i through SLURM_PROCID (the client's rank hint); the coordinator grants it.
  check "worker-$i.log is rank $i's, with its held-out accuracy" \
    grep -q "^\[worker $i/2\] test accuracy [0-9.]* (360 samples)" "$run_dir/worker-$i.log"
  check "server rank $i joined" grep -q "server rank $i: joined" "$run_dir"/server-*.log
done
check "the coordinator saw 2 workers and 2 servers join" \
  test "$(grep -c 'joined as worker rank\|joined as server rank' "$run_dir/coordinator.log")" -eq 4
check "the servers logged the transport choice" grep -q 'transport: auto picked' "$run_dir/server-0.log"

# --- a job whose trainer fails: FAILED at once, its other steps stopped --------------------------
# /bin/false as the trainer: the workers' step fails immediately while the coordinator and the
# servers would wait for workers until the 300 s bound; the script must stop them and fail.
bad_dir="$T/jobs/bad"
bad_out="$T/jobs/bad.out"
start=$SECONDS
bad_rc=0
(cd "$ROOT" && env -u SHARDPS_WORKERS SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA_DIR" \
   SHARDPS_PORT=0 SHARDPS_SERVERS=2 SHARDPS_REPLICAS=1 \
   timeout 200 sbatch --wait --parsable -N 1 -n 5 --time=5 --output="$bad_out" \
     "$ROOT/scripts/slurm/shardps.sbatch" --run-dir "$bad_dir" --timeout 300 --trainer /bin/false) \
  >"$T/jobs/bad-sbatch.out" 2>&1 || bad_rc=$?
bad_s=$((SECONDS - start))
bad_job=$(grep -m1 -o '^[0-9]\+' "$T/jobs/bad-sbatch.out" || true)
bad_line=$(timeout 10 scontrol -o show job "${bad_job:-0}" 2>/dev/null || true)
say "failing job ${bad_job:-?}: sbatch returned $bad_rc after $bad_s s;" \
    "$(grep -o 'RunTime=[^ ]*' <<<"$bad_line")" \
    "$(grep -o 'JobState=[A-Z_]*' <<<"$bad_line") $(grep -o ' ExitCode=[0-9:]*' <<<"$bad_line");" \
    "$(grep -m1 'FAILED:' "$bad_out" 2>/dev/null || echo 'no FAILED line')"
check "failing job: sbatch --wait exited non-zero" test "$bad_rc" -ne 0
check "failing job: state FAILED" grep -q 'JobState=FAILED' <<<"$bad_line"
check "failing job: exit code 1:0" grep -q ' ExitCode=1:0' <<<"$bad_line"
check "failing job: the worker step's failure is the reason" \
  grep -q 'FAILED: the worker step failed' "$bad_out"
# Slurm's RunTime, not sbatch --wait's return (it polls at growing intervals): the servers and the
# coordinator would otherwise have lingered 30 s after the workers, or until the 300 s bound.
bad_run=$(grep -o 'RunTime=[0-9:-]*' <<<"$bad_line" | cut -d= -f2)
bad_run_s=$(awk -F: '/-/ { print 86400; next } { s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; print s }' <<<"${bad_run:-99:99:99}")
check "failing job: ran ${bad_run:-?} (< 20 s: stopped at once, not by a bound)" test "$bad_run_s" -lt 20
check "failing job: no final line" bash -c "! grep -q 'final:' '$bad_out'"

if ((errors)); then
  for f in "$run_dir"/*.log; do
    [[ -e $f ]] && { echo "----- ${f#"$run_dir"/} (last 10 lines) -----" >&2; tail -n 10 "$f" >&2; }
  done
  fail "$errors check(s) failed"
fi
say "PASS: job $job COMPLETED, $final; job $bad_job (trainer /bin/false) FAILED after ${bad_run:-?}"
