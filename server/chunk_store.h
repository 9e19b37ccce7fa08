// ChunkStore: the dense chunks a server owns, in its registered weights region
// (wire/region_layout.h): per slot a ChunkHeader and two buffers, the optimizer state, the
// published version and, for VSGD, a short history of published weights.
//
// The publication protocol (docs/region-layout.md), which pulls rely on without running any
// server code, lives in two functions any kind of table shares:
//   BeginOverwrite(header, b)  gen[b] += 1 (acq_rel) BEFORE buffer b is written;
//   PublishHeader(header, b, version, min_clock_plus1)
//                              version[b], min_clock_plus1[b], then state = version<<1|b
//                              (release): one word, so a reader never pairs a version with the
//                              wrong buffer.
// Row tables (embeddings): a slot whose layout has a RowGeometry holds a RowShard
// (server/row_shard.h) instead of two buffers: rows updated in place, each self-verifying, and
// the slot's ChunkHeader published through the same two functions (buffer 0 only: its min clock
// says which clocks every row includes). For such a slot the value interfaces take sparse
// payloads: Compute's `grad` is one (RowShard's format), value_bytes() its capacity,
// Capture/Restore carry every row; published(), Init() and Set() do not apply.
//
// 16-bit chunks (float16, bfloat16: a trainer's mixed-precision tensors): the registered
// buffers hold the 16-bit weights workers pull; the store keeps float32 master weights in two
// private buffers beside them. Every value interface below (published(), Compute's gradient,
// Capture/Restore, the VSGD history) is float32 master; Init takes the wire bytes. Compute
// updates the master and encodes it into the registered buffer (round to nearest even, as
// torch's .to(dtype)).
//
// Computing a version and publishing it are separate steps: Compute()/Init() write the
// unpublished buffer and return it; Publish() makes it visible. In between (a version waiting
// for its replication record) pulls keep reading the published buffer.
//
// Thread safety: not thread-safe. Owned by the server's apply thread; workers read the headers
// and buffers with one-sided reads, which the protocol above makes safe.
#ifndef SHARDPS_SERVER_CHUNK_STORE_H_
#define SHARDPS_SERVER_CHUNK_STORE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "common/status.h"
#include "server/checkpoint.h"
#include "server/optimizer.h"
#include "server/row_shard.h"
#include "wire/region_layout.h"

namespace shardps::server {

void BeginOverwrite(layout::ChunkHeader* header, uint32_t buffer);
void PublishHeader(layout::ChunkHeader* header, uint32_t buffer, uint64_t version,
                   uint64_t min_clock_plus1);

class ChunkStore {
 public:
  struct Options {
    OptimizerConfig optimizer;
    int history = 0;  // published versions of weights kept per chunk (VSGD), 0: none
  };
  // `weights` is the registered weights region of `layout` (at least weights_bytes()); the
  // headers are constructed in it. `chunk_ids` per slot.
  // `chunk_dtypes` per slot (layout::DType; empty: all float32); chunk_bytes are wire bytes.
  ChunkStore(const Options& options, const layout::ServerLayout& layout, void* weights,
             const std::vector<uint32_t>& chunk_ids, const std::vector<uint64_t>& chunk_bytes,
             const std::vector<uint32_t>& chunk_dtypes = {},
             const std::vector<RowInit>& row_inits = {});
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  uint32_t slots() const { return static_cast<uint32_t>(chunks_.size()); }
  uint32_t chunk_id(uint32_t slot) const { return chunks_[slot].chunk_id; }
  uint64_t bytes(uint32_t slot) const { return chunks_[slot].bytes; }  // on the wire
  size_t elems(uint32_t slot) const { return chunks_[slot].elems; }
  // float32 bytes of the values (a gradient decoded, a replication payload): elems x 4; a row
  // shard: the largest sparse payload (a BSP clock of every worker's largest push).
  uint64_t value_bytes(uint32_t slot) const { return chunks_[slot].value_bytes; }
  bool is_rows(uint32_t slot) const { return chunks_[slot].rows != nullptr; }
  const RowShard* row_shard(uint32_t slot) const { return chunks_[slot].rows.get(); }
  layout::DType dtype(uint32_t slot) const { return chunks_[slot].dtype; }
  uint64_t version(uint32_t slot) const { return chunks_[slot].version; }
  bool initialised(uint32_t slot) const { return chunks_[slot].version > 0; }
  uint32_t published_buffer(uint32_t slot) const { return chunks_[slot].published; }
  const float* published(uint32_t slot) const;
  uint64_t published_min_clock_plus1(uint32_t slot) const;
  // The highest min clock (+1) any chunk has published.
  uint64_t max_published_min_clock_plus1() const;

  // Copies the initial weights (wire bytes: the slot's dtype) into buffer 0; returns it (0).
  uint32_t Init(uint32_t slot, const void* src);
  // Decodes a pushed 16-bit gradient into float32 (`add`: adds it to dst). float32: copies.
  void DecodeGradient(uint32_t slot, const void* src, float* dst, bool add) const;
  // Computes the next version from the published one into the other buffer; returns it.
  // `rule`: what the trainer's push carried (kind 0: the configured optimizer). `skip`: the
  // next version is the published one unchanged (a step with non-finite gradients).
  uint32_t Compute(uint32_t slot, const float* grad, float scale, float lr_scale,
                   const layout::UpdateRule& rule = layout::UpdateRule{}, bool skip = false);
  // A trainer's state transfer (layout::PushOp kSetWeights, kSetState1/2, kClearState):
  // `values` (float32, elems; unused for kClearState) replace the weights or a state buffer,
  // `steps` the optimizer's step count, in the next version; returns its buffer. A row shard:
  // `values` is a sparse payload of the rows to set (RowShard::Set), in place.
  uint32_t Set(uint32_t slot, layout::PushOp op, const float* values, uint64_t steps,
               const layout::UpdateRule& rule = layout::UpdateRule{});
  // VSGD: the learning-rate scale for a gradient computed on `base_version` (1 when current).
  float ValueStalenessScale(uint32_t slot, uint64_t base_version, float lambda) const;
  // Makes the version in `buffer` (the next version number) visible to pulls.
  void Publish(uint32_t slot, uint32_t buffer, uint64_t min_clock_plus1);
  // Raises the published version's min clock (clocks moved, nothing new computed).
  void RaisePublishedMinClock(uint32_t slot, uint64_t min_clock_plus1);
  // serving_epoch in every header (0 keeps workers away from a backup's copy).
  void SetServingEpoch(uint64_t epoch);

  // Checkpoints: the published state of a slot, and a restore of one (published in buffer 0).
  ChunkState Capture(uint32_t slot) const;
  // A row shard's rows written after `since_version`, as an increment on the checkpoint at
  // `base_clock` (ChunkState::base_clock, row_index).
  ChunkState CaptureIncrement(uint32_t slot, uint64_t since_version, uint64_t base_clock) const;
  // Which optimizer state buffers the slot has: bit 0 state 1, bit 1 state 2.
  uint32_t state_buffers(uint32_t slot) const {
    if (chunks_[slot].rows) return chunks_[slot].rows->state_buffers();
    return (chunks_[slot].optimizer->state1().empty() ? 0u : 1u) |
           (chunks_[slot].optimizer->state2().empty() ? 0u : 2u);
  }
  Status Restore(uint32_t slot, const ChunkState& state, uint64_t clock);
  // Re-replication (server/replica_handoff.h): a slot's VSGD history (version -> weights,
  // oldest first), and replacing it.
  using History = std::deque<std::pair<uint64_t, std::vector<float>>>;
  const History& history(uint32_t slot) const { return chunks_[slot].history; }
  const ChunkOptimizer& optimizer(uint32_t slot) const { return *chunks_[slot].optimizer; }
  void SetHistory(uint32_t slot, History h) { chunks_[slot].history = std::move(h); }

 private:
  struct DenseChunk {
    uint32_t chunk_id = 0;
    uint64_t bytes = 0;
    size_t elems = 0;
    layout::DType dtype = layout::DType::kF32;
    layout::ChunkHeader* header = nullptr;
    void* buf[2] = {nullptr, nullptr};  // registered: what workers pull
    // The float32 values: buf itself (float32) or the master copies (16-bit).
    float* val[2] = {nullptr, nullptr};
    std::vector<float> master[2];
    std::unique_ptr<ChunkOptimizer> optimizer;
    std::unique_ptr<RowShard> rows;  // a row shard (the buffers above are then unused)
    uint64_t value_bytes = 0;
    uint64_t version = 0;  // published
    uint32_t published = 0;
    std::deque<std::pair<uint64_t, std::vector<float>>> history;  // version -> weights
  };
  // 16-bit chunks: the registered buffer b from the master values (float32: nothing to do).
  static void Encode(DenseChunk& c, uint32_t b);
  Options options_;
  std::vector<DenseChunk> chunks_;  // by slot
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_CHUNK_STORE_H_
