#!/usr/bin/env bash
# Transport benchmark: builds bench/transport_bench if needed, runs tcp and shm on this host
# (each next to its bound: raw TCP socket pair, memcpy), then, when the SoftRoCE harness exists
# (../shared/softroce or $SOFTROCE_DIR), boots the guest ONCE and in it runs perftest
# (ib_write_lat / ib_read_lat at 8 B and 4 KiB, then per op and size ib_write_bw / ib_read_bw
# (1 s, or 6 ops above 1 MiB) immediately followed by transport_bench --transport=verbs for that point) between
# rxe0 (192.168.77.1, initiator) and rxe1 (192.168.77.2, target), with perftest's figures as
# the verbs bounds. Latency is measured up to 64 KiB there (a 16 MiB op takes seconds in TCG).
#
# Writes bench/results/transport-<UTC stamp>.json (all rows of all runs), the raw per-run files
# under bench/results/work-<stamp>/ (ignored by git), and docs/transport-benchmarks.md.
# Prints the ratios and which targets are met; exit 0 = ran (targets are reported, not enforced;
# --enforce makes a missed target exit 3).
#
# usage: scripts/bench-transport.sh [--no-verbs|--no-host] [--quick] [--enforce] [-- args]
#   --quick   reps=1 and shorter points (a fast look, not for the committed figures)
#   --perftest-from DIR   reuse DIR/perftest/*.log of an earlier run instead of running perftest
#   args after -- go to the host transport_bench run
# Env: SHARDPS_BENCH_BUILD_DIR (default build), SOFTROCE_DIR, BENCH_GUEST_TIMEOUT (default 420).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${SHARDPS_BENCH_BUILD_DIR:-build}
SOFTROCE=${SOFTROCE_DIR:-$ROOT/../shared/softroce}
PY=/usr/bin/python3
REPORT="$ROOT/bench/bench_report.py"
VERBS=1 HOST=1 QUICK=0 ENFORCE=0 PERFTEST_FROM=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-verbs) VERBS=0; shift ;;
    --no-host) HOST=0; shift ;;
    --perftest-from) PERFTEST_FROM=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --enforce) ENFORCE=1; shift ;;
    --) shift; break ;;
    *) echo "bench-transport.sh: unknown option $1 (see the header)" >&2; exit 2 ;;
  esac
done
EXTRA=("$@")

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORK="$ROOT/bench/results/work-$STAMP"
mkdir -p "$WORK"
BIN="$ROOT/$BUILD/bench/transport_bench"

echo "=== build ($BUILD) ==="
SHARDPS_BUILD_DIR="$BUILD" SHARDPS_BUILD_TARGETS="transport_bench" \
  "$ROOT/scripts/build.sh" > "$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log" >&2; echo "bench-transport.sh: build failed" >&2; exit 1; }

if [[ $QUICK == 1 ]]; then
  HOST_ARGS=(--reps=1 --seconds=0.15 --lat_seconds=0.1)
else
  HOST_ARGS=(--reps=5 --seconds=0.3 --lat_seconds=0.3)
fi

RUNS=()
if [[ $HOST == 1 ]]; then
echo "=== host: tcp and shm (nproc $(nproc), kernel $(uname -r)) ==="
"$BIN" --transport=tcp,shm "${HOST_ARGS[@]}" --json="$WORK/host.json" \
  --label="host $(hostname), loopback / same host" "${EXTRA[@]}" 2> "$WORK/host.log"
rc=$?
if [[ $rc -ne 0 ]]; then
  tail -30 "$WORK/host.log" >&2
  echo "bench-transport.sh: host run failed (rc $rc)" >&2
fi
[[ -s "$WORK/host.json" ]] && RUNS+=("$WORK/host.json")
fi

if [[ $VERBS == 1 && -x "$SOFTROCE/run-in-guest.sh" ]]; then
  echo "=== SoftRoCE guest: perftest + transport_bench --transport=verbs (one boot) ==="
  # Window per size exactly as transport_bench picks it with --max_inflight_bytes=32M:
  # W = min(256, max(16, 1 MiB / N), max(1, 32 MiB / N)); perftest gets the same -t.
  cat > "$WORK/guest.sh" <<EOF
#!/bin/sh
W='$WORK'
BIN='$BIN'
'$SOFTROCE/softroce-up.sh' 2 > "\$W/softroce-up.log" 2>&1 || { cat "\$W/softroce-up.log"; exit 1; }
mkdir -p "\$W/perftest"
port=18515
window() { n=\$1; w=\$((1048576 / n)); [ \$w -lt 16 ] && w=16; [ \$w -gt 256 ] && w=256
  c=\$((33554432 / n)); [ \$c -lt 1 ] && c=1; [ \$w -gt \$c ] && w=\$c; echo \$w; }
# perftest TOOL LOG ARGS...: server on rxe1, client on rxe0 -> 192.168.77.2 (crosses the veth).
perftest() { tool=\$1; log=\$2; shift 2; port=\$((port + 1))
  \$tool -d rxe1 -x 1 -p \$port -F "\$@" > "\$log.server" 2>&1 &
  spid=\$!
  sleep 1
  for try in 1 2; do
    timeout 30 \$tool -d rxe0 -x 1 -p \$port -F "\$@" 192.168.77.2 > "\$log" 2>&1 && break
    sleep 1
  done
  ( sleep 10; kill \$spid 2>/dev/null ) & killer=\$!
  wait \$spid 2>/dev/null; kill \$killer 2>/dev/null
  echo "  \$tool \$* : \$(grep -E '^ *[0-9]+ +[0-9]+' "\$log" | tail -1)"
}
counters() { for d in rxe0 rxe1; do for f in /sys/class/infiniband/\$d/ports/1/hw_counters/*; do
  echo "\$d \$(basename \$f) \$(cat \$f)"; done; done > "\$W/counters-\$1.txt"; }
counters 0
s0=\$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts)
if [ -n '$PERFTEST_FROM' ]; then
  cp '$PERFTEST_FROM'/perftest/*.log "\$W/perftest/" && echo "perftest: reusing $PERFTEST_FROM"
else
# Latency bounds first (4 KiB and 8 B; the 8 B write is also the ack trip of the write bound).
for op in write read; do
  for n in 8 4096; do
    perftest ib_\${op}_lat "\$W/perftest/lat_\${op}_\${n}.log" -s \$n -n 300
  done
done
fi
s1=\$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts)
counters 1
# Then, per (op, size): perftest bandwidth (duration mode, same window) and ours right after it,
# so that each ratio compares two measurements a few seconds apart on this noisy machine.
rc=0
for op in write read; do
  for n in 4096 65536 1048576 4194304 16777216; do
    # Duration mode below 1 MiB; from 1 MiB a fixed count (in TCG, -D reports 0 Gbit/s when
    # only a dozen large ops complete in the period).
    if [ \$n -lt 1048576 ]; then len="-D 1"; elif [ \$n -eq 1048576 ]; then len="-n 16"; else len="-n 6"; fi
    [ -n '$PERFTEST_FROM' ] || perftest ib_\${op}_bw "\$W/perftest/bw_\${op}_\${n}.log" -s \$n \$len -t \$(window \$n) --report_gbits
    /usr/bin/python3 '$REPORT' perftest-bounds "\$W/perftest" "\$W/verbs-bounds.txt" > /dev/null 2>&1
    "\$BIN" --transport=verbs --target_bind_ip=192.168.77.2 --initiator_bind_ip=192.168.77.1 \\
      --bounds_file="\$W/verbs-bounds.txt" --json="\$W/verbs-\$op-\$n.json" --ops=\$op --sizes=\$n \\
      --lat_sizes=\$([ \$n -eq 4096 ] && echo 8) --lat_max_size=64K \\
      --seconds=1 --lat_seconds=0.3 --lat_min_iters=5 --max_inflight_bytes=32M --footprint=32M \\
      --label="SoftRoCE guest (qemu TCG), rxe0 -> rxe1 over veth" \\
      > "\$W/verbs-\$op-\$n.out" 2>> "\$W/verbs.log" || rc=1
    grep -E '^verbs ' "\$W/verbs-\$op-\$n.out"
  done
done
s2=\$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts)
counters 2
echo "rxe0 sent \$((s1 - s0)) packets during the latency perftests, \$((s2 - s1)) during bandwidth perftest + transport_bench"
[ \$rc -eq 0 ] || tail -30 "\$W/verbs.log"
exit \$rc
EOF
  chmod +x "$WORK/guest.sh"
  if "$SOFTROCE/build-guest.sh" > "$WORK/build-guest.log" 2>&1; then
    t0=$(date +%s)
    "$SOFTROCE/run-in-guest.sh" --timeout "${BENCH_GUEST_TIMEOUT:-420}" --rw "$WORK" -- \
      "$WORK/guest.sh"
    rc=$?
    echo "guest: rc $rc, $(( $(date +%s) - t0 )) s"
    for f in "$WORK"/verbs-*.json; do [[ -s "$f" ]] && RUNS+=("$f"); done
    # rxe counters that moved: retransmissions, sequence errors, RNR, per phase.
    $PY "$REPORT" counters "$WORK" || true
  else
    tail -20 "$WORK/build-guest.log" >&2
    echo "bench-transport.sh: building the SoftRoCE guest failed; verbs not measured" >&2
  fi
elif [[ $VERBS == 1 ]]; then
  echo "=== verbs: not run (no SoftRoCE harness at $SOFTROCE; set SOFTROCE_DIR) ==="
fi

if [[ ${#RUNS[@]} -eq 0 ]]; then
  echo "bench-transport.sh: nothing was measured" >&2
  exit 1
fi
RESULT="$ROOT/bench/results/transport-$STAMP.json"
$PY "$REPORT" merge "$RESULT" "${RUNS[@]}" || exit 1
$PY "$REPORT" markdown "$RESULT" "$ROOT/docs/transport-benchmarks.md" || exit 1
echo "=== ratios (bw: ours/bound; lat: bound p50/ours p50) — $RESULT ==="
$PY "$REPORT" summary "$RESULT"
src=$?
[[ $ENFORCE == 1 ]] && exit $src
exit 0
