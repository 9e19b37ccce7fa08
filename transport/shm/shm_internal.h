// Internal classes of the shm provider (same-host peers over shared memory). Setup lives in
// shm_fabric.cc, the datapath (posts, polls) in shm_datapath.cc.
//
// Ownership: every object holds a shared_ptr to what it needs (FabricCore, CqState), so the
// Fabric, its CQs, endpoints, listeners and regions may be destroyed in any order.
#ifndef SHARDPS_TRANSPORT_SHM_SHM_INTERNAL_H_
#define SHARDPS_TRANSPORT_SHM_SHM_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/thread_annotations.h"
#include "transport/flow_control.h"
#include "transport/shm/shm_layout.h"
#include "transport/transport.h"

namespace shardps::transport::shm {

constexpr uint64_t kDefaultArenaBytes = 64ull << 30;

struct Hello;

// A peer fabric's arenas and region table, mapped once and shared by every endpoint of this
// fabric connected to that peer fabric: the read-write arena (regions peers may write), the
// read-only arena (regions they may only read; the memfd is sealed
// FUTURE_WRITE, so no peer can map it writable or mprotect it so) and the table (read-only).
// Immutable after creation.
struct PeerMemory {
  Mapping arena;
  Mapping ro_arena;
  Mapping table;
};

// One fabric's arena and region table. Thread-safe: the allocator and the table's slot
// bookkeeping are under mu_; arena()/table accessors are immutable after Create.
class FabricCore {
 public:
  static StatusOr<std::shared_ptr<FabricCore>> Create(uint64_t arena_reserve);
  ~FabricCore();

  struct Range {
    uint64_t offset = 0;
    uint64_t bytes = 0;
    bool read_only = false;  // in the read-only arena
  };
  // Carves a page-aligned (2 MiB aligned for >= 2 MiB) zero-filled range of the read-write
  // arena, or of the read-only one (peers map it PROT_READ: an HCA's missing remote-write
  // right, enforced by the kernel).
  StatusOr<Range> Carve(uint64_t length, bool read_only);
  // Frees the range: punched out of the read-write arena (memory goes back to the kernel);
  // zeroed in the read-only one (its seal forbids punching: the memory stays committed until
  // the fabric closes, and is reused).
  void Release(Range r);
  // The owner's (read-write) address of r's first byte.
  uint8_t* Address(const Range& r) const {
    return (r.read_only ? ro_arena_map_.data() : arena_map_.data()) + r.offset;
  }
  // Where peers find r in the table's offset space: [0, arena_size) is the read-write arena,
  // [arena_size, 2 * arena_size) the read-only one.
  uint64_t TableOffset(const Range& r) const {
    return (r.read_only ? arena_size_ : 0) + r.offset;
  }
  // Publishes a live table entry; returns its rkey.
  StatusOr<uint32_t> Publish(uint64_t va, uint64_t offset, uint64_t length, Access access);
  // Marks the entry dead (release store) so every later remote access is rejected.
  void Retract(uint32_t rkey);

  uint8_t* arena() const { return arena_map_.data(); }
  uint64_t arena_size() const { return arena_size_; }
  int arena_fd() const { return arena_fd_.get(); }
  int ro_arena_fd() const { return ro_arena_fd_.get(); }
  int table_fd() const { return table_fd_.get(); }
  std::string NextListenName();
  // Maps a peer fabric's arena and table (validated), or returns the mapping this fabric
  // already holds for the same pair of files.
  StatusOr<std::shared_ptr<PeerMemory>> MapPeer(const Hello& hello, int arena_fd, int ro_arena_fd,
                                                 int table_fd);

 private:
  FabricCore() = default;

  UniqueFd arena_fd_;
  UniqueFd ro_arena_fd_;
  UniqueFd table_fd_;
  Mapping arena_map_;
  Mapping ro_arena_map_;
  Mapping table_map_;
  uint64_t arena_size_ = 0;
  TableEntry* entries_ = nullptr;

  Mutex mu_;
  std::map<uint64_t, uint64_t> free_ GUARDED_BY(mu_);     // offset -> bytes, coalesced
  std::map<uint64_t, uint64_t> free_ro_ GUARDED_BY(mu_);  // the same, read-only arena
  std::vector<uint32_t> free_slots_ GUARDED_BY(mu_);
  // (arena inode, table inode) -> live mapping. A live entry keeps its files open through the
  // mapping, so the inode numbers cannot be reused while it is live.
  std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<PeerMemory>> peers_ GUARDED_BY(mu_);
};

// A region of an shm fabric. Accessors are const and thread-safe; the destructor (any thread)
// retracts the table entry before it returns the range to the arena.
class ShmRegion final : public MemoryRegion {
 public:
  // anon_bytes > 0: data is a private anonymous mapping of that size, unmapped here.
  ShmRegion(std::shared_ptr<FabricCore> core, void* data, size_t length, Access access,
            uint32_t rkey, bool published, FabricCore::Range range, bool owned,
            size_t anon_bytes = 0)
      : MemoryRegion(core.get(), data, length, access, MemoryKind::kHost),
        core_(std::move(core)),
        rkey_(rkey),
        published_(published),
        range_(range),
        owned_(owned),
        anon_bytes_(anon_bytes) {}
  ~ShmRegion() override;
  RegionDescriptor descriptor() const override;
  const FabricCore* core() const { return core_.get(); }

 private:
  std::shared_ptr<FabricCore> core_;
  const uint32_t rkey_;
  const bool published_;
  const FabricCore::Range range_;
  const bool owned_;
  const size_t anon_bytes_;
};

class ShmEndpoint;

// State of one completion queue, shared by the CQ object and its endpoints. Used only by the
// CQ's polling thread (attach and detach included, as flow_control.h requires).
struct CqState {
  explicit CqState(int depth) : quota(depth), ring(static_cast<size_t>(depth)) {}

  struct Entry {
    Completion wc;
    ShmEndpoint* ep = nullptr;  // credits go back to it when the entry is delivered
    int credits = 0;
  };
  // Initiator completions, in order. Capacity depth >= sum of send_depth of the attached
  // endpoints >= entries ever queued (each holds a send credit until delivered).
  void Push(const Entry& e);
  void Purge(const ShmEndpoint* ep);  // drops the entries of a destroyed endpoint

  CqQuota quota;
  std::vector<Entry> ring;
  size_t head = 0;
  size_t count = 0;
  std::vector<ShmEndpoint*> endpoints;
  size_t next_inbound = 0;  // round-robin start of the inbound scan
};

// Thread-compatible: owned by its polling thread.
class ShmCompletionQueue final : public CompletionQueue {
 public:
  explicit ShmCompletionQueue(int depth) : state_(std::make_shared<CqState>(depth)) {}
  int Poll(Completion* out, int max) override;
  int Wait(Completion* out, int max, std::chrono::microseconds timeout) override;
  int depth() const override { return state_->quota.depth(); }
  const std::shared_ptr<CqState>& state() const { return state_; }

 private:
  std::shared_ptr<CqState> state_;
};

// What Connect/Accept hand to the endpoint: the socket and every mapping of the connection.
struct ConnectionParts {
  UniqueFd sock;
  std::shared_ptr<PeerMemory> peer;  // the peer's arena and table
  Mapping doorbell;                  // read-write, both rings
  uint32_t cap0 = 0;  // ring 0: connector -> acceptor, capacity = acceptor's recv_depth
  uint32_t cap1 = 0;  // ring 1: acceptor -> connector, capacity = connector's recv_depth
  bool is_acceptor = false;
  uint32_t peer_pid = 0;
  std::string description;
};

// One operation moves at most this much (the same bound as tcp; a region is smaller anyway).
constexpr uint64_t kMaxOperationBytes = uint64_t{1} << 40;

// One connection. Owned and used by the polling thread of its CQ.
class ShmEndpoint final : public Endpoint {
 public:
  // The CQ quota (send_depth + recv_depth) must already be reserved; the endpoint releases it.
  ShmEndpoint(std::shared_ptr<FabricCore> core, std::shared_ptr<CqState> cq,
              const EndpointOptions& options, ConnectionParts parts);
  ~ShmEndpoint() override;

  Status status() const override { return status_; }
  int outstanding() const override { return credits_.outstanding(); }
  std::string DebugString() const override { return description_; }
  bool reads_are_local_copies() const override { return true; }

  // Called by the CQ's Poll.
  void Progress(int64_t now_ns);              // liveness check + backlog drain
  int PollInbound(Completion* out, int max);  // kRecvImm from the inbound ring
  void ReturnCredits(int n) { credits_.Return(n); }

 private:
  struct Op {
    OpType op = OpType::kWrite;
    LocalSlice local;
    RemoteSlice remote;
    uint32_t imm = 0;
    uint64_t context = 0;
    uint32_t flags = 0;
    bool copied = false;  // the memcpy is done; only the doorbell push is left
    uint32_t pieces = 0;  // a read list of this many pieces (kept in backlog_lists_ while queued)
  };
  enum class Outcome { kDone, kBlocked };

  Status PostChecked(OpType type, const LocalSlice& local, const RemoteSlice& remote, uint32_t imm,
                     uint64_t context, uint32_t flags) override;
  Status PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                             uint64_t context, uint32_t flags) override;
  // Runs op (the first memcpy, then the doorbell push of a write-with-immediate). A read list's
  // pieces are `list` (op.pieces of them).
  Outcome Execute(Op& op, const ReadPiece* list);
  // The copies of a read list into op.local, in piece order. False (the op completed with a
  // remote access error, the endpoint failed) when a piece is refused.
  bool GatherList(const Op& op, const ReadPiece* list);
  // Resolves [addr, addr+len) of the peer's region named by rkey to a local pointer, or
  // explains why the access is refused. The first resolution of a region (per access kind)
  // maps all of it into this process's page tables (populate.h), so that later operations on
  // it take no page fault.
  bool Resolve(const RemoteSlice& r, uint64_t len, bool write, uint8_t** out,
               std::string* why);
  void Complete(const Op& op, WcStatus st);
  // Moves into the error state (once): the backlog's front op gets front_status, the rest
  // kFlushed.
  void Fail(Status why, WcStatus front_status);
  void FlushBacklog(WcStatus front_status);
  void CheckPeer();

  std::shared_ptr<FabricCore> core_;
  std::shared_ptr<CqState> cq_;
  ConnectionParts parts_;
  const int recv_depth_;
  SendCredits credits_;

  // Peer's memory, validated at connect.
  uint8_t* peer_arena_ = nullptr;
  const uint8_t* peer_ro_arena_ = nullptr;  // PROT_READ
  uint64_t peer_arena_size_ = 0;            // each of the two
  const TableEntry* peer_entries_ = nullptr;
  // (rkey << 1 | write) of the peer's regions already populated in this process's mapping.
  std::unordered_set<uint64_t> populated_;
  uint64_t last_populated_ = ~0ull;  // the previous op's key: most ops skip the set
  RingView out_;  // this side produces
  RingView in_;   // this side consumes

  Status status_;
  bool error_ = false;
  bool peer_gone_ = false;
  bool inbound_broken_ = false;
  int unsignaled_ = 0;  // successful unsignaled ops since the last queued completion
  int64_t next_check_ns_ = 0;

  // Ops waiting behind a write-with-immediate whose doorbell ring was full; post order.
  std::vector<Op> backlog_;
  // The pieces of a read list queued in backlog_[i] (the same slot i); reused.
  std::vector<std::vector<ReadPiece>> backlog_lists_;
  // GatherList's resolved source of each piece; reused.
  std::vector<const uint8_t*> gather_src_;
  size_t backlog_head_ = 0;
  size_t backlog_count_ = 0;

  std::string description_;
};

}  // namespace shardps::transport::shm

#endif  // SHARDPS_TRANSPORT_SHM_SHM_INTERNAL_H_
