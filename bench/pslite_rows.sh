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
# libzmq3-dev protobuf-compiler libprotobuf-dev). Nothing is built in ShardPS's build tree:
# ps-lite's library goes to $PSLITE_DIR/build-sys (its own sources, compiled directly with g++
# against the system protobuf and ZeroMQ; ps-lite's Makefile would download its own), the
# driver and the run logs to $WORK_DIR (default: a fresh mktemp -d).
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

# ---- ps-lite's library (once per checkout) -----------------------------------------------------
[ -f "$PSLITE_DIR/include/ps/ps.h" ] || { echo "no ps-lite checkout at $PSLITE_DIR" >&2; exit 1; }
LIB="$PSLITE_DIR/build-sys"
if [ ! -f "$LIB/libps.a" ]; then
  echo "building ps-lite ($(git -C "$PSLITE_DIR" rev-parse HEAD 2>/dev/null || echo '?')) in $LIB" >&2
  mkdir -p "$LIB/gen"
  protoc --cpp_out="$LIB/gen" --proto_path="$PSLITE_DIR/src" "$PSLITE_DIR/src/meta.proto"
  for f in customer postoffice van; do
    g++ -std=c++14 -O3 -fPIC -pthread -w -I"$PSLITE_DIR/include" -I"$PSLITE_DIR/src" \
      -I"$LIB/gen" -c "$PSLITE_DIR/src/$f.cc" -o "$LIB/$f.o"
  done
  g++ -std=c++14 -O3 -fPIC -w -I"$LIB/gen" -c "$LIB/gen/meta.pb.cc" -o "$LIB/meta.pb.o"
  rm -f "$LIB/libps.a.tmp"
  ar crs "$LIB/libps.a.tmp" "$LIB"/customer.o "$LIB"/postoffice.o "$LIB"/van.o "$LIB"/meta.pb.o
  mv "$LIB/libps.a.tmp" "$LIB/libps.a"
fi

# ---- the driver ---------------------------------------------------------------------------------
BIN="$WORK_DIR/pslite_rows_bench"
g++ -std=c++14 -O3 -pthread -w -I"$PSLITE_DIR/include" -I"$LIB/gen" \
  "$HERE/pslite_rows_bench.cc" "$LIB/libps.a" -lprotobuf -lzmq -o "$BIN"

# ---- the matrix: one ps-lite cluster per (layout, dim) -----------------------------------------
RESULTS="$WORK_DIR/results.jsonl"
: > "$RESULTS"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

free_port() {  # a port nothing listens on, below Linux's ephemeral range (32768-60999 here)
  local p
  while :; do
    p=$((10000 + RANDOM % 22000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
}

# One cluster: scheduler + $S servers + $W workers of layout $1, dim $2, logs in $3.
# Returns 0, 1 (a process failed or timed out), or 2 (the scheduler could not bind its port).
run_cluster() {
  local layout=$1 dim=$2 run=$3
  local S=${layout%x*} W=${layout#*x}
  # Bound per cluster: start-up + per point (4 warm-up batches + the timed second + barriers).
  local npoints=$(( ${#ID_LIST[@]} * 2 * 2 ))
  local limit
  limit=$(awk -v n="$npoints" -v s="$SECONDS_PER_POINT" 'BEGIN { printf "%d", 60 + n * (s + 10) }')
  export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=$(free_port) DMLC_NODE_HOST=127.0.0.1
  export DMLC_NUM_SERVER=$S DMLC_NUM_WORKER=$W
  local args=(--rows="$ROWS" --dim="$dim" --ids="$IDS" --dists="$DISTS"
              --seconds="$SECONDS_PER_POINT" --inflight="$INFLIGHT" --layout="$layout"
              --out="$RESULTS" --run_dir="$run")
  PIDS=()
  DMLC_ROLE=scheduler timeout "$limit" "$BIN" "${args[@]}" > "$run/scheduler.log" 2>&1 &
  PIDS+=($!)
  local i
  for ((i = 0; i < S; ++i)); do
    DMLC_ROLE=server timeout "$limit" "$BIN" "${args[@]}" > "$run/server$i.log" 2>&1 &
    PIDS+=($!)
  done
  for ((i = 0; i < W; ++i)); do
    DMLC_ROLE=worker timeout "$limit" "$BIN" "${args[@]}" > "$run/worker$i.log" 2>&1 &
    PIDS+=($!)
  done
  echo "ps-lite $layout dim $dim: scheduler + $S server(s) + $W worker(s), port $DMLC_PS_ROOT_PORT," \
       "logs in $run; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  # Wait for all; the first to fail (crash or timeout) takes the others down with it, since
  # ps-lite's peers would otherwise wait for it until their own timeout.
  local failed=0 live=("${PIDS[@]}") rest rc done_pid p
  while [ "${#live[@]}" -gt 0 ]; do
    rc=0
    done_pid=""
    wait -n -p done_pid "${live[@]}" || rc=$?
    [ -n "$done_pid" ] || break  # nothing left to wait for
    rest=()
    for p in "${live[@]}"; do [ "$p" != "$done_pid" ] && rest+=("$p"); done
    live=("${rest[@]+"${rest[@]}"}")
    if [ "$rc" != 0 ] && [ "$failed" = 0 ]; then
      failed=1
      sleep 1
      for p in "${live[@]+"${live[@]}"}"; do kill "$p" 2>/dev/null || true; done
    fi
  done
  PIDS=()
  if [ "$failed" = 0 ]; then return 0; fi
  if grep -q "bind failed" "$run/scheduler.log"; then return 2; fi
  echo "ps-lite $layout dim $dim: a process failed or timed out (limit ${limit}s); logs:" >&2
  tail -n 5 "$run"/*.log >&2 || true
  return 1
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
