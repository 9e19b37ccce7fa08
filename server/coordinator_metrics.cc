// server/coordinator_metrics.h: every shardps_coordinator_* metric. Names and meanings are
// listed in docs/operations.md ("Metrics"); keep the two in step.
#include "server/coordinator_metrics.h"

namespace shardps::control {

void CollectCoordinatorMetrics(const Membership& membership, const CoordinatorCounters& c,
                               metrics::Exposition* x) {
  uint64_t servers = 0, spares = 0, workers = 0;
  for (const Member& m : membership.members()) {
    if (m.role() == ROLE_WORKER) {
      ++workers;
    } else if (m.role() == ROLE_SERVER) {
      ++(m.spare() ? spares : servers);
    }
  }
  const char* members_help = "Members in the current membership, by role.";
  x->Gauge("shardps_coordinator_members", members_help, {{"role", "server"}},
           static_cast<double>(servers));
  x->Gauge("shardps_coordinator_members", members_help, {{"role", "spare"}},
           static_cast<double>(spares));
  x->Gauge("shardps_coordinator_members", members_help, {{"role", "worker"}},
           static_cast<double>(workers));
  x->Gauge("shardps_coordinator_epoch", "Membership epoch (grows by one per change).", {},
           static_cast<double>(membership.epoch()));
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    x->Counter(name, help, {}, static_cast<double>(v));
  };
  counter("shardps_coordinator_joins_accepted_total", "Joins accepted.", c.joins_accepted);
  counter("shardps_coordinator_joins_refused_total", "Joins refused (token, transport, full).",
          c.joins_refused);
  counter("shardps_coordinator_rejoins_total",
          "Members taken back after a coordinator restart.", c.rejoins);
  counter("shardps_coordinator_protocol_errors_total",
          "Connections closed for a malformed or unexpected message.", c.protocol_errors);
  counter("shardps_coordinator_heartbeats_received_total", "Heartbeats received from members.",
          c.heartbeats);
  counter("shardps_coordinator_departures_total", "Members declared departed (any cause).",
          c.departures);
  counter("shardps_coordinator_declared_dead_total",
          "Members declared dead because their lease ran out or their host stopped answering.",
          c.heartbeat_timeouts);
  counter("shardps_coordinator_suspicions_total", "Members suspected (silent past the detector).",
          c.suspicions);
  counter("shardps_coordinator_suspicions_cleared_total",
          "Suspected members that spoke again in time.", c.suspicions_cleared);
  counter("shardps_coordinator_unreachable_total",
          "Suspected members whose host stopped acknowledging.", c.unreachable);
  counter("shardps_coordinator_pauses_total",
          "Times the coordinator's own loop was descheduled long enough to matter.",
          c.coordinator_pauses);
  counter("shardps_coordinator_lease_waits_total",
          "HA: times the leader held its loop back until its etcd lease was confirmed.",
          c.lease_waits);
  counter("shardps_coordinator_promotions_total",
          "Backups promoted to primary (failovers ordered).", c.promotions);
  counter("shardps_coordinator_groups_lost_total", "Primaries lost with no backup left.",
          c.groups_lost);
  counter("shardps_coordinator_backups_lost_total", "Backups lost.", c.backups_lost);
  counter("shardps_coordinator_backups_assigned_total",
          "Spares or replacements made a group's backup.", c.backups_assigned);
  counter("shardps_coordinator_backups_synced_total",
          "New backups that copied the snapshot and follow the stream.", c.backups_synced);
  counter("shardps_coordinator_checkpoints_requested_total",
          "Worker checkpoint requests forwarded to the servers.", c.checkpoints_requested);
}

void AddCoordinatorMetrics(const Coordinator* coordinator, metrics::Registry* registry) {
  registry->AddCollector([coordinator](metrics::Exposition* x) {
    CollectCoordinatorMetrics(coordinator->membership(), coordinator->counters(), x);
  });
}

}  // namespace shardps::control
