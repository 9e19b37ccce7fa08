// Output of shardps doctor: the table for people, JSON for tools, and the probe file (the link
// model shardps plan reads). Schemas: docs/doctor.md.
#include <cmath>
#include <cstdio>
#include <sstream>

#include "proto/json_string.h"
#include "tools/doctor.h"

namespace shardps::tools {
namespace {

std::string Num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string Q(const std::string& s) { return control::JsonQuote(s); }

void Figures(std::ostringstream& os, const OpFigures& f) {
  os << "{\"alpha_us\": " << Num(f.alpha_us) << ", \"p99_us\": " << Num(f.p99_us)
     << ", \"beta_Bps\": " << Num(f.beta_Bps) << ", \"small_bytes\": " << f.small_bytes
     << ", \"large_bytes\": " << f.large_bytes << ", \"latency_ops\": " << f.latency_ops
     << ", \"bandwidth_ops\": " << f.bandwidth_ops << "}";
}

void Pair(std::ostringstream& os, const PairResult& p) {
  os << "{\"from\": " << Q(p.from) << ", \"to\": " << Q(p.to) << ", \"to_host\": " << Q(p.to_host)
     << ", \"transport\": " << Q(p.transport) << ", \"why\": " << Q(p.why)
     << ", \"ok\": " << (p.ok ? "true" : "false") << ", \"error\": " << Q(p.error)
     << ", \"verified_bytes\": " << p.verified_bytes << ", \"write\": ";
  Figures(os, p.write);
  os << ", \"read\": ";
  Figures(os, p.read);
  os << "}";
}

}  // namespace

std::string FormatTable(const Report& r) {
  size_t wn = 5;
  for (const CheckResult& c : r.checks) wn = std::max(wn, c.name.size());
  std::ostringstream os;
  os << "shardps doctor on " << r.host << " (transport asked: " << r.transport_asked
     << ", opened: " << (r.transport_effective.empty() ? "none" : r.transport_effective) << ")\n";
  auto row = [&](const std::string& st, const std::string& name, const std::string& detail,
                 const std::string& fix) {
    std::string line = st;
    line.resize(7, ' ');
    std::string n = name;
    n.resize(wn + 2, ' ');
    line += n + detail;
    if (!fix.empty()) line += "  | fix: " + fix;
    os << line << "\n";
  };
  row("STATUS", "CHECK", "DETAIL", "");
  for (const CheckResult& c : r.checks) {
    std::string st = CheckStatusName(c.status);
    for (char& ch : st) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    row(st, c.name, c.detail, c.fix);
  }
  int fails = 0, warns = 0;
  for (const CheckResult& c : r.checks) {
    fails += c.status == CheckStatus::kFail;
    warns += c.status == CheckStatus::kWarn;
  }
  os << (fails ? "RESULT: " + std::to_string(fails) + " problem(s) would stop training"
               : std::string("RESULT: nothing would stop training"))
     << (warns ? ", " + std::to_string(warns) + " warning(s)" : std::string()) << "\n";
  return os.str();
}

std::string FormatJson(const Report& r) {
  std::ostringstream os;
  os << "{\"schema\": \"shardps-doctor/1\", \"host\": " << Q(r.host)
     << ", \"transport_asked\": " << Q(r.transport_asked)
     << ", \"transport_effective\": " << Q(r.transport_effective)
     << ", \"exit_status\": " << r.exit_code() << ",\n \"checks\": [";
  for (size_t i = 0; i < r.checks.size(); ++i) {
    const CheckResult& c = r.checks[i];
    os << (i ? ",\n  " : "\n  ") << "{\"name\": " << Q(c.name) << ", \"status\": "
       << Q(CheckStatusName(c.status)) << ", \"detail\": " << Q(c.detail)
       << ", \"fix\": " << Q(c.fix) << "}";
  }
  os << "],\n \"rdma_ports\": [";
  for (size_t i = 0; i < r.ports.size(); ++i) {
    const PortSummary& p = r.ports[i];
    os << (i ? ",\n  " : "\n  ") << "{\"device\": " << Q(p.device) << ", \"port\": " << p.port
       << ", \"state\": " << Q(p.state) << ", \"active\": " << (p.active ? "true" : "false")
       << ", \"link\": " << Q(p.link) << ", \"mtu\": " << p.mtu << ", \"auto_gid_index\": "
       << p.auto_gid << ", \"auto_gid_reason\": " << Q(p.auto_gid_reason) << ", \"gids\": [";
    for (size_t k = 0; k < p.gids.size(); ++k) {
      os << (k ? ", " : "") << "{\"index\": " << p.gids[k].index << ", \"type\": "
         << Q(p.gids[k].type) << ", \"gid\": " << Q(p.gids[k].gid) << "}";
    }
    os << "]}";
  }
  os << "],\n \"pairs\": [";
  for (size_t i = 0; i < r.pairs.size(); ++i) {
    os << (i ? ",\n  " : "\n  ");
    Pair(os, r.pairs[i]);
  }
  os << "]}\n";
  return os.str();
}

std::string FormatProbeFile(const std::vector<PairResult>& pairs) {
  std::ostringstream os;
  os << "{\"schema\": \"shardps-probe/1\", \"pairs\": [";
  bool first = true;
  for (const PairResult& p : pairs) {
    os << (first ? "\n  " : ",\n  ");
    first = false;
    Pair(os, p);
  }
  os << "]}\n";
  return os.str();
}

}  // namespace shardps::tools
