// The parameter server as real processes: shardps_coordinator, N shardps_server and W
// ps_test_worker processes started with posix_spawn, talking over tcp or shm (verbs inside the
// SoftRoCE guest). ps_cluster_test.cc and coordinator_test.cc check the same properties with
// threads in one process; this suite checks that they survive real process boundaries: separate
// address spaces, command-line configuration, exit codes and SIGKILL.
//
// Every wait is bounded, and every child is killed (SIGKILL) and reaped in TearDown, whatever
// the test's outcome. On failure the children's logs are printed and their directory is kept.
//
// This file: training over real processes (BSP, SSP, a killed worker) and the coordinator
// against hostile input. The fault-tolerance tests (server kills and failover, checkpoints,
// coordinator restart, injected errors, control messages dropped) are in
// process_fault_test.cc, linked into the same binary; ProcessClusterTest is instantiated here.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "proto/framing.h"
#include "proto/shard_plan.h"
#include "tests/integration/child_process.h"
#include "tests/integration/process_test_base.h"
#include "transport/transport.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

// BSP with W workers, each on its own minibatch, averages their gradients on the servers: the
// weights must equal one process that trains on the union of the minibatches.
TEST_P(ProcessClusterTest, BspMatchesStandaloneWithTheSameTotalBatch) {
  ClusterSpec spec = Spec();
  spec.workers = 4;
  spec.servers = 2;
  const int kSteps = 20;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    auto args = WorkerArgs(spec, r);
    workers.push_back(SpawnWorker(args, "worker" + std::to_string(r) + ".log",
                                  {"--steps=" + std::to_string(kSteps)}));
  }
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  auto ref = StandaloneResult(standalone, ProcessBound());
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  const std::vector<float>& w_ref = ref->tensors["W"];
  const std::vector<float>& b_ref = ref->tensors["b"];
  ASSERT_EQ(w_ref.size(), 64u * 8u);
  ASSERT_EQ(b_ref.size(), 8u);

  // Tolerance. Both runs compute each worker's minibatch gradient with the same code from the
  // same weights; they differ only in the order the W gradients are summed (servers: arrival
  // order; standalone: rank order). Two orders of a W-term float sum differ by at most
  // 2 (W-1) u sum_r |g_r| <= 2 (W-1) u W G (u = 2^-24, G = max |g|), and the update multiplies
  // the sum by lr / W: at most 2 (W-1) u lr G per step. A difference in the weights comes back
  // through later gradients multiplied by (I - lr H_t), which does not grow it while
  // lr * lambda_max(H_t) < 2 (here lr = 0.1, lambda_max ~ 2), so after T steps the difference is
  // at most T * 2 (W-1) u lr G. We allow 4x that (the contraction holds in the 2-norm, not
  // element by element) plus 4 ulp of the weight itself; G is measured by the standalone run.
  // With G ~ 5 that is ~1.5e-5 absolute. A wrong result (a lost or doubled gradient, a step
  // averaged over the wrong number of workers) moves the weights by ~1e-2 and more.
  const double u = std::ldexp(1.0, -24);
  const double g_max = std::strtod(ref->Get("max_abs_grad").c_str(), nullptr);
  ASSERT_GT(g_max, 0.0);
  const double abs_tol = 4.0 * kSteps * 2.0 * (spec.workers - 1) * u * spec.lr * g_max;
  auto tol = [&](float ref_value) { return abs_tol + 4.0 * u * std::fabs(ref_value); };

  // Training moved the weights far beyond the tolerance, so the comparison means something.
  double moved = 0;
  for (size_t i = 0; i < w_ref.size(); ++i) {
    const float w0 = 0.01f * static_cast<float>(static_cast<int>(i % 7) - 3);
    moved = std::max(moved, std::fabs(static_cast<double>(w_ref[i]) - w0));
  }
  EXPECT_GT(moved, 100 * abs_tol);

  double max_diff = 0;
  std::vector<float> first_w;
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("rank"), r);
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Get("consistency"), "bsp");
    EXPECT_EQ(res->Get("transport"), GetParam());
    const std::vector<float>& w = res->tensors["W"];
    const std::vector<float>& b = res->tensors["b"];
    ASSERT_EQ(w.size(), w_ref.size());
    ASSERT_EQ(b.size(), b_ref.size());
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(w[i], w_ref[i], tol(w_ref[i])) << "worker " << r << " W[" << i << "]";
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(w[i]) - w_ref[i]));
    }
    for (size_t j = 0; j < b.size(); ++j) {
      ASSERT_NEAR(b[j], b_ref[j], tol(b_ref[j])) << "worker " << r << " b[" << j << "]";
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(b[j]) - b_ref[j]));
    }
    // All workers pulled the same final version: bit-identical among themselves.
    if (r == 0) first_w = w;
    EXPECT_EQ(w, first_w) << "worker " << r << " pulled different final weights than worker 0";
  }
  std::cerr << "[ info ] max |cluster - standalone| = " << max_diff << " (tolerance " << abs_tol
            << " + 4 ulp, max |g| = " << g_max << ")\n";
}

// A steady-state step is one-sided only: no control message, while heartbeats go on.
TEST_P(ProcessClusterTest, SteadyStateStepsSendNoControlMessages) {
  ClusterSpec spec = Spec();
  spec.workers = 2;
  spec.servers = 2;
  const int kSteps = 30;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    // 10 ms per step: the run spans several heartbeat intervals (100 ms).
    workers.push_back(SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log",
                                  {"--steps=" + std::to_string(kSteps), "--step_delay_ms=10"}));
  }
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  // The chunks a step touches, from the same pure plan the coordinator uses.
  auto plan =
      PlanShards({TensorSpec{"W", DType::kFloat32, {64, 8}}, TensorSpec{"b", DType::kFloat32, {8}}},
                 spec.servers, spec.partition_bytes);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t chunks = static_cast<int64_t>(plan->chunks.size());
  ASSERT_GE(chunks, 3) << "W should span both servers";
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("control_messages_steady"), 0) << "worker " << r;
    EXPECT_EQ(res->Int("pushes"), kSteps * chunks) << "worker " << r;
    EXPECT_EQ(res->Int("pulls"), kSteps * chunks) << "worker " << r;
    EXPECT_GT(res->Int("heartbeats"), 0) << "worker " << r << ": the control thread was idle";
  }
}

// SSP(s): a worker at clock c never reads weights that lack an update from clocks <= c-s-1.
// Each worker pushes -1 into its own element (servers sum, lr 1), so w[k] counts worker k's
// applied pushes; every worker checks the bound after each step and reports violations.
TEST_P(ProcessClusterTest, SspBoundHoldsUnderRandomDelays) {
  ClusterSpec spec = CounterSpec();
  spec.consistency = "ssp";
  spec.staleness = 2;
  spec.workers = 3;
  spec.servers = 1;
  const int kSteps = 25;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers;
  for (int r = 0; r < spec.workers; ++r) {
    // Rank 0 is slow (0-30 ms per step), the others fast (0-8 ms): they drift apart.
    workers.push_back(
        SpawnWorker(WorkerArgs(spec, r), "worker" + std::to_string(r) + ".log",
                    {"--model=counter", "--staleness=2", "--steps=" + std::to_string(kSteps),
                     std::string("--max_delay_ms=") + (r == 0 ? "30" : "8")}));
  }
  for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
  int64_t max_lead = 0;
  for (int r = 0; r < spec.workers; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Get("consistency"), "ssp(s=2)");
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Int("violations"), 0) << "worker " << r;
    EXPECT_LE(res->Int("max_lead"), spec.staleness) << "worker " << r;
    max_lead = std::max(max_lead, res->Int("max_lead"));
    // Its own pushes are all in after its last step.
    ASSERT_EQ(res->tensors["W"].size(), 3u);
    EXPECT_GE(res->tensors["W"][r], kSteps - spec.staleness) << "worker " << r;
  }
  // The bound was exercised: some worker ran ahead of another's updates.
  EXPECT_GE(max_lead, 1);
}

// A worker SIGKILLed mid-training leaves the membership (its sockets close at once; a hung one
// would take the heartbeat timeout), and BSP goes on over the survivors.
TEST_P(ProcessClusterTest, KilledWorkerDoesNotStallTheOthers) {
  ClusterSpec spec = Spec();
  spec.workers = 3;
  spec.servers = 2;
  spec.heartbeat_timeout_ms = 1000;
  const int kSteps = 30, kStepDelayMs = 20, kKillAfter = 5;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec,
      {"--steps=" + std::to_string(kSteps), "--step_delay_ms=" + std::to_string(kStepDelayMs)});
  for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
  // Wait (bounded) until the victim is mid-training, then SIGKILL it.
  ChildProcess* victim = workers[2];
  const auto wait_until = Clock::now() + ProcessBound();
  int done = 0;
  while (Clock::now() < wait_until) {
    auto p = ReadFile(Path("progress2"));
    done = p.ok() ? std::atoi(p->c_str()) : 0;
    if (done >= kKillAfter) break;
    ASSERT_TRUE(victim->Running()) << victim->LogTail();
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_GE(done, kKillAfter) << "the victim never got to step " << kKillAfter;
  ASSERT_LT(done, kSteps);
  victim->Kill();
  const auto t0 = Clock::now();
  // Bound: the departure is noticed within the heartbeat timeout (at once, through EOF, for a
  // killed process); the survivors then have at most kSteps steps of kStepDelayMs left; 10 s of
  // slack for a loaded two-core machine (60 s under SoftRoCE emulation).
  const milliseconds bound(spec.heartbeat_timeout_ms + kSteps * kStepDelayMs + Slack().count());
  for (int r = 0; r < 2; ++r) {
    auto rc = workers[r]->Wait(bound - std::chrono::duration_cast<milliseconds>(Clock::now() - t0));
    ASSERT_TRUE(rc.has_value()) << "worker " << r << " did not finish within " << bound.count()
                                << " ms of the kill:\n"
                                << workers[r]->LogTail();
    ASSERT_EQ(*rc, 0) << workers[r]->LogTail();
  }
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  std::vector<float> w0;
  for (int r = 0; r < 2; ++r) {
    auto res = Result(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("steps"), kSteps);
    EXPECT_EQ(res->Int("workers_before_last_step"), 2) << "the dead worker is still a member";
    for (float v : res->tensors["W"]) ASSERT_TRUE(std::isfinite(v));
    if (r == 0) w0 = res->tensors["W"];
    EXPECT_EQ(res->tensors["W"], w0) << "survivors pulled different weights";
  }
  std::cerr << "[ info ] victim killed after step " << done << "; survivors finished "
            << took.count() << " ms later (bound " << bound.count() << " ms)\n";
}

INSTANTIATE_TEST_SUITE_P(Transports, ProcessClusterTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

// The real shardps_coordinator process against a wrong token and hostile bytes. The
// coordinator does not depend on the data-path transport, so this runs once (workers on tcp).
class CoordinatorProcessTest : public ProcessTestBase {
 protected:
  void SetUp() override {
    ProcessTestBase::SetUp();
    spec_.workers = 1;
    spec_.servers = 1;
    ASSERT_NE(StartCoordinator(spec_), "");
  }
  // A valid worker joins and leaves: exit 0 and a result file naming its rank.
  void ExpectAValidWorkerIsAccepted(const std::string& after) {
    ASSERT_TRUE(coordinator_->Running()) << "coordinator died after " << after << ":\n"
                                         << coordinator_->LogTail();
    const std::string tag = "join" + std::to_string(joins_++);
    std::vector<std::string> args = WorkerArgs(spec_, -1);
    args.push_back("--mode=join");
    args.push_back("--out=" + Path(tag + ".out"));  // the later flag wins
    ChildProcess* w = SpawnWorker(args, tag + ".log");
    ASSERT_EQ(ExitCode(w, milliseconds(20000)), 0) << "after " << after << ":\n" << Tail(w);
    auto res = ParseResult(Path(tag + ".out"));
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Get("mode"), "join");
    EXPECT_GE(res->Int("rank"), 0);
  }
  ClusterSpec spec_;
  int joins_ = 0;
};

TEST_F(CoordinatorProcessTest, WrongTokenIsRefusedWithAClearMessage) {
  std::vector<std::string> args = WorkerArgs(spec_, -1, "not-the-token");
  args.push_back("--mode=join");
  ChildProcess* w = SpawnWorker(args, "wrong_token.log");
  ASSERT_NE(w, nullptr);
  const int rc = ExitCode(w, milliseconds(20000));
  EXPECT_NE(rc, 0);
  EXPECT_EQ(rc, 3) << "3: join refused (ps_test_worker's exit codes)";
  const std::string log = w->LogTail(100000);
  EXPECT_NE(log.find("refused"), std::string::npos) << log;
  EXPECT_NE(log.find("wrong cluster token"), std::string::npos) << log;
  ExpectAValidWorkerIsAccepted("a wrong token");
}

// Sends bytes on a fresh connection and expects the coordinator to close it (EOF or reset,
// possibly after an error reply) within a bound, rather than hang or crash.
void ExpectConnectionClosed(const std::string& address, const std::string& bytes,
                            const std::string& what) {
  auto fd = net::ConnectTcp(address, "", milliseconds(3000));
  ASSERT_TRUE(fd.ok()) << what << ": " << fd.status();
  ASSERT_TRUE(net::SendAll(fd->get(), bytes.data(), bytes.size(), milliseconds(3000)).ok()) << what;
  const auto deadline = Clock::now() + seconds(5);
  Status r;
  char b;
  while (r.ok() && Clock::now() < deadline) r = net::RecvAll(fd->get(), &b, 1, milliseconds(5000));
  EXPECT_FALSE(r.ok()) << what << ": the connection stayed open";
  EXPECT_NE(r.code(), StatusCode::kDeadlineExceeded) << what << ": " << r;
}

TEST_F(CoordinatorProcessTest, SurvivesHostileBytesAndStillAcceptsWorkers) {
  // Each attack must be closed as a protocol error, with its reason in the coordinator's log
  // (written before the socket is closed, so it is there once we see EOF).
  auto ExpectLogged = [&](const std::string& reason) {
    const std::string log = coordinator_->LogTail(1 << 20);
    EXPECT_NE(log.find("coordinator: closing"), std::string::npos) << log;
    EXPECT_NE(log.find(reason), std::string::npos)
        << "coordinator did not log '" << reason << "':\n"
        << log;
  };
  ExpectConnectionClosed(coordinator_address_, "GET / HTTP/1.1\r\n\r\n", "bad magic");
  ExpectLogged("bad magic");
  ExpectAValidWorkerIsAccepted("a bad magic");

  ExpectConnectionClosed(coordinator_address_,
                         std::string(control::kMagic) + std::string("\xff\xff\xff\x7f", 4),
                         "a 2 GiB length prefix");
  ExpectLogged("control frame of 2147483647");
  ExpectAValidWorkerIsAccepted("a 2 GiB length prefix");

  ExpectConnectionClosed(
      coordinator_address_,
      std::string(control::kMagic) + std::string("\x05\x00\x00\x00\xff\xff\xff\xff\xff", 9),
      "a garbage protobuf");
  ExpectLogged("does not parse as an Envelope");
  ExpectAValidWorkerIsAccepted("a garbage protobuf");

  control::Envelope hb;
  hb.mutable_heartbeat()->set_member_id(1);
  auto frame = control::EncodeFrame(hb);
  ASSERT_TRUE(frame.ok()) << frame.status();
  ExpectConnectionClosed(coordinator_address_, std::string(control::kMagic) + *frame,
                         "a heartbeat before join");
  ExpectLogged("expected join, got heartbeat");
  ExpectAValidWorkerIsAccepted("a heartbeat before join");
}

}  // namespace
}  // namespace shardps
