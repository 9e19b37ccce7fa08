// Failover and reconnection. When a session fails (an error completion, an endpoint in the
// error state), the data path is repaired before the next operation: a server process that is
// still a member is reconnected (same incarnation: its exactly-once state survives, resending
// is safe); a dead one's group is moved to its promoted backup once the coordinator publishes
// the new shard map, after the backup serves. Either way the server is then resynchronised:
// the pushes it lacks are resent, the worker's clock is sent again and the pulls in flight
// restart. Bounded by the failover timeout; what cannot be repaired is returned as the error
// (the client then is broken, see client_lifecycle.h).
//
// Thread safety: none. Owned by the client; called from the client's (trainer's) thread only.
#ifndef SHARDPS_WORKER_RECOVERY_H_
#define SHARDPS_WORKER_RECOVERY_H_

#include <chrono>

#include "proto/control_client.h"
#include "worker/data_path.h"
#include "worker/pull_pipeline.h"
#include "worker/push_pipeline.h"
#include "worker/server_sessions.h"

namespace shardps::worker {

class Recovery {
 public:
  Recovery(const ClientOptions& options, const control::ClusterConfig& config,
           control::ControlClient& control, uint32_t rank, ServerSessions& sessions,
           PushPipeline& push, PullPipeline& pull, const StepClock& step)
      : options_(options),
        config_(config),
        control_(control),
        rank_(rank),
        sessions_(sessions),
        push_(push),
        pull_(pull),
        step_(step) {}

  // Recover() if a session has failed, or its server was declared departed (a new membership
  // epoch: cheap otherwise), and no recovery is under way.
  Status MaybeRecover();
  // Marks failed the sessions of servers a new membership epoch says departed, without
  // recovering (the wait that calls it returns, and its caller recovers). Not during a recovery.
  void NoteDepartures();
  // Repairs every failed session, or returns why it cannot.
  Status Recover();
  bool recovering() const { return recovering_; }

  uint64_t failovers() const { return failovers_; }
  uint64_t reconnects() const { return reconnects_; }

 private:
  // Takes the shard maps that arrived (the newest one newer than ours is kept).
  void DrainShardMaps();
  void Consider(const control::Envelope& e);
  // The newest map's entry for group i (null: no newer map yet).
  const control::ServerEntry* EntryOf(uint32_t i) const;
  // Reconnects the failed sessions whose server is still a member (once `reconnect_due`);
  // fails for a lost group, or a dead server without backups.
  Status ReconnectLiveServers(bool reconnect_due);
  // Every failed session has a replacement in the newest map.
  bool AllReplaced() const;
  // Moves the replaced groups to their new servers.
  Status MoveToBackups(std::chrono::steady_clock::time_point t0,
                       std::chrono::steady_clock::time_point deadline,
                       std::chrono::milliseconds timeout);
  // A promoted backup serves (and its acks are final) once it has applied every record of the
  // old primary: it then sets serving_epoch in its chunk headers. Read before trusting its acks.
  Status WaitServing(uint32_t server);
  // Learns which pushes the server has (its acks follow the replicated sequence numbers),
  // resends what it lacks, tells it our clock, and restarts the pulls in flight.
  Status Resync(uint32_t server);
  std::chrono::milliseconds FailoverTimeout() const;
  // ABORTED if the coordinator refused to take this worker back (it was declared dead).
  Status OutOfCluster() const;

  const ClientOptions& options_;
  const control::ClusterConfig& config_;
  control::ControlClient& control_;
  const uint32_t rank_;
  ServerSessions& sessions_;
  PushPipeline& push_;
  PullPipeline& pull_;
  const StepClock& step_;
  bool recovering_ = false;
  uint64_t checked_epoch_ = 0;  // the membership epoch MaybeRecover last looked at
  control::ShardMap newest_;  // during Recover: the newest map newer than ours
  bool have_newest_ = false;
  uint64_t failovers_ = 0;
  uint64_t reconnects_ = 0;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_RECOVERY_H_
