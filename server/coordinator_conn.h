// Coordinator::Conn: one control connection, as the coordinator's loop thread keeps it. Internal
// to server/coordinator*.cc. Loop thread only.
#ifndef SHARDPS_SERVER_COORDINATOR_CONN_H_
#define SHARDPS_SERVER_COORDINATOR_CONN_H_

#include <chrono>
#include <deque>
#include <string>

#include "common/failure_detector.h"
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
  // Liveness (joined members): the detector learns the member's heartbeat intervals; a silence
  // past its suspicion timeout makes it suspected and probed (docs/fault-tolerance.md).
  PhiAccrualDetector detector;
  uint64_t last_sent_us = 0;  // the previous heartbeat's send timestamp (member clock)
  bool suspected = false;
  Clock::time_point suspected_at{};
  Clock::time_point probed_at{};
  // While suspected: since when the member's kernel has had our data unacknowledged without a
  // break (time_point{} = nothing outstanding at the last look).
  Clock::time_point unacked_since{};
  // A status asker (StatusRequest, never joined): answered once, closed once the reply is out.
  bool status_answered = false;
  // A member's latest heartbeat stats (MemberStats), and the (time, bytes, pushes) samples of
  // its heartbeats of the last 1-2 s, oldest first (at most kMaxRateSamples): its rates are
  // measured over them (a sliding window, moved at every heartbeat).
  struct RateSample {
    Clock::time_point at;
    uint64_t bytes = 0;
    uint64_t pushes = 0;
  };
  static constexpr size_t kMaxRateSamples = 64;
  bool has_stats = false;
  MemberStats stats;
  std::deque<RateSample> rate_samples;
  double bytes_per_second = 0;
  double pushes_per_second = 0;

  Conn(size_t max_frame, const PhiAccrualDetector::Options& liveness)
      : decoder(max_frame), detector(liveness) {}
};

}  // namespace shardps::control

#endif  // SHARDPS_SERVER_COORDINATOR_CONN_H_
