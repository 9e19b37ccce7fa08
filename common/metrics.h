// Metrics in the Prometheus text exposition format, version 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/), for the daemons' and the
// client library's /metrics endpoint (common/metrics_http.h; docs/operations.md, "Metrics").
//
// Two ways to feed a scrape:
//  * metric objects (Counter, Gauge, Histogram): lock-free atomics that the code updating them
//    owns or registers; a Histogram costs one relaxed fetch_add per observation plus a CAS on
//    its sum, on whichever thread observes;
//  * collectors: callbacks run at scrape time that read counters the code already keeps (a
//    snapshot under their own lock) and write them into the Exposition. The data path pays
//    nothing for them when nobody scrapes.
//
// Naming (checked by the unit test and `promtool check metrics`): every name starts with
// shardps_, counters end in _total, histograms carry their unit (_seconds, _bytes, _clocks).
//
// Thread safety: Counter, Gauge and Histogram are safe from any thread. Exposition belongs to
// the one thread rendering a scrape. Registry is thread-safe (one mutex over its lists); its
// collectors run under that mutex on the rendering thread and must not call back into it.
#ifndef SHARDPS_COMMON_METRICS_H_
#define SHARDPS_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"

namespace shardps::metrics {

// Label name/value pairs, in the order they are written.
using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Inc(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

class Gauge {
 public:
  void Set(double v);
  double value() const;

 private:
  std::atomic<uint64_t> bits_{0};  // a double's bits (0 is 0.0)
};

class Histogram {
 public:
  // Cumulative buckets are rendered as le="bound" for each of `upper_bounds` (finite,
  // strictly increasing; anything else is a programmer error) plus le="+Inf".
  explicit Histogram(std::vector<double> upper_bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Lock-free. NaN is ignored.
  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;       // the finite upper bounds
    std::vector<uint64_t> cumulative;  // bounds.size() + 1 counts; the last is +Inf (= count)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

  // start, start*factor, ... (n bounds).
  static std::vector<double> ExponentialBounds(double start, double factor, int n);
  // start, start+width, ... (n bounds).
  static std::vector<double> LinearBounds(double start, double width, int n);

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // per bucket (not cumulative), +Inf last
  std::atomic<uint64_t> sum_bits_{0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

// One scrape's text. Samples of one family may be added in any order and from several
// collectors: Render() writes each family once (# HELP, # TYPE, then its samples in the order
// added), families in the order first seen. A family added again with another type or help is
// a programmer error; the sample is dropped and logged.
class Exposition {
 public:
  void Counter(const std::string& name, const std::string& help, const Labels& labels,
               double value);
  void Gauge(const std::string& name, const std::string& help, const Labels& labels,
             double value);
  void Histogram(const std::string& name, const std::string& help, const Labels& labels,
                 const Histogram::Snapshot& h);
  std::string Render() const;

 private:
  struct Family {
    MetricType type;
    std::string help;
    std::string samples;  // rendered lines
  };
  Family* FamilyFor(const std::string& name, MetricType type, const std::string& help);

  std::vector<std::string> order_;
  std::map<std::string, Family> families_;
};

// Text helpers (exposed for tests).
// A label value with \ " and newline escaped.
std::string EscapeLabelValue(const std::string& v);
// Help text with \ and newline escaped.
std::string EscapeHelp(const std::string& v);
// A sample value: integers exactly, others with full precision; +Inf, -Inf, NaN.
std::string FormatValue(double v);
// [a-zA-Z_:][a-zA-Z0-9_:]* (metric names) / [a-zA-Z_][a-zA-Z0-9_]* (label names).
bool ValidMetricName(const std::string& name);
bool ValidLabelName(const std::string& name);

// Metric objects and collectors, rendered together.
class Registry {
 public:
  using Collector = std::function<void(Exposition*)>;

  // The objects live as long as the registry; the pointers stay valid.
  Counter* AddCounter(const std::string& name, const std::string& help, Labels labels = {})
      EXCLUDES(mu_);
  Gauge* AddGauge(const std::string& name, const std::string& help, Labels labels = {})
      EXCLUDES(mu_);
  Histogram* AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds, Labels labels = {}) EXCLUDES(mu_);
  void AddCollector(Collector c) EXCLUDES(mu_);

  // Objects first (in the order added), then the collectors' samples.
  std::string Render() const EXCLUDES(mu_);

 private:
  struct Entry {
    std::string name, help;
    Labels labels;
    MetricType type;
    std::unique_ptr<metrics::Counter> counter;
    std::unique_ptr<metrics::Gauge> gauge;
    std::unique_ptr<metrics::Histogram> histogram;
  };
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ GUARDED_BY(mu_);
  std::vector<Collector> collectors_ GUARDED_BY(mu_);
};

}  // namespace shardps::metrics

#endif  // SHARDPS_COMMON_METRICS_H_
