// The property test's checker must be able to fail: each guarantee it checks is fed a pull that
// breaks it, and one that keeps it.
#include "tests/integration/signature_check.h"

#include <gtest/gtest.h>

namespace shardps::testing_util {
namespace {

constexpr int kWorkers = 3;
constexpr int kSteps = 6;

// The weights holding exactly the updates (w, t) for which has(w, t) is true.
template <typename F>
std::vector<float> Holding(F has) {
  std::vector<float> v(kWorkers * kSteps, 0.0f);
  for (int w = 0; w < kWorkers; ++w) {
    for (int t = 0; t < kSteps; ++t) v[w * kSteps + t] = has(w, t) ? 1.0f : 0.0f;
  }
  return v;
}

TEST(SignatureCheckTest, GradientIsOneSignature) {
  std::vector<float> g(kWorkers * kSteps, 7.0f);
  SignatureCheck::Gradient(2, 4, kSteps, &g);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], i == 2 * kSteps + 4 ? -1.0f : 0.0f);
}

TEST(SignatureCheckTest, BspWantsExactlyTheFinishedClocks) {
  SignatureCheck k(Mode::kBsp, 0, kWorkers, kSteps);
  EXPECT_EQ(k.Check(3, Holding([](int, int t) { return t < 3; })), 0);
  EXPECT_GT(k.Check(4, Holding([](int w, int t) { return t < 4 && !(w == 1 && t == 3); })), 0);
  SignatureCheck ahead(Mode::kBsp, 0, kWorkers, kSteps);
  EXPECT_GT(ahead.Check(2, Holding([](int w, int t) { return t < 2 || (w == 0 && t == 2); })), 0);
  EXPECT_EQ(ahead.violations(), 1u);
}

TEST(SignatureCheckTest, SspBoundAndAtBoundCount) {
  SignatureCheck k(Mode::kSsp, 2, kWorkers, kSteps);
  // Clock 5, s = 2: clocks <= 2 must be in; worker 1 lags at clock 3: exactly at the bound.
  EXPECT_EQ(k.Check(5, Holding([](int w, int t) { return w == 1 ? t < 3 : t < 5; })), 0);
  EXPECT_EQ(k.at_bound(), 1u);
  EXPECT_EQ(k.max_staleness(), 2);
  SignatureCheck bad(Mode::kSsp, 2, kWorkers, kSteps);
  EXPECT_EQ(bad.Check(5, Holding([](int w, int t) { return w == 1 ? t < 2 : t < 5; })), 1);
  EXPECT_NE(bad.last_error().find("worker 1, clock 2"), std::string::npos) << bad.last_error();
}

TEST(SignatureCheckTest, SspRejectsAnUpdateNoWorkerCanHaveReached) {
  for (Mode m : {Mode::kSsp, Mode::kVsgd}) {
    // Clock 2, s = 2: another worker may be at clock 4 (its pull at 4 needed this worker's
    // updates of clocks <= 1), so updates up to clock 4 may be in, and none of clock 5.
    SignatureCheck k(m, 2, kWorkers, kSteps);
    EXPECT_EQ(k.Check(2, Holding([](int w, int t) { return t < 2 || (w == 1 && t <= 4); })), 0);
    EXPECT_EQ(k.Check(2, Holding([](int w, int t) { return t < 2 || (w == 1 && t <= 5); })), 1);
    EXPECT_NE(k.last_error().find("worker 1, clock 5"), std::string::npos) << k.last_error();
  }
  SignatureCheck a(Mode::kAsp, 0, kWorkers, kSteps);  // ASP: no such limit
  EXPECT_EQ(a.Check(1, Holding([](int w, int t) { return w == 1 && t <= 5; })), 0);
}

TEST(SignatureCheckTest, DoubleAppliedAndVanishedUpdatesAreCaughtInEveryMode) {
  for (Mode m : {Mode::kBsp, Mode::kSsp, Mode::kAsp, Mode::kVsgd}) {
    SignatureCheck k(m, 1, kWorkers, kSteps);
    auto v = Holding([](int, int t) { return t < 2; });
    EXPECT_EQ(k.Check(2, v), 0);
    v[0] = 2.0f;  // (0, 0) applied twice
    EXPECT_GE(k.Check(2, v), 1);
    v[0] = 1.0f;
    v[1] = 0.0f;  // (0, 1) was in the last pull and is gone
    EXPECT_GE(k.Check(2, v), 1);
  }
}

TEST(SignatureCheckTest, VsgdAcceptsScaledUpdatesAspHasNoBound) {
  SignatureCheck v(Mode::kVsgd, 2, kWorkers, kSteps);
  auto w = Holding([](int, int t) { return t < 3; });
  w[1] = 0.625f;  // a scaled (stale) update
  EXPECT_EQ(v.Check(3, w), 0);
  SignatureCheck a(Mode::kAsp, 0, kWorkers, kSteps);
  EXPECT_EQ(a.Check(5, Holding([](int, int) { return false; })), 0);
  EXPECT_EQ(a.max_staleness(), 5);
}

}  // namespace
}  // namespace shardps::testing_util
