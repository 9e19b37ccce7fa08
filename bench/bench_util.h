// Small helpers shared by the transport benchmark: clocks, CPU accounting, percentiles, hex,
// data patterns. Internal to bench/.
//
// Thread safety: free functions over values; CpuMeter reads process-wide counters and may be
// used from any thread.
#ifndef SHARDPS_BENCH_BENCH_UTIL_H_
#define SHARDPS_BENCH_BENCH_UTIL_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/handshake_auth.h"

#include "common/byte_pattern.h"
#include "common/status.h"

namespace shardps::bench {

double NowSeconds();  // CLOCK_MONOTONIC

// CPU seconds (user + system) of this process (all threads).
double SelfCpuSeconds();
// CPU seconds of another process from /proc/PID/stat; -1 when unknown (pid <= 0, gone).
double ProcessCpuSeconds(pid_t pid);

// What a process has cost the machine so far: CPU, page faults, context switches.
struct ProcCounters {
  double cpu_s = 0;
  uint64_t minor_faults = 0, major_faults = 0;
  uint64_t voluntary_switches = 0, involuntary_switches = 0;  // summed over threads
  ProcCounters& operator+=(const ProcCounters& o);
  ProcCounters operator-(const ProcCounters& o) const;
};
// This process (getrusage: all threads, live and gone).
ProcCounters SelfCounters();
// Another process from /proc/PID/stat and /proc/PID/task/*/status; false when it is gone.
bool ReadProcCounters(pid_t pid, ProcCounters* out);

// Percentile p in [0, 100] of samples (nearest rank); sorts samples. 0 if empty.
double Percentile(std::vector<double>* samples, double p);

std::string ToHex(const std::string& bytes);
StatusOr<std::string> FromHex(const std::string& hex);

// "4096", "64K", "64KiB", "1M", "16MiB" -> bytes. Comma lists via ParseSizeList.
StatusOr<size_t> ParseSize(const std::string& s);
StatusOr<std::vector<size_t>> ParseSizeList(const std::string& s);
std::vector<std::string> SplitList(const std::string& s);  // by ',' dropping empties
std::string SizeName(size_t bytes);  // "4 KiB", "16 MiB", "8 B"

// FillPattern and FirstMismatch: common/byte_pattern.h (shared with the conformance suite).
using shardps::FillPattern;
using shardps::FirstMismatch;

// Touches every page so that first-touch faults are not timed.
void Prefault(void* p, size_t n);

// The data-path credential of a benchmark pair (the target's listener requires it when the
// fabric has tcp_tls on, since TLS is keyed by the proof). A fixed, public key: benchmarks
// only, never a cluster's.
inline constexpr char kBenchIdentity[] = "bench";
std::string BenchKey();
// The target's Authenticator: knows kBenchIdentity with BenchKey().
std::shared_ptr<transport::Authenticator> BenchAuthenticator();

}  // namespace shardps::bench

#endif  // SHARDPS_BENCH_BENCH_UTIL_H_
