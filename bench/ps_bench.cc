// shardps_bench: the parameter server end to end, with the real client library and real
// shardps_coordinator / shardps_server processes, next to a bound measured in the same run.
// See docs/benchmarks.md for what every column means; scripts/bench.sh runs the matrix.
//
// Per (transport, layout SxW, value size) it starts a cluster: one shardps_coordinator
// (--consistency=asp), S shardps_server processes (--optimizer=store: a pushed value is kept as
// it is, like ps-lite's benchmark server) and W worker threads in this process, each with its
// own shardps::Client. Every worker registers K = keys_per_server * S tensors ("keys") of the
// value size; with --partition_bytes >= size every key is one chunk, and the shard plan spreads
// equal keys evenly (K/S per server). Both workers use the same keys, as in ps-lite.
//
// Series:
//  * throughput: per round each worker issues all K requests (push: Push(k); pull: Pull(k);
//    push-pull: Push(k) and Pull(k) for every k, all in flight together), then waits for all.
//  * latency: one request in flight (push-pull: one push + one pull), keys rotating over one
//    key per server. Samples are per request; p50 / p99 over them.
// Goodput (ours) = 8 * bytes moved / elapsed, bytes moved = len per push or pull (push-pull
// counts 2 * len per key); ps-lite's convention counts len once per key in push-pull. Summed
// over workers; elapsed is each worker's own timed wall time. us/key = elapsed / (rounds * K),
// mean over workers. Server CPU s/GB = CPU seconds of all server processes during the timed
// part / (bytes moved / 1e9).
//
// Bounds (bench/bounds.h), measured right before each repetition of ours (interleaved):
//  * tcp: raw TCP socket pairs on the same addresses: push = W streams writing (window K,
//    8-byte acks), pull = W streams reading, push-pull = W writing + W reading at once (both
//    directions); latency: raw write ping-pong (N bytes + 8-byte ack) for push, raw read
//    (24-byte request + N bytes) for pull, their sum for push-pull.
//  * shm: single-thread memcpy of N bytes over the same number of distinct buffers as keys.
//  * verbs: perftest (ib_write_bw / ib_read_bw / *_lat) from --bounds_file.
// After the timed series every cluster verifies: each worker pushes a fresh pattern to its
// share of the keys and pulls until the server returns exactly those bytes (verified_bytes).
//
// Thread safety: main() drives everything; worker threads each own their Client.
//
// This file: the flags, the matrix walk and the report (table rows, JSON, --smoke checks).
// ps_bench_cluster.cc starts the clusters and runs the measurement loops; ps_bench_bounds.cc
// measures the bounds; ps_bench.h holds what they share.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "bench/bench_util.h"
#include "bench/ps_bench.h"

DEFINE_string(transports, "tcp,shm", "tcp, shm, verbs (verbs needs --bounds_file)");
DEFINE_string(layouts, "1x1,2x2", "servers x workers");
DEFINE_string(latency_layouts, "1x1", "layouts that also run the latency series");
DEFINE_string(modes, "push,pull,push-pull",
              "push, pull, push-pull, step (Client::Step over all keys; throughput only)");
DEFINE_string(sizes, "4K,64K,1M,4M,16M", "value sizes (bytes per key)");
DEFINE_string(series, "throughput,latency", "throughput (K keys per round), latency (1 in flight)");
DEFINE_bool(many, true,
            "throughput: a round is PushMany / PullMany of all K keys (their posts leave together); "
            "false: Push(k) / Pull(k) one key at a time, as before 2026-11-25");
DEFINE_int32(keys_per_server, 40, "throughput: keys per server per round (ps-lite's default 40)");
DEFINE_string(max_worker_bytes, "3G",
              "cap on one worker's tensor memory (grads + weights); fewer keys when above");
DEFINE_double(seconds, 1.0, "throughput: minimum timed duration per point");
DEFINE_int32(min_rounds, 3, "throughput: minimum timed rounds per point");
DEFINE_double(lat_seconds, 0.5, "latency: minimum timed duration per point");
DEFINE_int32(lat_min_iters, 20, "latency: minimum requests per point");
DEFINE_int32(reps, 3, "repetitions of every (bound, ours) pair; medians are reported");
DEFINE_string(server_bind_ip, "127.0.0.1", "servers' data-path address (verbs: 192.168.77.2)");
DEFINE_string(worker_bind_ip, "127.0.0.1", "workers' data-path address (verbs: 192.168.77.1)");
DEFINE_string(optimizer, "store", "servers' --optimizer (store keeps the pushed value)");
DEFINE_int64(server_busy_poll_us, 300,
             "servers' --busy_poll_us (how long the serving loop polls before it sleeps)");
DEFINE_string(consistency, "asp", "coordinator --consistency");
DEFINE_string(bounds_file, "",
              "bounds from outside (perftest for verbs): 'verbs write|read bw SIZE GBITS' and "
              "'verbs write|read lat SIZE P50_US P99_US' lines");
DEFINE_string(json, "", "write all rows here as JSON");
DEFINE_string(label, "", "free text stored in the JSON meta");
DEFINE_string(memory, "host",
              "workers' tensors: host, or cuda (cudaMalloc; a build with CUDA and a GPU)");
DEFINE_string(work_dir, "", "children's logs (default: a fresh /tmp/shardps_bench.XXXXXX)");
DEFINE_string(coordinator_bin, SHARDPS_COORDINATOR_BIN, "shardps_coordinator binary");
DEFINE_string(server_bin, SHARDPS_SERVER_BIN, "shardps_server binary");
DEFINE_bool(bounds, true, "measure the bounds");
DEFINE_bool(smoke, false,
            "CI smoke: tcp 1x1 + 2x2 and shm 1x1, 4 KiB and 1 MiB, 4 keys per server, short "
            "points; exit 1 unless every row is sane and every cluster verified its bytes");

namespace shardps::bench {
namespace {

StatusOr<Mode> ParseMode(const std::string& s) {
  if (s == "push") return Mode::kPush;
  if (s == "pull") return Mode::kPull;
  if (s == "push-pull" || s == "pushpull") return Mode::kPushPull;
  if (s == "step") return Mode::kStep;
  return InvalidArgumentError("unknown mode '" + s + "'");
}

// ---------------------------------------------------------------- rows

std::string Num(double v, int prec = 4) {
  if (std::isnan(v)) return "null";
  std::ostringstream o;
  o.precision(prec);
  o << v;
  return o.str();
}

std::string RowJson(const Row& r) {
  auto list = [](const std::vector<double>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + Num(v[i]);
    return s + "]";
  };
  std::ostringstream o;
  o << "{\"transport\":\"" << r.transport << "\",\"layout\":\"" << r.layout
    << "\",\"servers\":" << r.servers << ",\"workers\":" << r.workers << ",\"series\":\""
    << r.series << "\",\"mode\":\"" << r.mode << "\",\"size\":" << r.size
    << ",\"keys_per_round\":" << r.keys << ",\"reps\":" << r.reps << ",\"gbps\":" << Num(r.gbps)
    << ",\"gbps_pslite\":" << Num(r.gbps_pslite) << ",\"us_per_key\":" << Num(r.us_per_key)
    << ",\"lat_p50_us\":" << Num(r.p50) << ",\"lat_p99_us\":" << Num(r.p99)
    << ",\"server_cpu_s_per_gb\":" << Num(r.server_cpu_s_per_gb)
    << ",\"server_faults_per_gb\":" << Num(r.server_faults_per_gb)
    << ",\"worker_faults_per_gb\":" << Num(r.worker_faults_per_gb)
    << ",\"server_switches_per_gb\":" << Num(r.server_switches_per_gb)
    << ",\"worker_switches_per_gb\":" << Num(r.worker_switches_per_gb) << ",\"bound\":\"" << r.bound_name
    << "\",\"bound_gbps\":" << Num(r.bound_gbps) << ",\"bound_lat_p50_us\":" << Num(r.bound_p50)
    << ",\"ratio\":" << Num(r.ratio) << ",\"rounds\":" << r.rounds << ",\"requests\":" << r.requests
    << ",\"pull_retries\":" << r.pull_retries << ",\"pull_other_buffer\":" << r.pull_other_buffer
    << ",\"verified_bytes\":" << r.verified_bytes
    << ",\"rep_gbps\":" << list(r.rep_gbps) << ",\"rep_bound_gbps\":" << list(r.rep_bound) << "}";
  return o.str();
}

}  // namespace

void PrintRow(const Row& r) {
  if (r.series == "throughput") {
    printf(
        "%-5s %s %-10s %-9s %7s  %8.3f Gbit/s (ps-lite conv. %8.3f)  %9.1f us/key  "
        "srv %.3f cpu-s/GB flt/GB %.0f+%.0f csw/GB %.0f+%.0f retries %llu other %llu | bound %8.3f  "
        "ratio %.2f  [%s]\n",
        r.transport.c_str(), r.layout.c_str(), r.series.c_str(), r.mode.c_str(),
        SizeName(r.size).c_str(), r.gbps, r.gbps_pslite, r.us_per_key, r.server_cpu_s_per_gb,
        r.server_faults_per_gb, r.worker_faults_per_gb, r.server_switches_per_gb,
        r.worker_switches_per_gb,
        static_cast<unsigned long long>(r.pull_retries),
        static_cast<unsigned long long>(r.pull_other_buffer), r.bound_gbps, r.ratio,
        r.bound_name.c_str());
  } else {
    printf(
        "%-5s %s %-10s %-9s %7s  p50 %9.1f us  p99 %9.1f us  %8.3f Gbit/s  srv %.3f cpu-s/GB "
        "| bound p50 %9.1f us  ratio %.2f  [%s]\n",
        r.transport.c_str(), r.layout.c_str(), r.series.c_str(), r.mode.c_str(),
        SizeName(r.size).c_str(), r.p50, r.p99, r.gbps, r.server_cpu_s_per_gb, r.bound_p50, r.ratio,
        r.bound_name.c_str());
  }
  fflush(stdout);
}

namespace {

// ---------------------------------------------------------------- main loop

// SxW, or SxWr2: S server groups, W workers, every group with a backup server.
StatusOr<std::vector<Layout>> ParseLayouts(const std::string& s) {
  std::vector<Layout> v;
  for (const std::string& l : SplitList(s)) {
    int a = 0, b = 0, r = 1;
    const int n = sscanf(l.c_str(), "%dx%dr%d", &a, &b, &r);
    if (n < 2 || a < 1 || b < 1 || a > 16 || b > 16 || r < 1 || r > 2) {
      return InvalidArgumentError("bad layout '" + l + "' (want SxW or SxWr2, e.g. 2x2r2)");
    }
    v.push_back({a, b, r, l});
  }
  return v;
}

// Sanity of a row for --smoke.
std::string Insane(const Row& r) {
  auto bad = [](double v) { return std::isnan(v) || std::isinf(v) || v <= 0; };
  if (bad(r.gbps) || bad(r.gbps_pslite) || bad(r.us_per_key)) return "goodput or us/key not > 0";
  if (r.gbps > 10000) return "goodput above 10 Tbit/s";
  if (FLAGS_bounds && bad(r.bound_gbps) && bad(r.bound_p50)) return "no bound";
  if (FLAGS_bounds && bad(r.ratio)) return "no ratio";
  if (r.series == "latency" && (bad(r.p50) || r.p99 < r.p50)) return "latency percentiles";
  if (r.verified_bytes == 0) return "no verified bytes";
  return "";
}

int Main() {
  if (FLAGS_memory != "host" && FLAGS_memory != "cuda") {
    fprintf(stderr, "--memory must be host or cuda, not '%s'\n", FLAGS_memory.c_str());
    return 2;
  }
  if (FLAGS_smoke) {
    FLAGS_transports = "tcp,shm";
    FLAGS_layouts = "1x1,2x2";
    FLAGS_sizes = "4K,1M";
    FLAGS_keys_per_server = 4;
    FLAGS_seconds = 0.1;
    FLAGS_min_rounds = 2;
    FLAGS_lat_seconds = 0.05;
    FLAGS_lat_min_iters = 10;
    FLAGS_reps = 1;
  }
  auto layouts = ParseLayouts(FLAGS_layouts);
  auto lat_layouts = ParseLayouts(FLAGS_latency_layouts);
  auto sizes = ParseSizeList(FLAGS_sizes);
  auto max_bytes = ParseSize(FLAGS_max_worker_bytes);
  if (!layouts.ok() || !lat_layouts.ok() || !sizes.ok() || !max_bytes.ok()) {
    fprintf(stderr, "bad --layouts, --latency_layouts, --sizes or --max_worker_bytes\n");
    return 2;
  }
  std::vector<Mode> modes;
  for (const std::string& m : SplitList(FLAGS_modes)) {
    auto mm = ParseMode(m);
    if (!mm.ok()) {
      fprintf(stderr, "%s\n", mm.status().ToString().c_str());
      return 2;
    }
    modes.push_back(*mm);
  }
  const std::vector<std::string> series = SplitList(FLAGS_series);
  std::string dir = FLAGS_work_dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/shardps_bench.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return 1;
    dir = tmpl;
  }
  Bounds bounds;
  Status st = bounds.Init();
  if (!st.ok()) {
    fprintf(stderr, "%s\n", st.ToString().c_str());
    return 2;
  }
  printf(
      "# shardps_bench: goodput = 8 * bytes moved / elapsed (push-pull moves 2 * len per key; "
      "ps-lite's convention counts len once), summed over workers; server optimizer '%s', "
      "servers' busy poll %lld us, consistency '%s'; workers' tensors in %s memory; medians "
      "of %d reps, bound measured before each rep\n",
      FLAGS_optimizer.c_str(), static_cast<long long>(FLAGS_server_busy_poll_us),
      FLAGS_consistency.c_str(), FLAGS_memory.c_str(), FLAGS_reps);
  std::vector<Row> rows;
  std::vector<std::string> failures;
  const double t_start = NowSeconds();
  for (const std::string& tr : SplitList(FLAGS_transports)) {
    for (const Layout& lay : *layouts) {
      if (FLAGS_smoke && tr == "shm" && lay.name != "1x1") continue;
      bool lat_too = false;
      for (const Layout& l : *lat_layouts) lat_too |= l.name == lay.name;
      for (size_t size : *sizes) {
        ClusterSpec spec;
        spec.transport = tr;
        spec.servers = lay.servers;
        spec.workers = lay.workers;
        spec.replicas = lay.replicas;
        spec.size = size;
        int kps = FLAGS_keys_per_server;
        while (kps > 1 && 2.0 * size * kps * lay.servers > static_cast<double>(*max_bytes)) --kps;
        spec.keys = kps * lay.servers;
        Status s = RunCluster(spec, lay, modes, series, lat_too, &bounds,
                              dir + "/" + tr + "-" + lay.name + "-" + std::to_string(size), &rows);
        if (!s.ok()) {
          const std::string f = tr + " " + lay.name + " " + SizeName(size) + ": " + s.ToString();
          fprintf(stderr, "FAILED %s\n", f.c_str());
          failures.push_back(f);
        }
      }
    }
  }
  if (!FLAGS_json.empty()) {
    std::ofstream f(FLAGS_json);
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    f << "{\"meta\":{\"tool\":\"shardps_bench\",\"host\":\"" << host
      << "\",\"nproc\":" << std::thread::hardware_concurrency() << ",\"label\":\"" << FLAGS_label
      << "\",\"memory\":\"" << FLAGS_memory << "\",\"optimizer\":\"" << FLAGS_optimizer
      << "\",\"consistency\":\"" << FLAGS_consistency
      << "\",\"reps\":" << FLAGS_reps << ",\"seconds\":" << FLAGS_seconds
      << ",\"lat_seconds\":" << FLAGS_lat_seconds
      << ",\"keys_per_server\":" << FLAGS_keys_per_server
      << ",\"wall_s\":" << Num(NowSeconds() - t_start) << ",\"failures\":" << failures.size()
      << "},\n\"rows\":[\n";
    for (size_t i = 0; i < rows.size(); ++i) f << (i ? ",\n" : "") << RowJson(rows[i]);
    f << "\n]}\n";
  }
  // Replication cost: goodput with a backup per group / without, same run, same point.
  for (const Row& r2 : rows) {
    const auto rpos = r2.layout.find('r');
    if (rpos == std::string::npos || r2.series != "throughput") continue;
    for (const Row& r1 : rows) {
      if (r1.layout == r2.layout.substr(0, rpos) && r1.transport == r2.transport &&
          r1.series == r2.series && r1.mode == r2.mode && r1.size == r2.size) {
        printf(
            "replication cost: %s %s %s %s: goodput with a backup %.3f Gbit/s / without %.3f "
            "Gbit/s = %.2f\n",
            r2.transport.c_str(), r1.layout.c_str(), r2.mode.c_str(), SizeName(r2.size).c_str(),
            r2.gbps, r1.gbps, r1.gbps > 0 ? r2.gbps / r1.gbps : 0.0);
      }
    }
  }
  int rc = failures.empty() ? 0 : 1;
  if (FLAGS_smoke) {
    for (const Row& r : rows) {
      const std::string why = Insane(r);
      if (!why.empty()) {
        fprintf(stderr, "SMOKE: insane row %s %s %s %s %s: %s\n", r.transport.c_str(),
                r.layout.c_str(), r.series.c_str(), r.mode.c_str(), SizeName(r.size).c_str(),
                why.c_str());
        rc = 1;
      }
    }
    if (rows.empty()) rc = 1;
    printf("smoke: %zu rows, %zu failures, %s\n", rows.size(), failures.size(),
           rc == 0 ? "OK" : "FAILED");
  }
  for (const std::string& f : failures) fprintf(stderr, "failed: %s\n", f.c_str());
  return rc;
}

}  // namespace
}  // namespace shardps::bench

int main(int argc, char** argv) {
  gflags::SetUsageMessage("shardps_bench [--transports=tcp,shm] [--layouts=1x1,2x2] [--smoke]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 2;  // INFO and teardown warnings (coordinator gone) would drown the table
  FLAGS_logtostderr = true;
  signal(SIGPIPE, SIG_IGN);
  return shardps::bench::Main();
}
