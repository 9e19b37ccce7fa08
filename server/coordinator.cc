#include "server/coordinator.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include <glog/logging.h>

#include "common/crypto.h"
#include "common/net.h"
#include "proto/credentials.h"
#include "proto/shard_plan.h"

namespace shardps::control {

using Clock = std::chrono::steady_clock;

struct Coordinator::Conn {
  UniqueFd fd;
  std::string peer;
  Clock::time_point opened;
  Clock::time_point last_heard;
  bool magic_ok = false;
  std::string magic_buf;
  FrameDecoder decoder;
  std::string out;  // pending output
  size_t out_off = 0;
  bool joined = false;
  bool has_model = false;  // a worker that registered the model (it gets shard map updates)
  Member member;
  bool closing = false;

  explicit Conn(size_t max_frame) : decoder(max_frame) {}
};

Coordinator::Coordinator(const CoordinatorOptions& options) : options_(options) {
  ClusterConfig& c = options_.config;
  if (c.heartbeat_interval_ms() == 0) c.set_heartbeat_interval_ms(500);
  if (c.heartbeat_timeout_ms() == 0) c.set_heartbeat_timeout_ms(5 * c.heartbeat_interval_ms());
}

StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options) {
  if (options.cluster_token.empty()) {
    return InvalidArgumentError("coordinator: an empty cluster token is not allowed");
  }
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  ASSIGN_OR_RETURN(c->listen_fd_, net::ListenTcp(options.listen_address, &c->address_));
  RETURN_IF_ERROR(net::SetNonBlocking(c->listen_fd_.get(), true));
  c->wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!c->wake_fd_.valid()) return ErrnoError("eventfd", errno);
  ASSIGN_OR_RETURN(c->credential_secret_, crypto::RandomBytes(32));
  if (!options.state_file.empty()) RETURN_IF_ERROR(c->LoadState());
  c->thread_ = std::thread([p = c.get()] { p->Loop(); });
  LOG(INFO) << "coordinator: listening on " << c->address_ << ", heartbeat "
            << c->options_.config.heartbeat_interval_ms() << " ms, timeout "
            << c->options_.config.heartbeat_timeout_ms() << " ms";
  return c;
}

Coordinator::~Coordinator() { Stop(); }

void Coordinator::Stop() {
  if (stop_.exchange(true)) return;
  uint64_t one = 1;
  if (write(wake_fd_.get(), &one, sizeof(one)) < 0) PLOG(WARNING) << "coordinator: wake";
  if (thread_.joinable()) thread_.join();
}

uint64_t Coordinator::epoch() const {
  MutexLock l(&mu_);
  return membership_.epoch();
}

Membership Coordinator::membership() const {
  MutexLock l(&mu_);
  return membership_;
}

CoordinatorCounters Coordinator::counters() const {
  MutexLock l(&mu_);
  return counters_;
}

void Coordinator::Loop() {
  std::vector<pollfd> fds;
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({listen_fd_.get(), POLLIN, 0});
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    for (auto& [fd, c] : conns_) {
      short ev = POLLIN;
      if (c->out_off < c->out.size()) ev |= POLLOUT;
      fds.push_back({fd, ev, 0});
    }
    const int tick = std::max<int>(10, options_.config.heartbeat_interval_ms() / 4);
    const int n = poll(fds.data(), fds.size(), tick);
    if (n < 0 && errno != EINTR) {
      PLOG(ERROR) << "coordinator: poll";
      continue;
    }
    if (fds[0].revents & POLLIN) AcceptNew();
    for (size_t i = 2; i < fds.size(); ++i) {
      auto it = conns_.find(fds[i].fd);
      if (it == conns_.end()) continue;
      Conn* c = it->second.get();
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) ReadFrom(c);
      if (!c->closing && (fds[i].revents & POLLOUT)) FlushOutput(c);
    }
    CheckTimeouts();
    for (auto it = conns_.begin(); it != conns_.end();) {
      it = it->second->closing ? conns_.erase(it) : std::next(it);
    }
    if (dirty_) {
      if (options_.state_file.empty()) {
        dirty_ = false;
      } else {
        SaveState();
      }
    }
  }
  conns_.clear();
}

void Coordinator::AcceptNew() {
  while (true) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    UniqueFd fd(accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len,
                        SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno != EAGAIN && errno != EINTR) PLOG(WARNING) << "coordinator: accept";
      return;
    }
    auto c = std::make_unique<Conn>(options_.max_frame_bytes);
    c->opened = c->last_heard = Clock::now();
    c->peer = "fd" + std::to_string(fd.get());
    c->fd = std::move(fd);
    const int key = c->fd.get();
    conns_[key] = std::move(c);
  }
}

void Coordinator::ReadFrom(Conn* c) {
  char buf[64 << 10];
  while (!c->closing) {
    const StatusOr<size_t> recvd = net::RecvSome(c->fd.get(), buf, sizeof(buf));
    if (!recvd.ok()) {  // "recv: peer closed the connection" at EOF
      Close(c, std::string(recvd.status().message()), false);
      return;
    }
    if (*recvd == 0) break;  // drained
    const size_t k = *recvd;
    c->last_heard = Clock::now();
    size_t off = 0;
    if (!c->magic_ok) {
      const size_t need = kMagic.size() - c->magic_buf.size();
      const size_t take = std::min<size_t>(need, static_cast<size_t>(k));
      c->magic_buf.append(buf, take);
      off = take;
      if (c->magic_buf.size() < kMagic.size()) continue;
      if (c->magic_buf != kMagic) {
        Close(c, "bad magic: not a ShardPS control connection", true);
        return;
      }
      c->magic_ok = true;
    }
    c->decoder.Feed(buf + off, static_cast<size_t>(k) - off);
    Envelope e;
    while (!c->closing) {
      auto got = c->decoder.Next(&e);
      if (!got.ok()) {
        Close(c, got.status().ToString(), true);
        return;
      }
      if (!*got) break;
      Handle(c, e);
    }
  }
}

void Coordinator::Handle(Conn* c, const Envelope& e) {
  if (!c->joined) {
    if (e.body_case() != Envelope::kJoin) {
      Close(c, std::string("expected join, got ") + BodyName(e), true);
      return;
    }
    HandleJoin(c, e.join());
    return;
  }
  switch (e.body_case()) {
    case Envelope::kRegisterModel:
      if (c->member.role() != ROLE_WORKER) {
        Close(c, "register_model from a non-worker", true);
        return;
      }
      HandleRegisterModel(c, e.register_model());
      return;
    case Envelope::kShardsReady:
      if (c->member.role() != ROLE_SERVER) {
        Close(c, "shards_ready from a non-server", true);
        return;
      }
      HandleShardsReady(c, e.shards_ready());
      return;
    case Envelope::kCheckpoint:
      if (c->member.role() != ROLE_WORKER) {
        Close(c, "checkpoint request from a non-worker", true);
        return;
      }
      // Forwarded to every server; each checkpoints its group at that clock.
      LOG(INFO) << "coordinator: checkpoint at clock " << e.checkpoint().clock()
                << " requested by member " << c->member.member_id();
      for (auto& [fd, o] : conns_) {
        if (o->joined && !o->closing && o->member.role() == ROLE_SERVER) Queue(o.get(), e);
      }
      return;
    case Envelope::kHeartbeat:
      if (e.heartbeat().member_id() != c->member.member_id()) {
        Close(c, "heartbeat names another member", true);
      }
      return;  // last_heard already updated
    case Envelope::kLeave:
      Close(c, "left: " + e.leave().reason(), false);
      return;
    default:
      Close(c, std::string("unexpected message ") + BodyName(e) + " from a member", true);
      return;
  }
}

void Coordinator::HandleJoin(Conn* c, const JoinRequest& j) {
  Envelope reply;
  JoinReply* r = reply.mutable_join_reply();
  std::string refuse;
  if (j.cluster_token() != options_.cluster_token) {
    refuse = "wrong cluster token";
  } else if (j.role() != ROLE_SERVER && j.role() != ROLE_WORKER) {
    refuse = "join without a valid role";
  } else if (j.requested_rank() >= 65536) {
    refuse = "requested rank " + std::to_string(j.requested_rank()) + " is out of range";
  } else if (!options_.config.transport().empty() && !j.transport().empty() &&
             j.transport() != options_.config.transport()) {
    refuse = "transport '" + j.transport() + "' differs from the cluster's '" +
             options_.config.transport() + "'";
  }
  if (refuse.empty() && j.role() == ROLE_WORKER && shards_assigned_ &&
      j.previous_member_id() == 0) {
    // The servers' inboxes have max_workers slots: a worker beyond them could never push.
    const uint32_t max_workers = std::max<uint32_t>(
        options_.config.max_workers(), std::max<uint32_t>(1, options_.config.num_workers()));
    uint32_t workers = 0;
    for (auto& [fd, o] : conns_) workers += o->joined && o->member.role() == ROLE_WORKER;
    for (auto& [id, p] : pending_) workers += p.member.role() == ROLE_WORKER;
    if (workers >= max_workers) {
      refuse = "cluster full: " + std::to_string(max_workers) +
               " workers (max_workers; start the coordinator with a larger --max_workers for "
               "elastic growth)";
    }
  }
  for (const Region& reg : j.regions()) {
    if (reg.encoded_descriptor().size() > 4200 || reg.name().size() > 256) {
      refuse = "oversized region descriptor";
    }
  }
  if (!refuse.empty()) {
    {
      // Counted before the reply leaves, so a refused member never sees a stale counter.
      MutexLock l(&mu_);
      ++counters_.joins_refused;
    }
    r->set_accepted(false);
    r->set_error(refuse);
    Queue(c, reply);
    FlushOutput(c);
    Close(c, "join refused: " + refuse, true);
    return;
  }
  if (j.previous_member_id() != 0) {
    // A member rejoining a restarted coordinator: it comes back as itself (same id and rank),
    // if this coordinator's saved state still lists it.
    auto p = pending_.find(j.previous_member_id());
    const bool proven =
        p != pending_.end() &&
        crypto::ConstantTimeEquals(j.previous_credential(), CredentialOf(p->second.member));
    if (p != pending_.end() && !proven) {
      // The cluster token is not an identity: only the member itself holds its credential.
      {
        MutexLock l(&mu_);
        ++counters_.joins_refused;
      }
      LOG(WARNING) << "coordinator: a rejoin as member " << j.previous_member_id() << " from "
                   << j.hostname() << "/" << j.pid()
                   << " did not prove that member's credential; refused (the member may still "
                      "rejoin)";
      r->set_accepted(false);
      r->set_error("rejoin as member " + std::to_string(j.previous_member_id()) +
                   " refused: the credential does not match");
      Queue(c, reply);
      FlushOutput(c);
      Close(c, "rejoin refused: credential mismatch", true);
      return;
    }
    if (p == pending_.end() || p->second.member.role() != j.role()) {
      {
        MutexLock l(&mu_);
        ++counters_.joins_refused;
      }
      r->set_accepted(false);
      r->set_error("member " + std::to_string(j.previous_member_id()) +
                   " is not a member of this cluster any more (declared dead, or the coordinator "
                   "restarted without its state file); restart the process to join anew");
      Queue(c, reply);
      FlushOutput(c);
      Close(c, "rejoin refused", false);
      return;
    }
    c->joined = true;
    c->member = p->second.member;
    c->peer = j.hostname() + "/" + std::to_string(j.pid());
    c->has_model = std::find(has_model_ids_.begin(), has_model_ids_.end(), c->member.member_id()) !=
                   has_model_ids_.end();
    pending_.erase(p);
    {
      MutexLock l(&mu_);
      ++counters_.rejoins;
    }
    r->set_accepted(true);
    r->set_member_id(c->member.member_id());
    r->set_credential(CredentialOf(c->member));
    r->set_rank(c->member.rank());
    r->set_epoch(epoch() + 1);
    *r->mutable_config() = options_.config;
    Queue(c, reply);
    LOG(INFO) << "coordinator: member " << c->member.member_id() << " rejoined (" << pending_.size()
              << " still expected)";
    if (c->member.role() == ROLE_SERVER && shards_assigned_ && !primary_of_.empty()) {
      // A Promote or ReplicaTarget{none} queued before a coordinator crash may never have
      // reached it: both are idempotent, so send them again.
      const uint32_t g = c->member.rank() % NumGroups();
      if (primary_of_[g] == static_cast<int64_t>(c->member.rank())) {
        if (c->member.rank() >= NumGroups()) {
          Envelope e;
          e.mutable_promote()->set_group(g);
          e.mutable_promote()->set_epoch(epoch() + 1);
          Queue(c, e);
        }
        if (options_.config.replicas() >= 2 && backup_of_[g] < 0) {
          Envelope e;
          e.mutable_replica_target()->set_group(g);
          e.mutable_replica_target()->set_epoch(epoch() + 1);
          e.mutable_replica_target()->set_none(true);
          Queue(c, e);
        }
      }
    }
    Publish("member " + std::to_string(c->member.member_id()) + " rejoined", 0);
    return;
  }
  // Rank: the requested one if free, else the lowest free rank of that role.
  std::vector<bool> used;
  for (auto& [fd, o] : conns_) {
    if (o->joined && o->member.role() == j.role()) {
      if (used.size() <= o->member.rank()) used.resize(o->member.rank() + 1);
      used[o->member.rank()] = true;
    }
  }
  for (auto& [id, p] : pending_) {
    if (p.member.role() == j.role()) {
      if (used.size() <= p.member.rank()) used.resize(p.member.rank() + 1);
      used[p.member.rank()] = true;
    }
  }
  uint32_t rank = 0;
  if (j.requested_rank() >= 0 &&
      (static_cast<size_t>(j.requested_rank()) >= used.size() || !used[j.requested_rank()])) {
    rank = static_cast<uint32_t>(j.requested_rank());
  } else {
    while (rank < used.size() && used[rank]) ++rank;
  }
  if (j.role() == ROLE_WORKER) {
    const uint32_t max_workers = std::max<uint32_t>(
        options_.config.max_workers(), std::max<uint32_t>(1, options_.config.num_workers()));
    if (rank >= max_workers) {
      rank = 0;
      while (rank < used.size() && used[rank]) ++rank;
    }
  }
  c->joined = true;
  c->peer = j.hostname() + "/" + std::to_string(j.pid());
  Member& m = c->member;
  m.set_member_id(next_member_id_++);
  m.set_role(j.role());
  m.set_rank(rank);
  m.set_hostname(j.hostname());
  m.set_pid(j.pid());
  m.set_data_address(j.data_address());
  m.set_transport(j.transport());
  *m.mutable_regions() = j.regions();
  {
    MutexLock l(&mu_);
    ++counters_.joins_accepted;
  }
  r->set_accepted(true);
  r->set_member_id(m.member_id());
  r->set_credential(CredentialOf(m));
  r->set_rank(rank);
  r->set_epoch(epoch() + 1);
  *r->mutable_config() = options_.config;
  Queue(c, reply);
  LOG(INFO) << "coordinator: member " << m.member_id() << " joined as "
            << (m.role() == ROLE_SERVER ? "server" : "worker") << " rank " << rank << " ("
            << c->peer << ")";
  Publish("member " + std::to_string(m.member_id()) + " joined", 0);
  if (m.role() == ROLE_SERVER) MaybeAssignShards();
}

namespace {

StatusOr<ShardPlan> PlanFromModel(const RegisterModel& m, uint32_t num_servers,
                                  uint64_t default_partition,
                                  const std::vector<double>& capacity = {}) {
  std::vector<TensorSpec> specs;
  for (const auto& t : m.tensors()) {
    if (t.dtype() != 0) return InvalidArgumentError("tensor '" + t.name() + "': only float32");
    TensorSpec s;
    s.name = t.name();
    s.shape.assign(t.shape().begin(), t.shape().end());
    specs.push_back(std::move(s));
  }
  if (specs.empty()) return InvalidArgumentError("a model without tensors");
  const uint64_t part = m.partition_bytes() ? m.partition_bytes() : default_partition;
  return PlanShards(specs, num_servers, part, capacity);
}

std::vector<double> Capacity(const ClusterConfig& c) {  // --server_capacity; empty: equal
  return {c.server_capacity().begin(), c.server_capacity().end()};
}

}  // namespace

uint32_t Coordinator::NumGroups() const {
  return std::max<uint32_t>(1, options_.config.num_servers());
}

uint32_t Coordinator::NumServerRanks() const {
  return NumGroups() * std::max<uint32_t>(1, options_.config.replicas());
}

void Coordinator::HandleRegisterModel(Conn* c, const RegisterModel& m) {
  const uint32_t num_servers = NumGroups();
  auto plan =
      PlanFromModel(m, num_servers, options_.config.partition_bytes(), Capacity(options_.config));
  if (!plan.ok()) {
    Envelope err;
    err.mutable_error()->set_message("model refused: " + plan.status().ToString());
    Queue(c, err);
    FlushOutput(c);
    Close(c, "model refused: " + plan.status().ToString(), true);
    return;
  }
  if (!model_registered_) {
    model_registered_ = true;
    model_ = m;
    plan_fingerprint_ = plan->Fingerprint();
    LOG(INFO) << "coordinator: model registered by member " << c->member.member_id() << ": "
              << plan->tensors.size() << " tensors, " << plan->chunks.size() << " chunks over "
              << num_servers << " servers (imbalance " << plan->imbalance() << ")";
  } else if (plan->Fingerprint() != plan_fingerprint_) {
    Envelope err;
    err.mutable_error()->set_message(
        "model differs from the one already registered (same tensors, shapes and order "
        "are required on every worker)");
    Queue(c, err);
    FlushOutput(c);
    Close(c, "model mismatch", true);
    return;
  }
  c->has_model = true;
  has_model_ids_.push_back(c->member.member_id());
  dirty_ = true;
  if (shard_map_ready_) {
    Queue(c, ShardMapFor(c->member));
  } else {
    awaiting_map_.push_back(c->member.member_id());
    MaybeAssignShards();
  }
}

Coordinator::Conn* Coordinator::ServerByRank(uint32_t rank) {
  for (auto& [fd, c] : conns_) {
    if (c->joined && !c->closing && c->member.role() == ROLE_SERVER && c->member.rank() == rank) {
      return c.get();
    }
  }
  return nullptr;
}

void Coordinator::MaybeAssignShards() {
  if (!model_registered_ || shards_assigned_) return;
  const uint32_t num_servers = NumGroups();
  for (uint32_t r = 0; r < NumServerRanks(); ++r) {
    if (ServerByRank(r) == nullptr) return;  // wait for every server rank
  }
  auto plan = PlanFromModel(model_, num_servers, options_.config.partition_bytes(),
                            Capacity(options_.config));
  if (!plan.ok()) return;  // checked when registered
  const uint32_t max_workers = std::max<uint32_t>(
      options_.config.max_workers(), std::max<uint32_t>(1, options_.config.num_workers()));
  // Server rank r holds group r % G; ranks >= G hold the backups, so the backup of group g
  // is the process started as rank G + g (launchers put it on another host than rank g).
  primary_of_.assign(num_servers, -1);
  backup_of_.assign(num_servers, -1);
  target_sent_.assign(num_servers, false);
  for (uint32_t r = 0; r < NumServerRanks(); ++r) {
    const uint32_t g = r % num_servers;
    const bool backup = r >= num_servers;
    (backup ? backup_of_ : primary_of_)[g] = r;
    Envelope e;
    AssignShards* a = e.mutable_assign_shards();
    for (const auto& ch : plan->chunks) {
      if (ch.server != g) continue;
      a->add_chunk_ids(ch.chunk_id);
      a->add_chunk_bytes(ch.bytes);
    }
    a->set_max_workers(max_workers);
    a->set_plan_fingerprint(plan_fingerprint_);
    a->set_group(g);
    a->set_num_groups(num_servers);
    a->set_backup(backup);
    Queue(ServerByRank(r), e);
  }
  shards_assigned_ = true;
  // Remember the plan in the map we will publish.
  shard_map_.Clear();
  for (const auto& t : plan->tensors) {
    TensorSpecProto* p = shard_map_.add_tensors();
    p->set_name(t.name);
    p->set_dtype(0);
    for (auto d : t.shape) p->add_shape(d);
  }
  for (const auto& ch : plan->chunks) {
    ChunkEntry* e = shard_map_.add_chunks();
    e->set_chunk_id(ch.chunk_id);
    e->set_tensor(ch.tensor);
    e->set_offset(ch.offset);
    e->set_bytes(ch.bytes);
    e->set_server_rank(ch.server);
    e->set_slot(ch.server_slot);
  }
  shard_map_.set_max_workers(max_workers);
  shard_map_.set_partition_bytes(plan->partition_bytes);
  shard_map_.set_plan_fingerprint(plan_fingerprint_);
  dirty_ = true;
  LOG(INFO) << "coordinator: shards assigned to " << num_servers << " groups on "
            << NumServerRanks() << " servers"
            << (NumServerRanks() > num_servers ? " (every group has a backup)" : " (no backups)");
}

void Coordinator::HandleShardsReady(Conn* c, const ShardsReady& r) {
  if (!shards_assigned_ || r.plan_fingerprint() != plan_fingerprint_) {
    Close(c, "shards_ready for a plan that was not assigned", true);
    return;
  }
  ready_[c->member.rank()] = r;
  dirty_ = true;
  MaybeSendReplicaTarget(c->member.rank() % NumGroups());
  MaybePublishShardMap();
}

void Coordinator::MaybeSendReplicaTarget(uint32_t g) {
  if (options_.config.replicas() < 2 || g >= primary_of_.size() || target_sent_[g]) return;
  if (primary_of_[g] < 0 || backup_of_[g] < 0) return;
  Conn* p = ServerByRank(static_cast<uint32_t>(primary_of_[g]));
  Conn* b = ServerByRank(static_cast<uint32_t>(backup_of_[g]));
  auto ready = ready_.find(static_cast<uint32_t>(backup_of_[g]));
  if (p == nullptr || b == nullptr || ready == ready_.end()) return;
  Envelope e;
  ReplicaTarget* t = e.mutable_replica_target();
  t->set_group(g);
  t->set_epoch(epoch());
  t->set_member_id(b->member.member_id());
  t->set_data_address(b->member.data_address());
  t->set_peer_key(
      PeerKey(CredentialOf(b->member),
              {p->member.member_id(), static_cast<int>(p->member.role()), p->member.rank()}));
  for (const Region& r : ready->second.regions()) {
    if (r.name().rfind("repl_", 0) == 0) *t->add_regions() = r;
  }
  target_sent_[g] = true;
  Queue(p, e);
  LOG(INFO) << "coordinator: group " << g << ": primary server rank " << primary_of_[g]
            << " replicates to server rank " << backup_of_[g] << " (" << b->member.data_address()
            << ")";
}

void Coordinator::FillServerEntry(uint32_t g, uint32_t server_rank, ServerEntry* e) {
  Conn* s = ServerByRank(server_rank);
  e->set_rank(g);
  e->set_server_rank(server_rank);
  e->set_lost(false);
  e->clear_regions();
  if (s == nullptr) return;
  e->set_member_id(s->member.member_id());
  e->set_data_address(s->member.data_address());
  for (const Region& r : ready_[server_rank].regions()) {
    if (r.name().rfind("repl_", 0) != 0) *e->add_regions() = r;
  }
}

void Coordinator::BroadcastShardMap() {
  dirty_ = true;
  shard_map_.set_epoch(epoch());
  for (auto& [fd, c] : conns_) {
    if (!c->joined || c->closing || c->member.role() != ROLE_WORKER) continue;
    if (std::find(awaiting_map_.begin(), awaiting_map_.end(), c->member.member_id()) !=
        awaiting_map_.end()) {
      continue;  // gets the map when it is ready
    }
    if (!c->has_model) continue;  // asks for it with RegisterModel
    Queue(c.get(), ShardMapFor(c->member));
  }
}

void Coordinator::ServerDeparted(const Member& m) {
  if (!shards_assigned_) return;
  const uint32_t r = m.rank();
  for (uint32_t g = 0; g < primary_of_.size(); ++g) {
    if (backup_of_[g] == static_cast<int64_t>(r)) {
      backup_of_[g] = -1;
      {
        MutexLock l(&mu_);
        ++counters_.backups_lost;
      }
      LOG(WARNING) << "coordinator: group " << g << " lost its backup (server rank " << r
                   << "); its primary goes on without replication";
      if (primary_of_[g] >= 0) {
        if (Conn* p = ServerByRank(static_cast<uint32_t>(primary_of_[g]))) {
          Envelope e;
          e.mutable_replica_target()->set_group(g);
          e.mutable_replica_target()->set_epoch(epoch());
          e.mutable_replica_target()->set_none(true);
          Queue(p, e);
        }
      }
    }
    if (primary_of_[g] != static_cast<int64_t>(r)) continue;
    Conn* b = backup_of_[g] >= 0 ? ServerByRank(static_cast<uint32_t>(backup_of_[g])) : nullptr;
    if (b != nullptr && ready_.count(static_cast<uint32_t>(backup_of_[g]))) {
      const uint32_t br = static_cast<uint32_t>(backup_of_[g]);
      primary_of_[g] = br;
      backup_of_[g] = -1;
      Envelope e;
      e.mutable_promote()->set_group(g);
      e.mutable_promote()->set_epoch(epoch());
      Queue(b, e);
      {
        MutexLock l(&mu_);
        ++counters_.promotions;
      }
      LOG(WARNING) << "coordinator: group " << g << ": primary server rank " << r
                   << " is gone; PROMOTING its backup, server rank " << br << " ("
                   << b->member.data_address() << "), at epoch " << epoch();
      if (shard_map_ready_ && static_cast<int>(g) < shard_map_.servers_size()) {
        FillServerEntry(g, br, shard_map_.mutable_servers(g));
        BroadcastShardMap();
      }
    } else {
      primary_of_[g] = -1;
      {
        MutexLock l(&mu_);
        ++counters_.groups_lost;
      }
      LOG(ERROR) << "coordinator: group " << g << ": primary server rank " << r
                 << " is gone and there is NO BACKUP: the state of its shards is lost. "
                    "Restart the cluster from the latest checkpoint (docs/fault-tolerance.md)";
      if (shard_map_ready_ && static_cast<int>(g) < shard_map_.servers_size()) {
        shard_map_.mutable_servers(g)->set_lost(true);
        BroadcastShardMap();
      }
    }
  }
}

void Coordinator::MaybePublishShardMap() {
  const uint32_t num_servers = NumGroups();
  if (shard_map_ready_ || ready_.size() < NumServerRanks()) return;
  shard_map_.clear_servers();
  for (uint32_t g = 0; g < num_servers; ++g) {
    if (primary_of_[g] < 0 || ServerByRank(static_cast<uint32_t>(primary_of_[g])) == nullptr) {
      return;
    }
    FillServerEntry(g, static_cast<uint32_t>(primary_of_[g]), shard_map_.add_servers());
  }
  shard_map_ready_ = true;
  dirty_ = true;
  shard_map_.set_epoch(epoch());
  LOG(INFO) << "coordinator: shard map ready (" << shard_map_.chunks_size() << " chunks, "
            << num_servers << " servers); sending to " << awaiting_map_.size() << " workers";
  for (auto& [fd, c] : conns_) {
    if (!c->joined || c->closing) continue;
    if (std::find(awaiting_map_.begin(), awaiting_map_.end(), c->member.member_id()) !=
        awaiting_map_.end()) {
      Queue(c.get(), ShardMapFor(c->member));
    }
  }
  awaiting_map_.clear();
}

void Coordinator::Close(Conn* c, const std::string& why, bool protocol_error) {
  if (c->closing) return;
  c->closing = true;
  if (protocol_error) {
    LOG(WARNING) << "coordinator: closing " << c->peer << ": " << why;
    MutexLock l(&mu_);
    ++counters_.protocol_errors;
  } else {
    LOG(INFO) << "coordinator: closing " << c->peer << ": " << why;
  }
  // A worker that left before the shard map was ready is not waited for any more.
  awaiting_map_.erase(
      std::remove(awaiting_map_.begin(), awaiting_map_.end(), c->member.member_id()),
      awaiting_map_.end());
  if (c->joined) {
    c->joined = false;
    {
      MutexLock l(&mu_);
      ++counters_.departures;
    }
    Publish("member " + std::to_string(c->member.member_id()) + " departed: " + why,
            c->member.member_id());
    if (c->member.role() == ROLE_SERVER) ServerDeparted(c->member);
  }
  c->fd.reset();
}

void Coordinator::Queue(Conn* c, const Envelope& e) {
  auto frame = EncodeFrame(e, options_.max_frame_bytes);
  if (!frame.ok()) {
    LOG(ERROR) << "coordinator: cannot encode " << BodyName(e) << ": " << frame.status();
    return;
  }
  if (c->out.size() - c->out_off + frame->size() > options_.max_pending_output) {
    Close(c, "too slow: pending output over the limit", false);
    return;
  }
  if (c->out_off > 0 && c->out_off == c->out.size()) {
    c->out.clear();
    c->out_off = 0;
  }
  c->out += *frame;
  FlushOutput(c);
}

void Coordinator::FlushOutput(Conn* c) {
  while (!c->closing && c->out_off < c->out.size()) {
    const ssize_t k = send(c->fd.get(), c->out.data() + c->out_off, c->out.size() - c->out_off,
                           MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      c->out_off += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
    Close(c, std::string("send: ") + strerror(errno), false);
    return;
  }
}

void Coordinator::Publish(const std::string& reason, uint32_t departed) {
  Envelope e;
  Membership* m = e.mutable_membership();
  {
    MutexLock l(&mu_);
    m->set_epoch(membership_.epoch() + 1);
  }
  m->set_reason(reason);
  if (departed != 0) m->add_departed(departed);
  for (auto& [fd, c] : conns_) {
    if (c->joined && !c->closing) *m->add_members() = c->member;
  }
  for (auto& [id, p] : pending_) *m->add_members() = p.member;  // expected back
  std::sort(m->mutable_members()->begin(), m->mutable_members()->end(),
            [](const Member& a, const Member& b) { return a.member_id() < b.member_id(); });
  {
    MutexLock l(&mu_);
    membership_ = *m;
  }
  LOG(INFO) << "coordinator: epoch " << m->epoch() << " (" << m->members_size()
            << " members): " << reason;
  dirty_ = true;
  for (auto& [fd, c] : conns_) {
    if (c->joined && !c->closing) Queue(c.get(), e);
  }
}

void Coordinator::CheckTimeouts() {
  const auto now = Clock::now();
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (now < it->second.deadline) {
      ++it;
      continue;
    }
    const Member m = it->second.member;
    it = pending_.erase(it);
    {
      MutexLock l(&mu_);
      ++counters_.departures;
    }
    LOG(WARNING) << "coordinator: member " << m.member_id() << " did not rejoin within "
                 << options_.rejoin_grace.count() << " ms of the restart; declared departed";
    Publish("member " + std::to_string(m.member_id()) + " did not rejoin", m.member_id());
    if (m.role() == ROLE_SERVER) ServerDeparted(m);
  }
  const auto hb_timeout = std::chrono::milliseconds(options_.config.heartbeat_timeout_ms());
  for (auto& [fd, c] : conns_) {
    if (c->closing) continue;
    if (!c->joined && now - c->opened > options_.handshake_timeout) {
      Close(c.get(), "no join within the handshake timeout", true);
    } else if (c->joined && now - c->last_heard > hb_timeout) {
      {
        MutexLock l(&mu_);
        ++counters_.heartbeat_timeouts;
      }
      Close(c.get(), "no heartbeat for " + std::to_string(hb_timeout.count()) + " ms", false);
    }
  }
}

void Coordinator::SaveState() {
  dirty_ = false;
  CoordinatorState st;
  {
    MutexLock l(&mu_);
    st.set_epoch(membership_.epoch());
    *st.mutable_members() = membership_.members();
  }
  st.set_next_member_id(next_member_id_);
  st.set_credential_secret(credential_secret_);
  st.set_model_registered(model_registered_);
  *st.mutable_model() = model_;
  st.set_plan_fingerprint(plan_fingerprint_);
  st.set_shards_assigned(shards_assigned_);
  st.set_shard_map_ready(shard_map_ready_);
  *st.mutable_shard_map() = shard_map_;
  for (int64_t p : primary_of_) st.add_primary_of(p);
  for (int64_t b : backup_of_) st.add_backup_of(b);
  for (bool t : target_sent_) st.add_target_sent(t);
  for (const auto& [rank, r] : ready_) {
    st.add_ready_ranks(rank);
    *st.add_ready() = r;
  }
  for (uint32_t id : has_model_ids_) st.add_model_members(id);
  std::string bytes;
  if (!st.SerializeToString(&bytes)) {
    LOG(ERROR) << "coordinator: cannot serialise its state";
    return;
  }
  const std::string tmp = options_.state_file + ".tmp";
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  bool ok = fd.valid() && fdio::WriteAll(fd.get(), bytes.data(), bytes.size()).ok();
  ok = ok && fsync(fd.get()) == 0;
  fd.reset();
  if (!ok || rename(tmp.c_str(), options_.state_file.c_str()) != 0) {
    PLOG(ERROR) << "coordinator: cannot save its state to " << options_.state_file
                << " (a restart would not take the members back)";
    unlink(tmp.c_str());
  }
}

std::string Coordinator::CredentialOf(const Member& m) const {
  return MemberCredential(credential_secret_,
                          {m.member_id(), static_cast<int>(m.role()), m.rank()});
}

Envelope Coordinator::ShardMapFor(const Member& worker) const {
  Envelope e;
  ShardMap* map = e.mutable_shard_map();
  *map = shard_map_;
  map->set_epoch(epoch());
  const Identity client{worker.member_id(), static_cast<int>(worker.role()), worker.rank()};
  for (ServerEntry& se : *map->mutable_servers()) {
    if (se.lost()) continue;
    const std::string server_credential =
        MemberCredential(credential_secret_, {se.member_id(), ROLE_SERVER, se.server_rank()});
    se.set_peer_key(PeerKey(server_credential, client));
  }
  return e;
}

Status Coordinator::LoadState() {
  UniqueFd fd(open(options_.state_file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return Status::OK();  // a fresh cluster
    return ErrnoError("open " + options_.state_file, errno);
  }
  std::string bytes;
  char buf[1 << 16];
  while (true) {
    const ssize_t k = read(fd.get(), buf, sizeof(buf));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return ErrnoError("read " + options_.state_file, errno);
    if (k == 0) break;
    bytes.append(buf, static_cast<size_t>(k));
    if (bytes.size() > (256u << 20)) return DataLossError(options_.state_file + ": too large");
  }
  CoordinatorState st;
  if (!st.ParseFromString(bytes)) {
    return DataLossError(options_.state_file + ": not a coordinator state (corrupt?)");
  }
  next_member_id_ = std::max<uint32_t>(st.next_member_id(), 1);
  if (st.credential_secret().size() == 32) {
    credential_secret_ = st.credential_secret();
  } else if (!st.members().empty()) {
    LOG(WARNING) << "coordinator: " << options_.state_file
                 << " has no credential secret (an older version wrote it): its members cannot "
                    "prove who they are and must join anew";
  }
  model_registered_ = st.model_registered();
  model_ = st.model();
  plan_fingerprint_ = st.plan_fingerprint();
  shards_assigned_ = st.shards_assigned();
  shard_map_ready_ = st.shard_map_ready();
  shard_map_ = st.shard_map();
  primary_of_.assign(st.primary_of().begin(), st.primary_of().end());
  backup_of_.assign(st.backup_of().begin(), st.backup_of().end());
  target_sent_.assign(st.target_sent().begin(), st.target_sent().end());
  for (int i = 0; i < st.ready_ranks_size() && i < st.ready_size(); ++i) {
    ready_[st.ready_ranks(i)] = st.ready(i);
  }
  has_model_ids_.assign(st.model_members().begin(), st.model_members().end());
  const auto deadline = Clock::now() + options_.rejoin_grace;
  for (const Member& m : st.members()) pending_[m.member_id()] = Pending{m, deadline};
  {
    MutexLock l(&mu_);
    membership_.set_epoch(st.epoch());
    *membership_.mutable_members() = st.members();
  }
  LOG(WARNING) << "coordinator: restarted from " << options_.state_file << " at epoch "
               << st.epoch() << "; expecting " << pending_.size() << " members back within "
               << options_.rejoin_grace.count() << " ms";
  return Status::OK();
}

}  // namespace shardps::control
