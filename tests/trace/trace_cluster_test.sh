#!/usr/bin/env bash
# A local cluster with tracing on in every process (coordinator, 2 servers, 2 workers over tcp,
# BSP, chunks of 512 bytes), merged by tools/shardps_trace_merge.py, then checked on the data
# (tests/trace/check_trace.py): every worker has a step span for each step and, inside it, push
# and pull spans for every chunk; every server apply of (worker, chunk, clock) starts after that
# worker's push of (chunk, clock) started, on the merged clock; the merged file is JSON.
# Skips (77) without python3. Every process is killed on exit; every wait is bounded.
#
# usage: trace_cluster_test.sh COORDINATOR_BIN SERVER_BIN PS_TEST_WORKER_BIN MERGE_PY [KEEP_DIR]
set -euo pipefail
(($# >= 4)) || { echo "usage: $0 COORDINATOR_BIN SERVER_BIN PS_TEST_WORKER_BIN MERGE_PY" >&2; exit 2; }
COORD_BIN=$1 SERVER_BIN=$2 WORKER_BIN=$3 MERGE=$4 KEEP=${5:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "SKIP: no python3"; exit 77; }
readonly WORKERS=2 SERVERS=2 STEPS=12 BOUND_S=90

TMP=$(mktemp -d /tmp/shardps-trace-XXXXXX)
PIDS=()
cleanup() {
  local rc=$? p
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.3
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  if ((rc != 0)); then
    for f in "$TMP"/*.log; do echo "----- $(basename "$f")"; tail -n 20 "$f"; done
  fi
  [[ -n $KEEP ]] && { mkdir -p "$KEEP"; cp -r "$TMP"/. "$KEEP"/; }
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }

export SHARDPS_CLUSTER_TOKEN=trace-test-token
mkdir -p "$TMP/trace"
"$COORD_BIN" --listen=127.0.0.1:0 --address_file="$TMP/coordinator.addr" --consistency=bsp \
  --num_servers=$SERVERS --num_workers=$WORKERS --data_transport=tcp --partition_bytes=512 \
  --exit_when_done --trace_file="$TMP/trace/coordinator.json" >"$TMP/coordinator.log" 2>&1 &
COORD_PID=$!
PIDS+=($COORD_PID)
for _ in $(seq 200); do
  [[ -s $TMP/coordinator.addr ]] && break
  kill -0 $COORD_PID 2>/dev/null || fail "the coordinator exited"
  sleep 0.1
done
[[ -s $TMP/coordinator.addr ]] || fail "the coordinator did not listen within 20 s"
ADDR=$(head -n1 "$TMP/coordinator.addr")
SERVER_PIDS=()
for i in $(seq 0 $((SERVERS - 1))); do
  "$SERVER_BIN" --coordinator="$ADDR" --transport=tcp --bind_ip=127.0.0.1 --lr=0.1 \
    --exit_when_done --trace_file="$TMP/trace/server-{rank}.json" >"$TMP/server$i.log" 2>&1 &
  PIDS+=($!)
  SERVER_PIDS+=($!)
done
WORKER_PIDS=()
for r in $(seq 0 $((WORKERS - 1))); do
  # The worker gets its trace file from the environment (no code change: SHARDPS_TRACE_FILE).
  SHARDPS_TRACE_FILE="$TMP/trace/worker-%r.json" timeout -s KILL $BOUND_S "$WORKER_BIN" \
    --coordinator="$ADDR" --transport=tcp --bind_ip=127.0.0.1 --rank="$r" --workers=$WORKERS \
    --steps=$STEPS --lr=0.1 --out="$TMP/worker$r.out" >"$TMP/worker$r.log" 2>&1 &
  PIDS+=($!)
  WORKER_PIDS+=($!)
done
for p in "${WORKER_PIDS[@]}"; do wait "$p" || fail "a worker failed (exit $?)"; done
# The servers leave by themselves once every worker has left (--exit_when_done); the
# coordinator is stopped with SIGTERM (its --exit_when_done needs to have seen every worker at
# once, which a job this short may never show it). A clean stop writes each trace file whole.
stop() {  # stop PID WHAT SECONDS: wait for PID to exit (SIGTERM first if SECONDS is 0)
  local p=$1 what=$2 n=$(($3 * 10)) rc=0
  ((n > 0)) || { kill -TERM "$p" 2>/dev/null || true; n=100; }
  for _ in $(seq $n); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$p" 2>/dev/null && fail "$what (pid $p) did not exit"
  wait "$p" || rc=$?
  ((rc == 0)) || fail "$what (pid $p) exited with $rc"
}
for i in "${!SERVER_PIDS[@]}"; do stop "${SERVER_PIDS[i]}" "server $i" 30; done
stop $COORD_PID coordinator 0

ls "$TMP/trace"
n=$(ls "$TMP/trace" | wc -l)
((n == 1 + SERVERS + WORKERS)) || fail "expected $((1 + SERVERS + WORKERS)) trace files, found $n"
"$PY" "$MERGE" -o "$TMP/merged.json" "$TMP/trace" || fail "merge"
"$PY" "$MERGE" --summary "$TMP/trace" | tee "$TMP/summary.txt" || fail "summary"
"$PY" "$HERE/check_trace.py" "$TMP/merged.json" --workers $WORKERS --servers $SERVERS \
  --steps $STEPS --summary "$TMP/summary.txt"
# A file cut short (its process killed during a write): the merge keeps the whole event lines
# before the cut, with the anchor from the header line, and says so.
f=$(ls "$TMP"/trace/worker-0-*.json)
size=$(stat -c %s "$f")
mkdir "$TMP/cut"
head -c $((size * 2 / 3)) "$f" >"$TMP/cut/worker-0.json"
"$PY" "$MERGE" -o "$TMP/cut.json" "$TMP/cut" 2>"$TMP/cut.err" || fail "merge of a cut file"
grep -q "cut short" "$TMP/cut.err" || fail "the merge did not report the cut file"
"$PY" - "$f" "$TMP/cut.json" <<'PYEOF' || fail "the cut file's events"
import json, sys
whole = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"] != "M"]
cut = json.load(open(sys.argv[2]))
kept = [e for e in cut["traceEvents"] if e["ph"] != "M"]
assert cut["shardps_merge"]["processes"][0]["repaired"], "not marked repaired"
assert len(whole) / 2 < len(kept) < len(whole), (len(kept), len(whole))
names = sorted({e["name"] for e in kept})
assert names == ["pull", "push", "step", "wait"], names
print("cut file: %d of %d events kept" % (len(kept), len(whole)))
PYEOF
echo "PASS"
