#include "proto/control_client.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include <glog/logging.h>

#include "common/net.h"

namespace shardps::control {

using Clock = std::chrono::steady_clock;

namespace {

// "a:p,b:p": the coordinators of an HA cluster (only the leader listens), or one address.
std::vector<std::string> Addresses(const std::string& list) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= list.size()) {
    size_t comma = list.find(',', p);
    if (comma == std::string::npos) comma = list.size();
    if (comma > p) out.push_back(list.substr(p, comma - p));
    p = comma + 1;
  }
  if (out.empty()) out.push_back(list);
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<ControlClient>> ControlClient::Join(const ControlClientOptions& options) {
  std::unique_ptr<ControlClient> c(new ControlClient());
  // Launchers (mpirun MPMD, ssh, schedulers) start members and the coordinator together, so a
  // refused or unreachable coordinator is retried until connect_timeout, then reported. With
  // several addresses (HA coordinators) each is tried in turn: only the leader listens.
  const std::vector<std::string> addresses = Addresses(options.coordinator_address);
  const auto deadline = Clock::now() + options.connect_timeout;
  Envelope join;
  *join.mutable_join() = options.join;
  join.mutable_join()->set_cluster_token(options.cluster_token);
  Envelope r;
  bool logged = false;
  for (size_t attempt = 0;; ++attempt) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const std::chrono::milliseconds bound =
        addresses.size() > 1 ? std::min(left, std::chrono::milliseconds(1000)) : left;
    StatusOr<UniqueFd> fd = net::ConnectTcp(addresses[attempt % addresses.size()], "",
                                            std::max(bound, std::chrono::milliseconds(1)));
    Status st = fd.status();
    if (fd.ok()) {
      {
        MutexLock l(&c->send_mu_);
        c->fd_ = std::move(*fd);
      }
      c->decoder_ = FrameDecoder();
      st = SendMagic(c->LoopFd(), options.connect_timeout);
      if (st.ok()) st = c->Send(join, std::chrono::milliseconds(0));
      if (st.ok()) {
        auto rest = std::max(std::chrono::milliseconds(1),
                             std::chrono::duration_cast<std::chrono::milliseconds>(
                                 deadline - Clock::now()));
        // HA: a coordinator that accepts the connection and answers nothing (a leader stopped
        // past its lease, its socket still open) must not hold the join until the deadline:
        // the next address is tried after a few seconds.
        if (addresses.size() > 1) rest = std::min(rest, std::chrono::milliseconds(3000));
        StatusOr<Envelope> got = ReceiveEnvelope(c->LoopFd(), &c->decoder_, rest);
        if (got.ok()) {
          r = std::move(*got);
          c->address_ = addresses[attempt % addresses.size()];
          break;
        }
        st = got.status();
        if (addresses.size() > 1 && st.code() == StatusCode::kDeadlineExceeded) {
          st = UnavailableError(addresses[attempt % addresses.size()] + ": " + st.message());
        }
      }
      // The coordinator went away during the handshake (it died or is restarting before it
      // answered): nothing was granted, so the join is tried again while time remains.
      MutexLock l(&c->send_mu_);
      c->fd_.reset();
    }
    if (st.code() != StatusCode::kUnavailable ||
        Clock::now() + std::chrono::milliseconds(200) >= deadline) {
      return st;
    }
    if (!logged) {
      LOG(INFO) << "coordinator " << options.coordinator_address << " not reachable yet ("
                << st.message() << "); retrying for up to " << options.connect_timeout.count()
                << " ms";
      logged = true;
    }
    if ((attempt + 1) % addresses.size() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  if (r.body_case() != Envelope::kJoinReply) {
    return InternalError(std::string("coordinator answered the join with ") + BodyName(r));
  }
  if (!r.join_reply().accepted()) {
    return PermissionDeniedError("coordinator refused the join: " + r.join_reply().error());
  }
  c->reply_ = r.join_reply();
  c->options_ = options;
  c->addresses_ = addresses;
  {
    MutexLock l(&c->mu_);
    c->counters_.messages_received = 1;
  }
  c->thread_ = std::thread([p = c.get()] { p->Loop(); });
  return c;
}

ControlClient::~ControlClient() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

Status ControlClient::Send(const Envelope& e, std::chrono::milliseconds wait_for_rejoin) {
  const auto deadline = Clock::now() + wait_for_rejoin;
  uint64_t failed_generation = ~uint64_t{0};  // the connection a send broke on
  while (true) {
    {
      MutexLock l(&send_mu_);
      if (fd_.valid() && generation_ != failed_generation) {
        const Status sent = SendEnvelope(fd_.get(), e, std::chrono::milliseconds(5000));
        if (!sent.ok()) {
          // The connection broke under this send (the coordinator died) before the loop thread
          // noticed: wait for its rejoin and send again, as for a connection already broken.
          if (sent.code() != StatusCode::kUnavailable || wait_for_rejoin.count() <= 0 ||
              options_.rejoin_window.count() <= 0) {
            return sent;
          }
          failed_generation = generation_;
          continue;
        }
        MutexLock l2(&mu_);
        if (e.body_case() == Envelope::kHeartbeat) {
          ++counters_.heartbeats_sent;
        } else {
          ++counters_.other_messages_sent;
        }
        return Status::OK();
      }
    }
    // Rejoin() replaces fd_ once a restarted coordinator takes this member back.
    if (stop_.load() || !status().ok() || Clock::now() >= deadline) {
      return UnavailableError("control connection closed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void ControlClient::Fail(const Status& s) {
  MutexLock l(&mu_);
  if (status_.ok()) {
    status_ = s;
    if (leaving_.load()) {
      VLOG(1) << "control: the coordinator closed the connection after Leave: " << s;
    } else {
      LOG(WARNING) << "control: lost the coordinator: " << s;
    }
  }
  cv_.SignalAll();
}

void ControlClient::Loop() {
  const auto interval =
      std::chrono::milliseconds(std::max<uint32_t>(10, reply_.config().heartbeat_interval_ms()));
  // Frames that arrived together with the join reply are already in the decoder.
  Status first = DrainDecoder();
  if (!first.ok()) {
    Fail(first);
    return;
  }
  auto next_hb = Clock::now();
  auto next_probe = Clock::now();
  last_heard_ = Clock::now();
  while (!stop_.load()) {
    if (!MaybeMoveToNewLeader(Clock::now(), &next_probe)) return;
    if (Clock::now() >= next_hb) {
      Status s;
      SendHeartbeat(&s);
      if (!s.ok()) {
        if (!Rejoin(s)) return;
        continue;
      }
      next_hb = Clock::now() + interval;
    }
    const int fd = LoopFd();
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, 20);
    if (r <= 0) continue;
    char buf[64 << 10];
    StatusOr<size_t> k = net::RecvSome(fd, buf, sizeof(buf), "control connection");
    if (!k.ok()) {  // "control connection: peer closed the connection" at EOF
      if (!Rejoin(k.status())) return;
      continue;
    }
    if (*k == 0) continue;
    last_heard_ = Clock::now();
    decoder_.Feed(buf, *k);
    Status st = DrainDecoder();
    if (!st.ok()) {
      Fail(st);
      return;
    }
  }
}

Status ControlClient::SendAndRepeatOnRejoin(const Envelope& e) {
  {
    MutexLock l(&send_mu_);
    repeat_.push_back(e);
  }
  return Send(e);
}

void ControlClient::Forget(Envelope::BodyCase body) {
  MutexLock l(&send_mu_);
  repeat_.erase(std::remove_if(repeat_.begin(), repeat_.end(),
                               [&](const Envelope& x) { return x.body_case() == body; }),
                repeat_.end());
}

void ControlClient::SendHeartbeat(Status* error) {
  const auto now = Clock::now();
  Envelope hb;
  hb.mutable_heartbeat()->set_member_id(reply_.member_id());
  hb.mutable_heartbeat()->set_epoch(epoch());
  hb.mutable_heartbeat()->set_seq(++heartbeat_seq_);
  hb.mutable_heartbeat()->set_sent_us(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count()));
  if (options_.heartbeat_stats) options_.heartbeat_stats(hb.mutable_heartbeat()->mutable_stats());
  // Recorded before sending: the lease counts from before the coordinator could see it.
  unacked_.emplace_back(heartbeat_seq_, now);
  if (unacked_.size() > 256) unacked_.pop_front();  // a coordinator that never answers
  *error = Send(hb, std::chrono::milliseconds(0));
}

void ControlClient::OnHeartbeatAck(const HeartbeatAck& ack) {
  if (ack.seq() == 0) return;  // a probe: the kernel's acknowledgement was the answer
  while (!unacked_.empty() && unacked_.front().first < ack.seq()) unacked_.pop_front();
  if (unacked_.empty() || unacked_.front().first != ack.seq()) return;
  const Clock::time_point until = unacked_.front().second + std::chrono::milliseconds(ack.lease_ms());
  unacked_.pop_front();
  if (until.time_since_epoch().count() > lease_until_.load()) {
    lease_until_.store(until.time_since_epoch().count());
  }
  MutexLock l(&mu_);
  ++counters_.heartbeat_acks;
}

std::chrono::milliseconds ControlClient::LeaseLeft() const {
  const Clock::rep until = lease_until_.load();
  if (until == 0) return std::chrono::milliseconds::min();
  return std::chrono::duration_cast<std::chrono::milliseconds>(
      Clock::time_point(Clock::duration(until)) - Clock::now());
}

bool ControlClient::Rejoin(const Status& why) {
  // Leaving: the coordinator closing after our Leave is the end, not a reason to rejoin.
  if (options_.rejoin_window.count() <= 0 || stop_.load() || leaving_.load()) {
    Fail(why);
    return false;
  }
  LOG(WARNING) << "control: lost the coordinator (" << why << "); rejoining as member "
               << reply_.member_id() << " for up to " << options_.rejoin_window.count() << " ms";
  connected_ = false;
  {
    MutexLock l(&send_mu_);
    fd_.reset();
  }
  const auto deadline = Clock::now() + options_.rejoin_window;
  Status last = why;
  // HA: the next leader may be any of the coordinators; try each in turn.
  const std::vector<std::string> addresses = Addresses(options_.coordinator_address);
  for (size_t attempt = 0; !stop_.load() && Clock::now() < deadline; ++attempt) {
    switch (TryRejoin(addresses[attempt % addresses.size()], std::chrono::milliseconds(1000),
                      std::chrono::milliseconds(5000), &last)) {
      case RejoinResult::kJoined:
        return true;
      case RejoinResult::kRefused:
      case RejoinResult::kBroken:
        return false;  // Fail()ed
      case RejoinResult::kNoAnswer:
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        break;
    }
  }
  Fail(UnavailableError("coordinator unreachable for " +
                        std::to_string(options_.rejoin_window.count()) +
                        " ms: " + last.ToString()));
  return false;
}

ControlClient::RejoinResult ControlClient::TryRejoin(const std::string& address,
                                                     std::chrono::milliseconds connect_timeout,
                                                     std::chrono::milliseconds reply_timeout,
                                                     Status* last) {
  StatusOr<UniqueFd> fd = net::ConnectTcp(address, "", connect_timeout);
  if (!fd.ok()) {
    *last = fd.status();
    return RejoinResult::kNoAnswer;
  }
  FrameDecoder decoder;
  Envelope e;
  *e.mutable_join() = options_.join;
  e.mutable_join()->set_cluster_token(options_.cluster_token);
  e.mutable_join()->set_previous_member_id(reply_.member_id());
  e.mutable_join()->set_previous_credential(reply_.credential());
  e.mutable_join()->set_requested_rank(static_cast<int32_t>(reply_.rank()));
  Status s = SendMagic(fd->get(), std::chrono::milliseconds(2000));
  if (s.ok()) s = SendEnvelope(fd->get(), e, std::chrono::milliseconds(2000));
  if (!s.ok()) {
    *last = s;
    return RejoinResult::kNoAnswer;
  }
  auto r = ReceiveEnvelope(fd->get(), &decoder, reply_timeout);
  if (!r.ok() || r->body_case() != Envelope::kJoinReply) {
    *last = r.ok() ? InternalError("coordinator answered the rejoin with " +
                                   std::string(BodyName(*r)))
                   : r.status();
    return RejoinResult::kNoAnswer;
  }
  if (!r->join_reply().accepted()) {
    *last = PermissionDeniedError("coordinator refused to take member " +
                                  std::to_string(reply_.member_id()) +
                                  " back: " + r->join_reply().error());
    if (probing_) return RejoinResult::kNoAnswer;  // the connection we have stays the truth
    Fail(*last);
    return RejoinResult::kRefused;
  }
  std::vector<Envelope> repeat;
  {
    MutexLock l(&send_mu_);
    fd_ = std::move(*fd);  // closes the connection to the coordinator left behind, if any
    ++generation_;
    decoder_ = std::move(decoder);
    repeat = repeat_;
  }
  address_ = address;
  last_heard_ = Clock::now();
  for (const Envelope& x : repeat) {
    Status rs = Send(x, std::chrono::milliseconds(0));
    if (!rs.ok()) LOG(WARNING) << "control: re-sending " << BodyName(x) << " after the rejoin: " << rs;
  }
  {
    MutexLock l(&mu_);
    ++counters_.rejoins;
  }
  connected_ = true;
  LOG(WARNING) << "control: rejoined the coordinator at " << address << " as member "
               << reply_.member_id() << " (epoch " << r->join_reply().epoch() << ")";
  Status d = DrainDecoder();
  if (!d.ok()) {
    Fail(d);
    return RejoinResult::kBroken;
  }
  return RejoinResult::kJoined;
}

bool ControlClient::MaybeMoveToNewLeader(Clock::time_point now, Clock::time_point* next_probe) {
  if (addresses_.size() < 2 || options_.rejoin_window.count() <= 0 || leaving_.load()) {
    return true;
  }
  using std::chrono::milliseconds;
  const auto interval = milliseconds(std::max<uint32_t>(10, reply_.config().heartbeat_interval_ms()));
  // The new leader waits its rejoin grace (>= the lease) for this member, from its election,
  // which comes after the old leader's stop: probing within half of it leaves time to move.
  const ClusterConfig& cfg = reply_.config();
  const uint32_t grace_ms = cfg.rejoin_grace_ms() != 0 ? cfg.rejoin_grace_ms() : cfg.lease_ms();
  auto probe_after = std::max(milliseconds(1000), 10 * interval);
  if (grace_ms != 0) probe_after = std::min(probe_after, milliseconds(grace_ms / 2));
  probe_after = std::max(probe_after, 3 * interval);
  if (now - last_heard_ < probe_after || now < *next_probe) return true;
  *next_probe = now + probe_after / 2;
  // Long enough for a leader that writes its state to etcd before it answers (giving up after
  // it took us back would read to it as this member's departure); only a process that accepts
  // the connection and then answers nothing (a stopped one) makes this thread wait it out.
  const auto reply_timeout = std::clamp(20 * interval, milliseconds(1000), milliseconds(3000));
  const std::string old = address_;
  const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_heard_);
  probing_ = true;
  bool ok = true;
  for (const std::string& a : addresses_) {
    if (a == old) continue;
    Status why;
    const RejoinResult r = TryRejoin(a, milliseconds(200), reply_timeout, &why);
    if (r == RejoinResult::kJoined) {
      {
        MutexLock l(&mu_);
        ++counters_.leader_moves;
      }
      LOG(WARNING) << "control: moved to the coordinator at " << a << ": the one at " << old
                   << " was silent for " << silent.count()
                   << " ms and another took this member back (a new leader)";
      break;
    }
    if (r != RejoinResult::kNoAnswer) {
      ok = false;  // kBroken: Fail()ed
      break;
    }
    VLOG(1) << "control: coordinator " << a << " did not take this member: " << why;
  }
  probing_ = false;
  return ok;
}

Status ControlClient::DrainDecoder() {
  Envelope env;
  while (true) {
    ASSIGN_OR_RETURN(bool got, decoder_.Next(&env));
    if (!got) return Status::OK();
    if (env.body_case() == Envelope::kHeartbeatAck) {
      OnHeartbeatAck(env.heartbeat_ack());
      continue;
    }
    MutexLock l(&mu_);
    ++counters_.messages_received;
    if (env.body_case() == Envelope::kMembership) {
      if (env.membership().epoch() > membership_.epoch()) {
        membership_ = env.membership();
        epoch_.store(membership_.epoch());
      }
    } else {
      inbox_.push_back(env);
    }
    cv_.SignalAll();
  }
}

Membership ControlClient::membership() const {
  MutexLock l(&mu_);
  return membership_;
}

uint64_t ControlClient::epoch() const { return epoch_.load(); }

Status ControlClient::status() const {
  MutexLock l(&mu_);
  return status_;
}

ControlCounters ControlClient::counters() const {
  MutexLock l(&mu_);
  return counters_;
}

StatusOr<Membership> ControlClient::WaitFor(const std::function<bool(const Membership&)>& pred,
                                            std::chrono::milliseconds timeout) {
  MutexLock l(&mu_);
  // An Error from the coordinator (a start-up that failed) ends the wait too: it is final.
  auto error = [&]() REQUIRES(mu_) {
    return std::find_if(inbox_.begin(), inbox_.end(), [](const Envelope& e) {
      return e.body_case() == Envelope::kError;
    });
  };
  const bool ok = cv_.WaitFor(&mu_, timeout, [&]() REQUIRES(mu_) {
    return !status_.ok() || pred(membership_) || error() != inbox_.end();
  });
  if (!status_.ok()) return status_;
  if (auto it = error(); it != inbox_.end()) {
    return FailedPreconditionError("coordinator: " + it->error().message());
  }
  if (!ok) return DeadlineExceededError("membership condition not met in time");
  return membership_;
}

StatusOr<Envelope> ControlClient::WaitMessage(Envelope::BodyCase body,
                                              std::chrono::milliseconds timeout) {
  MutexLock l(&mu_);
  const auto deadline = Clock::now() + timeout;
  while (true) {
    for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
      if (it->body_case() == body || it->body_case() == Envelope::kError) {
        Envelope e = std::move(*it);
        inbox_.erase(it);
        if (e.body_case() == Envelope::kError && body != Envelope::kError) {
          return FailedPreconditionError("coordinator: " + e.error().message());
        }
        return e;
      }
    }
    if (!status_.ok()) return status_;
    if (cv_.WaitUntil(&mu_, deadline) == std::cv_status::timeout) {
      return DeadlineExceededError("control: no message of the expected kind in time");
    }
  }
}

Status ControlClient::Leave(const std::string& reason) {
  Envelope e;
  e.mutable_leave()->set_member_id(reply_.member_id());
  e.mutable_leave()->set_reason(reason);
  leaving_ = true;
  Status s = Send(e, std::chrono::milliseconds(0));  // a lost coordinator sees the close
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  MutexLock l(&send_mu_);
  fd_.reset();
  return s;
}

}  // namespace shardps::control
