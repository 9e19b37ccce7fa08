// The parameter server as real processes, under faults (docs/fault-tolerance.md): server kills
// and failover, exactly-once pushes across a failover, a server lost without a backup, worker
// restart and elastic join, restore from a checkpoint, injected data-path errors, a coordinator
// restart, and control messages dropped and delayed. Part of process_cluster_test (with
// process_cluster_test.cc, which instantiates ProcessClusterTest over the transports); the
// shared fixtures are in process_test_base.h.
//
// Every wait is bounded, and every child is killed (SIGKILL) and reaped in TearDown, whatever
// the test's outcome. On failure the children's logs are printed and their directory is kept.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/crash_point.h"
#include "common/row_init.h"
#include "tests/integration/child_process.h"
#include "tests/integration/process_test_base.h"

namespace shardps {
namespace {

// ps_test_worker's --embedding_load value of a row (RowTask::Loaded).
float LoadedRowValue(int64_t id, int j) {
  const uint64_t x = shardps::SplitMix64((7ull << 60) ^ static_cast<uint64_t>(id * 8 + j));
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) /
         static_cast<float>(1 << 23);
}

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

// ---- Fault tolerance (docs/fault-tolerance.md) ----------------------------------------------

// A server process is SIGKILLed mid-training (a primary or a backup, chosen by a seed, at a step
// chosen by the seed). Its group fails over to the backup (or goes on unreplicated) and the BSP
// run ends with weights BIT-IDENTICAL to the one-process reference: every gradient applied
// once, never twice, none dropped, and summed in the same (worker-rank) order. The recovery
// time (kill -> the next step completed) is printed.
class ServerKillTest : public ProcessTestBase,
                       public ::testing::WithParamInterface<std::tuple<std::string, int>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
  bool Emulated() const { return std::get<0>(GetParam()) == "verbs"; }
  milliseconds ProcessBound() const { return Emulated() ? 4 * kProcessBound : kProcessBound; }
};

TEST_P(ServerKillTest, BspWeightsAreBitIdenticalAfterAServerKill) {
  const auto [transport, seed] = GetParam();
  ClusterSpec spec;
  spec.transport = transport;
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  // Under SoftRoCE's CPU emulation a busy guest can starve a heartbeat thread for > 1.5 s.
  spec.heartbeat_timeout_ms = Emulated() ? 6000 : 1500;
  // Seeded victim and moment: seeds 0..3 kill primary 0, primary 1, backup 2, backup 3.
  // Seed 4 kills primary 0 of a model cut into 64-byte chunks (a 64 x 64 W): 130 chunks per
  // group, more than the replication ring's 512 entries hold at 4 per chunk (the ring is
  // capped; its records wait for room), so a BSP step's versions queue for the ring.
  std::vector<std::string> model;
  if (seed >= 4) {
    spec.partition_bytes = 64;
    model = {"--outputs=64"};
  }
  std::mt19937 rng(static_cast<uint32_t>(seed) * 7919u + 17u);
  const int victim_rank = seed % 4;
  const int kSteps = 30;
  const int kill_after = 4 + static_cast<int>(rng() % 16);
  const int step_delay_ms = Emulated() ? 40 : 15;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<std::string> flags = {"--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=" + std::to_string(step_delay_ms)};
  flags.insert(flags.end(), model.begin(), model.end());
  // Held 10 steps past the kill point (at most step 29 of 30) until the kill: never over
  // before it, and with 150 ms in which the kill lands mid-step as before.
  for (const std::string& f : HoldFlags(kill_after + 10)) flags.push_back(f);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps, model);
  for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
  const int done = WaitProgress(Path("progress0"), kill_after, ProcessBound(), workers[0]);
  ASSERT_GE(done, kill_after) << Tail(workers[0]);
  ASSERT_LT(done, kSteps) << "training ended before the kill";
  // The step in progress when the server dies is the one that recovers: the time from the kill
  // to its completion (minus the step's own sleep) is detection + failover + resend.
  const int at_kill = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  servers_[victim_rank]->Kill();
  const auto t0 = Clock::now();
  ASSERT_TRUE(ReleaseHold());
  const int after = WaitProgress(Path("progress0"), at_kill + 1, ProcessBound(), workers[0]);
  const auto recovery = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  ASSERT_GE(after, at_kill + 1) << "no progress after the kill:\n" << Tail(workers[0]);
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  int64_t failovers = 0;
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    failovers += res->Int("failovers");
    ExpectSameWeights(*res, *ref, r);
  }
  if (victim_rank < spec.servers) {
    EXPECT_EQ(failovers, spec.workers) << "every worker moves to the promoted backup once";
  } else {
    EXPECT_EQ(failovers, 0) << "a backup's death is invisible to the workers";
  }
  std::cerr << "[ info ] " << transport << " seed " << seed << ": killed server rank "
            << victim_rank << (victim_rank < spec.servers ? " (primary)" : " (backup)")
            << " after step " << at_kill << "; the next step completed " << recovery.count()
            << " ms after the kill (its own sleep: " << step_delay_ms << " ms); failovers "
            << failovers << "\n";
}

INSTANTIATE_TEST_SUITE_P(Seeds, ServerKillTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Values(0, 1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_seed" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The same with a row table (an embedding) trained beside the dense tensors: every row, read
// by the workers step by step and moved by their sparse gradients, ends bit-identical to the
// one-process reference after a primary or a backup is killed (as above: seeds 0..3 kill
// primary 0, primary 1, backup 2, backup 3). Row records are replicated, and pushes the backup lacks are resent from the
// client's row staging.
TEST_P(ServerKillTest, BspRowTableIsBitIdenticalAfterAServerKill) {
  const auto [transport, seed] = GetParam();
  ClusterSpec spec;
  spec.transport = transport;
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  spec.heartbeat_timeout_ms = Emulated() ? 6000 : 1500;
  std::mt19937 rng(static_cast<uint32_t>(seed) * 7919u + 29u);
  const int victim_rank = seed % 4;
  const int kSteps = 30;
  const int kill_after = 4 + static_cast<int>(rng() % 16);
  const std::string rows_flag = "--embedding_rows=600";
  // Every worker loads the table first (Client::SetRows): the backup must hold the loaded rows
  // (replicated row sets) for the run after the kill to stay bit-identical.
  const std::string load_flag = "--embedding_load";
  ASSERT_TRUE(StartCluster(spec));
  std::vector<std::string> flags = {"--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=" + std::to_string(Emulated() ? 40 : 15),
                                    rows_flag, load_flag};
  for (const std::string& f : HoldFlags(kill_after + 10)) flags.push_back(f);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps, {rows_flag, load_flag});
  for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
  const int done = WaitProgress(Path("progress0"), kill_after, ProcessBound(), workers[0]);
  ASSERT_GE(done, kill_after) << Tail(workers[0]);
  ASSERT_LT(done, kSteps) << "training ended before the kill";
  servers_[victim_rank]->Kill();
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  ASSERT_EQ(ref->tensors["E"].size(), 600u * 4);
  int moved = 0;
  for (size_t i = 0; i < ref->tensors["E"].size(); ++i) {
    moved += ref->tensors["E"][i] != LoadedRowValue(static_cast<int64_t>(i / 4), static_cast<int>(i % 4));
  }
  ASSERT_GT(moved, 200) << "the reference's rows barely trained";
  int64_t failovers = 0;
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    failovers += res->Int("failovers");
    ExpectSameWeights(*res, *ref, r);
  }
  EXPECT_EQ(failovers, victim_rank < spec.servers ? spec.workers : 0);
}

// The same with a hashed row table (64-bit keys, a capacity of 120 rows, so buckets fill and
// rows are evicted): the backup places, admits and evicts exactly as the primary did, and the
// rows of every key end bit-identical to the one-process model of the policy.
TEST_P(ServerKillTest, BspHashedRowTableIsBitIdenticalAfterAServerKill) {
  const auto [transport, seed] = GetParam();
  ClusterSpec spec;
  spec.transport = transport;
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  spec.heartbeat_timeout_ms = Emulated() ? 6000 : 1500;
  std::mt19937 rng(static_cast<uint32_t>(seed) * 7919u + 31u);
  const int victim_rank = seed % 4;
  const int kSteps = 30;
  const int kill_after = 4 + static_cast<int>(rng() % 16);
  const std::vector<std::string> table = {"--embedding_rows=120", "--embedding_hashed"};
  ASSERT_TRUE(StartCluster(spec));
  std::vector<std::string> flags = {"--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=" + std::to_string(Emulated() ? 40 : 15)};
  flags.insert(flags.end(), table.begin(), table.end());
  for (const std::string& f : HoldFlags(kill_after + 10)) flags.push_back(f);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps, table);
  for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
  const int done = WaitProgress(Path("progress0"), kill_after, ProcessBound(), workers[0]);
  ASSERT_GE(done, kill_after) << Tail(workers[0]);
  ASSERT_LT(done, kSteps) << "training ended before the kill";
  servers_[victim_rank]->Kill();
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  ASSERT_EQ(ref->tensors["E"].size(), (30u * 3 * 3 + 7) * 4) << "keys touched";
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    ExpectSameWeights(*res, *ref, r);
  }
}

// Exactly once for row tables, in every mode: each worker pushes -1 into its own row (100 +
// rank) and into a shared row 7 every step (servers sum, lr 1), so a row counts the pushes
// applied to it. A primary (of group 0, which holds rows 100 and 102) is SIGKILLed mid-run,
// each worker's own row must end at exactly its number of steps: under BSP, SSP(2) and ASP, the
// backup holds each row push once (replicated sparse records), and the pushes it lacks are
// resent from the client's row staging, none twice.
class RowFailoverModeTest : public ProcessTestBase,
                            public ::testing::WithParamInterface<std::tuple<std::string, int>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
  bool Emulated() const { return std::get<0>(GetParam()) == "verbs"; }
  // Three counter workers (--model=counter --embedding_rows, `extra` flags added) over 2 groups
  // x 2 replicas; the primary of group 0 (rows 100 and 102) is SIGKILLed a third of the way in.
  // Every worker's own row must count exactly its 30 pushes.
  void RunAcrossAFailover(const std::vector<std::string>& extra);
  // The mode's cluster: 2 groups x 2 replicas, `workers` workers, sums at lr 1.
  ClusterSpec FailoverSpec(int workers) const;
};

struct RowModeCase {
  const char* name;
  const char* consistency;
  int staleness;
};
constexpr RowModeCase kRowModes[] = {{"bsp", "bsp", 0}, {"ssp2", "ssp", 2}, {"asp", "asp", 0}};

ClusterSpec RowFailoverModeTest::FailoverSpec(int workers) const {
  const RowModeCase& mode = kRowModes[std::get<1>(GetParam())];
  ClusterSpec spec;
  spec.transport = std::get<0>(GetParam());
  spec.consistency = mode.consistency;
  spec.staleness = mode.staleness;
  spec.lr = 1.0;
  spec.aggregation = "sum";
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = workers;
  spec.heartbeat_timeout_ms = Emulated() ? 6000 : 1500;
  return spec;
}

void RowFailoverModeTest::RunAcrossAFailover(const std::vector<std::string>& extra) {
  const RowModeCase& mode = kRowModes[std::get<1>(GetParam())];
  const milliseconds bound = Emulated() ? 4 * kProcessBound : kProcessBound;
  ClusterSpec spec = FailoverSpec(3);
  const int kSteps = 30;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    std::vector<std::string> args = {
        "--model=counter", "--embedding_rows=200", "--steps=" + std::to_string(kSteps),
        "--staleness=" + std::to_string(mode.staleness),
        std::string("--max_delay_ms=") + (r == 0 ? "20" : "6"),
        "--progress_file=" + Path("progress" + std::to_string(r))};
    args.insert(args.end(), extra.begin(), extra.end());
    // Held two thirds in until the kill: every worker sees the failover.
    for (const std::string& f : HoldFlags(2 * kSteps / 3)) args.push_back(f);
    workers.push_back(
        SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log", args));
  }
  const int done = WaitProgress(Path("progress1"), kSteps / 3, bound, workers[1]);
  ASSERT_GE(done, kSteps / 3) << Tail(workers[1]);
  ASSERT_LT(done, kSteps) << "training ended before the kill";
  servers_[0]->Kill();  // the primary of group 0
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Int("row_count"), kSteps)
        << "worker " << r << "'s row holds " << res->Int("row_count") << " of its " << kSteps
        << " pushes (log: " << Tail(workers[r]) << ")";
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    if (std::string(mode.consistency) != "asp") {
      EXPECT_EQ(res->Int("violations"), 0) << "worker " << r << ": a dense read broke the bound";
    }
  }
}

TEST_P(RowFailoverModeTest, RowPushesAreAppliedExactlyOnceAcrossAFailover) {
  RunAcrossAFailover({});
}

// The same for a table every worker loads first (Client::SetRows of every row, to 1000; the
// count is over that) and then passes a barrier (Client::Barrier), rank 0 loading 400 ms after
// the others. Without the barrier the others' first SSP updates land before rank 0's load,
// which overwrites them (with --barrier_after_load=false: 27 of 30 under ssp2 on tcp and shm;
// bsp cannot race, and asp happened not to in that run).
TEST_P(RowFailoverModeTest, ALoadedTableCountsExactlyOnceAfterABarrierAndAFailover) {
  RunAcrossAFailover({"--embedding_load", "--load_delay_ms=400"});
}

// A dense load (rank 0's Client::SetStateValues, float32 ranges) caught by the death of the
// primary that takes it (crash point server.before_state_set_record@1: the set applied there,
// its record never posted, so the backup lacks it): the worker resends the set to the promoted
// backup, in every mode, and every worker reads the loaded weights back exactly after the
// barrier. Before the fix (found by review), SSP and ASP counted the set lost (a state op's
// push was not resendable once its send completed) and the load never finished.
TEST_P(RowFailoverModeTest, ADenseLoadCaughtByAFailoverIsResent) {
  const RowModeCase& mode = kRowModes[std::get<1>(GetParam())];
  const milliseconds bound = Emulated() ? 4 * kProcessBound : kProcessBound;
  ClusterSpec spec = FailoverSpec(2);
  spec.crash_rank = 0;
  spec.crash_point = "server.before_state_set_record@1";
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    workers.push_back(SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log",
                                  {"--model=counter", "--dense_load", "--steps=5",
                                   "--staleness=" + std::to_string(mode.staleness)}));
  }
  ASSERT_EQ(ExitCode(servers_[0], bound), kCrashPointExitCode) << Tail(servers_[0]);
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("dense_loaded"), 1) << "worker " << r;
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, RowFailoverModeTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Range(0, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  kRowModes[std::get<1>(info.param)].name;
                         });

// Crashes at named points of start-up, training, checkpointing and failover, in every role:
// tests/integration/crash_matrix_test.cc.

// A server that cannot start (here: --restore_from names a directory with no checkpoint) says
// why as it leaves, and the coordinator tells every waiting worker at once, naming the server,
// its group and the reason. Before, the workers waited for their 30 s setup timeout and failed
// with "control: no message of the expected kind in time", naming nothing (issue 14).
TEST_P(ProcessClusterTest, AServerThatCannotStartIsReportedToEveryWorkerAtOnce) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.workers = 2;
  spec.restore_from = Path("no-checkpoints-here");
  std::filesystem::create_directories(spec.restore_from);
  ASSERT_TRUE(StartCluster(spec));
  const auto t0 = Clock::now();
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, {"--steps=5"});
  for (ChildProcess* w : workers) {
    EXPECT_NE(ExitCode(w, ProcessBound()), 0) << Tail(w);
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (ChildProcess* w : workers) {
    const std::string log = w->LogTail(1 << 20);
    EXPECT_NE(log.find("start-up failed: server rank"), std::string::npos) << log;
    EXPECT_NE(log.find("no-checkpoints-here"), std::string::npos)
        << "the reason (the restore directory) did not reach the worker:\n"
        << log;
  }
  // Well inside the workers' 30 s setup timeout (the old failure mode).
  EXPECT_LT(s, 15.0) << "the workers were not told; they timed out";
  std::cerr << "[ info ] workers failed " << s << " s after they started, with the reason\n";
}

// Exactly once, counted: each worker pushes -1 into its own element (servers sum, lr 1), so
// w[k] is the number of worker k's pushes that were applied. The only group's primary is killed
// mid-run: after the last step every w[k] equals exactly the number of steps (a lost push would
// leave it short, a push applied twice would overshoot).
TEST_P(ProcessClusterTest, EveryPushIsAppliedExactlyOnceAcrossAFailover) {
  ClusterSpec spec = CounterSpec();
  spec.consistency = "bsp";
  spec.servers = 1;
  spec.replicas = 2;
  spec.workers = 3;
  const int kSteps = 40;
  ASSERT_TRUE(StartCluster(spec));
  // Held at step 30 until the kill: never over before it (ServerKillTest).
  std::vector<std::string> flags = {"--model=counter", "--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=" + std::string(Emulated() ? "40" : "10")};
  for (const std::string& f : HoldFlags(30)) flags.push_back(f);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
  const int done = WaitProgress(Path("progress1"), 12, ProcessBound(), workers[1]);
  ASSERT_GE(done, 12);
  servers_[0]->Kill();  // the only group's primary
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    const std::vector<float>& w = res->tensors["W"];
    ASSERT_EQ(w.size(), static_cast<size_t>(spec.workers));
    for (int k = 0; k < spec.workers; ++k) {
      EXPECT_EQ(w[k], static_cast<float>(kSteps))
          << "worker " << r << " sees " << w[k] << " applied pushes of worker " << k;
    }
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
  }
}

// Leases and fencing (issue 14): group 0's primary is SIGSTOPped mid-training (a hung process:
// its kernel still acknowledges, its connections stay open, nothing errors). The coordinator
// suspects it, declares it dead when its lease runs out, and promotes the backup; the workers
// fail over within the lease (they learn the departure from the membership, not from a
// data-path error that never comes) instead of stalling until their wait timeout. Resumed
// afterwards, the old primary finds its lease lapsed and serves nothing: the run ends with
// weights bit-identical to the one-process reference (a second, stale primary publishing
// would break that) and the old primary stops, fenced.
TEST_P(ProcessClusterTest, AStoppedPrimaryIsFailedOverWithinItsLeaseAndNeverServesAgain) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  const milliseconds lease(3 * spec.heartbeat_timeout_ms);
  const int kSteps = 30;
  const int step_delay_ms = Emulated() ? 40 : 15;
  ASSERT_TRUE(StartCluster(spec));
  // The wait timeout far beyond the lease: a stall until it would show as a slow recovery.
  const milliseconds wait_timeout = 4 * lease + Slack();
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--steps=" + std::to_string(kSteps), "--step_delay_ms=" + std::to_string(step_delay_ms),
             "--wait_timeout_ms=" + std::to_string(wait_timeout.count())});
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ASSERT_GE(WaitProgress(Path("progress0"), 5, ProcessBound(), workers[0]), 5) << Tail(workers[0]);
  const int at_stop = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  servers_[0]->Signal(SIGSTOP);
  const auto t0 = Clock::now();
  const int after = WaitProgress(Path("progress0"), at_stop + 1, ProcessBound(), workers[0]);
  const auto recovery = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  ASSERT_GE(after, at_stop + 1) << "no progress after the stop:\n" << Tail(workers[0]);
  // Detection at the lease (the host acknowledges: not unreachable), then promotion and resend.
  EXPECT_GE(recovery, lease - milliseconds(200)) << "declared dead before its lease ran out";
  EXPECT_LT(recovery, lease + milliseconds(2000) + Slack() / 2)
      << "failover took longer than lease + promotion drain";
  EXPECT_LT(recovery, wait_timeout / 2) << "the workers stalled instead of failing over";
  servers_[0]->Signal(SIGCONT);  // the old primary wakes up, its group long taken over
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, 1, ProcessBound());
  if (HasFatalFailure()) return;
  // Resumed, it found itself refused back (or its lease lapsed first): it stops by itself.
  EXPECT_EQ(ExitCode(servers_[0], Slack()), 1) << Tail(servers_[0]);
  const std::string old_log = servers_[0]->LogTail(1 << 22);
  EXPECT_NE(old_log.find("(fenced)"), std::string::npos) << Tail(servers_[0]);
  const std::string coord_log = coordinator_->LogTail(1 << 22);
  EXPECT_NE(coord_log.find("SUSPECTED"), std::string::npos);
  EXPECT_NE(coord_log.find("its lease"), std::string::npos);
  std::cerr << "[ info ] " << GetParam() << ": primary SIGSTOPped after step " << at_stop
            << "; the next step completed " << recovery.count() << " ms later (lease "
            << lease.count() << " ms, wait timeout " << wait_timeout.count() << " ms)\n";
}

// The same stop, landing where an ASP worker ends each step with a replicated cluster: the
// wait for every server's acknowledgement of the step's pushes (PushPipeline::AwaitAllAcked,
// "Step() never loses a push"). The primary of group 0 first stalls in its 30th commit, before
// that version's record (stall point server.before_record), so no worker's push of it is
// acknowledged: every worker sits in that wait, re-reading its acks (over tcp its read of the
// stopped primary is never answered; over shm and verbs the reads complete, with the acks
// unchanged). Then it is SIGSTOPped. The workers must learn of its departure from the
// membership at the lease and fail over, not wait out their wait timeout; each of their row
// pushes counts exactly once (counter model). Before the fix the multi-server wait never
// checked the membership: every worker stalled for its whole wait timeout and failed.
TEST_P(ProcessClusterTest, AStoppedPrimaryIsFailedOverWhileWorkersWaitForTheirStepsAcks) {
  ClusterSpec spec = CounterSpec();
  spec.consistency = "asp";
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  spec.stall_rank = 0;
  spec.stall_point = "server.before_record@30:600000";  // stopped, then killed in it
  const milliseconds lease(3 * spec.heartbeat_timeout_ms);
  const int kSteps = 30;
  ASSERT_TRUE(StartCluster(spec));
  // The wait timeout far beyond the lease: a stall until it shows as a failed step.
  const milliseconds wait_timeout = 4 * lease + Slack();
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--model=counter", "--embedding_rows=200", "--steps=" + std::to_string(kSteps),
             "--max_delay_ms=4", "--wait_timeout_ms=" + std::to_string(wait_timeout.count())});
  ASSERT_TRUE(WaitForLog(servers_[0], "stall point server.before_record", ProcessBound()))
      << Tail(servers_[0]);
  // Every worker's step is held by the stalled primary from now on (a push of the stalled
  // version awaits its acknowledgement); the stop lands on a server that answers nothing.
  std::this_thread::sleep_for(milliseconds(300));
  std::vector<int> at_stop;
  for (int r = 0; r < spec.workers; ++r) {
    at_stop.push_back(WaitProgress(Path("progress" + std::to_string(r)), 0, milliseconds(1), nullptr));
  }
  servers_[0]->Signal(SIGSTOP);
  const auto t0 = Clock::now();
  milliseconds slowest(0);
  for (int r = 0; r < spec.workers; ++r) {
    if (at_stop[r] >= kSteps) continue;
    const std::string progress = Path("progress" + std::to_string(r));
    const int after = WaitProgress(progress, at_stop[r] + 1, ProcessBound(), workers[r]);
    ASSERT_GE(after, at_stop[r] + 1) << "worker " << r << ": no progress after the stop\n"
                                     << Tail(workers[r]);
    slowest = std::max(slowest, std::chrono::duration_cast<milliseconds>(Clock::now() - t0));
  }
  EXPECT_LT(slowest, lease + milliseconds(2000) + Slack() / 2)
      << "a worker stalled in its step's acknowledgement wait instead of failing over";
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("row_count"), kSteps) << "worker " << r << "'s row: " << Tail(workers[r]);
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
  }
  std::cerr << "[ info ] " << GetParam() << ": primary stalled, then SIGSTOPped at steps "
            << at_stop[0] << "/" << at_stop[1] << "/" << at_stop[2]
            << "; every worker's next step completed within " << slowest.count() << " ms (lease "
            << lease.count() << " ms, wait timeout " << wait_timeout.count() << " ms)\n";
}

// A stuck cluster says why before its workers' waits run out (ShardServerOptions::
// stall_report): a BSP worker is SIGSTOPped (a descheduled process, short of its lease), so
// every chunk's next clock lacks its push. Each server logs, once, STALLED with the chunk, the
// clock pending, and the worker it still waits for with that worker's announced clock; resumed,
// the worker goes on and every push counts exactly once (counter model).
TEST_P(ProcessClusterTest, AServerReportsAStalledClockNamingTheWorkerItWaitsFor) {
  ClusterSpec spec = CounterSpec();
  spec.servers = 2;
  spec.workers = 3;
  // A lease far beyond the report (1 s): the stopped worker is suspected, never declared dead.
  spec.heartbeat_timeout_ms = Emulated() ? 20000 : 5000;
  spec.server_extra = {"--stall_report_ms=1000"};
  const int kSteps = 60;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--model=counter", "--steps=" + std::to_string(kSteps), "--step_delay_ms=5"});
  ASSERT_GE(WaitProgress(Path("progress2"), 5, ProcessBound(), workers[2]), 5) << Tail(workers[2]);
  workers[2]->Signal(SIGSTOP);
  const auto t0 = Clock::now();
  // (A loaded host may have logged an earlier, shorter stall naming another worker: the
  // report awaited is the one naming worker 2.)
  const std::string expected = "pending with workers {0,1}, still waiting for {2 (announced clock ";
  for (int g = 0; g < spec.servers; ++g) {
    ASSERT_TRUE(WaitForLog(servers_[g], expected, ProcessBound())) << Tail(servers_[g]);
  }
  const auto reported = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  workers[2]->Signal(SIGCONT);
  std::string line;
  for (int g = 0; g < spec.servers; ++g) {
    const std::string log = servers_[g]->LogTail(1 << 22);
    const size_t at = log.rfind("STALLED", log.find(expected));
    line = log.substr(at, log.find('\n', at) - at);
    EXPECT_NE(line.find("chunk(s) published no version for over 1000 ms"), std::string::npos)
        << line;
  }
  EXPECT_GE(reported, milliseconds(900)) << "reported before the stall lasted its bound";
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    for (int k = 0; k < spec.workers; ++k) {
      EXPECT_EQ(res->tensors.at("W")[k], static_cast<float>(kSteps)) << "worker " << r << ", W[" << k << "]";
    }
  }
  std::cerr << "[ info ] " << GetParam() << ": reported " << reported.count()
            << " ms after the stop: " << line << "\n";
}

// The other side of a lease: the coordinator is SIGSTOPped for longer than the lease (a
// descheduled or partitioned coordinator). Every replicated primary's lease lapses and it
// fences itself (nothing applied or published: the coordinator could have promoted its backup
// meanwhile); when the coordinator resumes it forgives its own pause (nobody is declared dead),
// the leases are renewed, and training goes on bit-identical to the one-process reference.
TEST_P(ProcessClusterTest, PrimariesFenceThemselvesWhileTheCoordinatorIsAwayAndResume) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  const milliseconds lease(3 * spec.heartbeat_timeout_ms);
  // Long enough to outlast the stop: steps x delay > lease + 2 s.
  const int kStepDelayMs = 30;
  const int kSteps = static_cast<int>((lease.count() + 4000) / kStepDelayMs);
  ASSERT_TRUE(StartCluster(spec));
  const milliseconds wait_timeout = 4 * lease + Slack();
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--steps=" + std::to_string(kSteps), "--step_delay_ms=" + std::to_string(kStepDelayMs),
             "--wait_timeout_ms=" + std::to_string(wait_timeout.count())});
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ASSERT_GE(WaitProgress(Path("progress0"), 5, ProcessBound(), workers[0]), 5) << Tail(workers[0]);
  coordinator_->Signal(SIGSTOP);
  const auto t0 = Clock::now();
  const int before = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  // Past the lease both primaries are fenced: no step completes in that second.
  std::this_thread::sleep_for(lease + milliseconds(500));
  const int fenced_from = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  std::this_thread::sleep_for(milliseconds(1000));
  const int during = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  coordinator_->Signal(SIGCONT);
  const auto stopped = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  EXPECT_GT(fenced_from, before) << "training went on within the lease";
  EXPECT_LE(during, fenced_from + 1) << "steps completed past the lease: not fenced";
  ExpectWorkersMatchReference(spec, workers, standalone, kSteps, 0, ProcessBound());
  if (HasFatalFailure()) return;
  for (int g = 0; g < spec.servers; ++g) {
    const std::string log = servers_[g]->LogTail(1 << 22);
    EXPECT_NE(log.find("LEASE LAPSED"), std::string::npos) << Tail(servers_[g]);
    EXPECT_NE(log.find("lease renewed"), std::string::npos) << Tail(servers_[g]);
  }
  const std::string clog = coordinator_->LogTail(1 << 22);
  EXPECT_NE(clog.find("was descheduled for"), std::string::npos) << clog.substr(clog.size() - 3000);
  EXPECT_EQ(clog.find("its lease ("), std::string::npos) << "a member was declared dead";
  std::cerr << "[ info ] " << GetParam() << ": coordinator stopped " << stopped.count()
            << " ms (lease " << lease.count() << " ms); steps " << before << " -> " << fenced_from
            << " within the lease, " << fenced_from << " -> " << during
            << " in the second past it; nobody declared dead\n";
}

// A worker dies while the primaries are fenced (the coordinator is stopped past the lease):
// its push of the clock they are blocked in is in their memory, its immediate in their
// completion queues, not yet polled (nothing is handled while fenced). When the coordinator
// resumes it renews the leases and reports the worker's departure, in the same poll. A fenced
// server used to close the departed worker's endpoints at once, discarding that push: its
// clock was then summed without it. Now the membership waits for the renewed lease, the
// completions are handled first, and the push counts (counter model, W and b on the two
// groups: each counts the worker's pushes).
TEST_P(ProcessClusterTest, AWorkerThatDiesWhileThePrimariesAreFencedHasItsLastPushCounted) {
  ClusterSpec spec = CounterSpec();
  spec.consistency = "bsp";
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  const milliseconds lease(3 * spec.heartbeat_timeout_ms);
  const int kStepDelayMs = 30;
  const int kSteps = static_cast<int>((lease.count() + 4000) / kStepDelayMs);
  ASSERT_TRUE(StartCluster(spec));
  const milliseconds wait_timeout = 4 * lease + Slack();
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--model=counter", "--count_in_b", "--steps=" + std::to_string(kSteps),
             "--step_delay_ms=" + std::to_string(kStepDelayMs),
             "--wait_timeout_ms=" + std::to_string(wait_timeout.count())});
  ASSERT_GE(WaitProgress(Path("progress2"), 5, ProcessBound(), workers[2]), 5) << Tail(workers[2]);
  coordinator_->Signal(SIGSTOP);
  // Past the lease every primary fences itself (awaited, bounded: a loaded host may log it
  // late). The second after the lease also lets worker 2 finish the step it was in: its next
  // push is out and its pull waits for the fenced primaries, so done + 1 pushes are counted.
  std::this_thread::sleep_for(lease + milliseconds(Emulated() ? 3000 : 1000));
  for (int g = 0; g < spec.servers; ++g) {
    ASSERT_TRUE(WaitForLog(servers_[g], "LEASE LAPSED", Slack()))
        << "primary " << g << " is not fenced yet\n" << Tail(servers_[g]);
  }
  // Steps done; the next one's push is out (BSP: its pull waits for the fenced primaries).
  // Awaited, not assumed: the count must hold still for 1 s (the step's own sleep is 30 ms), so
  // that worker 2 is blocked in that pull, not between its progress and its push, when killed.
  // (At least the 5 seen above: a read that lands while the worker rewrites the file is empty.)
  int done = WaitProgress(Path("progress2"), 5, milliseconds(2000), nullptr);
  auto still_since = Clock::now();
  const auto settle_by = still_since + Slack();
  while (Clock::now() - still_since < milliseconds(1000) && Clock::now() < settle_by) {
    std::this_thread::sleep_for(milliseconds(10));
    const int now_done = WaitProgress(Path("progress2"), 0, milliseconds(1), nullptr);
    if (now_done >= 5 && now_done != done) {
      done = now_done;
      still_since = Clock::now();
    }
  }
  ASSERT_GE(Clock::now() - still_since, milliseconds(1000)) << "worker 2 never blocked in its pull";
  ASSERT_GE(done, 5);
  workers[2]->Kill();
  std::this_thread::sleep_for(milliseconds(300));
  coordinator_->Signal(SIGCONT);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(ExitCode(workers[r], ProcessBound()), 0) << Tail(workers[r]);
  for (int r = 0; r < 2; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    for (const char* t : {"W", "b"}) {
      EXPECT_EQ(res->tensors.at(t)[2], static_cast<float>(done + 1))
          << "worker " << r << "'s " << t << "[2]: the dead worker's " << done
          << " steps and its push of the clock it died in";
      EXPECT_EQ(res->tensors.at(t)[r], static_cast<float>(kSteps)) << "worker " << r;
    }
  }
  std::cerr << "[ info ] " << GetParam() << ": worker 2 killed after " << done
            << " steps with both primaries fenced; its " << done + 1 << " pushes counted\n";
}

// A primary's backup dies while the primary is fenced (the coordinator stopped past the lease).
// When the coordinator resumes it tells the primary to go on alone (no backup to hand over to)
// and renews its lease. The fence must end then: a primary that cached "lapsed" past the
// point where it had no lease to lose deferred every later membership for ever, so a worker
// that died afterwards was never let go (BSP waited for its pushes until every survivor's
// wait timeout). Now the survivors finish, every one of their pushes counted.
TEST_P(ProcessClusterTest, APrimaryWhoseBackupDiesWhileFencedFollowsTheMembershipAfterwards) {
  ClusterSpec spec = CounterSpec();
  spec.consistency = "bsp";
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  const milliseconds lease(3 * spec.heartbeat_timeout_ms);
  const int kStepDelayMs = 30;
  const int kSteps = static_cast<int>((lease.count() + 6000) / kStepDelayMs);
  ASSERT_TRUE(StartCluster(spec));
  const milliseconds wait_timeout = 2 * lease + Slack();
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--model=counter", "--count_in_b", "--steps=" + std::to_string(kSteps),
             "--step_delay_ms=" + std::to_string(kStepDelayMs),
             "--wait_timeout_ms=" + std::to_string(wait_timeout.count())});
  ASSERT_GE(WaitProgress(Path("progress2"), 5, ProcessBound(), workers[2]), 5) << Tail(workers[2]);
  coordinator_->Signal(SIGSTOP);
  std::this_thread::sleep_for(lease + milliseconds(Emulated() ? 3000 : 1000));
  ASSERT_TRUE(WaitForLog(servers_[0], "LEASE LAPSED", Slack()))
      << "primary 0 is not fenced yet\n" << Tail(servers_[0]);
  // The primary is stopped too while the coordinator resumes, so that the coordinator's word
  // that the backup is gone and its renewal of the lease wait in the primary's socket and are
  // read in one poll while the primary is still fenced (shorter than a heartbeat timeout).
  servers_[0]->Signal(SIGSTOP);
  servers_[spec.servers]->Kill();  // group 0's backup
  std::this_thread::sleep_for(milliseconds(300));
  coordinator_->Signal(SIGCONT);
  std::this_thread::sleep_for(milliseconds(Emulated() ? 1500 : 500));
  servers_[0]->Signal(SIGCONT);
  // Training resumes; then a worker dies, and the survivors must go on without it.
  const int at = WaitProgress(Path("progress2"), 5, milliseconds(2000), nullptr);
  ASSERT_GE(WaitProgress(Path("progress2"), at + 5, ProcessBound(), workers[2]), at + 5)
      << Tail(workers[2]) << Tail(servers_[0]);
  workers[2]->Kill();
  for (int r = 0; r < 2; ++r) ASSERT_EQ(ExitCode(workers[r], ProcessBound()), 0) << Tail(workers[r]);
  for (int r = 0; r < 2; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    for (const char* t : {"W", "b"}) {
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ(res->tensors.at(t)[k], static_cast<float>(kSteps)) << "worker " << r << "'s "
                                                                     << t << "[" << k << "]";
      }
    }
  }
  const std::string plog = servers_[0]->LogTail(1 << 22);
  // Which came first at the primary, the renewal or the word that its backup is gone, is a
  // race (its control thread may renew the lease before its loop reads the rest): the case
  // under test is the second order, reported here.
  const bool unfenced = plog.find("it serves unfenced") != std::string::npos;
  std::cerr << "[ info ] " << GetParam() << ": group 0's backup killed while its primary was "
            << "fenced; " << (unfenced ? "the primary learnt it first, while fenced, and went on "
                                         "unfenced"
                                       : "the lease was renewed first")
            << "; a worker killed afterwards was let go; survivors exact\n";
}

// A server that joins after the shards were assigned (a replacement started for a dead one)
// is told at once that it is not used, instead of waiting for an assignment until its setup
// timeout (120 s); training is undisturbed.
TEST_P(ProcessClusterTest, AServerJoiningAfterTheAssignmentIsToldAtOnceItIsNotUsed) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.workers = 2;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers =
      SpawnWorkers(spec, {"--steps=30", "--step_delay_ms=" + std::string(Emulated() ? "40" : "15")});
  ASSERT_GE(WaitProgress(Path("progress0"), 3, ProcessBound(), workers[0]), 3) << Tail(workers[0]);
  const auto t0 = Clock::now();
  ChildProcess* late =
      Spawn({SHARDPS_SERVER_BIN, "--coordinator=" + coordinator_address_,
             std::string("--cluster_token=") + kToken, "--transport=" + spec.transport,
             "--bind_ip=" + ServerIp(spec.transport), "--rank=0", LrFlag(spec.lr)},
            "late-server.log");
  EXPECT_EQ(ExitCode(late, Slack()), 1) << Tail(late);
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  EXPECT_LT(took, Slack()) << "it waited for its setup timeout";
  EXPECT_NE(late->LogTail(1 << 20).find("it is not used"), std::string::npos) << Tail(late);
  for (ChildProcess* w : workers) EXPECT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  std::cerr << "[ info ] the late server was told it is not used and exited " << took.count()
            << " ms after it started\n";
}

// A worker stopped (SIGSTOP) past its lease is declared dead: the others go on without it
// (BSP waits for it only until then). Resumed, it is out of the cluster: the servers closed its
// endpoints and the coordinator refuses it back, so its next step fails at once with ABORTED
// saying so (restart it to rejoin), instead of training on in isolation or waiting for a
// timeout.
TEST_P(ProcessClusterTest, AWorkerStoppedPastItsLeaseIsToldItIsOutWhenItResumes) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.workers = 3;
  const milliseconds lease(3 * spec.heartbeat_timeout_ms);
  const int kStepDelayMs = 20;
  const int kSteps = static_cast<int>((lease.count() + 3000) / kStepDelayMs);
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec, {"--steps=" + std::to_string(kSteps), "--step_delay_ms=" + std::to_string(kStepDelayMs),
             "--wait_timeout_ms=" + std::to_string((4 * lease + Slack()).count())});
  ASSERT_GE(WaitProgress(Path("progress2"), 3, ProcessBound(), workers[2]), 3) << Tail(workers[2]);
  workers[2]->Signal(SIGSTOP);
  const int before = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  // The others go on once it is declared dead (at its lease).
  const int after = WaitProgress(Path("progress0"), before + 5, lease + Slack(), workers[0]);
  EXPECT_GE(after, before + 5) << "the others did not go on without the stopped worker";
  workers[2]->Signal(SIGCONT);
  const auto t0 = Clock::now();
  EXPECT_EQ(ExitCode(workers[2], Slack()), 5) << Tail(workers[2]);
  const auto told = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  const std::string log = workers[2]->LogTail(1 << 20);
  EXPECT_NE(log.find("no longer a member"), std::string::npos) << Tail(workers[2]);
  EXPECT_NE(log.find("ABORTED"), std::string::npos) << Tail(workers[2]);
  EXPECT_LT(told, milliseconds(5000)) << "it was not told promptly";
  std::vector<WorkerResult> results;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ExitCode(workers[r], ProcessBound()), 0) << Tail(workers[r]);
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    results.push_back(std::move(*res));
  }
  ExpectSameWeights(results[1], results[0], 1);
  std::cerr << "[ info ] the resumed worker was told it is out " << told.count()
            << " ms after SIGCONT\n";
}

// Without a backup, losing a server is reported, clearly and quickly, as lost state.
TEST_P(ProcessClusterTest, ServerLossWithoutBackupIsReportedAsLostState) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.workers = 2;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, {"--steps=100000", "--step_delay_ms=5"});
  ASSERT_GE(WaitProgress(Path("progress0"), 5, ProcessBound(), workers[0]), 5);
  servers_[1]->Kill();
  const auto t0 = Clock::now();
  for (ChildProcess* w : workers) {
    EXPECT_EQ(ExitCode(w, milliseconds(20000)), 5) << Tail(w);  // a step failed
    const std::string log = w->LogTail();
    EXPECT_NE(log.find("replicas=1"), std::string::npos) << log;
    EXPECT_NE(log.find("latest checkpoint"), std::string::npos) << log;
  }
  std::cerr << "[ info ] workers reported the loss "
            << std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count()
            << " ms after the kill\n";
}

// Both copies of a group die, the second as soon as it is promoted, so that the workers' move
// to it races its death: a worker may find the promoted server dead while connecting to it, or
// after it moved. Either way every worker must get DATA_LOSS naming the group, as soon as the
// coordinator declares it lost. Before, a worker that lost the race reported the failed
// connect (UNAVAILABLE "connection reset") instead, 1 run in 6 here (issue 14 saw it in a
// digits job); the move now waits for the coordinator's next word within the failover bound.
TEST_P(ProcessClusterTest, LosingBothCopiesOfAGroupDuringAFailoverIsDataLoss) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 2;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, {"--steps=100000", "--step_delay_ms=5"});
  ASSERT_GE(WaitProgress(Path("progress0"), 5, ProcessBound(), workers[0]), 5);
  servers_[0]->Kill();
  const auto promoted_by = Clock::now() + ProcessBound();
  while (servers_[2]->LogTail(1 << 20).find("PROMOTED") == std::string::npos &&
         Clock::now() < promoted_by) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  servers_[2]->Kill();
  const auto t0 = Clock::now();
  for (ChildProcess* w : workers) {
    EXPECT_EQ(ExitCode(w, ProcessBound()), 5) << Tail(w);  // a step failed
    const std::string log = w->LogTail();
    EXPECT_NE(log.find("DATA_LOSS"), std::string::npos) << log;
    EXPECT_NE(log.find("group 0"), std::string::npos) << log;
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  std::cerr << "[ info ] workers reported DATA_LOSS " << ms << " ms after the second kill\n";
}

// A worker restarted with its rank (counter model: w[k] counts worker k's applied pushes).
class WorkerRestartTest : public ProcessClusterTest {
 protected:
  static constexpr int kSteps = 40;
  std::string Delay() const { return Emulated() ? "40" : "15"; }

  // A counter cluster of 2 groups × `replicas` and 3 workers training kSteps; once worker
  // `victim` has done 8 steps it is SIGKILLed. Returns the steps it had done (0: failed).
  int StartAndKillAfter8(int replicas, int victim, ClusterSpec* spec,
                         std::vector<ChildProcess*>* workers) {
    *spec = CounterSpec();
    spec->servers = 2;
    spec->replicas = replicas;
    spec->workers = 3;
    spec->heartbeat_timeout_ms = 1000;
    if (!StartCluster(*spec)) return 0;
    *workers = SpawnWorkers(*spec, {"--model=counter", "--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=" + Delay()});
    const int done = WaitProgress(Path("progress" + std::to_string(victim)), 8, ProcessBound(),
                                  (*workers)[victim]);
    if (done < 8) return 0;
    (*workers)[victim]->Kill();
    return done;
  }
  ChildProcess* Restart(const ClusterSpec& spec, int rank) {
    return SpawnWorker(WorkerArgs(spec, rank), "worker" + std::to_string(rank) + "-restarted.log",
                       {"--model=counter", "--steps=10", "--step_delay_ms=" + Delay()});
  }
};

// A worker is SIGKILLed and restarted with the same rank: the others go on without it, it
// rejoins at the cluster's clock (not 0) with the current weights, and nobody's pushes are
// lost or doubled.
TEST_P(WorkerRestartTest, RestartedWorkerRejoinsAtTheClusterClock) {
  ClusterSpec spec;
  std::vector<ChildProcess*> workers;
  const int done = StartAndKillAfter8(/*replicas=*/1, /*victim=*/2, &spec, &workers);
  ASSERT_GE(done, 8);
  ChildProcess* again = Restart(spec, 2);
  for (int r = 0; r < 2; ++r)
    ASSERT_EQ(ExitCode(workers[r], ProcessBound()), 0) << Tail(workers[r]);
  ASSERT_EQ(ExitCode(again, ProcessBound()), 0) << Tail(again);
  auto res = ParseResult(Path("worker2.out"));  // the restarted worker's result
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_GT(res->Int("start_clock"), done - 1) << "a rejoining worker starts at the cluster clock";
  for (int r = 0; r < 2; ++r) {
    auto o = ParseResult(Path("worker" + std::to_string(r) + ".out"));
    ASSERT_TRUE(o.ok()) << o.status();
    // Survivors: every one of their pushes applied exactly once.
    EXPECT_EQ(o->tensors["W"][r], static_cast<float>(kSteps)) << "worker " << r;
  }
  // The restarted worker: its 10 new pushes, plus those of the killed process that were
  // applied (it died after `done` steps, with at most one more push in flight).
  const float w2 = res->tensors["W"][2];
  EXPECT_GE(w2, static_cast<float>(done + 10));
  EXPECT_LE(w2, static_cast<float>(done + 1 + 10));
  std::cerr << "[ info ] worker 2 killed after step " << done << ", restarted at clock "
            << res->Int("start_clock") << "; its applied pushes: " << w2 << "\n";
}

// A restarted rank 0 arrives during a failover: it connects to group 0's primary, stops (a
// descheduled process: the stall point worker.after_connect), and while it is stopped that
// primary is SIGKILLed. Its start then reads the chunk headers from a dead server (a rank 0
// joining a running cluster reads them before it publishes initial weights). That read used
// to fail Start outright; now the group is failed over to its backup and the reads are made
// there, as during training. Counted exactly: every survivor's push applied once, and the
// restarted worker's own pushes all applied on top of those its predecessor had applied.
TEST_P(WorkerRestartTest, ARestartedRankZeroRidesOutAFailoverDuringItsStart) {
  ClusterSpec spec;
  std::vector<ChildProcess*> workers;
  const int done = StartAndKillAfter8(/*replicas=*/2, /*victim=*/0, &spec, &workers);
  ASSERT_GE(done, 8);
  const milliseconds stall(Emulated() ? 8000 : 3000);
  setenv("SHARDPS_STALL_POINT", ("worker.after_connect:" + std::to_string(stall.count())).c_str(), 1);
  ChildProcess* again = Restart(spec, 0);
  unsetenv("SHARDPS_STALL_POINT");
  ASSERT_TRUE(WaitForLog(again, "stall point worker.after_connect (SHARDPS_STALL_POINT)",
                         ProcessBound()))
      << Tail(again);
  servers_[0]->Kill();  // group 0's primary, which the stopped worker is connected to
  ASSERT_EQ(ExitCode(again, ProcessBound() + stall), 0) << Tail(again);
  for (int r = 1; r < spec.workers; ++r) {
    ASSERT_EQ(ExitCode(workers[r], ProcessBound()), 0) << Tail(workers[r]);
  }
  // The case under test: the start's own operations met the dead server. (Over shm they do
  // not: a dead server's segment stays mapped, so the header reads succeed, and the worker
  // fails over at its first pull instead.)
  if (GetParam() != std::string("shm")) {
    EXPECT_NE(again->LogTail(1 << 22).find("worker rank 0: reading the chunk headers failed"),
              std::string::npos)
        << Tail(again);
  }
  auto res = ParseResult(Path("worker0.out"));  // the restarted worker's result
  ASSERT_TRUE(res.ok()) << res.status();
  for (int r = 1; r < spec.workers; ++r) {
    auto o = ParseResult(Path("worker" + std::to_string(r) + ".out"));
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->tensors["W"][r], static_cast<float>(kSteps)) << "worker " << r;
    EXPECT_EQ(o->Int("pushes_lost"), 0) << "worker " << r;
  }
  // The restarted worker: its 10 new pushes, plus those of the killed process that were
  // applied (it died after `done` steps, with at most one more push in flight).
  const float w0 = res->tensors["W"][0];
  EXPECT_GE(w0, static_cast<float>(done + 10));
  EXPECT_LE(w0, static_cast<float>(done + 1 + 10));
  std::cerr << "[ info ] " << GetParam() << ": rank 0 killed after step " << done
            << ", restarted, stopped after connecting while group 0's primary was killed; it "
               "started on the backup; its applied pushes: " << w0 << "\n";
}

INSTANTIATE_TEST_SUITE_P(Transports, WorkerRestartTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

// BSP completes each chunk's clocks in order. A restarted worker starts at the cluster's clock,
// the furthest chunk's, while another chunk may still lack a live worker's push of the clock
// before it. Worker 1 stalls (a descheduled process: SHARDPS_STALL_POINT) between its clock-6
// pushes of W and b; worker 0 dies just before its own clock-6 pushes (SHARDPS_CRASH_POINT) and
// is restarted at once. W's chunk completes clock 6 without it (it departed), b's cannot, so
// the new worker 0 starts at clock 7 with b's chunk at clock 5. Its push of b for clock 7 once
// became that chunk's pending clock: worker 1's push of clock 6 was then dropped as stale (clock
// 6 never applied there) and the cluster deadlocked on clock 7 until every worker failed at its
// wait timeout (AggregatorBarrierKillTest hit it under load). Two mechanisms now prevent it,
// each tested alone: the new worker's start pulls again until every chunk has applied the
// clocks it skipped (catch-up), and the server holds such a push back while a live worker owes
// an earlier clock (SHARDPS_TEST_NO_CATCH_UP_PULL=1 turns the catch-up off). And worker 1 either
// resumes (every push of both counts exactly once) or dies in its stall (nobody will push clock
// 6 to b: b's min clock rises past it without a version, and the restarted worker trains on
// alone; with the catch-up off, its held push is let in when worker 1 departs).
class RestartAheadTest : public ProcessClusterTest {
 protected:
  static constexpr int kSteps = 20;
  milliseconds Stall() const { return milliseconds(Emulated() ? 30000 : 8000); }  // outlasts a restart, loaded

  // The scene every case shares: a 2-server counter cluster of 2 workers; worker 0 exits at
  // `crash` (a crash point), worker 1 stalls at push `stall_push` (a stall point); once worker
  // 1 is in its stall and every server has seen worker 0 leave, and `settle` later, worker 0 is
  // restarted with --resume (catch-up pull off unless `catch_up`), and the restart is checked to
  // land inside the stall. Sets *w1 and *again; the caller returns on a fatal failure.
  void RestartInsideStall(const std::string& crash, int stall_push, milliseconds settle,
                          bool catch_up, ChildProcess** w1, ChildProcess** again) {
    ClusterSpec spec = CounterSpec();
    spec.servers = 2;
    spec.replicas = 1;
    spec.workers = 2;
    const milliseconds stall = Stall();
    ASSERT_TRUE(StartCluster(spec));
    const std::vector<std::string> flags = {
        "--model=counter", "--count_in_b", "--steps=" + std::to_string(kSteps),
        "--wait_timeout_ms=" + std::to_string((stall + Slack()).count())};
    setenv("SHARDPS_CRASH_POINT", crash.c_str(), 1);
    ChildProcess* w0 = SpawnWorker(WorkerArgs(spec, 0), "worker0.log", flags);
    unsetenv("SHARDPS_CRASH_POINT");
    setenv("SHARDPS_STALL_POINT",
           ("worker.before_push@" + std::to_string(stall_push) + ":" +
            std::to_string(stall.count())).c_str(),
           1);
    *w1 = SpawnWorker(WorkerArgs(spec, 1), "worker1.log", flags);
    unsetenv("SHARDPS_STALL_POINT");
    ASSERT_EQ(ExitCode(w0, ProcessBound()), kCrashPointExitCode) << Tail(w0);
    // Worker 1 is in its stall (after its push of W) and every server has seen worker 0 leave
    // (else the new process starts at the clock worker 0 died in, and nothing is ahead).
    ASSERT_TRUE(WaitForLog(*w1, "stall point worker.before_push (SHARDPS_STALL_POINT)", stall))
        << Tail(*w1);
    for (int g = 0; g < spec.servers; ++g) {
      ASSERT_TRUE(WaitForLog(servers_[g], "worker 0 left", stall)) << Tail(servers_[g]);
    }
    std::this_thread::sleep_for(settle);
    std::vector<std::string> resume = flags;
    resume.push_back("--resume");  // clocks start_clock..kSteps-1
    if (!catch_up) setenv("SHARDPS_TEST_NO_CATCH_UP_PULL", "1", 1);
    *again = SpawnWorker(WorkerArgs(spec, 0), "worker0-restarted.log", resume);
    unsetenv("SHARDPS_TEST_NO_CATCH_UP_PULL");
    // The restart must land inside worker 1's stall, or the case is not the one under test.
    ASSERT_TRUE(WaitForLog(*again, "joined a running cluster at clock", stall)) << Tail(*again);
    ASSERT_EQ((*w1)->LogTail(1 << 22).find("stall point worker.before_push: resumed"),
              std::string::npos)
        << "worker 1's stall ended before the restarted worker started; lengthen the stall";
  }

  void Run(bool catch_up, bool owing_dies) {
    const milliseconds stall = Stall();
    ChildProcess* w1 = nullptr;
    ChildProcess* again = nullptr;
    // Step t pushes W, then b: the process's pushes 2t+1 and 2t+2 (clock 6: 13 and 14). The
    // settle lets W's chunk apply clock 6 before the restart pulls.
    RestartInsideStall("worker.before_push@13", 14, milliseconds(Emulated() ? 2000 : 300),
                       catch_up, &w1, &again);
    if (HasFatalFailure()) return;
    if (owing_dies) {
      w1->Kill();
    } else {
      EXPECT_EQ(ExitCode(w1, ProcessBound() + stall), 0) << Tail(w1);
    }
    EXPECT_EQ(ExitCode(again, ProcessBound() + stall), 0) << Tail(again);
    if (HasFailure()) return;
    auto r0 = ParseResult(Path("worker0.out"));
    ASSERT_TRUE(r0.ok()) << r0.status();
    ASSERT_EQ(r0->Int("start_clock"), 7);
    std::vector<const WorkerResult*> results = {&*r0};
    auto r1 = ParseResult(Path("worker1.out"));
    if (!owing_dies) {
      ASSERT_TRUE(r1.ok()) << r1.status();
      results.push_back(&*r1);
    }
    // Worker 0: clocks 0-5 of the first process, 7-19 of the second. Worker 1: all 20, or, if it
    // died in its stall, clocks 0-5 and its W of clock 6.
    const float w0_count = 6 + (kSteps - 7);
    for (const WorkerResult* res : results) {
      for (const char* t : {"W", "b"}) {
        const std::vector<float>& v = res->tensors.at(t);
        ASSERT_GE(v.size(), 2u);
        const float w1_count = owing_dies ? (t[0] == 'W' ? 7 : 6) : kSteps;
        EXPECT_EQ(v[0], w0_count) << "worker " << res->Int("rank") << "'s pull of " << t
                                  << "[0]: worker 0's pushes applied";
        EXPECT_EQ(v[1], w1_count) << "worker " << res->Int("rank") << "'s pull of " << t
                                  << "[1]: worker 1's pushes applied";
      }
    }
    for (size_t g = 0; g < servers_.size(); ++g) {
      EXPECT_EQ(servers_[g]->LogTail(1 << 22).find("arrived after that clock was applied"),
                std::string::npos)
          << "a push was dropped as stale\n" << Tail(servers_[g]);
    }
    std::cerr << "[ info ] " << GetParam() << ": worker 0 restarted at clock "
              << r0->Int("start_clock") << " inside worker 1's " << stall.count()
              << " ms stall (catch-up " << (catch_up ? "on" : "off") << "); worker 1 "
              << (owing_dies ? "killed in it" : "resumed") << "; the counts are exact\n";
  }
};

// A dead rank 0's push that still waits in a BSP clock is left alone by its successor. Worker 0
// dies right after its clock-5 pushes (W and b) are sent; worker 1 stalls between its own W and
// b of clock 5, so b's chunk holds worker 0's push of clock 5 in the inbox, not yet summed,
// while worker 0 is restarted. That push is the process's 6th to the chunk, so it lies in
// inbox parity 0 (a push's parity is its sequence number's). Rank 0 publishes the initial weights at every start, into
// its own parity-0 inbox slot of every dense chunk: it overwrote that push with the initial
// values, and clock 5 of b then summed those in place of the dead process's gradient (b[0] one
// short). Now a rank 0 that joins a running cluster reads every chunk's header first and
// publishes only to chunks that have no weights yet (then no worker has pushed anything).
TEST_P(RestartAheadTest, ARestartedRankZeroLeavesItsPredecessorsPendingPushAlone) {
  const milliseconds stall = Stall();
  ChildProcess* w1 = nullptr;
  ChildProcess* again = nullptr;
  // Step 6 is clock 5: its pushes are the process's 11th (W) and 12th (b).
  RestartInsideStall("worker.after_clock@6", 12, milliseconds(0), true, &w1, &again);
  if (HasFatalFailure()) return;
  EXPECT_EQ(ExitCode(w1, ProcessBound() + stall), 0) << Tail(w1);
  EXPECT_EQ(ExitCode(again, ProcessBound() + stall), 0) << Tail(again);
  if (HasFailure()) return;
  auto r0 = ParseResult(Path("worker0.out"));
  auto r1 = ParseResult(Path("worker1.out"));
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  ASSERT_EQ(r0->Int("start_clock"), 6);
  // Worker 0: clocks 0-5 of the first process, 6-19 of the second; worker 1: all 20.
  for (const WorkerResult* res : {&*r0, &*r1}) {
    for (const char* t : {"W", "b"}) {
      const std::vector<float>& v = res->tensors.at(t);
      ASSERT_GE(v.size(), 2u);
      EXPECT_EQ(v[0], static_cast<float>(kSteps))
          << "worker " << res->Int("rank") << "'s pull of " << t << "[0]: worker 0's pushes";
      EXPECT_EQ(v[1], static_cast<float>(kSteps))
          << "worker " << res->Int("rank") << "'s pull of " << t << "[1]: worker 1's pushes";
    }
  }
  std::cerr << "[ info ] " << GetParam() << ": rank 0 restarted at clock 6 while its dead "
            << "predecessor's clock-5 push of b waited for worker 1's: every push counted once\n";
}

TEST_P(RestartAheadTest, TheOwingWorkerResumesAndNothingIsDropped) { Run(true, false); }
TEST_P(RestartAheadTest, TheServersHoldTheEarlyPushBackAlone) { Run(false, false); }
TEST_P(RestartAheadTest, TheOwingWorkerDiesAndTheRestartedOneTrainsOn) { Run(true, true); }
TEST_P(RestartAheadTest, TheHeldPushGoesInWhenTheOwingWorkerDies) { Run(false, true); }

INSTANTIATE_TEST_SUITE_P(Transports, RestartAheadTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

// Checkpoints: a BSP run writes one every 5 clocks; the newest is then corrupted (a flipped
// byte) and the whole cluster is restarted from the directory. The corrupt checkpoint is
// refused with the reason, the previous one restored, the workers resume at its clock, and the
// final weights are BIT-IDENTICAL to an uninterrupted one-process run (weights, optimizer
// state and clocks all came back exactly).
// A row table checkpointed incrementally (docs/checkpoints.md): every 5 clocks, the row shards
// write only the rows written since their last checkpoint (whole at 5, increments at 10, 15,
// 20). The newest checkpoint is corrupted, so the cluster restores from 15, a chain of three
// files, and resumes bit-identical to the one-process reference — rows (dense ids, then
// hashed keys with evictions) and dense tensors alike.
TEST_P(ProcessClusterTest, RowTableRestoredFromIncrementalCheckpointsResumesBitIdentical) {
  for (const bool hashed : {false, true}) {
    SCOPED_TRACE(hashed ? "hashed" : "dense ids");
    ClusterSpec spec = Spec();
    spec.servers = 2;
    spec.workers = 3;
    spec.checkpoint_dir = Path(hashed ? "ckpt-h" : "ckpt-d");
    spec.checkpoint_every = 5;
    const int kFirst = 20, kTotal = 30;
    std::vector<std::string> table = {"--embedding_rows=" + std::string(hashed ? "120" : "600")};
    if (hashed) table.push_back("--embedding_hashed");
    ASSERT_TRUE(StartCluster(spec));
    std::vector<std::string> flags = table;
    flags.push_back("--steps=" + std::to_string(kFirst));
    std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
    for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
    const std::string newest = spec.checkpoint_dir + "/ckpt-000000000020";
    for (int g = 0; g < 2; ++g) {
      const std::string f = newest + "/group-" + std::to_string(g) + "-of-2.shps";
      const auto until = Clock::now() + milliseconds(20000);
      while (!std::filesystem::exists(f) && Clock::now() < until) {
        std::this_thread::sleep_for(milliseconds(20));
      }
      ASSERT_TRUE(std::filesystem::exists(f)) << f;
    }
    std::this_thread::sleep_for(milliseconds(200));
    for (auto& c : children_) c->Kill();
    // Increments are smaller than the whole checkpoint they build on.
    const auto size_at = [&](int clock) {
      char name[64];
      std::snprintf(name, sizeof(name), "/ckpt-%012d/group-0-of-2.shps", clock);
      return std::filesystem::file_size(spec.checkpoint_dir + name);
    };
    EXPECT_LT(size_at(10), size_at(5));
    EXPECT_LT(size_at(15), size_at(5));
    {
      const std::string f = newest + "/group-1-of-2.shps";
      auto bytes = ReadFile(f);
      ASSERT_TRUE(bytes.ok());
      std::string b = *bytes;
      b[b.size() / 2] ^= 0x10;
      std::ofstream(f, std::ios::binary | std::ios::trunc) << b;
    }
    spec.restore_from = spec.checkpoint_dir;
    ASSERT_TRUE(StartCluster(spec));
    std::vector<ChildProcess*> again;
    flags = table;
    flags.push_back("--steps=" + std::to_string(kTotal));
    flags.push_back("--resume");
    for (int r = 0; r < spec.workers; ++r) {
      again.push_back(SpawnWorker(WorkerArgs(spec, r), "again" + std::to_string(r) + ".log", flags));
    }
    ChildProcess* standalone = SpawnStandalone(spec, kTotal, table);
    for (ChildProcess* w : again) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
    auto ref = StandaloneResult(standalone, ProcessBound());
    ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
    for (int r = 0; r < spec.workers; ++r) {
      auto res = Result(r);
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_EQ(res->Int("start_clock"), 15);
      ExpectSameWeights(*res, *ref, r);
    }
    for (auto& c : children_) c->Kill();
    servers_.clear();
  }
}

TEST_P(ProcessClusterTest, ClusterRestoredFromACheckpointResumesBitIdentical) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.workers = 3;
  spec.optimizer = "momentum";  // optimizer state must come back too
  spec.checkpoint_dir = Path("ckpt");
  spec.checkpoint_every = 5;
  const int kFirst = 20, kTotal = 30;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, {"--steps=" + std::to_string(kFirst)});
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  // The checkpoint of the last clock is written asynchronously: wait for both groups' files.
  const std::string newest = spec.checkpoint_dir + "/ckpt-000000000020";
  for (int g = 0; g < 2; ++g) {
    const std::string f = newest + "/group-" + std::to_string(g) + "-of-2.shps";
    const auto until = Clock::now() + milliseconds(20000);
    while (!std::filesystem::exists(f) && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    ASSERT_TRUE(std::filesystem::exists(f)) << f;
  }
  std::this_thread::sleep_for(milliseconds(200));
  for (auto& c : children_) c->Kill();  // the whole cluster goes down
  // Corrupt group 1's file of the newest checkpoint: one flipped byte in the middle.
  {
    const std::string f = newest + "/group-1-of-2.shps";
    auto bytes = ReadFile(f);
    ASSERT_TRUE(bytes.ok());
    std::string b = *bytes;
    b[b.size() / 2] ^= 0x10;
    std::ofstream(f, std::ios::binary | std::ios::trunc) << b;
  }
  spec.restore_from = spec.checkpoint_dir;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> again;
  for (int r = 0; r < spec.workers; ++r) {
    again.push_back(SpawnWorker(WorkerArgs(spec, r), "again" + std::to_string(r) + ".log",
                                {"--steps=" + std::to_string(kTotal), "--resume"}));
  }
  ChildProcess* standalone = SpawnStandalone(spec, kTotal, {"--optimizer=momentum"});
  for (ChildProcess* w : again) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("start_clock"), 15) << "resumed from the checkpoint before the corrupt one";
    ExpectSameWeights(*res, *ref, r);
  }
  // The refusal was reported with its reason (the whole log: on a busy host the lines after
  // the restore once pushed it out of a 20,000-byte tail).
  const std::string log = servers_[0]->LogTail(1 << 22);
  EXPECT_NE(log.find("ckpt-000000000020"), std::string::npos) << servers_[0]->LogTail();
  EXPECT_NE(log.find("checksum"), std::string::npos) << servers_[0]->LogTail();
  EXPECT_NE(log.find("using ckpt-000000000015"), std::string::npos) << servers_[0]->LogTail();
}

// Error completions injected on the data path (ps_test_worker --inject_data_error_every=7: its
// fabric is wrapped in tests/integration/fault_injecting_fabric.h, and every 7th push header of
// worker 1 names a wrong rkey, which the server's side refuses with a remote access error). The
// endpoint
// enters the error state; the worker reconnects to the same, live server, resends what it lacks
// and goes on: the weights stay bit-identical to the one-process run.
TEST_P(ProcessClusterTest, InjectedDataPathErrorsAreSurvivedBitIdentical) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.workers = 2;
  const int kSteps = 20;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    std::vector<std::string> extra = {"--steps=" + std::to_string(kSteps)};
    if (r == 1) extra.push_back("--inject_data_error_every=7");
    workers.push_back(
        SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log", extra));
  }
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    ExpectSameWeights(*res, *ref, r);
    if (r == 1) {
      EXPECT_GE(res->Int("injected_errors"), 5);  // 3 chunks x 20 steps / 7
      EXPECT_EQ(res->Int("reconnects"), res->Int("injected_errors"));
      std::cerr << "[ info ] worker 1: " << res->Int("injected_errors") << " injected errors, "
                << res->Int("reconnects") << " reconnects, " << res->Int("pushes_resent")
                << " pushes resent\n";
    } else {
      EXPECT_EQ(res->Int("injected_errors"), 0);
    }
  }
}

// Elastic growth: a third worker joins a running BSP cluster (max_workers 3). It starts at the
// cluster's clock, BSP averages over the workers present at each clock, and every push of the
// original workers is applied exactly once (counter model: w[k] counts worker k's pushes).
TEST_P(ProcessClusterTest, WorkerJoinsARunningClusterAtItsClock) {
  ClusterSpec spec = CounterSpec();
  spec.servers = 2;
  spec.workers = 2;
  spec.max_workers = 3;
  const int kSteps = 40;
  const std::string delay = Emulated() ? "40" : "15";
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < 2; ++r) {
    workers.push_back(SpawnWorker(
        WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log",
        {"--model=counter", "--workers=3", "--steps=" + std::to_string(kSteps),
         "--step_delay_ms=" + delay, "--progress_file=" + Path("progress" + std::to_string(r))}));
  }
  const int done = WaitProgress(Path("progress0"), 8, ProcessBound(), workers[0]);
  ASSERT_GE(done, 8);
  ChildProcess* late =
      SpawnWorker(WorkerArgs(spec, 2), "worker2.log",
                  {"--model=counter", "--workers=3", "--steps=10", "--step_delay_ms=" + delay});
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  ASSERT_EQ(ExitCode(late, ProcessBound()), 0) << Tail(late);
  auto res = ParseResult(Path("worker2.out"));
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_GE(res->Int("start_clock"), done) << "the newcomer starts at the cluster clock";
  for (int r = 0; r < 2; ++r) {
    auto o = ParseResult(Path("worker" + std::to_string(r) + ".out"));
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->tensors["W"][r], static_cast<float>(kSteps)) << "worker " << r;
  }
  // The newcomer's 10 pushes: each applied once, except a first one whose clock some chunk had
  // already completed without it (dropped, counted by the server as stale).
  const float w2 = res->tensors["W"][2];
  EXPECT_GE(w2, 9.0f);
  EXPECT_LE(w2, 10.0f);
  std::cerr << "[ info ] worker 2 joined at clock " << res->Int("start_clock")
            << " (others at step " << done << "); its applied pushes: " << w2 << "\n";
}

// The coordinator is SIGKILLed mid-training and restarted on the same address with its state
// file. Training goes on while it is down (a steady-state step needs no control message), every
// member rejoins it as itself, and it is fully functional afterwards: a primary killed after the
// restart is failed over through it. The weights are bit-identical to the one-process run.
TEST_P(ProcessClusterTest, CoordinatorRestartDoesNotStopTraining) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 2;
  spec.state_file = Path("coordinator.state");
  const int kSteps = 60;
  const int step_delay_ms = Emulated() ? 60 : 20;
  // A fixed port: the restarted coordinator must be found where the first one was.
  auto probe = net::ListenTcp("127.0.0.1:0", &spec.listen);
  ASSERT_TRUE(probe.ok()) << probe.status();
  probe->reset();
  ASSERT_NE(StartCoordinator(spec), "");
  ChildProcess* first = coordinator_;
  StartServers(spec);
  // Held at step 50 until the second fault: never over before it, however long the rejoins take.
  std::vector<std::string> flags = {"--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=" + std::to_string(step_delay_ms)};
  for (const std::string& f : HoldFlags(50)) flags.push_back(f);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  const int before = WaitProgress(Path("progress0"), 10, ProcessBound(), workers[0]);
  ASSERT_GE(before, 10);
  first->Kill();
  // Down for a while: training must go on without it.
  const int down_from = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  const int during =
      WaitProgress(Path("progress0"), down_from + 5, milliseconds(20000), workers[0]);
  EXPECT_GE(during, down_from + 5) << "training stopped while the coordinator was down";
  ASSERT_NE(StartCoordinator(spec), "");
  // Every member rejoins (4 servers + 2 workers).
  const auto until = Clock::now() + milliseconds(20000);
  size_t rejoined = 0;
  while (Clock::now() < until) {
    const std::string log = coordinator_->LogTail(200000);
    rejoined = 0;
    for (size_t p = log.find("rejoined ("); p != std::string::npos;
         p = log.find("rejoined (", p + 1)) {
      ++rejoined;
    }
    if (rejoined == 6) break;
    std::this_thread::sleep_for(milliseconds(20));
  }
  ASSERT_EQ(rejoined, 6u) << coordinator_->LogTail();
  // Now a primary dies: the restarted coordinator fails its group over.
  const int now = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  ASSERT_LT(now + 3, kSteps) << "training ended before the second fault";
  servers_[1]->Kill();
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    ExpectSameWeights(*res, *ref, r);
  }
  std::cerr << "[ info ] coordinator killed after step " << down_from << "; " << during - down_from
            << "+ steps done while it was down; 6 members rejoined; a primary killed at step "
            << now << " failed over through the restarted coordinator\n";
}

// Control-plane faults during training and a failover: every member reaches the coordinator
// through two control_fault_proxy instances in a row, one delaying half of all messages by
// 20 ms (order kept), one dropping 30% of the heartbeats. A primary is killed mid-run. Nobody is
// declared dead by the lost heartbeats, the failover goes through the delayed messages, and the
// weights are bit-identical to the one-process run.
TEST_P(ProcessClusterTest, ControlMessagesDroppedAndDelayedDuringAFailover) {
  ClusterSpec spec = Spec();
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 2;
  const int kSteps = 40;
  const std::string delay = Emulated() ? "40" : "15";
  ASSERT_NE(StartCoordinator(spec), "");
  const std::string coordinator = coordinator_address_;
  std::vector<ChildProcess*> proxies;
  auto proxy = [&](const std::string& name, const std::string& upstream,
                   std::vector<std::string> flags) -> std::string {
    const std::string port_file = Path(name + ".port");
    std::vector<std::string> argv = {CONTROL_FAULT_PROXY_BIN, "--upstream=" + upstream,
                                     "--listen=127.0.0.1:0", "--port_file=" + port_file, "--stats"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    ChildProcess* p = Spawn(argv, name + ".log");
    if (p == nullptr) return "";
    proxies.push_back(p);
    auto addr = WaitForFile(port_file, milliseconds(10000), p);
    if (!addr.ok()) return "";
    std::string a = *addr;
    a.erase(a.find_last_not_of("\n ") + 1);
    return a;
  };
  const std::string delayer =
      proxy("delay-proxy", coordinator, {"--delay_ms=20", "--delay_percent=50", "--seed=7"});
  ASSERT_NE(delayer, "");
  const std::string dropper =
      proxy("drop-proxy", delayer,
            {"--drop_percent=30", "--only=heartbeat", "--direction=up", "--seed=11"});
  ASSERT_NE(dropper, "");
  coordinator_address_ = dropper;  // every member dials the proxies
  StartServers(spec);
  // Held at step 30 until the kill: never over before it (ServerKillTest).
  std::vector<std::string> flags = {"--steps=" + std::to_string(kSteps), "--step_delay_ms=" + delay};
  for (const std::string& f : HoldFlags(30)) flags.push_back(f);
  std::vector<ChildProcess*> workers = SpawnWorkers(spec, flags);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ASSERT_GE(WaitProgress(Path("progress0"), 12, ProcessBound(), workers[0]), 12);
  servers_[0]->Kill();
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    ExpectSameWeights(*res, *ref, r);
  }
  // The faults really happened, and no member was declared dead for lost heartbeats.
  auto last_count = [&](const std::string& log, const std::string& key) -> int64_t {
    const size_t p = log.rfind(key);
    return p == std::string::npos ? -1 : std::strtoll(log.c_str() + p + key.size(), nullptr, 10);
  };
  for (ChildProcess* p : proxies) {  // SIGTERM: each prints its final counters and exits 0
    kill(p->pid(), SIGTERM);
    EXPECT_EQ(ExitCode(p, milliseconds(10000)), 0) << Tail(p);
  }
  auto text = [&](const std::string& name) {
    auto t = ReadFile(Path(name));
    return t.ok() ? *t : std::string();
  };
  const std::string drop_log = text("drop-proxy.log");
  const std::string delay_log = text("delay-proxy.log");
  const std::string coord_log = text("coordinator.log");
  EXPECT_GT(last_count(drop_log, "heartbeat: forwarded "), 0) << drop_log.substr(0, 2000);
  const size_t hb = drop_log.rfind("heartbeat: forwarded");
  ASSERT_NE(hb, std::string::npos);
  EXPECT_GT(last_count(drop_log.substr(hb), "dropped "), 0) << "no heartbeat was dropped";
  EXPECT_GT(last_count(delay_log, "total: forwarded "), 0);
  const size_t tot = delay_log.rfind("total: forwarded");
  ASSERT_NE(tot, std::string::npos);
  EXPECT_GT(last_count(delay_log.substr(tot), "delayed "), 0) << "no message was delayed";
  EXPECT_EQ(coord_log.find("no heartbeat for"), std::string::npos) << "a member was declared dead";
}

}  // namespace
}  // namespace shardps
