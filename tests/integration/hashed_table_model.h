// A one-process model of a hashed row table on the servers (docs/embeddings.md, "Hashed ids";
// server/row_shard.cc): the same placement (shard, bucket), admission (probability, decided
// per key and version) and eviction (the bucket's least recently updated row, ties to the
// lowest slot), and the servers' SGD arithmetic term for term, so tests can compare every row
// a cluster holds with it, bit for bit.
//
// Thread safety: none (a test's own object).
#ifndef SHARDPS_TESTS_INTEGRATION_HASHED_TABLE_MODEL_H_
#define SHARDPS_TESTS_INTEGRATION_HASHED_TABLE_MODEL_H_

#include <cstdint>
#include <vector>

#include "common/row_init.h"
#include "wire/region_layout.h"

namespace shardps::test {

class HashedTableModel {
 public:
  HashedTableModel(uint64_t capacity, uint32_t shards, uint32_t dim, RowInitKind init,
                   float init_scale, uint64_t init_seed, float admit_probability)
      : dim_(dim), init_(init), scale_(init_scale), seed_(init_seed), admit_(admit_probability) {
    g_.hashed = true;
    g_.shards = shards;
    g_.rows = layout::RowGeometry::ShardRows(capacity, shards, 0, true);
    slots_.assign(shards, std::vector<Slot>(g_.rows));
    for (auto& s : slots_) {
      for (Slot& x : s) x.v.assign(dim, 0.0f);
    }
    version_.assign(shards, 1);  // every shard starts at version 1
  }
  uint32_t ShardOf(uint64_t key) const { return g_.ShardOf(key); }

  // One version of shard k: its coalesced gradient (keys in the order the server applies them,
  // each key's summed row), w -= lr * (scale * g). An empty gradient still makes a version.
  void Apply(uint32_t k, const std::vector<uint64_t>& keys, const std::vector<float>& sums,
             float scale, float lr) {
    const uint64_t version = ++version_[k];
    for (size_t i = 0; i < keys.size(); ++i) {
      const int64_t slot = Place(k, keys[i], version);
      if (slot < 0) continue;
      Slot& x = slots_[k][slot];
      for (uint32_t j = 0; j < dim_; ++j) x.v[j] = x.v[j] - lr * (scale * sums[i * dim_ + j]);
      x.version = version;
    }
  }
  // What a read of `key` returns: its row, or its initial value.
  std::vector<float> Read(uint64_t key) const {
    const uint32_t k = ShardOf(key);
    const uint64_t first = g_.BucketOf(key) * layout::kBucketSlots;
    for (uint64_t s = first; s < first + layout::kBucketSlots; ++s) {
      if (slots_[k][s].occupied && slots_[k][s].key == key) return slots_[k][s].v;
    }
    std::vector<float> v(dim_);
    InitRow(init_, scale_, seed_, key, dim_, v.data());
    return v;
  }
  uint64_t evicted() const { return evicted_; }
  uint64_t rejected() const { return rejected_; }

 private:
  struct Slot {
    uint64_t key = 0;
    bool occupied = false;
    uint64_t version = 0;
    std::vector<float> v;
  };
  int64_t Place(uint32_t k, uint64_t key, uint64_t version) {
    const uint64_t first = g_.BucketOf(key) * layout::kBucketSlots;
    for (uint64_t s = first; s < first + layout::kBucketSlots; ++s) {
      if (slots_[k][s].occupied && slots_[k][s].key == key) return static_cast<int64_t>(s);
    }
    if (admit_ < 1.0f) {
      const double u = static_cast<double>(SplitMix64(key ^ SplitMix64(version)) >> 11) *
                       (1.0 / 9007199254740992.0);
      if (u >= admit_) {
        ++rejected_;
        return -1;
      }
    }
    uint64_t slot = first, oldest = ~0ull;
    bool free_found = false;
    for (uint64_t s = first; s < first + layout::kBucketSlots; ++s) {
      if (!slots_[k][s].occupied) {
        slot = s;
        free_found = true;
        break;
      }
      if (slots_[k][s].version < oldest) {
        oldest = slots_[k][s].version;
        slot = s;
      }
    }
    if (!free_found) ++evicted_;
    Slot& x = slots_[k][slot];
    x.key = key;
    x.occupied = true;
    InitRow(init_, scale_, seed_, key, dim_, x.v.data());
    return static_cast<int64_t>(slot);
  }

  layout::RowGeometry g_;
  uint32_t dim_;
  RowInitKind init_;
  float scale_;
  uint64_t seed_;
  float admit_;
  std::vector<std::vector<Slot>> slots_;  // per shard
  std::vector<uint64_t> version_;         // per shard
  uint64_t evicted_ = 0, rejected_ = 0;
};

}  // namespace shardps::test

#endif  // SHARDPS_TESTS_INTEGRATION_HASHED_TABLE_MODEL_H_
