// MetricsHttpServer (common/metrics_http.h): one poll(2) loop over the listening socket, an
// eventfd for stop, and at most max_connections non-blocking connections, each with a deadline.
#include "common/metrics_http.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <list>
#include <vector>

#include <glog/logging.h>

#include "common/net.h"

namespace shardps::metrics {
namespace {

using Clock = std::chrono::steady_clock;
// How long the listener is left out of the poll after accept4 ran out of descriptors.
constexpr std::chrono::milliseconds kAcceptPause{100};
// After a response: how long, and how many unread bytes, to drain before closing.
constexpr std::chrono::milliseconds kLingerTime{1000};
constexpr size_t kMaxDrainBytes = 1u << 20;

std::string Response(int code, const char* reason, const std::string& content_type,
                     const std::string& body, const char* extra_header = "") {
  std::string r = "HTTP/1.1 " + std::to_string(code) + " " + reason + "\r\n";
  r += "Content-Type: " + content_type + "\r\n";
  r += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  r += extra_header;
  r += "Connection: close\r\n\r\n";
  r += body;
  return r;
}

Status WriteAddressFile(const std::string& path, const std::string& address) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return ErrnoError("metrics address file " + tmp, errno);
  const bool ok = std::fprintf(f, "%s\n", address.c_str()) > 0;
  if (std::fclose(f) != 0 || !ok) return ErrnoError("metrics address file " + tmp, errno);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return ErrnoError("metrics address file " + path, errno);
  }
  return Status::OK();
}

}  // namespace

std::string ExpandPid(const std::string& path) {
  std::string out;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '%' && i + 1 < path.size() && path[i + 1] == 'p') {
      out += std::to_string(getpid());
      ++i;
    } else {
      out += path[i];
    }
  }
  return out;
}

struct MetricsHttpServer::Conn {
  UniqueFd fd;
  std::string in;
  std::string out;
  size_t sent = 0;
  bool responding = false;
  // Response sent and our side shut down: unread request bytes are drained (up to a bound)
  // before closing, so that the kernel does not reset the connection under the response.
  bool lingering = false;
  size_t drained = 0;
  Clock::time_point accepted;
  Clock::time_point deadline;
};

MetricsHttpServer::MetricsHttpServer(const HttpServerOptions& options, RenderFn render)
    : options_(options), render_(std::move(render)) {}

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const HttpServerOptions& options, RenderFn render) {
  if (options.port < 0 || options.port > 65535) {
    return InvalidArgumentError("metrics port " + std::to_string(options.port) +
                                " is out of 0..65535");
  }
  if (options.host.empty()) return InvalidArgumentError("metrics: empty listen host");
  if (options.max_connections < 1 || options.max_request_bytes < 64) {
    return InvalidArgumentError("metrics: max_connections >= 1, max_request_bytes >= 64");
  }
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer(options, std::move(render)));
  const std::string listen = (options.host.find(':') != std::string::npos
                                  ? "[" + options.host + "]"
                                  : options.host) +
                             ":" + std::to_string(options.port);
  auto fd = net::ListenTcp(listen, &s->address_, 64);
  if (!fd.ok()) return fd.status().WithContext("metrics endpoint " + listen);
  s->listen_fd_ = std::move(*fd);
  RETURN_IF_ERROR(net::SetNonBlocking(s->listen_fd_.get(), true));
  auto hp = net::ParseHostPort(s->address_);
  if (hp.ok()) s->port_ = hp->port;
  s->wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->wake_fd_.valid()) return ErrnoError("metrics: eventfd", errno);
  if (!options.address_file.empty()) {
    RETURN_IF_ERROR(WriteAddressFile(ExpandPid(options.address_file), s->address_));
  }
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  LOG(INFO) << "metrics: serving Prometheus text at http://" << s->address_ << "/metrics";
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (write(wake_fd_.get(), &one, sizeof(one)) < 0) PLOG(WARNING) << "metrics: eventfd write";
    thread_.join();
  }
}

MetricsHttpServer::Stats MetricsHttpServer::stats() const {
  Stats s;
  s.scrapes = scrapes_.load();
  s.errors_sent = errors_sent_.load();
  s.timed_out = timed_out_.load();
  s.evicted = evicted_.load();
  return s;
}

void MetricsHttpServer::Loop() {
  std::list<Conn> conns;  // oldest first
  std::vector<pollfd> pfds;
  std::vector<std::list<Conn>::iterator> order;
  std::string cached;  // the last rendering, and when it was made
  Clock::time_point cached_at;
  const auto respond = [&](Conn& c, std::string text, bool ok) {
    c.out = std::move(text);
    c.sent = 0;
    c.responding = true;
    c.deadline = Clock::now() + options_.request_timeout;
    (ok ? scrapes_ : errors_sent_).fetch_add(1, std::memory_order_relaxed);
  };
  // Looks at the request head received so far; responds once it is complete (or too long).
  const auto parse = [&](Conn& c) {
    size_t end = c.in.find("\r\n\r\n");
    if (end == std::string::npos) end = c.in.find("\n\n");
    if (end == std::string::npos) {
      if (c.in.size() > options_.max_request_bytes) {
        respond(c, Response(431, "Request Header Fields Too Large", "text/plain",
                            "request too large\n"), false);
      }
      return;
    }
    const size_t eol = c.in.find_first_of("\r\n");
    const std::string line = c.in.substr(0, eol);
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
    if (sp1 == std::string::npos || sp2 == std::string::npos ||
        line.compare(sp2 + 1, 5, "HTTP/") != 0) {
      respond(c, Response(400, "Bad Request", "text/plain", "bad request\n"), false);
      return;
    }
    const std::string method = line.substr(0, sp1);
    std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
    if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    if (method != "GET") {
      respond(c, Response(405, "Method Not Allowed", "text/plain", "only GET\n", "Allow: GET\r\n"),
              false);
    } else if (path != "/metrics") {
      respond(c, Response(404, "Not Found", "text/plain", "not found; try /metrics\n"), false);
    } else {
      // Rendered at most every min_render_interval (HttpServerOptions).
      const auto t = Clock::now();
      if (cached_at == Clock::time_point() || t - cached_at >= options_.min_render_interval) {
        cached = render_();
        cached_at = t;
      }
      respond(c, Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", cached), true);
    }
  };

  // After accept4 fails for want of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM) the pending
  // connection stays readable: the listener is left out of the poll until then, or the loop
  // would spin.
  Clock::time_point accept_paused_until;
  for (;;) {
    const auto now = Clock::now();
    // Deadlines. This thread may itself have been descheduled past a deadline (a busy host, or
    // a slow render): what a peer has already sent or can already take is handled before the
    // peer is judged slow, so a scrape never fails for the server's own delay.
    for (Conn& c : conns) {
      if (now < c.deadline || c.lingering) continue;
      if (!c.responding) {
        char buf[4096];
        const size_t room = options_.max_request_bytes + 1 - c.in.size();
        auto got = net::RecvSome(c.fd.get(), buf, std::min(sizeof(buf), room), "metrics");
        if (got.ok() && *got > 0) {
          c.in.append(buf, *got);
          parse(c);  // a complete request: responding, with a fresh deadline
        }
      }
    }
    for (auto it = conns.begin(); it != conns.end();) {
      if (now >= it->deadline) {
        if (!it->lingering) timed_out_.fetch_add(1, std::memory_order_relaxed);
        it = conns.erase(it);
      } else {
        ++it;
      }
    }
    auto next = now + std::chrono::seconds(1);
    pfds.clear();
    order.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    const bool accepting = now >= accept_paused_until;
    pfds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});  // fd -1: ignored by poll
    if (!accepting) next = std::min(next, accept_paused_until);
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      const bool out = it->responding && !it->lingering;
      pfds.push_back({it->fd.get(), static_cast<short>(out ? POLLOUT : POLLIN), 0});
      order.push_back(it);
      next = std::min(next, it->deadline);
    }
    const auto wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    const int n = poll(pfds.data(), pfds.size(), static_cast<int>(std::max<int64_t>(1, wait_ms)));
    if (n < 0) {
      if (errno == EINTR) continue;
      PLOG(ERROR) << "metrics: poll; the endpoint stops";
      return;
    }
    if (pfds[0].revents != 0) return;  // stop
    for (size_t i = 0; i < order.size(); ++i) {
      const short re = pfds[i + 2].revents;
      if (re == 0) continue;
      Conn& c = *order[i];
      if (c.lingering) {
        char sink[4096];
        auto got = net::RecvSome(c.fd.get(), sink, sizeof(sink), "metrics");
        if (!got.ok() || (c.drained += *got) > kMaxDrainBytes) conns.erase(order[i]);
        continue;
      }
      if (c.responding) {
        const ssize_t w = send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) c.sent += static_cast<size_t>(w);
        if ((w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ||
            c.sent == c.out.size()) {
          shutdown(c.fd.get(), SHUT_WR);
          c.lingering = true;
          c.out.clear();
          c.deadline = std::min(c.deadline, Clock::now() + kLingerTime);
        }
        continue;
      }
      // Reading the request head: at most max_request_bytes + 1 bytes are ever kept.
      char buf[4096];
      const size_t room = options_.max_request_bytes + 1 - c.in.size();
      auto got = net::RecvSome(c.fd.get(), buf, std::min(sizeof(buf), room), "metrics");
      if (!got.ok()) {
        conns.erase(order[i]);  // closed or failed before asking anything
        continue;
      }
      c.in.append(buf, *got);
      parse(c);
    }
    if (pfds[1].revents != 0) {
      // Accept everything pending (bounded by the backlog).
      for (int k = 0; k < 64; ++k) {
        const int fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          const int err = errno;
          if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
            if (accept_paused_until <= now) {
              PLOG(WARNING) << "metrics: accept (out of descriptors or memory); not accepting "
                            << "for " << kAcceptPause.count() << " ms";
            }
            accept_paused_until = Clock::now() + kAcceptPause;
          } else if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR && err != ECONNABORTED) {
            PLOG_EVERY_N(WARNING, 100) << "metrics: accept";
          }
          break;
        }
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          // Room for the newcomer: a connection that has had its response, else the oldest
          // one still sending its request (a response in progress is finished instead), else
          // the oldest of all.
          auto victim = std::find_if(conns.begin(), conns.end(),
                                     [](const Conn& c) { return c.lingering; });
          if (victim == conns.end()) {
            victim = std::find_if(conns.begin(), conns.end(),
                                  [](const Conn& c) { return !c.responding; });
          }
          if (victim == conns.end()) victim = conns.begin();
          conns.erase(victim);
          evicted_.fetch_add(1, std::memory_order_relaxed);
        }
        Conn c;
        c.fd.reset(fd);
        c.accepted = Clock::now();
        c.deadline = c.accepted + options_.request_timeout;
        conns.push_back(std::move(c));
      }
    }
  }
}

}  // namespace shardps::metrics
