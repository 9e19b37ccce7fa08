// An in-process cluster for integration tests: a coordinator and shard servers on their own
// threads, over a real transport (tcp and shm here; verbs in the SoftRoCE guest). Workers are
// the test's own shardps::Client objects (WorkerOptions gives their options).
//
// Thread safety: construct and destroy on the test's thread; WorkerOptions may be called from
// worker threads.
#ifndef SHARDPS_TESTS_INTEGRATION_IN_PROCESS_CLUSTER_H_
#define SHARDPS_TESTS_INTEGRATION_IN_PROCESS_CLUSTER_H_

#include <dirent.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "server/coordinator.h"
#include "server/shard_server.h"
#include "shardps/client.h"
#include "transport/transport.h"

namespace shardps::test {

inline constexpr char kToken[] = "cluster-secret";

struct ClusterSpec {
  std::string transport = "tcp";
  control::ConsistencyMode mode = control::BSP;
  uint32_t staleness = 0;
  int servers = 2;
  int workers = 2;
  uint64_t partition_bytes = 4096;
  server::OptimizerConfig optimizer;
  bool average = true;
  int heartbeat_timeout_ms = 1500;
  // ShardServerOptions::busy_poll of every server (its default unless a test sets it).
  std::chrono::microseconds server_busy_poll = server::ShardServerOptions().busy_poll;
};

// Where each role binds: loopback for tcp/shm; for verbs two rxe devices (the SoftRoCE
// guest's rxe0/rxe1 by default) so that every operation crosses a wire.
inline std::string ServerIp(const std::string& transport) {
  if (transport != "verbs") return "127.0.0.1";
  const char* ip = getenv("SHARDPS_TEST_VERBS_TARGET_IP");
  return ip ? ip : "192.168.77.2";
}
inline std::string WorkerIp(const std::string& transport) {
  if (transport != "verbs") return "127.0.0.1";
  const char* ip = getenv("SHARDPS_TEST_VERBS_INITIATOR_IP");
  return ip ? ip : "192.168.77.1";
}

// Empty when the transport can run here; the reason otherwise. SHARDPS_REQUIRE_VERBS=1 (set
// inside the SoftRoCE guest) turns a verbs skip into a failure.
inline std::string SkipReason(const std::string& transport) {
  if (transport != "verbs") return "";
  const char* req = getenv("SHARDPS_REQUIRE_VERBS");
  if (req != nullptr && std::string(req) == "1") return "";
  if (transport::CompiledProviders().find("verbs") == std::string::npos) {
    return "built without verbs";
  }
  bool any = false;
  if (DIR* d = opendir("/sys/class/infiniband")) {
    while (dirent* e = readdir(d)) any |= e->d_name[0] != '.';
    closedir(d);
  }
  return any ? "" : "no RDMA device here; the verbs tier runs in the SoftRoCE guest";
}

class Cluster {
 public:
  explicit Cluster(const ClusterSpec& spec) : spec_(spec) {
    control::CoordinatorOptions co;
    co.listen_address = "127.0.0.1:0";
    co.cluster_token = kToken;
    co.config.set_mode(spec.mode);
    co.config.set_staleness(spec.staleness);
    co.config.set_num_servers(spec.servers);
    co.config.set_num_workers(spec.workers);
    co.config.set_partition_bytes(spec.partition_bytes);
    co.config.set_heartbeat_interval_ms(100);
    co.config.set_heartbeat_timeout_ms(spec.heartbeat_timeout_ms);
    co.config.set_transport(spec.transport);
    auto c = control::Coordinator::Start(co);
    EXPECT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
    for (int i = 0; i < spec.servers; ++i) {
      server::ShardServerOptions so;
      so.fabric.provider = spec.transport;
      so.fabric.bind_ip = ServerIp(spec.transport);
      so.coordinator = coordinator_->address();
      so.cluster_token = kToken;
      so.requested_rank = i;
      so.optimizer = spec.optimizer;
      so.average = spec.average;
      so.busy_poll = spec.server_busy_poll;
      servers_.push_back(std::make_unique<server::ShardServer>(so));
    }
    for (auto& s : servers_) {
      server::ShardServer* p = s.get();
      threads_.emplace_back([p] {
        Status st = p->Run();
        EXPECT_TRUE(st.ok()) << st;
      });
    }
  }
  ~Cluster() {
    for (auto& s : servers_) s->Stop();
    for (auto& t : threads_) t.join();
  }
  void StopServer(int i) { servers_[i]->Stop(); }
  server::ShardServerCounters ServerCounters(int i) { return servers_[i]->counters(); }
  server::ShardServer& Server(int i) { return *servers_[i]; }

  ClientOptions WorkerOptions(int rank) const {
    ClientOptions o;
    o.coordinator = coordinator_->address();
    o.cluster_token = kToken;
    o.requested_rank = rank;
    o.transport = spec_.transport;
    o.bind_ip = WorkerIp(spec_.transport);
    o.setup_timeout = std::chrono::milliseconds(30000);
    o.wait_timeout = std::chrono::milliseconds(15000);
    return o;
  }

 private:
  ClusterSpec spec_;
  std::unique_ptr<control::Coordinator> coordinator_;
  std::vector<std::unique_ptr<server::ShardServer>> servers_;
  std::vector<std::thread> threads_;
};

}  // namespace shardps::test

#endif  // SHARDPS_TESTS_INTEGRATION_IN_PROCESS_CLUSTER_H_
