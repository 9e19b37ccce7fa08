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
      layout::UpdateRule rate{}, none{};
      rate.lr = 0.0375f;
      pushed.Apply(w, g, 0.5f, 1.0f, a, rate);
      configured.Apply(w, g, 0.5f, 1.0f, b);
      plain.Apply(w, g, 0.5f, 1.0f, c, none);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(a[i], b[i]) << static_cast<int>(kind) << " step " << step << " elem " << i;
      }
    }
    EXPECT_NE(a[0], c[0]) << "lr 0 must keep the configured rate";
  }
}

// What a peer may write into a push's rule: anything that is not a rule the server applies
// is refused (NaN and infinities included), so no push can poison the weights through it.
TEST(OptimizerTest, UpdateRuleChecksRefuseWhatCannotBeApplied) {
  layout::UpdateRule ok{};
  EXPECT_EQ(layout::CheckUpdateRule(ok), nullptr);
  ok.kind_flags = static_cast<uint32_t>(layout::RuleKind::kSgd) | layout::kRuleNesterov;
  ok.lr = 0.1f;
  ok.momentum = 0.9f;
  EXPECT_EQ(layout::CheckUpdateRule(ok), nullptr);
  auto bad = [&](auto mutate) {
    layout::UpdateRule r = ok;
    mutate(r);
    return layout::CheckUpdateRule(r) != nullptr;
  };
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.kind_flags = 6; }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.kind_flags |= 1u << 9; }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.lr = std::nanf(""); }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.lr = -0.1f; }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.lr = INFINITY; }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.momentum = std::nanf(""); }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.dampening = 0.5f; }));  // with nesterov
  EXPECT_TRUE(bad([](layout::UpdateRule& r) { r.weight_decay = -1.0f; }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) {
    r.kind_flags = static_cast<uint32_t>(layout::RuleKind::kAdam);
    r.beta2 = 1.0f;
  }));
  EXPECT_TRUE(bad([](layout::UpdateRule& r) {
    r.kind_flags = static_cast<uint32_t>(layout::RuleKind::kAdamW) | layout::kRuleNesterov;
  }));
  EXPECT_FALSE(bad([](layout::UpdateRule& r) { r.lr = 0.0f; }));  // a warm-up's first step
}

// torch.optim.SGD creates the momentum buffer from the first gradient: with dampening the
// first step is NOT mu*0 + (1-dampening)*g. Nesterov adds mu*v to the gradient.
TEST(OptimizerTest, SgdRuleFollowsTorchFirstStepAndNesterov) {
  layout::UpdateRule r{};
  r.kind_flags = static_cast<uint32_t>(layout::RuleKind::kSgd);
  r.lr = 0.1f;
  r.momentum = 0.5f;
  r.dampening = 0.5f;
  ChunkOptimizer o(OptimizerConfig{}, 1);
  float w = 1.0f, next;
  const float g = 2.0f;
  o.Apply(&w, &g, 1.0f, 1.0f, &next, r);  // v = 2 (not 1), w = 1 - 0.2
  EXPECT_FLOAT_EQ(o.state1()[0], 2.0f);
  EXPECT_FLOAT_EQ(next, 0.8f);
  w = next;
  o.Apply(&w, &g, 1.0f, 1.0f, &next, r);  // v = 0.5*2 + 0.5*2 = 2, w = 0.8 - 0.2
  EXPECT_FLOAT_EQ(next, 0.6f);
  layout::UpdateRule n = r;
  n.dampening = 0.0f;
  n.kind_flags |= layout::kRuleNesterov;
  ChunkOptimizer q(OptimizerConfig{}, 1);
  w = 1.0f;
  q.Apply(&w, &g, 1.0f, 1.0f, &next, n);  // v = 2, d = 2 + 0.5*2 = 3, w = 1 - 0.3
  EXPECT_FLOAT_EQ(next, 0.7f);
  EXPECT_TRUE(ChunkOptimizer(OptimizerConfig{}, 1).state2().empty());
}

// AdamW decays the weight before the Adam step (decoupled); Adam adds wd*w to the gradient.
TEST(OptimizerTest, AdamWDecaysTheWeightAdamDecaysTheGradient) {
  layout::UpdateRule r{};
  r.kind_flags = static_cast<uint32_t>(layout::RuleKind::kAdamW);
  r.lr = 0.01f;
  r.beta1 = 0.9f;
  r.beta2 = 0.999f;
  r.eps = 1e-8f;
  r.weight_decay = 0.5f;
  ChunkOptimizer o(OptimizerConfig{}, 1);
  const float w = 2.0f, g = 0.3f;
  float next;
  o.Apply(&w, &g, 1.0f, 1.0f, &next, r);  // w*(1-0.005) - 0.01*sign(g)
  EXPECT_NEAR(next, 2.0f * 0.995f - 0.01f, 1e-6);
  r.kind_flags = static_cast<uint32_t>(layout::RuleKind::kAdam);
  ChunkOptimizer a(OptimizerConfig{}, 1);
  a.Apply(&w, &g, 1.0f, 1.0f, &next, r);  // d = 0.3 + 1.0 > 0: first step moves by lr
  EXPECT_NEAR(next, 2.0f - 0.01f, 1e-6);
  EXPECT_EQ(a.state1().size(), 1u);
  EXPECT_EQ(a.state2().size(), 1u);
  EXPECT_EQ(a.steps(), 1u);
}

// Dense Adagrad, torch.optim.Adagrad's rule: the accumulator starts at
// initial_accumulator_value, the rate decays by lr_decay per step, weight decay is L2.
TEST(OptimizerTest, AdagradFollowsTorchsRule) {
  ChunkOptimizer o(OptimizerConfig{}, 2);
  layout::UpdateRule r{};
  r.kind_flags = static_cast<uint32_t>(layout::RuleKind::kAdagrad);
  r.lr = 0.1f;
  r.momentum = 0.5f;   // lr_decay
  r.dampening = 0.2f;  // initial_accumulator_value
  r.weight_decay = 0.01f;
  r.eps = 1e-10f;
  ASSERT_EQ(layout::CheckUpdateRule(r), nullptr);
  float w[2] = {1.0f, -1.0f}, out[2];
  const float g[2] = {0.5f, -2.0f};
  double ref[2] = {1.0, -1.0}, sum[2] = {0.2, 0.2};
  for (int t = 1; t <= 3; ++t) {
    o.Apply(w, g, 1.0f, 1.0f, out, r);
    for (int i = 0; i < 2; ++i) {
      const double gi = g[i] + 0.01 * ref[i];
      sum[i] += gi * gi;
      ref[i] -= 0.1 / (1 + (t - 1) * 0.5) * gi / (std::sqrt(sum[i]) + 1e-10);
      EXPECT_NEAR(out[i], ref[i], 1e-6) << "step " << t;
      w[i] = out[i];
    }
  }
  EXPECT_EQ(o.state1().size(), 2u);
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
