// The shard server's /metrics (docs/operations.md, "Metrics"): a collector that reads the
// server's counter snapshot, per-peer errors and histograms (ServerStats) at scrape time.
// Thread safety: the collector runs on the metrics thread and reads only thread-safe state.
#ifndef SHARDPS_SERVER_SERVER_METRICS_H_
#define SHARDPS_SERVER_SERVER_METRICS_H_

#include "common/metrics.h"
#include "server/server_stats.h"

namespace shardps::server {

class ShardServer;

// Writes every shardps_server_* metric of `stats` (server rank `rank`, read at each call).
void CollectServerMetrics(const ServerStats& stats, uint32_t rank, metrics::Exposition* x);
// A collector of `server`'s metrics; `server` must outlive the registry's renders.
void AddServerMetrics(const ShardServer* server, metrics::Registry* registry);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SERVER_METRICS_H_
