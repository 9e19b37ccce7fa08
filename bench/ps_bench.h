// Internal to shardps_bench (bench/ps_bench*.cc): the flags, types and functions its files
// share. ps_bench.cc parses the flags, walks the matrix and reports the rows;
// ps_bench_cluster.cc starts the cluster processes and runs the worker threads' measurement
// loops; ps_bench_bounds.cc measures the bound next to each point. docs/benchmarks.md says what
// every column means.
//
// Thread safety: main() drives everything; worker threads each own their Client.
#ifndef SHARDPS_BENCH_PS_BENCH_H_
#define SHARDPS_BENCH_PS_BENCH_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gflags/gflags.h>

#include "bench/bounds.h"
#include "common/status.h"

// Defined in ps_bench.cc.
DECLARE_int32(min_rounds);
DECLARE_double(seconds);
DECLARE_double(lat_seconds);
DECLARE_int32(lat_min_iters);
DECLARE_int32(reps);
DECLARE_string(server_bind_ip);
DECLARE_string(worker_bind_ip);
DECLARE_string(optimizer);
DECLARE_int64(server_busy_poll_us);
DECLARE_string(consistency);
DECLARE_string(bounds_file);
DECLARE_string(coordinator_bin);
DECLARE_string(server_bin);
DECLARE_bool(bounds);

namespace shardps::bench {

// kStep: a round is one Client::Step() over all K keys (push every key, wait, clock, pull every
// key, wait), the path a trainer's step takes; throughput series only.
enum class Mode { kPush, kPull, kPushPull, kStep };

struct ClusterSpec {
  std::string transport;
  int servers = 1;
  int workers = 1;
  int replicas = 1;  // 2: every server group has a backup server (replication cost)
  size_t size = 0;
  int keys = 0;  // per worker: keys_per_server * servers (possibly capped)
};

struct BoundResult {
  std::string name;
  double gbps = NAN;     // throughput
  double lat_p50 = NAN;  // latency, us
};

// The bound measured right before each repetition of ours (see the top of ps_bench.cc).
// Thread: the main thread only.
class Bounds {
 public:
  Status Init();

  // Raw TCP streams: `writers` streams writing and `readers` streams reading at once.
  StatusOr<double> TcpStreams(int writers, int readers, const PointParams& p);
  StatusOr<double> TcpLatencyP50(BenchOp op, const PointParams& p);

  StatusOr<BoundResult> Measure(const ClusterSpec& spec, Mode mode, bool latency);

 private:
  Status EnsureTcp(int n);

  ExternalBounds external_;
  std::vector<std::unique_ptr<RawTcpServer>> servers_;
  std::vector<std::unique_ptr<RawTcpClient>> clients_;
};

struct Row {
  std::string transport, layout, series, mode;
  int servers = 0, workers = 0, keys = 0;
  size_t size = 0;
  int reps = 0;
  double gbps = NAN, gbps_pslite = NAN, us_per_key = NAN, p50 = NAN, p99 = NAN;
  double server_cpu_s_per_gb = NAN;
  // Page faults (minor + major) and context switches (voluntary + involuntary) per GB moved in
  // the timed window: the server processes summed, and this process (the worker threads).
  double server_faults_per_gb = NAN, worker_faults_per_gb = NAN;
  double server_switches_per_gb = NAN, worker_switches_per_gb = NAN;
  double bound_gbps = NAN, bound_p50 = NAN;
  std::string bound_name;
  double ratio = NAN;  // throughput: gbps / bound; latency: p50 / bound p50
  uint64_t rounds = 0, requests = 0, pull_retries = 0;
  uint64_t pull_other_buffer = 0;  // pulls served from the other buffer read alongside
  uint64_t verified_bytes = 0;
  std::vector<double> rep_gbps, rep_bound;
};

// Prints one row of the table to stdout (ps_bench.cc).
void PrintRow(const Row& r);

struct Layout {
  int servers, workers, replicas;
  std::string name;
};

// Starts the cluster of `spec`, runs every (mode, series) point against its bound, appends the
// rows, then verifies the bytes (ps_bench_cluster.cc).
Status RunCluster(const ClusterSpec& spec, const Layout& lay, const std::vector<Mode>& modes,
                  const std::vector<std::string>& series, bool latency_too, Bounds* bounds,
                  const std::string& dir, std::vector<Row>* rows);

}  // namespace shardps::bench

#endif  // SHARDPS_BENCH_PS_BENCH_H_
