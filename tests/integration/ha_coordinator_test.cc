// HA coordinators (docs/control-protocol.md, "HA coordinator"): two shardps_coordinator
// processes share a 3-member etcd cluster on loopback (started by the test); one is elected
// leader and keeps the cluster's state in etcd, the other waits as a standby without listening.
// Members are given both addresses. kill -9 of the leader mid-training, and together with a
// primary (during a failover): the standby is elected, loads the state, the members rejoin it,
// and the BSP run ends BIT-IDENTICAL to the one-process reference. Part of process_cluster_test
// (tcp and shm: the control plane does not depend on the data path).
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/child_process.h"
#include "tests/integration/etcd_cluster.h"
#include "tests/integration/process_test_base.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

class HaCoordinatorTest : public ProcessClusterTest {
 protected:
  // The etcd cluster, then coordinator A (elected) and B (standby); members get both.
  // `leader_crash_point`: armed in coordinator A only (common/crash_point.h).
  void StartHa(const ClusterSpec& spec, const std::string& leader_crash_point = "") {
    const std::string why = etcd_.Start(dir_);
    if (why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
    ASSERT_EQ(why, "");
    const std::string prefix = "/shardps/ha-test-" + std::to_string(getpid());
    for (int i = 0; i < 2; ++i) {
      const std::string listen = "127.0.0.1:" + std::to_string(testing_util::FreeLoopbackPort());
      std::vector<std::string> argv =
          CoordinatorArgs(spec, listen, Path("coordinator" + std::to_string(i) + ".addr"));
      argv.push_back("--etcd=" + etcd_.Endpoints());
      argv.push_back("--etcd_prefix=" + prefix);
      argv.push_back("--etcd_lease_s=2");
      argv.push_back("--rejoin_grace_ms=5000");
      if (i == 0 && !leader_crash_point.empty()) {
        setenv("SHARDPS_CRASH_POINT", leader_crash_point.c_str(), 1);
      }
      coordinators_[i] = Spawn(argv, "coordinator" + std::to_string(i) + ".log");
      unsetenv("SHARDPS_CRASH_POINT");
      ASSERT_NE(coordinators_[i], nullptr);
      ASSERT_TRUE(WaitForLog(coordinators_[i], i == 0 ? "ELECTED" : "STANDBY", ProcessBound()))
          << Tail(coordinators_[i]);
      coordinator_address_ += (i ? "," : "") + listen;
    }
    coordinator_ = coordinators_[0];
    StartServers(spec);
  }

  // The HA tests' cluster: 2 groups x 2 replicas, 3 workers.
  ClusterSpec HaSpec() const {
    ClusterSpec spec = Spec();
    spec.servers = 2;
    spec.replicas = 2;
    spec.workers = 3;
    return spec;
  }
  // Starts the workers (kSteps BSP steps, delay_ms each) and the one-process reference, and
  // waits until worker 0 has done 10 steps.
  std::vector<ChildProcess*> TrainPastStep10(const ClusterSpec& spec, int steps, int delay_ms,
                                             ChildProcess** standalone) {
    std::vector<ChildProcess*> workers =
        SpawnWorkers(spec, {"--steps=" + std::to_string(steps),
                            "--step_delay_ms=" + std::to_string(delay_ms)});
    *standalone = SpawnStandalone(spec, steps);
    [&] { ASSERT_GE(WaitProgress(Path("progress0"), 10, ProcessBound(), workers[0]), 10); }();
    return workers;  // the caller returns on a fatal failure
  }

  testing_util::EtcdCluster etcd_;
  ChildProcess* coordinators_[2] = {nullptr, nullptr};
};

TEST_P(HaCoordinatorTest, KillingTheLeaderMidTrainingIsBitIdentical) {
  const ClusterSpec spec = HaSpec();
  // Long enough (~5 s) that the standby is elected (the leader's 2 s etcd lease) mid-run.
  const int kSteps = 150;
  ASSERT_NO_FATAL_FAILURE(StartHa(spec));
  if (IsSkipped()) return;
  ChildProcess* standalone = nullptr;
  std::vector<ChildProcess*> workers = TrainPastStep10(spec, kSteps, 30, &standalone);
  if (HasFatalFailure()) return;
  coordinators_[0]->Kill();
  const auto t0 = Clock::now();
  ASSERT_TRUE(WaitForLog(coordinators_[1], "ELECTED", ProcessBound())) << Tail(coordinators_[1]);
  const auto elected = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  ASSERT_LT(WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr), kSteps)
      << "training ended before the new leader was elected";
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/0, ProcessBound());
  EXPECT_NE(coordinators_[1]->LogTail(1 << 22).find("rejoined"), std::string::npos);
  std::cerr << "[ info ] " << GetParam() << ": leader killed; standby elected " << elected
            << " ms later; training went on, weights bit-identical\n";
}

TEST_P(HaCoordinatorTest, KillingTheLeaderWithAPrimaryFailsOverUnderTheNewLeader) {
  const ClusterSpec spec = HaSpec();
  const int kSteps = 60;
  ASSERT_NO_FATAL_FAILURE(StartHa(spec));
  if (IsSkipped()) return;
  ChildProcess* standalone = nullptr;
  std::vector<ChildProcess*> workers = TrainPastStep10(spec, kSteps, 15, &standalone);
  if (HasFatalFailure()) return;
  coordinators_[0]->Kill();
  servers_[0]->Kill();
  const auto t0 = Clock::now();
  ASSERT_TRUE(WaitForLog(servers_[2], "PROMOTED", ProcessBound())) << Tail(servers_[2]);
  const auto promoted = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/1, ProcessBound());
  std::cerr << "[ info ] " << GetParam() << ": leader and primary 0 killed together; the new "
            << "leader promoted the backup " << promoted << " ms later; bit-identical\n";
}

// During a failover: primary 0 is killed and the leader dies right after deciding the promotion
// (crash point coordinator.after_promote: the Promote is queued, its state not yet in etcd, so
// nothing left: write-ahead). The new leader knows nothing of it, declares the silent primary
// dead after the rejoin grace, promotes the backup itself, and the run is bit-identical.
TEST_P(HaCoordinatorTest, TheLeaderDyingAsItPromotesIsTakenOverBitIdentical) {
  const ClusterSpec spec = HaSpec();
  const int kSteps = 60;
  ASSERT_NO_FATAL_FAILURE(StartHa(spec, "coordinator.after_promote"));
  if (IsSkipped()) return;
  ChildProcess* standalone = nullptr;
  std::vector<ChildProcess*> workers = TrainPastStep10(spec, kSteps, 15, &standalone);
  if (HasFatalFailure()) return;
  servers_[0]->Kill();
  const auto t0 = Clock::now();
  ASSERT_TRUE(WaitForLog(coordinators_[1], "ELECTED", ProcessBound())) << Tail(coordinators_[1]);
  EXPECT_FALSE(coordinators_[0]->Running()) << "the crash point did not fire";
  ASSERT_TRUE(WaitForLog(servers_[2], "PROMOTED", ProcessBound())) << Tail(servers_[2]);
  const auto promoted = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  EXPECT_NE(coordinators_[1]->LogTail(1 << 22).find("PROMOTING"), std::string::npos)
      << "the new leader must decide the promotion itself";
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/1, ProcessBound());
  std::cerr << "[ info ] " << GetParam() << ": the leader died as it promoted; the new leader "
            << "promoted the backup " << promoted << " ms after the primary's kill\n";
}

// A leader stopped (SIGSTOP: a descheduled or swapped-out process) past its etcd lease is
// replaced by the standby, and the members move to it. When the old leader resumes it must not
// act -- read its members' sockets, judge their silence, decide anything -- before it learns
// that it lost the lease: its loop acts only while the lease its keeper thread last renewed
// surely still holds (the renewal's send time + 3/4 of the TTL). Before, the resumed loop ran
// for up to a quarter of the TTL (the keeper's sleep) and declared the members that had moved
// to the new leader gone, next to the leader that held them.
TEST_P(HaCoordinatorTest, ALeaderStoppedPastItsLeaseNeverActsAgain) {
  const ClusterSpec spec = HaSpec();
  const int kSteps = 150;
  ASSERT_NO_FATAL_FAILURE(StartHa(spec));
  if (IsSkipped()) return;
  ChildProcess* standalone = nullptr;
  std::vector<ChildProcess*> workers = TrainPastStep10(spec, kSteps, 30, &standalone);
  if (HasFatalFailure()) return;
  ChildProcess* old_leader = coordinators_[0];
  old_leader->Signal(SIGSTOP);
  const size_t stopped_at = old_leader->LogTail(1 << 24).size();
  ASSERT_TRUE(WaitForLog(coordinators_[1], "ELECTED", ProcessBound())) << Tail(coordinators_[1]);
  ASSERT_TRUE(WaitForLog(coordinators_[1], "rejoined", ProcessBound())) << Tail(coordinators_[1]);
  std::this_thread::sleep_for(milliseconds(1000));  // the members leave the old leader's sockets
  old_leader->Signal(SIGCONT);
  const int rc = ExitCode(old_leader, ProcessBound());
  EXPECT_EQ(rc, 3) << Tail(old_leader);  // LOST LEADERSHIP
  const std::string after = old_leader->LogTail(1 << 24).substr(stopped_at);
  EXPECT_NE(after.find("LOST LEADERSHIP"), std::string::npos) << after;
  for (const char* act : {"gone without leaving", "departed", "declared", "joined", "PROMOTING",
                          "epoch", "suspect"}) {
    EXPECT_EQ(after.find(act), std::string::npos)
        << "the deposed leader acted after it resumed (\"" << act << "\"):\n" << after;
  }
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/0, ProcessBound());
  std::cerr << "[ info ] " << GetParam() << ": the leader stopped past its lease resumed and "
            << "exited without acting; weights bit-identical under the new leader\n";
}

INSTANTIATE_TEST_SUITE_P(Transports, HaCoordinatorTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
