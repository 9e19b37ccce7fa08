#include "server/checkpoint_capture.h"

#include <algorithm>
#include <utility>

namespace shardps::server {

CheckpointCapture::Request CheckpointCapture::OnRequest(uint64_t clock, uint64_t published_plus1) {
  if (clock <= last_ || (next_ != 0 && clock >= next_) || pending_ != nullptr) {
    return Request::kIgnored;
  }
  if (published_plus1 > clock) return Request::kRefused;
  next_ = clock;
  return Request::kAccepted;
}

bool CheckpointCapture::Wants(uint32_t slot, uint64_t min_clock_plus1, uint64_t epoch) {
  if (next_ == 0) {
    if (every_ == 0) return false;
    next_ = std::max(last_, min_clock_plus1) / every_ * every_ + every_;
  }
  if (min_clock_plus1 < next_) return false;
  if (pending_ == nullptr) {
    pending_ = std::make_unique<ShardSnapshot>();
    ShardSnapshot& s = *pending_;
    s.plan_fingerprint = id_.plan_fingerprint;
    s.group = id_.group;
    s.num_groups = id_.num_groups;
    s.clock = next_;
    s.epoch = epoch;
    s.optimizer = id_.optimizer;
    s.chunks.resize(slots_);
    captured_.assign(slots_, false);
    captured_count_ = 0;
  }
  return !captured_[slot];
}

std::optional<ShardSnapshot> CheckpointCapture::Captured(uint32_t slot, ChunkState state,
                                                         const WorkerTable& workers) {
  if (pending_ == nullptr || captured_[slot]) return std::nullopt;
  pending_->chunks[slot] = std::move(state);
  captured_[slot] = true;
  if (++captured_count_ < slots_) return std::nullopt;
  for (const auto& [rank, w] : workers.all()) {
    WorkerProgress p;
    p.rank = rank;
    p.clock = w.clock;
    p.last_seq = w.last_seq;
    p.applied_clock = w.applied_clock;
    pending_->workers.push_back(std::move(p));
  }
  last_ = next_;
  next_ = every_ ? next_ + every_ : 0;
  ShardSnapshot done = std::move(*pending_);
  pending_.reset();
  return done;
}

std::optional<CheckpointCapture::Base> CheckpointCapture::IncrementalBase(uint32_t slot,
                                                                          uint32_t state) const {
  if (slot >= history_.size() || pending_ == nullptr) return std::nullopt;
  const SlotHistory& h = history_[slot];
  if (h.clock == 0 || h.clock >= pending_->clock || h.since_whole + 1 >= full_every_ ||
      h.had_state != state) {
    return std::nullopt;
  }
  return Base{h.clock, h.version};
}

void CheckpointCapture::NoteCapture(uint32_t slot, uint64_t version, bool whole, uint32_t state) {
  if (slot >= history_.size() || pending_ == nullptr) return;
  SlotHistory& h = history_[slot];
  h.clock = pending_->clock;
  h.version = version;
  h.since_whole = whole ? 0 : h.since_whole + 1;
  h.had_state = state;
}

void CheckpointCapture::ForceFull() {
  for (SlotHistory& h : history_) h.clock = 0;
}

}  // namespace shardps::server
