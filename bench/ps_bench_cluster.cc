// shardps_bench's clusters and measurement loops: the worker team (W threads in this process,
// each with its own shardps::Client, driven one task at a time: throughput rounds, latency
// samples, verification), the cluster processes (one shardps_coordinator, S shardps_server),
// and RunCluster, which measures every point of one cluster against its bound. The flags and the
// report are in ps_bench.cc.
//
// Thread safety: main() drives everything; worker threads each own their Client.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gflags/gflags.h>
#ifdef SHARDPS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "bench/bench_util.h"
#include "bench/ps_bench.h"
#include "shardps/client.h"
#include "tests/integration/child_process.h"

DECLARE_bool(many);
DECLARE_string(memory);

namespace shardps::bench {
namespace {

using std::chrono::milliseconds;
using testing_util::ChildProcess;
using testing_util::WaitForFile;

constexpr char kToken[] = "shardps-bench";

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kPush:
      return "push";
    case Mode::kPull:
      return "pull";
    case Mode::kPushPull:
      return "push-pull";
    case Mode::kStep:
      return "step";
  }
  return "?";
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
  uint64_t pull_other_buffer = 0;
};

class Worker {
 public:
  Worker(const ClusterSpec& spec, std::string coordinator, int rank)
      : spec_(spec), coordinator_(std::move(coordinator)), rank_(rank) {}
  ~Worker() {
    client_.reset();
#ifdef SHARDPS_HAVE_CUDA
    if (cuda_) {
      if (grads_) cudaFree(grads_);
      if (weights_) cudaFree(weights_);
      return;
    }
#endif
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
    cuda_ = FLAGS_memory == "cuda";
    if (cuda_) {
      // Device tensors: the client stages them through pinned host mirrors (tcp, shm) or
      // registers them with the NIC (verbs with GPUDirect); host images for the patterns.
#ifdef SHARDPS_HAVE_CUDA
      for (float** p : {&grads_, &weights_}) {
        if (cudaMalloc(reinterpret_cast<void**>(p), Bytes()) != cudaSuccess) {
          *p = nullptr;
          return ResourceExhaustedError("worker: cudaMalloc of " + std::to_string(Bytes()) +
                                        " bytes failed");
        }
      }
      host_grads_.assign(Bytes(), 0);
      host_weights_.assign(Bytes(), 0);
#else
      return InvalidArgumentError("--memory=cuda needs a build with CUDA");
#endif
    } else {
      for (float** p : {&grads_, &weights_}) {
        void* m =
            mmap(nullptr, Bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return ResourceExhaustedError("worker: cannot map tensor memory");
        *p = static_cast<float*>(m);
        Prefault(m, Bytes());
      }
    }
    const int64_t n = static_cast<int64_t>(spec_.size / sizeof(float));
    for (int k = 0; k < spec_.keys; ++k) {
      names_.push_back("k" + std::to_string(k));
      RETURN_IF_ERROR(SetGradPattern(k, 1000 + k));
      RETURN_IF_ERROR(client_->RegisterTensor(names_[k], Weight(k), Grad(k), {n}));
      if (k == 0) {
        auto path = client_->tensor_path(names_[k]);
        if (path.ok() && rank_ == 0) {
          fprintf(stderr, "# worker tensors: %s memory, path %s\n", cuda_ ? "cuda" : "host",
                  TensorPathName(*path));
        }
      }
    }
    return client_->Start();
  }

  WorkerOut Run(const Task& t, Barrier* start, const std::function<void()>& on_start) {
    WorkerOut out;
    const ClientCounters c0 = client_->counters();
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
    const ClientCounters c1 = client_->counters();
    out.pull_retries = c1.pull_retries - c0.pull_retries;
    out.pull_other_buffer = c1.pull_other_buffer - c0.pull_other_buffer;
    return out;
  }

  Status Close() { return client_ ? client_->Close() : Status::OK(); }

 private:
  size_t Bytes() const { return spec_.size * static_cast<size_t>(spec_.keys); }
  float* Grad(int k) { return grads_ + k * (spec_.size / sizeof(float)); }
  float* Weight(int k) { return weights_ + k * (spec_.size / sizeof(float)); }

  // Writes a pattern into key k's gradient (through its host image for device tensors).
  Status SetGradPattern(int k, uint64_t seed) {
    if (!cuda_) {
      FillPattern(Grad(k), spec_.size, seed);
      return Status::OK();
    }
#ifdef SHARDPS_HAVE_CUDA
    char* h = host_grads_.data() + static_cast<size_t>(k) * spec_.size;
    FillPattern(h, spec_.size, seed);
    if (cudaMemcpy(Grad(k), h, spec_.size, cudaMemcpyHostToDevice) != cudaSuccess) {
      return InternalError("worker: cudaMemcpy of a gradient pattern failed");
    }
#endif
    return Status::OK();
  }
  // The first byte where key k's pulled weights differ from its gradient pattern, or -1.
  StatusOr<int64_t> WeightMismatch(int k) {
    if (!cuda_) return FirstMismatch(Weight(k), Grad(k), spec_.size);
#ifdef SHARDPS_HAVE_CUDA
    char* h = host_weights_.data() + static_cast<size_t>(k) * spec_.size;
    if (cudaMemcpy(h, Weight(k), spec_.size, cudaMemcpyDeviceToHost) != cudaSuccess) {
      return InternalError("worker: cudaMemcpy of pulled weights failed");
    }
    return FirstMismatch(h, host_grads_.data() + static_cast<size_t>(k) * spec_.size, spec_.size);
#else
    return int64_t{-1};
#endif
  }

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
    if (m == Mode::kStep) return client_->Step();
    if (!FLAGS_many) {
      for (int k = 0; k < spec_.keys; ++k) RETURN_IF_ERROR(Issue(m, k, hs));
      return WaitAll(hs);
    }
    if (m != Mode::kPull) {
      ASSIGN_OR_RETURN(std::vector<Handle> p, client_->PushMany(names_));
      hs->insert(hs->end(), p.begin(), p.end());
    }
    if (m != Mode::kPush) {
      ASSIGN_OR_RETURN(std::vector<Handle> p, client_->PullMany(names_));
      hs->insert(hs->end(), p.begin(), p.end());
    }
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
    } while (NowSeconds() - t0 < t.seconds ||
             out->rounds < static_cast<uint64_t>(FLAGS_min_rounds));
    out->elapsed = NowSeconds() - t0;
    out->requests = out->rounds * spec_.keys;
    const double per_key = static_cast<double>(spec_.size);
    out->bytes_pslite = per_key * out->requests;
    out->bytes = out->bytes_pslite * (t.mode == Mode::kPushPull || t.mode == Mode::kStep ? 2 : 1);
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
    out->bytes = out->bytes_pslite * (t.mode == Mode::kPushPull || t.mode == Mode::kStep ? 2 : 1);
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
      RETURN_IF_ERROR(SetGradPattern(k, (r << 32) ^ (static_cast<uint64_t>(k) << 8) ^ rank_));
      RETURN_IF_ERROR(Issue(Mode::kPush, k, &hs));
    }
    RETURN_IF_ERROR(WaitAll(&hs));
    const double deadline = NowSeconds() + 20;
    for (int k : mine) {
      double repush_at = NowSeconds() + 0.1;
      while (true) {
        RETURN_IF_ERROR(Issue(Mode::kPull, k, &hs));
        RETURN_IF_ERROR(WaitAll(&hs));
        ASSIGN_OR_RETURN(const int64_t bad, WeightMismatch(k));
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
  bool cuda_ = false;                          // --memory=cuda: grads_/weights_ are device memory
  std::vector<char> host_grads_, host_weights_;  // their host images (patterns, verification)
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
      WorkerOut o =
          t.kind == TaskKind::kQuit ? WorkerOut() : workers_[w]->Run(t, &start_, on_start);
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
    ASSIGN_OR_RETURN(
        auto coord,
        ChildProcess::Spawn(
            {FLAGS_coordinator_bin, "--listen=127.0.0.1:0", "--address_file=" + addr_file,
             std::string("--cluster_token=") + kToken, "--consistency=" + FLAGS_consistency,
             "--num_servers=" + std::to_string(spec.servers),
             "--num_workers=" + std::to_string(spec.workers), "--data_transport=" + spec.transport,
             "--replicas=" + std::to_string(spec.replicas),
             "--partition_bytes=" + std::to_string(std::max<size_t>(spec.size, 4u << 20))},
            dir + "/coordinator.log", std::chrono::seconds(3600)));
    ASSIGN_OR_RETURN(std::string addr, WaitForFile(addr_file, milliseconds(10000), coord.get()));
    addr.erase(addr.find_last_not_of("\n ") + 1);
    c->address_ = addr;
    c->children_.push_back(std::move(coord));
    for (int s = 0; s < spec.servers * spec.replicas; ++s) {
      ASSIGN_OR_RETURN(
          auto srv,
          ChildProcess::Spawn(
              {FLAGS_server_bin, "--coordinator=" + addr, std::string("--cluster_token=") + kToken,
               "--transport=" + spec.transport, "--bind_ip=" + FLAGS_server_bind_ip,
               "--rank=" + std::to_string(s), "--optimizer=" + FLAGS_optimizer,
               "--busy_poll_us=" + std::to_string(FLAGS_server_busy_poll_us)},
              dir + "/server" + std::to_string(s) + ".log", std::chrono::seconds(3600)));
      c->server_pids_.push_back(ProgramPid(srv->pid()));
      c->children_.push_back(std::move(srv));
    }
    return c;
  }
  ~Cluster() {
    for (auto it = children_.rbegin(); it != children_.rend(); ++it) (*it)->Kill();
  }
  const std::string& address() const { return address_; }
  ProcCounters ServerCounters() const {
    ProcCounters sum;
    for (pid_t p : server_pids_) {
      ProcCounters c;
      if (ReadProcCounters(p, &c)) sum += c;
    }
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

}  // namespace

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
      if (lat && (!latency_too || mode == Mode::kStep)) continue;
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
      std::vector<double> srv_flt, wrk_flt, srv_csw, wrk_csw;
      for (int rep = 0; rep < FLAGS_reps; ++rep) {
        if (FLAGS_bounds) {
          ASSIGN_OR_RETURN(BoundResult b, bounds->Measure(spec, mode, lat));
          r.bound_name = b.name;
          bgb.push_back(b.gbps);
          bp50.push_back(b.lat_p50);
        }
        ProcCounters srv0, wrk0;
        Task t;
        t.kind = lat ? TaskKind::kLatency : TaskKind::kThroughput;
        t.mode = mode;
        t.seconds = lat ? FLAGS_lat_seconds : FLAGS_seconds;
        std::vector<WorkerOut> outs = team.Run(t, [&] {
          srv0 = cluster->ServerCounters();
          wrk0 = SelfCounters();
        });
        const ProcCounters srv = cluster->ServerCounters() - srv0;
        const ProcCounters wrk = SelfCounters() - wrk0;
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
          r.pull_other_buffer += o.pull_other_buffer;
        }
        gbps.push_back(g);
        gbps_ps.push_back(gp);
        uspk.push_back(u);
        const double gb = bytes / 1e9;
        cpu.push_back(srv.cpu_s / gb);
        srv_flt.push_back(static_cast<double>(srv.minor_faults + srv.major_faults) / gb);
        wrk_flt.push_back(static_cast<double>(wrk.minor_faults + wrk.major_faults) / gb);
        srv_csw.push_back(static_cast<double>(srv.voluntary_switches + srv.involuntary_switches) / gb);
        wrk_csw.push_back(static_cast<double>(wrk.voluntary_switches + wrk.involuntary_switches) / gb);
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
      r.server_faults_per_gb = Median(srv_flt);
      r.worker_faults_per_gb = Median(wrk_flt);
      r.server_switches_per_gb = Median(srv_csw);
      r.worker_switches_per_gb = Median(wrk_csw);
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

}  // namespace shardps::bench
