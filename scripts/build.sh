#!/usr/bin/env bash
# Configures and builds ShardPS into build/ (or $SHARDPS_BUILD_DIR). Extra args go to cmake.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${SHARDPS_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} "$@"
cmake --build "$BUILD" -j "$(nproc)"
