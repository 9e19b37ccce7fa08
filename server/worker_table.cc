#include "server/worker_table.h"

#include <algorithm>

namespace shardps::server {

WorkerState& WorkerTable::Ensure(uint32_t rank, uint64_t incarnation, bool* fresh) {
  auto it = workers_.find(rank);
  *fresh = it == workers_.end() || (incarnation != 0 && it->second.incarnation != incarnation);
  if (!*fresh) return it->second;
  // A new worker process (or the first we hear of it): fresh sequence state; it keeps the
  // endpoint it was last seen on.
  const uint64_t ep = it == workers_.end() ? 0 : it->second.endpoint_id;
  WorkerState& w = workers_[rank];
  w = WorkerState();
  w.last_seq.assign(slots_, 0);
  w.applied_clock.assign(slots_, -1);
  w.incarnation = incarnation;
  w.endpoint_id = ep;
  return w;
}

WorkerState* WorkerTable::Find(uint32_t rank) {
  auto it = workers_.find(rank);
  return it == workers_.end() ? nullptr : &it->second;
}

const WorkerState* WorkerTable::Find(uint32_t rank) const {
  auto it = workers_.find(rank);
  return it == workers_.end() ? nullptr : &it->second;
}

bool WorkerTable::Hello(uint32_t rank, uint64_t incarnation, uint64_t endpoint_id, bool* fresh) {
  const WorkerState* old = Find(rank);
  const bool known = old != nullptr && old->incarnation == incarnation && incarnation != 0;
  WorkerState& w = Ensure(rank, incarnation, fresh);
  if (incarnation == 0) {
    // An old client without an incarnation: every hello starts fresh sequence state.
    w.last_seq.assign(slots_, 0);
    w.applied_clock.assign(slots_, -1);
  }
  w.endpoint_id = endpoint_id;
  auto gone = departed_.find(rank);
  if (gone != departed_.end() && (gone->second == 0 || gone->second != incarnation)) {
    departed_.erase(gone);
  }
  return known;
}

bool WorkerTable::IsDuplicate(uint32_t rank, uint32_t slot, uint64_t seq) const {
  const WorkerState* w = Find(rank);
  return w != nullptr && seq <= w->last_seq[slot];
}

void WorkerTable::Consume(uint32_t rank, uint32_t slot, uint64_t seq, int64_t clock) {
  WorkerState* w = Find(rank);
  if (w == nullptr) return;
  w->last_seq[slot] = seq;
  if (clock >= 0) w->applied_clock[slot] = std::max(w->applied_clock[slot], clock);
}

bool WorkerTable::FoldReplicated(uint32_t rank, uint64_t incarnation, uint32_t slot, uint64_t seq,
                                 int64_t clock, bool* fresh) {
  *fresh = false;
  const WorkerState* known = Find(rank);
  if (known != nullptr && incarnation < known->incarnation) return false;
  WorkerState& w = Ensure(rank, incarnation, fresh);
  w.last_seq[slot] = std::max(w.last_seq[slot], seq);
  w.applied_clock[slot] = std::max(w.applied_clock[slot], clock);
  return true;
}

bool WorkerTable::AdvanceClock(uint32_t rank, uint32_t clock_low) {
  WorkerState* w = Find(rank);
  if (w == nullptr) return false;
  const uint64_t delta = (clock_low - static_cast<uint32_t>(w->clock)) & 0x0fffffffu;
  if (delta == 0 || delta > (1u << 27)) return false;  // repeated or stale
  w->clock += delta;
  return true;
}

std::vector<uint32_t> WorkerTable::SetMembers(const std::set<uint32_t>& now) {
  std::vector<uint32_t> departed;
  for (uint32_t r : members_) {
    if (!now.count(r)) {
      const WorkerState* w = Find(r);
      departed_[r] = w != nullptr ? w->incarnation : 0;
      departed.push_back(r);
    }
  }
  for (uint32_t r : now) departed_.erase(r);
  members_ = now;
  most_members_seen_ = std::max(most_members_seen_, now.size());
  return departed;
}

std::set<uint32_t> WorkerTable::Live() const {
  std::set<uint32_t> live = members_;
  for (const auto& [rank, w] : workers_) {
    if (!departed_.count(rank)) live.insert(rank);
  }
  return live;
}

uint64_t WorkerTable::LiveWeight() const {
  uint64_t sum = 0;
  for (uint32_t rank : Live()) {
    auto it = workers_.find(rank);
    sum += it == workers_.end() ? 1 : std::max<uint32_t>(1, it->second.weight);
  }
  return std::max<uint64_t>(1, sum);
}

}  // namespace shardps::server
