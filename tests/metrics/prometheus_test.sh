#!/usr/bin/env bash
# ctest metrics.prometheus: a real Prometheus scrapes a live local cluster.
#   1. scripts/launch-local.sh starts 1 coordinator, 2 shard servers and 2 digits_trainer
#      workers (tcp, BSP), every one with /metrics on a free loopback port: the daemons through
#      --metrics_port=-1 --metrics_address_file, the workers through SHARDPS_METRICS_PORT=-1
#      SHARDPS_METRICS_ADDRESS_FILE (the client library's one environment hook);
#   2. Debian's prometheus scrapes all five every second (generated config, storage in a temp
#      dir, its web API on 127.0.0.1 and a free port);
#   3. passes once Prometheus' query API reports, within a bound: shardps_server_pushes_applied
#      > 0 for every server target, shardps_client_pushes > 0 for every worker target, and the
#      coordinator's member gauges (2 servers, 2 workers); and `promtool check metrics` finds no
#      problem in a scrape of each endpoint.
# Exits 77 (ctest SKIP) with the reason only if prometheus/promtool are absent and cannot be
# installed, prometheus cannot be started, or python3-sklearn (the digits data) is missing.
# Everything started here is killed on exit.
# usage: prometheus_test.sh BUILD_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=$(cd "${1:?usage: prometheus_test.sh BUILD_DIR}" && pwd)
PY=${SHARDPS_PYTHON:-/usr/bin/python3}
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; show; exit 1; }

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  # scripts/deps.sh lists it; try to install it here (root and Debian's apt only).
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "prometheus: not installed; trying apt-get install prometheus"
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends \
      prometheus >/dev/null 2>&1 || true
  fi
  command -v prometheus >/dev/null && command -v promtool >/dev/null ||
    skip "prometheus/promtool are not installed and could not be installed (scripts/deps.sh)"
fi
"$PY" -c 'import sklearn' 2>/dev/null ||
  skip "scikit-learn is not importable by $PY (the digits data; install python3-sklearn)"
DATA="$BUILD/data"
[[ -s $DATA/digits_test.bin && -s $DATA/digits_train.bin ]] ||
  timeout 60 "$PY" "$ROOT/scripts/export_digits.py" --out "$DATA" >/dev/null

T=$(mktemp -d "$BUILD/metrics_prom.XXXXXX")
cluster_pid="" prom_pid=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  echo "($SECONDS s)"
  # launch-local runs in its own session: TERM lets its trap stop its processes; KILL the
  # group after a bound whatever is left.
  [[ -z $prom_pid ]] || kill -TERM "$prom_pid" 2>/dev/null || true
  [[ -z $cluster_pid ]] || kill -TERM -- "-$cluster_pid" 2>/dev/null || true
  for _ in $(seq 50); do
    { [[ -n $cluster_pid ]] && kill -0 -- "-$cluster_pid" 2>/dev/null; } ||
      { [[ -n $prom_pid ]] && kill -0 "$prom_pid" 2>/dev/null; } || break
    sleep 0.1
  done
  [[ -z $cluster_pid ]] || kill -KILL -- "-$cluster_pid" 2>/dev/null || true
  [[ -z $prom_pid ]] || kill -KILL "$prom_pid" 2>/dev/null || true
  ((rc != 0)) || rm -rf "$T"  # kept (logs, TSDB) when the test fails or skips
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
show() {
  local f
  for f in "$T"/cluster/*.log "$T"/prometheus.log; do
    [[ -f $f ]] || continue
    echo "----- ${f#"$T"/} (last 10 lines) -----"
    tail -n 10 "$f" || true
  done
}

# --- 1. the cluster, every member with /metrics on a free port --------------------------------
SHARDPS_METRICS_PORT=-1 SHARDPS_METRICS_ADDRESS_FILE="$T/worker-%p.metrics" \
SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA" \
  setsid "$ROOT/scripts/launch-local.sh" --servers 2 --workers 2 --transport tcp \
    --consistency bsp --timeout 240 --run-dir "$T/cluster" --quiet \
    --coordinator-arg --metrics_port=-1 \
    --coordinator-arg --metrics_address_file="$T/coordinator.metrics" \
    --server-arg --metrics_port=-1 --server-arg --metrics_address_file="$T/server-%p.metrics" \
    -- --epochs 100000 --log_every 0 >"$T/launch.log" 2>&1 &
cluster_pid=$!
n_files() { compgen -G "$1" | wc -l; }
for _ in $(seq 600); do  # 60 s
  (($(n_files "$T/server-*.metrics") == 2 && $(n_files "$T/worker-*.metrics") == 2)) &&
    [[ -s $T/coordinator.metrics ]] && break
  kill -0 "$cluster_pid" 2>/dev/null || { cat "$T/launch.log"; fail "the cluster exited early"; }
  sleep 0.1
done
(($(n_files "$T/server-*.metrics") == 2 && $(n_files "$T/worker-*.metrics") == 2)) ||
  fail "not every member wrote its metrics address within 60 s"
targets() { local f out=""; for f in "$@"; do out+="${out:+, }'$(<"$f")'"; done; echo "$out"; }
coord_t=$(targets "$T/coordinator.metrics")
server_t=$(targets "$T"/server-*.metrics)
worker_t=$(targets "$T"/worker-*.metrics)
echo "($SECONDS s) metrics endpoints: coordinator $coord_t; servers $server_t; workers $worker_t"

# --- 2. prometheus ----------------------------------------------------------------------------
cat >"$T/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: shardps_coordinator
    static_configs: [{targets: [$coord_t]}]
  - job_name: shardps_server
    static_configs: [{targets: [$server_t]}]
  - job_name: shardps_worker
    static_configs: [{targets: [$worker_t]}]
YML
promtool check config "$T/prometheus.yml" >/dev/null || fail "promtool rejects the generated config"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
API=""
for attempt in 1 2 3; do  # a free port may be taken by someone else before prometheus binds it
  port=$(free_port)
  prometheus --config.file="$T/prometheus.yml" --storage.tsdb.path="$T/tsdb" \
    --web.listen-address="127.0.0.1:$port" >"$T/prometheus.log" 2>&1 &
  prom_pid=$!
  for _ in $(seq 150); do  # 15 s
    kill -0 "$prom_pid" 2>/dev/null || break
    if "$PY" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/-/ready', timeout=1)" 2>/dev/null; then
      API="http://127.0.0.1:$port"
      break 2
    fi
    sleep 0.1
  done
  kill -KILL "$prom_pid" 2>/dev/null || true
  wait "$prom_pid" 2>/dev/null || true
  prom_pid=""
done
[[ -n $API ]] || { tail -n 20 "$T/prometheus.log"; skip "prometheus could not be started (log above)"; }
echo "($SECONDS s) prometheus at $API"

# --- 3. what Prometheus saw -------------------------------------------------------------------
query() {  # query PROMQL: prints one "labels value" line per result series
  "$PY" - "$API" "$1" <<'PYQ'
import json, sys, urllib.parse, urllib.request
api, q = sys.argv[1], sys.argv[2]
with urllib.request.urlopen(api + "/api/v1/query?" + urllib.parse.urlencode({"query": q}), timeout=5) as r:
    body = json.load(r)
assert body["status"] == "success", body
for s in body["data"]["result"]:
    m = s["metric"]
    print(",".join(f"{k}={v}" for k, v in sorted(m.items())), s["value"][1])
PYQ
}
# One poller process (a Python start-up per query is slow on a loaded host), bounded in time.
"$PY" - "$API" 90 <<'PYW' || fail "Prometheus did not see every member's work within 90 s (above)"
import json, sys, time, urllib.parse, urllib.request
api, bound = sys.argv[1], float(sys.argv[2])
def count(q):
    url = api + "/api/v1/query?" + urllib.parse.urlencode({"query": q})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
    except (OSError, ValueError) as e:  # a slow or restarting API: asked again
        return f"error {e}"
    return len(body["data"]["result"]) if body["status"] == "success" else -1
# Over the last 30 s of samples: on a loaded host one scrape may miss its 1 s timeout, and
# Prometheus then marks that target's series stale until the next one succeeds.
want = {
    "max_over_time(shardps_server_pushes_applied_total[30s]) > 0": 2,  # every server target
    "max_over_time(shardps_client_pushes_total[30s]) > 0": 2,          # every worker target
    'max_over_time(shardps_coordinator_members{role="server"}[30s]) == 2': 1,
    'max_over_time(shardps_coordinator_members{role="worker"}[30s]) == 2': 1,
}
deadline = time.monotonic() + bound
while True:
    got = {q: count(q) for q in want}
    if got == want:
        sys.exit(0)
    if time.monotonic() > deadline:
        for q, n in got.items():
            print(f"  {q}: {n} series (want {want[q]})")
        sys.exit(1)
    time.sleep(0.5)
PYW
echo "($SECONDS s) Prometheus: pushes applied by every server, pushes of every worker:"
query 'max_over_time(shardps_server_pushes_applied_total[30s])'
query 'max_over_time(shardps_client_pushes_total[30s])'
echo "Prometheus: scrapes that succeeded in the last 30 s, by target:"
query 'sum_over_time(up[30s])'
[[ $(query 'max_over_time(up[30s]) == 0' | wc -l) == 0 ]] ||
  fail "a target was never up in 30 s: $(query 'max_over_time(up[30s]) == 0')"

# promtool's lint of one scrape of every endpoint: no problems.
for f in "$T/coordinator.metrics" "$T"/server-*.metrics "$T"/worker-*.metrics; do
  addr=$(<"$f")
  "$PY" -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://$addr/metrics', timeout=5).read().decode())" \
    >"$T/scrape.txt" || fail "scrape of $addr failed"
  [[ -s $T/scrape.txt ]] || fail "empty scrape of $addr"
  problems=$(promtool check metrics <"$T/scrape.txt" 2>&1) || fail "promtool check metrics on $addr: $problems"
  [[ -z $problems ]] || fail "promtool check metrics on $addr: $problems"
  echo "promtool check metrics $addr: no problems ($(grep -vc '^#' "$T/scrape.txt") samples)"
  if [[ $f == */server-* && -z ${shown:-} ]]; then
    shown=1
    echo "----- an excerpt of server $addr's scrape -----"
    grep -E '^shardps_server_(pushes_applied_total|push_bytes_applied_total|duplicate_pushes_total|versions_published_total|heartbeats_sent_total|pushes_waiting) |^shardps_server_apply_seconds_(bucket\{le="(1.6e-05|0.000256|0.001024)"\}|sum|count) |^shardps_server_push_clock_lag_clocks_bucket\{le="0"\}' \
      "$T/scrape.txt" || true
  fi
done
echo "PASS"
