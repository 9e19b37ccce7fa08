// ShardServer: the shardps_server daemon's engine. It joins the coordinator, receives the
// chunks it owns, registers its three regions once (weights, inbox, acks; wire/region_layout.h),
// and then applies gradients as their write-with-immediate completions arrive. Workers never send
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
// The server wires components that own their state and return decisions (docs/architecture.md):
// WorkerTable (incarnations, sequence numbers, clocks, departures), ConsistencyGate (the only
// code that knows BSP/SSP/ASP/VSGD), ChunkStore (double buffers, publication, VSGD history),
// ReplicationStream (primary side), ReplicaApplier (backup side), CheckpointCapture, AckBoard,
// EndpointTable (accepted endpoints and the worker on each).
//
// Thread safety: Run() is the apply/polling thread and owns all data-path state and every
// component; Stop(), counters() and rank() may be called from any thread (e.g. a signal
// handler's flag watcher). ServerStats holds the only lock.
#ifndef SHARDPS_SERVER_SHARD_SERVER_H_
#define SHARDPS_SERVER_SHARD_SERVER_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/control_client.h"
#include "proto/fault_timeouts.h"
#include "server/ack_board.h"
#include "server/checkpoint.h"
#include "server/checkpoint_capture.h"
#include "server/chunk_store.h"
#include "server/consistency_gate.h"
#include "server/endpoint_table.h"
#include "server/member_authenticator.h"
#include "server/optimizer.h"
#include "server/replica_applier.h"
#include "server/replication_stream.h"
#include "server/server_stats.h"
#include "server/worker_table.h"
#include "transport/transport.h"
#include "wire/region_layout.h"

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
  // Replication ring entries (0: min(512, 4 x slots + 16), shrunk to fit a SoftRoCE CQ,
  // limited to ~256 MiB of ring). Tests set it; there is no flag.
  uint32_t replication_ring_entries = 0;
  // Checkpoints: where to write them ("" = the cluster's checkpoint_dir), and a directory to
  // restore the newest complete, valid checkpoint from at start ("" = start fresh).
  std::string checkpoint_dir;
  std::string restore_dir;
  // A spare (docs/fault-tolerance.md, "Redundancy restored"): joins, gets no shards at start,
  // and waits (without a setup timeout) until the coordinator makes it the new backup of a
  // group that lost one; it then copies the primary's snapshot and follows its stream.
  bool spare = false;
  // The serving loop polls its completion queue for this long after its last completion
  // before it sleeps in CompletionQueue::Wait (as the worker's ClientOptions::busy_poll): a
  // round's pushes arrive microseconds apart, and a server that sleeps between them pays a
  // wake-up per push (docs/operations.md, "Tuning"). 0: sleep at once, after the transport's
  // own brief spin; negative: never sleep (a core per server).
  std::chrono::microseconds busy_poll{300};
  // A chunk that waits for something (a BSP clock, queued pushes, a version in flight) and
  // publishes no new version for this long is logged once, with what it waits for (the
  // workers a clock lacks, their announced clocks, the queued pushes) and counted
  // (stalled_chunks): a stuck cluster says why before its workers' waits time out. 0: off.
  std::chrono::milliseconds stall_report{10000};
};

class ShardServer {
 public:
  using Clock = std::chrono::steady_clock;

  explicit ShardServer(const ShardServerOptions& options);
  ~ShardServer();
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;

  // Joins, sets up and serves until Stop() or a fatal error.
  Status Run();
  void Stop() { stop_ = true; }
  // Whether setup is done and Serve() runs (the signal handler's choice: stop or exit).
  bool serving() const { return serving_.load(); }

  // Snapshots, for tests and logs (safe from any thread).
  ShardServerCounters counters() const { return stats_.Snapshot(); }
  // Tests only (tests/integration/embedding_test.cc tears a row with it): the record of local
  // row `local_row` of the row shard in `slot` inside the weights region, or null before setup
  // or for a slot that holds no rows. Call it once a worker has started (setup is done then).
  char* RowRecordForTesting(uint32_t slot, uint64_t local_row);
  // The counters, per-peer errors and histograms (the /metrics endpoint reads them).
  const ServerStats& stats() const { return stats_; }
  uint32_t rank() const { return rank_.load(); }

 private:
  // A version computed into a chunk's unpublished buffer, waiting for its replication record.
  // A row shard's version is not written yet (its rows are written in place): its inputs wait
  // here, and FinishCommit writes it once the record is replicated, so that no reader sees a
  // row the backup may not have (a failover would take it back: docs/embeddings.md).
  struct PendingVersion {
    enum class Rows { kNone, kCompute, kSet };  // kNone: a dense chunk's, already computed
    uint32_t buffer = 0;
    uint64_t min_clock_plus1 = 0;
    Rows rows = Rows::kNone;
    const float* payload = nullptr;  // stream_->sum(slot): the slot's own, kept while in flight
    float scale = 1.0f;              // kCompute
    float lr_scale = 1.0f;
    bool skip = false;
    layout::UpdateRule rule{};       // kCompute and kSet
    layout::PushOp op{};             // kSet
    uint64_t steps = 0;
  };

  // Setup and control plane (shard_server.cc).
  Status Setup();
  Status SetupRegions(const control::AssignShards& a);
  Status SetupComponents(const control::AssignShards& a, const std::vector<uint64_t>& bytes);
  Status SendShardsReady(const control::AssignShards& a);
  Status ConnectReplication();
  Status Serve();
  bool Housekeeping(Status* fenced);  // periodic: accept, membership, liveness; false: stop
  // Housekeeping's stall report (ShardServerOptions::stall_report), every 100 ms at most.
  void ReportStalls();
  // A replicated primary without a lease (docs/fault-tolerance.md, "Liveness"): it must not
  // apply or publish anything. Logs and counts the transitions.
  bool LeaseLapsed();
  // Closes the endpoints that failed, after handling what their peers completed: a push whose
  // write completed at the worker is in this server's memory and its immediate in the CQ, and
  // closing an endpoint discards its unpolled completions (every provider), so the CQ is drained
  // first (DrainCompletions). A worker that completes a push and dies is applied, not lost.
  void DropFailedEndpoints();
  // Handles one completion of the serving loop (and the work it makes, DrainWork).
  void Dispatch(const transport::Completion& wc);
  // Handles every completion already in the CQ, without waiting (a bounded number of batches:
  // live workers keep it non-empty). Not while fenced (LeaseLapsed): nothing is applied then.
  void DrainCompletions();
  // Every expected worker has been in the cluster and none is in the current membership: the
  // job's end, when peers closing their endpoints is expected.
  bool WorkersDone() const;
  void AcceptPending();
  void PollControl();
  void RefreshMembership();
  void Promote(const control::Promote& p);
  // The backup is gone: publish every version that waited for its record.
  void DropBackup();
  // Waits for the shard assignment (a spare: until it is used, or the job ends).
  StatusOr<control::Envelope> WaitForAssignment();
  // Re-replication, primary side: a new backup for a training group. Snapshots the group's
  // state into a registered region (server/replica_handoff.h) and starts the stream to it in
  // the same apply-thread step, so every later version reaches it as a record.
  void ReplicateTo(const control::ReplicaTarget& t);
  // Backup side: the primary's hello named a snapshot; copy it with one-sided reads (records
  // that arrive meanwhile are held), restore it, apply the held records, report ReplicaSynced.
  void StartCatchUp(uint64_t endpoint_id, const layout::ReplHello& hello);
  void PostCatchUpReads();
  void OnCatchUpRead(const transport::Completion& c);
  void FinishCatchUp();
  void ApplyRecord(uint32_t entry);  // one replication record, from ring entry `entry`
  Status EnsureCheckpointWriter(const std::string& dir);
  Status Restore(const std::string& dir, const std::string& fingerprint);
  void OnCheckpointRequest(const control::CheckpointRequest& r);
  // Receives per accepted endpoint (AcceptRecvDepth(recv_depth_)), and the CQ's depth for them
  // all: sized once the ring is known, within fabric_->max_cq_depth() (fewer receives per
  // worker endpoint on a small device, or an error naming the limit).
  Status SizeCompletionQueue(uint32_t max_workers, int* depth);
  int AcceptRecvDepth(int recv_depth) const;

  // Data path (shard_server_apply.cc). Handlers never re-enter each other: a published version
  // puts its slot on work_, which DrainWork() empties once per completion handled.
  void HandleRecvImm(const transport::Completion& c);
  void HandleReplication(const transport::Completion& c, layout::ImmKind kind, uint32_t arg);
  void HandleHello(uint64_t endpoint_id, uint32_t rank);
  void HandleInit(uint32_t worker, uint32_t slot);
  // from_queue: a deferred push being retried. Returns false if the push had to wait.
  bool HandlePush(uint32_t worker, uint32_t slot, uint32_t parity, bool from_queue);
  // A push that is not a gradient (layout::PushOp): sets the chunk's weights or optimizer
  // state (a new version, replicated) or copies them into the outbox. False: deferred.
  bool HandleStateOp(uint32_t worker, uint32_t slot, uint32_t parity,
                     const layout::PushHeader& h);
  // A state set's replication record (kSet; its payload to be filled in the record's staging),
  // the push consumed and counted.
  ReplRecord SetRecord(uint32_t worker, uint32_t slot, uint32_t parity,
                       const layout::PushHeader& h, uint64_t bytes);
  // HandleStateOp for a row shard (layout::PushOp on rows: sets, gets, lists).
  bool HandleRowStateOp(uint32_t worker, uint32_t slot, uint32_t parity,
                        const layout::PushHeader& h);
  void HandleClock(uint32_t worker, uint32_t clock_low);
  // Counts a gradient push taken (applied now, or summed into its BSP clock) and its clock lag.
  void ObservePushApplied(uint32_t slot, const layout::PushHeader& h);
  // "worker-<rank>", "primary" or "endpoint-<id>": whose data-path endpoint `id` is.
  std::string PeerOf(uint64_t endpoint_id) const;
  void Reevaluate();  // BSP completions and SSP min clocks after a clock or membership change
  // Raises the published min clock of `slot` where the gate allows (ConsistencyGate::
  // RaisedMinClockPlus1); BSP: marks the clocks passed over as applied.
  void MaybeRaiseMinClock(uint32_t slot);
  void MaybeApplyBsp(uint32_t slot);
  // A new version of `slot` sits in `r`'s buffer: replicate it, then publish it.
  // `rows`: a row shard's version to write at FinishCommit (its buffer and min clock are set here).
  void Commit(uint32_t buffer, ReplRecord r, PendingVersion rows);
  void Commit(uint32_t buffer, ReplRecord r);  // a dense chunk's
  // Commit of an update: a dense chunk's version is computed now, a row shard's at FinishCommit.
  void ComputeAndCommit(const float* grad, ReplRecord r);
  void FinishCommit(uint32_t slot);  // publish, acknowledge, capture; queue the slot's work
  // Empties work_: for each slot, retries its deferred pushes (until one waits again) and
  // completes its next BSP clock. Called after every completion handled (and after control and
  // membership changes), so work_ is empty whenever a handler starts: a push never overtakes a
  // deferred one of a slot whose version was just published (BSP would otherwise take a later
  // clock as pending and drop the deferred earlier one as stale).
  void DrainWork();
  void MaybeCapture(uint32_t slot);
  // The MemberStats of this server's heartbeats (`shardps status`); any thread.
  void FillHeartbeatStats(control::MemberStats* s) const;

  ShardServerOptions options_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> serving_{false};
  std::atomic<uint32_t> rank_{0};
  ServerStats stats_;

  // Transport and control plane.
  std::unique_ptr<transport::Fabric> fabric_;
  std::unique_ptr<control::ControlClient> control_;
  control::ClusterConfig config_;
  control::FaultTimeouts timeouts_;  // of config_
  bool lease_lapsed_ = false;
  bool lease_awaited_ = false;  // fenced at start-up until the first lease (not a lapse)
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::unique_ptr<EndpointTable> endpoints_;
  std::shared_ptr<MemberAuthenticator> authenticator_;  // the data listener's (set at Setup)
  uint64_t seen_epoch_ = 0;
  uint64_t newest_push_epoch_ = 0;  // the newest membership epoch a BSP push was sent in
  Clock::time_point epoch_wait_since_{};  // since when BSP waits for that epoch
  // ReportStalls, per slot: since when it waits with its version unchanged, that version, and
  // whether that wait was reported.
  struct StallWatch {
    Clock::time_point since{};
    uint64_t version = 0;
    bool waiting = false;
    bool reported = false;
  };
  std::vector<StallWatch> stall_watch_;
  Clock::time_point stalls_checked_{};
  uint64_t keys_epoch_ = 0;  // the membership epoch whose member keys the authenticator holds
  Clock::time_point min_clock_at_{};      // last min_applied_clock update (Housekeeping)

  // Registered regions (wire/region_layout.h).
  std::unique_ptr<layout::ServerLayout> layout_;
  std::unique_ptr<layout::ReplLayout> repl_layout_;
  std::unique_ptr<transport::MemoryRegion> weights_, inbox_, acks_, clocks_;
  std::unique_ptr<transport::MemoryRegion> outbox_;  // kGetState answers (remote-read)
  std::unique_ptr<transport::MemoryRegion> ring_, consumed_;  // backup only

  // Components (each owns its state; the server wires them together).
  std::unique_ptr<ChunkStore> chunks_;
  std::unique_ptr<WorkerTable> workers_;
  std::unique_ptr<ConsistencyGate> gate_;
  std::unique_ptr<AckBoard> ack_board_;
  std::unique_ptr<ReplicationStream> stream_;  // primary side
  std::unique_ptr<ReplicaApplier> applier_;    // backup side
  std::unique_ptr<CheckpointCapture> capture_;
  std::unique_ptr<CheckpointWriter> ckpt_writer_;  // the writer thread does the disk I/O
  uint64_t ckpt_failures_seen_ = 0;                // writer failures already answered
  Clock::time_point gauges_published_{};           // Housekeeping's last gauge update
  std::vector<PendingVersion> pending_;            // by slot: the version in flight
  std::deque<uint32_t> work_;                      // slots with a newly published version

  // Role.
  uint32_t group_ = 0;
  uint32_t num_groups_ = 1;
  bool backup_ = false;       // holds the group's backup copy, not serving workers yet
  int recv_depth_ = 16;       // receives per worker endpoint (SizeCompletionQueue)
  uint64_t fence_epoch_ = 0;  // records and pushes of older epochs are refused
  std::vector<transport::Completion> early_;  // worker completions that reached a backup
  struct DeferredOp {
    uint32_t worker, slot, parity;
  };
  std::vector<DeferredOp> deferred_ops_;  // state transfers waiting for a version in flight

  // Re-replication. Primary: the snapshot a new backup copies (freed once it is in sync).
  std::unique_ptr<transport::MemoryRegion> handoff_;
  std::optional<control::ReplicaTarget> deferred_target_;  // came before this backup's promotion
  // Backup new to a training group: the copy of the primary's snapshot in progress.
  struct CatchUp {
    uint64_t endpoint_id = 0;
    std::unique_ptr<transport::MemoryRegion> local;
    transport::RegionDescriptor remote;
    uint64_t bytes = 0;
    uint32_t crc = 0;
    uint64_t posted = 0;     // bytes whose reads are posted
    uint64_t completed = 0;  // bytes read
    int outstanding = 0;
    Clock::time_point started;
    std::deque<uint32_t> held;  // ring entries of records that arrived during the copy
  };
  std::unique_ptr<CatchUp> catch_up_;
  bool awaiting_snapshot_ = false;   // assigned as a new backup; the primary's hello not in yet
  Clock::time_point assigned_at_{};  // when (the hello must come within the setup timeout)
  Status catch_up_error_;            // the copy failed: this backup leaves
  std::string plan_fingerprint_;
  std::vector<uint32_t> dtypes_;  // per slot (layout::DType); empty: all float32
  std::vector<RowInit> row_inits_;  // per slot: a row shard's initial values
  SparseAccumulator* row_acc(uint32_t dim);  // scratch of the apply thread
  std::unique_ptr<SparseAccumulator> row_acc_;
  uint32_t row_acc_dim_ = 0;
  std::vector<uint64_t> row_ids_;  // HandleRowStateOp: a get's ids, out of the inbox
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_SERVER_H_
