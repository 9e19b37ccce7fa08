// transport_bench: one-sided write and read bandwidth and latency of each transport provider,
// next to a bound measured by the same binary in the same run (see bench/bounds.h), with
// initiator and target in separate processes. docs/transport-benchmarks.md has the method,
// the formulas and results.
//
//   transport_bench --transport=tcp,shm [--json=out.json]      # target spawned as a child
//   transport_bench --smoke                                    # CI: tiny, checks sanity
//   transport_bench --role=target --transport=verbs --target_bind_ip=192.168.77.2
//   transport_bench --role=initiator --transport=verbs --peer=ADDR --region=HEX ...
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "bench/bench_util.h"
#include "bench/bounds.h"
#include "bench/initiator.h"
#include "bench/target.h"
#include "transport/flags.h"

DECLARE_string(transport);
DECLARE_string(bind_ip);

DEFINE_string(role, "both",
              "both: run the initiator here and spawn the target as a child process; target: "
              "serve a region (prints ADDR/DESC/BOUND/READY); initiator: connect to --peer");
DEFINE_string(peer, "", "initiator: the target's listen address (its ADDR line)");
DEFINE_string(region, "", "initiator: the target's region descriptor in hex (its DESC line)");
DEFINE_string(bound_peer, "", "initiator, tcp: the target's raw TCP bound server (BOUND line)");
DEFINE_string(target_bind_ip, "", "IP the target binds (default: --bind_ip; tcp: 127.0.0.1)");
DEFINE_string(initiator_bind_ip, "",
              "IP the initiator binds as source (default: --bind_ip; tcp: 127.0.0.1)");
DEFINE_string(ops, "write,read", "operations to measure");
DEFINE_string(sizes, "4K,64K,1M,4M,16M", "operation sizes (bandwidth and latency)");
DEFINE_string(lat_sizes, "", "extra sizes measured for latency only (e.g. 8)");
DEFINE_string(lat_max_size, "0",
              "measure latency only for sizes up to this (0: all); a 16 MiB op takes seconds "
              "under SoftRoCE/TCG");
DEFINE_int32(window, 16, "operations in flight for bandwidth");
DEFINE_string(small_window_bytes, "1M",
              "small sizes get more operations in flight: window = max(--window, this / size)");
DEFINE_int32(max_window, 256, "cap on operations in flight");
DEFINE_string(max_inflight_bytes, "256M", "cap on bytes in flight: window <= max(1, this/size)");
DEFINE_string(footprint, "64M",
              "operations rotate over min(window, footprint/size) source and destination slots "
              "(the memcpy bound rotates the same way); 64M > a 32 MiB LLC for 4M and 16M");
DEFINE_double(seconds, 0.3, "minimum timed duration of each bandwidth point");
DEFINE_double(lat_seconds, 0.3, "minimum timed duration of each latency point");
DEFINE_int32(lat_min_iters, 20, "minimum operations per latency point");
DEFINE_int32(lat_max_iters, 100000, "maximum operations per latency point");
DEFINE_int32(reps, 1, "repetitions of every (ours, bound) pair; medians are reported");
DEFINE_bool(unsignaled, true, "selective signaling in the bandwidth loop");
DEFINE_int32(signal_every, 0, "signal one op in this many (0: window/4)");
DEFINE_string(poll, "wait", "wait: CompletionQueue::Wait (sleeps when idle); spin: Poll loop");
DEFINE_bool(bounds, true, "measure the raw TCP / memcpy bounds");
DEFINE_string(bounds_file, "",
              "bounds supplied from outside (perftest for verbs): lines 'PROVIDER OP bw SIZE "
              "GBIT_S' and 'PROVIDER OP lat SIZE P50_US P99_US'");
DEFINE_string(json, "", "write every row as JSON here");
DEFINE_string(label, "", "free text stored in the JSON meta (e.g. 'softroce guest, TCG')");
DEFINE_bool(smoke, false,
            "tiny sizes and times over tcp and shm; exit non-zero unless every row is sane");
DEFINE_double(target_seconds, 900, "target: exit after this long regardless");
DEFINE_bool(target_watch_stdin, true, "target: exit when stdin reaches EOF");
DEFINE_string(region_bytes, "0", "target: region size (0: from --footprint and --sizes)");
DEFINE_bool(target_raw_tcp, false, "target: also serve the raw TCP bound (default: tcp only)");

namespace shardps::bench {
namespace {

using transport::FabricOptions;

struct Row {
  std::string provider, op, kind;  // kind: "bw" or "lat"
  size_t size = 0;
  int window = 1, slots = 1;
  double gbps = NAN, p50 = NAN, p99 = NAN;
  double bound_gbps = NAN, bound_p50 = NAN, bound_p99 = NAN;
  double cpu_ini = NAN, cpu_tgt = NAN;  // CPU cores busy (CPU seconds / wall seconds)
  double bound_cpu_ini = NAN, bound_cpu_tgt = NAN;
  uint64_t ops = 0;
  std::string bound_name;
  bool verified = false;
  double ratio() const {
    if (kind == "bw") return gbps / bound_gbps;  // NaN when no bound
    return bound_p50 / p50;
  }
};

double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}


// Shapes of one (size) point: window and slots, the same for ours and the bound.
struct Shape {
  int window = 1;
  int slots = 1;
};

struct Plan {
  std::vector<BenchOp> ops;
  std::vector<size_t> sizes, lat_sizes;
  size_t lat_max_size = 0;  // 0 = no limit
  size_t small_window_bytes = 0, max_inflight_bytes = 0, footprint = 0;
  Shape ShapeFor(size_t size) const {
    int64_t w = std::max<int64_t>(FLAGS_window, static_cast<int64_t>(small_window_bytes / size));
    w = std::min<int64_t>(w, std::min(FLAGS_max_window, TransportInitiator::kMaxWindow));
    w = std::min<int64_t>(w, std::max<int64_t>(1, max_inflight_bytes / size));
    Shape s;
    s.window = static_cast<int>(std::max<int64_t>(1, w));
    s.slots = static_cast<int>(
        std::clamp<int64_t>(static_cast<int64_t>(footprint / size), 1, s.window));
    return s;
  }
  size_t MaxSize() const {
    size_t m = 8;
    for (size_t s : sizes) m = std::max(m, s);
    for (size_t s : lat_sizes) m = std::max(m, s);
    return m;
  }
  size_t RegionBytes() const {  // the largest slots × size of any point
    size_t m = MaxSize();
    for (size_t s : sizes) m = std::max(m, ShapeFor(s).slots * s);
    return (m + 4095) / 4096 * 4096;
  }
};

StatusOr<Plan> MakePlan() {
  Plan p;
  for (const std::string& op : SplitList(FLAGS_ops)) {
    if (op == "write") {
      p.ops.push_back(BenchOp::kWrite);
    } else if (op == "read") {
      p.ops.push_back(BenchOp::kRead);
    } else {
      return InvalidArgumentError("--ops: unknown operation '" + op + "'");
    }
  }
  ASSIGN_OR_RETURN(p.sizes, ParseSizeList(FLAGS_sizes));
  ASSIGN_OR_RETURN(p.lat_sizes, ParseSizeList(FLAGS_lat_sizes));
  ASSIGN_OR_RETURN(p.small_window_bytes, ParseSize(FLAGS_small_window_bytes));
  ASSIGN_OR_RETURN(p.max_inflight_bytes, ParseSize(FLAGS_max_inflight_bytes));
  ASSIGN_OR_RETURN(p.footprint, ParseSize(FLAGS_footprint));
  ASSIGN_OR_RETURN(p.lat_max_size, ParseSize(FLAGS_lat_max_size));
  for (size_t s : p.sizes) {
    if (s == 0) return InvalidArgumentError("--sizes: zero");
  }
  return p;
}

std::string DefaultIp(const std::string& provider, const std::string& specific) {
  if (!specific.empty()) return specific;
  if (!FLAGS_bind_ip.empty()) return FLAGS_bind_ip;
  return provider == "tcp" ? "127.0.0.1" : "";
}

// Everything measured for one provider: the initiator, its bound, and the target's pid.
class ProviderRun {
 public:
  ProviderRun(std::string provider, const Plan& plan, const ExternalBounds& external,
              pid_t target_pid)
      : provider_(std::move(provider)), plan_(plan), external_(external),
        target_pid_(target_pid) {}

  Status Connect(const std::string& peer, const std::string& region_hex,
                 const std::string& bound_peer) {
    ASSIGN_OR_RETURN(std::string raw, FromHex(region_hex));
    ASSIGN_OR_RETURN(transport::RegionDescriptor remote, transport::RegionDescriptor::Decode(raw));
    InitiatorConfig c;
    c.fabric = transport::FabricOptionsFromFlags();
    c.fabric.provider = provider_;
    c.fabric.bind_ip = DefaultIp(provider_, FLAGS_initiator_bind_ip);
    c.peer_address = peer;
    c.remote = remote;
    c.local_bytes = plan_.RegionBytes();
    c.verify_bytes = plan_.MaxSize();
    c.poll = FLAGS_poll == "spin" ? PollMode::kSpin : PollMode::kWait;
    c.unsignaled = FLAGS_unsignaled;
    c.signal_every = FLAGS_signal_every;
    ASSIGN_OR_RETURN(ini_, TransportInitiator::Connect(c));
    if (FLAGS_bounds && provider_ == "tcp") {
      if (bound_peer.empty()) {
        return InvalidArgumentError("tcp bound: no raw TCP server address (BOUND / --bound_peer)");
      }
      ASSIGN_OR_RETURN(raw_, RawTcpClient::Connect(bound_peer, c.fabric.bind_ip));
    }
    return Status::OK();
  }

  Status Run(std::vector<Row>* rows) {
    for (BenchOp op : plan_.ops) {
      for (size_t size : plan_.sizes) {
        RETURN_IF_ERROR(MeasureBw(op, size, rows));
        if (plan_.lat_max_size == 0 || size <= plan_.lat_max_size) {
          RETURN_IF_ERROR(MeasureLat(op, size, rows));
        }
      }
      for (size_t size : plan_.lat_sizes) RETURN_IF_ERROR(MeasureLat(op, size, rows));
    }
    return Status::OK();
  }

 private:
  PointParams Params(size_t size) const {
    const Shape s = plan_.ShapeFor(size);
    PointParams p;
    p.size = size;
    p.window = s.window;
    p.slots = s.slots;
    // The raw TCP bound acks once per `batch` messages, as the transport signals once per
    // signal interval.
    p.batch = FLAGS_unsignaled ? FLAGS_signal_every : 1;
    p.seconds = FLAGS_seconds;
    p.lat_seconds = FLAGS_lat_seconds;
    p.lat_min_iters = FLAGS_lat_min_iters;
    p.lat_max_iters = FLAGS_lat_max_iters;
    return p;
  }

  const char* BoundName() const {
    if (provider_ == "tcp") return "raw TCP socket pair";
    if (provider_ == "shm") return "single-thread memcpy";
    return "external (--bounds_file)";
  }

  // Runs fn with CPU accounting of the target process; returns its CPU seconds (NaN unknown).
  template <typename Fn>
  StatusOr<double> WithTargetCpu(Fn fn) {
    const double c0 = ProcessCpuSeconds(target_pid_);
    RETURN_IF_ERROR(fn());
    const double c1 = ProcessCpuSeconds(target_pid_);
    return c0 < 0 || c1 < 0 ? NAN : c1 - c0;
  }

  Status MeasureBw(BenchOp op, size_t size, std::vector<Row>* rows) {
    const PointParams p = Params(size);
    Row r = NewRow(op, "bw", p);
    std::vector<double> ours, bound, ci, ct, bci, bct;
    for (int rep = 0; rep < FLAGS_reps; ++rep) {
      if (FLAGS_bounds && (provider_ == "tcp" || provider_ == "shm")) {
        BwResult b;
        ASSIGN_OR_RETURN(double tc, WithTargetCpu([&] {
          return provider_ == "tcp" ? raw_->Bandwidth(op, p, &b) : MemcpyBandwidth(p, &b);
        }));
        bound.push_back(b.gbps());
        bci.push_back(b.cpu_self / b.seconds);
        bct.push_back(tc / b.seconds);
      }
      BwResult o;
      ASSIGN_OR_RETURN(double tc, WithTargetCpu([&] { return ini_->Bandwidth(op, p, &o); }));
      ours.push_back(o.gbps());
      ci.push_back(o.cpu_self / o.seconds);
      ct.push_back(tc / o.seconds);
      r.ops += o.ops;
    }
    RETURN_IF_ERROR(ini_->Verify(size, 1000 + size + static_cast<int>(op)));
    r.verified = true;
    r.gbps = Median(ours);
    r.cpu_ini = Median(ci);
    r.cpu_tgt = Median(ct);
    r.bound_gbps = Median(bound);
    r.bound_cpu_ini = Median(bci);
    r.bound_cpu_tgt = Median(bct);
    auto it = external_.find({provider_, BenchOpName(op), "bw", size});
    if (it != external_.end()) r.bound_gbps = it->second.first;
    Print(r);
    rows->push_back(r);
    return Status::OK();
  }

  Status MeasureLat(BenchOp op, size_t size, std::vector<Row>* rows) {
    PointParams p = Params(size);
    p.window = 1;
    Row r = NewRow(op, "lat", p);
    std::vector<double> p50, p99, bp50, bp99, ci, ct;
    for (int rep = 0; rep < FLAGS_reps; ++rep) {
      if (FLAGS_bounds && (provider_ == "tcp" || provider_ == "shm")) {
        LatResult b;
        RETURN_IF_ERROR(provider_ == "tcp" ? raw_->Latency(op, p, &b) : MemcpyLatency(p, &b));
        bp50.push_back(Percentile(&b.us, 50));
        bp99.push_back(Percentile(&b.us, 99));
      }
      LatResult o;
      ASSIGN_OR_RETURN(double tc, WithTargetCpu([&] { return ini_->Latency(op, p, &o); }));
      p50.push_back(Percentile(&o.us, 50));
      p99.push_back(Percentile(&o.us, 99));
      ci.push_back(o.cpu_self / o.seconds);
      ct.push_back(tc / o.seconds);
      r.ops += o.us.size();
    }
    r.p50 = Median(p50);
    r.p99 = Median(p99);
    r.gbps = 8.0 * static_cast<double>(size) / (r.p50 * 1e-6) / 1e9;
    r.bound_p50 = Median(bp50);
    r.bound_p99 = Median(bp99);
    r.cpu_ini = Median(ci);
    r.cpu_tgt = Median(ct);
    auto it = external_.find({provider_, BenchOpName(op), "lat", size});
    if (it != external_.end()) {
      r.bound_p50 = it->second.first;
      r.bound_p99 = it->second.second;
    }
    if (!std::isnan(r.bound_p50)) r.bound_gbps = 8.0 * size / (r.bound_p50 * 1e-6) / 1e9;
    Print(r);
    rows->push_back(r);
    return Status::OK();
  }

  Row NewRow(BenchOp op, const char* kind, const PointParams& p) const {
    Row r;
    r.provider = provider_;
    r.op = BenchOpName(op);
    r.kind = kind;
    r.size = p.size;
    r.window = p.window;
    r.slots = p.slots;
    r.bound_name = BoundName();
    return r;
  }

  static void Print(const Row& r) {
    LOG(INFO) << r.provider << " " << r.op << " " << r.kind << " " << SizeName(r.size)
              << " w=" << r.window << ": " << r.gbps << " Gbit/s p50=" << r.p50
              << " us, bound " << r.bound_gbps << " Gbit/s p50=" << r.bound_p50
              << " us, ratio " << r.ratio();
  }

  const std::string provider_;
  const Plan& plan_;
  const ExternalBounds& external_;
  const pid_t target_pid_;
  std::unique_ptr<TransportInitiator> ini_;
  std::unique_ptr<RawTcpClient> raw_;
};

// ---- output ----

std::string Num(double v, const char* fmt = "%.3f") {
  if (std::isnan(v) || std::isinf(v)) return "-";
  char b[64];
  snprintf(b, sizeof b, fmt, v);
  return b;
}

std::string JsonNum(double v) {
  if (std::isnan(v) || std::isinf(v)) return "null";
  char b[64];
  snprintf(b, sizeof b, "%.6g", v);
  return b;
}

void PrintTable(const std::vector<Row>& rows) {
  printf("\n%-6s %-5s %-4s %8s %4s | %9s %8s %9s %9s | %9s %9s | %6s | %9s\n", "prov", "op",
         "kind", "size", "win", "Gbit/s", "GB/s", "p50 us", "p99 us", "bnd Gb/s", "bnd p50",
         "ratio", "cpu i/t");
  for (const Row& r : rows) {
    const bool bw = r.kind == "bw";
    printf("%-6s %-5s %-4s %8s %4d | %9s %8s %9s %9s | %9s %9s | %6s | %4s/%-4s\n",
           r.provider.c_str(), r.op.c_str(), r.kind.c_str(), SizeName(r.size).c_str(), r.window,
           Num(r.gbps).c_str(), Num(r.gbps / 8).c_str(), Num(r.p50, "%.1f").c_str(),
           Num(r.p99, "%.1f").c_str(), Num(r.bound_gbps).c_str(),
           Num(r.bound_p50, "%.1f").c_str(), Num(r.ratio(), "%.2f").c_str(),
           Num(r.cpu_ini, "%.2f").c_str(), Num(r.cpu_tgt, "%.2f").c_str());
    (void)bw;
  }
  printf("ratio: bw rows = ours Gbit/s / bound Gbit/s; lat rows = bound p50 / ours p50 "
         "(1.0 = as fast as the bound). cpu i/t = cores busy in initiator / target.\n");
  fflush(stdout);
}

std::string JsonStr(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o.push_back('\\');
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o.push_back(c);
  }
  return o + "\"";
}

Status WriteJson(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream f(path);
  if (!f) return UnavailableError("cannot write " + path);
  utsname u;
  uname(&u);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  char date[64];
  const time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  f << "{\n  \"meta\": {\"date\": " << JsonStr(date) << ", \"host\": " << JsonStr(host)
    << ", \"nproc\": " << sysconf(_SC_NPROCESSORS_ONLN) << ", \"kernel\": " << JsonStr(u.release)
    << ", \"label\": " << JsonStr(FLAGS_label) << ", \"poll\": " << JsonStr(FLAGS_poll)
    << ", \"seconds\": " << FLAGS_seconds << ", \"lat_seconds\": " << FLAGS_lat_seconds
    << ", \"reps\": " << FLAGS_reps << ", \"footprint\": " << JsonStr(FLAGS_footprint)
    << ", \"unsignaled\": " << (FLAGS_unsignaled ? "true" : "false") << "},\n  \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    f << "    {\"provider\": " << JsonStr(r.provider) << ", \"op\": " << JsonStr(r.op)
      << ", \"kind\": " << JsonStr(r.kind) << ", \"size\": " << r.size
      << ", \"window\": " << r.window << ", \"slots\": " << r.slots
      << ", \"gbps\": " << JsonNum(r.gbps) << ", \"GBps\": " << JsonNum(r.gbps / 8)
      << ", \"p50_us\": " << JsonNum(r.p50) << ", \"p99_us\": " << JsonNum(r.p99)
      << ", \"bound\": " << JsonStr(r.bound_name) << ", \"bound_gbps\": "
      << JsonNum(r.bound_gbps) << ", \"bound_p50_us\": " << JsonNum(r.bound_p50)
      << ", \"bound_p99_us\": " << JsonNum(r.bound_p99) << ", \"ratio\": " << JsonNum(r.ratio())
      << ", \"cpu_initiator\": " << JsonNum(r.cpu_ini) << ", \"cpu_target\": "
      << JsonNum(r.cpu_tgt) << ", \"bound_cpu_initiator\": " << JsonNum(r.bound_cpu_ini)
      << ", \"bound_cpu_target\": " << JsonNum(r.bound_cpu_tgt) << ", \"ops\": " << r.ops
      << ", \"verified\": " << (r.kind == "bw" ? (r.verified ? "true" : "false") : "null")
      << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
  return f ? Status::OK() : UnavailableError("write failed: " + path);
}

// Smoke: every row must carry plausible numbers and a bound.
Status CheckSane(const std::vector<Row>& rows, size_t expected) {
  if (rows.size() != expected) {
    return InternalError("smoke: " + std::to_string(rows.size()) + " rows, expected " +
                         std::to_string(expected));
  }
  for (const Row& r : rows) {
    const std::string what = r.provider + " " + r.op + " " + r.kind + " " + SizeName(r.size);
    if (!(r.gbps > 0) || std::isinf(r.gbps)) return InternalError("smoke: bad Gbit/s: " + what);
    if (r.kind == "lat" && !(r.p50 > 0 && r.p50 <= r.p99)) {
      return InternalError("smoke: bad latency percentiles: " + what);
    }
    if (!(r.ratio() > 0) || std::isinf(r.ratio())) return InternalError("smoke: no ratio: " + what);
    if (r.kind == "bw" && !r.verified) return InternalError("smoke: not verified: " + what);
  }
  return Status::OK();
}

// ---- roles ----

std::vector<std::string>* OriginalArgs() {
  static std::vector<std::string> args;
  return &args;
}

int TargetMain(const Plan& plan) {
  TargetConfig c;
  c.fabric = transport::FabricOptionsFromFlags();
  const std::string ip = DefaultIp(c.fabric.provider, FLAGS_target_bind_ip);
  c.fabric.bind_ip = ip;
  c.listen_address = c.fabric.provider == "shm" ? "" : (ip.empty() ? "0.0.0.0" : ip) + ":0";
  auto rb = ParseSize(FLAGS_region_bytes);
  c.region_bytes = rb.ok() && *rb > 0 ? *rb : plan.RegionBytes();
  c.raw_tcp_bound = FLAGS_target_raw_tcp || c.fabric.provider == "tcp";
  c.raw_tcp_bind_ip = ip;
  c.max_seconds = FLAGS_target_seconds;
  c.watch_stdin = FLAGS_target_watch_stdin;
  return RunTarget(c);
}

Status InitiatorMain(const Plan& plan, std::vector<Row>* rows) {
  ASSIGN_OR_RETURN(ExternalBounds external, LoadExternalBounds(FLAGS_bounds_file));
  std::vector<std::string> providers = SplitList(FLAGS_transport);
  if (FLAGS_transport == "auto") providers = {"tcp", "shm"};
  if (FLAGS_role == "initiator") {
    if (providers.size() != 1 || FLAGS_peer.empty() || FLAGS_region.empty()) {
      return InvalidArgumentError("--role=initiator needs one --transport, --peer and --region");
    }
    ProviderRun run(providers[0], plan, external, -1);
    RETURN_IF_ERROR(run.Connect(FLAGS_peer, FLAGS_region, FLAGS_bound_peer));
    return run.Run(rows);
  }
  for (const std::string& provider : providers) {
    std::vector<std::string> args = *OriginalArgs();
    args.push_back("--role=target");
    args.push_back("--transport=" + provider);
    args.push_back("--region_bytes=" + std::to_string(plan.RegionBytes()));
    args.push_back("--json=");
    TargetProcess target;
    Status s = target.Start(args, 120);
    if (!s.ok()) return s.WithContext("starting the " + provider + " target");
    LOG(INFO) << provider << ": target pid " << target.pid() << " at " << target.address();
    ProviderRun run(provider, plan, external, target.pid());
    s = run.Connect(target.address(), target.descriptor_hex(), target.bound_address());
    if (s.ok()) s = run.Run(rows);
    if (!s.ok()) return s.WithContext(provider);
  }
  return Status::OK();
}

void ApplySmokeDefaults() {
  if (FLAGS_transport == "auto") FLAGS_transport = "tcp,shm";
  FLAGS_sizes = "4K,64K";
  FLAGS_lat_sizes = "";
  FLAGS_seconds = 0.05;
  FLAGS_lat_seconds = 0.02;
  FLAGS_lat_min_iters = 5;
  FLAGS_reps = 1;
  FLAGS_footprint = "1M";
}

}  // namespace
}  // namespace shardps::bench

int main(int argc, char** argv) {
  using namespace shardps::bench;
  for (int i = 1; i < argc; ++i) OriginalArgs()->push_back(argv[i]);
  gflags::SetUsageMessage("one-sided write/read bandwidth and latency of transport providers");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (FLAGS_smoke && FLAGS_role != "target") ApplySmokeDefaults();
  auto plan = MakePlan();
  if (!plan.ok()) {
    fprintf(stderr, "transport_bench: %s\n", plan.status().ToString().c_str());
    return 2;
  }
  if (FLAGS_role == "target") return TargetMain(*plan);
  if (FLAGS_role != "both" && FLAGS_role != "initiator") {
    fprintf(stderr, "transport_bench: --role must be both, target or initiator\n");
    return 2;
  }
  if (FLAGS_poll != "wait" && FLAGS_poll != "spin") {
    fprintf(stderr, "transport_bench: --poll must be wait or spin\n");
    return 2;
  }
  std::vector<Row> rows;
  const double t0 = NowSeconds();
  const shardps::Status s = InitiatorMain(*plan, &rows);
  PrintTable(rows);
  printf("total %.1f s\n", NowSeconds() - t0);
  if (!FLAGS_json.empty()) {
    const shardps::Status j = WriteJson(FLAGS_json, rows);
    if (!j.ok()) fprintf(stderr, "transport_bench: %s\n", j.ToString().c_str());
  }
  if (!s.ok()) {
    fprintf(stderr, "transport_bench: FAILED: %s\n", s.ToString().c_str());
    return 1;
  }
  if (FLAGS_smoke) {
    const size_t providers = SplitList(FLAGS_transport).size();
    const size_t expected = providers * plan->ops.size() * plan->sizes.size() * 2;
    const shardps::Status sane = CheckSane(rows, expected);
    if (!sane.ok()) {
      fprintf(stderr, "transport_bench: %s\n", sane.ToString().c_str());
      return 1;
    }
    printf("smoke: OK (%zu rows sane, data verified)\n", rows.size());
  }
  return 0;
}
