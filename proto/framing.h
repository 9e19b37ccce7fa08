// Control-plane framing: how Envelope messages travel over a TCP connection.
//
//   connection = magic frame*
//   magic      = "SHPSCTL1"                 ; 8 bytes, sent once by the connecting side
//   frame      = length envelope
//   length     = u32 little-endian, 1..max_frame_bytes
//   envelope   = length bytes of a serialized shardps.control.Envelope with a body set
//
// A frame longer than the limit, an envelope that does not parse or has no body, or a wrong
// magic is a protocol error: the receiver reports it, closes the connection and keeps running.
//
// Thread safety: FrameDecoder is owned by one thread. The free functions are stateless.
#ifndef SHARDPS_PROTO_FRAMING_H_
#define SHARDPS_PROTO_FRAMING_H_

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"
#include "proto/control.pb.h"

namespace shardps::control {

inline constexpr std::string_view kMagic = "SHPSCTL1";
inline constexpr size_t kDefaultMaxFrameBytes = 16u << 20;

// Serializes one frame (length prefix + envelope).
StatusOr<std::string> EncodeFrame(const Envelope& envelope, size_t max_frame_bytes =
                                                                 kDefaultMaxFrameBytes);

// Incremental decoder for a byte stream that starts after the magic.
class FrameDecoder {
 public:
  explicit FrameDecoder(size_t max_frame_bytes = kDefaultMaxFrameBytes)
      : max_frame_bytes_(max_frame_bytes) {}

  // Appends received bytes.
  void Feed(const char* data, size_t n) { buffer_.append(data, n); }
  // Decodes the next complete frame into *out: true if one was decoded, false if more bytes
  // are needed, an error (INVALID_ARGUMENT / RESOURCE_EXHAUSTED) if the stream is malformed.
  // After an error the decoder is poisoned: the connection must be closed.
  StatusOr<bool> Next(Envelope* out);
  size_t buffered() const { return buffer_.size() - consumed_; }

 private:
  size_t max_frame_bytes_;
  std::string buffer_;
  size_t consumed_ = 0;
  Status error_;
};

// Blocking helpers for clients (setup paths; the coordinator uses FrameDecoder directly).
Status SendMagic(int fd, std::chrono::milliseconds timeout);
Status CheckMagic(int fd, std::chrono::milliseconds timeout);
Status SendEnvelope(int fd, const Envelope& envelope, std::chrono::milliseconds timeout);
// Reads until one envelope is decoded or the timeout passes.
StatusOr<Envelope> ReceiveEnvelope(int fd, FrameDecoder* decoder,
                                   std::chrono::milliseconds timeout);

// "join", "heartbeat", ...: the body's name, for logs.
const char* BodyName(const Envelope& envelope);

}  // namespace shardps::control

#endif  // SHARDPS_PROTO_FRAMING_H_
