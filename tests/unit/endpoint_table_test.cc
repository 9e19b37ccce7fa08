// EndpointTable over two in-process shm fabrics (no network).
#include "server/endpoint_table.h"

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

std::unique_ptr<transport::Fabric> OpenShm() {
  transport::FabricOptions o;
  o.provider = "shm";
  auto f = transport::Fabric::Open(o);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : nullptr;
}

TEST(EndpointTableTest, AcceptsBindsWorkersAndReportsFailedEndpoints) {
  auto server = OpenShm();
  auto client = OpenShm();
  ASSERT_TRUE(server && client);
  auto scq = server->CreateCompletionQueue(1024);
  auto ccq = client->CreateCompletionQueue(1024);
  ASSERT_TRUE(scq.ok() && ccq.ok());
  auto l = server->Listen("");
  ASSERT_TRUE(l.ok()) << l.status();
  EndpointTable table(std::move(*l));
  Status error;
  int refused = 0;
  EXPECT_EQ(table.AcceptPending(scq->get(), 16, 16, &error, &refused), 0);  // nobody: no block
  EXPECT_TRUE(error.ok()) << error;

  std::unique_ptr<transport::Endpoint> peers[2];
  for (auto& p : peers) {
    transport::EndpointOptions eo;
    eo.send_depth = 16;
    eo.recv_depth = 16;
    StatusOr<std::unique_ptr<transport::Endpoint>> ep = InternalError("not run");
    std::thread t([&] { ep = client->Connect(table.address(), ccq->get(), eo); });
    int accepted = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (accepted == 0 && std::chrono::steady_clock::now() < deadline) {
      accepted = table.AcceptPending(scq->get(), 16, 16, &error, &refused);
      if (accepted == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    t.join();
    ASSERT_EQ(accepted, 1);
    ASSERT_TRUE(ep.ok()) << ep.status();
    p = std::move(*ep);
  }
  EXPECT_EQ(table.size(), 2u);
  EXPECT_TRUE(table.Healthy(1));
  EXPECT_TRUE(table.Healthy(2));
  EXPECT_FALSE(table.Healthy(3));
  table.BindWorker(2, 7);
  EXPECT_EQ(table.WorkerOf(2), std::optional<uint32_t>(7));
  EXPECT_FALSE(table.WorkerOf(1).has_value());

  // The peer of endpoint 2 goes away: reported once, its worker binding stays.
  peers[1].reset();
  std::vector<std::pair<uint64_t, Status>> dropped;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (dropped.empty() && std::chrono::steady_clock::now() < deadline) {
    transport::Completion wc[8];
    (*scq)->Poll(wc, 8);
    dropped = table.DropFailed();
    if (dropped.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].first, 2u);
  EXPECT_FALSE(dropped[0].second.ok());
  EXPECT_EQ(table.size(), 1u);
  EXPECT_TRUE(table.DropFailed().empty());
  EXPECT_EQ(table.WorkerOf(2), std::optional<uint32_t>(7));
  table.Close(1);
  EXPECT_EQ(table.size(), 0u);
  table.CloseAll();
  EXPECT_FALSE(table.WorkerOf(2).has_value());
}

}  // namespace
}  // namespace shardps::server
