// shardps_aggregator: the per-host aggregator of hierarchical training (docs/hierarchical.md).
// One per host, started before or with the host's workers; the workers find it through
// SHARDPS_AGGREGATOR=<its --socket> and SHARDPS_LOCAL_RANK (or LOCAL_RANK).
//
//   shardps_aggregator --socket=/run/shardps/agg.sock --local_workers=4
//       --coordinator=10.0.0.1:7070 --transport=verbs [--rank=R]
//
// Exit codes: 0 every local worker left, 2 bad flags, 3 set-up failed, 4 a step failed.
#include <signal.h>
#include <sys/prctl.h>

#include <cstdlib>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "common/version.h"
#include "transport/flags.h"
#include "worker/aggregator.h"

DEFINE_string(socket, "", "Unix socket the local workers join (\"@name\": abstract namespace)");
DEFINE_int32(local_workers, 0, "Workers on this host (all join before the first step)");
DEFINE_string(coordinator, "127.0.0.1:7070", "shardps_coordinator address (host:port)");
DEFINE_string(cluster_token, "", "Cluster secret; empty reads $SHARDPS_CLUSTER_TOKEN");
DEFINE_int32(rank, -1, "Requested worker rank of this host (-1: the coordinator picks)");
DEFINE_int32(setup_timeout_s, 120, "Bound on the local workers joining and the cluster start");
DEFINE_int32(wait_timeout_s, 30, "Bound on one pull waiting for the consistency condition");
DEFINE_int32(failover_timeout_ms, 0, "Bound on a server failover (0: the cluster's)");
DEFINE_uint64(crash_at_clock, 0, "Testing: _exit(9) at this host clock (0: never)");
DEFINE_bool(crash_after_push, false, "Testing: crash after the clock's push, not before");

namespace {
shardps::worker::Aggregator* g_aggregator = nullptr;
void OnSignal(int) {
  if (g_aggregator != nullptr) g_aggregator->Stop();
}
}  // namespace

int main(int argc, char** argv) {
  shardps::ParseCommandLine(&argc, &argv,
                            "shardps_aggregator --socket=PATH --local_workers=N "
                            "--coordinator=HOST:PORT [--transport=verbs|tcp|shm]",
                            __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (FLAGS_socket.empty() || FLAGS_local_workers <= 0) {
    LOG(ERROR) << "--socket and --local_workers (> 0) are required";
    return 2;
  }
  // The shared region's memfd stays off /proc/<pid>/fd for other processes of this uid.
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  shardps::worker::AggregatorOptions o;
  o.socket_path = FLAGS_socket;
  o.local_workers = static_cast<uint32_t>(FLAGS_local_workers);
  o.setup_timeout = std::chrono::seconds(FLAGS_setup_timeout_s);
  o.crash_at_clock = FLAGS_crash_at_clock;
  o.crash_after_push = FLAGS_crash_after_push;
  const auto fo = shardps::transport::FabricOptionsFromFlags();
  o.client.coordinator = FLAGS_coordinator;
  o.client.cluster_token = FLAGS_cluster_token;
  o.client.requested_rank = FLAGS_rank;
  o.client.transport = fo.provider;
  o.client.bind_ip = fo.bind_ip;
  o.client.rdma_device = fo.rdma_device;
  o.client.rdma_gid_index = fo.rdma_gid_index;
  o.client.setup_timeout = std::chrono::seconds(FLAGS_setup_timeout_s);
  o.client.wait_timeout = std::chrono::seconds(FLAGS_wait_timeout_s);
  o.client.failover_timeout = std::chrono::milliseconds(FLAGS_failover_timeout_ms);
  o.client = shardps::WithEnvironmentDefaults(o.client);
  o.client.aggregator.clear();
  auto a = shardps::worker::Aggregator::Create(o);
  if (!a.ok()) {
    LOG(ERROR) << "shardps_aggregator: " << a.status().ToString();
    return 3;
  }
  g_aggregator = a->get();
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);
  signal(SIGPIPE, SIG_IGN);
  const shardps::Status s = (*a)->Run();
  g_aggregator = nullptr;
  if (!s.ok()) {
    LOG(ERROR) << "shardps_aggregator: " << s.ToString();
    return (*a)->steps() == 0 ? 3 : 4;
  }
  return 0;
}
