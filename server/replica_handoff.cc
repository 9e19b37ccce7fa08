#include "server/replica_handoff.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/crc32c.h"

namespace shardps::server {

namespace {

constexpr uint32_t kFormat = 2;  // 2: row shards, hashed shards' keys (kSlotHasRowKeys)
constexpr uint32_t kSlotHasRowKeys = 1;  // SlotHeader.reserved
// VSGD keeps a handful of versions; anything beyond this is not a snapshot this build wrote.
constexpr uint64_t kMaxHistory = 1024;

struct HandoffHeader {
  uint64_t magic;
  uint32_t format;
  uint32_t group;
  uint32_t slots;
  uint32_t workers;
};
struct SlotHeader {
  uint32_t chunk_id;
  uint32_t reserved;
  uint64_t version;
  uint64_t min_clock_plus1;
  int64_t applied_through;
  uint64_t optimizer_steps;
  uint64_t elems;
  uint64_t state1;   // elements (0 or elems)
  uint64_t state2;   // elements (0 or elems)
  uint64_t history;  // entries
};
struct WorkerHeader {
  uint32_t rank;
  uint32_t reserved;
  uint64_t incarnation;
};
struct WorkerSlot {
  uint64_t last_seq;
  int64_t applied_clock;
  uint64_t ack;
};

class Writer {
 public:
  Writer(char* dst, uint64_t capacity) : dst_(dst), capacity_(capacity) {}
  void Put(const void* p, uint64_t n) {
    if (n == 0) return;
    if (dst_ != nullptr && pos_ + n <= capacity_) std::memcpy(dst_ + pos_, p, n);
    pos_ += n;
  }
  template <typename T>
  void Put(const T& v) {
    Put(&v, sizeof(T));
  }
  void PutFloats(const float* p, uint64_t n) { Put(p, n * sizeof(float)); }
  uint64_t pos() const { return pos_; }

 private:
  char* dst_;
  uint64_t capacity_;
  uint64_t pos_ = 0;
};

class Reader {
 public:
  Reader(const char* src, uint64_t n) : src_(src), n_(n) {}
  bool Get(void* p, uint64_t n) {
    if (n > n_ - pos_) return false;
    if (n != 0) std::memcpy(p, src_ + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool Get(T* v) {
    return Get(v, sizeof(T));
  }
  bool GetFloats(std::vector<float>* v, uint64_t n) {
    if (n > (n_ - pos_) / sizeof(float)) return false;
    v->resize(n);
    return Get(v->data(), n * sizeof(float));
  }

 private:
  const char* src_;
  uint64_t n_;
  uint64_t pos_ = 0;
};

// The whole snapshot; WriteHandoff with dst = nullptr only counts.
uint64_t Write(const HandoffState& s, uint32_t group, char* dst, uint64_t capacity) {
  Writer w(dst, capacity);
  const ChunkStore& chunks = *s.chunks;
  const uint32_t slots = chunks.slots();
  w.Put(HandoffHeader{kHandoffMagic, kFormat, group, slots,
                      static_cast<uint32_t>(s.workers->all().size())});
  for (uint32_t slot = 0; slot < slots; ++slot) {
    // Straight from the store into dst: the snapshot is taken on the apply thread, so it
    // copies the group's state once.
    const bool init = chunks.initialised(slot);
    const ChunkOptimizer& opt = chunks.optimizer(slot);
    const ChunkStore::History& hist = chunks.history(slot);
    if (chunks.is_rows(slot)) {
      // A row shard: its rows and state, copied out of the records (no history).
      const ChunkState cs = chunks.Capture(slot);
      SlotHeader h{};
      h.chunk_id = chunks.chunk_id(slot);
      h.version = chunks.version(slot);
      h.min_clock_plus1 = chunks.published_min_clock_plus1(slot);
      h.applied_through = s.gate->applied_through(slot);
      h.optimizer_steps = cs.optimizer_steps;
      h.elems = cs.weights.size();
      h.state1 = cs.state1.size();
      h.state2 = cs.state2.size();
      h.reserved = cs.row_keys.empty() ? 0 : kSlotHasRowKeys;
      w.Put(h);
      w.PutFloats(cs.weights.data(), cs.weights.size());
      w.PutFloats(cs.state1.data(), cs.state1.size());
      w.PutFloats(cs.state2.data(), cs.state2.size());
      if (!cs.row_keys.empty()) {  // a hashed shard: every slot's key and version
        w.Put(static_cast<uint64_t>(cs.row_keys.size()));
        for (uint64_t k : cs.row_keys) w.Put(k);
        for (uint64_t v : cs.row_versions) w.Put(v);
      }
      continue;
    }
    SlotHeader h{};
    h.chunk_id = chunks.chunk_id(slot);
    h.version = chunks.version(slot);
    h.min_clock_plus1 = init ? chunks.published_min_clock_plus1(slot) : 0;
    h.applied_through = s.gate->applied_through(slot);
    h.optimizer_steps = init ? opt.steps() : 0;
    h.elems = init ? chunks.elems(slot) : 0;
    h.state1 = init ? opt.state1().size() : 0;
    h.state2 = init ? opt.state2().size() : 0;
    h.history = init ? hist.size() : 0;
    w.Put(h);
    if (!init) continue;
    w.PutFloats(chunks.published(slot), chunks.elems(slot));
    w.PutFloats(opt.state1().data(), opt.state1().size());
    w.PutFloats(opt.state2().data(), opt.state2().size());
    for (const auto& [version, weights] : hist) {
      w.Put(version);
      w.PutFloats(weights.data(), weights.size());
    }
  }
  for (const auto& [rank, ws] : s.workers->all()) {
    w.Put(WorkerHeader{rank, 0, ws.incarnation});
    for (uint32_t slot = 0; slot < slots; ++slot) {
      // What a backup that followed every record holds: the pushes APPLIED (acknowledged) so
      // far. A BSP push folded into a clock not applied yet is counted by the primary's table
      // already, but it is not in the weights: a failover must have it resent.
      const uint64_t ack = s.acks->Get(rank, slot);
      int64_t clock = ws.applied_clock[slot];
      if (s.gate->bsp()) clock = std::min<int64_t>(clock, s.gate->applied_through(slot));
      w.Put(WorkerSlot{ack, clock, ack});
    }
  }
  return w.pos() + sizeof(uint32_t);
}

struct ParsedSlot {
  SlotHeader h{};
  ChunkState state;
  ChunkStore::History history;
};
struct ParsedWorker {
  WorkerHeader h{};
  std::vector<WorkerSlot> slots;
};

}  // namespace

uint64_t HandoffBytes(const HandoffState& s) { return Write(s, 0, nullptr, 0); }

StatusOr<uint64_t> WriteHandoff(const HandoffState& s, uint32_t group, char* dst,
                                uint64_t capacity) {
  const uint64_t n = Write(s, group, dst, capacity);
  if (n > capacity) {
    return ResourceExhaustedError("handoff snapshot needs " + std::to_string(n) + " bytes, " +
                                  std::to_string(capacity) + " given");
  }
  const uint32_t crc = crc32c::Value(dst, n - sizeof(uint32_t));
  std::memcpy(dst + n - sizeof(uint32_t), &crc, sizeof(crc));
  return n;
}

Status RestoreHandoff(const char* src, uint64_t n, uint32_t group, uint32_t max_workers,
                      const HandoffState& s) {
  ChunkStore& chunks = *s.chunks;
  if (n < sizeof(HandoffHeader) + sizeof(uint32_t)) {
    return InvalidArgumentError("handoff snapshot truncated (" + std::to_string(n) + " bytes)");
  }
  uint32_t crc = 0;
  std::memcpy(&crc, src + n - sizeof(uint32_t), sizeof(crc));
  if (crc32c::Value(src, n - sizeof(uint32_t)) != crc) {
    return DataLossError("handoff snapshot: checksum mismatch");
  }
  Reader r(src, n - sizeof(uint32_t));
  HandoffHeader hh{};
  r.Get(&hh);
  if (hh.magic != kHandoffMagic || hh.format != kFormat) {
    return InvalidArgumentError("handoff snapshot: bad magic or format");
  }
  if (hh.group != group) {
    return FailedPreconditionError("handoff snapshot of group " + std::to_string(hh.group) +
                                   ", this server backs up group " + std::to_string(group));
  }
  if (hh.slots != chunks.slots() || hh.workers > max_workers) {
    return FailedPreconditionError("handoff snapshot: " + std::to_string(hh.slots) + " slots and " +
                                   std::to_string(hh.workers) + " workers, expected " +
                                   std::to_string(chunks.slots()) + " slots and at most " +
                                   std::to_string(max_workers) + " workers");
  }
  // Parse and check everything before changing anything.
  std::vector<ParsedSlot> slots(hh.slots);
  for (uint32_t slot = 0; slot < hh.slots; ++slot) {
    ParsedSlot& p = slots[slot];
    if (!r.Get(&p.h)) return InvalidArgumentError("handoff snapshot truncated in a slot");
    const SlotHeader& h = p.h;
    if (h.chunk_id != chunks.chunk_id(slot)) {
      return FailedPreconditionError("handoff snapshot: slot " + std::to_string(slot) +
                                     " holds chunk " + std::to_string(h.chunk_id) +
                                     ", the plan gives chunk " +
                                     std::to_string(chunks.chunk_id(slot)));
    }
    if (chunks.initialised(slot) && !chunks.is_rows(slot)) {  // row shards start initialised
      return FailedPreconditionError("handoff snapshot restored onto an initialised chunk");
    }
    if (h.version == 0) {
      if (h.elems != 0 || h.history != 0) return InvalidArgumentError("bad uninitialised slot");
      continue;
    }
    const uint64_t e = chunks.elems(slot);
    if (h.elems != e || (h.state1 != 0 && h.state1 != e) || (h.state2 != 0 && h.state2 != e) ||
        h.history > kMaxHistory) {
      return InvalidArgumentError("handoff snapshot: slot " + std::to_string(slot) +
                                  " sizes do not match the chunk");
    }
    p.state.chunk_id = h.chunk_id;
    p.state.version = h.version;
    p.state.optimizer_steps = h.optimizer_steps;
    if (!r.GetFloats(&p.state.weights, e) || !r.GetFloats(&p.state.state1, h.state1) ||
        !r.GetFloats(&p.state.state2, h.state2)) {
      return InvalidArgumentError("handoff snapshot truncated in slot " + std::to_string(slot));
    }
    if ((h.reserved & kSlotHasRowKeys) != 0) {
      uint64_t nk = 0;
      if (!r.Get(&nk) || nk > e) return InvalidArgumentError("handoff snapshot: row keys");
      p.state.row_keys.resize(nk);
      p.state.row_versions.resize(nk);
      for (uint64_t& k : p.state.row_keys) {
        if (!r.Get(&k)) return InvalidArgumentError("handoff snapshot truncated in row keys");
      }
      for (uint64_t& v : p.state.row_versions) {
        if (!r.Get(&v)) return InvalidArgumentError("handoff snapshot truncated in row keys");
      }
    }
    for (uint64_t i = 0; i < h.history; ++i) {
      uint64_t version = 0;
      std::vector<float> w;
      if (!r.Get(&version) || !r.GetFloats(&w, e)) {
        return InvalidArgumentError("handoff snapshot truncated in a history");
      }
      p.history.emplace_back(version, std::move(w));
    }
  }
  std::vector<ParsedWorker> workers(hh.workers);
  for (ParsedWorker& w : workers) {
    if (!r.Get(&w.h)) return InvalidArgumentError("handoff snapshot truncated in a worker");
    if (w.h.rank >= max_workers) return InvalidArgumentError("handoff snapshot: worker rank");
    w.slots.resize(hh.slots);
    for (WorkerSlot& ws : w.slots) {
      if (!r.Get(&ws)) return InvalidArgumentError("handoff snapshot truncated in a worker");
    }
  }
  // Everything checked: restore.
  for (uint32_t slot = 0; slot < hh.slots; ++slot) {
    ParsedSlot& p = slots[slot];
    if (p.h.version == 0) continue;
    RETURN_IF_ERROR(chunks.Restore(slot, p.state, p.h.min_clock_plus1));
    chunks.SetHistory(slot, std::move(p.history));
    s.gate->NoteAppliedThrough(slot, p.h.applied_through);
  }
  for (const ParsedWorker& w : workers) {
    bool fresh = false;
    WorkerState& st = s.workers->Ensure(w.h.rank, w.h.incarnation, &fresh);
    if (fresh) s.acks->ResetWorker(w.h.rank);
    for (uint32_t slot = 0; slot < hh.slots; ++slot) {
      st.last_seq[slot] = std::max(st.last_seq[slot], w.slots[slot].last_seq);
      st.applied_clock[slot] = std::max(st.applied_clock[slot], w.slots[slot].applied_clock);
      s.acks->Raise(w.h.rank, slot, w.slots[slot].ack);
    }
  }
  return Status::OK();
}

}  // namespace shardps::server
