#!/usr/bin/env bash
# ps-lite's side of the dense push/pull comparison (shardps_bench is ShardPS's side), run by
# scripts/bench.sh in the same run: dmlc ps-lite's ZPush / ZPull of one key per request over its
# default van (ZeroMQ tcp on 127.0.0.1), scheduler, servers and workers as separate processes on
# this host, the same matrix as shardps_bench. bench/pslite_dense_bench.cc says exactly what is
# measured.
#
#   PSLITE_DIR=/work/pslite bench/pslite_dense.sh [--out FILE] [--layouts 1x1,2x2]
#       [--latency-layouts 1x1] [--sizes 4K,64K,1M,4M,16M] [--modes push,pull,push-pull]
#       [--seconds S] [--lat-seconds S] [--reps N]
#
# Needs: g++, protoc + libprotobuf-dev, libzmq3-dev (bench/pslite_lib.sh). The driver and the
# run logs go to $WORK_DIR (default: a fresh mktemp -d). Output: one JSON line per point.
set -euo pipefail

PSLITE_DIR=${PSLITE_DIR:-/work/pslite}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=""
LAYOUTS="1x1,2x2"
LAT_LAYOUTS="1x1"
SIZES="4K,64K,1M,4M,16M"
MODES="push,pull,push-pull"
SECS=1
LAT_SECS=0.5
REPS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift ;;
    --layouts) LAYOUTS=$2; shift ;;
    --latency-layouts) LAT_LAYOUTS=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --modes) MODES=$2; shift ;;
    --seconds) SECS=$2; shift ;;
    --lat-seconds) LAT_SECS=$2; shift ;;
    --reps) REPS=$2; shift ;;
    *) echo "pslite_dense.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
WORK_DIR=${WORK_DIR:-$(mktemp -d /tmp/pslite-dense.XXXXXX)}
mkdir -p "$WORK_DIR"

# shellcheck source=pslite_lib.sh
. "$HERE/pslite_lib.sh"
pslite_build_lib
BIN="$WORK_DIR/pslite_dense_bench"
pslite_build_driver "$HERE/pslite_dense_bench.cc" "$BIN"

RESULTS="$WORK_DIR/results.jsonl"
: > "$RESULTS"
trap pslite_cleanup EXIT
status=0
IFS=, read -r -a LAYOUT_LIST <<< "$LAYOUTS"
IFS=, read -r -a SIZE_LIST <<< "$SIZES"
IFS=, read -r -a MODE_LIST <<< "$MODES"
for layout in "${LAYOUT_LIST[@]}"; do
  series=throughput
  [[ ",$LAT_LAYOUTS," == *",$layout,"* ]] && series=throughput,latency
  nseries=$(( $(tr -cd , <<< "$series" | wc -c) + 1 ))
  # Bound: start-up + per point and repetition (warm-up, window, barriers).
  npoints=$(( ${#SIZE_LIST[@]} * ${#MODE_LIST[@]} * nseries * REPS ))
  limit=$(awk -v n="$npoints" -v s="$SECS" 'BEGIN { printf "%d", 60 + n * (s + 8) }')
  for attempt in 1 2 3; do
    run="$WORK_DIR/$layout-try$attempt"
    mkdir -p "$run"
    rc=0
    pslite_run_cluster "${layout%x*}" "${layout#*x}" "$limit" "$run" "$BIN" --layout="$layout" \
      --sizes="$SIZES" --modes="$MODES" --series="$series" --seconds="$SECS" \
      --lat_seconds="$LAT_SECS" --reps="$REPS" --out="$RESULTS" --run_dir="$run" || rc=$?
    [ "$rc" = 2 ] || break
    echo "ps-lite $layout: the scheduler's port was taken; again on another" >&2
  done
  [ "$rc" = 0 ] || status=1
done
if [ -n "$OUT" ]; then cp "$RESULTS" "$OUT"; else cat "$RESULTS"; fi
exit $status
