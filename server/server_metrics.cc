// server/server_metrics.h: every shardps_server_* metric. Names and meanings are listed in
// docs/operations.md ("Metrics"); keep the two in step.
#include "server/server_metrics.h"

#include <string>

#include "server/shard_server.h"

namespace shardps::server {

void CollectServerMetrics(const ServerStats& stats, uint32_t rank, metrics::Exposition* x) {
  const ShardServerCounters c = stats.Snapshot();
  const metrics::Labels none;
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    x->Counter(name, help, none, static_cast<double>(v));
  };
  auto gauge = [&](const char* name, const char* help, double v) { x->Gauge(name, help, none, v); };
  gauge("shardps_server_rank", "This server's rank.", rank);
  gauge("shardps_server_group", "The shard group this server serves or backs up.", c.group);
  gauge("shardps_server_backup", "1 while this server holds a backup copy (not serving workers).",
        c.backup ? 1 : 0);
  gauge("shardps_server_replicating", "1 while this primary replicates to a backup.",
        c.replicating ? 1 : 0);
  counter("shardps_server_pushes_applied_total",
          "Gradient pushes taken: applied (SSP/ASP/VSGD) or summed into their clock (BSP).",
          c.pushes_applied);
  counter("shardps_server_push_bytes_applied_total", "Payload bytes of the pushes applied.",
          c.bytes_applied);
  counter("shardps_server_duplicate_pushes_total",
          "Pushes seen again (same worker, chunk, sequence number) and dropped: exactly once.",
          c.duplicate_pushes);
  counter("shardps_server_rejected_pushes_total",
          "Pushes refused: malformed header, wrong chunk, unknown worker, bad rule.",
          c.rejected_pushes);
  counter("shardps_server_stale_pushes_total",
          "BSP pushes of a clock already applied without them (dropped).", c.stale_pushes);
  counter("shardps_server_deferred_pushes_total",
          "Pushes that had to wait for their chunk's previous version.", c.deferred_pushes);
  gauge("shardps_server_pushes_waiting",
        "Pushes waiting in the consistency gate now (sampled every 200 ms).",
        static_cast<double>(c.pushes_waiting));
  counter("shardps_server_skipped_updates_total",
          "Versions left unchanged because a worker marked its step non-finite.",
          c.skipped_updates);
  counter("shardps_server_versions_published_total", "Chunk versions published to pulls.",
          c.versions_published);
  counter("shardps_server_stalled_chunks_total",
          "Chunks that waited longer than --stall_report_ms for their next version (each "
          "logged with what it waits for).",
          c.stalled_chunks);
  counter("shardps_server_endpoints_accepted_total", "Data-path connections accepted.",
          c.endpoints_accepted);
  counter("shardps_server_connections_refused_total",
          "Data-path connections refused (credential, uid).", c.connections_refused);
  counter("shardps_server_identity_mismatches_total",
          "Hellos naming another rank than the peer's credential.", c.identity_mismatches);
  counter("shardps_server_endpoint_errors_total", "Data-path endpoint failures (all peers).",
          c.endpoint_errors);
  for (const auto& [peer, n] : stats.PeerErrors()) {
    x->Counter("shardps_server_peer_errors_total", "Data-path endpoint failures by peer.",
               {{"peer", peer}}, static_cast<double>(n));
  }
  counter("shardps_server_replication_records_sent_total",
          "Primary: replication records written to the backup's ring.", c.records_sent);
  counter("shardps_server_replication_records_applied_total",
          "Backup: replication records applied (lag: the primary's sent minus this).",
          c.records_applied);
  counter("shardps_server_replication_records_rejected_total",
          "Backup: records malformed, out of sequence or fenced.", c.records_rejected);
  counter("shardps_server_replication_stalls_total",
          "Primary: times the ring was full and it waited for the backup.", c.replication_stalls);
  counter("shardps_server_promotions_total", "Times this backup was promoted to primary.",
          c.promotions);
  counter("shardps_server_lease_lapses_total",
          "Replicated primary: times its lease ran out (fenced until renewed).", c.lease_lapses);
  counter("shardps_server_rereplications_total", "Primary: new backups it started feeding.",
          c.rereplications);
  counter("shardps_server_catch_ups_total", "New backup: snapshots copied and restored.",
          c.catch_ups);
  counter("shardps_server_checkpoints_submitted_total", "Checkpoint snapshots taken.",
          c.checkpoints_submitted);
  counter("shardps_server_checkpoints_written_total", "Checkpoints written to disk.",
          c.checkpoints_written);
  counter("shardps_server_checkpoint_failures_total", "Checkpoint writes that failed.",
          c.checkpoint_failures);
  counter("shardps_server_checkpoint_bytes_written_total", "Bytes of the checkpoints written.",
          c.checkpoint_bytes);
  gauge("shardps_server_restored_clock", "The checkpoint clock restored at start (0: none).",
        static_cast<double>(c.restored_clock));
  counter("shardps_server_heartbeats_sent_total", "Heartbeats sent to the coordinator.",
          c.heartbeats_sent);
  counter("shardps_server_heartbeat_acks_total", "Heartbeats acknowledged (leases granted).",
          c.heartbeat_acks);
  counter("shardps_server_state_reads_total", "State reads answered (GetState).", c.state_reads);
  counter("shardps_server_state_sets_total", "State sets applied (SetState).", c.state_sets);
  const ServerStats::Histograms& h = stats.histograms();
  x->Histogram("shardps_server_apply_seconds",
               "Time to compute and commit one new chunk version (a push, or a BSP clock's sum).",
               none, h.apply_seconds.snapshot());
  x->Histogram("shardps_server_push_clock_lag_clocks",
               "A push's clock minus its chunk's oldest clock not complete on every worker "
               "(BSP 0; SSP at most s).",
               none, h.push_clock_lag.snapshot());
  x->Histogram("shardps_server_vsgd_drift",
               "VSGD: relative weight drift since the version a push's gradient was computed on.",
               none, h.vsgd_drift.snapshot());
  x->Histogram("shardps_server_checkpoint_seconds", "Duration of each checkpoint write.", none,
               h.checkpoint_seconds.snapshot());
  x->Histogram("shardps_server_checkpoint_bytes", "Size of each checkpoint written.", none,
               h.checkpoint_bytes.snapshot());
}

void AddServerMetrics(const ShardServer* server, metrics::Registry* registry) {
  registry->AddCollector([server](metrics::Exposition* x) {
    CollectServerMetrics(server->stats(), server->rank(), x);
  });
}

}  // namespace shardps::server
