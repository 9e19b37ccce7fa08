#include "bench/bench_util.h"

#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace shardps::bench {

double NowSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double SelfCpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  auto tv = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return tv(ru.ru_utime) + tv(ru.ru_stime);
}

double ProcessCpuSeconds(pid_t pid) {
  if (pid <= 0) return -1;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return -1;
  // Field 2 (comm) may contain spaces; parse after the last ')'.
  const size_t rp = line.rfind(')');
  if (rp == std::string::npos) return -1;
  std::istringstream is(line.substr(rp + 2));
  std::string field;
  // Fields from 3 on: state(3) ... utime(14) stime(15).
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && is >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

ProcCounters& ProcCounters::operator+=(const ProcCounters& o) {
  cpu_s += o.cpu_s;
  minor_faults += o.minor_faults;
  major_faults += o.major_faults;
  voluntary_switches += o.voluntary_switches;
  involuntary_switches += o.involuntary_switches;
  return *this;
}

ProcCounters ProcCounters::operator-(const ProcCounters& o) const {
  ProcCounters d;
  d.cpu_s = cpu_s - o.cpu_s;
  d.minor_faults = minor_faults - o.minor_faults;
  d.major_faults = major_faults - o.major_faults;
  d.voluntary_switches = voluntary_switches - o.voluntary_switches;
  d.involuntary_switches = involuntary_switches - o.involuntary_switches;
  return d;
}

ProcCounters SelfCounters() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  ProcCounters c;
  c.cpu_s = SelfCpuSeconds();
  c.minor_faults = static_cast<uint64_t>(ru.ru_minflt);
  c.major_faults = static_cast<uint64_t>(ru.ru_majflt);
  c.voluntary_switches = static_cast<uint64_t>(ru.ru_nvcsw);
  c.involuntary_switches = static_cast<uint64_t>(ru.ru_nivcsw);
  return c;
}

bool ReadProcCounters(pid_t pid, ProcCounters* out) {
  if (pid <= 0) return false;
  const std::string dir = "/proc/" + std::to_string(pid);
  std::ifstream f(dir + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  const size_t rp = line.rfind(')');
  if (rp == std::string::npos) return false;
  std::istringstream is(line.substr(rp + 2));
  std::string field;
  ProcCounters c;
  unsigned long long utime = 0, stime = 0;
  // Fields from 3 on: minflt(10) majflt(12) utime(14) stime(15); whole-process sums.
  for (int i = 3; i <= 15 && is >> field; ++i) {
    if (i == 10) c.minor_faults = std::stoull(field);
    if (i == 12) c.major_faults = std::stoull(field);
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  c.cpu_s = static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
  // /proc/PID/status counts the leader's switches only: sum the threads'.
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(dir + "/task", ec)) {
    std::ifstream st(t.path() / "status");
    while (std::getline(st, line)) {
      unsigned long long v = 0;
      if (sscanf(line.c_str(), "voluntary_ctxt_switches: %llu", &v) == 1) {
        c.voluntary_switches += v;
      } else if (sscanf(line.c_str(), "nonvoluntary_ctxt_switches: %llu", &v) == 1) {
        c.involuntary_switches += v;
      }
    }
  }
  *out = c;
  return true;
}

double Percentile(std::vector<double>* samples, double p) {
  if (samples->empty()) return 0;
  std::sort(samples->begin(), samples->end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(samples->size()));
  const size_t idx = std::min(samples->size() - 1, static_cast<size_t>(std::max(1.0, rank)) - 1);
  return (*samples)[idx];
}

std::string ToHex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

StatusOr<std::string> FromHex(const std::string& hex) {
  if (hex.size() % 2 != 0) return InvalidArgumentError("hex string of odd length");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgumentError("bad hex digit in '" + hex + "'");
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, ',')) {
    if (!cur.empty()) out.push_back(cur);
  }
  return out;
}

StatusOr<size_t> ParseSize(const std::string& s) {
  size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(s, &pos);
  } catch (...) {
    return InvalidArgumentError("bad size '" + s + "'");
  }
  std::string suffix = s.substr(pos);
  if (suffix == "" || suffix == "B") return static_cast<size_t>(v);
  if (suffix == "K" || suffix == "KiB" || suffix == "k") return static_cast<size_t>(v) << 10;
  if (suffix == "M" || suffix == "MiB" || suffix == "m") return static_cast<size_t>(v) << 20;
  if (suffix == "G" || suffix == "GiB" || suffix == "g") return static_cast<size_t>(v) << 30;
  return InvalidArgumentError("bad size suffix in '" + s + "' (use K, M or G: powers of 2)");
}

StatusOr<std::vector<size_t>> ParseSizeList(const std::string& s) {
  std::vector<size_t> out;
  for (const std::string& item : SplitList(s)) {
    ASSIGN_OR_RETURN(size_t v, ParseSize(item));
    out.push_back(v);
  }
  return out;
}

std::string SizeName(size_t b) {
  char buf[32];
  if (b >= (1u << 20) && b % (1u << 20) == 0) {
    snprintf(buf, sizeof buf, "%zu MiB", b >> 20);
  } else if (b >= 1024 && b % 1024 == 0) {
    snprintf(buf, sizeof buf, "%zu KiB", b >> 10);
  } else {
    snprintf(buf, sizeof buf, "%zu B", b);
  }
  return buf;
}

void Prefault(void* p, size_t n) {
  auto* b = static_cast<volatile uint8_t*>(p);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t i = 0; i < n; i += page) b[i] = b[i];
}

std::string BenchKey() { return std::string(32, 'k'); }

std::shared_ptr<transport::Authenticator> BenchAuthenticator() {
  class Bench final : public transport::Authenticator {
   public:
    StatusOr<std::string> KeyFor(std::string_view identity) const override {
      if (identity != kBenchIdentity) return PermissionDeniedError("not the bench initiator");
      return BenchKey();
    }
  };
  return std::make_shared<Bench>();
}

}  // namespace shardps::bench
