// worker/cuda_staging.h: device-pointer detection and the pinned-host staging pipeline. Tests
// that need a GPU skip, with the reason, when cudaGetDeviceCount reports none.
#include "worker/cuda_staging.h"

#include <cuda_runtime_api.h>

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace shardps::worker {
namespace {

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

#define REQUIRE_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)"

TEST(CudaStagingTest, HostMemoryIsNeverADevicePointer) {
  std::vector<float> host(16);
  EXPECT_FALSE(IsCudaDevicePointer(host.data()));
  EXPECT_FALSE(IsCudaDevicePointer(nullptr));
}

TEST(CudaStagingTest, DeviceMemoryIsRecognised) {
  REQUIRE_GPU();
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 1024), cudaSuccess);
  EXPECT_TRUE(IsCudaDevicePointer(d));
  cudaFree(d);
}

TEST(CudaStagingTest, PiecesReachHostAndWeightsReachDevice) {
  REQUIRE_GPU();
  constexpr size_t kN = 1000;  // 4000 bytes in 7 pieces of 576
  float *dw = nullptr, *dg = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dw), kN * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dg), kN * 4), cudaSuccess);
  std::vector<float> g(kN);
  std::iota(g.begin(), g.end(), 1.0f);
  ASSERT_EQ(cudaMemcpy(dg, g.data(), kN * 4, cudaMemcpyHostToDevice), cudaSuccess);
  auto s = CudaStaging::Create(dw, dg, kN * 4, 576);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->StartGradsToHost().ok());
  for (int spin = 0; spin < 1000000; ++spin) {
    auto ready = (*s)->GradsOnHost(kN * 4);
    ASSERT_TRUE(ready.ok()) << ready.status();
    if (*ready) break;
  }
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ((*s)->host_grads()[i], g[i]) << i;
  for (size_t i = 0; i < kN; ++i) (*s)->host_weights()[i] = -static_cast<float>(i);
  ASSERT_TRUE((*s)->WeightsToDevice(400, 2000).ok());  // elements [100, 600)
  ASSERT_TRUE((*s)->SyncWeights().ok());
  std::vector<float> back(kN, 7.0f);
  ASSERT_EQ(cudaMemcpy(dw, back.data(), 400, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), dw, kN * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 100; i < 600; ++i) EXPECT_EQ(back[i], -static_cast<float>(i)) << i;
  cudaFree(dw);
  cudaFree(dg);
}

}  // namespace
}  // namespace shardps::worker
