// RowShard's records (wire/region_layout.h RowHeader): 16 bytes, a 31-bit version stamp that
// the server makes whole again (RowVersionOf), and what depends on the whole version (an
// incremental checkpoint's rows, a hashed bucket's eviction) across the stamp's period.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "server/row_shard.h"
#include "wire/region_layout.h"

namespace shardps::server {
namespace {

constexpr uint64_t kP = layout::kRowStampPeriod;

TEST(RowStampTest, AVersionComesBackWholeFromItsStampAndTheNewest) {
  EXPECT_EQ(layout::RowVersionOf(layout::RowStampOf(0), 0), 0u);
  EXPECT_EQ(layout::RowVersionOf(layout::RowStampOf(0) | layout::kRowOccupied, 12345), 0u);
  for (uint64_t newest : {uint64_t{1}, uint64_t{5}, kP - 1, kP, kP + 1, 2 * kP + 3,
                          uint64_t{1} << 40, ~uint64_t{0} >> 1}) {
    for (uint64_t age : {uint64_t{0}, uint64_t{1}, uint64_t{2}, kP / 2, kP - 2}) {
      if (age >= newest) continue;
      const uint64_t v = newest - age;
      const uint32_t stamp = layout::RowStampOf(v);
      EXPECT_NE(stamp, 0u) << v;
      EXPECT_EQ(stamp & layout::kRowOccupied, 0u) << v;
      EXPECT_EQ(layout::RowVersionOf(stamp | layout::kRowOccupied, newest), v)
          << "version " << v << ", newest " << newest;
    }
    // Older than the period: read as younger than it is, never older.
    if (newest > kP + 10) {
      const uint64_t v = newest - kP - 10;
      EXPECT_GE(layout::RowVersionOf(layout::RowStampOf(v), newest), v);
      EXPECT_LE(layout::RowVersionOf(layout::RowStampOf(v), newest), newest);
    }
  }
}

TEST(RowStampTest, ARecordIsSixteenBytesOfHeaderAndItsValues) {
  layout::RowGeometry g;
  g.rows = 8;
  g.dim = 16;
  g.elem_bytes = 4;
  EXPECT_EQ(sizeof(layout::RowHeader), 16u);
  EXPECT_EQ(g.row_stride(), 80u);  // 1.25x the 64 bytes of values
  g.dim = 64;
  EXPECT_EQ(g.row_stride(), 272u);
  g.dim = 3;
  EXPECT_EQ(g.row_stride(), 32u);  // values stay 16-aligned
}

// The sparse payload of (row, value) pairs: [n][rows][n x dim floats].
std::vector<char> Payload(const std::vector<uint64_t>& rows, uint32_t dim, float value) {
  std::vector<char> p(SparsePayloadBytes(rows.size(), dim));
  const uint64_t n = rows.size();
  std::memcpy(p.data(), &n, sizeof(n));
  std::memcpy(p.data() + sizeof(n), rows.data(), n * sizeof(uint64_t));
  std::vector<float> v(n * dim, value);
  std::memcpy(p.data() + sizeof(n) + n * sizeof(uint64_t), v.data(), v.size() * sizeof(float));
  return p;
}

class RowShardStampTest : public ::testing::Test {
 protected:
  void Make(bool hashed, uint64_t rows) {
    g_.rows = rows;
    g_.dim = 4;
    g_.elem_bytes = 4;
    g_.max_ids = 8;
    g_.shard = 0;
    g_.shards = 1;
    g_.table_rows = rows;
    g_.hashed = hashed;
    area_.assign(g_.area_bytes() / 8 + 2, 0);
    RowInit init;
    init.kind = RowInitKind::kZeros;
    shard_ = std::make_unique<RowShard>(g_, layout::DType::kF32, init, OptimizerConfig{},
                                        reinterpret_cast<char*>(area_.data()));
    shard_->InitRows();
  }
  void Apply(const std::vector<uint64_t>& rows, uint64_t version) {
    const std::vector<char> p = Payload(rows, g_.dim, 1.0f);
    layout::UpdateRule rule{};
    rule.kind_flags = static_cast<uint32_t>(layout::RuleKind::kSgd);
    rule.lr = 0.5f;
    shard_->Apply(p.data(), 1.0f, 1.0f, rule, version);
  }
  const layout::RowHeader& Header(uint64_t local) const {
    return *reinterpret_cast<const layout::RowHeader*>(reinterpret_cast<const char*>(area_.data()) +
                                                       local * g_.row_stride());
  }

  layout::RowGeometry g_;
  std::vector<uint64_t> area_;  // 8-aligned; the records need no more
  std::unique_ptr<RowShard> shard_;
};

// Adagrad's initial_accumulator_value is what a row placed in a hashed shard starts its sum
// from. A restored shard (checkpoint, handoff) has every row's sum but not that value: it took
// it only when it allocated the sums, so rows placed after a restore started from 0 on the
// restored shard and from the value on one that never restarted (a backup diverged from its
// primary). Every push's rule carries it.
TEST_F(RowShardStampTest, ARestoredShardPlacesNewRowsWithAdagradsInitialSum) {
  layout::UpdateRule rule{};
  rule.kind_flags = static_cast<uint32_t>(layout::RuleKind::kAdagrad);
  rule.lr = 0.5f;
  rule.dampening = 0.25f;  // initial_accumulator_value
  rule.weight_decay = 0.0f;
  auto apply = [&](RowShard& shard, uint64_t key, uint64_t version) {
    const std::vector<char> p = Payload({key}, g_.dim, 1.0f);
    shard.Apply(p.data(), 1.0f, 1.0f, rule, version);
  };
  auto read = [&](const RowShard& shard, uint64_t key) {
    layout::RowOutbox o{1, g_.dim};
    std::vector<char> out(o.bytes());
    shard.Read(&key, 1, out.data());
    return std::vector<char>(out.begin() + o.values(), out.begin() + o.state2());
  };
  Make(/*hashed=*/true, 16);
  apply(*shard_, 1, 1);
  const ChunkState cs = shard_->Capture();
  apply(*shard_, 2, 2);  // the shard that never restarted places key 2
  const std::vector<char> want = read(*shard_, 2);
  std::vector<uint64_t> keep;
  keep.swap(area_);
  std::unique_ptr<RowShard> original = std::move(shard_);
  Make(/*hashed=*/true, 16);
  ASSERT_TRUE(shard_->Restore(cs).ok());
  apply(*shard_, 2, 2);
  EXPECT_EQ(read(*shard_, 2), want) << "key 2's value and sum after a restore";
}

// A record's sparse payload names its row count n; its bytes must be exactly that many rows.
// 8 + n * (8 + 4 dim) wraps for a huge n: with dim 4 (24 bytes a row), n = 2 + 2^61 matched
// the bytes of 2 rows, and the check then walked 2^61 ids past the payload (a hashed shard has
// no row count to bound n). A backup takes such a payload only from a faulty primary.
TEST_F(RowShardStampTest, APayloadWhoseRowCountWrapsItsSizeIsRefused) {
  Make(/*hashed=*/true, 16);
  std::vector<char> p = Payload({1, 2}, g_.dim, 1.0f);
  EXPECT_TRUE(shard_->CheckPayload(p.data(), p.size()).ok());
  const uint64_t wrapped = 2 + (uint64_t{1} << 61);
  ASSERT_EQ(SparsePayloadBytes(wrapped, g_.dim), p.size()) << "the size wraps to 2 rows'";
  std::memcpy(p.data(), &wrapped, sizeof(wrapped));
  EXPECT_FALSE(shard_->CheckPayload(p.data(), p.size()).ok());
  const uint64_t three = 3;  // more rows than the bytes hold
  std::memcpy(p.data(), &three, sizeof(three));
  EXPECT_FALSE(shard_->CheckPayload(p.data(), p.size()).ok());
}

// An incremental checkpoint takes exactly the rows written after `since`, when the versions
// cross the stamp's period (a stamp compared as it is would drop rows 2..4 from CaptureSince(P-1):
// their stamps are 1..3).
TEST_F(RowShardStampTest, AnIncrementalCaptureTakesTheRowsWrittenSinceAcrossThePeriod) {
  Make(/*hashed=*/false, 8);
  Apply({1}, kP - 1);
  Apply({2}, kP);
  Apply({3}, kP + 1);
  Apply({4}, kP + 2);
  Apply({5}, kP + 3);
  EXPECT_EQ(shard_->CaptureSince(kP - 2).row_index, (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(shard_->CaptureSince(kP - 1).row_index, (std::vector<uint64_t>{2, 3, 4, 5}));
  EXPECT_EQ(shard_->CaptureSince(kP + 1).row_index, (std::vector<uint64_t>{4, 5}));
  EXPECT_TRUE(shard_->CaptureSince(kP + 3).row_index.empty());
  // The record carries the row's id and the crc over it, its stamp and its values.
  const layout::RowHeader& h = Header(3);
  EXPECT_EQ(h.key, 3u);
  EXPECT_EQ(h.stamp, layout::kRowOccupied | layout::RowStampOf(kP + 1));
  const char* vals = reinterpret_cast<const char*>(&h) + sizeof(h);
  float v0;
  std::memcpy(&v0, vals, sizeof(v0));
  EXPECT_EQ(v0, -0.5f);
  EXPECT_EQ(h.crc, layout::RowRecordCrc(h, vals, g_.row_value_bytes()));
}

// A full bucket gives a new key the slot of its least recently written row, judged by the whole
// version: the oldest here has the highest stamp (kP - 1) and the youngest the lowest.
TEST_F(RowShardStampTest, EvictionTakesTheOldestRowAcrossThePeriod) {
  Make(/*hashed=*/true, layout::kBucketSlots);  // one bucket: every key lands in it
  const std::vector<uint64_t> keys = {101, 202, 303, 404};
  const uint64_t written[] = {kP - 1, kP, kP + 1, kP + 2};
  for (size_t i = 0; i < keys.size(); ++i) Apply({keys[i]}, written[i]);
  ASSERT_EQ(shard_->hashed_stats().rows, 4u);
  Apply({505}, kP + 3);
  EXPECT_EQ(shard_->hashed_stats().evicted, 1u);
  std::vector<uint64_t> held;
  for (uint64_t s = 0; s < layout::kBucketSlots; ++s) {
    ASSERT_NE(Header(s).stamp & layout::kRowOccupied, 0u);
    held.push_back(Header(s).key);
  }
  std::sort(held.begin(), held.end());
  EXPECT_EQ(held, (std::vector<uint64_t>{202, 303, 404, 505})) << "key 101 (the oldest) is the one evicted";
  // Capture gives every slot's whole version back.
  const ChunkState cs = shard_->Capture();
  ASSERT_EQ(cs.row_versions.size(), layout::kBucketSlots);
  for (uint64_t s = 0; s < layout::kBucketSlots; ++s) {
    const uint64_t want = Header(s).key == 505 ? kP + 3
                          : Header(s).key == 202 ? kP
                          : Header(s).key == 303 ? kP + 1
                                                 : kP + 2;
    EXPECT_EQ(cs.row_versions[s], want | layout::kRowVersionOccupied) << "slot " << s;
  }
  // A restored shard decides alike: restore, then one more key evicts 202.
  Make(/*hashed=*/true, layout::kBucketSlots);
  ASSERT_TRUE(shard_->Restore(cs).ok());
  Apply({606}, kP + 4);
  held.clear();
  for (uint64_t s = 0; s < layout::kBucketSlots; ++s) held.push_back(Header(s).key);
  std::sort(held.begin(), held.end());
  EXPECT_EQ(held, (std::vector<uint64_t>{303, 404, 505, 606}));
}

}  // namespace
}  // namespace shardps::server
