#!/usr/bin/env bash
# ctest examples.digits_smoke: a tiny local cluster (1 coordinator, 2 servers, 2 workers, tcp,
# BSP, 2 epochs) trains the digits MLP through scripts/launch-local.sh. Passes only if
#   1. rank 0's final line reports test accuracy >= 0.85 (2 epochs reach 0.92-0.95; a broken
#      data path or optimizer stays near 0.1),
#   2. it reports 0 control messages per step,
#   3. both workers end with the same weights, equal within 1e-4 to one --standalone process
#      running the same math on the same global batches (BSP is synchronous SGD).
# Exits 77 (ctest SKIP) only when python3-sklearn is missing, so the data cannot be exported.
# usage: digits_smoke.sh BUILD_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$(cd "${1:?usage: digits_smoke.sh BUILD_DIR}" && pwd)
PY=${SHARDPS_PYTHON:-/usr/bin/python3}
THRESHOLD=0.85

if ! "$PY" -c 'import sklearn' 2>/dev/null; then
  echo "SKIP: scikit-learn is not importable by $PY (install python3-sklearn: scripts/deps.sh)"
  exit 77
fi
DATA="$BUILD/data"
[[ -s $DATA/digits_test.bin && -s $DATA/digits_train.bin ]] ||
  timeout 60 "$PY" "$ROOT/scripts/export_digits.py" --out "$DATA"

RUN=$(mktemp -d "$BUILD/digits_smoke.XXXXXX")
common=(--epochs 2 --batch_size 32 --seed 7 --log_every 0)
out=$(SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA" timeout 55 \
        "$ROOT/scripts/launch-local.sh" --servers 2 --workers 2 --transport tcp --consistency bsp \
        --optimizer momentum --lr 0.2 --timeout 45 --run-dir "$RUN/cluster" --quiet -- \
        "${common[@]}" --dump_weights="$RUN/worker-{rank}.bin") || {
  echo "$out"; echo "FAIL: the local cluster run failed (logs in $RUN/cluster)"; exit 1; }
echo "$out"
final=$(grep -o 'final: .*' <<<"$out" | head -n 1)
acc=$(sed -n 's/^final: test accuracy \([0-9.]*\) .*/\1/p' <<<"$final")
ctl=$(sed -n 's/.*control messages per step \([0-9.e+-]*\),.*/\1/p' <<<"$final")
[[ -n $acc ]] || { echo "FAIL: no 'final: test accuracy' line"; exit 1; }
awk -v a="$acc" -v t="$THRESHOLD" 'BEGIN { exit !(a >= t) }' ||
  { echo "FAIL: test accuracy $acc < $THRESHOLD"; exit 1; }
[[ $ctl == 0 ]] || { echo "FAIL: $ctl control messages per step (want 0)"; exit 1; }

timeout 30 "$BUILD/examples/digits_trainer" --standalone --workers 2 --optimizer momentum \
  --lr 0.2 --data "$DATA/digits_train.bin" "${common[@]}" \
  --dump_weights="$RUN/standalone.bin" >"$RUN/standalone.log" 2>&1 ||
  { cat "$RUN/standalone.log"; echo "FAIL: standalone run"; exit 1; }
"$PY" - "$RUN/worker-0.bin" "$RUN/worker-1.bin" "$RUN/standalone.bin" <<'PY'
import struct, sys
from array import array

def load(path):
    with open(path, "rb") as f:
        magic, count = struct.unpack("<II", f.read(8))
        assert magic == 0x57445053, f"{path}: bad magic"
        out = []
        for _ in range(count):
            (n,) = struct.unpack("<I", f.read(4))
            a = array("f")
            a.frombytes(f.read(4 * n))
            out.extend(a)
        return out

w0, w1, ref = (load(p) for p in sys.argv[1:4])
assert len(w0) == len(w1) == len(ref), "dumps differ in size"
if w0 != w1:
    sys.exit("FAIL: the two BSP workers ended with different weights")
diff = max(abs(a - b) for a, b in zip(w0, ref))
print(f"BSP (2 workers) vs standalone: {len(ref)} weights, max |diff| {diff:.3g}")
if diff > 1e-4:
    sys.exit("FAIL: BSP weights differ from the standalone reference by more than 1e-4")
PY
echo "PASS: test accuracy $acc >= $THRESHOLD, 0 control messages per step, BSP == standalone"
rm -rf "$RUN"
