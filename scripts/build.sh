#!/usr/bin/env bash
# Configures and builds ShardPS into build/ (or $SHARDPS_BUILD_DIR). Extra args go to cmake.
# $SHARDPS_BUILD_TARGETS (space-separated) limits the build to those targets.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${SHARDPS_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} "$@"
# shellcheck disable=SC2086  # word splitting of the target list is intended
cmake --build "$BUILD" -j "$(nproc)" ${SHARDPS_BUILD_TARGETS:+--target $SHARDPS_BUILD_TARGETS}
