// shardps doctor: checks that find what stops RDMA parameter-server training before its first
// step (memlock, GID, NIC, unreachable coordinator or peers, a transport that cannot start) and
// say how to fix each. docs/doctor.md describes every check and the JSON and probe-file schemas.
//
// Each check returns a CheckResult {name, status ok|warn|fail, detail, fix}. A fail is something
// that would stop training; a warn is something that costs performance or robustness.
//
// Thread safety: the free functions are stateless and may run on any thread (the checks open
// and close their own fabrics and sockets). ProbeResponder: see its comment.
#ifndef SHARDPS_TOOLS_DOCTOR_H_
#define SHARDPS_TOOLS_DOCTOR_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "proto/shard_plan.h"
#include "transport/transport.h"

namespace shardps::tools {

enum class CheckStatus { kOk = 0, kWarn = 1, kFail = 2 };
const char* CheckStatusName(CheckStatus s);  // "ok", "warn", "fail"

struct CheckResult {
  std::string name;    // "memlock", "coordinator", "peer 10.0.0.2:7777", ...
  CheckStatus status = CheckStatus::kOk;
  std::string detail;  // what was found, in plain words
  std::string fix;     // what to do about it; empty when nothing needs doing
};

struct DoctorOptions {
  transport::FabricOptions fabric;  // --transport, --bind_ip, --rdma_device, --rdma_gid_index...
  // Transport the memlock check assumes ("" = the one this host would use).
  std::string assume_transport;
  std::string coordinator;          // "" = not checked
  std::vector<std::string> peers;   // probe responders' addresses ("host:port")
  std::chrono::milliseconds timeout{3000};  // every connect and every wait
  // The configuration whose registrations the memlock check computes ("" = none).
  std::string model;
  uint32_t num_servers = 1;
  uint32_t num_workers = 1;
  uint32_t max_workers = 0;  // 0 = num_workers (the coordinator uses max of the two)
  uint64_t partition_bytes = 4u << 20;
  // Probe sizes: latency with `small_bytes` ops (`probe_iters` of each kind), bandwidth with
  // `large_bytes` ops for `probe_time` per direction.
  int probe_iters = 200;
  uint64_t small_bytes = 8;
  uint64_t large_bytes = 1u << 20;
  std::chrono::milliseconds probe_time{500};
  std::string self_name;  // this process in pair results ("" = hostname)
  // Where the transparent-huge-page settings are read (`enabled`, `shmem_enabled`): sysfs,
  // or a copy of it (tests; a container whose sysfs is mounted elsewhere).
  std::string thp_dir = "/sys/kernel/mm/transparent_hugepage";
};

// ---- devices -----------------------------------------------------------------------------
struct GidSummary {
  int index = 0;
  std::string type;  // "RoCEv2", ...
  std::string gid;   // "::ffff:192.168.77.1"
};
struct PortSummary {
  std::string device;
  int port = 0;
  std::string state;
  bool active = false;
  std::string link;  // "ethernet (RoCE)" or "infiniband"
  int mtu = 0;
  std::vector<GidSummary> gids;
  int auto_gid = -1;           // the GID index automatic selection picks; -1 = none
  std::string auto_gid_reason;  // why (or why none)
};

// One check per device port (devices, link state, MTU, GID table, the automatic GID and why).
// `want_verbs`: whether verbs is asked for by name (no device is then a fail, else a warn).
std::vector<CheckResult> CheckRdmaDevices(const DoctorOptions& o, bool want_verbs,
                                          std::vector<PortSummary>* ports);

// Opens the transport the options ask for, exactly as the daemons would, and reports what it
// opened and why; a transport asked for by name that cannot start is a fail with the provider's
// reason (never a fallback). *effective receives the provider opened ("" on failure).
CheckResult CheckTransport(const DoctorOptions& o, std::string* effective);

// ---- memlock -----------------------------------------------------------------------------
// Bytes one process registers (and the kernel pins) for a configuration.
struct MemlockNeed {
  uint64_t server_bytes = 0;  // the most loaded server: weights + inbox + acks + clocks
  uint64_t worker_bytes = 0;  // a worker: its tensors (weights + gradients) + staging
  std::string server_detail;
  std::string worker_detail;
  uint64_t max() const { return server_bytes > worker_bytes ? server_bytes : worker_bytes; }
};
StatusOr<MemlockNeed> ComputeMemlockNeed(const std::vector<TensorSpec>& tensors,
                                         uint32_t num_servers, uint32_t max_workers,
                                         uint64_t partition_bytes);
// `transport`: the provider that will register the memory (only verbs pins it).
CheckResult CheckMemlock(const DoctorOptions& o, const std::string& transport);

// Whether the regions `transport` registers get 2 MiB pages: tcp and verbs allocate anonymous
// memory (transparent_hugepage/enabled governs it), shm a memfd arena (shmem_enabled governs
// it; Debian's default, never, leaves it at 4 KiB pages whatever `enabled` says). Both ask
// with MADV_HUGEPAGE. A warning where the transport's memory gets 4 KiB pages.
CheckResult CheckHugePages(const DoctorOptions& o, const std::string& transport);
CheckResult CheckForkSafety(const std::string& transport);

// TCP connect within the timeout, then the magic and a JoinRequest with a wrong token: a
// refusal proves a live coordinator speaking the control protocol, without joining.
CheckResult CheckCoordinator(const DoctorOptions& o);

// ---- probe -------------------------------------------------------------------------------
struct OpFigures {
  double alpha_us = 0;      // p50 latency of one small op, microseconds
  double p99_us = 0;
  double beta_Bps = 0;      // bandwidth of large ops, bytes per second
  uint64_t small_bytes = 0;
  uint64_t large_bytes = 0;
  uint64_t latency_ops = 0;
  uint64_t bandwidth_ops = 0;
};
struct PairResult {
  std::string from;
  std::string to;           // the responder's address
  std::string to_host;      // the responder's hostname
  std::string transport;    // provider used ("" when it never got that far)
  std::string why;          // why this transport for this pair
  bool ok = false;
  std::string error;        // why not ok
  OpFigures write, read;
  uint64_t verified_bytes = 0;  // bytes whose content was checked after moving both ways
};

// Serves probes: a TCP control socket (the address peers pass to --peer) and a fabric listener.
// Each prober gets its own registered region, filled with a known pattern, and can ask the
// responder to hash what it wrote. Runs one thread that owns the fabric, its CQ and endpoints;
// the constructor's caller may only query address() and destroy it (which stops the thread).
class ProbeResponder {
 public:
  // `control_address`: "ip:port" to listen on (port 0 = pick one).
  static StatusOr<std::unique_ptr<ProbeResponder>> Start(const DoctorOptions& o,
                                                         const std::string& control_address);
  ~ProbeResponder();
  ProbeResponder(const ProbeResponder&) = delete;
  ProbeResponder& operator=(const ProbeResponder&) = delete;

  const std::string& address() const { return address_; }
  const std::string& transport() const { return transport_; }
  uint64_t probes_served() const { return served_.load(); }

 private:
  ProbeResponder() = default;
  void Run();

  DoctorOptions options_;
  std::unique_ptr<transport::Fabric> fabric_;
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::unique_ptr<transport::Listener> listener_;
  UniqueFd control_fd_;
  UniqueFd wake_[2];  // pipe: the destructor wakes Run()
  std::string address_;
  std::string transport_;
  std::atomic<uint64_t> served_{0};
  std::thread thread_;
};

// Probes one responder: connect (within the timeout), verify a read of its pattern, latency of
// small writes and reads, bandwidth of large ones, then a write whose bytes the responder
// hashes. Fabrics are opened per provider and cached in *fabrics by the caller's thread.
struct FabricCache {
  std::vector<std::pair<std::string, std::unique_ptr<transport::Fabric>>> fabrics;
};
PairResult ProbePeer(const DoctorOptions& o, const std::string& address, FabricCache* cache);
// The check line for one pair (ok with the figures, or fail with the reason and the fix).
CheckResult PairCheck(const PairResult& p, std::chrono::milliseconds timeout);

// ---- report ------------------------------------------------------------------------------
struct Report {
  std::string host;
  std::string transport_asked;
  std::string transport_effective;
  std::vector<CheckResult> checks;
  std::vector<PortSummary> ports;
  std::vector<PairResult> pairs;
  // 0: nothing failed (warns allowed); 1: something would stop training.
  int exit_code() const;
};

// Runs every local check, the coordinator check and every probe the options ask for.
Report RunDoctor(const DoctorOptions& o);

std::string FormatTable(const Report& r);
std::string FormatJson(const Report& r);  // schema: docs/doctor.md
// The link model `shardps plan` reads (schema: docs/doctor.md).
std::string FormatProbeFile(const std::vector<PairResult>& pairs);

// "connect h:p: Connection refused" -> "connection refused"; a timeout -> "no answer within N
// ms".
std::string ShortReason(const Status& s, std::chrono::milliseconds timeout);

// This host's name (gethostname).
std::string HostName();

}  // namespace shardps::tools

#endif  // SHARDPS_TOOLS_DOCTOR_H_
