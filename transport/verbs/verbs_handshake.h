// Connection bootstrap of the verbs provider: a small TCP socket per endpoint carries the queue
// pair attributes both ways, then stays open as a liveness side channel (EOF = peer gone).
//
// Wire format, version 1 (all integers little-endian), sent by both sides right after the TCP
// connection is established, and read with the connect timeout:
//
//   qp_info  := magic:u32 = 0x42565053 ("SPVB") | version:u16 = 1 | link_layer:u8 (1 IB,
//               2 Ethernet) | mtu:u8 (ibv_mtu 1..5 = 256..4096) | qpn:u32 (< 2^24, != 0) |
//               psn:u32 (< 2^24) | lid:u16 (!= 0 on IB) | responder_resources:u8 (1..255,
//               the peer's max_dest_rd_atomic) | reserved:u8 = 0 | recv_depth:u32 |
//               gid:16 bytes (!= 0 on Ethernet)                                  -- 40 bytes
//   ready    := magic:u32 = 0x59445452 ("RTDY")      -- sent once the local QP is in RTS
//
// Either side validates every field; a malformed or short message fails that connect/accept
// only. After `ready` nothing more is sent; the socket's EOF or reset is the peer's death notice.
//
// Thread safety: free functions, no shared state.
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_HANDSHAKE_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_HANDSHAKE_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "common/fd.h"
#include "common/status.h"

namespace shardps::transport::verbs {

constexpr uint32_t kHandshakeMagic = 0x42565053;  // "SPVB" on the wire
constexpr uint32_t kReadyMagic = 0x59445452;      // "RTDY" on the wire
constexpr uint16_t kHandshakeVersion = 1;
constexpr size_t kQpInfoWireSize = 40;

struct QpInfo {
  uint8_t link_layer = 0;  // 1 = InfiniBand, 2 = Ethernet (IBV_LINK_LAYER_*)
  uint8_t mtu = 0;         // enum ibv_mtu
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t responder_resources = 0;
  uint32_t recv_depth = 0;
  uint8_t gid[16] = {};
};

void EncodeQpInfo(const QpInfo& info, uint8_t out[kQpInfoWireSize]);
// Validates the message; the error says which field is wrong.
StatusOr<QpInfo> DecodeQpInfo(const uint8_t* in, size_t len);

using Deadline = std::chrono::steady_clock::time_point;

using ::shardps::UniqueFd;  // common/fd.h

// "host:port" (or "[v6]:port"); an empty host means `default_host`, and then any address.
// *resolved receives "ip:port" of the bound socket.
StatusOr<UniqueFd> TcpListen(const std::string& address, const std::string& default_host,
                             std::string* resolved_ip, int* resolved_port);
// One waiting connection without blocking (an invalid fd when none waits). *peer receives
// "ip:port", *peer_ip the address alone.
StatusOr<UniqueFd> TcpAcceptNow(int listen_fd, std::string* peer, std::string* peer_ip);
// Connects to "host:port", source bound to bind_ip when not empty.
// A refused connect is retried until the deadline when retry_refused (a listener not up yet).
StatusOr<UniqueFd> TcpConnect(const std::string& address, const std::string& bind_ip,
                              Deadline deadline, std::string* local, bool retry_refused = true);
// Non-blocking liveness probe of a bootstrap socket: OK while the peer keeps it open (stray
// bytes are read and dropped).
Status ProbePeer(int fd);

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_HANDSHAKE_H_
