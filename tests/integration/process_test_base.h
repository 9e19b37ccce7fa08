// Process-level test fixtures shared by process_cluster_test.cc, process_fault_test.cc and
// consistency_property_test.cc: the result file parser, the cluster spec, and ProcessTestBase,
// which starts, tracks and tears down real shardps_coordinator, shardps_server and
// ps_test_worker processes (every wait bounded, every child SIGKILLed and reaped in TearDown).
// Test code: one gtest thread per test.
#ifndef SHARDPS_TESTS_INTEGRATION_PROCESS_TEST_BASE_H_
#define SHARDPS_TESTS_INTEGRATION_PROCESS_TEST_BASE_H_

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>
#include "common/net.h"
#include "tests/integration/child_process.h"
#include "transport/transport.h"

#include <gtest/gtest.h>

namespace shardps::proc_test {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing_util::ChildProcess;
using testing_util::ReadFile;
using testing_util::WaitForFile;
using Clock = std::chrono::steady_clock;

inline constexpr char kToken[] = "proc-test-secret";
// Bound on any one process's whole run in these tests (they take a few seconds each).
inline constexpr milliseconds kProcessBound{60000};

// What a ps_test_worker wrote to its --out file.
struct WorkerResult {
  std::map<std::string, std::string> values;
  std::map<std::string, std::vector<float>> tensors;
  std::string Get(const std::string& k) const {
    auto it = values.find(k);
    return it == values.end() ? "" : it->second;
  }
  int64_t Int(const std::string& k) const { return std::strtoll(Get(k).c_str(), nullptr, 10); }
};

inline StatusOr<WorkerResult> ParseResult(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  WorkerResult r;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "tensor") {
      std::string name;
      size_t n = 0;
      in >> name >> n;
      std::vector<float>& v = r.tensors[name];
      std::string tok;
      while (in >> tok) v.push_back(std::strtof(tok.c_str(), nullptr));
      if (v.size() != n) return DataLossError(path + ": tensor " + name + " is short");
    } else {
      std::string value;
      std::getline(in >> std::ws, value);
      r.values[key] = value;
    }
  }
  if (r.values.count("mode") == 0) return DataLossError(path + ": no 'mode' line");
  return r;
}

inline bool HasRdmaDevice() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

// Why this transport cannot run here ("" when it can), as the conformance suite decides it:
// only missing RDMA hardware is a reason to skip verbs.
inline std::string SkipReason(const std::string& transport) {
  if (transport != "verbs") return "";
  if (transport::CompiledProviders().find("verbs") == std::string::npos) {
    return "built without verbs support";
  }
  if (!HasRdmaDevice()) {
    return "no RDMA device (/sys/class/infiniband is empty); run the verbs tier inside the "
           "SoftRoCE guest (scripts/test.sh does)";
  }
  return "";
}

inline std::string EnvOr(const char* name, const char* fallback) {
  const char* v = getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

// --lr=... printed with enough digits that the servers and the workers parse the same double.
inline std::string LrFlag(double lr) {
  std::ostringstream o;
  o.precision(17);
  o << "--lr=" << lr;
  return o.str();
}

// A child's log tail for failure messages (a child that failed to spawn has none).
inline std::string Tail(ChildProcess* c) { return c == nullptr ? "(not started)" : c->LogTail(); }

struct ClusterSpec {
  std::string transport = "tcp";
  std::string consistency = "bsp";
  int staleness = 0;
  int servers = 2;
  int workers = 4;
  uint64_t partition_bytes = 1024;
  double lr = 0.1;
  std::string aggregation = "average";
  int heartbeat_interval_ms = 100;
  int heartbeat_timeout_ms = 1500;
  int lease_ms = 0;  // 0: derived (3 x heartbeat_timeout_ms; proto/fault_timeouts.h)
  int replicas = 1;
  int max_workers = 0;
  std::string checkpoint_dir;
  int checkpoint_every = 0;
  std::string restore_from;
  std::string listen = "127.0.0.1:0";
  std::string state_file;
  std::string optimizer = "sgd";
  // Server rank crash_rank (>= 0) runs with SHARDPS_CRASH_POINT=crash_point (common/crash_point.h).
  int crash_rank = -1;
  std::string crash_point;
  // Server rank stall_rank (>= 0) runs with SHARDPS_STALL_POINT=stall_point (common/stall_point.h).
  int stall_rank = -1;
  std::string stall_point;
  std::vector<std::string> coordinator_extra;  // more coordinator flags (e.g. --shard_layout)
  std::vector<std::string> server_extra;       // more flags for every server of StartCluster
};

// Starts, tracks and tears down the processes of one test.
class ProcessTestBase : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "shardps-proc-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << "mkdtemp " << tmpl;
    dir_ = tmpl;
  }

  void TearDown() override {
    // Workers first, then servers, then the coordinator; each SIGKILLed and reaped.
    for (auto it = children_.rbegin(); it != children_.rend(); ++it) (*it)->Kill();
    if (HasFailure()) {
      for (const auto& c : children_) {
        std::cerr << "----- " << c->name() << " (" << c->log_path() << ")\n"
                  << c->LogTail() << "\n";
      }
      std::cerr << "logs kept in " << dir_ << "\n";
    } else if (!dir_.empty() && getenv("SHARDPS_KEEP_TEST_LOGS") == nullptr) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
    children_.clear();
  }

  // SetUp of a test over `transport`: skips with the reason where it cannot run here (verbs
  // without an RDMA device), fails instead under SHARDPS_REQUIRE_VERBS=1 (the SoftRoCE guest).
  void SetUpFor(const std::string& transport) {
    const std::string reason = SkipReason(transport);
    if (!reason.empty()) {
      const char* require = getenv("SHARDPS_REQUIRE_VERBS");
      if (require != nullptr && std::string(require) == "1") {
        FAIL() << "SHARDPS_REQUIRE_VERBS=1 but " << transport << " cannot run: " << reason;
      }
      GTEST_SKIP() << transport << ": " << reason;
    }
    ProcessTestBase::SetUp();
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  ChildProcess* Spawn(const std::vector<std::string>& argv, const std::string& log_name) {
    auto c = ChildProcess::Spawn(argv, Path(log_name));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return nullptr;
    children_.push_back(std::move(*c));
    return children_.back().get();
  }

  // Starts shardps_coordinator on an ephemeral loopback port; returns its address ("" on error).
  std::string StartCoordinator(const ClusterSpec& spec) {
    const std::string addr_file = Path("coordinator.addr");
    std::error_code ec;
    std::filesystem::remove(addr_file, ec);  // a restarted cluster must not read the old one
    coordinator_ = Spawn(CoordinatorArgsWithExtra(spec, spec.listen, addr_file), "coordinator.log");
    if (coordinator_ == nullptr) return "";
    auto addr = WaitForFile(addr_file, milliseconds(10000), coordinator_);
    EXPECT_TRUE(addr.ok()) << addr.status();
    if (!addr.ok()) return "";
    std::string a = *addr;
    a.erase(a.find_last_not_of("\n ") + 1);
    coordinator_address_ = a;
    return a;
  }
  // shardps_coordinator's command line for `spec`, listening on `listen`.
  std::vector<std::string> CoordinatorArgs(const ClusterSpec& spec, const std::string& listen,
                                           const std::string& addr_file) const {
    return {SHARDPS_COORDINATOR_BIN, "--listen=" + listen, "--address_file=" + addr_file,
               "--state_file=" + spec.state_file,
               // At least the lease (checked at start), and long enough for slow restarts.
               "--rejoin_grace_ms=" +
                   std::to_string(std::max(15000, spec.lease_ms > 0 ? spec.lease_ms
                                                                   : 3 * spec.heartbeat_timeout_ms)),
               "--lease_ms=" + std::to_string(spec.lease_ms),
               std::string("--cluster_token=") + kToken, "--consistency=" + spec.consistency,
               "--staleness=" + std::to_string(spec.staleness),
               "--num_servers=" + std::to_string(spec.servers),
               "--num_workers=" + std::to_string(spec.workers),
               "--heartbeat_interval_ms=" + std::to_string(spec.heartbeat_interval_ms),
               "--heartbeat_timeout_ms=" + std::to_string(spec.heartbeat_timeout_ms),
               "--data_transport=" + spec.transport,
               "--partition_bytes=" + std::to_string(spec.partition_bytes),
               "--replicas=" + std::to_string(spec.replicas),
               "--max_workers=" + std::to_string(spec.max_workers), "--failover_timeout_ms=0",
               "--checkpoint_dir=" + spec.checkpoint_dir,
               "--checkpoint_every=" + std::to_string(spec.checkpoint_every)};
  }
  std::vector<std::string> CoordinatorArgsWithExtra(const ClusterSpec& spec, const std::string& listen,
                                                    const std::string& addr_file) const {
    std::vector<std::string> a = CoordinatorArgs(spec, listen, addr_file);
    a.insert(a.end(), spec.coordinator_extra.begin(), spec.coordinator_extra.end());
    return a;
  }

  std::string ServerIp(const std::string& transport) const {
    return transport == "verbs" ? EnvOr("SHARDPS_TEST_VERBS_TARGET_IP", "192.168.77.2")
                                : "127.0.0.1";
  }
  std::string WorkerIp(const std::string& transport) const {
    return transport == "verbs" ? EnvOr("SHARDPS_TEST_VERBS_INITIATOR_IP", "192.168.77.1")
                                : "127.0.0.1";
  }

  // spec.servers groups x spec.replicas processes: rank g is group g's primary, rank
  // servers + g its backup.
  void StartServers(const ClusterSpec& spec) {
    servers_.clear();
    for (int i = 0; i < spec.servers * spec.replicas; ++i) {
      // The child inherits the environment at spawn: armed for that one rank only.
      if (i == spec.crash_rank) {
        setenv("SHARDPS_CRASH_POINT", spec.crash_point.c_str(), 1);
      } else {
        unsetenv("SHARDPS_CRASH_POINT");
      }
      if (i == spec.stall_rank) {
        setenv("SHARDPS_STALL_POINT", spec.stall_point.c_str(), 1);
      } else {
        unsetenv("SHARDPS_STALL_POINT");
      }
      servers_.push_back(
          SpawnServer(spec, i, spec.server_extra, "server" + std::to_string(i) + ".log"));
    }
    unsetenv("SHARDPS_CRASH_POINT");
    unsetenv("SHARDPS_STALL_POINT");
  }
  // One shardps_server of this test's cluster, requesting `rank`, with `extra` flags (--spare).
  ChildProcess* SpawnServer(const ClusterSpec& spec, int rank,
                            const std::vector<std::string>& extra, const std::string& log_name) {
    std::vector<std::string> argv = {
        SHARDPS_SERVER_BIN,        "--coordinator=" + coordinator_address_,
        std::string("--cluster_token=") + kToken, "--transport=" + spec.transport,
        "--bind_ip=" + ServerIp(spec.transport),  "--rank=" + std::to_string(rank),
        "--optimizer=" + spec.optimizer,          LrFlag(spec.lr),
        "--aggregation=" + spec.aggregation,      "--restore_from=" + spec.restore_from};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Spawn(argv, log_name);
  }
  // Waits (bounded) until `c`'s log holds `text`; false if it never did.
  static bool WaitForLog(ChildProcess* c, const std::string& text, milliseconds bound) {
    const auto until = Clock::now() + bound;
    while (c != nullptr && Clock::now() < until) {
      if (c->LogTail(1 << 22).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(milliseconds(2));
    }
    return false;
  }

  // The coordinator, then its servers; false if the coordinator did not come up.
  bool StartCluster(const ClusterSpec& spec) {
    if (StartCoordinator(spec).empty()) return false;
    StartServers(spec);
    return true;
  }

  // A ps_test_worker joining this test's coordinator; its result goes to worker<rank>.out.
  std::vector<std::string> WorkerArgs(const ClusterSpec& spec, int rank,
                                      const std::string& token = kToken) {
    return {PS_TEST_WORKER_BIN,
            "--coordinator=" + coordinator_address_,
            "--cluster_token=" + token,
            "--transport=" + spec.transport,
            "--bind_ip=" + WorkerIp(spec.transport),
            "--rank=" + std::to_string(rank),
            "--workers=" + std::to_string(spec.workers),
            LrFlag(spec.lr),
            "--out=" + Path("worker" + std::to_string(rank) + ".out"),
            "--setup_timeout_ms=30000",
            "--wait_timeout_ms=15000"};
  }
  ChildProcess* SpawnWorker(std::vector<std::string> args, const std::string& log_name,
                            const std::vector<std::string>& extra = {}) {
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args, log_name);
  }

  // One ps_test_worker per rank (worker<r>.log, worker<r>.out), each with `extra` flags and a
  // progress file progress<r> (steps completed).
  std::vector<ChildProcess*> SpawnWorkers(const ClusterSpec& spec,
                                          const std::vector<std::string>& extra) {
    std::vector<ChildProcess*> workers;
    for (int r = 0; r < spec.workers; ++r) {
      std::vector<std::string> flags = extra;
      flags.push_back("--progress_file=" + Path("progress" + std::to_string(r)));
      workers.push_back(
          SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log", flags));
    }
    return workers;
  }

  // Flags that hold a worker before step `step` until ReleaseHold(name): a test that kills a
  // process mid-run gives them to every worker with a step past its kill point, so that a test
  // thread descheduled on a loaded host cannot find training over when it gets to the kill.
  // Workers of different clusters in one test take different names. A held worker marks it in
  // <name>.held.<rank> (ps_test_worker), so that ReleaseHold can say where the kill landed.
  std::vector<std::string> HoldFlags(int step, const std::string& name = "hold") const {
    return {"--hold_at_step=" + std::to_string(step), "--hold_file=" + Path(name)};
  }
  // Releases the workers of HoldFlags(.., name); false (with a failure) if it cannot. A kill test
  // calls it right after its kill: it records how many workers were already held by then
  // (workers_at_hold), 0 when the kill landed mid-run as the test means, and logs it.
  [[nodiscard]] bool ReleaseHold(const std::string& name = "hold") {
    int held = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      held += e.path().filename().string().rfind(name + ".held.", 0) == 0;
    }
    RecordProperty("workers_at_hold", held);
    std::cerr << "[ hold     ] " << held << " worker(s) had reached the hold ('" << name
              << "') when it was released" << (held == 0 ? ": the kill landed mid-run" : "")
              << "\n";
    std::ofstream f(Path(name));
    if (!f.good()) ADD_FAILURE() << "cannot create " << Path(name);
    return f.good();
  }

  // Waits (bounded) for a child to exit; its exit code, or -1 after a timeout (and a failure).
  int ExitCode(ChildProcess* c, milliseconds bound = kProcessBound) {
    if (c == nullptr) return -1;
    auto rc = c->Wait(bound);
    EXPECT_TRUE(rc.has_value()) << c->name() << " still running after " << bound.count() << " ms:\n"
                                << Tail(c);
    return rc.value_or(-1);
  }

  // The one-process reference of a linreg run: ps_test_worker --standalone, same total batch.
  ChildProcess* SpawnStandalone(const ClusterSpec& spec, int steps,
                                const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {PS_TEST_WORKER_BIN,
                                     "--standalone",
                                     "--workers=" + std::to_string(spec.workers),
                                     "--steps=" + std::to_string(steps),
                                     LrFlag(spec.lr),
                                     "--out=" + Path("standalone.out")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Spawn(argv, "standalone.log");
  }
  // Its result, once it has exited cleanly.
  StatusOr<WorkerResult> StandaloneResult(ChildProcess* standalone, milliseconds bound) {
    const int rc = ExitCode(standalone, bound);
    if (rc != 0) return InternalError("standalone run exited with " + std::to_string(rc));
    return ParseResult(Path("standalone.out"));
  }
  StatusOr<WorkerResult> Result(int rank, const std::string& prefix = "worker") {
    return ParseResult(Path(prefix + std::to_string(rank) + ".out"));
  }
  // Every worker exits 0 after `steps` steps with `failovers` failovers each (-1: any) and no
  // push lost, its weights bit-identical to the standalone reference's.
  void ExpectWorkersMatchReference(const ClusterSpec& spec, const std::vector<ChildProcess*>& workers,
                                   ChildProcess* standalone, int steps, int failovers,
                                   milliseconds bound) {
    for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
    auto ref = StandaloneResult(standalone, bound);
    ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
    for (int r = 0; r < spec.workers; ++r) {
      auto res = Result(r);
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_EQ(res->Int("steps"), steps) << "worker " << r;
      if (failovers >= 0) {
        EXPECT_EQ(res->Int("failovers"), failovers) << "worker " << r;
      }
      EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
      ExpectSameWeights(*res, *ref, r);
    }
  }
  // Bit-identical weights: the same floats, element by element.
  static void ExpectSameWeights(WorkerResult& got, WorkerResult& ref, int rank) {
    EXPECT_EQ(got.tensors["W"], ref.tensors["W"]) << "worker " << rank << ": W differs";
    EXPECT_EQ(got.tensors["b"], ref.tensors["b"]) << "worker " << rank << ": b differs";
    if (ref.tensors.count("E") != 0) {  // a row table (--embedding_rows)
      EXPECT_EQ(got.tensors["E"].size(), ref.tensors["E"].size());
      EXPECT_EQ(got.tensors["E"], ref.tensors["E"]) << "worker " << rank << ": row table differs";
    }
  }

  std::string dir_;
  std::vector<std::unique_ptr<ChildProcess>> children_;
  ChildProcess* coordinator_ = nullptr;
  std::vector<ChildProcess*> servers_;
  std::string coordinator_address_;
};

class ProcessClusterTest : public ProcessTestBase,
                           public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override { SetUpFor(GetParam()); }
  ClusterSpec Spec() const {
    ClusterSpec s;
    s.transport = GetParam();
    // Under SoftRoCE's CPU emulation a busy guest can starve a heartbeat thread for > 1.5 s.
    if (Emulated()) s.heartbeat_timeout_ms = 6000;
    return s;
  }
  // The counter model's cluster: servers sum with lr 1, so w[k] counts worker k's applied pushes.
  ClusterSpec CounterSpec() const {
    ClusterSpec s = Spec();
    s.lr = 1.0;
    s.aggregation = "sum";
    return s;
  }
  // SoftRoCE in the test guest runs under TCG (software CPU emulation), several times slower
  // than the host: its bounds are wider. The host transports keep the tight ones.
  bool Emulated() const { return GetParam() == "verbs"; }
  milliseconds ProcessBound() const { return Emulated() ? 4 * kProcessBound : kProcessBound; }
  milliseconds Slack() const { return Emulated() ? milliseconds(60000) : milliseconds(10000); }
};

// Waits (bounded) until worker `rank`'s progress file reaches `steps`; the steps it reports.
inline int WaitProgress(const std::string& path, int steps, milliseconds bound, ChildProcess* w) {
  // The file is read at least once, whatever the bound: with a 1 ms bound (a snapshot of the
  // progress) a test descheduled between taking `until` and the first check used to get 0
  // without any read ("killed after 0 steps" on a loaded host).
  const auto until = Clock::now() + bound;
  for (;;) {
    auto p = ReadFile(path);
    const int done = p.ok() ? std::atoi(p->c_str()) : 0;
    if (done >= steps || (w != nullptr && !w->Running()) || Clock::now() >= until) return done;
    std::this_thread::sleep_for(milliseconds(2));
  }
}

}  // namespace shardps::proc_test

#endif  // SHARDPS_TESTS_INTEGRATION_PROCESS_TEST_BASE_H_
