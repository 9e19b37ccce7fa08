// worker/client_metrics.h: every shardps_client_* metric. Names and meanings are listed in
// docs/operations.md ("Metrics"); keep the two in step.
#include "worker/client_metrics.h"

namespace shardps::worker {

ClientMetrics::ClientMetrics() : step_staleness_({0, 1, 2, 3, 4, 6, 8, 16, 32, 64}) {}

StatusOr<std::unique_ptr<ClientMetrics>> ClientMetrics::Start(const ClientOptions& options) {
  if (options.metrics_port == 0) return std::unique_ptr<ClientMetrics>();
  if (options.metrics_port < -1 || options.metrics_port > 65535) {
    return InvalidArgumentError(
        "metrics_port (or SHARDPS_METRICS_PORT) must be 0 (off), -1 (any free port) or 1..65535");
  }
  std::unique_ptr<ClientMetrics> m(new ClientMetrics());
  m->registry_.AddCollector([p = m.get()](metrics::Exposition* x) { p->Collect(x); });
  metrics::HttpServerOptions o;
  o.host = options.metrics_address.empty() ? "127.0.0.1" : options.metrics_address;
  o.port = options.metrics_port < 0 ? 0 : options.metrics_port;
  o.address_file = options.metrics_address_file;
  ASSIGN_OR_RETURN(m->http_, metrics::MetricsHttpServer::Start(
                                 o, [p = m.get()] { return p->registry_.Render(); }));
  return m;
}

void ClientMetrics::Publish(const ClientCounters& c, uint32_t rank, uint64_t clock) {
  published_at_ = std::chrono::steady_clock::now();
  MutexLock l(&mu_);
  counters_ = c;
  rank_ = rank;
  clock_ = clock;
}

void ClientMetrics::Collect(metrics::Exposition* x) const {
  ClientCounters c;
  uint32_t rank;
  uint64_t clock;
  {
    MutexLock l(&mu_);
    c = counters_;
    rank = rank_;
    clock = clock_;
  }
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    x->Counter(name, help, {}, static_cast<double>(v));
  };
  x->Gauge("shardps_client_rank", "This worker's rank.", {}, rank);
  x->Gauge("shardps_client_clock", "This worker's clock (steps taken).", {},
           static_cast<double>(clock));
  counter("shardps_client_pushes_total", "Chunk pushes.", c.pushes);
  counter("shardps_client_pulls_total", "Chunk pulls (consistent snapshots).", c.pulls);
  counter("shardps_client_pushed_bytes_total", "Bytes pushed.", c.bytes_pushed);
  counter("shardps_client_pulled_bytes_total", "Bytes pulled.", c.bytes_pulled);
  counter("shardps_client_pull_retries_total",
          "Torn or not-yet-ready reads that were repeated.", c.pull_retries);
  counter("shardps_client_pull_other_buffer_total",
          "Pulls of small chunks served from the other buffer read alongside the guessed one.",
          c.pull_other_buffer);
  counter("shardps_client_failovers_total",
          "Server groups this worker moved to a promoted backup.", c.failovers);
  counter("shardps_client_pushes_resent_total", "Pushes sent again after a failover.",
          c.pushes_resent);
  counter("shardps_client_pushes_lost_total",
          "Pushes neither replicated nor resendable (ASP/SSP only).", c.pushes_lost);
  counter("shardps_client_reconnects_total",
          "Data-path failures survived by reconnecting to the same server.", c.reconnects);
  counter("shardps_client_heartbeats_sent_total", "Heartbeats sent to the coordinator.",
          c.heartbeats_sent);
  counter("shardps_client_control_messages_total",
          "Control messages sent, heartbeats excluded (flat in steady state).",
          c.control_messages_sent);
  counter("shardps_client_rows_pulled_total", "Distinct rows read (PullRows).", c.rows_pulled);
  counter("shardps_client_row_reads_total", "One-sided reads posted for rows.", c.row_reads);
  counter("shardps_client_row_retries_total", "Rows read again (torn or behind the bound).",
          c.row_retries);
  counter("shardps_client_rows_pushed_total", "Distinct gradient rows pushed.", c.rows_pushed);
  counter("shardps_client_row_cache_hits_total", "Rows served from the worker's row cache.",
          c.row_cache_hits);
  counter("shardps_client_row_cache_misses_total", "Rows not in the worker's row cache.",
          c.row_cache_misses);
  counter("shardps_client_row_cache_staleness_clocks_total",
          "Sum over row-cache hits of the clocks the row lagged (mean: divide by hits).",
          c.row_cache_staleness);
  x->Histogram("shardps_client_step_staleness_clocks",
               "Per Step(): its clock minus the oldest min clock (+1) of the weights it pulled "
               "(BSP 0, SSP at most s).",
               {}, step_staleness_.snapshot());
}

}  // namespace shardps::worker
