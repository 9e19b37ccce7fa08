#include "proto/framing.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "common/net.h"

namespace shardps::control {

using Clock = std::chrono::steady_clock;

StatusOr<std::string> EncodeFrame(const Envelope& envelope, size_t max_frame_bytes) {
  if (envelope.body_case() == Envelope::BODY_NOT_SET) {
    return InvalidArgumentError("control frame: envelope has no body");
  }
  const size_t n = envelope.ByteSizeLong();
  if (n == 0 || n > max_frame_bytes) {
    return ResourceExhaustedError("control frame: " + std::to_string(n) +
                                  " bytes exceeds the limit of " + std::to_string(max_frame_bytes));
  }
  std::string out(4 + n, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  if (!envelope.SerializeToArray(out.data() + 4, static_cast<int>(n))) {
    return InternalError("control frame: serialization failed");
  }
  return out;
}

StatusOr<bool> FrameDecoder::Next(Envelope* out) {
  if (!error_.ok()) return error_;
  const size_t avail = buffer_.size() - consumed_;
  if (avail < 4) return false;
  const auto* p = reinterpret_cast<const unsigned char*>(buffer_.data() + consumed_);
  const size_t n = static_cast<size_t>(p[0]) | (static_cast<size_t>(p[1]) << 8) |
                   (static_cast<size_t>(p[2]) << 16) | (static_cast<size_t>(p[3]) << 24);
  if (n == 0 || n > max_frame_bytes_) {
    error_ = ResourceExhaustedError("control frame of " + std::to_string(n) + " bytes (limit " +
                                    std::to_string(max_frame_bytes_) + ")");
    return error_;
  }
  if (avail < 4 + n) return false;
  out->Clear();
  if (!out->ParseFromArray(buffer_.data() + consumed_ + 4, static_cast<int>(n))) {
    error_ = InvalidArgumentError("control frame does not parse as an Envelope");
    return error_;
  }
  if (out->body_case() == Envelope::BODY_NOT_SET) {
    error_ = InvalidArgumentError("control frame has no (known) body");
    return error_;
  }
  consumed_ += 4 + n;
  if (consumed_ > (1u << 20) && consumed_ * 2 > buffer_.size()) {
    buffer_.erase(0, consumed_);
    consumed_ = 0;
  }
  return true;
}

Status SendMagic(int fd, std::chrono::milliseconds timeout) {
  return net::SendAll(fd, kMagic.data(), kMagic.size(), timeout);
}

Status CheckMagic(int fd, std::chrono::milliseconds timeout) {
  char buf[8];
  RETURN_IF_ERROR(net::RecvAll(fd, buf, sizeof(buf), timeout));
  if (std::string_view(buf, 8) != kMagic) {
    return InvalidArgumentError("not a ShardPS control connection (bad magic)");
  }
  return Status::OK();
}

Status SendEnvelope(int fd, const Envelope& envelope, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(std::string frame, EncodeFrame(envelope));
  return net::SendAll(fd, frame.data(), frame.size(), timeout);
}

StatusOr<Envelope> ReceiveEnvelope(int fd, FrameDecoder* decoder,
                                   std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  Envelope env;
  while (true) {
    ASSIGN_OR_RETURN(bool got, decoder->Next(&env));
    if (got) return env;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return DeadlineExceededError("control: no message in time");
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno != EINTR) return ErrnoError("poll", errno);
    if (r <= 0) continue;
    char buf[64 << 10];
    ASSIGN_OR_RETURN(size_t k, net::RecvSome(fd, buf, sizeof(buf), "control"));
    decoder->Feed(buf, k);
  }
}

const char* BodyName(const Envelope& e) {
  switch (e.body_case()) {
    case Envelope::kJoin:
      return "join";
    case Envelope::kJoinReply:
      return "join_reply";
    case Envelope::kHeartbeat:
      return "heartbeat";
    case Envelope::kLeave:
      return "leave";
    case Envelope::kMembership:
      return "membership";
    case Envelope::kError:
      return "error";
    case Envelope::kRegisterModel:
      return "register_model";
    case Envelope::kAssignShards:
      return "assign_shards";
    case Envelope::kShardsReady:
      return "shards_ready";
    case Envelope::kShardMap:
      return "shard_map";
    case Envelope::kReplicaTarget:
      return "replica_target";
    case Envelope::kPromote:
      return "promote";
    case Envelope::kCheckpoint:
      return "checkpoint";
    case Envelope::kHeartbeatAck:
      return "heartbeat_ack";
    case Envelope::kReplicaSynced:
      return "replica_synced";
    case Envelope::kStatusRequest:
      return "status_request";
    case Envelope::kStatusReply:
      return "status_reply";
    case Envelope::kBarrier:
      return "barrier";
    case Envelope::kBarrierRelease:
      return "barrier_release";
    case Envelope::BODY_NOT_SET:
      return "none";
  }
  return "unknown";
}

}  // namespace shardps::control
