#include "server/row_shard.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "common/crc32c.h"
#include "common/half.h"

namespace shardps::server {

namespace {

// Read prefetches of the first `lines` (4 or 5) cache lines at p, straight-line: GCC drops
// prefetches in a loop of their own (and dropped them from a lambda here), and write
// prefetches without -mprfchw. A prefetch never faults, past the row or not.
inline void PrefetchLines(const char* p, int lines) {
  __builtin_prefetch(p);
  __builtin_prefetch(p + 64);
  __builtin_prefetch(p + 128);
  __builtin_prefetch(p + 192);
  if (lines > 4) __builtin_prefetch(p + 256);
}

}  // namespace

void SparseAccumulator::Clear() {
  index_.Clear();
  used_ = 0;
}

std::pair<float*, bool> SparseAccumulator::RowForStore(uint64_t local) {
  const auto [at, fresh] = index_.Insert(local);
  if (fresh) {
    used_ += dim_;
    if (values_.size() < used_) values_.resize(std::max<uint64_t>(used_, 2 * values_.size()));
  }
  return {values_.data() + uint64_t{at} * dim_, fresh};
}

float* SparseAccumulator::Row(uint64_t local) {
  const auto [row, fresh] = RowForStore(local);
  if (fresh) std::fill_n(row, dim_, 0.0f);
  return row;
}

void SparseAccumulator::Add(uint64_t local, const float* g) {
  float* r = Row(local);
  for (uint32_t j = 0; j < dim_; ++j) r[j] += g[j];
}

void SparseAccumulator::Emit(char* dst) const {
  const uint64_t n = index_.size();
  std::memcpy(dst, &n, sizeof(n));
  std::memcpy(dst + sizeof(n), index_.keys().data(), n * sizeof(uint64_t));
  std::memcpy(dst + sizeof(n) + n * sizeof(uint64_t), values_.data(), used_ * sizeof(float));
}

RowShard::RowShard(const layout::RowGeometry& geometry, layout::DType dtype, const RowInit& init,
                   const OptimizerConfig& server_optimizer, char* area)
    : g_(geometry), dtype_(dtype), init_(init), server_(server_optimizer), area_(area) {
  if (dtype_ != layout::DType::kF32) master_.assign(elems(), 0.0f);
}

float* RowShard::values(uint64_t local) {
  return dtype_ == layout::DType::kF32
             ? reinterpret_cast<float*>(record(local) + sizeof(layout::RowHeader))
             : master_.data() + local * g_.dim;
}

const float* RowShard::values(uint64_t local) const {
  return const_cast<RowShard*>(this)->values(local);
}


void RowShard::Seal(uint64_t local, uint64_t version) {
  if (!g_.hashed) return SealDense(&local, 1, version);
  char* rec = record(local);
  char* vals = rec + sizeof(layout::RowHeader);
  if (dtype_ != layout::DType::kF32) {
    EncodeHalf(static_cast<uint32_t>(dtype_), master_.data() + local * g_.dim,
               reinterpret_cast<uint16_t*>(vals), g_.dim);
  }
  auto* h = reinterpret_cast<layout::RowHeader*>(rec);
  layout::RowHeader next = *h;  // a hashed slot keeps the key and occupancy Place gave it
  next.stamp = (next.stamp & layout::kRowOccupied) | layout::RowStampOf(version);
  newest_version_ = std::max(newest_version_, version);
  next.crc = layout::RowRecordCrc(next, vals, g_.row_value_bytes());
  // Values first, then the header: a reader pairing either header with the other values fails
  // the crc and reads the row again.
  std::atomic_thread_fence(std::memory_order_release);
  *h = next;
}

void RowShard::SealDense(const uint64_t* locals, size_t n, uint64_t version) {
  constexpr size_t kBatch = 16;
  layout::RowHeader next[kBatch];
  const layout::RowHeader* hp[kBatch];
  const char* vp[kBatch];
  uint32_t crc[kBatch];
  const uint32_t stamp = layout::kRowOccupied | layout::RowStampOf(version);
  newest_version_ = std::max(newest_version_, version);
  for (size_t done = 0; done < n; done += kBatch) {
    const size_t k = std::min(kBatch, n - done);
    for (size_t i = 0; i < k; ++i) {
      const uint64_t local = locals[done + i];
      char* rec = record(local);
      char* vals = rec + sizeof(layout::RowHeader);
      if (dtype_ != layout::DType::kF32) {
        EncodeHalf(static_cast<uint32_t>(dtype_), master_.data() + local * g_.dim,
                   reinterpret_cast<uint16_t*>(vals), g_.dim);
      }
      next[i].key = local * g_.shards + g_.shard;
      next[i].stamp = stamp;
      next[i].crc = 0;
      hp[i] = &next[i];
      vp[i] = vals;
    }
    layout::RowRecordCrcs(hp, vp, k, g_.row_value_bytes(), crc);
    // Values first, then the headers: a reader pairing either header with the other values
    // fails the crc and reads the row again.
    std::atomic_thread_fence(std::memory_order_release);
    for (size_t i = 0; i < k; ++i) {
      next[i].crc = crc[i];
      *reinterpret_cast<layout::RowHeader*>(record(locals[done + i])) = next[i];
    }
  }
}

void RowShard::InitRows() {
  newest_version_ = 0;
  for (uint64_t r = 0; r < g_.rows; ++r) {
    auto* h = reinterpret_cast<layout::RowHeader*>(record(r));
    *h = layout::RowHeader{};
    if (g_.hashed) {
      std::fill_n(values(r), g_.dim, 0.0f);  // empty slots
    } else {
      InitRow(init_.kind, init_.scale, init_.seed, r * g_.shards + g_.shard, g_.dim, values(r));
    }
    Seal(r, 0);
  }
}

int64_t RowShard::Place(uint64_t key, uint64_t version, bool force) {
  auto it = slot_of_.find(key);
  if (it != slot_of_.end()) return static_cast<int64_t>(it->second);
  if (init_.admit_probability < 1.0f && !force) {
    // Deterministic in (key, version): the backup, applying the same record, decides alike.
    const double u = static_cast<double>(SplitMix64(key ^ SplitMix64(version)) >> 11) *
                     (1.0 / 9007199254740992.0);
    if (u >= init_.admit_probability) {
      ++hashed_.rejected;
      return -1;
    }
  }
  const uint64_t first = g_.BucketOf(key) * layout::kBucketSlots;
  uint64_t slot = first;
  uint64_t oldest = ~0ull;
  bool free_found = false;
  for (uint64_t s = first; s < first + layout::kBucketSlots; ++s) {
    const auto* h = reinterpret_cast<const layout::RowHeader*>(record(s));
    if ((h->stamp & layout::kRowOccupied) == 0) {
      slot = s;
      free_found = true;
      break;
    }
    if (const uint64_t v = version_of(*h); v < oldest) {
      oldest = v;
      slot = s;
    }
  }
  auto* h = reinterpret_cast<layout::RowHeader*>(record(slot));
  if (!free_found) {
    slot_of_.erase(h->key);
    ++hashed_.evicted;
  } else {
    ++hashed_.rows;
  }
  ++hashed_.admitted;
  // The new key's row: its initial value and state; sealed as occupied when the update is.
  InitRow(init_.kind, init_.scale, init_.seed, key, g_.dim, values(slot));
  ResetState(slot);
  std::atomic_thread_fence(std::memory_order_release);
  h->crc = 0;  // invalid until sealed: a reader of this slot now reads it again
  std::atomic_thread_fence(std::memory_order_release);
  h->key = key;
  h->stamp |= layout::kRowOccupied;
  slot_of_[key] = slot;
  return static_cast<int64_t>(slot);
}

void RowShard::ResetState(uint64_t local) {
  if (!s1_.empty()) std::fill_n(s1_.data() + local * g_.dim, g_.dim, s1_init_);
  if (!s2_.empty()) std::fill_n(s2_.data() + local * g_.dim, g_.dim, 0.0f);
}

Status RowShard::Accumulate(const char* entries, uint64_t n, SparseAccumulator& acc,
                            bool f32_rows) const {
  const auto* ids = reinterpret_cast<const uint64_t*>(entries);
  const char* rows = entries + n * sizeof(uint64_t);
  const bool f32 = f32_rows || dtype_ == layout::DType::kF32;
  const uint64_t row_bytes = f32 ? uint64_t{g_.dim} * sizeof(float) : g_.row_value_bytes();
  std::vector<float> tmp(g_.dim);
  for (uint64_t i = 0; i < n; ++i) {
    // Each id read once and checked as read: the entries are in a peer-writable inbox, so an
    // id checked before and read again after could have changed in between.
    uint64_t id;
    std::memcpy(&id, ids + i, sizeof(id));
    RETURN_IF_ERROR(CheckId(id));
    // hashed: by key (see the top)
    const auto [dst, fresh] = acc.RowForStore(g_.hashed ? id : id / g_.shards);
    const char* src = rows + i * row_bytes;
    float* into = fresh ? dst : tmp.data();  // a row's first addend is stored, not added
    if (f32) {
      std::memcpy(into, src, row_bytes);
    } else {
      DecodeHalf(static_cast<uint32_t>(dtype_), reinterpret_cast<const uint16_t*>(src), into,
                 g_.dim);
    }
    if (!fresh) {
      for (uint32_t j = 0; j < g_.dim; ++j) dst[j] += tmp[j];
    }
  }
  return Status::OK();
}

Status RowShard::CheckId(uint64_t id) const {
  if (g_.hashed) {
    if (g_.ShardOf(id) != g_.shard) {
      return InvalidArgumentError("key " + std::to_string(id) + " does not hash to shard " +
                                  std::to_string(g_.shard) + " of " + std::to_string(g_.shards));
    }
    return Status::OK();
  }
  if (id >= g_.table_rows || id % g_.shards != g_.shard) {
    return InvalidArgumentError("row id " + std::to_string(id) + " is not in shard " +
                                std::to_string(g_.shard) + " of " + std::to_string(g_.shards) +
                                " of a table of " + std::to_string(g_.table_rows) + " rows");
  }
  return Status::OK();
}

Status RowShard::CheckEntries(const char* entries, uint64_t n) const {
  const auto* ids = reinterpret_cast<const uint64_t*>(entries);
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t id;
    std::memcpy(&id, ids + i, sizeof(id));
    RETURN_IF_ERROR(CheckId(id));
  }
  return Status::OK();
}

Status RowShard::CheckPayload(const char* payload, uint64_t bytes) const {
  uint64_t n;
  if (bytes < sizeof(n)) return InvalidArgumentError("sparse payload shorter than its count");
  std::memcpy(&n, payload, sizeof(n));
  // n from the bytes, not the bytes from n: 8 + n * (8 + 4 dim) wraps for a huge n (a hashed
  // shard has no row count to bound it), which could then match `bytes`.
  const uint64_t per_row = sizeof(uint64_t) + uint64_t{g_.dim} * sizeof(float);
  if ((!g_.hashed && n > g_.rows) || n > (bytes - sizeof(n)) / per_row ||
      SparsePayloadBytes(n, g_.dim) != bytes) {
    return InvalidArgumentError("sparse payload of " + std::to_string(bytes) +
                                " bytes does not hold its " + std::to_string(n) + " rows");
  }
  const char* rows = payload + sizeof(n);
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t r;
    std::memcpy(&r, rows + i * sizeof(r), sizeof(r));
    if (g_.hashed ? g_.ShardOf(r) != g_.shard : r >= g_.rows) {
      return InvalidArgumentError("sparse payload: a row that is not this shard's");
    }
  }
  return Status::OK();
}

void RowShard::Apply(const char* payload, float scale, float lr_scale,
                     const layout::UpdateRule& rule, uint64_t version) {
  uint64_t n;
  std::memcpy(&n, payload, sizeof(n));
  const char* locals = payload + sizeof(n);
  const auto* grads = reinterpret_cast<const float*>(locals + n * sizeof(uint64_t));
  ++steps_;
  // The rule in effect: kServer maps the server's optimizer onto its sparse form.
  layout::RuleKind kind = rule.kind();
  float lr = rule.lr;
  float b1 = rule.beta1, b2 = rule.beta2, eps = rule.eps;
  if (kind == layout::RuleKind::kServer) {
    if (lr <= 0.0f) lr = server_.lr;
    switch (server_.kind) {
      case OptimizerKind::kAdam:
        kind = layout::RuleKind::kAdam;
        b1 = server_.beta1;
        b2 = server_.beta2;
        eps = server_.eps;
        break;
      case OptimizerKind::kStore:
        kind = layout::RuleKind::kStore;
        break;
      default:  // sgd; momentum has no sparse form: plain SGD (docs/embeddings.md)
        kind = layout::RuleKind::kSgd;
    }
  }
  lr *= lr_scale;
  const uint32_t dim = g_.dim;
  const uint64_t elems_total = elems();
  double adam_step = 0;
  float adagrad_clr = 0;
  if (kind == layout::RuleKind::kAdam) {
    if (s1_.empty()) s1_.assign(elems_total, 0.0f);
    if (s2_.empty()) s2_.assign(elems_total, 0.0f);
    const double t = static_cast<double>(steps_);
    const double bc1 = 1.0 - std::pow(static_cast<double>(b1), t);
    const double bc2 = 1.0 - std::pow(static_cast<double>(b2), t);
    adam_step = static_cast<double>(lr) * std::sqrt(bc2) / bc1;
  } else if (kind == layout::RuleKind::kAdagrad) {
    // initial_accumulator_value: what a row placed from now on starts its sum from. Taken from
    // every push's rule, not only the first: a restored shard (a checkpoint, a handoff) has
    // its sums but not this value, and a backup must place rows as its primary does.
    s1_init_ = rule.dampening;
    if (s1_.empty()) s1_.assign(elems_total, s1_init_);
    adagrad_clr = static_cast<float>(
        static_cast<double>(lr) /
        (1.0 + static_cast<double>(steps_ - 1) * static_cast<double>(rule.momentum)));
  }
  const float w1 = static_cast<float>(1.0 - static_cast<double>(b1));
  const float w2 = static_cast<float>(1.0 - static_cast<double>(b2));
  const float neg_step = static_cast<float>(-adam_step);
  size_t sealing = 0;  // dense rows of seal_ updated and not yet sealed
  // The rows are scattered over the table (a miss each): the record (and the optimizer state)
  // of the row kAhead ahead is prefetched, so that the misses overlap. Dense tables only (a
  // hashed key's slot is known only once placed).
  constexpr uint64_t kAhead = 6;
  for (uint64_t i = 0; i < n; ++i) {
    if (!g_.hashed && i + kAhead < n) {
      uint64_t ahead;
      std::memcpy(&ahead, locals + (i + kAhead) * sizeof(ahead), sizeof(ahead));
      if (ahead < g_.rows) {  // checked by CheckPayload; never prefetch outside anyway
        PrefetchLines(record(ahead), 5);
        if (!s1_.empty()) PrefetchLines(reinterpret_cast<const char*>(s1_.data() + ahead * dim), 4);
        if (!s2_.empty()) PrefetchLines(reinterpret_cast<const char*>(s2_.data() + ahead * dim), 4);
      }
    }
    uint64_t r;
    std::memcpy(&r, locals + i * sizeof(r), sizeof(r));
    if (g_.hashed) {
      const int64_t slot = Place(r, version);
      if (slot < 0) continue;  // not admitted: its gradient is dropped (counted)
      r = static_cast<uint64_t>(slot);
    }
    float* w = values(r);
    const float* gr = grads + i * dim;
    switch (kind) {
      case layout::RuleKind::kStore:
        std::memcpy(w, gr, dim * sizeof(float));
        break;
      case layout::RuleKind::kAdagrad: {
        float* s = s1_.data() + r * dim;
        for (uint32_t j = 0; j < dim; ++j) {
          const float g = scale * gr[j];
          s[j] = s[j] + g * g;
          w[j] = w[j] - adagrad_clr * (g / (std::sqrt(s[j]) + rule.eps));
        }
        break;
      }
      case layout::RuleKind::kAdam: {
        float* m = s1_.data() + r * dim;
        float* v = s2_.data() + r * dim;
        for (uint32_t j = 0; j < dim; ++j) {
          const float g = scale * gr[j];
          const float m_old = m[j], v_old = v[j];
          const float mu = (g - m_old) * w1;
          const float vu = (g * g - v_old) * w2;
          m[j] = m_old + mu;
          v[j] = v_old + vu;
          const float numer = mu + m_old;
          const float denom = std::sqrt(vu + v_old) + eps;
          w[j] = w[j] + neg_step * (numer / denom);
        }
        break;
      }
      default:  // kSgd (CheckRowRule refused the rest)
        for (uint32_t j = 0; j < dim; ++j) w[j] = w[j] - lr * (scale * gr[j]);
    }
    SealSoon(r, version, &sealing);
  }
  SealDense(seal_, sealing, version);
}

void RowShard::SealSoon(uint64_t local, uint64_t version, size_t* sealing) {
  if (g_.hashed) {
    Seal(local, version);  // at once: a later key of the same payload may take the same slot
    return;
  }
  // Dense: sealed in batches (interleaved crcs); a payload's rows are distinct.
  seal_[(*sealing)++] = local;
  if (*sealing == kSealBatch) {
    SealDense(seal_, *sealing, version);
    *sealing = 0;
  }
}

void RowShard::Set(layout::PushOp op, const char* payload, uint64_t steps, uint64_t version,
                   const layout::UpdateRule& rule) {
  uint64_t n;
  std::memcpy(&n, payload, sizeof(n));
  const char* locals = payload + sizeof(n);
  const auto* vals = reinterpret_cast<const float*>(locals + n * sizeof(uint64_t));
  const uint32_t dim = g_.dim;
  std::vector<float>* state = nullptr;
  if (op == layout::PushOp::kSetState1 || op == layout::PushOp::kSetState2) {
    // Rows not in any set keep a fresh row's state: Adagrad's initial sum, zeros otherwise (a
    // hashed key placed later starts from it too).
    state = op == layout::PushOp::kSetState1 ? &s1_ : &s2_;
    if (state->empty()) {
      if (op == layout::PushOp::kSetState1 && rule.kind() == layout::RuleKind::kAdagrad) {
        s1_init_ = rule.dampening;  // initial_accumulator_value
      }
      state->assign(elems(), op == layout::PushOp::kSetState1 ? s1_init_ : 0.0f);
    }
    steps_ = steps;
  }
  size_t sealing = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t r;
    std::memcpy(&r, locals + i * sizeof(r), sizeof(r));
    if (g_.hashed) r = static_cast<uint64_t>(Place(r, version, /*force=*/true));
    float* dst = state != nullptr ? state->data() + r * dim : values(r);
    std::memcpy(dst, vals + i * dim, dim * sizeof(float));
    // Sealed with the new version even when only its state changed: an incremental
    // checkpoint takes the rows whose version moved, state included.
    SealSoon(r, version, &sealing);
  }
  SealDense(seal_, sealing, version);
}

std::pair<bool, bool> RowShard::Read(const uint64_t* ids, uint64_t n, char* out) const {
  const layout::RowOutbox ob{n, g_.dim};
  auto* keys = reinterpret_cast<uint64_t*>(out + ob.keys());
  auto* versions = reinterpret_cast<uint64_t*>(out + ob.versions());
  auto* w = reinterpret_cast<float*>(out + ob.values());
  auto* s1 = reinterpret_cast<float*>(out + ob.state1());
  auto* s2 = reinterpret_cast<float*>(out + ob.state2());
  const uint32_t dim = g_.dim;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t id = ids[i];
    keys[i] = id;
    int64_t r = -1;
    if (g_.hashed) {
      auto it = slot_of_.find(id);
      if (it != slot_of_.end()) r = static_cast<int64_t>(it->second);
    } else {
      r = static_cast<int64_t>(id / g_.shards);
    }
    if (r < 0) {
      // A key without a row reads as a new row would be: its initial value and state.
      versions[i] = 0;
      InitRow(init_.kind, init_.scale, init_.seed, id, dim, w + i * dim);
      if (!s1_.empty()) std::fill_n(s1 + i * dim, dim, s1_init_);
      if (!s2_.empty()) std::fill_n(s2 + i * dim, dim, 0.0f);
      continue;
    }
    const auto* h = reinterpret_cast<const layout::RowHeader*>(record(static_cast<uint64_t>(r)));
    versions[i] = version_of(*h) | layout::kRowVersionOccupied;
    std::memcpy(w + i * dim, values(static_cast<uint64_t>(r)), dim * sizeof(float));
    if (!s1_.empty()) std::memcpy(s1 + i * dim, s1_.data() + r * dim, dim * sizeof(float));
    if (!s2_.empty()) std::memcpy(s2 + i * dim, s2_.data() + r * dim, dim * sizeof(float));
  }
  return {!s1_.empty(), !s2_.empty()};
}

void RowShard::List(uint64_t first, uint64_t n, char* out) const {
  const layout::RowOutbox ob{n, g_.dim};
  auto* keys = reinterpret_cast<uint64_t*>(out + ob.keys());
  auto* versions = reinterpret_cast<uint64_t*>(out + ob.versions());
  for (uint64_t i = 0; i < n; ++i) {
    const auto* h = reinterpret_cast<const layout::RowHeader*>(record(first + i));
    keys[i] = h->key;
    versions[i] = version_of(*h) |
                  ((h->stamp & layout::kRowOccupied) != 0 ? layout::kRowVersionOccupied : 0);
  }
}

ChunkState RowShard::Capture() const {
  ChunkState cs;
  cs.weights.resize(elems());
  for (uint64_t r = 0; r < g_.rows; ++r) {
    std::memcpy(cs.weights.data() + r * g_.dim, values(r), g_.dim * sizeof(float));
  }
  cs.optimizer_steps = steps_;
  cs.state1 = s1_;
  cs.state2 = s2_;
  if (g_.hashed) {
    cs.row_keys.resize(g_.rows);
    cs.row_versions.resize(g_.rows);
    for (uint64_t r = 0; r < g_.rows; ++r) {
      const auto* h = reinterpret_cast<const layout::RowHeader*>(record(r));
      cs.row_keys[r] = h->key;
      cs.row_versions[r] =
          version_of(*h) | ((h->stamp & layout::kRowOccupied) ? layout::kRowVersionOccupied : 0);
    }
  }
  return cs;
}

ChunkState RowShard::CaptureSince(uint64_t since_version) const {
  ChunkState cs;
  cs.optimizer_steps = steps_;
  for (uint64_t r = 0; r < g_.rows; ++r) {
    const auto* h = reinterpret_cast<const layout::RowHeader*>(record(r));
    if (version_of(*h) <= since_version) continue;
    cs.row_index.push_back(r);
    const float* v = values(r);
    cs.weights.insert(cs.weights.end(), v, v + g_.dim);
    if (!s1_.empty()) cs.state1.insert(cs.state1.end(), &s1_[r * g_.dim], &s1_[r * g_.dim] + g_.dim);
    if (!s2_.empty()) cs.state2.insert(cs.state2.end(), &s2_[r * g_.dim], &s2_[r * g_.dim] + g_.dim);
    if (g_.hashed) {
      cs.row_keys.push_back(h->key);
      cs.row_versions.push_back(
          version_of(*h) | ((h->stamp & layout::kRowOccupied) ? layout::kRowVersionOccupied : 0));
    }
  }
  return cs;
}

Status RowShard::Restore(const ChunkState& cs) {
  const uint64_t e = elems();
  if (cs.weights.size() != e || (!cs.state1.empty() && cs.state1.size() != e) ||
      (!cs.state2.empty() && cs.state2.size() != e)) {
    return FailedPreconditionError("row shard state does not match the table's geometry");
  }
  if (g_.hashed && (cs.row_keys.size() != g_.rows || cs.row_versions.size() != g_.rows)) {
    return FailedPreconditionError("hashed row shard state without its keys");
  }
  slot_of_.clear();
  hashed_ = HashedRowStats{};
  newest_version_ = 0;
  for (uint64_t r = 0; r < g_.rows; ++r) {
    std::memcpy(values(r), cs.weights.data() + r * g_.dim, g_.dim * sizeof(float));
    if (g_.hashed) {
      // Keys, occupancy and versions as they were: admission and eviction go on alike.
      auto* h = reinterpret_cast<layout::RowHeader*>(record(r));
      h->key = cs.row_keys[r];
      h->stamp = (cs.row_versions[r] & layout::kRowVersionOccupied) != 0 ? layout::kRowOccupied : 0;
      Seal(r, cs.row_versions[r] & ~layout::kRowVersionOccupied);
      if ((h->stamp & layout::kRowOccupied) != 0) {
        if (!slot_of_.emplace(h->key, r).second || g_.ShardOf(h->key) != g_.shard ||
            r / layout::kBucketSlots != g_.BucketOf(h->key)) {
          return FailedPreconditionError("hashed row shard state: key " + std::to_string(h->key) +
                                         " twice or in the wrong bucket");
        }
        ++hashed_.rows;
      }
    } else {
      Seal(r, cs.version);
    }
  }
  steps_ = cs.optimizer_steps;
  s1_ = cs.state1;
  s2_ = cs.state2;
  return Status::OK();
}

}  // namespace shardps::server
