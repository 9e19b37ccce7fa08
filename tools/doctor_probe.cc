// The pair probe of shardps doctor: a responder that serves registered memory over the real
// transport, and a prober that measures one-sided writes and reads against it and verifies the
// bytes both ways.
//
// Probe control protocol (TCP, text lines of at most 8 KiB, ending in '\n'):
//   responder -> prober, on accept:  "SHPSDOC1 <transport> <hostname> <data_address>
//                                     <hex(RegionDescriptor::Encode())> <seed>"
//   (the prober then connects a transport endpoint to <data_address>; the region holds
//    Pattern(seed) until the prober writes)
//   prober -> responder:  "VERIFY <length> <fnv1a64 hex>"  -> "OK" | "BAD <fnv1a64 hex>"
//   prober -> responder:  "BYE" (or closes): the responder drops the endpoint and the region.
// Anything else closes that connection; the responder keeps serving others.
#include <arpa/inet.h>
#include <glog/logging.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include "common/net.h"
#include "tools/doctor.h"

namespace shardps::tools {
namespace {

using Clock = std::chrono::steady_clock;
using transport::Access;
using transport::Completion;
using transport::LocalSlice;
using transport::RegionDescriptor;

constexpr size_t kMaxLine = 8192;
constexpr char kHelloTag[] = "SHPSDOC1";

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void FillPattern(void* p, uint64_t len, uint64_t seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (uint64_t i = 0; i < len; i += 8) {
    const uint64_t w = Mix(seed ^ (i / 8));
    std::memcpy(b + i, &w, std::min<uint64_t>(8, len - i));
  }
}

// Offset of the first byte that differs from Pattern(seed), or len when all match.
uint64_t FirstMismatch(const void* p, uint64_t len, uint64_t seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (uint64_t i = 0; i < len; i += 8) {
    const uint64_t w = Mix(seed ^ (i / 8));
    if (std::memcmp(b + i, &w, std::min<uint64_t>(8, len - i)) != 0) return i;
  }
  return len;
}

uint64_t Fnv1a(const void* p, uint64_t len) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t i = 0; i < len; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

std::string Hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

StatusOr<std::string> Unhex(const std::string& h) {
  if (h.size() % 2) return InvalidArgumentError("odd hex length");
  std::string out;
  for (size_t i = 0; i < h.size(); i += 2) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = h[i + k];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else
        return InvalidArgumentError("bad hex digit");
    }
    out.push_back(static_cast<char>(v));
  }
  return out;
}

// Reads one '\n'-terminated line (without it) within timeout. *buf keeps bytes past it.
StatusOr<std::string> RecvLine(int fd, std::string* buf, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    const size_t nl = buf->find('\n');
    if (nl != std::string::npos) {
      std::string line = buf->substr(0, nl);
      buf->erase(0, nl + 1);
      return line;
    }
    if (buf->size() > kMaxLine) return InvalidArgumentError("line too long");
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0)
      return DeadlineExceededError("no answer within " + std::to_string(timeout.count()) + " ms");
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno != EINTR) return ErrnoError("poll", errno);
    if (r <= 0) continue;
    char tmp[4096];
    ASSIGN_OR_RETURN(size_t n, net::RecvSome(fd, tmp, sizeof(tmp)));
    buf->append(tmp, n);
  }
}

Status SendLine(int fd, const std::string& line, std::chrono::milliseconds timeout) {
  const std::string l = line + "\n";
  return net::SendAll(fd, l.data(), l.size(), timeout);
}

std::vector<std::string> Split(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

std::string ShortError(const Status& s) { return s.message().empty() ? s.ToString() : s.message(); }

// Waits for the next completion until deadline; a failed completion is an error.
StatusOr<Completion> WaitOne(transport::CompletionQueue* cq, Clock::time_point deadline) {
  Completion wc;
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
    if (left.count() <= 0) return DeadlineExceededError("the peer stopped answering");
    if (cq->Wait(&wc, 1, std::min(left, std::chrono::microseconds(100000))) == 1) {
      if (!wc.ok()) {
        return UnavailableError(std::string(transport::OpTypeName(wc.op)) +
                                " failed: " + transport::WcStatusName(wc.status));
      }
      return wc;
    }
  }
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

// The address peers use to reach this host: bind_ip, else the first non-loopback IPv4.
std::string AdvertisedIp(const std::string& bind_ip) {
  if (!bind_ip.empty()) return bind_ip;
  ifaddrs* ifs = nullptr;
  std::string found;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i && found.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      const auto* sin = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      if ((ntohl(sin->sin_addr.s_addr) >> 24) == 127) continue;
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
      found = buf;
    }
    freeifaddrs(ifs);
  }
  return found.empty() ? "127.0.0.1" : found;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Responder

StatusOr<std::unique_ptr<ProbeResponder>> ProbeResponder::Start(
    const DoctorOptions& o, const std::string& control_address) {
  std::unique_ptr<ProbeResponder> r(new ProbeResponder());
  r->options_ = o;
  ASSIGN_OR_RETURN(r->fabric_, transport::Fabric::Open(o.fabric));
  r->transport_ = r->fabric_->name();
  ASSIGN_OR_RETURN(r->cq_, r->fabric_->CreateCompletionQueue(256));
  ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(control_address));
  const std::string ip = AdvertisedIp(hp.host == "0.0.0.0" ? o.fabric.bind_ip : hp.host);
  ASSIGN_OR_RETURN(r->listener_,
                   r->fabric_->Listen(r->transport_ == "shm" ? std::string() : ip + ":0"));
  std::string bound;
  ASSIGN_OR_RETURN(r->control_fd_, net::ListenTcp(control_address, &bound));
  ASSIGN_OR_RETURN(net::HostPort b, net::ParseHostPort(bound));
  r->address_ = ip + ":" + std::to_string(b.port);
  int p[2];
  if (pipe(p) != 0) return ErrnoError("pipe", errno);
  r->wake_[0].reset(p[0]);
  r->wake_[1].reset(p[1]);
  r->thread_ = std::thread([raw = r.get()] { raw->Run(); });
  return r;
}

ProbeResponder::~ProbeResponder() {
  if (thread_.joinable()) {
    const char c = 'x';
    if (write(wake_[1].get(), &c, 1) < 0) {
      // The thread still exits at its next poll timeout.
    }
    thread_.join();
  }
}

void ProbeResponder::Run() {
  struct Conn {
    UniqueFd fd;
    std::string buf;
    std::unique_ptr<transport::MemoryRegion> region;
    std::unique_ptr<transport::Endpoint> ep;
  };
  std::vector<std::unique_ptr<Conn>> conns;
  const uint64_t region_bytes = std::max<uint64_t>(options_.large_bytes, 4096);
  uint64_t next_seed = Mix(static_cast<uint64_t>(getpid()) ^
                           static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  while (true) {
    std::vector<pollfd> pfds;
    pfds.push_back({wake_[0].get(), POLLIN, 0});
    pfds.push_back({control_fd_.get(), POLLIN, 0});
    for (auto& c : conns) pfds.push_back({c->fd.get(), POLLIN, 0});
    const int n = poll(pfds.data(), pfds.size(), 1000);
    if (n < 0 && errno != EINTR) {
      LOG(ERROR) << "doctor responder: poll: " << strerror(errno);
      return;
    }
    if (n <= 0) continue;
    if (pfds[0].revents) return;
    // Existing connections first (their indexes shift when one closes).
    for (size_t i = conns.size(); i-- > 0;) {
      if (!pfds[2 + i].revents) continue;
      Conn& c = *conns[i];
      char tmp[4096];
      const StatusOr<size_t> k = net::RecvSome(c.fd.get(), tmp, sizeof(tmp));
      bool close_it = !k.ok();
      if (k.ok()) c.buf.append(tmp, *k);
      size_t nl;
      while (!close_it && (nl = c.buf.find('\n')) != std::string::npos) {
        const std::vector<std::string> w = Split(c.buf.substr(0, nl));
        c.buf.erase(0, nl + 1);
        if (w.size() == 3 && w[0] == "VERIFY") {
          const uint64_t len = std::strtoull(w[1].c_str(), nullptr, 10);
          if (len == 0 || len > c.region->length()) {
            close_it = true;
            break;
          }
          char h[32];
          snprintf(h, sizeof(h), "%016llx",
                   static_cast<unsigned long long>(Fnv1a(c.region->data(), len)));
          const std::string reply = w[2] == h ? "OK" : std::string("BAD ") + h;
          if (!SendLine(c.fd.get(), reply, options_.timeout).ok()) close_it = true;
        } else {
          close_it = true;  // BYE, or anything we do not understand
        }
      }
      if (c.buf.size() > kMaxLine) close_it = true;
      if (close_it) conns.erase(conns.begin() + static_cast<long>(i));
    }
    if (!pfds[1].revents) continue;
    auto fd = net::AcceptTcp(control_fd_.get(), std::chrono::milliseconds(0));
    if (!fd.ok()) continue;
    auto c = std::make_unique<Conn>();
    c->fd = std::move(*fd);
    auto region = fabric_->AllocateMemory(region_bytes, Access::kRemoteReadWrite);
    if (!region.ok()) {
      LOG(WARNING) << "doctor responder: " << region.status().ToString();
      (void)SendLine(c->fd.get(), "ERROR " + region.status().message(), options_.timeout);
      continue;
    }
    c->region = std::move(*region);
    const uint64_t seed = next_seed = Mix(next_seed);
    FillPattern(c->region->data(), c->region->length(), seed);
    const std::string hello = std::string(kHelloTag) + " " + transport_ + " " + HostName() + " " +
                              listener_->address() + " " + Hex(c->region->descriptor().Encode()) +
                              " " + std::to_string(seed);
    if (!SendLine(c->fd.get(), hello, options_.timeout).ok()) continue;
    transport::EndpointOptions eo;
    eo.endpoint_id = served_.load() + 1;
    eo.send_depth = 4;
    eo.recv_depth = 4;
    eo.connect_timeout = options_.timeout;
    auto ep = listener_->Accept(cq_.get(), eo, options_.timeout);
    if (!ep.ok()) {
      LOG(WARNING) << "doctor responder: the prober did not connect: " << ep.status().ToString();
      continue;
    }
    c->ep = std::move(*ep);
    served_.fetch_add(1);
    conns.push_back(std::move(c));
  }
}

// ---------------------------------------------------------------------------------------------
// Prober

PairResult ProbePeer(const DoctorOptions& o, const std::string& address, FabricCache* cache) {
  PairResult r;
  r.from = o.self_name.empty() ? HostName() : o.self_name;
  r.to = address;
  const std::string self_host = HostName();
  auto fail = [&](const std::string& why) {
    r.ok = false;
    r.error = why;
    return r;
  };
  auto fd = net::ConnectTcp(address, "", o.timeout);
  if (!fd.ok()) {
    return fail("cannot reach peer " + address + " (" + ShortReason(fd.status(), o.timeout) + ")");
  }
  std::string buf;
  auto hello = RecvLine(fd->get(), &buf, o.timeout);
  if (!hello.ok()) {
    return fail("peer " + address + " accepted a connection but sent no probe greeting (" +
                ShortError(hello.status()) + ")");
  }
  const std::vector<std::string> w = Split(*hello);
  if (w.size() != 6 || w[0] != kHelloTag) {
    return fail("peer " + address + " does not speak the doctor probe protocol (got \"" +
                hello->substr(0, 60) + "\")");
  }
  const std::string remote_transport = w[1];
  r.to_host = w[2];
  const std::string data_address = w[3];
  auto raw = Unhex(w[4]);
  if (!raw.ok()) return fail("peer " + address + " sent a malformed region descriptor");
  auto desc = RegionDescriptor::Decode(*raw);
  if (!desc.ok()) return fail("peer " + address + ": " + desc.status().message());
  const uint64_t seed = std::strtoull(w[5].c_str(), nullptr, 10);
  const std::string& asked = o.fabric.provider;
  if (asked != "auto" && asked != remote_transport) {
    return fail("this side asked for " + asked + ", the peer serves " + remote_transport +
                "; both ends of a pair must use the same transport");
  }
  const bool same_host = r.to_host == self_host;
  if (remote_transport == "shm") {
    r.why = same_host ? "same host (" + self_host + "): shm maps the peer's memory directly"
                      : "the peer serves shm but runs on " + r.to_host + ", not " + self_host;
  } else if (remote_transport == "verbs") {
    r.why = "the peer serves verbs and this side opened an RDMA device";
  } else {
    r.why = "the peer serves tcp";
    if (same_host) r.why += "; same host, so shm is possible (--transport shm) and faster";
  }
  r.transport = remote_transport;
  transport::Fabric* fabric = nullptr;
  for (auto& [name, f] : cache->fabrics) {
    if (name == remote_transport) fabric = f.get();
  }
  if (!fabric) {
    transport::FabricOptions fo = o.fabric;
    fo.provider = remote_transport;
    auto f = transport::Fabric::Open(fo);
    if (!f.ok()) {
      return fail("the peer serves " + remote_transport +
                  " and this side cannot open it: " + f.status().message());
    }
    if (remote_transport == "verbs") r.why += ": " + (*f)->DebugString();
    fabric = f->get();
    cache->fabrics.emplace_back(remote_transport, std::move(*f));
  }
  auto cq = fabric->CreateCompletionQueue(64);
  if (!cq.ok()) return fail(cq.status().message());
  transport::EndpointOptions eo;
  eo.send_depth = 16;
  eo.recv_depth = 4;
  eo.connect_timeout = o.timeout;
  auto ep = fabric->Connect(data_address, cq->get(), eo);
  if (!ep.ok()) {
    return fail("connecting " + remote_transport + " to " + data_address + ": " +
                ep.status().message());
  }
  const uint64_t len = std::min<uint64_t>(std::max<uint64_t>(o.large_bytes, 64), desc->length);
  const uint64_t small = std::min<uint64_t>(std::max<uint64_t>(o.small_bytes, 1), len);
  auto local = fabric->AllocateMemory(2 * len, Access::kLocalOnly);
  if (!local.ok()) return fail("registering probe memory: " + local.status().message());
  auto* base = static_cast<unsigned char*>((*local)->data());
  const LocalSlice src{local->get(), 0, len};
  const LocalSlice sink{local->get(), len, len};
  auto op_deadline = [&] { return Clock::now() + o.timeout; };
  auto one = [&](bool write, const LocalSlice& s) -> Status {
    Status st = write ? (*ep)->PostWrite(s, transport::AtOffset(*desc, 0), 1)
                      : (*ep)->PostRead(s, transport::AtOffset(*desc, 0), 1);
    RETURN_IF_ERROR(st);
    return WaitOne(cq->get(), op_deadline()).status();
  };

  // 1. The responder's pattern, read back: a read moves the bytes it claims to.
  if (Status s = one(false, sink); !s.ok())
    return fail("read of the peer's region: " + ShortError(s));
  const uint64_t bad = FirstMismatch(base + len, len, seed);
  if (bad != len) {
    return fail("read returned wrong bytes at offset " + std::to_string(bad) +
                " of the peer's region");
  }
  r.verified_bytes += len;

  // 2. Latency of small ops, one at a time.
  auto latency = [&](bool write, OpFigures* f) -> Status {
    std::vector<double> us;
    for (int i = 0; i < o.probe_iters; ++i) {
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(one(write, write ? LocalSlice{local->get(), 0, small}
                                       : LocalSlice{local->get(), len, small}));
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    f->alpha_us = Percentile(us, 0.5);
    f->p99_us = Percentile(us, 0.99);
    f->small_bytes = small;
    f->latency_ops = us.size();
    return Status::OK();
  };
  // 3. Bandwidth of large ops, `depth` outstanding, for probe_time.
  auto bandwidth = [&](bool write, OpFigures* f) -> Status {
    constexpr int kDepth = 8;
    int outstanding = 0;
    uint64_t done = 0;
    const auto t0 = Clock::now();
    const auto stop = t0 + o.probe_time;
    while (true) {
      const bool more = Clock::now() < stop;
      while (more && outstanding < kDepth) {
        RETURN_IF_ERROR(write ? (*ep)->PostWrite(src, transport::AtOffset(*desc, 0), 2)
                              : (*ep)->PostRead(sink, transport::AtOffset(*desc, 0), 2));
        ++outstanding;
      }
      if (outstanding == 0) break;
      RETURN_IF_ERROR(WaitOne(cq->get(), op_deadline()).status());
      --outstanding;
      ++done;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    f->beta_Bps = secs > 0 ? static_cast<double>(done * len) / secs : 0;
    f->large_bytes = len;
    f->bandwidth_ops = done;
    return Status::OK();
  };
  FillPattern(base, len, seed ^ 0x5a5a5a5a5a5a5a5aull);
  for (bool write : {true, false}) {
    OpFigures* f = write ? &r.write : &r.read;
    if (Status s = latency(write, f); !s.ok()) {
      return fail(std::string(write ? "write" : "read") + " latency probe: " + ShortError(s));
    }
    if (Status s = bandwidth(write, f); !s.ok()) {
      return fail(std::string(write ? "write" : "read") + " bandwidth probe: " + ShortError(s));
    }
  }

  // 4. A fresh pattern written, read back here and hashed there: the write landed intact.
  const uint64_t seed2 = Mix(seed + 1);
  FillPattern(base, len, seed2);
  std::memset(base + len, 0, len);
  if (Status s = one(true, src); !s.ok()) return fail("verification write: " + ShortError(s));
  if (Status s = one(false, sink); !s.ok()) return fail("verification read: " + ShortError(s));
  const uint64_t bad2 = FirstMismatch(base + len, len, seed2);
  if (bad2 != len) {
    return fail("bytes written to the peer read back wrong at offset " + std::to_string(bad2));
  }
  char h[32];
  snprintf(h, sizeof(h), "%016llx", static_cast<unsigned long long>(Fnv1a(base, len)));
  Status s = SendLine(fd->get(), "VERIFY " + std::to_string(len) + " " + h, o.timeout);
  auto answer = s.ok() ? RecvLine(fd->get(), &buf, o.timeout) : StatusOr<std::string>(s);
  if (!answer.ok())
    return fail("peer did not confirm the written bytes: " + ShortError(answer.status()));
  if (*answer != "OK")
    return fail("the peer's memory holds other bytes than were written (" + *answer + ")");
  r.verified_bytes += 2 * len;
  (void)SendLine(fd->get(), "BYE", o.timeout);
  r.ok = true;
  return r;
}

CheckResult PairCheck(const PairResult& p, std::chrono::milliseconds timeout) {
  CheckResult c{"peer " + p.to, CheckStatus::kOk, "", ""};
  if (!p.ok) {
    c.status = CheckStatus::kFail;
    c.detail = p.error;
    if (p.error.find("cannot reach") != std::string::npos ||
        p.error.find("no answer") != std::string::npos) {
      c.fix =
          "start `shardps doctor --serve` on that host (or check the address it printed); "
          "check routing and firewalls between the hosts (a dropped SYN times out after " +
          std::to_string(timeout.count()) + " ms)";
    } else if (p.error.find("both ends") != std::string::npos) {
      c.fix = "run both doctors with the same --transport (the cluster's)";
    } else {
      c.fix = "see the reason; for verbs check GIDs/MTU on both hosts (rdma checks above)";
    }
    return c;
  }
  char buf[512];
  snprintf(buf, sizeof(buf),
           "%s: write %.1f us p50 / %.1f us p99, %.1f MB/s; read %.1f us p50 / %.1f us p99, "
           "%.1f MB/s; %llu bytes verified (%s)",
           p.transport.c_str(), p.write.alpha_us, p.write.p99_us, p.write.beta_Bps / 1e6,
           p.read.alpha_us, p.read.p99_us, p.read.beta_Bps / 1e6,
           static_cast<unsigned long long>(p.verified_bytes), p.why.c_str());
  c.detail = buf;
  return c;
}

}  // namespace shardps::tools
