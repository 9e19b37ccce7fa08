#include "proto/shard_plan.h"

#include <gtest/gtest.h>

namespace shardps {
namespace {

TensorSpec T(const std::string& name, std::vector<int64_t> shape) {
  TensorSpec t;
  t.name = name;
  t.shape = std::move(shape);
  return t;
}

TEST(ShardPlanTest, ChunksCoverEachTensorExactlyOnce) {
  const std::vector<TensorSpec> specs = {T("w1", {1000, 784}), T("b1", {1000}),
                                         T("w2", {10, 1000}), T("b2", {10})};
  auto plan = PlanShards(specs, 3, 1 << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (uint32_t ti = 0; ti < specs.size(); ++ti) {
    uint64_t next = 0;
    for (const auto& c : plan->chunks) {
      if (c.tensor != ti) continue;
      EXPECT_EQ(c.offset, next) << "gap or overlap in tensor " << ti;
      EXPECT_EQ(c.offset % 4, 0u);
      EXPECT_EQ(c.bytes % 4, 0u);
      EXPECT_LE(c.bytes, 1u << 20);
      next += c.bytes;
    }
    EXPECT_EQ(next, specs[ti].bytes());
  }
  uint64_t total = 0;
  for (auto b : plan->server_bytes) total += b;
  EXPECT_EQ(total, (1000 * 784 + 1000 + 10 * 1000 + 10) * 4u);
}

TEST(ShardPlanTest, BalancesBytesAcrossServers) {
  // 3.2 MB + many small tensors over 4 servers with 256 KiB chunks: near-perfect balance.
  std::vector<TensorSpec> specs = {T("big", {800000})};
  for (int i = 0; i < 20; ++i) specs.push_back(T("small" + std::to_string(i), {1000 + i}));
  auto plan = PlanShards(specs, 4, 256 << 10);
  ASSERT_TRUE(plan.ok());
  EXPECT_LT(plan->imbalance(), 1.05) << "max/mean server bytes";
  // Slots are dense per server.
  std::vector<uint32_t> count(4, 0);
  for (const auto& c : plan->chunks) EXPECT_EQ(c.server_slot, count[c.server]++);
}

TEST(ShardPlanTest, DeterministicAndNameSensitive) {
  const std::vector<TensorSpec> a = {T("x", {4096}), T("y", {123})};
  auto p1 = PlanShards(a, 2, 4096);
  auto p2 = PlanShards(a, 2, 4096);
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(p1->Fingerprint(), p2->Fingerprint());
  auto p3 = PlanShards({T("x", {4096}), T("z", {123})}, 2, 4096);
  EXPECT_NE(p1->Fingerprint(), p3->Fingerprint());
}

TEST(ShardPlanTest, RejectsBadInput) {
  EXPECT_FALSE(PlanShards({T("x", {4})}, 0, 4096).ok());
  EXPECT_FALSE(PlanShards({T("x", {0})}, 1, 4096).ok());
  EXPECT_FALSE(PlanShards({T("x", {4}), T("x", {4})}, 1, 4096).ok());
  EXPECT_FALSE(PlanShards({T("", {4})}, 1, 4096).ok());
}

// Regression (tests/fuzz/fuzz_coordinator): a peer's model whose shape wraps the element count
// divided by zero, and one with a huge shape allocated chunks until the coordinator ran out of
// memory.
TEST(ShardPlanTest, RejectsModelsTooLargeToPlan) {
  auto wrap = PlanShards({T("w", {int64_t{1} << 62, 4})}, 1, 4096);
  ASSERT_FALSE(wrap.ok());
  EXPECT_EQ(wrap.status().code(), StatusCode::kInvalidArgument);
  auto huge = PlanShards({T("h", {int64_t{1} << 40})}, 1, 4096);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  auto over = PlanShards({T("o", {int64_t{1} << 49})}, 1, uint64_t{1} << 40);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  // The largest plan allowed still plans: kMaxPlanChunks chunks of 64 B.
  auto max = PlanShards({T("m", {static_cast<int64_t>(kMaxPlanChunks * 16)})}, 1, 64);
  ASSERT_TRUE(max.ok()) << max.status();
  EXPECT_EQ(max->chunks.size(), kMaxPlanChunks);
  EXPECT_FALSE(PlanShards({T("m", {static_cast<int64_t>(kMaxPlanChunks * 16 + 1)})}, 1, 64).ok());
}

}  // namespace
}  // namespace shardps
