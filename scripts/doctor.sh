#!/usr/bin/env bash
# Builds `shardps` if needed and runs `shardps doctor` with the given flags, e.g.
#   scripts/doctor.sh --transport verbs --coordinator 10.0.0.1:7070 --model 256MiB
#   scripts/doctor.sh --serve --transport tcp            # a probe responder for --peer
# Exit status: doctor's (0 nothing would stop training, 1 something would, 2 usage error).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${SHARDPS_BUILD_DIR:-$ROOT/build}
BIN="$BUILD/tools/shardps"
if [[ ! -x "$BIN" ]]; then
  SHARDPS_BUILD_DIR="$BUILD" SHARDPS_BUILD_TARGETS=shardps_tool "$ROOT/scripts/build.sh" >&2
fi
exec "$BIN" doctor "$@"
