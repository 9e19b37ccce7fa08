#include "server/chunk_store.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "common/half.h"

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
  // Past the history's length its buffers are reused (no allocation per publication): the
  // versions it answers for hold their own weights.
  for (int v = 4; v <= 6; ++v) store->Publish(0, store->Compute(0, grad, 1.0f, 1.0f), 0);
  ASSERT_EQ(store->published(0)[0], -1.5f);                       // version 6
  ASSERT_EQ(store->history(0).size(), 2u);
  EXPECT_EQ(store->history(0).front().first, 5u);
  EXPECT_EQ(store->history(0).front().second, std::vector<float>(4, -1.0f));
  // drift |(-1.5) - (-1)| / |-1.5| = 1/3: scale 1 / (1 + 1/3)
  EXPECT_FLOAT_EQ(store->ValueStalenessScale(0, 5, 1.0f), 0.75f);
  EXPECT_FLOAT_EQ(store->ValueStalenessScale(0, 4, 1.0f), 0.5f);  // forgotten
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

// A bfloat16 chunk: the registered buffers hold what workers pull (the float32 master rounded
// to nearest even); the master keeps what bfloat16 cannot (a step smaller than half an ulp);
// Capture/Restore carry the master.
TEST(ChunkStore16Test, Bfloat16ChunkKeepsAFloat32MasterAndPublishesItRounded) {
  struct alignas(64) Line {
    char bytes[64];
  };
  layout::ServerLayout layout({8}, 1);  // 4 bfloat16 elements
  std::vector<Line> memory(layout.weights_bytes() / 64 + 1);
  ChunkStore::Options o;
  o.optimizer.lr = 1.0f;
  ChunkStore store(o, layout, memory.data(), {3}, {8},
                   {static_cast<uint32_t>(layout::DType::kBF16)});
  EXPECT_EQ(store.elems(0), 4u);
  EXPECT_EQ(store.value_bytes(0), 16u);
  const uint16_t init[4] = {FloatToBF16(1.0f), FloatToBF16(-2.0f), FloatToBF16(256.0f),
                            FloatToBF16(0.5f)};
  store.Publish(0, store.Init(0, init), 1);
  EXPECT_EQ(store.published(0)[2], 256.0f);
  // A push of bfloat16 gradients, decoded and applied to the master.
  const uint16_t g16[4] = {FloatToBF16(0.25f), FloatToBF16(0.0f), FloatToBF16(0.5f),
                           FloatToBF16(-0.125f)};
  float g[4];
  store.DecodeGradient(0, g16, g, false);
  EXPECT_EQ(g[3], -0.125f);
  for (int step = 0; step < 3; ++step) store.Publish(0, store.Compute(0, g, 1.0f, 1.0f), 2);
  const float* master = store.published(0);
  EXPECT_EQ(master[0], 0.25f);
  EXPECT_EQ(master[2], 254.5f);  // 256 - 3 * 0.5: not a bfloat16 (its ulp at 256 is 2)
  const auto* pulled = reinterpret_cast<const uint16_t*>(
      reinterpret_cast<const char*>(memory.data()) + layout.buffer_offset(0, 1));
  EXPECT_EQ(pulled[0], FloatToBF16(0.25f));
  EXPECT_EQ(BF16ToFloat(pulled[2]), 254.0f);  // 254.5 rounds to even: 254
  EXPECT_EQ(pulled[3], FloatToBF16(0.875f));
  const ChunkState cs = store.Capture(0);
  ASSERT_EQ(cs.weights.size(), 4u);
  EXPECT_EQ(cs.weights[2], 254.5f);
  ChunkStore other(o, layout, memory.data(), {3}, {8},
                   {static_cast<uint32_t>(layout::DType::kBF16)});
  ASSERT_TRUE(other.Restore(0, cs, 5).ok());
  EXPECT_EQ(other.published(0)[2], 254.5f);
  const auto* restored = reinterpret_cast<const uint16_t*>(
      reinterpret_cast<const char*>(memory.data()) + layout.buffer_offset(0, 0));
  EXPECT_EQ(BF16ToFloat(restored[2]), 254.0f);
}

// The conversions are torch's: every float16 value survives float32 and back; ties round to
// even; overflow is infinity; NaN stays NaN; subnormals are kept.
TEST(HalfTest, ConversionsRoundToNearestEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    if (f != f) {
      EXPECT_NE(FloatToF16(f) & 0x3ff, 0) << h;  // NaN stays NaN
      continue;
    }
    ASSERT_EQ(FloatToF16(f), h) << h;
    ASSERT_EQ(FloatToBF16(BF16ToFloat(static_cast<uint16_t>(h))), h & 0xffff) << h;
  }
  EXPECT_EQ(F16ToFloat(0x0001), 5.9604644775390625e-08f);  // the smallest subnormal
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(1.0f + 1.0f / 2048), 0x3c00);  // a tie: to even (down)
  EXPECT_EQ(FloatToF16(1.0f + 3.0f / 2048), 0x3c02);  // a tie: to even (up)
  EXPECT_EQ(FloatToF16(2.9802322387695312e-08f), 0x0000);  // half the smallest: to even (0)
  EXPECT_EQ(FloatToF16(4.4703483581542969e-08f), 0x0001);  // 0.75 of it: up
  EXPECT_EQ(FloatToBF16(1.0f + 1.0f / 256), 0x3f80);  // a tie: to even (down)
  EXPECT_EQ(FloatToBF16(1.0f + 3.0f / 256), 0x3f82);  // a tie: to even (up)
  EXPECT_EQ(FloatToBF16(3.4e38f), 0x7f80);           // past bfloat16's max: infinity
  const float nan = std::nanf("");
  EXPECT_NE(BF16ToFloat(FloatToBF16(nan)), BF16ToFloat(FloatToBF16(nan)));
}

}  // namespace
}  // namespace shardps::server
