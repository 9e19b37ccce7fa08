// shm provider, datapath half: posts (memcpy into / out of the peer's arena, checked against
// the peer's region table), doorbell pushes for write-with-immediate, and CQ polling.
//
// Threading: everything here runs on the polling thread that owns the CQ and its endpoints.
// The post path makes no system call and no allocation; Poll makes one poll(2) per endpoint
// per millisecond at most, to notice a dead peer.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <typeinfo>

#include <glog/logging.h>

#include "common/net.h"
#include "transport/populate.h"
#include "transport/shm/shm_internal.h"

namespace shardps::transport::shm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kPeerCheckIntervalNs = 1000000;  // 1 ms

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

uint32_t Saturate32(uint64_t v) {
  return v > std::numeric_limits<uint32_t>::max() ? std::numeric_limits<uint32_t>::max()
                                                  : static_cast<uint32_t>(v);
}

std::string Hex(uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Asks for the cache lines of [p, p+len) (len > 0). Straight-line, not a lambda: GCC has been
// seen to drop prefetches from a lambda in a loop.
inline void PrefetchForRead(const uint8_t* p, uint64_t len) {
  for (uint64_t o = 0; o < len; o += 64) __builtin_prefetch(p + o, 0, 0);
  __builtin_prefetch(p + len - 1, 0, 0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

// ---- CqState ----------------------------------------------------------------------------------

void CqState::Push(const Entry& e) {
  // Every queued entry holds a send credit of an attached endpoint, and the attached endpoints'
  // send depths sum to at most the ring's size: overflow is a provider bug.
  CHECK_LT(count, ring.size()) << "shm: completion ring overflow (flow-control invariant broken)";
  ring[(head + count) % ring.size()] = e;
  ++count;
}

void CqState::Purge(const ShmEndpoint* ep) {
  size_t kept = 0;
  for (size_t i = 0; i < count; ++i) {
    const Entry e = ring[(head + i) % ring.size()];
    if (e.ep != ep) ring[(head + kept++) % ring.size()] = e;
  }
  count = kept;
}

// ---- Posts ------------------------------------------------------------------------------------

Status ShmEndpoint::PostChecked(OpType type, const LocalSlice& local, const RemoteSlice& remote,
                                uint32_t imm, uint64_t context, uint32_t flags) {
  Op op;
  op.op = type;
  op.local = local;
  op.remote = remote;
  op.imm = imm;
  op.context = context;
  op.flags = flags;
  RETURN_IF_ERROR(credits_.Take());
  if (error_) {
    Complete(op, WcStatus::kFlushed);
    return Status::OK();
  }
  if (backlog_count_ > 0) {  // keep post order behind a blocked write-with-immediate
    backlog_[(backlog_head_ + backlog_count_) % backlog_.size()] = op;
    ++backlog_count_;
    return Status::OK();
  }
  Op run = op;
  if (Execute(run, nullptr) == Outcome::kBlocked) {
    backlog_[(backlog_head_ + backlog_count_) % backlog_.size()] = run;
    ++backlog_count_;
  }
  return Status::OK();
}

Status ShmEndpoint::PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                                        uint64_t context, uint32_t flags) {
  Op op;
  op.op = OpType::kRead;
  op.local = dst;
  op.context = context;
  op.flags = flags;
  op.pieces = static_cast<uint32_t>(n);  // <= kMaxReadPieces (checked by PostReadList)
  RETURN_IF_ERROR(credits_.Take());
  if (error_) {
    Complete(op, WcStatus::kFlushed);
    return Status::OK();
  }
  if (backlog_count_ > 0) {  // behind a blocked write-with-immediate: keep the pieces, in order
    const size_t slot = (backlog_head_ + backlog_count_) % backlog_.size();
    backlog_lists_[slot].assign(pieces, pieces + n);
    backlog_[slot] = op;
    ++backlog_count_;
    return Status::OK();
  }
  Execute(op, pieces);  // a read never blocks
  return Status::OK();
}

bool ShmEndpoint::GatherList(const Op& op, const ReadPiece* list) {
  const size_t n = op.pieces;
  // Pass 1: every piece checked against the peer's table before a byte moves (a refused piece
  // fails the list as a whole, like one read).
  gather_src_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    uint8_t* src = nullptr;
    std::string why;
    if (!Resolve(list[i].remote, list[i].length, /*write=*/false, &src, &why)) {
      Complete(op, WcStatus::kRemoteAccessError);
      Fail(PermissionDeniedError("shm: remote access error: read list piece " + std::to_string(i) +
                                 ": " + why),
           WcStatus::kFlushed);
      return false;
    }
    gather_src_[i] = src;
  }
  // Pass 2: the copies, the lines of the piece kAhead places on requested first (the pieces are
  // scattered rows that miss the cache one by one; a few in flight hide most of it).
  constexpr size_t kAhead = 4;
  constexpr uint64_t kPrefetchBytes = 512;  // past that, the hardware prefetcher streams
  for (size_t i = 0; i < std::min(n, kAhead); ++i) {
    PrefetchForRead(gather_src_[i], std::min<uint64_t>(list[i].length, kPrefetchBytes));
  }
  uint8_t* out = static_cast<uint8_t*>(op.local.region->data()) + op.local.offset;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      PrefetchForRead(gather_src_[i + kAhead],
                      std::min<uint64_t>(list[i + kAhead].length, kPrefetchBytes));
    }
    std::memcpy(out, gather_src_[i], list[i].length);
    out += list[i].length;
  }
  return true;
}

bool ShmEndpoint::Resolve(const RemoteSlice& r, uint64_t len, bool write, uint8_t** out,
                          std::string* why) {
  const TableEntry& e = peer_entries_[r.rkey & kRkeySlotMask];
  const uint64_t s1 = e.state.load(std::memory_order_acquire);
  if (!StateLive(s1) || StateGeneration(s1) != (r.rkey >> kRkeySlotBits)) {
    *why = "rkey " + Hex(r.rkey) + " names no registered region of the peer";
    return false;
  }
  const uint32_t access = StateAccess(s1);
  if (write ? !(access & 2u) : !(access & 1u)) {
    *why = std::string("the peer's region ") + Hex(r.rkey) + " is " +
           AccessName(static_cast<Access>(access)) + ", the " + (write ? "write" : "read") +
           " needs remote " + (write ? "write" : "read");
    return false;
  }
  // Seqlock read: acquire loads keep the re-check of state after the fields (no fence, which
  // ThreadSanitizer cannot model; on x86 these are plain loads).
  const uint64_t va = e.va.load(std::memory_order_acquire);
  const uint64_t offset = e.offset.load(std::memory_order_acquire);
  const uint64_t length = e.length.load(std::memory_order_acquire);
  if (e.state.load(std::memory_order_relaxed) != s1) {
    *why = "the peer's region " + Hex(r.rkey) + " was deregistered";
    return false;
  }
  const bool in_ro = offset >= peer_arena_size_;
  const uint64_t off = in_ro ? offset - peer_arena_size_ : offset;
  if (off > peer_arena_size_ || length > peer_arena_size_ - off) {
    *why = "the peer's region table is corrupt (entry outside its arena)";
    return false;
  }
  if (write && in_ro) {  // only a corrupt table can say so: writable regions are never there
    *why = "the peer's region " + Hex(r.rkey) + " lies in its read-only arena";
    return false;
  }
  if (r.addr < va || r.addr - va > length || len > length - (r.addr - va)) {
    *why = "[" + Hex(r.addr) + ", +" + std::to_string(len) + ") is outside the peer's region [" +
           Hex(va) + ", +" + std::to_string(length) + ")";
    return false;
  }
  // A read from the read-only arena only ever reads through this pointer.
  uint8_t* base = in_ro ? const_cast<uint8_t*>(peer_ro_arena_) + off : peer_arena_ + off;
  const uint64_t key = static_cast<uint64_t>(r.rkey) << 1 | (write ? 1 : 0);
  if (key != last_populated_ && populated_.insert(key).second) {
    if (populated_.size() > 4096) populated_ = {key};
    // Best effort: a failure leaves demand paging, as before.
    const Status s = PopulatePages(base, length, write ? PopulateFor::kWrite : PopulateFor::kRead,
                                   "shm: the peer's region");
    if (!s.ok()) VLOG(1) << s.message();
  }
  last_populated_ = key;
  *out = base + (r.addr - va);
  return true;
}

ShmEndpoint::Outcome ShmEndpoint::Execute(Op& op, const ReadPiece* list) {
  if (op.pieces > 0) {
    if (GatherList(op, list)) Complete(op, WcStatus::kSuccess);
    return Outcome::kDone;
  }
  if (!op.copied) {
    // Checked by Endpoint::Post: the region is this fabric's and holds the local slice.
    const MemoryRegion* lr = op.local.region;
    const uint64_t len = op.local.length;
    if (len > 0) {  // like verbs, a zero-length operation names no remote memory
      uint8_t* remote = nullptr;
      std::string why;
      if (!Resolve(op.remote, len, op.op != OpType::kRead, &remote, &why)) {
        Complete(op, WcStatus::kRemoteAccessError);
        Fail(PermissionDeniedError("shm: remote access error: " + why), WcStatus::kFlushed);
        return Outcome::kDone;
      }
      uint8_t* local = static_cast<uint8_t*>(lr->data()) + op.local.offset;
      if (op.op == OpType::kRead) {
        std::memcpy(local, remote, len);
      } else {
        std::memcpy(remote, local, len);
      }
    }
    op.copied = true;
  }
  if (op.op == OpType::kWriteImm) {
    // Publish {imm, len} after the payload: the release store of tail orders the memcpy.
    const uint64_t head = out_.head->load(std::memory_order_acquire);
    const uint64_t used = out_.local - head;
    if (used > out_.capacity) {
      Complete(op, WcStatus::kRemoteOperationError);
      Fail(DataLossError("shm: the peer corrupted the doorbell ring (head " + std::to_string(head) +
                         ", tail " + std::to_string(out_.local) + ")"),
           WcStatus::kFlushed);
      return Outcome::kDone;
    }
    if (used == out_.capacity) return Outcome::kBlocked;  // the target has recv_depth unreaped
    const uint64_t entry = op.imm | (static_cast<uint64_t>(Saturate32(op.local.length)) << 32);
    out_.slots[out_.local % out_.capacity].store(entry, std::memory_order_relaxed);
    ++out_.local;
    out_.tail->store(out_.local, std::memory_order_release);
  }
  Complete(op, WcStatus::kSuccess);
  return Outcome::kDone;
}

void ShmEndpoint::Complete(const Op& op, WcStatus st) {
  if (st == WcStatus::kSuccess && (op.flags & kUnsignaled)) {
    ++unsignaled_;  // its credit goes back with the next completion of this endpoint
    return;
  }
  CqState::Entry e;
  e.wc.context = op.context;
  e.wc.endpoint_id = endpoint_id();
  e.wc.op = op.op;
  e.wc.status = st;
  e.wc.imm = op.op == OpType::kWriteImm ? op.imm : 0;
  e.wc.byte_len = Saturate32(op.local.length);
  e.ep = this;
  e.credits = 1 + unsignaled_;
  unsignaled_ = 0;
  cq_->Push(e);
}

void ShmEndpoint::Fail(Status why, WcStatus front_status) {
  if (!error_) {
    error_ = true;
    status_ = std::move(why);
    // INFO, as tcp's: the owner learns it from status() and decides what it means (a peer
    // that left at the job's end is no warning).
    LOG(INFO) << description_ << ": endpoint " << endpoint_id()
              << " entered the error state: " << status_;
  }
  FlushBacklog(front_status);
}

void ShmEndpoint::FlushBacklog(WcStatus front_status) {
  WcStatus st = front_status;
  while (backlog_count_ > 0) {
    Complete(backlog_[backlog_head_], st);
    backlog_head_ = (backlog_head_ + 1) % backlog_.size();
    --backlog_count_;
    st = WcStatus::kFlushed;
  }
}

void ShmEndpoint::CheckPeer() {
  pollfd p{parts_.sock.get(), POLLIN | POLLRDHUP, 0};
  const int r = poll(&p, 1, 0);
  if (r <= 0) return;
  bool gone = (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0;
  if (!gone && (p.revents & POLLIN)) {
    char buf[64];
    // A live peer sends nothing after the handshake; stray bytes are ignored.
    gone = !net::RecvSome(parts_.sock.get(), buf, sizeof(buf)).ok();
  }
  if (gone) {
    peer_gone_ = true;
    Fail(UnavailableError("shm: peer pid " + std::to_string(parts_.peer_pid) +
                          " closed the connection (process exited or endpoint destroyed)"),
         WcStatus::kRemoteDisconnected);
  }
}

void ShmEndpoint::Progress(int64_t now_ns) {
  if (error_) return;
  if (now_ns >= next_check_ns_) {
    next_check_ns_ = now_ns + kPeerCheckIntervalNs;
    CheckPeer();
  }
  // Retry the blocked write-with-immediate, then everything posted behind it, in order.
  while (backlog_count_ > 0 && !error_) {
    Op op = backlog_[backlog_head_];
    const ReadPiece* list = op.pieces > 0 ? backlog_lists_[backlog_head_].data() : nullptr;
    backlog_head_ = (backlog_head_ + 1) % backlog_.size();
    --backlog_count_;
    if (Execute(op, list) == Outcome::kBlocked) {
      backlog_head_ = (backlog_head_ + backlog_.size() - 1) % backlog_.size();
      backlog_[backlog_head_] = op;
      ++backlog_count_;
      break;
    }
  }
}

int ShmEndpoint::PollInbound(Completion* out, int max) {
  if (inbound_broken_ || max <= 0) return 0;
  const uint64_t tail = in_.tail->load(std::memory_order_acquire);
  const uint64_t avail = tail - in_.local;
  if (avail == 0) return 0;
  if (avail > in_.capacity) {
    inbound_broken_ = true;
    Fail(DataLossError("shm: the peer corrupted the doorbell ring (tail " + std::to_string(tail) +
                       ", head " + std::to_string(in_.local) + ")"),
         WcStatus::kFlushed);
    return 0;
  }
  const int n = static_cast<int>(std::min<uint64_t>(avail, static_cast<uint64_t>(max)));
  for (int i = 0; i < n; ++i) {
    const uint64_t v = in_.slots[in_.local % in_.capacity].load(std::memory_order_relaxed);
    ++in_.local;
    Completion& c = out[i];
    c = Completion{};
    c.endpoint_id = endpoint_id();
    c.op = OpType::kRecvImm;
    c.status = WcStatus::kSuccess;
    c.imm = static_cast<uint32_t>(v);
    c.byte_len = static_cast<uint32_t>(v >> 32);
  }
  in_.head->store(in_.local, std::memory_order_release);  // the slots are free again
  return n;
}

// ---- Completion queue -------------------------------------------------------------------------

int ShmCompletionQueue::Poll(Completion* out, int max) {
  if (max <= 0) return 0;
  CqState& s = *state_;
  const size_t k = s.endpoints.size();
  if (k > 0) {
    const int64_t now = NowNs();
    for (ShmEndpoint* ep : s.endpoints) ep->Progress(now);
  }
  int n = 0;
  while (n < max && s.count > 0) {
    const CqState::Entry& e = s.ring[s.head];
    out[n++] = e.wc;
    if (e.ep != nullptr) e.ep->ReturnCredits(e.credits);
    s.head = (s.head + 1) % s.ring.size();
    --s.count;
  }
  for (size_t i = 0; i < k && n < max; ++i) {
    n += s.endpoints[(s.next_inbound + i) % k]->PollInbound(out + n, max - n);
  }
  if (k > 0) s.next_inbound = (s.next_inbound + 1) % k;
  return n;
}

int ShmCompletionQueue::Wait(Completion* out, int max, std::chrono::microseconds timeout) {
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  int n = Poll(out, max);
  if (n != 0) return n;
  // Spin briefly: a completion is usually a memcpy away.
  const auto spin_end =
      start + std::min<std::chrono::microseconds>(timeout, std::chrono::microseconds(20));
  while (Clock::now() < spin_end) {
    for (int i = 0; i < 32; ++i) CpuRelax();
    if ((n = Poll(out, max)) != 0) return n;
  }
  // Then sleep in short, growing steps (50 us .. 1 ms), never past the deadline.
  auto step = std::chrono::microseconds(50);
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline) return 0;
    std::this_thread::sleep_for(std::min<Clock::duration>(step, deadline - now));
    if ((n = Poll(out, max)) != 0) return n;
    step = std::min(step * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace shardps::transport::shm
