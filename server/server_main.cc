// shardps_server: owns shards of the model in registered memory and applies the gradients that
// workers write into it.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include <sys/prctl.h>
#include <unistd.h>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "common/metrics_flags.h"
#include "common/trace.h"
#include "common/version.h"
#include "server/server_metrics.h"
#include "server/shard_server.h"
#include "transport/flags.h"

DEFINE_string(coordinator, "127.0.0.1:7070", "shardps_coordinator address (host:port)");
DEFINE_string(cluster_token, "", "Cluster secret; empty reads $SHARDPS_CLUSTER_TOKEN");
DEFINE_string(data_listen, "", "Data-path listen address (empty: --bind_ip with port 0)");
DEFINE_int32(rank, -1, "Requested server rank (-1: the coordinator picks)");
DEFINE_string(optimizer, "sgd", "sgd, momentum, adam, or store (benchmarks: keep the last pushed value)");
DEFINE_double(lr, 0.1, "Learning rate");
DEFINE_double(momentum, 0.9, "Momentum (momentum optimizer)");
DEFINE_double(beta1, 0.9, "Adam beta1");
DEFINE_double(beta2, 0.999, "Adam beta2");
DEFINE_double(eps, 1e-8, "Adam epsilon");
DEFINE_double(weight_decay, 0.0, "L2 weight decay");
DEFINE_string(aggregation, "average", "average or sum of the workers' gradients");
DEFINE_double(vsgd_lambda, 1.0, "VSGD: lr / (1 + lambda * relative weight drift)");
DEFINE_int32(vsgd_history, 8, "VSGD: weight versions kept per chunk");
DEFINE_string(checkpoint_dir, "", "Write checkpoints here (default: the coordinator's --checkpoint_dir)");
DEFINE_string(restore_from, "",
              "Start from the newest complete, valid checkpoint in this directory (a corrupt or "
              "incomplete newer one is refused and reported)");
DEFINE_bool(exit_when_done, false,
            "Exit once every expected worker has joined and all have left (batch jobs, mpirun)");
DEFINE_string(trace_file, "",
              "Write a timeline trace (Chrome-trace JSON, docs/tracing.md) here; empty = off. "
              "{rank} or %r become <rank>-<pid>");
DEFINE_uint64(trace_max_events, 1000000, "Trace events kept; later ones are dropped (counted)");
DEFINE_int64(stall_report_ms, 10000,
             "Log (once per stall, with what it waits for: the workers a BSP clock lacks, their "
             "announced clocks, queued pushes) and count any chunk that waits this long without "
             "publishing a new version; 0: off");
DEFINE_int64(busy_poll_us, 300,
             "How long the serving loop polls after its last completion before it sleeps "
             "(0: sleep at once; negative: never sleep, a core per server)");
DEFINE_bool(spare, false,
            "Join as a spare: no shards at start; become the new backup of a group that lost one "
            "(re-replication while training goes on; docs/fault-tolerance.md)");

namespace {
std::atomic<shardps::server::ShardServer*> g_server{nullptr};
void OnSignal(int sig) {
  // Serving: stop cleanly (leave, drain). Before that — waiting for the cluster to form, for a
  // shard assignment, or for a coordinator that has gone — nothing is held that a clean stop
  // would save, and those waits do not poll the stop flag: exit at once.
  auto* s = g_server.load();
  if (s != nullptr && s->serving()) {
    s->Stop();
  } else {
    _exit(128 + sig);
  }
}
}  // namespace

int main(int argc, char** argv) {
  shardps::ParseCommandLine(
      &argc, &argv, "shardps_server --coordinator=HOST:PORT --transport=verbs|tcp|shm", __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  using namespace shardps::server;
  ShardServerOptions o;
  o.fabric = shardps::transport::FabricOptionsFromFlags();
  if (o.fabric.provider == "shm") {
    // The arenas' memfds are reachable through /proc/<pid>/fd by any process of this uid unless
    // the process is not dumpable (docs/security.md): members prove credentials, bystanders of
    // the same uid must not bypass that. (No core dumps and no same-uid ptrace follow.)
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0) {
      LOG(INFO) << "shm: this server is not dumpable (/proc/" << getpid()
                << "/fd closed to other processes of its uid; no core dumps)";
    } else {
      PLOG(WARNING) << "shm: prctl(PR_SET_DUMPABLE, 0)";
    }
  }
  o.data_listen = FLAGS_data_listen;
  o.coordinator = FLAGS_coordinator;
  o.cluster_token = FLAGS_cluster_token;
  if (o.cluster_token.empty() && getenv("SHARDPS_CLUSTER_TOKEN")) {
    o.cluster_token = getenv("SHARDPS_CLUSTER_TOKEN");
  }
  o.requested_rank = FLAGS_rank;
  auto kind = ParseOptimizerKind(FLAGS_optimizer);
  if (!kind.ok()) {
    LOG(ERROR) << kind.status();
    return 2;
  }
  o.optimizer.kind = *kind;
  o.optimizer.lr = static_cast<float>(FLAGS_lr);
  o.optimizer.momentum = static_cast<float>(FLAGS_momentum);
  o.optimizer.beta1 = static_cast<float>(FLAGS_beta1);
  o.optimizer.beta2 = static_cast<float>(FLAGS_beta2);
  o.optimizer.eps = static_cast<float>(FLAGS_eps);
  o.optimizer.weight_decay = static_cast<float>(FLAGS_weight_decay);
  if (FLAGS_aggregation != "average" && FLAGS_aggregation != "sum") {
    LOG(ERROR) << "--aggregation must be average or sum";
    return 2;
  }
  o.average = FLAGS_aggregation == "average";
  o.vsgd_lambda = static_cast<float>(FLAGS_vsgd_lambda);
  o.vsgd_history = FLAGS_vsgd_history;
  o.exit_when_workers_done = FLAGS_exit_when_done;
  o.spare = FLAGS_spare;
  if (FLAGS_busy_poll_us > 1000000) {  // beyond a second it is a mistake (and overflows in ns)
    LOG(ERROR) << "--busy_poll_us=" << FLAGS_busy_poll_us
               << " is over 1 s: pass at most 1000000, or a negative value never to sleep";
    return 2;
  }
  o.busy_poll = std::chrono::microseconds(FLAGS_busy_poll_us);
  o.stall_report = std::chrono::milliseconds(std::max<int64_t>(0, FLAGS_stall_report_ms));
  o.checkpoint_dir = FLAGS_checkpoint_dir;
  o.restore_dir = FLAGS_restore_from;
  shardps::trace::ScopedTrace tracing;  // flushed and closed when main returns
  if (shardps::Status t = tracing.Begin({FLAGS_trace_file, FLAGS_trace_max_events}); !t.ok()) {
    LOG(ERROR) << "--trace_file: " << t;
    return 2;
  }
  if (tracing.owns()) shardps::trace::NameThread("apply");
  ShardServer server(o);
  // /metrics (--metrics_port): reads the server's counters at scrape time, on its own thread.
  shardps::metrics::Registry registry;
  AddServerMetrics(&server, &registry);
  auto metrics = shardps::metrics::StartMetricsFromFlags([&registry] { return registry.Render(); });
  if (!metrics.ok()) {
    LOG(ERROR) << "shardps_server: " << metrics.status();
    return 2;
  }
  g_server = &server;
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  shardps::Status s = server.Run();
  g_server = nullptr;
  if (!s.ok()) {
    LOG(ERROR) << "shardps_server: " << s;
    return 1;
  }
  return 0;
}
