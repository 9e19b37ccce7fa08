// Row tables (embeddings) end to end, in one process: a coordinator, shard servers on their own
// threads and workers on theirs, over a real transport (tcp and shm here; verbs in the SoftRoCE
// guest). Every test asserts on the rows: their initial values, the values after N steps
// against a reference computed here, and the consistency bound of every read, per mode.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/row_init.h"
#include "wire/region_layout.h"
#include "shardps/client.h"
#include "tests/integration/hashed_table_model.h"
#include "tests/integration/in_process_cluster.h"

namespace shardps {
namespace {

using std::chrono::milliseconds;
using test::Cluster;
using test::ClusterSpec;
using test::SkipReason;

constexpr int64_t kRows = 1000;
constexpr int kDim = 8;

// The ids worker `r` touches at step `t` (duplicates included, shared hot rows 0..3).
std::vector<int64_t> BatchIds(int r, int t) {
  std::vector<int64_t> ids;
  std::mt19937 rng(static_cast<uint32_t>(7919 * r + 31 * t + 5));
  for (int i = 0; i < 24; ++i) ids.push_back(static_cast<int64_t>(rng() % kRows));
  ids.push_back(t % 4);        // a hot row every worker touches
  ids.push_back(t % 4);        // twice: summed in the worker
  ids.push_back(kRows - 1);    // the last row (the last shard's edge)
  return ids;
}
// Exactly representable gradients: every sum over workers and duplicates is exact in float.
float RowGrad(int r, int t, int64_t id, int j) {
  return static_cast<float>(((r + 1) * (t % 3 + 1) + static_cast<int>(id % 5) - j) % 7 - 3) * 0.125f;
}

class EmbeddingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// BSP over 2 servers and 4 workers, beside a dense tensor: every row after N steps equals the
// reference (the initial rows, then per step the average over the workers of the summed
// gradient rows, times lr), exactly; every read of a step sees exactly the previous steps.
TEST_P(EmbeddingTest, BspRowsAfterNStepsAreExact) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 4;
  spec.servers = 2;
  spec.optimizer.lr = 0.5f;
  Cluster cluster(spec);
  const int kSteps = 8;
  EmbeddingOptions eo;
  eo.max_ids = 64;
  eo.init = EmbeddingOptions::Init::kUniform;
  eo.init_scale = 0.5f;
  eo.init_seed = 42;
  // The reference table, step by step.
  std::vector<std::vector<float>> ref(kSteps + 1, std::vector<float>(kRows * kDim));
  for (int64_t id = 0; id < kRows; ++id) {
    InitRow(RowInitKind::kUniform, 0.5f, 42, static_cast<uint64_t>(id), kDim, &ref[0][id * kDim]);
  }
  for (int t = 0; t < kSteps; ++t) {
    std::map<int64_t, std::vector<float>> sum;
    for (int r = 0; r < spec.workers; ++r) {
      for (int64_t id : BatchIds(r, t)) {
        auto& g = sum[id];
        g.resize(kDim, 0.0f);
        for (int j = 0; j < kDim; ++j) g[j] += RowGrad(r, t, id, j);
      }
    }
    ref[t + 1] = ref[t];
    for (auto& [id, g] : sum) {
      for (int j = 0; j < kDim; ++j) {
        ref[t + 1][id * kDim + j] = ref[t][id * kDim + j] - 0.5f * (0.25f * g[j]);
      }
    }
  }
  std::atomic<int> mismatches{0};
  std::vector<std::vector<float>> final_rows(spec.workers);
  std::vector<uint64_t> control_delta(spec.workers, 99);
  std::vector<std::thread> workers;
  for (int r = 0; r < spec.workers; ++r) {
    workers.emplace_back([&, r] {
      std::vector<float> w(300), gw(300);
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterTensor("w", w.data(), gw.data(), {300}).ok());
      ASSERT_TRUE(cl.RegisterEmbedding("emb", kRows, kDim, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      const int me = static_cast<int>(cl.rank());
      uint64_t control0 = 0;
      for (int t = 0; t < kSteps; ++t) {
        if (t == 1) control0 = cl.counters().control_messages_sent;
        const std::vector<int64_t> ids = BatchIds(me, t);
        std::vector<float> rows(ids.size() * kDim);
        Status st = cl.PullRows("emb", ids.data(), ids.size(), rows.data());
        ASSERT_TRUE(st.ok()) << st;
        for (size_t i = 0; i < ids.size(); ++i) {
          for (int j = 0; j < kDim; ++j) {
            if (rows[i * kDim + j] != ref[t][ids[i] * kDim + j]) ++mismatches;
          }
        }
        std::vector<float> grads(ids.size() * kDim);
        for (size_t i = 0; i < ids.size(); ++i) {
          for (int j = 0; j < kDim; ++j) grads[i * kDim + j] = RowGrad(me, t, ids[i], j);
        }
        ASSERT_TRUE(cl.AddRowGradients("emb", ids.data(), ids.size(), grads.data()).ok());
        std::fill(gw.begin(), gw.end(), 0.25f);
        st = cl.Step();
        ASSERT_TRUE(st.ok()) << st;
      }
      control_delta[r] = cl.counters().control_messages_sent - control0;
      std::vector<int64_t> all(kRows);
      for (int64_t i = 0; i < kRows; ++i) all[i] = i;
      final_rows[r].resize(kRows * kDim);
      Status st = cl.PullRows("emb", all.data(), all.size(), final_rows[r].data());
      ASSERT_TRUE(st.ok()) << st;
      // The dense tensor trained beside it: 8 steps of lr 0.5 x 0.25.
      EXPECT_FLOAT_EQ(w[0], w[299]);
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(mismatches.load(), 0) << "a BSP read did not see exactly the steps before it";
  for (int r = 0; r < spec.workers; ++r) {
    ASSERT_EQ(final_rows[r].size(), ref[kSteps].size());
    int bad = 0;
    for (size_t i = 0; i < ref[kSteps].size(); ++i) bad += final_rows[r][i] != ref[kSteps][i];
    EXPECT_EQ(bad, 0) << "worker " << r << ": rows after " << kSteps << " steps differ";
    EXPECT_EQ(control_delta[r], 0u) << "steady-state steps sent control messages";
  }
}

// BSP sums one gradient per worker per clock. A trainer that pushes a table (or a tensor) itself
// and then calls Step() gets it sent once: Step leaves out what Push sent in that clock. Before,
// Step pushed the table again, empty (its rows had gone with the first push), the server took
// the second push of the clock in place of the first, and the step's row gradients were lost
// without an error. A second explicit push in one clock is refused, and so is a Step after
// rows were added behind the table's push.
TEST_P(EmbeddingTest, UnderBspAPushBeforeStepIsSentOnceAndASecondIsRefused) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 2;
  spec.servers = 2;
  spec.optimizer.lr = 0.5f;
  Cluster cluster(spec);
  EmbeddingOptions eo;
  eo.max_ids = 16;
  eo.init = EmbeddingOptions::Init::kUniform;
  eo.init_scale = 0.5f;
  eo.init_seed = 42;
  std::vector<float> init(kRows * kDim);
  for (int64_t id = 0; id < kRows; ++id) {
    InitRow(RowInitKind::kUniform, 0.5f, 42, static_cast<uint64_t>(id), kDim, &init[id * kDim]);
  }
  std::vector<std::vector<float>> after(2), after2(2);
  std::vector<float> w_after(2, 0.0f);
  std::vector<Status> second_push(2), second_many(2), late_rows(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      std::vector<float> w(300, 1.0f), gw(300, 0.0f);
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterTensor("w", w.data(), gw.data(), {300}).ok());
      ASSERT_TRUE(cl.RegisterEmbedding("emb", kRows, kDim, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      const int me = static_cast<int>(cl.rank());
      // Clock 0: both pushed by hand (rows 5 and 10 + rank, gradient 1), then Step.
      const std::vector<int64_t> ids = {5, 10 + me};
      std::vector<float> ones(ids.size() * kDim, 1.0f);
      ASSERT_TRUE(cl.AddRowGradients("emb", ids.data(), ids.size(), ones.data()).ok());
      std::fill(gw.begin(), gw.end(), 0.25f);
      StatusOr<std::vector<Handle>> hs = cl.PushMany({"emb", "w"});
      ASSERT_TRUE(hs.ok()) << hs.status();
      for (Handle h : *hs) ASSERT_TRUE(cl.Wait(h).ok());
      StatusOr<Handle> again = cl.Push("w");
      second_push[r] = again.status();
      second_many[r] = cl.PushMany({"emb"}).status();
      Status st = cl.Step();
      ASSERT_TRUE(st.ok()) << st;
      w_after[r] = w[0];
      const std::vector<int64_t> look = {5, 10, 11};
      after[r].resize(look.size() * kDim);
      st = cl.PullRows("emb", look.data(), look.size(), after[r].data());
      ASSERT_TRUE(st.ok()) << st;
      // Clock 1: the table pushed (empty), then rows added behind it: Step refuses, posting
      // nothing; the rows go with a push of the next clock.
      StatusOr<Handle> h = cl.Push("emb");
      ASSERT_TRUE(h.ok()) << h.status();
      ASSERT_TRUE(cl.Wait(*h).ok());
      ASSERT_TRUE(cl.AddRowGradients("emb", ids.data(), 1, ones.data()).ok());
      late_rows[r] = cl.Step();
      ASSERT_TRUE(cl.Clock().ok());
      st = cl.Step();  // clock 2: the late rows (row 5, gradient 1 from each worker)
      ASSERT_TRUE(st.ok()) << st;
      after2[r].resize(kDim);
      st = cl.PullRows("emb", ids.data(), 1, after2[r].data());
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(second_push[r].code(), StatusCode::kFailedPrecondition) << second_push[r];
    EXPECT_EQ(second_many[r].code(), StatusCode::kFailedPrecondition) << second_many[r];
    EXPECT_EQ(late_rows[r].code(), StatusCode::kFailedPrecondition) << late_rows[r];
    EXPECT_EQ(w_after[r], 1.0f - 0.5f * 0.25f) << "the dense tensor's clock 0, applied once";
    ASSERT_EQ(after[r].size(), 3u * kDim);
    for (int j = 0; j < kDim; ++j) {
      // Averaged over the 2 workers: row 5 got 1 + 1, rows 10 and 11 got 1 each.
      EXPECT_EQ(after[r][j], init[5 * kDim + j] - 0.5f * 1.0f) << "row 5, worker " << r;
      EXPECT_EQ(after[r][kDim + j], init[10 * kDim + j] - 0.5f * 0.5f) << "row 10";
      EXPECT_EQ(after[r][2 * kDim + j], init[11 * kDim + j] - 0.5f * 0.5f) << "row 11";
      EXPECT_EQ(after2[r][j], init[5 * kDim + j] - 0.5f * 1.0f - 0.5f * 1.0f) << "row 5, clock 2";
    }
  }
}

// A trainer that abandons a batch (a non-finite loss, say) zeroes its gradients: the rows it
// added must not reach the servers with the next step. ClearRowGradients drops them, and the
// squared norm (a global clipping norm's share) counts exactly the rows still pending,
// duplicates summed. Under BSP, rows added behind a table's push and then cleared let the clock
// step on (nothing is left behind the push).
TEST_P(EmbeddingTest, ClearedRowGradientsAreNeverPushedAndTheNormCountsThePendingRows) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 2;
  spec.servers = 2;
  spec.optimizer.lr = 0.5f;
  Cluster cluster(spec);
  EmbeddingOptions eo;
  eo.max_ids = 16;
  eo.init = EmbeddingOptions::Init::kZeros;
  std::vector<std::vector<float>> after(2);
  std::vector<double> norm_dup(2, -1), norm_cleared(2, -1), norm_scaled(2, -1);
  std::vector<Status> step_after_clear(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterEmbedding("emb", kRows, kDim, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      std::vector<float> ones(2 * kDim, 1.0f), twos(kDim, 2.0f);
      // Clock 0: rows 3 and 999 (both shards) added, row 3 twice; measured; dropped; row 20
      // added and stepped.
      const std::vector<int64_t> abandoned = {3, kRows - 1};
      ASSERT_TRUE(cl.AddRowGradients("emb", abandoned.data(), 2, ones.data()).ok());
      ASSERT_TRUE(cl.AddRowGradients("emb", abandoned.data(), 1, twos.data()).ok());
      StatusOr<double> sq = cl.RowGradientsSquaredNorm("emb");
      ASSERT_TRUE(sq.ok()) << sq.status();
      norm_dup[r] = *sq;  // row 3: 1 + 2 = 3 per value; row 999: 1
      StatusOr<bool> finite = cl.ScaleRowGradients("emb", 0.5f);
      ASSERT_TRUE(finite.ok() && *finite);
      norm_scaled[r] = *cl.RowGradientsSquaredNorm("emb");
      ASSERT_TRUE(cl.ClearRowGradients("emb").ok());
      norm_cleared[r] = *cl.RowGradientsSquaredNorm("emb");
      const int64_t twenty = 20;
      ASSERT_TRUE(cl.AddRowGradients("emb", &twenty, 1, ones.data()).ok());
      Status st = cl.Step();
      ASSERT_TRUE(st.ok()) << st;
      // Clock 1: the table pushed, rows added behind the push and cleared: Step goes on.
      StatusOr<Handle> h = cl.Push("emb");
      ASSERT_TRUE(h.ok()) << h.status();
      ASSERT_TRUE(cl.Wait(*h).ok());
      ASSERT_TRUE(cl.AddRowGradients("emb", abandoned.data(), 1, ones.data()).ok());
      ASSERT_TRUE(cl.ClearRowGradients("emb").ok());
      step_after_clear[r] = cl.Step();
      const std::vector<int64_t> look = {3, 20, kRows - 1};
      after[r].resize(look.size() * kDim);
      st = cl.PullRows("emb", look.data(), look.size(), after[r].data());
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(cl.ClearRowGradients("nope").code(), StatusCode::kNotFound);
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(norm_dup[r], kDim * (3.0 * 3.0 + 1.0)) << "duplicates summed before the norm";
    EXPECT_EQ(norm_scaled[r], kDim * (1.5 * 1.5 + 0.25));
    EXPECT_EQ(norm_cleared[r], 0.0);
    EXPECT_TRUE(step_after_clear[r].ok()) << step_after_clear[r];
    ASSERT_EQ(after[r].size(), 3u * kDim);
    for (int j = 0; j < kDim; ++j) {
      EXPECT_EQ(after[r][j], 0.0f) << "row 3: its gradients were dropped, worker " << r;
      EXPECT_EQ(after[r][kDim + j], -0.5f) << "row 20: one step, 1 from each worker, averaged";
      EXPECT_EQ(after[r][2 * kDim + j], 0.0f) << "row 999 (the other shard): dropped";
    }
  }
}

// The consistency bound of every row read, per mode: each worker's push adds 1 to row
// (100 + its rank) and to a shared row 7 (lr 1, sum, gradient -1, zero-initialised rows), so a
// row counts the pushes applied. At clock c a read must include every push of clocks < c - s
// (BSP: s = 0, exactly all of them; SSP: s; ASP: no bound, only the final count).
class EmbeddingModeTest
    : public ::testing::TestWithParam<std::tuple<std::string, control::ConsistencyMode>> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(std::get<0>(GetParam()));
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(EmbeddingModeTest, EveryReadHoldsTheModesBound) {
  ClusterSpec spec;
  spec.transport = std::get<0>(GetParam());
  spec.mode = std::get<1>(GetParam());
  spec.staleness = spec.mode == control::SSP ? 2 : 0;
  spec.workers = 3;
  spec.servers = 2;
  spec.optimizer.lr = 1.0f;
  spec.average = false;
  Cluster cluster(spec);
  const int kSteps = 20;
  EmbeddingOptions eo;
  eo.max_ids = 8;
  eo.init = EmbeddingOptions::Init::kZeros;
  std::atomic<int> violations{0};
  std::atomic<int> max_lead{0};
  std::vector<float> final_counts(spec.workers + 1, -1.0f);
  std::vector<std::thread> workers;
  for (int r = 0; r < spec.workers; ++r) {
    workers.emplace_back([&, r] {
      std::mt19937 rng(1000 + r);
      std::vector<float> w(16), gw(16);
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterTensor("w", w.data(), gw.data(), {16}).ok());
      ASSERT_TRUE(cl.RegisterEmbedding("counts", 200, 4, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      const int me = static_cast<int>(cl.rank());
      const std::vector<int64_t> rows = {100, 101, 102, 7};
      std::vector<float> got(rows.size() * 4);
      for (int t = 0; t < kSteps; ++t) {
        const int64_t mine[2] = {100 + me, 7};
        const std::vector<float> minus(8, -1.0f);
        ASSERT_TRUE(cl.AddRowGradients("counts", mine, 2, minus.data()).ok());
        std::this_thread::sleep_for(milliseconds(rng() % (me == 0 ? 20 : 5)));
        Status st = cl.Step();
        ASSERT_TRUE(st.ok()) << st;
        st = cl.PullRows("counts", rows.data(), rows.size(), got.data());
        ASSERT_TRUE(st.ok()) << st;
        const int64_t clock = static_cast<int64_t>(cl.clock());
        const int64_t s = spec.mode == control::ASP ? clock : spec.staleness;
        for (int k = 0; k < spec.workers; ++k) {
          const float n = got[k * 4];
          if (n < clock - s && violations++ < 3) {
            ADD_FAILURE() << "worker " << me << " clock " << clock << " row " << rows[k] << " count " << n;
          }
          max_lead = std::max<int>(max_lead, static_cast<int>(clock - n));
          for (int j = 1; j < 4; ++j) {
            if (got[k * 4 + j] != got[k * 4] && violations++ < 3) {  // a row is one version
              ADD_FAILURE() << "row " << rows[k] << " values " << got[k * 4] << " " << got[k * 4 + j];
            }
          }
        }
        if (spec.mode == control::BSP && got[3 * 4] != 3.0f * clock && violations++ < 3) {
          ADD_FAILURE() << "shared row " << got[12] << " at clock " << clock;
        }
      }
      // After every worker's last step: all pushes are in (BSP/SSP: the next reads wait).
      ASSERT_TRUE(cl.Clock().ok());
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(violations.load(), 0);
  if (spec.mode == control::SSP) {
    EXPECT_GE(max_lead.load(), 1) << "the bound was never exercised";
  }
}

// The worker cache (EmbeddingOptions::cache_rows) under SSP(s=3): reads it serves still hold
// the bound (the counting rows of EveryReadHoldsTheModesBound), and it does serve some: hits,
// with a reported staleness within s + 1 clocks (a row read at min clock m includes the clocks
// before m; the bound asks m >= clock - s).
TEST_P(EmbeddingTest, CacheServesRowsWithinTheBound) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.mode = control::SSP;
  spec.staleness = 3;
  spec.workers = 2;
  spec.servers = 2;
  spec.optimizer.lr = 1.0f;
  spec.average = false;
  Cluster cluster(spec);
  EmbeddingOptions eo;
  eo.max_ids = 8;
  eo.init = EmbeddingOptions::Init::kZeros;
  eo.cache_rows = 64;
  std::atomic<int> violations{0};
  std::vector<ClientCounters> counters(spec.workers);
  std::vector<std::thread> workers;
  for (int r = 0; r < spec.workers; ++r) {
    workers.emplace_back([&, r] {
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterEmbedding("counts", 200, 4, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      const int me = static_cast<int>(cl.rank());
      const std::vector<int64_t> rows = {100, 101, 50, 51};
      std::vector<float> got(rows.size() * 4);
      for (int t = 0; t < 30; ++t) {
        const int64_t mine = 100 + me;
        const std::vector<float> minus(4, -1.0f);
        ASSERT_TRUE(cl.AddRowGradients("counts", &mine, 1, minus.data()).ok());
        Status st = cl.Step();
        ASSERT_TRUE(st.ok()) << st;
        for (int rep = 0; rep < 2; ++rep) {  // the second read of a step: all hits
          st = cl.PullRows("counts", rows.data(), rows.size(), got.data());
          ASSERT_TRUE(st.ok()) << st;
          const int64_t clock = static_cast<int64_t>(cl.clock());
          for (int k = 0; k < 2; ++k) {
            if (got[k * 4] < clock - 3) ++violations;
          }
        }
      }
      counters[r] = cl.counters();
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(violations.load(), 0);
  for (const ClientCounters& k : counters) {
    EXPECT_GT(k.row_cache_hits, 60u);
    EXPECT_GT(k.row_cache_misses, 0u);
    EXPECT_LE(k.row_cache_staleness, 4 * k.row_cache_hits);
  }
}

// Bad input: each a clear error naming the table, nothing half-done, the client still running.
TEST_P(EmbeddingTest, BadInputIsAClearError) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 2;
  spec.optimizer.lr = 1.0f;
  Cluster cluster(spec);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 4;
  eo.init = EmbeddingOptions::Init::kZeros;
  EXPECT_EQ(cl.RegisterEmbedding("bad", 0, 4, TensorDType::kFloat32, eo).code(),
            StatusCode::kInvalidArgument);
  EmbeddingOptions zero = eo;
  zero.max_ids = 0;
  EXPECT_EQ(cl.RegisterEmbedding("bad", 10, 4, TensorDType::kFloat32, zero).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(cl.RegisterEmbedding("t", 50, 4, TensorDType::kFloat32, eo).ok());
  EXPECT_EQ(cl.RegisterEmbedding("t", 50, 4, TensorDType::kFloat32, eo).code(),
            StatusCode::kAlreadyExists);
  ASSERT_TRUE(cl.Start().ok());
  std::vector<float> out(4 * 4);
  const int64_t outside[2] = {3, 50};
  Status st = cl.PullRows("t", outside, 2, out.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("'t'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("50"), std::string::npos) << st;
  const int64_t negative = -1;
  EXPECT_EQ(cl.PullRows("t", &negative, 1, out.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cl.PullRows("nope", outside, 1, out.data()).code(), StatusCode::kNotFound);
  // max_ids 4 per shard (2 shards: ids even / odd): 5 distinct even ids are too many; nothing
  // is added, so the next push carries only what came before.
  const std::vector<float> ones(6 * 4, -1.0f);
  const int64_t ok_ids[1] = {1};
  ASSERT_TRUE(cl.AddRowGradients("t", ok_ids, 1, ones.data()).ok());
  const int64_t many[5] = {0, 2, 4, 6, 8};
  st = cl.AddRowGradients("t", many, 5, ones.data());
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("max_ids"), std::string::npos) << st;
  const int64_t bad_add[2] = {2, 50};  // 2 is in range, 50 is not: the call adds nothing
  st = cl.AddRowGradients("t", bad_add, 2, ones.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("50"), std::string::npos) << st;
  const int64_t dup[5] = {0, 0, 2, 2, 4};  // 3 distinct: fine
  ASSERT_TRUE(cl.AddRowGradients("t", dup, 5, ones.data()).ok());
  // A dense call on a table and a table call on nothing.
  EXPECT_EQ(cl.Pull("t").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cl.SetState("t", Client::StatePart::kWeights, 0).code(), StatusCode::kUnimplemented);
  UpdateRule momentum;
  momentum.kind = UpdateRule::Kind::kSgd;
  momentum.lr = 0.1f;
  momentum.momentum = 0.9f;
  st = cl.SetUpdateRule("t", momentum);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  ASSERT_TRUE(cl.Step().ok());
  const int64_t check[4] = {0, 1, 2, 4};
  ASSERT_TRUE(cl.PullRows("t", check, 4, out.data()).ok());
  EXPECT_EQ(out[0], 2.0f);   // row 0: -1 twice, lr 1
  EXPECT_EQ(out[4], 1.0f);   // row 1
  EXPECT_EQ(out[8], 2.0f);   // row 2
  EXPECT_EQ(out[12], 1.0f);  // row 4
  EXPECT_EQ(cl.counters().rows_pushed, 4u);
  EXPECT_TRUE(cl.Close().ok());
}

// A torn row (its crc does not match its bytes: what a reader racing the server's writer sees)
// is read again and never returned: while row 6 stays torn the pull fails at wait_timeout with
// an error naming the table and the crc, and copies nothing of that row; once it is whole
// again during a pull, the pull returns it as it was.
// One pull of many scattered rows over 2 servers: each shard's rows go in several read lists
// (a first one sent at once, full ones, a short last one; tcp 1,024 pieces per list, shm and
// verbs 256), beside runs of adjacent rows (one piece each) and duplicate ids. Every place of
// every id gets exactly its row's initial value.
TEST_P(EmbeddingTest, AScatteredPullOfManyListsReturnsEveryRow) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 2;
  Cluster cluster(spec);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  constexpr int64_t kTableRows = 40000;
  EmbeddingOptions eo;
  eo.max_ids = 64;
  eo.init = EmbeddingOptions::Init::kUniform;
  eo.init_scale = 1.0f;
  eo.init_seed = 7;
  ASSERT_TRUE(cl.RegisterEmbedding("t", kTableRows, kDim, TensorDType::kFloat32, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  std::vector<int64_t> ids;
  for (int64_t k = 0; k < 3000; ++k) ids.push_back(13 * k);        // never adjacent in a shard
  for (int64_t id = 39001; id < 39601; ++id) ids.push_back(id);     // runs of adjacent rows
  for (int k = 0; k < 150; ++k) ids.push_back(ids[static_cast<size_t>(k * 17)]);  // duplicates
  ids.push_back(kTableRows - 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(11));
  for (int round = 0; round < 3; ++round) {
    std::vector<float> out(ids.size() * kDim, -1.0f);
    Status st = cl.PullRows("t", ids.data(), ids.size(), out.data());
    ASSERT_TRUE(st.ok()) << st;
    int bad = 0;
    std::vector<float> want(kDim);
    for (size_t i = 0; i < ids.size(); ++i) {
      InitRow(RowInitKind::kUniform, 1.0f, 7, static_cast<uint64_t>(ids[i]), kDim, want.data());
      for (int j = 0; j < kDim; ++j) bad += out[i * kDim + j] != want[j];
    }
    EXPECT_EQ(bad, 0) << "round " << round << ": " << bad << " of " << out.size()
                      << " values are not their row's";
  }
  EXPECT_TRUE(cl.Close().ok());
}

TEST_P(EmbeddingTest, ATornRowIsReadAgainNeverReturned) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 1;
  Cluster cluster(spec);
  ClientOptions o = cluster.WorkerOptions(0);
  o.wait_timeout = milliseconds(2000);  // the mended pull below has 1.9 s to see the mend
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 16;
  eo.init = EmbeddingOptions::Init::kUniform;
  eo.init_scale = 1.0f;
  ASSERT_TRUE(cl.RegisterEmbedding("t", 64, kDim, TensorDType::kFloat32, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  const std::vector<int64_t> ids = {5, 6, 7, 6};
  std::vector<float> before(ids.size() * kDim);
  ASSERT_TRUE(cl.PullRows("t", ids.data(), ids.size(), before.data()).ok());
  // The one server's one slot holds the table; dense row 6 is its local row 6.
  char* rec = cluster.Server(0).RowRecordForTesting(0, 6);
  ASSERT_NE(rec, nullptr);
  uint64_t key;
  std::memcpy(&key, rec, sizeof(key));  // RowHeader: key, stamp, crc
  ASSERT_EQ(key, 6u);
  char* value3 = rec + sizeof(layout::RowHeader) + 3 * sizeof(float);
  float whole;
  std::memcpy(&whole, value3, sizeof(whole));
  ASSERT_EQ(whole, before[1 * kDim + 3]) << "the record is not the row pulled";
  const float torn_value = whole + 100.0f;
  std::memcpy(value3, &torn_value, sizeof(torn_value));
  const uint64_t retries0 = cl.counters().row_retries;
  std::vector<float> out(ids.size() * kDim, 0.0f);
  Status st = cl.PullRows("t", ids.data(), ids.size(), out.data());
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(st.message().find("'t'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("crc"), std::string::npos) << st;
  EXPECT_GT(cl.counters().row_retries, retries0 + 1);
  for (size_t k : {size_t{1}, size_t{3}}) {  // the two places of id 6
    for (int j = 0; j < kDim; ++j) EXPECT_EQ(out[k * kDim + j], 0.0f) << "torn bytes returned";
  }
  // Whole again 100 ms into the next pull: it returns the row as it was.
  std::thread mend([&] {
    std::this_thread::sleep_for(milliseconds(100));
    std::memcpy(value3, &whole, sizeof(whole));
  });
  st = cl.PullRows("t", ids.data(), ids.size(), out.data());
  mend.join();
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(out, before);
  EXPECT_TRUE(cl.Close().ok());
}

// Adagrad and lazy Adam (torch's sparse semantics) on one worker, against the rule computed
// here; rows never touched keep their initial value and their state.
TEST_P(EmbeddingTest, SparseOptimizersFollowTheirRule) {
  for (const UpdateRule::Kind kind : {UpdateRule::Kind::kAdagrad, UpdateRule::Kind::kAdam}) {
    ClusterSpec spec;
    spec.transport = GetParam();
    spec.workers = 1;
    spec.servers = 2;
    Cluster cluster(spec);
    auto c = Client::Connect(cluster.WorkerOptions(0));
    ASSERT_TRUE(c.ok()) << c.status();
    Client& cl = **c;
    EmbeddingOptions eo;
    eo.max_ids = 16;
    eo.init_seed = 9;
    ASSERT_TRUE(cl.RegisterEmbedding("t", 64, 4, TensorDType::kFloat32, eo).ok());
    ASSERT_TRUE(cl.Start().ok());
    UpdateRule rule;
    rule.kind = kind;
    rule.lr = 0.05f;
    rule.eps = kind == UpdateRule::Kind::kAdagrad ? 1e-10f : 1e-8f;
    rule.lr_decay = kind == UpdateRule::Kind::kAdagrad ? 0.01f : 0.0f;
    rule.initial_accumulator_value = kind == UpdateRule::Kind::kAdagrad ? 0.1f : 0.0f;
    ASSERT_TRUE(cl.SetUpdateRule("t", rule).ok());
    std::vector<double> w(64 * 4), s1(64 * 4, rule.initial_accumulator_value), s2(64 * 4, 0);
    std::vector<float> init(4);
    for (int64_t id = 0; id < 64; ++id) {
      InitRow(RowInitKind::kNormal, 1.0f, 9, static_cast<uint64_t>(id), 4, init.data());
      for (int j = 0; j < 4; ++j) w[id * 4 + j] = init[j];
    }
    std::vector<int> shard_steps(2, 0);
    for (int t = 0; t < 6; ++t) {
      const std::vector<int64_t> ids = {t % 3, 10 + t, 20, 20};  // row 20 twice: summed
      std::vector<float> g(ids.size() * 4);
      for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i * 7 + t) % 5) - 2.0f;
      ASSERT_TRUE(cl.AddRowGradients("t", ids.data(), ids.size(), g.data()).ok());
      ASSERT_TRUE(cl.Step().ok());
      std::map<int64_t, std::vector<double>> sum;
      for (size_t i = 0; i < ids.size(); ++i) {
        auto& v = sum[ids[i]];
        v.resize(4, 0.0);
        for (int j = 0; j < 4; ++j) v[j] += g[i * 4 + j];
      }
      // Every shard steps once per clock (every worker pushes every shard every step).
      for (int k = 0; k < 2; ++k) ++shard_steps[k];
      for (auto& [id, gv] : sum) {
        const double step = shard_steps[id % 2];
        for (int j = 0; j < 4; ++j) {
          double& x = w[id * 4 + j];
          const double gj = gv[j];
          if (kind == UpdateRule::Kind::kAdagrad) {
            s1[id * 4 + j] += gj * gj;
            const double clr = 0.05 / (1 + (step - 1) * 0.01);
            x -= clr * gj / (std::sqrt(s1[id * 4 + j]) + 1e-10);
          } else {
            double& m = s1[id * 4 + j];
            double& v = s2[id * 4 + j];
            m += (gj - m) * 0.1;
            v += (gj * gj - v) * 0.001;
            const double ss = 0.05 * std::sqrt(1 - std::pow(0.999, step)) / (1 - std::pow(0.9, step));
            x -= ss * m / (std::sqrt(v) + 1e-8);
          }
        }
      }
    }
    std::vector<int64_t> all(64);
    for (int64_t i = 0; i < 64; ++i) all[i] = i;
    std::vector<float> got(64 * 4);
    ASSERT_TRUE(cl.PullRows("t", all.data(), all.size(), got.data()).ok());
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - w[i]));
    EXPECT_LT(worst, 2e-5) << (kind == UpdateRule::Kind::kAdam ? "lazy adam" : "adagrad");
    // Untouched rows (30..63 but 20) are exactly their initial values.
    InitRow(RowInitKind::kNormal, 1.0f, 9, 50, 4, init.data());
    for (int j = 0; j < 4; ++j) EXPECT_EQ(got[50 * 4 + j], init[j]);
    EXPECT_TRUE(cl.Close().ok());
  }
}

// A 16-bit table: rows pulled in bfloat16 are the float32 master rounded; updates happen in
// float32 on the server.
TEST_P(EmbeddingTest, HalfPrecisionTableKeepsFloat32Master) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 2;
  spec.optimizer.lr = 1.0f;
  Cluster cluster(spec);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 4;
  eo.init = EmbeddingOptions::Init::kZeros;
  ASSERT_TRUE(cl.RegisterEmbedding("h", 10, 2, TensorDType::kBFloat16, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  // 1000 steps of +1/1024 (bfloat16 1/1024 = 0x3A80): a 16-bit accumulator would stall at
  // 0.25 (1 + 1/1024 rounds back), the float32 master reaches 1000/1024.
  const int64_t id = 3;
  const uint16_t g[2] = {0xBA80, 0xBA80};  // -1/1024
  for (int t = 0; t < 300; ++t) {
    ASSERT_TRUE(cl.AddRowGradients("h", &id, 1, g).ok());
    ASSERT_TRUE(cl.Step().ok());
  }
  uint16_t out[2] = {0, 0};
  ASSERT_TRUE(cl.PullRows("h", &id, 1, out).ok());
  // 300/1024 = 0.29296875 in bfloat16: 0x3E96 (0.29296875 exactly).
  EXPECT_EQ(out[0], 0x3E96) << std::hex << out[0];
  EXPECT_EQ(out[1], 0x3E96);
  EXPECT_TRUE(cl.Close().ok());
}

// A 16-bit table whose inbox slot holds one 16-bit entry (max_ids 1) cannot carry a float32 row,
// which its sets send: SetRows says so. It looped for ever before, each round committing an
// empty replicated set.
TEST_P(EmbeddingTest, ASetThatNoPushCanCarryIsRefused) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 1;
  Cluster cluster(spec);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 1;
  ASSERT_TRUE(cl.RegisterEmbedding("h", 10, 4, TensorDType::kFloat16, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  const int64_t id = 3;
  const float v[4] = {1, 2, 3, 4};
  const Status st = cl.SetRows("h", Client::StatePart::kWeights, &id, 1, v, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("max_ids >= 2"), std::string::npos) << st;
  // The table still trains: one row per push.
  const uint16_t g[4] = {0x3C00, 0x3C00, 0x3C00, 0x3C00};  // 1.0
  ASSERT_TRUE(cl.AddRowGradients("h", &id, 1, g).ok());
  ASSERT_TRUE(cl.Step().ok());
  EXPECT_TRUE(cl.Close().ok());
}

// Hashed ids: any 64-bit key (negative ones too), rows created on first touch inside a small
// capacity, evicted by the bucket's least recently updated row, admitted with probability p.
// Two workers, BSP, two servers; every key any worker ever touched is read after every step
// and compared, bit for bit, with HashedTableModel (the servers' policy and arithmetic in one
// process): a missed admission, a different victim or a wrong value shows.
class HashedTableTest : public ::testing::TestWithParam<std::tuple<std::string, float>> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(std::get<0>(GetParam()));
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(HashedTableTest, RowsFollowTheAdmissionAndEvictionPolicy) {
  const float admit = std::get<1>(GetParam());
  ClusterSpec spec;
  spec.transport = std::get<0>(GetParam());
  spec.workers = 2;
  spec.servers = 2;
  spec.optimizer.lr = 0.5f;
  Cluster cluster(spec);
  constexpr int kCapacity = 48, kDimH = 4, kSteps = 25;
  EmbeddingOptions eo;
  eo.hashed = true;
  eo.admit_probability = admit;
  eo.max_ids = 16;
  eo.init = EmbeddingOptions::Init::kUniform;
  eo.init_scale = 0.5f;
  eo.init_seed = 77;
  // Worker r's keys at step t: 3 fresh keys (large, some negative) and one of a few hot keys,
  // so buckets fill, hot rows stay recent and cold ones are evicted.
  auto keys_of = [](int r, int t) {
    std::vector<int64_t> k;
    for (int i = 0; i < 3; ++i) {
      const uint64_t x = SplitMix64(uint64_t(t) * 131 + uint64_t(r) * 17 + i);
      k.push_back(static_cast<int64_t>(i == 2 ? x | (1ull << 63) : x >> 1));
    }
    k.push_back(1000 + t % 3);
    return k;
  };
  auto grad_of = [](int r, int t, int64_t key, int j) {
    return static_cast<float>(((r + 1) * (t % 4 + 1) + static_cast<int>(key & 7) + j) % 5 - 2) *
           0.25f;
  };
  test::HashedTableModel model(kCapacity, 2, kDimH, RowInitKind::kUniform, 0.5f, 77, admit);
  std::vector<int64_t> seen;
  // The model, step by step: reads before the step's update, then per shard the BSP sum of the
  // workers' coalesced rows in rank order (keys in first-occurrence order).
  std::vector<std::vector<std::vector<float>>> expect(kSteps + 1);
  for (int t = 0; t <= kSteps; ++t) {
    for (int r = 0; r < spec.workers && t < kSteps; ++r) {
      for (int64_t k : keys_of(r, t)) {
        if (std::find(seen.begin(), seen.end(), k) == seen.end()) seen.push_back(k);
      }
    }
    for (int64_t k : seen) expect[t].push_back(model.Read(static_cast<uint64_t>(k)));
    if (t == kSteps) break;
    for (uint32_t shard = 0; shard < 2; ++shard) {
      std::vector<uint64_t> order;
      std::map<uint64_t, std::vector<float>> sum;
      for (int r = 0; r < spec.workers; ++r) {
        for (int64_t k : keys_of(r, t)) {
          const uint64_t key = static_cast<uint64_t>(k);
          if (model.ShardOf(key) != shard) continue;
          auto [it, fresh] = sum.try_emplace(key, std::vector<float>(kDimH, 0.0f));
          if (fresh) order.push_back(key);
          for (int j = 0; j < kDimH; ++j) it->second[j] += grad_of(r, t, k, j);
        }
      }
      std::vector<float> flat;
      for (uint64_t k : order) flat.insert(flat.end(), sum[k].begin(), sum[k].end());
      model.Apply(shard, order, flat, 0.5f, 0.5f);
    }
  }
  ASSERT_GT(model.evicted(), 10u) << "the test must exercise eviction";
  if (admit < 1.0f) {
    ASSERT_GT(model.rejected(), 5u) << "the test must exercise admission";
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> workers;
  for (int r = 0; r < spec.workers; ++r) {
    workers.emplace_back([&, r] {
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterEmbedding("h", kCapacity, kDimH, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      const int me = static_cast<int>(cl.rank());
      for (int t = 0; t <= kSteps; ++t) {
        // Every key touched by step t or before (step t's: before its update).
        const size_t known = expect[t].size();
        std::vector<int64_t> ids(seen.begin(), seen.begin() + static_cast<long>(known));
        std::vector<float> got(ids.size() * kDimH);
        Status st = cl.PullRows("h", ids.data(), ids.size(), got.data());
        ASSERT_TRUE(st.ok()) << st;
        for (size_t i = 0; i < ids.size(); ++i) {
          for (int j = 0; j < kDimH; ++j) {
            if (got[i * kDimH + j] != expect[t][i][j] && mismatches++ < 5) {
              ADD_FAILURE() << "worker " << me << " step " << t << " key " << ids[i] << "["
                            << j << "]: " << got[i * kDimH + j] << ", model "
                            << expect[t][i][j];
            }
          }
        }
        if (t == kSteps) break;
        const std::vector<int64_t> mine = keys_of(me, t);
        std::vector<float> g(mine.size() * kDimH);
        for (size_t i = 0; i < mine.size(); ++i) {
          for (int j = 0; j < kDimH; ++j) g[i * kDimH + j] = grad_of(me, t, mine[i], j);
        }
        ASSERT_TRUE(cl.AddRowGradients("h", mine.data(), mine.size(), g.data()).ok());
        st = cl.Step();
        ASSERT_TRUE(st.ok()) << st;
      }
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    TransportsAdmission, HashedTableTest,
    ::testing::Combine(::testing::Values("tcp", "shm", "verbs"), ::testing::Values(1.0f, 0.5f)),
    [](const auto& info) {
      return std::get<0>(info.param) + (std::get<1>(info.param) < 1.0f ? "_admit_half" : "_admit_all");
    });

INSTANTIATE_TEST_SUITE_P(Transports, EmbeddingTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(
    TransportsModes, EmbeddingModeTest,
    ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                       ::testing::Values(control::BSP, control::SSP, control::ASP)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" +
             control::ConsistencyMode_Name(std::get<1>(info.param));
    });

}  // namespace
}  // namespace shardps
