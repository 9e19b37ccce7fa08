// Host aggregation (docs/hierarchical.md): the shared memory of one host's group (its
// aggregator and its local workers) and the helpers both sides use. Internal.
//
// The region (two memfds, created by the aggregator, passed to each local worker over the unix
// socket with SCM_RIGHTS; both sealed against resizing and further seals, so no worker can
// shrink them under the aggregator; the second, the weights, also sealed F_SEAL_FUTURE_WRITE
// once the aggregator has mapped it, so a worker can map it read-only only):
//
//   [GroupHeader][LocalSlot 0 | TensorControl x T] ... [LocalSlot L-1 | ...]   read-write
//   [gradient area of local rank 0] ... [gradient area of local rank L-1]     read-write
//   [weights area]            (second memfd, at offset 0) read-only in local workers, written
//                             by the aggregator's pulls (its registered memory)
//
// Every area is page aligned; a tensor sits at the same offset in each gradient area and in the
// weights area. A local worker finishing clock c writes its gradients and TensorControl, then
// stores clock_done = c + 1 (release) and rings agg_bell; the aggregator, once every live
// local worker's clock_done > c, sums the areas in local-rank order, pushes, clocks, pulls into
// the weights area, stores weights_clock = c + 1 (release) and rings worker_bell. Both bells are
// futex words (shared, not private): waiters sleep in the kernel, never on a timeout that could
// declare a descheduled peer dead. A peer's death is learnt from its socket (EOF), never from
// the shared memory.
//
// Thread safety: the structs are shared between processes; every field that both sides touch
// after set-up is atomic. The helper functions are stateless.
#ifndef SHARDPS_WORKER_HOST_GROUP_H_
#define SHARDPS_WORKER_HOST_GROUP_H_

#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "proto/control.pb.h"
#include "shardps/client.h"

namespace shardps::worker::host {

constexpr uint64_t kGroupMagic = 0x5348505348475250ull;  // "SHPSHGRP"
constexpr uint64_t kPage = 4096;
inline uint64_t PageUp(uint64_t x) { return (x + kPage - 1) & ~(kPage - 1); }

// What LocalJoin.proof authenticates (with the cluster token as the key).
constexpr const char* kJoinProofMessage = "shardps-local-join";
// The largest LocalMessage (a join lists every tensor).
constexpr size_t kMaxLocalMessage = 1 << 20;

enum class GroupState : uint32_t { kSetup = 0, kRunning = 1, kFailed = 2, kClosed = 3 };

struct alignas(64) GroupHeader {
  uint64_t magic;
  uint64_t generation;
  uint32_t local_workers;
  uint32_t tensors;
  std::atomic<uint32_t> state;        // GroupState
  std::atomic<uint32_t> worker_bell;  // futex: rung by the aggregator (weights, state)
  std::atomic<uint32_t> agg_bell;     // futex: rung by local workers (a clock done, a barrier)
  // The newest barrier generation passed (Client::Barrier), numbered as the cluster's: set at
  // start to the cluster's released generation; once every live local worker arrived at b =
  // this + 1, the aggregator passes the cluster's barrier b, stores b (release) and rings
  // worker_bell.
  std::atomic<uint32_t> barrier_released;
  std::atomic<uint64_t> weights_clock;  // the host clock the weights area satisfies
  std::atomic<uint32_t> hosts;          // live workers of the cluster (aggregators)
  uint32_t reserved1;
  char error[256];                      // kFailed: why (NUL-terminated)
};

// Per local rank; written by that worker only (after set-up).
struct alignas(64) LocalSlot {
  std::atomic<uint64_t> clock_done;  // c + 1: its gradients of clock c are complete
  uint32_t flags;                    // of the latest clock done: kPushNonFinite
  std::atomic<uint32_t> barrier_arrived;  // the latest barrier it arrived at (then agg_bell)
};

// Per local rank and tensor, written before clock_done.
struct TensorControl {
  uint64_t pushed_clock;  // c + 1: the tensor's gradient area holds its gradient of clock c
  float lr;               // SetLearningRate (0: the servers')
  uint32_t has_rule;      // SetUpdateRule was called
  UpdateRule rule;
  uint32_t no_gradient;   // SetNoGradient: this gradient is no gradient (zeros, a frozen tensor)
  uint32_t reserved;
};

// The layout both sides derive from LocalWelcome (checked by the local worker against the
// region's size before it touches anything).
struct GroupLayout {
  uint32_t local_workers = 0;
  uint32_t tensors = 0;
  uint64_t region_bytes = 0;
  uint64_t slots_offset = 0, slot_stride = 0;
  uint64_t grads_offset = 0, grads_stride = 0;
  uint64_t weights_offset = 0;
  std::vector<uint64_t> tensor_offset, tensor_bytes;

  // For `tensor_bytes` (each tensor's bytes) and `local_workers` slots.
  static GroupLayout Make(uint32_t local_workers, const std::vector<uint64_t>& tensor_bytes);
  control::LocalWelcome ToWelcome(uint64_t generation) const;
  // Checks a welcome from the aggregator (offsets inside the region, in order, page aligned).
  static StatusOr<GroupLayout> FromWelcome(const control::LocalWelcome& w, uint32_t tensors);

  uint64_t slot_offset(uint32_t l) const { return slots_offset + l * slot_stride; }
  uint64_t control_offset(uint32_t l, uint32_t t) const {
    return slot_offset(l) + sizeof(LocalSlot) + t * sizeof(TensorControl);
  }
  uint64_t grad_offset(uint32_t l, uint32_t t) const {
    return grads_offset + l * grads_stride + tensor_offset[t];
  }
  uint64_t weight_offset(uint32_t t) const { return weights_offset + tensor_offset[t]; }
};

// Bytes of one element of a wire dtype (0 float32, 1 float16, 2 bfloat16).
inline uint64_t ElemBytes(uint32_t dtype) { return dtype == 0 ? 4 : 2; }

// Futex wait on a shared word while it equals `seen`, at most `timeout` (spurious wake-ups are
// fine: callers re-check).
void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::microseconds timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

// One LocalMessage per packet on a SOCK_SEQPACKET socket, with up to two fds (-1: none).
Status SendLocal(int sock, const control::LocalMessage& m, int fd_to_pass = -1, int fd2 = -1);
// Waits up to `timeout` for one message. *fd (and *fd2) receive passed fds (or stay invalid).
// UNAVAILABLE on EOF (the peer is gone), DEADLINE_EXCEEDED on timeout, INVALID_ARGUMENT for a
// packet that does not parse.
StatusOr<control::LocalMessage> ReceiveLocal(int sock, std::chrono::milliseconds timeout,
                                             UniqueFd* fd = nullptr, UniqueFd* fd2 = nullptr);
// True when the peer of `sock` has closed it (or it failed); never blocks.
bool PeerGone(int sock);

// sockaddr for a socket path ("@name": abstract namespace).
Status MakeUnixAddress(const std::string& path, struct sockaddr_un* addr, socklen_t* len);

// A shared mapping of [offset, offset + bytes) of `fd`, unmapped by the destructor.
class Mapping {
 public:
  Mapping() = default;
  ~Mapping();
  Mapping(Mapping&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  static StatusOr<Mapping> Map(int fd, uint64_t offset, uint64_t bytes, bool writable);
  char* data() const { return static_cast<char*>(p_); }
  uint64_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  uint64_t n_ = 0;
};

}  // namespace shardps::worker::host

#endif  // SHARDPS_WORKER_HOST_GROUP_H_
