// The consistency contract as a property (docs/consistency.md), over every mode x replica count
// x transport: BSP, SSP at s = 0, 1, 2, ASP and VSGD (s = 2), each with one server per group
// and with a primary and a backup per group, over tcp, shm and verbs (verbs inside the SoftRoCE
// guest; skipped with the reason elsewhere).
//
// Each run: 2 server groups, 3 ps_test_worker processes on the signature model
// (tests/integration/signature_check.h: one exactly representable signature per (worker,
// clock) update), random per-step delays and a straggler (rank 0 sleeps up to 30 ms a step,
// the others up to 8 ms). After every step each worker decodes from the weights it pulled
// exactly which updates they hold and checks the mode's guarantee on that pull. The same
// signatures go to three row tables (embeddings) of one row per update: dense ids, hashed ids,
// and dense ids behind a worker cache; each is read whole with PullRows after every step and
// checked the same way. The `_rows` cases register the row tables only: there Step() has no
// dense pull, whose wait for the clock would otherwise let the servers finish the rows' clock
// before PullRows reads them, so each row pull's own check of the bound is what is tested.
// With replicas 2 the primary of group 0 is SIGKILLed mid-run: the guarantee must hold across
// the failover, for the dense tensors and the row tables alike. Every odd step pushes its
// tensors and tables by hand (PushMany) before Step(), the others leave the pushes to Step():
// under BSP a push sent twice in a clock would replace the first, and a table's second push
// would carry no rows (the update lost; 2026-12-07).
// Printed per case: pulls checked, pulls at the bound, the largest staleness seen, chunk pulls
// served from the other buffer, and rows the worker cache served.
#include <stdlib.h>

#include <algorithm>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/process_test_base.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

struct ModeCase {
  const char* name;  // the instance name's part
  const char* consistency;
  int staleness;
};
constexpr ModeCase kModes[] = {{"bsp", "bsp", 0},  {"ssp0", "ssp", 0}, {"ssp1", "ssp", 1},
                               {"ssp2", "ssp", 2}, {"asp", "asp", 0},  {"vsgd2", "vsgd", 2}};

// transport, index into kModes, replicas, row tables only
using Param = std::tuple<std::string, int, int, bool>;

class ConsistencyPropertyTest : public ProcessTestBase,
                                public ::testing::WithParamInterface<Param> {
 protected:
  void SetUp() override { SetUpFor(transport()); }
  std::string transport() const { return std::get<0>(GetParam()); }
  const ModeCase& mode() const { return kModes[std::get<1>(GetParam())]; }
  int replicas() const { return std::get<2>(GetParam()); }
  bool rows_only() const { return std::get<3>(GetParam()); }
  bool Emulated() const { return transport() == "verbs"; }
};

TEST_P(ConsistencyPropertyTest, EveryPullHoldsWhatTheModeGuarantees) {
  ClusterSpec spec;
  spec.transport = transport();
  spec.consistency = mode().consistency;
  spec.staleness = mode().staleness;
  spec.servers = 2;
  spec.replicas = replicas();
  spec.workers = 3;
  spec.lr = 1.0;
  spec.aggregation = "sum";
  // 3 workers x 24 clocks = 72 floats per tensor: 3 chunks of 32 floats (W) + 3 (b), spread
  // over both groups.
  spec.partition_bytes = 128;
  // Under SoftRoCE's CPU emulation a busy guest can starve a heartbeat thread for > 1.5 s.
  spec.heartbeat_timeout_ms = Emulated() ? 6000 : 1500;
  const int kSteps = 24;
  const milliseconds bound = Emulated() ? 4 * kProcessBound : kProcessBound;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    std::vector<std::string> flags = {"--model=signature", "--signature_rows",
                                      rows_only() ? "--nosignature_dense" : "--signature_dense",
                                      "--signature_push_by_hand_every=2",
                                      "--steps=" + std::to_string(kSteps),
                                      std::string("--max_delay_ms=") + (r == 0 ? "30" : "8"),
                                      "--progress_file=" + Path("progress" + std::to_string(r))};
    if (replicas() == 2) {
      // Held two thirds in until the kill: no worker (ASP's fast ones least of all) is done
      // before it, however late this thread gets to it.
      for (const std::string& f : HoldFlags(2 * kSteps / 3)) flags.push_back(f);
    }
    workers.push_back(
        SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log", flags));
  }
  if (replicas() == 2) {
    // Mid-run, the primary of group 0 (rank 0; its backup is rank `servers`).
    const int done = WaitProgress(Path("progress1"), kSteps / 3, bound, workers[1]);
    ASSERT_GE(done, kSteps / 3) << Tail(workers[1]);
    servers_[0]->Kill();
    ASSERT_TRUE(ReleaseHold());
  }
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  int64_t pulls = 0, row_pulls = 0, at_bound = 0, max_staleness = 0, other_buffer = 0;
  int64_t cache_hits = 0;
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Int("violations"), 0) << "worker " << r << " (log: " << Tail(workers[r]) << ")";
    EXPECT_EQ(res->Int("sig_pulls"), rows_only() ? 0 : 2 * kSteps) << "worker " << r;
    EXPECT_EQ(res->Int("row_sig_pulls"), 3 * kSteps) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    if (replicas() == 2) {
      EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    }
    if (std::string(mode().consistency) != "asp") {
      EXPECT_LE(res->Int("sig_max_staleness"), mode().staleness) << "worker " << r;
    }
    pulls += res->Int("sig_pulls");
    row_pulls += res->Int("row_sig_pulls");
    cache_hits += res->Int("row_cache_hits");
    at_bound += res->Int("sig_at_bound");
    max_staleness = std::max(max_staleness, res->Int("sig_max_staleness"));
    other_buffer += res->Int("pull_other_buffer");
  }
  std::cerr << "[ info ] " << transport() << " " << mode().name << " replicas " << replicas()
            << ": " << pulls << " tensor and " << row_pulls << " row-table pulls checked, "
            << at_bound << " at the bound, max staleness " << max_staleness << ", "
            << other_buffer << " chunk pulls from the other buffer, " << cache_hits
            << " rows from the worker cache"
            << (replicas() == 2 ? ", primary of group 0 killed mid-run" : "")
            << "\n";
}

// A row is never read before its backup has it (docs/embeddings.md, "Nothing visible before it
// is replicated"). ASP, one group of a primary and a backup, two workers pushing the row
// signatures (rows only) and a third that only reads every table, over and over, checking each
// read against the ones before. The primary stops at its 30th Commit (stall point
// server.before_record: the version's record not posted yet), the reader reads it at least 5
// more times, and the primary is killed in the stop, so that version never reaches the backup
// and its worker sends it again to the promoted backup. Had the primary written the version's
// rows before posting its record, the reader would have seen them during the stop and found
// them gone after the failover: the pushers hold their resend back for 1.5 s (stall point
// worker.before_resent_push), so that the reader reads the promoted backup before the resent
// version is there. What it does not cover: rows written after the record is posted and before
// it completes (a kill cannot be placed there from outside), BSP (whose reads wait for the
// header, published after the record), and row sets.
class RowVisibilityTest : public ProcessTestBase,
                          public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override { SetUpFor(GetParam()); }
};

TEST_P(RowVisibilityTest, ARowIsNeverReadBeforeItsBackupHasIt) {
  const bool emulated = GetParam() == "verbs";
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.consistency = "asp";
  spec.servers = 1;
  spec.replicas = 2;
  spec.workers = 3;
  spec.lr = 1.0;
  spec.aggregation = "sum";
  spec.heartbeat_timeout_ms = emulated ? 6000 : 1500;
  spec.stall_rank = 0;
  spec.stall_point = "server.before_record@30:600000";  // killed in it
  const int kSteps = 24;
  const milliseconds bound = emulated ? 4 * kProcessBound : kProcessBound;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    std::vector<std::string> flags = {"--model=signature", "--signature_rows",
                                      "--nosignature_dense", "--steps=" + std::to_string(kSteps),
                                      "--max_delay_ms=4"};
    if (r == 2) {
      flags.push_back(std::string("--signature_reader_ms=") + (emulated ? "90000" : "30000"));
      flags.push_back("--progress_file=" + Path("reader"));
      unsetenv("SHARDPS_STALL_POINT");
    } else {
      setenv("SHARDPS_STALL_POINT", "worker.before_resent_push:1500", 1);  // inherited at spawn
    }
    workers.push_back(
        SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log", flags));
  }
  unsetenv("SHARDPS_STALL_POINT");
  ASSERT_TRUE(WaitForLog(servers_[0], "stall point server.before_record", bound))
      << Tail(servers_[0]);
  // The reader reads the stopped primary (what it could see of the version in flight, it sees
  // now) 5 more times, then the primary dies in its stop.
  const int read_before = WaitProgress(Path("reader"), 0, milliseconds(0), workers[2]);
  ASSERT_GE(WaitProgress(Path("reader"), read_before + 5, bound, workers[2]), read_before + 5)
      << Tail(workers[2]);
  servers_[0]->Kill();
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("violations"), 0) << "worker " << r << " (log: " << Tail(workers[r]) << ")";
    EXPECT_EQ(res->Int("failovers"), 1) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    if (r < 2) {
      EXPECT_EQ(res->Int("row_sig_pulls"), 3 * kSteps) << "worker " << r;
    } else {
      EXPECT_EQ(res->Int("steps"), 1) << "the reader never saw the pushers' every update";
      std::cerr << "[ info ] " << GetParam() << ": the reader checked "
                << res->Int("row_sig_pulls") << " reads of a table, across the failover\n";
    }
  }
}

// A push by hand that Step() leaves out (Push, then Step, then Wait: overlapping the push with
// the rest of backward) is resent after a failover during that Step, as Step's own pushes are:
// the caller has not waited for it, so its gradient is still in the buffer (PushPipeline::
// ResyncChunk: a push whose handle is not waited for is resendable). ASP, one group of
// a primary and a backup, one worker pushing every step by hand; the primary stops at its 10th
// Commit (a hand push's, not replicated yet) and is killed in the stop, while the worker waits
// in Step for the acknowledgements (ASP with a backup). Before, that push was counted lost.
// `waited`: the worker waits for its hand pushes before Step (Push, Wait, Step), after which it
// may have reused the buffer: the push is counted lost (pushes_lost 1, a warning), and Step
// goes on; before, Step then waited for that push's acknowledgement, which never comes, and
// failed with DEADLINE_EXCEEDED.
class HandPushFailoverTest : public ProcessTestBase,
                             public ::testing::WithParamInterface<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
};

TEST_P(HandPushFailoverTest, AHandPushStepLeftOutIsResentAfterAFailoverInIt) {
  const auto& [transport, waited] = GetParam();
  const bool emulated = transport == "verbs";
  ClusterSpec spec;
  spec.transport = transport;
  spec.consistency = "asp";
  spec.servers = 1;
  spec.replicas = 2;
  spec.workers = 1;
  spec.lr = 1.0;
  spec.aggregation = "sum";
  spec.heartbeat_timeout_ms = emulated ? 6000 : 1500;
  spec.stall_rank = 0;
  spec.stall_point = "server.before_record@10:600000";  // killed in it
  const int kSteps = 12;
  const milliseconds bound = emulated ? 4 * kProcessBound : kProcessBound;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<std::string> flags = {"--model=signature", "--steps=" + std::to_string(kSteps),
                                    "--max_delay_ms=2", "--signature_push_by_hand_every=1"};
  if (waited) flags.push_back("--signature_wait_hand_pushes");
  ChildProcess* worker = SpawnWorker(WorkerArgs(spec, 0), "worker0.log", flags);
  ASSERT_TRUE(WaitForLog(servers_[0], "stall point server.before_record", bound))
      << Tail(servers_[0]);
  servers_[0]->Kill();
  ASSERT_EQ(ExitCode(worker, bound), 0) << Tail(worker);
  auto res = Result(0);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->Int("steps"), kSteps);
  EXPECT_EQ(res->Int("failovers"), 1);
  if (waited) {
    EXPECT_EQ(res->Int("pushes_lost"), 1) << "the waited hand push the primary died on";
  } else {
    EXPECT_EQ(res->Int("pushes_lost"), 0) << Tail(worker);
    EXPECT_GE(res->Int("pushes_resent"), 1) << "the hand push the primary died on";
  }
  EXPECT_EQ(res->Int("violations"), 0) << Tail(worker);
}

INSTANTIATE_TEST_SUITE_P(Transports, HandPushFailoverTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) ? "_waited" : "");
                         });

INSTANTIATE_TEST_SUITE_P(Transports, RowVisibilityTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Combinations, ConsistencyPropertyTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Range(0, 6), ::testing::Values(1, 2),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  kModes[std::get<1>(info.param)].name + "_r" +
                                  std::to_string(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_rows" : "");
                         });

}  // namespace
}  // namespace shardps
