#include "server/optimizer.h"

#include <cmath>
#include <cstring>

namespace shardps::server {

StatusOr<OptimizerKind> ParseOptimizerKind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "momentum") return OptimizerKind::kMomentum;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "store") return OptimizerKind::kStore;
  return InvalidArgumentError("unknown optimizer '" + name + "' (sgd, momentum, adam, store)");
}

ChunkOptimizer::ChunkOptimizer(const OptimizerConfig& config, size_t elements)
    : config_(config), n_(elements) {}

void ChunkOptimizer::Apply(const float* src, const float* grad, float scale, float lr_scale,
                           float* dst, const layout::UpdateRule& rule) {
  const uint64_t before = steps_;
  ++steps_;
  switch (rule.kind()) {
    case layout::RuleKind::kServer:
      ApplyServerRule(src, grad, scale, (rule.lr > 0.0f ? rule.lr : config_.lr) * lr_scale, dst);
      return;
    case layout::RuleKind::kSgd:
      {
        // torch.optim.SGD creates the momentum buffer from the first gradient (no dampening).
        const bool fresh = rule.momentum != 0.0f && (s1_.empty() || before == 0);
        if (fresh) s1_.assign(n_, 0.0f);
        ApplySgd(src, grad, scale, rule.lr * lr_scale, rule, fresh, dst);
      }
      return;
    case layout::RuleKind::kStore:
      std::memcpy(dst, grad, n_ * sizeof(float));
      return;
    case layout::RuleKind::kAdam:
    case layout::RuleKind::kAdamW:
      if (s1_.empty()) s1_.assign(n_, 0.0f);
      if (s2_.empty()) s2_.assign(n_, 0.0f);
      ApplyAdam(src, grad, scale, rule.lr * lr_scale, rule, dst);
      return;
    case layout::RuleKind::kAdagrad:
      if (s1_.empty()) s1_.assign(n_, rule.dampening);  // initial_accumulator_value
      ApplyAdagrad(src, grad, scale, rule.lr * lr_scale, rule, dst);
      return;
  }
}

void ChunkOptimizer::ApplyAdagrad(const float* src, const float* grad, float scale, float lr,
                                  const layout::UpdateRule& rule, float* dst) {
  // torch.optim.Adagrad (1.13, single-tensor, dense): clr = lr / (1 + (step - 1) * lr_decay);
  // sum += g*g; w -= clr * g / (sqrt(sum) + eps).
  const double clr = static_cast<double>(lr) /
                     (1.0 + static_cast<double>(steps_ - 1) * static_cast<double>(rule.momentum));
  const float c = static_cast<float>(clr);
  const float wd = rule.weight_decay, eps = rule.eps;
  float* sum = s1_.data();
  for (size_t i = 0; i < n_; ++i) {
    float g = scale * grad[i];
    if (wd != 0.0f) g = g + wd * src[i];
    sum[i] = sum[i] + g * g;
    dst[i] = src[i] - c * (g / (std::sqrt(sum[i]) + eps));
  }
}

void ChunkOptimizer::ApplyServerRule(const float* src, const float* grad, float scale, float lr,
                                     float* dst) {
  const float wd = config_.weight_decay;
  switch (config_.kind) {
    case OptimizerKind::kSgd:
      for (size_t i = 0; i < n_; ++i) dst[i] = src[i] - lr * (scale * grad[i] + wd * src[i]);
      break;
    case OptimizerKind::kMomentum: {
      if (s1_.empty()) s1_.assign(n_, 0.0f);
      const float mu = config_.momentum;
      float* v = s1_.data();
      for (size_t i = 0; i < n_; ++i) {
        v[i] = mu * v[i] + scale * grad[i] + wd * src[i];
        dst[i] = src[i] - lr * v[i];
      }
      break;
    }
    case OptimizerKind::kStore:
      // Benchmarks: keep the pushed value as it is (ps-lite's benchmark server stores without
      // aggregating). scale, lr and src are ignored.
      std::memcpy(dst, grad, n_ * sizeof(float));
      break;
    case OptimizerKind::kAdam: {
      if (s1_.empty()) s1_.assign(n_, 0.0f);
      if (s2_.empty()) s2_.assign(n_, 0.0f);
      const float b1 = config_.beta1, b2 = config_.beta2, eps = config_.eps;
      const float c1 = 1.0f - std::pow(b1, static_cast<float>(steps_));
      const float c2 = 1.0f - std::pow(b2, static_cast<float>(steps_));
      float* m = s1_.data();
      float* v = s2_.data();
      for (size_t i = 0; i < n_; ++i) {
        const float g = scale * grad[i] + wd * src[i];
        m[i] = b1 * m[i] + (1.0f - b1) * g;
        v[i] = b2 * v[i] + (1.0f - b2) * g * g;
        dst[i] = src[i] - lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
      }
      break;
    }
  }
}

void ChunkOptimizer::ApplySgd(const float* src, const float* grad, float scale, float lr,
                              const layout::UpdateRule& rule, bool first, float* dst) {
  const float wd = rule.weight_decay, mu = rule.momentum;
  const float keep = static_cast<float>(1.0 - static_cast<double>(rule.dampening));
  if (mu == 0.0f) {
    for (size_t i = 0; i < n_; ++i) {
      float d = scale * grad[i];
      if (wd != 0.0f) d = d + wd * src[i];
      dst[i] = src[i] - lr * d;
    }
    return;
  }
  const bool nesterov = rule.nesterov();
  float* v = s1_.data();
  for (size_t i = 0; i < n_; ++i) {
    float d = scale * grad[i];
    if (wd != 0.0f) d = d + wd * src[i];
    v[i] = first ? d : v[i] * mu + d * keep;
    d = nesterov ? d + mu * v[i] : v[i];
    dst[i] = src[i] - lr * d;
  }
}

void ChunkOptimizer::ApplyAdam(const float* src, const float* grad, float scale, float lr,
                               const layout::UpdateRule& rule, float* dst) {
  // torch.optim.Adam/AdamW (1.13, single-tensor path): Python-float scalars, float32 tensors.
  const double t = static_cast<double>(steps_);
  const double bc1 = 1.0 - std::pow(static_cast<double>(rule.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(rule.beta2), t);
  const float step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float w1 = static_cast<float>(1.0 - static_cast<double>(rule.beta1));
  const float b1 = rule.beta1, b2 = rule.beta2;
  const float w2 = static_cast<float>(1.0 - static_cast<double>(rule.beta2));
  const float eps = rule.eps;
  const bool decoupled = rule.kind() == layout::RuleKind::kAdamW;
  const float wd = rule.weight_decay;
  const float shrink =
      static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(wd));
  float* m = s1_.data();
  float* v = s2_.data();
  for (size_t i = 0; i < n_; ++i) {
    float w = src[i];
    float d = scale * grad[i];
    if (decoupled) {
      if (wd != 0.0f) w = w * shrink;
    } else if (wd != 0.0f) {
      d = d + wd * w;
    }
    m[i] = m[i] * b1 + d * w1;
    v[i] = v[i] * b2 + w2 * d * d;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    dst[i] = w - step_size * (m[i] / denom);
  }
}

void ChunkOptimizer::RestoreState(uint64_t steps, std::vector<float> s1, std::vector<float> s2) {
  // The state buffers exist once a rule used them: a restored state of n elements or none.
  steps_ = steps;
  if (s1.size() == n_ || s1.empty()) s1_ = std::move(s1);
  if (s2.size() == n_ || s2.empty()) s2_ = std::move(s2);
}

void ChunkOptimizer::SetState(int which, const float* values, uint64_t steps) {
  std::vector<float>& s = which == 1 ? s1_ : s2_;
  if (values == nullptr) {
    s.clear();
  } else {
    s.assign(values, values + n_);
  }
  steps_ = steps;
}

float VsgdScale(const float* w_now, const float* w_then, size_t n, float lambda, float* drift) {
  double dd = 0, ww = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(w_now[i]) - w_then[i];
    dd += d * d;
    ww += static_cast<double>(w_now[i]) * w_now[i];
  }
  const double rel = std::sqrt(dd) / (std::sqrt(ww) + 1e-12);
  if (drift != nullptr) *drift = static_cast<float>(rel);
  return static_cast<float>(1.0 / (1.0 + lambda * rel));
}

}  // namespace shardps::server
