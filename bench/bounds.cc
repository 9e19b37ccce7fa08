#include "bench/bounds.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <cmath>
#include <fstream>
#include <sstream>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>

#include <glog/logging.h>

#include "bench/bench_util.h"
#include "common/fd.h"
#include "common/net.h"

namespace shardps::bench {
namespace {

// Raw-TCP bound wire format: every request starts with this header (host byte order; both
// ends are this binary on the same kind of machine). A request names `count` messages of `size`
// bytes: kWriteKind is followed by count × size payload bytes and answered with one 8-byte ack
// (the bound's analogue of one signaled completion per batch); kReadKind is answered with
// count × size bytes. Payloads go straight into / out of the rotating slots (readv / writev).
struct Header {
  uint32_t kind;   // kEnd, kWriteKind, kReadKind
  uint32_t slots;  // the server rotates its buffer over this many size-byte slots
  uint64_t size;
  uint64_t count;  // messages in this request, 1..kMaxBatch
};
static_assert(sizeof(Header) == 24, "raw TCP header is 24 bytes");
constexpr uint32_t kEnd = 0, kWriteKind = 1, kReadKind = 2;
constexpr int kMaxBatch = 256;

// iovecs for `count` consecutive slots starting at message number `first`.
int SlotIovecs(char* base, uint64_t first, uint64_t count, uint32_t slots, uint64_t size,
               iovec* out) {
  for (uint64_t i = 0; i < count; ++i) {
    out[i].iov_base = base + ((first + i) % slots) * size;
    out[i].iov_len = size;
  }
  return static_cast<int>(count);
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

const char* BenchOpName(BenchOp op) { return op == BenchOp::kWrite ? "write" : "read"; }

// ---- server ----

StatusOr<std::unique_ptr<RawTcpServer>> RawTcpServer::Start(const std::string& bind_ip) {
  std::unique_ptr<RawTcpServer> s(new RawTcpServer());
  ASSIGN_OR_RETURN(s->listen_fd_,
                   net::ListenTcp((bind_ip.empty() ? "127.0.0.1" : bind_ip) + ":0", &s->address_,
                                  /*backlog=*/4));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

RawTcpServer::~RawTcpServer() {
  stop_ = true;
  const int c = conn_fd_.load();
  if (c >= 0) shutdown(c, SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
}

void RawTcpServer::Loop() {
  while (!stop_) {
    pollfd p{listen_fd_.get(), POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) continue;
    SetNoDelay(fd.get());
    conn_fd_ = fd.get();
    if (!stop_) Serve(fd.get());
    conn_fd_ = -1;
  }
}

void RawTcpServer::Serve(int fd) {
  uint64_t counter = 0;
  iovec iov[kMaxBatch];
  for (;;) {
    Header h;
    if (!fdio::ReadFull(fd, &h, sizeof h).ok() || h.kind == kEnd) return;
    const uint32_t slots = std::max<uint32_t>(1, h.slots);
    if (h.count < 1 || h.count > kMaxBatch || h.size == 0) {
      LOG(WARNING) << "raw tcp server: bad request (count " << h.count << ")";
      return;
    }
    if (buf_.size() < h.size * slots) {
      buf_.assign(h.size * slots, 0x5a);  // assign() touches every page: no faults while timed
    }
    const int n = SlotIovecs(buf_.data(), counter, h.count, slots, h.size, iov);
    counter += h.count;
    if (h.kind == kWriteKind) {
      if (!fdio::ReadvFull(fd, iov, n, "raw tcp readv").ok()) return;
      const uint64_t ack = counter;
      if (!fdio::WriteAll(fd, &ack, sizeof ack).ok()) return;
    } else if (h.kind == kReadKind) {
      if (!fdio::WritevAll(fd, iov, n, "raw tcp writev").ok()) return;
    } else {
      LOG(WARNING) << "raw tcp server: unknown request kind " << h.kind;
      return;
    }
  }
}

// ---- client ----

StatusOr<std::unique_ptr<RawTcpClient>> RawTcpClient::Connect(const std::string& address,
                                                              const std::string& bind_ip) {
  std::unique_ptr<RawTcpClient> c(new RawTcpClient());
  ASSIGN_OR_RETURN(c->fd_, net::ConnectTcp(address, bind_ip, std::chrono::seconds(10)));
  return c;
}

RawTcpClient::~RawTcpClient() {
  if (fd_.valid()) {
    Header h{kEnd, 0, 0, 0};
    fdio::WriteAll(fd_.get(), &h, sizeof h).IgnoreError();
  }
}

void RawTcpClient::EnsureBuffer(size_t bytes) {
  if (buf_.size() < bytes) buf_.assign(bytes, 0x33);
}

// Keeps up to p.window messages outstanding, in requests of `batch` messages (window / 4, the
// transport's signaling interval), until `seconds` have passed, then drains.
Status RawTcpClient::RunWindow(BenchOp op, const PointParams& p, double seconds, uint64_t* ops) {
  const uint32_t slots = static_cast<uint32_t>(std::max(1, p.slots));
  EnsureBuffer(p.size * slots);
  const int batch = std::clamp(p.batch > 0 ? p.batch : p.window / 4, 1, kMaxBatch);
  std::deque<uint64_t> inflight;  // message counts of the outstanding requests, oldest first
  uint64_t posted = 0, done = 0;
  iovec iov[kMaxBatch + 1];
  const double start = NowSeconds();
  for (;;) {
    const bool stop = NowSeconds() - start >= seconds;
    while (!stop && posted - done < static_cast<uint64_t>(p.window)) {
      const uint64_t k = std::min<uint64_t>(batch, p.window - (posted - done));
      Header h{op == BenchOp::kWrite ? kWriteKind : kReadKind, slots, p.size, k};
      iov[0] = {&h, sizeof h};
      int n = 1;
      if (op == BenchOp::kWrite) n += SlotIovecs(buf_.data(), posted, k, slots, p.size, iov + 1);
      RETURN_IF_ERROR(fdio::WritevAll(fd_.get(), iov, n, "raw tcp writev"));
      posted += k;
      inflight.push_back(k);
    }
    if (inflight.empty()) break;
    const uint64_t k = inflight.front();
    inflight.pop_front();
    if (op == BenchOp::kWrite) {
      uint64_t ack;
      RETURN_IF_ERROR(fdio::ReadFull(fd_.get(), &ack, sizeof ack));
    } else {
      const int n = SlotIovecs(buf_.data(), done, k, slots, p.size, iov);
      RETURN_IF_ERROR(fdio::ReadvFull(fd_.get(), iov, n, "raw tcp readv"));
    }
    done += k;
  }
  *ops = done;
  return Status::OK();
}

Status TimedBandwidth(const std::function<Status(double seconds, uint64_t* ops)>& run_window,
                      const PointParams& p, BwResult* out) {
  uint64_t warm = 0;
  RETURN_IF_ERROR(run_window(std::min(0.05, p.seconds * 0.2), &warm));
  const double c0 = SelfCpuSeconds(), t0 = NowSeconds();
  RETURN_IF_ERROR(run_window(p.seconds, &out->ops));
  out->seconds = NowSeconds() - t0;
  out->cpu_self = SelfCpuSeconds() - c0;
  out->bytes_per_op = p.size;
  return Status::OK();
}

Status RawTcpClient::Bandwidth(BenchOp op, const PointParams& p, BwResult* out) {
  return TimedBandwidth(
      [&](double seconds, uint64_t* ops) { return RunWindow(op, p, seconds, ops); }, p, out);
}

Status RawTcpClient::Latency(BenchOp op, const PointParams& p, LatResult* out) {
  PointParams one = p;
  one.window = 1;
  one.batch = 1;
  uint64_t warm = 0;
  RETURN_IF_ERROR(RunWindow(op, one, 0.01, &warm));
  const uint32_t slots = static_cast<uint32_t>(std::max(1, p.slots));
  out->us.clear();
  const double c0 = SelfCpuSeconds(), start = NowSeconds();
  for (int i = 0; i < p.lat_max_iters; ++i) {
    if (i >= p.lat_min_iters && NowSeconds() - start >= p.lat_seconds) break;
    char* slot = buf_.data() + (i % slots) * p.size;
    Header h{op == BenchOp::kWrite ? kWriteKind : kReadKind, slots, p.size, 1};
    const double t0 = NowSeconds();
    if (op == BenchOp::kWrite) {
      iovec iov[2] = {{&h, sizeof h}, {slot, p.size}};
      uint64_t ack;
      RETURN_IF_ERROR(fdio::WritevAll(fd_.get(), iov, 2, "raw tcp writev"));
      RETURN_IF_ERROR(fdio::ReadFull(fd_.get(), &ack, sizeof ack));
    } else {
      RETURN_IF_ERROR(fdio::WriteAll(fd_.get(), &h, sizeof h));
      RETURN_IF_ERROR(fdio::ReadFull(fd_.get(), slot, p.size));
    }
    out->us.push_back((NowSeconds() - t0) * 1e6);
  }
  out->seconds = NowSeconds() - start;
  out->cpu_self = SelfCpuSeconds() - c0;
  return Status::OK();
}

// ---- memcpy ----

namespace {

struct CopyBuffers {
  char* src = nullptr;
  char* dst = nullptr;
  size_t bytes = 0;
  explicit CopyBuffers(size_t n) : bytes((n + 4095) / 4096 * 4096) {
    src = static_cast<char*>(aligned_alloc(4096, bytes));
    dst = static_cast<char*>(aligned_alloc(4096, bytes));
    if (src != nullptr && dst != nullptr) {
      memset(src, 1, bytes);
      memset(dst, 2, bytes);
    }
  }
  ~CopyBuffers() {
    free(src);
    free(dst);
  }
  bool ok() const { return src != nullptr && dst != nullptr; }
};

}  // namespace

Status MemcpyBandwidth(const PointParams& p, BwResult* out) {
  const int slots = std::max(1, p.slots);
  CopyBuffers b(p.size * slots);
  if (!b.ok()) return ResourceExhaustedError("memcpy bound: out of memory");
  auto run = [&](double seconds, uint64_t* ops) {
    const double start = NowSeconds();
    uint64_t i = 0;
    // Check the clock once per `slots` copies (at least every 16) to keep it off the profile.
    const int batch = std::max(16, slots);
    do {
      for (int k = 0; k < batch; ++k, ++i) {
        const size_t off = (i % slots) * p.size;
        memcpy(b.dst + off, b.src + off, p.size);
        __asm__ volatile("" ::"r"(b.dst) : "memory");
      }
    } while (NowSeconds() - start < seconds);
    *ops = i;
  };
  uint64_t warm = 0;
  run(std::min(0.05, p.seconds * 0.2), &warm);
  const double c0 = SelfCpuSeconds(), t0 = NowSeconds();
  run(p.seconds, &out->ops);
  out->seconds = NowSeconds() - t0;
  out->cpu_self = SelfCpuSeconds() - c0;
  out->bytes_per_op = p.size;
  return Status::OK();
}

Status MemcpyLatency(const PointParams& p, LatResult* out) {
  const int slots = std::max(1, p.slots);
  CopyBuffers b(p.size * slots);
  if (!b.ok()) return ResourceExhaustedError("memcpy bound: out of memory");
  out->us.clear();
  const double c0 = SelfCpuSeconds(), start = NowSeconds();
  for (int i = 0; i < p.lat_max_iters; ++i) {
    if (i >= p.lat_min_iters && NowSeconds() - start >= p.lat_seconds) break;
    const size_t off = (i % slots) * p.size;
    const double t0 = NowSeconds();
    memcpy(b.dst + off, b.src + off, p.size);
    __asm__ volatile("" ::"r"(b.dst) : "memory");
    out->us.push_back((NowSeconds() - t0) * 1e6);
  }
  out->seconds = NowSeconds() - start;
  out->cpu_self = SelfCpuSeconds() - c0;
  return Status::OK();
}

StatusOr<ExternalBounds> LoadExternalBounds(const std::string& path) {
  ExternalBounds b;
  if (path.empty()) return b;
  std::ifstream f(path);
  if (!f) return NotFoundError("cannot open --bounds_file " + path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    std::string prov, op, kind;
    size_t size = 0;
    double a = NAN, b2 = NAN;
    is >> prov >> op >> kind >> size >> a;
    if (!is) return InvalidArgumentError("--bounds_file: bad line '" + line + "'");
    if (kind == "lat") is >> b2;
    b[{prov, op, kind, size}] = {a, b2};
  }
  return b;
}

}  // namespace shardps::bench
