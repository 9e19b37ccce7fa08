#include "examples/digits_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

namespace digits {

namespace {

constexpr char kMagic[4] = {'S', 'P', 'D', 'G'};
constexpr uint32_t kVersion = 1;

// Uniform in [-a, a) from the top 53 bits; the same on every platform (unlike
// std::uniform_real_distribution, whose algorithm the standard leaves open).
float Uniform(std::mt19937_64& rng, double a) {
  const double u = static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>((2.0 * u - 1.0) * a);
}

}  // namespace

shardps::StatusOr<Dataset> LoadDataset(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return shardps::NotFoundError("cannot open data file " + path);
  char magic[4];
  uint32_t hdr[4];  // version, n, features, classes
  f.read(magic, sizeof(magic));
  f.read(reinterpret_cast<char*>(hdr), sizeof(hdr));
  if (!f || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return shardps::InvalidArgumentError(path + ": not a digits data file (bad magic)");
  }
  if (hdr[0] != kVersion) {
    return shardps::InvalidArgumentError(path + ": unsupported version " + std::to_string(hdr[0]));
  }
  Dataset d;
  d.n = hdr[1];
  d.features = hdr[2];
  d.classes = hdr[3];
  if (d.n == 0 || d.features == 0 || d.features > 4096 || d.classes < 2 || d.classes > 255 ||
      d.n > (1u << 24)) {
    return shardps::InvalidArgumentError(path + ": implausible header");
  }
  d.x.resize(static_cast<size_t>(d.n) * d.features);
  d.y.resize(d.n);
  f.read(reinterpret_cast<char*>(d.x.data()), static_cast<std::streamsize>(d.x.size() * 4));
  f.read(reinterpret_cast<char*>(d.y.data()), static_cast<std::streamsize>(d.y.size()));
  if (!f) return shardps::DataLossError(path + ": truncated");
  f.peek();
  if (!f.eof()) return shardps::DataLossError(path + ": trailing bytes after the labels");
  for (uint8_t label : d.y) {
    if (label >= d.classes) return shardps::DataLossError(path + ": label out of range");
  }
  return d;
}

shardps::StatusOr<Model> Model::Create(ModelKind kind, uint32_t features, uint32_t hidden,
                                       uint32_t classes, uint64_t seed) {
  if (features == 0 || classes < 2) return shardps::InvalidArgumentError("empty model");
  if (kind == ModelKind::kMlp && (hidden == 0 || hidden > 65536)) {
    return shardps::InvalidArgumentError("--hidden must be in [1, 65536]");
  }
  Model m;
  m.kind_ = kind;
  m.features_ = features;
  m.hidden_ = kind == ModelKind::kMlp ? hidden : 0;
  m.classes_ = classes;
  auto add = [&m](const std::string& name, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    m.tensors_.push_back(Tensor{
        name, std::move(shape), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f), {}});
  };
  std::mt19937_64 rng(seed);
  if (kind == ModelKind::kMlp) {
    add("fc1.weight", {hidden, features});
    add("fc1.bias", {hidden});
    add("fc2.weight", {classes, hidden});
    add("fc2.bias", {classes});
    for (float& v : m.tensors_[0].w) v = Uniform(rng, std::sqrt(6.0 / features));
    for (float& v : m.tensors_[2].w) v = Uniform(rng, std::sqrt(6.0 / (hidden + classes)));
  } else {
    add("linear.weight", {classes, features});
    add("linear.bias", {classes});
    for (float& v : m.tensors_[0].w) v = Uniform(rng, std::sqrt(6.0 / (features + classes)));
  }
  return m;
}

size_t Model::num_parameters() const {
  size_t n = 0;
  for (const Tensor& t : tensors_) n += t.w.size();
  return n;
}

std::string Model::Describe() const {
  if (kind_ == ModelKind::kMlp) {
    return "mlp " + std::to_string(features_) + "-" + std::to_string(hidden_) + "-" +
           std::to_string(classes_);
  }
  return "logreg " + std::to_string(features_) + "-" + std::to_string(classes_);
}

void Model::Forward(const float* x, float* hidden, float* logits) const {
  const float* in = x;
  uint32_t in_dim = features_;
  size_t out_layer = 0;
  if (kind_ == ModelKind::kMlp) {
    const float* w1 = tensors_[0].w.data();
    const float* b1 = tensors_[1].w.data();
    for (uint32_t j = 0; j < hidden_; ++j) {
      float z = b1[j];
      const float* row = w1 + static_cast<size_t>(j) * features_;
      for (uint32_t k = 0; k < features_; ++k) z += row[k] * x[k];
      hidden[j] = z > 0.0f ? z : 0.0f;
    }
    in = hidden;
    in_dim = hidden_;
    out_layer = 2;
  }
  const float* w = tensors_[out_layer].w.data();
  const float* b = tensors_[out_layer + 1].w.data();
  for (uint32_t c = 0; c < classes_; ++c) {
    float z = b[c];
    const float* row = w + static_cast<size_t>(c) * in_dim;
    for (uint32_t k = 0; k < in_dim; ++k) z += row[k] * in[k];
    logits[c] = z;
  }
}

float Model::ComputeGradients(const Dataset& d, const uint32_t* idx, size_t count) {
  for (Tensor& t : tensors_) std::fill(t.g.begin(), t.g.end(), 0.0f);
  if (count == 0) return 0.0f;
  std::vector<float> h(hidden_), logits(classes_), dlogits(classes_), dh(hidden_);
  const float inv = 1.0f / static_cast<float>(count);
  const size_t out_layer = kind_ == ModelKind::kMlp ? 2 : 0;
  const uint32_t in_dim = kind_ == ModelKind::kMlp ? hidden_ : features_;
  double loss = 0.0;
  for (size_t s = 0; s < count; ++s) {
    const float* x = d.row(idx[s]);
    const uint32_t label = d.y[idx[s]];
    Forward(x, h.data(), logits.data());
    // Softmax cross-entropy, shifted by the max logit for stability.
    const float mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (uint32_t c = 0; c < classes_; ++c) sum += std::exp(static_cast<double>(logits[c] - mx));
    loss += std::log(sum) - static_cast<double>(logits[label] - mx);
    for (uint32_t c = 0; c < classes_; ++c) {
      const float p = static_cast<float>(std::exp(static_cast<double>(logits[c] - mx)) / sum);
      dlogits[c] = (p - (c == label ? 1.0f : 0.0f)) * inv;
    }
    // Output layer.
    const float* in = kind_ == ModelKind::kMlp ? h.data() : x;
    float* gw = tensors_[out_layer].g.data();
    float* gb = tensors_[out_layer + 1].g.data();
    for (uint32_t c = 0; c < classes_; ++c) {
      float* row = gw + static_cast<size_t>(c) * in_dim;
      for (uint32_t k = 0; k < in_dim; ++k) row[k] += dlogits[c] * in[k];
      gb[c] += dlogits[c];
    }
    if (kind_ != ModelKind::kMlp) continue;
    // Hidden layer: back through fc2 and the ReLU.
    const float* w2 = tensors_[2].w.data();
    std::fill(dh.begin(), dh.end(), 0.0f);
    for (uint32_t c = 0; c < classes_; ++c) {
      const float* row = w2 + static_cast<size_t>(c) * hidden_;
      for (uint32_t j = 0; j < hidden_; ++j) dh[j] += row[j] * dlogits[c];
    }
    float* gw1 = tensors_[0].g.data();
    float* gb1 = tensors_[1].g.data();
    for (uint32_t j = 0; j < hidden_; ++j) {
      if (h[j] <= 0.0f) continue;  // ReLU gradient is 0 where the unit was off
      float* row = gw1 + static_cast<size_t>(j) * features_;
      for (uint32_t k = 0; k < features_; ++k) row[k] += dh[j] * x[k];
      gb1[j] += dh[j];
    }
  }
  return static_cast<float>(loss / static_cast<double>(count));
}

void Model::LocalUpdate(float lr, float momentum) {
  for (Tensor& t : tensors_) {
    if (momentum == 0.0f) {
      for (size_t i = 0; i < t.w.size(); ++i) t.w[i] = t.w[i] - lr * t.g[i];
      continue;
    }
    t.v.resize(t.w.size(), 0.0f);
    for (size_t i = 0; i < t.w.size(); ++i) {
      t.v[i] = momentum * t.v[i] + t.g[i];
      t.w[i] = t.w[i] - lr * t.v[i];
    }
  }
}

double Model::Accuracy(const Dataset& d) const {
  std::vector<float> h(hidden_), logits(classes_);
  uint32_t correct = 0;
  for (uint32_t i = 0; i < d.n; ++i) {
    Forward(d.row(i), h.data(), logits.data());
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    correct += static_cast<uint32_t>(best) == d.y[i];
  }
  return static_cast<double>(correct) / d.n;
}

std::vector<uint32_t> EpochPermutation(uint32_t n, uint64_t seed, uint32_t epoch) {
  std::vector<uint32_t> p(n);
  for (uint32_t i = 0; i < n; ++i) p[i] = i;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + epoch + 1);
  // Fisher-Yates with our own bounded draw (std::shuffle's use of the engine is unspecified).
  for (uint32_t i = n - 1; i > 0; --i) {
    const uint32_t j = static_cast<uint32_t>(rng() % (static_cast<uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

}  // namespace digits
