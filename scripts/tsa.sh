#!/usr/bin/env bash
# Clang's thread-safety analysis over the ShardPS libraries: every GUARDED_BY / REQUIRES of
# common/thread_annotations.h is checked, a violation is a build error. A second build dir
# ($SHARDPS_TSA_BUILD_DIR, default build-tsa) with clang, SHARDPS_THREAD_SAFETY=ON, no tests,
# benchmarks or Python module, -O0 and no debug info, so it stays short. Builds the library
# targets only: common, transport, proto, coordinator, server core, checkpoint, worker.
# Fails (loudly) without clang. scripts/test.sh runs it first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${SHARDPS_TSA_BUILD_DIR:-build-tsa}
command -v clang++ >/dev/null || { echo "tsa.sh: clang++ not found" >&2; exit 1; }
start=$SECONDS
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -DSHARDPS_THREAD_SAFETY=ON \
  -DSHARDPS_BUILD_TESTS=OFF -DSHARDPS_BUILD_BENCH=OFF -DSHARDPS_WITH_PYTHON=OFF \
  -DSHARDPS_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
  -DCMAKE_C_FLAGS_DEBUG=-O0 >/dev/null
if ! cmake --build "$BUILD" -j "$(nproc)" --target shardps_common shardps_transport \
     shardps_proto shardps_coordinator shardps_server_core shardps_checkpoint shardps; then
  echo "tsa.sh: thread-safety analysis FAILED after $((SECONDS - start)) s (a lock" \
       "annotation is violated: see the errors above)" >&2
  exit 1
fi
echo "tsa.sh: thread-safety analysis clean in $((SECONDS - start)) s"
