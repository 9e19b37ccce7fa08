// The byte-moving layer: one-sided access to memory in another process.
//
// A Fabric is one provider ("verbs", "tcp" or "shm") opened by name at run time. It registers
// memory regions, creates completion queues, and connects endpoints to peers. An Endpoint posts
// one-sided operations (write, write-with-immediate, read) against a peer's registered memory;
// their outcomes arrive as Completions on the endpoint's CompletionQueue.
//
// Nothing here knows what the bytes mean. The full contract of every operation (ordering,
// visibility, errors, thread safety) is written out in docs/transport.md; the summary:
//
//  * Ordering. Operations posted on one endpoint are executed at the target in post order and
//    complete at the initiator in post order. A read posted after a write on the same endpoint
//    observes that write (read-after-write). No ordering holds across endpoints.
//  * Visibility. A kWrite/kRead completion at the initiator means the bytes are in the target's
//    memory (write) or in the local buffer (read). A kRecvImm completion at the target is
//    delivered only after the whole payload of that write is visible in the target's memory.
//  * Errors. Any failed operation (bad rkey, out of bounds, missing access right, peer gone,
//    retry exceeded) puts the endpoint into the error state, exactly like an RC queue pair: the
//    failing operation completes with its error, every later-posted and still-outstanding one
//    completes with kFlushed, and Endpoint::status() explains why. An error never aborts the
//    process and never touches the target region.
//  * Checked posts. Endpoint::PostWrite/PostWriteImm/PostRead (not virtual) check their
//    arguments once, for every provider, before any provider code runs (transport/fabric.cc); a
//    refused post returns its error synchronously, takes no credit, queues nothing, produces no
//    completion and leaves the endpoint's state as it was. Refused, with these codes:
//      - INVALID_ARGUMENT: no local region (LocalSlice::region null);
//      - INVALID_ARGUMENT: a local region registered by another fabric;
//      - INVALID_ARGUMENT: flags other than kSignaled / kUnsignaled / kMore;
//      - INVALID_ARGUMENT: a length above Endpoint::max_operation_bytes() (verbs 2 GiB, tcp and
//        shm 1 TiB);
//      - OUT_OF_RANGE: a local slice not inside its region ([offset, offset+length) must lie
//        in [0, region.length()), arithmetic overflow included);
//      - OUT_OF_RANGE: a remote slice [addr, addr+length) that wraps past 2^64 (no region can
//        hold it); a zero-length operation names no remote memory and is not checked.
//    What only the target can know (rkey, bounds, access rights of the remote region) is an
//    error completion, as under "Errors". Providers implement only Endpoint::PostChecked.
//  * Flow control. Every post takes one credit of the endpoint's send queue and of its
//    completion queue's quota before it is handed to the provider; when none is left the post
//    fails with kResourceExhausted and nothing is queued. Polling returns credits. A completion
//    queue therefore can never overflow.
//
// Thread safety: a Fabric is thread-safe (setup calls take an internal lock). A CompletionQueue
// and every Endpoint attached to it belong to one polling thread: posts, polls and destruction
// happen on that thread. MemoryRegion accessors are const and thread-safe; destroying a region
// while operations on it are outstanding is a caller bug (as with ibv_dereg_mr).
#ifndef SHARDPS_TRANSPORT_TRANSPORT_H_
#define SHARDPS_TRANSPORT_TRANSPORT_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "transport/handshake_auth.h"

namespace shardps::transport {

// Remote access rights of a region. Local access (as a source or sink of this process's own
// operations) is always allowed.
enum class Access : uint32_t {
  kLocalOnly = 0,
  kRemoteRead = 1,
  kRemoteWrite = 2,
  kRemoteReadWrite = 3,
};
inline bool AllowsRemoteRead(Access a) { return static_cast<uint32_t>(a) & 1u; }
inline bool AllowsRemoteWrite(Access a) { return static_cast<uint32_t>(a) & 2u; }
const char* AccessName(Access a);

enum class MemoryKind : uint32_t {
  kHost = 0,
  kCuda = 1,  // device memory; only when built with CUDA (SHARDPS_HAVE_CUDA)
};

// What the control plane needs to name a region to a peer. Serializable with Encode/Decode
// (a versioned, fixed-layout little-endian byte string; see docs/transport.md).
struct RegionDescriptor {
  std::string provider;  // name of the fabric that registered it
  uint64_t addr = 0;     // the address an initiator names in a RemoteSlice
  uint64_t length = 0;   // bytes
  uint32_t rkey = 0;     // remote key
  Access access = Access::kLocalOnly;
  std::string provider_data;  // opaque provider fields (may be empty)

  std::string Encode() const;
  static StatusOr<RegionDescriptor> Decode(std::string_view bytes);
  std::string DebugString() const;
};

// Registered memory. Destroying it deregisters it: later remote accesses naming its rkey fail
// with a remote-access error at the initiator.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  void* data() const { return data_; }
  size_t length() const { return length_; }
  Access access() const { return access_; }
  MemoryKind kind() const { return kind_; }
  // Full descriptor, for the control plane.
  virtual RegionDescriptor descriptor() const = 0;
  // Names the fabric that registered the region (an identity, never dereferenced): posts take
  // only regions whose fabric() is their endpoint's.
  const void* fabric() const { return fabric_; }

 protected:
  MemoryRegion(const void* fabric, void* data, size_t length, Access access, MemoryKind kind)
      : fabric_(fabric), data_(data), length_(length), access_(access), kind_(kind) {}

 private:
  const void* const fabric_;
  void* const data_;
  const size_t length_;
  const Access access_;
  const MemoryKind kind_;
};

// [offset, offset+length) of a local region: the source of a write, the sink of a read.
struct LocalSlice {
  const MemoryRegion* region = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A place in a peer's region, as named by its descriptor: addr is descriptor.addr + offset.
struct RemoteSlice {
  uint64_t addr = 0;
  uint32_t rkey = 0;
};
inline RemoteSlice AtOffset(const RegionDescriptor& d, uint64_t offset) {
  return RemoteSlice{d.addr + offset, d.rkey};
}

enum class OpType : uint8_t {
  kWrite = 0,     // initiator: a one-sided write finished
  kWriteImm = 1,  // initiator: a write-with-immediate finished
  kRead = 2,      // initiator: a one-sided read finished
  kRecvImm = 3,   // target: a write-with-immediate's payload is visible; imm is valid
};
const char* OpTypeName(OpType t);

// Outcome of one operation, in the spirit of ibv_wc_status but provider-neutral.
enum class WcStatus : uint8_t {
  kSuccess = 0,
  kRemoteAccessError = 1,   // bad rkey, out of bounds, missing right, deregistered region
  kFlushed = 2,             // never executed: the endpoint was already in the error state
  kRetryExceeded = 3,       // the peer stopped answering (dead process, broken link)
  kRemoteDisconnected = 4,  // the peer closed or reset the connection
  kLocalError = 5,          // local protection/length error, or an internal provider failure
  kRemoteOperationError = 6,
};
const char* WcStatusName(WcStatus s);

struct Completion {
  uint64_t context = 0;      // the caller's context of the post; for kRecvImm, 0
  uint64_t endpoint_id = 0;  // the id given when the endpoint was created
  OpType op = OpType::kWrite;
  WcStatus status = WcStatus::kSuccess;
  uint32_t imm = 0;       // kRecvImm (and kWriteImm at the initiator: the value sent)
  uint32_t byte_len = 0;  // kRecvImm: payload length (saturated at 2^32-1); kRead: length
  bool ok() const { return status == WcStatus::kSuccess; }
};

// One piece of a gathered read (Endpoint::PostReadList): `length` bytes of the peer at `remote`.
struct ReadPiece {
  RemoteSlice remote;
  uint64_t length = 0;
};
// The most pieces one PostReadList may gather.
constexpr size_t kMaxReadPieces = 4096;

// Post flags.
enum PostFlags : uint32_t {
  kSignaled = 0,
  // Selective signaling: a successful unsignaled op produces no completion. Its credits are
  // returned when a later signaled op on the same endpoint completes. A failed one always
  // produces a completion.
  kUnsignaled = 1u << 0,
  // More posts on this endpoint follow at once (like MSG_MORE): the provider may hold the
  // operation until the next post without kMore, or until the owning thread next polls the
  // endpoint's completion queue, so that a burst leaves in one doorbell (tcp: one sendmsg).
  // Order, credits and completions are unchanged. A hint: providers may send at once.
  kMore = 1u << 1,
};

// A completion queue, shared by all endpoints of one polling thread.
class CompletionQueue {
 public:
  virtual ~CompletionQueue() = default;
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  // Non-blocking: drives provider progress if it needs the caller's thread, then stores up to
  // max completions in out. Returns how many (0 if none).
  virtual int Poll(Completion* out, int max) = 0;

  // Like Poll, but if nothing is ready it waits up to timeout (spinning briefly, then sleeping
  // on a provider event: a completion channel, a condition variable, a futex). Returns 0 on
  // timeout. For servers and benchmarks that must not burn a core while idle.
  virtual int Wait(Completion* out, int max, std::chrono::microseconds timeout) = 0;

  // Number of completion slots (the quota shared by the attached endpoints).
  virtual int depth() const = 0;

 protected:
  CompletionQueue() = default;
};

struct EndpointOptions {
  uint64_t endpoint_id = 0;  // echoed in every Completion of this endpoint
  int send_depth = 256;      // max operations outstanding (posted, not yet completed)
  int recv_depth = 256;      // max unreaped kRecvImm completions at this side as target
  std::chrono::milliseconds connect_timeout{10000};
  // A refused connection (nobody listens at the address) is retried until connect_timeout when
  // true: at launch the listener may not be up yet. False: refused fails at once (a peer that
  // was listening before, now refusing, is dead). Providers whose connect never retries ignore it.
  bool retry_refused = true;
  // Connect: who this side is and the key it proves (transport/handshake_auth.h). An empty key
  // connects only to a listener without an Authenticator; a key refuses such a listener.
  std::string auth_identity;
  std::string auth_key;
};

// A connection to one peer. Owned and used by the polling thread of its CompletionQueue.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // The three posts check their arguments first ("Checked posts" above), then hand the
  // operation to the provider. Not virtual: the checks are the same for every provider.
  //
  // One-sided write of src into the peer's memory at dst. src.region must be local to this
  // fabric; dst must lie inside one peer region that allows remote write.
  Status PostWrite(const LocalSlice& src, const RemoteSlice& dst, uint64_t context,
                   uint32_t flags = kSignaled) {
    return Post(OpType::kWrite, src, dst, 0, context, flags);
  }
  // Like PostWrite, then the peer's CQ receives kRecvImm with imm, after the data is visible.
  // If the target has recv_depth kRecvImm completions of this endpoint not yet polled, the
  // operation waits (verbs: RNR retry; tcp: the target stops reading; shm: the doorbell ring
  // entry is pushed from a later Poll) rather than failing.
  Status PostWriteImm(const LocalSlice& src, const RemoteSlice& dst, uint32_t imm, uint64_t context,
                      uint32_t flags = kSignaled) {
    return Post(OpType::kWriteImm, src, dst, imm, context, flags);
  }
  // One-sided read of the peer's memory at src into dst.
  Status PostRead(const LocalSlice& dst, const RemoteSlice& src, uint64_t context,
                  uint32_t flags = kSignaled) {
    return Post(OpType::kRead, dst, src, 0, context, flags);
  }
  // A gathered read: pieces[0, n) of the peer's memory, concatenated into `dst` (whose length
  // is their total). Like PostRead, it runs no code of the peer's application. The tcp provider
  // does it in one exchange (one request frame listing the pieces, one response: one operation,
  // one credit, one completion when signaled; a refused piece fails the whole operation with a
  // remote access error and writes nothing... of the refused piece); the other providers post
  // one read per piece (the last one with `flags`, the others unsignaled: n credits). Checked
  // like the other posts, plus: 1 <= n <= kMaxReadPieces, every piece non-empty and not
  // wrapping, and their total equal to dst.length.
  Status PostReadList(const LocalSlice& dst, const ReadPiece* pieces, size_t n, uint64_t context,
                      uint32_t flags = kSignaled);
  // The most bytes one operation may move on this endpoint's provider.
  uint64_t max_operation_bytes() const { return max_operation_bytes_; }
  // True when PostReadList is one operation (one credit, one request) whatever its number of
  // pieces (tcp, pieces under 4 GiB each); false when it posts a read per piece (n credits).
  virtual bool gathers_read_lists() const { return false; }
  // True when a read is the initiator's own copy out of the target's mapped memory (shm): it
  // costs no round trip, so reading again is as cheap as reading more in the first place.
  virtual bool reads_are_local_copies() const { return false; }

  // OK while healthy; the first error that moved the endpoint into the error state otherwise.
  virtual Status status() const = 0;
  // Operations posted and not yet completed (unsignaled ones included).
  virtual int outstanding() const = 0;
  uint64_t endpoint_id() const { return endpoint_id_; }
  // The identity of the fabric whose regions this endpoint posts (MemoryRegion::fabric()): a
  // decorator (tests' fault injection) forwards it so that the inner fabric's regions pass.
  const void* fabric_identity() const { return fabric_; }
  // "provider:local->remote" for logs.
  virtual std::string DebugString() const = 0;
  // The identity the peer proved at Accept (its Authenticator's terms); "" for a connected
  // endpoint, and for one accepted by a listener without an Authenticator.
  const std::string& peer_identity() const { return peer_identity_; }
  // Set once, by the listener that accepted this endpoint, before Accept returns it (or by a
  // decorator that wraps one).
  void set_peer_identity(std::string identity) { peer_identity_ = std::move(identity); }

 protected:
  // PostReadList past its checks (the same guarantees as PostChecked's). Default: one
  // PostChecked read per piece.
  virtual Status PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                                     uint64_t context, uint32_t flags);
  // fabric: the identity its regions carry (MemoryRegion::fabric()).
  Endpoint(uint64_t endpoint_id, const void* fabric, uint64_t max_operation_bytes)
      : endpoint_id_(endpoint_id), fabric_(fabric), max_operation_bytes_(max_operation_bytes) {}

 private:
  // The checks above (fabric.cc), then PostChecked.
  Status Post(OpType type, const LocalSlice& local, const RemoteSlice& remote, uint32_t imm,
              uint64_t context, uint32_t flags);
  // The provider's work for one post whose arguments passed the checks: local.region is this
  // fabric's (a static_cast to the provider's region type is safe), flags hold only
  // kUnsignaled, local.length <= max_operation_bytes(), the local slice lies inside its region,
  // and a non-empty remote slice does not wrap. Flow control, the error state and the
  // operation itself are the provider's. Polling thread.
  virtual Status PostChecked(OpType type, const LocalSlice& local, const RemoteSlice& remote,
                             uint32_t imm, uint64_t context, uint32_t flags) = 0;


  const uint64_t endpoint_id_;
  const void* const fabric_;
  const uint64_t max_operation_bytes_;
  std::string peer_identity_;
};

// Accepts connections on an address. Owned by one thread.
class Listener {
 public:
  virtual ~Listener() = default;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // The address peers pass to Fabric::Connect (port 0 and empty names are resolved).
  virtual std::string address() const = 0;
  // Waits up to timeout for one peer that passes the authentication (handshake_auth.h); the
  // endpoint is attached to cq. Never waits on a single peer: connections that have not
  // answered the challenge are multiplexed and bounded (HandshakeGate), so a silent stranger
  // costs a zero-timeout Accept nothing. PERMISSION_DENIED: a peer was refused (call again);
  // DEADLINE_EXCEEDED: none passed in time.
  virtual StatusOr<std::unique_ptr<Endpoint>> Accept(CompletionQueue* cq,
                                                     const EndpointOptions& options,
                                                     std::chrono::milliseconds timeout) = 0;

  // Every later Accept requires peers to prove a key of `auth` (null: none required). Call
  // before the address is published.
  void set_authenticator(std::shared_ptr<const Authenticator> auth) {
    authenticator_ = std::move(auth);
  }
  // What this listener's gate has seen (handshakes passed, refused, evicted, timed out).
  virtual HandshakeGate::Stats gate_stats() const = 0;

 protected:
  Listener() = default;
  const Authenticator* authenticator() const { return authenticator_.get(); }

 private:
  std::shared_ptr<const Authenticator> authenticator_;
};

struct FabricOptions {
  // "verbs", "tcp", "shm" or "auto". A named provider that cannot start is an error.
  std::string provider = "auto";
  // verbs: device name ("" = the device that owns bind_ip, else the first active one).
  std::string rdma_device;
  int rdma_port = 1;
  int rdma_gid_index = -1;  // -1 = automatic RoCEv2 IPv4 GID selection
  // Address this fabric binds for listening and as connection source ("" = any / default).
  std::string bind_ip;
  // verbs: payloads up to this many bytes are posted inline (clamped to the QP's max).
  int max_inline = 128;
  // verbs: one signaled work request in every `signal_interval` unsignaled ones.
  int signal_interval = 32;
  // verbs: QP local ACK timeout exponent (4.096us * 2^t) and retry count: peer-death bound.
  int rdma_timeout = 14;
  int rdma_retry_count = 7;
  // shm: bytes of sparse address space each fabric reserves for AllocateMemory (0 = 64 GiB;
  // nothing is committed until touched; smaller reservations are tried if this one fails).
  uint64_t shm_arena_bytes = 0;
  // shm: uids, besides this process's effective uid, whose processes a listener of this fabric
  // serves. The listener reads the connecting process's uid with SO_PEERCRED and refuses any
  // other uid before a byte of the handshake is read or an fd sent. Empty: same uid only.
  std::vector<uint32_t> shm_allowed_uids;
  // tcp: TLS 1.3 on every data-path connection, keyed by the per-connection secret of the
  // data-path authentication (transport/tcp/tcp_tls.h). A listener with it on requires it of
  // every peer (and needs an Authenticator); a connector follows what the listener requires
  // (the requirement is authenticated), and with it on also refuses a listener without it.
  bool tcp_tls = false;
  // tcp: the longest a read request arriving behind immediates waits for the application to be
  // done with them (its next CompletionQueue::Poll after the one that returned them), so that
  // the read sees what the application made of the writes before it (a server's pull right
  // behind the same worker's push reads the applied push). Bounded so that reads stay
  // one-sided; 0: reads never wait (docs/transport.md).
  int tcp_read_wait_us = 1000;
};

class Fabric {
 public:
  virtual ~Fabric() = default;
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  // Opens a provider by name (options.provider). Logs the choice, and for "auto" the reason.
  static StatusOr<std::unique_ptr<Fabric>> Open(const FabricOptions& options);

  virtual std::string name() const = 0;
  // Human-readable: device, port, GID for verbs; address for tcp/shm.
  virtual std::string DebugString() const = 0;

  // Registers caller-owned memory [addr, addr+length). The memory must outlive the region.
  // shm can expose to peers only memory it allocated: it refuses remote access rights here.
  virtual StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                                 Access access,
                                                                 MemoryKind kind) = 0;
  // Allocates and registers length bytes, zero-filled, page aligned, owned by the region.
  // Works for remote access on every provider.
  virtual StatusOr<std::unique_ptr<MemoryRegion>> AllocateMemory(size_t length, Access access) = 0;

  virtual StatusOr<std::unique_ptr<CompletionQueue>> CreateCompletionQueue(int depth) = 0;
  // The largest depth CreateCompletionQueue accepts (verbs: half the device's max_cqe; the
  // software providers: no practical limit). A caller sizing its queue from its peers' count
  // fits it here rather than fail to start.
  virtual int max_cq_depth() const { return 1 << 30; }

  // address: "host:port" for verbs and tcp (port 0 = pick one); a name for shm ("" = pick one).
  virtual StatusOr<std::unique_ptr<Listener>> Listen(const std::string& address) = 0;
  virtual StatusOr<std::unique_ptr<Endpoint>> Connect(const std::string& address,
                                                      CompletionQueue* cq,
                                                      const EndpointOptions& options) = 0;

 protected:
  Fabric() = default;
};

// Providers compiled into this binary, e.g. {"tcp", "shm", "verbs"}.
std::string CompiledProviders();

}  // namespace shardps::transport

#endif  // SHARDPS_TRANSPORT_TRANSPORT_H_
