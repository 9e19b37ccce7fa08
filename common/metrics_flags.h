// The daemons' /metrics flags (--metrics_port, --metrics_address, --metrics_address_file),
// defined once here for shardps_server and shardps_coordinator (docs/operations.md, "Metrics").
// Thread safety: call from main() after flag parsing.
#ifndef SHARDPS_COMMON_METRICS_FLAGS_H_
#define SHARDPS_COMMON_METRICS_FLAGS_H_

#include <memory>

#include "common/metrics_http.h"
#include "common/status.h"

namespace shardps::metrics {

// The endpoint the flags ask for, serving `render`; null (and OK) when --metrics_port=0.
// An endpoint that cannot start (a port in use, a bad address) is an error.
StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsFromFlags(
    MetricsHttpServer::RenderFn render);

}  // namespace shardps::metrics

#endif  // SHARDPS_COMMON_METRICS_FLAGS_H_
