// common/metrics_flags.h
#include "common/metrics_flags.h"

#include <gflags/gflags.h>

DEFINE_int32(metrics_port, 0,
             "Serve Prometheus metrics at http://--metrics_address:PORT/metrics (0: off; -1: "
             "any free port, see --metrics_address_file)");
DEFINE_string(metrics_address, "127.0.0.1",
              "Address the /metrics endpoint binds (loopback by default; 0.0.0.0 or :: only if "
              "you mean every interface)");
DEFINE_string(metrics_address_file, "",
              "Write the /metrics endpoint's bound ip:port here once listening (%p: the pid)");

namespace shardps::metrics {

StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsFromFlags(
    MetricsHttpServer::RenderFn render) {
  if (FLAGS_metrics_port == 0) return std::unique_ptr<MetricsHttpServer>();
  if (FLAGS_metrics_port < -1 || FLAGS_metrics_port > 65535) {
    return InvalidArgumentError("--metrics_port must be 0 (off), -1 (any) or 1..65535");
  }
  HttpServerOptions o;
  o.host = FLAGS_metrics_address;
  o.port = FLAGS_metrics_port < 0 ? 0 : FLAGS_metrics_port;
  o.address_file = FLAGS_metrics_address_file;
  return MetricsHttpServer::Start(o, std::move(render));
}

}  // namespace shardps::metrics
