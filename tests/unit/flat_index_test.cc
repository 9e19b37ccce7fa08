// FlatIndex (common/flat_index.h): indices in insertion order across growth, both ways of
// clearing (per key, and the whole table once many keys are in), and Truncate's undo.
#include "common/flat_index.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

namespace shardps {
namespace {

// Inserts `keys` (with repeats) and checks every index against a reference map.
void InsertAndCheck(FlatIndex& f, const std::vector<uint64_t>& keys) {
  std::unordered_map<uint64_t, uint32_t> ref;
  for (uint64_t k : keys) {
    const auto [at, added] = f.Insert(k);
    auto it = ref.find(k);
    if (it == ref.end()) {
      ASSERT_TRUE(added) << k;
      ASSERT_EQ(at, ref.size()) << k;
      ref.emplace(k, at);
    } else {
      ASSERT_FALSE(added) << k;
      ASSERT_EQ(at, it->second) << k;
    }
  }
  ASSERT_EQ(f.size(), ref.size());
  for (const auto& [k, at] : ref) {
    ASSERT_EQ(f.Find(k), static_cast<int64_t>(at)) << k;
    ASSERT_EQ(f.keys()[at], k);
  }
}

std::vector<uint64_t> RandomKeys(size_t n, uint64_t range, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> v(n);
  for (uint64_t& k : v) k = rng() % range;
  return v;
}

TEST(FlatIndexTest, IndicesFollowInsertionOrderAcrossGrowthAndBothClears) {
  FlatIndex f;
  // Few keys in a big table (per-key clear), then many (the whole table), then few again.
  for (size_t n : {100000u, 50u, 70000u, 3u, 5000u}) {
    const auto keys = RandomKeys(n, n / 2 + 1, static_cast<uint32_t>(n));
    ASSERT_NO_FATAL_FAILURE(InsertAndCheck(f, keys));
    f.Clear();
    ASSERT_EQ(f.size(), 0u);
    for (uint64_t k : keys) ASSERT_EQ(f.Find(k), -1) << "key " << k << " survived Clear";
  }
}

TEST(FlatIndexTest, TruncateKeepsThePrefixAndForgetsTheRest) {
  FlatIndex f;
  std::vector<uint64_t> keys;
  for (uint64_t k = 0; k < 1000; ++k) keys.push_back(k * 7919 + 13);
  ASSERT_NO_FATAL_FAILURE(InsertAndCheck(f, keys));
  f.Truncate(400);
  ASSERT_EQ(f.size(), 400u);
  for (uint64_t i = 0; i < keys.size(); ++i) {
    ASSERT_EQ(f.Find(keys[i]), i < 400 ? static_cast<int64_t>(i) : -1) << i;
  }
  // The dropped keys come back with new indices after the kept ones.
  const auto [at, added] = f.Insert(keys[999]);
  EXPECT_TRUE(added);
  EXPECT_EQ(at, 400u);
  f.Truncate(1000);  // no-op
  EXPECT_EQ(f.size(), 401u);
}

}  // namespace
}  // namespace shardps
