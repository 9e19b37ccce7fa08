#!/usr/bin/env bash
# Parameter-server benchmark matrix: builds shardps_bench (and the servers, coordinator and
# digits_trainer), then
#   1. host: shardps_bench over tcp and shm, layouts 1x1 and 2x2, push / pull / push-pull,
#      4 KiB .. 16 MiB, throughput (40 keys per server per round) and latency (one in flight)
#      series, each point interleaved with its bound (raw TCP socket pairs, memcpy);
#   2. verbs (unless --no-verbs, and only where the SoftRoCE harness exists): boots the guest once,
#      runs perftest ib_write_bw / ib_read_bw / *_lat between rxe0 and rxe1 and then
#      shardps_bench --transports=verbs with those figures as bounds (a reduced matrix: the guest
#      runs under TCG at tens of MB/s);
#   2b. ps-lite (unless --no-pslite, and only with a ps-lite checkout at $PSLITE_DIR, default
#      ../pslite): bench/pslite_dense.sh runs dmlc ps-lite's push/pull over the same matrix in
#      this run, so that every ps-lite column compares figures of the same run (none from
#      another day);
#   3. training: examples/digits_trainer on a local cluster (1 server, BSP = synchronous SGD,
#      --optimizer sgd) with 1, 2 and 4 workers over tcp: step time and samples/s;
#   4. row tables (embeddings): scripts/bench-rows.sh (shardps_row_bench next to its bound and,
#      with a ps-lite checkout, ps-lite's key-value pull/push of the same batches);
#   5. bench/results/ps-<stamp>.json, docs/benchmarks.md (generated part) and docs/benchmarks.png.
# Targets are reported, not enforced (--enforce: exit 3 when one is missed).
#
# usage: scripts/bench.sh [--quick] [--no-verbs] [--no-training] [--no-rows] [--no-pslite] [--enforce]
#                         [-- shardps_bench args]
#   --quick   reps=1 and shorter points (a fast look, not for the committed figures)
# Env: SHARDPS_BENCH_BUILD_DIR (default build), SOFTROCE_DIR, BENCH_GUEST_TIMEOUT (default 600),
#      PSLITE_DIR (default ../pslite: a dmlc/ps-lite checkout; bench/pslite_lib.sh builds it).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${SHARDPS_BENCH_BUILD_DIR:-build}
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"
SOFTROCE=${SOFTROCE_DIR:-$ROOT/../shared/softroce}
PY=/usr/bin/python3
REPORT="$ROOT/bench/ps_report.py"
VERBS=1 TRAIN=1 QUICK=0 ENFORCE=0 ROWS=1 PSLITE=1
PSLITE_DIR=${PSLITE_DIR:-$ROOT/../pslite}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-verbs) VERBS=0; shift ;;
    --no-training) TRAIN=0; shift ;;
    --no-rows) ROWS=0; shift ;;
    --no-pslite) PSLITE=0; shift ;;
    --quick) QUICK=1; shift ;;
    --enforce) ENFORCE=1; shift ;;
    --) shift; break ;;
    *) echo "bench.sh: unknown option $1 (see the header)" >&2; exit 2 ;;
  esac
done
EXTRA=("$@")

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK="$ROOT/bench/results/work-$STAMP"
mkdir -p "$WORK"
BIN="$BUILD/bench/shardps_bench"

echo "=== build ($BUILD) ==="
SHARDPS_BUILD_DIR="$BUILD" SHARDPS_BUILD_TARGETS="shardps_bench shardps_server shardps_coordinator_bin digits_trainer" \
  "$ROOT/scripts/build.sh" > "$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log" >&2; echo "bench.sh: build failed" >&2; exit 1; }

if [[ $QUICK == 1 ]]; then
  ARGS=(--reps=1 --seconds=0.4 --lat_seconds=0.2)
else
  ARGS=(--reps=3 --seconds=1 --lat_seconds=0.5)
fi

RUNS=()
echo "=== host: tcp and shm (nproc $(nproc), kernel $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)) ==="
"$BIN" --transports=tcp,shm --layouts=1x1,2x2 "${ARGS[@]}" --json="$WORK/host.json" \
  --work_dir="$WORK/clusters" --label="host $(hostname), loopback" "${EXTRA[@]}" \
  2> "$WORK/host.log" | tee "$WORK/host.out"
rc=${PIPESTATUS[0]}
[[ $rc -eq 0 ]] || { tail -30 "$WORK/host.log" >&2; echo "bench.sh: host run: rc $rc" >&2; }
[[ -s "$WORK/host.json" ]] && RUNS+=("$WORK/host.json")

if [[ $PSLITE == 1 && -f "$PSLITE_DIR/include/ps/ps.h" ]]; then
  echo "=== ps-lite (dmlc, ZeroMQ tcp), same matrix, this run: bench/pslite_dense.sh ==="
  if [[ $QUICK == 1 ]]; then PARGS=(--reps 1 --seconds 0.4 --lat-seconds 0.2); else PARGS=(--reps 3); fi
  PSLITE_DIR="$PSLITE_DIR" WORK_DIR="$WORK/pslite" "$ROOT/bench/pslite_dense.sh" "${PARGS[@]}" \
    --out "$WORK/pslite-dense.jsonl" > "$WORK/pslite.out" 2> "$WORK/pslite.log" ||
    { tail -20 "$WORK/pslite.log" >&2; echo "bench.sh: the ps-lite run failed (partial rows kept)" >&2; }
  [[ -s "$WORK/pslite-dense.jsonl" ]] && RUNS+=("$WORK/pslite-dense.jsonl")
  echo "  $(wc -l < "$WORK/pslite-dense.jsonl" 2>/dev/null || echo 0) ps-lite points"
elif [[ $PSLITE == 1 ]]; then
  echo "=== ps-lite: not run (no checkout at $PSLITE_DIR; set PSLITE_DIR); no ps-lite columns ==="
fi

if [[ $VERBS == 1 && -x "$SOFTROCE/run-in-guest.sh" ]]; then
  echo "=== SoftRoCE guest: perftest + shardps_bench --transports=verbs (one boot) ==="
  cat > "$WORK/guest.sh" <<EOF
#!/bin/sh
W='$WORK'
'$SOFTROCE/softroce-up.sh' 2 > "\$W/softroce-up.log" 2>&1 || { cat "\$W/softroce-up.log"; exit 1; }
mkdir -p "\$W/perftest"
port=18515
perftest() { tool=\$1; log=\$2; shift 2; port=\$((port + 1))
  \$tool -d rxe1 -x 1 -p \$port -F "\$@" > "\$log.server" 2>&1 &
  spid=\$!
  sleep 1
  timeout 60 \$tool -d rxe0 -x 1 -p \$port -F "\$@" 192.168.77.2 > "\$log" 2>&1
  ( sleep 10; kill \$spid 2>/dev/null ) & killer=\$!
  wait \$spid 2>/dev/null; kill \$killer 2>/dev/null
  echo "  \$tool \$* : \$(grep -E '^ *[0-9]+ +[0-9]+' "\$log" | tail -1)"
}
for op in write read; do
  for n in 8 4096; do perftest ib_\${op}_lat "\$W/perftest/lat_\${op}_\${n}.log" -s \$n -n 300; done
  for n in 4096 65536 1048576; do
    if [ \$n -lt 1048576 ]; then len="-D 1"; else len="-n 16"; fi
    perftest ib_\${op}_bw "\$W/perftest/bw_\${op}_\${n}.log" -s \$n \$len -t 4 --report_gbits
  done
done
/usr/bin/python3 '$ROOT/bench/bench_report.py' perftest-bounds "\$W/perftest" "\$W/verbs-bounds.txt"
'$BIN' --transports=verbs --layouts=1x1 --sizes=4K,64K,1M --keys_per_server=4 --reps=1 \\
  --seconds=1 --lat_seconds=0.5 --min_rounds=2 --server_bind_ip=192.168.77.2 \\
  --worker_bind_ip=192.168.77.1 --bounds_file="\$W/verbs-bounds.txt" --json="\$W/verbs.json" \\
  --work_dir="\$W/verbs-clusters" --label="SoftRoCE guest (qemu TCG), rxe0 -> rxe1 over veth" \\
  2> "\$W/verbs.log"
EOF
  chmod +x "$WORK/guest.sh"
  if "$SOFTROCE/build-guest.sh" > "$WORK/build-guest.log" 2>&1; then
    "$SOFTROCE/run-in-guest.sh" --timeout "${BENCH_GUEST_TIMEOUT:-600}" --rw "$WORK" -- "$WORK/guest.sh"
    echo "guest: rc $?"
    [[ -s "$WORK/verbs.json" ]] && RUNS+=("$WORK/verbs.json")
  else
    tail -20 "$WORK/build-guest.log" >&2
    echo "bench.sh: building the SoftRoCE guest failed; verbs not measured" >&2
  fi
elif [[ $VERBS == 1 ]]; then
  echo "=== verbs: not run (no SoftRoCE harness at $SOFTROCE; set SOFTROCE_DIR) ==="
fi

TRAIN_JSON=""
if [[ $TRAIN == 1 ]]; then
  echo "=== training: digits_trainer, 1 server, BSP (sync SGD), tcp, 1 / 2 / 4 workers ==="
  DATA="$BUILD/data"
  if [[ ! -s $DATA/digits_train.bin ]]; then
    timeout 120 "$PY" "$ROOT/scripts/export_digits.py" --out "$DATA" > "$WORK/export.log" 2>&1 ||
      echo "bench.sh: exporting the digits data failed (python3-sklearn?)" >&2
  fi
  LOGS=()
  for w in 1 2 4; do
    SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA" timeout 300 \
      "$ROOT/scripts/launch-local.sh" --servers 1 --workers "$w" --transport tcp \
      --consistency bsp --optimizer sgd --lr 0.1 --timeout 240 --run-dir "$WORK/train-$w" \
      --quiet -- --epochs "$([[ $QUICK == 1 ]] && echo 1 || echo 5)" --batch_size 32 --seed 7 \
      --log_every 0 > "$WORK/train-$w.log" 2>&1
    echo "  $w worker(s): $(grep -o 'final: .*' "$WORK/train-$w.log" || echo "failed (see $WORK/train-$w)")"
    LOGS+=("$WORK/train-$w.log")
  done
  TRAIN_JSON="$WORK/training.json"
  $PY "$REPORT" training "$TRAIN_JSON" "${LOGS[@]}"
fi

if [[ $ROWS == 1 ]]; then
  echo "=== row tables: scripts/bench-rows.sh ==="
  SHARDPS_BENCH_BUILD_DIR="$BUILD" "$ROOT/scripts/bench-rows.sh" $([[ $QUICK == 1 ]] && echo --quick) ||
    echo "bench.sh: the row-table benchmark failed" >&2
fi

if [[ ${#RUNS[@]} -eq 0 ]]; then
  echo "bench.sh: nothing was measured" >&2
  exit 1
fi
RESULT="$ROOT/bench/results/ps-$STAMP.json"
$PY "$REPORT" merge "$RESULT" "${RUNS[@]}" || exit 1
[[ -n $TRAIN_JSON ]] && cp "$TRAIN_JSON" "$ROOT/bench/results/training-$STAMP.json" &&
  TRAIN_JSON="$ROOT/bench/results/training-$STAMP.json"
$PY "$REPORT" plot "$RESULT" "$ROOT/docs/benchmarks.png" || echo "bench.sh: plot failed" >&2
$PY "$REPORT" markdown "$RESULT" "${TRAIN_JSON:-none}" "$ROOT/docs/benchmarks.md" \
  "$ROOT/docs/benchmarks.png" || exit 1
echo "=== targets — $RESULT ==="
$PY "$REPORT" summary "$RESULT"
src=$?
[[ $ENFORCE == 1 ]] && exit $src
exit 0
