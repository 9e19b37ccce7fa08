// CUDA tensors end to end: a coordinator and shard servers in this process (tcp and shm), and
// workers whose weights and gradients live in device memory (cudaMalloc). Every test asserts on
// the weights that reach the device: bit for bit the same as the same run with host tensors,
// and equal to the closed form of BSP SGD. Tests skip, with the reason, where there is no CUDA
// device (every machine of this project's CI); they ran on a GPU machine (docs/python.md).
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/half.h"
#include "shardps/client.h"
#include "tests/integration/in_process_cluster.h"

namespace shardps {
namespace {

using test::Cluster;
using test::ClusterSpec;

std::string NoGpuReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (e != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(e);
  if (n == 0) return "no CUDA device (cudaGetDeviceCount reports none)";
  return "";
}

// Device memory, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&p_, bytes) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

// Exactly representable gradients (multiples of 1/8 below 4): float sums and means over two
// workers are exact, and so is their bfloat16 encoding.
float Grad(int worker, int step, size_t i) {
  return static_cast<float>((worker + 1) * ((step % 5) + 1) * (static_cast<int>(i % 7) - 3)) *
         0.125f;
}

// One tensor of a worker: its host image, and device buffers when it lives on the GPU.
struct TensorSpec {
  const char* name;
  size_t elems;
  TensorDType dtype;
};
constexpr TensorSpec kTensors[] = {
    {"big", 300'000, TensorDType::kFloat32},  // 1.2 MB: 19 chunks, 2 pipeline pieces at 1 MiB
    {"odd", 1237, TensorDType::kFloat32},     // not a multiple of any piece or chunk
    {"half", 2049, TensorDType::kBFloat16},   // 16 bits on the wire, float32 masters
};
constexpr int kNumTensors = sizeof(kTensors) / sizeof(kTensors[0]);

size_t ElemBytes(TensorDType d) { return d == TensorDType::kFloat32 ? 4 : 2; }

struct WorkerTensor {
  std::vector<char> w, g;  // host images (the registered memory itself for host tensors)
  std::unique_ptr<DeviceBuffer> dw, dg;
};

// What one worker saw: every tensor's weights, as bytes, after every step.
using History = std::vector<std::vector<std::vector<char>>>;  // [step][tensor] -> bytes

struct RunSpec {
  std::string transport;
  bool cuda[2];  // per worker: device tensors (true) or host tensors
  uint64_t pipeline_bytes = 1u << 20;
};

constexpr int kSteps = 8;
constexpr float kLr = 0.5f;

// Two workers, BSP SGD (lr 0.5, averaged), kSteps steps; even steps with Step(), odd ones with
// PushMany, Clock and PullMany. Returns each worker's history.
void Train(const RunSpec& run, std::vector<History>* out) {
  ClusterSpec spec;
  spec.transport = run.transport;
  spec.servers = 2;
  spec.workers = 2;
  spec.partition_bytes = 64 << 10;
  spec.optimizer.lr = kLr;
  Cluster cluster(spec);
  out->assign(2, History());
  std::vector<std::thread> workers;
  for (int r = 0; r < 2; ++r) {
    workers.emplace_back([&, r] {
      ClientOptions o = cluster.WorkerOptions(r);
      o.cuda_pipeline_bytes = run.pipeline_bytes;
      auto c = Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      std::vector<WorkerTensor> ts(kNumTensors);
      std::vector<std::string> names;
      for (int k = 0; k < kNumTensors; ++k) {
        const TensorSpec& s = kTensors[k];
        const size_t bytes = s.elems * ElemBytes(s.dtype);
        WorkerTensor& t = ts[k];
        t.w.assign(bytes, 0);
        t.g.assign(bytes, 0);
        // Rank 0's initial weights become everyone's; the others start from garbage.
        for (size_t i = 0; i < s.elems; ++i) {
          const float v = r == 0 ? static_cast<float>(i % 11) - 5.0f : -99.0f;
          if (s.dtype == TensorDType::kFloat32) {
            std::memcpy(&t.w[i * 4], &v, 4);
          } else {
            const uint16_t h = FloatToBF16(v);
            std::memcpy(&t.w[i * 2], &h, 2);
          }
        }
        void* w = t.w.data();
        void* g = t.g.data();
        if (run.cuda[r]) {
          t.dw = std::make_unique<DeviceBuffer>(bytes);
          t.dg = std::make_unique<DeviceBuffer>(bytes);
          ASSERT_NE(t.dw->get(), nullptr);
          ASSERT_NE(t.dg->get(), nullptr);
          ASSERT_EQ(cudaMemcpy(t.dw->get(), t.w.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
          ASSERT_EQ(cudaMemset(t.dg->get(), 0, bytes), cudaSuccess);
          w = t.dw->get();
          g = t.dg->get();
        }
        ASSERT_TRUE((*c)->RegisterTensor(s.name, w, g, {static_cast<int64_t>(s.elems)}, s.dtype)
                        .ok());
        auto path = (*c)->tensor_path(s.name);
        ASSERT_TRUE(path.ok());
        EXPECT_EQ(*path, run.cuda[r] ? TensorPath::kCudaStaged : TensorPath::kHost)
            << s.name << " on " << run.transport;
        names.push_back(s.name);
      }
      Status st = (*c)->Start();
      ASSERT_TRUE(st.ok()) << st;
      const int me = static_cast<int>((*c)->rank());
      for (int step = 0; step < kSteps; ++step) {
        for (int k = 0; k < kNumTensors; ++k) {
          const TensorSpec& s = kTensors[k];
          WorkerTensor& t = ts[k];
          for (size_t i = 0; i < s.elems; ++i) {
            const float v = Grad(me, step, i + k);
            if (s.dtype == TensorDType::kFloat32) {
              std::memcpy(&t.g[i * 4], &v, 4);
            } else {
              const uint16_t h = FloatToBF16(v);
              std::memcpy(&t.g[i * 2], &h, 2);
            }
          }
          if (run.cuda[r]) {
            ASSERT_EQ(cudaMemcpy(t.dg->get(), t.g.data(), t.g.size(), cudaMemcpyHostToDevice),
                      cudaSuccess);
          }
        }
        if (step % 2 == 0) {
          st = (*c)->Step();
          ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
        } else {
          auto pushes = (*c)->PushMany(names);
          ASSERT_TRUE(pushes.ok()) << pushes.status();
          for (Handle h : *pushes) ASSERT_TRUE((*c)->Wait(h).ok());
          ASSERT_TRUE((*c)->Clock().ok());
          auto pulls = (*c)->PullMany(names);
          ASSERT_TRUE(pulls.ok()) << pulls.status();
          for (Handle h : *pulls) {
            st = (*c)->Wait(h);
            ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
          }
        }
        std::vector<std::vector<char>> seen(kNumTensors);
        for (int k = 0; k < kNumTensors; ++k) {
          WorkerTensor& t = ts[k];
          seen[k].assign(t.w.size(), 0);
          if (run.cuda[r]) {
            ASSERT_EQ(cudaMemcpy(seen[k].data(), t.dw->get(), seen[k].size(),
                                 cudaMemcpyDeviceToHost),
                      cudaSuccess);
          } else {
            seen[k] = t.w;
          }
        }
        (*out)[r].push_back(std::move(seen));
      }
      EXPECT_TRUE((*c)->Close().ok());
    });
  }
  for (auto& t : workers) t.join();
}

// The closed form of BSP SGD for float32 tensor k after `steps` steps, element i.
float Expected(int k, int steps, size_t i) {
  float w = static_cast<float>(i % 11) - 5.0f;
  for (int t = 0; t < steps; ++t) {
    const float mean = 0.5f * (Grad(0, t, i + k) + Grad(1, t, i + k));
    w = w - kLr * mean;
  }
  return w;
}

// (transport, worker 0 on the GPU, worker 1 on the GPU, pipeline piece bytes)
class CudaClusterTest
    : public ::testing::TestWithParam<std::tuple<std::string, bool, bool, uint64_t>> {
 protected:
  void SetUp() override {
    const std::string why = NoGpuReason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(CudaClusterTest, DeviceTensorsEndBitIdenticalToHostTensors) {
  const auto& [transport, cuda0, cuda1, pipeline] = GetParam();
  std::vector<History> host, dev;
  Train({transport, {false, false}, pipeline}, &host);
  ASSERT_FALSE(HasFatalFailure());
  Train({transport, {cuda0, cuda1}, pipeline}, &dev);
  ASSERT_FALSE(HasFatalFailure());
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(dev[r].size(), static_cast<size_t>(kSteps));
    for (int step = 0; step < kSteps; ++step) {
      for (int k = 0; k < kNumTensors; ++k) {
        const auto& d = dev[r][step][k];
        const auto& h = host[r][step][k];
        ASSERT_EQ(d.size(), h.size());
        if (std::memcmp(d.data(), h.data(), d.size()) != 0) {
          size_t at = 0;
          while (d[at] == h[at]) ++at;
          FAIL() << "worker " << r << " step " << step << " tensor " << kTensors[k].name
                 << ": device weights differ from the host run's at byte " << at;
        }
      }
    }
  }
  // And the host run is BSP SGD itself (float32 tensors; bf16 masters are float32 too, so its
  // pulled value is the rounded closed form).
  for (int k = 0; k < kNumTensors; ++k) {
    const TensorSpec& s = kTensors[k];
    const auto& got = dev[1][kSteps - 1][k];
    for (size_t i = 0; i < s.elems; ++i) {
      const float want = Expected(k, kSteps, i);
      if (s.dtype == TensorDType::kFloat32) {
        float v;
        std::memcpy(&v, &got[i * 4], 4);
        ASSERT_EQ(v, want) << s.name << "[" << i << "]";
      } else {
        uint16_t v;
        std::memcpy(&v, &got[i * 2], 2);
        ASSERT_EQ(v, FloatToBF16(want)) << s.name << "[" << i << "]";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transports, CudaClusterTest,
    ::testing::Values(std::make_tuple("tcp", true, true, uint64_t{1} << 20),
                      std::make_tuple("tcp", true, false, uint64_t{1} << 20),
                      std::make_tuple("tcp", true, true, uint64_t{4096}),
                      // Odd pieces, 656 to a 64 KiB chunk: more than the send queue holds
                      // (failed with "send queue full" before kOpCredit).
                      std::make_tuple("tcp", true, true, uint64_t{100}),
                      std::make_tuple("shm", true, true, uint64_t{100}),
                      std::make_tuple("shm", true, true, uint64_t{1} << 20),
                      std::make_tuple("shm", false, true, uint64_t{64} << 10)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + (std::get<1>(info.param) ? "gpu" : "host") + "_" +
             (std::get<2>(info.param) ? "gpu" : "host") + "_" +
             std::to_string(std::get<3>(info.param));
    });

// A trainer writes gradients with asynchronous work on the legacy default stream and calls
// Step() without synchronizing (as PyTorch does: its kernels run on that stream). The staging
// copies must be ordered after that work. The gradient's last writer is a device-to-device
// copy queued behind ~1 GB of memsets, so an unordered D2H copy would read the previous
// step's gradient.
class CudaStreamOrderTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = NoGpuReason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(CudaStreamOrderTest, PushSeesGradientsQueuedOnTheDefaultStream) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.servers = 1;
  spec.workers = 1;
  spec.partition_bytes = 1 << 20;
  spec.optimizer.lr = 1.0f;
  Cluster cluster(spec);
  constexpr size_t kN = 1 << 20;  // 4 MiB
  constexpr size_t kBytes = kN * 4;
  DeviceBuffer dw(kBytes), dg(kBytes), src(kBytes), scratch(size_t{1} << 30);
  ASSERT_NE(scratch.get(), nullptr);
  std::vector<float> host(kN, 0.0f);
  ASSERT_EQ(cudaMemcpy(dw.get(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dg.get(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->RegisterTensor("w", static_cast<float*>(dw.get()),
                                   static_cast<float*>(dg.get()), {static_cast<int64_t>(kN)})
                  .ok());
  ASSERT_TRUE((*c)->Start().ok());
  float expect = 0;
  for (int step = 1; step <= 5; ++step) {
    // This step's gradient: `step` everywhere, staged in src, then the slow work and the copy
    // into the registered gradient, all queued on the legacy default stream (0).
    std::fill(host.begin(), host.end(), static_cast<float>(step));
    ASSERT_EQ(cudaMemcpy(src.get(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(cudaMemsetAsync(scratch.get(), i, scratch.bytes(), 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(dg.get(), src.get(), kBytes, cudaMemcpyDeviceToDevice, 0),
              cudaSuccess);
    Status st = (*c)->Step();  // no cudaDeviceSynchronize before it
    ASSERT_TRUE(st.ok()) << st;
    expect -= static_cast<float>(step);
    ASSERT_EQ(cudaMemcpy(host.data(), dw.get(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < kN; i += 4099) {
      ASSERT_EQ(host[i], expect) << "step " << step << " element " << i;
    }
    ASSERT_EQ(host[kN - 1], expect) << "step " << step;
  }
  EXPECT_TRUE((*c)->Close().ok());
}

// PushMany starts the device->host copies of all its staged tensors before it pushes the
// first (PushPipeline::Prestart). When it fails part-way (here: "a" is refused, its previous
// push not waited for), "b" was copied but never pushed; the trainer then rewrites b's gradient
// and pushes it: the new gradient must travel, not the copy PushMany left behind.
TEST_P(CudaStreamOrderTest, APushManyThatFailsLeavesNoStaleCopyBehind) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.servers = 1;
  spec.workers = 1;
  spec.optimizer.lr = 1.0f;
  Cluster cluster(spec);
  constexpr size_t kN = 4096;
  constexpr size_t kBytes = kN * 4;
  DeviceBuffer wa(kBytes), ga(kBytes), wb(kBytes), gb(kBytes);
  std::vector<float> host(kN, 0.0f);
  for (void* p : {wa.get(), wb.get()}) {
    ASSERT_EQ(cudaMemcpy(p, host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::fill(host.begin(), host.end(), 1.0f);
  for (void* p : {ga.get(), gb.get()}) {
    ASSERT_EQ(cudaMemcpy(p, host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t n = static_cast<int64_t>(kN);
  ASSERT_TRUE((*c)->RegisterTensor("a", static_cast<float*>(wa.get()),
                                   static_cast<float*>(ga.get()), {n}).ok());
  ASSERT_TRUE((*c)->RegisterTensor("b", static_cast<float*>(wb.get()),
                                   static_cast<float*>(gb.get()), {n}).ok());
  ASSERT_TRUE((*c)->Start().ok());
  auto ha = (*c)->Push("a");
  ASSERT_TRUE(ha.ok()) << ha.status();
  auto many = (*c)->PushMany({"a", "b"});
  ASSERT_FALSE(many.ok());
  EXPECT_EQ(many.status().code(), StatusCode::kFailedPrecondition) << many.status();
  ASSERT_TRUE((*c)->Wait(*ha).ok());
  std::fill(host.begin(), host.end(), 5.0f);  // b's real gradient of this clock
  ASSERT_EQ(cudaMemcpy(gb.get(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto hb = (*c)->Push("b");
  ASSERT_TRUE(hb.ok()) << hb.status();
  ASSERT_TRUE((*c)->Wait(*hb).ok());
  ASSERT_TRUE((*c)->Clock().ok());
  auto pulls = (*c)->PullMany({"a", "b"});
  ASSERT_TRUE(pulls.ok()) << pulls.status();
  for (Handle h : *pulls) ASSERT_TRUE((*c)->Wait(h).ok());
  ASSERT_EQ(cudaMemcpy(host.data(), wa.get(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host[0], -1.0f);
  EXPECT_EQ(host[kN - 1], -1.0f);
  ASSERT_EQ(cudaMemcpy(host.data(), wb.get(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host[0], -5.0f) << "b pushed the gradient copied by the failed PushMany";
  EXPECT_EQ(host[kN - 1], -5.0f);
  EXPECT_TRUE((*c)->Close().ok());
}

// The control for PushSeesGradientsQueuedOnTheDefaultStream: the same queue, read by a copy on
// a non-blocking stream (what the staging would be if it were not ordered after the default
// stream), shows whether the race that test guards against is observable on this GPU.
// Informational: it logs how often the unordered copy read the old gradient.
TEST(CudaStreamOrderControl, AnUnorderedCopyCanReadTheOldGradient) {
  const std::string why = NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << why;
  constexpr size_t kBytes = 4u << 20;
  DeviceBuffer dg(kBytes), src(kBytes), scratch(size_t{1} << 30);
  ASSERT_NE(scratch.get(), nullptr);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), kBytes), cudaSuccess);
  cudaStream_t unordered;
  ASSERT_EQ(cudaStreamCreateWithFlags(&unordered, cudaStreamNonBlocking), cudaSuccess);
  int stale = 0;
  for (int round = 1; round <= 5; ++round) {
    ASSERT_EQ(cudaMemset(dg.get(), 0, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(src.get(), round, kBytes), cudaSuccess);
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(cudaMemsetAsync(scratch.get(), i, scratch.bytes(), 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(dg.get(), src.get(), kBytes, cudaMemcpyDeviceToDevice, 0),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(pinned, dg.get(), kBytes, cudaMemcpyDeviceToHost, unordered),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(unordered), cudaSuccess);
    const auto* b = reinterpret_cast<const unsigned char*>(pinned);
    stale += b[kBytes - 1] != static_cast<unsigned char>(round);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::printf("[ control ] an unordered D2H copy read the old gradient in %d of 5 rounds\n",
              stale);
  cudaStreamDestroy(unordered);
  cudaFreeHost(pinned);
}

INSTANTIATE_TEST_SUITE_P(Transports, CudaStreamOrderTest, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace shardps
