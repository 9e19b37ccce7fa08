#include "server/checkpoint_capture.h"

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

ChunkState State(uint32_t id, uint64_t version) {
  ChunkState s;
  s.chunk_id = id;
  s.version = version;
  s.weights = {static_cast<float>(version)};
  return s;
}

TEST(CheckpointCaptureTest, EachChunkIsCapturedAtItsFirstVersionReachingTheClock) {
  WorkerTable workers(2);
  bool fresh = false;
  workers.Hello(0, 5, 1, &fresh);
  workers.Consume(0, 1, 3, 2);
  CheckpointCapture c({"plan", 1, 2, "lr=0.1"}, 2, 4);
  EXPECT_FALSE(c.Wants(0, 3, 9));  // below the first checkpoint clock (4)
  EXPECT_EQ(c.next(), 4u);
  EXPECT_TRUE(c.Wants(0, 4, 9));
  EXPECT_FALSE(c.Captured(0, State(10, 7), workers).has_value());
  EXPECT_FALSE(c.Wants(0, 5, 9)) << "captured already";
  EXPECT_FALSE(c.Wants(1, 2, 9));
  EXPECT_TRUE(c.Wants(1, 6, 9));
  std::optional<ShardSnapshot> s = c.Captured(1, State(11, 3), workers);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->clock, 4u);
  EXPECT_EQ(s->epoch, 9u);
  EXPECT_EQ(s->group, 1u);
  EXPECT_EQ(s->num_groups, 2u);
  EXPECT_EQ(s->plan_fingerprint, "plan");
  ASSERT_EQ(s->chunks.size(), 2u);
  EXPECT_EQ(s->chunks[0].version, 7u);
  EXPECT_EQ(s->chunks[1].chunk_id, 11u);
  ASSERT_EQ(s->workers.size(), 1u);
  EXPECT_EQ(s->workers[0].last_seq, (std::vector<uint64_t>{0, 3}));
  EXPECT_EQ(s->workers[0].applied_clock, (std::vector<int64_t>{-1, 2}));
  EXPECT_EQ(c.last(), 4u);
  EXPECT_EQ(c.next(), 8u);
}

TEST(CheckpointCaptureTest, RequestsAreAcceptedIgnoredOrRefused) {
  WorkerTable workers(1);
  CheckpointCapture c({"plan", 0, 1, ""}, 1, 0);
  c.Restored(3);
  EXPECT_EQ(c.OnRequest(3, 0), CheckpointCapture::Request::kIgnored);  // not after the last
  EXPECT_EQ(c.OnRequest(5, 6), CheckpointCapture::Request::kRefused);  // already at clock 5
  EXPECT_EQ(c.OnRequest(5, 5), CheckpointCapture::Request::kAccepted);
  EXPECT_EQ(c.OnRequest(7, 0), CheckpointCapture::Request::kIgnored);  // one is planned before
  EXPECT_EQ(c.OnRequest(4, 0), CheckpointCapture::Request::kAccepted);
  EXPECT_FALSE(c.Wants(0, 3, 1));
  EXPECT_TRUE(c.Wants(0, 4, 1));
  EXPECT_EQ(c.OnRequest(4, 0), CheckpointCapture::Request::kIgnored);  // being captured
  ASSERT_TRUE(c.Captured(0, State(1, 1), workers).has_value());
  EXPECT_EQ(c.next(), 0u);  // on request only
  EXPECT_FALSE(c.Wants(0, 9, 1));
}

}  // namespace
}  // namespace shardps::server
