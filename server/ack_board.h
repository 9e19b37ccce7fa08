// AckBoard: the registered acks region (wire/region_layout.h): per worker and slot, the highest
// push sequence number consumed, which workers read with one-sided reads. A push is
// acknowledged only once the version folding it in is published (and, with a backup,
// replicated): until then the worker must keep its inbox slot and its own copy.
//
// Thread safety: not thread-safe for writers; owned by the server's apply thread. Workers read
// the words remotely (each is one aligned 64-bit atomic, stored with release).
#ifndef SHARDPS_SERVER_ACK_BOARD_H_
#define SHARDPS_SERVER_ACK_BOARD_H_

#include <atomic>
#include <cstdint>

#include "wire/region_layout.h"

namespace shardps::server {

class AckBoard {
 public:
  AckBoard(void* acks, const layout::ServerLayout& layout)
      : base_(static_cast<char*>(acks)), layout_(layout) {}
  // Raises (never lowers) the ack of (worker, slot) to seq.
  void Raise(uint32_t worker, uint32_t slot, uint64_t seq) {
    auto* ack = Word(layout_.ack_offset(worker, slot));
    if (ack->load(std::memory_order_relaxed) < seq) ack->store(seq, std::memory_order_release);
  }
  uint64_t Get(uint32_t worker, uint32_t slot) const {
    return Word(layout_.ack_offset(worker, slot))->load(std::memory_order_acquire);
  }
  // A new incarnation of the worker: its acks restart with its sequence numbers.
  void ResetWorker(uint32_t worker) {
    auto* acks = Word(layout_.acks_of_worker_offset(worker));
    for (uint32_t s = 0; s < layout_.slots(); ++s) acks[s].store(0, std::memory_order_release);
  }

 private:
  std::atomic<uint64_t>* Word(uint64_t offset) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + offset);
  }
  char* base_;
  const layout::ServerLayout& layout_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_ACK_BOARD_H_
