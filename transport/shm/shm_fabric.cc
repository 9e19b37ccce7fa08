// shm provider, setup half: arena and region table, regions, completion queues, listening,
// connecting and the handshake. The datapath (posts, polls) is in shm_datapath.cc.
//
// Shared memory per fabric: two arena memfds (regions are ranges of them; peers map each whole,
// once per peer fabric: the read-write one read-write, the read-only one, sealed FUTURE_WRITE,
// PROT_READ) and a region table memfd (peers map it read-only; the
// initiator checks every operation against it like an HCA checks an rkey). Per connection: a
// doorbell memfd with two SPSC rings carrying write-with-immediate notifications. Layouts in
// shm_layout.h. Connections are AF_UNIX SOCK_SEQPACKET sockets (abstract namespace unless the
// address is a path); the fds travel with SCM_RIGHTS, and the socket stays open for the life of
// the connection so that either side notices the other one's death (EOF/HUP).
// A listener serves only processes of its own effective uid (or of FabricOptions::
// shm_allowed_uids): it checks SO_PEERCRED before it reads the hello or sends any fd.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include <glog/logging.h>

#include "transport/populate.h"
#include "transport/providers.h"
#include "transport/shm/shm_internal.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace shardps::transport {
namespace shm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kPage = 4096;
constexpr uint64_t kHugePage = 2ull << 20;
constexpr uint64_t kMaxPeerArena = 1ull << 46;
constexpr int kMaxDepth = 1 << 20;
constexpr auto kHandshakeTimeout = std::chrono::seconds(10);

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string Bytes(uint64_t b) {
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) return std::to_string(b >> 30) + " GiB";
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) return std::to_string(b >> 20) + " MiB";
  return std::to_string(b) + " B";
}

StatusOr<UniqueFd> MakeMemfd(const char* name) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoError(std::string("shm: memfd_create ") + name, errno);
  return UniqueFd(fd);
}

// Maps fd shared at an address aligned to `align` (a power of two >= the page size): reserves
// len + align bytes of address space, maps the file over the aligned part, trims the slack.
StatusOr<Mapping> MapFd(int fd, size_t len, int prot, const char* what, size_t align = kPage) {
  if (align <= kPage) {
    void* p = mmap(nullptr, len, prot, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) return ErrnoError(std::string("shm: mmap ") + what, errno);
    return Mapping(p, len);
  }
  void* r =
      mmap(nullptr, len + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return ErrnoError(std::string("shm: reserving space for ") + what, errno);
  const uintptr_t base = reinterpret_cast<uintptr_t>(r);
  const uintptr_t aligned = (base + align - 1) & ~(static_cast<uintptr_t>(align) - 1);
  void* p = mmap(reinterpret_cast<void*>(aligned), len, prot,
                 MAP_SHARED | MAP_FIXED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    munmap(r, len + align);
    return ErrnoError(std::string("shm: mmap ") + what, err);
  }
  if (aligned > base) munmap(r, aligned - base);
  const uintptr_t end = aligned + len;
  if (base + len + align > end) munmap(reinterpret_cast<void*>(end), base + len + align - end);
  return Mapping(p, len);
}

Status Seal(int fd, int seals, const char* what) {
  if (fcntl(fd, F_ADD_SEALS, seals) != 0) {
    return ErrnoError(std::string("shm: sealing ") + what, errno);
  }
  return Status::OK();
}

// Maps a memfd received from a peer after checking that it is a regular file of the expected
// size that can no longer shrink (so the mapping can never SIGBUS this process).
StatusOr<Mapping> MapPeerFd(int fd, uint64_t size, int prot, const char* what,
                            size_t align = kPage) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoError(std::string("shm: fstat peer ") + what, errno);
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != size) {
    return FailedPreconditionError(std::string("shm: peer's ") + what + " is not a file of " +
                                   std::to_string(size) + " bytes");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    return FailedPreconditionError(std::string("shm: peer's ") + what +
                                   " is not sealed against shrinking");
  }
  return MapFd(fd, size, prot, what, align);
}

// "@name" or "name": abstract namespace; anything with a '/': a filesystem path.
Status MakeAddress(const std::string& address, sockaddr_un* sa, socklen_t* len,
                   std::string* canonical) {
  std::memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  const bool is_path = address.find('/') != std::string::npos;
  const std::string name =
      (!is_path && !address.empty() && address[0] == '@') ? address.substr(1) : address;
  if (name.empty()) return InvalidArgumentError("shm: empty address");
  if (name.size() + 1 > sizeof(sa->sun_path)) {
    return InvalidArgumentError("shm: address too long: " + address);
  }
  if (is_path) {
    std::memcpy(sa->sun_path, name.data(), name.size());
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + 1);
    *canonical = name;
  } else {
    std::memcpy(sa->sun_path + 1, name.data(), name.size());
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    *canonical = "@" + name;
  }
  return Status::OK();
}

int MillisLeft(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

Status WaitFd(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, MillisLeft(deadline));
    if (r > 0) return Status::OK();
    if (r == 0) return DeadlineExceededError(std::string("shm: timed out ") + what);
    if (errno != EINTR) return ErrnoError(std::string("shm: poll ") + what, errno);
  }
}

Status SendMsg(int fd, const void* buf, size_t len, const int* fds, int nfds,
               Clock::time_point deadline) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  iovec iov{const_cast<void*>(buf), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  for (;;) {
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(len)) return Status::OK();
    if (n >= 0) return InternalError("shm: short handshake send");
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {
      RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline, "sending the handshake"));
      continue;
    }
    return ErrnoError("shm: handshake send", errno);
  }
}

// Receives one message of exactly len bytes with up to max_fds fds.
Status RecvMsg(int fd, void* buf, size_t len, std::vector<UniqueFd>* fds, int max_fds,
               Clock::time_point deadline) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  for (;;) {
    iovec iov{buf, len};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline, "waiting for the peer's handshake"));
        continue;
      }
      return ErrnoError("shm: handshake receive", errno);
    }
    // Take ownership of every fd first, so none leaks whatever else is wrong.
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(f);
      }
    }
    if (n == 0) return UnavailableError("shm: peer closed the connection during the handshake");
    if (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) {
      return FailedPreconditionError("shm: oversized handshake message from peer");
    }
    if (static_cast<size_t>(n) != len || static_cast<int>(fds->size()) != max_fds) {
      return FailedPreconditionError("shm: malformed handshake from peer (" + std::to_string(n) +
                                     " bytes, " + std::to_string(fds->size()) + " fds)");
    }
    return Status::OK();
  }
}

Status CheckHello(const Hello& h, int sock) {
  if (h.magic != kHelloMagic) {
    return FailedPreconditionError("shm: peer is not a ShardPS shm endpoint (bad magic)");
  }
  if (h.version != kLayoutVersion) {
    return FailedPreconditionError("shm: peer speaks layout version " + std::to_string(h.version) +
                                   ", this process " + std::to_string(kLayoutVersion));
  }
  if (h.recv_depth < 1 || h.recv_depth > kMaxRingCapacity) {
    return FailedPreconditionError("shm: peer's recv_depth out of range");
  }
  if (h.table_capacity != kTableCapacity) {
    return FailedPreconditionError("shm: peer's region table has another capacity");
  }
  if (h.arena_size == 0 || h.arena_size > kMaxPeerArena || h.arena_size % kPage != 0) {
    return FailedPreconditionError("shm: peer's arena size is implausible");
  }
  // The claimed pid is informational: a peer in another pid namespace (containers of one pod
  // share the network namespace, hence abstract sockets, but not pids) legitimately differs
  // from SO_PEERCRED's view, so a mismatch is logged, not refused.
  ucred cred{};
  socklen_t cl = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 &&
      static_cast<uint32_t>(cred.pid) != h.pid) {
    LOG(INFO) << "shm: peer says pid " << h.pid << ", the socket says pid " << cred.pid
              << " (another pid namespace?)";
  }
  return Status::OK();
}

// The first thing a listener does with a new connection, before it reads the hello, maps
// anything or sends an fd: the connecting process's uid, as the kernel recorded it at connect()
// (SO_PEERCRED), must be this process's effective uid or one of `allowed`. An abstract socket
// is reachable by every local uid (and listed in /proc/net/unix), so this is what keeps another
// user's processes away from the arena.
Status CheckPeerUid(int sock, const std::vector<uint32_t>& allowed, const std::string& address) {
  ucred cred{};
  socklen_t cl = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
    return ErrnoError("shm: SO_PEERCRED of a connection to " + address, errno);
  }
  const uint32_t uid = static_cast<uint32_t>(cred.uid);
  const uint32_t own = static_cast<uint32_t>(geteuid());
  if (uid == own || std::find(allowed.begin(), allowed.end(), uid) != allowed.end()) {
    return Status::OK();
  }
  // The first refusal, then one line per 1000: a flood of foreign connects must not flood the
  // log (the caller counts every one).
  static std::atomic<uint64_t> refusals{0};
  const uint64_t n = refusals.fetch_add(1, std::memory_order_relaxed);
  if (n % 1000 == 0) {
    LOG(WARNING) << "shm: refused a connection to " << address << " from uid " << uid
                 << " (pid " << cred.pid << "): this process runs as uid " << own << " and "
                 << (allowed.empty() ? "admits no other uid"
                                     : std::to_string(allowed.size()) + " other uid(s)")
                 << " (FabricOptions::shm_allowed_uids); " << n + 1 << " refused so far";
  }
  return PermissionDeniedError("shm: refused a peer of uid " + std::to_string(uid) + " (pid " +
                               std::to_string(cred.pid) + ") on " + address +
                               ": not this process's uid " + std::to_string(own) +
                               " nor an allowed one");
}

Status CheckOptions(const EndpointOptions& o) {
  if (o.send_depth < 1 || o.send_depth > kMaxDepth || o.recv_depth < 1 ||
      o.recv_depth > static_cast<int>(kMaxRingCapacity)) {
    return InvalidArgumentError("shm: send_depth and recv_depth must be in [1, 2^20]");
  }
  return Status::OK();
}

StatusOr<std::shared_ptr<CqState>> CqOf(CompletionQueue* cq) {
  auto* s = dynamic_cast<ShmCompletionQueue*>(cq);
  if (s == nullptr) {
    return InvalidArgumentError("shm: the completion queue was not created by an shm fabric");
  }
  return s->state();
}

// Releases a CQ quota reservation unless disarmed (the endpoint took it over). Lives on the
// stack of the thread running Connect/Accept.
class QuotaGuard {
 public:
  QuotaGuard(CqState* cq, int slots) : cq_(cq), slots_(slots) {}
  ~QuotaGuard() {
    if (cq_ != nullptr) cq_->quota.Release(slots_);
  }
  void Disarm() { cq_ = nullptr; }

 private:
  CqState* cq_;
  int slots_;
};

Status CheckDoorbell(const Mapping& m, uint32_t cap0, uint32_t cap1) {
  const auto* dh = reinterpret_cast<const DoorbellHeader*>(m.data());
  if (dh->magic.load(std::memory_order_acquire) != kDoorbellMagic ||
      dh->version.load(std::memory_order_relaxed) != kLayoutVersion ||
      dh->capacity[0].load(std::memory_order_relaxed) != cap0 ||
      dh->capacity[1].load(std::memory_order_relaxed) != cap1) {
    return FailedPreconditionError("shm: peer's doorbell header is invalid");
  }
  return Status::OK();
}

Hello MakeHello(const FabricCore& core, int recv_depth) {
  Hello h{};
  h.magic = kHelloMagic;
  h.version = kLayoutVersion;
  h.pid = static_cast<uint32_t>(getpid());
  h.recv_depth = static_cast<uint32_t>(recv_depth);
  h.table_capacity = kTableCapacity;
  h.arena_size = core.arena_size();
  return h;
}

}  // namespace

// ---- FabricCore -------------------------------------------------------------------------------

StatusOr<std::shared_ptr<FabricCore>> FabricCore::Create(uint64_t arena_reserve) {
  std::shared_ptr<FabricCore> core(new FabricCore());
  ASSIGN_OR_RETURN(core->arena_fd_, MakeMemfd("shardps-shm-arena"));
  // tmpfs is sparse: the reservation commits nothing until touched. Fall back to smaller
  // reservations where the kernel or the address space refuses the large one.
  uint64_t size = std::max<uint64_t>(RoundUp(arena_reserve, kHugePage), kHugePage);
  Status last;
  for (;;) {
    if (ftruncate(core->arena_fd_.get(), static_cast<off_t>(size)) == 0) {
      auto m = MapFd(core->arena_fd_.get(), size, PROT_READ | PROT_WRITE, "arena", kHugePage);
      if (m.ok()) {
        core->arena_map_ = std::move(*m);
        break;
      }
      last = m.status();
    } else {
      last = ErrnoError("shm: ftruncate arena", errno);
    }
    if (size <= (64ull << 20)) return last.WithContext("shm: cannot reserve an arena");
    LOG(WARNING) << "shm: cannot reserve a " << Bytes(size) << " arena (" << last << "); trying "
                 << Bytes(size / 4);
    size /= 4;
  }
  core->arena_size_ = size;
  // F_SEAL_SEAL on every memfd a peer receives: a peer must not add seals of its own (one
  // that added FUTURE_WRITE to the read-write arena would stop every later punch and mapping).
  RETURN_IF_ERROR(
      Seal(core->arena_fd_.get(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, "arena"));
  // The read-only arena, as large: mapped read-write here, then sealed so that no later mapping
  // (a peer's) can be writable. Sparse like the other one.
  ASSIGN_OR_RETURN(core->ro_arena_fd_, MakeMemfd("shardps-shm-ro-arena"));
  if (ftruncate(core->ro_arena_fd_.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoError("shm: ftruncate read-only arena", errno);
  }
  ASSIGN_OR_RETURN(core->ro_arena_map_, MapFd(core->ro_arena_fd_.get(), size,
                                              PROT_READ | PROT_WRITE, "read-only arena", kHugePage));
  RETURN_IF_ERROR(Seal(core->ro_arena_fd_.get(),
                       F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL,
                       "read-only arena"));
  {
    MutexLock l(&core->mu_);  // not shared yet; the lock is for the analysis (and costs nothing)
    core->free_[0] = size;
    core->free_ro_[0] = size;
  }

  ASSIGN_OR_RETURN(core->table_fd_, MakeMemfd("shardps-shm-regions"));
  if (ftruncate(core->table_fd_.get(), kTableBytes) != 0) {
    return ErrnoError("shm: ftruncate region table", errno);
  }
  ASSIGN_OR_RETURN(core->table_map_,
                   MapFd(core->table_fd_.get(), kTableBytes, PROT_READ | PROT_WRITE, "table"));
  auto* th = reinterpret_cast<TableHeader*>(core->table_map_.data());
  th->version.store(kLayoutVersion, std::memory_order_relaxed);
  th->capacity.store(kTableCapacity, std::memory_order_relaxed);
  th->arena_size.store(size, std::memory_order_relaxed);
  th->magic.store(kTableMagic, std::memory_order_release);
  core->entries_ = reinterpret_cast<TableEntry*>(core->table_map_.data() + sizeof(TableHeader));
  // After our own read-write mapping exists, nobody can write-map the table any more.
  RETURN_IF_ERROR(Seal(core->table_fd_.get(),
                       F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL,
                       "region table"));
  {
    MutexLock l(&core->mu_);
    core->free_slots_.reserve(kTableCapacity);
    for (uint32_t s = kTableCapacity; s > 0; --s) core->free_slots_.push_back(s - 1);
  }
  return core;
}

FabricCore::~FabricCore() = default;

StatusOr<FabricCore::Range> FabricCore::Carve(uint64_t length, bool read_only) {
  if (length == 0) return InvalidArgumentError("shm: zero-length allocation");
  const uint64_t align = length >= kHugePage ? kHugePage : kPage;
  if (length > arena_size_) {
    return ResourceExhaustedError("shm: " + std::to_string(length) + " bytes exceed the " +
                                  Bytes(arena_size_) + " arena");
  }
  const uint64_t bytes = RoundUp(length, align);
  Range r;
  r.read_only = read_only;
  {
    MutexLock lock(&mu_);
    std::map<uint64_t, uint64_t>& free = read_only ? free_ro_ : free_;
    auto it = free.begin();
    for (; it != free.end(); ++it) {
      const uint64_t start = RoundUp(it->first, align);
      const uint64_t end = it->first + it->second;
      if (start <= end && end - start >= bytes) {
        const uint64_t free_start = it->first;
        free.erase(it);
        if (start > free_start) free[free_start] = start - free_start;
        if (start + bytes < end) free[start + bytes] = end - start - bytes;
        r.offset = start;
        r.bytes = bytes;
        break;
      }
    }
    if (it == free.end()) {
      return ResourceExhaustedError("shm: " + std::string(read_only ? "read-only " : "") +
                                    "arena of " + Bytes(arena_size_) + " has no free " +
                                    std::to_string(bytes) + "-byte range");
    }
  }
  // Zero-fill even if a racing peer wrote into the range after it was last freed. Nobody but
  // this process writes the read-only arena, and Release zeroes what it frees there.
  if (!read_only && fallocate(arena_fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              static_cast<off_t>(r.offset), static_cast<off_t>(r.bytes)) != 0) {
    const int err = errno;
    Release(r);
    return ErrnoError("shm: fallocate(PUNCH_HOLE) arena", err);
  }
  if (r.bytes >= kHugePage) madvise(Address(r), r.bytes, MADV_HUGEPAGE);  // best effort
  // Committed now, not at a peer's first write inside a step (populate.h).
  Status populated = PopulatePages(Address(r), r.bytes, PopulateFor::kWriteFresh, "shm");
  if (!populated.ok()) {
    Release(r);
    return populated;
  }
  return r;
}

void FabricCore::Release(Range r) {
  if (r.read_only) {
    // FUTURE_WRITE forbids punching holes: zero through our own mapping instead.
    std::memset(Address(r), 0, r.bytes);
  } else if (fallocate(arena_fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                       static_cast<off_t>(r.offset), static_cast<off_t>(r.bytes)) != 0) {
    PLOG(WARNING) << "shm: punching a freed arena range failed; memory stays committed";
  }
  MutexLock lock(&mu_);
  std::map<uint64_t, uint64_t>& free = r.read_only ? free_ro_ : free_;
  uint64_t start = r.offset, end = r.offset + r.bytes;
  auto next = free.lower_bound(start);
  if (next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      free.erase(prev);
    }
  }
  if (next != free.end() && next->first == end) {
    end += next->second;
    free.erase(next);
  }
  free[start] = end - start;
}

StatusOr<uint32_t> FabricCore::Publish(uint64_t va, uint64_t offset, uint64_t length,
                                       Access access) {
  MutexLock lock(&mu_);
  if (free_slots_.empty()) {
    return ResourceExhaustedError("shm: region table full (" + std::to_string(kTableCapacity) +
                                  " regions)");
  }
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  TableEntry& e = entries_[slot];
  uint32_t gen = (StateGeneration(e.state.load(std::memory_order_relaxed)) + 1) & 0xffff;
  if (gen == 0) gen = 1;
  e.va.store(va, std::memory_order_relaxed);
  e.offset.store(offset, std::memory_order_relaxed);
  e.length.store(length, std::memory_order_relaxed);
  e.state.store(EntryState(gen, static_cast<uint32_t>(access), true), std::memory_order_release);
  return slot | (gen << kRkeySlotBits);
}

void FabricCore::Retract(uint32_t rkey) {
  const uint32_t slot = rkey & kRkeySlotMask;
  entries_[slot].state.store(EntryState(rkey >> kRkeySlotBits, 0, false),
                             std::memory_order_release);
  MutexLock lock(&mu_);
  free_slots_.push_back(slot);
}

StatusOr<std::shared_ptr<PeerMemory>> FabricCore::MapPeer(const Hello& h, int arena_fd,
                                                          int ro_arena_fd, int table_fd) {
  struct stat a, t;
  if (fstat(arena_fd, &a) != 0 || fstat(table_fd, &t) != 0) {
    return ErrnoError("shm: fstat peer arena/table", errno);
  }
  const std::pair<uint64_t, uint64_t> key(a.st_ino, t.st_ino);
  {
    MutexLock lock(&mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) {
      if (auto live = it->second.lock()) {
        if (live->arena.size() == h.arena_size) return live;
      }
    }
  }
  auto pm = std::make_shared<PeerMemory>();
  ASSIGN_OR_RETURN(pm->arena,
                   MapPeerFd(arena_fd, h.arena_size, PROT_READ | PROT_WRITE, "arena", kHugePage));
  ASSIGN_OR_RETURN(pm->ro_arena, MapPeerFd(ro_arena_fd, h.arena_size, PROT_READ,
                                           "read-only arena", kHugePage));
  ASSIGN_OR_RETURN(pm->table, MapPeerFd(table_fd, kTableBytes, PROT_READ, "table"));
  const auto* th = reinterpret_cast<const TableHeader*>(pm->table.data());
  if (th->magic.load(std::memory_order_acquire) != kTableMagic ||
      th->version.load(std::memory_order_relaxed) != kLayoutVersion ||
      th->capacity.load(std::memory_order_relaxed) != kTableCapacity ||
      th->arena_size.load(std::memory_order_relaxed) != h.arena_size) {
    return FailedPreconditionError("shm: peer's region table header is invalid");
  }
  MutexLock lock(&mu_);
  for (auto it = peers_.begin(); it != peers_.end();) {  // forget peers nobody maps any more
    it = it->second.expired() ? peers_.erase(it) : std::next(it);
  }
  peers_[key] = pm;
  return pm;
}

std::string FabricCore::NextListenName() {
  // Unique in this process across fabrics and listeners: a process-wide counter (an object
  // address is not: per-thread malloc arenas are 64 MiB aligned, so low bits repeat).
  static std::atomic<uint64_t> seq{0};
  return "@shardps-" + std::to_string(getpid()) + "-" + std::to_string(seq.fetch_add(1));
}

// ---- ShmRegion --------------------------------------------------------------------------------

ShmRegion::~ShmRegion() {
  // Retract first: from here on every remote access naming this rkey is refused.
  if (published_) core_->Retract(rkey_);
  if (owned_) core_->Release(range_);
  if (anon_bytes_ > 0) munmap(data(), anon_bytes_);
}

RegionDescriptor ShmRegion::descriptor() const {
  RegionDescriptor d;
  d.provider = "shm";
  d.addr = reinterpret_cast<uint64_t>(data());
  d.length = length();
  d.rkey = rkey_;
  d.access = access();
  return d;
}

// ---- Endpoint setup ---------------------------------------------------------------------------

ShmEndpoint::ShmEndpoint(std::shared_ptr<FabricCore> core, std::shared_ptr<CqState> cq,
                         const EndpointOptions& options, ConnectionParts parts)
    : Endpoint(options.endpoint_id, core.get(), kMaxOperationBytes),
      core_(std::move(core)),
      cq_(std::move(cq)),
      parts_(std::move(parts)),
      recv_depth_(options.recv_depth),
      credits_(options.send_depth),
      backlog_(static_cast<size_t>(options.send_depth)),
      backlog_lists_(static_cast<size_t>(options.send_depth)),
      description_(parts_.description) {
  peer_arena_ = parts_.peer->arena.data();
  peer_arena_size_ = parts_.peer->arena.size();
  peer_ro_arena_ = parts_.peer->ro_arena.data();
  peer_entries_ =
      reinterpret_cast<const TableEntry*>(parts_.peer->table.data() + sizeof(TableHeader));
  uint8_t* db = parts_.doorbell.data();
  const int out_ring = parts_.is_acceptor ? 1 : 0;
  out_ = RingView::At(db, out_ring, parts_.cap0, parts_.cap1);
  in_ = RingView::At(db, 1 - out_ring, parts_.cap0, parts_.cap1);
  cq_->endpoints.push_back(this);
}

ShmEndpoint::~ShmEndpoint() {
  auto& eps = cq_->endpoints;
  eps.erase(std::remove(eps.begin(), eps.end(), this), eps.end());
  cq_->Purge(this);
  cq_->quota.Release(credits_.depth() + recv_depth_);
  // parts_ closes the socket (the peer sees EOF) and unmaps everything.
}

// ---- Listener ---------------------------------------------------------------------------------

namespace {

// Owned by one thread (Listener's contract).
class ShmListener final : public Listener {
 public:
  ShmListener(std::shared_ptr<FabricCore> core, UniqueFd fd, std::string address,
              std::string unlink_path, std::vector<uint32_t> allowed_uids)
      : core_(std::move(core)),
        fd_(std::move(fd)),
        address_(std::move(address)),
        unlink_path_(std::move(unlink_path)),
        allowed_uids_(std::move(allowed_uids)),
        gate_("shm: listener " + address_, HandshakeGate::Limits{}) {}
  ~ShmListener() override {
    if (!unlink_path_.empty()) unlink(unlink_path_.c_str());
  }
  std::string address() const override { return address_; }
  StatusOr<std::unique_ptr<Endpoint>> Accept(CompletionQueue* cq, const EndpointOptions& options,
                                             std::chrono::milliseconds timeout) override;
  HandshakeGate::Stats gate_stats() const override { return gate_.stats(); }

 private:
  // One waiting connection, non-blocking, whose uid passed CheckPeerUid; its source is its uid.
  StatusOr<HandshakeGate::Accepted> AcceptOne();
  StatusOr<std::unique_ptr<Endpoint>> Handshake(UniqueFd sock, std::shared_ptr<CqState> cq,
                                                const EndpointOptions& options,
                                                Clock::time_point deadline);
  std::shared_ptr<FabricCore> core_;
  UniqueFd fd_;
  const std::string address_;
  const std::string unlink_path_;
  const std::vector<uint32_t> allowed_uids_;  // besides our own euid (CheckPeerUid)
  HandshakeGate gate_;
};

StatusOr<HandshakeGate::Accepted> ShmListener::AcceptOne() {
  for (;;) {
    UniqueFd s(accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (s.valid()) {
      // The uid first: a process of another uid gets no challenge, no byte, no fd.
      RETURN_IF_ERROR(CheckPeerUid(s.get(), allowed_uids_, address_));
      ucred cred{};
      socklen_t cl = sizeof(cred);
      getsockopt(s.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cl);
      return HandshakeGate::Accepted{std::move(s), "uid " + std::to_string(cred.uid)};
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN) return HandshakeGate::Accepted{};
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      return ResourceExhaustedError("shm: accept on " + address_ + ": " + strerror(errno));
    }
    return ErrnoError("shm: accept on " + address_, errno);
  }
}

StatusOr<std::unique_ptr<Endpoint>> ShmListener::Accept(CompletionQueue* cq,
                                                        const EndpointOptions& options,
                                                        std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(auto cq_state, CqOf(cq));
  RETURN_IF_ERROR(CheckOptions(options));
  const auto deadline = Clock::now() + timeout;
  ASSIGN_OR_RETURN(HandshakeGate::Passed passed,
                   gate_.Next(
                       fd_.get(), [this] { return AcceptOne(); }, authenticator(), deadline));
  // An authenticated peer sends its hello right after the verdict: give it at least 1 s,
  // never more than kHandshakeTimeout.
  const auto hs_deadline = std::clamp(deadline, Clock::now() + std::chrono::seconds(1),
                                      Clock::now() + kHandshakeTimeout);
  auto ep = Handshake(std::move(passed.fd), std::move(cq_state), options, hs_deadline);
  if (ep.ok()) (*ep)->set_peer_identity(std::move(passed.identity));
  return ep;
}

StatusOr<std::unique_ptr<Endpoint>> ShmListener::Handshake(UniqueFd sock,
                                                           std::shared_ptr<CqState> cq,
                                                           const EndpointOptions& options,
                                                           Clock::time_point deadline) {
  const int slots = options.send_depth + options.recv_depth;
  RETURN_IF_ERROR(cq->quota.Reserve(slots));
  QuotaGuard guard(cq.get(), slots);

  Hello peer{};
  std::vector<UniqueFd> fds;
  RETURN_IF_ERROR(RecvMsg(sock.get(), &peer, sizeof(peer), &fds, 3, deadline));
  RETURN_IF_ERROR(CheckHello(peer, sock.get()));
  ConnectionParts parts;
  ASSIGN_OR_RETURN(parts.peer, core_->MapPeer(peer, fds[0].get(), fds[1].get(), fds[2].get()));

  parts.is_acceptor = true;
  parts.cap0 = static_cast<uint32_t>(options.recv_depth);
  parts.cap1 = peer.recv_depth;
  const size_t db_bytes = DoorbellBytes(parts.cap0, parts.cap1);
  ASSIGN_OR_RETURN(UniqueFd db_fd, MakeMemfd("shardps-shm-doorbell"));
  if (ftruncate(db_fd.get(), static_cast<off_t>(db_bytes)) != 0) {
    return ErrnoError("shm: ftruncate doorbell", errno);
  }
  ASSIGN_OR_RETURN(parts.doorbell,
                   MapFd(db_fd.get(), db_bytes, PROT_READ | PROT_WRITE, "doorbell"));
  auto* dh = reinterpret_cast<DoorbellHeader*>(parts.doorbell.data());
  dh->version.store(kLayoutVersion, std::memory_order_relaxed);
  dh->capacity[0].store(parts.cap0, std::memory_order_relaxed);
  dh->capacity[1].store(parts.cap1, std::memory_order_relaxed);
  dh->magic.store(kDoorbellMagic, std::memory_order_release);
  RETURN_IF_ERROR(Seal(db_fd.get(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, "doorbell"));

  Hello me = MakeHello(*core_, options.recv_depth);
  me.doorbell_bytes = db_bytes;
  const int out_fds[4] = {core_->arena_fd(), core_->ro_arena_fd(), core_->table_fd(),
                          db_fd.get()};
  RETURN_IF_ERROR(SendMsg(sock.get(), &me, sizeof(me), out_fds, 4, deadline));
  char ack = 0;
  std::vector<UniqueFd> none;
  RETURN_IF_ERROR(RecvMsg(sock.get(), &ack, 1, &none, 0, deadline));
  if (ack != 'A') return FailedPreconditionError("shm: bad handshake ack from peer");

  parts.peer_pid = peer.pid;
  parts.description = "shm:" + address_ + "<-pid " + std::to_string(peer.pid);
  parts.sock = std::move(sock);
  guard.Disarm();
  return std::unique_ptr<Endpoint>(
      new ShmEndpoint(core_, std::move(cq), options, std::move(parts)));
}

// Thread-safe: setup calls share nothing mutable but FabricCore, which locks.
class ShmFabric final : public Fabric {
 public:
  ShmFabric(std::shared_ptr<FabricCore> core, std::vector<uint32_t> allowed_uids)
      : core_(std::move(core)), allowed_uids_(std::move(allowed_uids)) {}
  std::string name() const override { return "shm"; }
  std::string DebugString() const override {
    return "shm{pid=" + std::to_string(getpid()) + " arena=" + Bytes(core_->arena_size()) +
           " sparse memfd}";
  }

  StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length, Access access,
                                                         MemoryKind kind) override {
    if (kind == MemoryKind::kCuda) {
      return UnimplementedError(
          "shm: CUDA device memory is not supported by the shm provider "
          "(use verbs with GPUDirect, or stage through host memory)");
    }
    if (access != Access::kLocalOnly) {
      return FailedPreconditionError(
          "shm can expose to peers only memory from AllocateMemory (RegisterMemory of caller "
          "memory is allowed only with Access::kLocalOnly)");
    }
    if (addr == nullptr && length > 0) return InvalidArgumentError("shm: null address");
    return std::unique_ptr<MemoryRegion>(
        new ShmRegion(core_, addr, length, access, 0, false, FabricCore::Range{}, false));
  }

  StatusOr<std::unique_ptr<MemoryRegion>> AllocateMemory(size_t length, Access access) override {
    if (access == Access::kLocalOnly) {
      // Never shared: private anonymous memory, which no peer maps at all (like an HCA's
      // local-only registration, which no rkey names).
      if (length == 0) return InvalidArgumentError("shm: zero-length allocation");
      const size_t bytes = RoundUp(length, kPage);
      ASSIGN_OR_RETURN(void* p, MapPopulated(bytes, "shm"));
      return std::unique_ptr<MemoryRegion>(new ShmRegion(core_, p, length, access, 0, false,
                                                         FabricCore::Range{}, false, bytes));
    }
    // Regions peers may not write (remote-read-only) live in the read-only arena: the kernel,
    // not only the initiator's check, keeps peers from writing them.
    ASSIGN_OR_RETURN(FabricCore::Range r, core_->Carve(length, !AllowsRemoteWrite(access)));
    uint8_t* data = core_->Address(r);
    auto rkey =
        core_->Publish(reinterpret_cast<uint64_t>(data), core_->TableOffset(r), length, access);
    if (!rkey.ok()) {
      core_->Release(r);
      return rkey.status();
    }
    return std::unique_ptr<MemoryRegion>(
        new ShmRegion(core_, data, length, access, *rkey, true, r, true));
  }

  StatusOr<std::unique_ptr<CompletionQueue>> CreateCompletionQueue(int depth) override {
    if (depth < 1 || depth > (1 << 24)) {
      return InvalidArgumentError("shm: completion queue depth must be in [1, 2^24]");
    }
    return std::unique_ptr<CompletionQueue>(new ShmCompletionQueue(depth));
  }

  StatusOr<std::unique_ptr<Listener>> Listen(const std::string& address) override {
    const std::string want = address.empty() ? core_->NextListenName() : address;
    sockaddr_un sa;
    socklen_t len;
    std::string canonical;
    RETURN_IF_ERROR(MakeAddress(want, &sa, &len, &canonical));
    UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return ErrnoError("shm: socket", errno);
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      return ErrnoError("shm: bind " + canonical, errno);
    }
    if (listen(fd.get(), 128) != 0) return ErrnoError("shm: listen " + canonical, errno);
    const bool is_path = canonical[0] != '@';
    return std::unique_ptr<Listener>(new ShmListener(
        core_, std::move(fd), canonical, is_path ? canonical : std::string(), allowed_uids_));
  }

  StatusOr<std::unique_ptr<Endpoint>> Connect(const std::string& address, CompletionQueue* cq,
                                              const EndpointOptions& options) override;

 private:
  std::shared_ptr<FabricCore> core_;
  const std::vector<uint32_t> allowed_uids_;  // handed to every listener
};

StatusOr<std::unique_ptr<Endpoint>> ShmFabric::Connect(const std::string& address,
                                                       CompletionQueue* cq,
                                                       const EndpointOptions& options) {
  ASSIGN_OR_RETURN(auto cq_state, CqOf(cq));
  RETURN_IF_ERROR(CheckOptions(options));
  const int slots = options.send_depth + options.recv_depth;
  RETURN_IF_ERROR(cq_state->quota.Reserve(slots));
  QuotaGuard guard(cq_state.get(), slots);
  const auto deadline = Clock::now() + options.connect_timeout;

  sockaddr_un sa;
  socklen_t len;
  std::string canonical;
  RETURN_IF_ERROR(MakeAddress(address, &sa, &len, &canonical));
  UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock.valid()) return ErrnoError("shm: socket", errno);
  for (;;) {
    if (connect(sock.get(), reinterpret_cast<sockaddr*>(&sa), len) == 0) break;
    if (errno == EINTR) continue;
    if (errno == EAGAIN && Clock::now() < deadline) {  // the listener's backlog is full
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    return ErrnoError("shm: connect to " + canonical, errno);
  }
  // The listener's uid, as the kernel recorded it at listen(): a process of another uid that
  // took the name first is refused before it learns anything (our memfds go to it next).
  RETURN_IF_ERROR(CheckPeerUid(sock.get(), allowed_uids_, canonical)
                      .WithContext("shm: connect to " + canonical + " (the listener)"));
  RETURN_IF_ERROR(
      auth::ConnectorHandshake(sock.get(), options.auth_identity, options.auth_key, deadline)
          .WithContext("shm: connect to " + canonical));

  Hello me = MakeHello(*core_, options.recv_depth);
  const int my_fds[3] = {core_->arena_fd(), core_->ro_arena_fd(), core_->table_fd()};
  RETURN_IF_ERROR(SendMsg(sock.get(), &me, sizeof(me), my_fds, 3, deadline)
                      .WithContext("connect to " + canonical));
  Hello peer{};
  std::vector<UniqueFd> fds;
  RETURN_IF_ERROR(RecvMsg(sock.get(), &peer, sizeof(peer), &fds, 4, deadline)
                      .WithContext("connect to " + canonical));
  RETURN_IF_ERROR(CheckHello(peer, sock.get()));
  ConnectionParts parts;
  ASSIGN_OR_RETURN(parts.peer, core_->MapPeer(peer, fds[0].get(), fds[1].get(), fds[2].get()));
  parts.is_acceptor = false;
  parts.cap0 = peer.recv_depth;
  parts.cap1 = static_cast<uint32_t>(options.recv_depth);
  const size_t db_bytes = DoorbellBytes(parts.cap0, parts.cap1);
  if (peer.doorbell_bytes != db_bytes) {
    return FailedPreconditionError("shm: peer's doorbell has an unexpected size");
  }
  ASSIGN_OR_RETURN(parts.doorbell,
                   MapPeerFd(fds[3].get(), db_bytes, PROT_READ | PROT_WRITE, "doorbell"));
  RETURN_IF_ERROR(CheckDoorbell(parts.doorbell, parts.cap0, parts.cap1));
  const char ack = 'A';
  RETURN_IF_ERROR(SendMsg(sock.get(), &ack, 1, nullptr, 0, deadline));

  parts.peer_pid = peer.pid;
  parts.description = "shm:pid " + std::to_string(getpid()) + "->" + canonical + " (pid " +
                      std::to_string(peer.pid) + ")";
  parts.sock = std::move(sock);
  guard.Disarm();
  return std::unique_ptr<Endpoint>(
      new ShmEndpoint(core_, std::move(cq_state), options, std::move(parts)));
}

}  // namespace
}  // namespace shm

StatusOr<std::unique_ptr<Fabric>> OpenShmFabric(const FabricOptions& options) {
  const uint64_t reserve =
      options.shm_arena_bytes != 0 ? options.shm_arena_bytes : shm::kDefaultArenaBytes;
  ASSIGN_OR_RETURN(auto core, shm::FabricCore::Create(reserve));
  return std::unique_ptr<Fabric>(new shm::ShmFabric(std::move(core), options.shm_allowed_uids));
}

}  // namespace shardps::transport
