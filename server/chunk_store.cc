#include "server/chunk_store.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "common/half.h"

namespace shardps::server {

void BeginOverwrite(layout::ChunkHeader* header, uint32_t buffer) {
  header->gen[buffer].fetch_add(1, std::memory_order_acq_rel);
}

void PublishHeader(layout::ChunkHeader* header, uint32_t buffer, uint64_t version,
                   uint64_t min_clock_plus1) {
  header->version[buffer].store(version, std::memory_order_relaxed);
  header->min_clock_plus1[buffer].store(min_clock_plus1, std::memory_order_relaxed);
  header->state.store((version << 1) | buffer, std::memory_order_release);
}

ChunkStore::ChunkStore(const Options& options, const layout::ServerLayout& layout, void* weights,
                       const std::vector<uint32_t>& chunk_ids,
                       const std::vector<uint64_t>& chunk_bytes,
                       const std::vector<uint32_t>& chunk_dtypes,
                       const std::vector<RowInit>& row_inits)
    : options_(options), chunks_(layout.slots()) {
  auto* base = static_cast<char*>(weights);
  for (uint32_t s = 0; s < layout.slots(); ++s) {
    DenseChunk& c = chunks_[s];
    c.chunk_id = chunk_ids[s];
    c.bytes = chunk_bytes[s];
    c.dtype = s < chunk_dtypes.size() ? static_cast<layout::DType>(chunk_dtypes[s])
                                      : layout::DType::kF32;
    c.elems = chunk_bytes[s] / layout::DTypeBytes(c.dtype);
    c.value_bytes = c.elems * sizeof(float);
    c.header = new (base + layout.header_offset(s)) layout::ChunkHeader();
    if (layout.is_rows(s)) {
      // A row shard: its rows start at their initial values, version 1, on every server of
      // the group alike (no init push, no record).
      const layout::RowGeometry& g = layout.rows(s);
      c.rows = std::make_unique<RowShard>(g, c.dtype, s < row_inits.size() ? row_inits[s] : RowInit{},
                                          options_.optimizer,
                                          base + layout.buffer_offset(s, 0));
      c.elems = g.rows * g.dim;
      c.value_bytes = SparsePayloadBytes(MaxSparseRows(g, layout.max_workers()), g.dim);
      c.optimizer = std::make_unique<ChunkOptimizer>(options_.optimizer, 0);
      c.rows->InitRows();
      c.version = 1;
      PublishHeader(c.header, 0, 1, 0);
      continue;
    }
    for (int b = 0; b < 2; ++b) {
      c.buf[b] = base + layout.buffer_offset(s, b);
      if (c.dtype == layout::DType::kF32) {
        c.val[b] = static_cast<float*>(c.buf[b]);
      } else {
        c.master[b].assign(c.elems, 0.0f);
        c.val[b] = c.master[b].data();
      }
    }
    c.optimizer = std::make_unique<ChunkOptimizer>(options_.optimizer, c.elems);
  }
}

const float* ChunkStore::published(uint32_t slot) const {
  if (chunks_[slot].rows) return nullptr;
  return chunks_[slot].val[chunks_[slot].published];
}

uint64_t ChunkStore::published_min_clock_plus1(uint32_t slot) const {
  const DenseChunk& c = chunks_[slot];
  return c.header->min_clock_plus1[c.published].load(std::memory_order_relaxed);
}

uint64_t ChunkStore::max_published_min_clock_plus1() const {
  uint64_t m = 0;
  for (uint32_t s = 0; s < slots(); ++s) m = std::max(m, published_min_clock_plus1(s));
  return m;
}

uint32_t ChunkStore::Init(uint32_t slot, const void* src) {
  DenseChunk& c = chunks_[slot];
  if (c.rows) return 0;  // initialised at construction
  BeginOverwrite(c.header, 0);
  std::memmove(c.buf[0], src, c.bytes);  // src may be buffer 0 itself (a backup's restore)
  if (c.dtype != layout::DType::kF32) {
    DecodeHalf(static_cast<uint32_t>(c.dtype), static_cast<const uint16_t*>(c.buf[0]),
               c.val[0], c.elems);
  }
  return 0;
}

void ChunkStore::DecodeGradient(uint32_t slot, const void* src, float* dst, bool add) const {
  const DenseChunk& c = chunks_[slot];
  if (c.dtype == layout::DType::kF32) {
    const auto* g = static_cast<const float*>(src);
    if (add) {
      for (size_t i = 0; i < c.elems; ++i) dst[i] += g[i];
    } else {
      std::memcpy(dst, g, c.bytes);
    }
  } else if (add) {
    AddDecodedHalf(static_cast<uint32_t>(c.dtype), static_cast<const uint16_t*>(src), dst,
                   c.elems);
  } else {
    DecodeHalf(static_cast<uint32_t>(c.dtype), static_cast<const uint16_t*>(src), dst, c.elems);
  }
}

void ChunkStore::Encode(DenseChunk& c, uint32_t b) {
  if (c.dtype == layout::DType::kF32) return;
  EncodeHalf(static_cast<uint32_t>(c.dtype), c.val[b], static_cast<uint16_t*>(c.buf[b]),
             c.elems);
}

uint32_t ChunkStore::Compute(uint32_t slot, const float* grad, float scale, float lr_scale,
                             const layout::UpdateRule& rule, bool skip) {
  DenseChunk& c = chunks_[slot];
  if (c.rows) {
    // In place: the rows carry the version being computed; the header publishes it later.
    if (!skip) c.rows->Apply(reinterpret_cast<const char*>(grad), scale, lr_scale, rule, c.version + 1);
    return 0;
  }
  const uint32_t target = 1 - c.published;
  BeginOverwrite(c.header, target);
  if (skip) {
    std::memcpy(c.val[target], c.val[c.published], c.elems * sizeof(float));
  } else {
    c.optimizer->Apply(c.val[c.published], grad, scale, lr_scale, c.val[target], rule);
  }
  Encode(c, target);
  return target;
}

uint32_t ChunkStore::Set(uint32_t slot, layout::PushOp op, const float* values,
                         uint64_t steps, const layout::UpdateRule& rule) {
  DenseChunk& c = chunks_[slot];
  if (c.rows) {
    // In place, like Compute: `values` is a checked sparse payload (kClearState is refused
    // before it gets here).
    c.rows->Set(op, reinterpret_cast<const char*>(values), steps, c.version + 1, rule);
    return 0;
  }
  const uint32_t target = 1 - c.published;
  BeginOverwrite(c.header, target);
  const size_t n = c.elems * sizeof(float);
  if (op == layout::PushOp::kSetWeights) {
    std::memcpy(c.val[target], values, n);
  } else {
    std::memcpy(c.val[target], c.val[c.published], n);
    if (op == layout::PushOp::kClearState) {
      c.optimizer->SetState(1, nullptr, steps);
      c.optimizer->SetState(2, nullptr, steps);
    } else {
      c.optimizer->SetState(op == layout::PushOp::kSetState1 ? 1 : 2, values, steps);
    }
  }
  Encode(c, target);
  return target;
}

float ChunkStore::ValueStalenessScale(uint32_t slot, uint64_t base_version, float lambda) const {
  const DenseChunk& c = chunks_[slot];
  if (base_version >= c.version || c.rows) return 1.0f;
  for (const auto& [v, w] : c.history) {
    if (v == base_version) return VsgdScale(c.val[c.published], w.data(), c.elems, lambda);
  }
  // Older than the history: treat as maximally stale (relative drift 1).
  return 1.0f / (1.0f + lambda);
}

void ChunkStore::Publish(uint32_t slot, uint32_t buffer, uint64_t min_clock_plus1) {
  DenseChunk& c = chunks_[slot];
  const uint64_t v = c.version + 1;
  PublishHeader(c.header, buffer, v, min_clock_plus1);
  c.version = v;
  c.published = buffer;
  if (options_.history > 0 && !c.rows) {
    const float* w = c.val[buffer];
    const size_t keep = static_cast<size_t>(options_.history);
    while (c.history.size() > keep) c.history.pop_front();  // SetHistory may have given more
    if (c.history.size() == keep) {
      // The oldest version's buffer takes the new one: no allocation, hence no fresh pages to
      // fault in, per publication (a 1 MiB chunk's history cost 228k page faults per GB pushed).
      auto oldest = std::move(c.history.front());
      c.history.pop_front();
      oldest.first = v;
      oldest.second.assign(w, w + c.elems);
      c.history.push_back(std::move(oldest));
    } else {
      c.history.emplace_back(v, std::vector<float>(w, w + c.elems));
    }
  }
}

void ChunkStore::RaisePublishedMinClock(uint32_t slot, uint64_t min_clock_plus1) {
  DenseChunk& c = chunks_[slot];
  auto& mc = c.header->min_clock_plus1[c.published];
  if (min_clock_plus1 > mc.load(std::memory_order_relaxed)) {
    mc.store(min_clock_plus1, std::memory_order_release);
  }
}

void ChunkStore::SetServingEpoch(uint64_t epoch) {
  for (DenseChunk& c : chunks_) c.header->serving_epoch.store(epoch, std::memory_order_release);
}

ChunkState ChunkStore::Capture(uint32_t slot) const {
  const DenseChunk& c = chunks_[slot];
  if (c.rows) {
    ChunkState cs = c.rows->Capture();
    cs.chunk_id = c.chunk_id;
    cs.version = c.version;
    return cs;
  }
  ChunkState cs;
  cs.chunk_id = c.chunk_id;
  cs.version = c.version;
  cs.weights.assign(c.val[c.published], c.val[c.published] + c.elems);
  cs.optimizer_steps = c.optimizer->steps();
  cs.state1 = c.optimizer->state1();
  cs.state2 = c.optimizer->state2();
  return cs;
}

ChunkState ChunkStore::CaptureIncrement(uint32_t slot, uint64_t since_version,
                                        uint64_t base_clock) const {
  const DenseChunk& c = chunks_[slot];
  ChunkState cs = c.rows->CaptureSince(since_version);
  cs.chunk_id = c.chunk_id;
  cs.version = c.version;
  cs.base_clock = base_clock;
  return cs;
}

Status ChunkStore::Restore(uint32_t slot, const ChunkState& cs, uint64_t clock) {
  DenseChunk& c = chunks_[slot];
  if (cs.chunk_id != c.chunk_id || cs.weights.size() != c.elems || cs.version == 0) {
    return FailedPreconditionError("chunk " + std::to_string(slot) + " does not match the plan");
  }
  if (c.rows) {
    RETURN_IF_ERROR(c.rows->Restore(cs));
    c.version = cs.version;
    PublishHeader(c.header, 0, cs.version, clock);
    return Status::OK();
  }
  BeginOverwrite(c.header, 0);
  std::memcpy(c.val[0], cs.weights.data(), c.elems * sizeof(float));
  Encode(c, 0);
  c.optimizer->RestoreState(cs.optimizer_steps, cs.state1, cs.state2);
  c.version = cs.version;
  c.published = 0;
  PublishHeader(c.header, 0, cs.version, clock);
  return Status::OK();
}

}  // namespace shardps::server
