#include "tests/tools/fault_proxy.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <sstream>
#include <vector>

#include <glog/logging.h>

#include "common/net.h"

namespace shardps::tools {

using Clock = std::chrono::steady_clock;
using control::Envelope;

namespace {

// Bytes buffered towards one side above which the other side is not read (backpressure).
constexpr size_t kMaxBufferedOut = 4u << 20;

// Every body control::BodyName names (proto/framing.cc).
const char* const kBodies[] = {"join",          "join_reply",     "heartbeat",      "leave",
                               "membership",    "error",          "register_model", "assign_shards",
                               "shards_ready",  "shard_map",      "replica_target", "promote",
                               "checkpoint",    "heartbeat_ack",  "replica_synced", "status_request",
                               "status_reply",  "barrier",        "barrier_release"};

}  // namespace

StatusOr<ProxyDirection> ParseProxyDirection(const std::string& s) {
  if (s == "up") return ProxyDirection::kUp;
  if (s == "down") return ProxyDirection::kDown;
  if (s == "both") return ProxyDirection::kBoth;
  return InvalidArgumentError("direction must be up, down or both, not '" + s + "'");
}

BodyCounters FaultProxyCounters::Total() const {
  BodyCounters t;
  for (const auto& [name, c] : by_body) {
    t.forwarded += c.forwarded;
    t.dropped += c.dropped;
    t.delayed += c.delayed;
    t.blackholed += c.blackholed;
  }
  return t;
}

std::string FaultProxyCounters::ToString() const {
  std::ostringstream os;
  auto line = [&os](const std::string& name, const BodyCounters& c) {
    os << name << ": forwarded " << c.forwarded << " dropped " << c.dropped << " delayed "
       << c.delayed << " blackholed " << c.blackholed << "\n";
  };
  for (const auto& [name, c] : by_body) line(name, c);
  line("total", Total());
  os << "connections " << connections << " malformed " << malformed << " upstream_failures "
     << upstream_failures << "\n";
  return os.str();
}

// One direction of a pair: bytes read from `src`, frames queued, bytes written to `dst`.
struct FaultProxy::Flow {
  ProxyDirection dir;
  int src = -1, dst = -1;
  bool need_magic = false;  // up: the magic comes first
  std::string in;           // received, not yet parsed
  bool src_eof = false;
  struct Queued {
    Clock::time_point release;
    std::string bytes;
    std::string body;  // empty: the magic
  };
  std::deque<Queued> queue;  // parsed, waiting for their release time
  Clock::time_point last_release{};
  std::string out;  // released, not yet written to dst
  size_t out_off = 0;
  size_t pending_out() const { return out.size() - out_off; }
};

struct FaultProxy::Pair {
  uint64_t id = 0;
  UniqueFd client, upstream;
  Flow up, down;
  bool closing = false;
};

FaultProxy::FaultProxy(const FaultProxyOptions& options) : options_(options), rng_(options.seed) {}

StatusOr<std::unique_ptr<FaultProxy>> FaultProxy::Start(const FaultProxyOptions& options) {
  if (options.upstream.empty()) return InvalidArgumentError("fault proxy: no upstream address");
  RETURN_IF_ERROR(net::ParseHostPort(options.upstream).status());
  if (options.drop_percent < 0 || options.drop_percent > 100 || options.delay_percent < 0 ||
      options.delay_percent > 100) {
    return InvalidArgumentError("fault proxy: percentages must be within 0..100");
  }
  if (!options.only.empty() &&
      std::find(std::begin(kBodies), std::end(kBodies), options.only) == std::end(kBodies)) {
    std::string known;
    for (const char* b : kBodies) known += std::string(known.empty() ? "" : ", ") + b;
    return InvalidArgumentError("fault proxy: unknown body '" + options.only + "' (" + known +
                                ")");
  }
  std::unique_ptr<FaultProxy> p(new FaultProxy(options));
  ASSIGN_OR_RETURN(p->listen_fd_, net::ListenTcp(options.listen_address, &p->address_));
  RETURN_IF_ERROR(net::SetNonBlocking(p->listen_fd_.get(), true));
  p->wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!p->wake_fd_.valid()) return ErrnoError("eventfd", errno);
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  LOG(INFO) << "fault proxy: " << p->address_ << " -> " << options.upstream << ", drop "
            << options.drop_percent << "%, delay " << options.delay_ms << " ms for "
            << options.delay_percent << "%, only '" << options.only << "', seed " << options.seed;
  return p;
}

FaultProxy::~FaultProxy() { Stop(); }

void FaultProxy::Stop() {
  if (stop_.exchange(true)) return;
  uint64_t one = 1;
  if (write(wake_fd_.get(), &one, sizeof(one)) < 0) PLOG(WARNING) << "fault proxy: wake";
  if (thread_.joinable()) thread_.join();
}

void FaultProxy::SetBlackhole(bool on) {
  if (blackhole_.exchange(on) == on) return;
  LOG(INFO) << "fault proxy: blackhole " << (on ? "on" : "off");
  uint64_t one = 1;
  if (write(wake_fd_.get(), &one, sizeof(one)) < 0) PLOG(WARNING) << "fault proxy: wake";
}

FaultProxyCounters FaultProxy::counters() const {
  std::lock_guard<std::mutex> l(mu_);
  return counters_;
}

bool FaultProxy::Roll(double percent) {
  if (percent <= 0) return false;
  if (percent >= 100) return true;
  // splitmix64: small, seeded, the same sequence everywhere.
  uint64_t z = (rng_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (100.0 / 9007199254740992.0) < percent;
}

void FaultProxy::Loop() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Pair*, Flow*>> who;  // per pollfd after the first two: the flow it reads
  while (!stop_.load()) {
    const bool hole = blackhole_.load();
    const auto now = Clock::now();
    // Release what is due, flush, close pairs that are done.
    for (auto& [id, p] : pairs_) {
      for (Flow* f : {&p->up, &p->down}) {
        if (p->closing) break;
        if (!hole) {
          Release(p.get(), f);
          Flush(p.get(), f);
        }
        if (!p->closing && f->src_eof && f->queue.empty() && f->pending_out() == 0) {
          ClosePair(p.get(),
                    f->dir == ProxyDirection::kUp ? "member side done" : "upstream side done");
        }
      }
    }
    for (auto it = pairs_.begin(); it != pairs_.end();) {
      it = it->second->closing ? pairs_.erase(it) : std::next(it);
    }
    // Poll: readable sources (unless the other side is backed up), writable destinations.
    fds.clear();
    who.clear();
    fds.push_back({listen_fd_.get(), POLLIN, 0});
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    int timeout_ms = 100;
    for (auto& [id, p] : pairs_) {
      for (Flow* f : {&p->up, &p->down}) {
        short ev = 0;
        if (!f->src_eof && f->pending_out() < kMaxBufferedOut) ev |= POLLIN;
        fds.push_back({f->src, ev, 0});
        who.emplace_back(p.get(), f);
        if (!hole && f->pending_out() > 0) {
          fds.push_back({f->dst, POLLOUT, 0});  // wakes the loop, which flushes at its top
          who.emplace_back(nullptr, nullptr);
        }
        if (!hole && !f->queue.empty()) {
          const auto ms =
              std::chrono::duration_cast<std::chrono::milliseconds>(f->queue.front().release - now)
                  .count() +
              1;
          timeout_ms = std::max<int>(0, std::min<int>(timeout_ms, static_cast<int>(ms)));
        }
      }
    }
    const int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      PLOG(ERROR) << "fault proxy: poll";
      continue;
    }
    if (fds[1].revents & POLLIN) {
      uint64_t v;
      if (read(wake_fd_.get(), &v, sizeof(v)) < 0 && errno != EAGAIN) PLOG(WARNING) << "wake";
    }
    if (fds[0].revents & POLLIN) AcceptNew();
    for (size_t i = 2; i < fds.size(); ++i) {
      auto [p, f] = who[i - 2];
      if (p == nullptr || p->closing) continue;
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) ReadInto(p, f);
    }
  }
  pairs_.clear();
}

void FaultProxy::AcceptNew() {
  while (true) {
    UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno != EAGAIN && errno != EINTR) PLOG(WARNING) << "fault proxy: accept";
      return;
    }
    // Blocking connect on the loop thread, bounded by connect_timeout: a test tool, not a
    // data path.
    auto up = net::ConnectTcp(options_.upstream, "", options_.connect_timeout);
    Status nb = up.ok() ? net::SetNonBlocking(up->get(), true) : up.status();
    if (!nb.ok()) {
      LOG(WARNING) << "fault proxy: upstream " << options_.upstream << ": " << nb;
      std::lock_guard<std::mutex> l(mu_);
      ++counters_.upstream_failures;
      continue;  // fd closes: the member sees its connection closed
    }
    auto p = std::make_unique<Pair>();
    p->id = next_pair_++;
    p->client = std::move(fd);
    p->upstream = std::move(*up);
    p->up.dir = ProxyDirection::kUp;
    p->up.src = p->client.get();
    p->up.dst = p->upstream.get();
    p->up.need_magic = true;
    p->down.dir = ProxyDirection::kDown;
    p->down.src = p->upstream.get();
    p->down.dst = p->client.get();
    {
      std::lock_guard<std::mutex> l(mu_);
      ++counters_.connections;
    }
    VLOG(1) << "fault proxy: pair " << p->id << " opened";
    pairs_[p->id] = std::move(p);
  }
}

void FaultProxy::ReadInto(Pair* p, Flow* f) {
  char buf[64 << 10];
  while (!p->closing && !f->src_eof && f->pending_out() < kMaxBufferedOut) {
    const ssize_t k = recv(f->src, buf, sizeof(buf), MSG_DONTWAIT);
    if (k == 0) {
      f->src_eof = true;
      break;
    }
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      ClosePair(p, std::string("recv: ") + strerror(errno));
      return;
    }
    f->in.append(buf, static_cast<size_t>(k));
    ParseFrames(p, f);
  }
}

void FaultProxy::ParseFrames(Pair* p, Flow* f) {
  const auto now = Clock::now();
  const bool hole = blackhole_.load();
  size_t off = 0;
  auto enqueue = [&](std::string bytes, std::string body, bool delay) {
    auto release =
        now + (delay ? std::chrono::milliseconds(options_.delay_ms) : std::chrono::milliseconds(0));
    release = std::max(release, f->last_release);  // never overtake a frame queued earlier
    f->last_release = release;
    f->queue.push_back({release, std::move(bytes), std::move(body)});
  };
  if (f->need_magic) {
    if (f->in.size() < control::kMagic.size()) return;
    if (std::string_view(f->in).substr(0, control::kMagic.size()) != control::kMagic) {
      Malformed(p, f, "bad magic from the member");
      return;
    }
    // The magic is connection setup, not a message: always forwarded, even in a blackhole.
    enqueue(std::string(control::kMagic), "", false);
    f->need_magic = false;
    off = control::kMagic.size();
  }
  const bool dir_matches = (static_cast<int>(options_.direction) & static_cast<int>(f->dir)) != 0;
  while (f->in.size() - off >= 4) {
    const auto* h = reinterpret_cast<const unsigned char*>(f->in.data() + off);
    const size_t n = static_cast<size_t>(h[0]) | (static_cast<size_t>(h[1]) << 8) |
                     (static_cast<size_t>(h[2]) << 16) | (static_cast<size_t>(h[3]) << 24);
    if (n == 0 || n > options_.max_frame_bytes) {
      Malformed(p, f, "frame length " + std::to_string(n));
      return;
    }
    if (f->in.size() - off < 4 + n) break;
    Envelope e;
    if (!e.ParseFromArray(f->in.data() + off + 4, static_cast<int>(n)) ||
        e.body_case() == Envelope::BODY_NOT_SET) {
      f->in.erase(0, off);
      Malformed(p, f, "a frame that is not an Envelope with a body");
      return;
    }
    const std::string body = control::BodyName(e);
    std::string bytes = f->in.substr(off, 4 + n);
    off += 4 + n;
    bool drop = false, delay = false, holed = false;
    if (hole) {
      holed = true;
    } else if (dir_matches && (options_.only.empty() || options_.only == body)) {
      drop = Roll(options_.drop_percent);
      if (!drop && options_.delay_ms > 0) delay = Roll(options_.delay_percent);
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      BodyCounters& c = counters_.by_body[body];
      c.blackholed += holed;
      c.dropped += drop;
      c.delayed += delay;
    }
    if (holed || drop) continue;
    enqueue(std::move(bytes), body, delay);
  }
  f->in.erase(0, off);
}

void FaultProxy::Malformed(Pair* p, Flow* f, const std::string& why) {
  LOG(WARNING) << "fault proxy: pair " << p->id << ": malformed input from the "
               << (f->dir == ProxyDirection::kUp ? "member" : "upstream") << ": " << why
               << "; closing the pair once the frames before it are forwarded";
  {
    std::lock_guard<std::mutex> l(mu_);
    ++counters_.malformed;
  }
  f->in.clear();
  f->src_eof = true;  // read no more; the loop closes the pair when this flow has drained
}

void FaultProxy::Release(Pair* p, Flow* f) {
  const auto now = Clock::now();
  while (!f->queue.empty() && f->queue.front().release <= now) {
    Flow::Queued& q = f->queue.front();
    if (f->out_off > 0 && f->out_off == f->out.size()) {
      f->out.clear();
      f->out_off = 0;
    }
    f->out += q.bytes;
    if (!q.body.empty()) {
      std::lock_guard<std::mutex> l(mu_);
      ++counters_.by_body[q.body].forwarded;
    }
    f->queue.pop_front();
  }
}

void FaultProxy::Flush(Pair* p, Flow* f) {
  while (!p->closing && f->pending_out() > 0) {
    const ssize_t k =
        send(f->dst, f->out.data() + f->out_off, f->pending_out(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      f->out_off += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
    ClosePair(p, std::string("send: ") + strerror(errno));
    return;
  }
}

void FaultProxy::ClosePair(Pair* p, const std::string& why) {
  if (p->closing) return;
  p->closing = true;
  VLOG(1) << "fault proxy: closing pair " << p->id << ": " << why;
  p->client.reset();
  p->upstream.reset();
}

}  // namespace shardps::tools
