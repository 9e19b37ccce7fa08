// The snapshot a primary hands a new backup (server/replica_handoff.h), without a network: a
// backup restored from it must continue bit-identically to the primary (weights, optimizer
// state, VSGD history, exactly-once state of applied pushes only), and a damaged snapshot must
// be refused with nothing changed.
#include "server/replica_handoff.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

struct alignas(64) Line {
  char bytes[64];
};

// One server's components over plain memory (two slots: 2 and 4 floats).
struct Side {
  static ChunkStore::Options Opts() {
    ChunkStore::Options o;
    o.optimizer.kind = OptimizerKind::kMomentum;
    o.optimizer.lr = 0.1f;
    o.history = 3;
    return o;
  }
  Side()
      : layout({8, 16}, 4),
        weights(layout.weights_bytes() / 64 + 1),
        acks(layout.acks_bytes() / 64 + 1),
        chunks(Opts(), layout, weights.data(), {7, 9}, {8, 16}),
        workers(2),
        gate(ConsistencyMode::kBsp, 2),
        board(acks.data(), layout) {}
  HandoffState state() { return {&chunks, &workers, &gate, &board}; }
  // One applied version of `slot` from `grad`, as the primary's apply thread makes it.
  void Step(uint32_t slot, const std::vector<float>& grad, uint64_t min_clock_plus1) {
    chunks.Publish(slot, chunks.Compute(slot, grad.data(), 0.5f, 1.0f), min_clock_plus1);
  }

  layout::ServerLayout layout;
  std::vector<Line> weights, acks;
  ChunkStore chunks;
  WorkerTable workers;
  ConsistencyGate gate;
  AckBoard board;
};

std::vector<float> Published(const ChunkStore& c, uint32_t slot) {
  return std::vector<float>(c.published(slot), c.published(slot) + c.elems(slot));
}

class ReplicaHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const float w0[2] = {1.0f, -2.0f};
    const float w1[4] = {0.5f, 0.25f, -0.125f, 3.0f};
    p_.chunks.Publish(0, p_.chunks.Init(0, w0), 1);
    p_.chunks.Publish(1, p_.chunks.Init(1, w1), 1);
    bool fresh = false;
    p_.workers.Ensure(0, 100, &fresh);
    p_.workers.Ensure(3, 103, &fresh);
    for (uint64_t clock = 0; clock < 5; ++clock) {
      p_.Step(0, {0.3f * (clock + 1), -0.7f}, clock + 1);
      p_.Step(1, {0.1f, 0.2f, 0.3f / (clock + 1), -0.4f}, clock + 1);
      for (uint32_t slot = 0; slot < 2; ++slot) {
        for (uint32_t w : {0u, 3u}) {
          p_.workers.Consume(w, slot, clock + 1, static_cast<int64_t>(clock));
          p_.board.Raise(w, slot, clock + 1);
        }
        p_.gate.NoteAppliedThrough(slot, static_cast<int64_t>(clock));
      }
    }
    // A BSP push of clock 5 folded into the aggregation of slot 0, not applied yet: counted by
    // the primary's table, not acknowledged, not in the weights.
    p_.workers.Consume(0, 0, 6, 5);
  }
  std::vector<char> Snapshot(uint32_t group = 1) {
    std::vector<char> buf(HandoffBytes(p_.state()));
    auto n = WriteHandoff(p_.state(), group, buf.data(), buf.size());
    EXPECT_TRUE(n.ok()) << n.status();
    if (n.ok()) {
      EXPECT_EQ(*n, buf.size());
    }
    return buf;
  }
  Status Restore(const std::vector<char>& buf, uint32_t group = 1) {
    return RestoreHandoff(buf.data(), buf.size(), group, 4, b_.state());
  }

  Side p_;  // the primary
  Side b_;  // the new backup
};

TEST_F(ReplicaHandoffTest, ARestoredBackupContinuesBitIdentically) {
  ASSERT_TRUE(Restore(Snapshot()).ok());
  for (uint32_t slot = 0; slot < 2; ++slot) {
    EXPECT_EQ(b_.chunks.version(slot), p_.chunks.version(slot));
    EXPECT_EQ(b_.chunks.published_min_clock_plus1(slot), p_.chunks.published_min_clock_plus1(slot));
    EXPECT_EQ(Published(b_.chunks, slot), Published(p_.chunks, slot));
    EXPECT_EQ(b_.chunks.Capture(slot).state1, p_.chunks.Capture(slot).state1);
    EXPECT_EQ(b_.chunks.Capture(slot).optimizer_steps, p_.chunks.Capture(slot).optimizer_steps);
    EXPECT_EQ(b_.chunks.history(slot), p_.chunks.history(slot));
    EXPECT_EQ(b_.gate.applied_through(slot), 4);
  }
  // The same records applied to both from here: momentum makes the optimizer state matter.
  for (int i = 0; i < 3; ++i) {
    p_.Step(0, {0.9f, 0.01f * i}, 6 + i);
    b_.Step(0, {0.9f, 0.01f * i}, 6 + i);
  }
  EXPECT_EQ(Published(b_.chunks, 0), Published(p_.chunks, 0));
  EXPECT_EQ(b_.chunks.version(0), p_.chunks.version(0));
}

TEST_F(ReplicaHandoffTest, OnlyAppliedPushesCountAsConsumed) {
  ASSERT_TRUE(Restore(Snapshot()).ok());
  const WorkerState* w0 = b_.workers.Find(0);
  ASSERT_NE(w0, nullptr);
  EXPECT_EQ(w0->incarnation, 100u);
  EXPECT_EQ(w0->last_seq[0], 5u) << "the folded, unapplied push (seq 6) must be resent";
  EXPECT_EQ(w0->applied_clock[0], 4);
  EXPECT_FALSE(b_.workers.IsDuplicate(0, 0, 6));
  EXPECT_TRUE(b_.workers.IsDuplicate(0, 0, 5));
  EXPECT_EQ(b_.board.Get(0, 0), 5u);
  EXPECT_EQ(b_.board.Get(3, 1), 5u);
  ASSERT_NE(b_.workers.Find(3), nullptr);
  EXPECT_EQ(b_.workers.Find(3)->incarnation, 103u);
}

TEST_F(ReplicaHandoffTest, ADamagedSnapshotIsRefusedAndChangesNothing) {
  const std::vector<char> good = Snapshot();
  std::vector<char> flipped = good;
  flipped[good.size() / 2] ^= 0x40;
  EXPECT_EQ(Restore(flipped).code(), StatusCode::kDataLoss);
  std::vector<char> cut(good.begin(), good.begin() + good.size() / 3);
  EXPECT_FALSE(Restore(cut).ok());
  EXPECT_EQ(Restore(good, /*group=*/2).code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(b_.chunks.initialised(0));
  EXPECT_FALSE(b_.chunks.initialised(1));
  EXPECT_EQ(b_.workers.Find(0), nullptr);
  // Accepted once; a second restore onto the now initialised chunks is refused.
  ASSERT_TRUE(Restore(good).ok());
  EXPECT_EQ(Restore(good).code(), StatusCode::kFailedPrecondition);
}

TEST_F(ReplicaHandoffTest, AShortBufferIsRefused) {
  std::vector<char> buf(HandoffBytes(p_.state()) - 1);
  EXPECT_EQ(WriteHandoff(p_.state(), 1, buf.data(), buf.size()).status().code(),
            StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace shardps::server
