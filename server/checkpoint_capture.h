// CheckpointCapture: decides when a group's checkpoint is taken and assembles it. Each chunk is
// captured at the first version it publishes whose min clock reaches the checkpoint clock (so
// the snapshot holds every update of clocks below it and, per chunk, none of later ones); once
// every chunk is captured, the workers' exactly-once state is added and the snapshot is handed
// back for the CheckpointWriter. Clocks come from `checkpoint_every` or from requests.
//
// Thread safety: not thread-safe. Owned by the server's apply thread (the writer thread only
// receives finished snapshots).
#ifndef SHARDPS_SERVER_CHECKPOINT_CAPTURE_H_
#define SHARDPS_SERVER_CHECKPOINT_CAPTURE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/checkpoint.h"
#include "server/worker_table.h"

namespace shardps::server {

class CheckpointCapture {
 public:
  struct Identity {
    std::string plan_fingerprint;
    uint32_t group = 0;
    uint32_t num_groups = 1;
    std::string optimizer;
  };
  CheckpointCapture(Identity identity, uint32_t slots, uint64_t every)
      : id_(std::move(identity)), slots_(slots), every_(every) {}

  // A checkpoint was restored at `clock`: the next one comes after it.
  void Restored(uint64_t clock) { last_ = clock; }
  uint64_t next() const { return next_; }
  uint64_t last() const { return last_; }

  enum class Request { kAccepted, kIgnored, kRefused };
  // A request for a checkpoint at `clock`, while the group's chunks have published up to
  // `published_plus1` (the highest min clock + 1). Ignored when not after the last one, not
  // before the planned one, or while one is being captured; refused when some chunk already
  // holds updates of `clock` or later (a snapshot now would mix clocks).
  Request OnRequest(uint64_t clock, uint64_t published_plus1);

  // Whether `slot`'s version just published with `min_clock_plus1` is to be captured now (the
  // caller then passes its state to Captured). The snapshot started by the first capture
  // records `epoch`.
  bool Wants(uint32_t slot, uint64_t min_clock_plus1, uint64_t epoch);
  // The captured state of `slot`. When it completes the snapshot, returns it (with the workers'
  // progress from `workers`) for the writer.
  std::optional<ShardSnapshot> Captured(uint32_t slot, ChunkState state,
                                        const WorkerTable& workers);

  // Incremental checkpoints of row shards (docs/checkpoints.md): the base a capture of `slot`
  // for the checkpoint being taken may be relative to — the clock and the version of its last
  // capture — or nothing (a whole capture: the first, every `full_every`-th, after ForceFull,
  // or when its optimizer state buffers changed since: an increment's state rows need them in
  // its base). state: which buffers the slot has now (ChunkStore::state_buffers).
  struct Base {
    uint64_t clock;
    uint64_t version;
  };
  std::optional<Base> IncrementalBase(uint32_t slot, uint32_t state) const;
  // Records a capture of `slot` (its version, whether it was whole, its state buffers).
  void NoteCapture(uint32_t slot, uint64_t version, bool whole, uint32_t state);
  // The next capture of every slot is whole (a write failed: its increments have no base).
  void ForceFull();
  void set_full_every(uint32_t n) { full_every_ = n; }

 private:
  Identity id_;
  uint32_t slots_;
  uint64_t every_;
  uint64_t next_ = 0;  // the clock of the next checkpoint (0: none planned)
  uint64_t last_ = 0;  // the clock of the last one submitted (or restored)
  std::unique_ptr<ShardSnapshot> pending_;
  std::vector<bool> captured_;
  uint32_t captured_count_ = 0;
  struct SlotHistory {
    uint64_t clock = 0;  // of its last capture (0: none)
    uint64_t version = 0;
    uint32_t since_whole = 0;  // increments since the last whole capture
    uint32_t had_state = 0;  // state buffers (bit 0: state 1, bit 1: state 2)
  };
  std::vector<SlotHistory> history_ = std::vector<SlotHistory>(slots_);
  uint32_t full_every_ = 8;  // a whole capture at least every this many
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_CHECKPOINT_CAPTURE_H_
