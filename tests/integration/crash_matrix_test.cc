// The crash-point matrix (issue 14; docs/fault-tolerance.md, "Crash points"): every named crash
// point (common/crash_point.h) along start-up, training, checkpointing and failover, armed in
// every process role that reaches it (primary, backup, worker, coordinator), over tcp and shm on
// the host and verbs in the SoftRoCE guest. One case is one real cluster (2 groups x 2
// replicas, 3 workers, BSP) whose armed process exits at that point (_exit, like kill -9
// between two lines). The outcome each case must have:
//
//  * a server or the coordinator at any point: training finishes, every worker's weights
//    BIT-IDENTICAL to the one-process reference, no push lost (the coordinator is restarted
//    from its state file on the same port, as an operator or systemd would);
//  * a worker: it is restarted once (as a launcher would); the other workers finish with the
//    same weights as each other and nobody waits for a timeout;
//  * the backup at a promotion point after its primary was killed (no copy of the group
//    survives): every worker fails with DATA_LOSS naming group 0 within 1 s of the crash.
//
// No case may end by a timeout: every wait below is far shorter than the client's timeouts, and
// a case that would have stalled fails on its bound.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/crash_point.h"
#include "common/net.h"
#include "tests/integration/child_process.h"
#include "tests/integration/process_test_base.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

enum class Role { kPrimary, kBackup, kWorker, kCoordinator };
enum class Outcome { kBitIdentical, kWorkersAgree, kDataLoss };

struct CrashCase {
  const char* point;
  Role role;
  bool kill_primary_first;  // failover points: primary 0 is killed mid-training first
  Outcome outcome;
  bool checkpoints = false;
  // Workers also train a row table that each loads first (Client::SetRows of all 600 rows,
  // 16 rows per push: 19 set pushes per shard and worker), so the point falls in a load.
  bool loads_table = false;
  // The worker armed (Role::kWorker). Rank 0 publishes the initial weights at every start: a
  // restarted rank 0 must do so where no chunk has weights yet (it died before they were all
  // written) and must not where they have (a push of its predecessor may wait in its slot).
  int victim = 1;
};

const CrashCase kCases[] = {
    // Start-up.
    {"server.after_join", Role::kPrimary, false, Outcome::kBitIdentical},
    {"server.after_join", Role::kBackup, false, Outcome::kBitIdentical},
    {"server.before_shards_ready", Role::kPrimary, false, Outcome::kBitIdentical},
    {"server.before_shards_ready", Role::kBackup, false, Outcome::kBitIdentical},
    {"server.after_shards_ready", Role::kPrimary, false, Outcome::kBitIdentical},
    {"server.after_shards_ready", Role::kBackup, false, Outcome::kBitIdentical},
    {"server.after_replica_connect", Role::kPrimary, false, Outcome::kBitIdentical},
    {"coordinator.after_assign_shards", Role::kCoordinator, false, Outcome::kBitIdentical},
    {"coordinator.after_shard_map", Role::kCoordinator, false, Outcome::kBitIdentical},
    // A primary that takes rank 0's initial weights and dies before it replicates them.
    {"server.before_init_record", Role::kPrimary, false, Outcome::kBitIdentical},
    {"worker.after_join", Role::kWorker, false, Outcome::kWorkersAgree},
    {"worker.after_shard_map", Role::kWorker, false, Outcome::kWorkersAgree},
    {"worker.after_connect", Role::kWorker, false, Outcome::kWorkersAgree},
    {"worker.after_first_pull", Role::kWorker, false, Outcome::kWorkersAgree},
    {"worker.after_connect", Role::kWorker, false, Outcome::kWorkersAgree, false, false, 0},
    // Training and checkpointing.
    {"server.after_publish@10", Role::kPrimary, false, Outcome::kBitIdentical},
    {"worker.after_clock@5", Role::kWorker, false, Outcome::kWorkersAgree},
    {"worker.after_clock@5", Role::kWorker, false, Outcome::kWorkersAgree, false, false, 0},
    {"server.after_checkpoint_submit", Role::kPrimary, false, Outcome::kBitIdentical, true},
    // State transfer: a table being loaded (every worker sets every row before its first step).
    {"server.before_state_set_record@20", Role::kPrimary, false, Outcome::kBitIdentical, false,
     true},
    {"server.after_state_set@20", Role::kPrimary, false, Outcome::kBitIdentical, false, true},
    {"server.after_state_set@20", Role::kBackup, false, Outcome::kBitIdentical, false, true},
    {"worker.mid_state_transfer@10", Role::kWorker, false, Outcome::kWorkersAgree, false, true},
    // Failover (primary 0 killed first).
    {"coordinator.after_promote", Role::kCoordinator, true, Outcome::kBitIdentical},
    {"worker.before_resend", Role::kWorker, true, Outcome::kWorkersAgree},
    {"server.promote_before_drain", Role::kBackup, true, Outcome::kDataLoss},
    {"server.promote_after_cut", Role::kBackup, true, Outcome::kDataLoss},
};

const char* RoleName(Role r) {
  switch (r) {
    case Role::kPrimary:
      return "primary";
    case Role::kBackup:
      return "backup";
    case Role::kWorker:
      return "worker";
    case Role::kCoordinator:
      return "coordinator";
  }
  return "?";
}

std::string CaseName(const CrashCase& c) {
  std::string s = std::string(c.point) + "_" + RoleName(c.role);
  for (char& ch : s) {
    if (ch == '.' || ch == '@') ch = '_';
  }
  if (c.role == Role::kWorker && c.victim != 1) {
    s += "_rank" + std::to_string(c.victim);
  }
  return s;
}

class CrashMatrixTest : public ProcessTestBase,
                        public ::testing::WithParamInterface<std::tuple<std::string, int>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
  bool Emulated() const { return std::get<0>(GetParam()) == "verbs"; }
  milliseconds Bound() const { return Emulated() ? 4 * kProcessBound : kProcessBound; }

  // Runs `c` and checks its outcome.
  void Run(const CrashCase& c) {
    ClusterSpec spec;
    spec.transport = std::get<0>(GetParam());
    if (Emulated()) spec.heartbeat_timeout_ms = 6000;
    spec.servers = 2;
    spec.replicas = 2;
    spec.workers = 3;
    spec.state_file = Path("coordinator.state");
    if (c.checkpoints) {
      spec.checkpoint_dir = Path("checkpoints");
      spec.checkpoint_every = 3;
    }
    // A fixed port: a restarted coordinator must be found where the first one was.
    auto probe = net::ListenTcp("127.0.0.1:0", &spec.listen);
    ASSERT_TRUE(probe.ok()) << probe.status();
    probe->reset();
    const int kVictimWorker = c.victim;
    if (c.role == Role::kPrimary || c.role == Role::kBackup) {
      spec.crash_rank = c.role == Role::kPrimary ? 0 : spec.servers;
      spec.crash_point = c.point;
    }
    if (c.role == Role::kCoordinator) setenv("SHARDPS_CRASH_POINT", c.point, 1);
    ASSERT_NE(StartCoordinator(spec), "");
    unsetenv("SHARDPS_CRASH_POINT");
    ChildProcess* first_coordinator = coordinator_;
    StartServers(spec);
    const int kSteps = 20;
    const std::string delay = Emulated() ? "40" : "15";
    const std::string rows_flag = "--embedding_rows=600";
    std::vector<std::string> table;
    if (c.loads_table) table = {rows_flag, "--embedding_load"};
    std::vector<ChildProcess*> workers;
    for (int r = 0; r < spec.workers; ++r) {
      if (c.role == Role::kWorker && r == kVictimWorker) {
        setenv("SHARDPS_CRASH_POINT", c.point, 1);
      }
      std::vector<std::string> flags = {"--steps=" + std::to_string(kSteps),
                                        "--step_delay_ms=" + delay,
                                        "--progress_file=" + Path("progress" + std::to_string(r))};
      flags.insert(flags.end(), table.begin(), table.end());
      workers.push_back(SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log",
                                    flags));
      unsetenv("SHARDPS_CRASH_POINT");
    }
    ChildProcess* standalone = SpawnStandalone(spec, kSteps, table);
    // The armed process.
    ChildProcess* victim = c.role == Role::kCoordinator ? first_coordinator
                           : c.role == Role::kWorker    ? workers[kVictimWorker]
                                                        : servers_[spec.crash_rank];
    if (c.kill_primary_first) {
      const int w = c.role == Role::kWorker ? (kVictimWorker == 0 ? 2 : 0) : kVictimWorker;
      ASSERT_GE(WaitProgress(Path("progress" + std::to_string(w)), 4, Bound(), workers[w]), 4)
          << Tail(workers[w]);
      servers_[0]->Kill();
    }
    // The crash: the armed process exits with the crash point's status.
    ASSERT_EQ(ExitCode(victim, Bound()), kCrashPointExitCode) << Tail(victim);
    const auto crashed = Clock::now();
    if (c.role == Role::kCoordinator) {
      ASSERT_NE(StartCoordinator(spec), "") << "the restarted coordinator did not come up";
    }
    ChildProcess* again = nullptr;
    if (c.role == Role::kWorker) {
      // (It trains the table but does not load it again: it rejoins a running job. The others
      // pass a barrier after their loads; it is counted there unless it came back after the
      // release, so it arrives at an open one.)
      std::vector<std::string> flags = {"--steps=3", "--step_delay_ms=" + delay,
                                        "--out=" + Path("restarted.out")};
      if (c.loads_table) {
        flags.push_back(rows_flag);
        flags.push_back("--join_open_barrier");
      }
      again = SpawnWorker(WorkerArgs(spec, kVictimWorker), "worker-restarted.log", flags);
    }
    switch (c.outcome) {
      case Outcome::kBitIdentical:
        ExpectWorkersMatchReference(spec, workers, standalone, kSteps, -1, Bound());
        break;
      case Outcome::kWorkersAgree: {
        std::vector<WorkerResult> results;
        for (int r = 0; r < spec.workers; ++r) {
          if (r == kVictimWorker) continue;
          ASSERT_EQ(ExitCode(workers[r], Bound()), 0) << Tail(workers[r]);
          auto res = Result(r);
          ASSERT_TRUE(res.ok()) << res.status();
          EXPECT_EQ(res->Int("steps"), kSteps);
          EXPECT_EQ(res->Int("pushes_lost"), 0);
          results.push_back(std::move(*res));
        }
        for (size_t i = 1; i < results.size(); ++i) ExpectSameWeights(results[i], results[0], 0);
        EXPECT_EQ(ExitCode(again, Bound()), 0) << Tail(again);
        break;
      }
      case Outcome::kDataLoss: {
        // Every worker fails with DATA_LOSS naming group 0, within 1 s of the crash.
        milliseconds slowest(0);
        for (ChildProcess* w : workers) {
          const int rc = ExitCode(w, Bound());
          slowest = std::max(slowest, std::chrono::duration_cast<milliseconds>(Clock::now() - crashed));
          EXPECT_EQ(rc, 5) << "a step must fail:\n" << Tail(w);
          const std::string log = w->LogTail(1 << 20);
          EXPECT_NE(log.find("DATA_LOSS"), std::string::npos) << Tail(w);
          EXPECT_NE(log.find("group 0"), std::string::npos) << Tail(w);
        }
        EXPECT_LE(slowest, Emulated() ? milliseconds(5000) : milliseconds(1000))
            << "DATA_LOSS reached the last worker " << slowest.count() << " ms after the crash";
        std::cerr << "[ info ] DATA_LOSS reached every worker within " << slowest.count()
                  << " ms of the crash\n";
        break;
      }
    }
  }
};

TEST_P(CrashMatrixTest, EveryCrashPointEndsBitIdenticalOrInAPromptError) {
  Run(kCases[std::get<1>(GetParam())]);
}

INSTANTIATE_TEST_SUITE_P(
    Points, CrashMatrixTest,
    ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                       ::testing::Range(0, static_cast<int>(sizeof(kCases) / sizeof(kCases[0])))),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + CaseName(kCases[std::get<1>(info.param)]);
    });

}  // namespace
}  // namespace shardps
