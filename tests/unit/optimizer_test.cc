#include "server/optimizer.h"

#include <cmath>

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

TEST(OptimizerTest, SgdAveragesAndSteps) {
  OptimizerConfig c;
  c.lr = 0.5f;
  ChunkOptimizer o(c, 2);
  const float w[2] = {1.0f, -2.0f}, g[2] = {4.0f, 8.0f};  // sum of 4 workers' gradients
  float out[2];
  o.Apply(w, g, 0.25f, 1.0f, out);
  EXPECT_FLOAT_EQ(out[0], 1.0f - 0.5f * 1.0f);
  EXPECT_FLOAT_EQ(out[1], -2.0f - 0.5f * 2.0f);
  EXPECT_EQ(o.steps(), 1u);
}

// A push's learning rate (a trainer's LR schedule) replaces the configured one exactly: the
// result equals an optimizer configured with that rate, bit for bit, for every kind that uses a
// rate, and lr 0 keeps the configured one.
TEST(OptimizerTest, APushedLearningRateReplacesTheConfiguredOne) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kMomentum, OptimizerKind::kAdam}) {
    OptimizerConfig base;
    base.kind = kind;
    base.lr = 0.5f;
    OptimizerConfig scheduled = base;
    scheduled.lr = 0.0375f;
    ChunkOptimizer pushed(base, 3), configured(scheduled, 3), plain(base, 3);
    const float w[3] = {1.0f, -2.0f, 0.25f};
    const float g[3] = {0.3f, 0.1f, -0.7f};
    float a[3], b[3], c[3];
    for (int step = 0; step < 3; ++step) {
      pushed.Apply(w, g, 0.5f, 1.0f, a, 0.0375f);
      configured.Apply(w, g, 0.5f, 1.0f, b);
      plain.Apply(w, g, 0.5f, 1.0f, c, 0.0f);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(a[i], b[i]) << static_cast<int>(kind) << " step " << step << " elem " << i;
      }
    }
    EXPECT_NE(a[0], c[0]) << "lr 0 must keep the configured rate";
  }
}

TEST(OptimizerTest, StoreKeepsThePushedValue) {
  ASSERT_TRUE(ParseOptimizerKind("store").ok());
  OptimizerConfig c;
  c.kind = *ParseOptimizerKind("store");
  c.lr = 0.5f;
  ChunkOptimizer o(c, 3);
  const float w[3] = {1.0f, -2.0f, 3.0f}, g[3] = {4.0f, -8.0f, 0.5f};
  float out[3];
  o.Apply(w, g, 0.25f, 0.5f, out);  // scale, lr and the old weights play no part
  EXPECT_EQ(out[0], 4.0f);
  EXPECT_EQ(out[1], -8.0f);
  EXPECT_EQ(out[2], 0.5f);
  EXPECT_TRUE(o.state1().empty());
  EXPECT_FALSE(ParseOptimizerKind("stor").ok());
}

TEST(OptimizerTest, MomentumAccumulatesVelocity) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kMomentum;
  c.lr = 0.1f;
  c.momentum = 0.9f;
  ChunkOptimizer o(c, 1);
  float w = 1.0f, next;
  const float g = 1.0f;
  o.Apply(&w, &g, 1.0f, 1.0f, &next);  // v=1, w=0.9
  EXPECT_FLOAT_EQ(next, 0.9f);
  w = next;
  o.Apply(&w, &g, 1.0f, 1.0f, &next);  // v=1.9, w=0.9-0.19
  EXPECT_NEAR(next, 0.71f, 1e-6);
  EXPECT_NEAR(o.state1()[0], 1.9f, 1e-6);
}

TEST(OptimizerTest, AdamFirstStepMovesByLr) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 0.01f;
  ChunkOptimizer o(c, 3);
  const float w[3] = {0.0f, 1.0f, -1.0f}, g[3] = {0.3f, -5.0f, 1e-3f};
  float out[3];
  o.Apply(w, g, 1.0f, 1.0f, out);
  // Bias-corrected first step: m_hat = g, v_hat = g^2, so the step is lr * sign(g).
  EXPECT_NEAR(out[0], -0.01f, 1e-5);
  EXPECT_NEAR(out[1], 1.01f, 1e-5);
  EXPECT_NEAR(out[2], -1.01f, 1e-4);
}

TEST(OptimizerTest, VsgdScaleShrinksWithDrift) {
  const float now[2] = {3.0f, 4.0f};  // norm 5
  const float same[2] = {3.0f, 4.0f};
  const float far[2] = {0.0f, 0.0f};  // drift 5 -> relative 1
  float drift = -1;
  EXPECT_FLOAT_EQ(VsgdScale(now, same, 2, 2.0f, &drift), 1.0f);
  EXPECT_FLOAT_EQ(drift, 0.0f);
  EXPECT_NEAR(VsgdScale(now, far, 2, 2.0f, &drift), 1.0f / 3.0f, 1e-6);
  EXPECT_NEAR(drift, 1.0f, 1e-6);
  EXPECT_FLOAT_EQ(VsgdScale(now, far, 2, 0.0f), 1.0f);
}

}  // namespace
}  // namespace shardps::server
