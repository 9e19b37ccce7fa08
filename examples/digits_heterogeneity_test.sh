#!/usr/bin/env bash
# ctest examples.digits_heterogeneity: the study flags of digits_trainer do what their help says.
#   1. --standalone with --compute_delay_ms 2 and --slowdown 1 vs 3: the slowed run's 'timing:'
#      line shows a slowdown sleep of at least 2 x (compute + delay) per step (sleep_until never
#      wakes early), and its run lasts at least its sleeps. Lower bounds only: a busy host
#      makes a process slower, never faster, so nothing here fails because it was descheduled.
#   2. --eval_every 4: 'eval:' lines at step 0, every 4th step and the last step, t and unix
#      increasing, the last one's accuracy equal to the final test accuracy.
#   3. a 2-worker ASP cluster (scripts/launch-local.sh) with --slowdown 3 --slowdown_rank 1:
#      only rank 1 sleeps (factor 3, sleep >= 2 x its compute + delay), rank 0 does not.
#   4. --slowdown 0.5 is refused (exit 2).
# Exits 77 (ctest SKIP) only when python3-sklearn is missing, so the data cannot be exported.
# usage: digits_heterogeneity_test.sh BUILD_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$(cd "${1:?usage: digits_heterogeneity_test.sh BUILD_DIR}" && pwd)
PY=${SHARDPS_PYTHON:-/usr/bin/python3}
TRAINER="$BUILD/examples/digits_trainer"

DATA="$BUILD/data"
if [[ ! -s $DATA/digits_test.bin || ! -s $DATA/digits_train.bin ]]; then
  if ! "$PY" -c 'import sklearn' 2>/dev/null; then
    echo "SKIP: scikit-learn is not importable by $PY (install python3-sklearn: scripts/deps.sh)"
    exit 77
  fi
  timeout 60 "$PY" "$ROOT/scripts/export_digits.py" --out "$DATA"
fi
RUN=$(mktemp -d "$BUILD/digits_heterogeneity.XXXXXX")
fail() { echo "FAIL: $*"; echo "logs in $RUN"; exit 1; }

# --- 1 and 2: standalone ------------------------------------------------------------------------
common=(--standalone --workers 2 --epochs 2 --batch_size 32 --seed 3 --log_every 0
        --data "$DATA/digits_train.bin" --compute_delay_ms 2 --eval_every 4)
for f in 1 3; do
  timeout 60 "$TRAINER" "${common[@]}" --slowdown "$f" >"$RUN/standalone-$f.log" 2>&1 ||
    fail "standalone run with --slowdown $f (see $RUN/standalone-$f.log)"
done
"$PY" - "$RUN/standalone-1.log" "$RUN/standalone-3.log" <<'PY' || fail "standalone checks"
import re, sys

def parse(path):
    text = open(path).read()
    evals = [(int(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5])) for m in re.finditer(
        r"^eval: rank (\d+) step (\d+) t=([\d.]+) unix=([\d.]+) acc=([\d.]+)$", text, re.M)]
    t = re.search(r"^timing: rank 0 steps (\d+) elapsed ([\d.]+) s compute ([\d.]+) ms "
                  r"delay ([\d.]+) ms slowdown ([\d.]+) ms \(factor ([\d.]+)\)", text, re.M)
    final = re.search(r"^final: test accuracy ([\d.]+) after (\d+) steps", text, re.M)
    assert t and final, f"{path}: no timing: or final: line"
    steps, elapsed, compute, delay, slow, factor = (float(x) for x in t.groups())
    return evals, dict(steps=int(steps), elapsed=elapsed, compute=compute, delay=delay,
                       slow=slow, factor=factor, acc=float(final[1]))

(e1, t1), (e3, t3) = parse(sys.argv[1]), parse(sys.argv[2])
# 1. the sleep rule and its effect on the run's length
assert t1["slow"] == 0 and t1["factor"] == 1, f"unslowed run slept: {t1}"
assert t3["factor"] == 3, t3
assert t1["delay"] >= 2.0 and t3["delay"] >= 2.0, "--compute_delay_ms 2 slept less than 2 ms"
want = 2 * (t3["compute"] + 2.0)  # (F - 1) x (measured compute + the nominal delay)
# Lower bounds only: a descheduled process sleeps longer and computes longer, never shorter,
# so these hold on a busy host (an upper bound or a ratio of two runs' times would not).
assert t3["slow"] >= want, f"slowdown sleep {t3['slow']} ms per step, the rule gives {want}"
slept = t3["steps"] * t3["slow"] / 1000
assert t3["elapsed"] >= slept, f"the run ({t3['elapsed']} s) is shorter than its sleeps ({slept} s)"
ratio = t3["elapsed"] / t1["elapsed"]
# 2. eval lines: step 0, every 4th, and the last; time increases; last == final accuracy
for evals, t in ((e1, t1), (e3, t3)):
    steps = [e[1] for e in evals]
    want_steps = sorted(set([0] + list(range(4, t["steps"] + 1, 4)) + [t["steps"]]))
    assert steps == want_steps, f"eval steps {steps}, want {want_steps}"
    assert all(e[0] == 0 for e in evals)
    for a, b in zip(evals, evals[1:]):
        assert b[2] > a[2] and b[3] > a[3], f"time does not increase: {a} then {b}"
    assert evals[-1][4] == t["acc"], f"last eval {evals[-1][4]} != final {t['acc']}"
    assert evals[0][4] < 0.5 < evals[-1][4], "accuracy did not rise from chance"
print(f"standalone: slowdown sleep {t3['slow']:.2f} ms/step (rule: {want:.2f}), "
      f"run {ratio:.2f}x as long as the unslowed one; {len(e1)} eval lines per run")
PY

# --- 3: one slowed rank in a cluster ------------------------------------------------------------
SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA" timeout 60 \
  "$ROOT/scripts/launch-local.sh" --servers 1 --workers 2 --transport tcp --consistency asp \
  --timeout 45 --run-dir "$RUN/cluster" --quiet -- --epochs 1 --log_every 0 \
  --compute_delay_ms 3 --slowdown 3 --slowdown_rank 1 --eval_every 5 >"$RUN/cluster.out" 2>&1 ||
  fail "the cluster run failed (see $RUN/cluster.out)"
"$PY" - "$RUN"/cluster/worker-[0-9].log <<'PY' || fail "cluster checks"
import re, sys
seen = {}
for path in sys.argv[1:]:
    m = re.search(r"^timing: rank (\d+) steps \d+ elapsed [\d.]+ s compute ([\d.]+) ms "
                  r"delay ([\d.]+) ms slowdown ([\d.]+) ms \(factor ([\d.]+)\)",
                  open(path).read(), re.M)
    assert m, f"{path}: no timing: line"
    rank, compute, delay, slow, factor = int(m[1]), *map(float, m.groups()[1:])
    seen[rank] = (compute, delay, slow, factor)
assert sorted(seen) == [0, 1], seen
assert seen[0][2] == 0 and seen[0][3] == 1, f"rank 0 was slowed: {seen[0]}"
c, d, s, f = seen[1]
assert f == 3 and s >= 2 * (c + 3.0), f"rank 1: sleep {s} ms, want >= {2 * (c + 3.0)}"
print(f"cluster: rank 1 slept {s:.2f} ms/step (compute {c:.2f} + delay {d:.2f}), rank 0 none")
PY

# --- 4: a slowdown below 1 is refused -----------------------------------------------------------
rc=0
timeout 30 "$TRAINER" --standalone --data "$DATA/digits_train.bin" --slowdown 0.5 \
  >"$RUN/bad.log" 2>&1 || rc=$?
((rc == 2)) || fail "--slowdown 0.5 exited $rc, want 2"
echo "PASS: --slowdown, --slowdown_rank, --compute_delay_ms and --eval_every do what they say"
rm -rf "$RUN"
