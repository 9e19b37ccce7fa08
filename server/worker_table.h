// WorkerTable: what a server knows about each worker process. Per worker rank: its incarnation
// (member id of the process), the highest push sequence number consumed per slot (exactly-once),
// the highest clock applied per slot, the clock the worker announced, and the endpoint it
// speaks on; plus the membership view: the worker ranks of the latest membership and those that
// departed. It decides; it touches no registered memory (the caller resets a worker's acks when
// Ensure() reports a new incarnation).
//
// Thread safety: not thread-safe. Owned by the server's apply thread.
#ifndef SHARDPS_SERVER_WORKER_TABLE_H_
#define SHARDPS_SERVER_WORKER_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace shardps::server {

struct WorkerState {
  uint64_t incarnation = 0;            // the worker process (its member id); 0: unknown
  std::vector<uint64_t> last_seq;      // per slot: highest push sequence number consumed
  std::vector<int64_t> applied_clock;  // per slot, -1 = none
  // From the worker's clock immediates: it finished clocks < clock, and every push of those was
  // posted before its kClock immediate, hence already processed (same endpoint, in order).
  uint64_t clock = 0;
  uint64_t endpoint_id = 0;
  // Trainers behind this worker, from its latest push's weight (a host aggregator: its live
  // local workers; a plain worker: 1). ASP/SSP averaging divides by the live workers' sum.
  uint32_t weight = 1;
};

class WorkerTable {
 public:
  explicit WorkerTable(uint32_t slots) : slots_(slots) {}

  // The state of `rank`, created fresh when unknown or when `incarnation` (non-zero) names
  // another process than the one known; *fresh tells which (the caller then resets its acks).
  WorkerState& Ensure(uint32_t rank, uint64_t incarnation, bool* fresh);
  WorkerState* Find(uint32_t rank);
  const WorkerState* Find(uint32_t rank) const;
  const std::map<uint32_t, WorkerState>& all() const { return workers_; }

  // A worker said hello on `endpoint_id`. An incarnation of 0 (an old client) starts fresh
  // sequence state on every hello. Returns true when the worker was known under this same
  // incarnation (it keeps its sequence numbers). *fresh as for Ensure(). A process that
  // departed stays departed (not Live) until a membership names its rank again; a new
  // process of the rank is live at once.
  bool Hello(uint32_t rank, uint64_t incarnation, uint64_t endpoint_id, bool* fresh);

  // Exactly-once: a push of sequence `seq` was consumed (applied, folded or dropped) already.
  bool IsDuplicate(uint32_t rank, uint32_t slot, uint64_t seq) const;
  // Records a consumed push; `clock` < 0 records no clock (a BSP push dropped as stale).
  void Consume(uint32_t rank, uint32_t slot, uint64_t seq, int64_t clock);
  // A replicated record folded a push in (backup side). Member ids only grow: a push of an
  // older incarnation than the one known is ignored (returns false); a newer one starts fresh
  // state (*fresh). Sequence numbers and clocks only move forward.
  bool FoldReplicated(uint32_t rank, uint64_t incarnation, uint32_t slot, uint64_t seq,
                      int64_t clock, bool* fresh);

  // A clock immediate carrying the low 28 bits of the worker's clock. Clocks move by one per
  // Clock(); a worker that (re)connects sends its whole clock (a step below 2^27). Returns true
  // when the clock moved (false: unknown worker, repeated or stale).
  bool AdvanceClock(uint32_t rank, uint32_t clock_low);

  // Membership: the worker ranks of a new membership. Returns the ranks that departed with it.
  std::vector<uint32_t> SetMembers(const std::set<uint32_t>& now);
  // Live workers: the members, plus known workers that did not depart.
  std::set<uint32_t> Live() const;
  // The sum of the live workers' weights (at least 1).
  uint64_t LiveWeight() const;
  size_t most_members_seen() const { return most_members_seen_; }

 private:
  uint32_t slots_;
  std::map<uint32_t, WorkerState> workers_;  // by rank
  std::set<uint32_t> members_;               // worker ranks in the latest membership
  // Ranks that left a membership, with the incarnation known then (0: none). A hello of that
  // same process does not make it live again (only a membership that names it, or a new
  // process of the rank, does): its endpoint may have been accepted before the departure and
  // its hello polled after, and a process the coordinator let go would then be waited for by
  // every BSP clock for good.
  std::map<uint32_t, uint64_t> departed_;
  size_t most_members_seen_ = 0;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_WORKER_TABLE_H_
