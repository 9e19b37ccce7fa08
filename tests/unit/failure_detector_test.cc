// The phi-accrual detector (common/failure_detector.h) and the fault-tolerance timeout chain
// (proto/fault_timeouts.h): a jittery member is suspected later than a regular one, a pause of
// the observer is not the member's silence, and a contradictory timeout set is refused.
#include <chrono>
#include <random>

#include <gtest/gtest.h>

#include "common/failure_detector.h"
#include "proto/fault_timeouts.h"

namespace shardps {
namespace {

using Clock = PhiAccrualDetector::Clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

PhiAccrualDetector::Options Opts() {
  PhiAccrualDetector::Options o;
  o.expected_interval = milliseconds(500);
  o.min_stddev = milliseconds(50);
  return o;
}

// Feeds n heartbeats with intervals mean +- jitter (uniform); returns the last arrival.
Clock::time_point Feed(PhiAccrualDetector* d, Clock::time_point t, int n, milliseconds mean,
                       milliseconds jitter, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-static_cast<int>(jitter.count()),
                                       static_cast<int>(jitter.count()));
  for (int i = 0; i < n; ++i) {
    t += mean + milliseconds(u(rng));
    d->Heartbeat(t);
  }
  return t;
}

TEST(PhiAccrualDetectorTest, PhiGrowsWithSilenceAndSilenceForInvertsIt) {
  PhiAccrualDetector d(Opts());
  const Clock::time_point t = Feed(&d, Clock::time_point{}, 50, milliseconds(500),
                                   milliseconds(20), 1);
  EXPECT_EQ(d.samples(), 49u);
  EXPECT_NEAR(d.mean().count(), 500000, 10000);
  double prev = -1;
  for (int ms = 0; ms <= 3000; ms += 100) {
    const double phi = d.Phi(t + milliseconds(ms));
    EXPECT_GE(phi, prev) << ms;
    prev = phi;
  }
  EXPECT_LT(d.Phi(t + milliseconds(500)), 1.0);
  EXPECT_GT(d.Phi(t + milliseconds(1500)), 8.0);
  for (double phi : {1.0, 3.0, 8.0, 12.0}) {
    const microseconds at = d.SilenceFor(phi);
    EXPECT_NEAR(d.Phi(t + at), phi, 0.05) << phi;
  }
}

TEST(PhiAccrualDetectorTest, AJitteryMemberIsSuspectedLaterThanARegularOne) {
  PhiAccrualDetector regular(Opts()), jittery(Opts());
  Feed(&regular, Clock::time_point{}, 100, milliseconds(500), milliseconds(10), 2);
  // A busy host: heartbeats due every 500 ms arrive anywhere from 0 to 2.5 s apart.
  Feed(&jittery, Clock::time_point{}, 100, milliseconds(1250), milliseconds(1250), 3);
  const microseconds r = regular.SilenceFor(8);
  const microseconds j = jittery.SilenceFor(8);
  EXPECT_LT(r, milliseconds(1000));
  EXPECT_GT(j, milliseconds(4000)) << "sd " << jittery.stddev().count();
  EXPECT_GT(j, 4 * r);
}

TEST(PhiAccrualDetectorTest, TheMembersOwnIntervalsAreLearntNotTheObserversDelays) {
  PhiAccrualDetector d(Opts());
  Clock::time_point t{};
  d.Heartbeat(t);
  // The observer read these late and in bursts (its own pauses), but the member sent them
  // every 500 ms: the detector learns 500 ms.
  for (int i = 0; i < 20; ++i) {
    t += milliseconds(i % 4 == 0 ? 1900 : 10);
    d.Heartbeat(t, milliseconds(500));
  }
  EXPECT_NEAR(d.mean().count(), 500000, 1);
  EXPECT_EQ(d.stddev(), milliseconds(50));  // the floor: perfectly regular
}

TEST(PhiAccrualDetectorTest, AnObserverPauseIsNotTheMembersSilence) {
  PhiAccrualDetector d(Opts());
  const Clock::time_point t =
      Feed(&d, Clock::time_point{}, 30, milliseconds(500), milliseconds(20), 4);
  const double before = d.Phi(t + milliseconds(3000));
  EXPECT_GT(before, 8.0);
  d.Shift(milliseconds(2800), t + milliseconds(3000));  // the observer slept 2.8 s of those 3 s
  EXPECT_LT(d.Phi(t + milliseconds(3000)), 1.0);
}

// A heartbeat taken after the observer's pause began (read once it resumed, before the pause
// was measured) keeps its own time: the shift stops at the moment the pause is measured, so a
// member that dies right after is not given the pause as extra credit.
TEST(PhiAccrualDetectorTest, AShiftNeverMovesTheLastHeartbeatPastNow) {
  PhiAccrualDetector d(Opts());
  const Clock::time_point t =
      Feed(&d, Clock::time_point{}, 30, milliseconds(500), milliseconds(20), 4);
  d.Shift(milliseconds(5000), t + milliseconds(100));
  EXPECT_EQ(d.last(), t + milliseconds(100));
  d.Shift(milliseconds(5000), t);  // `now` before the last heartbeat: it stays
  EXPECT_EQ(d.last(), t + milliseconds(100));
}

TEST(PhiAccrualDetectorTest, BeforeAnySampleThePriorApplies) {
  PhiAccrualDetector d(Opts());
  EXPECT_EQ(d.Phi(Clock::time_point{} + milliseconds(10000)), 0.0) << "no heartbeat yet";
  d.Heartbeat(Clock::time_point{});
  // Prior: mean 500 ms, sd 125 ms.
  EXPECT_NEAR(d.SilenceFor(8).count() / 1000.0, 500 + 5.6 * 125, 20);
}

TEST(FaultTimeoutsTest, DefaultsAreDerivedFromTheHeartbeat) {
  control::ClusterConfig c;
  c.set_heartbeat_interval_ms(500);
  c.set_heartbeat_timeout_ms(3000);
  auto t = control::FaultTimeouts::Derive(&c);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->lease, milliseconds(9000));
  EXPECT_EQ(t->rejoin_grace, milliseconds(9000));
  EXPECT_EQ(t->failover, milliseconds(20000));
  EXPECT_EQ(t->backup_eviction, milliseconds(9000 + 9000 + 3000));
  // The members get the whole table.
  EXPECT_EQ(c.lease_ms(), 9000u);
  EXPECT_EQ(c.rejoin_grace_ms(), 9000u);
  EXPECT_EQ(c.failover_timeout_ms(), 20000u);
  const control::FaultTimeouts m = control::FaultTimeouts::Of(c);
  EXPECT_EQ(m.lease, t->lease);
  EXPECT_EQ(m.backup_eviction, t->backup_eviction);
  // A long heartbeat timeout stretches the worker's failover bound with it.
  control::ClusterConfig slow;
  slow.set_heartbeat_timeout_ms(6000);
  slow.set_heartbeat_interval_ms(500);
  auto ts = control::FaultTimeouts::Derive(&slow);
  ASSERT_TRUE(ts.ok()) << ts.status();
  EXPECT_EQ(ts->failover, milliseconds(18000 + 2000 + 6000));
}

TEST(FaultTimeoutsTest, AContradictorySetIsRefusedNamingTheRule) {
  struct Case {
    uint32_t interval, timeout, lease, grace, failover;
    const char* rule;
  } cases[] = {
      {500, 1000, 0, 0, 0, "heartbeat_timeout_ms must be >= 3 x"},
      {500, 3000, 4000, 0, 0, "lease_ms must be >= 2 x"},
      {500, 3000, 9000, 5000, 0, "rejoin_grace_ms must be >= lease_ms"},
      {500, 3000, 9000, 9000, 10000, "failover_timeout_ms must be >="},
  };
  for (const Case& k : cases) {
    control::ClusterConfig c;
    c.set_heartbeat_interval_ms(k.interval);
    c.set_heartbeat_timeout_ms(k.timeout);
    c.set_lease_ms(k.lease);
    c.set_rejoin_grace_ms(k.grace);
    c.set_failover_timeout_ms(k.failover);
    auto t = control::FaultTimeouts::Derive(&c);
    ASSERT_FALSE(t.ok()) << k.rule;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(k.rule), std::string::npos) << t.status();
  }
}

}  // namespace
}  // namespace shardps
