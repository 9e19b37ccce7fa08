// Client settings from the environment (shardps::WithEnvironmentDefaults), as launchers set them:
// what the caller set wins; the rank comes from the first launcher variable that holds a
// non-negative integer; a client with no coordinator anywhere is refused with the reason.
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "shardps/client.h"

namespace shardps {
namespace {

class ClientEnvTest : public ::testing::Test {
 protected:
  void SetUp() override { Clear(); }
  void TearDown() override { Clear(); }
  static void Clear() {
    for (const char* v : {"SHARDPS_COORDINATOR", "SHARDPS_CLUSTER_TOKEN", "SHARDPS_TRANSPORT",
                          "SHARDPS_BIND_IP", "SHARDPS_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                          "RANK"}) {
      unsetenv(v);
    }
  }
};

TEST_F(ClientEnvTest, UnsetFieldsComeFromTheEnvironment) {
  setenv("SHARDPS_COORDINATOR", "10.0.0.1:7070,10.0.0.2:7070", 1);
  setenv("SHARDPS_CLUSTER_TOKEN", "secret", 1);
  setenv("SHARDPS_TRANSPORT", "tcp", 1);
  setenv("SHARDPS_BIND_IP", "10.0.0.9", 1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("RANK", "7", 1);
  std::string sources;
  const ClientOptions o = WithEnvironmentDefaults(ClientOptions(), &sources);
  EXPECT_EQ(o.coordinator, "10.0.0.1:7070,10.0.0.2:7070");
  EXPECT_EQ(o.cluster_token, "secret");
  EXPECT_EQ(o.transport, "tcp");
  EXPECT_EQ(o.bind_ip, "10.0.0.9");
  EXPECT_EQ(o.requested_rank, 5) << "SLURM_PROCID comes before torchrun's RANK";
  EXPECT_NE(sources.find("rank 5 from SLURM_PROCID"), std::string::npos) << sources;
  EXPECT_NE(sources.find("cluster token from SHARDPS_CLUSTER_TOKEN"), std::string::npos);
}

TEST_F(ClientEnvTest, WhatTheCallerSetWinsAndBadRanksAreSkipped) {
  setenv("SHARDPS_COORDINATOR", "10.0.0.1:7070", 1);
  setenv("SHARDPS_CLUSTER_TOKEN", "from-env", 1);
  setenv("SHARDPS_RANK", "-1", 1);
  setenv("OMPI_COMM_WORLD_RANK", "2x", 1);
  setenv("PMI_RANK", "3", 1);
  ClientOptions given;
  given.coordinator = "127.0.0.1:1";
  given.cluster_token = "given";
  given.transport = "shm";
  given.bind_ip = "127.0.0.1";
  setenv("SHARDPS_BIND_IP", "10.0.0.9", 1);
  const ClientOptions o = WithEnvironmentDefaults(given);
  EXPECT_EQ(o.bind_ip, "127.0.0.1");
  EXPECT_EQ(o.coordinator, "127.0.0.1:1");
  EXPECT_EQ(o.cluster_token, "given");
  EXPECT_EQ(o.transport, "shm");
  EXPECT_EQ(o.requested_rank, 3);
  given.requested_rank = 0;
  EXPECT_EQ(WithEnvironmentDefaults(given).requested_rank, 0);
}

TEST_F(ClientEnvTest, NoCoordinatorAnywhereIsRefusedWithTheReason) {
  auto c = Client::Connect(ClientOptions());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("SHARDPS_COORDINATOR"), std::string::npos);
}

}  // namespace
}  // namespace shardps
