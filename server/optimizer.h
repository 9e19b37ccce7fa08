// Server-side optimizers, applied per chunk by the apply thread. Double-buffered: the update
// reads the published weights and writes the next version into the other buffer.
//
//   g      = scale * grad                        (scale = 1/n for average, 1 for sum)
//   SGD:      w' = w - lr_t * (g + wd * w)
//   Momentum: v' = mu * v + (g + wd * w);  w' = w - lr_t * v'          (PyTorch convention)
//   Adam:     m' = b1 m + (1-b1) g;  v' = b2 v + (1-b2) g^2;
//             w' = w - lr_t * (m'/(1-b1^t)) / (sqrt(v'/(1-b2^t)) + eps)
//   Store:    w' = grad (benchmarks; scale and lr ignored)
//   lr_t   = lr * lr_scale                       (lr_scale from VSGD, else 1)
//
// Those are the server's own rule (--optimizer, --lr ...): layout::UpdateRule kind 0. A push
// may carry a rule of its own (kind 1-3: a trainer's torch.optim param group), applied with
// torch.optim's semantics and operation order, in float32 (bias corrections in double):
//   SGD:   d = g + wd*w;  if mu: v = (first ? d : mu*v + (1-dampening)*d);
//          d = nesterov ? d + mu*v : v;                         w' = w - lr_t*d
//   Adam:  d = g + wd*w;  m = b1*m + (1-b1)*d;  v = b2*v + (1-b2)*d*d;
//          w' = w - (lr_t/(1-b1^t)) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
//   AdamW: as Adam with d = g, after w <- w*(1 - lr_t*wd)
//   Adagrad: d = g + wd*w;  s += d*d;  w' = w - lr_t/(1+(t-1)*lr_decay) * d / (sqrt(s) + eps)
// t counts this chunk's updates; the state buffers are allocated on first use.
//
// Thread safety: a ChunkOptimizer belongs to the apply thread of its shard.
#ifndef SHARDPS_SERVER_OPTIMIZER_H_
#define SHARDPS_SERVER_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "wire/region_layout.h"

namespace shardps::server {

// kStore is for benchmarks only: the new version is the pushed gradient itself (w' = grad),
// as ps-lite's benchmark server stores values without aggregating.
enum class OptimizerKind { kSgd, kMomentum, kAdam, kStore };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.1f;
  float momentum = 0.9f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

StatusOr<OptimizerKind> ParseOptimizerKind(const std::string& name);

class ChunkOptimizer {
 public:
  ChunkOptimizer(const OptimizerConfig& config, size_t elements);

  // dst = update(src, grad). dst and src must not overlap; grad may be summed gradients
  // (scale = 1/count averages them). `rule` is the one the push carried (kind 0: this
  // optimizer's config, its lr replacing the configured rate when > 0); lr_scale multiplies the
  // rate (VSGD). The rule must have passed layout::CheckUpdateRule.
  void Apply(const float* src, const float* grad, float scale, float lr_scale, float* dst,
             const layout::UpdateRule& rule = layout::UpdateRule{});

  uint64_t steps() const { return steps_; }
  // Optimizer state, for replication and checkpoints: momentum (or Adam's m) then Adam's v.
  const std::vector<float>& state1() const { return s1_; }
  const std::vector<float>& state2() const { return s2_; }
  void RestoreState(uint64_t steps, std::vector<float> s1, std::vector<float> s2);
  // A trainer's load_state_dict: buffer 1 or 2 becomes `values` (n elements; nullptr drops
  // it), and the step count `steps`.
  void SetState(int which, const float* values, uint64_t steps);

 private:
  void ApplyServerRule(const float* src, const float* grad, float scale, float lr, float* dst);
  void ApplySgd(const float* src, const float* grad, float scale, float lr,
                const layout::UpdateRule& rule, bool first, float* dst);
  void ApplyAdam(const float* src, const float* grad, float scale, float lr,
                 const layout::UpdateRule& rule, float* dst);
  void ApplyAdagrad(const float* src, const float* grad, float scale, float lr,
                    const layout::UpdateRule& rule, float* dst);

  const OptimizerConfig config_;
  const size_t n_;
  uint64_t steps_ = 0;
  std::vector<float> s1_;
  std::vector<float> s2_;
};

// VSGD: learning-rate scale from value staleness, the relative distance between the weights a
// gradient was computed on and the weights it is applied to:
//   d = ||w_now - w_then||_2 / (||w_now||_2 + 1e-12)
//   lr_scale = 1 / (1 + lambda * d)
// lambda = 0 disables it. Returns d through *drift if non-null.
float VsgdScale(const float* w_now, const float* w_then, size_t n, float lambda,
                float* drift = nullptr);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_OPTIMIZER_H_
