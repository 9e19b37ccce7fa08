// ReplicaApplier: the backup side of replication (docs/fault-tolerance.md). The primary writes
// records into this server's registered ring; each record's immediate hands its entry here.
// Records are applied strictly in sequence with the same optimizer code as the primary's, so
// weights, optimizer state and exactly-once state (last sequence number per worker and slot,
// acks included) match the primary's bit for bit. After each record the sequence number applied
// is stored in the remote-read `consumed` word, from which the primary learns the ring's space.
//
// A refused record (malformed, out of sequence, fenced) means this backup can no longer follow
// its primary: Apply() returns the reason and the applier remembers since when it is broken.
//
// Thread safety: not thread-safe. Owned by the server's apply thread; the primary writes the
// ring remotely, and a record is read only once its immediate completed (it is then whole).
#ifndef SHARDPS_SERVER_REPLICA_APPLIER_H_
#define SHARDPS_SERVER_REPLICA_APPLIER_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "common/status.h"
#include "server/ack_board.h"
#include "server/chunk_store.h"
#include "server/consistency_gate.h"
#include "server/worker_table.h"
#include "wire/region_layout.h"

namespace shardps::server {

// Checks a record header against the state it must follow. Pure.
Status CheckRecord(const layout::ReplHeader& h, uint64_t expected_seq, uint64_t fence_epoch,
                   const ChunkStore& chunks, uint32_t max_workers);

class ReplicaApplier {
 public:
  // `ring` (ring.ring_bytes()) and `consumed` (one u64) are this backup's registered regions.
  ReplicaApplier(const layout::ReplLayout& ring, const void* ring_memory, void* consumed,
                 uint32_t max_workers)
      : ring_(ring),
        ring_memory_(static_cast<const char*>(ring_memory)),
        consumed_(static_cast<std::atomic<uint64_t>*>(consumed)),
        max_workers_(max_workers) {}

  // Applies the record in ring entry `entry` to the chunks, the workers' exactly-once state, the
  // acks and (BSP) the gate's applied clock, and publishes its version.
  Status Apply(uint32_t entry, uint64_t fence_epoch, ChunkStore& chunks, WorkerTable& workers,
               ConsistencyGate& gate, AckBoard& acks);
  uint64_t applied() const { return expected_ - 1; }

  // The endpoint the primary's stream arrives on (0: none yet or cut off).
  uint64_t primary_endpoint() const { return primary_endpoint_; }
  void set_primary_endpoint(uint64_t id) { primary_endpoint_ = id; }
  // When this backup lost its primary's stream or refused a record (epoch of steady_clock: not).
  std::chrono::steady_clock::time_point broken_since() const { return broken_since_; }
  bool broken() const { return broken_since_ != std::chrono::steady_clock::time_point(); }
  void MarkBroken() {
    if (!broken()) broken_since_ = std::chrono::steady_clock::now();
  }

 private:
  const layout::ReplLayout& ring_;
  const char* ring_memory_;
  std::atomic<uint64_t>* consumed_;
  uint32_t max_workers_;
  uint64_t expected_ = 1;
  uint64_t primary_endpoint_ = 0;
  std::chrono::steady_clock::time_point broken_since_{};
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_REPLICA_APPLIER_H_
