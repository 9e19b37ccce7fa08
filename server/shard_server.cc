#include "server/shard_server.h"

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

constexpr uint64_t kBackupEndpointId = 1ull << 62;
// Contexts of the operations on the primary's endpoint to its backup.
enum ReplOp : uint64_t { kOpRecord = 1, kOpConsumed = 2, kOpReplHello = 3, kOpPayload = 4 };
uint64_t ReplContext(ReplOp op, uint32_t slot) { return (static_cast<uint64_t>(op) << 32) | slot; }
ReplOp ReplOpOf(uint64_t ctx) { return static_cast<ReplOp>(ctx >> 32); }
uint32_t ReplSlotOf(uint64_t ctx) { return static_cast<uint32_t>(ctx & 0xffffffffu); }

}  // namespace

// Per-slot state, owned by the apply thread.
struct ShardServer::Chunk {
  uint32_t chunk_id = 0;
  uint64_t bytes = 0;
  size_t elems = 0;
  layout::ChunkHeader* header = nullptr;
  float* buf[2] = {nullptr, nullptr};
  std::unique_ptr<ChunkOptimizer> optimizer;
  uint64_t version = 0;  // published
  uint32_t published = 0;
  // BSP aggregation of one clock at a time; the gradients stay in the inbox (a worker reuses an
  // inbox slot only after its push is acknowledged, which happens at publication) and are
  // summed in worker-rank order when the last one is in, so the sum does not depend on arrival
  // order: runs are reproducible bit for bit, failovers included.
  std::map<uint32_t, Contributor> contrib;  // by worker rank
  int64_t pending_clock = -1;
  int64_t applied_through = -1;  // BSP: the last clock applied
  float* sum = nullptr;          // in repl_staging_ (registered: a record's payload)
  uint64_t sum_offset = 0;
  // A computed version waiting for its replication record to complete.
  bool inflight = false;
  uint32_t inflight_target = 0;
  uint64_t inflight_min_clock_plus1 = 0;
  std::vector<Contributor> inflight_acks;
  // Record description for PostRecord.
  layout::ReplKind record_kind = layout::ReplKind::kApply;
  const transport::MemoryRegion* record_payload = nullptr;
  uint64_t record_payload_offset = 0;
  float record_scale = 1.0f;
  float record_lr_scale = 1.0f;
  // Pushes that arrived while a version was in flight or ahead of the pending BSP clock.
  std::deque<std::pair<uint32_t, uint32_t>> deferred;  // (worker, parity)
  // VSGD history: version -> weights (the last vsgd_history versions).
  std::deque<std::pair<uint64_t, std::vector<float>>> history;
};

struct ShardServer::WorkerState {
  uint64_t incarnation = 0;            // the worker process (its member id)
  std::vector<uint64_t> last_seq;      // per slot
  std::vector<int64_t> applied_clock;  // per slot, -1 = none
  // From the worker's clock immediates: it finished clocks < clock, and every push of those was
  // posted before its kClock immediate, hence already processed (same endpoint, in order).
  uint64_t clock = 0;
  uint64_t endpoint_id = 0;
};

ShardServer::ShardServer(const ShardServerOptions& options) : options_(options) {}
ShardServer::~ShardServer() = default;

ShardServerCounters ShardServer::counters() const {
  ShardServerCounters c;
  {
    std::lock_guard<std::mutex> l(counters_mu_);
    c = counters_;
  }
  return c;
}

Status ShardServer::Run() {
  RETURN_IF_ERROR(Setup());
  return Serve();
}

Status ShardServer::Setup() {
  ASSIGN_OR_RETURN(fabric_, transport::Fabric::Open(options_.fabric));
  std::string listen = options_.data_listen;
  if (listen.empty() && fabric_->name() != "shm") {
    listen =
        (options_.fabric.bind_ip.empty() ? std::string("0.0.0.0") : options_.fabric.bind_ip) + ":0";
  }
  ASSIGN_OR_RETURN(listener_, fabric_->Listen(listen));
  std::string data_address = listener_->address();
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
  co.connect_timeout = std::chrono::milliseconds(10000);
  // A restarted coordinator takes the server back; training goes on meanwhile.
  co.rejoin_window = std::chrono::milliseconds(300000);
  ASSIGN_OR_RETURN(control_, control::ControlClient::Join(co));
  rank_ = control_->reply().rank();
  config_ = control_->reply().config();
  LOG(INFO) << "server rank " << rank_ << ": joined as member " << control_->member_id()
            << ", data path " << fabric_->name() << " at " << data_address << ", mode "
            << control::ConsistencyMode_Name(config_.mode()) << " s=" << config_.staleness();

  ASSIGN_OR_RETURN(control::Envelope assign,
                   control_->WaitMessage(control::Envelope::kAssignShards, options_.setup_timeout));
  const control::AssignShards& a = assign.assign_shards();
  if (a.chunk_ids_size() != a.chunk_bytes_size() || a.max_workers() == 0 ||
      a.max_workers() > 4096 || a.num_groups() == 0 || a.group() >= a.num_groups()) {
    return InvalidArgumentError("malformed shard assignment from the coordinator");
  }
  group_ = a.group();
  num_groups_ = a.num_groups();
  backup_ = a.backup();
  std::vector<uint64_t> bytes(a.chunk_bytes().begin(), a.chunk_bytes().end());
  uint64_t max_chunk = layout::kAlign;
  for (uint64_t b : bytes) {
    if (b == 0 || b % sizeof(float) != 0 || b > (1ull << 40)) {
      return InvalidArgumentError("bad chunk size");
    }
    max_chunk = std::max(max_chunk, b);
  }
  layout_ = std::make_unique<layout::ServerLayout>(bytes, a.max_workers());
  // A server may own no chunk (a model smaller than one partition per server): its regions
  // are then empty, but a region of 0 bytes cannot be allocated, so each has at least kAlign.
  auto at_least = [](uint64_t n) { return std::max<uint64_t>(n, layout::kAlign); };
  ASSIGN_OR_RETURN(
      weights_, fabric_->AllocateMemory(at_least(layout_->weights_bytes()), Access::kRemoteRead));
  ASSIGN_OR_RETURN(inbox_,
                   fabric_->AllocateMemory(at_least(layout_->inbox_bytes()), Access::kRemoteWrite));
  ASSIGN_OR_RETURN(acks_,
                   fabric_->AllocateMemory(at_least(layout_->acks_bytes()), Access::kRemoteRead));
  ASSIGN_OR_RETURN(
      clocks_, fabric_->AllocateMemory(at_least(layout_->clocks_bytes()), Access::kRemoteWrite));
  // Replication: the ring (backup) or the records' staging (primary). Both sides compute the
  // ring's geometry from the same assignment.
  const uint64_t contrib_bytes = layout::AlignUp(sizeof(layout::ReplContributor) * a.max_workers());
  const uint64_t stride = sizeof(layout::ReplHeader) + contrib_bytes + layout::AlignUp(max_chunk);
  uint32_t entries = options_.replication_ring_entries != 0 ? options_.replication_ring_entries
                                                            : 4 * layout_->slots() + 16;
  entries = static_cast<uint32_t>(std::max<uint64_t>(
      2, std::min<uint64_t>(entries, std::max<uint64_t>(2, (256ull << 20) / stride))));
  repl_layout_ = std::make_unique<layout::ReplLayout>(max_chunk, a.max_workers(), entries);
  repl_slot_stride_ = stride;
  ASSIGN_OR_RETURN(repl_staging_,
                   fabric_->AllocateMemory(at_least(stride * layout_->slots() + layout::kAlign),
                                           Access::kLocalOnly));
  consumed_staging_offset_ = stride * layout_->slots();
  const bool replicated = config_.replicas() >= 2;
  if (backup_) {
    ASSIGN_OR_RETURN(ring_,
                     fabric_->AllocateMemory(repl_layout_->ring_bytes(), Access::kRemoteWrite));
    ASSIGN_OR_RETURN(consumed_, fabric_->AllocateMemory(layout::kAlign, Access::kRemoteRead));
  }
  auto* wbase = static_cast<char*>(weights_->data());
  for (uint32_t s = 0; s < layout_->slots(); ++s) {
    auto c = std::make_unique<Chunk>();
    c->chunk_id = a.chunk_ids(s);
    c->bytes = bytes[s];
    c->elems = bytes[s] / sizeof(float);
    c->header = new (wbase + layout_->header_offset(s)) layout::ChunkHeader();
    for (int b = 0; b < 2; ++b) {
      c->buf[b] = reinterpret_cast<float*>(wbase + layout_->buffer_offset(s, b));
    }
    c->sum_offset = stride * s + sizeof(layout::ReplHeader) + contrib_bytes;
    c->sum = reinterpret_cast<float*>(static_cast<char*>(repl_staging_->data()) + c->sum_offset);
    c->optimizer = std::make_unique<ChunkOptimizer>(options_.optimizer, c->elems);
    if (!backup_) c->header->serving_epoch.store(1, std::memory_order_release);
    chunks_.push_back(std::move(c));
  }
  plan_fingerprint_ = a.plan_fingerprint();
  if (!options_.restore_dir.empty())
    RETURN_IF_ERROR(Restore(options_.restore_dir, plan_fingerprint_));
  ckpt_every_ = config_.checkpoint_every();
  const std::string ckpt_dir =
      !options_.checkpoint_dir.empty() ? options_.checkpoint_dir : config_.checkpoint_dir();
  if (!ckpt_dir.empty()) RETURN_IF_ERROR(EnsureCheckpointWriter(ckpt_dir));
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

  const int recv_depth = static_cast<int>(std::min<uint32_t>(1024, 2 * layout_->slots() + 32));
  ASSIGN_OR_RETURN(cq_, fabric_->CreateCompletionQueue(static_cast<int>(a.max_workers() + 3) *
                                                           (recv_depth + 16) +
                                                       4 * static_cast<int>(entries) + 64));

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
  if (backup_) {
    add("repl_ring", *ring_);
    add("repl_consumed", *consumed_);
  }
  RETURN_IF_ERROR(control_->Send(ready));
  {
    std::lock_guard<std::mutex> l(counters_mu_);
    counters_.backup = backup_;
    counters_.group = group_;
  }
  if (!backup_ && replicated) {
    // Updates are replicated from the first one on: wait for the backup before serving.
    ASSIGN_OR_RETURN(control::Envelope t, control_->WaitMessage(control::Envelope::kReplicaTarget,
                                                                options_.setup_timeout));
    if (t.replica_target().none()) {
      backup_state_ = BackupState::kGone;
      LOG(WARNING) << "server rank " << rank_ << ": group " << group_
                   << " has no backup: a failure of this server loses its state (checkpoints "
                      "are the only copy)";
    } else {
      RETURN_IF_ERROR(ConnectBackup(t.replica_target()));
    }
  } else if (!backup_) {
    LOG(INFO) << "server rank " << rank_ << ": replicas=1: group " << group_
              << " has no backup (a failure of this server loses its state; checkpoints are the "
                 "only copy)";
  }
  return Status::OK();
}

Status ShardServer::ConnectBackup(const control::ReplicaTarget& t) {
  for (const auto& r : t.regions()) {
    ASSIGN_OR_RETURN(transport::RegionDescriptor d,
                     transport::RegionDescriptor::Decode(r.encoded_descriptor()));
    if (r.name() == "repl_ring") backup_ring_ = d;
    if (r.name() == "repl_consumed") backup_consumed_ = d;
  }
  if (backup_ring_.length < repl_layout_->ring_bytes() || backup_consumed_.length < 8) {
    return FailedPreconditionError("backup's replication regions are smaller than the ring");
  }
  transport::EndpointOptions eo;
  eo.endpoint_id = kBackupEndpointId;
  eo.send_depth = static_cast<int>(2 * repl_layout_->entries() + 16);
  eo.recv_depth = 4;
  eo.connect_timeout = std::chrono::milliseconds(10000);
  auto ep = fabric_->Connect(t.data_address(), cq_.get(), eo);
  if (!ep.ok())
    return ep.status().WithContext("connecting to the backup of group " + std::to_string(group_));
  backup_ep_ = std::move(*ep);
  RETURN_IF_ERROR(backup_ep_->PostWriteImm(
      {repl_staging_.get(), consumed_staging_offset_, 8}, transport::AtOffset(backup_ring_, 0),
      layout::MakeImm(layout::ImmKind::kReplHello, group_), ReplContext(kOpReplHello, 0)));
  // Wait for the hello to complete (nothing else is on this CQ yet).
  const auto deadline = Clock::now() + std::chrono::milliseconds(10000);
  while (true) {
    Completion wc[8];
    const int n = cq_->Wait(wc, 8, std::chrono::microseconds(2000));
    bool done = false;
    for (int i = 0; i < n; ++i) {
      if (wc[i].endpoint_id != kBackupEndpointId) continue;
      if (!wc[i].ok()) return UnavailableError("backup refused the replication stream");
      done = true;
    }
    if (done) break;
    if (Clock::now() > deadline) return DeadlineExceededError("backup did not answer");
  }
  backup_state_ = BackupState::kConnected;
  backup_member_ = t.member_id();
  std::lock_guard<std::mutex> l(counters_mu_);
  counters_.replicating = true;
  LOG(INFO) << "server rank " << rank_ << ": replicating group " << group_ << " to member "
            << t.member_id() << " at " << t.data_address() << " (" << repl_layout_->entries()
            << "-entry ring)";
  return Status::OK();
}

std::set<uint32_t> ShardServer::LiveWorkers() const {
  std::set<uint32_t> live = member_workers_;
  for (const auto& [rank, w] : workers_) {
    if (!departed_workers_.count(rank)) live.insert(rank);
  }
  return live;
}

ShardServer::WorkerState& ShardServer::Worker(uint32_t rank, uint64_t incarnation) {
  auto& w = workers_[rank];
  if (!w || (incarnation != 0 && w->incarnation != incarnation)) {
    // A new worker process (or the first we hear of it): fresh sequence state.
    const uint64_t old_clock = w ? w->clock : 0;
    const uint64_t ep = w ? w->endpoint_id : 0;
    w = std::make_unique<WorkerState>();
    w->last_seq.assign(layout_->slots(), 0);
    w->applied_clock.assign(layout_->slots(), -1);
    w->incarnation = incarnation;
    w->endpoint_id = ep;
    (void)old_clock;
    // Its acks restart with its sequence numbers.
    auto* acks = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(acks_->data()) +
                                                          layout_->acks_of_worker_offset(rank));
    for (uint32_t s = 0; s < layout_->slots(); ++s) acks[s].store(0, std::memory_order_release);
  }
  return *w;
}

void ShardServer::PollControl() {
  // Control messages outside steady state: replication target changes and promotion.
  while (true) {
    auto t = control_->WaitMessage(control::Envelope::kReplicaTarget, std::chrono::milliseconds(0));
    if (!t.ok()) break;
    const control::ReplicaTarget& rt = t->replica_target();
    if (rt.none() && backup_state_ != BackupState::kNone) {
      LOG(WARNING) << "server rank " << rank_ << ": the backup of group " << group_
                   << " is gone (epoch " << rt.epoch() << "); going on without replication";
      backup_state_ = BackupState::kGone;
      backup_ep_.reset();
      {
        std::lock_guard<std::mutex> l(counters_mu_);
        counters_.replicating = false;
      }
      // Versions that waited for the backup are published now.
      ring_wait_.clear();
      for (uint32_t s = 0; s < chunks_.size(); ++s) {
        if (chunks_[s]->inflight) FinishCommit(s);
      }
    }
  }
  auto p = control_->WaitMessage(control::Envelope::kPromote, std::chrono::milliseconds(0));
  if (p.ok()) Promote(p->promote());
  auto k = control_->WaitMessage(control::Envelope::kCheckpoint, std::chrono::milliseconds(0));
  if (k.ok()) {
    const control::CheckpointRequest& r = k->checkpoint();
    Status st = EnsureCheckpointWriter(r.dir().empty() ? config_.checkpoint_dir() : r.dir());
    if (!st.ok()) {
      LOG(ERROR) << "server rank " << rank_ << ": checkpoint at clock " << r.clock()
                 << " requested, but: " << st;
    } else if (r.clock() > ckpt_last_ && (ckpt_next_ == 0 || r.clock() < ckpt_next_) &&
               ckpt_pending_ == nullptr) {
      uint64_t passed = 0;
      for (const auto& c : chunks_) {
        passed = std::max(passed,
                          c->header->min_clock_plus1[c->published].load(std::memory_order_relaxed));
      }
      if (passed > r.clock()) {
        // Some chunk already holds updates of clocks >= the requested one: a snapshot now would
        // mix clocks. Refused (this group's file is missing, so that checkpoint is never
        // complete and never restored).
        LOG(ERROR) << "server rank " << rank_ << ": checkpoint at clock " << r.clock()
                   << " refused: group " << group_ << " is already at clock " << passed - 1
                   << "; request a later clock";
      } else {
        ckpt_next_ = r.clock();
        LOG(INFO) << "server rank " << rank_ << ": checkpoint requested at clock " << r.clock();
      }
    }
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
  ckpt_writer_ = std::make_unique<CheckpointWriter>(o);
  LOG(INFO) << "server rank " << rank_ << ": checkpoints of group " << group_ << " go to " << dir
            << (ckpt_every_ ? " every " + std::to_string(ckpt_every_) + " clocks" : " on request")
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
  if (snap.chunks.size() != chunks_.size()) {
    return FailedPreconditionError(path + ": " + std::to_string(snap.chunks.size()) +
                                   " chunks, the plan gives this group " +
                                   std::to_string(chunks_.size()));
  }
  for (uint32_t s = 0; s < chunks_.size(); ++s) {
    Chunk& c = *chunks_[s];
    const ChunkState& cs = snap.chunks[s];
    if (cs.chunk_id != c.chunk_id || cs.weights.size() != c.elems || cs.version == 0) {
      return FailedPreconditionError(path + ": chunk " + std::to_string(s) +
                                     " does not match the plan");
    }
    std::memcpy(c.buf[0], cs.weights.data(), c.bytes);
    c.optimizer->RestoreState(cs.optimizer_steps, cs.state1, cs.state2);
    c.version = cs.version;
    c.published = 0;
    c.header->version[0].store(cs.version, std::memory_order_relaxed);
    c.header->min_clock_plus1[0].store(snap.clock, std::memory_order_relaxed);
    c.header->state.store(cs.version << 1, std::memory_order_release);
    c.applied_through = static_cast<int64_t>(snap.clock) - 1;
  }
  restored_clock_ = snap.clock;
  ckpt_last_ = snap.clock;
  {
    std::lock_guard<std::mutex> l(counters_mu_);
    counters_.restored_clock = snap.clock;
  }
  LOG(WARNING) << "server rank " << rank_ << ": group " << group_ << " RESTORED from " << path
               << " (clock " << snap.clock << ")";
  return Status::OK();
}

void ShardServer::MaybeCapture(uint32_t slot) {
  if (!ckpt_writer_ || backup_) return;
  Chunk& c = *chunks_[slot];
  const uint64_t mc = c.header->min_clock_plus1[c.published].load(std::memory_order_relaxed);
  if (ckpt_next_ == 0) {
    if (ckpt_every_ == 0) return;
    ckpt_next_ = std::max(ckpt_last_, mc) / ckpt_every_ * ckpt_every_ + ckpt_every_;
  }
  if (mc < ckpt_next_) return;
  if (ckpt_pending_ == nullptr) {
    ckpt_pending_ = std::make_unique<ShardSnapshot>();
    ShardSnapshot& s = *ckpt_pending_;
    s.plan_fingerprint = plan_fingerprint_;
    s.group = group_;
    s.num_groups = num_groups_;
    s.clock = ckpt_next_;
    s.epoch = control_->epoch();
    s.optimizer = "lr=" + std::to_string(options_.optimizer.lr);
    s.chunks.resize(chunks_.size());
    ckpt_captured_.assign(chunks_.size(), false);
    ckpt_captured_count_ = 0;
  }
  if (ckpt_captured_[slot]) return;
  ChunkState& cs = ckpt_pending_->chunks[slot];
  cs.chunk_id = c.chunk_id;
  cs.version = c.version;
  cs.weights.assign(c.buf[c.published], c.buf[c.published] + c.elems);
  cs.optimizer_steps = c.optimizer->steps();
  cs.state1 = c.optimizer->state1();
  cs.state2 = c.optimizer->state2();
  ckpt_captured_[slot] = true;
  if (++ckpt_captured_count_ < chunks_.size()) return;
  for (const auto& [rank, w] : workers_) {
    WorkerProgress p;
    p.rank = rank;
    p.clock = w->clock;
    p.last_seq = w->last_seq;
    p.applied_clock = w->applied_clock;
    ckpt_pending_->workers.push_back(std::move(p));
  }
  VLOG(1) << "server rank " << rank_ << ": checkpoint of group " << group_ << " at clock "
          << ckpt_next_ << " captured";
  ckpt_last_ = ckpt_next_;
  ckpt_next_ = ckpt_every_ ? ckpt_next_ + ckpt_every_ : 0;
  ckpt_writer_->Submit(std::move(*ckpt_pending_));
  ckpt_pending_.reset();
  std::lock_guard<std::mutex> l(counters_mu_);
  ++counters_.checkpoints_submitted;
}

void ShardServer::RefreshMembership() {
  PollControl();
  const uint64_t e = control_->epoch();
  if (e == seen_epoch_) return;
  seen_epoch_ = e;
  const control::Membership m = control_->membership();
  std::set<uint32_t> now;
  bool backup_present = false;
  for (const auto& mem : m.members()) {
    if (mem.role() == control::ROLE_WORKER) now.insert(mem.rank());
    if (mem.member_id() == backup_member_) backup_present = true;
  }
  if (backup_state_ == BackupState::kFailed && !backup_present) {
    LOG(WARNING) << "server rank " << rank_ << ": backup member " << backup_member_
                 << " left the membership (epoch " << e << ")";
  }
  for (uint32_t r : member_workers_) {
    if (!now.count(r)) {
      departed_workers_.insert(r);
      LOG(WARNING) << "server rank " << rank_ << ": worker " << r << " left (epoch " << e
                   << "); BSP/SSP waits go on without it";
    }
  }
  for (uint32_t r : now) departed_workers_.erase(r);
  member_workers_ = now;
  most_workers_seen_ = std::max(most_workers_seen_, now.size());
  if (options_.exit_when_workers_done && now.empty() &&
      most_workers_seen_ >= std::max<size_t>(1, config_.num_workers())) {
    LOG(INFO) << "server rank " << rank_ << ": all " << most_workers_seen_
              << " workers have left (epoch " << e << "); stopping (--exit_when_done)";
    stop_ = true;
  }
  // A departure may complete BSP aggregations or raise SSP min clocks.
  Reevaluate();
}

void ShardServer::Reevaluate() {
  if (backup_) return;  // a backup follows its primary's records only
  for (uint32_t s = 0; s < chunks_.size(); ++s) {
    if (config_.mode() == control::BSP) {
      ApplyBsp(s);
    } else if (chunks_[s]->version > 0) {
      const uint64_t mc = SspMinClockPlus1(s);
      Chunk& c = *chunks_[s];
      if (mc > c.header->min_clock_plus1[c.published].load(std::memory_order_relaxed)) {
        c.header->min_clock_plus1[c.published].store(mc, std::memory_order_release);
      }
    }
  }
}

Status ShardServer::Serve() {
  Status fenced;
  Completion wc[64];
  auto last_accept = Clock::now() - std::chrono::seconds(1);
  while (!stop_.load()) {
    const int n = cq_->Wait(wc, 64, std::chrono::microseconds(2000));
    for (int i = 0; i < n; ++i) {
      if (wc[i].endpoint_id == kBackupEndpointId) {
        HandleBackupCompletion(wc[i]);
      } else if (wc[i].op == OpType::kRecvImm && wc[i].ok()) {
        HandleRecvImm(wc[i]);
      } else if (!wc[i].ok()) {
        std::lock_guard<std::mutex> l(counters_mu_);
        ++counters_.endpoint_errors;
      }
    }
    if (n == 0 || Clock::now() - last_accept > std::chrono::milliseconds(5)) {
      AcceptPending();
      RefreshMembership();
      last_accept = Clock::now();
      bool primary_member = false;  // the group's primary is still in the membership
      if (backup_ && repl_broken_since_ != Clock::time_point()) {
        const control::Membership now = control_->membership();
        for (const auto& m : now.members()) {
          primary_member =
              primary_member || (m.role() == control::ROLE_SERVER && m.rank() == group_);
        }
      }
      if (backup_ && repl_broken_since_ != Clock::time_point() && primary_member &&
          control_->connected() &&
          Clock::now() - repl_broken_since_ >
              std::chrono::milliseconds(2 *
                                        std::max<uint32_t>(1000, config_.heartbeat_timeout_ms()))) {
        // Not promoted: the primary is alive but this backup can no longer follow it. Leave,
        // so that the coordinator tells the primary to go on alone instead of stalling.
        LOG(ERROR) << "server rank " << rank_ << ": lost the replication stream of group " << group_
                   << "'s primary and was not promoted; leaving the cluster so the "
                   << "primary goes on without a backup";
        fenced = UnavailableError("backup of group " + std::to_string(group_) +
                                  " lost its primary's replication stream");
        stop_ = true;
      }
      {
        // Checkpoint writer statistics, for counters() (read by other threads).
        if (ckpt_writer_) {
          const CheckpointWriter::Stats st = ckpt_writer_->stats();
          std::lock_guard<std::mutex> l(counters_mu_);
          counters_.checkpoints_written = st.written;
          counters_.checkpoint_failures = st.failed;
        }
      }
      Status cs = control_->status();
      if (!cs.ok()) {
        // Refused back by the coordinator (declared dead: its group may have been failed over)
        // or unreachable for the whole rejoin window: this server must not serve on (fenced).
        LOG(ERROR) << "server rank " << rank_ << ": lost its membership: " << cs
                   << "; stopping (fenced)";
        stop_ = true;
        fenced = cs;
      }
    }
    if (backup_ep_ && backup_state_ == BackupState::kConnected && !backup_ep_->status().ok()) {
      BackupFailed(backup_ep_->status());
    }
    // Drop endpoints that failed (a dead worker); membership decides what it means.
    for (auto it = endpoints_.begin(); it != endpoints_.end();) {
      if (!it->second->status().ok()) {
        LOG(WARNING) << "server rank " << rank_ << ": endpoint " << it->first
                     << (it->first == primary_endpoint_ ? " (the primary's replication stream)"
                                                        : "")
                     << " failed: " << it->second->status();
        // endpoint_worker_ keeps its entry: immediates of this endpoint still queued in the CQ
        // are pushes that arrived and are applied like any other (ids are never reused).
        if (it->first == primary_endpoint_ && backup_ &&
            repl_broken_since_ == Clock::time_point()) {
          repl_broken_since_ = Clock::now();
        }
        it = endpoints_.erase(it);
        std::lock_guard<std::mutex> l(counters_mu_);
        ++counters_.endpoint_errors;
      } else {
        ++it;
      }
    }
  }
  LOG(INFO) << "server rank " << rank_ << ": stopping";
  if (control_) control_->Leave("server stopping").IgnoreError();
  // Tear the data path down now, as a process exit would: peers see their endpoints fail.
  backup_ep_.reset();
  endpoints_.clear();
  endpoint_worker_.clear();
  listener_.reset();
  cq_.reset();
  return fenced;
}

void ShardServer::AcceptPending() {
  const int recv_depth = static_cast<int>(std::min<uint32_t>(1024, 2 * layout_->slots() + 32));
  while (true) {
    transport::EndpointOptions eo;
    eo.endpoint_id = next_endpoint_id_;
    eo.send_depth = 16;
    // A backup's stream from its primary carries up to one record per ring entry.
    eo.recv_depth = std::max<int>(recv_depth, static_cast<int>(repl_layout_->entries()) + 16);
    auto ep = listener_->Accept(cq_.get(), eo, std::chrono::milliseconds(0));
    if (!ep.ok()) {
      if (ep.status().code() != StatusCode::kDeadlineExceeded) {
        LOG(WARNING) << "server rank " << rank_ << ": accept: " << ep.status();
      }
      return;
    }
    endpoints_[next_endpoint_id_++] = std::move(*ep);
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.endpoints_accepted;
  }
}

void ShardServer::HandleRecvImm(const Completion& c) {
  const uint32_t arg = layout::ImmArg(c.imm);
  const layout::ImmKind kind = layout::ImmKindOf(c.imm);
  if (kind == layout::ImmKind::kReplHello || kind == layout::ImmKind::kRepl) {
    if (!backup_) {
      // A primary that lost its group (fenced) still writing: refuse it.
      LOG_EVERY_N(WARNING, 100) << "server rank " << rank_
                                << ": replication traffic to a server that is not a backup "
                                   "(fenced); closing that endpoint";
      endpoints_.erase(c.endpoint_id);
      std::lock_guard<std::mutex> l(counters_mu_);
      ++counters_.records_rejected;
      return;
    }
    if (kind == layout::ImmKind::kReplHello) {
      if (arg != group_) {
        LOG(WARNING) << "server rank " << rank_ << ": replication hello for group " << arg
                     << ", but this server backs up group " << group_;
        endpoints_.erase(c.endpoint_id);
        return;
      }
      primary_endpoint_ = c.endpoint_id;
      LOG(INFO) << "server rank " << rank_ << ": primary of group " << group_
                << " connected its replication stream (endpoint " << c.endpoint_id << ")";
      return;
    }
    if (c.endpoint_id != primary_endpoint_) {
      std::lock_guard<std::mutex> l(counters_mu_);
      ++counters_.records_rejected;
      return;
    }
    ApplyRecord(arg);
    return;
  }
  if (backup_) {
    // A worker that reached the backup before its promotion: kept until then.
    if (early_.size() < 1u << 20) early_.push_back(c);
    return;
  }
  if (kind == layout::ImmKind::kHello) {
    HandleHello(c.endpoint_id, arg);
    return;
  }
  auto it = endpoint_worker_.find(c.endpoint_id);
  if (it == endpoint_worker_.end()) {
    LOG(WARNING) << "server rank " << rank_ << ": immediate from an endpoint that never said hello";
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.rejected_pushes;
    return;
  }
  const uint32_t worker = it->second;
  if (kind == layout::ImmKind::kInit) {
    HandleInit(worker, arg);
  } else if (kind == layout::ImmKind::kPush) {
    HandlePush(worker, arg >> 1, arg & 1, false);
  } else if (kind == layout::ImmKind::kClock) {
    HandleClock(worker, arg);
  } else {
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.rejected_pushes;
  }
}

void ShardServer::HandleHello(uint64_t endpoint_id, uint32_t rank) {
  if (rank >= layout_->max_workers()) {
    LOG(WARNING) << "server rank " << rank_ << ": hello from worker rank " << rank
                 << " beyond max_workers " << layout_->max_workers();
    return;
  }
  layout::Hello hello;
  std::memcpy(&hello, static_cast<const char*>(clocks_->data()) + layout_->clock_offset(rank),
              sizeof(hello));
  const uint64_t incarnation = hello.magic == layout::kHelloMagic ? hello.incarnation : 0;
  const bool known =
      workers_.count(rank) && workers_[rank]->incarnation == incarnation && incarnation != 0;
  WorkerState& w = Worker(rank, incarnation);
  if (incarnation == 0) {
    // An old client without an incarnation: every hello starts fresh sequence state.
    w.last_seq.assign(layout_->slots(), 0);
    w.applied_clock.assign(layout_->slots(), -1);
  }
  w.endpoint_id = endpoint_id;
  endpoint_worker_[endpoint_id] = rank;
  departed_workers_.erase(rank);
  LOG(INFO) << "server rank " << rank_ << ": worker " << rank << " connected (endpoint "
            << endpoint_id << ", incarnation " << incarnation
            << (known ? ", known: keeps its sequence numbers" : "") << ")";
}

void ShardServer::HandleInit(uint32_t worker, uint32_t slot) {
  if (slot >= chunks_.size() || worker != 0) return;
  Chunk& c = *chunks_[slot];
  if (c.version != 0 || c.inflight) return;  // already initialised: a duplicate
  const char* src =
      static_cast<const char*>(inbox_->data()) + layout_->push_data_offset(worker, slot, 0);
  c.header->gen[0].fetch_add(1, std::memory_order_acq_rel);
  std::memcpy(c.buf[0], src, c.bytes);
  Commit(slot, 0, 0, layout::ReplKind::kInit, weights_.get(), layout_->buffer_offset(slot, 0), 1.0f,
         1.0f, {});
}

bool ShardServer::HandlePush(uint32_t worker, uint32_t slot, uint32_t parity, bool from_queue) {
  auto reject = [&](const char* why) {
    LOG_EVERY_N(WARNING, 100) << "server rank " << rank_ << ": push from worker " << worker
                              << " slot " << slot << " rejected: " << why;
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.rejected_pushes;
    return true;
  };
  if (slot >= chunks_.size()) return reject("slot out of range");
  auto wit = workers_.find(worker);
  if (wit == workers_.end()) return reject("unknown worker");
  Chunk& c = *chunks_[slot];
  WorkerState& w = *wit->second;
  const char* base = static_cast<const char*>(inbox_->data());
  layout::PushHeader h;
  std::memcpy(&h, base + layout_->push_header_offset(worker, slot, parity), sizeof(h));
  if (h.magic != layout::kPushMagic) return reject("bad magic");
  if (h.chunk_id != c.chunk_id || h.bytes != c.bytes || h.worker != worker) {
    return reject("header does not match the slot");
  }
  if ((h.seq & 1) != parity) return reject("parity does not match seq");
  if (h.epoch < fence_epoch_) return reject("push from an epoch before this server's promotion");
  auto defer = [&] {
    if (from_queue) {
      c.deferred.emplace_front(worker, parity);
    } else {
      c.deferred.emplace_back(worker, parity);
    }
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.deferred_pushes;
    return false;
  };
  if (h.seq <= w.last_seq[slot]) {
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.duplicate_pushes;
    return true;  // applied already: exactly once
  }
  // ASP/SSP apply pushes in arrival order (FIFO behind deferred ones); BSP only needs clock
  // order (a clock's gradients are summed in worker-rank order whatever their arrival order).
  if (c.inflight || (config_.mode() != control::BSP && !from_queue && !c.deferred.empty())) {
    return defer();
  }
  if (c.version == 0) return reject("chunk not initialised yet");
  const uint64_t incarnation = w.incarnation;
  if (config_.mode() == control::BSP) {
    const int64_t clock = static_cast<int64_t>(h.clock);
    if (clock <= c.applied_through || (c.pending_clock >= 0 && clock < c.pending_clock)) {
      // Its clock was completed without it (it joined late, or was presumed gone): acknowledge
      // and drop it rather than mixing clocks.
      w.last_seq[slot] = h.seq;
      auto* ack = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(acks_->data()) +
                                                           layout_->ack_offset(worker, slot));
      if (ack->load(std::memory_order_relaxed) < h.seq)
        ack->store(h.seq, std::memory_order_release);
      LOG_EVERY_N(WARNING, 100) << "server rank " << rank_ << ": BSP push of clock " << clock
                                << " from worker " << worker << " for chunk " << c.chunk_id
                                << " arrived after that clock was applied; dropped";
      std::lock_guard<std::mutex> l(counters_mu_);
      ++counters_.stale_pushes;
      return true;
    }
    if (c.pending_clock >= 0 && clock > c.pending_clock) return defer();
    w.last_seq[slot] = h.seq;
    c.pending_clock = clock;
    c.contrib[worker] = Contributor{worker, parity, h.seq, incarnation, clock};
    w.applied_clock[slot] = std::max(w.applied_clock[slot], clock);
    {
      std::lock_guard<std::mutex> l(counters_mu_);
      ++counters_.pushes_applied;
    }
    ApplyBsp(slot);
    return true;
  }
  w.last_seq[slot] = h.seq;
  const size_t live = std::max<size_t>(1, LiveWorkers().size());
  const float scale = options_.average ? 1.0f / live : 1.0f;
  const uint64_t data_off = layout_->push_data_offset(worker, slot, parity);
  const float lr_scale =
      ApplyOne(slot, reinterpret_cast<const float*>(base + data_off), scale, h.base_version);
  w.applied_clock[slot] = std::max<int64_t>(w.applied_clock[slot], static_cast<int64_t>(h.clock));
  {
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.pushes_applied;
  }
  Commit(slot, 1 - c.published, SspMinClockPlus1(slot), layout::ReplKind::kApply, inbox_.get(),
         data_off, scale, lr_scale,
         {Contributor{worker, parity, h.seq, incarnation, static_cast<int64_t>(h.clock)}});
  return true;
}

void ShardServer::HandleClock(uint32_t worker, uint32_t clock_low) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  // The clock comes from the immediate, not from the slot: by the time this immediate is
  // polled the slot may already hold a later clock whose pushes are still queued behind it.
  // The immediate carries the low 28 bits; clocks move by one per Clock(), so the delta from
  // the clock we know is small and positive (a worker that (re)connects sends its whole clock,
  // which may be a large step from 0: still below 2^27).
  WorkerState& w = *it->second;
  const uint64_t delta = (clock_low - static_cast<uint32_t>(w.clock)) & 0x0fffffffu;
  if (delta == 0 || delta > (1u << 27)) return;  // repeated or stale
  w.clock += delta;
  Reevaluate();
}

void ShardServer::ApplyBsp(uint32_t slot) {
  Chunk& c = *chunks_[slot];
  if (c.pending_clock < 0 || c.inflight) return;
  const std::set<uint32_t> live = LiveWorkers();
  for (uint32_t r : live) {
    if (c.contrib.count(r)) continue;
    // A worker whose clock moved past the pending clock will not push this chunk for it —
    // unless its push of that clock is still queued here (deferred behind a replication).
    auto w = workers_.find(r);
    if (w != workers_.end() && w->second->clock > static_cast<uint64_t>(c.pending_clock) &&
        MinDeferredClock(slot, r) > c.pending_clock) {
      continue;
    }
    return;  // still waiting for a live worker
  }
  // Sum in worker-rank order (std::map), straight from the inbox slots.
  const char* base = static_cast<const char*>(inbox_->data());
  bool first = true;
  std::vector<Contributor> contributors;
  for (const auto& [r, k] : c.contrib) {
    const auto* g =
        reinterpret_cast<const float*>(base + layout_->push_data_offset(r, slot, k.parity));
    if (first) {
      std::memcpy(c.sum, g, c.bytes);
      first = false;
    } else {
      for (size_t i = 0; i < c.elems; ++i) c.sum[i] += g[i];
    }
    contributors.push_back(k);
  }
  const size_t n = std::max<size_t>(1, c.contrib.size());
  const float scale = options_.average ? 1.0f / n : 1.0f;
  const uint32_t target = 1 - c.published;
  c.header->gen[target].fetch_add(1, std::memory_order_acq_rel);
  c.optimizer->Apply(c.buf[c.published], c.sum, scale, 1.0f, c.buf[target]);
  const uint64_t clock = static_cast<uint64_t>(c.pending_clock);
  c.applied_through = c.pending_clock;
  c.pending_clock = -1;
  c.contrib.clear();
  Commit(slot, target, clock + 1, layout::ReplKind::kApply, repl_staging_.get(), c.sum_offset,
         scale, 1.0f, std::move(contributors));
}

float ShardServer::ApplyOne(uint32_t slot, const float* grad, float scale, uint64_t base_version) {
  Chunk& c = *chunks_[slot];
  float lr_scale = 1.0f;
  if (config_.mode() == control::VSGD && base_version < c.version) {
    const float* then = nullptr;
    for (const auto& [v, w] : c.history) {
      if (v == base_version) then = w.data();
    }
    if (then != nullptr) {
      lr_scale = VsgdScale(c.buf[c.published], then, c.elems, options_.vsgd_lambda);
    } else {
      // Older than the history: treat as maximally stale (relative drift 1).
      lr_scale = 1.0f / (1.0f + options_.vsgd_lambda);
    }
  }
  const uint32_t target = 1 - c.published;
  c.header->gen[target].fetch_add(1, std::memory_order_acq_rel);
  c.optimizer->Apply(c.buf[c.published], grad, scale, lr_scale, c.buf[target]);
  return lr_scale;
}

uint64_t ShardServer::SspMinClockPlus1(uint32_t slot) const {
  const std::set<uint32_t> live = LiveWorkers();
  const Chunk& c = *chunks_[slot];
  int64_t m = INT64_MAX;
  for (uint32_t r : live) {
    auto it = workers_.find(r);
    int64_t applied = -1;
    if (it != workers_.end()) {
      applied =
          std::max(it->second->applied_clock[slot], static_cast<int64_t>(it->second->clock) - 1);
      // A push of this worker still queued here is not applied, whatever its clock says.
      const int64_t d = MinDeferredClock(slot, r);
      if (d != INT64_MAX) applied = std::min(applied, d - 1);
      // Nor is one folded into a version that waits for its replication record: that version
      // is not published yet, and the published one (whose min clock this is while a version
      // is in flight) lacks it.
      if (c.inflight) {
        for (const Contributor& k : c.inflight_acks) {
          if (k.worker == r) applied = std::min(applied, k.clock - 1);
        }
      }
    }
    m = std::min(m, applied);
  }
  if (m == INT64_MAX) return 0;
  return static_cast<uint64_t>(m + 1);
}

void ShardServer::Commit(uint32_t slot, uint32_t target, uint64_t min_clock_plus1,
                         layout::ReplKind kind, const transport::MemoryRegion* payload,
                         uint64_t payload_offset, float scale, float lr_scale,
                         std::vector<Contributor> contributors) {
  Chunk& c = *chunks_[slot];
  c.inflight = true;
  c.inflight_target = target;
  c.inflight_min_clock_plus1 = min_clock_plus1;
  c.inflight_acks = std::move(contributors);
  c.record_kind = kind;
  c.record_payload = payload;
  c.record_payload_offset = payload_offset;
  c.record_scale = scale;
  c.record_lr_scale = lr_scale;
  switch (backup_state_) {
    case BackupState::kConnected:
      ring_wait_.push_back(slot);
      PostWaitingRecords();
      return;
    case BackupState::kFailed:
      // Published once the coordinator has decided the backup's fate (PollControl).
      return;
    case BackupState::kNone:
    case BackupState::kGone:
      FinishCommit(slot);
      return;
  }
}

void ShardServer::PostWaitingRecords() {
  while (!ring_wait_.empty() && backup_state_ == BackupState::kConnected) {
    if (next_record_seq_ - 1 - known_consumed_ >= repl_layout_->entries()) {
      // The ring is full of records the backup has not applied yet: ask how far it got.
      if (!consumed_read_outstanding_) {
        Status s = backup_ep_->PostRead({repl_staging_.get(), consumed_staging_offset_, 8},
                                        transport::AtOffset(backup_consumed_, 0),
                                        ReplContext(kOpConsumed, 0));
        if (!s.ok()) {
          BackupFailed(s);
          return;
        }
        consumed_read_outstanding_ = true;
        std::lock_guard<std::mutex> l(counters_mu_);
        ++counters_.replication_stalls;
      }
      return;
    }
    const uint32_t slot = ring_wait_.front();
    ring_wait_.pop_front();
    PostRecord(slot);
  }
}

void ShardServer::PostRecord(uint32_t slot) {
  Chunk& c = *chunks_[slot];
  const uint64_t seq = next_record_seq_++;
  const uint32_t entry = static_cast<uint32_t>((seq - 1) % repl_layout_->entries());
  char* hdr_base = static_cast<char*>(repl_staging_->data()) + repl_slot_stride_ * slot;
  auto* h = reinterpret_cast<layout::ReplHeader*>(hdr_base);
  std::memset(h, 0, sizeof(*h));
  h->seq = seq;
  h->kind = static_cast<uint32_t>(c.record_kind);
  h->slot = slot;
  h->version = c.version + 1;
  h->min_clock_plus1 = c.inflight_min_clock_plus1;
  h->scale = c.record_scale;
  h->lr_scale = c.record_lr_scale;
  h->contributors = static_cast<uint32_t>(c.inflight_acks.size());
  h->bytes = c.bytes;
  h->epoch = control_->epoch();
  h->magic = layout::kReplMagic;
  auto* k = reinterpret_cast<layout::ReplContributor*>(hdr_base + sizeof(layout::ReplHeader));
  for (size_t i = 0; i < c.inflight_acks.size(); ++i) {
    const Contributor& a = c.inflight_acks[i];
    k[i] = layout::ReplContributor{a.worker, 0, a.incarnation, a.seq, a.clock};
  }
  // Payload first (unsignaled), then header + contributors with the immediate: writes on one
  // endpoint are placed in order, so the backup sees the record whole when the immediate lands.
  Status s =
      backup_ep_->PostWrite({c.record_payload, c.record_payload_offset, c.bytes},
                            transport::AtOffset(backup_ring_, repl_layout_->payload_offset(entry)),
                            ReplContext(kOpPayload, slot), transport::kUnsignaled);
  if (s.ok()) {
    s = backup_ep_->PostWriteImm(
        {repl_staging_.get(), repl_slot_stride_ * slot,
         sizeof(layout::ReplHeader) + sizeof(layout::ReplContributor) * c.inflight_acks.size()},
        transport::AtOffset(backup_ring_, repl_layout_->entry_offset(entry)),
        layout::MakeImm(layout::ImmKind::kRepl, entry), ReplContext(kOpRecord, slot));
  }
  if (!s.ok()) {
    BackupFailed(s);
    return;
  }
  std::lock_guard<std::mutex> l(counters_mu_);
  ++counters_.records_sent;
}

void ShardServer::HandleBackupCompletion(const Completion& wc) {
  if (!wc.ok()) {
    BackupFailed(UnavailableError(std::string("replication write failed: ") +
                                  transport::WcStatusName(wc.status)));
    return;
  }
  switch (ReplOpOf(wc.context)) {
    case kOpRecord: {
      const uint32_t slot = ReplSlotOf(wc.context);
      if (slot < chunks_.size() && chunks_[slot]->inflight &&
          backup_state_ == BackupState::kConnected) {
        FinishCommit(slot);
      }
      return;
    }
    case kOpConsumed: {
      consumed_read_outstanding_ = false;
      uint64_t v = 0;
      std::memcpy(&v, static_cast<char*>(repl_staging_->data()) + consumed_staging_offset_, 8);
      known_consumed_ = std::max(known_consumed_, v);
      PostWaitingRecords();
      return;
    }
    default:
      return;
  }
}

void ShardServer::BackupFailed(const Status& why) {
  if (backup_state_ != BackupState::kConnected) return;
  backup_state_ = BackupState::kFailed;
  LOG(WARNING) << "server rank " << rank_ << ": replication to the backup of group " << group_
               << " failed: " << why
               << "; new versions wait until the coordinator declares the backup gone";
}

void ShardServer::FinishCommit(uint32_t slot) {
  Chunk& c = *chunks_[slot];
  if (!c.inflight) return;
  c.inflight = false;
  uint64_t min_clock_plus1 = c.inflight_min_clock_plus1;
  if (config_.mode() != control::BSP && c.version > 0) {
    // Clocks that arrived while the version waited for its record may raise its min clock: with
    // nothing in flight any more, every processed, undeferred push is in this version.
    min_clock_plus1 = std::max(min_clock_plus1, SspMinClockPlus1(slot));
  }
  Publish(slot, c.inflight_target, min_clock_plus1);
  // The pushes folded into this version are acknowledged only now: their inbox slots (and, for
  // a failover, the workers' own buffers) may be reused once the version is replicated.
  for (const Contributor& a : c.inflight_acks) {
    auto w = workers_.find(a.worker);
    if (w == workers_.end() || w->second->incarnation != a.incarnation) continue;
    auto* ack = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(acks_->data()) +
                                                         layout_->ack_offset(a.worker, slot));
    if (ack->load(std::memory_order_relaxed) < a.seq) ack->store(a.seq, std::memory_order_release);
  }
  c.inflight_acks.clear();
  MaybeCapture(slot);
  DrainDeferred(slot);
  if (config_.mode() == control::BSP) ApplyBsp(slot);
}

void ShardServer::DrainDeferred(uint32_t slot) {
  Chunk& c = *chunks_[slot];
  while (!c.inflight && !c.deferred.empty()) {
    // BSP: the lowest clock first (a later clock's push must not hold back an earlier one's);
    // ASP/SSP: arrival order.
    size_t pick = 0;
    if (config_.mode() == control::BSP) {
      int64_t best = INT64_MAX;
      for (size_t i = 0; i < c.deferred.size(); ++i) {
        const int64_t k = DeferredClock(slot, c.deferred[i].first, c.deferred[i].second);
        if (k < best) {
          best = k;
          pick = i;
        }
      }
    }
    const auto [worker, parity] = c.deferred[pick];
    c.deferred.erase(c.deferred.begin() + static_cast<std::ptrdiff_t>(pick));
    if (!HandlePush(worker, slot, parity, true)) break;  // it waits again, at the front
  }
}

int64_t ShardServer::DeferredClock(uint32_t slot, uint32_t worker, uint32_t parity) const {
  layout::PushHeader h;
  std::memcpy(
      &h,
      static_cast<const char*>(inbox_->data()) + layout_->push_header_offset(worker, slot, parity),
      sizeof(h));
  return static_cast<int64_t>(h.clock);
}

int64_t ShardServer::MinDeferredClock(uint32_t slot, uint32_t worker) const {
  int64_t m = INT64_MAX;
  for (const auto& [w, p] : chunks_[slot]->deferred) {
    if (w == worker) m = std::min(m, DeferredClock(slot, w, p));
  }
  return m;
}

void ShardServer::ApplyRecord(uint32_t entry) {
  auto reject = [&](const std::string& why) {
    LOG(ERROR) << "server rank " << rank_ << ": replication record in entry " << entry
               << " refused: " << why << " (this backup can no longer follow its primary)";
    if (repl_broken_since_ == Clock::time_point()) repl_broken_since_ = Clock::now();
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.records_rejected;
  };
  if (entry >= repl_layout_->entries()) return reject("entry out of range");
  const char* base = static_cast<const char*>(ring_->data()) + repl_layout_->entry_offset(entry);
  layout::ReplHeader h;
  std::memcpy(&h, base, sizeof(h));
  if (h.magic != layout::kReplMagic) return reject("bad magic");
  if (h.seq != expected_record_) {
    return reject("sequence " + std::to_string(h.seq) + ", expected " +
                  std::to_string(expected_record_));
  }
  if (h.epoch < fence_epoch_) return reject("from an epoch before the fence");
  if (h.slot >= chunks_.size()) return reject("slot out of range");
  Chunk& c = *chunks_[h.slot];
  if (h.bytes != c.bytes || h.contributors > layout_->max_workers()) {
    return reject("size fields do not match the slot");
  }
  if (h.version != c.version + 1) {
    return reject("version " + std::to_string(h.version) + " does not follow " +
                  std::to_string(c.version));
  }
  const auto* payload = reinterpret_cast<const float*>(static_cast<const char*>(ring_->data()) +
                                                       repl_layout_->payload_offset(entry));
  uint32_t target;
  if (h.kind == static_cast<uint32_t>(layout::ReplKind::kInit)) {
    if (c.version != 0) return reject("init of an initialised chunk");
    target = 0;
    c.header->gen[0].fetch_add(1, std::memory_order_acq_rel);
    std::memcpy(c.buf[0], payload, c.bytes);
  } else if (h.kind == static_cast<uint32_t>(layout::ReplKind::kApply)) {
    if (c.version == 0) return reject("update of an uninitialised chunk");
    target = 1 - c.published;
    c.header->gen[target].fetch_add(1, std::memory_order_acq_rel);
    c.optimizer->Apply(c.buf[c.published], payload, h.scale, h.lr_scale, c.buf[target]);
  } else {
    return reject("unknown kind");
  }
  const auto* k =
      reinterpret_cast<const layout::ReplContributor*>(base + sizeof(layout::ReplHeader));
  for (uint32_t i = 0; i < h.contributors; ++i) {
    if (k[i].worker >= layout_->max_workers()) continue;
    // Member ids only grow: a record folding in a push of an older incarnation of this worker
    // (it restarted meanwhile) must not reset the newer incarnation's exactly-once state.
    auto known = workers_.find(k[i].worker);
    if (known != workers_.end() && k[i].incarnation < known->second->incarnation) continue;
    WorkerState& w = Worker(k[i].worker, k[i].incarnation);
    w.last_seq[h.slot] = std::max(w.last_seq[h.slot], k[i].seq);
    w.applied_clock[h.slot] = std::max(w.applied_clock[h.slot], k[i].clock);
    auto* ack = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(acks_->data()) +
                                                         layout_->ack_offset(k[i].worker, h.slot));
    if (ack->load(std::memory_order_relaxed) < k[i].seq) {
      ack->store(k[i].seq, std::memory_order_release);
    }
    if (config_.mode() == control::BSP) c.applied_through = std::max(c.applied_through, k[i].clock);
  }
  Publish(h.slot, target, h.min_clock_plus1);
  ++expected_record_;
  reinterpret_cast<std::atomic<uint64_t>*>(consumed_->data())
      ->store(h.seq, std::memory_order_release);
  std::lock_guard<std::mutex> l(counters_mu_);
  ++counters_.records_applied;
}

void ShardServer::Promote(const control::Promote& p) {
  if (!backup_ || p.group() != group_) {
    LOG(WARNING) << "server rank " << rank_ << ": promotion for group " << p.group()
                 << " ignored (this server is " << (backup_ ? "the backup" : "the primary")
                 << " of group " << group_ << ")";
    return;
  }
  const auto t0 = Clock::now();
  // Every record the old primary saw complete is in this CQ: apply them all first. Wait (boundedly)
  // for its stream to fail so that nothing is still in flight inside the transport; a primary
  // that is only partitioned is cut off instead (its later writes fail: fenced).
  const auto deadline = t0 + std::chrono::milliseconds(2000);
  Completion wc[64];
  while (true) {
    const int n = cq_->Wait(wc, 64, std::chrono::microseconds(1000));
    for (int i = 0; i < n; ++i) {
      if (wc[i].op == OpType::kRecvImm && wc[i].ok()) HandleRecvImm(wc[i]);
    }
    auto it = endpoints_.find(primary_endpoint_);
    const bool primary_gone = it == endpoints_.end() || !it->second->status().ok();
    if (n == 0 && (primary_gone || Clock::now() > deadline)) break;
  }
  // Cut the old primary off first (a partitioned one's later writes fail, so it never sees
  // them complete and never publishes them), then apply what it completed before the cut.
  endpoints_.erase(primary_endpoint_);
  for (int empty = 0; empty < 3;) {
    const int n = cq_->Wait(wc, 64, std::chrono::microseconds(1000));
    empty = n == 0 ? empty + 1 : 0;
    for (int i = 0; i < n; ++i) {
      if (wc[i].op == OpType::kRecvImm && wc[i].ok()) HandleRecvImm(wc[i]);
    }
  }
  primary_endpoint_ = 0;
  backup_ = false;
  fence_epoch_ = p.epoch();
  for (auto& c : chunks_) {
    c->header->serving_epoch.store(std::max<uint64_t>(1, p.epoch()), std::memory_order_release);
  }
  backup_state_ = BackupState::kGone;
  {
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.promotions;
    counters_.backup = false;
  }
  LOG(WARNING) << "server rank " << rank_ << ": PROMOTED to primary of group " << group_
               << " at epoch " << p.epoch() << " after " << expected_record_ - 1
               << " replicated records (drained in "
               << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()
               << " ms); the group has no backup now";
  std::vector<Completion> early;
  early.swap(early_);
  for (const Completion& c : early) HandleRecvImm(c);
  Reevaluate();
}

void ShardServer::Publish(uint32_t slot, uint32_t target, uint64_t min_clock_plus1) {
  Chunk& c = *chunks_[slot];
  const uint64_t v = c.version + 1;
  c.header->version[target].store(v, std::memory_order_relaxed);
  c.header->min_clock_plus1[target].store(min_clock_plus1, std::memory_order_relaxed);
  c.header->state.store((v << 1) | target, std::memory_order_release);
  c.version = v;
  c.published = target;
  if (config_.mode() == control::VSGD && options_.vsgd_history > 0) {
    c.history.emplace_back(v, std::vector<float>(c.buf[target], c.buf[target] + c.elems));
    while (c.history.size() > static_cast<size_t>(options_.vsgd_history)) c.history.pop_front();
  }
  std::lock_guard<std::mutex> l(counters_mu_);
  ++counters_.versions_published;
}

}  // namespace shardps::server
