// FlatIndex: a map from 64-bit keys to dense indices 0, 1, 2, ... in insertion order, for the
// per-step sets of row ids (a push's distinct rows on the worker, a clock's on the server).
// Open addressing with linear probing over a power-of-two table kept at most half full; no
// allocation per key, and Clear() costs O(keys inserted), not O(capacity). Replaces
// std::unordered_map on those paths, where node allocation and hashing were most of the cost.
//
// Thread safety: none; owned by one thread.
#ifndef SHARDPS_COMMON_FLAT_INDEX_H_
#define SHARDPS_COMMON_FLAT_INDEX_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace shardps {

class FlatIndex {
 public:
  FlatIndex() { Rehash(16); }

  // The index of `key`: (its index, false) if present, else (size() before, true), inserted.
  std::pair<uint32_t, bool> Insert(uint64_t key) {
    if (2 * (keys_.size() + 1) > slots_.size()) Rehash(2 * slots_.size());
    size_t i = Hash(key) & mask_;
    while (true) {
      Slot& s = slots_[i];
      if (s.index == kEmpty) {
        s.key = key;
        s.index = static_cast<uint32_t>(keys_.size());
        keys_.push_back(key);
        return {s.index, true};
      }
      if (s.key == key) return {s.index, false};
      i = (i + 1) & mask_;
    }
  }
  // The index of `key`, or -1.
  int64_t Find(uint64_t key) const {
    size_t i = Hash(key) & mask_;
    while (true) {
      const Slot& s = slots_[i];
      if (s.index == kEmpty) return -1;
      if (s.key == key) return s.index;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return keys_.size(); }
  // The keys, in insertion order (key i has index i).
  const std::vector<uint64_t>& keys() const { return keys_; }
  void Clear() {
    if (keys_.size() >= slots_.size() / 8) {
      // Many keys: one sequential pass over the table beats a probe (a likely cache miss) per key.
      std::fill(slots_.begin(), slots_.end(), Slot{});
      keys_.clear();
      return;
    }
    for (uint64_t k : keys_) {
      size_t i = Hash(k) & mask_;
      while (slots_[i].index != kEmpty) {  // clears k's probe run (every key of it goes)
        slots_[i].index = kEmpty;
        i = (i + 1) & mask_;
      }
    }
    keys_.clear();
  }
  // Keeps the first `n` keys (with their indices) and drops the rest: an error path's undo,
  // O(n).
  void Truncate(size_t n) {
    if (n >= keys_.size()) return;
    std::vector<uint64_t> kept(keys_.begin(), keys_.begin() + static_cast<std::ptrdiff_t>(n));
    Clear();
    for (uint64_t k : kept) Insert(k);
  }

 private:
  static constexpr uint32_t kEmpty = ~0u;
  struct Slot {
    uint64_t key = 0;
    uint32_t index = kEmpty;
  };
  static size_t Hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return static_cast<size_t>(k);
  }
  void Rehash(size_t capacity) {
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    for (uint32_t idx = 0; idx < keys_.size(); ++idx) {
      size_t i = Hash(keys_[idx]) & mask_;
      while (slots_[i].index != kEmpty) i = (i + 1) & mask_;
      slots_[i] = Slot{keys_[idx], idx};
    }
  }

  std::vector<Slot> slots_;
  std::vector<uint64_t> keys_;
  size_t mask_ = 0;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_FLAT_INDEX_H_
