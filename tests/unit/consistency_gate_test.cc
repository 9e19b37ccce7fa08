#include "server/consistency_gate.h"

#include <set>

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

using D = ConsistencyGate::Decision;

// Two workers (ranks 0 and 1) on one slot, both members.
class GateTest : public ::testing::TestWithParam<ConsistencyMode> {
 protected:
  GateTest() : workers_(1) {
    bool fresh = false;
    workers_.Hello(0, 10, 1, &fresh);
    workers_.Hello(1, 11, 2, &fresh);
    workers_.SetMembers({0, 1});
  }
  Contributor Push(uint32_t worker, uint64_t seq, int64_t clock) {
    return Contributor{worker, static_cast<uint32_t>(seq & 1), seq, 10 + worker, clock};
  }
  // What the server does with an applied push: records its sequence number and clock.
  void Applied(const Contributor& c) { workers_.Consume(c.worker, 0, c.seq, c.clock); }
  WorkerTable workers_;
};

TEST_P(GateTest, UninitialisedChunksRejectPushes) {
  ConsistencyGate g(GetParam(), 1);
  EXPECT_EQ(g.OnPush(0, Push(0, 1, 0), false, false, workers_), D::kUninitialised);
}

TEST_P(GateTest, AVersionInFlightDefersEveryPushAndHandsThemBackInOrder) {
  ConsistencyGate g(GetParam(), 1);
  g.BeginVersion(0, {Push(0, 1, 0)});
  EXPECT_TRUE(g.in_flight(0));
  EXPECT_EQ(g.OnPush(0, Push(1, 1, 1), false, true, workers_), D::kDefer);
  EXPECT_EQ(g.OnPush(0, Push(0, 2, 0), false, true, workers_), D::kDefer);
  EXPECT_FALSE(g.NextDeferred(0).has_value());  // not while in flight
  const std::vector<Contributor> acks = g.EndVersion(0);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].seq, 1u);
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  // BSP: the lowest clock first; the others: arrival order.
  EXPECT_EQ(d->worker, GetParam() == ConsistencyMode::kBsp ? 0u : 1u);
  EXPECT_EQ(g.deferred(0), 1u);
}

INSTANTIATE_TEST_SUITE_P(AllModes, GateTest,
                         ::testing::Values(ConsistencyMode::kBsp, ConsistencyMode::kSsp,
                                           ConsistencyMode::kAsp, ConsistencyMode::kVsgd),
                         [](const auto& info) {
                           switch (info.param) {
                             case ConsistencyMode::kBsp:
                               return std::string("bsp");
                             case ConsistencyMode::kSsp:
                               return std::string("ssp");
                             case ConsistencyMode::kAsp:
                               return std::string("asp");
                             default:
                               return std::string("vsgd");
                           }
                         });

class AsyncGateTest : public GateTest {};

TEST_P(AsyncGateTest, PushesApplyInArrivalOrderBehindDeferredOnes) {
  ConsistencyGate g(GetParam(), 1);
  EXPECT_EQ(g.OnPush(0, Push(0, 1, 0), false, true, workers_), D::kApply);
  g.BeginVersion(0, {Push(0, 1, 0)});
  EXPECT_EQ(g.OnPush(0, Push(1, 1, 0), false, true, workers_), D::kDefer);
  g.EndVersion(0);
  // A new arrival may not overtake the deferred push...
  EXPECT_EQ(g.OnPush(0, Push(0, 2, 1), false, true, workers_), D::kDefer);
  // ...which, handed back, applies (from_queue).
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->worker, 1u);
  EXPECT_EQ(g.OnPush(0, Push(1, 1, 0), true, true, workers_), D::kApply);
}

TEST_P(AsyncGateTest, MinClockCountsOnlyPushesInPublishedVersions) {
  ConsistencyGate g(GetParam(), 1);
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 0u);  // nothing applied yet
  // Both workers push clock 0; worker 0's version is published, worker 1's is in flight.
  Applied(Push(0, 1, 0));
  Applied(Push(1, 1, 0));
  g.BeginVersion(0, {Push(1, 1, 0)});
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 0u) << "worker 1's clock 0 is not published";
  // Worker 1 finishes clock 0 and 1 meanwhile: still not in the published weights.
  workers_.AdvanceClock(1, 2);
  workers_.AdvanceClock(0, 1);
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 0u);
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 0, true, workers_).has_value());
  // Published: the min clock is recomputed at publication (worker 0 finished clock 0).
  g.EndVersion(0);
  EXPECT_EQ(g.PublishMinClockPlus1(0, 0, true, workers_), 1u);
  // The very first version (the init) keeps the min clock it was computed with.
  EXPECT_EQ(g.PublishMinClockPlus1(0, 0, false, workers_), 0u);
  // A deferred push of clock 1 holds worker 1 at clock 0 whatever it announced.
  workers_.AdvanceClock(0, 3);
  g.BeginVersion(0, {});
  EXPECT_EQ(g.OnPush(0, Push(1, 2, 1), false, true, workers_), D::kDefer);
  g.EndVersion(0);
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 1u);
  EXPECT_EQ(g.RaisedMinClockPlus1(0, 0, true, workers_), std::optional<uint64_t>(1));
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 1, true, workers_).has_value());
  // Its departure lets the others go on (worker 0 finished clock 2).
  workers_.SetMembers({0});
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 3u);
}

TEST_P(AsyncGateTest, DeparturesStopHoldingTheMinClockBack) {
  ConsistencyGate g(GetParam(), 1);
  Applied(Push(0, 1, 4));
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 0u);  // worker 1 applied nothing
  workers_.SetMembers({0});                        // worker 1 left
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 5u);
  EXPECT_FALSE(g.TakeBspClock(0, workers_).has_value());  // never for the async modes
}

// A state transfer (a set of weights, state or rows) is a version whose contributor has no
// clock (-1). In flight, it once made the min clock -2 + 1 = -1, published as 2^64 - 1: every
// SSP pull accepted the chunk whatever its clock, and a worker's row cache kept the rows read
// then for ever. A set holds no clock back, and a min clock never wraps.
TEST_P(AsyncGateTest, ASetInFlightHoldsNoClockBackAndNeverWrapsTheMinClock) {
  ConsistencyGate g(GetParam(), 1);
  Applied(Push(0, 1, 2));
  Applied(Push(1, 1, 1));
  workers_.AdvanceClock(0, 3);
  workers_.AdvanceClock(1, 2);
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 2u);
  g.BeginVersion(0, {Contributor{1, 0, 2, 11, -1}});  // worker 1's set waits for its record
  EXPECT_EQ(g.SspMinClockPlus1(0, workers_), 2u);
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 2, true, workers_).has_value());
  g.EndVersion(0);
  // Nothing applied yet anywhere, a set in flight: "none", not a wrapped clock.
  ConsistencyGate fresh(GetParam(), 1);
  WorkerTable none(1);
  bool f = false;
  none.Hello(0, 10, 1, &f);
  none.SetMembers({0});
  fresh.BeginVersion(0, {Contributor{0, 1, 1, 10, -1}});
  EXPECT_EQ(fresh.SspMinClockPlus1(0, none), 0u);
  EXPECT_FALSE(fresh.RaisedMinClockPlus1(0, 0, true, none).has_value());
}

INSTANTIATE_TEST_SUITE_P(Async, AsyncGateTest,
                         ::testing::Values(ConsistencyMode::kSsp, ConsistencyMode::kAsp,
                                           ConsistencyMode::kVsgd));

TEST(BspGateTest, AClockCompletesWhenEveryLiveWorkerContributedSummedInRankOrder) {
  WorkerTable workers(1);
  bool fresh = false;
  workers.Hello(0, 10, 1, &fresh);
  workers.Hello(1, 11, 2, &fresh);
  workers.SetMembers({0, 1});
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  EXPECT_TRUE(g.bsp());
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 0}, false, true, workers), D::kAggregate);
  EXPECT_FALSE(g.TakeBspClock(0, workers).has_value());  // worker 0 missing
  // A push of the next clock waits for this one.
  EXPECT_EQ(g.OnPush(0, Contributor{1, 0, 2, 11, 1}, false, true, workers), D::kDefer);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 10, 0}, false, true, workers), D::kAggregate);
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->clock, 0);
  ASSERT_EQ(a->contributors.size(), 2u);
  EXPECT_EQ(a->contributors[0].worker, 0u);  // rank order, not arrival order
  EXPECT_EQ(a->contributors[1].worker, 1u);
  EXPECT_EQ(g.applied_through(0), 0);
  // The version's min clock is the clock applied.
  EXPECT_EQ(g.PublishMinClockPlus1(0, 1, true, workers), 1u);
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 0, true, workers).has_value());
  // A late push of clock 0 is dropped.
  EXPECT_EQ(g.OnPush(0, Contributor{0, 0, 2, 10, 0}, false, true, workers), D::kDropStale);
}

TEST(BspGateTest, AWorkerPastTheClockIsNotWaitedForUnlessItsPushIsQueued) {
  WorkerTable workers(1);
  bool fresh = false;
  workers.Hello(0, 10, 1, &fresh);
  workers.Hello(1, 11, 2, &fresh);
  workers.SetMembers({0, 1});
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 10, 0}, false, true, workers), D::kAggregate);
  // Worker 1's push of clock 0 waits behind a version in flight; it announced clock 1.
  g.BeginVersion(0, {});
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 0}, false, true, workers), D::kDefer);
  workers.AdvanceClock(1, 1);
  EXPECT_FALSE(g.TakeBspClock(0, workers).has_value()) << "in flight";
  g.EndVersion(0);
  EXPECT_FALSE(g.TakeBspClock(0, workers).has_value()) << "worker 1's clock 0 is queued";
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, d->clock}, true, true, workers), D::kAggregate);
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->contributors.size(), 2u);
  // Clock 1: worker 0 pushes; worker 1 announced clock 2 without a push of clock 1 queued.
  workers.AdvanceClock(1, 2);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 0, 2, 10, 1}, false, true, workers), D::kAggregate);
  a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->contributors.size(), 1u);
  // A departure completes a clock too.
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 3, 10, 2}, false, true, workers), D::kAggregate);
  workers.AdvanceClock(1, 2);
  EXPECT_FALSE(g.TakeBspClock(0, workers).has_value());
  workers.SetMembers({0});
  EXPECT_TRUE(g.TakeBspClock(0, workers).has_value());
  // A backup follows records: applied_through only rises.
  g.NoteAppliedThrough(0, 1);
  EXPECT_EQ(g.applied_through(0), 2);
}

// A restarted worker starts at the cluster's clock, the furthest chunk's: here 7, while this
// chunk has applied through 5 and worker 1 has still to push its clock 6. Its push of clock 7
// must wait: taken as the pending clock, it made worker 1's push of clock 6 "stale" (dropped,
// although clock 6 was never applied here) and the cluster waited for ever on clock 7 (a
// deadlock of AggregatorBarrierKillTest under load). Fails on the gate without the check.
TEST(BspGateTest, APushOfALaterClockWaitsWhileAnotherWorkerOwesAnEarlierOne) {
  WorkerTable workers(1);
  bool fresh = false;
  workers.Hello(0, 10, 1, &fresh);
  workers.Hello(1, 11, 2, &fresh);
  workers.SetMembers({0, 1});
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  uint64_t seq0 = 0, seq1 = 0;
  for (int64_t c = 0; c <= 5; ++c) {  // clocks 0..5 applied with both workers
    ++seq0;
    ++seq1;
    ASSERT_EQ(g.OnPush(0, Contributor{0, uint32_t(seq0 & 1), seq0, 10, c}, false, true, workers),
              D::kAggregate);
    ASSERT_EQ(g.OnPush(0, Contributor{1, uint32_t(seq1 & 1), seq1, 11, c}, false, true, workers),
              D::kAggregate);
    ASSERT_TRUE(g.TakeBspClock(0, workers).has_value());
    workers.AdvanceClock(0, static_cast<uint32_t>(c + 1));
    workers.AdvanceClock(1, static_cast<uint32_t>(c + 1));
  }
  ASSERT_EQ(g.applied_through(0), 5);
  // Worker 0 is restarted (a new incarnation: fresh state) and announces clock 7.
  workers.Hello(0, 20, 3, &fresh);
  ASSERT_TRUE(fresh);
  workers.AdvanceClock(0, 7);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 20, 7}, false, true, workers), D::kDefer)
      << "worker 1 (at clock 6) still owes clock 6 here";
  // Worker 1's clock 6 completes without worker 0 (past it), and is not dropped.
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 7, 11, 6}, false, true, workers), D::kAggregate);
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->clock, 6);
  ASSERT_EQ(a->contributors.size(), 1u);
  EXPECT_EQ(a->contributors[0].worker, 1u);
  // Then worker 0's clock 7, handed back, is the pending clock; worker 1's joins it.
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->clock, 7);
  workers.AdvanceClock(1, 7);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 20, 7}, true, true, workers), D::kAggregate);
  EXPECT_FALSE(g.TakeBspClock(0, workers).has_value()) << "worker 1's clock 7 is owed";
  EXPECT_EQ(g.OnPush(0, Contributor{1, 0, 8, 11, 7}, false, true, workers), D::kAggregate);
  a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->clock, 7);
  EXPECT_EQ(a->contributors.size(), 2u);
}

// Workers 0..n-1 (incarnation 10 + rank) said hello on one slot's table and are members.
void JoinWorkers(WorkerTable& workers, uint32_t n) {
  bool fresh = false;
  std::set<uint32_t> members;
  for (uint32_t r = 0; r < n; ++r) {
    workers.Hello(r, 10 + r, r + 1, &fresh);
    members.insert(r);
  }
  workers.SetMembers(members);
}

// The wait ends without a push too: the other worker announces a clock past it (it had nothing
// to push here), or departs. ShouldRetryDeferred tells the server to hand the push back.
TEST(BspGateTest, AHeldBackPushGoesInOnceNoEarlierClockIsOwed) {
  WorkerTable workers(1);
  JoinWorkers(workers, 3);
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  // A restored cluster: every worker starts at clock 4 on a chunk that has applied nothing.
  workers.AdvanceClock(0, 4);
  workers.AdvanceClock(1, 4);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 10, 4}, false, true, workers), D::kDefer)
      << "worker 2 has announced no clock yet";
  EXPECT_TRUE(g.ShouldRetryDeferred(0));
  workers.AdvanceClock(2, 4);  // it announces: nobody owes a clock below 4
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 10, 4}, true, true, workers), D::kAggregate);
  EXPECT_FALSE(g.ShouldRetryDeferred(0)) << "a clock is pending";
  // Worker 1 jumps further ahead (to 6) while clock 4 is pending: it waits behind it as before.
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 6}, false, true, workers), D::kDefer);
  EXPECT_EQ(g.OnPush(0, Contributor{2, 1, 1, 12, 4}, false, true, workers), D::kAggregate);
  workers.AdvanceClock(1, 6);  // past clock 4, its clock-6 push queued: 4 completes without it
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->contributors.size(), 2u);
  d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  // Clock 6 > applied_through (4) + 1: workers 0 and 2 are at clock 4, so they owe clock 5.
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 6}, true, true, workers), D::kDefer);
  workers.SetMembers({1});  // both leave: nobody owes clock 5 any more
  EXPECT_TRUE(g.ShouldRetryDeferred(0));
  d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 6}, true, true, workers), D::kAggregate);
  a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->clock, 6);
}

// A push held back while no clock was pending, whose clock another worker's push then made the
// pending one (the server retries the queue on a clock change, but a push of the same clock may
// be taken before that retry runs): the pending clock waits for the held-back push, so the gate
// must ask for the queue to be retried. Before, ShouldRetryDeferred said no once any clock was
// pending; only a publication or a membership change retried the queue, and with every worker
// waiting for this clock neither came: the chunk stalled for ever.
TEST(BspGateTest, AHeldBackPushOfThePendingClockIsHandedBack) {
  WorkerTable workers(1);
  JoinWorkers(workers, 3);
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  g.NoteAppliedThrough(0, 5);  // a restored chunk: clocks 0..5 applied
  for (uint32_t r = 0; r < 3; ++r) workers.AdvanceClock(r, 6);
  // Worker 0 was restarted at the cluster's clock 7; workers 1 and 2 still owe clock 6 here.
  bool fresh = false;
  workers.Hello(0, 20, 4, &fresh);
  workers.AdvanceClock(0, 7);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 20, 7}, false, true, workers), D::kDefer);
  EXPECT_TRUE(g.ShouldRetryDeferred(0)) << "no clock pending: a clock change retries it";
  // Workers 1 and 2 had nothing to push here at clock 6 and move on to 7; worker 1's push of
  // clock 7 comes before the server has retried the queue, and is the pending clock.
  workers.AdvanceClock(1, 7);
  workers.AdvanceClock(2, 7);
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 7}, false, true, workers), D::kAggregate);
  EXPECT_EQ(g.OnPush(0, Contributor{2, 1, 1, 12, 7}, false, true, workers), D::kAggregate);
  EXPECT_FALSE(g.TakeBspClock(0, workers).has_value()) << "worker 0's push of clock 7 is queued";
  ASSERT_TRUE(g.ShouldRetryDeferred(0)) << "clock 7 waits for a queued push of clock 7";
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->clock, 7);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 20, d->clock}, true, true, workers), D::kAggregate);
  EXPECT_FALSE(g.ShouldRetryDeferred(0)) << "nothing queued";
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->clock, 7);
  ASSERT_EQ(a->contributors.size(), 3u);
  EXPECT_EQ(a->contributors[0].worker, 0u);
  // A queued push of a later clock than the pending one is not retried: it would wait again.
  EXPECT_EQ(g.OnPush(0, Contributor{1, 0, 2, 11, 8}, false, true, workers), D::kAggregate);
  EXPECT_EQ(g.OnPush(0, Contributor{2, 0, 2, 12, 9}, false, true, workers), D::kDefer);
  EXPECT_FALSE(g.ShouldRetryDeferred(0)) << "clock 8 pending, only clock 9 queued";
}

// Nobody will push clock 6 here any more: the restarted worker 0 is past it (at 7), and worker 1,
// which owed it, departed. The published min clock rises to 7 without a version (a worker
// pulling at clock 7 would otherwise wait for ever); never while a live worker may still push
// a lower clock, or a clock is pending.
TEST(BspGateTest, AMinClockRisesPastClocksNoLiveWorkerWillPush) {
  WorkerTable workers(1);
  bool fresh = false;
  workers.Hello(0, 10, 1, &fresh);
  workers.Hello(1, 11, 2, &fresh);
  workers.SetMembers({0, 1});
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  for (int64_t c = 0; c <= 5; ++c) {
    ASSERT_EQ(g.OnPush(0, Contributor{0, uint32_t((c + 1) & 1), uint64_t(c + 1), 10, c}, false,
                       true, workers),
              D::kAggregate);
    ASSERT_EQ(g.OnPush(0, Contributor{1, uint32_t((c + 1) & 1), uint64_t(c + 1), 11, c}, false,
                       true, workers),
              D::kAggregate);
    ASSERT_TRUE(g.TakeBspClock(0, workers).has_value());
    workers.AdvanceClock(0, static_cast<uint32_t>(c + 1));
    workers.AdvanceClock(1, static_cast<uint32_t>(c + 1));
  }
  // Both at clock 6 with clock 5 published (min clock + 1 = 6): nothing to raise.
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 6, true, workers).has_value());
  workers.Hello(0, 20, 3, &fresh);  // restarted: announced no clock yet
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 6, true, workers).has_value());
  workers.AdvanceClock(0, 7);
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 6, true, workers).has_value()) << "worker 1 owes 6";
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 20, 7}, false, true, workers), D::kDefer);
  workers.SetMembers({0});  // worker 1 departs without pushing clock 6 here
  EXPECT_EQ(g.RaisedMinClockPlus1(0, 6, true, workers), std::optional<uint64_t>(7));
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 7, true, workers).has_value()) << "already published";
  g.NoteAppliedThrough(0, 6);  // what the server does with the raise
  EXPECT_TRUE(g.ShouldRetryDeferred(0));
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 20, 7}, true, true, workers), D::kAggregate);
  EXPECT_FALSE(g.RaisedMinClockPlus1(0, 7, true, workers).has_value()) << "a clock is pending";
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->clock, 7);
  // A push of clock 6 now is stale: that clock is done.
  EXPECT_EQ(g.OnPush(0, Contributor{0, 0, 2, 20, 6}, false, true, workers), D::kDropStale);
}

// A push queued by a process that has since been replaced holds nothing: the new process of
// that rank is past the clock, and the old process's push is dropped when it is handed back
// (ShardServer::DrainWork). Counted as the rank's queued push, it held the clock (and the
// vacuous raise) until the slot happened to be drained.
TEST(BspGateTest, APushQueuedByAReplacedProcessHoldsNothing) {
  WorkerTable workers(1);
  bool fresh = false;
  workers.Hello(0, 10, 1, &fresh);
  workers.Hello(1, 11, 2, &fresh);
  workers.SetMembers({0, 1});
  ConsistencyGate g(ConsistencyMode::kBsp, 1);
  EXPECT_EQ(g.OnPush(0, Contributor{0, 1, 1, 10, 0}, false, true, workers), D::kAggregate);
  g.BeginVersion(0, {});  // worker 1's push of clock 0 waits behind a version in flight
  EXPECT_EQ(g.OnPush(0, Contributor{1, 1, 1, 11, 0}, false, true, workers), D::kDefer);
  g.EndVersion(0);
  // Worker 1 dies and its rank comes back as a new process, which starts past clock 0.
  workers.Hello(1, 21, 3, &fresh);
  ASSERT_TRUE(fresh);
  workers.AdvanceClock(1, 1);
  std::optional<BspAggregate> a = g.TakeBspClock(0, workers);
  ASSERT_TRUE(a.has_value()) << "clock 0 waited for a dead process's queued push";
  ASSERT_EQ(a->contributors.size(), 1u);
  EXPECT_EQ(a->contributors[0].worker, 0u);
  // The queued push is still there, tagged with its process, for the server to drop.
  std::optional<DeferredPush> d = g.NextDeferred(0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->incarnation, 11u);
}

}  // namespace
}  // namespace shardps::server
