// Redundancy restored (docs/fault-tolerance.md): after a failover a group gets a new backup (a
// spare started with --spare, or the restarted old primary), which copies the primary's
// snapshot with one-sided reads while training goes on and then follows its replication
// stream; a second failure of the same group is then survived BIT-IDENTICALLY. A primary that
// dies while its new backup is still copying loses the group (DATA_LOSS at every worker), since
// the copy is not a copy yet. Part of process_cluster_test (ProcessClusterTest over tcp, shm
// and verbs); fixtures in process_test_base.h.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/crash_point.h"
#include "tests/integration/child_process.h"
#include "tests/integration/process_test_base.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
}

// The line of `c`'s log holding `text` ("" if none).
std::string LogLine(ChildProcess* c, const std::string& text) {
  const std::string log = c->LogTail(1 << 22);
  const size_t at = log.find(text);
  if (at == std::string::npos) return "";
  const size_t begin = log.rfind('\n', at);
  const size_t end = log.find('\n', at);
  return log.substr(begin == std::string::npos ? 0 : begin + 1,
                    end == std::string::npos ? std::string::npos : end - begin - 1);
}

class ReReplication {
 public:
  // 2 groups x 2 replicas, 3 workers, BSP with momentum (the optimizer state must be copied too).
  static ClusterSpec Of(ClusterSpec spec) {
    spec.servers = 2;
    spec.replicas = 2;
    spec.workers = 3;
    spec.optimizer = "momentum";
    return spec;
  }
};

// Kill group 0's primary; a spare becomes the group's new backup and catches up while training
// goes on; kill the promoted primary too: the spare takes over, and the run ends bit-identical
// to the one-process reference (every worker failed over twice, no push lost or doubled).
TEST_P(ProcessClusterTest, ASpareRestoresRedundancySoASecondFailureIsSurvivedBitIdentical) {
  const ClusterSpec spec = ReReplication::Of(Spec());
  const int kSteps = Emulated() ? 50 : 70;
  const int step_delay_ms = Emulated() ? 40 : 15;
  ASSERT_TRUE(StartCluster(spec));
  ChildProcess* spare = SpawnServer(spec, -1, {"--spare"}, "spare.log");
  ASSERT_NE(spare, nullptr);
  std::vector<ChildProcess*> workers =
      SpawnWorkers(spec, {"--steps=" + std::to_string(kSteps),
                          "--step_delay_ms=" + std::to_string(step_delay_ms)});
  ChildProcess* standalone = SpawnStandalone(spec, kSteps, {"--optimizer=momentum"});
  ASSERT_GE(WaitProgress(Path("progress0"), 8, ProcessBound(), workers[0]), 8) << Tail(workers[0]);

  servers_[0]->Kill();
  const auto t_kill = Clock::now();
  ASSERT_TRUE(WaitForLog(spare, "IN SYNC", ProcessBound())) << Tail(spare);
  const int64_t kill_to_sync = MsSince(t_kill);
  const int at_sync = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  ASSERT_LT(at_sync + 4, kSteps) << "training ended before the second kill";
  // Training goes on with the new backup following the stream, then the second failure.
  ASSERT_GE(WaitProgress(Path("progress0"), at_sync + 2, ProcessBound(), workers[0]), at_sync + 2);
  servers_[2]->Kill();
  const auto t_kill2 = Clock::now();
  ASSERT_TRUE(WaitForLog(spare, "PROMOTED", ProcessBound())) << Tail(spare);
  const int64_t kill_to_promoted = MsSince(t_kill2);
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/2, ProcessBound());
  EXPECT_NE(coordinator_->LogTail(1 << 22).find("REPLICATED AGAIN"), std::string::npos);
  std::cerr << "[ info ] " << GetParam() << ": first kill -> spare in sync " << kill_to_sync
            << " ms; " << LogLine(spare, "IN SYNC") << "\n[ info ] second kill -> spare promoted "
            << kill_to_promoted << " ms; both failovers bit-identical\n";
}

// No spare: the killed primary is started again with its rank; it becomes the group's new
// backup (not "unused"), catches up, and takes over when the promoted primary dies too.
TEST_P(ProcessClusterTest, ARestartedPrimaryBecomesItsGroupsNewBackup) {
  const ClusterSpec spec = ReReplication::Of(Spec());
  const int kSteps = Emulated() ? 50 : 70;
  const int step_delay_ms = Emulated() ? 40 : 15;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers =
      SpawnWorkers(spec, {"--steps=" + std::to_string(kSteps),
                          "--step_delay_ms=" + std::to_string(step_delay_ms)});
  ChildProcess* standalone = SpawnStandalone(spec, kSteps, {"--optimizer=momentum"});
  ASSERT_GE(WaitProgress(Path("progress0"), 8, ProcessBound(), workers[0]), 8) << Tail(workers[0]);
  servers_[0]->Kill();
  ASSERT_TRUE(WaitForLog(servers_[2], "PROMOTED", ProcessBound())) << Tail(servers_[2]);
  ChildProcess* again = SpawnServer(spec, 0, {}, "server0-again.log");
  ASSERT_NE(again, nullptr);
  ASSERT_TRUE(WaitForLog(again, "IN SYNC", ProcessBound())) << Tail(again);
  const int at_sync = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  ASSERT_LT(at_sync + 4, kSteps) << "training ended before the second kill";
  ASSERT_GE(WaitProgress(Path("progress0"), at_sync + 2, ProcessBound(), workers[0]), at_sync + 2);
  servers_[2]->Kill();
  ASSERT_TRUE(WaitForLog(again, "PROMOTED", ProcessBound())) << Tail(again);
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/2, ProcessBound());
  std::cerr << "[ info ] " << GetParam() << ": " << LogLine(again, "IN SYNC") << "\n";
}

// The promoted primary dies right after it took the snapshot for its new backup (crash point
// server.after_handoff): the spare holds nothing yet, so it is not promoted; the group is lost
// and every worker gets DATA_LOSS naming it, at once rather than after a timeout.
TEST_P(ProcessClusterTest, APrimaryLostWhileItsNewBackupCopiesIsDataLoss) {
  ClusterSpec spec = ReReplication::Of(Spec());
  spec.crash_rank = 2;
  spec.crash_point = "server.after_handoff";
  ASSERT_TRUE(StartCluster(spec));
  ChildProcess* spare = SpawnServer(spec, -1, {"--spare"}, "spare.log");
  ASSERT_NE(spare, nullptr);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, {"--steps=100000", "--step_delay_ms=5"});
  ASSERT_GE(WaitProgress(Path("progress0"), 5, ProcessBound(), workers[0]), 5) << Tail(workers[0]);
  servers_[0]->Kill();
  const auto t0 = Clock::now();
  for (ChildProcess* w : workers) {
    EXPECT_EQ(ExitCode(w, ProcessBound()), 5) << Tail(w);  // a step failed
    const std::string log = w->LogTail();
    EXPECT_NE(log.find("DATA_LOSS"), std::string::npos) << log;
    EXPECT_NE(log.find("group 0"), std::string::npos) << log;
  }
  EXPECT_EQ(spare->LogTail(1 << 22).find("IN SYNC"), std::string::npos);
  EXPECT_NE(coordinator_->LogTail(1 << 22).find("still copying"), std::string::npos)
      << Tail(coordinator_);
  std::cerr << "[ info ] " << GetParam() << ": workers reported DATA_LOSS " << MsSince(t0)
            << " ms after the first kill (the promoted primary died during the copy)\n";
}

// The first spare dies at a crash point of its copy; the primary goes on unreplicated, the
// second spare is made the group's backup and catches up, and a failure of the promoted primary
// is then survived bit-identically. `point`:
//  * server.before_catch_up: as it starts copying (it never gets in sync);
//  * server.after_catch_up: right after its copy is restored and the records held meanwhile
//    applied ("IN SYNC" logged), before it tells the coordinator (ReplicaSynced): the primary
//    already streams to it, and nobody may count it as the group's backup.
class SpareDeathTest : public ProcessClusterTest {
 public:
  void Run(const std::string& point) {
    const ClusterSpec spec = ReReplication::Of(Spec());
    const int kSteps = Emulated() ? 50 : 70;
    const int step_delay_ms = Emulated() ? 40 : 15;
    ASSERT_TRUE(StartCluster(spec));
    setenv("SHARDPS_CRASH_POINT", point.c_str(), 1);
    ChildProcess* first = SpawnServer(spec, -1, {"--spare"}, "spare-first.log");
    unsetenv("SHARDPS_CRASH_POINT");
    ASSERT_TRUE(WaitForLog(first, "SPARE", ProcessBound())) << Tail(first);
    ChildProcess* second = SpawnServer(spec, -1, {"--spare"}, "spare-second.log");
    ASSERT_TRUE(WaitForLog(second, "SPARE", ProcessBound())) << Tail(second);
    std::vector<ChildProcess*> workers =
        SpawnWorkers(spec, {"--steps=" + std::to_string(kSteps),
                            "--step_delay_ms=" + std::to_string(step_delay_ms)});
    ChildProcess* standalone = SpawnStandalone(spec, kSteps, {"--optimizer=momentum"});
    ASSERT_GE(WaitProgress(Path("progress0"), 8, ProcessBound(), workers[0]), 8) << Tail(workers[0]);
    servers_[0]->Kill();
    ASSERT_TRUE(WaitForLog(second, "IN SYNC", ProcessBound())) << Tail(second);
    // The first spare died at its point (crash exit), chosen first; the second took its place.
    EXPECT_EQ(ExitCode(first, ProcessBound()), kCrashPointExitCode) << Tail(first);
    const bool synced_first = first->LogTail(1 << 22).find("IN SYNC") != std::string::npos;
    EXPECT_EQ(synced_first, point == "server.after_catch_up") << Tail(first);
    const int at_sync = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
    ASSERT_LT(at_sync + 4, kSteps) << "training ended before the second kill";
    ASSERT_GE(WaitProgress(Path("progress0"), at_sync + 2, ProcessBound(), workers[0]),
              at_sync + 2);
    servers_[2]->Kill();
    ASSERT_TRUE(WaitForLog(second, "PROMOTED", ProcessBound())) << Tail(second);
    ExpectWorkersMatchReference(spec, workers, standalone, kSteps, /*failovers=*/2,
                                ProcessBound());
    std::cerr << "[ info ] " << GetParam() << ": first spare died at " << point
              << "; the second: " << LogLine(second, "IN SYNC") << "\n";
  }
};

TEST_P(SpareDeathTest, ASpareDyingAsItStartsItsCopyIsReplacedByTheNextSpare) {
  Run("server.before_catch_up");
}

TEST_P(SpareDeathTest, ASpareDyingOnceInSyncButUnreportedIsReplacedByTheNextSpare) {
  Run("server.after_catch_up");
}

INSTANTIATE_TEST_SUITE_P(Transports, SpareDeathTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
