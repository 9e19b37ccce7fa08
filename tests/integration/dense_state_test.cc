// Dense tensors' state transfer from float32 values (Client::SetStateValues: shardps.torch's
// load_state_dict), end to end over a real transport (tcp and shm here; verbs in the SoftRoCE
// guest), for every element type. The property: a tensor's master weights, optimizer state and
// step count read with GetState and set with SetStateValues into a fresh cluster train on
// exactly as the original, bit for bit; for a 16-bit tensor too, whose float32 values travel
// in ranges of its inbox slot (layout::kPushF32Values). And a peer that rewrites such a push's
// range out of bounds gets it refused: nothing of it is applied, and the server keeps serving.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/half.h"
#include "shardps/client.h"
#include "tests/integration/fault_injecting_fabric.h"
#include "tests/integration/in_process_cluster.h"
#include "worker/client_testing.h"
#include "wire/region_layout.h"

namespace shardps {
namespace {

using test::Cluster;
using test::ClusterSpec;
using test::SkipReason;

// 700 elements over partition_bytes 1024: float32 chunks of 256 elements, 16-bit chunks of
// 512 (each set in two float32 pushes), and a short last chunk.
constexpr int kElems = 700;

const char* DTypeName(TensorDType d) {
  return d == TensorDType::kFloat32 ? "f32" : d == TensorDType::kFloat16 ? "f16" : "bf16";
}

// A tensor of `dtype` in a one-worker cluster; its buffers are float32 or 16-bit.
struct Trainer {
  std::unique_ptr<Cluster> cluster;
  std::unique_ptr<Client> client;
  TensorDType dtype;
  std::vector<float> w32, g32;
  std::vector<uint16_t> w16, g16;

  Trainer(const std::string& transport, TensorDType d) : dtype(d) {
    ClusterSpec spec;
    spec.transport = transport;
    spec.workers = 1;
    spec.servers = 2;
    spec.partition_bytes = 1024;
    cluster = std::make_unique<Cluster>(spec);
    auto c = Client::Connect(cluster->WorkerOptions(0));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return;
    client = std::move(c).value();
    // Initial weights of every dtype the same numbers (exact in 16 bits: multiples of 1/64).
    w32.resize(kElems);
    for (int i = 0; i < kElems; ++i) w32[i] = static_cast<float>(i % 37 - 18) / 64.0f;
    g32.assign(kElems, 0.0f);
    w16.resize(kElems);
    g16.assign(kElems, 0);
    for (int i = 0; i < kElems; ++i) {
      w16[i] = d == TensorDType::kBFloat16 ? FloatToBF16(w32[i]) : FloatToF16(w32[i]);
    }
    const Status st = d == TensorDType::kFloat32
                          ? client->RegisterTensor("w", w32.data(), g32.data(), {kElems})
                          : client->RegisterTensor("w", w16.data(), g16.data(), {kElems}, d);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(client->Start().ok());
    UpdateRule adam;
    adam.kind = UpdateRule::Kind::kAdam;
    adam.lr = 0.01f;
    EXPECT_TRUE(client->SetUpdateRule("w", adam).ok());
  }

  // Step t's gradient: not representable in 16 bits before the cast (the cast rounds it).
  void Train(int from, int to) {
    for (int t = from; t < to; ++t) {
      for (int i = 0; i < kElems; ++i) {
        const float g = static_cast<float>((i * 7 + t * 3) % 11 - 5) / 3.0f;
        if (dtype == TensorDType::kFloat32) g32[i] = g;
        else g16[i] = dtype == TensorDType::kBFloat16 ? FloatToBF16(g) : FloatToF16(g);
      }
      ASSERT_TRUE(client->Step().ok());
    }
  }

  struct State {
    std::vector<float> w, s1, s2;
    uint64_t steps = 0;
    bool has1 = false, has2 = false;
  };
  State Get() {
    State s;
    s.w.resize(kElems);
    s.s1.resize(kElems);
    s.s2.resize(kElems);
    const Status st = client->GetState("w", s.w.data(), s.s1.data(), s.s2.data(), &s.steps,
                                       &s.has1, &s.has2);
    EXPECT_TRUE(st.ok()) << st;
    return s;
  }
};

class DenseStateTest : public ::testing::TestWithParam<std::tuple<std::string, TensorDType>> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(std::get<0>(GetParam()));
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// Saved after 4 Adam steps, loaded into a fresh cluster, 3 more steps: the master weights,
// both moments and the step count equal those of 7 uninterrupted steps, bit for bit.
TEST_P(DenseStateTest, ATensorLoadedFromFloat32ValuesTrainsOnExactly) {
  const auto [transport, dtype] = GetParam();
  Trainer whole(transport, dtype);
  ASSERT_NE(whole.client, nullptr);
  whole.Train(0, 4);
  const Trainer::State saved = whole.Get();
  ASSERT_TRUE(saved.has1 && saved.has2);
  ASSERT_EQ(saved.steps, 4u);
  // The moments of 16-bit gradients are not 16-bit numbers: a set rounded to the tensor's
  // dtype would lose them (the test must be able to tell).
  int inexact = 0;
  for (float v : saved.s1) inexact += BF16ToFloat(FloatToBF16(v)) != v;
  ASSERT_GT(inexact, kElems / 2);
  whole.Train(4, 7);
  const Trainer::State want = whole.Get();
  EXPECT_TRUE(whole.client->Close().ok());

  Trainer resumed(transport, dtype);
  ASSERT_NE(resumed.client, nullptr);
  Client& c = *resumed.client;
  ASSERT_TRUE(c.SetStateValues("w", Client::StatePart::kWeights, saved.w.data(), 0).ok());
  ASSERT_TRUE(c.SetStateValues("w", Client::StatePart::kState1, saved.s1.data(), 4).ok());
  ASSERT_TRUE(c.SetStateValues("w", Client::StatePart::kState2, saved.s2.data(), 4).ok());
  const Trainer::State loaded = resumed.Get();
  EXPECT_EQ(loaded.w, saved.w);
  EXPECT_EQ(loaded.s1, saved.s1);
  EXPECT_EQ(loaded.s2, saved.s2);
  EXPECT_EQ(loaded.steps, 4u);
  // The pull after the set delivers the master rounded to the tensor's dtype.
  auto h = c.Pull("w");
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(c.Wait(*h).ok());
  for (int i = 0; i < kElems; ++i) {
    const float m = saved.w[i];
    if (dtype == TensorDType::kFloat32) {
      ASSERT_EQ(resumed.w32[i], m) << i;
    } else {
      ASSERT_EQ(resumed.w16[i], dtype == TensorDType::kBFloat16 ? FloatToBF16(m) : FloatToF16(m))
          << i;
    }
  }
  resumed.Train(4, 7);
  const Trainer::State got = resumed.Get();
  EXPECT_EQ(got.w, want.w);
  EXPECT_EQ(got.s1, want.s1);
  EXPECT_EQ(got.s2, want.s2);
  EXPECT_EQ(got.steps, want.steps);
  EXPECT_TRUE(c.Close().ok());
}

// Bad input: kNoState, a null pointer and a row table are refused before anything moves, and
// the gradient buffer is not touched.
TEST_P(DenseStateTest, SetStateValuesRefusesWhatItCannotSet) {
  const auto [transport, dtype] = GetParam();
  Trainer t(transport, dtype);
  ASSERT_NE(t.client, nullptr);
  Client& c = *t.client;
  std::vector<float> v(kElems, 0.25f);
  EXPECT_EQ(c.SetStateValues("w", Client::StatePart::kNoState, v.data(), 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.SetStateValues("w", Client::StatePart::kWeights, nullptr, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.SetStateValues("nope", Client::StatePart::kWeights, v.data(), 0).code(),
            StatusCode::kNotFound);
  for (int i = 0; i < kElems; ++i) t.g32[i] = 3.0f, t.g16[i] = 0x1234;
  ASSERT_TRUE(c.SetStateValues("w", Client::StatePart::kWeights, v.data(), 0).ok());
  for (int i = 0; i < kElems; ++i) {
    ASSERT_EQ(t.g32[i], 3.0f);
    ASSERT_EQ(t.g16[i], 0x1234);
  }
  EXPECT_EQ(t.Get().w, v);
  EXPECT_TRUE(c.Close().ok());
}

INSTANTIATE_TEST_SUITE_P(
    Transports, DenseStateTest,
    ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                       ::testing::Values(TensorDType::kFloat32, TensorDType::kFloat16,
                                         TensorDType::kBFloat16)),
    [](const auto& info) {
      return std::get<0>(info.param) + std::string("_") + DTypeName(std::get<1>(info.param));
    });

// A client over `fault`'s injecting fabric, or a plain one when fault is null.
StatusOr<std::unique_ptr<Client>> ConnectMaybeFaulty(const ClientOptions& o,
                                                     const test::FaultOptions* fault) {
  if (fault == nullptr) return Client::Connect(o);
  auto fabric = transport::Fabric::Open(worker::ClientFabricOptions(o));
  if (!fabric.ok()) return fabric.status();
  return worker::ConnectOverFabric(
      o, std::make_unique<test::FaultInjectingFabric>(std::move(*fabric), *fault));
}

class DenseStateAttackTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// Worker 0's fabric rewrites its float32-values pushes once armed: the range runs past the
// chunk's end. The server refuses them (nothing applied, no acknowledgement, so worker 0's
// set times out), and worker 1 then reads the values set before, exactly, and sets new ones.
TEST_P(DenseStateAttackTest, AnOutOfRangeFloat32SetIsRefusedAndAppliesNothing) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 2;
  spec.servers = 1;
  spec.partition_bytes = 1 << 20;  // one chunk
  Cluster cluster(spec);
  std::atomic<bool> armed{false};
  std::atomic<int> rewritten{0};
  std::atomic<int> phase{0};
  std::vector<float> a(kElems), b(kElems, 9.0f), cvals(kElems, -2.5f), seen(kElems, 0.0f);
  for (int i = 0; i < kElems; ++i) a[i] = 1.0f + static_cast<float>(i) / 4096.0f;  // not bf16
  Status bad_set = Status::OK();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      ClientOptions o = cluster.WorkerOptions(r);
      std::unique_ptr<Client> owned;
      test::FaultOptions owned_fault;
      if (r == 0) {
        o.wait_timeout = std::chrono::milliseconds(4000);  // the refused set waits this long
        test::FaultOptions fault;
        fault.rewrite = [&](char* data, uint64_t length, uint32_t) {
          if (!armed.load() || length < sizeof(layout::PushHeader)) return;
          auto* ph = reinterpret_cast<layout::PushHeader*>(data);
          if (ph->magic != layout::kPushMagic || (ph->flags & layout::kPushF32Values) == 0) return;
          // Ten values from the end: the push's bytes / 4 values run past the chunk.
          ph->first = kElems - 10;
          rewritten.fetch_add(1);
        };
        owned_fault = fault;
      }
      auto c = ConnectMaybeFaulty(o, r == 0 ? &owned_fault : nullptr);
      ASSERT_TRUE(c.ok()) << c.status();
      owned = std::move(c).value();
      Client& cl = *owned;
      std::vector<uint16_t> w(kElems, 0), g(kElems, 0);
      ASSERT_TRUE(cl.RegisterTensor("w", w.data(), g.data(), {kElems}, TensorDType::kBFloat16).ok());
      ASSERT_TRUE(cl.Start().ok());
      if (cl.rank() == 0) {
        ASSERT_TRUE(cl.SetStateValues("w", Client::StatePart::kWeights, a.data(), 0).ok());
        armed = true;
        bad_set = cl.SetStateValues("w", Client::StatePart::kWeights, b.data(), 0);
        phase = 1;
        while (phase.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      } else {
        while (phase.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ASSERT_TRUE(cl.GetState("w", seen.data(), nullptr, nullptr, nullptr, nullptr, nullptr).ok());
        // The server still takes sets from a peer that behaves.
        ASSERT_TRUE(cl.SetStateValues("w", Client::StatePart::kWeights, cvals.data(), 0).ok());
        std::vector<float> after(kElems);
        ASSERT_TRUE(cl.GetState("w", after.data(), nullptr, nullptr, nullptr, nullptr, nullptr).ok());
        EXPECT_EQ(after, cvals);
        phase = 2;
      }
      cl.Close().IgnoreError();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_GE(rewritten.load(), 1);
  EXPECT_FALSE(bad_set.ok()) << "the refused set was never acknowledged";
  EXPECT_EQ(seen, a) << "nothing of the refused set was applied";
}

// BSP sums a clock's pushes once every worker has pushed, straight from the inbox slots, which
// stay writable by their workers until the clock is published. Worker 0 pushes with lr 0.5 and,
// while the clock waits for worker 1, writes its push's header again with lr 1000 (a valid
// rule, so only the value tells). The server must apply the rule it checked when it took the
// push; before, it read the header again at the sum and applied lr 1000 (and a rewritten
// invalid rule unchecked, which the backup then refused, breaking replication).
TEST_P(DenseStateAttackTest, ARuleRewrittenAfterItsPushWasTakenIsNotApplied) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 2;
  spec.servers = 1;
  spec.partition_bytes = 4096;  // one chunk of kElems floats
  Cluster cluster(spec);
  std::atomic<bool> armed{false};
  std::atomic<bool> rewritten{false};
  std::atomic<int64_t> kept_at_ms{0};
  auto now_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::vector<std::vector<float>> final_w(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      ClientOptions o = cluster.WorkerOptions(r);
      std::unique_ptr<Client> owned;
      test::FaultOptions owned_fault;
      if (r == 0) {
        test::FaultOptions fault;
        fault.keep = [&](const char* data, uint64_t length, uint32_t imm) {
          if (!armed.load() || kept_at_ms.load() != 0 || length < sizeof(layout::PushHeader) ||
              (imm >> 28) != static_cast<uint32_t>(layout::ImmKind::kPush)) {
            return false;
          }
          layout::PushHeader ph;
          std::memcpy(&ph, data, sizeof(ph));
          if (ph.magic != layout::kPushMagic) return false;
          kept_at_ms = now_ms();
          return true;
        };
        // Long after the push was taken (the server handles a push within microseconds of
        // its arrival), while the clock still waits for worker 1.
        fault.rewrite_now = [&] {
          return kept_at_ms.load() != 0 && now_ms() - kept_at_ms.load() >= 150;
        };
        fault.change = [&](char* data, uint64_t) {
          auto* ph = reinterpret_cast<layout::PushHeader*>(data);
          ph->rule.lr = 1000.0f;
          rewritten = true;
        };
        owned_fault = fault;
      }
      auto c = ConnectMaybeFaulty(o, r == 0 ? &owned_fault : nullptr);
      ASSERT_TRUE(c.ok()) << c.status();
      owned = std::move(c).value();
      Client& cl = *owned;
      std::vector<float> w(kElems, 1.0f), g(kElems, 0.0f);
      ASSERT_TRUE(cl.RegisterTensor("w", w.data(), g.data(), {kElems}).ok());
      ASSERT_TRUE(cl.Start().ok());
      UpdateRule sgd;
      sgd.kind = UpdateRule::Kind::kSgd;
      sgd.lr = 0.5f;
      ASSERT_TRUE(cl.SetUpdateRule("w", sgd).ok());
      std::fill(g.begin(), g.end(), 1.0f);
      if (cl.rank() == 0) {
        armed = true;
      } else {
        // Worker 1 pushes only once worker 0 has rewritten its header (or after 10 s).
        for (int i = 0; i < 10000 && !rewritten.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      Status st = cl.Step();
      ASSERT_TRUE(st.ok()) << st;
      final_w[cl.rank()] = w;
      cl.Close().IgnoreError();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_TRUE(rewritten.load()) << "worker 0's pull posted no read after the rewrite time";
  const std::vector<float> want(kElems, 1.0f - 0.5f * 1.0f);  // lr 0.5, the average of 1 and 1
  EXPECT_EQ(final_w[0], want) << "the rule applied is not the one checked when taken";
  EXPECT_EQ(final_w[1], want);
}

// A push whose post the provider refuses (the session stays healthy) leaves its chunk as it
// was: a row shard's rows stay pending, and the sequence number is not spent. BSP, one worker,
// a table over 2 servers: Push(table) posts shard 0's push and has shard 1's refused; Step()
// then pushes shard 1 only, with its rows. Before, the refused shard's rows had already left
// pending for the staging, so Step pushed it empty and its rows were lost.
TEST_P(DenseStateAttackTest, ARefusedPostLosesNoRowsAndTheNextPushSendsThem) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 2;
  spec.optimizer.lr = 0.5f;
  Cluster cluster(spec);
  std::atomic<bool> armed{false};
  std::atomic<int> pushes_seen{0}, refused{0};
  test::FaultOptions fault;
  fault.refuse = [&](const char* data, uint64_t length, uint32_t imm) {
    if (!armed.load() || length < sizeof(layout::PushHeader) ||
        (imm >> 28) != static_cast<uint32_t>(layout::ImmKind::kPush)) {
      return false;
    }
    layout::PushHeader ph;
    std::memcpy(&ph, data, sizeof(ph));
    if (ph.magic != layout::kPushMagic || pushes_seen.fetch_add(1) != 1) return false;
    ++refused;
    return true;  // the table's second shard push after arming
  };
  auto c = ConnectMaybeFaulty(cluster.WorkerOptions(0), &fault);
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 64;
  eo.init = EmbeddingOptions::Init::kZeros;
  constexpr int kDim = 4;
  ASSERT_TRUE(cl.RegisterEmbedding("emb", 100, kDim, TensorDType::kFloat32, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  std::vector<int64_t> ids(20);
  for (int i = 0; i < 20; ++i) ids[i] = 5 * i;  // rows on both shards
  const std::vector<float> ones(ids.size() * kDim, 1.0f);
  ASSERT_TRUE(cl.AddRowGradients("emb", ids.data(), ids.size(), ones.data()).ok());
  armed = true;
  StatusOr<Handle> h = cl.Push("emb");
  ASSERT_TRUE(h.ok()) << h.status();
  const Status failed = cl.Wait(*h);
  EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed;
  EXPECT_EQ(refused.load(), 1);
  Status st = cl.Step();  // the refused shard's push, with its rows
  ASSERT_TRUE(st.ok()) << st;
  std::vector<float> rows(ids.size() * kDim, 99.0f);
  st = cl.PullRows("emb", ids.data(), ids.size(), rows.data());
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(rows, std::vector<float>(ids.size() * kDim, -0.5f)) << "every row once, lr 0.5";
  EXPECT_EQ(refused.load(), 1);
  EXPECT_TRUE(cl.Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, DenseStateAttackTest,
                         ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
