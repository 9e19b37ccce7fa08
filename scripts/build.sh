#!/usr/bin/env bash
# Configures and builds ShardPS into build/ (or $SHARDPS_BUILD_DIR). Extra args go to cmake.
# $SHARDPS_BUILD_TARGETS (space-separated) limits the build to those targets.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${SHARDPS_BUILD_DIR:-build}
# ccache when installed (scripts/deps.sh installs it): rebuilds of a clean clone and of other
# build dirs reuse objects. SHARDPS_NO_CCACHE=1 turns it off.
launcher=()
if command -v ccache >/dev/null && [[ -z ${SHARDPS_NO_CCACHE:-} ]]; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} ${launcher[@]+"${launcher[@]}"} "$@"
# shellcheck disable=SC2086  # word splitting of the target list is intended
cmake --build "$BUILD" -j "$(nproc)" ${SHARDPS_BUILD_TARGETS:+--target $SHARDPS_BUILD_TARGETS}
