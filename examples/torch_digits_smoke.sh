#!/usr/bin/env bash
# ctest examples.torch_digits_smoke (label python): the PyTorch example, shortened. A local
# cluster (1 coordinator, 2 servers, 2 workers, tcp, BSP, 3 epochs) trains the MLP through
# shardps.torch.DistributedOptimizer (scripts/launch-local.sh --trainer examples/torch_digits.py);
# the same model is trained in one process (--standalone --workers 2, same hyper-parameters and
# global batches). Passes only if the cluster's test accuracy is >= 0.85 and within 1
# percentage point of the single process's.
# Exits 77 (ctest SKIP) when the shardps module, torch or sklearn is not importable.
# usage: torch_digits_smoke.sh BUILD_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$(cd "${1:?usage: torch_digits_smoke.sh BUILD_DIR}" && pwd)
PY=${SHARDPS_PYTHON:-/usr/bin/python3}
THRESHOLD=0.85
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=${GLOG_minloglevel:-1}

if ! "$PY" -c 'import shardps.torch, sklearn' 2>/dev/null; then
  echo "SKIP: shardps.torch or sklearn is not importable by $PY (PYTHONPATH=$PYTHONPATH)"
  exit 77
fi
DATA="$BUILD/data"
[[ -s $DATA/digits_test.bin && -s $DATA/digits_train.bin ]] ||
  timeout 60 "$PY" "$ROOT/scripts/export_digits.py" --out "$DATA"

RUN=$(mktemp -d "$BUILD/torch_digits_smoke.XXXXXX")
common=(--epochs 3 --batch_size 32 --seed 3)
out=$(SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA" timeout 55 \
        "$ROOT/scripts/launch-local.sh" --servers 2 --workers 2 --transport tcp --consistency bsp \
        --optimizer momentum --lr 0.2 --timeout 45 --run-dir "$RUN/cluster" --quiet \
        --trainer "$ROOT/examples/torch_digits.py" -- "${common[@]}" --consistency bsp) || {
  echo "$out"; echo "FAIL: the local cluster run failed (logs in $RUN/cluster)"; exit 1; }
echo "$out"
single=$(timeout 60 "$PY" "$ROOT/examples/torch_digits.py" --standalone --workers 2 \
           --lr 0.2 --momentum 0.9 --data "$DATA/digits_train.bin" "${common[@]}")
echo "$single" | tail -n 1
acc=$(grep -o 'final: test accuracy [0-9.]*' <<<"$out" | head -n 1 | awk '{print $4}')
ref=$(grep -o 'final: test accuracy [0-9.]*' <<<"$single" | awk '{print $4}')
[[ -n $acc && -n $ref ]] || { echo "FAIL: no 'final: test accuracy' line"; exit 1; }
awk -v a="$acc" -v t="$THRESHOLD" 'BEGIN { exit !(a >= t) }' ||
  { echo "FAIL: test accuracy $acc < $THRESHOLD"; exit 1; }
awk -v a="$acc" -v r="$ref" 'BEGIN { d = a - r; if (d < 0) d = -d; exit !(d <= 0.01) }' ||
  { echo "FAIL: cluster accuracy $acc is not within 1 point of the single process's $ref"; exit 1; }
echo "PASS: cluster $acc vs single process $ref (2 servers, 2 workers, 3 epochs)"
rm -rf "$RUN"
