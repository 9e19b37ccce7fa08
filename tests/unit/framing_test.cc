#include "proto/framing.h"

#include <gtest/gtest.h>

namespace shardps::control {
namespace {

Envelope Join(const std::string& token) {
  Envelope e;
  e.mutable_join()->set_cluster_token(token);
  e.mutable_join()->set_role(ROLE_WORKER);
  e.mutable_join()->set_hostname("h");
  return e;
}

TEST(FramingTest, RoundTripsByteByByte) {
  auto f1 = EncodeFrame(Join("alpha"));
  auto f2 = EncodeFrame(Join("beta"));
  ASSERT_TRUE(f1.ok() && f2.ok());
  const std::string stream = *f1 + *f2;
  FrameDecoder d;
  std::vector<std::string> tokens;
  Envelope e;
  for (char ch : stream) {
    d.Feed(&ch, 1);
    auto got = d.Next(&e);
    ASSERT_TRUE(got.ok()) << got.status();
    if (*got) tokens.push_back(e.join().cluster_token());
  }
  EXPECT_EQ(tokens, (std::vector<std::string>{"alpha", "beta"}));
  EXPECT_EQ(d.buffered(), 0u);
}

TEST(FramingTest, RejectsOversizedFrameBeforeBufferingIt) {
  FrameDecoder d(1024);
  const unsigned char hdr[4] = {0x00, 0x00, 0x10, 0x00};  // 1 MiB
  d.Feed(reinterpret_cast<const char*>(hdr), 4);
  Envelope e;
  auto got = d.Next(&e);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kResourceExhausted);
  // Poisoned: stays an error.
  EXPECT_FALSE(d.Next(&e).ok());
}

TEST(FramingTest, RejectsZeroLengthGarbageAndEmptyBody) {
  {
    FrameDecoder d;
    const char zero[4] = {0, 0, 0, 0};
    d.Feed(zero, 4);
    Envelope e;
    EXPECT_FALSE(d.Next(&e).ok());
  }
  {
    FrameDecoder d;
    const char garbage[] = {8, 0, 0, 0, '\xff', '\xff', '\xff', '\xff', '\xff', '\xff', '\xff',
                            '\xff'};
    d.Feed(garbage, sizeof(garbage));
    Envelope e;
    auto got = d.Next(&e);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  }
  {
    // A valid protobuf that sets no body (unknown field 99).
    FrameDecoder d;
    const char unknown[] = {3, 0, 0, 0, static_cast<char>(99 << 3), 1, 0};
    d.Feed(unknown, sizeof(unknown));
    Envelope e;
    EXPECT_FALSE(d.Next(&e).ok());
  }
  Envelope empty;
  EXPECT_FALSE(EncodeFrame(empty).ok());
}

TEST(FramingTest, TruncatedFrameWaitsForMore) {
  auto f = EncodeFrame(Join("t"));
  ASSERT_TRUE(f.ok());
  FrameDecoder d;
  d.Feed(f->data(), f->size() - 1);
  Envelope e;
  auto got = d.Next(&e);
  ASSERT_TRUE(got.ok());
  EXPECT_FALSE(*got);
}

}  // namespace
}  // namespace shardps::control
