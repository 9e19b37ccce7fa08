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
    : config_(config), n_(elements) {
  if (config.kind == OptimizerKind::kMomentum || config.kind == OptimizerKind::kAdam) {
    s1_.assign(n_, 0.0f);
  }
  if (config.kind == OptimizerKind::kAdam) s2_.assign(n_, 0.0f);
}

void ChunkOptimizer::Apply(const float* src, const float* grad, float scale, float lr_scale,
                           float* dst, float lr_override) {
  ++steps_;
  const float lr = (lr_override > 0.0f ? lr_override : config_.lr) * lr_scale;
  const float wd = config_.weight_decay;
  switch (config_.kind) {
    case OptimizerKind::kSgd:
      for (size_t i = 0; i < n_; ++i) dst[i] = src[i] - lr * (scale * grad[i] + wd * src[i]);
      break;
    case OptimizerKind::kMomentum: {
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

void ChunkOptimizer::RestoreState(uint64_t steps, std::vector<float> s1, std::vector<float> s2) {
  steps_ = steps;
  if (s1.size() == s1_.size()) s1_ = std::move(s1);
  if (s2.size() == s2_.size()) s2_ = std::move(s2);
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
