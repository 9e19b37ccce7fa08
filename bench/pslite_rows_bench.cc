// pslite_rows_bench: the ps-lite side of the row-table (embedding) comparison with
// bench/row_bench.cc. Built and run only by bench/pslite_rows.sh, against a ps-lite checkout
// given by PSLITE_DIR: this file includes ps-lite's public headers (ps/ps.h) and links its
// libps.a; no ps-lite code lives in this repository, and ShardPS's build never sees this file.
//
// One binary, every role (ps-lite's DMLC_ROLE picks scheduler / server / worker). One cluster
// per (layout, dim); the worker(s) run every (dist, ids, op) point in the order row_bench.cc
// uses, meeting at ps-lite worker barriers so the workers of 2x2 measure at the same time.
//
//   table  = R rows x D floats. Row r is ps-lite key r * (kMaxKey / R): ps-lite assigns server
//            i the contiguous key range [kMaxKey/S*i, kMaxKey/S*(i+1)), so this spreads the
//            rows over the servers as S contiguous row ranges (raw row ids < 1e6 would all
//            land on server 0). Each server preallocates its rows x D with calloc (zero pages,
//            touched lazily); a value is D floats per key (no lens).
//   pull   = KVWorker::ZPull of B sorted distinct keys into B x D floats; the server copies
//            the stored rows into its response.
//   push   = KVWorker::ZPush of B sorted distinct keys x D floats; the server adds them into
//            the rows and acknowledges.
//   ids    = per point, 4 batches of B distinct ids (uniform over [0, R), or Zipf(1.1) over
//            ranks mapped through a fixed permutation, seed 12345; deduped and topped up),
//            seeds 1000 * (worker rank + 1) + point index, as in row_bench.cc.
//   timing = warm-up (each of the 4 batches once, untimed), barrier, then batches cycled for
//            --seconds (at least 3), at most --inflight requests outstanding per worker
//            (default 1: wait for each before issuing the next, as row_bench does).
//            rows/s = B x batches / seconds per worker; the point's rows/s is the sum over
//            workers; GB/s = rows/s x D x 4 / 1e9.
// Output: worker rank 0 appends one JSON line per point to --out (and prints it).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "ps/ps.h"
#include "pslite_driver_util.h"

namespace {

struct Flags {
  int64_t rows = 1000000;
  int64_t dim = 64;
  std::vector<int64_t> ids = {1024, 4096, 16384, 65536};
  std::vector<std::string> dists = {"uniform", "zipf"};
  double seconds = 1.0;
  int inflight = 1;
  std::string layout;
  std::string out;
  std::string run_dir = "/tmp";
};

using pslite_driver::Now;
using pslite_driver::Split;

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  pslite_driver::ParseFlags(argc, argv, "pslite_rows_bench",
                            [&](const std::string& k, const std::string& v) {
    if (k == "rows") {
      f.rows = std::stoll(v);
    } else if (k == "dim") {
      f.dim = std::stoll(v);
    } else if (k == "ids") {
      f.ids.clear();
      for (auto& x : Split(v)) f.ids.push_back(std::stoll(x));
    } else if (k == "dists") {
      f.dists = Split(v);
    } else if (k == "seconds") {
      f.seconds = std::stod(v);
    } else if (k == "inflight") {
      f.inflight = std::max(1, std::stoi(v));
    } else if (k == "layout") {
      f.layout = v;
    } else if (k == "out") {
      f.out = v;
    } else if (k == "run_dir") {
      f.run_dir = v;
    } else {
      return false;
    }
    return true;
  });
  return f;
}

ps::Key Stride(int64_t rows) { return ps::kMaxKey / static_cast<ps::Key>(rows); }

// ---------------------------------------------------------------------------------------------
// Server: a dense slab for the rows whose keys fall in this server's key range.

class RowTable {
 public:
  RowTable(int64_t rows, int64_t dim) : dim_(dim), stride_(Stride(rows)) {
    const ps::Range& r = ps::Postoffice::Get()->GetServerKeyRanges()[ps::MyRank()];
    lo_ = static_cast<int64_t>((r.begin() + stride_ - 1) / stride_);
    // Keys of rows >= hi_ are >= r.end(); r.end() may be kMaxKey (last server): clamp to rows.
    const ps::Key hi_key_rows = (r.end() - 1) / stride_ + 1;
    hi_ = std::min<int64_t>(rows, static_cast<int64_t>(hi_key_rows));
    if (hi_ < lo_) hi_ = lo_;
    data_ = static_cast<float*>(calloc(static_cast<size_t>(std::max<int64_t>(1, hi_ - lo_)) *
                                           static_cast<size_t>(dim_),
                                       sizeof(float)));
    CHECK(data_ != nullptr) << "calloc of " << (hi_ - lo_) << " x " << dim_ << " floats";
    fprintf(stderr, "pslite_rows_bench: server rank %d holds rows [%lld, %lld) x %lld\n",
            ps::MyRank(), static_cast<long long>(lo_), static_cast<long long>(hi_),
            static_cast<long long>(dim_));
  }
  ~RowTable() { free(data_); }

  float* Row(ps::Key key) {
    CHECK_EQ(key % stride_, 0u) << "key " << key << " is not a row key";
    const int64_t row = static_cast<int64_t>(key / stride_);
    CHECK(row >= lo_ && row < hi_) << "row " << row << " not on this server";
    return data_ + static_cast<size_t>(row - lo_) * static_cast<size_t>(dim_);
  }

  void operator()(const ps::KVMeta& meta, const ps::KVPairs<float>& req,
                  ps::KVServer<float>* server) {
    const size_t n = req.keys.size();
    const size_t d = static_cast<size_t>(dim_);
    ps::KVPairs<float> res;
    if (meta.push) {
      CHECK_EQ(req.vals.size(), n * d) << "push: want " << dim_ << " floats per key";
      CHECK(req.lens.empty());
      const float* v = req.vals.data();
      for (size_t i = 0; i < n; ++i) {
        float* row = Row(req.keys[i]);
        for (size_t j = 0; j < d; ++j) row[j] += v[i * d + j];
      }
    }
    if (meta.pull) {
      res.keys = req.keys;
      res.vals.resize(n * d);
      float* out = res.vals.data();
      for (size_t i = 0; i < n; ++i) memcpy(out + i * d, Row(req.keys[i]), d * sizeof(float));
    }
    server->Response(meta, res);
  }

 private:
  int64_t dim_;
  ps::Key stride_;
  int64_t lo_ = 0, hi_ = 0;
  float* data_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Worker.

// Batches of b distinct ids in [0, rows), sorted (the same generator as row_bench.cc).
std::vector<std::vector<int64_t>> MakeBatches(const std::string& dist, int64_t rows, int64_t b,
                                              int count, uint64_t seed) {
  static std::vector<double> cdf;  // Zipf(1.1) over ranks 1..rows
  static std::vector<int64_t> perm;
  if (dist == "zipf" && static_cast<int64_t>(cdf.size()) != rows) {
    cdf.resize(rows);
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) cdf[r] = (sum += std::pow(static_cast<double>(r + 1), -1.1));
    for (double& c : cdf) c /= sum;
    perm.resize(rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(12345));
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::vector<std::vector<int64_t>> out;
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

ps::SArray<ps::Key> ToKeys(const std::vector<int64_t>& ids, int64_t rows) {
  const ps::Key stride = Stride(rows);
  ps::SArray<ps::Key> keys(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) keys[i] = static_cast<ps::Key>(ids[i]) * stride;
  return keys;
}

void WorkerBarrier() { ps::Postoffice::Get()->Barrier(0, ps::kWorkerGroup); }

// Before any point (rank 0 only, the others wait at the barrier): push a known pattern into rows
// at both ends of the table (so on every server in 2x2), pull it back, and compare.
void SelfCheck(ps::KVWorker<float>* kv, const Flags& f) {
  std::vector<int64_t> ids = {0, 1, 2, f.rows / 2 - 1, f.rows / 2, f.rows - 2, f.rows - 1};
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const size_t d = static_cast<size_t>(f.dim);
  ps::SArray<ps::Key> keys = ToKeys(ids, f.rows);
  ps::SArray<float> before(ids.size() * d), after(ids.size() * d), vals(ids.size() * d);
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = static_cast<float>(i % 97) + 0.5f;
  kv->Wait(kv->ZPull(keys, &before));
  kv->Wait(kv->ZPush(keys, vals));
  kv->Wait(kv->ZPull(keys, &after));
  for (size_t i = 0; i < vals.size(); ++i) {
    CHECK(std::fabs(after[i] - before[i] - vals[i]) < 1e-3)
        << "self-check: value " << i << " is " << after[i] << ", want " << before[i] + vals[i];
  }
  fprintf(stderr, "pslite_rows_bench: self-check ok (%zu rows x %zu)\n", ids.size(), d);
}

struct Job {
  std::string dist, op;
  int64_t ids;
};

void RunWorker(const Flags& f) {
  ps::KVWorker<float> kv(0, 0);
  const int rank = ps::MyRank();
  const int workers = ps::NumWorkers();
  const size_t d = static_cast<size_t>(f.dim);
  if (rank == 0) SelfCheck(&kv, f);
  WorkerBarrier();

  std::vector<Job> jobs;
  for (const std::string& dist : f.dists) {
    for (int64_t b : f.ids) {
      for (const char* op : {"pull", "push"}) jobs.push_back({dist, op, b});
    }
  }
  const int64_t max_ids = *std::max_element(f.ids.begin(), f.ids.end());
  ps::SArray<float> push_vals(static_cast<size_t>(max_ids) * d, 0.001f);
  std::vector<ps::SArray<float>> pull_bufs(f.inflight);

  // Per point: batches and seconds of this worker.
  std::vector<int64_t> my_batches(jobs.size());
  std::vector<double> my_seconds(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    const auto ids = MakeBatches(job.dist, f.rows, job.ids, 4, 1000 * (rank + 1) + j);
    std::vector<ps::SArray<ps::Key>> keys;
    for (const auto& b : ids) keys.push_back(ToKeys(b, f.rows));
    const size_t nvals = static_cast<size_t>(job.ids) * d;
    for (auto& buf : pull_bufs) buf.resize(nvals);
    ps::SArray<float> vals = push_vals.segment(0, nvals);
    const bool pull = job.op == "pull";
    auto issue = [&](int64_t n) {
      const auto& k = keys[n % keys.size()];
      if (pull) return kv.ZPull(k, &pull_bufs[n % f.inflight]);
      return kv.ZPush(k, vals);
    };
    for (size_t i = 0; i < keys.size(); ++i) kv.Wait(issue(static_cast<int64_t>(i)));  // warm-up
    WorkerBarrier();
    std::deque<int> outstanding;
    const double t0 = Now();
    int64_t n = 0;
    while (n < 3 || Now() - t0 < f.seconds) {
      if (static_cast<int>(outstanding.size()) >= f.inflight) {
        kv.Wait(outstanding.front());
        outstanding.pop_front();
      }
      outstanding.push_back(issue(n));
      ++n;
    }
    while (!outstanding.empty()) {
      kv.Wait(outstanding.front());
      outstanding.pop_front();
    }
    my_seconds[j] = Now() - t0;
    my_batches[j] = n;
    WorkerBarrier();
  }

  // Gather: every worker writes its figures to the run dir (all on this host), rank 0 sums.
  {
    std::ofstream w(f.run_dir + "/worker" + std::to_string(rank) + ".txt");
    for (size_t j = 0; j < jobs.size(); ++j) w << my_batches[j] << " " << my_seconds[j] << "\n";
  }
  WorkerBarrier();
  if (rank != 0) return;
  std::vector<int64_t> batches(jobs.size(), 0);
  std::vector<double> seconds(jobs.size(), 0), rate(jobs.size(), 0);
  for (int w = 0; w < workers; ++w) {
    std::ifstream in(f.run_dir + "/worker" + std::to_string(w) + ".txt");
    for (size_t j = 0; j < jobs.size(); ++j) {
      int64_t nb = 0;
      double s = 0;
      CHECK(in >> nb >> s) << "worker " << w << "'s figures are missing";
      batches[j] += nb;
      seconds[j] = std::max(seconds[j], s);
      rate[j] += static_cast<double>(nb) * static_cast<double>(jobs[j].ids) / s;
    }
  }
  FILE* out = f.out.empty() ? nullptr : fopen(f.out.c_str(), "a");
  for (size_t j = 0; j < jobs.size(); ++j) {
    char line[512];
    snprintf(line, sizeof(line),
             "{\"system\":\"ps-lite\",\"layout\":\"%s\",\"dist\":\"%s\",\"ids\":%lld,"
             "\"dim\":%lld,\"op\":\"%s\",\"rows_per_s\":%.1f,\"gbps\":%.4f,"
             "\"per_worker_rows_per_s\":%.1f,\"batches\":%lld,\"seconds\":%.3f,"
             "\"inflight\":%d,\"workers\":%d}",
             f.layout.c_str(), jobs[j].dist.c_str(), static_cast<long long>(jobs[j].ids),
             static_cast<long long>(f.dim), jobs[j].op.c_str(), rate[j],
             rate[j] * static_cast<double>(f.dim) * 4 / 1e9, rate[j] / workers,
             static_cast<long long>(batches[j]), seconds[j], f.inflight, workers);
    printf("%s\n", line);
    if (out != nullptr) fprintf(out, "%s\n", line);
  }
  fflush(stdout);
  if (out != nullptr) fclose(out);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  ps::Start(0, argv[0]);
  RowTable* table = nullptr;
  ps::KVServer<float>* server = nullptr;
  if (ps::IsServer()) {
    table = new RowTable(f.rows, f.dim);
    server = new ps::KVServer<float>(0);
    server->set_request_handle(
        [table](const ps::KVMeta& m, const ps::KVPairs<float>& r, ps::KVServer<float>* s) {
          (*table)(m, r, s);
        });
  }
  // No request before every server's handle is set: ps-lite's KVServer takes requests as soon as
  // it is constructed, before set_request_handle (a worker that raced it aborted the server).
  if (!ps::IsScheduler()) ps::Postoffice::Get()->Barrier(0, ps::kServerGroup + ps::kWorkerGroup);
  if (ps::IsWorker()) RunWorker(f);
  ps::Finalize(0, true);
  delete server;
  delete table;
  return 0;
}
