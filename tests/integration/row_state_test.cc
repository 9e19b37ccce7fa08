// Row tables' state transfer (Client::SetRows / GetRows / TableKeys: shardps.torch's Embedding
// state_dict / load_state_dict), end to end in one process over a real transport (tcp and shm
// here; verbs in the SoftRoCE guest). The property: a table saved from one cluster and loaded
// into a fresh one trains on exactly as the original does, bit for bit (weights, optimizer
// state and step count), for dense and hashed ids, over shards and batches of max_ids.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/row_init.h"
#include "shardps/client.h"
#include "tests/integration/in_process_cluster.h"

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
                const UpdateRule& rule) {
  ClusterSpec spec;
  spec.transport = transport;
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
void TrainSteps(Client& c, int from, int to, bool hashed) {
  for (int t = from; t < to; ++t) {
    const std::vector<int64_t> ids = StepIds(t, hashed);
    std::vector<float> g(ids.size() * kDim);
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i * 5 + t) % 7) * 0.25f - 0.7f;
    ASSERT_TRUE(c.AddRowGradients("t", ids.data(), ids.size(), g.data()).ok());
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
// lazy Adam (two state buffers and the step count's bias correction) and Adagrad.
TEST_P(RowStateTest, ALoadedTableTrainsOnExactlyAsTheSavedOne) {
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
      OneWorker a = Start(GetParam(), rows, hashed, TensorDType::kFloat32, rule);
      ASSERT_NE(a.client, nullptr);
      TrainSteps(*a.client, 0, 5, hashed);
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
      OneWorker b = Start(GetParam(), rows, hashed, TensorDType::kFloat32, rule);
      ASSERT_NE(b.client, nullptr);
      Load(*b.client, saved);
      // The loaded state reads back as saved.
      const Saved again = Save(*b.client, rows, hashed);
      EXPECT_EQ(again.w, saved.w);
      EXPECT_EQ(again.s1, saved.s1);
      EXPECT_EQ(again.info.steps, saved.info.steps);
      TrainSteps(*a.client, 5, 10, hashed);
      TrainSteps(*b.client, 5, 10, hashed);
      const Saved fa = Save(*a.client, rows, hashed), fb = Save(*b.client, rows, hashed);
      std::vector<float> pa(fa.w.size()), pb(fb.w.size());
      ASSERT_TRUE(a.client->PullRows("t", fa.ids.data(), fa.ids.size(), pa.data()).ok());
      ASSERT_TRUE(b.client->PullRows("t", fa.ids.data(), fa.ids.size(), pb.data()).ok());
      EXPECT_EQ(pa, fa.w) << "a pull reads what GetRows read";
      EXPECT_EQ(pb, pa) << "the loaded table trained differently";
      EXPECT_EQ(fb.s1, fa.s1);
      EXPECT_EQ(fb.s2, fa.s2);
      EXPECT_NE(fa.w, saved.w) << "the steps after the load must change the rows";
      EXPECT_TRUE(a.client->Close().ok());
      EXPECT_TRUE(b.client->Close().ok());
    }
  }
}

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
TEST_P(RowStateTest, HalfPrecisionSetsAreRoundedAndReadBackAsMaster) {
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
  EXPECT_EQ(w[0], 1.0f) << "1 + 2^-8 rounds to even in bfloat16";
  EXPECT_EQ(w[1], 3.0f);
  EXPECT_EQ(w[2], -0.5f);
  EXPECT_EQ(w[3], 0.333984375f);  // bf16(1/3) = 0x3EAB
  uint16_t pulled[kDim];
  ASSERT_TRUE(c.PullRows("t", &id, 1, pulled).ok());
  EXPECT_EQ(pulled[1], 0x4040);  // 3.0
  EXPECT_TRUE(c.Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, RowStateTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
