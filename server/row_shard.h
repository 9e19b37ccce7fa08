// RowShard: one shard of a row table (an embedding) in a server's registered weights region
// (wire/region_layout.h, RowGeometry): rows updated in place, each with a self-verifying
// RowHeader (key, stamp, crc32c), and the optimizer state of the rows touched.
//
// Sparse gradients travel, inside the server and to the backup, as a "sparse payload" of
// float32 values: [uint64 n][uint64 row x n][float x n x dim], coalesced (each row once); a row
// is a local row (dense ids) or a key (hashed ids: its slot is resolved when it is applied, by
// the primary and the backup alike, so both place, admit and evict the same rows).
//
// Hashed ids (docs/embeddings.md): a key lives in one of the kBucketSlots slots of its bucket.
//   admission: a key without a row gets one the first time a gradient for it is applied, with
//              probability admit_probability, decided by a hash of (key, the shard's version):
//              deterministic, so the backup decides alike; a key not admitted keeps its
//              initial value (its gradient is dropped and counted);
//   eviction:  a full bucket gives the new key the slot of its least recently updated row
//              (the lowest record version; ties: the lowest slot); the evicted key is forgotten
//              (a later read sees its initial value again), its optimizer state reset.
// Everything this needs is in the records (key, occupancy, version stamp), so a restored or handed-off
// shard decides exactly as the one it came from.
// A worker's pushed entries (global ids, rows in the table's dtype) are decoded and coalesced
// into one by Accumulate; BSP accumulates a clock's pushes in worker-rank order, so the sum (and
// the run) is the same whatever order the pushes arrived in.
//
// Optimizers (layout::UpdateRule; torch 1.13's sparse semantics, docs/embeddings.md), per
// applied payload t += 1 (the shard's step), for each row r in it, g = scale * grad_r:
//   SGD:      w_r -= lr * g
//   Adagrad:  s_r += g*g;  w_r -= lr / (1 + (t-1) * lr_decay) * g / (sqrt(s_r) + eps)
//   Adam (SparseAdam, lazy): m_r += (g - m_r)(1 - b1);  v_r += (g*g - v_r)(1 - b2);
//             w_r -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m_r / (sqrt(v_r) + eps)
//   Store:    w_r = grad_r
// Rows not in the payload are not touched, their state included. State buffers (rows x dim)
// are allocated when a rule first needs them.
//
// Thread safety: not thread-safe; owned by the server's apply thread (through ChunkStore).
// Workers read the rows with one-sided reads, which the RowHeader's crc makes safe.
#ifndef SHARDPS_SERVER_ROW_SHARD_H_
#define SHARDPS_SERVER_ROW_SHARD_H_

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/flat_index.h"
#include "common/row_init.h"
#include "common/status.h"
#include "server/checkpoint.h"
#include "server/optimizer.h"
#include "wire/region_layout.h"

namespace shardps::server {

struct RowInit {
  RowInitKind kind = RowInitKind::kNormal;
  float scale = 1.0f;
  uint64_t seed = 0;
  float admit_probability = 1.0f;  // hashed tables
};

// Hashed tables: what admission and eviction did (RowShard::hashed_stats).
struct HashedRowStats {
  uint64_t rows = 0;      // keys holding a row now
  uint64_t admitted = 0;  // keys given a row
  uint64_t evicted = 0;   // rows taken from a key for another
  uint64_t rejected = 0;  // gradients of keys not admitted (dropped)
};

// Bytes of a sparse payload of n rows of `dim` values.
inline uint64_t SparsePayloadBytes(uint64_t n, uint32_t dim) {
  return sizeof(uint64_t) + n * sizeof(uint64_t) + n * uint64_t{dim} * sizeof(float);
}

// The most rows a sparse payload of a shard holds: a BSP clock sums up to max_ids distinct ids
// from each worker; dense ids are also bounded by the shard's rows, hashed keys are not (a
// shard of few slots may be pushed more distinct keys than it holds).
inline uint64_t MaxSparseRows(const layout::RowGeometry& g, uint32_t max_workers) {
  const uint64_t pushed = uint64_t{g.max_ids} * max_workers;
  return g.hashed ? pushed : std::min<uint64_t>(g.rows, pushed);
}

// Coalesces sparse gradients: each local row once, rows summed in the order they come.
class SparseAccumulator {
 public:
  explicit SparseAccumulator(uint32_t dim) : dim_(dim) {}
  void Clear();
  // Adds `g` (dim floats) to row `local`'s sum.
  void Add(uint64_t local, const float* g);
  float* Row(uint64_t local);  // the row's sum (created as zeros)
  // The row's sum, and whether it was just created (its values then undefined: the caller
  // stores the first addend rather than adding it to zeros).
  std::pair<float*, bool> RowForStore(uint64_t local);
  uint64_t size() const { return index_.size(); }
  // Writes the payload into dst (SparsePayloadBytes(size(), dim) bytes).
  void Emit(char* dst) const;

 private:
  uint32_t dim_;
  FlatIndex index_;  // local row -> its sum's index; the rows in index_.keys()
  std::vector<float> values_;  // size() x dim_ used; grown, never shrunk (no zeroing per push)
  uint64_t used_ = 0;          // floats of values_ in use
};

class RowShard {
 public:
  // `area` is the slot's row area (geometry.area_bytes() bytes, registered, remote-read).
  RowShard(const layout::RowGeometry& geometry, layout::DType dtype, const RowInit& init,
           const OptimizerConfig& server_optimizer, char* area);
  RowShard(const RowShard&) = delete;
  RowShard& operator=(const RowShard&) = delete;

  const layout::RowGeometry& geometry() const { return g_; }
  uint64_t elems() const { return g_.rows * g_.dim; }
  // Every row to its initial value, with version 0.
  void InitRows();

  // A worker's pushed entries: `n` global ids, then n rows in the table's dtype (float32 with
  // `f32_rows`: a set with layout::kPushF32Rows). Adds them to `acc` (local rows), each id
  // checked as it is read. INVALID_ARGUMENT for an id not of this shard (the entries before it
  // are added: the caller discards `acc` or logs it).
  Status Accumulate(const char* entries, uint64_t n, SparseAccumulator& acc,
                    bool f32_rows = false) const;
  // The ids of `n` pushed entries: each of this shard and in the table. Callers that use the
  // ids afterwards check a copy that no peer can write (the inbox is peer-writable).
  Status CheckEntries(const char* entries, uint64_t n) const;
  Status CheckId(uint64_t id) const;
  // Checks a sparse payload of `bytes` (a replication record's): n consistent with the size,
  // every local row in range.
  Status CheckPayload(const char* payload, uint64_t bytes) const;
  // Applies a checked sparse payload; the rows written carry `version`.
  void Apply(const char* payload, float scale, float lr_scale, const layout::UpdateRule& rule,
             uint64_t version);

  // A trainer's state transfer (layout::PushOp on a row shard, Client::SetRows): the rows of
  // a checked sparse payload get its values (kSetWeights) or state rows (kSetState1/2, the
  // shard's step count then `steps`); the rows written carry `version`. A hashed key without a
  // row is placed (admission bypassed; a full bucket evicts as for an update).
  // `rule`: the one the set carried (Adagrad's: a fresh row's sum is its
  // initial_accumulator_value, for state 1 allocated here).
  void Set(layout::PushOp op, const char* payload, uint64_t steps, uint64_t version,
           const layout::UpdateRule& rule);
  // Client::GetRows: rows `ids` (global ids or keys, checked: of this shard) into an outbox
  // laid out as layout::RowOutbox{n, dim}: key, version (kRowVersionOccupied: has a row), the
  // float32 values and state rows. A hashed key without a row: its initial value and state,
  // version 0. Returns whether state 1 / state 2 exist (written only then).
  std::pair<bool, bool> Read(const uint64_t* ids, uint64_t n, char* out) const;
  // Client::TableKeys: the keys and versions of slots [first, first + n) (checked in range).
  void List(uint64_t first, uint64_t n, char* out) const;

  // Checkpoints and re-replication: every row's float32 value and the optimizer state, and
  // for a hashed shard every slot's key and version (with kRowVersionOccupied, bit 63).
  ChunkState Capture() const;
  // Only the rows written after `since_version` (record version > it), for an incremental
  // checkpoint (ChunkState::row_index; base_clock is the caller's).
  ChunkState CaptureSince(uint64_t since_version) const;
  bool has_state() const { return !s1_.empty() || !s2_.empty(); }
  uint32_t state_buffers() const { return (s1_.empty() ? 0u : 1u) | (s2_.empty() ? 0u : 2u); }
  // Restores them (rows written with `version`; a hashed shard's records keep their own).
  Status Restore(const ChunkState& state);
  const HashedRowStats& hashed_stats() const { return hashed_; }
  uint64_t steps() const { return steps_; }
  const std::vector<float>& state1() const { return s1_; }
  const std::vector<float>& state2() const { return s2_; }

 private:
  // Seals dense rows locals[0, n) (distinct) with `version`: as Seal, with the crcs of 16 rows
  // computed together.
  void SealDense(const uint64_t* locals, size_t n, uint64_t version);
  static constexpr size_t kSealBatch = 64;
  // Apply / Set, per row written: a hashed row is sealed at once, a dense one queued in seal_
  // (*sealing of them), the batch sealed when full; the caller seals the rest at the end.
  void SealSoon(uint64_t local, uint64_t version, size_t* sealing);
  uint64_t seal_[kSealBatch];  // Apply: dense rows updated, not yet sealed

  char* record(uint64_t local) const { return area_ + local * g_.row_stride(); }
  // The float32 values of a row: in the record (float32 tables) or the master copy.
  float* values(uint64_t local);
  const float* values(uint64_t local) const;
  // Encodes the master row into the record (16-bit) and writes its header.
  void Seal(uint64_t local, uint64_t version);
  // Hashed: the slot of `key`, admitting (and evicting) as the policy says; -1: not admitted.
  // `force`: admit whatever the policy's probability (an explicit load).
  int64_t Place(uint64_t key, uint64_t version, bool force = false);
  void ResetState(uint64_t local);  // a slot given to a new key: initial optimizer state
  // The version that last wrote a record (its stamp made whole against newest_version_).
  uint64_t version_of(const layout::RowHeader& h) const {
    return layout::RowVersionOf(h.stamp, newest_version_);
  }

  const layout::RowGeometry g_;
  const layout::DType dtype_;
  const RowInit init_;
  const OptimizerConfig server_;
  char* const area_;
  std::vector<float> master_;  // 16-bit tables: rows x dim float32 master values
  uint64_t steps_ = 0;
  uint64_t newest_version_ = 0;  // the highest version a record was sealed with
  std::vector<float> s1_, s2_;  // Adagrad's sum / Adam's m; Adam's v
  float s1_init_ = 0.0f;        // what a fresh row's state 1 holds (Adagrad's initial sum)
  // Hashed: key -> slot of the keys holding a row (the records are the truth; this indexes them).
  std::unordered_map<uint64_t, uint64_t> slot_of_;
  HashedRowStats hashed_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_ROW_SHARD_H_
