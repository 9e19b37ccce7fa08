// ClientMetrics: a client's /metrics endpoint (ClientOptions::metrics_port; docs/operations.md,
// "Metrics"). The training thread publishes a copy of its counters (once per Step, and at most
// every 100 ms from a Wait outside Step) and observes each step's staleness; the endpoint's
// thread renders them.
//
// Thread safety: Publish, PublishDue and ObserveStepStaleness from the client's (training)
// thread; the render runs on the endpoint's thread. mu_ guards the published copy only.
#ifndef SHARDPS_WORKER_CLIENT_METRICS_H_
#define SHARDPS_WORKER_CLIENT_METRICS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "shardps/client.h"

namespace shardps::worker {

class ClientMetrics {
 public:
  // The endpoint `options` ask for (null, OK, when metrics_port is 0). An invalid port, or one
  // that cannot be bound, is an error.
  static StatusOr<std::unique_ptr<ClientMetrics>> Start(const ClientOptions& options);
  ~ClientMetrics() = default;

  // Whether a new copy is due (100 ms since the last): one clock read.
  bool PublishDue() const {
    return std::chrono::steady_clock::now() - published_at_ >= std::chrono::milliseconds(100);
  }
  void Publish(const ClientCounters& c, uint32_t rank, uint64_t clock) EXCLUDES(mu_);
  // The clocks by which the weights a step pulled lag its own clock (BSP 0, SSP at most s).
  void ObserveStepStaleness(uint64_t clocks) {
    step_staleness_.Observe(static_cast<double>(clocks));
  }

  std::string address() const { return http_ ? http_->address() : ""; }

 private:
  ClientMetrics();
  void Collect(metrics::Exposition* x) const EXCLUDES(mu_);

  std::chrono::steady_clock::time_point published_at_{};  // training thread only
  mutable Mutex mu_;
  ClientCounters counters_ GUARDED_BY(mu_);
  uint32_t rank_ GUARDED_BY(mu_) = 0;
  uint64_t clock_ GUARDED_BY(mu_) = 0;
  metrics::Histogram step_staleness_;
  metrics::Registry registry_;
  std::unique_ptr<metrics::MetricsHttpServer> http_;  // last: stopped before the rest goes
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CLIENT_METRICS_H_
