#include "server/consistency_gate.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <set>
#include <string>

namespace shardps::server {

ConsistencyGate::ConsistencyGate(ConsistencyMode mode, uint32_t slots)
    : mode_(mode), slots_(slots) {}

void ConsistencyGate::Defer(Slot& s, const Contributor& c, bool from_queue) {
  const DeferredPush d{c.worker, c.parity, c.clock, c.incarnation};
  if (from_queue) {
    s.deferred.push_front(d);
  } else {
    s.deferred.push_back(d);
  }
}

ConsistencyGate::Decision ConsistencyGate::OnPush(uint32_t slot, const Contributor& c,
                                                  bool from_queue, bool initialised,
                                                  const WorkerTable& workers) {
  Slot& s = slots_[slot];
  // ASP/SSP apply pushes in arrival order (FIFO behind deferred ones); BSP only needs clock
  // order (a clock's gradients are summed in worker-rank order whatever their arrival order).
  if (s.inflight || (!bsp() && !from_queue && !s.deferred.empty())) {
    Defer(s, c, from_queue);
    return Decision::kDefer;
  }
  if (!initialised) return Decision::kUninitialised;
  if (!bsp()) return Decision::kApply;
  if (c.clock <= s.applied_through || (s.pending_clock >= 0 && c.clock < s.pending_clock)) {
    // Its clock was completed without it (it joined late, or was presumed gone).
    return Decision::kDropStale;
  }
  if (s.pending_clock >= 0 && c.clock > s.pending_clock) {
    Defer(s, c, from_queue);
    return Decision::kDefer;
  }
  if (s.pending_clock < 0 && c.clock > s.applied_through + 1 && EarlierClockOwed(s, c, workers)) {
    Defer(s, c, from_queue);
    return Decision::kDefer;
  }
  s.pending_clock = c.clock;
  s.contrib[c.worker] = c;
  return Decision::kAggregate;
}

bool ConsistencyGate::ShouldRetryDeferred(uint32_t slot) const {
  const Slot& s = slots_[slot];
  if (!bsp() || s.inflight || s.deferred.empty()) return false;
  if (s.pending_clock < 0) return true;
  for (const DeferredPush& d : s.deferred) {
    if (d.clock <= s.pending_clock) return true;
  }
  return false;
}

std::optional<BspAggregate> ConsistencyGate::TakeBspClock(uint32_t slot,
                                                          const WorkerTable& workers) {
  Slot& s = slots_[slot];
  if (!bsp() || s.pending_clock < 0 || s.inflight) return std::nullopt;
  for (uint32_t r : workers.Live()) {
    if (s.contrib.count(r)) continue;
    // A worker whose clock moved past the pending clock will not push this chunk for it —
    // unless its push of that clock is still queued here (deferred behind a replication).
    const WorkerState* w = workers.Find(r);
    if (w != nullptr && w->clock > static_cast<uint64_t>(s.pending_clock) &&
        MinDeferredClock(s, r, workers) > s.pending_clock) {
      continue;
    }
    return std::nullopt;  // still waiting for a live worker
  }
  BspAggregate a;
  a.clock = s.pending_clock;
  for (const auto& [r, k] : s.contrib) a.contributors.push_back(k);
  s.applied_through = s.pending_clock;
  s.pending_clock = -1;
  s.contrib.clear();
  return a;
}

void ConsistencyGate::BeginVersion(uint32_t slot, std::vector<Contributor> contributors) {
  Slot& s = slots_[slot];
  s.inflight = true;
  s.inflight_contributors = std::move(contributors);
}

std::vector<Contributor> ConsistencyGate::EndVersion(uint32_t slot) {
  Slot& s = slots_[slot];
  s.inflight = false;
  std::vector<Contributor> c;
  c.swap(s.inflight_contributors);
  return c;
}

std::optional<DeferredPush> ConsistencyGate::NextDeferred(uint32_t slot) {
  Slot& s = slots_[slot];
  if (s.inflight || s.deferred.empty()) return std::nullopt;
  size_t pick = 0;
  if (bsp()) {
    // The lowest clock first: a later clock's push must not hold back an earlier one's.
    int64_t best = INT64_MAX;
    for (size_t i = 0; i < s.deferred.size(); ++i) {
      if (s.deferred[i].clock < best) {
        best = s.deferred[i].clock;
        pick = i;
      }
    }
  }
  const DeferredPush d = s.deferred[pick];
  s.deferred.erase(s.deferred.begin() + static_cast<std::ptrdiff_t>(pick));
  return d;
}

std::string ConsistencyGate::DescribeWait(uint32_t slot, const WorkerTable& workers) const {
  const Slot& s = slots_[slot];
  std::string out = "applied through clock " + std::to_string(s.applied_through);
  if (s.inflight) out += "; a version in flight (computed, waiting for its replication)";
  if (s.pending_clock >= 0) {
    out += "; clock " + std::to_string(s.pending_clock) + " pending with workers {";
    bool first = true;
    for (const auto& [r, c] : s.contrib) {
      out += (first ? "" : ",") + std::to_string(r);
      first = false;
    }
    out += "}, still waiting for {";
    first = true;
    for (uint32_t r : workers.Live()) {
      if (s.contrib.count(r)) continue;
      const WorkerState* w = workers.Find(r);
      out += (first ? "" : ", ") + std::to_string(r) + " (announced clock " +
             (w != nullptr ? std::to_string(w->clock) : std::string("none")) + ")";
      first = false;
    }
    out += "}";
  }
  if (!s.deferred.empty()) {
    out += "; queued pushes (worker:clock)";
    for (const DeferredPush& d : s.deferred) {
      out += " " + std::to_string(d.worker) + ":" + std::to_string(d.clock);
    }
  }
  return out;
}

bool ConsistencyGate::EarlierClockOwed(const Slot& s, const Contributor& c,
                                       const WorkerTable& workers) const {
  for (uint32_t r : workers.Live()) {
    if (r == c.worker) {
      if (MinDeferredClock(s, r, workers) < c.clock) return true;  // its own earlier push waits here
      continue;
    }
    const WorkerState* w = workers.Find(r);
    // Unknown, or announced a clock below c's (a worker that just joined has announced none
    // yet: it will start at a clock this slot may not have reached).
    if (w == nullptr || w->clock < static_cast<uint64_t>(c.clock)) return true;
    if (MinDeferredClock(s, r, workers) < c.clock) return true;  // its earlier push waits here
  }
  return false;
}

int64_t ConsistencyGate::MinDeferredClock(const Slot& s, uint32_t worker,
                                          const WorkerTable& workers) const {
  // Only the worker's current process: a push queued by a process that has since been replaced
  // (it died, and the rank came back) is dropped when it is handed back (ShardServer::DrainWork)
  // and holds nothing meanwhile.
  const WorkerState* w = workers.Find(worker);
  int64_t m = INT64_MAX;
  for (const DeferredPush& d : s.deferred) {
    if (d.worker != worker) continue;
    if (w != nullptr && d.incarnation != 0 && w->incarnation != 0 &&
        d.incarnation != w->incarnation) {
      continue;
    }
    m = std::min(m, d.clock);
  }
  return m;
}

uint64_t ConsistencyGate::SspMinClockPlus1(uint32_t slot, const WorkerTable& workers) const {
  const Slot& s = slots_[slot];
  int64_t m = INT64_MAX;
  for (uint32_t r : workers.Live()) {
    const WorkerState* w = workers.Find(r);
    int64_t applied = -1;
    if (w != nullptr) {
      applied = std::max(w->applied_clock[slot], static_cast<int64_t>(w->clock) - 1);
      // A push of this worker still queued here is not applied, whatever its clock says.
      const int64_t d = MinDeferredClock(s, r, workers);
      if (d != INT64_MAX) applied = std::min(applied, d - 1);
      // Nor is one folded into a version that waits for its replication record: that version
      // is not published yet, and the published one (whose min clock this is while a version
      // is in flight) lacks it.
      // A state transfer (a set: clock -1) is no clock's push and holds no clock back.
      if (s.inflight) {
        for (const Contributor& k : s.inflight_contributors) {
          if (k.worker == r && k.clock >= 0) applied = std::min(applied, k.clock - 1);
        }
      }
    }
    m = std::min(m, applied);
  }
  // -1 (nothing applied) is the least there is: 0, "none", never a wrapped 2^64 - 1.
  if (m == INT64_MAX || m < 0) return 0;
  return static_cast<uint64_t>(m + 1);
}

uint64_t ConsistencyGate::PublishMinClockPlus1(uint32_t slot, uint64_t computed_plus1,
                                               bool initialised, const WorkerTable& workers) const {
  if (bsp() || !initialised) return computed_plus1;
  // Clocks that arrived while the version waited for its record may raise its min clock: once
  // it is published (EndVersion before this call), every processed, undeferred push is in it.
  return std::max(computed_plus1, SspMinClockPlus1(slot, workers));
}

std::optional<uint64_t> ConsistencyGate::RaisedMinClockPlus1(uint32_t slot,
                                                             uint64_t published_plus1,
                                                             bool initialised,
                                                             const WorkerTable& workers) const {
  if (!initialised) return std::nullopt;
  if (bsp()) return BspVacuousMinClockPlus1(slot, published_plus1, workers);
  const uint64_t mc = SspMinClockPlus1(slot, workers);
  if (mc > published_plus1) return mc;
  return std::nullopt;
}

std::optional<uint64_t> ConsistencyGate::BspVacuousMinClockPlus1(
    uint32_t slot, uint64_t published_plus1, const WorkerTable& workers) const {
  const Slot& s = slots_[slot];
  if (s.inflight || s.pending_clock >= 0) return std::nullopt;
  // The lowest clock a live worker may still push here: its announced clock, or a queued push.
  uint64_t m = UINT64_MAX;
  for (uint32_t r : workers.Live()) {
    const WorkerState* w = workers.Find(r);
    if (w == nullptr) return std::nullopt;
    uint64_t c = w->clock;
    const int64_t d = MinDeferredClock(s, r, workers);
    if (d != INT64_MAX) c = std::min(c, static_cast<uint64_t>(std::max<int64_t>(0, d)));
    m = std::min(m, c);
  }
  if (m == UINT64_MAX) return std::nullopt;  // nobody live: nothing moves
  // Every clock below m is complete: no live worker will push it here, and the pushes that
  // came were applied. Only a restart makes this happen (a dead process's push of a clock
  // never came, and the live workers are all past it); the version is unchanged, its min
  // clock rises, and pushes of those clocks are stale from now on (ApplyVacuous).
  if (m > published_plus1 && static_cast<int64_t>(m) > s.applied_through + 1) return m;
  return std::nullopt;
}

void ConsistencyGate::NoteAppliedThrough(uint32_t slot, int64_t clock) {
  if (!bsp()) return;
  slots_[slot].applied_through = std::max(slots_[slot].applied_through, clock);
}

}  // namespace shardps::server
