// Metric objects and the Prometheus text format 0.0.4 (common/metrics.h).
#include "common/metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <glog/logging.h>

namespace shardps::metrics {
namespace {

uint64_t Bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}
double FromBits(uint64_t b) {
  double v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// name{l1="v1",l2="v2"} value\n; `extra` is one more label (le) written last.
void AppendSample(std::string* out, const std::string& name, const Labels& labels,
                  const std::pair<std::string, std::string>* extra, double value) {
  *out += name;
  if (!labels.empty() || extra != nullptr) {
    *out += '{';
    bool first = true;
    auto add = [&](const std::pair<std::string, std::string>& l) {
      if (!first) *out += ',';
      first = false;
      *out += l.first;
      *out += "=\"";
      *out += EscapeLabelValue(l.second);
      *out += '"';
    };
    for (const auto& l : labels) add(l);
    if (extra != nullptr) add(*extra);
    *out += '}';
  }
  *out += ' ';
  *out += FormatValue(value);
  *out += '\n';
}

bool LabelsValid(const Labels& labels) {
  for (const auto& l : labels) {
    if (!ValidLabelName(l.first) || l.first == "le" || l.first.rfind("__", 0) == 0) return false;
  }
  return true;
}

}  // namespace

void Gauge::Set(double v) { bits_.store(Bits(v), std::memory_order_relaxed); }
double Gauge::value() const { return FromBits(bits_.load(std::memory_order_relaxed)); }

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)),
      buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    CHECK(std::isfinite(bounds_[i])) << "histogram bound " << bounds_[i] << " is not finite";
    CHECK(i == 0 || bounds_[i] > bounds_[i - 1]) << "histogram bounds must increase";
  }
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
  sum_bits_.store(Bits(0.0), std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;
  // First bound >= v (le is inclusive); bucket lists are short, a linear scan is fastest.
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  uint64_t old = sum_bits_.load(std::memory_order_relaxed);
  while (!sum_bits_.compare_exchange_weak(old, Bits(FromBits(old) + v),
                                          std::memory_order_relaxed)) {
  }
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += buckets_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = acc;
  }
  s.count = acc;  // = the +Inf bucket, by construction
  s.sum = FromBits(sum_bits_.load(std::memory_order_relaxed));
  return s;
}

std::vector<double> Histogram::ExponentialBounds(double start, double factor, int n) {
  std::vector<double> b;
  double v = start;
  for (int i = 0; i < n; ++i, v *= factor) b.push_back(v);
  return b;
}

std::vector<double> Histogram::LinearBounds(double start, double width, int n) {
  std::vector<double> b;
  for (int i = 0; i < n; ++i) b.push_back(start + width * i);
  return b;
}

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    // The shortest of %.15g..%.17g that reads back as the same double (1.6e-05, not
    // 1.6000000000000001e-05).
    for (int digits = 15; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
  }
  return buf;
}

bool ValidMetricName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool ValidLabelName(const std::string& name) {
  return ValidMetricName(name) && name.find(':') == std::string::npos;
}

Exposition::Family* Exposition::FamilyFor(const std::string& name, MetricType type,
                                          const std::string& help) {
  if (!ValidMetricName(name)) {
    LOG_FIRST_N(ERROR, 8) << "metrics: invalid metric name '" << name << "' dropped";
    return nullptr;
  }
  auto it = families_.find(name);
  if (it == families_.end()) {
    order_.push_back(name);
    return &families_.emplace(name, Family{type, help, ""}).first->second;
  }
  if (it->second.type != type) {
    LOG_FIRST_N(ERROR, 8) << "metrics: '" << name << "' added as a " << TypeName(type)
                          << " and a " << TypeName(it->second.type) << "; sample dropped";
    return nullptr;
  }
  return &it->second;
}

void Exposition::Counter(const std::string& name, const std::string& help, const Labels& labels,
                         double value) {
  if (!LabelsValid(labels)) {
    LOG_FIRST_N(ERROR, 8) << "metrics: invalid label name in '" << name << "'; dropped";
    return;
  }
  if (Family* f = FamilyFor(name, MetricType::kCounter, help)) {
    AppendSample(&f->samples, name, labels, nullptr, value);
  }
}

void Exposition::Gauge(const std::string& name, const std::string& help, const Labels& labels,
                       double value) {
  if (!LabelsValid(labels)) {
    LOG_FIRST_N(ERROR, 8) << "metrics: invalid label name in '" << name << "'; dropped";
    return;
  }
  if (Family* f = FamilyFor(name, MetricType::kGauge, help)) {
    AppendSample(&f->samples, name, labels, nullptr, value);
  }
}

void Exposition::Histogram(const std::string& name, const std::string& help,
                           const Labels& labels, const Histogram::Snapshot& h) {
  if (!LabelsValid(labels)) {
    LOG_FIRST_N(ERROR, 8) << "metrics: invalid label name in '" << name << "'; dropped";
    return;
  }
  Family* f = FamilyFor(name, MetricType::kHistogram, help);
  if (f == nullptr) return;
  const std::string bucket = name + "_bucket";
  for (size_t i = 0; i < h.cumulative.size(); ++i) {
    const std::pair<std::string, std::string> le{
        "le", i < h.bounds.size() ? FormatValue(h.bounds[i]) : "+Inf"};
    AppendSample(&f->samples, bucket, labels, &le, static_cast<double>(h.cumulative[i]));
  }
  AppendSample(&f->samples, name + "_sum", labels, nullptr, h.sum);
  AppendSample(&f->samples, name + "_count", labels, nullptr, static_cast<double>(h.count));
}

std::string Exposition::Render() const {
  std::string out;
  for (const std::string& name : order_) {
    const Family& f = families_.at(name);
    out += "# HELP " + name + " " + EscapeHelp(f.help) + "\n";
    out += "# TYPE " + name + " " + TypeName(f.type) + "\n";
    out += f.samples;
  }
  return out;
}

Counter* Registry::AddCounter(const std::string& name, const std::string& help, Labels labels) {
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->help = help;
  e->labels = std::move(labels);
  e->type = MetricType::kCounter;
  e->counter = std::make_unique<metrics::Counter>();
  metrics::Counter* c = e->counter.get();
  MutexLock l(&mu_);
  entries_.push_back(std::move(e));
  return c;
}

Gauge* Registry::AddGauge(const std::string& name, const std::string& help, Labels labels) {
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->help = help;
  e->labels = std::move(labels);
  e->type = MetricType::kGauge;
  e->gauge = std::make_unique<metrics::Gauge>();
  metrics::Gauge* g = e->gauge.get();
  MutexLock l(&mu_);
  entries_.push_back(std::move(e));
  return g;
}

Histogram* Registry::AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> bounds, Labels labels) {
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->help = help;
  e->labels = std::move(labels);
  e->type = MetricType::kHistogram;
  e->histogram = std::make_unique<metrics::Histogram>(std::move(bounds));
  metrics::Histogram* h = e->histogram.get();
  MutexLock l(&mu_);
  entries_.push_back(std::move(e));
  return h;
}

void Registry::AddCollector(Collector c) {
  MutexLock l(&mu_);
  collectors_.push_back(std::move(c));
}

std::string Registry::Render() const {
  Exposition x;
  MutexLock l(&mu_);
  for (const auto& e : entries_) {
    switch (e->type) {
      case MetricType::kCounter:
        x.Counter(e->name, e->help, e->labels, static_cast<double>(e->counter->value()));
        break;
      case MetricType::kGauge:
        x.Gauge(e->name, e->help, e->labels, e->gauge->value());
        break;
      case MetricType::kHistogram:
        x.Histogram(e->name, e->help, e->labels, e->histogram->snapshot());
        break;
    }
  }
  for (const Collector& c : collectors_) c(&x);
  return x.Render();
}

}  // namespace shardps::metrics
