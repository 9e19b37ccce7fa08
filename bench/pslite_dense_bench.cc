// pslite_dense_bench: ps-lite's side of the dense push/pull comparison with shardps_bench, measured
// in the same run (scripts/bench.sh calls bench/pslite_dense.sh, which builds this file against a
// ps-lite checkout given by PSLITE_DIR: it includes ps-lite's public headers (ps/ps.h) and links
// its libps.a; no ps-lite code lives in this repository and ShardPS's build never sees this file).
//
// One binary, every role (ps-lite's DMLC_ROLE picks scheduler / server / worker); one cluster per
// layout. The worker(s) walk the same matrix as shardps_bench, meeting at ps-lite worker barriers
// so that the workers of 2x2 measure at the same time:
//
//   keys    K = keys_per_server x S per worker (40 x S, fewer where 2 x size x K would pass
//           --max_worker_bytes, as shardps_bench caps them); key i of K is about i x (kMaxKey / K), so
//           ps-lite's contiguous key ranges give every server K / S keys (i + 1/2 in fact:
//           no key on a range boundary). One key per request.
//   server  keeps the last pushed value of every key (a copy into its own buffer, as ShardPS's
//           'store' optimizer copies the push into the published weights) and answers a pull
//           with that buffer (ps-lite's SArray shares it: no copy on the server).
//   push    ZPush of one key with `size` bytes; pull: ZPull of one key into a per-key buffer;
//           push-pull: both for the key, issued together (as shardps_bench issues them).
//   series  throughput: rounds of K requests in flight, each round waited for; latency: one key
//           (rotating over the servers) in flight at a time.
//   timing  per point and repetition: one untimed warm-up round, a barrier, then rounds for at
//           least --seconds (3 rounds minimum; latency: --lat_seconds, 20 requests minimum).
//           Goodput = 8 x bytes / elapsed summed over workers, bytes = size x requests (x 2 for
//           push-pull; gbps_pslite counts size once as ps-lite's own benchmark does). The
//           servers' CPU seconds, page faults and context switches in the window are read from
//           /proc by worker rank 0 (every process runs on this host). Medians over --reps.
// Output: worker rank 0 appends one JSON line per point to --out (and prints it).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ps/ps.h"
#include "pslite_driver_util.h"

namespace {

struct Flags {
  std::vector<size_t> sizes = {4096, 65536, 1 << 20, 4 << 20, 16 << 20};
  std::vector<std::string> modes = {"push", "pull", "push-pull"};
  std::vector<std::string> series = {"throughput", "latency"};
  int keys_per_server = 40;
  double max_worker_bytes = 3.0 * (1 << 30);
  double seconds = 1.0, lat_seconds = 0.5;
  int reps = 3;
  std::string layout, out, run_dir = "/tmp";
};

using pslite_driver::Now;
using pslite_driver::Split;

size_t ParseSize(const std::string& s) {
  size_t pos = 0;
  const unsigned long long v = std::stoull(s, &pos);
  const std::string suffix = s.substr(pos);
  if (suffix == "K" || suffix == "KiB") return static_cast<size_t>(v) << 10;
  if (suffix == "M" || suffix == "MiB") return static_cast<size_t>(v) << 20;
  if (suffix == "G" || suffix == "GiB") return static_cast<size_t>(v) << 30;
  if (suffix.empty() || suffix == "B") return static_cast<size_t>(v);
  fprintf(stderr, "pslite_dense_bench: bad size %s\n", s.c_str());
  exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  pslite_driver::ParseFlags(argc, argv, "pslite_dense_bench",
                            [&](const std::string& k, const std::string& v) {
    if (k == "sizes") {
      f.sizes.clear();
      for (const auto& x : Split(v)) f.sizes.push_back(ParseSize(x));
    } else if (k == "modes") {
      f.modes = Split(v);
    } else if (k == "series") {
      f.series = Split(v);
    } else if (k == "keys_per_server") {
      f.keys_per_server = std::max(1, std::stoi(v));
    } else if (k == "max_worker_bytes") {
      f.max_worker_bytes = static_cast<double>(ParseSize(v));
    } else if (k == "seconds") {
      f.seconds = std::stod(v);
    } else if (k == "lat_seconds") {
      f.lat_seconds = std::stod(v);
    } else if (k == "reps") {
      f.reps = std::max(1, std::stoi(v));
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

double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  return v[std::min(v.size() - 1, static_cast<size_t>(std::max(1.0, rank)) - 1)];
}

// ---------------------------------------------------------------------------------------------
// /proc counters of the server processes (their pids are in run_dir/server<rank>.pid).

struct Counters {
  double cpu_s = 0, faults = 0, switches = 0;
};

Counters ReadCounters(int pid) {
  Counters c;
  const std::string dir = "/proc/" + std::to_string(pid);
  std::ifstream f(dir + "/stat");
  std::string line;
  if (!std::getline(f, line)) return c;
  std::istringstream is(line.substr(line.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 15 && is >> field; ++i) {
    if (i == 10 || i == 12) c.faults += std::stod(field);
    if (i == 14 || i == 15) c.cpu_s += std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  if (DIR* d = opendir((dir + "/task").c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream st(dir + "/task/" + e->d_name + "/status");
      while (std::getline(st, line)) {
        unsigned long long v = 0;
        if (sscanf(line.c_str(), "voluntary_ctxt_switches: %llu", &v) == 1 ||
            sscanf(line.c_str(), "nonvoluntary_ctxt_switches: %llu", &v) == 1) {
          c.switches += static_cast<double>(v);
        }
      }
    }
    closedir(d);
  }
  return c;
}

Counters ServerCounters(const std::vector<int>& pids) {
  Counters sum;
  for (int p : pids) {
    const Counters c = ReadCounters(p);
    sum.cpu_s += c.cpu_s;
    sum.faults += c.faults;
    sum.switches += c.switches;
  }
  return sum;
}

// ---------------------------------------------------------------------------------------------
// Server: the last value pushed for every key.

class Store {
 public:
  void operator()(const ps::KVMeta& meta, const ps::KVPairs<float>& req,
                  ps::KVServer<float>* server) {
    CHECK_EQ(req.keys.size(), 1u) << "one key per request";
    const ps::Key key = req.keys[0];
    ps::KVPairs<float> res;
    if (meta.push) {
      ps::SArray<float>& v = store_[key];
      if (v.size() != req.vals.size()) v = ps::SArray<float>(req.vals.size(), 0.0f);
      memcpy(v.data(), req.vals.data(), req.vals.size() * sizeof(float));
    }
    if (meta.pull) {
      res.keys = req.keys;
      res.vals = store_[key];  // shared, not copied
    }
    server->Response(meta, res);
  }

 private:
  std::map<ps::Key, ps::SArray<float>> store_;
};

// ---------------------------------------------------------------------------------------------
// Worker.

void WorkerBarrier() { ps::Postoffice::Get()->Barrier(0, ps::kWorkerGroup); }

struct Point {
  std::string series, mode;
  size_t size;
  int keys;
};

struct Sample {  // one worker, one repetition
  double bytes = 0, bytes_pslite = 0, elapsed = 0, requests = 0;
  std::vector<double> lat_us;
};

void RunWorker(const Flags& f) {
  ps::KVWorker<float> kv(0, 0);
  const int rank = ps::MyRank();
  const int workers = ps::NumWorkers();
  const int servers = ps::NumServers();
  std::vector<int> server_pids;
  if (rank == 0) {
    for (int s = 0; s < servers; ++s) {
      std::ifstream p(f.run_dir + "/server" + std::to_string(s) + ".pid");
      int pid = 0;
      if (p >> pid) server_pids.push_back(pid);
    }
  }

  std::vector<Point> points;
  for (size_t size : f.sizes) {
    int kps = f.keys_per_server;
    while (kps > 1 && 2.0 * size * kps * servers > f.max_worker_bytes) --kps;
    for (const std::string& mode : f.modes) {
      for (const std::string& s : f.series) points.push_back({s, mode, size, kps * servers});
    }
  }
  FILE* out = (rank == 0 && !f.out.empty()) ? fopen(f.out.c_str(), "a") : nullptr;
  for (const Point& pt : points) {
    const bool lat = pt.series == "latency";
    const size_t n = pt.size / sizeof(float);
    const ps::Key stride = ps::kMaxKey / static_cast<ps::Key>(pt.keys);
    std::vector<ps::SArray<ps::Key>> keys(pt.keys);
    std::vector<ps::SArray<float>> push_vals(pt.keys), pull_vals(pt.keys);
    for (int k = 0; k < pt.keys; ++k) {
      // The middle of key k's share: exactly K / S keys fall in each server's key range.
      keys[k] = ps::SArray<ps::Key>(1, static_cast<ps::Key>(k) * stride + stride / 2);
      push_vals[k] = ps::SArray<float>(n, 1.0f + static_cast<float>(rank));
      pull_vals[k] = ps::SArray<float>(n, 0.0f);
    }
    const bool push = pt.mode != "pull", pull = pt.mode != "push";
    std::vector<int> ts;
    auto issue = [&](int k) {
      if (push) ts.push_back(kv.ZPush(keys[k], push_vals[k]));
      if (pull) ts.push_back(kv.ZPull(keys[k], &pull_vals[k]));
    };
    auto wait_all = [&] {
      for (int t : ts) kv.Wait(t);
      ts.clear();
    };
    std::vector<double> gbps, gbps_ps, uspk, p50, p99, cpu, flt, csw;
    for (int rep = 0; rep < f.reps; ++rep) {
      for (int k = 0; k < pt.keys; ++k) issue(k);  // warm-up round, untimed
      wait_all();
      WorkerBarrier();
      const Counters c0 = rank == 0 ? ServerCounters(server_pids) : Counters{};
      Sample smp;
      const double t0 = Now();
      if (lat) {
        const int rotate = std::min(servers, pt.keys);
        for (int i = 0; i < 20 || Now() - t0 < f.lat_seconds; ++i) {
          const double s = Now();
          issue((i % rotate) * (pt.keys / rotate));  // the first key of each server in turn
          wait_all();
          smp.lat_us.push_back((Now() - s) * 1e6);
        }
        smp.requests = static_cast<double>(smp.lat_us.size());
      } else {
        int rounds = 0;
        do {
          for (int k = 0; k < pt.keys; ++k) issue(k);
          wait_all();
          ++rounds;
        } while (rounds < 3 || Now() - t0 < f.seconds);
        smp.requests = static_cast<double>(rounds) * pt.keys;
      }
      smp.elapsed = Now() - t0;
      smp.bytes_pslite = static_cast<double>(pt.size) * smp.requests;
      smp.bytes = smp.bytes_pslite * (push && pull ? 2 : 1);
      // Gather: each worker writes its sample; rank 0 sums after the barrier.
      {
        std::ofstream w(f.run_dir + "/worker" + std::to_string(rank) + ".txt");
        w.precision(17);
        w << smp.bytes << " " << smp.bytes_pslite << " " << smp.elapsed << " " << smp.requests
          << " " << smp.lat_us.size();
        for (double l : smp.lat_us) w << " " << l;
        w << "\n";
      }
      WorkerBarrier();
      if (rank == 0) {
        const Counters c1 = ServerCounters(server_pids);
        double g = 0, gp = 0, bytes = 0, u = 0;
        std::vector<double> lats;
        for (int w = 0; w < workers; ++w) {
          std::ifstream in(f.run_dir + "/worker" + std::to_string(w) + ".txt");
          double b = 0, bp = 0, e = 0, r = 0;
          size_t nl = 0;
          CHECK(in >> b >> bp >> e >> r >> nl) << "worker " << w << "'s figures are missing";
          for (size_t i = 0; i < nl; ++i) {
            double l = 0;
            in >> l;
            lats.push_back(l);
          }
          g += 8 * b / e / 1e9;
          gp += 8 * bp / e / 1e9;
          bytes += b;
          u += e * 1e6 / std::max(1.0, r) / workers;
        }
        gbps.push_back(g);
        gbps_ps.push_back(gp);
        uspk.push_back(u);
        cpu.push_back((c1.cpu_s - c0.cpu_s) / (bytes / 1e9));
        flt.push_back((c1.faults - c0.faults) / (bytes / 1e9));
        csw.push_back((c1.switches - c0.switches) / (bytes / 1e9));
        if (lat) {
          p50.push_back(Percentile(lats, 50));
          p99.push_back(Percentile(lats, 99));
        }
      }
      WorkerBarrier();  // nobody rewrites its figures before rank 0 read them
    }
    if (rank != 0) continue;
    auto num = [](double v) {
      char b[32];
      if (std::isnan(v)) return std::string("null");
      snprintf(b, sizeof(b), "%.6g", v);
      return std::string(b);
    };
    std::string reps = "[";
    for (size_t i = 0; i < gbps.size(); ++i) reps += (i ? "," : "") + num(gbps[i]);
    reps += "]";
    std::ostringstream line;
    line << "{\"system\":\"ps-lite\",\"series\":\"" << pt.series << "\",\"layout\":\"" << f.layout
         << "\",\"servers\":" << servers << ",\"workers\":" << workers << ",\"mode\":\""
         << pt.mode << "\",\"size\":" << pt.size << ",\"keys_per_round\":" << (lat ? 1 : pt.keys)
         << ",\"reps\":" << f.reps << ",\"gbps\":" << num(Median(gbps))
         << ",\"gbps_pslite\":" << num(Median(gbps_ps)) << ",\"us_per_key\":" << num(Median(uspk))
         << ",\"lat_p50_us\":" << num(Median(p50)) << ",\"lat_p99_us\":" << num(Median(p99))
         << ",\"server_cpu_s_per_gb\":" << num(Median(cpu))
         << ",\"server_faults_per_gb\":" << num(Median(flt))
         << ",\"server_switches_per_gb\":" << num(Median(csw)) << ",\"rep_gbps\":" << reps << "}";
    printf("%s\n", line.str().c_str());
    fflush(stdout);
    if (out != nullptr) {
      fprintf(out, "%s\n", line.str().c_str());
      fflush(out);
    }
  }
  if (out != nullptr) fclose(out);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  ps::Start(0, argv[0]);
  Store* store = nullptr;
  ps::KVServer<float>* server = nullptr;
  if (ps::IsServer()) {
    std::ofstream(f.run_dir + "/server" + std::to_string(ps::MyRank()) + ".pid") << getpid();
    store = new Store();
    server = new ps::KVServer<float>(0);
    server->set_request_handle(
        [store](const ps::KVMeta& m, const ps::KVPairs<float>& r, ps::KVServer<float>* s) {
          (*store)(m, r, s);
        });
  }
  // No request before every server's handle is set (a worker that raced it aborted the server).
  if (!ps::IsScheduler()) ps::Postoffice::Get()->Barrier(0, ps::kServerGroup + ps::kWorkerGroup);
  if (ps::IsWorker()) RunWorker(f);
  ps::Finalize(0, true);
  delete server;
  delete store;
  return 0;
}
