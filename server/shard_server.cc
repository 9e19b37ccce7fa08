#include "server/shard_server.h"

#include "proto/shard_plan.h"

#include "common/crash_point.h"
#include "common/trace.h"

#include "proto/credentials.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <glog/logging.h>

namespace shardps::server {

using transport::Access;
using transport::Completion;
using transport::OpType;
using Clock = std::chrono::steady_clock;

namespace {

ConsistencyMode ModeOf(const control::ClusterConfig& config) {
  switch (config.mode()) {
    case control::BSP:
      return ConsistencyMode::kBsp;
    case control::ASP:
      return ConsistencyMode::kAsp;
    case control::VSGD:
      return ConsistencyMode::kVsgd;
    default:
      return ConsistencyMode::kSsp;
  }
}

// A server may own no chunk (a model smaller than one partition per server): its regions are
// then empty, but a region of 0 bytes cannot be allocated, so each has at least kAlign.
uint64_t AtLeastAligned(uint64_t n) { return std::max<uint64_t>(n, layout::kAlign); }

}  // namespace

ShardServer::ShardServer(const ShardServerOptions& options) : options_(options) {}
ShardServer::~ShardServer() = default;

Status ShardServer::Run() {
  const Status setup = Setup();
  if (setup.ok() && !layout_) {
    // A spare the job never needed: it ended (every worker left) or this server was stopped.
    if (control_) control_->Leave("spare not needed; the job is done").IgnoreError();
    return Status::OK();
  }
  if (!setup.ok()) {
    // Say why before going: the coordinator tells the workers (server, group, reason) at once
    // instead of letting them wait for their setup timeout.
    if (control_) control_->Leave("start-up failed: " + setup.ToString()).IgnoreError();
    return setup;
  }
  return Serve();
}

int ShardServer::AcceptRecvDepth(int recv_depth) const {
  // A backup's stream from its primary carries up to one record per ring entry (and the
  // listener cannot tell it from a worker before it is accepted).
  return backup_ ? std::max<int>(recv_depth, static_cast<int>(repl_layout_->entries()) + 16)
                 : recv_depth;
}

namespace {

// What the endpoints on a server's CQ reserve (send + recv depth each,
// transport/flow_control.h): up to max_workers + 3 accepted ones (workers, a backup's stream
// from its primary, peers reconnecting while their old endpoint is still being dropped), 16
// sends and `accept_recv` receives each, and a primary's stream to its backup
// (ReplicationStream: 2 * entries + 16 sends, 4 receives), plus 64 spare.
int64_t ServerCqNeed(uint32_t max_workers, int64_t accept_recv, int64_t entries) {
  return (int64_t{max_workers} + 3) * (accept_recv + 16) + 2 * entries + 20 + 64;
}

}  // namespace

Status ShardServer::SizeCompletionQueue(uint32_t max_workers, int* depth) {
  const int64_t entries = repl_layout_->entries();
  auto need = [&](int rd) { return ServerCqNeed(max_workers, AcceptRecvDepth(rd), entries); };
  const int wanted = static_cast<int>(std::min<uint32_t>(1024, 2 * layout_->slots() + 32));
  const int64_t limit = fabric_->max_cq_depth();
  // A small device (SoftRoCE: 16,383) with many workers: fewer receives per worker endpoint.
  // A worker's write-with-immediate beyond them waits at the transport (verbs: receiver-not-
  // ready retries, without limit; tcp and shm: the reader pauses), never fails.
  int rd = wanted;
  while (rd > 16 && need(rd) > limit) --rd;
  if (need(rd) > limit) {
    return ResourceExhaustedError(
        "server rank " + std::to_string(rank_) + ": " + std::to_string(max_workers) +
        " workers need a completion queue of " + std::to_string(need(rd)) +
        " entries, more than this " + fabric_->name() + " device allows (" +
        std::to_string(limit) + "); lower --max_workers or use a device with a larger max_cqe");
  }
  LOG_IF(WARNING, rd < wanted) << "server rank " << rank_ << ": " << max_workers
                               << " workers on a device whose completion queues hold " << limit
                               << " entries: " << rd << " receives per worker endpoint (of "
                               << wanted << "); pushes beyond them wait at the transport";
  recv_depth_ = rd;
  *depth = static_cast<int>(need(rd));
  return Status::OK();
}

Status ShardServer::Setup() {
  ASSIGN_OR_RETURN(fabric_, transport::Fabric::Open(options_.fabric));
  std::string listen = options_.data_listen;
  if (listen.empty() && fabric_->name() != "shm") {
    listen =
        (options_.fabric.bind_ip.empty() ? std::string("0.0.0.0") : options_.fabric.bind_ip) + ":0";
  }
  ASSIGN_OR_RETURN(auto listener, fabric_->Listen(listen));
  // Every data-path peer proves a member credential before it gets anything; until the join
  // gives this server its credential, everyone is refused (docs/security.md).
  authenticator_ = std::make_shared<MemberAuthenticator>();
  listener->set_authenticator(authenticator_);
  endpoints_ = std::make_unique<EndpointTable>(std::move(listener));
  std::string data_address = endpoints_->address();
  // A wildcard listen address is useless to peers: advertise a reachable one.
  if (data_address.rfind("0.0.0.0:", 0) == 0) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    data_address = std::string(host) + data_address.substr(7);
  }

  control::ControlClientOptions co;
  co.coordinator_address = options_.coordinator;
  co.cluster_token = options_.cluster_token;
  co.join.set_role(control::ROLE_SERVER);
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  co.join.set_hostname(host);
  co.join.set_pid(static_cast<uint32_t>(getpid()));
  co.join.set_data_address(data_address);
  co.join.set_transport(fabric_->name());
  co.join.set_requested_rank(options_.requested_rank);
  co.join.set_spare(options_.spare);
  co.connect_timeout = std::chrono::milliseconds(10000);
  // A restarted coordinator takes the server back; training goes on meanwhile.
  co.rejoin_window = std::chrono::milliseconds(300000);
  // stats_ outlives control_ (declared before it): the control thread may read it until then.
  co.heartbeat_stats = [this](control::MemberStats* s) { FillHeartbeatStats(s); };
  ASSIGN_OR_RETURN(control_, control::ControlClient::Join(co));
  rank_ = control_->reply().rank();
  config_ = control_->reply().config();
  trace::SetIdentity("server", rank_);
  timeouts_ = control::FaultTimeouts::Of(config_);
  if (control_->reply().credential().empty()) {
    return FailedPreconditionError(
        "the coordinator issued no credential (an older coordinator?): the data path would "
        "refuse every worker");
  }
  authenticator_->SetCredential(control_->reply().credential());
  LOG(INFO) << "server rank " << rank_ << ": joined as member " << control_->member_id()
            << ", data path " << fabric_->name() << " at " << data_address << ", mode "
            << control::ConsistencyMode_Name(config_.mode()) << " s=" << config_.staleness();
  CrashPoint("server.after_join");

  ASSIGN_OR_RETURN(control::Envelope assign, WaitForAssignment());
  if (assign.body_case() != control::Envelope::kAssignShards) return Status::OK();  // unused
  const control::AssignShards& a = assign.assign_shards();
  if (a.chunk_ids_size() != a.chunk_bytes_size() || a.max_workers() == 0 ||
      a.max_workers() > 4096 || a.num_groups() == 0 || a.group() >= a.num_groups()) {
    return InvalidArgumentError("malformed shard assignment from the coordinator");
  }
  RETURN_IF_ERROR(SetupRegions(a));
  if (a.catch_up()) {
    awaiting_snapshot_ = true;
    assigned_at_ = Clock::now();
    LOG(WARNING) << "server rank " << rank_ << ": made the NEW BACKUP of group " << group_
                 << " (training is under way): its primary's snapshot comes next";
  }
  CrashPoint("server.before_shards_ready");
  RETURN_IF_ERROR(SendShardsReady(a));
  CrashPoint("server.after_shards_ready");
  return ConnectReplication();
}

StatusOr<control::Envelope> ShardServer::WaitForAssignment() {
  if (!options_.spare) {
    return control_->WaitMessage(control::Envelope::kAssignShards, options_.setup_timeout);
  }
  LOG(INFO) << "server rank " << rank_ << ": SPARE: waiting until a group needs a new backup";
  size_t most_workers = 0;
  while (!stop_.load()) {
    auto a = control_->WaitMessage(control::Envelope::kAssignShards, std::chrono::milliseconds(200));
    if (a.ok() || a.status().code() != StatusCode::kDeadlineExceeded) return a;
    // A batch job's spare ends with the job: every expected worker came and all have left.
    size_t workers = 0;
    const control::Membership now = control_->membership();
    for (const auto& m : now.members()) workers += m.role() == control::ROLE_WORKER;
    most_workers = std::max(most_workers, workers);
    if (options_.exit_when_workers_done && workers == 0 &&
        most_workers >= std::max<size_t>(1, config_.num_workers())) {
      LOG(INFO) << "server rank " << rank_ << ": the job is done and this spare was not needed";
      break;
    }
  }
  return control::Envelope();
}

Status ShardServer::SetupRegions(const control::AssignShards& a) {
  group_ = a.group();
  num_groups_ = a.num_groups();
  backup_ = a.backup();
  trace::SetIdentity(backup_ ? "backup" : "server", rank_, group_);
  std::vector<uint64_t> bytes(a.chunk_bytes().begin(), a.chunk_bytes().end());
  dtypes_.assign(a.chunk_dtypes().begin(), a.chunk_dtypes().end());
  if (!dtypes_.empty() && dtypes_.size() != bytes.size()) {
    return InvalidArgumentError("chunk_dtypes does not match chunk_bytes");
  }
  if (a.chunk_row_shards_size() != 0 && a.chunk_row_shards_size() != a.chunk_ids_size()) {
    return InvalidArgumentError("chunk_row_shards does not match chunk_ids");
  }
  // The ring and the records' staging hold float32 values (a 16-bit chunk's are twice its
  // wire bytes; a row shard's, its largest sparse payload). The outbox holds dense chunks only.
  uint64_t max_chunk = layout::kAlign;
  uint64_t max_dense = layout::kAlign;
  uint64_t max_outbox = 0;
  std::vector<layout::RowGeometry> rows(bytes.size());
  row_inits_.assign(bytes.size(), RowInit{});
  for (size_t i = 0; i < bytes.size(); ++i) {
    const uint32_t d = dtypes_.empty() ? 0 : dtypes_[i];
    if (d > static_cast<uint32_t>(layout::DType::kBF16)) return InvalidArgumentError("bad dtype");
    const uint64_t esize = layout::DTypeBytes(static_cast<layout::DType>(d));
    const uint64_t b = bytes[i];
    if (b == 0 || b % esize != 0 || b > (1ull << 40)) return InvalidArgumentError("bad chunk size");
    if (i < static_cast<size_t>(a.chunk_row_shards_size()) && a.chunk_row_shards(i).rows() != 0) {
      const control::RowShard& rs = a.chunk_row_shards(i);
      layout::RowGeometry& g = rows[i];
      g.rows = rs.rows();
      g.dim = rs.dim();
      g.elem_bytes = static_cast<uint32_t>(esize);
      g.max_ids = rs.max_ids();
      g.shard = rs.shard();
      g.shards = rs.shards();
      g.table_rows = rs.table_rows();
      g.hashed = rs.hashed();
      if (g.dim == 0 || g.dim > kMaxRowDim || g.max_ids == 0 || g.max_ids > kMaxIdsPerPush ||
          g.shards == 0 || g.shard >= g.shards ||
          g.rows != layout::RowGeometry::ShardRows(g.table_rows, g.shards, g.shard, g.hashed) ||
          g.rows * g.dim * esize != b || rs.init() > 2 ||
          (g.hashed && !(rs.admit_probability() > 0.0f && rs.admit_probability() <= 1.0f))) {
        return InvalidArgumentError("bad row shard geometry in slot " + std::to_string(i));
      }
      row_inits_[i] = RowInit{static_cast<RowInitKind>(rs.init()), rs.init_scale(),
                              rs.init_seed(), g.hashed ? rs.admit_probability() : 1.0f};
      // kGetState of max_ids rows (RowOutbox) fits the outbox.
      max_outbox = std::max(max_outbox, layout::RowOutbox{g.max_ids, g.dim}.bytes());
      max_chunk = std::max(max_chunk, SparsePayloadBytes(MaxSparseRows(g, a.max_workers()), g.dim));
      continue;
    }
    max_chunk = std::max(max_chunk, b / esize * sizeof(float));
    max_dense = std::max(max_dense, b / esize * sizeof(float));
  }
  layout_ = std::make_unique<layout::ServerLayout>(bytes, a.max_workers(), rows);
  ASSIGN_OR_RETURN(weights_, fabric_->AllocateMemory(AtLeastAligned(layout_->weights_bytes()),
                                                     Access::kRemoteRead));
  ASSIGN_OR_RETURN(inbox_, fabric_->AllocateMemory(AtLeastAligned(layout_->inbox_bytes()),
                                                   Access::kRemoteWrite));
  ASSIGN_OR_RETURN(
      acks_, fabric_->AllocateMemory(AtLeastAligned(layout_->acks_bytes()), Access::kRemoteRead));
  ASSIGN_OR_RETURN(clocks_, fabric_->AllocateMemory(AtLeastAligned(layout_->clocks_bytes()),
                                                    Access::kRemoteWrite));
  ASSIGN_OR_RETURN(outbox_, fabric_->AllocateMemory(std::max(layout::OutboxBytes(max_dense), max_outbox),
                                                    Access::kRemoteRead));
  // Replication: the ring (backup) or the records' staging (primary). Both sides compute the
  // ring's geometry from the same assignment.
  const uint64_t contrib_bytes = layout::AlignUp(sizeof(layout::ReplContributor) * a.max_workers());
  const uint64_t stride = sizeof(layout::ReplHeader) + contrib_bytes + layout::AlignUp(max_chunk);
  // At most kMaxRingEntries by default: the entries are the records in flight to the backup (a
  // primary waits for ring space beyond them), and every entry costs completion-queue room on
  // both sides. A function of the assignment only: primary and backup must agree. A backup's
  // accepted endpoints each reserve entries + 16 receives (AcceptRecvDepth), so the entries
  // also shrink with max_workers until a backup's queue fits a SoftRoCE device (16,383, the
  // smallest limit supported), down to 16.
  constexpr uint32_t kMaxRingEntries = 512;
  constexpr int64_t kSmallestCqDepth = 16383;
  uint32_t entries = options_.replication_ring_entries;
  if (entries == 0) {
    entries = std::min<uint32_t>(kMaxRingEntries, 4 * layout_->slots() + 16);
    while (entries > 16 && ServerCqNeed(a.max_workers(), entries + 16, entries) > kSmallestCqDepth) {
      --entries;
    }
  }
  entries = static_cast<uint32_t>(std::max<uint64_t>(
      2, std::min<uint64_t>(entries, std::max<uint64_t>(2, (256ull << 20) / stride))));
  repl_layout_ = std::make_unique<layout::ReplLayout>(max_chunk, a.max_workers(), entries);
  int cq_depth = 0;
  RETURN_IF_ERROR(SizeCompletionQueue(a.max_workers(), &cq_depth));
  ASSIGN_OR_RETURN(cq_, fabric_->CreateCompletionQueue(cq_depth));
  ASSIGN_OR_RETURN(auto staging,
                   fabric_->AllocateMemory(AtLeastAligned(ReplicationStream::StagingBytes(
                                               *repl_layout_, layout_->slots())),
                                           Access::kLocalOnly));
  stream_ = std::make_unique<ReplicationStream>(fabric_.get(), cq_.get(), *repl_layout_,
                                                layout_->slots(), group_, std::move(staging),
                                                &stats_, [this] { return control_->epoch(); });
  if (backup_) {
    ASSIGN_OR_RETURN(ring_,
                     fabric_->AllocateMemory(repl_layout_->region_bytes(), Access::kRemoteWrite));
    ASSIGN_OR_RETURN(consumed_, fabric_->AllocateMemory(layout::kAlign, Access::kRemoteRead));
    applier_ = std::make_unique<ReplicaApplier>(*repl_layout_, ring_->data(), consumed_->data(),
                                                a.max_workers());
  }
  RETURN_IF_ERROR(SetupComponents(a, bytes));
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  LOG(INFO) << "server rank " << rank_ << ": " << (backup_ ? "BACKUP" : "primary") << " of group "
            << group_ << "/" << num_groups_ << ": " << layout_->slots() << " chunks, "
            << total / 1024 << " KiB of weights; registered weights "
            << layout_->weights_bytes() / 1024 << " KiB (remote-read), inbox "
            << layout_->inbox_bytes() / 1024 << " KiB for " << a.max_workers()
            << " workers (remote-write), acks " << layout_->acks_bytes() << " B"
            << (backup_
                    ? ", replication ring " + std::to_string(repl_layout_->ring_bytes() / 1024) +
                          " KiB (" + std::to_string(entries) + " entries)"
                    : std::string());
  return Status::OK();
}

Status ShardServer::SetupComponents(const control::AssignShards& a,
                                    const std::vector<uint64_t>& bytes) {
  gate_ = std::make_unique<ConsistencyGate>(ModeOf(config_), layout_->slots());
  ChunkStore::Options co;
  co.optimizer = options_.optimizer;
  co.history = gate_->value_staleness() ? options_.vsgd_history : 0;
  std::vector<uint32_t> ids(a.chunk_ids().begin(), a.chunk_ids().end());
  chunks_ = std::make_unique<ChunkStore>(co, *layout_, weights_->data(), ids, bytes, dtypes_,
                                         row_inits_);
  if (!backup_) chunks_->SetServingEpoch(1);
  workers_ = std::make_unique<WorkerTable>(layout_->slots());
  ack_board_ = std::make_unique<AckBoard>(acks_->data(), *layout_);
  pending_.assign(layout_->slots(), PendingVersion());
  plan_fingerprint_ = a.plan_fingerprint();
  CheckpointCapture::Identity id{plan_fingerprint_, group_, num_groups_,
                                 "lr=" + std::to_string(options_.optimizer.lr)};
  capture_ = std::make_unique<CheckpointCapture>(id, layout_->slots(), config_.checkpoint_every());
  if (!options_.restore_dir.empty())
    RETURN_IF_ERROR(Restore(options_.restore_dir, plan_fingerprint_));
  const std::string ckpt_dir =
      !options_.checkpoint_dir.empty() ? options_.checkpoint_dir : config_.checkpoint_dir();
  if (!ckpt_dir.empty()) RETURN_IF_ERROR(EnsureCheckpointWriter(ckpt_dir));
  return Status::OK();
}

Status ShardServer::SendShardsReady(const control::AssignShards& a) {
  control::Envelope ready;
  control::ShardsReady* r = ready.mutable_shards_ready();
  r->set_plan_fingerprint(a.plan_fingerprint());
  auto add = [&](const char* name, const transport::MemoryRegion& m) {
    control::Region* reg = r->add_regions();
    reg->set_name(name);
    reg->set_encoded_descriptor(m.descriptor().Encode());
  };
  add("weights", *weights_);
  add("inbox", *inbox_);
  add("acks", *acks_);
  add("clocks", *clocks_);
  add("outbox", *outbox_);
  if (backup_) {
    add("repl_ring", *ring_);
    add("repl_consumed", *consumed_);
  }
  // Again after every rejoin: a coordinator that died before saving it would wait for ever.
  RETURN_IF_ERROR(control_->SendAndRepeatOnRejoin(ready));
  stats_.Update([&](ShardServerCounters& c) {
    c.backup = backup_;
    c.group = group_;
  });
  return Status::OK();
}

Status ShardServer::ConnectReplication() {
  if (backup_) return Status::OK();
  if (config_.replicas() < 2) {
    LOG(INFO) << "server rank " << rank_ << ": replicas=1: group " << group_
              << " has no backup (a failure of this server loses its state; checkpoints are the "
                 "only copy)";
    return Status::OK();
  }
  // Updates are replicated from the first one on: wait for the backup before serving.
  ASSIGN_OR_RETURN(control::Envelope t, control_->WaitMessage(control::Envelope::kReplicaTarget,
                                                              options_.setup_timeout));
  if (t.replica_target().none()) {
    stream_->NoBackup();
    LOG(WARNING) << "server rank " << rank_ << ": group " << group_
                 << " has no backup: a failure of this server loses its state (checkpoints "
                    "are the only copy)";
    return Status::OK();
  }
  // A backup that dies during start-up must not take its primary down: when it cannot be
  // reached, wait for the coordinator's verdict (a new target, or none: the backup was declared
  // gone, and the group goes on unreplicated, reported), within the setup timeout.
  const auto deadline = std::chrono::steady_clock::now() + options_.setup_timeout;
  const std::string identity = control::IdentityString(
      {control_->member_id(), static_cast<int>(control::ROLE_SERVER), rank_});
  for (;;) {
    const Status st = stream_->Connect(t.replica_target(), identity, nullptr, /*wait_for_hello=*/true);
    if (st.ok()) break;
    LOG(WARNING) << "server rank " << rank_ << ": cannot reach the backup of group " << group_
                 << " (member " << t.replica_target().member_id() << " at "
                 << t.replica_target().data_address() << "): " << st
                 << "; waiting for the coordinator's verdict";
    StatusOr<control::Envelope> next = DeadlineExceededError("no verdict yet");
    while (!next.ok() && std::chrono::steady_clock::now() < deadline) {
      next = control_->WaitMessage(control::Envelope::kReplicaTarget,
                                   std::chrono::milliseconds(500));
    }
    if (!next.ok()) {
      return st.WithContext("the backup of group " + std::to_string(group_) +
                            " stayed unreachable and the coordinator named no other");
    }
    t = std::move(*next);
    if (t.replica_target().none()) {
      stream_->NoBackup();
      // At the job's end (every worker done) the backup leaving is expected: INFO.
      LOG_IF(WARNING, !WorkersDone())
          << "server rank " << rank_ << ": the backup of group " << group_
          << " is gone (died during start-up); going on WITHOUT replication: a failure "
             "of this server now loses its state (checkpoints are the only copy)";
      return Status::OK();
    }
  }
  LOG(INFO) << "server rank " << rank_ << ": replicating group " << group_ << " to member "
            << t.replica_target().member_id() << " at " << t.replica_target().data_address() << " ("
            << repl_layout_->entries() << "-entry ring)";
  CrashPoint("server.after_replica_connect");
  return Status::OK();
}

void ShardServer::PollControl() {
  // Control messages outside steady state: replication target changes and promotion.
  while (true) {
    auto t = control_->WaitMessage(control::Envelope::kReplicaTarget, std::chrono::milliseconds(0));
    if (!t.ok()) break;
    const control::ReplicaTarget& rt = t->replica_target();
    if (rt.none() && stream_->has_backup()) {
      // At the job's end (every worker done) the backup leaving is expected: no WARNING.
      LOG_IF(WARNING, !WorkersDone())
          << "server rank " << rank_ << ": the backup of group " << group_ << " is gone (epoch "
          << rt.epoch() << "); going on without replication";
      DropBackup();
      handoff_.reset();
    } else if (!rt.none()) {
      ReplicateTo(rt);
    }
  }
  while (true) {
    auto y = control_->WaitMessage(control::Envelope::kReplicaSynced, std::chrono::milliseconds(0));
    if (!y.ok()) break;
    const control::ReplicaSynced& rs = y->replica_synced();
    if (backup_ || rs.group() != group_) continue;
    LOG(INFO) << "server rank " << rank_ << ": the new backup of group " << group_
              << " is in sync (copied " << rs.snapshot_bytes() << " bytes in " << rs.copy_ms()
              << " ms, " << rs.records_held() << " records held meanwhile); snapshot freed";
    handoff_.reset();
  }
  auto p = control_->WaitMessage(control::Envelope::kPromote, std::chrono::milliseconds(0));
  if (p.ok()) Promote(p->promote());
  auto k = control_->WaitMessage(control::Envelope::kCheckpoint, std::chrono::milliseconds(0));
  if (k.ok()) OnCheckpointRequest(k->checkpoint());
  DrainWork();
}

void ShardServer::DropBackup() {
  if (!stream_->OnBackupGone()) return;
  // Versions that waited for the backup are published now.
  for (uint32_t s = 0; s < chunks_->slots(); ++s) {
    if (gate_->in_flight(s)) FinishCommit(s);
  }
}

void ShardServer::OnCheckpointRequest(const control::CheckpointRequest& r) {
  Status st = EnsureCheckpointWriter(r.dir().empty() ? config_.checkpoint_dir() : r.dir());
  if (!st.ok()) {
    LOG(ERROR) << "server rank " << rank_ << ": checkpoint at clock " << r.clock()
               << " requested, but: " << st;
    return;
  }
  const uint64_t passed = chunks_->max_published_min_clock_plus1();
  switch (capture_->OnRequest(r.clock(), passed)) {
    case CheckpointCapture::Request::kAccepted:
      LOG(INFO) << "server rank " << rank_ << ": checkpoint requested at clock " << r.clock();
      return;
    case CheckpointCapture::Request::kRefused:
      // Some chunk already holds updates of clocks >= the requested one: a snapshot now would
      // mix clocks. Refused (this group's file is missing, so that checkpoint is never complete
      // and never restored).
      LOG(ERROR) << "server rank " << rank_ << ": checkpoint at clock " << r.clock()
                 << " refused: group " << group_ << " is already at clock " << passed - 1
                 << "; request a later clock";
      return;
    case CheckpointCapture::Request::kIgnored:
      return;
  }
}

Status ShardServer::EnsureCheckpointWriter(const std::string& dir) {
  if (ckpt_writer_) return Status::OK();
  if (dir.empty()) {
    return FailedPreconditionError(
        "no checkpoint directory (coordinator --checkpoint_dir or "
        "server --checkpoint_dir)");
  }
  CheckpointWriter::Options o;
  o.dir = dir;
  o.keep = std::max<uint32_t>(1, config_.checkpoint_keep() ? config_.checkpoint_keep() : 3);
  ServerStats::Histograms* h = &stats_.histograms();  // outlives the writer (declared before)
  ckpt_writer_ = std::make_unique<CheckpointWriter>(o, [h](bool ok, uint64_t bytes, double s) {
    if (!ok) return;
    h->checkpoint_seconds.Observe(s);
    h->checkpoint_bytes.Observe(static_cast<double>(bytes));
  });
  LOG(INFO) << "server rank " << rank_ << ": checkpoints of group " << group_ << " go to " << dir
            << (config_.checkpoint_every()
                    ? " every " + std::to_string(config_.checkpoint_every()) + " clocks"
                    : " on request")
            << ", keeping " << o.keep;
  return Status::OK();
}

Status ShardServer::Restore(const std::string& dir, const std::string& fingerprint) {
  std::string report;
  auto k = LatestCompleteCheckpoint(dir, num_groups_, fingerprint, &report);
  if (!k.ok()) {
    return k.status().WithContext("restoring group " + std::to_string(group_) + " from " + dir +
                                  (report.empty() ? "" : " (" + report + ")"));
  }
  LOG(WARNING) << "server rank " << rank_ << ": restore: " << report;
  const std::string path = SnapshotPath(dir, *k, group_, num_groups_);
  ASSIGN_OR_RETURN(ShardSnapshot snap, ReadSnapshot(path));
  // Row shards checkpointed incrementally: their rows from the checkpoints they build on.
  Status resolved = ResolveIncremental(dir, &snap);
  if (!resolved.ok()) return resolved.WithContext("restoring group " + std::to_string(group_));
  if (snap.chunks.size() != chunks_->slots()) {
    return FailedPreconditionError(path + ": " + std::to_string(snap.chunks.size()) +
                                   " chunks, the plan gives this group " +
                                   std::to_string(chunks_->slots()));
  }
  for (uint32_t s = 0; s < chunks_->slots(); ++s) {
    Status st = chunks_->Restore(s, snap.chunks[s], snap.clock);
    if (!st.ok()) return FailedPreconditionError(path + ": " + st.message());
    gate_->NoteAppliedThrough(s, static_cast<int64_t>(snap.clock) - 1);
  }
  capture_->Restored(snap.clock);
  stats_.Update([&](ShardServerCounters& c) { c.restored_clock = snap.clock; });
  LOG(WARNING) << "server rank " << rank_ << ": group " << group_ << " RESTORED from " << path
               << " (clock " << snap.clock << ")";
  return Status::OK();
}

void ShardServer::RefreshMembership() {
  PollControl();
  const uint64_t e = control_->epoch();
  if (e == seen_epoch_) return;
  // A departed member's key is spent at once, fenced or not (no completion depends on it).
  if (e != keys_epoch_) {
    keys_epoch_ = e;
    std::set<uint32_t> ids;
    const control::Membership m = control_->membership();
    for (const auto& mem : m.members()) ids.insert(mem.member_id());
    authenticator_->SetMembership(std::move(ids));
  }
  // Fenced (lease lapsed; possibly renewed by the poll above, which this loop pass has not
  // seen yet): a departed worker's completions cannot be handled now (nothing is applied
  // while fenced), and closing its endpoints below would discard them, a push its worker
  // completed among them. The rest of the new membership waits until the lease is renewed.
  if (lease_lapsed_) return;
  // A departed worker's endpoints are closed below: first handle what it completed (its last
  // push may be in the CQ, not yet polled). Before seen_epoch_ moves: a push that names the
  // new epoch then waits for the new membership (MaybeApplyBsp) instead of completing a clock
  // against the old one.
  DrainCompletions();
  seen_epoch_ = e;
  const control::Membership m = control_->membership();
  std::set<uint32_t> now;
  bool backup_present = false;
  for (const auto& mem : m.members()) {
    if (mem.role() == control::ROLE_WORKER) now.insert(mem.rank());
    if (mem.member_id() == stream_->backup_member()) backup_present = true;
  }
  if (stream_->failed() && !backup_present) {
    LOG_IF(WARNING, !WorkersDone())
        << "server rank " << rank_ << ": backup member " << stream_->backup_member()
        << " left the membership (epoch " << e << ")";
  }
  for (uint32_t r : workers_->SetMembers(now)) {
    // Its endpoints are closed: a worker declared dead that is in fact alive (stopped past its
    // lease) must not go on writing into this server; it learns it is out of the cluster.
    const int closed = endpoints_->CloseWorker(r);
    // INFO: the coordinator logs a worker that went without leaving as a WARNING.
    LOG(INFO) << "server rank " << rank_ << ": worker " << r << " left (epoch " << e
                 << "); BSP/SSP waits go on without it (" << closed << " endpoint(s) closed)";
  }
  // workers_complete: the coordinator saw every expected worker at once, even if this server's
  // polls never did (a job shorter than the gaps between them).
  if (options_.exit_when_workers_done && now.empty() &&
      (workers_->most_members_seen() >= std::max<size_t>(1, config_.num_workers()) ||
       m.workers_complete())) {
    LOG(INFO) << "server rank " << rank_ << ": all " << workers_->most_members_seen()
              << " workers have left (epoch " << e << "); stopping (--exit_when_done)";
    stop_ = true;
  }
  // A departure may complete BSP aggregations or raise SSP min clocks.
  Reevaluate();
  DrainWork();
}

Status ShardServer::Serve() {
  serving_ = true;
  Status fenced;
  Completion wc[64];
  auto last_accept = Clock::now() - std::chrono::seconds(1);
  auto last_completion = Clock::now();
  while (!stop_.load()) {
    if (LeaseLapsed()) {
      // Fenced: nothing is applied or published until the lease is renewed (pushes wait in
      // the inbox and the transport), so a primary that the coordinator may have replaced
      // never serves beside its successor. Control and membership are still handled.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (!Housekeeping(&fenced)) stop_ = true;
      continue;
    }
    // Busy-poll for options_.busy_poll after the last completion, then sleep (2 ms at most:
    // housekeeping runs at least that often while idle).
    auto now = Clock::now();
    const bool spinning = options_.busy_poll.count() < 0 ||
                          now - last_completion < options_.busy_poll;
    const int n = spinning ? cq_->Poll(wc, 64)
                           : cq_->Wait(wc, 64, std::chrono::microseconds(2000));
    // A spinning server must not starve the threads it waits for where cores are fewer than
    // busy threads (2x2 over shm on 2 cores: 4 KiB pushes fell to 0.4x without the yield).
    if (spinning && n == 0) sched_yield();
    if (n > 0 || !spinning) now = Clock::now();
    if (n > 0) last_completion = now;
    for (int i = 0; i < n; ++i) Dispatch(wc[i]);
    if ((n == 0 && !spinning) || now - last_accept > std::chrono::milliseconds(5)) {
      last_accept = now;
      if (!Housekeeping(&fenced)) stop_ = true;
    }
    stream_->CheckEndpoint([this] { return WorkersDone(); });
    DropFailedEndpoints();
  }
  LOG(INFO) << "server rank " << rank_ << ": stopping";
  if (control_) control_->Leave("server stopping").IgnoreError();
  // Tear the data path down now, as a process exit would: peers see their endpoints fail.
  stream_->Close();
  endpoints_->CloseAll();
  cq_.reset();
  return fenced;
}

bool ShardServer::LeaseLapsed() {
  // Only a replicated group's primary fences itself: the coordinator can hand such a group to
  // its backup. An unreplicated primary has no successor, and stopping it while the
  // coordinator is away (restarting) would only stall training.
  if (backup_ || config_.replicas() < 2 || !stream_ ||
      !(stream_->connected() || stream_->failed())) {
    // Not subject to a lease (any more: e.g. its backup was dropped while it was fenced):
    // whatever was cached while it was must not fence it, or defer its memberships, for ever.
    if (lease_lapsed_ || lease_awaited_) {
      LOG(WARNING) << "server rank " << rank_ << ": group " << group_
                   << " has no backup to hand over to: it serves unfenced";
      lease_lapsed_ = false;
      lease_awaited_ = false;
    }
    return false;
  }
  const bool lapsed = !control_->LeaseHeld();
  if (lapsed != lease_lapsed_) {
    lease_lapsed_ = lapsed;
    if (lapsed && !control_->LeaseEverGranted()) {
      // Start-up: the replication stream connected before the first heartbeat acknowledgement
      // (a loaded host). Fenced as after a lapse, but nothing has lapsed.
      lease_awaited_ = true;
      LOG(INFO) << "server rank " << rank_ << ": group " << group_
                << " has no lease yet (the first heartbeat acknowledgement grants it): nothing "
                   "is applied or published until then";
    } else if (!lapsed && lease_awaited_) {
      lease_awaited_ = false;
      LOG(INFO) << "server rank " << rank_ << ": first lease granted; group " << group_
                << " serves";
    } else if (lapsed) {
      stats_.Bump(&ShardServerCounters::lease_lapses);
      LOG(ERROR) << "server rank " << rank_ << ": LEASE LAPSED (no heartbeat acknowledged for "
                 << timeouts_.lease.count() << " ms; ended " << -control_->LeaseLeft().count()
                 << " ms ago): group " << group_
                 << " is fenced: nothing is applied or published until it is renewed";
    } else {
      LOG(WARNING) << "server rank " << rank_ << ": lease renewed; group " << group_
                   << " serves again";
    }
  }
  return lapsed;
}

void ShardServer::ReportStalls() {
  if (options_.stall_report.count() <= 0 || backup_ || gate_ == nullptr || chunks_ == nullptr) {
    return;
  }
  const auto now = Clock::now();
  if (now - stalls_checked_ < std::chrono::milliseconds(100)) return;
  stalls_checked_ = now;
  const uint32_t slots = chunks_->slots();
  if (stall_watch_.size() != slots) stall_watch_.assign(slots, StallWatch{});
  // One line per pass however many chunks stalled together (a straggler holds every chunk):
  // their count and the first one's description.
  uint32_t newly = 0;
  int64_t first = -1;
  for (uint32_t slot = 0; slot < slots; ++slot) {
    StallWatch& w = stall_watch_[slot];
    const uint64_t version = chunks_->version(slot);
    const bool waiting = gate_->Waiting(slot);
    if (!waiting || !w.waiting || version != w.version) {
      w = StallWatch{now, version, waiting, false};
      continue;
    }
    if (w.reported || now - w.since < options_.stall_report) continue;
    w.reported = true;
    stats_.Bump(&ShardServerCounters::stalled_chunks);
    if (newly++ == 0) first = slot;
  }
  if (newly == 0) return;
  const auto slot = static_cast<uint32_t>(first);
  LOG(WARNING) << "server rank " << rank_ << ": STALLED: " << newly << " chunk(s) published no "
               << "version for over " << options_.stall_report.count() << " ms; chunk "
               << chunks_->chunk_id(slot) << " (slot " << slot << ", version "
               << stall_watch_[slot].version << ", for "
               << std::chrono::duration_cast<std::chrono::milliseconds>(
                      now - stall_watch_[slot].since)
                      .count()
               << " ms): " << gate_->DescribeWait(slot, *workers_)
               << (lease_lapsed_ ? "; this primary is fenced (its lease lapsed)" : "");
}

bool ShardServer::Housekeeping(Status* fenced) {
  AcceptPending();
  RefreshMembership();
  // BSP waits for the membership of the newest epoch a push came from (MaybeApplyBsp). A
  // membership takes well under a heartbeat to arrive; an epoch that never comes (a peer's
  // header naming a future epoch) must not stall training: after the lease, go on.
  if (newest_push_epoch_ > seen_epoch_ && !lease_lapsed_) {  // (fenced: nothing is applied)
    if (epoch_wait_since_ == Clock::time_point{}) epoch_wait_since_ = Clock::now();
    if (Clock::now() - epoch_wait_since_ > timeouts_.lease) {
      LOG(WARNING) << "server rank " << rank_ << ": a push named membership epoch "
                   << newest_push_epoch_ << " but this server's is still " << seen_epoch_
                   << " after the lease; applying with the membership it has";
      newest_push_epoch_ = seen_epoch_;
      epoch_wait_since_ = Clock::time_point{};
      Reevaluate();
      DrainWork();
    }
  } else {
    epoch_wait_since_ = Clock::time_point{};
  }
  ReportStalls();
  if (backup_ && awaiting_snapshot_ && Clock::now() - assigned_at_ > options_.setup_timeout) {
    catch_up_error_ = DeadlineExceededError(
        "the primary of group " + std::to_string(group_) + " did not start replicating to this "
        "new backup within the setup timeout");
  }
  if (!catch_up_error_.ok()) {
    // Leave, so that the coordinator drops this backup (and may pick another spare); the
    // primary goes on meanwhile, unreplicated.
    LOG(ERROR) << "server rank " << rank_ << ": " << catch_up_error_
               << "; leaving the cluster (this server cannot back the group up)";
    *fenced = catch_up_error_;
    return false;
  }
  // The primary may be dead without the coordinator knowing yet: it may be within its lease, or
  // a restarted coordinator may still be waiting for it to rejoin (proto/fault_timeouts.h).
  if (backup_ && applier_->broken() && control_->connected() &&
      Clock::now() - applier_->broken_since() > timeouts_.backup_eviction) {
    bool primary_member = false;  // the group's primary is still in the membership
    const control::Membership now = control_->membership();
    for (const auto& m : now.members()) {
      primary_member = primary_member || (m.role() == control::ROLE_SERVER && m.rank() == group_);
    }
    if (primary_member) {
      // Not promoted: the primary is alive but this backup can no longer follow it. Leave, so
      // that the coordinator tells the primary to go on alone instead of stalling.
      LOG(ERROR) << "server rank " << rank_ << ": lost the replication stream of group " << group_
                 << "'s primary and was not promoted; leaving the cluster so the "
                 << "primary goes on without a backup";
      *fenced = UnavailableError("backup of group " + std::to_string(group_) +
                                 " lost its primary's replication stream");
      return false;
    }
  }
  if (ckpt_writer_) {
    // Checkpoint writer statistics, for counters() (read by other threads).
    const CheckpointWriter::Stats st = ckpt_writer_->stats();
    stats_.Update([&](ShardServerCounters& c) {
      c.checkpoints_written = st.written;
      c.checkpoint_failures = st.failed;
      c.checkpoint_bytes = st.bytes_written;
      if (st.last_written_clock.has_value()) {
        c.has_checkpoint = true;
        c.last_checkpoint_clock = *st.last_written_clock;
      }
    });
  }
  if (Clock::now() - gauges_published_ > std::chrono::milliseconds(200)) {
    // Gauges of apply-thread state, for counters() and /metrics: a few times a second.
    gauges_published_ = Clock::now();
    uint64_t waiting = 0;
    if (gate_ && chunks_) {
      for (uint32_t s = 0; s < chunks_->slots(); ++s) waiting += gate_->deferred(s);
    }
    const control::ControlCounters cc = control_->counters();
    stats_.Update([&](ShardServerCounters& c) {
      c.pushes_waiting = waiting;
      c.heartbeats_sent = cc.heartbeats_sent;
      c.heartbeat_acks = cc.heartbeat_acks;
    });
  }
  if (workers_ != nullptr && Clock::now() - min_clock_at_ > std::chrono::milliseconds(100)) {
    // For `shardps status` (heartbeats): the slowest live worker's newest applied clock; every
    // 100 ms, not every pass (it walks workers x slots).
    min_clock_at_ = Clock::now();
    bool any = false;
    int64_t min_clock = 0, max_clock = 0;
    for (uint32_t rank : workers_->Live()) {
      const WorkerState* w = workers_->Find(rank);
      if (w == nullptr || w->applied_clock.empty()) continue;
      const int64_t newest = *std::max_element(w->applied_clock.begin(), w->applied_clock.end());
      if (newest < 0) continue;
      min_clock = any ? std::min(min_clock, newest) : newest;
      max_clock = std::max(max_clock, newest);
      any = true;
    }
    // A backup applies records, not pushes: its clocks come from the records it folded in.
    stats_.Update([&](ShardServerCounters& c) {
      c.min_applied_clock = static_cast<uint64_t>(min_clock);
      c.max_applied_clock = std::max(c.max_applied_clock, static_cast<uint64_t>(max_clock));
    });
  }
  Status cs = control_->status();
  if (!cs.ok()) {
    // Refused back by the coordinator (declared dead: its group may have been failed over) or
    // unreachable for the whole rejoin window: this server must not serve on (fenced).
    LOG(ERROR) << "server rank " << rank_ << ": lost its membership: " << cs
               << "; stopping (fenced)";
    *fenced = cs;
    return false;
  }
  return true;
}

bool ShardServer::WorkersDone() const {
  if (control_ == nullptr) return false;
  const control::Membership m = control_->membership();
  if (workers_->most_members_seen() < std::max<size_t>(1, config_.num_workers()) &&
      !m.workers_complete()) {
    return false;
  }
  for (const auto& mem : m.members()) {
    if (mem.role() == control::ROLE_WORKER) return false;
  }
  return true;
}

void ShardServer::FillHeartbeatStats(control::MemberStats* s) const {
  const ShardServerCounters c = stats_.Snapshot();
  s->set_pushes_applied(c.pushes_applied);
  s->set_bytes_applied(c.bytes_applied);
  s->set_min_applied_clock(c.min_applied_clock);
  s->set_max_applied_clock(c.max_applied_clock);
  s->set_has_checkpoint(c.has_checkpoint);
  s->set_last_checkpoint_clock(c.last_checkpoint_clock);
}

void ShardServer::Dispatch(const Completion& wc) {
  if (ReplicationStream::IsStreamEndpoint(wc.endpoint_id)) {
    const std::optional<uint32_t> slot = stream_->OnCompletion(wc);
    if (slot && gate_->in_flight(*slot)) FinishCommit(*slot);
  } else if (wc.op == OpType::kRecvImm && wc.ok()) {
    HandleRecvImm(wc);
  } else if (catch_up_ && wc.op == OpType::kRead &&
             wc.endpoint_id == catch_up_->endpoint_id) {
    OnCatchUpRead(wc);
  } else if (!wc.ok()) {
    stats_.Bump(&ShardServerCounters::endpoint_errors);
    stats_.BumpPeerError(PeerOf(wc.endpoint_id));
  }
  DrainWork();
}

void ShardServer::DrainCompletions() {
  if (!cq_ || lease_lapsed_) return;
  Completion wc[64];
  // Whatever was in the queue when this began is at most its depth; what live workers add
  // meanwhile is newer and need not be waited for.
  const int rounds = cq_->depth() / 64 + 1;
  for (int round = 0; round < rounds; ++round) {
    const int n = cq_->Poll(wc, 64);
    for (int i = 0; i < n; ++i) Dispatch(wc[i]);
    if (n < 64) return;
  }
}

void ShardServer::DropFailedEndpoints() {
  // Drop endpoints that failed (a dead worker); membership decides what it means. A worker's
  // endpoint closing is logged at INFO: its departure (left, or declared dead: a WARNING) is
  // what matters, and comes with the next membership. So is the primary's stream ending once
  // the job's workers are done.
  if (!endpoints_->AnyFailed()) return;
  DrainCompletions();
  const uint64_t primary = applier_ ? applier_->primary_endpoint() : 0;
  for (const auto& [id, why] : endpoints_->DropFailed()) {
    const bool is_primary = id == primary && primary != 0;
    // The primary's stream failing is followed by a promotion (or is the job's end): the
    // coordinator logs the primary's loss, this backup its promotion.
    const bool expected = is_primary || endpoints_->WorkerOf(id).has_value();
    LOG_IF(WARNING, !expected) << "server rank " << rank_ << ": endpoint " << id
                               << (is_primary ? " (the primary's replication stream)" : "")
                               << " failed: " << why;
    LOG_IF(INFO, expected) << "server rank " << rank_ << ": endpoint " << id
                           << (is_primary ? " (the primary's replication stream)" : "")
                           << " closed: " << why;
    if (backup_ && id == primary) applier_->MarkBroken();
    stats_.Bump(&ShardServerCounters::endpoint_errors);
    stats_.BumpPeerError(id == primary && primary != 0 ? "primary" : PeerOf(id));
  }
}

std::string ShardServer::PeerOf(uint64_t endpoint_id) const {
  if (const std::optional<uint32_t> w = endpoints_->WorkerOf(endpoint_id)) {
    return "worker-" + std::to_string(*w);
  }
  if (applier_ && endpoint_id == applier_->primary_endpoint()) return "primary";
  return "endpoint-" + std::to_string(endpoint_id);
}

void ShardServer::AcceptPending() {
  Status error;
  int refused = 0;
  const int accepted =
      endpoints_->AcceptPending(cq_.get(), 16, AcceptRecvDepth(recv_depth_), &error, &refused);
  if (refused > 0) {
    const uint64_t before = stats_.Snapshot().connections_refused;
    stats_.Update([&](ShardServerCounters& c) { c.connections_refused += refused; });
    // The first refusal, then one line per 100 (a flood must not flood the log).
    if (before == 0 || before / 100 != (before + refused) / 100) {
      LOG(WARNING) << "server rank " << rank_ << ": " << before + refused
                   << " data-path connection(s) refused so far; the latest: " << error;
    }
  } else if (!error.ok()) {
    LOG(WARNING) << "server rank " << rank_ << ": accept: " << error;
  }
  if (accepted > 0) {
    stats_.Update([&](ShardServerCounters& c) { c.endpoints_accepted += accepted; });
  }
}

void ShardServer::Promote(const control::Promote& p) {
  if (!backup_ || p.group() != group_) {
    LOG(WARNING) << "server rank " << rank_ << ": promotion for group " << p.group()
                 << " ignored (this server is " << (backup_ ? "the backup" : "the primary")
                 << " of group " << group_ << ")";
    return;
  }
  if (catch_up_ || awaiting_snapshot_) {
    // The coordinator promotes only a backup in sync (ReplicaSynced); this one is not.
    catch_up_error_ = FailedPreconditionError(
        "promoted while still copying group " + std::to_string(group_) +
        "'s snapshot: this server does not hold the group's state");
    return;
  }
  const auto t0 = Clock::now();
  CrashPoint("server.promote_before_drain");
  // Every record the old primary saw complete is in this CQ: apply them all first. Wait
  // (boundedly) for its stream to fail so that nothing is still in flight inside the transport;
  // a primary that is only partitioned is cut off instead (its later writes fail: fenced).
  const auto deadline = t0 + std::chrono::milliseconds(2000);
  Completion wc[64];
  while (true) {
    const int n = cq_->Wait(wc, 64, std::chrono::microseconds(1000));
    for (int i = 0; i < n; ++i) {
      if (wc[i].op == OpType::kRecvImm && wc[i].ok()) HandleRecvImm(wc[i]);
    }
    const bool primary_gone = !endpoints_->Healthy(applier_->primary_endpoint());
    // A hard bound: a live (partitioned) primary that keeps writing never leaves the CQ empty.
    // What is left is drained after the cut below.
    if ((n == 0 && primary_gone) || Clock::now() > deadline) break;
  }
  // Cut the old primary off first (a partitioned one's later writes fail, so it never sees
  // them complete and never publishes them), then apply what it completed before the cut.
  endpoints_->Close(applier_->primary_endpoint());
  CrashPoint("server.promote_after_cut");
  for (int empty = 0; empty < 3;) {
    const int n = cq_->Wait(wc, 64, std::chrono::microseconds(1000));
    empty = n == 0 ? empty + 1 : 0;
    for (int i = 0; i < n; ++i) {
      if (wc[i].op == OpType::kRecvImm && wc[i].ok()) HandleRecvImm(wc[i]);
    }
  }
  applier_->set_primary_endpoint(0);
  backup_ = false;
  fence_epoch_ = p.epoch();
  chunks_->SetServingEpoch(std::max<uint64_t>(1, p.epoch()));
  stream_->NoBackup();
  stats_.Update([](ShardServerCounters& c) {
    ++c.promotions;
    c.backup = false;
  });
  trace::Instant("promote", "server", {{"group", group_}, {"epoch", p.epoch()}});
  trace::SetIdentity("server", rank_, group_);
  // The coordinator promotes at the job's end too (its primary left first): INFO then.
  LOG_IF(WARNING, !WorkersDone())
      << "server rank " << rank_ << ": PROMOTED to primary of group " << group_ << " at epoch "
      << p.epoch() << " after " << applier_->applied() << " replicated records (drained in "
      << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()
      << " ms); the group has no backup now";
  std::vector<Completion> early;
  early.swap(early_);
  for (const Completion& c : early) {
    HandleRecvImm(c);
    DrainWork();
  }
  Reevaluate();
  if (deferred_target_) {
    const control::ReplicaTarget t = *deferred_target_;
    deferred_target_.reset();
    ReplicateTo(t);
  }
}

char* ShardServer::RowRecordForTesting(uint32_t slot, uint64_t local_row) {
  if (weights_ == nullptr || layout_ == nullptr || slot >= layout_->slots()) return nullptr;
  if (!layout_->is_rows(slot) || local_row >= layout_->rows(slot).rows) return nullptr;
  return static_cast<char*>(weights_->data()) + layout_->row_offset(slot, local_row);
}

}  // namespace shardps::server
