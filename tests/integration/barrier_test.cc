// Client::Barrier end to end: real clients of an in-process cluster (coordinator and servers),
// over tcp (the barrier is control plane only; the transport does not matter). The property:
// no worker leaves barrier g before every live worker has arrived at it, over generations,
// whatever the order of arrival; a worker that departs is not waited for; a call after a
// timeout waits for the same barrier again.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shardps/client.h"
#include "tests/integration/in_process_cluster.h"

namespace shardps {
namespace {

using test::Cluster;
using test::ClusterSpec;

ClusterSpec Spec(int workers) {
  ClusterSpec spec;
  spec.transport = "tcp";
  spec.mode = control::ASP;
  spec.workers = workers;
  spec.servers = 1;
  return spec;
}

// A started client of `cluster` with one small tensor.
struct Worker {
  std::unique_ptr<Client> client;
  std::vector<float> w = std::vector<float>(16, 0.0f), g = std::vector<float>(16, 0.0f);
  Worker(const Cluster& cluster, int rank) {
    auto c = Client::Connect(cluster.WorkerOptions(rank));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return;
    client = std::move(c).value();
    EXPECT_TRUE(client->RegisterTensor("w", w.data(), g.data(), {16}).ok());
    EXPECT_TRUE(client->Start().ok());
  }
};

// Three workers, five barriers, each worker late at a different one: after each release every
// worker has arrived (counted before the call), and none is released early.
TEST(BarrierTest, NoWorkerLeavesABarrierBeforeEveryWorkerArrived) {
  constexpr int kWorkers = 3, kRounds = 5;
  Cluster cluster(Spec(kWorkers));
  std::vector<std::atomic<int>> arrived(kRounds);
  std::vector<std::atomic<int>> seen_at_release(kRounds * kWorkers);
  std::vector<std::thread> ts;
  for (int r = 0; r < kWorkers; ++r) {
    ts.emplace_back([&, r] {
      Worker me(cluster, r);
      ASSERT_NE(me.client, nullptr);
      const int rank = static_cast<int>(me.client->rank());
      for (int g = 0; g < kRounds; ++g) {
        // The late one: rank g % kWorkers sleeps before arriving.
        if (rank == g % kWorkers) std::this_thread::sleep_for(std::chrono::milliseconds(150));
        arrived[g].fetch_add(1);
        const Status st = me.client->Barrier();
        ASSERT_TRUE(st.ok()) << st;
        seen_at_release[g * kWorkers + rank] = arrived[g].load();
      }
      EXPECT_TRUE(me.client->Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  for (int g = 0; g < kRounds; ++g) {
    for (int r = 0; r < kWorkers; ++r) {
      EXPECT_EQ(seen_at_release[g * kWorkers + r].load(), kWorkers)
          << "worker " << r << " left barrier " << g + 1 << " before every worker arrived";
    }
  }
}

// A worker that leaves instead of arriving is not waited for: the others are released once
// the coordinator saw it depart, not before.
TEST(BarrierTest, AWorkerThatDepartsIsNotWaitedFor) {
  Cluster cluster(Spec(3));
  std::atomic<bool> departed{false};
  std::vector<int> released_after_departure(3, -1);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] {
      Worker me(cluster, r);
      ASSERT_NE(me.client, nullptr);
      const int rank = static_cast<int>(me.client->rank());
      if (rank == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        departed = true;
        EXPECT_TRUE(me.client->Close().ok());
        return;
      }
      const Status st = me.client->Barrier(std::chrono::milliseconds(10000));
      ASSERT_TRUE(st.ok()) << st;
      released_after_departure[rank] = departed.load() ? 1 : 0;
      EXPECT_TRUE(me.client->Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(released_after_departure[0], 1);
  EXPECT_EQ(released_after_departure[1], 1);
}

// A timeout returns DEADLINE_EXCEEDED and this worker stays arrived: calling Barrier again
// waits for the same barrier (a retry), which passes once the late worker arrives there, and
// the two are in step after it (a retry that moved on to the next barrier would let worker 1
// pass its next one alone).
TEST(BarrierTest, ATimeoutIsRetriedAtTheSameBarrier) {
  Cluster cluster(Spec(2));
  std::atomic<int> phase{0};
  Status first_of_rank0 = Status::OK(), alone = Status::OK();
  std::atomic<bool> retry_released_early{false};
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      Worker me(cluster, r);
      ASSERT_NE(me.client, nullptr);
      const int rank = static_cast<int>(me.client->rank());
      if (rank == 0) {
        first_of_rank0 = me.client->Barrier(std::chrono::milliseconds(300));
        phase = 1;
        const Status retry = me.client->Barrier(std::chrono::milliseconds(10000));
        EXPECT_TRUE(retry.ok()) << retry;
        retry_released_early = phase.load() < 2;
        phase = 3;
      } else {
        while (phase.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        phase = 2;
        const Status st = me.client->Barrier(std::chrono::milliseconds(10000));
        EXPECT_TRUE(st.ok()) << st;
        while (phase.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        alone = me.client->Barrier(std::chrono::milliseconds(300));  // worker 0 never comes
        phase = 4;
      }
      while (phase.load() < 4) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_TRUE(me.client->Close().ok());
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(first_of_rank0.code(), StatusCode::kDeadlineExceeded) << first_of_rank0;
  EXPECT_FALSE(retry_released_early.load()) << "the retry passed before worker 1 arrived";
  EXPECT_EQ(alone.code(), StatusCode::kDeadlineExceeded)
      << "worker 1 passed barrier 2 alone: worker 0's retry had moved on to it";
}

}  // namespace
}  // namespace shardps
