#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU, from a bundle of scripts/gpu-bundle.sh
# (binaries built elsewhere; this machine needs the driver, Python 3 with PyTorch and pybind11,
# and a C++ compiler for the Python extension). Run from the source tree's root:
#
#   bash scripts/gpu-check.sh [BUNDLE_DIR] [RESULTS_DIR]
#
# 1. the GPU, driver, OS and toolchain;
# 2. unit.CudaStagingTest and integration.CudaClusterTest / CudaStreamOrderTest (gtest XML);
# 3. the Python extension, compiled here against libshardps.so, then the CUDA Python tests
#    (tests/python/test_cuda.py, CudaTest, the GradScaler skip), the digits MLP trained on the GPU through a cluster and
#    alone, and bench/gpu_step_bench.py (a GPU learner's step against a CPU one's);
# 4. cuda_staging_bench (host<->device GB/s, pinned vs pageable, whole vs 1 MiB pieces);
# 5. shardps_bench with the workers' tensors in host and in device memory, same run, tcp and shm;
# 6. compute-sanitizer's memcheck over the staging test and one cluster case;
# Every part runs even if one before it failed; the exit status is the number of failed parts.
# 7. (not by default) a 256 MiB model's step at pipeline pieces of 256 KiB to 16 MiB.
# GPU_CHECK_PARTS (e.g. "2 7") runs only those parts (1 always runs); GPU_BENCH_SIZES the
# sizes of part 5 (default 4K,1M,16M).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUNDLE=$(realpath "${1:-.gpu}")
RES=$(realpath -m "${2:-${OUT:-gpu-results}}")
mkdir -p "$RES"
B=$BUNDLE/build
export LD_LIBRARY_PATH=$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SHARDPS_BUILD_DIR=$B
export GLOG_minloglevel=${GLOG_minloglevel:-1}
failed=()
PARTS=${GPU_CHECK_PARTS:-2 3 4 5 6}
want() { [[ " $PARTS " == *" $1 "* ]]; }
part() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
run() {  # run NAME TIMEOUT CMD...: records a failure by name
  local name=$1 t=$2
  shift 2
  timeout "$t" "$@"
  local rc=$?
  [[ $rc -eq 0 ]] || { echo "--- $name: exit $rc"; failed+=("$name($rc)"); }
  return 0
}

part "1. machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
grep PRETTY_NAME /etc/os-release
uname -r
nproc
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
g++ --version | head -1
ls /sys/class/infiniband 2>/dev/null || echo "no RDMA device (/sys/class/infiniband)"
missing=$(ldd "$B/tests/cuda_cluster_test" "$B/bench/shardps_bench" "$B/server/shardps_server" | grep 'not found' | sort -u)
[[ -z $missing ]] || { echo "missing libraries: $missing"; failed+=(libs); }

want 2 && {
part "2. C++ CUDA tests"
run cuda_staging_test 120 "$B/tests/cuda_staging_test" --gtest_output="xml:$RES/cuda_staging_test.xml"
run cuda_cluster_test 420 "$B/tests/cuda_cluster_test" --gtest_output="xml:$RES/cuda_cluster_test.xml"
# A deliberately broken build of a test (the bundle's tests/*_broken, with the filter in
# tests/*_broken.filter) must fail: a test that cannot fail is a defect.
for broken in "$B"/tests/*_broken; do
  [[ -x $broken ]] || continue
  timeout 120 "$broken" --gtest_filter="$(cat "$broken.filter")" >"$RES/broken.log" 2>&1
  rc=$?
  grep -E '^\[  (FAILED|PASSED) |Failure|Expected|Which is|pushed the' "$RES/broken.log" | head -20
  if [[ $rc -eq 1 ]]; then
    echo "$(basename "$broken"): failed as it must (exit 1)"
  else
    echo "$(basename "$broken"): exit $rc: the test did not catch the broken build"
    failed+=("$(basename "$broken")($rc)")
  fi
done

}

ext_ok=0
if want 3 || want 7; then
  part "3. Python on the GPU"
  py=$B/python/shardps
  ext=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  [[ -f $inc/Python.h ]] || inc=$(ls -d "$BUNDLE"/pyinc/python3* 2>/dev/null | head -1)
  pyb=$(python3 -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null)
  build_ext() {  # build_ext PYBIND11_INCLUDE
    echo "extension $ext: Python.h from $inc, pybind11 from $1"
    g++ -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -I. -Iworker/include -I"$1" -I"$inc" \
      python/shardps_module.cc -o "$py/_shardps$ext" -L"$B/lib" -lshardps -Wl,-rpath,"$B/lib"
  }
  if { [[ -n $pyb ]] && build_ext "$pyb"; } || build_ext "$BUNDLE/pyinc"; then
    ext_ok=1
    export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
  else
    failed+=(python_extension)
  fi
fi
if want 3 && ((ext_ok)); then
  run python_cuda_tests 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda.py \
    tests/python/test_shardps.py -k "GpuLearnerTest or NotDeviceMemoryTest or CudaTest or grad_scaler" -rA \
    --junitxml="$RES/python_cuda.xml"
  run digits_cuda 240 python3 -m shardps.run --servers 2 --workers 2 --transport shm --timeout 200 \
    --run-dir /tmp/gpu-check-digits -- \
    sh -c 'exec python3 examples/torch_digits.py --coordinator "$SHARDPS_COORDINATOR" --transport shm --device cuda --epochs 8 --min_accuracy 0.9'
  tail -n 3 /tmp/gpu-check-digits/worker-1.log 2>/dev/null
  run digits_cuda_standalone 120 python3 examples/torch_digits.py --standalone --workers 2 \
    --device cuda --epochs 8
  for tr in shm tcp; do
    run "gpu_step_bench_$tr" 180 python3 bench/gpu_step_bench.py --width 2048 --layers 4 \
      --steps 20 --transport $tr
  done
  # Many small tensors (100 of 16 KiB): the per-tensor cost of staging.
  run gpu_step_bench_small 180 python3 bench/gpu_step_bench.py --width 64 --layers 100 \
    --steps 50 --transport shm
fi

want 4 && {
part "4. cuda_staging_bench"
run cuda_staging_bench 120 "$B/worker/cuda_staging_bench" --sizes=65536,1048576,16777216,268435456 --iters=20

}

want 5 && {
part "5. shardps_bench: host vs device tensors"
for mem in host cuda; do
  run "shardps_bench_$mem" 240 "$B/bench/shardps_bench" --memory=$mem --transports=tcp,shm \
    --layouts=1x1,2x2 --latency_layouts=1x1 --modes=push,pull,push-pull --sizes="${GPU_BENCH_SIZES:-4K,1M,16M}" \
    --keys_per_server=8 --seconds=0.3 --lat_seconds=0.2 --reps=1 \
    --coordinator_bin="$B/server/shardps_coordinator" --server_bin="$B/server/shardps_server" \
    --json="$RES/bench-$mem.json" --label="gpu-check $mem"
done

}

want 6 && {
part "6. compute-sanitizer (memcheck) on the staging pipeline and one cluster case"
if command -v compute-sanitizer >/dev/null; then
  run sanitizer_staging 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$B/tests/cuda_staging_test"
  run sanitizer_cluster 180 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$B/tests/cuda_cluster_test" --gtest_filter='*tcp_gpu_gpu_4096*'
else
  echo "compute-sanitizer not on PATH"
fi

}

if want 7 && ((ext_ok)); then
  part "7. the staging pipeline's piece size: a 256 MiB model's step (shm, tcp)"
  for tr in shm tcp; do
    for pb in 262144 1048576 4194304 16777216; do
      run "gpu_step_bench_${tr}_$pb" 180 python3 bench/gpu_step_bench.py --width 4096 --layers 4 \
        --steps 10 --transport $tr --pipeline-bytes $pb
    done
  done
fi

part "summary"
echo "failed parts: ${#failed[@]} ${failed[*]}"
exit "${#failed[@]}"
