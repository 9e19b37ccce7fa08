#include "server/coordinator.h"

#include "server/coordinator_conn.h"

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
#include "common/stall_point.h"
#include "common/trace.h"
#include "proto/credentials.h"

namespace shardps::control {

Coordinator::Coordinator(const CoordinatorOptions& options) : options_(options) {}

StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options,
                                                          UniqueFd bound) {
  if (options.cluster_token.empty()) {
    return InvalidArgumentError("coordinator: an empty cluster token is not allowed");
  }
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  ClusterConfig& config = c->options_.config;
  if (config.rejoin_grace_ms() == 0 && options.rejoin_grace.count() > 0) {
    config.set_rejoin_grace_ms(static_cast<uint32_t>(options.rejoin_grace.count()));
  }
  ASSIGN_OR_RETURN(c->timeouts_, FaultTimeouts::Derive(&config));
  c->options_.rejoin_grace = c->timeouts_.rejoin_grace;
  if (bound.valid()) {
    ASSIGN_OR_RETURN(c->address_, net::ListenOnBound(bound.get()));
    c->listen_fd_ = std::move(bound);
  } else {
    ASSIGN_OR_RETURN(c->listen_fd_, net::ListenTcp(options.listen_address, &c->address_));
  }
  RETURN_IF_ERROR(net::SetNonBlocking(c->listen_fd_.get(), true));
  c->wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!c->wake_fd_.valid()) return ErrnoError("eventfd", errno);
  ASSIGN_OR_RETURN(c->credential_secret_, crypto::RandomBytes(32));
  if (c->Persistent()) RETURN_IF_ERROR(c->LoadState());
  c->thread_ = std::thread([p = c.get()] { p->Loop(); });
  LOG(INFO) << "coordinator: listening on " << c->address_ << "; liveness: "
            << c->timeouts_.ToString();
  return c;
}

Coordinator::~Coordinator() { Stop(); }

void Coordinator::Stop() {
  if (stop_.exchange(true)) return;
  uint64_t one = 1;
  // (No wake descriptor: Start failed before the loop existed.)
  if (wake_fd_.valid() && write(wake_fd_.get(), &one, sizeof(one)) < 0) {
    PLOG(WARNING) << "coordinator: wake";
  }
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
  const auto tick_ms = std::chrono::milliseconds(
      std::max<int>(10, static_cast<int>(timeouts_.heartbeat_interval.count() / 4)));
  auto last_pass = Clock::now();
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({listen_fd_.get(), POLLIN, 0});
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    for (auto& [fd, c] : conns_) {
      short ev = POLLIN;
      if (c->out_off < c->out.size()) ev |= POLLOUT;
      fds.push_back({fd, ev, 0});
    }
    const int n = poll(fds.data(), fds.size(), static_cast<int>(tick_ms.count()));
    if (n < 0 && errno != EINTR) {
      PLOG(ERROR) << "coordinator: poll";
      continue;
    }
    // A pass takes at most one tick plus a little work. Longer means this thread was
    // descheduled (a busy host, a slow disk under SaveState): its members were not silent for
    // that long, it was not listening. Forgiven before anyone's silence is judged, and judged
    // against `now`, taken here: a pause later in this pass (reading, handling, saving) is
    // not in it, and is measured and forgiven by the next pass before it judges anyone. (The
    // pause check once came before the reads, and CheckTimeouts took a fresh clock: a stop
    // landing between the two was judged as every member's silence.)
    StallPoint("coordinator.after_poll");
    const Clock::time_point now = Clock::now();
    if (!LeaseConfirmed(now)) {
      // Not `last_pass`: the wait is forgiven, with the pause before it, once the lease is
      // confirmed and this loop judges again.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    {
      const auto pass = now - last_pass;
      last_pass = now;
      const auto allowed = tick_ms + std::chrono::milliseconds(100);
      if (pass > allowed) {
        ForgivePause(std::chrono::duration_cast<std::chrono::microseconds>(pass - tick_ms), now);
      }
    }
    if (fds[0].revents & POLLIN) AcceptNew();
    // HA: the lease is checked again before each member is served and before anyone is
    // judged, so a stop inside this pass holds back the rest of it (the next pass forgives it).
    bool confirmed = true;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (options_.lead_until_ns != nullptr && !LeaseConfirmed(Clock::now())) {
        confirmed = false;
        break;
      }
      auto it = conns_.find(fds[i].fd);
      if (it == conns_.end()) continue;
      Conn* c = it->second.get();
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) ReadFrom(c);
      if (!c->closing && (fds[i].revents & POLLOUT)) FlushOutput(c);
      StallPoint("coordinator.mid_pass");
    }
    StallPoint("coordinator.before_timeouts");
    if (!confirmed || (options_.lead_until_ns != nullptr && !LeaseConfirmed(Clock::now()))) {
      continue;
    }
    CheckTimeouts(now);
    for (auto it = conns_.begin(); it != conns_.end();) {
      it = it->second->closing ? conns_.erase(it) : std::next(it);
    }
    if (dirty_) {
      if (!Persistent()) {
        dirty_ = false;
      } else {
        SaveState();
      }
      dirty_ = false;  // a failed save was logged; the messages must go out regardless
      for (auto& [fd, c] : conns_) {
        if (!c->closing && c->out_off < c->out.size()) FlushOutput(c.get());
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
    PhiAccrualDetector::Options liveness;
    liveness.expected_interval = timeouts_.heartbeat_interval;
    liveness.min_stddev = std::max<std::chrono::microseconds>(
        std::chrono::milliseconds(20), timeouts_.heartbeat_interval / 10);
    auto c = std::make_unique<Conn>(options_.max_frame_bytes, liveness);
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
    if (c->status_answered) {
      Close(c, std::string("a message after a status request: ") + BodyName(e), true);
      return;
    }
    if (e.body_case() == Envelope::kStatusRequest) {
      HandleStatusRequest(c, e.status_request());
      return;
    }
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
    case Envelope::kReplicaSynced:
      if (c->member.role() != ROLE_SERVER) {
        Close(c, "replica_synced from a non-server", true);
        return;
      }
      HandleReplicaSynced(c, e.replica_synced());
      return;
    case Envelope::kCheckpoint:
      if (c->member.role() != ROLE_WORKER) {
        Close(c, "checkpoint request from a non-worker", true);
        return;
      }
      // Forwarded to every server; each checkpoints its group at that clock.
      LOG(INFO) << "coordinator: checkpoint at clock " << e.checkpoint().clock()
                << " requested by member " << c->member.member_id();
      {
        MutexLock l(&mu_);
        ++counters_.checkpoints_requested;
      }
      last_checkpoint_request_ = e.checkpoint();
      for (auto& [fd, o] : conns_) {
        if (o->joined && !o->closing && o->member.role() == ROLE_SERVER) Queue(o.get(), e);
      }
      return;
    case Envelope::kHeartbeat:
      if (e.heartbeat().member_id() != c->member.member_id()) {
        Close(c, "heartbeat names another member", true);
        return;
      }
      HandleHeartbeat(c, e.heartbeat());
      return;
    case Envelope::kBarrier:
      if (c->member.role() != ROLE_WORKER) {
        Close(c, "barrier from a non-worker", true);
        return;
      }
      HandleBarrier(c, e.barrier());
      return;
    case Envelope::kLeave:
      Close(c, "left: " + e.leave().reason(), false);
      return;
    default:
      Close(c, std::string("unexpected message ") + BodyName(e) + " from a member", true);
      return;
  }
}

void Coordinator::HandleJoin(Conn* c, const JoinRequest& j) {
  const std::string refuse = JoinRefusal(j);
  if (!refuse.empty()) {
    RefuseJoin(c, refuse, "join refused: " + refuse, true);
  } else if (j.previous_member_id() != 0) {
    HandleRejoin(c, j);
  } else {
    AdmitMember(c, j);
  }
}

std::string Coordinator::JoinRefusal(const JoinRequest& j) const {
  std::string refuse;
  if (!crypto::ConstantTimeEquals(j.cluster_token(), options_.cluster_token)) {
    refuse = "wrong cluster token";
  } else if (j.role() != ROLE_SERVER && j.role() != ROLE_WORKER) {
    refuse = "join without a valid role";
  } else if (j.spare() && j.role() != ROLE_SERVER) {
    refuse = "only a server can be a spare";
  } else if (j.hostname().size() > 255 || j.data_address().size() > 255 ||
             j.transport().size() > 64) {
    // Published to every member and shown by `shardps status`: bounded.
    refuse = "hostname, data address or transport name too long";
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
  return refuse;
}

void Coordinator::RefuseJoin(Conn* c, const std::string& error, const std::string& why,
                             bool protocol_error) {
  {
    // Counted before the reply leaves, so a refused member never sees a stale counter.
    MutexLock l(&mu_);
    ++counters_.joins_refused;
  }
  Envelope reply;
  reply.mutable_join_reply()->set_accepted(false);
  reply.mutable_join_reply()->set_error(error);
  Queue(c, reply);
  FlushOutput(c);
  Close(c, why, protocol_error);
}

void Coordinator::SendJoinAccepted(Conn* c) {
  Envelope reply;
  JoinReply* r = reply.mutable_join_reply();
  r->set_accepted(true);
  r->set_member_id(c->member.member_id());
  r->set_credential(CredentialOf(c->member));
  r->set_rank(c->member.rank());
  r->set_epoch(epoch() + 1);
  *r->mutable_config() = options_.config;
  // Training has begun: the map is out and the job's workers were all there at some point
  // (counted before this member joined). A late worker then starts at once.
  r->set_cluster_started(shard_map_ready_ &&
                         most_workers_ >= std::max<uint32_t>(1, options_.config.num_workers()));
  r->set_barrier_generation(barrier_generation_);
  Queue(c, reply);
}

void Coordinator::HandleRejoin(Conn* c, const JoinRequest& j) {
  // A member rejoining a restarted coordinator: it comes back as itself (same id and rank), if
  // this coordinator's saved state still lists it and it proves it is that member.
  auto p = pending_.find(j.previous_member_id());
  if (p != pending_.end() &&
      !crypto::ConstantTimeEquals(j.previous_credential(), CredentialOf(p->second.member))) {
    // The cluster token is not an identity: only the member itself holds its credential.
    LOG(WARNING) << "coordinator: a rejoin as member " << j.previous_member_id() << " from "
                 << j.hostname() << "/" << j.pid()
                 << " did not prove that member's credential; refused (the member may still "
                    "rejoin)";
    RefuseJoin(c,
               "rejoin as member " + std::to_string(j.previous_member_id()) +
                   " refused: the credential does not match",
               "rejoin refused: credential mismatch", true);
    return;
  }
  if (p == pending_.end() || p->second.member.role() != j.role()) {
    RefuseJoin(c,
               "member " + std::to_string(j.previous_member_id()) +
                   " is not a member of this cluster any more (declared dead, or the "
                   "coordinator restarted without its state file); restart the process to join "
                   "anew",
               "rejoin refused", false);
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
  SendJoinAccepted(c);
  LOG(INFO) << "coordinator: member " << c->member.member_id() << " rejoined (" << pending_.size()
            << " still expected)";
  if (c->member.role() == ROLE_SERVER) ResendServerOrders(c);
  Publish("member " + std::to_string(c->member.member_id()) + " rejoined", 0);
  // A coordinator restarted before it had assigned the shards assigns them once every server
  // is back (the first one's assignment never left: write-ahead, see Queue).
  if (c->member.role() == ROLE_SERVER) MaybeAssignShards();
}

void Coordinator::ResendServerOrders(Conn* c) {
  if (!shards_assigned_ || primary_of_.empty()) return;
  // A Promote or ReplicaTarget{none} queued before a coordinator crash may never have reached
  // it: both are idempotent, so send them again.
  const uint32_t g = GroupOf(c->member.rank());
  if (g >= primary_of_.size() || primary_of_[g] != static_cast<int64_t>(c->member.rank())) return;
  if (c->member.rank() != g || reassigned_.count(c->member.rank())) {  // it was promoted
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

uint32_t Coordinator::PickRank(const JoinRequest& j) const {
  // The requested rank if free, else the lowest free rank of that role.
  std::vector<bool> used;
  auto mark = [&](const Member& m) {
    if (m.role() != j.role()) return;
    if (used.size() <= m.rank()) used.resize(m.rank() + 1);
    used[m.rank()] = true;
  };
  for (auto& [fd, o] : conns_) {
    if (o->joined) mark(o->member);
  }
  for (auto& [id, p] : pending_) mark(p.member);
  // A spare takes a rank past the job's server ranks (it serves whichever group needs it).
  uint32_t rank = j.spare() ? NumServerRanks() : 0;
  if (j.spare()) {
    while (rank < used.size() && used[rank]) ++rank;
  } else if (j.requested_rank() >= 0 &&
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
  return rank;
}

void Coordinator::AdmitMember(Conn* c, const JoinRequest& j) {
  // An admission is a state change (a member id, a rank): write-ahead like every other, so
  // the JoinReply leaves only once the state holds the member. A coordinator that dies in
  // between never told anyone an id its successor does not know; the member's Join retries.
  dirty_ = true;
  const uint32_t rank = PickRank(j);
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
  m.set_spare(j.spare());
  *m.mutable_regions() = j.regions();
  {
    MutexLock l(&mu_);
    ++counters_.joins_accepted;
  }
  SendJoinAccepted(c);
  LOG(INFO) << "coordinator: member " << m.member_id() << " joined as "
            << (m.role() == ROLE_SERVER ? "server" : "worker") << " rank " << rank << " ("
            << c->peer << ")";
  Publish("member " + std::to_string(m.member_id()) + " joined", 0);
  if (m.role() == ROLE_SERVER) {
    gone_before_assignment_.erase(rank);  // a replacement for a server that died
    if (m.spare()) {
      LOG(INFO) << "coordinator: server rank " << rank
                << " is a SPARE: it becomes the backup of the first group that needs one";
    }
    // A group that lost its backup takes this server as its new one (a spare, or a server
    // started after the assignment, e.g. the restarted old primary).
    MaybeReplaceBackups();
    if (shards_assigned_ && !m.spare() && reassigned_.count(rank) == 0) {
      // Too late to be assigned anything and no group needs a backup: say so now rather than
      // let it wait for an assignment that never comes (its setup timeout).
      Envelope err;
      err.mutable_error()->set_message(
          "server rank " + std::to_string(rank) +
          " joined after the shards were assigned, and every group has its servers (a group "
          "whose server dies is failed over to its backup, and a group without a backup takes "
          "the next server that joins); it is not used (start it with --spare to keep it "
          "waiting for a group that needs a backup)");
      Queue(c, err);
      LOG(WARNING) << "coordinator: " << err.error().message();
    }
    MaybeAssignShards();
  }
}

void Coordinator::Close(Conn* c, const std::string& why, bool protocol_error) {
  if (c->closing) return;
  c->closing = true;
  // A member that goes without a Leave (its lease ran out, it is unreachable, its connection
  // broke) is the one departure an operator may have to act on: WARNING. A Leave is INFO.
  const bool unannounced = c->joined && why.rfind("left: ", 0) != 0;
  if (protocol_error) {
    LOG(WARNING) << "coordinator: closing " << c->peer << ": " << why;
    MutexLock l(&mu_);
    ++counters_.protocol_errors;
  } else if (unannounced) {
    LOG(WARNING) << "coordinator: member " << c->member.member_id() << " ("
                 << (c->member.role() == ROLE_SERVER ? "server" : "worker") << " rank "
                 << c->member.rank() << ", " << c->peer << ") is gone without leaving: " << why;
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
    if (c->member.role() == ROLE_SERVER) {
      ServerDeparted(c->member);
      MaybeFailStartUp(c->member, why);
    }
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
  // Write-ahead: a message that follows from a state change (an assignment, a promotion, a new
  // shard map, a membership) leaves only once that state is in the state file, so a coordinator
  // that dies in between never has told anyone what its successor will not know. The loop
  // flushes right after saving.
  if (!dirty_ || !Persistent()) FlushOutput(c);
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
  // A status reply is the connection's only message: closed once it is out.
  if (c->status_answered && !c->closing) Close(c, "status answered", false);
}

void Coordinator::Publish(const std::string& reason, uint32_t departed) {
  {
    uint32_t workers = 0;
    for (auto& [fd, c] : conns_) workers += c->joined && !c->closing && c->member.role() == ROLE_WORKER;
    most_workers_ = std::max(most_workers_, workers);
  }
  Envelope e;
  Membership* m = e.mutable_membership();
  {
    MutexLock l(&mu_);
    m->set_epoch(membership_.epoch() + 1);
  }
  m->set_reason(reason);
  trace::Instant("membership", "coordinator", {{"epoch", m->epoch()}, {"reason", reason}});
  m->set_workers_complete(most_workers_ >= std::max<uint32_t>(1, options_.config.num_workers()));
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
  // A departure (or a pending member's expiry) may leave every remaining worker at a barrier.
  if (departed != 0) {
    barrier_arrived_.erase(departed);
    barrier_released_.erase(departed);
  }
  MaybeReleaseBarriers();
}

void Coordinator::CheckTimeouts(Clock::time_point now) {
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
  for (auto& [fd, c] : conns_) {
    if (c->closing) continue;
    if (!c->joined && now - c->opened > options_.handshake_timeout) {
      Close(c.get(), "no join within the handshake timeout", true);
    } else if (c->joined) {
      CheckLiveness(c.get(), now);
    }
  }
}

void Coordinator::HandleHeartbeat(Conn* c, const Heartbeat& hb) {
  const auto now = Clock::now();
  {
    MutexLock l(&mu_);
    ++counters_.heartbeats;
  }
  std::chrono::microseconds member_interval(0);
  if (hb.sent_us() > c->last_sent_us && c->last_sent_us != 0) {
    member_interval = std::chrono::microseconds(hb.sent_us() - c->last_sent_us);
  }
  if (hb.sent_us() != 0) c->last_sent_us = hb.sent_us();
  c->detector.Heartbeat(now, member_interval);
  if (hb.has_stats()) NoteStats(c, hb.stats());
  if (c->suspected) {
    c->suspected = false;
    {
      MutexLock l(&mu_);
      ++counters_.suspicions_cleared;
    }
    LOG(WARNING) << "coordinator: member " << c->member.member_id() << " (" << c->peer
                 << ") spoke again after "
                 << std::chrono::duration_cast<std::chrono::milliseconds>(now - c->suspected_at)
                        .count()
                 << " ms of suspicion: slow, not dead";
  }
  if (hb.seq() == 0) return;  // a member that does not take leases
  Envelope ack;
  ack.mutable_heartbeat_ack()->set_seq(hb.seq());
  ack.mutable_heartbeat_ack()->set_lease_ms(static_cast<uint32_t>(timeouts_.lease.count()));
  Queue(c, ack);
}

void Coordinator::CheckLiveness(Conn* c, Clock::time_point now) {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  // Any byte from the member counts as life (ReadFrom); the detector's last heartbeat may be
  // older than that, never newer.
  const Clock::time_point heard = std::max(c->last_heard, c->detector.last());
  const auto silent = now - heard;
  const auto silent_ms = duration_cast<milliseconds>(silent).count();
  // The lease: the member's own view of it ends before this (it counts from sending), so a
  // primary has stopped serving by the time it is declared dead. The margin covers clock-rate
  // differences between the two hosts (100 ppm is generous) and one tick.
  const auto lease_end = timeouts_.lease + timeouts_.lease / 100 + timeouts_.heartbeat_interval / 4;
  if (silent > lease_end) {
    {
      MutexLock l(&mu_);
      ++counters_.heartbeat_timeouts;
    }
    Close(c,
          "no heartbeat for " + std::to_string(silent_ms) + " ms: its lease (" +
              std::to_string(timeouts_.lease.count()) + " ms) ran out",
          false);
    return;
  }
  const auto suspect_after = std::clamp<std::chrono::microseconds>(
      c->detector.SilenceFor(timeouts_.suspicion_phi), timeouts_.suspect_after, timeouts_.lease);
  if (!c->suspected) {
    if (silent < suspect_after) return;
    c->suspected = true;
    c->suspected_at = now;
    c->probed_at = Clock::time_point{};
    c->unacked_since = Clock::time_point{};
    {
      MutexLock l(&mu_);
      ++counters_.suspicions;
    }
    LOG(WARNING) << "coordinator: member " << c->member.member_id() << " (" << c->peer
                 << ") SUSPECTED: silent " << silent_ms << " ms (phi "
                 << static_cast<int>(c->detector.Phi(now)) << "; its heartbeat intervals: mean "
                 << c->detector.mean().count() / 1000 << " ms, sd "
                 << c->detector.stddev().count() / 1000
                 << " ms); probing its host. Declared dead if the host stops acknowledging, else "
                 << "when its lease runs out in "
                 << duration_cast<milliseconds>(timeouts_.lease - silent).count() << " ms";
  }
  // Probe: a frame the member's kernel must acknowledge even if the process is stopped or
  // descheduled. A host that is down or cut off acknowledges nothing: then the member is dead
  // now, not at its lease (its replication stream is fenced by the promotion, see Promote).
  const auto probe_every = std::max<milliseconds>(milliseconds(50), timeouts_.heartbeat_interval);
  if (now - c->probed_at >= probe_every && c->out_off == c->out.size()) {
    c->probed_at = now;
    Envelope probe;
    probe.mutable_heartbeat_ack()->set_seq(0);
    Queue(c, probe);
    if (c->closing) return;
  }
  if (!net::HasUnacknowledgedData(c->fd.get())) {
    c->unacked_since = Clock::time_point{};
    return;
  }
  if (c->unacked_since == Clock::time_point{}) c->unacked_since = now;
  const auto unacked_for = duration_cast<milliseconds>(now - c->unacked_since);
  const milliseconds confirm =
      std::max<milliseconds>(milliseconds(200), duration_cast<milliseconds>(timeouts_.suspect_after / 2));
  if (unacked_for >= confirm) {
    {
      MutexLock l(&mu_);
      ++counters_.unreachable;
      ++counters_.heartbeat_timeouts;
    }
    Close(c,
          "silent for " + std::to_string(silent_ms) + " ms and its host has acknowledged "
              "nothing for " + std::to_string(unacked_for.count()) + " ms: unreachable",
          false);
  }
}

bool Coordinator::LeaseConfirmed(Clock::time_point now) {
  if (options_.lead_until_ns == nullptr) return true;
  const int64_t until = options_.lead_until_ns->load(std::memory_order_acquire);
  const int64_t at =
      std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
  if (at < until) {
    if (lease_unconfirmed_) {
      lease_unconfirmed_ = false;
      LOG(WARNING) << "coordinator: the leader's lease is confirmed again; acting";
    }
    return true;
  }
  if (!lease_unconfirmed_) {
    lease_unconfirmed_ = true;
    {
      MutexLock l(&mu_);
      ++counters_.lease_waits;
    }
    LOG(WARNING) << "coordinator: the leader's lease is not confirmed for now (this process was "
                    "stopped or descheduled past it, or etcd is slow): acting on nothing until "
                    "it is renewed, or ending if it was lost";
  }
  return false;
}

void Coordinator::ForgivePause(std::chrono::microseconds pause, Clock::time_point now) {
  // Never past `now`: a member heard after the pause began (read after a stop that landed
  // mid-pass) is not given credit for silence it has not had yet.
  for (auto& [fd, c] : conns_) {
    c->last_heard = std::min(c->last_heard + pause, now);
    c->detector.Shift(pause, now);
    // A handshake in progress and an unacknowledged probe were not waited on either.
    c->opened = std::min(c->opened + pause, now);
    if (c->unacked_since != Clock::time_point{}) {
      c->unacked_since = std::min(c->unacked_since + pause, now);
    }
  }
  for (auto& [id, p] : pending_) p.deadline += pause;
  uint64_t n;
  {
    MutexLock l(&mu_);
    n = ++counters_.coordinator_pauses;
  }
  if (n == 1 || n % 100 == 0) {
    LOG(WARNING) << "coordinator: this process was descheduled for "
                 << std::chrono::duration_cast<std::chrono::milliseconds>(pause).count()
                 << " ms (" << n << " such pauses so far); not counted as its members' silence";
  }
}

}  // namespace shardps::control
