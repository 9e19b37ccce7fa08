#!/usr/bin/env bash
# The main job: trains a digits classifier (MLP 64-64-10) on a local ShardPS cluster.
# From a fresh clone on Debian 12 as root: installs packages (scripts/deps.sh), builds
# (scripts/build.sh), exports scikit-learn's digits if missing, then starts 1 coordinator,
# 2 shard server groups, each with a primary and a backup server (4 server processes), and 4
# workers (scripts/launch-local.sh), streams rank 0's progress and ends with the held-out test
# accuracy.
#
# usage: scripts/run.sh [--transport verbs|tcp|shm|auto] [--quick] [--replicas 1|2]
#                       [-- TRAINER ARGS...]
#   --transport  default $SHARDPS_TRANSPORT, else auto (verbs if usable, else tcp; logged)
#   --quick      3 epochs instead of 15 (about 0.93-0.95 instead of about 0.97)
#   --replicas   2 (default): every server group has a backup (docs/fault-tolerance.md); 1: none
# Env: SHARDPS_BUILD_DIR (default build), SHARDPS_DATA_DIR (default BUILD/data).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
transport=${SHARDPS_TRANSPORT:-auto}
epochs=15
replicas=2
extra=()
while (($#)); do
  case $1 in
    --transport) transport=$2; shift 2 ;;
    --transport=*) transport=${1#*=}; shift ;;
    --quick) epochs=3; shift ;;
    --replicas) replicas=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run.sh: unknown option '$1' (--help)" >&2; exit 2 ;;
  esac
done
BUILD=${SHARDPS_BUILD_DIR:-build}
export SHARDPS_BUILD_DIR=$BUILD
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"
export SHARDPS_DATA_DIR=${SHARDPS_DATA_DIR:-$BUILD/data}

echo "=== [1/4] packages ==="
"$ROOT/scripts/deps.sh"
echo "=== [2/4] build ==="
SHARDPS_BUILD_TARGETS=${SHARDPS_BUILD_TARGETS:-"shardps_coordinator_bin shardps_server digits_trainer"} \
  "$ROOT/scripts/build.sh"
echo "=== [3/4] data ==="
if [[ -s $SHARDPS_DATA_DIR/digits_train.bin && -s $SHARDPS_DATA_DIR/digits_test.bin ]]; then
  echo "data: $SHARDPS_DATA_DIR/digits_{train,test}.bin present"
else
  # Debian's python, where python3-sklearn lives (not a pyenv/venv python earlier on PATH).
  timeout 120 "${SHARDPS_PYTHON:-/usr/bin/python3}" "$ROOT/scripts/export_digits.py" \
    --out "$SHARDPS_DATA_DIR"
fi
echo "=== [4/4] train: 2 server groups x $replicas replica(s), 4 workers, transport $transport," \
     "BSP, $epochs epochs ==="
exec "$ROOT/scripts/launch-local.sh" --servers 2 --replicas "$replicas" --workers 4 \
  --transport "$transport" \
  --consistency bsp --optimizer momentum --lr 0.2 --timeout 600 -- \
  --epochs "$epochs" --batch_size 32 --log_every 11 ${extra[@]+"${extra[@]}"}
