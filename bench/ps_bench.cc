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
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "bench/bench_util.h"
#include "bench/bounds.h"
#include "shardps/client.h"
#include "tests/integration/child_process.h"

DEFINE_string(transports, "tcp,shm", "tcp, shm, verbs (verbs needs --bounds_file)");
DEFINE_string(layouts, "1x1,2x2", "servers x workers");
DEFINE_string(latency_layouts, "1x1", "layouts that also run the latency series");
DEFINE_string(modes, "push,pull,push-pull", "push, pull, push-pull");
DEFINE_string(sizes, "4K,64K,1M,4M,16M", "value sizes (bytes per key)");
DEFINE_string(series, "throughput,latency", "throughput (K keys per round), latency (1 in flight)");
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
DEFINE_string(consistency, "asp", "coordinator --consistency");
DEFINE_string(bounds_file, "",
              "bounds from outside (perftest for verbs): 'verbs write|read bw SIZE GBITS' and "
              "'verbs write|read lat SIZE P50_US P99_US' lines");
DEFINE_string(json, "", "write all rows here as JSON");
DEFINE_string(label, "", "free text stored in the JSON meta");
DEFINE_string(work_dir, "", "children's logs (default: a fresh /tmp/shardps_bench.XXXXXX)");
DEFINE_string(coordinator_bin, SHARDPS_COORDINATOR_BIN, "shardps_coordinator binary");
DEFINE_string(server_bin, SHARDPS_SERVER_BIN, "shardps_server binary");
DEFINE_bool(bounds, true, "measure the bounds");
DEFINE_bool(smoke, false,
            "CI smoke: tcp 1x1 + 2x2 and shm 1x1, 4 KiB and 1 MiB, 4 keys per server, short "
            "points; exit 1 unless every row is sane and every cluster verified its bytes");

namespace shardps::bench {
namespace {

using testing_util::ChildProcess;
using testing_util::WaitForFile;
using std::chrono::milliseconds;

constexpr char kToken[] = "shardps-bench";

enum class Mode { kPush, kPull, kPushPull };
const char* ModeName(Mode m) {
  return m == Mode::kPush ? "push" : m == Mode::kPull ? "pull" : "push-pull";
}
StatusOr<Mode> ParseMode(const std::string& s) {
  if (s == "push") return Mode::kPush;
  if (s == "pull") return Mode::kPull;
  if (s == "push-pull" || s == "pushpull") return Mode::kPushPull;
  return InvalidArgumentError("unknown mode '" + s + "'");
}

double Median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// ---------------------------------------------------------------- worker team

// A cyclic barrier for n threads; the last to arrive runs `on_last` before releasing the others.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Arrive(const std::function<void()>& on_last = nullptr) {
    std::unique_lock<std::mutex> l(mu_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      if (on_last) on_last();
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return gen_ != gen; });
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
  uint64_t gen_ = 0;
};

enum class TaskKind { kThroughput, kLatency, kVerify, kQuit };
struct Task {
  TaskKind kind = TaskKind::kQuit;
  Mode mode = Mode::kPush;
  double seconds = 0;
};
struct WorkerOut {
  Status status;
  double elapsed = 0;
  uint64_t rounds = 0;
  uint64_t requests = 0;  // keys pushed and/or pulled, per key once
  double bytes = 0;       // our convention: push-pull counts both directions
  double bytes_pslite = 0;
  std::vector<double> lat_us;
  uint64_t verified_bytes = 0;
  uint64_t pull_retries = 0;
};

struct ClusterSpec {
  std::string transport;
  int servers = 1;
  int workers = 1;
  int replicas = 1;  // 2: every server group has a backup server (replication cost)
  size_t size = 0;
  int keys = 0;  // per worker: keys_per_server * servers (possibly capped)
};

class Worker {
 public:
  Worker(const ClusterSpec& spec, std::string coordinator, int rank)
      : spec_(spec), coordinator_(std::move(coordinator)), rank_(rank) {}
  ~Worker() {
    client_.reset();
    if (grads_) munmap(grads_, Bytes());
    if (weights_) munmap(weights_, Bytes());
  }

  Status Setup() {
    ClientOptions o;
    o.coordinator = coordinator_;
    o.cluster_token = kToken;
    o.requested_rank = rank_;
    o.transport = spec_.transport;
    o.bind_ip = FLAGS_worker_bind_ip;
    o.setup_timeout = milliseconds(60000);
    o.wait_timeout = milliseconds(30000);
    ASSIGN_OR_RETURN(client_, Client::Connect(o));
    for (float** p : {&grads_, &weights_}) {
      void* m = mmap(nullptr, Bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) return ResourceExhaustedError("worker: cannot map tensor memory");
      *p = static_cast<float*>(m);
      Prefault(m, Bytes());
    }
    const int64_t n = static_cast<int64_t>(spec_.size / sizeof(float));
    for (int k = 0; k < spec_.keys; ++k) {
      names_.push_back("k" + std::to_string(k));
      FillPattern(Grad(k), spec_.size, 1000 + k);
      RETURN_IF_ERROR(client_->RegisterTensor(names_[k], Weight(k), Grad(k), {n}));
    }
    return client_->Start();
  }

  WorkerOut Run(const Task& t, Barrier* start, const std::function<void()>& on_start) {
    WorkerOut out;
    const uint64_t retries0 = client_->counters().pull_retries;
    switch (t.kind) {
      case TaskKind::kThroughput:
        out.status = Throughput(t, start, on_start, &out);
        break;
      case TaskKind::kLatency:
        out.status = Latency(t, start, on_start, &out);
        break;
      case TaskKind::kVerify:
        start->Arrive(on_start);
        out.status = Verify(&out);
        break;
      case TaskKind::kQuit:
        break;
    }
    out.pull_retries = client_->counters().pull_retries - retries0;
    return out;
  }

  Status Close() { return client_ ? client_->Close() : Status::OK(); }

 private:
  size_t Bytes() const { return spec_.size * static_cast<size_t>(spec_.keys); }
  float* Grad(int k) { return grads_ + k * (spec_.size / sizeof(float)); }
  float* Weight(int k) { return weights_ + k * (spec_.size / sizeof(float)); }

  Status Issue(Mode m, int k, std::vector<Handle>* hs) {
    if (m != Mode::kPull) {
      ASSIGN_OR_RETURN(Handle h, client_->Push(names_[k]));
      hs->push_back(h);
    }
    if (m != Mode::kPush) {
      ASSIGN_OR_RETURN(Handle h, client_->Pull(names_[k]));
      hs->push_back(h);
    }
    return Status::OK();
  }
  Status WaitAll(std::vector<Handle>* hs) {
    Status first;
    for (Handle h : *hs) {
      Status s = client_->Wait(h);
      if (first.ok() && !s.ok()) first = s;
    }
    hs->clear();
    return first;
  }
  Status Round(Mode m, std::vector<Handle>* hs) {
    for (int k = 0; k < spec_.keys; ++k) RETURN_IF_ERROR(Issue(m, k, hs));
    return WaitAll(hs);
  }

  Status Throughput(const Task& t, Barrier* start, const std::function<void()>& on_start,
                    WorkerOut* out) {
    std::vector<Handle> hs;
    hs.reserve(2 * spec_.keys);
    Status warm = Round(t.mode, &hs);  // warm-up, untimed
    start->Arrive(on_start);
    RETURN_IF_ERROR(warm);
    const double t0 = NowSeconds();
    do {
      RETURN_IF_ERROR(Round(t.mode, &hs));
      ++out->rounds;
    } while (NowSeconds() - t0 < t.seconds || out->rounds < static_cast<uint64_t>(FLAGS_min_rounds));
    out->elapsed = NowSeconds() - t0;
    out->requests = out->rounds * spec_.keys;
    const double per_key = static_cast<double>(spec_.size);
    out->bytes_pslite = per_key * out->requests;
    out->bytes = out->bytes_pslite * (t.mode == Mode::kPushPull ? 2 : 1);
    return Status::OK();
  }

  Status Latency(const Task& t, Barrier* start, const std::function<void()>& on_start,
                 WorkerOut* out) {
    std::vector<Handle> hs;
    const int rotate = std::min(spec_.servers, spec_.keys);  // one key per server
    for (int i = 0; i < 5; ++i) {
      RETURN_IF_ERROR(Issue(t.mode, i % rotate, &hs));
      RETURN_IF_ERROR(WaitAll(&hs));
    }
    start->Arrive(on_start);
    const double t0 = NowSeconds();
    for (int i = 0;; ++i) {
      if (i >= FLAGS_lat_min_iters && NowSeconds() - t0 >= t.seconds) break;
      const double s = NowSeconds();
      RETURN_IF_ERROR(Issue(t.mode, i % rotate, &hs));
      RETURN_IF_ERROR(WaitAll(&hs));
      out->lat_us.push_back((NowSeconds() - s) * 1e6);
    }
    out->elapsed = NowSeconds() - t0;
    out->requests = out->lat_us.size();
    out->bytes_pslite = static_cast<double>(spec_.size) * out->requests;
    out->bytes = out->bytes_pslite * (t.mode == Mode::kPushPull ? 2 : 1);
    return Status::OK();
  }

  // Pushes a fresh pattern to keys k with k % W == rank, then pulls until the server returns
  // exactly those bytes (ASP: the apply is asynchronous, so a pull may still see the old value).
  Status Verify(WorkerOut* out) {
    static std::atomic<uint64_t> round{0};
    const uint64_t r = ++round;
    std::vector<Handle> hs;
    std::vector<int> mine;
    for (int k = rank_; k < spec_.keys; k += spec_.workers) mine.push_back(k);
    for (int k : mine) {
      FillPattern(Grad(k), spec_.size, (r << 32) ^ (static_cast<uint64_t>(k) << 8) ^ rank_);
      RETURN_IF_ERROR(Issue(Mode::kPush, k, &hs));
    }
    RETURN_IF_ERROR(WaitAll(&hs));
    const double deadline = NowSeconds() + 20;
    for (int k : mine) {
      double repush_at = NowSeconds() + 0.1;
      while (true) {
        RETURN_IF_ERROR(Issue(Mode::kPull, k, &hs));
        RETURN_IF_ERROR(WaitAll(&hs));
        const int64_t bad = FirstMismatch(Weight(k), Grad(k), spec_.size);
        if (bad < 0) break;
        // The keys are shared: another worker's push of this key from the timed series may
        // still have been queued on the server (ASP applies in arrival order per key, and
        // arrival order across workers is not send order). Push the pattern again: once no
        // other push is in flight, the last one applied is ours.
        if (NowSeconds() > repush_at) {
          RETURN_IF_ERROR(Issue(Mode::kPush, k, &hs));
          RETURN_IF_ERROR(WaitAll(&hs));
          repush_at = NowSeconds() + 0.1;
        }
        if (NowSeconds() > deadline) {
          return DataLossError("worker " + std::to_string(rank_) + ": key " + names_[k] +
                               " pulled back differs from the pushed bytes at offset " +
                               std::to_string(bad));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      out->verified_bytes += spec_.size;
    }
    return Status::OK();
  }

  const ClusterSpec spec_;
  const std::string coordinator_;
  const int rank_;
  std::unique_ptr<Client> client_;
  float* grads_ = nullptr;
  float* weights_ = nullptr;
  std::vector<std::string> names_;
};

// W worker threads driven by the main thread, one task at a time.
class Team {
 public:
  Team(const ClusterSpec& spec, const std::string& coordinator)
      : spec_(spec), start_(spec.workers) {
    for (int w = 0; w < spec.workers; ++w) {
      workers_.push_back(std::make_unique<Worker>(spec, coordinator, w));
    }
  }
  ~Team() { Quit(); }

  Status Setup() {
    std::vector<Status> st(workers_.size());
    std::vector<std::thread> ts;
    for (size_t w = 0; w < workers_.size(); ++w) {
      ts.emplace_back([&, w] { st[w] = workers_[w]->Setup(); });
    }
    for (auto& t : ts) t.join();
    for (auto& s : st) RETURN_IF_ERROR(s);
    for (size_t w = 0; w < workers_.size(); ++w) {
      threads_.emplace_back([this, w] { Loop(static_cast<int>(w)); });
    }
    return Status::OK();
  }

  // Runs t on every worker; on_start runs once when all of them are past their warm-up.
  std::vector<WorkerOut> Run(const Task& t, const std::function<void()>& on_start) {
    std::unique_lock<std::mutex> l(mu_);
    task_ = t;
    on_start_ = on_start;
    outs_.assign(workers_.size(), WorkerOut());
    done_ = 0;
    ++gen_;
    cv_.notify_all();
    cv_.wait(l, [&] { return done_ == static_cast<int>(workers_.size()); });
    return outs_;
  }

  void Quit() {
    if (threads_.empty()) return;
    Run(Task{TaskKind::kQuit}, nullptr);
    for (auto& t : threads_) t.join();
    threads_.clear();
    for (auto& w : workers_) w->Close().IgnoreError();
  }

 private:
  void Loop(int w) {
    uint64_t seen = 0;
    while (true) {
      Task t;
      std::function<void()> on_start;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return gen_ != seen; });
        seen = gen_;
        t = task_;
        on_start = on_start_;
      }
      WorkerOut o = t.kind == TaskKind::kQuit ? WorkerOut() : workers_[w]->Run(t, &start_, on_start);
      std::lock_guard<std::mutex> l(mu_);
      outs_[w] = std::move(o);
      ++done_;
      cv_.notify_all();
      if (t.kind == TaskKind::kQuit) return;
    }
  }

  const ClusterSpec spec_;
  Barrier start_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t gen_ = 0;
  Task task_;
  std::function<void()> on_start_;
  std::vector<WorkerOut> outs_;
  int done_ = 0;
};

// ---------------------------------------------------------------- cluster processes

// The program's own pid under ChildProcess's `timeout` wrapper (its only child), else pid.
pid_t ProgramPid(pid_t pid) {
  for (int i = 0; i < 50; ++i) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
    pid_t c = 0;
    if (f >> c && c > 0) return c;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return pid;
}

class Cluster {
 public:
  static StatusOr<std::unique_ptr<Cluster>> Start(const ClusterSpec& spec, const std::string& dir) {
    std::unique_ptr<Cluster> c(new Cluster());
    c->dir_ = dir;
    std::filesystem::create_directories(dir);
    const std::string addr_file = dir + "/coordinator.addr";
    std::filesystem::remove(addr_file);
    ASSIGN_OR_RETURN(auto coord,
                     ChildProcess::Spawn(
                         {FLAGS_coordinator_bin, "--listen=127.0.0.1:0",
                          "--address_file=" + addr_file, std::string("--cluster_token=") + kToken,
                          "--consistency=" + FLAGS_consistency,
                          "--num_servers=" + std::to_string(spec.servers),
                          "--num_workers=" + std::to_string(spec.workers),
                          "--data_transport=" + spec.transport,
                          "--replicas=" + std::to_string(spec.replicas),
                          "--partition_bytes=" +
                              std::to_string(std::max<size_t>(spec.size, 4u << 20))},
                         dir + "/coordinator.log", std::chrono::seconds(3600)));
    ASSIGN_OR_RETURN(std::string addr, WaitForFile(addr_file, milliseconds(10000), coord.get()));
    addr.erase(addr.find_last_not_of("\n ") + 1);
    c->address_ = addr;
    c->children_.push_back(std::move(coord));
    for (int s = 0; s < spec.servers * spec.replicas; ++s) {
      ASSIGN_OR_RETURN(auto srv, ChildProcess::Spawn(
                                     {FLAGS_server_bin, "--coordinator=" + addr,
                                      std::string("--cluster_token=") + kToken,
                                      "--transport=" + spec.transport,
                                      "--bind_ip=" + FLAGS_server_bind_ip,
                                      "--rank=" + std::to_string(s),
                                      "--optimizer=" + FLAGS_optimizer},
                                     dir + "/server" + std::to_string(s) + ".log",
                                     std::chrono::seconds(3600)));
      c->server_pids_.push_back(ProgramPid(srv->pid()));
      c->children_.push_back(std::move(srv));
    }
    return c;
  }
  ~Cluster() {
    for (auto it = children_.rbegin(); it != children_.rend(); ++it) (*it)->Kill();
  }
  const std::string& address() const { return address_; }
  double ServerCpuSeconds() const {
    double sum = 0;
    for (pid_t p : server_pids_) sum += std::max(0.0, ProcessCpuSeconds(p));
    return sum;
  }
  std::string LogTails() const {
    std::string s;
    for (const auto& c : children_) s += "--- " + c->log_path() + ":\n" + c->LogTail(1500);
    return s;
  }

 private:
  Cluster() = default;
  std::string dir_;
  std::string address_;
  std::vector<std::unique_ptr<ChildProcess>> children_;
  std::vector<pid_t> server_pids_;
};

// ---------------------------------------------------------------- bounds


struct BoundResult {
  std::string name;
  double gbps = NAN;     // throughput
  double lat_p50 = NAN;  // latency, us
};

class Bounds {
 public:
  Status Init() {
    ASSIGN_OR_RETURN(external_, LoadExternalBounds(FLAGS_bounds_file));
    return Status::OK();
  }

  // Raw TCP streams: `writers` streams writing and `readers` streams reading at once.
  StatusOr<double> TcpStreams(int writers, int readers, const PointParams& p) {
    const int n = writers + readers;
    RETURN_IF_ERROR(EnsureTcp(n));
    std::vector<BwResult> r(n);
    std::vector<Status> st(n);
    std::vector<std::thread> ts;
    for (int i = 0; i < n; ++i) {
      ts.emplace_back([&, i] {
        st[i] = clients_[i]->Bandwidth(i < writers ? BenchOp::kWrite : BenchOp::kRead, p, &r[i]);
      });
    }
    for (auto& t : ts) t.join();
    double sum = 0;
    for (int i = 0; i < n; ++i) {
      RETURN_IF_ERROR(st[i]);
      sum += r[i].gbps();
    }
    return sum;
  }
  StatusOr<double> TcpLatencyP50(BenchOp op, const PointParams& p) {
    RETURN_IF_ERROR(EnsureTcp(1));
    LatResult r;
    RETURN_IF_ERROR(clients_[0]->Latency(op, p, &r));
    return Percentile(&r.us, 50);
  }

  StatusOr<BoundResult> Measure(const ClusterSpec& spec, Mode mode, bool latency) {
    BoundResult b;
    PointParams p;
    p.size = spec.size;
    p.window = std::max(1, spec.keys);
    const size_t footprint = 256u << 20;
    p.slots = static_cast<int>(std::clamp<size_t>(footprint / spec.size, 1, spec.keys));
    p.seconds = std::max(0.1, FLAGS_seconds * 0.5);
    p.lat_seconds = std::max(0.1, FLAGS_lat_seconds * 0.5);
    p.lat_min_iters = FLAGS_lat_min_iters;
    const int W = spec.workers;
    if (spec.transport == "tcp") {
      if (latency) {
        double us = 0;
        if (mode != Mode::kPull) {
          ASSIGN_OR_RETURN(double w, TcpLatencyP50(BenchOp::kWrite, p));
          us += w;
        }
        if (mode != Mode::kPush) {
          ASSIGN_OR_RETURN(double r, TcpLatencyP50(BenchOp::kRead, p));
          us += r;
        }
        b.lat_p50 = us;
        b.name = mode == Mode::kPush ? "raw TCP write+ack ping-pong"
                 : mode == Mode::kPull ? "raw TCP read round trip"
                                       : "raw TCP write ping-pong + read round trip";
      } else {
        const int wr = mode == Mode::kPull ? 0 : W;
        const int rd = mode == Mode::kPush ? 0 : W;
        ASSIGN_OR_RETURN(b.gbps, TcpStreams(wr, rd, p));
        b.name = "raw TCP, " + std::to_string(wr) + " writing + " + std::to_string(rd) +
                 " reading stream(s)";
      }
    } else if (spec.transport == "shm") {
      if (latency) {
        LatResult r;
        RETURN_IF_ERROR(MemcpyLatency(p, &r));
        b.lat_p50 = Percentile(&r.us, 50) * (mode == Mode::kPushPull ? 2 : 1);
        b.name = mode == Mode::kPushPull ? "2 x memcpy" : "memcpy";
      } else {
        BwResult r;
        RETURN_IF_ERROR(MemcpyBandwidth(p, &r));
        b.gbps = r.gbps();
        b.name = "memcpy, 1 thread";
      }
    } else if (spec.transport == "verbs") {
      auto get = [&](const char* op, const char* kind) {
        auto it = external_.find({"verbs", op, kind, spec.size});
        return it == external_.end() ? std::pair<double, double>{NAN, NAN} : it->second;
      };
      if (latency) {
        double us = 0;
        if (mode != Mode::kPull) us += get("write", "lat").first;
        if (mode != Mode::kPush) us += get("read", "lat").first;
        b.lat_p50 = us;
      } else {
        double g = 0;
        if (mode != Mode::kPull) g += get("write", "bw").first;
        if (mode != Mode::kPush) g += get("read", "bw").first;
        b.gbps = g;
      }
      b.name = "perftest (ib_write/ib_read" + std::string(latency ? "_lat)" : "_bw)");
    }
    return b;
  }

 private:
  Status EnsureTcp(int n) {
    while (static_cast<int>(clients_.size()) < n) {
      ASSIGN_OR_RETURN(auto s, RawTcpServer::Start(FLAGS_server_bind_ip));
      ASSIGN_OR_RETURN(auto c, RawTcpClient::Connect(s->address(), FLAGS_worker_bind_ip));
      servers_.push_back(std::move(s));
      clients_.push_back(std::move(c));
    }
    return Status::OK();
  }

  ExternalBounds external_;
  std::vector<std::unique_ptr<RawTcpServer>> servers_;
  std::vector<std::unique_ptr<RawTcpClient>> clients_;
};

// ---------------------------------------------------------------- rows

struct Row {
  std::string transport, layout, series, mode;
  int servers = 0, workers = 0, keys = 0;
  size_t size = 0;
  int reps = 0;
  double gbps = NAN, gbps_pslite = NAN, us_per_key = NAN, p50 = NAN, p99 = NAN;
  double server_cpu_s_per_gb = NAN;
  double bound_gbps = NAN, bound_p50 = NAN;
  std::string bound_name;
  double ratio = NAN;      // throughput: gbps / bound; latency: p50 / bound p50
  uint64_t rounds = 0, requests = 0, pull_retries = 0;
  uint64_t verified_bytes = 0;
  std::vector<double> rep_gbps, rep_bound;
};

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
    << ",\"bound\":\"" << r.bound_name << "\",\"bound_gbps\":" << Num(r.bound_gbps)
    << ",\"bound_lat_p50_us\":" << Num(r.bound_p50) << ",\"ratio\":" << Num(r.ratio)
    << ",\"rounds\":" << r.rounds << ",\"requests\":" << r.requests
    << ",\"pull_retries\":" << r.pull_retries << ",\"verified_bytes\":" << r.verified_bytes
    << ",\"rep_gbps\":" << list(r.rep_gbps) << ",\"rep_bound_gbps\":" << list(r.rep_bound) << "}";
  return o.str();
}

void PrintRow(const Row& r) {
  if (r.series == "throughput") {
    printf("%-5s %s %-10s %-9s %7s  %8.3f Gbit/s (ps-lite conv. %8.3f)  %9.1f us/key  "
           "srv %.3f cpu-s/GB retries %llu | bound %8.3f  ratio %.2f  [%s]\n",
           r.transport.c_str(), r.layout.c_str(), r.series.c_str(), r.mode.c_str(),
           SizeName(r.size).c_str(), r.gbps, r.gbps_pslite, r.us_per_key, r.server_cpu_s_per_gb,
           static_cast<unsigned long long>(r.pull_retries), r.bound_gbps, r.ratio,
           r.bound_name.c_str());
  } else {
    printf("%-5s %s %-10s %-9s %7s  p50 %9.1f us  p99 %9.1f us  %8.3f Gbit/s  srv %.3f cpu-s/GB "
           "| bound p50 %9.1f us  ratio %.2f  [%s]\n",
           r.transport.c_str(), r.layout.c_str(), r.series.c_str(), r.mode.c_str(),
           SizeName(r.size).c_str(), r.p50, r.p99, r.gbps, r.server_cpu_s_per_gb, r.bound_p50,
           r.ratio, r.bound_name.c_str());
  }
  fflush(stdout);
}

// ---------------------------------------------------------------- main loop

struct Layout {
  int servers, workers, replicas;
  std::string name;
};

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

Status RunCluster(const ClusterSpec& spec, const Layout& lay, const std::vector<Mode>& modes,
                  const std::vector<std::string>& series, bool latency_too, Bounds* bounds,
                  const std::string& dir, std::vector<Row>* rows) {
  ASSIGN_OR_RETURN(auto cluster, Cluster::Start(spec, dir));
  Team team(spec, cluster->address());
  Status st = team.Setup();
  if (!st.ok()) return st.WithContext("cluster setup; logs:\n" + cluster->LogTails());
  std::vector<size_t> first_row;
  for (Mode mode : modes) {
    for (const std::string& s : series) {
      const bool lat = s == "latency";
      if (lat && !latency_too) continue;
      Row r;
      r.transport = spec.transport;
      r.layout = lay.name;
      r.servers = spec.servers;
      r.workers = spec.workers;
      r.series = s;
      r.mode = ModeName(mode);
      r.size = spec.size;
      r.keys = lat ? 1 : spec.keys;
      r.reps = FLAGS_reps;
      std::vector<double> gbps, gbps_ps, uspk, p50, p99, cpu, bgb, bp50;
      for (int rep = 0; rep < FLAGS_reps; ++rep) {
        if (FLAGS_bounds) {
          ASSIGN_OR_RETURN(BoundResult b, bounds->Measure(spec, mode, lat));
          r.bound_name = b.name;
          bgb.push_back(b.gbps);
          bp50.push_back(b.lat_p50);
        }
        double cpu0 = 0;
        Task t;
        t.kind = lat ? TaskKind::kLatency : TaskKind::kThroughput;
        t.mode = mode;
        t.seconds = lat ? FLAGS_lat_seconds : FLAGS_seconds;
        std::vector<WorkerOut> outs =
            team.Run(t, [&] { cpu0 = cluster->ServerCpuSeconds(); });
        const double cpu1 = cluster->ServerCpuSeconds();
        double g = 0, gp = 0, bytes = 0, u = 0;
        std::vector<double> lats;
        for (const WorkerOut& o : outs) {
          if (!o.status.ok()) {
            return o.status.WithContext(std::string(ModeName(mode)) + " " + s + "; logs:\n" +
                                        cluster->LogTails());
          }
          g += 8 * o.bytes / o.elapsed / 1e9;
          gp += 8 * o.bytes_pslite / o.elapsed / 1e9;
          bytes += o.bytes;
          u += o.elapsed * 1e6 / std::max<uint64_t>(1, o.requests) / outs.size();
          lats.insert(lats.end(), o.lat_us.begin(), o.lat_us.end());
          r.rounds += o.rounds;
          r.requests += o.requests;
          r.pull_retries += o.pull_retries;
        }
        gbps.push_back(g);
        gbps_ps.push_back(gp);
        uspk.push_back(u);
        cpu.push_back((cpu1 - cpu0) / (bytes / 1e9));
        if (lat) {
          p50.push_back(Percentile(&lats, 50));
          p99.push_back(Percentile(&lats, 99));
        }
      }
      r.gbps = Median(gbps);
      r.gbps_pslite = Median(gbps_ps);
      r.us_per_key = Median(uspk);
      r.p50 = Median(p50);
      r.p99 = Median(p99);
      r.server_cpu_s_per_gb = Median(cpu);
      r.bound_gbps = Median(bgb);
      r.bound_p50 = Median(bp50);
      r.rep_gbps = gbps;
      r.rep_bound = lat ? bp50 : bgb;
      r.ratio = lat ? r.p50 / r.bound_p50 : r.gbps / r.bound_gbps;
      PrintRow(r);
      rows->push_back(r);
    }
  }
  // Verification: every worker's share of the keys comes back byte for byte.
  std::vector<WorkerOut> outs = team.Run(Task{TaskKind::kVerify}, nullptr);
  uint64_t verified = 0;
  for (const WorkerOut& o : outs) {
    if (!o.status.ok()) return o.status.WithContext("verification");
    verified += o.verified_bytes;
  }
  const uint64_t want = static_cast<uint64_t>(spec.keys) * spec.size;
  if (verified != want) {
    return DataLossError("verified " + std::to_string(verified) + " of " + std::to_string(want) +
                         " bytes");
  }
  for (Row& r : *rows) {
    if (r.transport == spec.transport && r.layout == lay.name && r.size == spec.size) {
      r.verified_bytes = verified;
    }
  }
  printf("%-5s %s %7s  verified %llu bytes (%d keys pushed and pulled back)\n",
         spec.transport.c_str(), lay.name.c_str(), SizeName(spec.size).c_str(),
         static_cast<unsigned long long>(verified), spec.keys);
  team.Quit();
  return Status::OK();
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
  printf("# shardps_bench: goodput = 8 * bytes moved / elapsed (push-pull moves 2 * len per key; "
         "ps-lite's convention counts len once), summed over workers; server optimizer '%s', "
         "consistency '%s'; medians of %d reps, bound measured before each rep\n",
         FLAGS_optimizer.c_str(), FLAGS_consistency.c_str(), FLAGS_reps);
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
    f << "{\"meta\":{\"tool\":\"shardps_bench\",\"host\":\"" << host << "\",\"nproc\":"
      << std::thread::hardware_concurrency() << ",\"label\":\"" << FLAGS_label
      << "\",\"optimizer\":\"" << FLAGS_optimizer << "\",\"consistency\":\"" << FLAGS_consistency
      << "\",\"reps\":" << FLAGS_reps << ",\"seconds\":" << FLAGS_seconds
      << ",\"lat_seconds\":" << FLAGS_lat_seconds << ",\"keys_per_server\":"
      << FLAGS_keys_per_server << ",\"wall_s\":" << Num(NowSeconds() - t_start)
      << ",\"failures\":" << failures.size() << "},\n\"rows\":[\n";
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
        printf("replication cost: %s %s %s %s: goodput with a backup %.3f Gbit/s / without %.3f "
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
