#include "tools/plan.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

namespace shardps::plan {

// ---- model -----------------------------------------------------------------------------------

StatusOr<std::vector<TensorSpec>> ParseModel(const std::string& text) {
  std::vector<TensorSpec> out;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream ls(line);
    TensorSpec t;
    if (!(ls >> t.name)) continue;  // blank
    std::string d;
    while (ls >> d) {
      char* end = nullptr;
      const long long v = std::strtoll(d.c_str(), &end, 10);
      if (*end != '\0' || v <= 0 || v > (1LL << 40)) {
        return InvalidArgumentError("model line " + std::to_string(lineno) + ": dimension '" + d +
                                    "' is not a positive integer");
      }
      t.shape.push_back(v);
    }
    if (t.shape.empty()) {
      return InvalidArgumentError("model line " + std::to_string(lineno) + ": tensor '" + t.name +
                                  "' has no dimensions");
    }
    out.push_back(std::move(t));
  }
  if (out.empty()) return InvalidArgumentError("model: no tensors");
  return out;
}

StatusOr<std::vector<TensorSpec>> LoadModelFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("cannot open model file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseModel(ss.str());
}

std::vector<TensorSpec> DigitsMlp(int features, int hidden, int classes) {
  // The names and order of examples/digits_model (fc1 then fc2, weight then bias).
  auto t = [](const char* n, std::vector<int64_t> s) {
    TensorSpec x;
    x.name = n;
    x.shape = std::move(s);
    return x;
  };
  return {t("fc1.weight", {hidden, features}), t("fc1.bias", {hidden}),
          t("fc2.weight", {classes, hidden}), t("fc2.bias", {classes})};
}

// ---- probe file ------------------------------------------------------------------------------

StatusOr<ProbeFile> ParseProbeJson(const std::string& json) {
  ProbeFile p;
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = true;  // doctor may add fields
  auto st = google::protobuf::util::JsonStringToMessage(json, &p, o);
  if (!st.ok()) return InvalidArgumentError("probe file: " + std::string(st.ToString()));
  return p;
}

StatusOr<ProbeFile> LoadProbeFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("cannot open probe file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseProbeJson(ss.str());
}

StatusOr<std::string> ProbeToJson(const ProbeFile& p) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.add_whitespace = true;
  auto st = google::protobuf::util::MessageToJsonString(p, &out, o);
  if (!st.ok()) return InternalError("probe to json: " + std::string(st.ToString()));
  return out;
}

namespace {
double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
bool Sane(const OpCost& c) {
  return std::isfinite(c.alpha_us()) && c.alpha_us() > 0 && std::isfinite(c.beta_bps()) &&
         c.beta_bps() > 0;
}
}  // namespace

StatusOr<Costs> CostsFromProbe(const ProbeFile& p) {
  // Several pairs (doctor probes every pair): the median of each figure. A pair without op_us
  // gets alpha / 8 (eight operations overlap in a window): an assumption, stated in plan.md.
  std::vector<double> wa, wb, wo, ra, rb, ro;
  for (const Pair& pr : p.pairs()) {
    // A pair doctor could not measure ("ok": false, figures null) is left out.
    if (!Sane(pr.write()) || !Sane(pr.read())) continue;
    wa.push_back(pr.write().alpha_us());
    wb.push_back(pr.write().beta_bps());
    wo.push_back(pr.write().op_us() > 0 ? pr.write().op_us() : pr.write().alpha_us() / 8);
    ra.push_back(pr.read().alpha_us());
    rb.push_back(pr.read().beta_bps());
    ro.push_back(pr.read().op_us() > 0 ? pr.read().op_us() : pr.read().alpha_us() / 8);
  }
  if (wa.empty()) {
    return InvalidArgumentError("probe file: no pair with positive alpha_us and beta_Bps");
  }
  Costs c;
  c.write.set_alpha_us(Median(wa));
  c.write.set_beta_bps(Median(wb));
  c.write.set_op_us(Median(wo));
  c.read.set_alpha_us(Median(ra));
  c.read.set_beta_bps(Median(rb));
  c.read.set_op_us(Median(ro));
  const HostProbe& h = p.host();
  if (h.cores() > 0) c.cores = h.cores();
  if (h.apply_bps() > 0) c.apply_Bps = h.apply_bps();
  if (h.add_bps() > 0) c.add_Bps = h.add_bps();
  c.spin_rtt_us.assign(h.spin_rtt_us().begin(), h.spin_rtt_us().end());
  c.pair_step_us.assign(h.pair_step_us().begin(), h.pair_step_us().end());
  c.pair_step4_us.assign(h.pair_step4_us().begin(), h.pair_step4_us().end());
  c.pair_cpu_us = h.pair_cpu_us();
  c.wait_cpu_us = h.wait_cpu_us();
  c.op_cpu_us = h.op_cpu_us();
  if (h.mem_copy_bps() > 0) c.mem_copy_Bps = h.mem_copy_bps();
  if (h.mem_add_bps() > 0) c.mem_add_Bps = h.mem_add_bps();
  if (h.local_hop_us() > 0) c.local_hop_us = h.local_hop_us();
  return c;
}

double Costs::PairCpu() const {
  if (pair_cpu_us > 0) return pair_cpu_us;
  // Once the host is saturated (more clients than cores) an exchange's wall time times cores
  // over clients is its CPU cost; the median over those points (the host is shared, the
  // probe's points are noisy).
  std::vector<double> v;
  for (size_t i = 0; i < pair_step_us.size(); ++i) {
    if (i + 1 > cores) v.push_back(cores * pair_step_us[i] / (i + 1));
  }
  if (!v.empty()) return Median(v);
  if (!pair_step_us.empty()) return pair_step_us.back();
  return ExchangeLatency();
}

// The probe's exchange has 6.5 operations with one chunk, 23 with four.
constexpr double kProbeOps1 = 6.5, kProbeOps4 = 23;

double Costs::OpCpu() const {
  if (op_cpu_us > 0) return op_cpu_us;
  if (pair_step4_us.size() == 2 && pair_step_us.size() > cores) {
    const double n = pair_step_us.size();
    const double d = cores * (pair_step4_us[1] - pair_step_us.back()) / n;
    return std::max(0.0, d / (kProbeOps4 - kProbeOps1));
  }
  return 0.5 * (write.op_us() + read.op_us());
}

double Costs::ExchangeLatency() const {
  if (!pair_step_us.empty()) return pair_step_us[0];
  return 1.5 * write.alpha_us() + read.alpha_us() + kProbeOps1 * 0.5 * (write.op_us() + read.op_us());
}

double Costs::OpLatency() const {
  if (pair_step4_us.size() == 2 && !pair_step_us.empty()) {
    return std::max(0.0, (pair_step4_us[0] - pair_step_us[0]) / (kProbeOps4 - kProbeOps1));
  }
  return 0.5 * (write.op_us() + read.op_us());
}

double Costs::Rtt(double k) const {
  // The link's own round trip, plus what k spinning threads on the host add to it (measured
  // on this host by the probe; a doctor file without it: no contention term).
  const double base = read.alpha_us();
  if (spin_rtt_us.size() < 2 || k <= 0) return base;
  const double n = static_cast<double>(spin_rtt_us.size() - 1);
  double extra;
  if (k <= n) {
    const size_t i = static_cast<size_t>(std::floor(k));
    const double f = k - i;
    const double hi = i + 1 < spin_rtt_us.size() ? spin_rtt_us[i + 1] : spin_rtt_us[i];
    extra = spin_rtt_us[i] * (1 - f) + hi * f - spin_rtt_us[0];
  } else {
    const double slope = spin_rtt_us.back() - spin_rtt_us[spin_rtt_us.size() - 2];
    extra = spin_rtt_us.back() - spin_rtt_us[0] + slope * (k - n);
  }
  return base + std::max(0.0, extra);
}

// ---- predictor -------------------------------------------------------------------------------

const char* ModeName(Mode m) {
  return m == Mode::kBsp ? "bsp" : m == Mode::kSsp ? "ssp" : "asp";
}

std::string Config::Describe() const {
  std::ostringstream os;
  os << servers << "s x " << workers << "w";
  if (machines > 1 && hosts == 0) {
    os << " on " << machines << " machines" << (colocated ? " colocated" : " apart");
  }
  os << ", partition ";
  if (partition_bytes >= (1u << 20) && partition_bytes % (1u << 20) == 0) {
    os << (partition_bytes >> 20) << "M";
  } else if (partition_bytes % 1024 == 0) {
    os << (partition_bytes >> 10) << "K";
  } else {
    os << partition_bytes;
  }
  os << ", " << ModeName(mode);
  if (mode == Mode::kSsp) os << "(s=" << staleness << ")";
  if (hosts > 0) {
    os << ", " << hosts << "h x " << local_workers << "l " << (hierarchical ? "hier" : "flat")
       << " " << (servers_dedicated ? "dedicated" : "colocated")
       << (machines > 1 ? "" : " (one machine)");
  }
  return os.str();
}

double Prediction::WorkerLinkBytes() const {
  double m = 0;
  for (uint32_t h = 0; h < config.hosts && h < link_bytes.size(); ++h)
    m = std::max(m, link_bytes[h]);
  return m;
}

double Prediction::BusiestLinkBytes() const {
  double m = 0;
  for (double x : link_bytes) m = std::max(m, x);
  return m;
}

std::string Prediction::Why() const {
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "bound: %s; compute %.0f + push %.0f + barrier %.0f + pull %.0f us; busiest "
                "server %u %.0f us (imbalance %.2f, %u chunks); cpu %.0f us",
                bound.c_str(), compute_us, push_us, barrier_us, pull_us, busiest_server, server_us,
                imbalance, chunks, cpu_us);
  std::string out = buf;
  if (config.hosts > 0) {
    std::snprintf(buf, sizeof(buf),
                  "; reduce %.0f + hops %.0f + straggler %.0f us; link push %.0f + pull %.0f "
                  "us; worker link %.2fx model, busiest link %.2fx",
                  reduce_us, hop_us, straggler_us, link_push_us, link_pull_us,
                  model_bytes > 0 ? WorkerLinkBytes() / model_bytes : 0,
                  model_bytes > 0 ? BusiestLinkBytes() / model_bytes : 0);
    out += buf;
    if (net_cpu_worker_us + net_cpu_server_us > 0) {
      std::snprintf(buf, sizeof(buf), "; bytes' cpu %.0f (clients) + %.0f (servers) us",
                    net_cpu_worker_us, net_cpu_server_us);
      out += buf;
    }
  }
  return out;
}

namespace {

// Transport bytes per step between one client (a worker, or a host's aggregator) and one server
// holding n chunks of b bytes, on the tcp provider (transport/tcp/tcp_wire.h: a 40-byte frame
// header on every request and response) with the operations of worker/ (push_pipeline.cc,
// pull_pipeline.cc, server_sessions.cc). docs/plan.md derives them.
struct PairBytes {
  double push_out = 0, push_in = 0, pull_out = 0, pull_in = 0;  // seen from the client
};
constexpr double kFrameBytes = 40, kPushHeaderBytes = 128, kChunkHeaderBytes = 64,
                 kAckWordsBytes = 64, kClockBytes = 8;
// `wasted`: the fraction of chunk pulls whose first data read is wasted (pull_pipeline.cc posts
// header, data, header back to back; a chunk not yet at the consistency bound is read again,
// data and header, once it is): under BSP every client but the last to push, (1 - 1/K).
PairBytes ClientServerBytes(double n, double b, double wasted) {
  PairBytes x;
  // Push: per chunk the data write and the header write-with-immediate (PushHeader), an ack
  // read every other step; one clock write per server. Back: one coalesced ACK frame per
  // chunk, the ack read's response every other step, the clock's ACK.
  x.push_out = b + n * (kFrameBytes + kFrameBytes + kPushHeaderBytes + 0.5 * kFrameBytes) +
               kFrameBytes + kClockBytes;
  x.push_in = n * (kFrameBytes + 0.5 * (kFrameBytes + kAckWordsBytes)) + kFrameBytes;
  // Pull: three read requests per chunk (header, buffer, header); their responses.
  x.pull_out = n * 3 * kFrameBytes;
  x.pull_in = b + n * (3 * kFrameBytes + 2 * kChunkHeaderBytes);
  // The second read of a wasted pull: data and header requests, their responses.
  x.pull_out += wasted * n * 2 * kFrameBytes;
  x.pull_in += wasted * (b + n * (2 * kFrameBytes + kChunkHeaderBytes));
  return x;
}

// sqrt(2 ln n): the expected maximum of n standard normal samples, roughly (n >= 2).
double MaxOfNormals(double n) { return n >= 2 ? std::sqrt(2 * std::log(n)) : 0; }

}  // namespace

StatusOr<Prediction> Predict(const Workload& w, const Costs& c, const Config& cfg) {
  if (cfg.servers == 0 || cfg.workers == 0 || cfg.machines == 0) {
    return InvalidArgumentError("plan: servers, workers and machines must be >= 1");
  }
  if (!cfg.colocated && cfg.machines < 2 && cfg.hosts == 0) {
    return InvalidArgumentError("plan: servers apart from workers needs >= 2 machines");
  }
  if (cfg.hosts > 0 && (cfg.local_workers == 0 || cfg.hosts * cfg.local_workers != cfg.workers)) {
    return InvalidArgumentError("plan: workers must be hosts x local_workers");
  }
  if (cfg.hosts == 0 && (cfg.hierarchical || cfg.link_Bps > 0)) {
    return InvalidArgumentError("plan: --hierarchical and --link_Bps need --hosts");
  }
  if (!(cfg.link_Bps >= 0) || !(cfg.wire_overhead >= 0) || !(cfg.compute_cv >= 0)) {
    return InvalidArgumentError("plan: link_Bps, wire_overhead and compute_cv must be >= 0");
  }
  ASSIGN_OR_RETURN(ShardPlan sp, PlanShards(w.tensors, cfg.servers, cfg.partition_bytes));
  const double S = cfg.servers, W = cfg.workers, C = std::max<uint32_t>(1, c.cores);
  const bool hier = cfg.hierarchical;
  const double H = cfg.hosts, L = cfg.hosts > 0 ? cfg.local_workers : 1;
  // The processes that talk to the servers: every worker (flat), or one aggregator per host.
  const double K = hier ? H : W;
  // Placement: round robin; apart: servers on min(S, M-1) machines, workers on the rest.
  // One link model serves local and remote pairs alike (the probe's median; docs/plan.md).
  double ws_host, ss_host;  // workers / servers on the busiest host
  double worker_machines;
  // With hosts on machines of their own (machines > 1), the CPU placement is the network's:
  // each worker host a machine; servers on machines of their own (dedicated) or on the worker
  // hosts, server s on host s mod hosts. machines = 1: emulated hosts sharing one machine.
  const bool real_hosts = cfg.hosts > 0 && cfg.machines > 1;
  const bool cpu_colocated = real_hosts ? !cfg.servers_dedicated : cfg.colocated;
  if (real_hosts) {
    worker_machines = cfg.hosts;
    ss_host = cfg.servers_dedicated ? 1 : std::ceil(S / cfg.hosts);
  } else if (cfg.colocated) {
    worker_machines = cfg.machines;
    ss_host = std::ceil(S / cfg.machines);
  } else {
    const double ms = std::min<double>(S, cfg.machines - 1);
    worker_machines = cfg.machines - ms;
    ss_host = std::ceil(S / ms);
  }
  ws_host = std::ceil(W / worker_machines);
  // Hierarchical: whole hosts (an aggregator and its L workers) per machine.
  const double hosts_per_machine = hier ? std::ceil(H / worker_machines) : 0;
  if (hier) ws_host = hosts_per_machine * L;

  std::vector<double> n(cfg.servers, 0), b(cfg.servers, 0);
  for (const auto& ch : sp.chunks) {
    n[ch.server] += 1;
    b[ch.server] += static_cast<double>(ch.bytes);
  }
  double chunks = 0, bytes = 0;
  for (uint32_t s = 0; s < cfg.servers; ++s) {
    chunks += n[s];
    bytes += b[s];
  }

  Prediction p;
  p.config = cfg;
  p.chunks = static_cast<uint32_t>(chunks);
  p.imbalance = sp.imbalance();
  p.model_bytes = bytes;
  // Operations per client per step (worker/client_impl.h): a push is a data write and a header
  // write-with-immediate per chunk plus an ack read every other push; one clock write per
  // server; a pull is three reads per chunk (header, buffer, header).
  const double push_ops = 2.5 * chunks + S;
  const double pull_ops = 3 * chunks;
  // Round trips per client-server pair per step: the push (1), the ack read (every other step,
  // 0.5), the pull (1); under BSP a pull that finds the version not yet ready is retried (1),
  // under SSP(s) one step in s+1 waits, under ASP none.
  const double retry = cfg.mode == Mode::kBsp   ? 1.0
                       : cfg.mode == Mode::kSsp ? 1.0 / (cfg.staleness + 1)
                                                : 0.0;
  const double rts = 2.5 + (K > 1 ? retry : 0.0);
  const double op_lat = c.OpLatency(), c_op = c.OpCpu(), x0 = c.ExchangeLatency();

  // (1) The latency path of one client's step with the host to itself: the probe's exchange
  // (2.5 round trips, 6.5 operations; exchanges with all servers overlap) plus the client's
  // further operations, serialized through its one thread, plus the bytes.
  const double rtt0 = c.Rtt(0);
  p.compute_us = w.compute_us;
  // Hierarchical: a host's L workers are released together by its aggregator's pull, and the
  // aggregators of all hosts pull the same version at about the same time, so the workers of a
  // machine compute at once and share its cores (flat workers' pulls end one after another as
  // the links serve them, so their computes overlap the others' transfers instead).
  if (hier && ws_host > C) p.compute_us = w.compute_us * ws_host / C;
  p.push_us = 0.6 * x0 + std::max(0.0, push_ops - 3.5) * op_lat + bytes / c.write.beta_bps() * 1e6;
  p.pull_us = 0.4 * x0 + std::max(0.0, pull_ops - 3) * op_lat + bytes / c.read.beta_bps() * 1e6;
  // (4) Links (hosts given): the bytes each host's link carries per phase, both directions; a
  // phase takes at least its busiest link's bytes over the link rate (full duplex: the larger
  // direction; half: their sum). Clients per worker host: L flat, 1 (the aggregator) hier.
  const double push_lat = p.push_us, pull_lat = p.pull_us;
  if (cfg.hosts > 0) {
    const uint32_t nh = cfg.hosts + (cfg.servers_dedicated ? cfg.servers : 0);
    std::vector<double> push_out(nh, 0), push_in(nh, 0), pull_out(nh, 0), pull_in(nh, 0);
    const double per_host = hier ? 1 : L;
    // Under BSP (SSP: one step in s+1) a client's first pull is posted before the last of the K
    // clients' pushes is applied. The pull reads the header alone first when its previous pull
    // found the chunk not ready (worker/pull_pipeline.cc, ChunkPull::speculate), so the data is
    // read twice only when a client that was last to push one step is not the next: with a
    // random last pusher, (1/K)(1 - 1/K) of the pulls. The header-only re-reads while it waits
    // are not counted (a few hundred bytes each).
    const double wasted = K > 1 ? retry * (1 / K) * (1 - 1 / K) : 0.0;
    // The CPU of these bytes (Costs::net_cpu_ns_per_byte): half on the client's host, half on
    // the server's; a server on the client's own host is reached over loopback (no link).
    std::vector<double> client_cpu(nh, 0), server_cpu(nh, 0);
    for (uint32_t h = 0; h < cfg.hosts; ++h) {
      for (uint32_t s = 0; s < cfg.servers; ++s) {
        const uint32_t sh = cfg.servers_dedicated ? cfg.hosts + s : s % cfg.hosts;
        const PairBytes x = ClientServerBytes(n[s], b[s], wasted);
        const double ns = sh == h ? c.loopback_cpu_ns_per_byte : c.net_cpu_ns_per_byte;
        const double cpu_us =
            0.5 * per_host * (x.push_out + x.push_in + x.pull_out + x.pull_in) * ns * 1e-3;
        client_cpu[h] += cpu_us;
        server_cpu[sh] += cpu_us;
        if (sh == h) continue;
        const double f = per_host * (1 + cfg.wire_overhead);
        push_out[h] += f * x.push_out;
        push_in[h] += f * x.push_in;
        pull_out[h] += f * x.pull_out;
        pull_in[h] += f * x.pull_in;
        push_in[sh] += f * x.push_out;
        push_out[sh] += f * x.push_in;
        pull_in[sh] += f * x.pull_out;
        pull_out[sh] += f * x.pull_in;
      }
    }
    // Emulated hosts (one machine) share its cores: all of it; real hosts: the busiest.
    for (uint32_t h = 0; h < nh; ++h) {
      const bool one_machine = cfg.machines <= 1;
      p.net_cpu_worker_us = one_machine ? p.net_cpu_worker_us + client_cpu[h]
                                        : std::max(p.net_cpu_worker_us, client_cpu[h]);
      p.net_cpu_server_us = one_machine ? p.net_cpu_server_us + server_cpu[h]
                                        : std::max(p.net_cpu_server_us, server_cpu[h]);
    }
    p.link_bytes.resize(nh);
    double push_max = 0, pull_max = 0;
    for (uint32_t h = 0; h < nh; ++h) {
      p.link_bytes[h] = push_out[h] + push_in[h] + pull_out[h] + pull_in[h];
      const double ph =
          cfg.link_full_duplex ? std::max(push_out[h], push_in[h]) : push_out[h] + push_in[h];
      const double pl =
          cfg.link_full_duplex ? std::max(pull_out[h], pull_in[h]) : pull_out[h] + pull_in[h];
      push_max = std::max(push_max, ph);
      pull_max = std::max(pull_max, pl);
    }
    if (cfg.link_Bps > 0) {
      p.link_push_us = push_max / cfg.link_Bps * 1e6;
      p.link_pull_us = pull_max / cfg.link_Bps * 1e6;
      p.push_us = std::max(p.push_us, p.link_push_us);
      p.pull_us = std::max(p.pull_us, p.link_pull_us);
      // Except where dedicated servers' links carry more than any worker host's: there the
      // aggregators (more of them than servers) share a server's link, it serves them one
      // after another, and a host's workers compute while the next hosts are served; only one
      // host's L workers share the cores at a time.
      if (hier && cfg.servers_dedicated && cfg.hosts > cfg.servers &&
          p.BusiestLinkBytes() > p.WorkerLinkBytes() * 1.01) {
        p.compute_us = w.compute_us * std::max(1.0, L / C);
      }
    }
  }
  // (5) Hierarchical: the local reduction through the host's memory, taken as serial memory
  // traffic (worker/host_client.cc, worker/aggregator.cc): L gradients copied into shared
  // memory, local rank 0's copied into the sum, L - 1 adds, L weight copies out.
  // Two more hops on the path: the last local worker's bell wakes the aggregator, the
  // aggregator's bell wakes the workers (worker/host_group.h).
  if (hier) {
    p.reduce_us = ((2 * L + 1) * bytes / c.mem_copy_Bps + (L - 1) * bytes / c.mem_add_Bps) * 1e6;
    p.hop_us = 2 * c.local_hop_us;
  }
  // The straggler wait (compute_cv > 0): the slowest of the workers one waits for, beyond the
  // mean: BSP waits for all W (r = 1), SSP one step in s+1; the hierarchical local workers wait
  // for their host's L in every mode (the aggregator sums them all).
  {
    const double r = W > 1 ? retry : 0.0;
    const double g = hier ? r * MaxOfNormals(W) + (1 - r) * MaxOfNormals(L) : r * MaxOfNormals(W);
    p.straggler_us = cfg.compute_cv * w.compute_us * g;
  }
  // (2) The busiest server, serially: its half of the CPU of every client's operations to it,
  // K gradients accumulated, one apply.
  for (uint32_t s = 0; s < cfg.servers; ++s) {
    const double ops = K * (5.5 * n[s] + 1);
    const double t = ops * 0.5 * c_op + K * b[s] / c.add_Bps * 1e6 + b[s] / c.apply_Bps * 1e6;
    if (t > p.server_us) {
      p.server_us = t;
      p.busiest_server = s;
    }
  }
  // BSP: a pull waits for the slowest client's push to be applied: the busiest server's work
  // beyond our own push, plus the retried pull's round trip; SSP(s) waits one step in s+1.
  p.barrier_us = K > 1 ? retry * (std::max(0.0, p.server_us - p.push_us) + rtt0) : 0.0;
  const double path =
      p.compute_us + p.straggler_us + p.reduce_us + p.hop_us + p.push_us + p.barrier_us + p.pull_us;
  // (3) CPU of the busiest host per step over its cores. Every client-server exchange costs CPU
  // on both ends (system calls, wake-ups of the progress and apply threads): c_pair per
  // exchange of one chunk (the probe's pair step on a saturated host: cores x its mean time /
  // clients), c_op per further pipelined operation (chunks beyond one), c_rt per retried pull
  // round trip (BSP/SSP waits).
  const double kmax = c.spin_rtt_us.empty() ? 0 : c.spin_rtt_us.size() - 1;
  const double c_rt = c.wait_cpu_us > 0      ? c.wait_cpu_us
                      : c.spin_rtt_us.empty() ? 2 * rtt0
                                              : C * c.Rtt(kmax) / (kmax + 1);
  const double c_pair = c.PairCpu();
  const double extra_ops_pair = std::max(0.0, (push_ops + pull_ops) / S - 6.5);
  // SSP on an oversubscribed host: fair CPU sharing drifts the workers apart until the leader
  // sits at the bound, and from then on it waits every step as under BSP (the validation
  // measured SSP no faster than BSP here back to back; interleaved, 20-30% faster: known
  // error, docs/plan.md); SSP's 1/(s+1) only holds for transient stragglers.
  const double r_cpu = cfg.mode == Mode::kSsp && K > 1 && ws_host > C ? 1.0 : (rts - 2.5);
  // The wait is charged per exchange (per server). A pull whose chunk is not ready re-reads
  // that chunk's header (ClientImpl::EvaluatePull), but charged per chunk, 1 server x 7 chunks
  // came out 47-84% high in all three validation runs refitted offline (docs/plan.md).
  const double per_pair = c_pair + extra_ops_pair * c_op + r_cpu * c_rt;
  double server_bytes_cpu = 0;  // all servers: accumulate K gradients, apply once
  for (uint32_t s = 0; s < cfg.servers; ++s) {
    server_bytes_cpu += K * b[s] / c.add_Bps * 1e6 + b[s] / c.apply_Bps * 1e6;
  }
  // An exchange's CPU is split between the client's and the server's side (half each); every
  // client talks to every server. Colocated: the busiest host has ws_host workers (each in S
  // exchanges) and ss_host servers (each in K). Apart: a worker host and a server host.
  // Hierarchical: per host L workers computing and copying (they wait blocked on futexes, no
  // CPU), the aggregator's copies, adds and S exchanges, and 2 L hand-offs (each worker rings
  // the aggregator once and is woken once), each costing a hop's time in CPU.
  double worker_side =
      hier ? hosts_per_machine *
                 (L * w.compute_us + p.reduce_us + 2 * L * c.local_hop_us + 0.5 * S * per_pair)
           : ws_host * (w.compute_us + 0.5 * S * per_pair);
  const double server_side =
      ss_host * (0.5 * K * per_pair + server_bytes_cpu / S) + p.net_cpu_server_us;
  worker_side += p.net_cpu_worker_us;
  p.cpu_us =
      cpu_colocated ? (worker_side + server_side) / C : std::max(worker_side, server_side) / C;
  p.step_us = path;
  p.bound = "latency path";
  // The link set the path when it, not the latency, set a phase's time.
  if (p.link_push_us > push_lat || p.link_pull_us > pull_lat) p.bound = "link";
  if (p.server_us > p.step_us) {
    p.step_us = p.server_us;
    p.bound = "busiest server";
  }
  if (p.cpu_us > p.step_us) {
    p.step_us = p.cpu_us;
    p.bound = "host cpu";
  }
  p.samples_per_s = W * w.batch / p.step_us * 1e6;
  return p;
}

std::string CompareHierarchy(const Prediction& flat, const Prediction& hier) {
  char buf[400];
  const double m = flat.model_bytes > 0 ? flat.model_bytes : 1;
  const bool hier_wins = hier.step_us < flat.step_us;
  const double speedup = hier_wins ? flat.step_us / hier.step_us : hier.step_us / flat.step_us;
  const Config& c = flat.config;
  std::string rate;
  if (c.link_Bps > 0) {
    std::snprintf(buf, sizeof(buf), " at %.3g Gbit/s", c.link_Bps * 8 / 1e9);
    rate = buf;
  }
  if (hier_wins) {
    std::string links;
    if (flat.BusiestLinkBytes() > hier.BusiestLinkBytes()) {
      std::snprintf(buf, sizeof(buf),
                    "the busiest host link carries %.1fx model bytes per step instead of %.1fx",
                    hier.BusiestLinkBytes() / m, flat.BusiestLinkBytes() / m);
      links = buf;
      if (flat.BusiestLinkBytes() > flat.WorkerLinkBytes()) {  // a dedicated server's link
        std::snprintf(buf, sizeof(buf), " (a worker host's: %.1fx instead of %.1fx)",
                      hier.WorkerLinkBytes() / m, flat.WorkerLinkBytes() / m);
        links += buf;
      }
    } else {
      std::snprintf(buf, sizeof(buf), "the servers serve %u aggregators instead of %u workers",
                    c.hosts, c.workers);
      links = buf;
    }
    std::snprintf(buf, sizeof(buf),
                  "hierarchical: %s; predicted %.2fx faster%s (step %.0f us "
                  "instead of %.0f; bound: %s)",
                  links.c_str(), speedup, rate.c_str(), hier.step_us, flat.step_us,
                  hier.bound.c_str());
    return buf;
  }
  const double flat_link = flat.link_push_us + flat.link_pull_us;
  std::string why;
  if (c.link_Bps <= 0) {
    why = "no link rate given (--link_Bps), so aggregation saves no link time";
  } else if (flat.bound != "link") {
    std::snprintf(buf, sizeof(buf),
                  "links are not the bottleneck (link time %.2f ms of a %.2f "
                  "ms step, bound: %s)",
                  flat_link / 1e3, flat.step_us / 1e3, flat.bound.c_str());
    why = buf;
  } else {
    // What aggregation saves is the communication phases' time, not the link terms alone (a
    // phase may be set by its latency once the link is lighter).
    std::snprintf(buf, sizeof(buf),
                  "the communication time it saves (%.2f ms) is less than "
                  "what it adds",
                  (flat.push_us + flat.pull_us - hier.push_us - hier.pull_us) / 1e3);
    why = buf;
  }
  std::snprintf(buf, sizeof(buf),
                "flat: %s; the local reduction costs %.2f ms and the hand-offs "
                "%.2f ms%s; predicted %.2fx faster%s (step %.0f us instead of %.0f)",
                why.c_str(), hier.reduce_us / 1e3, hier.hop_us / 1e3,
                hier.straggler_us > flat.straggler_us ? " plus the local straggler wait" : "",
                speedup, rate.c_str(), flat.step_us, hier.step_us);
  return buf;
}

StatusOr<double> Calibrate(const Workload& w, Costs c, const Config& cfg, double measured_step_us) {
  double& knob = cfg.mode == Mode::kAsp ? c.pair_cpu_us : c.wait_cpu_us;
  knob = 1;
  ASSIGN_OR_RETURN(Prediction p1, Predict(w, c, cfg));
  knob = 2;
  ASSIGN_OR_RETURN(Prediction p2, Predict(w, c, cfg));
  const double slope = p2.cpu_us - p1.cpu_us;
  if (slope <= 0) return InvalidArgumentError("calibration: the host CPU term does not depend on it");
  const double v = 1 + (measured_step_us - p1.cpu_us) / slope;
  if (!(v > 0)) {
    return InvalidArgumentError("calibration: the measured step is below what compute and "
                                "operations alone need; is this configuration CPU-bound?");
  }
  return v;
}

namespace {
// Solves the n x n system a x = b (n <= 3) by Gaussian elimination with partial pivoting; false
// when it is (numerically) singular.
bool Solve(int n, double a[3][3], double b[3], double x[3]) {
  double scale = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) scale = std::max(scale, std::fabs(a[i][j]));
  }
  if (!(scale > 0)) return false;
  for (int c = 0; c < n; ++c) {
    int p = c;
    for (int r = c + 1; r < n; ++r) {
      if (std::fabs(a[r][c]) > std::fabs(a[p][c])) p = r;
    }
    if (std::fabs(a[p][c]) < 1e-9 * scale) return false;
    if (p != c) {
      for (int k = 0; k < n; ++k) std::swap(a[p][k], a[c][k]);
      std::swap(b[p], b[c]);
    }
    for (int r = c + 1; r < n; ++r) {
      const double f = a[r][c] / a[c][c];
      for (int k = c; k < n; ++k) a[r][k] -= f * a[c][k];
      b[r] -= f * b[c];
    }
  }
  for (int c = n - 1; c >= 0; --c) {
    double v = b[c];
    for (int k = c + 1; k < n; ++k) v -= a[c][k] * x[k];
    x[c] = v / a[c][c];
  }
  return true;
}
}  // namespace

StatusOr<Calibration> CalibrateLeastSquares(const Workload& w, Costs c,
                                            const std::vector<MeasuredRun>& runs) {
  if (runs.empty()) return InvalidArgumentError("calibration: no runs");
  // Predict's cpu_us = base + a * pair_cpu_us + d * wait_cpu_us + o * op_cpu_us for each run;
  // the coefficients from four evaluations (the knobs must stay positive: 0 means "from the
  // probe"). The per-op CPU is evaluated at the probe's value for the 2-knob fallback.
  struct Row {
    double base, a, d, o, m;
  };
  const double op_probe = c.OpCpu();
  std::vector<Row> rows;
  bool any_wait = false;
  for (const MeasuredRun& r : runs) {
    if (!(r.step_us > 0) || !std::isfinite(r.step_us)) {
      return InvalidArgumentError("calibration: a measured step must be positive");
    }
    if (r.config.workers <= c.cores * r.config.machines) {
      return InvalidArgumentError("calibration: " + r.config.Describe() +
                                  " is not CPU-bound (no more workers than cores)");
    }
    Costs k = c;
    k.pair_cpu_us = 1;
    k.wait_cpu_us = 1;
    k.op_cpu_us = 1;
    ASSIGN_OR_RETURN(Prediction p111, Predict(w, k, r.config));
    k.pair_cpu_us = 2;
    ASSIGN_OR_RETURN(Prediction p211, Predict(w, k, r.config));
    k.pair_cpu_us = 1;
    k.wait_cpu_us = 2;
    ASSIGN_OR_RETURN(Prediction p121, Predict(w, k, r.config));
    k.wait_cpu_us = 1;
    k.op_cpu_us = 2;
    ASSIGN_OR_RETURN(Prediction p112, Predict(w, k, r.config));
    const double a = p211.cpu_us - p111.cpu_us, d = p121.cpu_us - p111.cpu_us,
                 o = p112.cpu_us - p111.cpu_us;
    rows.push_back({p111.cpu_us - a - d - o, a, d, o, r.step_us});
    if (d > 0) any_wait = true;
  }
  // Minimise sum ((base + a x + d y + o z - m) / m)^2 over the knobs being fitted: the normal
  // equations. fit_wait / fit_op say which of y, z are unknowns (else y = c's, z = the probe's).
  auto fit = [&](bool fit_wait, bool fit_op, Calibration* out) -> bool {
    const int n = 1 + fit_wait + fit_op;
    double ata[3][3] = {}, atb[3] = {}, x[3] = {};
    for (const Row& r : rows) {
      double col[3];
      int k = 0;
      col[k++] = r.a / r.m;
      if (fit_wait) col[k++] = r.d / r.m;
      if (fit_op) col[k++] = r.o / r.m;
      double t = r.m - r.base;
      if (!fit_wait) t -= r.d * (c.wait_cpu_us > 0 ? c.wait_cpu_us : 0);
      if (!fit_op) t -= r.o * op_probe;
      t /= r.m;
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) ata[i][j] += col[i] * col[j];
        atb[i] += col[i] * t;
      }
    }
    if (!Solve(n, ata, atb, x)) return false;
    int k = 0;
    out->pair_cpu_us = x[k++];
    out->wait_cpu_us = fit_wait ? x[k++] : c.wait_cpu_us;
    out->op_cpu_us = fit_op ? x[k++] : op_probe;
    out->wait_fitted = fit_wait;
    out->op_fitted = fit_op;
    return out->pair_cpu_us > 0 && (!fit_wait || out->wait_cpu_us > 0) && out->op_cpu_us > 0;
  };
  Calibration out;
  if (!fit(any_wait, true, &out) && !fit(any_wait, false, &out)) {
    char buf[240];
    std::snprintf(buf, sizeof(buf),
                  "calibration: least squares gives pair_cpu_us %.1f, wait_cpu_us %.1f (must be "
                  "positive, or the runs cannot tell them apart: give ASP and BSP runs of "
                  "CPU-bound configurations)",
                  out.pair_cpu_us, out.wait_cpu_us);
    return InvalidArgumentError(buf);
  }
  double ss = 0;
  for (const Row& r : rows) {
    const double y = out.wait_fitted ? out.wait_cpu_us : (c.wait_cpu_us > 0 ? c.wait_cpu_us : 0);
    const double e = (r.base + r.a * out.pair_cpu_us + r.d * y + r.o * out.op_cpu_us - r.m) / r.m;
    ss += e * e;
  }
  out.rms_rel_residual = std::sqrt(ss / rows.size());
  return out;
}

StatusOr<std::vector<Prediction>> Search(const Workload& w, Costs c, const Budget& b) {
  if (b.cores > 0) c.cores = b.cores;
  std::vector<Prediction> out;
  // Without hosts: one pass (flat, no network placement). With hosts: every network placement
  // and, with more than one worker per host, flat and hierarchical.
  const std::vector<bool> no_choice = {true}, flat_only = {false};
  const std::vector<bool>& placements = b.hosts > 0 ? b.placements : no_choice;
  const std::vector<bool>& hierarchy = b.hosts > 0 && b.local_workers > 1 ? b.hierarchy : flat_only;
  for (uint32_t s = 1; s <= b.max_servers; ++s) {
    for (int colo = 1; colo >= 0; --colo) {
      // With hosts the CPU placement follows the network's (Predict): one pass.
      if (!colo && (b.machines < 2 || b.hosts > 0)) continue;
      for (bool dedicated : placements) {
        for (bool hier : hierarchy) {
          for (uint64_t part : b.partitions) {
            for (const auto& [mode, st] : b.modes) {
              Config cfg;
              cfg.servers = s;
              cfg.workers = b.workers;
              cfg.machines = b.machines;
              cfg.colocated = colo;
              cfg.partition_bytes = part;
              cfg.mode = mode;
              cfg.staleness = st;
              cfg.hosts = b.hosts;
              cfg.local_workers = b.hosts > 0 ? b.local_workers : 1;
              cfg.hierarchical = hier;
              cfg.servers_dedicated = dedicated;
              cfg.link_Bps = b.link_Bps;
              cfg.link_full_duplex = b.link_full_duplex;
              cfg.wire_overhead = b.wire_overhead;
              cfg.compute_cv = b.compute_cv;
              ASSIGN_OR_RETURN(Prediction p, Predict(w, c, cfg));
              out.push_back(p);
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& x) {
    return a.samples_per_s > x.samples_per_s;
  });
  return out;
}

}  // namespace shardps::plan
