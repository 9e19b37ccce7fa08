// The memory a server registers once at start, and how workers address it. This is the
// contract between server/ and worker/ (and tools/, which size regions from it), so it lives
// in wire/, included by both sides; docs/region-layout.md draws it.
//
// A server owning chunks c_0..c_{k-1} (its "slots") registers five regions (a backup two more,
// its replication ring and consumed counter, ReplLayout):
//
//  weights (remote-read only)   per slot: ChunkHeader, then two buffers of the chunk's bytes
//  inbox   (remote-write only)  per worker w, per slot, per parity p in {0,1}:
//                               PushHeader, then the gradient bytes
//  acks    (remote-read only)   per worker w, per slot: the highest push seq consumed
//  clocks  (remote-write only)  per worker w: one 64-byte slot, its clock (u64) first
//  outbox  (remote-read only)   answers to state and row requests (OutboxHeader, below)
//
// Everything is 64-byte aligned. Offsets are pure functions of (chunk sizes, max_workers), so
// both sides compute them from the shard plan; the control plane ships only the region
// descriptors, one per region.
#ifndef SHARDPS_WIRE_REGION_LAYOUT_H_
#define SHARDPS_WIRE_REGION_LAYOUT_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/crc32c.h"

namespace shardps::layout {

constexpr size_t kAlign = 64;
inline uint64_t AlignUp(uint64_t x) { return (x + kAlign - 1) & ~(kAlign - 1); }

// Published state of one chunk, read by workers with one-sided reads.
//   state         = version << 1 | buf: the buffer that holds `version` (one 64-bit word, so a
//                   read can never see a version paired with the wrong buffer)
//   gen[b]        incremented (release) BEFORE the server starts overwriting buffer b
//   min_clock[b]  every live worker's pushes with clock <= min_clock[b] are in buffer b
//                 (stored as clock+1 so that 0 means "none yet")
//   version[b]    the version buffer b holds
// A worker reads header, data of buffer b, header again (posted back to back on one endpoint,
// executed in order); the data is a consistent snapshot iff gen[b] did not change.
struct alignas(kAlign) ChunkHeader {
  std::atomic<uint64_t> state;
  std::atomic<uint64_t> gen[2];
  std::atomic<uint64_t> min_clock_plus1[2];
  std::atomic<uint64_t> version[2];
  // Nonzero once this server serves the chunk: set at setup by a primary, at the end of its
  // promotion by a backup (the epoch), so a worker that failed over reads acks only after the
  // promoted backup applied every replicated record.
  std::atomic<uint64_t> serving_epoch;
};
static_assert(sizeof(ChunkHeader) == kAlign, "ChunkHeader is one cache line");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "lock-free 64-bit atomics required");

// The update rule a push asks the server to apply to its gradient, per tensor (a trainer's
// torch.optim param group: rule and hyper-parameters, changed by its schedulers, travel with
// the pushes: no control message). torch.optim semantics, exactly (server/optimizer.h):
//   kind 0: the server's own --optimizer and flags, with `lr` replacing --lr when > 0.
//   kind 1 (SGD): momentum, dampening, nesterov, weight_decay (L2 added to the gradient).
//   kind 2 (Adam): beta1, beta2, eps, weight_decay (L2).  kind 3 (AdamW): decoupled decay.
//   kind 4 (Store): the new value is the pushed value (BSP: the clock's pushes summed, not
//   averaged): counters such as the workers' count of non-finite steps (shardps.torch).
//   kind 5 (Adagrad): lr, eps, weight_decay (L2); `momentum` carries lr_decay and `dampening`
//   initial_accumulator_value (torch.optim.Adagrad's names).
// Row tables (embeddings) take kinds 0-2, 4, 5 with torch's sparse semantics: SGD without
// momentum or weight decay, Adam as torch.optim.SparseAdam (lazy: only the rows touched),
// Adagrad without weight decay (CheckRowRule).
enum class RuleKind : uint32_t {
  kServer = 0,
  kSgd = 1,
  kAdam = 2,
  kAdamW = 3,
  kStore = 4,
  kAdagrad = 5,
};
constexpr uint32_t kRuleKindMask = 0xff;
constexpr uint32_t kRuleNesterov = 1u << 8;
// Plain data: value-initialised ({}), it is kind 0 with lr 0 (the server's rule and rate).
struct UpdateRule {
  uint32_t kind_flags;  // RuleKind | kRuleNesterov
  float lr;             // kind 0: 0 = the server's --lr; kinds 1-3: the rate itself
  float momentum;
  float dampening;
  float weight_decay;
  float beta1;
  float beta2;
  float eps;
  RuleKind kind() const { return static_cast<RuleKind>(kind_flags & kRuleKindMask); }
  bool nesterov() const { return (kind_flags & kRuleNesterov) != 0; }
};
static_assert(sizeof(UpdateRule) == 32, "UpdateRule is 32 bytes");

// nullptr if `r` is a rule a server applies, else why not. Checked by the client before it
// sends a rule and by the server on every push (a peer may write anything there).
inline const char* CheckUpdateRule(const UpdateRule& r) {
  auto in = [](float x, float lo, float hi) { return x >= lo && x < hi; };  // false for NaN
  if ((r.kind_flags & ~(kRuleKindMask | kRuleNesterov)) != 0 ||
      (r.kind_flags & kRuleKindMask) > static_cast<uint32_t>(RuleKind::kAdagrad)) {
    return "unknown update rule";
  }
  if (!in(r.lr, 0.0f, 1e6f)) return "learning rate out of [0, 1e6)";
  if (r.kind() == RuleKind::kServer || r.kind() == RuleKind::kStore) {
    return r.nesterov() ? "nesterov is an SGD option" : nullptr;  // the rest is not used
  }
  if (!in(r.weight_decay, 0.0f, 1e6f)) return "weight decay out of [0, 1e6)";
  if (r.kind() == RuleKind::kSgd) {
    if (!in(r.momentum, 0.0f, 1e6f)) return "momentum out of [0, 1e6)";
    if (!in(r.dampening, 0.0f, 1.0f + 1e-6f)) return "dampening out of [0, 1]";
    if (r.nesterov() && (r.momentum <= 0.0f || r.dampening != 0.0f)) {
      return "nesterov momentum requires a momentum and zero dampening";
    }
    return nullptr;
  }
  if (r.nesterov()) return "nesterov is an SGD option";
  if (!in(r.eps, 0.0f, 1e6f)) return "eps out of [0, 1e6)";
  if (r.kind() == RuleKind::kAdagrad) {
    if (!in(r.momentum, 0.0f, 1e6f)) return "lr_decay out of [0, 1e6)";
    if (!in(r.dampening, 0.0f, 1e6f)) return "initial_accumulator_value out of [0, 1e6)";
    return nullptr;
  }
  if (!in(r.beta1, 0.0f, 1.0f) || !in(r.beta2, 0.0f, 1.0f)) return "betas out of [0, 1)";
  return nullptr;
}

// nullptr if a row table applies `r` (which passed CheckUpdateRule), else why not: torch's
// sparse optimizers (SGD, SparseAdam, Adagrad) have no momentum and no weight decay on sparse
// gradients, and AdamW has no sparse form.
inline const char* CheckRowRule(const UpdateRule& r) {
  switch (r.kind()) {
    case RuleKind::kServer:
    case RuleKind::kStore:
      return nullptr;
    case RuleKind::kSgd:
      return r.momentum != 0.0f || r.weight_decay != 0.0f
                 ? "a row table's SGD has no momentum and no weight decay (torch's sparse SGD)"
                 : nullptr;
    case RuleKind::kAdam:
    case RuleKind::kAdagrad:
      return r.weight_decay != 0.0f ? "a row table's optimizer has no weight decay" : nullptr;
    case RuleKind::kAdamW:
      return "AdamW has no sparse form (use Adam, which is lazy on row tables)";
  }
  return "unknown update rule";
}

// Element types on the wire (TensorSpecProto.dtype): gradients pushed and weights pulled in
// the trainer's type; the server keeps float32 master weights and optimizer state.
enum class DType : uint32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
inline uint32_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Written by a worker after the gradient bytes, on the same endpoint, with the immediate.
struct alignas(kAlign) PushHeader {
  uint64_t seq;           // per (worker, chunk), starts at 1, +1 per push: duplicates show
  uint64_t clock;         // the worker's clock when it computed the gradient
  uint64_t base_version;  // version of the weights the gradient was computed on (VSGD)
  uint32_t chunk_id;      // global chunk id, checked against the slot
  uint32_t worker;        // the worker's rank, checked against the endpoint
  uint64_t bytes;         // gradient bytes, checked against the chunk
  uint64_t epoch;         // membership epoch the worker was in (fencing)
  uint64_t magic;         // kPushMagic
  uint32_t flags;  // kPushNonFinite
  uint32_t op;     // PushOp: a gradient, or a transfer of the chunk's state
  // How to apply this gradient (BSP: the lowest rank's of the clock is applied).
  UpdateRule rule;
  uint64_t op_arg;  // kSet*: the optimizer step count to set; kGetState: the request's nonce
  // How many trainers' gradients this push sums (0 reads as 1): a host aggregator pushes the
  // sum of its local workers' gradients (docs/hierarchical.md), and an averaging server
  // divides by the total weight, not by the number of pushes.
  uint32_t weight;
  uint32_t reserved32;
  uint64_t first;  // kPushF32Values: the chunk element the values start at
  uint64_t reserved;
};
static_assert(sizeof(PushHeader) == 2 * kAlign, "PushHeader is two cache lines");
// What a push carries. Not a gradient: the chunk's state moved between a trainer and the
// servers (shardps.torch's state_dict / load_state_dict), through the same inbox slots,
// sequence numbers and acknowledgements, outside the consistency gate:
//   kSetWeights, kSetState1, kSetState2: the payload (the chunk's values, in its dtype, as a
//     gradient is) replaces the master weights / the optimizer's first / second state buffer
//     (momentum or Adam's m, Adam's v), and op_arg the optimizer's step count; a new version.
//   kClearState: the optimizer state is dropped (a torch optimizer that has not stepped).
//   kGetState: the server copies an OutboxHeader, the weights and both state buffers of the
//     published version into its outbox (remote-read) and acknowledges; the worker reads them.
// (Such a set of a 16-bit chunk is at 16-bit precision; a get returns float32. With
// kPushF32Values a set carries float32 values of a range of the chunk instead: exact.)
// On a row shard (an embedding's; Client::SetRows / GetRows / TableKeys) the ops name rows:
//   kSetWeights, kSetState1, kSetState2: the payload is entries as a gradient push's ([ids |
//     rows in the table's dtype, or float32 with kPushF32Rows], distinct ids of this shard);
//     those rows' values / state rows
//     are replaced (a hashed key without a row is given one, admission bypassed: a load is
//     explicit), and a state set makes op_arg the shard's step count; a new version.
//   kClearState: refused (a row table's state is set by rows).
//   kGetState: the payload is n ids (uint64, n <= max_ids, of this shard); the server writes
//     RowOutbox(n) into its outbox: the rows' keys and versions, float32 values, state rows.
//   kListRows: the payload is two uint64 (first slot, count <= max_ids); the server writes
//     the keys and versions of those slots (a hashed table's keys, for a state_dict).
enum class PushOp : uint32_t {
  kGradient = 0,
  kSetWeights = 1,
  kSetState1 = 2,
  kSetState2 = 3,
  kClearState = 4,
  kGetState = 5,
  kListRows = 6,  // row shards only
};
struct alignas(kAlign) OutboxHeader {
  uint64_t magic;  // kOutboxMagic
  uint64_t nonce;  // the request's
  uint32_t worker;
  uint32_t chunk_id;
  uint64_t version;
  uint64_t steps;   // the optimizer's step count
  uint64_t state1;  // elements of state buffer 1 in the outbox (0 or the chunk's)
  uint64_t state2;
  uint64_t elems;   // elements of the weights (float32) that follow this header
};
static_assert(sizeof(OutboxHeader) == kAlign, "OutboxHeader is one cache line");
constexpr uint64_t kOutboxMagic = 0x5348505342584f4full;  // "SHPSOBXO"
// The outbox: the header, then weights, state1, state2 (float32, each AlignUp'd).
inline uint64_t OutboxBytes(uint64_t max_value_bytes) {
  return kAlign + 3 * AlignUp(max_value_bytes);
}
// A row shard's answer to kGetState / kListRows of n rows of `dim` values: the header (elems =
// n x dim for a get, n for a list; state1/state2 = n x dim where the shard has that state, else
// 0), then per row its key and its version (uint64 each; bit 63 of the version: the slot holds
// a row), then (a get only) the float32 values, state 1 and state 2, each AlignUp'd.
struct RowOutbox {
  uint64_t n = 0;
  uint32_t dim = 0;
  uint64_t keys() const { return kAlign; }                     // uint64 key[n]
  uint64_t versions() const { return kAlign + AlignUp(8 * n); }  // uint64 version[n]
  uint64_t value_stride() const { return AlignUp(4 * n * uint64_t{dim}); }
  uint64_t values() const { return versions() + AlignUp(8 * n); }
  uint64_t state1() const { return values() + value_stride(); }
  uint64_t state2() const { return state1() + value_stride(); }
  uint64_t bytes() const { return state2() + value_stride(); }
};
constexpr uint64_t kRowVersionOccupied = 1ull << 63;

// The worker's gradients of this step were not all finite (a mixed-precision overflow): BSP
// skips the whole clock's update on every server (every worker pushes every chunk, so every
// chunk sees the mark: the step is skipped everywhere, consistently), ASP and SSP skip this
// push's update; a kStore rule's value is stored all the same.
constexpr uint32_t kPushNonFinite = 1;
// The push carries no gradient (Client::SetNoGradient: a frozen parameter, or one without a
// .grad this step): its data is zeros. BSP leaves the chunk as it is (weights, optimizer state
// and step count: a skipped update) when every push of the clock carries the mark, as torch
// skips a parameter whose .grad is None; otherwise the zeros are summed in. ASP and SSP skip
// the marked push's update. A kStore rule's value is stored all the same.
constexpr uint32_t kPushNoGradient = 2;
// A row set (kSetWeights, kSetState1, kSetState2 on a row shard) whose rows are float32 whatever
// the table's dtype: a 16-bit table's float32 master rows and state rows, set exactly (a
// state_dict saved from GetRows, which reads float32, loads back bit for bit). Its entries are
// [ids | n x dim float32], within the inbox slot's bytes (max_ids entries of the table's
// dtype). Refused on any other push.
constexpr uint32_t kPushF32Rows = 4;
// A dense set (kSetWeights, kSetState1, kSetState2 on a dense chunk) whose payload is float32
// values of elements [first, first + bytes / 4) of the chunk, whatever its dtype: a 16-bit
// chunk's float32 master weights and state, set exactly (Client::SetStateValues), in as many
// pushes as the inbox slot (the chunk's bytes, AlignUp'd) needs. The other elements keep
// theirs (a state not yet allocated: zeros). bytes: a positive multiple of 4, within the slot
// and the chunk. Refused on any other push.
constexpr uint32_t kPushF32Values = 8;
constexpr uint64_t kPushMagic = 0x5348505350555348ull;  // "SHPSPUSH"

// The 32-bit immediate of a worker's write-with-immediate to a server.
//   [31:28] kind, [27:0] argument
enum class ImmKind : uint32_t {
  kHello = 1,      // argument: worker rank; first message on a new endpoint (payload: Hello)
  kPush = 2,       // argument: slot << 1 | parity
  kInit = 3,       // argument: slot; the payload is initial weights (rank 0 only)
  kClock = 4,      // argument: the new clock's low 28 bits (the slot holds the full value)
  kReplHello = 5,  // primary -> backup: argument: the group; first message on the endpoint
  kRepl = 6,       // primary -> backup: argument: the record's ring entry
};

// What a worker's hello writes into its clock slot (clocks region, clock_offset(rank)); not
// into the inbox, where it would overwrite a push header the server may not have read yet. A
// new incarnation (a restarted worker process) starts fresh sequence numbers; a reconnect of the
// same incarnation (after a failover or a data-path error) keeps them, so a retried push is
// recognised as a duplicate. (The clock in the slot is informative only: the server takes
// clocks from the immediates.)
struct alignas(kAlign) Hello {
  uint64_t clock;        // the worker's clock
  uint64_t incarnation;  // the worker's coordinator member id (unique per process and join)
  uint64_t magic;        // kHelloMagic
  uint64_t reserved[5];
};
static_assert(sizeof(Hello) == kAlign, "Hello is one cache line");
constexpr uint64_t kHelloMagic = 0x5348505348454c4full;  // "SHPSHELO"

// Replication (docs/fault-tolerance.md). A backup registers a ring of record entries
// (remote-write) and a consumed counter (remote-read). The primary writes one record per new
// version it computes, BEFORE publishing that version to pulls:
//   [ReplHeader | contributors (ReplContributor x n) | payload]
// The backup applies records strictly in sequence with the same optimizer code, so its weights
// and optimizer state are bit-identical to the primary's.
enum class ReplKind : uint32_t {
  kInit = 1,   // payload: the chunk's initial weights
  kApply = 2,  // payload: the gradient (BSP: the sum in worker-rank order), scale, lr_scale
  kSet = 3,    // payload: float32 values; op: the PushOp (weights, state 1, 2, clear), steps
};
struct alignas(kAlign) ReplHeader {
  uint64_t seq;   // 1, 2, ...: strictly sequential per primary->backup stream
  uint32_t kind;  // ReplKind
  uint32_t slot;
  uint64_t version;          // the version this record produces
  uint64_t min_clock_plus1;  // published with it
  float scale;
  float lr_scale;
  uint32_t contributors;
  uint32_t flags;  // kReplSkip
  uint64_t bytes;  // payload bytes
  uint64_t epoch;  // the primary's membership epoch (fencing)
  uint64_t magic;  // kReplMagic
  UpdateRule rule;  // the rule the version was computed with (kApply)
  uint64_t steps;  // kSet: the optimizer step count set
  uint32_t op;     // kSet: the PushOp
  uint32_t reserved1;
  uint64_t reserved2;
};
static_assert(sizeof(ReplHeader) == 2 * kAlign, "ReplHeader is two cache lines");
constexpr uint64_t kReplMagic = 0x534850535245504cull;  // "SHPSREPL"
// The version is the previous one unchanged, optimizer state included (a skipped update).
constexpr uint32_t kReplSkip = 1;

// One push folded into a record: the backup's exactly-once state follows it.
struct ReplContributor {
  uint32_t worker;
  uint32_t reserved;
  uint64_t incarnation;
  uint64_t seq;
  int64_t clock;
};
static_assert(sizeof(ReplContributor) == 32, "ReplContributor is 32 bytes");

// The backup's replication ring: `entries` entries of a fixed stride.
class ReplLayout {
 public:
  ReplLayout(uint64_t max_chunk_bytes, uint32_t max_workers, uint32_t entries)
      : entries_(entries),
        contrib_bytes_(AlignUp(sizeof(ReplContributor) * max_workers)),
        stride_(sizeof(ReplHeader) + contrib_bytes_ + AlignUp(max_chunk_bytes)) {}
  uint32_t entries() const { return entries_; }
  uint64_t ring_bytes() const { return stride_ * entries_; }
  uint64_t entry_offset(uint32_t e) const { return stride_ * e; }
  uint64_t contributors_offset(uint32_t e) const { return entry_offset(e) + sizeof(ReplHeader); }
  uint64_t payload_offset(uint32_t e) const {
    return entry_offset(e) + sizeof(ReplHeader) + contrib_bytes_;
  }
  uint64_t contributors_bytes() const { return contrib_bytes_; }
  // After the entries: the hello area (one ReplHello), which no record ever overwrites.
  uint64_t hello_offset() const { return ring_bytes(); }
  uint64_t region_bytes() const;

 private:
  uint32_t entries_;
  uint64_t contrib_bytes_;
  uint64_t stride_;
};
// What the primary's kReplHello write carries (into the backup's hello area). A backup new to
// a training group (ReplicaTarget.catch_up) gets the descriptor of a snapshot of the group's
// state (server/replica_handoff.h) to copy with one-sided reads; descriptor_bytes = 0: the
// backup starts from nothing, as at start-up.
constexpr uint32_t kReplHelloDescriptorMax = 960;
struct alignas(kAlign) ReplHello {
  uint64_t magic;  // kReplHelloMagic
  uint64_t snapshot_bytes;
  uint32_t snapshot_crc;  // crc32c of the snapshot's bytes
  uint32_t descriptor_bytes;
  uint64_t reserved[5];
  char descriptor[kReplHelloDescriptorMax];  // transport::RegionDescriptor::Encode()
};
static_assert(sizeof(ReplHello) == 1024, "ReplHello is 1 KiB");
constexpr uint64_t kReplHelloMagic = 0x5348505352484c4full;  // "SHPSRHLO"
inline uint64_t ReplLayout::region_bytes() const { return ring_bytes() + sizeof(ReplHello); }

inline uint32_t MakeImm(ImmKind k, uint32_t arg) {
  return (static_cast<uint32_t>(k) << 28) | (arg & 0x0fffffffu);
}
inline ImmKind ImmKindOf(uint32_t imm) { return static_cast<ImmKind>(imm >> 28); }
inline uint32_t ImmArg(uint32_t imm) { return imm & 0x0fffffffu; }

// A row table (an embedding) is cut into `shards` row shards. Dense ids (0 <= id < rows):
// global row r lives in shard r % shards, at local row r / shards. Hashed ids (any 64-bit
// key): in shard RowHash(key) % shards, in bucket (RowHash(key) / shards) % buckets, in one of
// the bucket's kBucketSlots slots (local rows bucket * kBucketSlots ...), placed there by the
// server when the key is admitted. A slot holding a row shard has, instead of a dense chunk's
// two buffers, ONE row area updated in place, one record per local row:
//
//   RowHeader (16 B) | dim values in the table's dtype | padding to 16 B
//
// The server writes a row's values, then its header: key (the row's id), stamp (kRowOccupied
// and the version that last wrote it, modulo kRowStampPeriod: RowStampOf) and crc32c over
// (key, stamp, values). A reader takes a row only if the crc matches (a torn read of a row
// being rewritten fails it, whatever order the NIC moved the bytes in: Pilaf's self-verifying
// objects) and its key is the one looked up; the slot's ChunkHeader says which min clock every
// row includes (published after the rows are written), so one header read and the row reads
// give a consistent pull without server code.
//
// 16 bytes, not 32: for a dim-16 float32 row the header is what the row pays most for (80 B a
// record against 64 of values, 1.25x; 96 B with the former 32-byte header). The version is
// kept to 31 bits: only the server reads it (eviction picks the oldest row of a bucket; an
// incremental checkpoint takes the rows written since the last one), and it recovers the full
// version from the newest one it wrote (RowVersionOf), exactly for any row written fewer than
// kRowStampPeriod versions ago; an older row reads as younger than it is (it may be evicted
// later than its true age says, or go into an incremental checkpoint again), never as older.
//
// Its inbox slot (per worker, per parity) holds a PushHeader, then up to max_ids entries of a
// sparse gradient: n ids (uint64), then n rows of dim values in the table's dtype;
// PushHeader.bytes = n * (8 + dim * dtype bytes).
struct alignas(16) RowHeader {
  uint64_t key;    // the row's id (dense: its global row; hashed: the key; empty slot: 0)
  uint32_t stamp;  // kRowOccupied | RowStampOf(the version that last wrote the row)
  uint32_t crc;    // crc32c of key and stamp (the first 12 bytes), then the row's value bytes
};
static_assert(sizeof(RowHeader) == 16, "RowHeader is 16 bytes");
constexpr uint32_t kRowOccupied = 1u << 31;       // in RowHeader.stamp
constexpr uint64_t kRowStampPeriod = (1ull << 31) - 1;
constexpr size_t kRowHeaderCrcBytes = sizeof(uint64_t) + sizeof(uint32_t);
// A version's stamp: 0 for version 0 (the initial value), else 1 + (version - 1) mod the period
// (never 0, so a written row is never taken for an initial one).
inline uint32_t RowStampOf(uint64_t version) {
  return version == 0 ? 0 : static_cast<uint32_t>((version - 1) % kRowStampPeriod) + 1;
}
// The version a stamp stands for, given the newest version the shard wrote (`newest` >= it):
// exact when the row was written fewer than kRowStampPeriod versions before `newest`.
inline uint64_t RowVersionOf(uint32_t stamp, uint64_t newest) {
  const uint32_t s = stamp & ~kRowOccupied;
  if (s == 0) return 0;
  const uint64_t age = (RowStampOf(newest) + kRowStampPeriod - s) % kRowStampPeriod;
  return age < newest ? newest - age : newest;
}
// The crc32c a record's header carries: over key and stamp (12 bytes), then the row's value
// bytes. Writers store it in `crc`; readers compare.
inline uint32_t RowRecordCrc(const RowHeader& h, const void* values, uint64_t value_bytes) {
  const uint32_t c = crc32c::Value(&h, kRowHeaderCrcBytes);
  return crc32c::Extend(c, values, value_bytes);
}
// RowRecordCrc of `n` rows at once, interleaved (crc32c::ExtendLanes), about 3x a row at a
// time: header(i) and values(i) (value_bytes) are row i's; out[i] is what its header should
// carry in `crc`.
template <typename HeaderAt, typename ValuesAt>
inline void RowRecordCrcsOf(size_t n, uint64_t value_bytes, uint32_t* out, HeaderAt header,
                            ValuesAt values) {
  constexpr size_t kLanes = 16;
  const void* p[kLanes];
  for (size_t done = 0; done < n; done += kLanes) {
    const size_t k = std::min(kLanes, n - done);
    for (size_t i = 0; i < k; ++i) {
      out[done + i] = 0;
      p[i] = header(done + i);
    }
    crc32c::ExtendLanes(out + done, p, k, kRowHeaderCrcBytes);
    for (size_t i = 0; i < k; ++i) p[i] = values(done + i);
    crc32c::ExtendLanes(out + done, p, k, value_bytes);
  }
}
// Rows whose headers and values lie apart (a server sealing rows it has not written yet).
inline void RowRecordCrcs(const RowHeader* const* headers, const char* const* values, size_t n,
                          uint64_t value_bytes, uint32_t* out) {
  RowRecordCrcsOf(n, value_bytes, out, [&](size_t i) { return headers[i]; },
                  [&](size_t i) { return values[i]; });
}
// Records as laid out in a region or a read's staging: each a RowHeader, then its values.
inline void RowRecordCrcs(const char* const* records, size_t n, uint64_t value_bytes,
                          uint32_t* out) {
  RowRecordCrcsOf(
      n, value_bytes, out,
      [&](size_t i) { return reinterpret_cast<const RowHeader*>(records[i]); },
      [&](size_t i) { return records[i] + sizeof(RowHeader); });
}
constexpr uint32_t kBucketSlots = 4;  // slots per bucket of a hashed shard
// The hash of a hashed table's key (splitmix64's finaliser: every bit of the key moves every
// bit of the hash).
inline uint64_t RowHash(uint64_t key) {
  key += 0x9e3779b97f4a7c15ull;
  key = (key ^ (key >> 30)) * 0xbf58476d1ce4e5b9ull;
  key = (key ^ (key >> 27)) * 0x94d049bb133111ebull;
  return key ^ (key >> 31);
}
struct RowGeometry {
  uint64_t rows = 0;        // local rows (hashed: slots) of this shard (0: a dense chunk)
  uint32_t dim = 0;         // values per row
  uint32_t elem_bytes = 4;  // the dtype's
  uint32_t max_ids = 0;     // ids one push may carry
  uint32_t shard = 0;       // this shard's index in the table
  uint32_t shards = 1;      // the table's shard count
  uint64_t table_rows = 0;  // dense: the table's rows (ids < table_rows); hashed: its capacity
  bool hashed = false;      // any 64-bit key, placed in buckets (above)
  bool rows_kind() const { return rows != 0; }
  uint64_t row_value_bytes() const { return uint64_t{dim} * elem_bytes; }
  uint64_t row_stride() const { return (sizeof(RowHeader) + row_value_bytes() + 15) & ~15ull; }
  uint64_t area_bytes() const { return rows * row_stride(); }
  uint64_t buckets() const { return rows / kBucketSlots; }
  // One pushed entry: its id and its gradient row.
  uint64_t entry_bytes() const { return sizeof(uint64_t) + row_value_bytes(); }
  uint64_t inbox_bytes() const { return uint64_t{max_ids} * entry_bytes(); }
  // A row set's entry (kPushF32Rows: float32 rows), and how many fit one inbox slot.
  uint64_t set_entry_bytes(bool f32_rows) const {
    return f32_rows ? sizeof(uint64_t) + uint64_t{dim} * sizeof(float) : entry_bytes();
  }
  uint64_t max_set_entries(bool f32_rows) const {
    const uint64_t fit = inbox_bytes() / set_entry_bytes(f32_rows);
    return fit < max_ids ? fit : max_ids;
  }
  // Where an id lives.
  uint32_t ShardOf(uint64_t id) const {
    return static_cast<uint32_t>((hashed ? RowHash(id) : id) % shards);
  }
  uint64_t LocalRow(uint64_t id) const { return id / shards; }  // dense
  uint64_t BucketOf(uint64_t key) const { return (RowHash(key) / shards) % buckets(); }  // hashed
  // Local rows of shard `k` of a table of `table_rows` (hashed: capacity) cut into `shards`.
  static uint64_t ShardRows(uint64_t table_rows, uint32_t shards, uint32_t k, bool hashed = false) {
    if (hashed) {
      const uint64_t per = (table_rows + shards - 1) / shards;
      return std::max<uint64_t>(kBucketSlots, (per + kBucketSlots - 1) / kBucketSlots * kBucketSlots);
    }
    return table_rows > k ? (table_rows - k + shards - 1) / shards : 0;
  }
};

// Offsets for one server, from the byte sizes of its chunks (in slot order) and, for row
// shards, their geometry (rows[slot].rows != 0; `chunk_bytes` is then unused for offsets).
class ServerLayout {
 public:
  ServerLayout(std::vector<uint64_t> chunk_bytes, uint32_t max_workers,
               std::vector<RowGeometry> rows = {});

  uint32_t slots() const { return static_cast<uint32_t>(chunk_bytes_.size()); }
  uint32_t max_workers() const { return max_workers_; }
  uint64_t chunk_bytes(uint32_t slot) const { return chunk_bytes_[slot]; }
  // The slot's row geometry (rows == 0: a dense chunk).
  const RowGeometry& rows(uint32_t slot) const { return rows_[slot]; }
  bool is_rows(uint32_t slot) const { return rows_[slot].rows_kind(); }

  uint64_t weights_bytes() const { return weights_total_; }
  uint64_t header_offset(uint32_t slot) const { return weights_off_[slot]; }
  // Dense: buffer b. Rows: the row area (b must be 0).
  uint64_t buffer_offset(uint32_t slot, uint32_t b) const {
    return weights_off_[slot] + kAlign + b * AlignUp(chunk_bytes_[slot]);
  }
  uint64_t row_offset(uint32_t slot, uint64_t local_row) const {
    return weights_off_[slot] + kAlign + local_row * rows_[slot].row_stride();
  }

  uint64_t inbox_bytes() const { return inbox_stride_ * max_workers_; }
  uint64_t push_header_offset(uint32_t worker, uint32_t slot, uint32_t parity) const {
    return worker * inbox_stride_ + inbox_off_[slot] + parity * inbox_slot_bytes_[slot];
  }
  uint64_t push_data_offset(uint32_t worker, uint32_t slot, uint32_t parity) const {
    return push_header_offset(worker, slot, parity) + sizeof(PushHeader);
  }
  // The most payload bytes one push of the slot may carry.
  uint64_t push_capacity(uint32_t slot) const {
    return inbox_slot_bytes_[slot] - sizeof(PushHeader);
  }

  uint64_t acks_bytes() const { return AlignUp(sizeof(uint64_t) * slots()) * max_workers_; }
  uint64_t ack_offset(uint32_t worker, uint32_t slot) const {
    return worker * AlignUp(sizeof(uint64_t) * slots()) + slot * sizeof(uint64_t);
  }
  uint64_t acks_of_worker_offset(uint32_t worker) const { return ack_offset(worker, 0); }

  uint64_t clocks_bytes() const { return kAlign * max_workers_; }
  uint64_t clock_offset(uint32_t worker) const { return kAlign * worker; }
  uint64_t acks_of_worker_bytes() const { return sizeof(uint64_t) * slots(); }

 private:
  std::vector<uint64_t> chunk_bytes_;
  uint32_t max_workers_;
  std::vector<RowGeometry> rows_;
  std::vector<uint64_t> weights_off_;
  uint64_t weights_total_ = 0;
  std::vector<uint64_t> inbox_off_;
  std::vector<uint64_t> inbox_slot_bytes_;  // one parity's: PushHeader + payload
  uint64_t inbox_stride_ = 0;
};

inline ServerLayout::ServerLayout(std::vector<uint64_t> chunk_bytes, uint32_t max_workers,
                                  std::vector<RowGeometry> rows)
    : chunk_bytes_(std::move(chunk_bytes)), max_workers_(max_workers), rows_(std::move(rows)) {
  rows_.resize(chunk_bytes_.size());
  for (size_t s = 0; s < chunk_bytes_.size(); ++s) {
    const uint64_t b = chunk_bytes_[s];
    const RowGeometry& g = rows_[s];
    weights_off_.push_back(weights_total_);
    weights_total_ += g.rows_kind() ? kAlign + AlignUp(g.area_bytes()) : kAlign + 2 * AlignUp(b);
    inbox_off_.push_back(inbox_stride_);
    inbox_slot_bytes_.push_back(sizeof(PushHeader) +
                                AlignUp(g.rows_kind() ? g.inbox_bytes() : b));
    inbox_stride_ += 2 * inbox_slot_bytes_.back();
  }
  if (weights_total_ == 0) weights_total_ = kAlign;
  if (inbox_stride_ == 0) inbox_stride_ = kAlign;
}

}  // namespace shardps::layout

#endif  // SHARDPS_WIRE_REGION_LAYOUT_H_
