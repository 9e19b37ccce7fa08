// SignatureCheck: decodes, from the weights one pull returned, exactly which (worker, clock)
// updates they contain, and checks the consistency mode's documented guarantee
// (docs/consistency.md) on every pull.
//
// The signature model (ps_test_worker --model=signature): a tensor of workers x steps floats,
// all 0 at the start; worker w's gradient at clock t is -1 at element w * steps + t and 0
// elsewhere, and the servers apply plain SGD with lr 1 and --aggregation=sum. So element
// (w, t) is exactly 1 once that update is in the weights and exactly 0 before: a distinct,
// exactly representable signature per update. VSGD scales each update's learning rate into
// (0, 1], so there an element is in (0, 1] once applied.
//
// What is checked on each pull, by a worker at clock c (after Step(): it pushed clocks < c):
//   every mode   each element is 0 or 1 (VSGD: 0 or in (0, 1]): an update applied twice, or
//                mixed into another's element, shows; an update once seen never disappears
//                (published versions are ordered, failovers included);
//   BSP          the pull holds exactly the updates of clocks < c, every worker's;
//   SSP(s), VSGD(s)  it holds every update of clocks <= c - s - 1 (the bound), and none of a
//                clock above c + s (no worker can push one before this worker's clock c);
//   ASP          nothing more (staleness is reported, not bounded).
// Reported per worker: pulls, violations, pulls at the bound (the oldest missing update was of
// clock c - s exactly: the worker read as stale as the bound allows, s >= 1), and the largest
// staleness seen (c minus the oldest missing update's clock, over clocks < c).
//
// Thread safety: none; one per tensor per worker, used by the worker's training thread.
#ifndef SHARDPS_TESTS_INTEGRATION_SIGNATURE_CHECK_H_
#define SHARDPS_TESTS_INTEGRATION_SIGNATURE_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

namespace shardps::testing_util {

enum class Mode { kBsp, kSsp, kAsp, kVsgd };

// "bsp", "ssp", "asp", "vsgd" (the coordinator's --consistency names); false if unknown.
bool ParseMode(const std::string& name, Mode* mode);

class SignatureCheck {
 public:
  SignatureCheck(Mode mode, int staleness, int workers, int steps)
      : mode_(mode),
        staleness_(staleness),
        workers_(workers),
        steps_(steps),
        seen_(static_cast<size_t>(workers) * steps, 0) {}

  // The gradient of `worker` at `clock`, written into `grad` (workers * steps floats).
  static void Gradient(int worker, int clock, int steps, std::vector<float>* grad);

  // Checks one pull of `weights` (workers * steps floats) by a worker at `clock`. Returns the
  // violations found in this pull; the latest is described in last_error().
  int Check(int64_t clock, const std::vector<float>& weights);

  uint64_t pulls() const { return pulls_; }
  uint64_t violations() const { return violations_; }
  uint64_t at_bound() const { return at_bound_; }
  int64_t max_staleness() const { return max_staleness_; }
  const std::string& last_error() const { return last_error_; }

 private:
  void Violation(const std::string& what);

  const Mode mode_;
  const int staleness_;
  const int workers_;
  const int steps_;
  std::vector<uint8_t> seen_;  // update (w, t) was in an earlier pull
  uint64_t pulls_ = 0;
  uint64_t violations_ = 0;
  uint64_t at_bound_ = 0;
  int64_t max_staleness_ = 0;
  std::string last_error_;
};

}  // namespace shardps::testing_util

#endif  // SHARDPS_TESTS_INTEGRATION_SIGNATURE_CHECK_H_
