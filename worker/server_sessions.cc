#include "worker/server_sessions.h"

#include "proto/credentials.h"

#include <algorithm>
#include <cstring>

#include <glog/logging.h>

namespace shardps::worker {

using transport::Completion;
using SteadyClock = std::chrono::steady_clock;

Status ServerSessions::Configure(const control::ShardMap& map,
                                 const std::vector<ChunkPlacement>& chunks) {
  servers_.resize(map.servers_size());
  map_epoch_ = map.epoch();
  for (const auto& se : map.servers()) {
    if (se.rank() >= servers_.size()) return InvalidArgumentError("shard map: bad server rank");
    RETURN_IF_ERROR(ApplyEntry(se, se.rank()));
  }
  num_chunks_ = chunks.size();
  std::vector<std::vector<uint64_t>> slot_bytes(servers_.size());
  std::vector<std::vector<layout::RowGeometry>> slot_rows(servers_.size());
  for (const ChunkPlacement& c : chunks) {
    auto& sb = slot_bytes[c.server];
    if (sb.size() <= c.slot) sb.resize(c.slot + 1);
    sb[c.slot] = c.bytes;
    auto& sr = slot_rows[c.server];
    if (sr.size() <= c.slot) sr.resize(c.slot + 1);
    sr[c.slot] = c.rows;
    auto& cos = servers_[c.server].chunk_of_slot;
    if (cos.size() <= c.slot) cos.resize(c.slot + 1);
    cos[c.slot] = c.id;
  }
  for (size_t s = 0; s < servers_.size(); ++s) {
    servers_[s].layout =
        std::make_unique<layout::ServerLayout>(slot_bytes[s], map.max_workers(), slot_rows[s]);
    if (servers_[s].inbox.length < servers_[s].layout->inbox_bytes() ||
        servers_[s].weights.length < servers_[s].layout->weights_bytes() ||
        servers_[s].clocks.length < servers_[s].layout->clocks_bytes()) {
      return FailedPreconditionError("server " + std::to_string(s) +
                                     "'s regions are smaller than its layout");
    }
  }
  return Status::OK();
}

StatusOr<uint64_t> ServerSessions::AllocateStaging(uint64_t extra_bytes) {
  // Per chunk 2 push headers + 2 header reads; the hello; per server an acks buffer; per
  // server a clock value; then the caller's bytes.
  acks_staging_offset_ = layout::AlignUp(num_chunks_ * kStagingPerChunk + layout::kAlign);
  uint64_t bytes = acks_staging_offset_;
  for (const auto& s : servers_) bytes += layout::AlignUp(s.layout->acks_of_worker_bytes());
  acks_area_bytes_ = bytes - acks_staging_offset_;
  bytes += acks_area_bytes_;  // the acks-ahead reads' copies (PostAcksAhead)
  clock_staging_offset_ = bytes;
  bytes += layout::kAlign * servers_.size();
  const uint64_t extra = bytes;
  ASSIGN_OR_RETURN(staging_,
                   fabric_.AllocateMemory(bytes + extra_bytes, transport::Access::kLocalOnly));
  return extra;
}

Status ServerSessions::ConnectAll(uint64_t clock) {
  // All endpoints on one CQ owned by this thread. Room for the completions of endpoints
  // replaced by failovers, whose flushed operations may still arrive.
  ASSIGN_OR_RETURN(cq_, fabric_.CreateCompletionQueue(
                            2 * static_cast<int>(servers_.size()) * (kSendDepth + 8) + 64));
  for (uint32_t s = 0; s < servers_.size(); ++s) {
    const Status st = Connect(s, clock);
    if (st.ok()) continue;
    // A server that died since the shard map was published (its group fails over): the
    // caller recovers that session like any failed one. Anything else is this worker's error.
    const bool transport_error = st.code() == StatusCode::kUnavailable ||
                                 st.code() == StatusCode::kDeadlineExceeded ||
                                 st.code() == StatusCode::kPermissionDenied;
    if (!transport_error) return st;
    LOG(WARNING) << "worker rank " << rank_ << ": " << st << "; waiting for its group's failover";
    servers_[s].failed = true;
  }
  return Status::OK();
}

Status ServerSessions::ApplyEntry(const control::ServerEntry& se, uint32_t server) {
  ServerSession& s = servers_[server];
  if (se.lost()) {
    return DataLossError("server group " + std::to_string(se.rank()) +
                         " is lost: its primary (server rank " + std::to_string(se.server_rank()) +
                         ") died and no backup was left (replicas=1, or the backup had died "
                         "first); restart the cluster from the latest checkpoint");
  }
  s.rank = se.rank();
  s.member_id = se.member_id();
  s.server_rank = se.server_rank();
  s.address = se.data_address();
  s.peer_key = se.peer_key();
  for (const auto& r : se.regions()) {
    ASSIGN_OR_RETURN(transport::RegionDescriptor d,
                     transport::RegionDescriptor::Decode(r.encoded_descriptor()));
    if (r.name() == "weights") s.weights = d;
    if (r.name() == "inbox") s.inbox = d;
    if (r.name() == "acks") s.acks = d;
    if (r.name() == "clocks") s.clocks = d;
    if (r.name() == "outbox") s.outbox = d;
  }
  if (s.layout != nullptr &&
      (s.inbox.length < s.layout->inbox_bytes() || s.weights.length < s.layout->weights_bytes() ||
       s.clocks.length < s.layout->clocks_bytes())) {
    return FailedPreconditionError("server " + std::to_string(s.rank) +
                                   "'s regions are smaller than its layout");
  }
  return Status::OK();
}

Status ServerSessions::Connect(uint32_t server, uint64_t clock, std::chrono::milliseconds timeout) {
  ServerSession& s = servers_[server];
  s.ep.reset();
  ++s.gen;
  s.ahead_in_flight = false;  // its completion, if any, is the old generation's: dropped
  s.ahead_ready = false;
  transport::EndpointOptions eo;
  eo.endpoint_id = (static_cast<uint64_t>(s.gen) << 32) | s.rank;
  eo.send_depth = kSendDepth;
  eo.recv_depth = 4;
  eo.retry_refused = false;
  eo.connect_timeout = timeout.count() > 0
                           ? timeout
                           : std::min(options_.setup_timeout, std::chrono::milliseconds(30000));
  // The data path proves this worker's membership credential (docs/security.md): the server
  // takes its rank from the identity proven here, not from the hello below.
  eo.auth_identity = control::IdentityString(
      {control_.member_id(), static_cast<int>(control::ROLE_WORKER), rank_});
  eo.auth_key = s.peer_key;
  auto ep = fabric_.Connect(s.address, cq_.get(), eo);
  if (!ep.ok()) {
    return ep.status().WithContext("connecting to server group " + std::to_string(s.rank) + " at " +
                                   s.address);
  }
  s.ep = std::move(*ep);
  s.failed = false;
  // Hello: tells the server which worker (rank and incarnation) this endpoint belongs to.
  const uint64_t hello_off = num_chunks_ * kStagingPerChunk;
  auto* hello = reinterpret_cast<layout::Hello*>(StagingAt(hello_off));
  std::memset(hello, 0, sizeof(*hello));
  hello->clock = clock;
  hello->incarnation = control_.member_id();
  hello->magic = layout::kHelloMagic;
  BeginSetupOps();
  RETURN_IF_ERROR(PostWithCredit([&] {
    return s.ep->PostWriteImm({staging_.get(), hello_off, sizeof(layout::Hello)},
                              transport::AtOffset(s.clocks, s.layout->clock_offset(rank_)),
                              layout::MakeImm(layout::ImmKind::kHello, rank_),
                              setup_context(0));
  }));
  return WaitSetupOps(1, timeout);
}

bool ServerSessions::MarkFailed() {
  bool any = false;
  for (ServerSession& s : servers_) {
    if (s.ep && !s.ep->status().ok()) s.failed = true;
    any = any || s.failed;
  }
  return any;
}

bool ServerSessions::MarkDeparted(const control::Membership& m) {
  bool any = false;
  for (ServerSession& s : servers_) {
    bool member = false;
    for (const auto& mm : m.members()) member = member || mm.member_id() == s.member_id;
    if (!member && !s.failed && s.ep) {
      LOG(WARNING) << "worker rank " << rank_ << ": server rank " << s.server_rank
                   << " (member " << s.member_id << ", group " << s.rank
                   << ") was declared departed at epoch " << m.epoch() << ": "
                   << m.reason() << "; failing over";
      s.failed = true;
    }
    any = any || s.failed;
  }
  return any;
}

bool ServerSessions::AnyFailed() const {
  for (const ServerSession& s : servers_) {
    if (s.failed) return true;
  }
  return false;
}

Status ServerSessions::ServerError(uint32_t server, const std::string& what) const {
  const ServerSession& s = servers_[server];
  Status st = s.ep ? s.ep->status() : UnavailableError("not connected");
  return UnavailableError("server rank " + std::to_string(s.rank) + " at " + s.address + ": " +
                          what + (st.ok() ? "" : " (" + st.ToString() + ")"));
}

uint64_t ServerSessions::AcksOffset(uint32_t server) const {
  uint64_t off = acks_staging_offset_;
  for (uint32_t i = 0; i < server; ++i) {
    off += layout::AlignUp(servers_[i].layout->acks_of_worker_bytes());
  }
  return off;
}

const uint64_t* ServerSessions::TakeAcksAhead(uint32_t server) {
  ServerSession& s = servers_[server];
  if (!s.ahead_ready || s.ahead_in_flight) return nullptr;
  s.ahead_ready = false;
  return reinterpret_cast<const uint64_t*>(StagingAt(AcksOffset(server) + acks_area_bytes_));
}

void ServerSessions::PostAcksAhead(uint32_t server, uint32_t flags) {
  ServerSession& s = servers_[server];
  if (!s.ep || s.failed || s.ahead_in_flight) return;
  const uint64_t off = AcksOffset(server) + acks_area_bytes_;
  const Status st =
      s.ep->PostRead({staging_.get(), off, s.layout->acks_of_worker_bytes()},
                     transport::AtOffset(s.acks, s.layout->acks_of_worker_offset(rank_)),
                     MakeContext(kOpAcksAhead, 0, 0), flags);
  if (!st.ok()) return;  // no credit (or a failing endpoint, seen by the next real post)
  s.ahead_in_flight = true;
  s.ahead_ready = false;  // the staging is being overwritten
}

Status ServerSessions::SendClock(uint32_t server, uint64_t clock) {
  ServerSession& s = servers_[server];
  if (!s.ep) return ServerError(server, "not connected");
  const uint64_t off = clock_staging_offset_ + s.rank * layout::kAlign;
  std::memcpy(StagingAt(off), &clock, sizeof(clock));
  return PostWithCredit([&] {
    return s.ep->PostWriteImm(
        {staging_.get(), off, sizeof(uint64_t)},
        transport::AtOffset(s.clocks, s.layout->clock_offset(rank_)),
        layout::MakeImm(layout::ImmKind::kClock, static_cast<uint32_t>(clock)),
        MakeContext(kOpClock, 0, 0), transport::kUnsignaled);
  });
}

Status ServerSessions::ReadAcks(uint32_t server, uint32_t chunk, SteadyClock::time_point deadline,
                                const std::function<Status()>& timeout_error, bool stop_if_failed) {
  ServerSession& s = servers_[server];
  // A group whose failover target failed too has no endpoint until the next shard map.
  if (!s.ep) return ServerError(server, "not connected");
  const uint64_t off = AcksOffset(server);
  BeginReads(1);
  RETURN_IF_ERROR(PostWithCredit([&] {
    return s.ep->PostRead({staging_.get(), off, s.layout->acks_of_worker_bytes()},
                          transport::AtOffset(s.acks, s.layout->acks_of_worker_offset(rank_)),
                          AcksContext(chunk));
  }));
  if (!stop_if_failed) return AwaitRead(deadline, timeout_error, nullptr);
  return AwaitRead(deadline, timeout_error, [&s] { return s.failed; });
}

Status ServerSessions::ReadAcks(const std::vector<uint32_t>& servers,
                                SteadyClock::time_point deadline,
                                const std::function<Status()>& timeout_error) {
  auto any_failed = [&] {
    for (uint32_t server : servers) {
      if (servers_[server].failed) return true;
    }
    return false;
  };
  if (any_failed()) return Status::OK();  // recovered first; no read is posted to be abandoned
  BeginReads(0);
  for (uint32_t server : servers) {
    ServerSession& s = servers_[server];
    if (!s.ep) continue;
    const uint64_t off = AcksOffset(server);
    Status st = PostWithCredit([&] {
      return s.ep->PostRead({staging_.get(), off, s.layout->acks_of_worker_bytes()},
                            transport::AtOffset(s.acks, s.layout->acks_of_worker_offset(rank_)),
                            AcksContext(0));
    });
    if (!st.ok()) {
      s.failed = true;  // recovered by the caller, like a failed completion
      continue;
    }
    ++acks_pending_;
  }
  // A failed server (above, or declared departed while the reads wait) ends the wait: its
  // caller recovers it. The healthy servers' reads are left in flight: AwaitRead retires the
  // wait's generation, which keeps their completions (and errors) out of every later wait, and
  // each lands in its server's own acks staging, in order on its endpoint ahead of any later
  // read of the same server.
  return AwaitRead(deadline, timeout_error, any_failed);
}

Status ServerSessions::ReadHeader(uint32_t server, uint32_t slot, uint32_t chunk,
                                  SteadyClock::time_point deadline,
                                  const std::function<Status()>& timeout_error) {
  ServerSession& s = servers_[server];
  if (!s.ep) return ServerError(server, "not connected");
  BeginReads(1);
  RETURN_IF_ERROR(PostWithCredit([&] {
    return s.ep->PostRead({staging_.get(), ChunkStagingOffset(chunk, 2), layout::kAlign},
                          transport::AtOffset(s.weights, s.layout->header_offset(slot)),
                          AcksContext(chunk));
  }));
  return AwaitRead(deadline, timeout_error, nullptr);
}

Status ServerSessions::ReadOutbox(uint32_t server, uint64_t offset, uint64_t bytes,
                                  const transport::LocalSlice& local,
                                  SteadyClock::time_point deadline,
                                  const std::function<Status()>& timeout_error) {
  ServerSession& s = servers_[server];
  if (!s.ep) return ServerError(server, "not connected");
  if (offset > s.outbox.length || bytes > s.outbox.length - offset) {
    return FailedPreconditionError("server " + std::to_string(server) +
                                   "'s outbox is smaller than its chunks' state");
  }
  BeginReads(1);
  RETURN_IF_ERROR(PostWithCredit([&] {
    return s.ep->PostRead({local.region, local.offset, bytes}, transport::AtOffset(s.outbox, offset),
                          AcksContext(0));
  }));
  return AwaitRead(deadline, timeout_error, nullptr);
}

void ServerSessions::CheckDepartures() {
  if (!departure_check_) return;
  const auto now = SteadyClock::now();
  if (now < next_departure_check_) return;
  next_departure_check_ = now + std::chrono::milliseconds(50);
  departure_check_();
}

void ServerSessions::BeginReads(int reads) {
  ++acks_gen_;
  acks_pending_ = reads;
  read_error_ = Status::OK();
}

Status ServerSessions::AwaitRead(SteadyClock::time_point deadline,
                                 const std::function<Status()>& timeout_error,
                                 const std::function<bool()>& stop) {
  // A wait that returns with reads still in flight retires its generation: their completions
  // count in no wait, and their errors fail no other one.
  struct Retire {
    ServerSessions* s;
    ~Retire() {
      if (s->acks_pending_ > 0) {
        ++s->acks_gen_;
        s->acks_pending_ = 0;
      }
    }
  } retire{this};
  while (acks_pending_ > 0) {
    RETURN_IF_ERROR(Progress());
    // Checked even when the read just completed: over shm a read completes at once, and a
    // caller that reads again until the acks move (AwaitAllAcked) relies on this to time out.
    if (SteadyClock::now() > deadline) return timeout_error();
    // A server declared departed while stopped never answers: its session fails here, and a
    // wait that stops on it (`stop`) returns for the caller to fail over.
    if (stop) {
      CheckDepartures();
      if (stop()) return Status::OK();
    }
  }
  return read_error_;
}

void ServerSessions::BeginSetupOps() {
  ++setup_gen_;
  setup_done_ = 0;
  setup_error_ = Status::OK();
}

Status ServerSessions::WaitSetupOps(int count, std::chrono::milliseconds timeout) {
  const auto deadline =
      SteadyClock::now() + (timeout.count() > 0 ? timeout : options_.setup_timeout);
  while (setup_done_ < count) {
    RETURN_IF_ERROR(Progress());
    if (!setup_error_.ok()) return setup_error_;
    if (SteadyClock::now() > deadline) return DeadlineExceededError("setup writes timed out");
  }
  return setup_error_;
}

Status ServerSessions::PostWithCredit(const std::function<Status()>& post) {
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  while (true) {
    Status s = post();
    if (s.code() != StatusCode::kResourceExhausted) return s;
    RETURN_IF_ERROR(Progress());  // reap completions, returning credits
    if (SteadyClock::now() > deadline) return s;
  }
}

Status ServerSessions::Progress() { return ProgressOrSleep(std::chrono::microseconds(0)); }

Status ServerSessions::ProgressOrSleep(std::chrono::microseconds max_sleep) {
  if (cq_ == nullptr) return Status::OK();
  Completion wc[64];
  const int n = max_sleep.count() > 0 ? cq_->Wait(wc, 64, max_sleep) : cq_->Poll(wc, 64);
  for (int i = 0; i < n; ++i) OnCompletion(wc[i]);
  return Status::OK();
}

void ServerSessions::OnCompletion(const Completion& wc) {
  const uint32_t kind = ContextKind(wc.context);
  const uint32_t server = static_cast<uint32_t>(wc.endpoint_id & 0xffffffffu);
  const uint32_t gen = static_cast<uint32_t>(wc.endpoint_id >> 32);
  if (server >= servers_.size() || servers_[server].gen != gen) return;  // a replaced endpoint
  const Status err =
      wc.ok() ? Status::OK() : ServerError(server, std::string(transport::WcStatusName(wc.status)));
  // A failed operation puts its session into the failed state: the group is failed over to its
  // backup, or the endpoint reconnected if the server is alive (Recovery).
  if (!wc.ok()) servers_[server].failed = true;
  switch (kind) {
    case kOpSetup:
      if (ContextHandle(wc.context) != setup_gen_) return;  // an earlier batch's
      if (!wc.ok() && setup_error_.ok()) setup_error_ = err;
      ++setup_done_;
      return;
    case kOpAcks:
      if (ContextHandle(wc.context) != acks_gen_) return;  // an abandoned wait's read
      --acks_pending_;
      if (!wc.ok() && read_error_.ok()) read_error_ = err;
      return;
    case kOpAcksAhead:
      servers_[server].ahead_in_flight = false;
      servers_[server].ahead_ready = wc.ok();
      return;
    case kOpPush:
      sink_.OnPushCompletion(ContextChunk(wc.context), ContextHandle(wc.context), err);
      return;
    case kOpPull:
      sink_.OnPullCompletion(ContextChunk(wc.context), ContextHandle(wc.context), err);
      return;
    case kOpRows:
      sink_.OnRowsCompletion(ContextChunk(wc.context), ContextHandle(wc.context), err);
      return;
    case kOpCredit:  // credits only; a failure marked the session failed above
      return;
    default:
      return;
  }
}

void ServerSessions::Disconnect() {
  for (ServerSession& s : servers_) s.ep.reset();
}

}  // namespace shardps::worker
