// ShardServerCounters and ServerStats, the one lock of the server: the apply thread and its
// components bump counters; any thread may take a snapshot.
//
// Thread safety: ServerStats is thread-safe; mu_ guards the counters and nothing else.
#ifndef SHARDPS_SERVER_SERVER_STATS_H_
#define SHARDPS_SERVER_SERVER_STATS_H_

#include <cstdint>

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

 private:
  mutable Mutex mu_;
  ShardServerCounters counters_ GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SERVER_STATS_H_
