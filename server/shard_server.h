// ShardServer: the shardps_server daemon's engine. It joins the coordinator, receives the
// chunks it owns, registers its three regions once (weights, inbox, acks; wire/region_layout.h), and
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
// Replication (docs/fault-tolerance.md): with replicas = 2 every shard group has a primary and a
// backup server. The primary writes one record per new version into the backup's registered
// ring with one-sided writes (primary-backup, not chain: one hop, and the backup is the only
// other copy) and publishes the version to pulls only once that write has completed. The
// backup applies the records in order with the same optimizer code, so its weights, optimizer
// state and exactly-once state (last sequence number per worker and chunk) match the primary's
// bit for bit. When the coordinator promotes it, it drains the ring and serves the group.
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
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/control_client.h"
#include "server/checkpoint.h"
#include "wire/region_layout.h"
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
  bool average = true;       // average (true) or sum the workers' gradients
  float vsgd_lambda = 1.0f;  // VSGD strength
  int vsgd_history = 8;      // versions of weights kept per chunk for VSGD
  std::chrono::milliseconds setup_timeout{120000};
  // Batch jobs (mpirun, scripts): stop once every expected worker has joined and all of them
  // have left again. Off by default: an elastic cluster may be empty of workers for a while.
  bool exit_when_workers_done = false;
  // Replication ring entries cap (0: slots + 4, limited to ~256 MiB of ring).
  uint32_t replication_ring_entries = 0;
  // Checkpoints: where to write them ("" = the cluster's checkpoint_dir), and a directory to
  // restore the newest complete, valid checkpoint from at start ("" = start fresh).
  std::string checkpoint_dir;
  std::string restore_dir;
};

struct ShardServerCounters {
  uint64_t pushes_applied = 0;
  uint64_t duplicate_pushes = 0;  // same (worker, chunk, seq) seen again: dropped
  uint64_t rejected_pushes = 0;   // malformed header, wrong chunk, unknown worker
  uint64_t versions_published = 0;
  uint64_t endpoints_accepted = 0;
  uint64_t endpoint_errors = 0;
  uint64_t deferred_pushes = 0;     // waited for the chunk's previous version to be replicated
  uint64_t stale_pushes = 0;        // BSP: a clock already applied without it (a late joiner)
  uint64_t records_sent = 0;        // primary: replication records written to the backup
  uint64_t records_applied = 0;     // backup: records applied
  uint64_t records_rejected = 0;    // backup: malformed, out of sequence or fenced
  uint64_t replication_stalls = 0;  // primary: ring full, waited for the backup to consume
  uint64_t promotions = 0;          // backup -> primary
  uint64_t checkpoints_submitted = 0;
  uint64_t checkpoints_written = 0;
  uint64_t checkpoint_failures = 0;  // e.g. disk full: logged, training goes on
  uint64_t restored_clock = 0;       // the checkpoint clock restored at start (0: none)
  bool backup = false;               // currently holds a backup copy (not serving workers)
  bool replicating = false;          // currently replicating to a backup
  uint32_t group = 0;
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
  struct Contributor {
    uint32_t worker;
    uint32_t parity;
    uint64_t seq;
    uint64_t incarnation;
    int64_t clock;
  };
  enum class BackupState { kNone, kConnected, kFailed, kGone };

  Status Setup();
  Status Serve();
  void AcceptPending();
  void HandleRecvImm(const transport::Completion& c);
  void HandleHello(uint64_t endpoint_id, uint32_t rank);
  void HandleInit(uint32_t worker, uint32_t slot);
  // from_queue: a deferred push being retried (it keeps its place ahead of newer ones).
  // Returns false if the push had to wait (it was queued).
  bool HandlePush(uint32_t worker, uint32_t slot, uint32_t parity, bool from_queue);
  void HandleClock(uint32_t worker, uint32_t clock_low);
  void Reevaluate();  // BSP completions and SSP min clocks after a clock or membership change
  void ApplyBsp(uint32_t slot);
  // Computes the next version into the unpublished buffer; returns the lr scale used.
  float ApplyOne(uint32_t slot, const float* grad, float scale, uint64_t base_version);
  // A new version sits in buffer `target`: replicate it (if there is a backup), then publish
  // it and acknowledge its pushes. `payload` is registered memory (region, offset).
  void Commit(uint32_t slot, uint32_t target, uint64_t min_clock_plus1, layout::ReplKind kind,
              const transport::MemoryRegion* payload, uint64_t payload_offset, float scale,
              float lr_scale, std::vector<Contributor> contributors);
  void FinishCommit(uint32_t slot);
  void DrainDeferred(uint32_t slot);
  // The clock in the header of a deferred push; the lowest clock of a worker's deferred pushes
  // of a slot (INT64_MAX: none).
  int64_t DeferredClock(uint32_t slot, uint32_t worker, uint32_t parity) const;
  int64_t MinDeferredClock(uint32_t slot, uint32_t worker) const;
  void Publish(uint32_t slot, uint32_t target, uint64_t min_clock_plus1);
  void RefreshMembership();
  WorkerState& Worker(uint32_t rank, uint64_t incarnation);
  // Replication.
  Status ConnectBackup(const control::ReplicaTarget& t);
  void PostRecord(uint32_t slot);
  void PostWaitingRecords();
  void HandleBackupCompletion(const transport::Completion& c);
  void BackupFailed(const Status& why);
  void ApplyRecord(uint32_t entry);
  void Promote(const control::Promote& p);
  void PollControl();
  // Checkpoints: capture each chunk's state at the first version whose min clock reaches the
  // checkpoint clock; submit the group's snapshot once every chunk is captured.
  void MaybeCapture(uint32_t slot);
  Status EnsureCheckpointWriter(const std::string& dir);
  Status Restore(const std::string& dir, const std::string& fingerprint);
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
  std::vector<std::unique_ptr<Chunk>> chunks_;                // by slot
  std::map<uint32_t, std::unique_ptr<WorkerState>> workers_;  // by rank
  std::set<uint32_t> member_workers_;  // worker ranks in the latest membership
  size_t most_workers_seen_ = 0;       // for exit_when_workers_done
  std::set<uint32_t> departed_workers_;
  uint64_t seen_epoch_ = 0;

  // Role.
  uint32_t group_ = 0;
  uint32_t num_groups_ = 1;
  bool backup_ = false;       // holds the group's backup copy, not serving workers yet
  uint64_t fence_epoch_ = 0;  // records and pushes of older epochs are refused
  std::vector<transport::Completion> early_;  // worker completions that reached a backup
  // Primary side of replication.
  BackupState backup_state_ = BackupState::kNone;
  uint32_t backup_member_ = 0;
  std::unique_ptr<transport::Endpoint> backup_ep_;
  transport::RegionDescriptor backup_ring_, backup_consumed_;
  std::unique_ptr<layout::ReplLayout> repl_layout_;
  std::unique_ptr<transport::MemoryRegion> repl_staging_;  // per slot: header|contributors|sum
  uint64_t repl_slot_stride_ = 0;
  uint64_t consumed_staging_offset_ = 0;
  uint64_t next_record_seq_ = 1;
  uint64_t known_consumed_ = 0;
  bool consumed_read_outstanding_ = false;
  std::deque<uint32_t> ring_wait_;  // slots whose records wait for ring space
  // Backup side of replication.
  std::unique_ptr<transport::MemoryRegion> ring_;      // remote-write
  std::unique_ptr<transport::MemoryRegion> consumed_;  // remote-read: u64 last applied seq
  uint64_t primary_endpoint_ = 0;
  uint64_t expected_record_ = 1;
  // When this backup lost its primary's stream or refused a record (it cannot follow any more).
  std::chrono::steady_clock::time_point repl_broken_since_{};

  // Checkpoints (apply thread; the writer thread does the disk I/O).
  std::string plan_fingerprint_;
  std::unique_ptr<CheckpointWriter> ckpt_writer_;
  uint64_t ckpt_every_ = 0;
  uint64_t ckpt_next_ = 0;  // the clock of the next checkpoint (0: none planned)
  uint64_t ckpt_last_ = 0;  // the clock of the last one submitted (or restored)
  std::unique_ptr<ShardSnapshot> ckpt_pending_;
  std::vector<bool> ckpt_captured_;
  uint32_t ckpt_captured_count_ = 0;
  uint64_t restored_clock_ = 0;

  mutable std::mutex counters_mu_;
  ShardServerCounters counters_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_SERVER_H_
