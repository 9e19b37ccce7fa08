// shardps_coordinator: owns membership and the cluster configuration (docs/control-protocol.md).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "proto/etcd_client.h"

#include "common/metrics_flags.h"
#include "common/net.h"
#include "common/trace.h"
#include "common/version.h"
#include "proto/shard_plan.h"
#include "server/coordinator.h"
#include "server/coordinator_metrics.h"

DEFINE_string(listen, "0.0.0.0:7070", "Control-plane listen address (host:port; port 0 picks)");
DEFINE_string(cluster_token, "",
              "Shared secret every member must present; empty reads $SHARDPS_CLUSTER_TOKEN");
DEFINE_string(consistency, "bsp", "bsp, ssp, asp or vsgd");
DEFINE_int32(staleness, 0, "SSP/VSGD staleness bound s");
DEFINE_int32(num_servers, 1, "Servers expected at start");
DEFINE_int32(num_workers, 1, "Workers expected at start");
DEFINE_int32(heartbeat_interval_ms, 500, "Member heartbeat interval");
DEFINE_int32(heartbeat_timeout_ms, 3000,
             "A member silent this long (or longer, as its measured heartbeat jitter says) is "
             "suspected and its host probed; dead when its host stops acknowledging or its "
             "lease runs out (docs/fault-tolerance.md, \"Liveness\")");
DEFINE_int32(lease_ms, 0,
             "A member silent this long is declared dead; a replicated primary whose heartbeats "
             "went unacknowledged this long stops serving (0: 3 x --heartbeat_timeout_ms)");
DEFINE_double(suspicion_phi, 8.0,
              "Phi-accrual threshold: suspect a member once its silence is this unlikely "
              "(-log10 probability) given its own heartbeat intervals");
DEFINE_string(data_transport, "", "If set, members must use this transport (verbs, tcp, shm)");
DEFINE_uint64(partition_bytes, 4u << 20, "Chunk size for sharding tensors");
DEFINE_string(server_capacity, "",
              "Optional per-server capacity weights in rank order, e.g. 1,0.25 (from shardps plan "
              "--probe or doctor): chunk bytes per server proportional to them; empty: balanced");
DEFINE_string(shard_layout, "lpt",
              "lpt: chunks per tensor, largest first onto the least-loaded server; balanced: the "
              "dense tensors as one buffer cut into one part per server (every server's bytes "
              "equal to one element; docs/hierarchical.md)");
DEFINE_string(address_file, "", "Write the bound address here once listening (for scripts)");
DEFINE_bool(exit_when_done, false,
            "Exit once all --num_workers workers have joined and left again, after the servers "
            "have left too (or --exit_grace_ms has passed): batch jobs under mpirun or scripts");
DEFINE_int32(replicas, 1,
             "Copies of every shard group: 2 = a primary and a backup server per group "
             "(num_servers * replicas server processes; docs/fault-tolerance.md)");
DEFINE_int32(max_workers, 0, "Inbox slots per server: workers that may join (0: num_workers)");
DEFINE_int32(failover_timeout_ms, 0,
             "How long workers wait for a failed server's group to be failed over (0: the larger "
             "of 20 s and lease + promotion drain + heartbeat timeout)");
DEFINE_string(checkpoint_dir, "", "Periodic checkpoints go here (servers read it too)");
DEFINE_int32(checkpoint_every, 0, "Checkpoint every N clocks (0: only on request)");
DEFINE_int32(checkpoint_keep, 3, "Complete checkpoints kept");
DEFINE_string(state_file, "",
              "Save the coordinator's state here after every change; a coordinator restarted "
              "with the same file takes its members back (docs/fault-tolerance.md)");
DEFINE_int32(rejoin_grace_ms, 0,
             "After a restart: members of the saved state that do not rejoin within this are "
             "declared departed (0: the lease; it may not be shorter)");
DEFINE_string(trace_file, "",
              "Write a timeline trace (Chrome-trace JSON, docs/tracing.md) here; empty = off");
DEFINE_uint64(trace_max_events, 1000000, "Trace events kept; later ones are dropped (counted)");
DEFINE_int32(exit_grace_ms, 10000, "--exit_when_done: how long to wait for servers to leave");
DEFINE_string(etcd, "",
              "HA: etcd client endpoints (host:port,...). Several coordinators with the same "
              "--etcd and --etcd_prefix elect one leader; the state lives in etcd, and members "
              "get every coordinator's address (--coordinator=a:p,b:p)");
DEFINE_string(etcd_prefix, "/shardps/default", "HA: the cluster's key prefix in etcd");
DEFINE_int32(etcd_lease_s, 3,
             "HA: the leader's etcd lease (seconds): a dead leader is replaced after about this");

namespace {
std::atomic<bool> g_stop{false};
// HA: steady_clock ns until which the leader's lease surely holds (CoordinatorOptions).
std::atomic<int64_t> g_lead_until_ns{0};
int64_t SteadyNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
// A lease granted or renewed by a request sent at `sent` runs at least until sent + TTL (etcd
// counts it from when it got the request); 3/4 of it leaves room for clock rates and latency.
void ConfirmLease(std::chrono::steady_clock::time_point sent) {
  const auto ttl = std::chrono::seconds(FLAGS_etcd_lease_s);
  g_lead_until_ns.store(SteadyNs(sent + ttl * 3 / 4), std::memory_order_release);
}
void OnSignal(int) { g_stop = true; }

// HA: campaigns until this coordinator holds the leader key (a standby waits here, not
// listening, so members only ever reach the leader); returns the lease it holds it with.
int64_t BecomeLeader(shardps::etcd::Client& etcd, const std::string& key,
                     const std::string& value) {
  std::string seen;
  while (!g_stop) {
    const auto sent = std::chrono::steady_clock::now();
    auto lease = etcd.GrantLease(FLAGS_etcd_lease_s);
    if (lease.ok()) {
      auto won = etcd.CreateIfAbsent(key, value, *lease);
      if (won.ok() && *won) {
        ConfirmLease(sent);
        return *lease;
      }
      etcd.Revoke(*lease).IgnoreError();
      auto leader = etcd.Get(key);
      const std::string now = leader.ok() && leader->has_value() ? (*leader)->value : "";
      if (now != seen) {
        LOG(INFO) << "coordinator: STANDBY; the leader is " << (now.empty() ? "(none)" : now);
        seen = now;
      }
    } else {
      LOG_EVERY_N(WARNING, 10) << "coordinator: etcd: " << lease.status();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return 0;
}

// HA: keeps the leader's lease alive; ends this process the moment it may have lapsed (another
// coordinator may lead from then on, and two must never act at once).
void KeepLeadership(std::string endpoints, int64_t lease) {
  auto etcd = shardps::etcd::Client::Create(endpoints, std::chrono::milliseconds(1000));
  auto renewed = std::chrono::steady_clock::now();
  const auto ttl = std::chrono::seconds(FLAGS_etcd_lease_s);
  while (!g_stop) {
    std::this_thread::sleep_for(ttl / 4);
    const auto sent = std::chrono::steady_clock::now();
    auto left = etcd->KeepAlive(lease);
    if (left.ok()) {
      renewed = sent;
      ConfirmLease(sent);
      continue;
    }
    // Not renewed for most of the TTL (or expired): stop before a successor can be elected.
    if (left.status().code() == shardps::StatusCode::kNotFound ||
        std::chrono::steady_clock::now() - renewed > ttl * 3 / 4) {
      LOG(ERROR) << "coordinator: LOST LEADERSHIP (etcd lease: " << left.status()
                 << "); exiting at once so that only the leader acts";
      std::_Exit(3);
    }
  }
}
}  // namespace

int main(int argc, char** argv) {
  shardps::ParseCommandLine(
      &argc, &argv, "shardps_coordinator --listen=HOST:PORT --cluster_token=SECRET", __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;

  using namespace shardps::control;
  CoordinatorOptions o;
  o.listen_address = FLAGS_listen;
  o.cluster_token = FLAGS_cluster_token;
  if (o.cluster_token.empty() && getenv("SHARDPS_CLUSTER_TOKEN") != nullptr) {
    o.cluster_token = getenv("SHARDPS_CLUSTER_TOKEN");
  }
  ConsistencyMode mode;
  std::string m = FLAGS_consistency;
  for (char& ch : m) ch = static_cast<char>(toupper(ch));
  if (!ConsistencyMode_Parse(m, &mode)) {
    LOG(ERROR) << "unknown --consistency=" << FLAGS_consistency << " (bsp, ssp, asp, vsgd)";
    return 2;
  }
  o.config.set_mode(mode);
  o.config.set_staleness(FLAGS_staleness);
  o.config.set_num_servers(FLAGS_num_servers);
  o.config.set_num_workers(FLAGS_num_workers);
  o.config.set_heartbeat_interval_ms(FLAGS_heartbeat_interval_ms);
  o.config.set_heartbeat_timeout_ms(FLAGS_heartbeat_timeout_ms);
  o.config.set_lease_ms(FLAGS_lease_ms);
  o.config.set_suspicion_phi(FLAGS_suspicion_phi);
  o.config.set_transport(FLAGS_data_transport);
  o.config.set_partition_bytes(FLAGS_partition_bytes);
  if (FLAGS_replicas < 1 || FLAGS_replicas > 2) {
    LOG(ERROR) << "--replicas must be 1 or 2";
    return 2;
  }
  o.config.set_replicas(FLAGS_replicas);
  o.config.set_max_workers(FLAGS_max_workers);
  o.config.set_failover_timeout_ms(FLAGS_failover_timeout_ms);
  o.config.set_checkpoint_dir(FLAGS_checkpoint_dir);
  o.config.set_checkpoint_every(FLAGS_checkpoint_every);
  o.config.set_checkpoint_keep(FLAGS_checkpoint_keep);
  o.state_file = FLAGS_state_file;
  o.config.set_rejoin_grace_ms(FLAGS_rejoin_grace_ms);
  if (!FLAGS_server_capacity.empty()) {
    std::stringstream ss(FLAGS_server_capacity);
    for (std::string w; std::getline(ss, w, ',');) {
      char* end = nullptr;
      const double v = std::strtod(w.c_str(), &end);
      if (w.empty() || *end != '\0' || !(v > 0)) {
        LOG(ERROR) << "--server_capacity: '" << w << "' is not a positive number";
        return 2;
      }
      o.config.add_server_capacity(v);
    }
    if (o.config.server_capacity_size() != FLAGS_num_servers) {
      LOG(ERROR) << "--server_capacity has " << o.config.server_capacity_size()
                 << " weights for --num_servers=" << FLAGS_num_servers;
      return 2;
    }
  }
  if (auto how = shardps::ParseShardLayout(FLAGS_shard_layout); !how.ok()) {
    LOG(ERROR) << "--shard_layout: " << how.status().ToString();
    return 2;
  }
  o.config.set_shard_layout(FLAGS_shard_layout);
  shardps::trace::ScopedTrace tracing;  // flushed and closed when main returns
  if (shardps::Status t = tracing.Begin({FLAGS_trace_file, FLAGS_trace_max_events}); !t.ok()) {
    LOG(ERROR) << "--trace_file: " << t;
    return 2;
  }
  shardps::trace::SetIdentity("coordinator", -1);
  std::thread keeper;
  shardps::UniqueFd reserved;  // HA: the --listen port, bound (not listening) while a standby
  if (!FLAGS_etcd.empty()) {
    auto etcd = shardps::etcd::Client::Create(FLAGS_etcd);
    if (!etcd.ok()) {
      LOG(ERROR) << "--etcd: " << etcd.status();
      return 2;
    }
    if (FLAGS_listen.find(":0") == FLAGS_listen.size() - 2 || FLAGS_etcd_lease_s < 1) {
      LOG(ERROR) << "--etcd needs a fixed --listen port (members are given every "
                    "coordinator's address) and --etcd_lease_s >= 1";
      return 2;
    }
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    o.etcd_endpoints = FLAGS_etcd;
    o.etcd_leader_key = FLAGS_etcd_prefix + "/leader";
    o.etcd_state_key = FLAGS_etcd_prefix + "/state";
    o.etcd_leader_value = FLAGS_listen + " " + host + "/" + std::to_string(getpid());
    if (!o.state_file.empty()) {
      LOG(WARNING) << "--state_file is ignored with --etcd (the state lives in etcd)";
      o.state_file.clear();
    }
    // The port is reserved before campaigning: a standby waits for seconds or days, and an
    // unbound port meanwhile goes to any socket that asks for one (an outgoing connection's
    // ephemeral port), so the elected leader could not listen where its members look for it.
    // Bound without listening, so members' connections to a standby are refused, not queued.
    auto bound = shardps::net::BindTcp(FLAGS_listen, nullptr);
    if (!bound.ok()) {
      LOG(ERROR) << "--listen " << FLAGS_listen << ": cannot reserve the port to lead on: "
                 << bound.status();
      return 2;
    }
    reserved = std::move(*bound);
    LOG(INFO) << "coordinator: HA via etcd " << FLAGS_etcd << " (" << FLAGS_etcd_prefix
              << "); campaigning as " << o.etcd_leader_value << " (port reserved)";
    signal(SIGINT, OnSignal);
    signal(SIGTERM, OnSignal);
    const int64_t lease = BecomeLeader(*etcd, o.etcd_leader_key, o.etcd_leader_value);
    if (g_stop) return 0;
    LOG(WARNING) << "coordinator: ELECTED leader (etcd lease " << lease << ", "
                 << FLAGS_etcd_lease_s << " s); loading the cluster's state from etcd";
    keeper = std::thread(KeepLeadership, FLAGS_etcd, lease);
    keeper.detach();
    o.lead_until_ns = &g_lead_until_ns;
  }
  auto c = Coordinator::Start(o, std::move(reserved));
  if (!c.ok()) {
    LOG(ERROR) << "coordinator: " << c.status();
    return 1;
  }
  if (!FLAGS_address_file.empty()) {
    std::ofstream f(FLAGS_address_file + ".tmp");
    f << (*c)->address() << "\n";
    f.close();
    std::rename((FLAGS_address_file + ".tmp").c_str(), FLAGS_address_file.c_str());
  }
  // /metrics (--metrics_port): reads the coordinator's snapshots at scrape time.
  shardps::metrics::Registry registry;
  shardps::control::AddCoordinatorMetrics(c->get(), &registry);
  auto metrics = shardps::metrics::StartMetricsFromFlags([&registry] { return registry.Render(); });
  if (!metrics.ok()) {
    LOG(ERROR) << "coordinator: " << metrics.status();
    return 2;
  }
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  size_t most_workers = 0;
  auto workers_gone_at = std::chrono::steady_clock::time_point::max();
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!FLAGS_exit_when_done) continue;
    size_t workers = 0, servers = 0;
    const Membership membership = (*c)->membership();
    for (const Member& m : membership.members()) {
      workers += m.role() == ROLE_WORKER;
      servers += m.role() == ROLE_SERVER;
    }
    most_workers = std::max(most_workers, workers);
    // workers_complete: the coordinator saw every expected worker at once, even if this
    // 100 ms poll never did (a job shorter than a poll).
    const bool done =
        workers == 0 && (most_workers >= static_cast<size_t>(std::max(1, FLAGS_num_workers)) ||
                         membership.workers_complete());
    if (!done) continue;
    const auto now = std::chrono::steady_clock::now();
    if (workers_gone_at == std::chrono::steady_clock::time_point::max()) {
      workers_gone_at = now;
      LOG(INFO) << "coordinator: all "
                << std::max(most_workers, static_cast<size_t>(std::max(1, FLAGS_num_workers)))
                << " workers have left; waiting for " << servers
                << " server(s) to leave (--exit_when_done)";
    }
    if (servers == 0) break;
    if (now - workers_gone_at > std::chrono::milliseconds(FLAGS_exit_grace_ms)) {
      LOG(WARNING) << "coordinator: " << servers << " server(s) still present after "
                   << FLAGS_exit_grace_ms << " ms; exiting anyway";
      break;
    }
  }
  LOG(INFO) << "coordinator: stopping at epoch " << (*c)->epoch();
  return 0;
}
