// Host aggregation (docs/hierarchical.md) as properties of real processes, over tcp, shm and
// verbs (verbs inside the SoftRoCE guest; skipped with the reason elsewhere): 2 emulated hosts,
// each a shardps_aggregator with 2 local ps_test_worker processes, 2 server groups.
//
//   BspIsTheHostOrderedSumBitForBit   BSP equals, bit for bit, the one-process run that sums
//                                     each host's workers first, then the hosts (the stated
//                                     order), on every worker, run after run; the second run
//                                     reads the weights in place (WeightsView, no copy).
//   EveryPullHoldsWhatTheModeGuarantees  BSP, SSP(2), ASP, VSGD(2): every pull decoded
//                                     (signature model), the mode's bound holds between hosts.
//   AKilledLocalWorkerCountsAtMostOnce   kill -9 of a local worker mid-run: the others finish,
//                                     every survivor's gradients are applied exactly once, the
//                                     dead one's at most once each (counter model).
//   AKilledAggregatorRestartsWithNothingAppliedTwice  the aggregator _exit(9)s at a clock,
//                                     before its push or after it was acknowledged; a restarted
//                                     aggregator takes the host's workers back: the clock in
//                                     flight is applied exactly 0 or 1 times, as the crash point
//                                     says, every other clock exactly once.
//   ABarrierHoldsEveryLearnerOfEveryHost  Client::Barrier in every mode: no learner passes a
//                                     barrier before the last learner of any host arrived.
//   BarriersHoldAcrossARestart        the same across a killed and restarted aggregator
//                                     (between barriers, and while its learners wait at one).
//   AFrozenTensorStaysAsItIsInEveryMode  learners' no-gradient marks reach the servers
//                                     through the aggregators: a frozen tensor under weight
//                                     decay stays bit for bit as it started, in every mode
//                                     (and under BSP the rest trains as the host-ordered sum).
//   BalancedLayoutSplitsTheServersToOneElement  the balanced shard layout (Herring's fusion
//                                     buffers): both servers hold 260 of the 520 floats, and
//                                     training is still bit for bit.
//   AHostileLocalProcessCannotHurtTheGroup  garbage packets, a join without the token, and an
//                                     admitted member that tries to map the weights writable,
//                                     resize or re-seal the shared memory: all refused, and the
//                                     real worker trains on to the end.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/crypto.h"
#include "tests/integration/process_test_base.h"
#include "worker/host_group.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

constexpr int kHosts = 2;
constexpr int kLocal = 2;
constexpr int kWorkers = kHosts * kLocal;

class HierarchicalTest : public ProcessTestBase {
 protected:
  bool Emulated(const std::string& transport) const { return transport == "verbs"; }

  std::string Socket(int host) const {
    // Abstract namespace: no path-length limit from the test directory, nothing left behind.
    return "@shardps-test-" + std::to_string(getpid()) + "-" + std::to_string(serial_) + "-" +
           std::to_string(host);
  }

  ChildProcess* SpawnAggregator(const ClusterSpec& spec, int host,
                                const std::vector<std::string>& extra = {},
                                const std::string& log_suffix = "") {
    std::vector<std::string> argv = {SHARDPS_AGGREGATOR_BIN,
                                     "--socket=" + Socket(host),
                                     "--local_workers=" + std::to_string(kLocal),
                                     "--coordinator=" + coordinator_address_,
                                     std::string("--cluster_token=") + kToken,
                                     "--transport=" + spec.transport,
                                     "--bind_ip=" + WorkerIp(spec.transport),
                                     "--rank=" + std::to_string(host),
                                     "--setup_timeout_s=60",
                                     "--wait_timeout_s=30"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Spawn(argv, "aggregator" + std::to_string(host) + log_suffix + ".log");
  }

  // Local worker `l` of `host` (global rank host * kLocal + l): worker<rank>.out.
  ChildProcess* SpawnLocal(const ClusterSpec& spec, int host, int l,
                           const std::vector<std::string>& extra) {
    const int rank = host * kLocal + l;
    setenv("SHARDPS_AGGREGATOR", Socket(host).c_str(), 1);
    setenv("SHARDPS_LOCAL_RANK", std::to_string(l).c_str(), 1);
    setenv("SHARDPS_CLUSTER_TOKEN", kToken, 1);
    std::vector<std::string> argv = {PS_TEST_WORKER_BIN,
                                     "--workers=" + std::to_string(kWorkers),
                                     LrFlag(spec.lr),
                                     "--out=" + Path("worker" + std::to_string(rank) + ".out"),
                                     "--progress_file=" + Path("progress" + std::to_string(rank)),
                                     "--setup_timeout_ms=60000",
                                     "--wait_timeout_ms=30000"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ChildProcess* c = Spawn(argv, "worker" + std::to_string(rank) + ".log");
    unsetenv("SHARDPS_AGGREGATOR");
    unsetenv("SHARDPS_LOCAL_RANK");
    unsetenv("SHARDPS_CLUSTER_TOKEN");
    return c;
  }

  // A cluster whose coordinator counts hosts (one aggregator each), the aggregators, and their
  // local workers; returns the workers by global rank.
  std::vector<ChildProcess*> StartHosts(const ClusterSpec& spec,
                                        const std::vector<std::string>& worker_flags,
                                        std::vector<ChildProcess*>* aggregators,
                                        const std::vector<std::vector<std::string>>& agg_flags = {}) {
    ++serial_;
    std::vector<ChildProcess*> workers;
    if (!StartCluster(spec)) return workers;
    for (int h = 0; h < kHosts; ++h) {
      aggregators->push_back(
          SpawnAggregator(spec, h, h < static_cast<int>(agg_flags.size()) ? agg_flags[h]
                                                                           : std::vector<std::string>{}));
      for (int l = 0; l < kLocal; ++l) workers.push_back(SpawnLocal(spec, h, l, worker_flags));
    }
    return workers;
  }

  // --barrier_every's property over every learner's result: each barrier generation 1 ..
  // `barriers` was passed by at least `min_passers` learners, none before the last learner that
  // passed it arrived there (steady clock, one machine). A learner that skipped a generation
  // (its host was away while the cluster released it) does not count there.
  void ExpectEveryBarrierHeld(int barriers, int min_passers = kWorkers) {
    auto split = [](const std::string& list) {
      std::vector<int64_t> v;
      size_t at = 0;
      while (at < list.size()) {
        size_t end = list.find(',', at);
        if (end == std::string::npos) end = list.size();
        v.push_back(std::strtoll(list.substr(at, end - at).c_str(), nullptr, 10));
        at = end + 1;
      }
      return v;
    };
    std::vector<int64_t> latest_arrival(barriers + 1, 0), earliest_release(barriers + 1, INT64_MAX);
    std::vector<int> passers(barriers + 1, 0);
    for (int r = 0; r < kWorkers; ++r) {
      auto res = Result(r);
      ASSERT_TRUE(res.ok()) << res.status();
      const std::vector<int64_t> arrive = split(res->Get("barrier_arrive_ns"));
      const std::vector<int64_t> release = split(res->Get("barrier_release_ns"));
      const std::vector<int64_t> gen = split(res->Get("barrier_gen"));
      ASSERT_EQ(release.size(), arrive.size()) << "worker " << r;
      ASSERT_EQ(gen.size(), arrive.size()) << "worker " << r;
      for (size_t i = 0; i < gen.size(); ++i) {
        // (Past `barriers`: a restarted host's learners, clocks ahead of their steps, may pass
        // more after the other host is done; those are released by its departure.)
        ASSERT_GE(gen[i], 1) << "worker " << r;
        if (i > 0) {
          ASSERT_GT(gen[i], gen[i - 1]) << "worker " << r << " passed a generation twice";
        }
        if (gen[i] > barriers) continue;
        latest_arrival[gen[i]] = std::max(latest_arrival[gen[i]], arrive[i]);
        earliest_release[gen[i]] = std::min(earliest_release[gen[i]], release[i]);
        ++passers[gen[i]];
      }
    }
    for (int g = 1; g <= barriers; ++g) {
      EXPECT_GE(passers[g], min_passers) << "barrier " << g;
      EXPECT_GE(earliest_release[g], latest_arrival[g])
          << "barrier " << g << ": a learner passed it "
          << (latest_arrival[g] - earliest_release[g]) / 1000 << " us before the last arrived";
    }
  }

  // Tears the processes of one run down (the next run of the same test starts fresh).
  void EndRun() {
    for (auto& c : children_) c->Kill();
    children_.clear();
    servers_.clear();
    coordinator_ = nullptr;
  }

  // The one-process reference of kHosts x kLocal learners summed host by host (or, with
  // --steps=0, the initial weights), writing `out`.
  ChildProcess* SpawnHostReference(double lr, int steps, const std::vector<std::string>& extra,
                                   const std::string& out = "standalone") {
    std::vector<std::string> argv = {PS_TEST_WORKER_BIN, "--standalone",
                                     "--workers=" + std::to_string(kWorkers),
                                     "--local_workers=" + std::to_string(kLocal),
                                     "--steps=" + std::to_string(steps), LrFlag(lr),
                                     "--out=" + Path(out + ".out")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Spawn(argv, out + ".log");
  }

  int serial_ = 0;
};

class HierarchicalTransportTest : public HierarchicalTest,
                                  public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override { SetUpFor(GetParam()); }
  milliseconds Bound() const { return Emulated(GetParam()) ? 4 * kProcessBound : kProcessBound; }
  ClusterSpec Spec() const {
    ClusterSpec spec;
    spec.transport = GetParam();
    spec.servers = 2;
    spec.workers = kHosts;  // the coordinator's workers are the aggregators
    spec.heartbeat_timeout_ms = Emulated(GetParam()) ? 6000 : 1500;
    return spec;
  }
};

TEST_P(HierarchicalTransportTest, BspIsTheHostOrderedSumBitForBit) {
  ClusterSpec spec = Spec();
  const int kSteps = 12;
  std::vector<std::vector<float>> first_run;
  for (int run = 0; run < 2; ++run) {
    std::vector<ChildProcess*> aggs;
    // Run 2 reads the weights in place (Client::WeightsView, no copy per worker).
    std::vector<std::string> flags = {"--model=linreg", "--steps=" + std::to_string(kSteps)};
    if (run == 1) flags.push_back("--weights_view");
    std::vector<ChildProcess*> workers = StartHosts(spec, flags, &aggs);
    ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
    ChildProcess* standalone = SpawnHostReference(spec.lr, kSteps, {});
    for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, Bound()), 0) << Tail(w);
    for (ChildProcess* a : aggs) ASSERT_EQ(ExitCode(a, Bound()), 0) << Tail(a);
    auto ref = StandaloneResult(standalone, Bound());
    ASSERT_TRUE(ref.ok()) << ref.status();
    for (int r = 0; r < kWorkers; ++r) {
      auto res = Result(r);
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_EQ(res->Int("rank"), r);
      EXPECT_EQ(res->Int("steps"), kSteps);
      EXPECT_EQ(res->Get("transport"), "host+" + GetParam());
      EXPECT_EQ(res->Int("control_messages_steady"), 0);
      EXPECT_EQ(res->Int("pushes_lost"), 0);
      EXPECT_EQ(res->tensors["W"], ref->tensors["W"]) << "worker " << r << ": W differs";
      EXPECT_EQ(res->tensors["b"], ref->tensors["b"]) << "worker " << r << ": b differs";
      if (run == 0) {
        first_run.push_back(res->tensors["W"]);
      } else {
        EXPECT_EQ(res->tensors["W"], first_run[r]) << "worker " << r << ": run 2 differs";
        // The pulls never wrote the registered buffers: the views were read in place.
        EXPECT_EQ(res->Int("view_buffer_untouched"), 1) << "worker " << r;
      }
    }
    // Each aggregator pushed and pulled once per clock for its two workers.
    for (int h = 0; h < kHosts; ++h) {
      EXPECT_TRUE(WaitForLog(aggs[h], "after " + std::to_string(kSteps) + " steps",
                             milliseconds(1000)))
          << Tail(aggs[h]);
    }
    EndRun();
  }
}

// Balanced fusion buffers (proto/shard_plan.h, ShardLayout::kBalanced) under the same cluster:
// W (512 floats) and b (8) are one buffer cut into 260 floats per server -- the LPT layout gives
// 264 and 256 -- and training is still the host-ordered sum bit for bit.
TEST_P(HierarchicalTransportTest, BalancedLayoutSplitsTheServersToOneElement) {
  ClusterSpec spec = Spec();
  spec.coordinator_extra = {"--shard_layout=balanced"};
  const int kSteps = 8;
  std::vector<ChildProcess*> aggs;
  std::vector<ChildProcess*> workers =
      StartHosts(spec, {"--model=linreg", "--steps=" + std::to_string(kSteps)}, &aggs);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  ChildProcess* standalone = SpawnHostReference(spec.lr, kSteps, {});
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, Bound()), 0) << Tail(w);
  EXPECT_TRUE(WaitForLog(coordinator_, "layout balanced, imbalance 1, bytes per server 1040,1040",
                         milliseconds(1000)))
      << Tail(coordinator_);
  auto ref = StandaloneResult(standalone, Bound());
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (int r = 0; r < kWorkers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->tensors["W"], ref->tensors["W"]) << "worker " << r << ": W differs";
    EXPECT_EQ(res->tensors["b"], ref->tensors["b"]) << "worker " << r << ": b differs";
  }
}

TEST_P(HierarchicalTransportTest, AKilledLocalWorkerCountsAtMostOnce) {
  ClusterSpec spec = Spec();
  spec.lr = 1.0;
  spec.aggregation = "sum";
  const int kSteps = 30;
  std::vector<ChildProcess*> aggs;
  // Held two thirds in until the kill: the victim dies mid-run however late this thread is.
  std::vector<std::string> flags = {"--model=counter", "--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=15"};
  for (const std::string& f : HoldFlags(2 * kSteps / 3)) flags.push_back(f);
  std::vector<ChildProcess*> workers = StartHosts(spec, flags, &aggs);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  const int victim = 1;  // host 0, local rank 1
  const int before = WaitProgress(Path("progress1"), kSteps / 3, Bound(), workers[victim]);
  ASSERT_GE(before, kSteps / 3) << Tail(workers[victim]);
  workers[victim]->Kill();
  ASSERT_TRUE(ReleaseHold());
  const int after = WaitProgress(Path("progress1"), 0, milliseconds(100), nullptr);
  for (int r = 0; r < kWorkers; ++r) {
    if (r != victim) {
      ASSERT_EQ(ExitCode(workers[r], Bound()), 0) << Tail(workers[r]);
    }
  }
  for (ChildProcess* a : aggs) ASSERT_EQ(ExitCode(a, Bound()), 0) << Tail(a);
  for (int r = 0; r < kWorkers; ++r) {
    if (r == victim) continue;
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    const std::vector<float>& w = res->tensors["W"];
    ASSERT_EQ(w.size(), static_cast<size_t>(kWorkers));
    for (int k = 0; k < kWorkers; ++k) {
      if (k == victim) {
        // Its finished clocks, each once: at least those it had reported, at most one more.
        EXPECT_GE(w[k], static_cast<float>(before)) << "worker " << r << " sees " << k;
        EXPECT_LE(w[k], static_cast<float>(std::max(before, after) + 1)) << "worker " << r;
      } else {
        // A survivor's every push, exactly once (BSP: a final pull holds every clock below it).
        EXPECT_EQ(w[k], static_cast<float>(kSteps)) << "worker " << r << " sees " << k;
      }
    }
  }
}

class AggregatorKillTest
    : public HierarchicalTest,
      public ::testing::WithParamInterface<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
  const std::string& transport() const { return std::get<0>(GetParam()); }
  milliseconds Bound() const { return Emulated(transport()) ? 4 * kProcessBound : kProcessBound; }
  // The kill tests' cluster: 2 servers, one worker per host, sums at lr 1.
  ClusterSpec KillSpec() const {
    ClusterSpec spec;
    spec.transport = transport();
    spec.servers = 2;
    spec.workers = kHosts;
    spec.lr = 1.0;
    spec.aggregation = "sum";
    spec.heartbeat_timeout_ms = Emulated(transport()) ? 6000 : 1500;
    return spec;
  }
};

TEST_P(AggregatorKillTest, AKilledAggregatorRestartsWithNothingAppliedTwice) {
  const bool after_push = std::get<1>(GetParam());
  const milliseconds bound = Bound();
  const ClusterSpec spec = KillSpec();
  const int kSteps = 16, kCrashClock = 6;
  std::vector<ChildProcess*> aggs;
  std::vector<std::string> crash = {"--crash_at_clock=" + std::to_string(kCrashClock)};
  if (after_push) crash.push_back("--crash_after_push");
  std::vector<ChildProcess*> workers = StartHosts(
      spec, {"--model=counter", "--steps=" + std::to_string(kSteps), "--step_delay_ms=5"}, &aggs,
      {crash});
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  ASSERT_EQ(ExitCode(aggs[0], bound), 9) << Tail(aggs[0]);  // its crash point
  // Restarted, as a launcher would: same socket, same host rank.
  ChildProcess* again = SpawnAggregator(spec, 0, {}, "-restarted");
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  ASSERT_EQ(ExitCode(again, bound), 0) << Tail(again);
  ASSERT_EQ(ExitCode(aggs[1], bound), 0) << Tail(aggs[1]);
  // What the servers applied: each worker's count, the largest any final pull holds (the last
  // worker to finish holds every push; BSP pulls never hold a push twice).
  std::vector<float> applied(kWorkers, 0.0f);
  for (int r = 0; r < kWorkers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    const bool host0 = r < kLocal;
    EXPECT_EQ(res->Int("pushes_lost"), host0 ? 1 : 0) << "worker " << r;
    EXPECT_EQ(res->Int("reconnects"), host0 ? 1 : 0) << "worker " << r;
    const std::vector<float>& w = res->tensors["W"];
    ASSERT_EQ(w.size(), static_cast<size_t>(kWorkers));
    for (int k = 0; k < kWorkers; ++k) {
      EXPECT_LE(w[k], static_cast<float>(kSteps)) << "worker " << r << " sees " << k << " twice";
      applied[k] = std::max(applied[k], w[k]);
    }
  }
  for (int k = 0; k < kWorkers; ++k) {
    const bool host0 = k < kLocal;
    // Host 0's clock in flight: lost before its push, applied once after its acknowledgement.
    const float want = static_cast<float>(host0 && !after_push ? kSteps - 1 : kSteps);
    EXPECT_EQ(applied[k], want) << "worker " << k << (after_push ? " (crash after the push)"
                                                                : " (crash before the push)");
  }
}

// Barriers across an aggregator restart: host 0's aggregator _exit(9)s after its push of clock
// 5 was acknowledged (its learners notice in a wait for weights, between barriers 2 and 3) or
// of clock 7 (they notice inside barrier 3, arrived there). BSP goes on without the departed
// host, so the restarted one joins a few clocks later; the learners' barriers follow the
// clock (--barrier_by_clock: before a step, whenever the generation of the latest multiple of
// 4 at or below the clock is not released yet), as a trainer's must once clocks can be
// skipped. The restarted aggregator's group starts at the generation the cluster had released
// when it joined, and a learner that was waiting arrives again in its new slot, so no learner
// passes a generation before the last one that passed it arrived, and every worker ends.
//  * between_barriers: restarted at once (host 1 is still waiting at clock 6 or 7 for host 0).
//  * at_a_barrier: killed once its learners arrived at barrier 3 (clock 8).
//  * late: restarted only once host 1 has gone on without host 0 through clocks 6 and 7; host
//    1's learners then hold before barrier 3 until the restarted aggregator has started (at
//    clock 8, --hold_before_barrier), so that barrier waits for host 0 again. Host 0's
//    learners, in the wait for weights that ends step 5, jump from clock 6 to 8 (they end at
//    clock 18 after 16 steps) and must still arrive at barrier 3 in their new group.
// Numbered per group (the first version), a learner arrived at "its" 3 in a group that had
// released 0 made the aggregator pass three cluster barriers.
enum class BarrierKill { kBetweenBarriers, kAtABarrier, kLate };

const char* BarrierKillName(BarrierKill k) {
  switch (k) {
    case BarrierKill::kBetweenBarriers:
      return "_between_barriers";
    case BarrierKill::kAtABarrier:
      return "_at_a_barrier";
    case BarrierKill::kLate:
      return "_late";
  }
  return "_unknown";
}

class AggregatorBarrierKillTest
    : public HierarchicalTest,
      public ::testing::WithParamInterface<std::tuple<std::string, BarrierKill>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
  const std::string& transport() const { return std::get<0>(GetParam()); }
  milliseconds Bound() const { return Emulated(transport()) ? 4 * kProcessBound : kProcessBound; }
};

TEST_P(AggregatorBarrierKillTest, BarriersHoldAcrossARestart) {
  const milliseconds bound = Bound();
  ClusterSpec spec;
  spec.transport = transport();
  spec.servers = 2;
  spec.workers = kHosts;
  spec.lr = 1.0;
  spec.aggregation = "sum";
  spec.heartbeat_timeout_ms = Emulated(transport()) ? 6000 : 1500;
  const int kSteps = 16;
  const BarrierKill when = std::get<1>(GetParam());
  const bool at_barrier = when == BarrierKill::kAtABarrier;
  std::vector<std::string> crash = {"--crash_at_clock=" + std::string(at_barrier ? "8" : "6"),
                                    "--crash_after_push"};
  const std::string hold = Path("hold-barrier-3");
  std::vector<std::string> flags = {"--model=counter", "--steps=" + std::to_string(kSteps),
                                    "--step_delay_ms=5", "--barrier_every=4",
                                    "--barrier_by_clock"};
  if (when == BarrierKill::kLate) {
    flags.push_back("--hold_before_barrier=3");
    flags.push_back("--hold_file=" + hold);
  }
  std::vector<ChildProcess*> aggs;
  std::vector<ChildProcess*> workers = StartHosts(spec, flags, &aggs, {crash});
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  ASSERT_EQ(ExitCode(aggs[0], bound), 9) << Tail(aggs[0]);
  if (when == BarrierKill::kLate) {
    // Host 1's learners finished step 7: the cluster applied clocks 6 and 7 without host 0
    // (its departure was seen at once: the dead aggregator's connections closed).
    for (int r = kLocal; r < kWorkers; ++r) {
      const int done = WaitProgress(Path("progress" + std::to_string(r)), 8, bound, workers[r]);
      ASSERT_GE(done, 8) << Tail(workers[r]);
    }
  }
  ChildProcess* again = SpawnAggregator(spec, 0, {}, "-restarted");
  if (when == BarrierKill::kLate) {
    ASSERT_TRUE(WaitForLog(again, "host aggregator: started at clock 8", bound)) << Tail(again);
    // Host 1's learners arrive at barrier 3 now.
    UniqueFd created(open(hold.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
    ASSERT_TRUE(created.valid()) << hold << ": " << strerror(errno);
  }
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  ASSERT_EQ(ExitCode(again, bound), 0) << Tail(again);
  ASSERT_EQ(ExitCode(aggs[1], bound), 0) << Tail(aggs[1]);
  for (int r = 0; r < kWorkers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps) << "worker " << r;
    EXPECT_EQ(res->Int("reconnects"), r < kLocal ? 1 : 0) << "worker " << r;
    if (when == BarrierKill::kLate && r < kLocal) {
      // The restarted host joined at clock 8 (host 1 waits at barrier 3, before its clock 8):
      // its learners skipped clocks 6 and 7, inside step 6.
      EXPECT_EQ(res->Int("end_clock"), kSteps + 2) << "worker " << r;
    }
  }
  // Host 1's learners pass all four; host 0's skip one the cluster released while it was away.
  ExpectEveryBarrierHeld(4, kLocal);
}

// A raw connection to an aggregator's socket, greeted (the aggregator's first message read).
UniqueFd ConnectRaw(const std::string& path) {
  struct sockaddr_un addr;
  socklen_t len;
  if (!worker::host::MakeUnixAddress(path, &addr, &len).ok()) return UniqueFd();
  for (int i = 0; i < 500; ++i) {
    UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      auto hello = worker::host::ReceiveLocal(fd.get(), milliseconds(10000));
      if (hello.ok() && hello->has_started()) return fd;
      return UniqueFd();
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  return UniqueFd();
}

control::LocalMessage LinregJoin(uint32_t local_rank, const std::string& token) {
  control::LocalMessage m;
  auto* j = m.mutable_join();
  j->set_local_rank(local_rank);
  j->set_pid(static_cast<uint32_t>(getpid()));
  j->set_proof(crypto::HmacSha256(token, worker::host::kJoinProofMessage));
  auto* w = j->add_tensors();
  w->set_name("W");
  w->add_shape(64);
  w->add_shape(8);
  auto* b = j->add_tensors();
  b->set_name("b");
  b->add_shape(8);
  return m;
}

TEST_P(HierarchicalTransportTest, AHostileLocalProcessCannotHurtTheGroup) {
  ClusterSpec spec = Spec();
  spec.workers = 1;  // one host: one aggregator
  const int kSteps = 20;
  ++serial_;
  ASSERT_TRUE(StartCluster(spec));
  ChildProcess* agg = SpawnAggregator(spec, 0);
  // The real local rank 0; this test process plays local rank 1.
  ChildProcess* real = SpawnLocal(spec, 0, 0, {"--model=linreg", "--steps=" + std::to_string(kSteps),
                                               "--step_delay_ms=10", "--workers=2"});
  // 1. Bytes that are no message: the connection is dropped, the aggregator goes on.
  {
    UniqueFd fd = ConnectRaw(Socket(0));
    ASSERT_TRUE(fd.valid());
    const char junk[] = "\xff\xfe not a protobuf \x01";
    ASSERT_GT(send(fd.get(), junk, sizeof(junk), MSG_NOSIGNAL), 0);
    auto r = worker::host::ReceiveLocal(fd.get(), milliseconds(10000));
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
  }
  // 2. A join without the cluster's token: refused, naming the token.
  {
    UniqueFd fd = ConnectRaw(Socket(0));
    ASSERT_TRUE(fd.valid());
    ASSERT_TRUE(worker::host::SendLocal(fd.get(), LinregJoin(1, "not-the-token")).ok());
    auto r = worker::host::ReceiveLocal(fd.get(), milliseconds(10000));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->has_error());
    EXPECT_NE(r->error().message().find("token"), std::string::npos) << r->error().message();
  }
  // 3. An admitted member (it has the token) turning hostile.
  UniqueFd member = ConnectRaw(Socket(0));
  ASSERT_TRUE(member.valid());
  ASSERT_TRUE(worker::host::SendLocal(member.get(), LinregJoin(1, kToken)).ok());
  UniqueFd group, weights;
  auto welcome = worker::host::ReceiveLocal(member.get(), milliseconds(30000), &group, &weights);
  ASSERT_TRUE(welcome.ok()) << welcome.status();
  ASSERT_TRUE(welcome->has_welcome()) << welcome->DebugString();
  ASSERT_TRUE(group.valid() && weights.valid());
  const uint64_t weights_bytes = welcome->welcome().region_bytes() - welcome->welcome().weights_offset();
  void* w = mmap(nullptr, weights_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, weights.get(), 0);
  EXPECT_EQ(w, MAP_FAILED) << "the weights were mapped writable";
  if (w != MAP_FAILED) munmap(w, weights_bytes);
  void* r = mmap(nullptr, weights_bytes, PROT_READ, MAP_SHARED, weights.get(), 0);
  EXPECT_NE(r, MAP_FAILED) << "the weights cannot even be read";
  if (r != MAP_FAILED) {
    EXPECT_NE(mprotect(r, weights_bytes, PROT_READ | PROT_WRITE), 0) << "mprotect made them writable";
    munmap(r, weights_bytes);
  }
  char byte = 1;
  EXPECT_LT(pwrite(weights.get(), &byte, 1, 0), 0) << "a write through the weights' fd went in";
  EXPECT_NE(ftruncate(group.get(), 0), 0) << "the group's memory was shrunk";
  EXPECT_NE(ftruncate(weights.get(), 0), 0) << "the weights were shrunk";
  EXPECT_NE(fcntl(group.get(), F_ADD_SEALS, F_SEAL_WRITE), 0) << "a seal was added";
  control::LocalMessage ready;
  ready.mutable_ready();
  ASSERT_TRUE(worker::host::SendLocal(member.get(), ready).ok());
  auto started = worker::host::ReceiveLocal(member.get(), milliseconds(60000));
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_TRUE(started->has_started());
  // It leaves without ever finishing a clock: the real worker trains on alone.
  member.reset();
  ASSERT_EQ(ExitCode(real, Bound()), 0) << Tail(real);
  ASSERT_EQ(ExitCode(agg, Bound()), 0) << Tail(agg);
  auto res = Result(0);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->Int("steps"), kSteps);
  EXPECT_TRUE(WaitForLog(agg, "refused a local connection", milliseconds(0)) ||
              WaitForLog(agg, "sent no join", milliseconds(1000)))
      << Tail(agg);
}

struct ModeCase {
  const char* name;
  const char* consistency;
  int staleness;
};
constexpr ModeCase kModes[] = {
    {"bsp", "bsp", 0}, {"ssp2", "ssp", 2}, {"asp", "asp", 0}, {"vsgd2", "vsgd", 2}};

class HierarchicalModeTest
    : public HierarchicalTest,
      public ::testing::WithParamInterface<std::tuple<std::string, int>> {
 protected:
  void SetUp() override { SetUpFor(std::get<0>(GetParam())); }
  std::string transport() const { return std::get<0>(GetParam()); }
  const ModeCase& mode() const { return kModes[std::get<1>(GetParam())]; }
  milliseconds ModeBound() const {
    return Emulated(transport()) ? 4 * kProcessBound : kProcessBound;
  }
  // The mode's cluster: 2 servers, whose workers are the hosts' aggregators.
  ClusterSpec ModeSpec() const {
    ClusterSpec spec;
    spec.transport = transport();
    spec.consistency = mode().consistency;
    spec.staleness = mode().staleness;
    spec.servers = 2;
    spec.workers = kHosts;
    spec.heartbeat_timeout_ms = Emulated(transport()) ? 6000 : 1500;
    return spec;
  }
};

TEST_P(HierarchicalModeTest, EveryPullHoldsWhatTheModeGuarantees) {
  const std::string transport = this->transport();
  const ModeCase& mode = this->mode();
  const milliseconds bound = ModeBound();
  ClusterSpec spec = ModeSpec();
  spec.lr = 1.0;
  spec.aggregation = "sum";
  spec.partition_bytes = 128;
  const int kSteps = 20;
  std::vector<ChildProcess*> aggs;
  std::vector<ChildProcess*> workers;
  {
    ++serial_;
    ASSERT_TRUE(StartCluster(spec));
    for (int h = 0; h < kHosts; ++h) {
      aggs.push_back(SpawnAggregator(spec, h));
      for (int l = 0; l < kLocal; ++l) {
        // Host 0 is the straggler.
        workers.push_back(SpawnLocal(spec, h, l,
                                     {"--model=signature", "--steps=" + std::to_string(kSteps),
                                      std::string("--max_delay_ms=") + (h == 0 ? "30" : "5")}));
      }
    }
  }
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  int64_t pulls = 0, at_bound = 0, max_staleness = 0;
  for (int r = 0; r < kWorkers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Int("violations"), 0) << "worker " << r << ": " << Tail(workers[r]);
    EXPECT_EQ(res->Int("sig_pulls"), 2 * kSteps) << "worker " << r;
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    if (std::string(mode.consistency) != "asp") {
      EXPECT_LE(res->Int("sig_max_staleness"), mode.staleness) << "worker " << r;
    }
    pulls += res->Int("sig_pulls");
    at_bound += res->Int("sig_at_bound");
    max_staleness = std::max(max_staleness, res->Int("sig_max_staleness"));
  }
  std::cerr << "[ info ] " << transport << " " << mode.name << " hierarchical " << kHosts << "x"
            << kLocal << ": " << pulls << " pulls checked, " << at_bound
            << " at the bound, max staleness " << max_staleness << "\n";
}

// Client::Barrier under host aggregators, in every mode: every learner of both hosts passes
// each of its 3 barriers (before steps 0, 4 and 8, each after a random pause of up to 40 ms)
// only once every learner arrived there: the earliest release of a barrier is after the
// latest arrival (steady clock, one host). A learner's arrival waits in its slot until the
// host's all did; the aggregator then passes the cluster's barrier for the host.
TEST_P(HierarchicalModeTest, ABarrierHoldsEveryLearnerOfEveryHost) {
  const milliseconds bound = ModeBound();
  const ClusterSpec spec = ModeSpec();
  std::vector<ChildProcess*> aggs;
  std::vector<ChildProcess*> workers =
      StartHosts(spec, {"--model=linreg", "--steps=12", "--barrier_every=4"}, &aggs);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  for (ChildProcess* a : aggs) ASSERT_EQ(ExitCode(a, bound), 0) << Tail(a);
  ExpectEveryBarrierHeld(3);
}

// The frozen-tensor mark through the aggregators in every mode: b (SGD with weight decay 0.5,
// which moves it unless the update is skipped) stays bit for bit as it started, whatever order
// and staleness the mode lets the pushes have; W trains. (W's bits depend on timing outside
// BSP, so only b is compared with the one-process reference.)
TEST_P(HierarchicalModeTest, AFrozenTensorStaysAsItIsInEveryMode) {
  const ModeCase& mode = this->mode();
  const milliseconds bound = ModeBound();
  const ClusterSpec spec = ModeSpec();
  const int kSteps = 8;
  std::vector<ChildProcess*> aggs;
  std::vector<ChildProcess*> workers = StartHosts(
      spec, {"--model=linreg", "--steps=" + std::to_string(kSteps), "--freeze_b"}, &aggs);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  ChildProcess* standalone = SpawnHostReference(spec.lr, kSteps, {"--freeze_b"});
  ChildProcess* initial = SpawnHostReference(spec.lr, 0, {"--freeze_b"}, "initial");
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, bound), 0) << Tail(w);
  for (ChildProcess* a : aggs) ASSERT_EQ(ExitCode(a, bound), 0) << Tail(a);
  auto ref = StandaloneResult(standalone, bound);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ(ExitCode(initial, bound), 0) << Tail(initial);
  auto init = ParseResult(Path("initial.out"));
  ASSERT_TRUE(init.ok()) << init.status();
  ASSERT_EQ(ref->tensors["b"], init->tensors["b"]) << "the reference's frozen b moved";
  for (int r = 0; r < kWorkers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->tensors["b"], init->tensors["b"]) << "worker " << r << ": the frozen b moved";
    EXPECT_NE(res->tensors["W"], init->tensors["W"]) << "worker " << r << ": W did not train";
    if (std::string(mode.consistency) == "bsp") {
      EXPECT_EQ(res->tensors["W"], ref->tensors["W"]) << "worker " << r << ": W differs";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, HierarchicalTransportTest,
                         ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Transports, AggregatorKillTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) ? "_after_push" : "_before_push");
                         });
INSTANTIATE_TEST_SUITE_P(Transports, AggregatorBarrierKillTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Values(BarrierKill::kBetweenBarriers,
                                                              BarrierKill::kAtABarrier,
                                                              BarrierKill::kLate)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + BarrierKillName(std::get<1>(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(Combinations, HierarchicalModeTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "verbs"),
                                            ::testing::Range(0, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  kModes[std::get<1>(info.param)].name;
                         });

}  // namespace
}  // namespace shardps
