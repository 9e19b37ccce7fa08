// The coordinator's /metrics (docs/operations.md, "Metrics"): a collector that reads the
// coordinator's membership and counter snapshots at scrape time.
// Thread safety: the collector runs on the metrics thread; Coordinator's accessors are
// thread-safe.
#ifndef SHARDPS_SERVER_COORDINATOR_METRICS_H_
#define SHARDPS_SERVER_COORDINATOR_METRICS_H_

#include "common/metrics.h"
#include "server/coordinator.h"

namespace shardps::control {

// Every shardps_coordinator_* metric of these snapshots.
void CollectCoordinatorMetrics(const Membership& membership, const CoordinatorCounters& c,
                               metrics::Exposition* x);
// A collector of `coordinator`'s metrics; it must outlive the registry's renders.
void AddCoordinatorMetrics(const Coordinator* coordinator, metrics::Registry* registry);

}  // namespace shardps::control

#endif  // SHARDPS_SERVER_COORDINATOR_METRICS_H_
