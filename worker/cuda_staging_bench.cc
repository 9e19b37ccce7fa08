// cuda_staging_bench: host<->device copy bandwidth as the CUDA staging pipeline sees it.
//
// For each size: H2D and D2H GB/s from pinned (cudaHostAlloc) and pageable (malloc) host
// memory, and the pinned copy split into --piece_bytes pieces with one event each (what
// worker/cuda_staging.cc does per push). Prints one line per measurement; exits 77 (a skip for
// ctest and scripts) when no CUDA device is present.
//
//   build/worker/cuda_staging_bench --sizes=1048576,16777216,268435456 --iters=20
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gflags/gflags.h>

DEFINE_string(sizes, "1048576,16777216,134217728", "Comma-separated transfer sizes in bytes");
DEFINE_int32(iters, 20, "Timed copies per measurement (after 3 warm-up copies)");
DEFINE_uint64(piece_bytes, 1u << 20, "Piece size of the pipelined (per-piece event) variant");
DEFINE_int32(device, 0, "CUDA device");

namespace {

#define CHECK_CUDA(expr)                                                             \
  do {                                                                               \
    cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_));        \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

double Time(const std::function<void()>& once, int iters) {
  for (int i = 0; i < 3; ++i) once();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) once();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("cuda_staging_bench: SKIP: no CUDA device (cudaGetDeviceCount reports none)\n");
    return 77;
  }
  CHECK_CUDA(cudaSetDevice(FLAGS_device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, FLAGS_device));
  std::printf("device %d: %s\n", FLAGS_device, prop.name);
  std::vector<size_t> sizes;
  std::stringstream ss(FLAGS_sizes);
  for (std::string tok; std::getline(ss, tok, ',');) sizes.push_back(std::stoull(tok));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  for (size_t bytes : sizes) {
    void* dev = nullptr;
    void* pinned = nullptr;
    CHECK_CUDA(cudaMalloc(&dev, bytes));
    CHECK_CUDA(cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault));
    std::unique_ptr<char[]> pageable(new char[bytes]);
    std::memset(pageable.get(), 1, bytes);
    std::memset(pinned, 1, bytes);
    const size_t pieces = (bytes + FLAGS_piece_bytes - 1) / FLAGS_piece_bytes;
    std::vector<cudaEvent_t> events(pieces);
    for (auto& e : events) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    auto copy = [&](void* dst, const void* src, cudaMemcpyKind kind) {
      return [=] {
        CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
      };
    };
    auto pieced = [&](cudaMemcpyKind kind) {
      return [&, kind] {
        for (size_t i = 0; i < pieces; ++i) {
          const size_t off = i * FLAGS_piece_bytes;
          const size_t len = std::min<size_t>(FLAGS_piece_bytes, bytes - off);
          char* d = static_cast<char*>(dev) + off;
          char* h = static_cast<char*>(pinned) + off;
          CHECK_CUDA(kind == cudaMemcpyDeviceToHost
                         ? cudaMemcpyAsync(h, d, len, kind, stream)
                         : cudaMemcpyAsync(d, h, len, kind, stream));
          CHECK_CUDA(cudaEventRecord(events[i], stream));
        }
        for (auto& e : events) CHECK_CUDA(cudaEventSynchronize(e));
      };
    };
    struct Case {
      const char* name;
      std::function<void()> fn;
    };
    const Case cases[] = {
        {"H2D pinned", copy(dev, pinned, cudaMemcpyHostToDevice)},
        {"D2H pinned", copy(pinned, dev, cudaMemcpyDeviceToHost)},
        {"H2D pageable", copy(dev, pageable.get(), cudaMemcpyHostToDevice)},
        {"D2H pageable", copy(pageable.get(), dev, cudaMemcpyDeviceToHost)},
        {"H2D pinned, pieces", pieced(cudaMemcpyHostToDevice)},
        {"D2H pinned, pieces", pieced(cudaMemcpyDeviceToHost)},
    };
    for (const Case& c : cases) {
      const double s = Time(c.fn, FLAGS_iters);
      std::printf("%-20s %12zu bytes  %8.2f GB/s  (%.1f us)%s\n", c.name, bytes, bytes / s / 1e9,
                  s * 1e6,
                  std::strstr(c.name, "pieces") ? (" [" + std::to_string(pieces) + " pieces of " +
                                                   std::to_string(FLAGS_piece_bytes) + " B]")
                                                      .c_str()
                                                : "");
    }
    for (auto& e : events) cudaEventDestroy(e);
    cudaFreeHost(pinned);
    cudaFree(dev);
  }
  cudaStreamDestroy(stream);
  return 0;
}
