// Coordinator::Conn: one control connection, as the coordinator's loop thread keeps it. Internal
// to server/coordinator*.cc. Loop thread only.
#ifndef SHARDPS_SERVER_COORDINATOR_CONN_H_
#define SHARDPS_SERVER_COORDINATOR_CONN_H_

#include <chrono>
#include <string>

#include "common/fd.h"
#include "proto/framing.h"
#include "server/coordinator.h"

namespace shardps::control {

using Clock = std::chrono::steady_clock;

struct Coordinator::Conn {
  UniqueFd fd;
  std::string peer;
  Clock::time_point opened;
  Clock::time_point last_heard;
  bool magic_ok = false;
  std::string magic_buf;
  FrameDecoder decoder;
  std::string out;  // pending output
  size_t out_off = 0;
  bool joined = false;
  bool has_model = false;  // a worker that registered the model (it gets shard map updates)
  Member member;
  bool closing = false;

  explicit Conn(size_t max_frame) : decoder(max_frame) {}
};

}  // namespace shardps::control

#endif  // SHARDPS_SERVER_COORDINATOR_CONN_H_
