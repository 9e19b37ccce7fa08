// The coordinator: owns membership and publishes it, with an epoch that grows by one on every
// change. It runs as its own small process (shardps_coordinator) so that losing it never loses
// a shard, and so that it can restart without the data path noticing (docs/control-protocol.md).
//
// Protocol duties:
//  * a connection must send the magic and then a JoinRequest carrying the cluster token within
//    the handshake timeout; anything else is refused and closed;
//  * members send Heartbeats, each acknowledged with the lease it grants (HeartbeatAck). A member
//    whose connection closes is declared departed at once (its process is gone). One that is
//    silent is suspected once a phi-accrual detector over its own heartbeat intervals says so
//    (never before heartbeat_timeout); a suspected member's host is probed, and the member is
//    declared departed when its host stops acknowledging (TCP), or when its lease runs out. A
//    member that is only slow (descheduled on a busy host) is never declared departed before
//    its lease (docs/fault-tolerance.md, "Liveness"). The coordinator's own pauses are not
//    counted as its members' silence;
//  * every change is broadcast to all members as a Membership message;
//  * a malformed, oversized or unexpected message closes that connection (and removes the
//    member) and is logged; the coordinator keeps running.
//
// Thread safety: Start/Stop/accessors from any thread; the event loop runs on its own thread and
// owns all connection state. Accessors read a snapshot under a mutex.
#ifndef SHARDPS_SERVER_COORDINATOR_H_
#define SHARDPS_SERVER_COORDINATOR_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "proto/control.pb.h"
#include "proto/fault_timeouts.h"
#include "proto/framing.h"
#include "proto/shard_plan.h"

namespace shardps::control {

struct CoordinatorOptions {
  std::string listen_address = "0.0.0.0:0";
  std::string cluster_token;
  ClusterConfig config;  // heartbeat_* are taken from here (defaults applied if 0)
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
  std::chrono::milliseconds handshake_timeout{5000};
  // A member whose unsent output exceeds this is too slow and is dropped.
  size_t max_pending_output = 64u << 20;
  // Saved after every change (temp file + rename); loaded at start if it exists, and the
  // members it names may then rejoin as themselves within rejoin_grace. "" = no state file.
  std::string state_file;
  // 0 = config.rejoin_grace_ms (itself derived from the lease when 0; proto/fault_timeouts.h).
  std::chrono::milliseconds rejoin_grace{0};
  // HA (docs/control-protocol.md, "HA coordinator"): the state lives in etcd under
  // etcd_state_key instead of state_file, and is written only while etcd_leader_key holds
  // etcd_leader_value (this coordinator's leadership). A write refused because another
  // coordinator leads ends this process at once: it must never act beside the leader.
  std::string etcd_endpoints;
  std::string etcd_leader_key, etcd_leader_value, etcd_state_key;
  // HA: steady_clock nanoseconds (since its epoch) until which this process surely holds the
  // leader's lease, moved on by the thread that renews it (the renewal's send time + 3/4 of the
  // TTL). The loop neither reads, nor judges, nor answers, nor decides past it: a process that
  // was stopped or descheduled for longer may have been replaced, and must not act beside its
  // successor until a renewal says it was not (else the renewing thread ends the process).
  // nullptr: no lease (not HA).
  const std::atomic<int64_t>* lead_until_ns = nullptr;
};

struct CoordinatorCounters {
  uint64_t joins_accepted = 0;
  uint64_t joins_refused = 0;
  uint64_t protocol_errors = 0;
  uint64_t heartbeat_timeouts = 0;
  uint64_t departures = 0;
  uint64_t promotions = 0;   // a backup took over a group whose primary died
  uint64_t groups_lost = 0;  // a primary died with no backup left
  uint64_t backups_lost = 0;
  uint64_t rejoins = 0;  // members taken back after a coordinator restart
  // Liveness (docs/fault-tolerance.md, "Liveness").
  uint64_t suspicions = 0;          // members suspected (silent past their detector's timeout)
  uint64_t suspicions_cleared = 0;  // ... that spoke again before their lease ran out
  uint64_t unreachable = 0;         // suspected members whose host stopped acknowledging
  uint64_t coordinator_pauses = 0;  // times this loop was descheduled long enough to matter
  uint64_t lease_waits = 0;  // HA: passes held back until the leader's lease was confirmed
  // Re-replication (docs/fault-tolerance.md, "Redundancy restored").
  uint64_t backups_assigned = 0;  // spares or replacements made a training group's backup
  uint64_t backups_synced = 0;    // ... that copied the snapshot and follow the stream
  uint64_t heartbeats = 0;              // heartbeats received from members
  uint64_t checkpoints_requested = 0;   // worker checkpoint requests forwarded to the servers
  // `shardps status` (StatusRequest): answered, and refused (wrong token or over the rate).
  uint64_t status_answered = 0;
  uint64_t status_refused = 0;
  uint64_t barriers_released = 0;  // BarrierRelease messages sent
};

// At most this many StatusRequests are answered per second (the rest get an Error), and a
// reply lists at most kMaxStatusMembers members: a status asker never slows the loop.
inline constexpr int kMaxStatusPerSecond = 20;
inline constexpr int kMaxStatusMembers = 4096;

class Coordinator {
 public:
  // `bound`: a socket already bound to options.listen_address (net::BindTcp), which the
  // coordinator takes over and listens on: an HA standby reserves its port while it
  // campaigns, so that no other socket (an outgoing connection's ephemeral port) takes it. Empty:
  // binds listen_address itself.
  static StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options,
                                                      UniqueFd bound = UniqueFd());
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  const std::string& address() const { return address_; }
  uint64_t epoch() const;
  Membership membership() const;
  CoordinatorCounters counters() const;
  void Stop();

 private:
  struct Conn;
  explicit Coordinator(const CoordinatorOptions& options);
  void Loop();
  void AcceptNew();
  void ReadFrom(Conn* c);
  void Handle(Conn* c, const Envelope& e);
  void HandleJoin(Conn* c, const JoinRequest& j);
  // Join steps: why a join is refused ("" = it is not); the refusal sent; the acceptance sent
  // (the member's id, rank, credential, config); a rejoin after a coordinator restart; a new
  // member admitted with the rank PickRank gives it; the idempotent orders a rejoining server
  // gets again.
  std::string JoinRefusal(const JoinRequest& j) const;
  void RefuseJoin(Conn* c, const std::string& error, const std::string& why, bool protocol_error);
  void SendJoinAccepted(Conn* c);
  void HandleRejoin(Conn* c, const JoinRequest& j);
  uint32_t PickRank(const JoinRequest& j) const;
  void AdmitMember(Conn* c, const JoinRequest& j);
  void ResendServerOrders(Conn* c);
  void Close(Conn* c, const std::string& why, bool protocol_error);
  void Queue(Conn* c, const Envelope& e);
  void FlushOutput(Conn* c);
  void Publish(const std::string& reason, uint32_t departed);
  void CheckTimeouts(std::chrono::steady_clock::time_point now);
  // Liveness of one joined member: suspicion, probing, death (CheckTimeouts).
  void CheckLiveness(Conn* c, std::chrono::steady_clock::time_point now);
  void HandleHeartbeat(Conn* c, const Heartbeat& hb);
  // The loop found itself descheduled for `pause`: nobody's silence counts it.
  void ForgivePause(std::chrono::microseconds pause, std::chrono::steady_clock::time_point now);
  // HA: whether options_.lead_until_ns is still ahead of `now` (always true without HA).
  bool LeaseConfirmed(std::chrono::steady_clock::time_point now);
  // Model / shard-map state machine (docs/control-protocol.md, "Model setup").
  void HandleRegisterModel(Conn* c, const RegisterModel& m);
  void HandleShardsReady(Conn* c, const ShardsReady& r);
  void MaybeAssignShards();
  void MaybePublishShardMap();
  Conn* ServerByRank(uint32_t rank);
  // Replication: backup placement, the primary's replica target, failover.
  uint32_t NumGroups() const;
  uint32_t NumServerRanks() const;
  void MaybeSendReplicaTarget(uint32_t group);
  // The AssignShards of group `g` under the current plan (chunks in slot order).
  Envelope AssignmentFor(const ShardPlan& plan, uint32_t g, uint32_t max_workers, bool backup,
                         bool catch_up) const;
  // The group server rank `rank` serves: rank % num_servers, unless it was made another
  // group's backup (a spare or a replacement; reassigned_).
  uint32_t GroupOf(uint32_t rank) const;
  // Re-replication: every group that has a live primary and no backup gets a free server (a
  // spare, or a server that joined after the assignment) as its new backup.
  void MaybeReplaceBackups();
  void HandleReplicaSynced(Conn* c, const ReplicaSynced& r);
  void ServerDeparted(const Member& m);
  // Every expected worker came and all have left (servers leaving then are not failures).
  bool JobDone() const;
  // After ServerDeparted: if that departure means the shard map can never be ready, tells every
  // worker why (server, group, reason) instead of letting them wait for their setup timeout.
  void MaybeFailStartUp(const Member& m, const std::string& why);
  // Records why the job cannot start and tells every worker (later registrants get it too).
  void FailStartUp(const std::string& why);
  void FillServerEntry(uint32_t group, uint32_t server_rank, ServerEntry* e);
  void BroadcastShardMap();
  // `shardps status` (coordinator_status.cc): a StatusRequest on a connection that did not
  // join, answered once and closed; a member's heartbeat stats kept for it; the reply.
  void HandleStatusRequest(Conn* c, const StatusRequest& r);
  void NoteStats(Conn* c, const MemberStats& s);
  StatusReply BuildStatus() const;
  // Barriers (coordinator_barrier.cc): a worker's arrival; the releases every live worker's
  // arrival allows (after an arrival or any membership change).
  void HandleBarrier(Conn* c, const Barrier& b);
  void MaybeReleaseBarriers();
  // Restart support (a state file, or etcd for HA coordinators).
  bool Persistent() const { return !options_.state_file.empty() || !options_.etcd_endpoints.empty(); }
  void SaveState();
  StatusOr<std::string> ReadStateBytes(bool* found);
  std::string StateSource() const {
    return options_.etcd_endpoints.empty() ? options_.state_file
                                           : "etcd " + options_.etcd_state_key;
  }
  Status LoadState();
  bool IsPending(uint32_t member_id) const { return pending_.count(member_id) != 0; }
  // The secret credential of a member (docs/security.md): HMAC-SHA256 under
  // credential_secret_ of its id, role and rank.
  std::string CredentialOf(const Member& m) const;
  // The shard map as `worker` receives it: with its own peer key for every server.
  Envelope ShardMapFor(const Member& worker) const;

  CoordinatorOptions options_;
  FaultTimeouts timeouts_;  // derived from options_.config at Start
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd to stop the loop
  std::string address_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  // Loop-thread state.
  std::map<int, std::unique_ptr<Conn>> conns_;  // by fd
  uint32_t next_member_id_ = 1;
  // 32 random bytes drawn at first start (kept in the state file): the key of every member's
  // credential. Never derived from the cluster token, so a token holder cannot forge one.
  std::string credential_secret_;
  // Model state (loop thread).
  bool model_registered_ = false;
  RegisterModel model_;
  std::string plan_fingerprint_;
  bool shards_assigned_ = false;
  std::map<uint32_t, ShardsReady> ready_;  // by server rank
  bool shard_map_ready_ = false;
  // Set when a server's departure means the shard map can never be ready; every worker gets it
  // as an Error (at once, and at its RegisterModel if it comes later).
  std::string startup_failure_;
  ShardMap shard_map_;
  std::vector<uint32_t> awaiting_map_;  // member ids of workers waiting for the map
  // Server ranks that joined and departed before the assignment: the assignment goes ahead
  // without them (a group keeps whichever of its two ranks is there), unless a replacement
  // with the same rank joins first.
  std::set<uint32_t> gone_before_assignment_;
  // The most workers joined at once so far (JoinReply.cluster_started).
  uint32_t most_workers_ = 0;
  // Per group: the server rank that is its primary and the one that holds its backup (-1 none).
  std::vector<int64_t> primary_of_;
  std::vector<int64_t> backup_of_;
  std::vector<bool> target_sent_;
  // Per group: its backup holds the group's state (false for a new backup until ReplicaSynced):
  // only such a backup is promoted.
  std::vector<bool> backup_synced_;
  std::map<uint32_t, uint32_t> reassigned_;  // server rank -> the group it backs (GroupOf)
  std::map<uint32_t, std::chrono::steady_clock::time_point> assigned_at_;  // by group (logs)
  std::vector<uint32_t> has_model_ids_;
  // Members of the saved state that have not rejoined this (restarted) coordinator yet: they
  // stay in the membership until rejoin_grace passes.
  struct Pending {
    Member member;
    std::chrono::steady_clock::time_point deadline;
  };
  std::map<uint32_t, Pending> pending_;
  bool dirty_ = false;
  bool lease_unconfirmed_ = false;  // loop thread: LeaseConfirmed said no last time
  // Status (loop thread): when this coordinator started, the answers of the last second (rate
  // limit), the newest checkpoint clock a server reported and when, the last requested one.
  std::chrono::steady_clock::time_point started_at_ = std::chrono::steady_clock::now();
  std::deque<std::chrono::steady_clock::time_point> status_times_;
  bool checkpoint_seen_ = false;
  uint64_t checkpoint_seen_clock_ = 0;
  uint64_t checkpoint_seen_unix_ms_ = 0;
  CheckpointRequest last_checkpoint_request_;
  // Barriers, by worker member id: the newest generation it arrived at, and the newest it was
  // released from; the highest generation released to anyone (JoinReply.barrier_generation).
  std::map<uint32_t, uint64_t> barrier_arrived_;
  std::map<uint32_t, uint64_t> barrier_released_;
  uint64_t barrier_generation_ = 0;

  mutable Mutex mu_;  // guards the snapshot below (written by the loop thread, read by anyone)
  Membership membership_ GUARDED_BY(mu_);  // epoch + members
  CoordinatorCounters counters_ GUARDED_BY(mu_);
};

}  // namespace shardps::control

#endif  // SHARDPS_SERVER_COORDINATOR_H_
