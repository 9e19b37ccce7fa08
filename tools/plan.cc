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
  if (machines > 1) os << " on " << machines << " machines" << (colocated ? " colocated" : " apart");
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
  return os.str();
}

std::string Prediction::Why() const {
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "bound: %s; compute %.0f + push %.0f + barrier %.0f + pull %.0f us; busiest "
                "server %u %.0f us (imbalance %.2f, %u chunks); cpu %.0f us",
                bound.c_str(), compute_us, push_us, barrier_us, pull_us, busiest_server, server_us,
                imbalance, chunks, cpu_us);
  return buf;
}

StatusOr<Prediction> Predict(const Workload& w, const Costs& c, const Config& cfg) {
  if (cfg.servers == 0 || cfg.workers == 0 || cfg.machines == 0) {
    return InvalidArgumentError("plan: servers, workers and machines must be >= 1");
  }
  if (!cfg.colocated && cfg.machines < 2) {
    return InvalidArgumentError("plan: servers apart from workers needs >= 2 machines");
  }
  ASSIGN_OR_RETURN(ShardPlan sp, PlanShards(w.tensors, cfg.servers, cfg.partition_bytes));
  const double S = cfg.servers, W = cfg.workers, C = std::max<uint32_t>(1, c.cores);
  // Placement: round robin; apart: servers on min(S, M-1) machines, workers on the rest.
  // One link model serves local and remote pairs alike (the probe's median; docs/plan.md).
  double ws_host, ss_host;  // workers / servers on the busiest host
  if (cfg.colocated) {
    ws_host = std::ceil(W / cfg.machines);
    ss_host = std::ceil(S / cfg.machines);
  } else {
    const double ms = std::min<double>(S, cfg.machines - 1);
    ws_host = std::ceil(W / (cfg.machines - ms));
    ss_host = std::ceil(S / ms);
  }

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
  // Operations per worker per step (worker/client_impl.h): a push is a data write and a header
  // write-with-immediate per chunk plus an ack read every other push; one clock write per
  // server; a pull is three reads per chunk (header, buffer, header).
  const double push_ops = 2.5 * chunks + S;
  const double pull_ops = 3 * chunks;
  // Round trips per worker-server pair per step: the push (1), the ack read (every other step,
  // 0.5), the pull (1); under BSP a pull that finds the version not yet ready is retried (1),
  // under SSP(s) one step in s+1 waits, under ASP none.
  const double retry = cfg.mode == Mode::kBsp   ? 1.0
                       : cfg.mode == Mode::kSsp ? 1.0 / (cfg.staleness + 1)
                                                : 0.0;
  const double rts = 2.5 + (W > 1 ? retry : 0.0);
  const double op_lat = c.OpLatency(), c_op = c.OpCpu(), x0 = c.ExchangeLatency();

  // (1) The latency path of one worker's step with the host to itself: the probe's exchange
  // (2.5 round trips, 6.5 operations; exchanges with all servers overlap) plus the worker's
  // further operations, serialized through its one thread, plus the bytes.
  const double rtt0 = c.Rtt(0);
  p.compute_us = w.compute_us;
  p.push_us = 0.6 * x0 + std::max(0.0, push_ops - 3.5) * op_lat + bytes / c.write.beta_bps() * 1e6;
  p.pull_us = 0.4 * x0 + std::max(0.0, pull_ops - 3) * op_lat + bytes / c.read.beta_bps() * 1e6;
  // (2) The busiest server, serially: its half of the CPU of every worker's operations to it,
  // W gradients accumulated, one apply.
  for (uint32_t s = 0; s < cfg.servers; ++s) {
    const double ops = W * (5.5 * n[s] + 1);
    const double t = ops * 0.5 * c_op + W * b[s] / c.add_Bps * 1e6 + b[s] / c.apply_Bps * 1e6;
    if (t > p.server_us) {
      p.server_us = t;
      p.busiest_server = s;
    }
  }
  // BSP: a pull waits for the slowest worker's push to be applied: the busiest server's work
  // beyond our own push, plus the retried pull's round trip; SSP(s) waits one step in s+1.
  p.barrier_us = W > 1 ? retry * (std::max(0.0, p.server_us - p.push_us) + rtt0) : 0.0;
  const double path = p.compute_us + p.push_us + p.barrier_us + p.pull_us;
  // (3) CPU of the busiest host per step over its cores. Every worker-server exchange costs CPU
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
  const double r_cpu =
      cfg.mode == Mode::kSsp && W > 1 && ws_host > C ? 1.0 : (rts - 2.5);
  // The wait is charged per exchange (per server). A pull whose chunk is not ready re-reads
  // that chunk's header (ClientImpl::EvaluatePull), but charged per chunk, 1 server x 7 chunks
  // came out 47-84% high in all three validation runs refitted offline (docs/plan.md).
  const double per_pair = c_pair + extra_ops_pair * c_op + r_cpu * c_rt;
  double server_bytes_cpu = 0;  // all servers: accumulate W gradients, apply once
  for (uint32_t s = 0; s < cfg.servers; ++s) {
    server_bytes_cpu += W * b[s] / c.add_Bps * 1e6 + b[s] / c.apply_Bps * 1e6;
  }
  // An exchange's CPU is split between the worker's and the server's side (half each); every
  // worker talks to every server. Colocated: the busiest host has ws_host workers (each in S
  // exchanges) and ss_host servers (each in W). Apart: a worker host and a server host.
  const double worker_side = ws_host * (w.compute_us + 0.5 * S * per_pair);
  const double server_side = ss_host * (0.5 * W * per_pair + server_bytes_cpu / S);
  p.cpu_us = cfg.colocated ? (worker_side + server_side) / C
                           : std::max(worker_side, server_side) / C;
  p.step_us = path;
  p.bound = "latency path";
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
  for (uint32_t s = 1; s <= b.max_servers; ++s) {
    for (int colo = 1; colo >= 0; --colo) {
      if (!colo && b.machines < 2) continue;
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
          ASSIGN_OR_RETURN(Prediction p, Predict(w, c, cfg));
          out.push_back(p);
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
