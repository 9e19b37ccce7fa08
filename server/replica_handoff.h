// Replica handoff: the snapshot of a group's state that a primary hands to a NEW backup (a spare
// or a replacement server) so that it can follow the replication stream of a group that is
// already training (docs/fault-tolerance.md, "Redundancy restored").
//
// The primary writes the snapshot into a registered remote-read region at the moment its stream
// to the new backup starts (one apply-thread step: nothing in between), and names that region in
// its replication hello. Every version after the snapshot goes to the backup as a record. The
// backup copies the snapshot with one-sided reads while training goes on (records that arrive
// meanwhile wait in its ring), restores it, then applies the held records and follows.
//
// The snapshot holds exactly the state a backup that had followed from the start would hold:
// per slot the published weights, version and min clock, the optimizer state, the VSGD history
// and the BSP clock applied; per worker its incarnation and, per slot, the exactly-once state of
// APPLIED pushes (the acknowledged sequence number; a BSP push folded into a clock not applied
// yet is neither acknowledged nor counted, so a failover resends it).
//
// Format (host byte order: primary and backup run the same build; docs/region-layout.md):
//   HandoffHeader, then per slot: SlotHeader, weights[elems], state1[n1], state2[n2],
//   history x (u64 version, weights[elems]); then per worker: WorkerHeader, then per slot
//   (u64 last_seq, i64 applied_clock, u64 ack); then u32 crc32c of everything before.
//
// Thread safety: pure functions over the apply thread's components.
#ifndef SHARDPS_SERVER_REPLICA_HANDOFF_H_
#define SHARDPS_SERVER_REPLICA_HANDOFF_H_

#include <cstdint>

#include "common/status.h"
#include "server/ack_board.h"
#include "server/chunk_store.h"
#include "server/consistency_gate.h"
#include "server/worker_table.h"

namespace shardps::server {

constexpr uint64_t kHandoffMagic = 0x53485053484e4446ull;  // "SHPSHNDF"

// The components a snapshot is taken from and restored into.
struct HandoffState {
  ChunkStore* chunks;
  WorkerTable* workers;
  ConsistencyGate* gate;
  AckBoard* acks;
};

// Bytes WriteHandoff needs for the current state.
uint64_t HandoffBytes(const HandoffState& s);
// Writes the snapshot into dst[0, capacity); returns the bytes written.
StatusOr<uint64_t> WriteHandoff(const HandoffState& s, uint32_t group, char* dst,
                                uint64_t capacity);
// Checks the snapshot in src[0, n) completely (checksum, group, slots, sizes, ranks below
// max_workers) and only then restores it into `s`, whose chunks must all be uninitialised (a
// new backup). Nothing is changed when it is refused.
Status RestoreHandoff(const char* src, uint64_t n, uint32_t group, uint32_t max_workers,
                      const HandoffState& s);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_REPLICA_HANDOFF_H_
