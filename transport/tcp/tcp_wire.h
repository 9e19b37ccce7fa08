// Wire format of the tcp provider (version 1). Internal to transport/tcp/.
//
// A connection is one TCP stream per endpoint pair, full duplex: each side is an initiator
// (sends requests, receives responses) and a target (receives requests, sends responses) at
// once. All integers are little-endian (the provider refuses to build on big-endian hosts).
//
//   stream     = hello *frame
//   hello      = magic version header_size reserved send_depth recv_depth reserved
//                endpoint_id                 ; 32 bytes
//   magic      = u32 0x43545053 ("SPTC")       ; both sides send a hello, then read the peer's
//   version    = u16 1                         ; a mismatch closes the connection
//   header_size= u16 40
//   reserved   = u32 0
//   send_depth = u32, recv_depth = u32         ; informational
//   reserved   = u32 0
//   endpoint_id= u64                           ; informational (logs)
//
//   frame      = header [payload]
//   header     = fmagic opcode reason flags imm rkey reserved addr length seq   ; 40 bytes
//   fmagic     = u8 0xA5                       ; resynchronisation guard
//   opcode     = u8: 1 WRITE, 2 WRITE_IMM, 3 READ_REQ, 4 READ_RESP, 5 ACK, 6 NAK
//   reason     = u8 (NAK only): 1 remote access refused. One reason for every refusal (unknown
//                or stale rkey, range outside the region, access right missing, region
//                deregistered during the transfer): a NAK that said which would let a peer
//                tell a valid rkey from an invalid one. The target logs the precise reason.
//                (2, 3, 4 were sent by earlier builds; a receiver treats any value as 1.)
//   flags      = u8 0
//   imm        = u32 (WRITE_IMM)
//   rkey       = u32 (requests; 0 in NAK)
//   reserved   = u32 0
//   addr       = u64 target virtual address (requests; 0 in NAK)
//   length     = u64 payload bytes (WRITE, WRITE_IMM, READ_RESP) or bytes asked (READ_REQ);
//                0 in NAK
//   seq        = u64 request sequence number, 1, 2, 3... per direction
//
// A peer whose hello is wrong is dropped by Accept, which keeps waiting for a real peer. After
// the hello, a frame with a bad fmagic, an unknown opcode, a length above 2^40, a request seq
// out of order, or a response that matches no outstanding request closes the connection (the
// endpoint fails with kRemoteOperationError, status "protocol error ...").
//
// Requests (initiator -> target): WRITE and WRITE_IMM carry `length` payload bytes, which the
// target receives straight into the region (or into a scratch sink when the access check
// fails). READ_REQ has no payload. A target executes requests strictly in seq order. A
// WRITE_IMM counts as executed once its payload is in memory and its kRecvImm is queued; while
// the target endpoint has recv_depth immediates unreaped, its target stops reading the socket
// (TCP flow control then holds the initiator back), so nothing is dropped or failed.
//
// Responses (target -> initiator), all cumulative: ACK(seq) says every request up to seq was
// executed; READ_RESP(seq) carries the read's bytes (sent straight from the region) and also
// acknowledges every request before seq; NAK(seq, reason) says requests before seq were
// executed and request seq was rejected (a NAK carries only seq and reason 1, so every refusal
// looks the same on the wire); the target then discards (never executes) every later
// request on that connection, and the initiator moves its endpoint into the error state and
// closes the connection. ACKs are coalesced: one after draining what the socket had readable
// (and at least every 64 requests / 4 MiB during a long drain).
#ifndef SHARDPS_TRANSPORT_TCP_TCP_WIRE_H_
#define SHARDPS_TRANSPORT_TCP_TCP_WIRE_H_

#include <cstddef>
#include <cstdint>

namespace shardps::transport::tcp {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "tcp wire format assumes little-endian");

constexpr uint32_t kHelloMagic = 0x43545053;  // "SPTC"
constexpr uint16_t kWireVersion = 1;
constexpr uint8_t kFrameMagic = 0xA5;
// Larger requests are treated as hostile (a peer could otherwise make us drain forever).
constexpr uint64_t kMaxMessageBytes = 1ull << 40;

struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t header_size;
  uint32_t reserved;
  uint32_t send_depth;
  uint32_t recv_depth;
  uint32_t reserved2;
  uint64_t endpoint_id;
};
static_assert(sizeof(Hello) == 32, "hello layout");

enum Opcode : uint8_t {
  kOpWrite = 1,
  kOpWriteImm = 2,
  kOpReadReq = 3,
  kOpReadResp = 4,
  kOpAck = 5,
  kOpNak = 6,
  // A gathered read: imm = n pieces; the payload is n x ReadListEntry; length = their total.
  // Answered by one kOpReadResp of `length` bytes (the pieces, concatenated), or a NAK.
  kOpReadListReq = 7,
};

struct ReadListEntry {
  uint64_t addr;
  uint32_t rkey;
  uint32_t length;
};
static_assert(sizeof(ReadListEntry) == 16, "read list entry layout");

enum NakReason : uint8_t {
  kNakRefused = 1,  // the only reason sent (see the grammar above)
};

struct FrameHeader {
  uint8_t magic;
  uint8_t opcode;
  uint8_t reason;
  uint8_t flags;
  uint32_t imm;
  uint32_t rkey;
  uint32_t reserved;
  uint64_t addr;
  uint64_t length;
  uint64_t seq;
};
constexpr size_t kHeaderSize = 40;
static_assert(sizeof(FrameHeader) == kHeaderSize, "frame header layout");

}  // namespace shardps::transport::tcp

#endif  // SHARDPS_TRANSPORT_TCP_TCP_WIRE_H_
