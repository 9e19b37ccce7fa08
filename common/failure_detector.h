// PhiAccrualDetector: how suspicious a member's silence is, given the heartbeat intervals it has
// shown so far (Hayashibara et al., "The phi accrual failure detector", SRDS 2004).
//
// The detector keeps the last `window` intervals between a member's heartbeats and models them
// as a normal distribution. phi(t) = -log10(P(an interval exceeds t)): phi 1 means the silence t
// is exceeded by one interval in 10, phi 8 by one in 10^8. A member on a busy host, whose
// heartbeats arrive with seconds of jitter, reaches a given phi much later than one on an idle
// host: the timeout follows the measured jitter instead of being a constant. SilenceFor(phi)
// inverts it, so that callers can turn a threshold into a duration (and clamp it).
//
// The intervals are the member's own (the differences of its send timestamps) when it reports
// them, so that the observer's own scheduling delays (a coordinator descheduled for seconds)
// are not learnt as the member's jitter; Shift() moves the last heartbeat later by a pause of
// the observer, so that such a pause is not counted as the member's silence either.
//
// Thread safety: none; one owner thread (the coordinator's loop).
#ifndef SHARDPS_COMMON_FAILURE_DETECTOR_H_
#define SHARDPS_COMMON_FAILURE_DETECTOR_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <deque>

namespace shardps {

class PhiAccrualDetector {
 public:
  using Clock = std::chrono::steady_clock;
  using Duration = std::chrono::microseconds;

  struct Options {
    // The interval the member was told to use: the prior before real samples arrive.
    Duration expected_interval{500000};
    // A floor on the standard deviation: perfectly regular heartbeats must not make a few
    // milliseconds of lateness infinitely suspicious.
    Duration min_stddev{50000};
    size_t window = 100;
  };

  explicit PhiAccrualDetector(const Options& options);

  // A heartbeat arrived at `now`. `member_interval` is the member's own interval since its
  // previous heartbeat (from its send timestamps); zero or negative = unknown, and the arrival
  // interval is used.
  void Heartbeat(Clock::time_point now, Duration member_interval = Duration(0));
  // The observer was paused (descheduled) for `pause`: the silence so far does not count it.
  // Never past `now` (a heartbeat taken after the pause began keeps its own time).
  void Shift(Duration pause, Clock::time_point now) {
    if (started_) last_ = std::min(last_ + pause, std::max(last_, now));
  }

  Clock::time_point last() const { return last_; }
  // phi of the silence since the last heartbeat (0 before the first; capped at 1000).
  double Phi(Clock::time_point now) const;
  // The silence at which phi reaches `phi` (>= the mean interval).
  Duration SilenceFor(double phi) const;

  Duration mean() const;
  Duration stddev() const;
  size_t samples() const { return intervals_.size(); }

 private:
  double Mean() const;    // microseconds
  double StdDev() const;  // microseconds, floored at min_stddev

  Options options_;
  Clock::time_point last_{};
  bool started_ = false;
  std::deque<double> intervals_;  // microseconds
  double sum_ = 0, sum_sq_ = 0;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_FAILURE_DETECTOR_H_
