// Busy hosts (issue 14; docs/fault-tolerance.md, "Liveness"): training hosts are loaded, and a
// process descheduled for seconds is slow, not dead. Each test loads this host to a load
// average of at least 10 with CPU hogs (stress-ng, or shell loops where it is missing; both
// bounded in time and killed in teardown), then runs kRuns short BSP trainings (2 groups x 2
// replicas, 3 workers), and in every run SIGSTOPs two members chosen by a seed (a server, a
// worker or the coordinator) for 1.6-2.8 s each: past the 1.5 s suspicion floor, short of the
// 4.5 s lease. Required, in every run: no member declared dead, no failover, no promotion, and
// weights bit-identical to the one-process reference. The totals (runs, stops, suspicions,
// false deaths, load) are printed.
//
// Before leases and suspicion (a member silent for heartbeat_timeout was dead), the first stop
// past 1.5 s killed its member: a server's group failed over, a worker was dropped and exited.
//
// Runs alone (ctest RUN_SERIAL): the load would slow every other test on the host.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/child_process.h"
#include "tests/integration/process_test_base.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

double LoadAverage1() {
  std::ifstream f("/proc/loadavg");
  double l = 0;
  f >> l;
  return l;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

class BusyHostTest : public ProcessTestBase, public ::testing::WithParamInterface<std::string> {
 protected:
  static constexpr int kRunsDefault = 20;
  static constexpr int kHogs = 20;

  void SetUp() override { SetUpFor(GetParam()); }

  void TearDown() override {
    for (auto& h : hogs_) h->Kill();
    hogs_.clear();
    dir_ = base_dir_.empty() ? dir_ : base_dir_;
    ProcessTestBase::TearDown();
  }

  // CPU hogs until the 1-minute load average is >= 10 (bounded); false if it never gets there.
  bool LoadTheHost(std::chrono::seconds lifetime) {
    const bool have_stress = access("/usr/bin/stress-ng", X_OK) == 0;
    if (have_stress) {
      auto h = ChildProcess::Spawn({"/usr/bin/stress-ng", "--cpu", std::to_string(kHogs),
                                    "--cpu-method", "int64", "--timeout",
                                    std::to_string(lifetime.count()) + "s"},
                                   Path("stress.log"), lifetime + std::chrono::seconds(5));
      if (!h.ok()) return false;
      hogs_.push_back(std::move(*h));
    } else {
      for (int i = 0; i < kHogs; ++i) {
        auto h = ChildProcess::Spawn({"/bin/sh", "-c", "while :; do :; done"},
                                     Path("hog" + std::to_string(i) + ".log"), lifetime);
        if (!h.ok()) return false;
        hogs_.push_back(std::move(*h));
      }
    }
    std::cerr << "[ info ] " << kHogs << " CPU hogs (" << (have_stress ? "stress-ng" : "sh loops")
              << ") on " << std::thread::hardware_concurrency()
              << " CPUs; waiting for load average >= 10\n";
    const auto until = Clock::now() + std::chrono::seconds(150);
    while (Clock::now() < until) {
      if (LoadAverage1() >= 10) return true;
      std::this_thread::sleep_for(milliseconds(500));
    }
    return LoadAverage1() >= 10;
  }

  // Kills this run's processes (not the hogs) and starts the next run in a fresh directory.
  void EndRun() {
    for (auto it = children_.rbegin(); it != children_.rend(); ++it) (*it)->Kill();
    children_.clear();
    servers_.clear();
    coordinator_ = nullptr;
  }
  void BeginRun(int run) {
    if (base_dir_.empty()) base_dir_ = dir_;
    dir_ = base_dir_ + "/run" + std::to_string(run);
    std::filesystem::create_directories(dir_);
  }

  std::vector<std::unique_ptr<ChildProcess>> hogs_;
  std::string base_dir_;
};

TEST_P(BusyHostTest, NothingDiesWhenTheHostIsLoadedAndProcessesAreDescheduledForSeconds) {
  const char* env = getenv("SHARDPS_BUSY_HOST_RUNS");
  const int runs = env != nullptr ? std::max(1, atoi(env)) : kRunsDefault;
  ASSERT_TRUE(LoadTheHost(std::chrono::seconds(60 + 40 * runs)))
      << "could not load the host to 10; load average " << LoadAverage1();
  const double load_start = LoadAverage1();
  double load_min = load_start;
  int stops = 0, false_deaths = 0, failed_runs = 0;
  size_t suspicions = 0, cleared = 0, coordinator_pauses = 0;
  std::mt19937 rng(20261124u);
  for (int run = 0; run < runs; ++run) {
    BeginRun(run);
    ClusterSpec spec;
    spec.transport = GetParam();
    spec.servers = 2;
    spec.replicas = 2;
    spec.workers = 3;
    spec.heartbeat_interval_ms = 100;
    spec.heartbeat_timeout_ms = 1500;  // lease 4.5 s
    const int kSteps = 12;
    ASSERT_TRUE(StartCluster(spec));
    std::vector<ChildProcess*> workers =
        SpawnWorkers(spec, {"--steps=" + std::to_string(kSteps), "--step_delay_ms=20"});
    ChildProcess* standalone = SpawnStandalone(spec, kSteps);
    // Two stops a run, once training is under way: each a random member for 1.6-2.8 s.
    std::vector<ChildProcess*> members = servers_;
    members.insert(members.end(), workers.begin(), workers.end());
    members.push_back(coordinator_);
    WaitProgress(Path("progress0"), 2, kProcessBound, workers[0]);
    for (int k = 0; k < 2; ++k) {
      ChildProcess* victim = members[rng() % members.size()];
      const milliseconds pause(1600 + static_cast<int>(rng() % 1200));
      victim->Signal(SIGSTOP);
      std::this_thread::sleep_for(pause);
      victim->Signal(SIGCONT);
      ++stops;
      std::cerr << "[ info ] run " << run << ": " << victim->name() << " stopped for "
                << pause.count() << " ms (load " << LoadAverage1() << ")\n";
      std::this_thread::sleep_for(milliseconds(300));
    }
    bool ok = true;
    for (ChildProcess* w : workers) {
      const int rc = ExitCode(w, kProcessBound);
      EXPECT_EQ(rc, 0) << "run " << run << ":\n" << Tail(w);
      ok = ok && rc == 0;
    }
    auto ref = StandaloneResult(standalone, kProcessBound);
    ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
    for (int r = 0; r < spec.workers && ok; ++r) {
      auto res = Result(r);
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_EQ(res->Int("failovers"), 0) << "run " << run << " worker " << r;
      EXPECT_EQ(res->Int("pushes_lost"), 0) << "run " << run << " worker " << r;
      ok = ok && res->Int("failovers") == 0;
      ExpectSameWeights(*res, *ref, r);
    }
    const std::string clog = coordinator_->LogTail(1 << 24);
    const size_t deaths = Count(clog, "its lease (") + Count(clog, ": unreachable");
    false_deaths += static_cast<int>(deaths);
    EXPECT_EQ(deaths, 0u) << "run " << run << ": a descheduled member was declared dead";
    for (ChildProcess* s : servers_) {
      EXPECT_EQ(s->LogTail(1 << 24).find("PROMOTED"), std::string::npos)
          << "run " << run << ": " << s->name() << " was promoted";
    }
    suspicions += Count(clog, "SUSPECTED");
    cleared += Count(clog, "slow, not dead");
    coordinator_pauses += Count(clog, "was descheduled for");
    failed_runs += ok && deaths == 0 ? 0 : 1;
    load_min = std::min(load_min, LoadAverage1());
    EndRun();
  }
  std::cerr << "[ info ] busy host, " << GetParam() << ": " << runs << " runs, " << stops
            << " stops of 1.6-2.8 s (suspicion floor 1.5 s, lease 4.5 s), " << suspicions
            << " suspicions (" << cleared << " cleared), " << coordinator_pauses
            << " coordinator pauses forgiven, " << false_deaths << " false deaths, "
            << failed_runs << " failed runs; load average " << load_start << " at start, >= "
            << load_min << " throughout\n";
  EXPECT_EQ(false_deaths, 0);
  EXPECT_EQ(failed_runs, 0);
  EXPECT_GE(load_min, 10.0) << "the host was not loaded enough for this to mean anything";
}

INSTANTIATE_TEST_SUITE_P(Transports, BusyHostTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
