// The etcd client (proto/etcd_client.h) against a real 3-member etcd cluster on loopback
// (Debian's etcd-server), started and torn down by the test, every wait bounded: values and
// leases round-trip, an election has exactly one winner, a guarded write is refused once the
// guard changed, a lease's keys vanish when it expires, and the client goes on when the member
// it used dies. Skips with the reason where /usr/bin/etcd is missing.
#include "proto/etcd_client.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "tests/integration/child_process.h"
#include "tests/integration/etcd_cluster.h"

namespace shardps {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

class EtcdClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "shardps-etcd-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    const std::string why = cluster_.Start(dir_);
    if (why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
    ASSERT_EQ(why, "");
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::string Endpoints() const { return cluster_.Endpoints(); }

  std::string dir_;
  testing_util::EtcdCluster cluster_;
};

TEST(EtcdBase64Test, RoundTripsEveryByte) {
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (size_t n : {0, 1, 2, 3, 4, 255, 256}) {
    const std::string s = all.substr(0, n);
    auto back = etcd::Base64Decode(etcd::Base64Encode(s));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, s) << n;
  }
  EXPECT_EQ(etcd::Base64Encode("shardps"), "c2hhcmRwcw==");
  EXPECT_FALSE(etcd::Base64Decode("c2h*").ok());
}

TEST_F(EtcdClusterTest, ValuesRoundTripWithTheirRevisions) {
  auto c = *etcd::Client::Create(Endpoints());
  std::string binary("state\0with\xff bytes", 17);
  ASSERT_TRUE(c.Put("/shardps-test/state", binary).ok());
  auto got = c.Get("/shardps-test/state");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->value, binary);
  EXPECT_GT((*got)->mod_revision, 0);
  auto none = c.Get("/shardps-test/absent");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  ASSERT_TRUE(c.Delete("/shardps-test/state").ok());
  EXPECT_FALSE(c.Get("/shardps-test/state")->has_value());
}

TEST_F(EtcdClusterTest, AnElectionHasOneWinnerAndAGuardedWriteFollowsTheGuard) {
  auto a = *etcd::Client::Create(Endpoints());
  auto b = *etcd::Client::Create(Endpoints());
  auto la = a.GrantLease(10);
  auto lb = b.GrantLease(10);
  ASSERT_TRUE(la.ok() && lb.ok()) << la.status() << lb.status();
  auto wa = a.CreateIfAbsent("/shardps-test/leader", "A", *la);
  auto wb = b.CreateIfAbsent("/shardps-test/leader", "B", *lb);
  ASSERT_TRUE(wa.ok() && wb.ok()) << wa.status() << wb.status();
  EXPECT_TRUE(*wa);
  EXPECT_FALSE(*wb);
  EXPECT_EQ((*a.Get("/shardps-test/leader"))->value, "A");
  EXPECT_EQ((*a.Get("/shardps-test/leader"))->lease, *la);
  EXPECT_TRUE(*a.PutIf("/shardps-test/leader", "A", "/shardps-test/state", "from A"));
  EXPECT_FALSE(*b.PutIf("/shardps-test/leader", "B", "/shardps-test/state", "from B"));
  EXPECT_EQ((*b.Get("/shardps-test/state"))->value, "from A");
  // A's lease revoked: its key goes, and B can win.
  ASSERT_TRUE(a.Revoke(*la).ok());
  EXPECT_FALSE(b.Get("/shardps-test/leader")->has_value());
  EXPECT_TRUE(*b.CreateIfAbsent("/shardps-test/leader", "B", *lb));
}

TEST_F(EtcdClusterTest, AnExpiredLeaseTakesItsKeysAndCannotBeRenewed) {
  auto c = *etcd::Client::Create(Endpoints());
  auto lease = c.GrantLease(1);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(*c.CreateIfAbsent("/shardps-test/leased", "x", *lease));
  auto ttl = c.KeepAlive(*lease);
  ASSERT_TRUE(ttl.ok()) << ttl.status();
  EXPECT_GE(*ttl, 1);
  const auto until = Clock::now() + milliseconds(10000);
  while (Clock::now() < until && c.Get("/shardps-test/leased")->has_value()) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_FALSE(c.Get("/shardps-test/leased")->has_value());
  EXPECT_EQ(c.KeepAlive(*lease).status().code(), StatusCode::kNotFound);
}

TEST_F(EtcdClusterTest, TheClientGoesOnWhenTheMemberItUsedDies) {
  auto c = *etcd::Client::Create(Endpoints(), milliseconds(8000));
  ASSERT_TRUE(c.Put("/shardps-test/k", "1").ok());
  cluster_.member(0)->Kill();  // the first endpoint, the one the client answered from
  const auto until = Clock::now() + milliseconds(15000);
  Status st;
  while (Clock::now() < until && !(st = c.Put("/shardps-test/k", "2")).ok()) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ((*c.Get("/shardps-test/k"))->value, "2");
}

}  // namespace
}  // namespace shardps
