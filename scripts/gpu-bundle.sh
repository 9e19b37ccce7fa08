#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs into a folder (default .gpu/), for a GPU machine that has
# the CUDA driver, Python and PyTorch but none of ShardPS's build dependencies (no glog, gflags,
# protobuf, rdma-core): the CUDA test and benchmark binaries of a build with CUDA, the daemons,
# libshardps.so, the pure-Python package, and every shared library they load that is not the C
# runtime (glibc, libstdc++, libgcc) or the CUDA driver. Stripped; about 25 MB.
#
#   scripts/build.sh && scripts/gpu-bundle.sh [BUNDLE_DIR]
#
# The GPU machine then runs `bash scripts/gpu-check.sh BUNDLE_DIR` from a copy of the source tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${SHARDPS_BUILD_DIR:-build}
DEST=${1:-.gpu}
bins=(
  tests/cuda_staging_test tests/cuda_cluster_test worker/cuda_staging_bench
  bench/shardps_bench server/shardps_coordinator server/shardps_server
)
for b in "${bins[@]}"; do
  [[ -x $BUILD/$b ]] || { echo "gpu-bundle: $BUILD/$b missing: build with CUDA first" >&2; exit 1; }
done
rm -rf "$DEST"
mkdir -p "$DEST/build/lib" "$DEST/build/python/shardps"
for b in "${bins[@]}"; do
  mkdir -p "$DEST/build/$(dirname "$b")"
  strip -o "$DEST/build/$b" "$BUILD/$b"
done
so=$(find "$BUILD/worker" -maxdepth 1 -name 'libshardps.so.*.*' | head -1)
strip -o "$DEST/build/lib/$(basename "$so")" "$so"
ln -sf "$(basename "$so")" "$DEST/build/lib/libshardps.so"
soname=$(objdump -p "$so" | awk '/SONAME/ {print $2}')
[[ $soname == "$(basename "$so")" ]] || ln -sf "$(basename "$so")" "$DEST/build/lib/$soname"
# Every library the binaries load, less the C runtime and the driver (the GPU machine's own).
for f in "${bins[@]/#/$BUILD/}" "$so"; do
  ldd "$f" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++*|libgcc_s*|libcuda.so*) ;;
    libshardps.so*) ;;
    *) cp -L "$lib" "$DEST/build/lib/" ;;
  esac
done
cp python/shardps/*.py python/shardps/launch_defaults.env "$DEST/build/python/shardps/"
version=$(sed -n "s/^VERSION = '\(.*\)'/\1/p" "$BUILD/python/shardps/_build_info.py" 2>/dev/null || true)
# BUILD_DIR is resolved on the GPU machine by gpu-check.sh (SHARDPS_BUILD_DIR wins anyway).
printf "BUILD_DIR = ''\nVERSION = '%s'\n" "${version:-0}" > "$DEST/build/python/shardps/_build_info.py"
# Python headers of a 3.12 interpreter, for the extension when the GPU machine's Python has none.
for inc in /root/.pyenv/versions/3.12*/include/python3.12; do
  [[ -f $inc/Python.h ]] && { mkdir -p "$DEST/pyinc"; cp -r "$inc" "$DEST/pyinc/"; break; }
done
# Debian's pybind11 headers, for when the GPU machine's Python has no pybind11.
[[ -d /usr/include/pybind11 ]] && mkdir -p "$DEST/pyinc" && cp -r /usr/include/pybind11 "$DEST/pyinc/"
du -sh "$DEST"
