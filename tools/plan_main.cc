// shardps_plan: predicts step time and throughput of ShardPS configurations and recommends one.
// See docs/plan.md.
//
//   shardps_plan --probe --probe_out=probe.json              # measure this host
//   shardps_plan --probe_file=probe.json --model=model.txt --compute_us=200 --workers=4
//   shardps_plan --probe_file=probe.json --digits --compute_us=200 --predict
//       --servers=2 --workers=4 --partition_bytes=4194304 --mode=bsp
//   shardps_plan --probe_file=probe.json --digits --compute_us=200 --hosts=4 --local_workers=4
//       --link_Bps=125e6                                      # flat vs hierarchical, 1 Gbit/s
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "common/version.h"
#include "tools/plan.h"

DEFINE_bool(probe, false, "Measure link, contention and update costs on this host");
DEFINE_string(probe_out, "", "--probe: write the probe file here (JSON, tools/probe.proto)");
DEFINE_string(probe_file, "", "Read costs from this probe file (plan's or doctor's)");
DEFINE_string(transport, "tcp", "--probe: provider to measure (tcp, shm)");
DEFINE_double(probe_seconds, 0.3, "--probe: seconds per measured point");
DEFINE_int32(probe_clients, 9, "--probe: loaded points with 1..this many concurrent clients");
DEFINE_string(model, "", "Model file: one tensor per line, 'name dim0 dim1 ...'");
DEFINE_bool(digits, false, "Model: the digits trainer's MLP (64 x --hidden x 10)");
DEFINE_int32(hidden, 64, "--digits: hidden units");
DEFINE_double(compute_us, 0, "Compute time per step per worker, microseconds");
DEFINE_int32(batch, 32, "Samples per worker per step");
DEFINE_int32(machines, 1,
             "Machine budget. With --hosts: 1 = the hosts are emulated on one machine and share "
             "its cores; more = each host is a machine of its own");
DEFINE_int32(cores, 0, "Cores per machine (0: the probe's)");
DEFINE_int32(workers, 4, "Workers (data-parallel replicas) to place");
DEFINE_int32(max_servers, 4, "Search servers 1..this");
DEFINE_string(partitions, "4096,16384,65536,1048576,4194304", "Partition sizes to search");
DEFINE_int32(top, 10, "Print this many configurations");
DEFINE_bool(predict, false, "Predict one configuration (--servers, --workers, ...) only");
DEFINE_int32(servers, 1, "--predict: servers");
DEFINE_uint64(partition_bytes, 4u << 20, "--predict: partition size");
DEFINE_string(mode, "bsp", "--predict: bsp, ssp or asp");
DEFINE_int32(staleness, 0, "--predict: SSP staleness bound");
DEFINE_bool(colocated, true, "--predict: servers on the workers' machines");
DEFINE_double(calibrate_step_us, 0,
              "Measured step of the --predict configuration (CPU-bound): solve for the exchange "
              "CPU (--mode=asp) or the wait CPU (bsp/ssp) and store it in the probe file written "
              "to --probe_out (calibrate asp first)");

DEFINE_int32(hosts, 0,
             "Network hosts the workers run on (0: no host model). With --local_workers, "
             "--workers defaults to hosts x local_workers; without, local workers = workers / "
             "hosts");
DEFINE_int32(local_workers, 0, "Workers per host (needs --hosts)");
DEFINE_double(link_Bps, 0,
              "Each host's NIC rate, bytes/s (0: links not modelled); "
              "without --hosts, each worker on a host of its own");
DEFINE_string(link_duplex, "full", "full: each direction carries link_Bps; half: both share it");
DEFINE_string(placement, "",
              "Network placement of servers: dedicated (hosts of their own) or colocated (server "
              "s on worker host s mod hosts); empty: the search tries both, --predict follows "
              "--colocated");
DEFINE_bool(hierarchical, false,
            "--predict: one aggregator per host (the search tries flat and hierarchical unless "
            "--hierarchical is given explicitly)");
DEFINE_double(wire_overhead, shardps::plan::Config::kDefaultWireOverhead,
              "Bytes below the transport (TCP/IP/Ethernet headers, TCP acks) per transport "
              "byte; 0.068 for MTU 1500 without segmentation offload (docs/plan.md)");
DEFINE_double(net_cpu_ns_per_byte, 0,
              "With --hosts: CPU (ns of one core, both ends) per byte a client and a server "
              "exchange over a host link; 0: not modelled. scripts/bench-hierarchy.py measures "
              "it on its emulated hosts (iperf3, rate_check in its details file)");
DEFINE_double(loopback_cpu_ns_per_byte, 0,
              "With --hosts: the same for a client and a server on one host (loopback)");
DEFINE_double(compute_cv, 0,
              "Coefficient of variation of compute per step (straggler wait; 0: none)");
DEFINE_string(calibrate_file, "",
              "Measured steps of CPU-bound configurations, one a line: 'servers workers "
              "partition_bytes mode staleness step_us' ('#' comments): fit the exchange and wait "
              "CPU by least squares (docs/plan.md) and store them in the probe file written to "
              "--probe_out; then predict or search with them");

namespace {

using namespace shardps;
using namespace shardps::plan;

int Fail(const Status& s) {
  std::fprintf(stderr, "shardps_plan: %s\n", s.ToString().c_str());
  return 1;
}

StatusOr<Mode> ParseMode(const std::string& m) {
  if (m == "bsp") return Mode::kBsp;
  if (m == "ssp") return Mode::kSsp;
  if (m == "asp") return Mode::kAsp;
  return InvalidArgumentError("mode must be bsp, ssp or asp, not '" + m + "'");
}

// --calibrate_file: "servers workers partition_bytes mode staleness step_us" per line.
StatusOr<std::vector<MeasuredRun>> LoadCalibrationFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("cannot open calibration file " + path);
  std::vector<MeasuredRun> out;
  std::string line;
  int lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream ls(line);
    long long servers = 0, workers = 0, partition = 0, staleness = 0;
    std::string mode;
    double step = 0;
    if (!(ls >> servers)) continue;  // blank
    std::string rest;
    if (!(ls >> workers >> partition >> mode >> staleness >> step) || (ls >> rest) ||
        servers < 1 || servers > 4096 || workers < 1 || workers > 65536 || partition < 1 ||
        staleness < 0 || staleness > 1000000 || !(step > 0)) {
      return InvalidArgumentError("calibration file line " + std::to_string(lineno) +
                                  ": want 'servers workers partition_bytes mode staleness "
                                  "step_us' with positive figures");
    }
    ASSIGN_OR_RETURN(Mode m, ParseMode(mode));
    MeasuredRun r;
    r.config.servers = static_cast<uint32_t>(servers);
    r.config.workers = static_cast<uint32_t>(workers);
    r.config.partition_bytes = static_cast<uint64_t>(partition);
    r.config.mode = m;
    r.config.staleness = static_cast<uint32_t>(staleness);
    r.config.machines = static_cast<uint32_t>(std::max(1, FLAGS_machines));
    r.step_us = step;
    out.push_back(r);
  }
  if (out.empty()) return InvalidArgumentError("calibration file " + path + ": no runs");
  return out;
}

// The host model's flags (docs/plan.md, "Hosts, links and hierarchical aggregation").
struct HostFlags {
  uint32_t hosts = 0, local_workers = 1, workers = 0;
  bool dedicated = true;
  std::vector<bool> placements;
};
StatusOr<HostFlags> ResolveHosts() {
  HostFlags f;
  f.workers = static_cast<uint32_t>(FLAGS_workers);
  const bool workers_given = !gflags::GetCommandLineFlagInfoOrDie("workers").is_default;
  if (FLAGS_workers < 1) return InvalidArgumentError("--workers must be >= 1");
  if (FLAGS_hosts < 0 || FLAGS_local_workers < 0) {
    return InvalidArgumentError("--hosts and --local_workers must be >= 0");
  }
  if (FLAGS_local_workers > 0 && FLAGS_hosts == 0) {
    return InvalidArgumentError("--local_workers needs --hosts");
  }
  if (FLAGS_hosts > 0) {
    f.hosts = static_cast<uint32_t>(FLAGS_hosts);
    if (FLAGS_local_workers > 0) {
      f.local_workers = static_cast<uint32_t>(FLAGS_local_workers);
      if (workers_given && f.workers != f.hosts * f.local_workers) {
        return InvalidArgumentError("--workers must equal --hosts x --local_workers");
      }
      f.workers = f.hosts * f.local_workers;
    } else {
      if (f.workers % f.hosts != 0) {
        return InvalidArgumentError("--workers must be a multiple of --hosts");
      }
      f.local_workers = f.workers / f.hosts;
    }
  } else if (FLAGS_link_Bps > 0 || FLAGS_hierarchical) {
    if (FLAGS_hierarchical) return InvalidArgumentError("--hierarchical needs --hosts");
    f.hosts = f.workers;  // a link rate without hosts: every worker on a host of its own
  }
  if (FLAGS_link_Bps < 0) return InvalidArgumentError("--link_Bps must be >= 0");
  if (FLAGS_link_duplex != "full" && FLAGS_link_duplex != "half") {
    return InvalidArgumentError("--link_duplex must be full or half");
  }
  if (FLAGS_placement == "dedicated") {
    f.placements = {true};
  } else if (FLAGS_placement == "colocated") {
    f.placements = {false};
  } else if (FLAGS_placement.empty()) {
    f.placements = {true, false};
  } else {
    return InvalidArgumentError("--placement must be dedicated or colocated");
  }
  f.dedicated = FLAGS_placement.empty() ? !FLAGS_colocated : FLAGS_placement == "dedicated";
  return f;
}

void PrintLinks(const Prediction& p) {
  if (p.config.hosts == 0) return;
  std::printf("link_bytes_per_step");
  for (double x : p.link_bytes) std::printf(" %.0f", x);
  std::printf("\nratio_to_model");
  for (double x : p.link_bytes) std::printf(" %.3f", p.model_bytes > 0 ? x / p.model_bytes : 0);
  std::printf("\n");
}

int Main() {
  auto hf = ResolveHosts();
  if (!hf.ok()) return Fail(hf.status());
  ProbeFile probe;
  if (FLAGS_probe) {
    ProbeOptions o;
    o.transport = FLAGS_transport;
    o.seconds_per_point = FLAGS_probe_seconds;
    if (FLAGS_probe_clients < 1 || FLAGS_probe_clients > 64) {
      return Fail(InvalidArgumentError("--probe_clients must be 1..64"));
    }
    o.max_spinners = FLAGS_probe_clients - 1;
    auto p = RunProbe(o);
    if (!p.ok()) return Fail(p.status());
    probe = *p;
    auto json = ProbeToJson(probe);
    if (!json.ok()) return Fail(json.status());
    if (!FLAGS_probe_out.empty()) {
      std::ofstream f(FLAGS_probe_out);
      f << *json;
      if (!f) return Fail(InternalError("cannot write " + FLAGS_probe_out));
    }
    std::printf("%s\n", json->c_str());
  } else if (!FLAGS_probe_file.empty()) {
    auto p = LoadProbeFile(FLAGS_probe_file);
    if (!p.ok()) return Fail(p.status());
    probe = *p;
  }
  if (FLAGS_model.empty() && !FLAGS_digits) {
    if (FLAGS_probe) return 0;
    return Fail(InvalidArgumentError("give --model=FILE or --digits"));
  }
  if (probe.pairs_size() == 0) return Fail(InvalidArgumentError("give --probe or --probe_file"));
  auto costs = CostsFromProbe(probe);
  if (!costs.ok()) return Fail(costs.status());
  if (FLAGS_cores > 0) costs->cores = FLAGS_cores;
  if (FLAGS_net_cpu_ns_per_byte < 0 || FLAGS_loopback_cpu_ns_per_byte < 0) {
    return Fail(InvalidArgumentError("--net_cpu_ns_per_byte and --loopback_cpu_ns_per_byte "
                                     "must be >= 0"));
  }
  costs->net_cpu_ns_per_byte = FLAGS_net_cpu_ns_per_byte;
  costs->loopback_cpu_ns_per_byte = FLAGS_loopback_cpu_ns_per_byte;
  Workload w;
  if (FLAGS_digits) {
    w.tensors = DigitsMlp(64, FLAGS_hidden, 10);
  } else {
    auto t = LoadModelFile(FLAGS_model);
    if (!t.ok()) return Fail(t.status());
    w.tensors = *t;
  }
  w.compute_us = FLAGS_compute_us > 0 ? FLAGS_compute_us : probe.host().compute_us();
  w.batch = static_cast<uint32_t>(FLAGS_batch);
  if (!FLAGS_calibrate_file.empty()) {
    auto runs = LoadCalibrationFile(FLAGS_calibrate_file);
    if (!runs.ok()) return Fail(runs.status());
    auto cal = CalibrateLeastSquares(w, *costs, *runs);
    if (!cal.ok()) return Fail(cal.status());
    Costs estimate = *costs;
    estimate.pair_cpu_us = 0;
    estimate.op_cpu_us = 0;
    std::printf("calibrated pair_cpu_us %.1f (the probe's own estimate %.1f), wait_cpu_us %.1f%s, "
                "op_cpu_us %.2f%s (the probe's %.2f) from %zu runs, rms relative residual "
                "%.1f%%\n",
                cal->pair_cpu_us, estimate.PairCpu(), cal->wait_cpu_us,
                cal->wait_fitted ? "" : " (not fitted: no bsp/ssp run)", cal->op_cpu_us,
                cal->op_fitted ? "" : " (not fitted)", estimate.OpCpu(), runs->size(),
                cal->rms_rel_residual * 100);
    costs->pair_cpu_us = cal->pair_cpu_us;
    costs->wait_cpu_us = cal->wait_cpu_us;
    costs->op_cpu_us = cal->op_fitted ? cal->op_cpu_us : 0;
    probe.mutable_host()->set_pair_cpu_us(cal->pair_cpu_us);
    probe.mutable_host()->set_wait_cpu_us(cal->wait_cpu_us);
    probe.mutable_host()->set_op_cpu_us(cal->op_fitted ? cal->op_cpu_us : 0);
    if (!FLAGS_probe_out.empty()) {
      auto json = ProbeToJson(probe);
      if (!json.ok()) return Fail(json.status());
      std::ofstream f(FLAGS_probe_out);
      f << *json;
      if (!f) return Fail(InternalError("cannot write " + FLAGS_probe_out));
    }
  }
  if (FLAGS_predict) {
    Config c;
    c.servers = FLAGS_servers;
    c.workers = hf->workers;
    c.machines = FLAGS_machines;
    c.colocated = FLAGS_colocated;
    c.hosts = hf->hosts;
    c.local_workers = hf->local_workers;
    c.hierarchical = FLAGS_hierarchical;
    c.servers_dedicated = hf->dedicated;
    c.link_Bps = FLAGS_link_Bps;
    c.link_full_duplex = FLAGS_link_duplex == "full";
    c.wire_overhead = FLAGS_wire_overhead;
    c.compute_cv = FLAGS_compute_cv;
    c.partition_bytes = FLAGS_partition_bytes;
    c.mode = FLAGS_mode == "asp" ? Mode::kAsp : FLAGS_mode == "ssp" ? Mode::kSsp : Mode::kBsp;
    if (FLAGS_mode != "asp" && FLAGS_mode != "ssp" && FLAGS_mode != "bsp") {
      return Fail(InvalidArgumentError("--mode must be bsp, ssp or asp"));
    }
    c.staleness = FLAGS_staleness;
    if (FLAGS_calibrate_step_us > 0) {
      auto v = Calibrate(w, *costs, c, FLAGS_calibrate_step_us);
      if (!v.ok()) return Fail(v.status());
      Costs estimate = *costs;
      if (c.mode == Mode::kAsp) {
        probe.mutable_host()->set_pair_cpu_us(*v);
        estimate.pair_cpu_us = 0;
        std::printf("calibrated pair_cpu_us %.1f (the probe's own estimate %.1f)\n", *v,
                    estimate.PairCpu());
        costs->pair_cpu_us = *v;
      } else {
        probe.mutable_host()->set_wait_cpu_us(*v);
        std::printf("calibrated wait_cpu_us %.1f\n", *v);
        costs->wait_cpu_us = *v;
      }
      if (!FLAGS_probe_out.empty()) {
        auto json = ProbeToJson(probe);
        if (!json.ok()) return Fail(json.status());
        std::ofstream f(FLAGS_probe_out);
        f << *json;
        if (!f) return Fail(InternalError("cannot write " + FLAGS_probe_out));
      }
    }
    auto p = Predict(w, *costs, c);
    if (!p.ok()) return Fail(p.status());
    std::printf("predicted_step_us %.1f samples_per_s %.0f | %s | %s\n", p->step_us,
                p->samples_per_s, c.Describe().c_str(), p->Why().c_str());
    PrintLinks(*p);
    if (c.hosts > 0 && c.local_workers > 1) {
      Config other = c;
      other.hierarchical = !c.hierarchical;
      auto q = Predict(w, *costs, other);
      if (!q.ok()) return Fail(q.status());
      std::printf("flat vs hierarchical: %s\n",
                  (c.hierarchical ? CompareHierarchy(*q, *p) : CompareHierarchy(*p, *q)).c_str());
    }
    return 0;
  }
  Budget b;
  b.machines = FLAGS_machines;
  b.cores = FLAGS_cores;
  b.workers = hf->workers;
  b.max_servers = FLAGS_max_servers;
  b.hosts = hf->hosts;
  b.local_workers = hf->local_workers;
  b.link_Bps = FLAGS_link_Bps;
  b.link_full_duplex = FLAGS_link_duplex == "full";
  b.wire_overhead = FLAGS_wire_overhead;
  b.compute_cv = FLAGS_compute_cv;
  b.placements = hf->placements;
  if (!gflags::GetCommandLineFlagInfoOrDie("hierarchical").is_default) {
    b.hierarchy = {FLAGS_hierarchical};
  }
  b.partitions.clear();
  std::stringstream ss(FLAGS_partitions);
  for (std::string x; std::getline(ss, x, ',');) b.partitions.push_back(std::stoull(x));
  auto ranked = Search(w, *costs, b);
  if (!ranked.ok()) return Fail(ranked.status());
  std::printf("model: %zu tensors; compute %.0f us/step; %u cores/machine; link: write "
              "alpha %.1f us op %.2f us beta %.0f MB/s, read alpha %.1f us op %.2f us beta %.0f "
              "MB/s\n",
              w.tensors.size(), w.compute_us, costs->cores, costs->write.alpha_us(),
              costs->write.op_us(), costs->write.beta_bps() / 1e6, costs->read.alpha_us(),
              costs->read.op_us(), costs->read.beta_bps() / 1e6);
  if (b.hosts > 0) {
    if (b.link_Bps > 0) {
      std::printf("hosts: %u x %u local workers; links %.3g Gbit/s, %s duplex\n", b.hosts,
                  b.local_workers, b.link_Bps * 8 / 1e9, FLAGS_link_duplex.c_str());
    } else {
      std::printf("hosts: %u x %u local workers; links not modelled (no --link_Bps)\n", b.hosts,
                  b.local_workers);
    }
  }
  std::printf("%-4s %-44s %10s %12s  %s\n", "rank", "configuration", "step_us", "samples/s",
              "why");
  for (size_t i = 0; i < ranked->size() && i < static_cast<size_t>(FLAGS_top); ++i) {
    const Prediction& p = (*ranked)[i];
    std::printf("%-4zu %-44s %10.1f %12.0f  %s\n", i + 1, p.config.Describe().c_str(), p.step_us,
                p.samples_per_s, p.Why().c_str());
  }
  const Prediction& best = ranked->front();
  std::printf("recommended: %s (%.0f samples/s, step %.1f us)\n", best.config.Describe().c_str(),
              best.samples_per_s, best.step_us);
  // Flat against hierarchical: the recommended configuration and its counterpart.
  if (b.hosts > 0 && b.local_workers > 1) {
    for (const Prediction& q : *ranked) {
      Config a = q.config, x = best.config;
      if (a.hierarchical == x.hierarchical) continue;
      a.hierarchical = x.hierarchical;
      if (a.Describe() != x.Describe()) continue;
      std::printf("flat vs hierarchical: %s\n",
                  (best.config.hierarchical ? CompareHierarchy(q, best) : CompareHierarchy(best, q))
                      .c_str());
      break;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  shardps::ParseCommandLine(
      &argc, &argv, "shardps_plan --probe | --probe_file=F (--model=F | --digits) ...", __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  return Main();
}
