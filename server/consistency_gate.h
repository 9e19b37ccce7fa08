// ConsistencyGate: the one place that knows the consistency modes (docs/consistency.md).
//
//  * BSP: a chunk's gradients of clock t are summed over the live workers and applied once; the
//    new version carries min_clock = t. Pushes of later clocks wait; pushes of a clock already
//    applied without them (a late joiner) are dropped.
//  * SSP, ASP (SSP without a bound: the worker does not wait), VSGD (ASP/SSP with learning rates
//    scaled by value staleness): each push is applied when it lands, in arrival order; a
//    version's min_clock is the smallest clock whose pushes every live worker has had applied
//    in that version.
//
// Per slot it holds the pushes that wait (deferred), the contributors of the version in flight
// (computed, waiting for its replication record), and BSP's aggregation of one clock. It
// answers, for a push, "apply, defer or drop"; for BSP, "is this clock complete"; and for a
// version, "which min_clock may it publish". It reads the WorkerTable; it writes nothing but its
// own state.
//
// The min clock of a published version counts only pushes in published versions: a push still
// deferred, or folded into the version in flight, is not in the published weights, whatever
// clock its worker has announced since. A version's min clock is recomputed when it is
// published (clocks that arrived while it waited may raise it).
//
// Thread safety: not thread-safe. Owned by the server's apply thread.
#ifndef SHARDPS_SERVER_CONSISTENCY_GATE_H_
#define SHARDPS_SERVER_CONSISTENCY_GATE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/worker_table.h"
#include "wire/region_layout.h"

namespace shardps::server {

enum class ConsistencyMode { kBsp, kSsp, kAsp, kVsgd };

// One push, as a version (or a replication record) folds it in.
struct Contributor {
  uint32_t worker;
  uint32_t parity;
  uint64_t seq;
  uint64_t incarnation;
  int64_t clock;
  // BSP: what the push's header said when the push was taken and checked (HandlePush). The
  // clock's sum uses these, not a second read of the header: the inbox slot stays writable by
  // its worker until the clock is published, and a rule rewritten there meanwhile was never
  // checked.
  layout::UpdateRule rule{};
  uint32_t flags = 0;
  uint32_t weight = 1;
};

// A push that waits in the gate: its inbox slot (worker, parity) and the clock of its header
// (stable: a worker reuses an inbox slot only once its push there is acknowledged).
struct DeferredPush {
  uint32_t worker;
  uint32_t parity;
  int64_t clock;
  uint64_t incarnation = 0;  // the process that pushed it (0: unknown)
};

// A complete BSP clock: its contributors in worker-rank order (the order of the sum, so that the
// sum does not depend on arrival order).
struct BspAggregate {
  int64_t clock;
  std::vector<Contributor> contributors;
};

class ConsistencyGate {
 public:
  enum class Decision {
    kApply,          // SSP/ASP/VSGD: apply it now, alone
    kAggregate,      // BSP: recorded as a contributor of the pending clock (see TakeBspClock)
    kDefer,          // queued here; NextDeferred hands it back later
    kDropStale,      // BSP: its clock was completed without it; acknowledge and drop
    kUninitialised,  // the chunk has no version yet: reject
  };

  ConsistencyGate(ConsistencyMode mode, uint32_t slots);

  ConsistencyMode mode() const { return mode_; }
  bool bsp() const { return mode_ == ConsistencyMode::kBsp; }
  // VSGD scales learning rates by value staleness, which needs a history of versions.
  bool value_staleness() const { return mode_ == ConsistencyMode::kVsgd; }

  // A validated, non-duplicate push of `c` (c.clock from its header). `from_queue`: handed back
  // by NextDeferred (it keeps its place ahead of newer pushes if it must wait again).
  // `initialised`: the chunk has a published version.
  //
  // BSP completes a slot's clocks in order. A push of clock t while no clock is pending and
  // t > applied_through + 1 (a worker that started at a later clock than this slot reached:
  // a restarted worker starts where the cluster's furthest chunk is) waits while any other
  // live worker may still push an earlier clock here (its announced clock is below t, or its
  // push of an earlier clock is queued): taking t as pending would drop that earlier push as
  // stale although its clock was never applied, and the cluster would wait for it for ever.
  Decision OnPush(uint32_t slot, const Contributor& c, bool from_queue, bool initialised,
                  const WorkerTable& workers);

  // BSP: a deferred push of `slot` may be admissible now: retry the queue. Either no clock is
  // pending (a worker's clock or the membership changed, so a push held back for an earlier
  // clock may go in), or a queued push is of the pending clock (or below it), which TakeBspClock
  // waits for and nothing else would hand back: it was held back while no clock was pending,
  // and another worker's push of the same clock became the pending one before the queue was
  // retried. Nothing while a version is in flight (EndVersion's drain retries then).
  bool ShouldRetryDeferred(uint32_t slot) const;

  // BSP: the pending clock, when every live worker has contributed to it or moved past it
  // without a push of it still queued here. Removes the aggregation (the clock is applied).
  std::optional<BspAggregate> TakeBspClock(uint32_t slot, const WorkerTable& workers);

  // Whether `slot` waits for something (a BSP clock pending, pushes queued, a version in
  // flight) and, for the stall report (ShardServer::ReportStalls), what it waits for in words:
  // the clock applied through, the pending clock, the live workers it still lacks with their
  // announced clocks, the queued pushes.
  bool Waiting(uint32_t slot) const {
    const Slot& s = slots_[slot];
    return s.pending_clock >= 0 || !s.deferred.empty() || s.inflight;
  }
  std::string DescribeWait(uint32_t slot, const WorkerTable& workers) const;

  // A version of `slot` was computed and waits for publication; its pushes are `contributors`.
  void BeginVersion(uint32_t slot, std::vector<Contributor> contributors);
  bool in_flight(uint32_t slot) const { return slots_[slot].inflight; }
  // The version in flight is published: returns its contributors (to acknowledge).
  std::vector<Contributor> EndVersion(uint32_t slot);

  // The next waiting push to retry (BSP: the lowest clock; otherwise arrival order); none while
  // a version is in flight.
  std::optional<DeferredPush> NextDeferred(uint32_t slot);
  size_t deferred(uint32_t slot) const { return slots_[slot].deferred.size(); }

  // Min clock (+1, 0 = none) for a version of `slot` about to be published that was computed
  // with `computed_plus1`. BSP: the clock it applied; others: recomputed now (at least
  // `computed_plus1`) once the chunk has been initialised.
  uint64_t PublishMinClockPlus1(uint32_t slot, uint64_t computed_plus1, bool initialised,
                                const WorkerTable& workers) const;
  // SSP/ASP/VSGD: the min clock (+1) of the published version of `slot`, from the live
  // workers' applied and announced clocks, less pushes deferred or in flight.
  uint64_t SspMinClockPlus1(uint32_t slot, const WorkerTable& workers) const;
  // After a clock or membership change: the min clock (+1) the published version may now carry,
  // if higher than `published_plus1`. BSP's versions complete in TakeBspClock; a BSP min clock
  // rises here only vacuously: nothing pending, and every live worker is past clocks that no
  // push of reached this slot (a dead process's push never came while a restarted one jumped
  // past them). The caller then marks those clocks applied (NoteAppliedThrough(raised - 1)).
  std::optional<uint64_t> RaisedMinClockPlus1(uint32_t slot, uint64_t published_plus1,
                                              bool initialised, const WorkerTable& workers) const;

  // BSP: the last clock applied (restore, and records replicated to a backup).
  void NoteAppliedThrough(uint32_t slot, int64_t clock);
  int64_t applied_through(uint32_t slot) const { return slots_[slot].applied_through; }

 private:
  struct Slot {
    std::deque<DeferredPush> deferred;
    bool inflight = false;
    std::vector<Contributor> inflight_contributors;
    // BSP aggregation of one clock at a time.
    std::map<uint32_t, Contributor> contrib;  // by worker rank
    int64_t pending_clock = -1;
    int64_t applied_through = -1;
  };
  void Defer(Slot& s, const Contributor& c, bool from_queue);
  int64_t MinDeferredClock(const Slot& s, uint32_t worker, const WorkerTable& workers) const;
  // BSP: may a live worker other than c's still push a clock below c.clock to this slot?
  bool EarlierClockOwed(const Slot& s, const Contributor& c, const WorkerTable& workers) const;
  std::optional<uint64_t> BspVacuousMinClockPlus1(uint32_t slot, uint64_t published_plus1,
                                                  const WorkerTable& workers) const;

  ConsistencyMode mode_;
  std::vector<Slot> slots_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_CONSISTENCY_GATE_H_
