#include "transport/flags.h"

#include <algorithm>

#include <gflags/gflags.h>

DEFINE_string(transport, "auto",
              "Data-path transport: verbs, tcp, shm or auto. A transport asked for by name that "
              "cannot start is an error; auto logs what it picked and why.");
DEFINE_string(rdma_device, "", "verbs: RDMA device name (empty: the one owning --bind_ip, else "
                               "the first device with an active port)");
DEFINE_int32(rdma_port, 1, "verbs: HCA port number");
DEFINE_int32(rdma_gid_index, -1,
             "verbs: GID index; -1 selects the RoCEv2 IPv4-mapped GID automatically");
DEFINE_string(bind_ip, "", "Local IP address to listen on and to connect from (empty: any)");
DEFINE_int32(rdma_max_inline, 128, "verbs: payloads up to this size are posted inline");
DEFINE_int32(rdma_signal_interval, 32,
             "verbs: one signaled work request per this many unsignaled ones");
DEFINE_int32(rdma_timeout, 14, "verbs: QP local ACK timeout exponent (4.096us * 2^t)");
DEFINE_int32(rdma_retry_count, 7, "verbs: QP transport retry count (0..7)");
DEFINE_bool(tcp_tls, false,
            "tcp: TLS 1.3 on every data-path connection (PSK from the data-path authentication; "
            "set it on the servers: workers follow, see docs/security.md)");
DEFINE_int32(tcp_read_wait_us, 1000,
             "tcp: the longest a read request waits for this process to be done with the "
             "immediates (pushes) that arrived before it on its connection, so that a pull "
             "right behind a push reads the applied value (0: never waits; docs/transport.md)");

namespace shardps::transport {

FabricOptions FabricOptionsFromFlags() {
  FabricOptions o;
  o.provider = FLAGS_transport;
  o.rdma_device = FLAGS_rdma_device;
  o.rdma_port = FLAGS_rdma_port;
  o.rdma_gid_index = FLAGS_rdma_gid_index;
  o.bind_ip = FLAGS_bind_ip;
  o.max_inline = FLAGS_rdma_max_inline;
  o.signal_interval = FLAGS_rdma_signal_interval;
  o.rdma_timeout = FLAGS_rdma_timeout;
  o.rdma_retry_count = FLAGS_rdma_retry_count;
  o.tcp_tls = FLAGS_tcp_tls;
  o.tcp_read_wait_us = std::max(0, FLAGS_tcp_read_wait_us);
  return o;
}

}  // namespace shardps::transport
