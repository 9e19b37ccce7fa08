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
  // BSP aggregation of one clock at a time.
  std::vector<float> sum;
  int64_t pending_clock = -1;
  std::set<uint32_t> contributors;
  uint64_t max_base_version = 0;
  // VSGD history: version -> weights (the last vsgd_history versions).
  std::deque<std::pair<uint64_t, std::vector<float>>> history;
};

struct ShardServer::WorkerState {
  std::vector<uint64_t> last_seq;       // per slot
  std::vector<int64_t> applied_clock;   // per slot, -1 = none
  // From the worker's clock slot: it finished clocks < clock, and every push of those was
  // posted before its kClock immediate, hence already processed (same endpoint, in order).
  uint64_t clock = 0;
  uint64_t endpoint_id = 0;
};

ShardServer::ShardServer(const ShardServerOptions& options) : options_(options) {}
ShardServer::~ShardServer() = default;

ShardServerCounters ShardServer::counters() const {
  std::lock_guard<std::mutex> l(counters_mu_);
  return counters_;
}

Status ShardServer::Run() {
  RETURN_IF_ERROR(Setup());
  return Serve();
}

Status ShardServer::Setup() {
  ASSIGN_OR_RETURN(fabric_, transport::Fabric::Open(options_.fabric));
  std::string listen = options_.data_listen;
  if (listen.empty() && fabric_->name() != "shm") {
    listen = (options_.fabric.bind_ip.empty() ? std::string("0.0.0.0") : options_.fabric.bind_ip) +
             ":0";
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
  ASSIGN_OR_RETURN(control_, control::ControlClient::Join(co));
  rank_ = control_->reply().rank();
  config_ = control_->reply().config();
  LOG(INFO) << "server rank " << rank_ << ": joined as member " << control_->member_id()
            << ", data path " << fabric_->name() << " at " << data_address << ", mode "
            << control::ConsistencyMode_Name(config_.mode()) << " s=" << config_.staleness();

  ASSIGN_OR_RETURN(control::Envelope assign,
                   control_->WaitMessage(control::Envelope::kAssignShards,
                                         options_.setup_timeout));
  const control::AssignShards& a = assign.assign_shards();
  if (a.chunk_ids_size() != a.chunk_bytes_size() || a.max_workers() == 0 ||
      a.max_workers() > 4096) {
    return InvalidArgumentError("malformed shard assignment from the coordinator");
  }
  std::vector<uint64_t> bytes(a.chunk_bytes().begin(), a.chunk_bytes().end());
  for (uint64_t b : bytes) {
    if (b == 0 || b % sizeof(float) != 0) return InvalidArgumentError("bad chunk size");
  }
  layout_ = std::make_unique<layout::ServerLayout>(bytes, a.max_workers());
  // A server may own no chunk (a model smaller than one partition per server): its regions
  // are then empty, but a region of 0 bytes cannot be allocated, so each has at least kAlign.
  auto at_least = [](uint64_t n) { return std::max<uint64_t>(n, layout::kAlign); };
  ASSIGN_OR_RETURN(weights_, fabric_->AllocateMemory(at_least(layout_->weights_bytes()),
                                                     Access::kRemoteRead));
  ASSIGN_OR_RETURN(inbox_, fabric_->AllocateMemory(at_least(layout_->inbox_bytes()),
                                                   Access::kRemoteWrite));
  ASSIGN_OR_RETURN(acks_, fabric_->AllocateMemory(at_least(layout_->acks_bytes()),
                                                  Access::kRemoteRead));
  ASSIGN_OR_RETURN(clocks_, fabric_->AllocateMemory(at_least(layout_->clocks_bytes()),
                                                    Access::kRemoteWrite));
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
    c->optimizer = std::make_unique<ChunkOptimizer>(options_.optimizer, c->elems);
    chunks_.push_back(std::move(c));
  }
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  LOG(INFO) << "server rank " << rank_ << ": " << layout_->slots() << " chunks, "
            << total / 1024 << " KiB of weights; registered weights "
            << layout_->weights_bytes() / 1024 << " KiB (remote-read), inbox "
            << layout_->inbox_bytes() / 1024 << " KiB for " << a.max_workers()
            << " workers (remote-write), acks " << layout_->acks_bytes() << " B";

  const int recv_depth = static_cast<int>(std::min<uint32_t>(1024, 2 * layout_->slots() + 32));
  ASSIGN_OR_RETURN(cq_, fabric_->CreateCompletionQueue(
                            static_cast<int>(a.max_workers() + 2) * (recv_depth + 16)));

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
  return control_->Send(ready);
}

std::set<uint32_t> ShardServer::LiveWorkers() const {
  std::set<uint32_t> live = member_workers_;
  for (const auto& [rank, w] : workers_) {
    if (!departed_workers_.count(rank)) live.insert(rank);
  }
  return live;
}

void ShardServer::RefreshMembership() {
  const uint64_t e = control_->epoch();
  if (e == seen_epoch_) return;
  seen_epoch_ = e;
  const control::Membership m = control_->membership();
  std::set<uint32_t> now;
  for (const auto& mem : m.members()) {
    if (mem.role() == control::ROLE_WORKER) now.insert(mem.rank());
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
  Completion wc[64];
  auto last_accept = Clock::now() - std::chrono::seconds(1);
  while (!stop_.load()) {
    const int n = cq_->Wait(wc, 64, std::chrono::microseconds(2000));
    for (int i = 0; i < n; ++i) {
      if (wc[i].op == OpType::kRecvImm && wc[i].ok()) {
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
    }
    // Drop endpoints that failed (a dead worker); membership decides what it means.
    for (auto it = endpoints_.begin(); it != endpoints_.end();) {
      if (!it->second->status().ok()) {
        LOG(WARNING) << "server rank " << rank_ << ": endpoint " << it->first
                     << " failed: " << it->second->status();
        endpoint_worker_.erase(it->first);
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
  endpoints_.clear();
  endpoint_worker_.clear();
  listener_.reset();
  cq_.reset();
  return Status::OK();
}

void ShardServer::AcceptPending() {
  const int recv_depth = static_cast<int>(std::min<uint32_t>(1024, 2 * layout_->slots() + 32));
  while (true) {
    transport::EndpointOptions eo;
    eo.endpoint_id = next_endpoint_id_;
    eo.send_depth = 16;
    eo.recv_depth = recv_depth;
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
  switch (layout::ImmKindOf(c.imm)) {
    case layout::ImmKind::kHello:
      HandleHello(c.endpoint_id, arg);
      return;
    default:
      break;
  }
  auto it = endpoint_worker_.find(c.endpoint_id);
  if (it == endpoint_worker_.end()) {
    LOG(WARNING) << "server rank " << rank_ << ": immediate from an endpoint that never said hello";
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.rejected_pushes;
    return;
  }
  const uint32_t worker = it->second;
  if (layout::ImmKindOf(c.imm) == layout::ImmKind::kInit) {
    HandleInit(worker, arg);
  } else if (layout::ImmKindOf(c.imm) == layout::ImmKind::kPush) {
    HandlePush(worker, arg >> 1, arg & 1);
  } else if (layout::ImmKindOf(c.imm) == layout::ImmKind::kClock) {
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
  auto& w = workers_[rank];
  if (!w || w->endpoint_id != 0) {
    // New worker, or a worker that reconnected: fresh sequence state.
    w = std::make_unique<WorkerState>();
    w->last_seq.assign(layout_->slots(), 0);
    w->applied_clock.assign(layout_->slots(), -1);
  }
  w->endpoint_id = endpoint_id;
  endpoint_worker_[endpoint_id] = rank;
  departed_workers_.erase(rank);
  LOG(INFO) << "server rank " << rank_ << ": worker " << rank << " connected (endpoint "
            << endpoint_id << ")";
}

void ShardServer::HandleInit(uint32_t worker, uint32_t slot) {
  if (slot >= chunks_.size() || worker != 0) return;
  Chunk& c = *chunks_[slot];
  if (c.version != 0) return;  // already initialised: a later init is a duplicate
  const char* src = static_cast<const char*>(inbox_->data()) +
                    layout_->push_data_offset(worker, slot, 0);
  c.header->gen[0].fetch_add(1, std::memory_order_acq_rel);
  std::memcpy(c.buf[0], src, c.bytes);
  Publish(slot, 0, 0);
}

void ShardServer::HandlePush(uint32_t worker, uint32_t slot, uint32_t parity) {
  auto reject = [&](const char* why) {
    LOG_EVERY_N(WARNING, 100) << "server rank " << rank_ << ": push from worker " << worker
                              << " slot " << slot << " rejected: " << why;
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.rejected_pushes;
  };
  if (slot >= chunks_.size()) return reject("slot out of range");
  Chunk& c = *chunks_[slot];
  WorkerState& w = *workers_[worker];
  const char* base = static_cast<const char*>(inbox_->data());
  layout::PushHeader h;
  std::memcpy(&h, base + layout_->push_header_offset(worker, slot, parity), sizeof(h));
  if (h.magic != layout::kPushMagic) return reject("bad magic");
  if (h.chunk_id != c.chunk_id || h.bytes != c.bytes || h.worker != worker) {
    return reject("header does not match the slot");
  }
  if ((h.seq & 1) != parity) return reject("parity does not match seq");
  auto* ack = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(acks_->data()) +
                                                       layout_->ack_offset(worker, slot));
  if (h.seq <= w.last_seq[slot]) {
    std::lock_guard<std::mutex> l(counters_mu_);
    ++counters_.duplicate_pushes;
    return;  // applied already: exactly once
  }
  if (c.version == 0) return reject("chunk not initialised yet");
  w.last_seq[slot] = h.seq;
  const auto* grad = reinterpret_cast<const float*>(base +
                                                    layout_->push_data_offset(worker, slot, parity));
  if (config_.mode() == control::BSP) {
    if (c.pending_clock < 0) {
      c.pending_clock = static_cast<int64_t>(h.clock);
      c.sum.assign(grad, grad + c.elems);
      c.contributors.clear();
    } else if (static_cast<int64_t>(h.clock) == c.pending_clock) {
      for (size_t i = 0; i < c.elems; ++i) c.sum[i] += grad[i];
    } else {
      // Cannot happen with conforming workers: a worker pushes clock t+1 only after pulling
      // the version that applied clock t.
      LOG(ERROR) << "server rank " << rank_ << ": BSP push of clock " << h.clock
                 << " while clock " << c.pending_clock << " is pending (worker " << worker
                 << ")";
      ack->store(h.seq, std::memory_order_release);
      return reject("clock out of step");
    }
    c.contributors.insert(worker);
    c.max_base_version = std::max(c.max_base_version, h.base_version);
    ack->store(h.seq, std::memory_order_release);  // the inbox slot may be reused
    w.applied_clock[slot] = static_cast<int64_t>(h.clock);
    ApplyBsp(slot);
  } else {
    const size_t live = std::max<size_t>(1, LiveWorkers().size());
    ApplyOne(slot, grad, options_.average ? 1.0f / live : 1.0f, h.base_version);
    ack->store(h.seq, std::memory_order_release);
    w.applied_clock[slot] = std::max<int64_t>(w.applied_clock[slot], static_cast<int64_t>(h.clock));
    Publish(slot, 1 - c.published, SspMinClockPlus1(slot));
  }
  std::lock_guard<std::mutex> l(counters_mu_);
  ++counters_.pushes_applied;
}

void ShardServer::HandleClock(uint32_t worker, uint32_t clock_low) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  // The clock comes from the immediate, not from the slot: by the time this immediate is
  // polled the slot may already hold a later clock whose pushes are still queued behind it.
  // The immediate carries the low 28 bits; clocks move by one per Clock(), so the delta from
  // the clock we know is small and positive.
  WorkerState& w = *it->second;
  const uint64_t delta = (clock_low - static_cast<uint32_t>(w.clock)) & 0x0fffffffu;
  if (delta == 0 || delta > (1u << 27)) return;  // repeated or stale
  w.clock += delta;
  Reevaluate();
}

void ShardServer::ApplyBsp(uint32_t slot) {
  Chunk& c = *chunks_[slot];
  if (c.pending_clock < 0) return;
  const std::set<uint32_t> live = LiveWorkers();
  for (uint32_t r : live) {
    if (c.contributors.count(r)) continue;
    // A worker whose clock moved past the pending clock will not push this chunk for it.
    auto w = workers_.find(r);
    if (w != workers_.end() && w->second->clock > static_cast<uint64_t>(c.pending_clock)) continue;
    return;  // still waiting for a live worker
  }
  const size_t n = std::max<size_t>(1, c.contributors.size());
  const uint32_t target = 1 - c.published;
  c.header->gen[target].fetch_add(1, std::memory_order_acq_rel);
  c.optimizer->Apply(c.buf[c.published], c.sum.data(), options_.average ? 1.0f / n : 1.0f, 1.0f,
                     c.buf[target]);
  const uint64_t clock = static_cast<uint64_t>(c.pending_clock);
  c.pending_clock = -1;
  c.contributors.clear();
  Publish(slot, target, clock + 1);
}

void ShardServer::ApplyOne(uint32_t slot, const float* grad, float scale, uint64_t base_version) {
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
}

uint64_t ShardServer::SspMinClockPlus1(uint32_t slot) const {
  const std::set<uint32_t> live = LiveWorkers();
  int64_t m = INT64_MAX;
  for (uint32_t r : live) {
    auto it = workers_.find(r);
    int64_t applied = -1;
    if (it != workers_.end()) {
      applied = std::max(it->second->applied_clock[slot],
                         static_cast<int64_t>(it->second->clock) - 1);
    }
    m = std::min(m, applied);
  }
  if (m == INT64_MAX) return 0;
  return static_cast<uint64_t>(m + 1);
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
