// ShardServer: the shardps_server daemon's engine. It joins the coordinator, receives the
// chunks it owns, registers its three regions once (weights, inbox, acks; server/layout.h), and
// then applies gradients as their write-with-immediate completions arrive. Workers never send
// it a message on the data path: pushes are one-sided writes into the inbox, pulls are
// one-sided reads of the weights.
//
// Consistency (docs/consistency.md):
//  * BSP: a chunk's gradients of clock t are summed over the live workers and applied once;
//    the new version carries min_clock = t.
//  * SSP / ASP / VSGD: each push is applied when it lands; min_clock is the smallest clock whose
//    pushes every live worker has had applied. Workers wait on it (SSP) or not (ASP).
//  * VSGD additionally scales the learning rate by value staleness (server/optimizer.h).
//
// Thread safety: Run() is the apply/polling thread and owns all data-path state; Stop() may be
// called from any thread (e.g. a signal handler's flag watcher).
#ifndef SHARDPS_SERVER_SHARD_SERVER_H_
#define SHARDPS_SERVER_SHARD_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/control_client.h"
#include "server/layout.h"
#include "server/optimizer.h"
#include "transport/transport.h"

namespace shardps::server {

struct ShardServerOptions {
  transport::FabricOptions fabric;
  std::string data_listen;  // "" = provider default ("ip:0" from bind_ip for tcp/verbs)
  std::string coordinator;
  std::string cluster_token;
  int requested_rank = -1;
  OptimizerConfig optimizer;
  bool average = true;          // average (true) or sum the workers' gradients
  float vsgd_lambda = 1.0f;     // VSGD strength
  int vsgd_history = 8;         // versions of weights kept per chunk for VSGD
  std::chrono::milliseconds setup_timeout{120000};
  // Batch jobs (mpirun, scripts): stop once every expected worker has joined and all of them
  // have left again. Off by default: an elastic cluster may be empty of workers for a while.
  bool exit_when_workers_done = false;
};

struct ShardServerCounters {
  uint64_t pushes_applied = 0;
  uint64_t duplicate_pushes = 0;  // same (worker, chunk, seq) seen again: dropped
  uint64_t rejected_pushes = 0;   // malformed header, wrong chunk, unknown worker
  uint64_t versions_published = 0;
  uint64_t endpoints_accepted = 0;
  uint64_t endpoint_errors = 0;
};

class ShardServer {
 public:
  explicit ShardServer(const ShardServerOptions& options);
  ~ShardServer();
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;

  // Joins, sets up and serves until Stop() or a fatal error.
  Status Run();
  void Stop() { stop_ = true; }

  // Snapshots, for tests and logs (safe from any thread).
  ShardServerCounters counters() const;
  uint32_t rank() const { return rank_.load(); }

 private:
  struct Chunk;
  struct WorkerState;

  Status Setup();
  Status Serve();
  void AcceptPending();
  void HandleRecvImm(const transport::Completion& c);
  void HandleHello(uint64_t endpoint_id, uint32_t rank);
  void HandleInit(uint32_t worker, uint32_t slot);
  void HandlePush(uint32_t worker, uint32_t slot, uint32_t parity);
  void HandleClock(uint32_t worker, uint32_t clock_low);
  void Reevaluate();  // BSP completions and SSP min clocks after a clock or membership change
  void ApplyBsp(uint32_t slot);
  void ApplyOne(uint32_t slot, const float* grad, float scale, uint64_t base_version);
  void Publish(uint32_t slot, uint32_t target, uint64_t min_clock_plus1);
  void RefreshMembership();
  uint64_t SspMinClockPlus1(uint32_t slot) const;
  std::set<uint32_t> LiveWorkers() const;

  ShardServerOptions options_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> rank_{0};

  std::unique_ptr<transport::Fabric> fabric_;
  std::unique_ptr<control::ControlClient> control_;
  control::ClusterConfig config_;
  std::unique_ptr<transport::Listener> listener_;
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::map<uint64_t, std::unique_ptr<transport::Endpoint>> endpoints_;  // by endpoint id
  std::map<uint64_t, uint32_t> endpoint_worker_;                        // endpoint id -> rank
  uint64_t next_endpoint_id_ = 1;

  std::unique_ptr<layout::ServerLayout> layout_;
  std::unique_ptr<transport::MemoryRegion> weights_;
  std::unique_ptr<transport::MemoryRegion> inbox_;
  std::unique_ptr<transport::MemoryRegion> acks_;
  std::unique_ptr<transport::MemoryRegion> clocks_;
  std::vector<std::unique_ptr<Chunk>> chunks_;  // by slot
  std::map<uint32_t, std::unique_ptr<WorkerState>> workers_;  // by rank
  std::set<uint32_t> member_workers_;   // worker ranks in the latest membership
  size_t most_workers_seen_ = 0;        // for exit_when_workers_done
  std::set<uint32_t> departed_workers_;
  uint64_t seen_epoch_ = 0;

  mutable std::mutex counters_mu_;
  ShardServerCounters counters_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_SERVER_H_
