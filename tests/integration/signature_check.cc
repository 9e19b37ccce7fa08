#include "tests/integration/signature_check.h"

#include <algorithm>
#include <cstdio>

namespace shardps::testing_util {

bool ParseMode(const std::string& name, Mode* mode) {
  if (name == "bsp") {
    *mode = Mode::kBsp;
  } else if (name == "ssp") {
    *mode = Mode::kSsp;
  } else if (name == "asp") {
    *mode = Mode::kAsp;
  } else if (name == "vsgd") {
    *mode = Mode::kVsgd;
  } else {
    return false;
  }
  return true;
}

void SignatureCheck::Gradient(int worker, int clock, int steps, std::vector<float>* grad) {
  std::fill(grad->begin(), grad->end(), 0.0f);
  const size_t i = static_cast<size_t>(worker) * steps + clock;
  if (clock >= 0 && clock < steps && i < grad->size()) (*grad)[i] = -1.0f;
}

void SignatureCheck::Violation(const std::string& what) {
  ++violations_;
  last_error_ = what;
}

int SignatureCheck::Check(int64_t clock, const std::vector<float>& weights) {
  ++pulls_;
  const uint64_t before = violations_;
  char buf[200];
  if (weights.size() != seen_.size()) {
    Violation("tensor of " + std::to_string(weights.size()) + " floats, expected " +
              std::to_string(seen_.size()));
    return 1;
  }
  int64_t oldest_missing = clock;  // over clocks < clock
  for (int w = 0; w < workers_; ++w) {
    for (int t = 0; t < steps_; ++t) {
      const size_t i = static_cast<size_t>(w) * steps_ + t;
      const float v = weights[i];
      bool in = v != 0.0f;
      const bool well_formed =
          v == 0.0f || v == 1.0f || (mode_ == Mode::kVsgd && v > 0.0f && v <= 1.0f);
      auto report = [&](const char* what) {
        std::snprintf(buf, sizeof(buf),
                      "pull at clock %lld: update (worker %d, clock %d) = %.9g: %s",
                      static_cast<long long>(clock), w, t, static_cast<double>(v), what);
        Violation(buf);
      };
      if (!well_formed) report("not a signature value (applied twice, or mixed)");
      if (seen_[i] && !in) report("was in an earlier pull and is gone");
      seen_[i] = seen_[i] || in;
      if (!in && t < oldest_missing) oldest_missing = t;
      switch (mode_) {
        case Mode::kBsp:
          if (in != (t < clock))
            report(in ? "BSP: an update of a clock not finished yet"
                      : "BSP: missing an update of a finished clock");
          break;
        case Mode::kSsp:
        case Mode::kVsgd:
          if (!in && t <= clock - staleness_ - 1) report("beyond the staleness bound");
          // A worker pushes clock t only after a pull at clock t that needed this worker's
          // updates of clocks <= t - s - 1; this worker has pushed clocks < `clock` only.
          if (in && t > clock + staleness_) report("an update of a clock no worker can reach yet");
          break;
        case Mode::kAsp:
          break;
      }
    }
  }
  const int64_t staleness = clock - oldest_missing;
  max_staleness_ = std::max(max_staleness_, staleness);
  if (staleness_ >= 1 && staleness == staleness_) ++at_bound_;
  return static_cast<int>(violations_ - before);
}

}  // namespace shardps::testing_util
