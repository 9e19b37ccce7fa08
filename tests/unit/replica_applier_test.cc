// The replication record format end to end without a network: the primary's encoding
// (EncodeRecord, as ReplicationStream writes it) read back by the backup's ReplicaApplier.
#include "server/replica_applier.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "server/replication_stream.h"

namespace shardps::server {
namespace {

struct alignas(64) Line {
  char bytes[64];
};

class ReplicaApplierTest : public ::testing::Test {
 protected:
  ReplicaApplierTest()
      : layout_({8}, 4),
        ring_layout_(8, 4, 3),
        weights_(layout_.weights_bytes() / 64 + 1),
        acks_(layout_.acks_bytes() / 64 + 1),
        ring_(ring_layout_.ring_bytes() / 64 + 1),
        consumed_(1),
        chunks_(ChunkStore::Options(), layout_, weights_.data(), {42}, {8}),
        workers_(1),
        gate_(ConsistencyMode::kBsp, 1),
        board_(acks_.data(), layout_),
        applier_(ring_layout_, ring_.data(), consumed_.data(), 4) {}

  // Writes record `seq` (with `payload`) into its ring entry, as the primary's two writes do.
  uint32_t Write(ReplRecord r, uint64_t seq, const std::vector<float>& payload,
                 uint64_t epoch = 1) {
    const uint32_t entry = static_cast<uint32_t>((seq - 1) % ring_layout_.entries());
    char* base = reinterpret_cast<char*>(ring_.data());
    std::memcpy(base + ring_layout_.payload_offset(entry), payload.data(), payload.size() * 4);
    EncodeRecord(r, seq, epoch, base + ring_layout_.entry_offset(entry));
    return entry;
  }
  Status Apply(uint32_t entry, uint64_t fence = 0) {
    return applier_.Apply(entry, fence, chunks_, workers_, gate_, board_);
  }
  uint64_t consumed() const {
    uint64_t v;
    std::memcpy(&v, consumed_.data(), 8);
    return v;
  }

  layout::ServerLayout layout_;
  layout::ReplLayout ring_layout_;
  std::vector<Line> weights_, acks_, ring_, consumed_;
  ChunkStore chunks_;
  WorkerTable workers_;
  ConsistencyGate gate_;
  AckBoard board_;
  ReplicaApplier applier_;
};

ReplRecord Record(layout::ReplKind kind, uint64_t version, std::vector<Contributor> c) {
  ReplRecord r;
  r.kind = kind;
  r.version = version;
  r.min_clock_plus1 = version;
  r.scale = 0.5f;
  r.bytes = 8;
  r.contributors = std::move(c);
  return r;
}

TEST_F(ReplicaApplierTest, RecordsApplyInSequenceAndCarryExactlyOnceState) {
  ASSERT_TRUE(Apply(Write(Record(layout::ReplKind::kInit, 1, {}), 1, {1, 2})).ok());
  EXPECT_EQ(chunks_.version(0), 1u);
  EXPECT_EQ(chunks_.published(0)[1], 2.0f);
  EXPECT_EQ(consumed(), 1u);
  const std::vector<Contributor> c = {{0, 1, 1, 100, 0}, {2, 1, 1, 102, 0}};
  ASSERT_TRUE(Apply(Write(Record(layout::ReplKind::kApply, 2, c), 2, {4, 4})).ok());
  EXPECT_EQ(chunks_.version(0), 2u);
  EXPECT_FLOAT_EQ(chunks_.published(0)[0], 1.0f - 0.1f * 0.5f * 4);  // default lr 0.1
  EXPECT_EQ(chunks_.published_min_clock_plus1(0), 2u);
  EXPECT_TRUE(workers_.IsDuplicate(2, 0, 1));
  EXPECT_EQ(workers_.Find(0)->incarnation, 100u);
  EXPECT_EQ(board_.Get(2, 0), 1u);
  EXPECT_EQ(board_.Get(1, 0), 0u);
  EXPECT_EQ(gate_.applied_through(0), 0);
  EXPECT_EQ(applier_.applied(), 2u);
  EXPECT_FALSE(applier_.broken());
}

TEST_F(ReplicaApplierTest, OutOfSequenceFencedOrMalformedRecordsAreRefused) {
  ReplRecord init = Record(layout::ReplKind::kInit, 1, {});
  EXPECT_FALSE(Apply(Write(init, 2, {1, 2})).ok()) << "sequence 2 before 1";
  EXPECT_TRUE(applier_.broken());
  EXPECT_FALSE(Apply(Write(init, 1, {1, 2}, /*epoch=*/1), /*fence=*/2).ok()) << "fenced";
  EXPECT_FALSE(Apply(7).ok()) << "entry out of range";
  ReplRecord wrong = Record(layout::ReplKind::kApply, 1, {});
  EXPECT_FALSE(Apply(Write(wrong, 1, {1, 2})).ok()) << "update of an uninitialised chunk";
  wrong = init;
  wrong.bytes = 4;
  EXPECT_FALSE(Apply(Write(wrong, 1, {1, 2})).ok()) << "size";
  EXPECT_EQ(chunks_.version(0), 0u);
  EXPECT_EQ(consumed(), 0u);
  ASSERT_TRUE(Apply(Write(init, 1, {1, 2})).ok());
  EXPECT_FALSE(Apply(Write(Record(layout::ReplKind::kApply, 3, {}), 2, {1, 1})).ok())
      << "version 3 does not follow 1";
}

TEST_F(ReplicaApplierTest, AnOlderIncarnationsPushDoesNotResetTheNewerOne) {
  ASSERT_TRUE(Apply(Write(Record(layout::ReplKind::kInit, 1, {}), 1, {1, 2})).ok());
  ASSERT_TRUE(
      Apply(Write(Record(layout::ReplKind::kApply, 2, {{1, 0, 6, 200, 3}}), 2, {0, 0})).ok());
  ASSERT_TRUE(
      Apply(Write(Record(layout::ReplKind::kApply, 3, {{1, 1, 9, 199, 4}}), 3, {0, 0})).ok());
  EXPECT_EQ(workers_.Find(1)->incarnation, 200u);
  EXPECT_EQ(workers_.Find(1)->last_seq[0], 6u);
  EXPECT_EQ(board_.Get(1, 0), 6u);
  EXPECT_EQ(consumed(), 3u);
}

TEST(ReplicationRingTest, SpaceIsCountedFromTheBackupsConsumedWord) {
  EXPECT_TRUE(RingHasSpace(1, 0, 2));
  EXPECT_TRUE(RingHasSpace(2, 0, 2));
  EXPECT_FALSE(RingHasSpace(3, 0, 2));
  EXPECT_TRUE(RingHasSpace(3, 1, 2));
}

}  // namespace
}  // namespace shardps::server
