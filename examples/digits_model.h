// The digits example's data set and model: plain C++ on the CPU, no linear-algebra library.
//
// Dataset: the file written by scripts/export_digits.py (format in docs/operations.md, "Digits
// data files"). Model: an MLP features->hidden->classes with ReLU, or multinomial logistic
// regression, trained with softmax cross-entropy. The model computes gradients only; who
// applies them (the parameter servers, or SgdUpdate in --standalone) is the caller's business.
//
// Thread safety: none; a Model and a Dataset belong to the training loop's thread.
#ifndef SHARDPS_EXAMPLES_DIGITS_MODEL_H_
#define SHARDPS_EXAMPLES_DIGITS_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "shardps/status.h"

namespace digits {

struct Dataset {
  uint32_t n = 0;
  uint32_t features = 0;
  uint32_t classes = 0;
  std::vector<float> x;    // n * features, row-major
  std::vector<uint8_t> y;  // n labels in [0, classes)
  const float* row(uint32_t i) const { return x.data() + static_cast<size_t>(i) * features; }
};

// Reads and validates a data file (magic, version, sizes, label range).
shardps::StatusOr<Dataset> LoadDataset(const std::string& path);

// One parameter tensor: weights and the gradient buffer the servers read pushes from.
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> w;
  std::vector<float> g;
  std::vector<float> v;  // momentum state of LocalUpdate
};

enum class ModelKind { kMlp, kLogReg };

class Model {
 public:
  // Deterministic initialisation from `seed`: He-uniform for the ReLU layer, Glorot-uniform for
  // the output layer, zero biases.
  static shardps::StatusOr<Model> Create(ModelKind kind, uint32_t features, uint32_t hidden,
                                         uint32_t classes, uint64_t seed);

  std::vector<Tensor>& tensors() { return tensors_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  size_t num_parameters() const;
  std::string Describe() const;  // "mlp 64-64-10" or "logreg 64-10"

  // Overwrites every gradient buffer with the gradient of the mean cross-entropy over the
  // samples idx[0..count) and returns that mean loss.
  float ComputeGradients(const Dataset& d, const uint32_t* idx, size_t count);
  // The servers' sgd / momentum rule (server/optimizer.cc), for --standalone only; in a
  // cluster the servers apply updates. momentum == 0: w -= lr * g; else v = mu * v + g,
  // w -= lr * v.
  void LocalUpdate(float lr, float momentum);
  // Fraction of `d` classified correctly with the current weights.
  double Accuracy(const Dataset& d) const;

 private:
  Model() = default;
  // Logits of one sample; `hidden` receives the post-ReLU activations (MLP only).
  void Forward(const float* x, float* hidden, float* logits) const;

  ModelKind kind_ = ModelKind::kMlp;
  uint32_t features_ = 0, hidden_ = 0, classes_ = 0;
  std::vector<Tensor> tensors_;  // mlp: fc1.weight, fc1.bias, fc2.weight, fc2.bias
};

// A permutation of [0, n) that depends only on (seed, epoch): every worker computes the same
// one, so worker shards of a global batch never overlap.
std::vector<uint32_t> EpochPermutation(uint32_t n, uint64_t seed, uint32_t epoch);

}  // namespace digits

#endif  // SHARDPS_EXAMPLES_DIGITS_MODEL_H_
