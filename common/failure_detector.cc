#include "common/failure_detector.h"

#include <algorithm>
#include <cmath>

namespace shardps {

PhiAccrualDetector::PhiAccrualDetector(const Options& options) : options_(options) {
  if (options_.window < 2) options_.window = 2;
}

void PhiAccrualDetector::Heartbeat(Clock::time_point now, Duration member_interval) {
  if (started_) {
    double us = member_interval.count() > 0
                    ? static_cast<double>(member_interval.count())
                    : std::chrono::duration<double, std::micro>(now - last_).count();
    us = std::max(0.0, us);
    intervals_.push_back(us);
    sum_ += us;
    sum_sq_ += us * us;
    if (intervals_.size() > options_.window) {
      const double old = intervals_.front();
      intervals_.pop_front();
      sum_ -= old;
      sum_sq_ -= old * old;
    }
  }
  started_ = true;
  last_ = now;
}

double PhiAccrualDetector::Mean() const {
  if (intervals_.empty()) return static_cast<double>(options_.expected_interval.count());
  return sum_ / static_cast<double>(intervals_.size());
}

double PhiAccrualDetector::StdDev() const {
  double sd = static_cast<double>(options_.expected_interval.count()) / 4;  // the prior
  if (intervals_.size() >= 2) {
    const double n = static_cast<double>(intervals_.size());
    const double m = sum_ / n;
    sd = std::sqrt(std::max(0.0, sum_sq_ / n - m * m));
  }
  return std::max(sd, static_cast<double>(options_.min_stddev.count()));
}

PhiAccrualDetector::Duration PhiAccrualDetector::mean() const {
  return Duration(static_cast<int64_t>(Mean()));
}

PhiAccrualDetector::Duration PhiAccrualDetector::stddev() const {
  return Duration(static_cast<int64_t>(StdDev()));
}

namespace {

// -log10 of the upper tail of the standard normal at y, accurate far into the tail (where
// erfc underflows, the asymptotic expansion takes over).
double MinusLog10Tail(double y) {
  if (y < 30) {
    const double p = 0.5 * std::erfc(y / std::sqrt(2.0));
    if (p > 0) return -std::log10(p);
  }
  // log(phi(y)/y) for the normal density phi: the Mills-ratio bound, tight for large y.
  const double ln = -0.5 * y * y - std::log(y * std::sqrt(2 * M_PI));
  return -ln / std::log(10.0);
}

}  // namespace

double PhiAccrualDetector::Phi(Clock::time_point now) const {
  if (!started_) return 0;
  const double t = std::chrono::duration<double, std::micro>(now - last_).count();
  const double y = (t - Mean()) / StdDev();
  return std::min(1000.0, MinusLog10Tail(y));
}

PhiAccrualDetector::Duration PhiAccrualDetector::SilenceFor(double phi) const {
  // MinusLog10Tail is increasing in y: bisect for the y where it reaches phi.
  double lo = 0, hi = 60;
  for (int i = 0; i < 60; ++i) {
    const double mid = (lo + hi) / 2;
    (MinusLog10Tail(mid) < phi ? lo : hi) = mid;
  }
  return Duration(static_cast<int64_t>(Mean() + hi * StdDev()));
}

}  // namespace shardps
