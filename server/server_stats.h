// ShardServerCounters and ServerStats, whose lock guards only the counters: the apply thread and its
// components bump counters; any thread may take a snapshot. ServerStats also holds the
// server's histograms (lock-free, common/metrics.h), read by the /metrics endpoint.
//
// Thread safety: ServerStats is thread-safe; mu_ guards the counters and the per-peer error
// counts and nothing else; the histograms are atomics.
#ifndef SHARDPS_SERVER_SERVER_STATS_H_
#define SHARDPS_SERVER_SERVER_STATS_H_

#include <cstdint>
#include <map>
#include <string>

#include "common/metrics.h"
#include "common/thread_annotations.h"

namespace shardps::server {

struct ShardServerCounters {
  uint64_t pushes_applied = 0;
  uint64_t bytes_applied = 0;      // gradient bytes of the pushes applied
  uint64_t max_applied_clock = 0;  // the newest clock of any push applied
  uint64_t min_applied_clock = 0;  // over live workers, the lowest of their newest applied clock
  bool has_checkpoint = false;     // a checkpoint was written since start ...
  uint64_t last_checkpoint_clock = 0;  // ... at this clock
  uint64_t duplicate_pushes = 0;  // same (worker, chunk, seq) seen again: dropped
  uint64_t rejected_pushes = 0;   // malformed header, wrong chunk, unknown worker
  uint64_t versions_published = 0;
  uint64_t endpoints_accepted = 0;
  uint64_t connections_refused = 0;  // the data listener refused a peer (credential, uid)
  uint64_t identity_mismatches = 0;  // a hello naming another rank than the credential's
  uint64_t endpoint_errors = 0;
  uint64_t deferred_pushes = 0;     // waited for the chunk's previous version to be replicated
  uint64_t skipped_updates = 0;
  uint64_t state_reads = 0;  // kGetState requests answered
  uint64_t state_sets = 0;   // kSet* versions     // versions unchanged: a worker's step was non-finite
  uint64_t stale_pushes = 0;        // BSP: a clock already applied without it (a late joiner)
  uint64_t records_sent = 0;        // primary: replication records written to the backup
  uint64_t records_applied = 0;     // backup: records applied
  uint64_t records_rejected = 0;    // backup: malformed, out of sequence or fenced
  uint64_t replication_stalls = 0;  // primary: ring full, waited for the backup to consume
  uint64_t promotions = 0;          // backup -> primary
  uint64_t lease_lapses = 0;        // replicated primary: lease ran out, fenced until renewed
  uint64_t rereplications = 0;      // primary: new backups it started feeding (a snapshot each)
  uint64_t catch_ups = 0;           // new backup: snapshots copied and restored
  uint64_t checkpoints_submitted = 0;
  uint64_t checkpoints_written = 0;
  uint64_t checkpoint_failures = 0;  // e.g. disk full: logged, training goes on
  uint64_t restored_clock = 0;       // the checkpoint clock restored at start (0: none)
  uint64_t stalled_chunks = 0;       // chunks reported stuck (ShardServer::ReportStalls)
  uint64_t checkpoint_bytes = 0;     // bytes of the checkpoints written
  uint64_t heartbeats_sent = 0;      // to the coordinator (copied at housekeeping)
  uint64_t heartbeat_acks = 0;       // leases granted by the coordinator
  uint64_t pushes_waiting = 0;       // now: pushes deferred in the consistency gate
  bool backup = false;               // currently holds a backup copy (not serving workers)
  bool replicating = false;          // currently replicating to a backup
  uint32_t group = 0;
};

class ServerStats {
 public:
  // ++counters.*field.
  void Bump(uint64_t ShardServerCounters::*field) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    ++(counters_.*field);
  }
  // Runs f(counters) under the lock (several fields at once).
  template <typename F>
  void Update(F f) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    f(counters_);
  }
  ShardServerCounters Snapshot() const EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return counters_;
  }
  // Data-path errors by peer ("worker-3", "primary", ...).
  void BumpPeerError(const std::string& peer) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    ++peer_errors_[peer];
  }
  std::map<std::string, uint64_t> PeerErrors() const EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return peer_errors_;
  }

  // Observed where they happen, on the apply thread (the checkpoint ones on the writer thread).
  struct Histograms {
    // Computing and committing one new version of a chunk (SSP/ASP: one push; BSP: a clock's
    // sum), from the push taken to the version handed to replication/publication.
    metrics::Histogram apply_seconds{metrics::Histogram::ExponentialBounds(1e-6, 4, 10)};
    // A gradient push's clock minus the oldest clock of its chunk not yet complete on every
    // worker (published min clock + 1), at 0 when behind: BSP 0, SSP at most s.
    metrics::Histogram push_clock_lag{{0, 1, 2, 3, 4, 6, 8, 16, 32, 64}};
    // VSGD: the relative weight drift since the version a push's gradient was computed on.
    metrics::Histogram vsgd_drift{metrics::Histogram::ExponentialBounds(0.001, 2, 11)};
    metrics::Histogram checkpoint_seconds{metrics::Histogram::ExponentialBounds(0.001, 4, 10)};
    metrics::Histogram checkpoint_bytes{metrics::Histogram::ExponentialBounds(4096, 4, 12)};
  };
  Histograms& histograms() { return histograms_; }
  const Histograms& histograms() const { return histograms_; }

 private:
  mutable Mutex mu_;
  ShardServerCounters counters_ GUARDED_BY(mu_);
  std::map<std::string, uint64_t> peer_errors_ GUARDED_BY(mu_);
  Histograms histograms_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SERVER_STATS_H_
