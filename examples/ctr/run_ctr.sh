#!/usr/bin/env bash
# The CTR example end to end: trains the same model on the same data twice --
#   local:   one process, torch.nn.Embedding(sparse=True) + torch Adagrad/Adam, whole global
#            batch per step;
#   cluster: python -m shardps.run, 2 servers holding the table (shardps.torch.Embedding, the
#            servers apply Adagrad to the rows and Adam to the MLP), 4 workers each taking a
#            quarter of every global batch, BSP, tcp --
# then prints both test AUCs, the best achievable AUC (the true probabilities') and their
# difference, and fails unless |AUC_cluster - AUC_local| < 0.005.
#
# usage: examples/ctr/run_ctr.sh [--small] [--build DIR] [-- EXTRA ctr_train.py FLAGS...]
#   --small (or CTR_SMALL=1): the CI version, 50,000 rows x 16, 800 steps of 1024 (about a
#            minute on 2 cores); default: the full version, 1,000,000 rows x 64.
#   --build DIR (or SHARDPS_BUILD_DIR): the build (default: the repository's build/);
#            PYTHONPATH is set to its python/ directory
# environment:
#   SHARDPS_PYTHON     the interpreter (default /usr/bin/python3: Debian's torch, numpy, sklearn)
#   CTR_SERVERS, CTR_WORKERS  cluster size (default 2 and 4)
#   CTR_TIMEOUT        seconds allowed per mode (default 300 small, 900 full)
#   CTR_KEEP=1         keep the temporary directory (logs, JSON results) and print its path
#   CTR_RESULTS=FILE   also write a JSON summary of both runs here
# exit status: 0 the two runs agree; 1 they differ by >= 0.005 or a run failed; 2 usage;
# 77 (ctest's SKIP) when the interpreter cannot import torch and the built shardps.torch.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${SHARDPS_BUILD_DIR:-$ROOT/build}
PY=${SHARDPS_PYTHON:-/usr/bin/python3}
SMALL=${CTR_SMALL:-0}
EXTRA=()
while (($#)); do
  case $1 in
    --small) SMALL=1 ;;
    --full) SMALL=0 ;;
    --build) BUILD=${2:?--build needs a directory}; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_ctr.sh: unknown argument '$1' (ctr_train.py flags go after --)" >&2; exit 2 ;;
  esac
  shift
done
[[ -d $BUILD/python/shardps ]] || {
  echo "run_ctr.sh: no shardps package in $BUILD/python (build first, or set SHARDPS_BUILD_DIR)" >&2
  exit 1; }
BUILD=$(cd "$BUILD" && pwd)
export SHARDPS_BUILD_DIR=$BUILD
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=${GLOG_minloglevel:-1}
if ! "$PY" -c 'import numpy, torch, shardps.torch' 2>/dev/null; then
  echo "SKIP: $PY cannot import numpy, torch and shardps.torch (PYTHONPATH=$PYTHONPATH)"
  exit 77
fi
SERVERS=${CTR_SERVERS:-2}
WORKERS=${CTR_WORKERS:-4}
BOUND=0.005

if ((SMALL)); then
  ARGS=(--rows 50000 --dim 16 --steps 800 --global-batch 1024 --emb-lr 0.05 --n-test 20000
        --eval-every 200 --log-every 100)
  TIMEOUT=${CTR_TIMEOUT:-300}
  SIZE=small
else
  ARGS=(--rows 1000000 --dim 64 --steps 1500 --global-batch 4096 --emb-lr 0.03
        --n-test 100000 --eval-every 250 --log-every 50)
  TIMEOUT=${CTR_TIMEOUT:-900}
  SIZE=full
fi
ARGS+=("${EXTRA[@]}")

TMP=$(mktemp -d "${TMPDIR:-/tmp}/shardps-ctr.XXXXXX")
cleanup() {
  if [[ ${CTR_KEEP:-0} == 1 ]]; then echo "run_ctr.sh: kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Samples VmHWM (peak resident memory) of every process under $1 each second, until it ends:
# lines "pid role kB", role: server, coordinator, trainer (ctr_train.py) or other.
descendants() {
  ps -eo pid=,ppid= | awk -v root="$1" '{ parent[$1] = $2 }
    END { for (p in parent) { q = p; n = 0
            while ((q in parent) && q != root && n++ < 64) q = parent[q]
            if (q == root) print p } }'
}
monitor() {
  local root=$1 out=$2 p role cmd hwm
  while kill -0 "$root" 2>/dev/null; do
    for p in $(descendants "$root"); do
      cmd=$( { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null) || continue
      case $cmd in
        timeout\ *) role=other ;;
        *\ -m\ shardps.run\ *) role=launcher ;;
        */shardps_server\ *) role=server ;;
        */shardps_coordinator\ *) role=coordinator ;;
        *ctr_train.py*) role=trainer ;;
        *) role=other ;;
      esac
      hwm=$( { awk '/^VmHWM/ { print $2 }' <"/proc/$p/status"; } 2>/dev/null) || continue
      [[ -n $hwm ]] && echo "$p $role $hwm"
    done
    sleep 1
  done >"$out"
}
peaks() {  # the peak MiB of each process of role $2 in monitor file $1, space-separated
  awk -v want="$2" '$2 == want { if ($3 > m[$1]) m[$1] = $3 }
    END { s = ""; for (p in m) s = s sprintf("%s%.0f", (s == "" ? "" : " "), m[p] / 1024)
          print s }' "$1"
}

# run NAME CMD...: runs CMD under the memory monitor, its output on the console and in
# $TMP/NAME.log; sets RC and SECS.
run() {
  local name=$1 t0 t1 mon
  shift
  t0=$(date +%s.%N)
  "$@" > >(tee "$TMP/$name.log") 2>&1 &
  local pid=$!
  monitor "$pid" "$TMP/$name.mem" &
  mon=$!
  wait "$pid"
  RC=$?
  wait "$mon" 2>/dev/null
  t1=$(date +%s.%N)
  SECS=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
}

echo "=== CTR example ($SIZE): ctr_train.py ${ARGS[*]}"
echo "=== [1/2] local: one process"
run local timeout "$TIMEOUT" "$PY" "$HERE/ctr_train.py" --mode local "${ARGS[@]}" \
  --out "$TMP/local.json"
LOCAL_RC=$RC LOCAL_SECS=$SECS
if ((LOCAL_RC != 0)); then
  echo "run_ctr.sh: FAIL: the local run exited with $LOCAL_RC$( ((LOCAL_RC == 124)) &&
    echo " (timed out after $TIMEOUT s)")"
  exit 1
fi

echo "=== [2/2] cluster: $SERVERS servers, $WORKERS workers, BSP, tcp (python -m shardps.run)"
run cluster timeout $((TIMEOUT + 60)) "$PY" -m shardps.run --servers "$SERVERS" \
  --workers "$WORKERS" --consistency bsp --transport tcp --timeout "$TIMEOUT" \
  --run-dir "$TMP/cluster" -- "$PY" "$HERE/ctr_train.py" --mode shardps "${ARGS[@]}" \
  --out "$TMP/cluster.json"
CLUSTER_RC=$RC CLUSTER_SECS=$SECS
if ((CLUSTER_RC != 0)) || [[ ! -s $TMP/cluster.json ]]; then
  echo "run_ctr.sh: FAIL: the cluster run exited with $CLUSTER_RC$( ((CLUSTER_RC == 124)) &&
    echo " (timed out after $TIMEOUT s)")"
  for f in "$TMP"/cluster/*.log; do
    [[ -f $f ]] || continue
    echo "--- last lines of $(basename "$f"):"
    tail -n 15 "$f"
  done
  exit 1
fi

SERVER_MIB=$(peaks "$TMP/cluster.mem" server)
WORKER_MIB=$(peaks "$TMP/cluster.mem" trainer)
LOCAL_MIB=$(peaks "$TMP/local.mem" trainer)

"$PY" - "$TMP/local.json" "$TMP/cluster.json" "$BOUND" "$SIZE" "$SERVERS" "$WORKERS" \
  "$LOCAL_SECS" "$CLUSTER_SECS" "$LOCAL_MIB" "$WORKER_MIB" "$SERVER_MIB" \
  "${CTR_RESULTS:-}" <<'EOF'
import json, sys
(local_f, cluster_f, bound, size, servers, workers, local_s, cluster_s, local_mib, worker_mib,
 server_mib, results) = sys.argv[1:13]
lo, cl = json.load(open(local_f)), json.load(open(cluster_f))
bound = float(bound)
diff = cl["final_test_auc"] - lo["final_test_auc"]
mib = lambda s: [int(x) for x in s.split()]
print(f"=== results ({size}: {lo['rows']:,} rows x {lo['dim']}, {lo['steps']} steps of "
      f"{lo['global_batch']}, {lo['steps'] * lo['global_batch']:,} training samples)")
print(f"  best achievable test AUC (true probabilities): {lo['best_auc']:.4f}")
print(f"  local   (1 process)                 test AUC {lo['final_test_auc']:.4f}  "
      f"train {lo['train_seconds']:7.1f} s  {lo['samples_per_s']:>9,.0f} samples/s  "
      f"wall {float(local_s):6.1f} s  peak RSS {local_mib} MiB")
print(f"  cluster ({servers} servers, {workers} workers) test AUC {cl['final_test_auc']:.4f}  "
      f"train {cl['train_seconds']:7.1f} s  {cl['samples_per_s']:>9,.0f} samples/s  "
      f"wall {float(cluster_s):6.1f} s")
print(f"    peak RSS: servers {server_mib} MiB; workers {worker_mib} MiB")
print(f"  AUC cluster - local: {diff:+.5f} (bound: |diff| < {bound})")
print("  eval history (step: local / cluster AUC): " + ", ".join(
    f"{a['step']}: {a['test_auc']:.4f}/{b['test_auc']:.4f}"
    for a, b in zip(lo["history"], cl["history"])))
ok = abs(diff) < bound
if results:
    with open(results, "w") as f:
        json.dump({"size": size, "servers": int(servers), "workers": int(workers),
                   "local": lo, "cluster": cl, "auc_difference": diff, "pass": ok,
                   "local_wall_seconds": float(local_s), "cluster_wall_seconds": float(cluster_s),
                   "local_peak_rss_mib": mib(local_mib), "worker_peak_rss_mib": mib(worker_mib),
                   "server_peak_rss_mib": mib(server_mib)}, f, indent=1)
print("run_ctr.sh: " + ("PASS" if ok else "FAIL") +
      f": |AUC_cluster - AUC_local| = {abs(diff):.5f} {'<' if ok else '>='} {bound}")
sys.exit(0 if ok else 1)
EOF
