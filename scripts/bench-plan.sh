#!/usr/bin/env bash
# Validates the performance model of `shardps_plan` (docs/plan.md) against real runs: probes
# this host, measures the digits trainer's compute per step, then runs local clusters (tcp) over
# a grid of servers / workers / partition sizes / consistency modes and prints predicted vs
# measured step time, the error of each, the median and max absolute error, and whether the
# configuration the model recommends is within 5% of the best one measured.
# Writes bench/results/plan-<stamp>.json.
#
# usage: scripts/bench-plan.sh [--quick] [--reps N] [--epochs N] [--configs S:W:PART:MODE[:s],...]
#                              [--probe-file F] [--compute-us X] [--out F] [--max-median-error X]
# Env: SHARDPS_BUILD_DIR (default build), SHARDPS_DATA_DIR (default BUILD/data).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec "${SHARDPS_PYTHON:-/usr/bin/python3}" "$ROOT/bench/plan_validate.py" "$@"
