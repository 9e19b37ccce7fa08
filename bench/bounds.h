// The bounds a provider is compared with, measured by this binary in the same run:
//
//  * tcp: a raw TCP socket pair (blocking sockets, TCP_NODELAY) between the initiator process
//    and the target process, on the same addresses as the provider.
//      write bandwidth: the client streams N-byte messages in requests of `batch` messages
//        ([24-byte header | batch × N bytes], one writev), the server reads them straight into
//        its slots (readv) and answers each request with an 8-byte ack; at most `window`
//        messages unacknowledged. batch = window / 4 = the transport loop's signaling
//        interval, so the bound gets one ack where the transport gets one completion;
//      read bandwidth: 24-byte requests for `batch` messages, answered with batch × N bytes
//        (writev from the slots), at most `window` messages outstanding;
//      latency: one message in flight (write = N bytes + 8-byte ack, as tcp_pingpong.c's
//        "push"; read = 24-byte request + N-byte answer).
//  * shm: single-thread glibc memcpy of N bytes in this process, rotating over the same number
//    of source and destination slots as the transport point (so both run equally cache-hot or
//    equally cache-cold); latency = the time of one memcpy.
//  * verbs: perftest figures, supplied by the caller (see --bounds_file).
//
// Thread safety: RawTcpServer runs one serving thread of its own and may be destroyed from any
// thread; RawTcpClient and the memcpy functions belong to the calling thread.
#ifndef SHARDPS_BENCH_BOUNDS_H_
#define SHARDPS_BENCH_BOUNDS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/status.h"

namespace shardps::bench {

enum class BenchOp { kWrite, kRead };
const char* BenchOpName(BenchOp op);

// One measured point's parameters.
struct PointParams {
  size_t size = 0;       // bytes per operation
  int window = 1;        // operations in flight (bandwidth)
  int batch = 0;         // raw TCP: messages per request/ack (0 = window / 4, the signaling
                         // interval of the transport loop)
  int slots = 1;         // distinct source / destination buffers rotated over
  int remote_slots = 0;  // Latency only: > 0, the remote offset rotates over this many slots
                         // instead (a cache-cold remote side beside a hot local one)
  double seconds = 0.3;  // minimum timed duration of a bandwidth point
  double lat_seconds = 0.3;
  int lat_min_iters = 20;
  int lat_max_iters = 100000;
};

struct BwResult {
  double seconds = 0;  // timed wall time, including the final drain
  uint64_t ops = 0;
  double cpu_self = 0;   // CPU seconds of this process during the timed part
  double gbps() const {  // Gbit/s, 1e9
    return seconds > 0 ? 8.0 * static_cast<double>(ops) * bytes_per_op / seconds / 1e9 : 0;
  }
  size_t bytes_per_op = 0;
};

// A bandwidth point: a short warm-up window, then `run_window` timed for p.seconds; fills ops,
// wall seconds, this process's CPU seconds and bytes per op. Shared by every bandwidth runner.
Status TimedBandwidth(const std::function<Status(double seconds, uint64_t* ops)>& run_window,
                      const PointParams& p, BwResult* out);

struct LatResult {
  std::vector<double> us;  // one sample per operation, microseconds
  double seconds = 0;
  double cpu_self = 0;
};

// Serves raw-TCP bound clients, one connection at a time, on its own thread.
class RawTcpServer {
 public:
  static StatusOr<std::unique_ptr<RawTcpServer>> Start(const std::string& bind_ip);
  ~RawTcpServer();
  RawTcpServer(const RawTcpServer&) = delete;
  RawTcpServer& operator=(const RawTcpServer&) = delete;
  std::string address() const { return address_; }  // "ip:port"

 private:
  RawTcpServer() = default;
  void Loop();
  void Serve(int fd);

  UniqueFd listen_fd_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::atomic<int> conn_fd_{-1};
  std::vector<char> buf_;
  std::thread thread_;
};

// The client side of the raw TCP bound. Owned by one thread.
class RawTcpClient {
 public:
  static StatusOr<std::unique_ptr<RawTcpClient>> Connect(const std::string& address,
                                                         const std::string& bind_ip);
  ~RawTcpClient();
  RawTcpClient(const RawTcpClient&) = delete;
  RawTcpClient& operator=(const RawTcpClient&) = delete;

  Status Bandwidth(BenchOp op, const PointParams& p, BwResult* out);
  Status Latency(BenchOp op, const PointParams& p, LatResult* out);

 private:
  RawTcpClient() = default;
  Status RunWindow(BenchOp op, const PointParams& p, double seconds, uint64_t* ops);
  void EnsureBuffer(size_t bytes);

  UniqueFd fd_;
  std::vector<char> buf_;
};

Status MemcpyBandwidth(const PointParams& p, BwResult* out);
Status MemcpyLatency(const PointParams& p, LatResult* out);

// Bounds measured outside the benchmark (perftest on SoftRoCE), keyed by
// (provider, op, kind, size): bw lines carry Gbit/s, lat lines p50 and p99 in µs.
//   file = *( comment | line );  line = provider op ("bw" gbits | "lat" p50 p99) size
//   actual order on a line: provider op kind size value [p99]
using ExternalBounds =
    std::map<std::tuple<std::string, std::string, std::string, size_t>, std::pair<double, double>>;
StatusOr<ExternalBounds> LoadExternalBounds(const std::string& path);

}  // namespace shardps::bench

#endif  // SHARDPS_BENCH_BOUNDS_H_
