#include "server/chunk_store.h"

#include <vector>

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

class ChunkStoreTest : public ::testing::Test {
 protected:
  // Registered regions are page-aligned; the headers need their 64-byte alignment.
  struct alignas(64) Line {
    char bytes[64];
  };
  ChunkStoreTest() : layout_({16, 8}, 2), memory_(layout_.weights_bytes() / 64 + 1) {}
  std::unique_ptr<ChunkStore> Make(int history) {
    ChunkStore::Options o;
    o.optimizer.lr = 0.5f;
    o.history = history;
    return std::make_unique<ChunkStore>(o, layout_, memory_.data(), std::vector<uint32_t>{7, 9},
                                        std::vector<uint64_t>{16, 8});
  }
  const layout::ChunkHeader& header(uint32_t slot) const {
    return *reinterpret_cast<const layout::ChunkHeader*>(
        reinterpret_cast<const char*>(memory_.data()) + layout_.header_offset(slot));
  }
  const float* buffer(uint32_t slot, uint32_t b) const {
    return reinterpret_cast<const float*>(reinterpret_cast<const char*>(memory_.data()) +
                                          layout_.buffer_offset(slot, b));
  }
  layout::ServerLayout layout_;
  std::vector<Line> memory_;
};

TEST_F(ChunkStoreTest, ComputeWritesTheOtherBufferAndPublishFlipsTheStateWord) {
  auto store = Make(0);
  EXPECT_EQ(store->slots(), 2u);
  EXPECT_EQ(store->chunk_id(1), 9u);
  EXPECT_EQ(store->elems(0), 4u);
  EXPECT_FALSE(store->initialised(0));
  const float init[4] = {1, 2, 3, 4};
  EXPECT_EQ(store->Init(0, init), 0u);
  EXPECT_EQ(header(0).gen[0].load(), 1u);  // bumped before the buffer was written
  EXPECT_EQ(header(0).state.load(), 0u);   // not visible yet
  store->Publish(0, 0, 0);
  EXPECT_EQ(header(0).state.load(), 1u << 1);  // version 1 in buffer 0
  EXPECT_EQ(store->version(0), 1u);

  const float grad[4] = {2, 2, 2, 2};
  const uint32_t b = store->Compute(0, grad, 0.5f, 1.0f);
  EXPECT_EQ(b, 1u);
  EXPECT_EQ(header(0).gen[1].load(), 1u);
  EXPECT_EQ(header(0).state.load(), 1u << 1) << "pulls still read version 1";
  EXPECT_FLOAT_EQ(buffer(0, 1)[0], 1.0f - 0.5f * 1.0f);
  EXPECT_FLOAT_EQ(store->published(0)[0], 1.0f);
  store->Publish(0, b, 3);
  EXPECT_EQ(header(0).state.load(), (2u << 1) | 1u);
  EXPECT_EQ(header(0).version[1].load(), 2u);
  EXPECT_EQ(store->published_min_clock_plus1(0), 3u);
  store->RaisePublishedMinClock(0, 2);  // never lowers
  EXPECT_EQ(header(0).min_clock_plus1[1].load(), 3u);
  store->RaisePublishedMinClock(0, 5);
  EXPECT_EQ(store->max_published_min_clock_plus1(), 5u);
  // The next version goes back to buffer 0, whose generation moves again.
  EXPECT_EQ(store->Compute(0, grad, 0.5f, 1.0f), 0u);
  EXPECT_EQ(header(0).gen[0].load(), 2u);
  store->SetServingEpoch(4);
  EXPECT_EQ(header(1).serving_epoch.load(), 4u);
}

TEST_F(ChunkStoreTest, ValueStalenessUsesTheHistoryOfPublishedVersions) {
  auto store = Make(2);
  const float init[4] = {1, 1, 1, 1};
  store->Publish(0, store->Init(0, init), 0);
  const float grad[4] = {1, 1, 1, 1};
  store->Publish(0, store->Compute(0, grad, 1.0f, 1.0f), 0);      // version 2: 0.5
  store->Publish(0, store->Compute(0, grad, 1.0f, 1.0f), 0);      // version 3: 0
  EXPECT_EQ(store->ValueStalenessScale(0, 3, 1.0f), 1.0f);        // current
  EXPECT_LT(store->ValueStalenessScale(0, 2, 1.0f), 1.0f);        // in the history
  EXPECT_FLOAT_EQ(store->ValueStalenessScale(0, 1, 1.0f), 0.5f);  // forgotten: maximal
}

TEST_F(ChunkStoreTest, CaptureAndRestoreRoundTrip) {
  auto store = Make(0);
  const float init[2] = {5, 6};
  store->Publish(1, store->Init(1, init), 0);
  const float grad[2] = {2, 4};
  store->Publish(1, store->Compute(1, grad, 1.0f, 1.0f), 4);
  ChunkState cs = store->Capture(1);
  EXPECT_EQ(cs.chunk_id, 9u);
  EXPECT_EQ(cs.version, 2u);
  EXPECT_EQ(cs.weights, (std::vector<float>{4, 4}));

  std::vector<Line> other(memory_.size());
  ChunkStore::Options o;
  ChunkStore restored(o, layout_, other.data(), {7, 9}, {16, 8});
  ASSERT_TRUE(restored.Restore(1, cs, 6).ok());
  EXPECT_EQ(restored.version(1), 2u);
  EXPECT_EQ(restored.published_buffer(1), 0u);
  EXPECT_EQ(restored.published_min_clock_plus1(1), 6u);
  EXPECT_EQ(restored.published(1)[1], 4.0f);
  cs.chunk_id = 8;
  EXPECT_FALSE(restored.Restore(1, cs, 6).ok());
}

}  // namespace
}  // namespace shardps::server
