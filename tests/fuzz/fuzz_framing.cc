// libFuzzer target: the control-plane FrameDecoder (proto/framing.h).
//
// Input layout:
//   byte 0            bits 0-3: number of split points k (0..15); bits 4-5: the decoder's
//                     frame limit (16 MiB, 64 B, 1 KiB, 64 KiB)
//   bytes 1..k        piece sizes (each byte + 1), the stream fed in that many pieces; what
//                     is left after the last piece goes in one more piece
//   the rest          the byte stream after the magic (frames)
//
// Checks, on data:
//  * piecewise feeding decodes exactly the envelopes, and ends in exactly the state (error code
//    or "need more bytes", bytes still buffered), that feeding the stream at once does;
//  * a poisoned decoder stays poisoned;
//  * every decoded envelope re-encodes; decoding the re-encoded frame gives one envelope equal
//    to it, with nothing left over; and re-encoding that gives the same bytes (a fixed point).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/message_differencer.h>

#include "proto/framing.h"

namespace {

using shardps::StatusCode;
using shardps::control::EncodeFrame;
using shardps::control::Envelope;
using shardps::control::FrameDecoder;

[[noreturn]] void Fail(const char* what) {
  fprintf(stderr, "fuzz_framing: check failed: %s\n", what);
  abort();
}
#define FUZZ_CHECK(cond)      \
  do {                        \
    if (!(cond)) Fail(#cond); \
  } while (0)

struct Outcome {
  std::vector<std::string> frames;  // each decoded envelope, re-encoded
  bool error = false;
  StatusCode code = StatusCode::kOk;
  size_t buffered = 0;
};

// Decodes everything available; records envelopes; stops at an error.
void Drain(FrameDecoder* d, Outcome* o) {
  while (!o->error) {
    Envelope e;
    auto got = d->Next(&e);
    if (!got.ok()) {
      o->error = true;
      o->code = got.status().code();
      FUZZ_CHECK(o->code == StatusCode::kInvalidArgument ||
                 o->code == StatusCode::kResourceExhausted);
      // Poisoned: the same error again, nothing decoded.
      auto again = d->Next(&e);
      FUZZ_CHECK(!again.ok() && again.status().code() == o->code);
      return;
    }
    if (!*got) return;
    FUZZ_CHECK(e.body_case() != Envelope::BODY_NOT_SET);
    auto frame = EncodeFrame(e);
    FUZZ_CHECK(frame.ok());
    // Round trip: the re-encoded frame decodes to one equal envelope, and is a fixed point.
    FrameDecoder d2;
    d2.Feed(frame->data(), frame->size());
    Envelope e2;
    auto got2 = d2.Next(&e2);
    FUZZ_CHECK(got2.ok() && *got2);
    FUZZ_CHECK(d2.buffered() == 0);
    FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(e, e2));
    auto frame2 = EncodeFrame(e2);
    FUZZ_CHECK(frame2.ok() && *frame2 == *frame);
    o->frames.push_back(std::move(*frame));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Envelopes with invalid UTF-8 in string fields fail to parse, and protobuf logs each one.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static constexpr size_t kLimits[4] = {shardps::control::kDefaultMaxFrameBytes, 64, 1024,
                                        64 << 10};
  const size_t limit = kLimits[(data[0] >> 4) & 3];
  size_t k = data[0] & 15;
  if (k > size - 1) k = size - 1;
  const uint8_t* sizes = data + 1;
  const char* stream = reinterpret_cast<const char*>(data + 1 + k);
  const size_t stream_len = size - 1 - k;

  // Piecewise.
  Outcome piecewise;
  FrameDecoder d(limit);
  size_t off = 0;
  for (size_t i = 0; i <= k && off < stream_len; ++i) {
    size_t n = i < k ? static_cast<size_t>(sizes[i]) + 1 : stream_len - off;
    if (n > stream_len - off) n = stream_len - off;
    d.Feed(stream + off, n);
    off += n;
    Drain(&d, &piecewise);
  }
  FUZZ_CHECK(off == stream_len);
  if (!piecewise.error) piecewise.buffered = d.buffered();

  // At once.
  Outcome whole;
  FrameDecoder w(limit);
  w.Feed(stream, stream_len);
  Drain(&w, &whole);
  if (!whole.error) whole.buffered = w.buffered();

  FUZZ_CHECK(piecewise.frames == whole.frames);
  FUZZ_CHECK(piecewise.error == whole.error);
  FUZZ_CHECK(piecewise.code == whole.code);
  FUZZ_CHECK(piecewise.buffered == whole.buffered);
  if (!whole.error) {
    // What is left is the stream's tail and less than one whole frame.
    FUZZ_CHECK(whole.buffered <= stream_len);
    if (whole.buffered >= 4) {
      const auto* p = reinterpret_cast<const uint8_t*>(stream + stream_len - whole.buffered);
      const size_t n = static_cast<size_t>(p[0]) | (static_cast<size_t>(p[1]) << 8) |
                       (static_cast<size_t>(p[2]) << 16) | (static_cast<size_t>(p[3]) << 24);
      FUZZ_CHECK(n >= 1 && n <= limit && whole.buffered < 4 + n);
    }
  }
  return 0;
}
