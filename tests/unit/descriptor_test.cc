#include <gtest/gtest.h>

#include "transport/transport.h"

namespace shardps::transport {
namespace {

RegionDescriptor Sample() {
  RegionDescriptor d;
  d.provider = "verbs";
  d.addr = 0x7f00'dead'beefULL;
  d.length = 64ull << 20;
  d.rkey = 0x1234'5678;
  d.access = Access::kRemoteWrite;
  d.provider_data = std::string("\x00\x01\xff", 3);
  return d;
}

TEST(DescriptorTest, RoundTrips) {
  const RegionDescriptor d = Sample();
  auto back = RegionDescriptor::Decode(d.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->provider, "verbs");
  EXPECT_EQ(back->addr, d.addr);
  EXPECT_EQ(back->length, d.length);
  EXPECT_EQ(back->rkey, d.rkey);
  EXPECT_EQ(back->access, Access::kRemoteWrite);
  EXPECT_EQ(back->provider_data, d.provider_data);
}

TEST(DescriptorTest, RejectsTruncationAndGarbage) {
  const std::string enc = Sample().Encode();
  for (size_t n = 0; n < enc.size(); ++n) {
    EXPECT_FALSE(RegionDescriptor::Decode(enc.substr(0, n)).ok()) << "prefix " << n;
  }
  EXPECT_FALSE(RegionDescriptor::Decode(enc + "x").ok());
  std::string bad_version = enc;
  bad_version[0] = 9;
  EXPECT_FALSE(RegionDescriptor::Decode(bad_version).ok());
  std::string bad_access = enc;
  bad_access[1] = 7;
  EXPECT_FALSE(RegionDescriptor::Decode(bad_access).ok());
}

TEST(DescriptorTest, RejectsWrapAround) {
  RegionDescriptor d = Sample();
  d.addr = ~0ull - 10;
  d.length = 100;
  EXPECT_FALSE(RegionDescriptor::Decode(d.Encode()).ok());
}

TEST(DescriptorTest, UnknownProviderNameIsAnError) {
  FabricOptions o;
  o.provider = "carrier-pigeon";
  auto f = Fabric::Open(o);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("carrier-pigeon"), std::string::npos);
}

}  // namespace
}  // namespace shardps::transport
