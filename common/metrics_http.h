// MetricsHttpServer: a tiny read-only HTTP/1.1 endpoint that answers GET /metrics with the
// Prometheus text format (common/metrics.h) on a thread of its own.
//
// It is for a scraper on a trusted network, hardened against strangers all the same:
//  * binds 127.0.0.1 unless told otherwise; serves nothing but the rendered text;
//  * GET /metrics (a query string is ignored) -> 200, text/plain; version=0.0.4; another path
//    -> 404; another method -> 405; a malformed request line -> 400; a request head over
//    max_request_bytes -> 431; every response closes the connection;
//  * each connection must deliver its request head within request_timeout of being accepted,
//    and take its response within request_timeout of it being ready, or it is closed (a slow or
//    silent client, slowloris, costs at most one slot for that long);
//  * at most max_connections at once: a new connection past that evicts the oldest one still
//    sending its request, so strangers holding connections open cannot lock out a scrape;
//  * one non-blocking event loop: no stranger's byte is waited for while another connection is
//    ready; the render callback runs on this thread, never on a data path.
//
// Thread safety: Start, address(), port(), stats() and the destructor from any one owner
// thread; the render callback runs on the server's own thread (it must be thread-safe with
// respect to whatever it reads).
#ifndef SHARDPS_COMMON_METRICS_HTTP_H_
#define SHARDPS_COMMON_METRICS_HTTP_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/status.h"

namespace shardps::metrics {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // IPv4 / IPv6 literal or a host name; never 0.0.0.0 unless asked
  int port = 0;                    // 0: pick a free port
  // If set, "ip:port\n" of the bound socket is written here once listening (temp file +
  // rename). "%p" in it is replaced by this process's id.
  std::string address_file;
  size_t max_request_bytes = 8192;
  std::chrono::milliseconds request_timeout{3000};
  int max_connections = 16;
  // A rendering is reused for this long: a client looping GETs cannot make the render
  // callback (which takes the daemons' counter locks) run more often. 0: every GET renders.
  std::chrono::milliseconds min_render_interval{250};
};

class MetricsHttpServer {
 public:
  using RenderFn = std::function<std::string()>;
  struct Stats {
    uint64_t scrapes = 0;         // 200 responses
    uint64_t errors_sent = 0;     // 400/404/405/431 responses
    uint64_t timed_out = 0;       // connections closed at their deadline
    uint64_t evicted = 0;         // connections closed to make room
  };

  // Listens and starts the thread. A port that cannot be bound, a bad host or an unwritable
  // address_file is an error (nothing is left running).
  static StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const HttpServerOptions& options,
                                                            RenderFn render);
  ~MetricsHttpServer();  // stops the thread and closes every socket
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  const std::string& address() const { return address_; }  // "ip:port"
  uint16_t port() const { return port_; }
  Stats stats() const;

 private:
  struct Conn;
  MetricsHttpServer(const HttpServerOptions& options, RenderFn render);
  void Loop();

  const HttpServerOptions options_;
  const RenderFn render_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd: the destructor's stop signal
  std::string address_;
  uint16_t port_ = 0;
  std::atomic<uint64_t> scrapes_{0}, errors_sent_{0}, timed_out_{0}, evicted_{0};
  std::thread thread_;  // last: started once everything above exists
};

// "%p" in `path` replaced by the process id.
std::string ExpandPid(const std::string& path);

}  // namespace shardps::metrics

#endif  // SHARDPS_COMMON_METRICS_HTTP_H_
