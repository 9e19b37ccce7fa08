#!/usr/bin/env bash
# The ps-lite side of the row-table comparison (bench/row_bench.cc is ShardPS's side):
# dmlc ps-lite's key-value ZPull / ZPush of explicit sorted key lists against a KVServer<float>
# that keeps R x D floats, over ps-lite's default van (ZeroMQ tcp on 127.0.0.1), scheduler,
# servers and workers as separate processes on this host. bench/pslite_rows_bench.cc says
# exactly what is measured.
#
#   PSLITE_DIR=/work/pslite bench/pslite_rows.sh [--quick] [--out FILE] [--seconds S]
#                                                [--inflight K] [--layouts 1x1,2x2]
#                                                [--dims 16,64,256] [--ids 1024,...]
#
# Needs: g++, protoc + libprotobuf-dev, libzmq3-dev (Debian 12: apt-get install -y
# libzmq3-dev protobuf-compiler libprotobuf-dev). ps-lite's library: bench/pslite_lib.sh; the
# driver and the run logs go to $WORK_DIR (default: a fresh mktemp -d).
set -euo pipefail

PSLITE_DIR=${PSLITE_DIR:-/work/pslite}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=""
QUICK=0
SECONDS_PER_POINT=1.0
INFLIGHT=1
LAYOUTS="1x1,2x2"
DIMS="16,64,256"
IDS="1024,4096,16384,65536"
DISTS="uniform,zipf"
ROWS=1000000
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --out) OUT=$2; shift ;;
    --seconds) SECONDS_PER_POINT=$2; shift ;;
    --inflight) INFLIGHT=$2; shift ;;
    --layouts) LAYOUTS=$2; shift ;;
    --dims) DIMS=$2; shift ;;
    --ids) IDS=$2; shift ;;
    --rows) ROWS=$2; shift ;;
    *) echo "pslite_rows.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$QUICK" = 1 ]; then
  DIMS=64
  IDS=1024,4096
fi
WORK_DIR=${WORK_DIR:-$(mktemp -d /tmp/pslite-rows.XXXXXX)}
mkdir -p "$WORK_DIR"

# ---- ps-lite's library (once per checkout) and the driver ----------------------------------------
# shellcheck source=pslite_lib.sh
. "$HERE/pslite_lib.sh"
pslite_build_lib
BIN="$WORK_DIR/pslite_rows_bench"
pslite_build_driver "$HERE/pslite_rows_bench.cc" "$BIN"

# ---- the matrix: one ps-lite cluster per (layout, dim) -----------------------------------------
RESULTS="$WORK_DIR/results.jsonl"
: > "$RESULTS"
trap pslite_cleanup EXIT

# One cluster of layout $1, dim $2, logs in $3 (pslite_run_cluster's return codes).
run_cluster() {
  local layout=$1 dim=$2 run=$3
  local S=${layout%x*} W=${layout#*x}
  # Bound per cluster: start-up + per point (4 warm-up batches + the timed second + barriers).
  local npoints=$(( ${#ID_LIST[@]} * 2 * 2 ))
  local limit
  limit=$(awk -v n="$npoints" -v s="$SECONDS_PER_POINT" 'BEGIN { printf "%d", 60 + n * (s + 10) }')
  pslite_run_cluster "$S" "$W" "$limit" "$run" "$BIN" --rows="$ROWS" --dim="$dim" --ids="$IDS" \
    --dists="$DISTS" --seconds="$SECONDS_PER_POINT" --inflight="$INFLIGHT" --layout="$layout" \
    --out="$RESULTS" --run_dir="$run"
}

status=0
IFS=, read -r -a LAYOUT_LIST <<< "$LAYOUTS"
IFS=, read -r -a DIM_LIST <<< "$DIMS"
IFS=, read -r -a ID_LIST <<< "$IDS"
for layout in "${LAYOUT_LIST[@]}"; do
  for dim in "${DIM_LIST[@]}"; do
    for attempt in 1 2 3; do
      run="$WORK_DIR/$layout-d$dim-try$attempt"
      mkdir -p "$run"
      rc=0
      run_cluster "$layout" "$dim" "$run" || rc=$?
      [ "$rc" = 2 ] || break
      echo "ps-lite $layout dim $dim: the scheduler's port was taken; again on another" >&2
    done
    [ "$rc" = 0 ] || status=1
  done
done

if [ -n "$OUT" ]; then
  cp "$RESULTS" "$OUT"
else
  cat "$RESULTS"
fi
# A readable table on stderr.
if command -v jq > /dev/null; then
  jq -r '[.layout, .dist, .op, .dim, .ids, (.rows_per_s|floor), .gbps, (.per_worker_rows_per_s|floor), .batches] | @tsv' \
    "$RESULTS" | sort -k1,1 -k2,2 -k3,3 -k4,4n -k5,5n |
    awk 'BEGIN { printf "%-6s %-8s %-5s %5s %7s %12s %8s %12s %7s\n", "layout", "dist", "op", "dim", "ids", "rows/s", "GB/s", "per_worker", "batches" }
         { printf "%-6s %-8s %-5s %5d %7d %12d %8.3f %12d %7d\n", $1, $2, $3, $4, $5, $6, $7, $8, $9 }' >&2
fi
exit $status
