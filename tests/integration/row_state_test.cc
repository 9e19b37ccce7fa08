// Row tables' state transfer (Client::SetRows / GetRows / TableKeys: shardps.torch's Embedding
// state_dict / load_state_dict), end to end in one process over a real transport (tcp and shm
// here; verbs in the SoftRoCE guest). The property: a table saved from one cluster and loaded
// into a fresh one trains on exactly as the original does, bit for bit (weights, optimizer
// state and step count), for dense and hashed ids, over shards and batches of max_ids.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/half.h"
#include "common/row_init.h"
#include "shardps/client.h"
#include "tests/integration/in_process_cluster.h"
#include "wire/region_layout.h"

namespace shardps {
namespace {

using test::Cluster;
using test::ClusterSpec;
using test::SkipReason;

class RowStateTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

constexpr int kDim = 4;

// One worker's client of a fresh cluster (2 servers) with one row table.
struct OneWorker {
  std::unique_ptr<Cluster> cluster;
  std::unique_ptr<Client> client;
};
OneWorker Start(const std::string& transport, int64_t rows, bool hashed, TensorDType dtype,
                const UpdateRule& rule, control::ConsistencyMode mode = control::BSP,
                uint32_t staleness = 0) {
  ClusterSpec spec;
  spec.transport = transport;
  spec.mode = mode;
  spec.staleness = staleness;
  spec.workers = 1;
  spec.servers = 2;
  OneWorker w;
  w.cluster = std::make_unique<Cluster>(spec);
  auto c = Client::Connect(w.cluster->WorkerOptions(0));
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return w;
  w.client = std::move(c).value();
  EmbeddingOptions eo;
  eo.max_ids = 16;  // a save or load of more rows per shard goes in several pushes
  eo.init_seed = 5;
  eo.hashed = hashed;
  EXPECT_TRUE(w.client->RegisterEmbedding("t", rows, kDim, dtype, eo).ok());
  EXPECT_TRUE(w.client->Start().ok());
  EXPECT_TRUE(w.client->SetUpdateRule("t", rule).ok());
  return w;
}

// Step t's ids (some rows twice: summed by the worker) and float32 gradients.
std::vector<int64_t> StepIds(int t, bool hashed) {
  std::vector<int64_t> ids;
  for (int i = 0; i < 12; ++i) {
    const int64_t id = (t * 37 + i * 11) % 90;
    ids.push_back(hashed ? id * 1000003 - 7 : id);
  }
  ids.push_back(ids[0]);
  return ids;
}
void TrainSteps(Client& c, int from, int to, bool hashed,
                TensorDType dtype = TensorDType::kFloat32) {
  for (int t = from; t < to; ++t) {
    const std::vector<int64_t> ids = StepIds(t, hashed);
    std::vector<float> g(ids.size() * kDim);
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i * 5 + t) % 7) * 0.25f - 0.7f;
    if (dtype == TensorDType::kBFloat16) {
      std::vector<uint16_t> g16(g.size());
      for (size_t i = 0; i < g.size(); ++i) g16[i] = FloatToBF16(g[i]);  // its dtype's
      ASSERT_TRUE(c.AddRowGradients("t", ids.data(), ids.size(), g16.data()).ok());
    } else {
      ASSERT_TRUE(c.AddRowGradients("t", ids.data(), ids.size(), g.data()).ok());
    }
    ASSERT_TRUE(c.Step().ok());
  }
}

struct Saved {
  std::vector<int64_t> ids;
  std::vector<float> w, s1, s2;
  Client::RowStateInfo info;
};
Saved Save(Client& c, int64_t rows, bool hashed) {
  Saved s;
  if (hashed) {
    auto keys = c.TableKeys("t");
    EXPECT_TRUE(keys.ok()) << keys.status();
    if (keys.ok()) s.ids = *keys;
  } else {
    for (int64_t i = 0; i < rows; ++i) s.ids.push_back(i);
  }
  const size_t n = s.ids.size();
  s.w.resize(n * kDim);
  s.s1.resize(n * kDim);
  s.s2.resize(n * kDim);
  const Status st = c.GetRows("t", s.ids.data(), n, s.w.data(), s.s1.data(), s.s2.data(), &s.info);
  EXPECT_TRUE(st.ok()) << st;
  return s;
}
void Load(Client& c, const Saved& s) {
  const size_t n = s.ids.size();
  ASSERT_TRUE(c.SetRows("t", Client::StatePart::kWeights, s.ids.data(), n, s.w.data(), 0).ok());
  if (s.info.has1) {
    ASSERT_TRUE(c.SetRows("t", Client::StatePart::kState1, s.ids.data(), n, s.s1.data(),
                          s.info.steps).ok());
  }
  if (s.info.has2) {
    ASSERT_TRUE(c.SetRows("t", Client::StatePart::kState2, s.ids.data(), n, s.s2.data(),
                          s.info.steps).ok());
  }
}

// Save after 5 steps, load into a fresh cluster, 5 more steps on both: equal bit for bit, for
// lazy Adam (two state buffers and the step count's bias correction) and Adagrad. The steps'
// gradients do not depend on the rows read, so with one worker the rows after a step are the
// same in every mode (its pushes apply in order): under SSP and ASP too, a load must carry
// exactly the state that the saved table's next steps start from.
void ExpectALoadedTableTrainsOnExactlyAsTheSavedOne(const std::string& transport,
                                                    control::ConsistencyMode mode,
                                                    uint32_t staleness,
                                                    TensorDType dtype = TensorDType::kFloat32) {
  for (const bool hashed : {false, true}) {
    for (const UpdateRule::Kind kind : {UpdateRule::Kind::kAdam, UpdateRule::Kind::kAdagrad}) {
      SCOPED_TRACE(std::string(hashed ? "hashed " : "dense ") +
                   (kind == UpdateRule::Kind::kAdam ? "adam" : "adagrad"));
      UpdateRule rule;
      rule.kind = kind;
      rule.lr = 0.05f;
      rule.initial_accumulator_value = kind == UpdateRule::Kind::kAdagrad ? 0.1f : 0.0f;
      // Hashed: a capacity with room for every key (eviction order depends on the rows'
      // recency, which a load does not carry: docs/embeddings.md).
      const int64_t rows = hashed ? 1024 : 100;
      OneWorker a = Start(transport, rows, hashed, dtype, rule, mode, staleness);
      ASSERT_NE(a.client, nullptr);
      TrainSteps(*a.client, 0, 5, hashed, dtype);
      const Saved saved = Save(*a.client, rows, hashed);
      ASSERT_EQ(saved.info.steps, 5u) << "each shard steps once per clock";
      ASSERT_TRUE(saved.info.has1);
      ASSERT_EQ(saved.info.has2, kind == UpdateRule::Kind::kAdam);
      if (hashed) {
        std::vector<int64_t> touched;
        for (int t = 0; t < 5; ++t) {
          for (int64_t k : StepIds(t, true)) touched.push_back(k);
        }
        std::sort(touched.begin(), touched.end());
        touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
        std::vector<int64_t> listed = saved.ids;
        std::sort(listed.begin(), listed.end());
        ASSERT_EQ(listed, touched) << "TableKeys lists exactly the keys holding a row";
      }
      OneWorker b = Start(transport, rows, hashed, dtype, rule, mode, staleness);
      ASSERT_NE(b.client, nullptr);
      Load(*b.client, saved);
      // The loaded state reads back as saved.
      const Saved again = Save(*b.client, rows, hashed);
      EXPECT_EQ(again.w, saved.w) << "the float32 (master) rows read back as saved";
      EXPECT_EQ(again.s1, saved.s1);
      EXPECT_EQ(again.s2, saved.s2);
      EXPECT_EQ(again.info.steps, saved.info.steps);
      TrainSteps(*a.client, 5, 10, hashed, dtype);
      TrainSteps(*b.client, 5, 10, hashed, dtype);
      const Saved fa = Save(*a.client, rows, hashed), fb = Save(*b.client, rows, hashed);
      if (dtype == TensorDType::kFloat32) {
        std::vector<float> pa(fa.w.size()), pb(fb.w.size());
        ASSERT_TRUE(a.client->PullRows("t", fa.ids.data(), fa.ids.size(), pa.data()).ok());
        ASSERT_TRUE(b.client->PullRows("t", fa.ids.data(), fa.ids.size(), pb.data()).ok());
        EXPECT_EQ(pa, fa.w) << "a pull reads what GetRows read";
        EXPECT_EQ(pb, pa) << "the loaded table trained differently";
      } else {
        // The 16-bit rows workers read, rounded from the float32 master.
        std::vector<uint16_t> pa(fa.w.size()), pb(fb.w.size());
        ASSERT_TRUE(a.client->PullRows("t", fa.ids.data(), fa.ids.size(), pa.data()).ok());
        ASSERT_TRUE(b.client->PullRows("t", fa.ids.data(), fa.ids.size(), pb.data()).ok());
        EXPECT_EQ(pb, pa) << "the loaded table's 16-bit rows differ";
        EXPECT_EQ(fb.w, fa.w) << "the loaded table's float32 master trained differently";
      }
      EXPECT_EQ(fb.s1, fa.s1);
      EXPECT_EQ(fb.s2, fa.s2);
      EXPECT_NE(fa.w, saved.w) << "the steps after the load must change the rows";
      EXPECT_TRUE(a.client->Close().ok());
      EXPECT_TRUE(b.client->Close().ok());
    }
  }
}

TEST_P(RowStateTest, ALoadedTableTrainsOnExactlyAsTheSavedOne) {
  ExpectALoadedTableTrainsOnExactlyAsTheSavedOne(GetParam(), control::BSP, 0);
}

// The same for a bfloat16 table: its float32 master and state rows are saved (GetRows reads
// float32) and set back exactly (SetRows sends float32 rows, kPushF32Rows), so the loaded
// table trains on bit for bit, master and 16-bit rows alike. (Before, a set sent the rows in
// the table's dtype: the master and the optimizer state came back rounded to 16 bits.)
TEST_P(RowStateTest, AHalfPrecisionTableResumesBitForBit) {
  ExpectALoadedTableTrainsOnExactlyAsTheSavedOne(GetParam(), control::BSP, 0,
                                                 TensorDType::kBFloat16);
}

// The same property under SSP (staleness 2) and ASP, over every transport.
class RowStateModeTest
    : public ::testing::TestWithParam<std::tuple<std::string, control::ConsistencyMode>> {
 protected:
  void SetUp() override {
    const std::string why = SkipReason(std::get<0>(GetParam()));
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(RowStateModeTest, ALoadedTableTrainsOnExactlyAsTheSavedOne) {
  const control::ConsistencyMode mode = std::get<1>(GetParam());
  ExpectALoadedTableTrainsOnExactlyAsTheSavedOne(std::get<0>(GetParam()), mode,
                                                 mode == control::SSP ? 2 : 0);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, RowStateModeTest,
    ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                       ::testing::Values(control::SSP, control::ASP)),
    [](const auto& info) {
      return std::get<0>(info.param) + (std::get<1>(info.param) == control::SSP ? "_ssp2" : "_asp");
    });

// A set is of exactly the rows named (others keep their value), in batches over shards; the
// gradient rows added before it stay pending and are pushed by the next step; rows set twice
// in one call, ids outside the table, kNoState and a dense name are refused with nothing set.
TEST_P(RowStateTest, SetsNameTheirRowsAndBadInputSetsNothing) {
  UpdateRule sgd;
  sgd.kind = UpdateRule::Kind::kSgd;
  sgd.lr = 1.0f;
  OneWorker a = Start(GetParam(), 200, false, TensorDType::kFloat32, sgd);
  ASSERT_NE(a.client, nullptr);
  Client& c = *a.client;
  std::vector<float> init(200 * kDim);
  for (int64_t id = 0; id < 200; ++id) {
    InitRow(RowInitKind::kNormal, 1.0f, 5, static_cast<uint64_t>(id), kDim, &init[id * kDim]);
  }
  const int64_t grad_id = 7;
  const float grad[kDim] = {1, 2, 3, 4};
  ASSERT_TRUE(c.AddRowGradients("t", &grad_id, 1, grad).ok());
  // 60 rows (30 per shard, 16 per push): every third id, values id + j / 8.
  std::vector<int64_t> ids;
  std::vector<float> vals;
  for (int64_t id = 1; id < 180; id += 3) {
    ids.push_back(id);
    for (int j = 0; j < kDim; ++j) vals.push_back(static_cast<float>(id) + j / 8.0f);
  }
  ASSERT_TRUE(c.SetRows("t", Client::StatePart::kWeights, ids.data(), ids.size(), vals.data(), 0).ok());
  // Bad calls: nothing of them lands.
  const int64_t twice[3] = {0, 3, 0};
  const float junk[3 * kDim] = {};
  Status st = c.SetRows("t", Client::StatePart::kWeights, twice, 3, junk, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("twice"), std::string::npos) << st;
  const int64_t outside[2] = {3, 200};
  st = c.SetRows("t", Client::StatePart::kWeights, outside, 2, junk, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("'t'"), std::string::npos) << st;
  EXPECT_EQ(c.GetRows("t", outside, 2, nullptr, nullptr, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.SetRows("t", Client::StatePart::kNoState, outside, 1, junk, 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.SetRows("nope", Client::StatePart::kWeights, outside, 1, junk, 0).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(c.TableKeys("t").status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c.Step().ok());  // pushes row 7's gradient, added before the set
  std::vector<int64_t> all(200);
  for (int64_t i = 0; i < 200; ++i) all[i] = i;
  std::vector<float> got(200 * kDim);
  ASSERT_TRUE(c.PullRows("t", all.data(), all.size(), got.data()).ok());
  for (int64_t id = 0; id < 200; ++id) {
    for (int j = 0; j < kDim; ++j) {
      float want = init[id * kDim + j];
      if (id % 3 == 1 && id < 180) want = static_cast<float>(id) + j / 8.0f;
      if (id == 7) want = 7.0f + j / 8.0f - grad[j];  // set, then the pending gradient
      ASSERT_EQ(got[id * kDim + j], want) << "row " << id << "[" << j << "]";
    }
  }
  EXPECT_TRUE(c.Close().ok());
}

// A bfloat16 table: a set travels in bfloat16 (rounded as torch's .to()), GetRows returns the
// float32 master, which then trains in float32.
TEST_P(RowStateTest, HalfPrecisionSetsKeepTheirFloat32Master) {
  UpdateRule sgd;
  sgd.kind = UpdateRule::Kind::kSgd;
  sgd.lr = 1.0f;
  OneWorker a = Start(GetParam(), 10, false, TensorDType::kBFloat16, sgd);
  ASSERT_NE(a.client, nullptr);
  Client& c = *a.client;
  const int64_t id = 4;
  const float v[kDim] = {1.0f + 1.0f / 256, 3.0f, -0.5f, 1.0f / 3};  // 1 + 2^-8: not bf16
  ASSERT_TRUE(c.SetRows("t", Client::StatePart::kWeights, &id, 1, v, 0).ok());
  float w[kDim];
  ASSERT_TRUE(c.GetRows("t", &id, 1, w, nullptr, nullptr, nullptr).ok());
  for (int j = 0; j < kDim; ++j) EXPECT_EQ(w[j], v[j]) << "the float32 master is the value set";
  uint16_t pulled[kDim];
  ASSERT_TRUE(c.PullRows("t", &id, 1, pulled).ok());
  EXPECT_EQ(pulled[0], 0x3F80) << "1 + 2^-8 rounds to even in bfloat16: 1.0";
  EXPECT_EQ(pulled[1], 0x4040);  // 3.0
  EXPECT_EQ(pulled[2], 0xBF00);  // -0.5
  EXPECT_EQ(pulled[3], 0x3EAB);  // bf16(1/3)
  // A step moves the master, not the rounded row: 1 + 2^-8 - 2^-8 = 1 exactly.
  const uint16_t g[kDim] = {FloatToBF16(1.0f / 256), 0, 0, 0};  // bf16 gradients: 2^-8 exactly
  ASSERT_TRUE(c.AddRowGradients("t", &id, 1, g).ok());
  ASSERT_TRUE(c.Step().ok());
  ASSERT_TRUE(c.GetRows("t", &id, 1, w, nullptr, nullptr, nullptr).ok());
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[3], v[3]);
  EXPECT_TRUE(c.Close().ok());
}

// BSP: a worker's gradient push of a clock waits in the server's inbox until every worker
// pushed that clock. A get of more rows than max_ids (several state ops on one shard) right
// after the step must not overwrite it: row 0 must move by worker 0's gradient. Before the
// fix (ops posted without waiting for the previous push's acknowledgement) it stayed 0.
TEST_P(RowStateTest, StateOpsAfterAStepKeepTheGradientTheClockWaitsFor) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 2;
  spec.servers = 2;
  spec.average = false;
  Cluster cluster(spec);
  EmbeddingOptions eo;
  eo.max_ids = 4;
  eo.init = EmbeddingOptions::Init::kZeros;
  UpdateRule sgd;
  sgd.kind = UpdateRule::Kind::kSgd;
  sgd.lr = 1.0f;
  std::atomic<int> phase{0};
  std::vector<std::vector<float>> row0(2, std::vector<float>(kDim, 99.0f));
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterEmbedding("t", 64, kDim, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      ASSERT_TRUE(cl.SetUpdateRule("t", sgd).ok());
      const int me = static_cast<int>(cl.rank());
      const float g[kDim] = {1, 1, 1, 1};
      const int64_t id = me == 0 ? 0 : 2;
      if (me == 1) {
        while (phase.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ASSERT_TRUE(cl.AddRowGradients("t", &id, 1, g).ok());
      if (me == 0) {
        // Push (not Step: Step's pull would wait for the clock), then read 16 rows: four gets
        // per shard, while the push waits for worker 1's.
        auto h = cl.Push("t");
        ASSERT_TRUE(h.ok()) << h.status();
        ASSERT_TRUE(cl.Wait(*h).ok());
        std::vector<int64_t> ids(16);
        for (int i = 0; i < 16; ++i) ids[i] = i;
        std::vector<float> w(16 * kDim);
        std::thread release([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          phase = 1;  // worker 1 pushes only now: the gets had to wait for the clock
        });
        Status st = cl.GetRows("t", ids.data(), ids.size(), w.data(), nullptr, nullptr, nullptr);
        release.join();
        EXPECT_TRUE(st.ok()) << st;
        EXPECT_EQ(w[0], -1.0f) << "the get waited for the clock, so it sees its update";
        ASSERT_TRUE(cl.Clock().ok());
      } else {
        ASSERT_TRUE(cl.Step().ok());
      }
      const int64_t first = 0;
      ASSERT_TRUE(cl.PullRows("t", &first, 1, row0[me].data()).ok());
      phase.fetch_add(1);
      while (phase.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(row0[r], std::vector<float>(kDim, -1.0f))
        << "worker " << r << ": worker 0's gradient of row 0 was lost";
  }
}

// The server has one outbox: two workers reading rows at once must each get their own rows
// (seen before the fix: 48-111 of 600 reads on shm returned the other worker's rows, OK).
TEST_P(RowStateTest, ConcurrentGetsReturnTheirOwnRows) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 2;
  spec.servers = 1;
  spec.mode = control::ASP;
  Cluster cluster(spec);
  EmbeddingOptions eo;
  // 1 MiB answers: long reads, which another answer may overwrite (SoftRoCE, emulated: 128 KiB,
  // fewer rounds).
  const bool emulated = GetParam() == "verbs";
  eo.max_ids = emulated ? 512 : 4096;
  eo.init = EmbeddingOptions::Init::kZeros;
  const int64_t kRows = 2 * int64_t{eo.max_ids};
  const int rounds = emulated ? 12 : 100;
  constexpr int kD = 64;
  std::atomic<int> bad{0}, errors{0}, ready{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      auto c = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(c.ok()) << c.status();
      Client& cl = **c;
      ASSERT_TRUE(cl.RegisterEmbedding("t", kRows, kD, TensorDType::kFloat32, eo).ok());
      ASSERT_TRUE(cl.Start().ok());
      const int me = static_cast<int>(cl.rank());
      std::vector<int64_t> ids;  // worker 0: even ids, worker 1: odd; row id holds id
      for (int64_t i = me; i < kRows; i += 2) ids.push_back(i);
      std::vector<float> v(ids.size() * kD);
      for (size_t i = 0; i < ids.size(); ++i) std::fill_n(&v[i * kD], kD, float(ids[i]));
      ASSERT_TRUE(cl.SetRows("t", Client::StatePart::kWeights, ids.data(), ids.size(), v.data(),
                             0).ok());
      ready.fetch_add(1);
      while (ready.load() < 2) std::this_thread::yield();
      std::vector<float> w(ids.size() * kD);
      for (int it = 0; it < rounds; ++it) {
        const Status st =
            cl.GetRows("t", ids.data(), ids.size(), w.data(), nullptr, nullptr, nullptr);
        if (!st.ok()) {
          if (errors.fetch_add(1) < 3) ADD_FAILURE() << st;
          continue;
        }
        if (w != v && bad.fetch_add(1) < 2) {
          size_t k = 0;
          while (w[k] == v[k]) ++k;
          ADD_FAILURE() << "worker " << me << ": id " << ids[k / kD] << " read " << w[k];
        }
      }
      ready.fetch_add(1);
      while (ready.load() < 4) std::this_thread::yield();
      EXPECT_TRUE(cl.Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(bad.load(), 0) << "a GetRows returned another request's rows";
}

// A set drops the rows from this worker's own row cache (ASP serves a cached row until it is
// evicted): the next pull reads the set value, not the cached one.
TEST_P(RowStateTest, ASetDropsTheRowsFromTheWorkersCache) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 2;
  spec.mode = control::ASP;
  Cluster cluster(spec);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 4;
  eo.init = EmbeddingOptions::Init::kZeros;
  eo.cache_rows = 16;
  ASSERT_TRUE(cl.RegisterEmbedding("t", 64, kDim, TensorDType::kFloat32, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  const int64_t id = 5;
  float row[kDim];
  // Two steps with a gradient of another row: the shard's header then names a min clock,
  // which a cached row needs.
  const int64_t other = 9;
  const float zero[kDim] = {};
  for (int t = 0; t < 2; ++t) {
    ASSERT_TRUE(cl.AddRowGradients("t", &other, 1, zero).ok());
    ASSERT_TRUE(cl.Step().ok());
  }
  ASSERT_TRUE(cl.PullRows("t", &id, 1, row).ok());
  ASSERT_TRUE(cl.PullRows("t", &id, 1, row).ok());
  ASSERT_EQ(cl.counters().row_cache_hits, 1u)
      << "the test needs the row cached (misses " << cl.counters().row_cache_misses << ")";
  const float v[kDim] = {7, 7, 7, 7};
  ASSERT_TRUE(cl.SetRows("t", Client::StatePart::kWeights, &id, 1, v, 0).ok());
  ASSERT_TRUE(cl.PullRows("t", &id, 1, row).ok());
  EXPECT_EQ(row[0], 7.0f) << "the pull served the cached row from before the set";
  EXPECT_TRUE(cl.Close().ok());
}

// A hashed load holds what fits: a set whose keys overflow their 4-slot buckets says how many
// keys hold no row (RESOURCE_EXHAUSTED), rather than OK; one that fits lists every key. A
// state set reaches every shard: the step count is the table's, also where no row was set.
TEST_P(RowStateTest, AHashedLoadSaysWhatDidNotFitAndStepsReachEveryShard) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.workers = 1;
  spec.servers = 2;
  Cluster cluster(spec);
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& cl = **c;
  EmbeddingOptions eo;
  eo.max_ids = 64;
  eo.hashed = true;
  ASSERT_TRUE(cl.RegisterEmbedding("small", 256, kDim, TensorDType::kFloat32, eo).ok());
  ASSERT_TRUE(cl.RegisterEmbedding("large", 1 << 14, kDim, TensorDType::kFloat32, eo).ok());
  ASSERT_TRUE(cl.Start().ok());
  std::vector<int64_t> keys;
  for (int i = 0; i < 128; ++i) keys.push_back(i * 7919 + 3);
  std::vector<float> v(keys.size() * kDim, 1.5f);
  Status st = cl.SetRows("small", Client::StatePart::kWeights, keys.data(), keys.size(),
                         v.data(), 0);
  ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("'small'"), std::string::npos) << st;
  auto listed = cl.TableKeys("small");
  ASSERT_TRUE(listed.ok()) << listed.status();
  const std::string held = std::to_string(keys.size() - listed->size()) + " of 128 keys";
  EXPECT_NE(st.message().find(held), std::string::npos) << st << " (listed " << listed->size() << ")";
  ASSERT_TRUE(cl.SetRows("large", Client::StatePart::kWeights, keys.data(), keys.size(),
                         v.data(), 0).ok());
  listed = cl.TableKeys("large");
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<int64_t> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(*listed, sorted);
  // State 1 of one key, step count 7: a key of the other shard then reads steps 7 too.
  const int64_t one = keys[0];
  int64_t other = 1;
  while ((layout::RowHash(static_cast<uint64_t>(other)) % 2) ==
         (layout::RowHash(static_cast<uint64_t>(one)) % 2)) {
    ++other;
  }
  ASSERT_TRUE(cl.SetRows("large", Client::StatePart::kState1, &one, 1, v.data(), 7).ok());
  Client::RowStateInfo info;
  float w[kDim], s1[kDim];
  ASSERT_TRUE(cl.GetRows("large", &other, 1, w, s1, nullptr, &info).ok());
  EXPECT_EQ(info.steps, 7u) << "the shard without a row set kept step count 0";
  EXPECT_TRUE(info.has1);
  EXPECT_EQ(s1[0], 0.0f) << "a row not set keeps a fresh row's state";
  EXPECT_TRUE(cl.Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, RowStateTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
