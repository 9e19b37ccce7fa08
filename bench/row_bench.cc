// shardps_row_bench: row tables (embeddings) end to end — real coordinator and server
// processes, the real client — against the bound measured in the same run: ONE contiguous
// one-sided read (pull) or write (push) of the same value bytes (ids x dim x 4) between this
// process and a target process over the same transport, one in flight (as a PullRows batch
// is). docs/benchmarks.md, "Row tables", says what every column means.
//
//   pull  = Client::PullRows of B distinct ids (a chunk header read + the rows, adjacent rows
//           coalesced, each verified by its crc), one batch in flight per worker;
//   push  = AddRowGradients of B ids x dim + Push + Wait (ASP: applied as it lands; the next
//           push of a shard reuses an inbox slot only once the server acknowledged the one
//           before the last).
// Ids per batch are distinct, uniform over the table or Zipf(1.1) over ranks mapped through a
// fixed permutation (hot rows scattered). Per point: rows/s (summed over workers), GB/s of
// values, the bound's rows/s for one stream and ours per worker / it, and the bound at the
// layout's concurrency (one contiguous operation per worker at once, each to its own target
// process: what the transport and this host give W streams together) and ours summed / it.
// Also printed: the servers' resident memory per row (VmRSS after the table and an Adagrad
// state exist) against the row's bytes plus its optimizer state.
//
// Thread safety: main() drives; each worker thread owns its Client.
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "bench/bench_util.h"
#include "bench/bounds.h"
#include "bench/initiator.h"
#include "bench/target.h"
#include "common/row_init.h"
#include "shardps/client.h"
#include "tests/integration/child_process.h"
#include "transport/flags.h"
#include "wire/region_layout.h"

DEFINE_string(role, "main", "main, or target (the bound's peer, started by main)");
DEFINE_string(transports, "tcp", "tcp, shm, verbs");
DEFINE_string(server_ip, "127.0.0.1",
              "servers' and the bound's target's data-path address (verbs: an RDMA device's, "
              "e.g. the SoftRoCE guest's rxe0 192.168.77.2)");
DEFINE_string(worker_ip, "127.0.0.1",
              "workers' and the bound's initiator's data-path address (verbs: e.g. rxe1 "
              "192.168.77.1)");
DEFINE_string(layouts, "1x1,2x2", "servers x workers");
DEFINE_string(ids, "1024,4096,16384,65536", "distinct ids per batch");
DEFINE_string(dims, "16,64,256", "values per row");
DEFINE_string(dists, "uniform,zipf", "id distributions");
DEFINE_string(ops, "pull,push", "operations measured (pull, push)");
DEFINE_string(tables, "dense", "dense (ids < rows), hashed (64-bit keys; --rows is the capacity)");
DEFINE_int64(rows, 1000000, "table rows");
DEFINE_double(seconds, 1.0, "timed duration of each point (at least 3 batches)");
DEFINE_string(json, "", "write every point as JSON lines here");
DEFINE_string(work_dir, "/tmp/shardps-row-bench", "cluster logs");
DEFINE_bool(smoke, false, "a tiny matrix (CI): 20k rows, dims 16, ids 256 and 1024, 1x1");
DEFINE_int64(region_bytes, 0, "target: its region's bytes");
DEFINE_int64(batch_ids, int64_t{1} << 22,
             "distinct batches per point and worker: this many ids over the batch size (4 to "
             "256 batches; the defaults: 256 batches of 4,096 ids touch 300 MB of a 1 M x 64 "
             "table, more than any cache, as a real step's new ids do)");
DEFINE_int32(rounds, 1,
             "rounds over the points, interleaved (every point's ours, bound and floor once per "
             "round); a point reports the median of its rounds");
DEFINE_bool(floor, true,
            "pull points: also measure the gather floor (the same batches' row records copied "
            "out of a local table of the same size with no transport: what any one-sided design "
            "pays this host's memory for scattered rows)");
DEFINE_int64(cold_bound_mib, 256,
             "the cache-cold bound reads a different slice of a target region this large each "
             "time (as a pull reads rows spread over a table that no cache holds); 0: no cold "
             "bound");

namespace shardps::bench {
namespace {

using std::chrono::milliseconds;
using testing_util::ChildProcess;
using testing_util::WaitForFile;
constexpr char kToken[] = "row-bench-token";

std::vector<int64_t> Ints(const std::string& s) {
  std::vector<int64_t> v;
  for (const std::string& x : SplitList(s)) v.push_back(std::stoll(x));
  return v;
}

// Batches per point and worker (--batch_ids).
int BatchCount(int64_t ids) {
  return static_cast<int>(std::clamp<int64_t>(FLAGS_batch_ids / std::max<int64_t>(1, ids), 4, 256));
}

// Batches of `b` distinct ids in [0, rows), sorted. Called by every worker thread at once.
std::vector<std::vector<int64_t>> MakeBatches(const std::string& dist, int64_t rows, int64_t b,
                                              int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int64_t>> out;
  static std::mutex mu;  // guards the Zipf tables while one thread (re)builds them
  static std::vector<double> cdf;  // Zipf(1.1) over ranks 1..rows
  static std::vector<int64_t> perm;
  std::unique_lock<std::mutex> zipf_lock(mu);
  if (dist == "zipf" && static_cast<int64_t>(cdf.size()) != rows) {
    cdf.resize(rows);
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) cdf[r] = (sum += std::pow(static_cast<double>(r + 1), -1.1));
    for (double& c : cdf) c /= sum;
    perm.resize(rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(12345));
  }
  zipf_lock.unlock();  // built once per table size; read-only from here
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (int i = 0; i < count; ++i) {
    std::unordered_set<int64_t> seen;
    std::vector<int64_t> ids;
    while (static_cast<int64_t>(ids.size()) < std::min(b, rows)) {
      int64_t id;
      if (dist == "zipf") {
        const int64_t r = std::lower_bound(cdf.begin(), cdf.end(), u01(rng)) - cdf.begin();
        id = perm[std::min(r, rows - 1)];
      } else {
        id = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
      }
      if (seen.insert(id).second) ids.push_back(id);
    }
    std::sort(ids.begin(), ids.end());
    out.push_back(std::move(ids));
  }
  return out;
}

int64_t VmRssKiB(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

pid_t ProgramPid(pid_t pid) {  // the program under ChildProcess's `timeout` wrapper
  for (int i = 0; i < 50; ++i) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
    pid_t c = 0;
    if (f >> c && c > 0) return c;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return pid;
}

struct Cluster {
  std::vector<std::unique_ptr<ChildProcess>> children;
  std::vector<pid_t> server_pids;
  std::string address;
  ~Cluster() {
    for (auto it = children.rbegin(); it != children.rend(); ++it) (*it)->Kill();
  }
};

StatusOr<std::unique_ptr<Cluster>> StartCluster(const std::string& transport, int servers,
                                                 int workers, const std::string& dir) {
  auto c = std::make_unique<Cluster>();
  std::filesystem::create_directories(dir);
  const std::string addr_file = dir + "/coordinator.addr";
  std::filesystem::remove(addr_file);
  ASSIGN_OR_RETURN(auto coord,
                   ChildProcess::Spawn({SHARDPS_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                        "--address_file=" + addr_file,
                                        std::string("--cluster_token=") + kToken,
                                        "--consistency=asp",
                                        "--num_servers=" + std::to_string(servers),
                                        "--num_workers=" + std::to_string(workers),
                                        "--data_transport=" + transport},
                                       dir + "/coordinator.log", std::chrono::seconds(3600)));
  ASSIGN_OR_RETURN(std::string addr, WaitForFile(addr_file, milliseconds(10000), coord.get()));
  addr.erase(addr.find_last_not_of("\n ") + 1);
  c->address = addr;
  c->children.push_back(std::move(coord));
  for (int s = 0; s < servers; ++s) {
    ASSIGN_OR_RETURN(auto srv,
                     ChildProcess::Spawn({SHARDPS_SERVER_BIN, "--coordinator=" + addr,
                                          std::string("--cluster_token=") + kToken,
                                          "--transport=" + transport, "--bind_ip=" + FLAGS_server_ip,
                                          "--rank=" + std::to_string(s), "--optimizer=sgd",
                                          "--lr=0.001"},
                                         dir + "/server" + std::to_string(s) + ".log",
                                         std::chrono::seconds(3600)));
    c->server_pids.push_back(ProgramPid(srv->pid()));
    c->children.push_back(std::move(srv));
  }
  return c;
}

struct Point {
  std::string transport, layout, dist, op;
  int64_t ids = 0, dim = 0;
  double rows_per_s = 0, gbps = 0, per_worker = 0, bound_rows_per_s = 0, ratio = 0;
  // The bound at the layout's concurrency: one contiguous read/write per worker at once, each
  // to its own target process (summed rows/s), and ours (summed) / it. 1 worker: the same.
  double bound_all_rows_per_s = 0, ratio_all = 0;
  // The same bounds with a cache-cold remote side: each contiguous operation at a different
  // offset of a --cold_bound_mib region (the local side stays hot, as a pull's output does).
  double cold_rows_per_s = 0, ratio_cold = 0, cold_all_rows_per_s = 0, ratio_cold_all = 0;
  // The same statistic on both sides: ours per worker from the median batch time (the bounds
  // are medians of their operation times), over the hot and the cold bound.
  double p50_per_worker = 0, ratio_p50 = 0, ratio_cold_p50 = 0;
  // The gather floor (pull): rows/s of a bare local copy of the same batches' records out of a
  // table of the same size, and ours (median, per worker) / it.
  double floor_rows_per_s = 0, ratio_floor = 0;
  int rounds = 0;
  uint64_t reads = 0, retries = 0;
};

// The median (bench_util's nearest-rank percentile) of a copy of `v`.
double Median(std::vector<double> v) { return Percentile(&v, 50); }

// The gather floor of one batch shape: `table` holds rows x stride bytes (touched once, so
// that its pages exist, as a server's table's do); each timed repetition copies the records of
// one batch (cycling through `batches`, as the workers do) into `out`, with the lines of the
// record kAhead places on prefetched, and the median repetition's rows/s is returned.
double GatherFloor(const std::vector<char>& table, uint64_t stride,
                   const std::vector<std::vector<int64_t>>& batches, std::vector<char>* out,
                   double seconds) {
  constexpr size_t kAhead = 8;
  std::vector<double> us;
  const double t0 = NowSeconds();
  for (size_t rep = 0; rep < 5 || (NowSeconds() - t0 < seconds && rep < 100000); ++rep) {
    const std::vector<int64_t>& ids = batches[rep % batches.size()];
    const size_t n = ids.size();
    if (out->size() < n * stride) out->resize(n * stride);
    char* d = out->data();
    const double s = NowSeconds();
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        const char* p = table.data() + static_cast<uint64_t>(ids[i + kAhead]) * stride;
        for (uint64_t l = 0; l < stride; l += 64) __builtin_prefetch(p + l);
      }
      std::memcpy(d + i * stride, table.data() + static_cast<uint64_t>(ids[i]) * stride, stride);
    }
    us.push_back((NowSeconds() - s) * 1e6);
  }
  return static_cast<double>(batches[0].size()) / (Median(us) * 1e-6);
}

// A small reusable barrier for the worker threads and main.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> l(mu_);
    const int gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return gen != gen_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

// The bound of one point at `n` streams at once (bounds[0, n), one thread each, started
// together): the summed rows/s of their p50 latencies.
StatusOr<double> ConcurrentBound(const std::vector<TransportInitiator*>& bounds, int n, BenchOp op,
                                 const PointParams& pp, int64_t ids) {
  std::vector<LatResult> lr(static_cast<size_t>(n));
  std::vector<Status> st(static_cast<size_t>(n));
  Barrier start(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      start.Wait();
      st[i] = bounds[i]->Latency(op, pp, &lr[i]);
    });
  }
  for (auto& t : threads) t.join();
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    RETURN_IF_ERROR(st[i]);
    sum += static_cast<double>(ids) / (Percentile(&lr[i].us, 50) * 1e-6);
  }
  return sum;
}

Status RunLayout(const std::string& transport, int servers, int workers, int64_t dim,
                 bool hashed, const std::vector<TransportInitiator*>& bounds,
                 std::vector<Point>* points) {
  TransportInitiator* bound = bounds.empty() ? nullptr : bounds[0];
  const std::string layout =
      std::to_string(servers) + "x" + std::to_string(workers) + (hashed ? "-hashed" : "");
  const std::vector<int64_t> id_counts = Ints(FLAGS_ids);
  const std::vector<std::string> dists = SplitList(FLAGS_dists);
  const int64_t max_ids = *std::max_element(id_counts.begin(), id_counts.end());
  ASSIGN_OR_RETURN(auto cluster,
                   StartCluster(transport, servers, workers,
                                FLAGS_work_dir + "/" + transport + "-" + layout + "-d" +
                                    std::to_string(dim)));
  // The plan: every (dist, ids, op) point, in order; workers and main meet at the barrier.
  // With --rounds R, the points' list R times over (interleaved: a point's rounds are spread
  // over the run, so a slow minute of the host lands in one round of many points, not in every
  // round of one); `point` is the job's index in the first round.
  struct Job {
    std::string dist, op;
    int64_t ids;
    size_t point;
  };
  std::vector<Job> jobs;
  size_t npoints = 0;
  for (int round = 0; round < std::max(1, FLAGS_rounds); ++round) {
    size_t point = 0;
    for (const std::string& d : dists) {
      for (int64_t b : id_counts) {
        for (const std::string& op : SplitList(FLAGS_ops)) jobs.push_back({d, op, b, point++});
      }
    }
    npoints = point;
  }
  Barrier barrier(workers + 1);
  std::vector<std::vector<double>> rate(jobs.size(), std::vector<double>(workers, 0.0));
  // Per job and worker: every batch's seconds.
  std::vector<std::vector<std::vector<double>>> batch_s(
      jobs.size(), std::vector<std::vector<double>>(workers));
  std::vector<Status> errors(workers);
  std::vector<ClientCounters> counters(workers);
  std::vector<std::thread> threads;
  std::atomic<bool> stop_all{false};
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      Status st;
      std::unique_ptr<Client> c;
      auto fail = [&](Status s) {
        if (errors[w].ok()) errors[w] = s;
      };
      {
        ClientOptions o;
        o.coordinator = cluster->address;
        o.cluster_token = kToken;
        o.requested_rank = w;
        o.transport = transport;
        o.bind_ip = FLAGS_worker_ip;
        o.wait_timeout = milliseconds(60000);
        auto got = Client::Connect(o);
        if (!got.ok()) {
          fail(got.status());
        } else {
          c = std::move(*got);
          EmbeddingOptions eo;
          eo.max_ids = static_cast<uint32_t>(max_ids);
          eo.init = EmbeddingOptions::Init::kUniform;
          eo.init_scale = 0.01f;
          eo.hashed = hashed;
          st = c->RegisterEmbedding("E", FLAGS_rows, dim, TensorDType::kFloat32, eo);
          if (st.ok()) st = c->Start();
          if (!st.ok()) fail(st);
        }
      }
      std::vector<float> buf(static_cast<size_t>(max_ids * dim), 0.001f);
      barrier.Wait();  // started
      for (size_t j = 0; j < jobs.size(); ++j) {
        auto batches =
            MakeBatches(jobs[j].dist, FLAGS_rows, jobs[j].ids, BatchCount(jobs[j].ids),
                        1000 * (w + 1) + jobs[j].point);
        if (hashed) {
          // 64-bit keys (a feature hash of the id): as many distinct keys, any value.
          for (auto& b : batches) {
            for (int64_t& id : b) id = static_cast<int64_t>(SplitMix64(static_cast<uint64_t>(id)));
          }
        }
        barrier.Wait();  // go
        if (!errors[w].ok() || stop_all) {
          barrier.Wait();
          continue;
        }
        const double t0 = NowSeconds();
        int64_t n = 0;
        std::vector<double>& times = batch_s[j][w];
        times.reserve(4096);
        while (n < 3 || NowSeconds() - t0 < FLAGS_seconds) {
          const std::vector<int64_t>& ids = batches[n % batches.size()];
          const double b0 = NowSeconds();
          if (jobs[j].op == "pull") {
            st = c->PullRows("E", ids.data(), ids.size(), buf.data());
          } else {
            st = c->AddRowGradients("E", ids.data(), ids.size(), buf.data());
            if (st.ok()) {
              auto h = c->Push("E");
              st = h.ok() ? c->Wait(*h) : h.status();
            }
          }
          if (!st.ok()) {
            fail(st);
            break;
          }
          times.push_back(NowSeconds() - b0);
          ++n;
        }
        rate[j][w] = static_cast<double>(n) * static_cast<double>(jobs[j].ids) /
                     (NowSeconds() - t0);
        barrier.Wait();  // done
      }
      if (c) {
        counters[w] = c->counters();
        (void)c->Close();
      }
    });
  }
  barrier.Wait();  // started
  for (int w = 0; w < workers; ++w) {
    if (!errors[w].ok()) stop_all = true;
  }
  // The gather floor's table: as many records as the servers' table, each of a dense row
  // record's stride (wire/region_layout.h), every page touched.
  const uint64_t floor_stride = 
      (sizeof(::shardps::layout::RowHeader) + static_cast<uint64_t>(dim) * 4 + 15) & ~15ull;
  std::vector<char> floor_table, floor_out;
  if (FLAGS_floor && !hashed) {
    floor_table.assign(static_cast<size_t>(FLAGS_rows) * floor_stride, 1);
  }
  std::vector<std::vector<Point>> rounds(npoints);
  for (size_t j = 0; j < jobs.size(); ++j) {
    barrier.Wait();  // go
    barrier.Wait();  // done
    Point p;
    p.transport = transport;
    p.layout = layout;
    p.dist = jobs[j].dist;
    p.op = jobs[j].op;
    p.ids = jobs[j].ids;
    p.dim = dim;
    for (double r : rate[j]) p.rows_per_s += r;
    p.per_worker = p.rows_per_s / workers;
    for (int w = 0; w < workers; ++w) {
      const double med = Median(batch_s[j][w]);
      if (med > 0) p.p50_per_worker += static_cast<double>(jobs[j].ids) / med / workers;
    }
    p.gbps = p.rows_per_s * static_cast<double>(dim) * 4 / 1e9;
    if (bound != nullptr) {
      const BenchOp bop = p.op == "pull" ? BenchOp::kRead : BenchOp::kWrite;
      PointParams pp;
      pp.size = static_cast<size_t>(jobs[j].ids * dim * 4);
      pp.lat_seconds = std::min(0.5, FLAGS_seconds);
      pp.lat_min_iters = 5;
      // One stream, then W at once (W > 1), into the rows/s of `ids` per operation.
      auto measure = [&](const PointParams& q, double* one, double* all) {
        LatResult lr;
        Status bs = bound->Latency(bop, q, &lr);
        if (bs.ok()) {
          *one = static_cast<double>(jobs[j].ids) / (Percentile(&lr.us, 50) * 1e-6);
        } else {
          LOG(WARNING) << "bound: " << bs;
        }
        if (workers == 1) {
          *all = *one;
        } else if (static_cast<int>(bounds.size()) >= workers) {
          auto sum = ConcurrentBound(bounds, workers, bop, q, jobs[j].ids);
          if (sum.ok()) {
            *all = *sum;
          } else {
            LOG(WARNING) << "bound at " << workers << " streams: " << sum.status();
          }
        }
      };
      measure(pp, &p.bound_rows_per_s, &p.bound_all_rows_per_s);
      const int64_t cold_slots = (FLAGS_cold_bound_mib << 20) / static_cast<int64_t>(pp.size);
      if (cold_slots >= 2) {
        PointParams cold = pp;
        cold.remote_slots = static_cast<int>(std::min<int64_t>(cold_slots, 1 << 20));
        measure(cold, &p.cold_rows_per_s, &p.cold_all_rows_per_s);
      }
    }
    if (p.op == "pull" && !floor_table.empty()) {
      const auto batches =
          MakeBatches(jobs[j].dist, FLAGS_rows, jobs[j].ids, BatchCount(jobs[j].ids),
                      1000 + jobs[j].point);
      p.floor_rows_per_s =
          GatherFloor(floor_table, floor_stride, batches, &floor_out, std::min(0.5, FLAGS_seconds));
    }
    auto ratios = [](Point* q) {
      auto div = [](double a, double b) { return b > 0 ? a / b : 0.0; };
      q->ratio = div(q->per_worker, q->bound_rows_per_s);
      q->ratio_all = div(q->rows_per_s, q->bound_all_rows_per_s);
      q->ratio_cold = div(q->per_worker, q->cold_rows_per_s);
      q->ratio_cold_all = div(q->rows_per_s, q->cold_all_rows_per_s);
      q->ratio_p50 = div(q->p50_per_worker, q->bound_rows_per_s);
      q->ratio_cold_p50 = div(q->p50_per_worker, q->cold_rows_per_s);
      q->ratio_floor = div(q->p50_per_worker, q->floor_rows_per_s);
    };
    ratios(&p);
    p.rounds = 1;
    std::vector<Point>& done = rounds[jobs[j].point];
    done.push_back(p);
    if (done.size() < static_cast<size_t>(std::max(1, FLAGS_rounds))) continue;
    if (done.size() > 1) {
      // The point: the median of each figure over its rounds, and of each round's ratio (not
      // the ratio of medians: a round's ours and bound were taken minutes apart from another's).
      auto med = [&](double Point::*f) {
        std::vector<double> v;
        for (const Point& q : done) v.push_back(q.*f);
        return Median(v);
      };
      for (double Point::*f :
           {&Point::rows_per_s, &Point::gbps, &Point::per_worker, &Point::bound_rows_per_s,
            &Point::bound_all_rows_per_s, &Point::cold_rows_per_s, &Point::cold_all_rows_per_s,
            &Point::p50_per_worker, &Point::floor_rows_per_s, &Point::ratio, &Point::ratio_all,
            &Point::ratio_cold, &Point::ratio_cold_all, &Point::ratio_p50,
            &Point::ratio_cold_p50, &Point::ratio_floor}) {
        p.*f = med(f);
      }
      p.rounds = static_cast<int>(done.size());
    }
    printf("%-4s %-4s %-7s %-5s ids %6lld dim %4lld  %11.0f rows/s  %6.3f GB/s  per worker "
           "%11.0f  bound %11.0f rows/s  ratio %5.2f  bound x%d %11.0f rows/s  ratio %5.2f  "
           "cold bound %11.0f rows/s  ratio %5.2f  cold x%d %11.0f rows/s  ratio %5.2f  "
           "p50 per worker %11.0f  ratio %5.2f  cold %5.2f  floor %11.0f rows/s  ratio %5.2f  "
           "rounds %d\n",
           p.transport.c_str(), p.layout.c_str(), p.dist.c_str(), p.op.c_str(),
           static_cast<long long>(p.ids), static_cast<long long>(p.dim), p.rows_per_s, p.gbps,
           p.per_worker, p.bound_rows_per_s, p.ratio, workers, p.bound_all_rows_per_s,
           p.ratio_all, p.cold_rows_per_s, p.ratio_cold, workers, p.cold_all_rows_per_s,
           p.ratio_cold_all, p.p50_per_worker, p.ratio_p50, p.ratio_cold_p50,
           p.floor_rows_per_s, p.ratio_floor, p.rounds);
    fflush(stdout);
    points->push_back(p);
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    if (!errors[w].ok()) return errors[w].WithContext("worker " + std::to_string(w));
  }
  // Memory per row: the servers' resident bytes, now that every row exists and (pushes were
  // applied with the servers' SGD: no state) -- then with an Adagrad state on every row.
  int64_t rss = 0;
  for (pid_t pid : cluster->server_pids) rss += VmRssKiB(pid);
  const double row_bytes = static_cast<double>(dim) * 4;
  printf("%-4s %-4s dim %4lld: servers' RSS %.1f MiB for %lld rows: %.1f B/row (row values %.0f "
         "B: %.3fx; the inbox for %d worker(s) x max_ids %lld is part of it)\n",
         transport.c_str(), layout.c_str(), static_cast<long long>(dim), rss / 1024.0,
         static_cast<long long>(FLAGS_rows), rss * 1024.0 / FLAGS_rows,
         row_bytes, rss * 1024.0 / FLAGS_rows / row_bytes, workers,
         static_cast<long long>(max_ids));
  fflush(stdout);
  return Status::OK();
}

int Main() {
  if (FLAGS_smoke) {
    FLAGS_rows = 20000;
    FLAGS_dims = "16";
    FLAGS_ids = "256,1024";
    FLAGS_layouts = "1x1";
    FLAGS_seconds = 0.2;
    FLAGS_cold_bound_mib = std::min<int64_t>(FLAGS_cold_bound_mib, 16);
  }
  std::vector<Point> points;
  for (const std::string& transport : SplitList(FLAGS_transports)) {
    // The bound's peer: a target process with a region of the largest batch's bytes.
    const std::vector<int64_t> ids = Ints(FLAGS_ids), dims = Ints(FLAGS_dims);
    const int64_t max_bytes = *std::max_element(ids.begin(), ids.end()) *
                              *std::max_element(dims.begin(), dims.end()) * 4;
    const int64_t region_bytes = std::max<int64_t>(max_bytes, FLAGS_cold_bound_mib << 20);
    // One target process (and one initiator) per worker of the largest layout: the bound of a
    // layout with W workers is W contiguous operations at once, each with its own peer.
    int max_workers = 1;
    for (const std::string& lay : SplitList(FLAGS_layouts)) {
      max_workers = std::max(max_workers, std::stoi(lay.substr(lay.find('x') + 1)));
    }
    std::vector<std::unique_ptr<TargetProcess>> targets;
    std::vector<std::unique_ptr<TransportInitiator>> initiators;
    Status s;
    for (int w = 0; w < max_workers && s.ok(); ++w) {
      auto target = std::make_unique<TargetProcess>();
      std::vector<std::string> args = {"--role=target", "--transport=" + transport,
                                       "--region_bytes=" + std::to_string(region_bytes),
                                       "--server_ip=" + FLAGS_server_ip};
      s = target->Start(args, 120);
      if (!s.ok()) break;
      auto raw = FromHex(target->descriptor_hex());
      auto remote = raw.ok() ? transport::RegionDescriptor::Decode(*raw)
                             : StatusOr<transport::RegionDescriptor>(raw.status());
      if (!remote.ok()) {
        s = remote.status();
        break;
      }
      InitiatorConfig c;
      c.fabric.provider = transport;
      c.fabric.bind_ip = FLAGS_worker_ip;
      c.peer_address = target->address();
      c.remote = *remote;
      c.local_bytes = static_cast<size_t>(max_bytes);
      c.verify_bytes = static_cast<size_t>(max_bytes);
      auto ini = TransportInitiator::Connect(c);
      s = ini.status();
      if (ini.ok()) initiators.push_back(std::move(*ini));
      targets.push_back(std::move(target));
    }
    if (!s.ok()) LOG(WARNING) << transport << ": bound peers: " << s << " (ratios need them)";
    std::vector<TransportInitiator*> bound;
    for (auto& i : initiators) bound.push_back(i.get());
    for (const std::string& lay : SplitList(FLAGS_layouts)) {
      const int servers = std::stoi(lay.substr(0, lay.find('x')));
      const int workers = std::stoi(lay.substr(lay.find('x') + 1));
      for (int64_t dim : dims) {
       for (const std::string& table : SplitList(FLAGS_tables)) {
        Status st = RunLayout(transport, servers, workers, dim, table == "hashed", bound,
                              &points);
        if (!st.ok()) {
          fprintf(stderr, "shardps_row_bench: %s %s dim %lld: %s\n", transport.c_str(),
                  lay.c_str(), static_cast<long long>(dim), st.ToString().c_str());
          return 1;
        }
       }
      }
    }
  }
  if (!FLAGS_json.empty()) {
    std::ofstream f(FLAGS_json);
    for (const Point& p : points) {
      f << "{\"system\":\"shardps\",\"transport\":\"" << p.transport << "\",\"layout\":\""
        << p.layout << "\",\"dist\":\"" << p.dist << "\",\"op\":\"" << p.op
        << "\",\"ids\":" << p.ids << ",\"dim\":" << p.dim << ",\"rows_per_s\":" << p.rows_per_s
        << ",\"gbps\":" << p.gbps << ",\"per_worker\":" << p.per_worker
        << ",\"bound_rows_per_s\":" << p.bound_rows_per_s << ",\"ratio\":" << p.ratio
        << ",\"bound_all_rows_per_s\":" << p.bound_all_rows_per_s
        << ",\"ratio_all\":" << p.ratio_all << ",\"cold_rows_per_s\":" << p.cold_rows_per_s
        << ",\"ratio_cold\":" << p.ratio_cold
        << ",\"cold_all_rows_per_s\":" << p.cold_all_rows_per_s
        << ",\"ratio_cold_all\":" << p.ratio_cold_all
        << ",\"p50_per_worker\":" << p.p50_per_worker << ",\"ratio_p50\":" << p.ratio_p50
        << ",\"ratio_cold_p50\":" << p.ratio_cold_p50
        << ",\"floor_rows_per_s\":" << p.floor_rows_per_s << ",\"ratio_floor\":" << p.ratio_floor
        << ",\"rounds\":" << p.rounds << "}\n";
    }
  }
  // Smoke: every point moved rows.
  for (const Point& p : points) {
    if (!(p.rows_per_s > 0)) {
      fprintf(stderr, "shardps_row_bench: a point moved no rows\n");
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace shardps::bench

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  google::InitGoogleLogging(argv[0]);
  if (FLAGS_role == "target") {
    shardps::bench::TargetConfig c;
    c.fabric = shardps::transport::FabricOptionsFromFlags();
    c.fabric.bind_ip = FLAGS_server_ip;
    c.listen_address = c.fabric.provider == "shm" ? "" : FLAGS_server_ip + ":0";
    c.region_bytes = static_cast<size_t>(FLAGS_region_bytes);
    c.raw_tcp_bound = false;
    return shardps::bench::RunTarget(c);
  }
  for (const std::string& op : shardps::bench::SplitList(FLAGS_ops)) {
    if (op != "pull" && op != "push") {
      fprintf(stderr, "shardps_row_bench: --ops takes pull and/or push, not '%s'\n", op.c_str());
      return 2;
    }
  }
  return shardps::bench::Main();
}
