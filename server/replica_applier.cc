#include "server/replica_applier.h"

#include <cstring>
#include <string>

#include "common/crash_point.h"

namespace shardps::server {

Status CheckRecord(const layout::ReplHeader& h, uint64_t expected_seq, uint64_t fence_epoch,
                   const ChunkStore& chunks, uint32_t max_workers) {
  if (h.magic != layout::kReplMagic) return InvalidArgumentError("bad magic");
  if (h.seq != expected_seq) {
    return FailedPreconditionError("sequence " + std::to_string(h.seq) + ", expected " +
                                   std::to_string(expected_seq));
  }
  if (h.epoch < fence_epoch) return FailedPreconditionError("from an epoch before the fence");
  if (h.slot >= chunks.slots()) return InvalidArgumentError("slot out of range");
  // An init carries the wire bytes, an update the float32 values.
  const bool init = h.kind == static_cast<uint32_t>(layout::ReplKind::kInit);
  if (chunks.is_rows(h.slot)) {
    // A row shard's records are updates and row sets, of a sparse payload (checked by the
    // applier).
    const bool set = h.kind == static_cast<uint32_t>(layout::ReplKind::kSet) &&
                     h.op >= static_cast<uint32_t>(layout::PushOp::kSetWeights) &&
                     h.op <= static_cast<uint32_t>(layout::PushOp::kSetState2);
    if ((h.kind != static_cast<uint32_t>(layout::ReplKind::kApply) && !set) ||
        h.bytes > chunks.value_bytes(h.slot) || h.contributors > max_workers) {
      return InvalidArgumentError(
          "a row shard's record is not an update or a row set that fits the slot");
    }
    if (const char* bad = layout::CheckRowRule(h.rule)) return InvalidArgumentError(bad);
  } else if (h.bytes != (init ? chunks.bytes(h.slot) : chunks.value_bytes(h.slot)) ||
             h.contributors > max_workers) {
    return InvalidArgumentError("size fields do not match the slot");
  }
  const uint64_t version = chunks.version(h.slot);
  if (h.version != version + 1) {
    return FailedPreconditionError("version " + std::to_string(h.version) + " does not follow " +
                                   std::to_string(version));
  }
  if (h.kind == static_cast<uint32_t>(layout::ReplKind::kInit)) {
    if (version != 0) return FailedPreconditionError("init of an initialised chunk");
  } else if (h.kind == static_cast<uint32_t>(layout::ReplKind::kApply)) {
    if (version == 0) return FailedPreconditionError("update of an uninitialised chunk");
    if (const char* bad = layout::CheckUpdateRule(h.rule)) return InvalidArgumentError(bad);
  } else if (h.kind == static_cast<uint32_t>(layout::ReplKind::kSet)) {
    if (version == 0) return FailedPreconditionError("set of an uninitialised chunk");
    if (h.op < static_cast<uint32_t>(layout::PushOp::kSetWeights) ||
        h.op > static_cast<uint32_t>(layout::PushOp::kClearState)) {
      return InvalidArgumentError("unknown set");
    }
  } else {
    return InvalidArgumentError("unknown kind");
  }
  return Status::OK();
}

Status ReplicaApplier::Apply(uint32_t entry, uint64_t fence_epoch, ChunkStore& chunks,
                             WorkerTable& workers, ConsistencyGate& gate, AckBoard& acks) {
  Status st = [&]() -> Status {
    if (entry >= ring_.entries()) return InvalidArgumentError("entry out of range");
    const char* base = ring_memory_ + ring_.entry_offset(entry);
    layout::ReplHeader h;
    std::memcpy(&h, base, sizeof(h));
    RETURN_IF_ERROR(CheckRecord(h, expected_, fence_epoch, chunks, max_workers_));
    const auto* payload =
        reinterpret_cast<const float*>(ring_memory_ + ring_.payload_offset(entry));
    uint32_t target;
    if (h.kind == static_cast<uint32_t>(layout::ReplKind::kInit)) {
      target = chunks.Init(h.slot, payload);
    } else if (h.kind == static_cast<uint32_t>(layout::ReplKind::kSet)) {
      if (chunks.is_rows(h.slot)) {
        RETURN_IF_ERROR(chunks.row_shard(h.slot)->CheckPayload(
            reinterpret_cast<const char*>(payload), h.bytes));
      }
      target = chunks.Set(h.slot, static_cast<layout::PushOp>(h.op), payload, h.steps, h.rule);
    } else {
      if (chunks.is_rows(h.slot) && (h.flags & layout::kReplSkip) == 0) {
        RETURN_IF_ERROR(chunks.row_shard(h.slot)->CheckPayload(
            reinterpret_cast<const char*>(payload), h.bytes));
      }
      target = chunks.Compute(h.slot, payload, h.scale, h.lr_scale, h.rule,
                              (h.flags & layout::kReplSkip) != 0);
    }
    const auto* k =
        reinterpret_cast<const layout::ReplContributor*>(base + sizeof(layout::ReplHeader));
    for (uint32_t i = 0; i < h.contributors; ++i) {
      if (k[i].worker >= max_workers_) continue;
      bool fresh = false;
      if (!workers.FoldReplicated(k[i].worker, k[i].incarnation, h.slot, k[i].seq, k[i].clock,
                                  &fresh)) {
        continue;
      }
      if (fresh) acks.ResetWorker(k[i].worker);
      acks.Raise(k[i].worker, h.slot, k[i].seq);
      gate.NoteAppliedThrough(h.slot, k[i].clock);
    }
    chunks.Publish(h.slot, target, h.min_clock_plus1);
    ++expected_;
    consumed_->store(h.seq, std::memory_order_release);
    // The backup's side of the same point: "@N", the Nth state set's record applied.
    if (h.kind == static_cast<uint32_t>(layout::ReplKind::kSet)) CrashPoint("server.after_state_set");
    return Status::OK();
  }();
  if (!st.ok()) MarkBroken();
  return st;
}

}  // namespace shardps::server
