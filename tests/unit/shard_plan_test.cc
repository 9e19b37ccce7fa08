#include "proto/shard_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

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

TEST(ShardPlanTest, EqualCapacitiesGiveTheByteBalancedPlan) {
  const std::vector<TensorSpec> specs = {T("w", {1000, 784}), T("b", {1000})};
  auto plain = PlanShards(specs, 3, 64 << 10);
  auto equal = PlanShards(specs, 3, 64 << 10, {2.0, 2.0, 2.0});
  ASSERT_TRUE(plain.ok() && equal.ok());
  EXPECT_EQ(plain->Fingerprint(), equal->Fingerprint());
  EXPECT_EQ(plain->server_bytes, equal->server_bytes);
  EXPECT_TRUE(equal->capacity.empty());
}

TEST(ShardPlanTest, CapacityWeightsServerBytes) {
  // 4 MB tensor, 64 KiB partitions, server 1 has a quarter of server 0's capacity: server 0
  // should own 4/5 of the bytes, server 1 1/5, within one chunk.
  const std::vector<TensorSpec> specs = {T("w", {1 << 20})};
  auto plan = PlanShards(specs, 2, 64 << 10, {1.0, 0.25});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const uint64_t total = (1u << 20) * 4u;
  ASSERT_EQ(plan->server_bytes.size(), 2u);
  EXPECT_EQ(plan->server_bytes[0] + plan->server_bytes[1], total);
  uint64_t biggest = 0;
  for (const auto& c : plan->chunks) biggest = std::max(biggest, c.bytes);
  EXPECT_NEAR(static_cast<double>(plan->server_bytes[0]), 0.8 * total, biggest);
  EXPECT_NEAR(static_cast<double>(plan->server_bytes[1]), 0.2 * total, biggest);
  EXPECT_LT(plan->weighted_imbalance(), 1.05);
  // The byte-balanced plan of the same model splits it evenly.
  auto even = PlanShards(specs, 2, 64 << 10);
  ASSERT_TRUE(even.ok());
  EXPECT_EQ(even->server_bytes[0], total / 2);
  EXPECT_NE(even->Fingerprint(), plan->Fingerprint());
  // Slots stay dense per server.
  std::vector<uint32_t> count(2, 0);
  for (const auto& c : plan->chunks) EXPECT_EQ(c.server_slot, count[c.server]++);
}

TEST(ShardPlanTest, CapacityRepresentableForOneBigTensorAboveOnePartition) {
  // 1 MiB tensor with 1 MiB / 2 partitions: unweighted that is 2 chunks; with weights 3:1 it
  // must be cut into a multiple of 4 so that the 3/4 share exists.
  auto plan = PlanShards({T("w", {1 << 18})}, 2, 512 << 10, {3.0, 1.0});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->chunks.size() % 4, 0u);
  EXPECT_EQ(plan->server_bytes[0], 3u * plan->server_bytes[1]);
}

TEST(ShardPlanTest, CapacityTwoSmallTensorsGoToTheFastServerFirst) {
  // Two equal one-chunk tensors, capacities 1:10: both belong on the fast server 1
  // (finish 2/10 < 1/1), byte balancing would give one each.
  auto plan = PlanShards({T("a", {1000}), T("b", {1000})}, 2, 1 << 20, {1.0, 10.0});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->server_bytes[0], 0u);
  EXPECT_EQ(plan->server_bytes[1], 8000u);
}

TEST(ShardPlanTest, RejectsBadCapacity) {
  EXPECT_FALSE(PlanShards({T("x", {4})}, 2, 4096, {1.0}).ok());
  EXPECT_FALSE(PlanShards({T("x", {4})}, 2, 4096, {1.0, 0.0}).ok());
  EXPECT_FALSE(PlanShards({T("x", {4})}, 2, 4096, {1.0, -1.0}).ok());
  EXPECT_FALSE(PlanShards({T("x", {4})}, 2, 4096, {1.0, std::nan("")}).ok());
}

}  // namespace
}  // namespace shardps
