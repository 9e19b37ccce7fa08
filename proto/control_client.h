// ControlClient: a member's side of the control plane (servers and workers use it alike).
// Join() connects to the coordinator, presents the cluster token and waits for the reply; a
// background thread then sends heartbeats and receives Membership updates. Every heartbeat the
// coordinator acknowledges renews this member's lease (lease_ms from the heartbeat's sending):
// a replicated primary serves only while it holds one (docs/fault-tolerance.md, "Liveness").
//
// Thread safety: all public methods may be called from any thread. The background thread owns
// the socket's receive side; sends are serialised by a mutex.
#ifndef SHARDPS_PROTO_CONTROL_CLIENT_H_
#define SHARDPS_PROTO_CONTROL_CLIENT_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "proto/control.pb.h"
#include "proto/framing.h"

namespace shardps::control {

struct ControlClientOptions {
  std::string coordinator_address;
  std::string cluster_token;
  JoinRequest join;  // role, hostname, pid, data_address, transport, regions...
  std::chrono::milliseconds connect_timeout{10000};
  // When the control connection breaks (the coordinator died or restarted), rejoin as the same
  // member (JoinRequest.previous_member_id) for up to this long before giving up; 0 = never.
  // A coordinator that declared this member dead refuses: status() then says so.
  std::chrono::milliseconds rejoin_window{60000};
  // Optional: fills the MemberStats each periodic heartbeat carries (`shardps status`). Called
  // on the control client's own thread before every heartbeat: it must be thread-safe, quick and
  // must not call back into the ControlClient. Heartbeats stay periodic: a training step still
  // sends no control message.
  std::function<void(MemberStats*)> heartbeat_stats;
};

struct ControlCounters {
  uint64_t heartbeats_sent = 0;
  uint64_t other_messages_sent = 0;  // everything but heartbeats
  uint64_t messages_received = 0;
  uint64_t rejoins = 0;  // reconnections to a (restarted) coordinator as the same member
  uint64_t leader_moves = 0;  // HA: moves to a new leader while the old one was silent
  uint64_t heartbeat_acks = 0;  // leases granted
};

class ControlClient {
 public:
  static StatusOr<std::unique_ptr<ControlClient>> Join(const ControlClientOptions& options);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  const JoinReply& reply() const { return reply_; }
  uint32_t member_id() const { return reply_.member_id(); }
  Membership membership() const;
  uint64_t epoch() const;
  // OK while the coordinator is reachable; the reason otherwise.
  Status status() const;
  // False while the connection is broken and a rejoin is being attempted.
  bool connected() const { return connected_.load(); }
  // The lease: held until the sending of the newest acknowledged heartbeat plus the lease it
  // was granted. Before the first acknowledgement there is none.
  bool LeaseHeld() const { return Clock::now().time_since_epoch().count() < lease_until_.load(); }
  // Whether any heartbeat acknowledgement has granted a lease yet (false at start-up).
  bool LeaseEverGranted() const { return lease_until_.load() != 0; }
  // Until the lease ends (negative: it ended that long ago; min() if never granted).
  std::chrono::milliseconds LeaseLeft() const;
  ControlCounters counters() const;

  // Waits until pred(membership) holds, the connection fails, the coordinator sends an Error
  // (returned as FAILED_PRECONDITION, and left for WaitMessage), or the timeout passes.
  StatusOr<Membership> WaitFor(const std::function<bool(const Membership&)>& pred,
                               std::chrono::milliseconds timeout);
  // Sends a control message (register_model, shards_ready, ...). Counted in
  // counters().other_messages_sent. While the connection is being re-established (a
  // coordinator restart) it waits for that, up to `wait_for_rejoin`, instead of failing.
  Status Send(const Envelope& e,
              std::chrono::milliseconds wait_for_rejoin = std::chrono::milliseconds(10000));
  // Send(), and again after every rejoin until Forget(e.body_case()): for requests a
  // coordinator that dies before saving them would lose (RegisterModel, ShardsReady); the
  // coordinator takes them idempotently.
  Status SendAndRepeatOnRejoin(const Envelope& e);
  void Forget(Envelope::BodyCase body);
  // Waits for the next message with the given body (join replies, heartbeats and membership
  // are handled internally; an Error from the coordinator is returned as an error).
  StatusOr<Envelope> WaitMessage(Envelope::BodyCase body, std::chrono::milliseconds timeout);

  // Sends Leave and closes; the coordinator publishes the departure.
  Status Leave(const std::string& reason);

 private:
  using Clock = std::chrono::steady_clock;
  ControlClient() = default;
  void Loop();
  void SendHeartbeat(Status* error);  // loop thread
  void OnHeartbeatAck(const HeartbeatAck& ack);  // loop thread
  Status DrainDecoder();  // decodes every buffered frame (loop thread)
  void Fail(const Status& s);
  // Loop thread: the connection broke for `why`; rejoin within the window or fail.
  bool Rejoin(const Status& why);
  enum class RejoinResult { kJoined, kNoAnswer, kRefused, kBroken };
  // Loop thread: one rejoin at `address`. kJoined: fd_ is that connection now (the old one
  // closed). kRefused / kBroken: Fail()ed (a refusal while probing_ is kNoAnswer instead).
  RejoinResult TryRejoin(const std::string& address, std::chrono::milliseconds connect_timeout,
                         std::chrono::milliseconds reply_timeout, Status* last);
  // Loop thread, HA (several coordinator addresses): a leader stopped or descheduled past its
  // etcd lease is replaced while its socket stays open, so nothing breaks for its members;
  // they would wait on it while the new leader declares them departed at the end of its rejoin
  // grace. Silent for max(1 s, 10 heartbeats), at most half the rejoin grace, a member tries
  // the other addresses (a standby does not listen: refused at once; a deposed leader answers
  // nothing); one that takes it back is the leader, and it moves there. The connection it has
  // is kept otherwise. False: the move broke the client (Fail()ed); the loop ends.
  bool MaybeMoveToNewLeader(Clock::time_point now, Clock::time_point* next_probe);
  // The socket's fd, for the loop thread's receive side (and Create's, before the loop starts).
  int LoopFd() EXCLUDES(send_mu_) {
    MutexLock l(&send_mu_);
    return fd_.get();
  }

  ControlClientOptions options_;

  // The socket: replaced (Rejoin) and closed (Leave) under send_mu_; Send writes to it under
  // send_mu_; the loop thread reads it through LoopFd().
  UniqueFd fd_ GUARDED_BY(send_mu_);
  uint64_t generation_ GUARDED_BY(send_mu_) = 0;  // connections made (Rejoin counts them)
  JoinReply reply_;
  FrameDecoder decoder_;  // loop thread (Create before it starts)
  std::thread thread_;
  std::atomic<bool> stop_{false};
  // Set by Leave() before it sends: the coordinator closing the connection after that is the
  // expected end, not a lost coordinator (logged at INFO, not WARNING).
  std::atomic<bool> leaving_{false};
  std::atomic<bool> connected_{true};
  std::vector<std::string> addresses_;  // every coordinator's (set by Join, then constant)
  std::string address_;         // loop thread (Join's before): the coordinator connected to
  Clock::time_point last_heard_;  // loop thread: when it last sent this member anything
  bool probing_ = false;          // loop thread: inside MaybeMoveToNewLeader
  // Heartbeats sent and not yet acknowledged, oldest first (loop thread only): seq, sent at.
  std::deque<std::pair<uint64_t, Clock::time_point>> unacked_;
  uint64_t heartbeat_seq_ = 0;  // loop thread
  std::atomic<uint64_t> epoch_{0};  // membership_.epoch(), readable without mu_ (hot paths)
  std::atomic<Clock::rep> lease_until_{0};  // steady-clock ticks; 0 = never granted
  Mutex send_mu_;
  std::vector<Envelope> repeat_ GUARDED_BY(send_mu_);  // re-sent after every rejoin

  mutable Mutex mu_;
  CondVar cv_;  // signalled on a new message, membership or status_
  Membership membership_ GUARDED_BY(mu_);
  std::deque<Envelope> inbox_ GUARDED_BY(mu_);
  Status status_ GUARDED_BY(mu_);
  ControlCounters counters_ GUARDED_BY(mu_);
};

}  // namespace shardps::control

#endif  // SHARDPS_PROTO_CONTROL_CLIENT_H_
