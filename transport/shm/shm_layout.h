// Shared-memory layouts of the shm provider, and the RAII holders of fds and mappings.
//
// Three kinds of shared memory exist (see docs in shm_fabric.cc's header comment):
//
//  * Arenas (two memfds per Fabric): the bytes of every region the fabric allocated; a region
//    is a [offset, offset+len) range of one. The read-write arena (sealed SHRINK|GROW) holds
//    regions peers may write; peers map it read-write. The read-only arena (sealed
//    SHRINK|GROW|FUTURE_WRITE after the owner mapped it) holds remote-read-only
//    regions; peers can map it only PROT_READ, and cannot mprotect it writable. In the table,
//    offsets [0, S) name the read-write arena and [S, 2S) the read-only one (S = arena_size).
//  * Region table (one memfd per Fabric, sealed SHRINK|GROW|FUTURE_WRITE after the owner mapped
//    it read-write, so peers can map it read-only only): TableHeader, then kTableCapacity
//    TableEntry records. The initiator checks every operation against the target's table.
//  * Doorbell (one memfd per connection, created by the acceptor, sealed SHRINK|GROW): a
//    DoorbellHeader, then two single-producer single-consumer rings of write-with-immediate
//    notifications. Ring 0 carries connector->acceptor, ring 1 acceptor->connector.
//
// Everything read from shared memory written by a peer is validated before use: a buggy or
// hostile peer can corrupt its own connection, never crash or mislead this process into an
// out-of-bounds access.
//
// Thread safety: the layout structs are accessed only through std::atomic members (the peer
// writes concurrently); UniqueFd and Mapping are plain values owned by one object.
#ifndef SHARDPS_TRANSPORT_SHM_SHM_LAYOUT_H_
#define SHARDPS_TRANSPORT_SHM_SHM_LAYOUT_H_

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "common/fd.h"

namespace shardps::transport::shm {

constexpr uint32_t kLayoutVersion = 2;  // 2: the read-only arena
constexpr size_t kCacheLine = 64;

// ---- Region table -------------------------------------------------------------------------
// rkey = slot | generation << kRkeySlotBits. Generations start at 1 and skip 0 when they wrap,
// so rkey 0 never names a live region and a reused slot never matches an old rkey (until the
// 16-bit generation of that very slot wraps: 65535 re-registrations of one slot).
constexpr int kRkeySlotBits = 16;
constexpr uint32_t kTableCapacity = 1u << kRkeySlotBits;
constexpr uint32_t kRkeySlotMask = kTableCapacity - 1;
constexpr uint64_t kTableMagic = 0x3130425450485353ull;  // "SSHPTB01"

struct alignas(kCacheLine) TableHeader {
  std::atomic<uint64_t> magic;
  std::atomic<uint64_t> version;
  std::atomic<uint64_t> capacity;
  std::atomic<uint64_t> arena_size;
};

// state: bit 0 live, bits 1-2 Access, bits 32-47 generation. Written by the owner with a
// release store after va/offset/length; a reader loads state (acquire), the fields, then state
// again (seqlock) and accepts only if both loads agree.
struct TableEntry {
  std::atomic<uint64_t> state;
  std::atomic<uint64_t> va;      // the owner's address of the region's first byte
  std::atomic<uint64_t> offset;  // arena offset of the region's first byte
  std::atomic<uint64_t> length;  // bytes
};
static_assert(sizeof(TableEntry) == 32, "table entry layout");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock free");
constexpr size_t kTableBytes = sizeof(TableHeader) + kTableCapacity * sizeof(TableEntry);

inline uint64_t EntryState(uint32_t generation, uint32_t access, bool live) {
  return (static_cast<uint64_t>(generation) << 32) | (access << 1) | (live ? 1u : 0u);
}
inline bool StateLive(uint64_t s) { return s & 1u; }
inline uint32_t StateAccess(uint64_t s) { return (s >> 1) & 3u; }
inline uint32_t StateGeneration(uint64_t s) { return static_cast<uint32_t>(s >> 32); }

// ---- Doorbell rings ------------------------------------------------------------------------
// A ring of capacity C (the consumer's recv_depth): tail (producer-owned) and head
// (consumer-owned) on their own cache lines, then C slots of {u32 imm, u32 byte_len} packed into
// one u64 (imm in the low half). Indices count up forever; slot = index % C. The producer
// memcpys the payload, stores the slot, then publishes tail with a release store; the consumer
// acquire-loads tail, reads slots, then publishes head with a release store.
constexpr uint64_t kDoorbellMagic = 0x3130424450485353ull;  // "SSHPDB01"
constexpr uint32_t kMaxRingCapacity = 1u << 20;

struct alignas(kCacheLine) DoorbellHeader {
  std::atomic<uint64_t> magic;
  std::atomic<uint64_t> version;
  std::atomic<uint64_t> capacity[2];
};
struct alignas(kCacheLine) RingIndex {
  std::atomic<uint64_t> value;
};
static_assert(sizeof(RingIndex) == kCacheLine, "ring indices own a cache line");

inline size_t RingBytes(uint32_t capacity) {
  const size_t slots = (static_cast<size_t>(capacity) * 8 + kCacheLine - 1) / kCacheLine;
  return 2 * sizeof(RingIndex) + slots * kCacheLine;
}
inline size_t RingOffset(int ring, uint32_t cap0) {
  return sizeof(DoorbellHeader) + (ring == 0 ? 0 : RingBytes(cap0));
}
inline size_t DoorbellBytes(uint32_t cap0, uint32_t cap1) {
  return sizeof(DoorbellHeader) + RingBytes(cap0) + RingBytes(cap1);
}

// One side's view of a ring. `local` is this side's private copy of its own index (tail for the
// producer, head for the consumer): the shared copy is only ever written, never trusted.
struct RingView {
  std::atomic<uint64_t>* tail = nullptr;
  std::atomic<uint64_t>* head = nullptr;
  std::atomic<uint64_t>* slots = nullptr;
  uint64_t capacity = 0;
  uint64_t local = 0;

  static RingView At(uint8_t* base, int ring, uint32_t cap0, uint32_t cap1) {
    RingView v;
    uint8_t* p = base + RingOffset(ring, cap0);
    v.tail = &reinterpret_cast<RingIndex*>(p)->value;
    v.head = &reinterpret_cast<RingIndex*>(p + sizeof(RingIndex))->value;
    v.slots = reinterpret_cast<std::atomic<uint64_t>*>(p + 2 * sizeof(RingIndex));
    v.capacity = ring == 0 ? cap0 : cap1;
    return v;
  }
};

// ---- Connection handshake (SOCK_SEQPACKET, one message each way, then a one-byte ack) -------
// (after the data-path authentication of transport/handshake_auth.h)
// connector -> acceptor: Hello, fds {arena, read-only arena, table}
// acceptor -> connector: Hello, fds {arena, read-only arena, table, doorbell}
//                        (doorbell_bytes set)
// connector -> acceptor: 1 byte 'A' once everything is mapped
constexpr uint64_t kHelloMagic = 0x3130484c50485353ull;  // "SSHPHL01"
struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t pid;
  uint32_t recv_depth;
  uint32_t table_capacity;
  uint64_t arena_size;
  uint64_t doorbell_bytes;
  uint64_t reserved[2];
};
static_assert(sizeof(Hello) == 56, "hello layout");

// ---- RAII -----------------------------------------------------------------------------------
using ::shardps::UniqueFd;  // common/fd.h

class Mapping {
 public:
  Mapping() = default;
  Mapping(void* addr, size_t size) : addr_(static_cast<uint8_t*>(addr)), size_(size) {}
  ~Mapping() { reset(); }
  Mapping(Mapping&& o) noexcept
      : addr_(std::exchange(o.addr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      addr_ = std::exchange(o.addr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint8_t* data() const { return addr_; }
  size_t size() const { return size_; }
  void reset() {
    if (addr_ != nullptr) ::munmap(addr_, size_);
    addr_ = nullptr;
    size_ = 0;
  }

 private:
  uint8_t* addr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace shardps::transport::shm

#endif  // SHARDPS_TRANSPORT_SHM_SHM_LAYOUT_H_
