// shardps plan: a performance model of a ShardPS cluster and a search over configurations.
// docs/plan.md states every equation used here.
//
//   inputs : the model (tensor shapes), compute time per step per worker, the link costs
//            (alpha, beta, per-op cost; from plan's own probe or doctor's probe file), the
//            server's update throughput and the host's CPU contention (plan's probe).
//   output : predicted step time and samples/s per configuration; the best one.
//
// Thread safety: free functions and plain structs; RunProbe starts and joins its own threads.
#ifndef SHARDPS_TOOLS_PLAN_H_
#define SHARDPS_TOOLS_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/shard_plan.h"
#include "tools/probe.pb.h"

namespace shardps::plan {

// Model file: one tensor per line, "name dim0 dim1 ...", '#' starts a comment.
StatusOr<std::vector<TensorSpec>> LoadModelFile(const std::string& path);
StatusOr<std::vector<TensorSpec>> ParseModel(const std::string& text);
// The digits trainer's MLP (features x hidden x classes), as examples/digits_trainer registers it.
std::vector<TensorSpec> DigitsMlp(int features, int hidden, int classes);

// Probe file (tools/probe.proto as JSON; doctor's "pairs" schema is a subset).
StatusOr<ProbeFile> LoadProbeFile(const std::string& path);
StatusOr<ProbeFile> ParseProbeJson(const std::string& json);
StatusOr<std::string> ProbeToJson(const ProbeFile& p);

struct ProbeOptions {
  std::string transport = "tcp";
  double seconds_per_point = 0.3;
  int max_spinners = 8;
};
// Measures on this host: one-sided write/read alpha, beta and per-op cost between two
// endpoints of two fabrics (loopback), the read round trip with k = 0..max_spinners threads
// spinning, and ChunkOptimizer::Apply / accumulation throughput.
StatusOr<ProbeFile> RunProbe(const ProbeOptions& o);

// The costs the predictor uses, reduced from a probe file.
struct Costs {
  OpCost write, read;
  uint32_t cores = 2;
  double apply_Bps = 1e9, add_Bps = 4e9;
  std::vector<double> spin_rtt_us;   // loaded round trip by clients - 1; empty: no contention
  std::vector<double> pair_step_us;   // loaded worker-server exchange by clients - 1
  std::vector<double> pair_step4_us;  // the same with 4 chunks: alone, at the last k
  double pair_cpu_us = 0;             // calibrated exchange CPU (0: from pair_step_us)
  double wait_cpu_us = 0;             // calibrated BSP wait CPU per exchange (0: c_rt)
  double op_cpu_us = 0;               // calibrated CPU of one more operation (0: from the probe)
  // Host memory throughput for the hierarchical local reduction (docs/plan.md): memcpy of a
  // buffer far larger than the caches (bytes copied per second) and dst += src over such
  // buffers (bytes of dst per second). The probe measures them; these defaults, when absent.
  double mem_copy_Bps = kDefaultMemCopyBps, mem_add_Bps = kDefaultMemAddBps;
  static constexpr double kDefaultMemCopyBps = 4e9, kDefaultMemAddBps = 2e9;
  // One hand-off between a host's processes through a shared futex (probe: local_hop_us).
  double local_hop_us = kDefaultLocalHopUs;
  static constexpr double kDefaultLocalHopUs = 10;
  // CPU (ns of one core, both ends together) per byte a client and a server exchange over a
  // host link (net) and within one host (loopback): the kernel's copies and protocol work, which
  // on emulated hosts (veth pairs, tbf and a bridge on one machine) cost ~1 ns a byte. Used only
  // with hosts (Config::hosts > 0); 0: not modelled. From --net_cpu_ns_per_byte /
  // --loopback_cpu_ns_per_byte (bench-hierarchy.py measures both with iperf3 on its fabric).
  double net_cpu_ns_per_byte = 0, loopback_cpu_ns_per_byte = 0;
  double Rtt(double spinners) const;  // interpolated, extrapolated linearly past the end
  double PairCpu() const;          // CPU of one worker-server exchange (docs/plan.md)
  double OpCpu() const;            // CPU of one more pipelined operation
  double ExchangeLatency() const;  // one exchange with the host to itself
  double OpLatency() const;        // one more pipelined operation in it
};
StatusOr<Costs> CostsFromProbe(const ProbeFile& p);

enum class Mode { kBsp, kSsp, kAsp };
const char* ModeName(Mode m);

struct Config {
  uint32_t servers = 1;
  uint32_t workers = 1;
  uint32_t machines = 1;
  bool colocated = true;  // servers share machines with workers (always, on one machine)
  uint64_t partition_bytes = 4u << 20;
  Mode mode = Mode::kBsp;
  uint32_t staleness = 0;
  // Network hosts and links (issue 18; docs/plan.md, "Hosts, links and hierarchical
  // aggregation"). hosts = 0: no host model (the predictions of before). Otherwise workers must
  // be hosts x local_workers. machines = 1: the hosts are emulated on one machine (network
  // namespaces) and share its cores, `colocated` is the CPU placement as without hosts;
  // machines > 1: each host is a machine of its own and the CPU placement follows
  // servers_dedicated.
  uint32_t hosts = 0;
  uint32_t local_workers = 1;     // workers per host
  bool hierarchical = false;      // one aggregator per host pushes and pulls for its workers
  bool servers_dedicated = true;  // network placement: servers on hosts of their own, or
                                  // server s on worker host s mod hosts (colocated)
  double link_Bps = 0;            // each host's NIC, bytes/s; 0: links not modelled
  bool link_full_duplex = true;   // false: a link's rate is shared by both directions
  double wire_overhead = kDefaultWireOverhead;  // bytes below the transport (TCP/IP/Ethernet
                                                // headers, TCP acks) per transport byte
  double compute_cv = 0;  // coefficient of variation of compute (straggler wait); 0: none
  // Default 0: transport bytes only. The veth counters of the first emulated-host benchmark run
  // (segmentation offload: a header per super-packet) matched that best (docs/plan.md).
  static constexpr double kDefaultWireOverhead = 0;
  // A link without offload, MTU 1500: 66 B of Ethernet/IP/TCP headers per 1448-byte segment and
  // a 66 B TCP ack per two segments of the opposite direction.
  static constexpr double kMtu1500WireOverhead = 99.0 / 1448;
  std::string Describe() const;
};

struct Workload {
  std::vector<TensorSpec> tensors;
  double compute_us = 0;   // per step per worker, measured alone on one core
  uint32_t batch = 32;     // samples per worker per step
};

struct Prediction {
  Config config;
  double step_us = 0;        // per worker step
  double samples_per_s = 0;  // cluster-wide
  // The terms (docs/plan.md): compute, push, pull, barrier, the busiest server, the CPU bound.
  double compute_us = 0, push_us = 0, pull_us = 0, barrier_us = 0, server_us = 0, cpu_us = 0;
  uint32_t busiest_server = 0;
  double imbalance = 1;
  uint32_t chunks = 0;
  std::string bound;  // which term set the step time
  // With hosts (config.hosts > 0): the local reduction (hierarchical), the straggler wait, the
  // link time of the push and pull phases on the busiest link, and the bytes each host's link
  // carries per step (both directions; worker hosts 0..hosts-1, then dedicated server hosts).
  double reduce_us = 0, hop_us = 0, straggler_us = 0, link_push_us = 0, link_pull_us = 0;
  // The CPU of the bytes exchanged (Costs::net_cpu_ns_per_byte), per step: on the busiest
  // worker host's client side and on the busiest server host's side (part of cpu_us).
  double net_cpu_worker_us = 0, net_cpu_server_us = 0;
  double model_bytes = 0;
  std::vector<double> link_bytes;
  double WorkerLinkBytes() const;   // the busiest worker host's link, bytes per step
  double BusiestLinkBytes() const;  // any host's
  std::string Why() const;
};

StatusOr<Prediction> Predict(const Workload& w, const Costs& c, const Config& cfg);

// Flat against hierarchical for the same configuration (docs/plan.md): which is predicted
// faster and why, in one sentence, e.g. "hierarchical: a worker host's link carries 2.1x model
// bytes per step instead of 8.5x; predicted 2.90x faster at 1 Gbit/s".
std::string CompareHierarchy(const Prediction& flat, const Prediction& hier);

struct Budget {
  uint32_t machines = 1;
  uint32_t cores = 2;  // per machine (overrides the probe's)
  uint32_t workers = 4;  // data-parallel workers to place (fixed by the job)
  uint32_t max_servers = 4;
  std::vector<uint64_t> partitions = {4096, 16384, 65536, 1u << 20, 4u << 20};
  std::vector<std::pair<Mode, uint32_t>> modes = {
      {Mode::kBsp, 0}, {Mode::kSsp, 1}, {Mode::kSsp, 2}, {Mode::kSsp, 4}, {Mode::kAsp, 0}};
  // Hosts (0: none). With hosts, `workers` must be hosts x local_workers; the search tries
  // flat and hierarchical (when local_workers > 1, unless `hierarchy` fixes one) and the
  // network placements in `placements` (true: dedicated server hosts).
  uint32_t hosts = 0, local_workers = 1;
  double link_Bps = 0;
  bool link_full_duplex = true;
  double wire_overhead = Config::kDefaultWireOverhead;
  double compute_cv = 0;
  std::vector<bool> placements = {true, false};
  std::vector<bool> hierarchy = {false, true};
};
// Calibration from real runs (docs/plan.md): the value of c.pair_cpu_us (cfg ASP) or of
// c.wait_cpu_us (cfg BSP/SSP) that makes Predict(cfg)'s host-CPU term equal a measured step
// time (the term is linear in either); cfg must be CPU-bound (more workers than cores).
StatusOr<double> Calibrate(const Workload& w, Costs c, const Config& cfg, double measured_step_us);

// Calibration from several real runs (docs/plan.md, what scripts/bench-plan.sh does): the
// values of c.pair_cpu_us, c.wait_cpu_us and c.op_cpu_us that minimise the sum of squared
// relative errors of Predict's host-CPU term over `runs` (the term is linear in all three: a
// 3 x 3 least squares). When that system is singular or gives a non-positive value, the per-op
// CPU stays the probe's and the other two are fitted (op_fitted false); without a BSP/SSP run
// the wait CPU is not fitted either (wait_fitted false, c's value kept). Every run must be
// CPU-bound (more workers than cores); a non-positive solution is an error.
struct MeasuredRun {
  Config config;
  double step_us = 0;
};
struct Calibration {
  double pair_cpu_us = 0, wait_cpu_us = 0, op_cpu_us = 0;
  bool wait_fitted = false, op_fitted = false;
  double rms_rel_residual = 0;  // of the fitted CPU term over the runs
};
StatusOr<Calibration> CalibrateLeastSquares(const Workload& w, Costs c,
                                            const std::vector<MeasuredRun>& runs);

// Every configuration within the budget, ranked best (highest samples/s) first.
StatusOr<std::vector<Prediction>> Search(const Workload& w, Costs c, const Budget& b);

}  // namespace shardps::plan

#endif  // SHARDPS_TOOLS_PLAN_H_
