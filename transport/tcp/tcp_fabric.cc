// tcp provider, setup side: the engine (rkey registry, progress thread), regions, listeners,
// connection establishment and the handshake. The datapath lives in tcp_datapath.cc.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <glog/logging.h>

#include "common/crypto.h"
#include "common/net.h"
#include "transport/populate.h"
#include "transport/providers.h"
#include "transport/tcp/tcp_internal.h"

namespace shardps::transport {
namespace tcp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kSocketBufferBytes = 4 << 20;
constexpr int kUserTimeoutMs =
    30000;  // unacknowledged data (or a shut window) this old kills the link
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);

long ReadProcLong(const char* path) {
  std::ifstream f(path);
  long v = 0;
  if (!(f >> v)) return 0;
  return v;
}

// TCP_NODELAY, keepalive/user timeout (bounded peer-death detection), and bigger buffers
// only where the system allows them (setting SO_*BUF below the autotuning limit would cap it).
void ConfigureSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 5, intvl = 2, cnt = 5, user_timeout = kUserTimeoutMs;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));
  static const long rmem_max = ReadProcLong("/proc/sys/net/core/rmem_max");
  static const long wmem_max = ReadProcLong("/proc/sys/net/core/wmem_max");
  int bytes = kSocketBufferBytes;
  if (rmem_max >= kSocketBufferBytes) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  if (wmem_max >= kSocketBufferBytes) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
}

// Both sides send their hello, then read and check the peer's.
Status Handshake(int fd, const EndpointOptions& options, Clock::time_point deadline) {
  Hello mine{};
  mine.magic = kHelloMagic;
  mine.version = kWireVersion;
  mine.header_size = kHeaderSize;
  mine.send_depth = static_cast<uint32_t>(options.send_depth);
  mine.recv_depth = static_cast<uint32_t>(options.recv_depth);
  mine.endpoint_id = options.endpoint_id;
  RETURN_IF_ERROR(net::SendAll(fd, &mine, sizeof(mine), deadline, "handshake: send"));
  Hello peer{};
  RETURN_IF_ERROR(
      net::RecvAll(fd, &peer, sizeof(peer), deadline, "handshake: hello from the peer"));
  if (peer.magic != kHelloMagic) {
    char buf[64];
    snprintf(buf, sizeof(buf), "handshake: bad magic 0x%08x (not a shardps tcp peer)", peer.magic);
    return DataLossError(buf);
  }
  if (peer.version != kWireVersion || peer.header_size != kHeaderSize) {
    return FailedPreconditionError(
        "handshake: peer speaks wire version " + std::to_string(peer.version) + " (header " +
        std::to_string(peer.header_size) + " bytes), we speak " + std::to_string(kWireVersion));
  }
  return Status::OK();
}

std::string LocalAddress(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "?";
  return SockaddrToString(sa);
}

std::string PeerAddress(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "?";
  return SockaddrToString(sa);
}

Status CheckEndpointOptions(const EndpointOptions& o) {
  if (o.send_depth <= 0 || o.recv_depth < 0 || o.send_depth > (1 << 20) ||
      o.recv_depth > (1 << 20)) {
    return InvalidArgumentError(
        "endpoint options: send_depth must be in [1, 2^20] and "
        "recv_depth in [0, 2^20]");
  }
  return Status::OK();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Helpers

Status ParseAddress(const std::string& address, sockaddr_in* out) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgumentError("tcp address '" + address + "' is not host:port");
  }
  std::string host = address.substr(0, colon);
  const std::string port_s = address.substr(colon + 1);
  char* end = nullptr;
  const long port = strtol(port_s.c_str(), &end, 10);
  if (port_s.empty() || *end != '\0' || port < 0 || port > 65535) {
    return InvalidArgumentError("tcp address '" + address + "': bad port");
  }
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  *out = sockaddr_in{};
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "*") {
    out->sin_addr.s_addr = htonl(INADDR_ANY);
    return Status::OK();
  }
  if (inet_pton(AF_INET, host.c_str(), &out->sin_addr) == 1) return Status::OK();
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return NotFoundError("tcp address '" + address + "': cannot resolve '" + host +
                         "': " + gai_strerror(rc));
  }
  out->sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return Status::OK();
}

std::string SockaddrToString(const sockaddr_in& sa) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(sa.sin_port));
}

// ---------------------------------------------------------------------------------------------
// TcpEngine

TcpEngine::TcpEngine(const FabricOptions& options) : options_(options), scratch_(256 << 10) {}

StatusOr<std::shared_ptr<TcpEngine>> TcpEngine::Create(const FabricOptions& options) {
  if (!options.bind_ip.empty()) {
    in_addr a{};
    if (inet_pton(AF_INET, options.bind_ip.c_str(), &a) != 1) {
      return InvalidArgumentError("tcp: bind_ip '" + options.bind_ip + "' is not an IPv4 address");
    }
  }
  std::shared_ptr<TcpEngine> e(new TcpEngine(options));
  e->epoll_fd_ = UniqueFd(epoll_create1(EPOLL_CLOEXEC));
  if (!e->epoll_fd_.valid()) return ErrnoError("tcp: epoll_create1", errno);
  e->event_fd_ = UniqueFd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!e->event_fd_.valid()) return ErrnoError("tcp: eventfd", errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  if (epoll_ctl(e->epoll_fd_.get(), EPOLL_CTL_ADD, e->event_fd_.get(), &ev) != 0) {
    return ErrnoError("tcp: epoll_ctl(eventfd)", errno);
  }
  {
    MutexLock l(&e->cl_mu_);
    e->running_ = true;
  }
  TcpEngine* raw = e.get();
  e->thread_ = std::thread([raw] { raw->Loop(); });
  return e;
}

TcpEngine::~TcpEngine() {
  Shutdown();
  for (auto& m : zero_maps_) munmap(m.first, m.second);
}

void TcpEngine::Shutdown() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  Wake();
  thread_.join();
}

namespace {
// The progress thread stays parked while an application thread did progress work within this
// long; it is also the longest a parked thread waits before it checks again.
constexpr int64_t kParkNs = 200 * 1000;
int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}
}  // namespace

void TcpEngine::Unpark() {
  if (NowNs() - last_inline_ns_.load(std::memory_order_relaxed) >= kParkNs) return;
  last_inline_ns_.store(0, std::memory_order_relaxed);
  {
    MutexLock l(&park_mu_);
    park_wake_ = true;
  }
  park_cv_.Signal();
}

void TcpEngine::Wake() {
  {
    MutexLock l(&park_mu_);
    park_wake_ = true;
  }
  park_cv_.Signal();
  const uint64_t one = 1;
  ssize_t n;
  do {
    n = ::write(event_fd_.get(), &one, sizeof(one));
  } while (n < 0 && errno == EINTR);
  // EAGAIN means the counter is already non-zero: the thread will wake anyway.
}

void TcpEngine::RunSync(const std::function<void()>& fn) {
  if (OnProgressThread()) {
    fn();
    return;
  }
  Closure c{&fn, false};
  bool queued = false;
  {
    MutexLock l(&cl_mu_);
    if (running_) {
      closures_.push_back(&c);
      queued = true;
    }
  }
  if (!queued) {  // the progress thread is gone: run it here, under the progress lock
    MutexLock p(&progress_mu_);
    fn();
    return;
  }
  Wake();
  MutexLock l(&cl_mu_);
  cl_cv_.Wait(&cl_mu_, [&]() REQUIRES(cl_mu_) { return c.done; });
}

void TcpEngine::RunClosures() {
  std::vector<Closure*> todo;
  {
    MutexLock l(&cl_mu_);
    if (closures_.empty()) return;
    todo.swap(closures_);
  }
  for (Closure* c : todo) (*c->fn)();
  {
    MutexLock l(&cl_mu_);
    for (Closure* c : todo) c->done = true;
  }
  cl_cv_.SignalAll();
}

void TcpEngine::HandleEvents(const epoll_event* evs, int n) {
  if (!read_wait_.empty()) {
    std::vector<TcpEndpoint*> list;
    list.swap(read_wait_);
    for (TcpEndpoint* ep : list) ep->RetryReadWait();  // each lists itself again if it waits
  }
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.ptr == nullptr) continue;  // the eventfd: handled by the progress thread
    static_cast<TcpEndpoint*>(evs[i].data.ptr)->OnEvents(evs[i].events);
  }
  if (!again_.empty()) {
    std::vector<TcpEndpoint*> list;
    list.swap(again_);
    for (TcpEndpoint* ep : list) ep->OnReadable();
  }
  if (!paused_.empty()) ResumePaused();
}

void TcpEngine::Loop() {
  thread_id_ = std::this_thread::get_id();
  epoll_event evs[64];
  while (!stop_.load(std::memory_order_acquire)) {
    int timeout = -1;
    // Parked while an application thread polls: woken early only by Unpark/Wake. A timed-out
    // wait parks again for what is left of kParkNs since the application's last poll, so the
    // thread never takes events from under a poller that is still polling (it used to check
    // every 200 us, and each check could take a response the poller was about to receive, on
    // the core of the process that sent it).
    for (;;) {
      const int64_t polled_ago = NowNs() - last_inline_ns_.load(std::memory_order_relaxed);
      if (polled_ago >= kParkNs) break;
      MutexLock lk(&park_mu_);
      park_cv_.WaitFor(&park_mu_, std::chrono::nanoseconds(kParkNs - polled_ago),
                       [&]() REQUIRES(park_mu_) { return park_wake_; });
      if (park_wake_) {
        park_wake_ = false;
        timeout = 0;
        break;
      }
    }
    {
      MutexLock l(&progress_mu_);
      if (!again_.empty()) {
        timeout = 0;
      } else if (!read_wait_.empty() && timeout != 0) {
        timeout = 1;  // ms: a read waiting for the application waits a bounded time
      }
      blocking_ = timeout < 0;  // a read wait listed meanwhile must wake us (NudgeReadWaits)
    }
    const int n = epoll_wait(epoll_fd_.get(), evs, 64, timeout);
    MutexLock l(&progress_mu_);
    blocking_ = false;
    if (n < 0) {
      if (errno != EINTR) PLOG(ERROR) << "tcp: epoll_wait";
      continue;
    }
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.ptr == nullptr) {
        uint64_t v;
        while (::read(event_fd_.get(), &v, sizeof(v)) > 0) {
        }
      }
    }
    HandleEvents(evs, n);
    // Closures run between batches, so no event of a removed endpoint is still pending.
    RunClosures();
    if (!paused_.empty()) ResumePaused();
  }
  MutexLock p(&progress_mu_);
  MutexLock l(&cl_mu_);
  running_ = false;
  for (Closure* c : closures_) {
    (*c->fn)();
    c->done = true;
  }
  closures_.clear();
  cl_cv_.SignalAll();
}

void TcpEngine::TryProgress() {
  if (stop_.load(std::memory_order_relaxed) || !progress_mu_.TryLock()) return;
  epoll_event evs[16];
  last_inline_ns_.store(NowNs(), std::memory_order_relaxed);
  const int n = epoll_wait(epoll_fd_.get(), evs, 16, 0);
  // Events a concurrent epoll_wait of the progress thread took are handled there; endpoints
  // removed by closures cannot appear here because closures run under progress_mu_.
  if (n > 0 || !again_.empty() || !paused_.empty() || !read_wait_.empty()) {
    HandleEvents(evs, std::max(n, 0));
  }
  NudgeReadWaits();
  progress_mu_.Unlock();
}

void TcpEngine::Rescan(const std::unordered_set<TcpEndpoint*>& eps) {
  if (stop_.load(std::memory_order_relaxed) || !progress_mu_.TryLock()) return;
  for (TcpEndpoint* ep : eps) {
    if (ep->outstanding() > 0) ep->OnReadable();
  }
  NudgeReadWaits();
  progress_mu_.Unlock();
}

void TcpEngine::NudgeReadWaits() {
  // A read wait listed by an application thread while the progress thread sleeps in
  // epoll_wait with no timeout: nobody would retry it if the application stopped polling now.
  // Wake the thread through the eventfd (it drains it at once: it is not parked), so that it
  // sleeps again with the 1 ms timeout. Not while it is parked: it looks at read_wait_ before
  // it sleeps, and waking a parked thread would have it compete with the poller.
  if (!blocking_ || read_wait_.empty()) return;
  blocking_ = false;
  const uint64_t one = 1;
  ssize_t n;
  do {
    n = ::write(event_fd_.get(), &one, sizeof(one));
  } while (n < 0 && errno == EINTR);
}

void TcpEngine::ResumePaused() {
  std::vector<TcpEndpoint*> list;
  list.swap(paused_);
  for (TcpEndpoint* ep : list) {
    if (!ep->TryResume()) paused_.push_back(ep);
  }
}

Status TcpEngine::AddEndpoint(TcpEndpoint* ep) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.ptr = ep;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, ep->fd(), &ev) != 0) {
    return ErrnoError("tcp: epoll_ctl(ADD)", errno);
  }
  endpoints_.push_back(ep);
  return Status::OK();
}

void TcpEngine::RemoveEndpoint(TcpEndpoint* ep) {
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, ep->fd(), nullptr);  // may already be gone
  endpoints_.erase(std::remove(endpoints_.begin(), endpoints_.end(), ep), endpoints_.end());
  paused_.erase(std::remove(paused_.begin(), paused_.end(), ep), paused_.end());
  again_.erase(std::remove(again_.begin(), again_.end(), ep), again_.end());
  read_wait_.erase(std::remove(read_wait_.begin(), read_wait_.end(), ep), read_wait_.end());
}

void TcpEngine::Unwatch(int fd) { epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr); }

const char* TcpEngine::Zeros(uint64_t n) {
  for (auto& m : zero_maps_) {
    if (m.second >= n) return static_cast<const char*>(m.first);
  }
  void* p = mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  zero_maps_.emplace_back(p, n);
  return static_cast<const char*>(p);
}

uint32_t TcpEngine::RegisterRegion(char* base, uint64_t length, Access access) {
  MutexLock l(&reg_mu_);
  // Each rkey is drawn from the kernel CSPRNG (docs/security.md): a peer that holds some of
  // this fabric's rkeys can infer nothing about the others, and a stale descriptor of an
  // earlier process or region is unlikely to name a live one. Never 0; redrawn on collision.
  uint32_t key;
  do {
    key = static_cast<uint32_t>(crypto::RandomU64());
  } while (key == 0 || regions_.count(key) != 0);
  regions_[key] = RegionEntry{base, length, access};
  return key;
}

void TcpEngine::DeregisterRegion(uint32_t rkey, char* base, uint64_t length) {
  {
    MutexLock l(&reg_mu_);
    regions_.erase(rkey);
  }
  RunSync([&]() REQUIRES(progress_mu_) {
    for (TcpEndpoint* ep : endpoints_) ep->OnRegionGone(base, length);
  });
}

AccessCheck TcpEngine::Lookup(uint32_t rkey, uint64_t addr, uint64_t len, bool write, char** out) {
  MutexLock l(&reg_mu_);
  auto it = regions_.find(rkey);
  if (it == regions_.end()) return AccessCheck::kUnknownRkey;
  return CheckAccess(it->second, addr, len, write, out);
}

AccessCheck TcpEngine::CheckAccess(const RegionEntry& r, uint64_t addr, uint64_t len, bool write,
                                   char** out) {
  const uint64_t base = reinterpret_cast<uint64_t>(r.base);
  // Overflow-safe: addr >= base, offset <= length, len <= length - offset.
  if (addr < base || addr - base > r.length || len > r.length - (addr - base)) {
    return AccessCheck::kOutOfBounds;
  }
  if (write ? !AllowsRemoteWrite(r.access) : !AllowsRemoteRead(r.access)) {
    return AccessCheck::kNoAccess;
  }
  *out = r.base + (addr - base);
  return AccessCheck::kOk;
}

AccessCheck TcpEngine::LookupReadList(const ReadListEntry* entries, size_t n, const char** out) {
  MutexLock l(&reg_mu_);
  const RegionEntry* last = nullptr;
  uint32_t last_rkey = 0;
  for (size_t i = 0; i < n; ++i) {
    const ReadListEntry& e = entries[i];
    if (e.length == 0) return AccessCheck::kOutOfBounds;
    if (last == nullptr || e.rkey != last_rkey) {
      auto it = regions_.find(e.rkey);
      if (it == regions_.end()) return AccessCheck::kUnknownRkey;
      last = &it->second;
      last_rkey = e.rkey;
    }
    char* p = nullptr;
    const AccessCheck chk = CheckAccess(*last, e.addr, e.length, false, &p);
    if (chk != AccessCheck::kOk) return chk;
    out[i] = p;
  }
  return AccessCheck::kOk;
}

// ---------------------------------------------------------------------------------------------
// TcpRegion

TcpRegion::TcpRegion(std::shared_ptr<TcpEngine> engine, void* data, size_t length, Access access,
                     size_t owned_map_bytes)
    : MemoryRegion(engine.get(), data, length, access, MemoryKind::kHost),
      engine_(std::move(engine)),
      rkey_(engine_->RegisterRegion(static_cast<char*>(data), length, access)),
      owned_map_bytes_(owned_map_bytes) {}

TcpRegion::~TcpRegion() {
  engine_->DeregisterRegion(rkey_, static_cast<char*>(data()), length());
  if (owned_map_bytes_ != 0 && munmap(data(), owned_map_bytes_) != 0) {
    PLOG(WARNING) << "tcp: munmap of an allocated region";
  }
}

RegionDescriptor TcpRegion::descriptor() const {
  RegionDescriptor d;
  d.provider = "tcp";
  d.addr = reinterpret_cast<uint64_t>(data());
  d.length = length();
  d.rkey = rkey_;
  d.access = access();
  return d;
}

// ---------------------------------------------------------------------------------------------
// Listener: owned by one thread; Accept runs the handshake on the calling thread.

namespace {

class TcpListener final : public Listener {
 public:
  TcpListener(std::shared_ptr<TcpEngine> engine, UniqueFd fd, std::string address)
      : engine_(std::move(engine)),
        fd_(std::move(fd)),
        address_(std::move(address)),
        tls_(engine_->options().tcp_tls),
        gate_("tcp: listener " + address_, HandshakeGate::Limits{},
              tls_ ? auth::kFlagTcpTls : 0) {}
  std::string address() const override { return address_; }
  StatusOr<std::unique_ptr<Endpoint>> Accept(CompletionQueue* cq, const EndpointOptions& options,
                                             std::chrono::milliseconds timeout) override;
  HandshakeGate::Stats gate_stats() const override { return gate_.stats(); }

 private:
  // One waiting connection, non-blocking; its source is the peer's IP (the per-source limit).
  StatusOr<HandshakeGate::Accepted> AcceptOne();

  std::shared_ptr<TcpEngine> engine_;
  UniqueFd fd_;
  const std::string address_;
  const bool tls_;  // FabricOptions::tcp_tls: every connection runs TLS after the proof
  bool tls_logged_ = false;
  HandshakeGate gate_;
};

// Reserves the CQ quota for an endpoint; released by the endpoint (or by the caller on error).
StatusOr<TcpCompletionQueue*> ReserveCq(TcpEngine* engine, CompletionQueue* cq,
                                        const EndpointOptions& options) {
  RETURN_IF_ERROR(CheckEndpointOptions(options));
  auto* tcq = dynamic_cast<TcpCompletionQueue*>(cq);
  if (tcq == nullptr || tcq->engine() != engine) {
    return InvalidArgumentError("tcp: the completion queue was not created by this fabric");
  }
  MutexLock l(&engine->setup_mu());
  RETURN_IF_ERROR(tcq->quota().Reserve(options.send_depth + options.recv_depth));
  return tcq;
}

void UnreserveCq(TcpEngine* engine, TcpCompletionQueue* cq, const EndpointOptions& options) {
  MutexLock l(&engine->setup_mu());
  cq->quota().Release(options.send_depth + options.recv_depth);
}

StatusOr<std::unique_ptr<Endpoint>> MakeEndpoint(const std::shared_ptr<TcpEngine>& engine,
                                                 UniqueFd fd, TcpCompletionQueue* cq,
                                                 const EndpointOptions& options,
                                                 std::unique_ptr<TlsSession> tls) {
  const std::string local = LocalAddress(fd.get());
  const std::string remote = PeerAddress(fd.get());
  auto ep = std::make_unique<TcpEndpoint>(engine, std::move(fd), cq, options, local, remote,
                                          std::move(tls));
  Status added;
  engine->RunSync([&]() REQUIRES(engine->progress_mu()) { added = engine->AddEndpoint(ep.get()); });
  if (!added.ok()) return added;  // ~TcpEndpoint releases the quota
  VLOG(1) << "tcp: connected " << ep->DebugString();
  return std::unique_ptr<Endpoint>(std::move(ep));
}

StatusOr<HandshakeGate::Accepted> TcpListener::AcceptOne() {
  for (;;) {
    sockaddr_in sa{};
    socklen_t len = sizeof(sa);
    UniqueFd conn(accept4(fd_.get(), reinterpret_cast<sockaddr*>(&sa), &len,
                          SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (conn.valid()) {
      ConfigureSocket(conn.get());
      // The source for the per-source limit: the IPv4 address, except that all of 127/8 is one
      // source (any local process can connect from any 127.x.y.z).
      char ip[INET_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
      const bool loopback = (ntohl(sa.sin_addr.s_addr) >> 24) == 127;
      return HandshakeGate::Accepted{std::move(conn), loopback ? "127.0.0.0/8" : ip};
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return HandshakeGate::Accepted{};
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      return ResourceExhaustedError("tcp: accept on " + address_ + ": " + strerror(errno));
    }
    return ErrnoError("tcp: accept on " + address_, errno);
  }
}

StatusOr<std::unique_ptr<Endpoint>> TcpListener::Accept(CompletionQueue* cq,
                                                        const EndpointOptions& options,
                                                        std::chrono::milliseconds timeout) {
  if (tls_ && authenticator() == nullptr) {
    return FailedPreconditionError(
        "tcp: listener " + address_ +
        " has TLS on (tcp_tls) but no Authenticator: TLS is keyed by the members' proof");
  }
  ASSIGN_OR_RETURN(TcpCompletionQueue * tcq, ReserveCq(engine_.get(), cq, options));
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    // The gate holds every connection that has not yet proved itself, across calls, and never
    // waits on one of them: a silent stranger costs a zero-timeout Accept nothing.
    auto passed = gate_.Next(
        fd_.get(), [this] { return AcceptOne(); }, authenticator(), deadline);
    if (!passed.ok()) {
      UnreserveCq(engine_.get(), tcq, options);
      return passed.status();
    }
    // An authenticated peer sends its hello right after the verdict: give it at least 1 s,
    // never more than kHandshakeTimeout.
    const auto hs_deadline = std::clamp(deadline, Clock::now() + std::chrono::seconds(1),
                                        Clock::now() + kHandshakeTimeout);
    Status hs = Handshake(passed->fd.get(), options, hs_deadline);
    std::unique_ptr<TlsSession> tls;
    if (hs.ok() && tls_) {
      auto t = TlsSession::Handshake(passed->fd.get(), /*server=*/true, passed->session_secret,
                                     hs_deadline);
      if (t.ok()) {
        tls = std::move(*t);
      } else {
        hs = t.status();
      }
    }
    if (!hs.ok()) {
      LOG(WARNING) << "tcp: dropped a connection from " << passed->source << " on " << address_
                   << " after it authenticated: " << hs;
      continue;
    }
    if (tls != nullptr && !tls_logged_) {
      tls_logged_ = true;
      LOG(INFO) << "tcp: " << address_ << " serves its peers over " << tls->Describe()
                << " (PSK from the data-path proof)";
    }
    auto ep = MakeEndpoint(engine_, std::move(passed->fd), tcq, options, std::move(tls));
    if (ep.ok()) (*ep)->set_peer_identity(std::move(passed->identity));
    return ep;
  }
}

// ---------------------------------------------------------------------------------------------
// TcpFabric: thread-safe; a thin handle on the engine.

class TcpFabric final : public Fabric {
 public:
  explicit TcpFabric(std::shared_ptr<TcpEngine> engine) : engine_(std::move(engine)) {}
  ~TcpFabric() override { engine_->Shutdown(); }

  std::string name() const override { return "tcp"; }
  std::string DebugString() const override {
    return "tcp{bind_ip=" +
           (engine_->options().bind_ip.empty() ? std::string("any") : engine_->options().bind_ip) +
           "}";
  }

  StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length, Access access,
                                                         MemoryKind kind) override {
    if (kind == MemoryKind::kCuda) {
      return UnimplementedError(
          "tcp: device (CUDA) memory cannot be registered yet; the GPU staging pipeline is "
          "not implemented (use host memory or the verbs provider)");
    }
    if (addr == nullptr || length == 0) {
      return InvalidArgumentError("tcp: RegisterMemory needs a non-null address and length > 0");
    }
    if (reinterpret_cast<uint64_t>(addr) + length < reinterpret_cast<uint64_t>(addr)) {
      return InvalidArgumentError("tcp: RegisterMemory: range wraps around");
    }
    // Best effort on the caller's memory (what ibv_reg_mr's pinning does): its first touch by a
    // receive is then no page fault inside a step. Never rewritten (the caller may be writing).
    const Status populated = PopulatePages(
        addr, length, AllowsRemoteWrite(access) ? PopulateFor::kWrite : PopulateFor::kRead, "tcp");
    if (!populated.ok()) VLOG(1) << populated.message();
    return std::unique_ptr<MemoryRegion>(new TcpRegion(engine_, addr, length, access, 0));
  }

  StatusOr<std::unique_ptr<MemoryRegion>> AllocateMemory(size_t length, Access access) override {
    if (length == 0) return InvalidArgumentError("tcp: AllocateMemory of 0 bytes");
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t map = (length + page - 1) / page * page;
    ASSIGN_OR_RETURN(void* p, MapPopulated(map, "tcp"));  // no page fault later
    return std::unique_ptr<MemoryRegion>(new TcpRegion(engine_, p, length, access, map));
  }

  StatusOr<std::unique_ptr<CompletionQueue>> CreateCompletionQueue(int depth) override {
    if (depth <= 0 || depth > (1 << 24)) {
      return InvalidArgumentError("tcp: completion queue depth must be in [1, 2^24]");
    }
    return std::unique_ptr<CompletionQueue>(new TcpCompletionQueue(engine_, depth));
  }

  StatusOr<std::unique_ptr<Listener>> Listen(const std::string& address) override {
    sockaddr_in sa{};
    RETURN_IF_ERROR(ParseAddress(address, &sa));
    if (sa.sin_addr.s_addr == htonl(INADDR_ANY) && !engine_->options().bind_ip.empty()) {
      inet_pton(AF_INET, engine_->options().bind_ip.c_str(), &sa.sin_addr);
    }
    UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoError("tcp: socket", errno);
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      return ErrnoError("tcp: bind " + address, errno);
    }
    if (listen(fd.get(), 128) != 0) return ErrnoError("tcp: listen " + address, errno);
    sockaddr_in bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    if (bound.sin_addr.s_addr == htonl(INADDR_ANY)) bound.sin_addr = PrimaryIp();
    const std::string real = SockaddrToString(bound);
    LOG(INFO) << "tcp: listening on " << real;
    return std::unique_ptr<Listener>(new TcpListener(engine_, std::move(fd), real));
  }

  StatusOr<std::unique_ptr<Endpoint>> Connect(const std::string& address, CompletionQueue* cq,
                                              const EndpointOptions& options) override {
    const auto deadline = Clock::now() + options.connect_timeout;
    sockaddr_in sa{};
    RETURN_IF_ERROR(ParseAddress(address, &sa));
    ASSIGN_OR_RETURN(TcpCompletionQueue * tcq, ReserveCq(engine_.get(), cq, options));
    auto fd_or = Dial(sa, address, deadline);
    auth::Outcome outcome;
    Status hs = fd_or.ok() ? auth::ConnectorHandshake(fd_or->get(), options.auth_identity,
                                                      options.auth_key, deadline, &outcome)
                           : fd_or.status();
    // TLS when the listener requires it (an authenticated requirement: a man in the middle
    // cannot strip it), and a refusal when this side requires it and the listener does not.
    const bool tls = (outcome.flags & auth::kFlagTcpTls) != 0;
    if (hs.ok() && engine_->options().tcp_tls && !tls) {
      hs = PermissionDeniedError(
          "the listener does not use TLS and this side requires it (tcp_tls)");
    }
    if (hs.ok()) hs = Handshake(fd_or->get(), options, deadline);
    std::unique_ptr<TlsSession> session;
    if (hs.ok() && tls) {
      auto t = TlsSession::Handshake(fd_or->get(), /*server=*/false, outcome.session_secret,
                                     deadline);
      if (t.ok()) {
        session = std::move(*t);
      } else {
        hs = t.status();
      }
    }
    if (!hs.ok()) {
      UnreserveCq(engine_.get(), tcq, options);
      return hs.WithContext("tcp: connect to " + address);
    }
    return MakeEndpoint(engine_, std::move(*fd_or), tcq, options, std::move(session));
  }

 private:
  StatusOr<UniqueFd> Dial(const sockaddr_in& sa, const std::string& address,
                          Clock::time_point deadline) {
    UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoError("socket", errno);
    if (!engine_->options().bind_ip.empty()) {
      sockaddr_in src{};
      src.sin_family = AF_INET;
      inet_pton(AF_INET, engine_->options().bind_ip.c_str(), &src.sin_addr);
      if (bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0) {
        return ErrnoError("bind to " + engine_->options().bind_ip, errno);
      }
    }
    ConfigureSocket(fd.get());
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {
      if (errno != EINPROGRESS && errno != EINTR) return ErrnoError("connect", errno);
      RETURN_IF_ERROR(net::WaitFd(fd.get(), POLLOUT, deadline, "connect"));
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) return ErrnoError("connect", err);
    }
    return fd;
  }

  // The address peers can reach a wildcard listener on: the source address of the default
  // route (no packet is sent), else loopback.
  static in_addr PrimaryIp() {
    in_addr out{};
    out.s_addr = htonl(INADDR_LOOPBACK);
    UniqueFd s(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!s.valid()) return out;
    sockaddr_in probe{};
    probe.sin_family = AF_INET;
    probe.sin_port = htons(9);
    inet_pton(AF_INET, "192.0.2.1", &probe.sin_addr);  // TEST-NET-1, never contacted
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&probe), sizeof(probe)) != 0) return out;
    sockaddr_in me{};
    socklen_t len = sizeof(me);
    if (getsockname(s.get(), reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
        me.sin_addr.s_addr != htonl(INADDR_ANY)) {
      out = me.sin_addr;
    }
    return out;
  }

  std::shared_ptr<TcpEngine> engine_;
};

}  // namespace
}  // namespace tcp

StatusOr<std::unique_ptr<Fabric>> OpenTcpFabric(const FabricOptions& options) {
  auto engine = tcp::TcpEngine::Create(options);
  if (!engine.ok()) return UnavailableError("tcp: " + engine.status().ToString());
  return std::unique_ptr<Fabric>(new tcp::TcpFabric(std::move(*engine)));
}

}  // namespace shardps::transport
