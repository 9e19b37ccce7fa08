// Internal classes of the tcp provider. See tcp_wire.h for the wire format.
//
// Threading model:
//  * TcpEngine owns one progress thread per fabric (epoll, edge-triggered, blocking in
//    epoll_wait). It serves every inbound request (target role), receives every response
//    (initiator role), pushes completions into CQs and continues partial sends when a socket
//    becomes writable. The target application never has to call anything for its memory to
//    be served.
//  * Progress work runs under the engine's progress mutex. CompletionQueue::Poll/Wait on the
//    application's thread try to take it and do the work inline (TryProgress); while they keep
//    doing so the progress thread parks (condition variable) until 200 us after their last poll
//    or an Unpark/Wake, so on a 2-core machine a spinning poller and the progress thread do
//    not fight over the events.
//  * The application's polling thread posts (the send is attempted inline, under the
//    endpoint's send mutex), polls CQs and destroys endpoints/CQs/regions.
//  * Setup (Connect/Accept/Listen/registration) may run on any thread; it takes the engine's
//    setup mutex. State the progress thread owns is changed only by closures run on it
//    (TcpEngine::RunSync), which is how endpoints and regions leave safely.
// Lock order: setup_mu -> op_mu -> cq.mu -> park_mu; progress_mu -> {op_mu, send_mu, reg_mu,
// cl_mu}. No lock is held across a blocking call except send_mu across a non-blocking sendmsg.
#ifndef SHARDPS_TRANSPORT_TCP_TCP_INTERNAL_H_
#define SHARDPS_TRANSPORT_TCP_TCP_INTERNAL_H_

#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/types.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/fd.h"
#include "common/thread_annotations.h"
#include "transport/flow_control.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/tcp/tcp_tls.h"
#include "transport/transport.h"

namespace shardps::transport::tcp {

class TcpEndpoint;
class TcpCompletionQueue;

// Result of checking a remote access against the registry, as an HCA would; kDeregistered: the
// region went away while a write into it was being received. Only the target's log sees which
// check failed: every refusal draws the same NAK (tcp_wire.h).
enum class AccessCheck : uint8_t { kOk, kUnknownRkey, kOutOfBounds, kNoAccess, kDeregistered };
const char* AccessCheckName(AccessCheck c);

// Shared state of one tcp fabric: the rkey registry, the progress thread, the setup lock.
// Held by shared_ptr by every object made from the fabric, so destroying them in any order is
// safe. Thread-safe unless a method says "progress thread".
class TcpEngine {
 public:
  static StatusOr<std::shared_ptr<TcpEngine>> Create(const FabricOptions& options);
  ~TcpEngine();
  TcpEngine(const TcpEngine&) = delete;
  TcpEngine& operator=(const TcpEngine&) = delete;

  const FabricOptions& options() const { return options_; }
  Mutex& setup_mu() RETURN_CAPABILITY(setup_mu_) { return setup_mu_; }

  // Stops and joins the progress thread (fabric destruction). Later RunSync calls run inline.
  void Shutdown();

  // ---- region registry (any thread) ----
  // Returns a fresh rkey drawn from the kernel CSPRNG: never 0, unique within the fabric.
  uint32_t RegisterRegion(char* base, uint64_t length, Access access);
  // Removes the rkey, then fences the progress thread: when this returns, no receive or send
  // of the engine touches [base, base+length) any more.
  void DeregisterRegion(uint32_t rkey, char* base, uint64_t length);
  // Progress thread (or anyone): checks [addr, addr+len) of rkey for the right; on kOk stores
  // the local pointer.
  AccessCheck Lookup(uint32_t rkey, uint64_t addr, uint64_t len, bool write, char** out);
  // Lookup for the pieces of a read list, under one lock (a list of one table's rows names one
  // region): kOk with every local pointer in out[0, n), or the first refusal.
  AccessCheck LookupReadList(const ReadListEntry* entries, size_t n, const char** out);

  // ---- progress thread plumbing ----
  // Runs fn on the progress thread and waits for it (inline when called from it, or when the
  // thread is stopped).
  void RunSync(const std::function<void()>& fn);
  void Wake();
  // Any thread (CompletionQueue::Poll): if no one else is doing progress work, handles what is
  // ready without blocking. On a machine with few cores this lets a spinning application
  // thread do the work itself instead of handing it to the progress thread.
  void TryProgress();
  // Polling thread: reads every endpoint of `eps` that has operations outstanding until
  // EAGAIN, under the progress lock (skipped if another thread holds it). A safety net: with
  // edge-triggered epoll an edge that was consumed without draining the socket would otherwise
  // never come again, and a peer's EOF would go unnoticed.
  void Rescan(const std::unordered_set<TcpEndpoint*>& eps);
  // A thread about to sleep in CompletionQueue::Wait: the progress thread takes over now.
  void Unpark();
  int epoll_fd() const { return epoll_fd_.get(); }
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_id_; }
  // Progress thread: endpoint membership and the set of read-paused endpoints.
  Status AddEndpoint(TcpEndpoint* ep) REQUIRES(progress_mu_);
  void RemoveEndpoint(TcpEndpoint* ep) REQUIRES(progress_mu_);
  void AddPaused(TcpEndpoint* ep) REQUIRES(progress_mu_) { paused_.push_back(ep); }
  // An endpoint that used up its read budget with data still pending: read it again on the
  // next round, after the others had their turn.
  void AddAgain(TcpEndpoint* ep) REQUIRES(progress_mu_) { again_.push_back(ep); }
  // An endpoint whose next request is a read that waits for the application to be done with
  // the immediates before it (TcpEndpoint::ReadWaits): looked at again on every pass.
  void AddReadWait(TcpEndpoint* ep) REQUIRES(progress_mu_) { read_wait_.push_back(ep); }
  // Progress thread: stop watching a failed endpoint's socket.
  void Unwatch(int fd);
  char* scratch() REQUIRES(progress_mu_) { return scratch_.data(); }
  size_t scratch_size() const REQUIRES(progress_mu_) { return scratch_.size(); }
  // Progress thread: read-only zero bytes of at least n (replaces a vanished send source).
  const char* Zeros(uint64_t n) REQUIRES(progress_mu_);
  // Held by whoever does progress work; "progress thread" methods require it. Closures given
  // to RunSync run with it held.
  Mutex& progress_mu() RETURN_CAPABILITY(progress_mu_) { return progress_mu_; }

 private:
  explicit TcpEngine(const FabricOptions& options);
  void Loop();
  void HandleEvents(const struct epoll_event* evs, int n) REQUIRES(progress_mu_);
  void RunClosures() REQUIRES(progress_mu_);
  void ResumePaused() REQUIRES(progress_mu_);
  void NudgeReadWaits() REQUIRES(progress_mu_);

  const FabricOptions options_;
  // Serialises setup; guards each CQ's quota() and attached() (TcpCompletionQueue).
  Mutex setup_mu_;

  Mutex reg_mu_;
  struct RegionEntry {
    char* base;
    uint64_t length;
    Access access;
  };
  // [addr, addr+len) against one region: bounds, then the right; on kOk the local pointer.
  static AccessCheck CheckAccess(const RegionEntry& r, uint64_t addr, uint64_t len, bool write,
                                 char** out);
  // rkey (CSPRNG-drawn, never 0) -> region.
  std::unordered_map<uint32_t, RegionEntry> regions_ GUARDED_BY(reg_mu_);

  UniqueFd epoll_fd_;
  UniqueFd event_fd_;
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  std::atomic<bool> stop_{false};
  // Parking: while an application thread keeps calling TryProgress, the progress thread
  // sleeps on park_cv_ instead of competing for the same events (two cores are common).
  std::atomic<int64_t> last_inline_ns_{0};
  Mutex park_mu_;
  CondVar park_cv_;
  bool park_wake_ GUARDED_BY(park_mu_) = false;

  struct Closure {
    const std::function<void()>* fn;
    bool done;
  };
  Mutex cl_mu_;
  CondVar cl_cv_;
  std::vector<Closure*> closures_ GUARDED_BY(cl_mu_);
  bool running_ GUARDED_BY(cl_mu_) = false;

  // Held by whichever thread does progress work (the progress thread, or an application
  // thread in TryProgress); "progress thread" methods below run under it.
  Mutex progress_mu_;
  std::vector<TcpEndpoint*> endpoints_ GUARDED_BY(progress_mu_);
  std::vector<TcpEndpoint*> paused_ GUARDED_BY(progress_mu_);
  std::vector<TcpEndpoint*> again_ GUARDED_BY(progress_mu_);
  std::vector<TcpEndpoint*> read_wait_ GUARDED_BY(progress_mu_);
  // The progress thread is in (or about to enter) epoll_wait with no timeout.
  bool blocking_ GUARDED_BY(progress_mu_) = false;
  std::vector<char> scratch_ GUARDED_BY(progress_mu_);
  std::vector<std::pair<void*, size_t>> zero_maps_ GUARDED_BY(progress_mu_);
};

// A registered region: an rkey registry entry; AllocateMemory regions own their mapping.
// Accessors are const and thread-safe; destroy on any thread with no local ops outstanding.
class TcpRegion final : public MemoryRegion {
 public:
  TcpRegion(std::shared_ptr<TcpEngine> engine, void* data, size_t length, Access access,
            size_t owned_map_bytes);
  ~TcpRegion() override;
  RegionDescriptor descriptor() const override;
  const TcpEngine* engine() const { return engine_.get(); }

 private:
  std::shared_ptr<TcpEngine> engine_;
  const uint32_t rkey_;
  const size_t owned_map_bytes_;  // 0: caller memory
};

// A CQ: a mutex-guarded ring filled by the progress thread (and by posts on errored
// endpoints), drained by the polling thread. Poll/Wait/destruction: the polling thread only.
class TcpCompletionQueue final : public CompletionQueue {
 public:
  TcpCompletionQueue(std::shared_ptr<TcpEngine> engine, int depth);
  ~TcpCompletionQueue() override;
  int Poll(Completion* out, int max) override;
  int Wait(Completion* out, int max, std::chrono::microseconds timeout) override;
  int depth() const override { return depth_; }

  // Any thread. credits: send credits this completion returns to ep when polled (kRecvImm: 0).
  void Push(const Completion& c, TcpEndpoint* ep, uint32_t credits);
  // Polling thread: drops ep's entries (endpoint destruction).
  void Purge(TcpEndpoint* ep);
  // Polling thread: ep holds unsignaled posts not yet sent; FlushDeferred (from Poll) sends them.
  void AddDeferred(TcpEndpoint* ep);
  void FlushDeferred();

  const TcpEngine* engine() const { return engine_.get(); }
  // Guarded by the engine's setup mutex.
  CqQuota& quota() { return quota_; }
  std::unordered_set<TcpEndpoint*>& attached() { return attached_; }

 private:
  struct Entry {
    Completion c;
    TcpEndpoint* ep;
    uint32_t credits;
  };
  std::shared_ptr<TcpEngine> engine_;
  const int depth_;
  CqQuota quota_;
  std::unordered_set<TcpEndpoint*> attached_;

  UniqueFd event_fd_;  // signalled by Push while a Wait sleeps
  Mutex mu_;
  std::vector<Entry> ring_ GUARDED_BY(mu_);
  size_t head_ GUARDED_BY(mu_) = 0;
  size_t size_ GUARDED_BY(mu_) = 0;
  int waiters_ GUARDED_BY(mu_) = 0;
  std::atomic<size_t> count_{0};
  // Endpoints with deferred sends (see TcpEndpoint::Post).
  Mutex deferred_mu_;
  std::vector<TcpEndpoint*> deferred_ GUARDED_BY(deferred_mu_);
  std::atomic<bool> has_deferred_{false};
  // Polling thread: last time Poll re-scanned the attached endpoints (see TcpEngine::Rescan).
  std::chrono::steady_clock::time_point last_rescan_{};
  // Immediates the last Poll returned, per endpoint: the next Poll begins by telling each
  // endpoint that the application is done with them (TcpEndpoint::OnImmsDone), which lets a
  // read request waiting behind them go (TcpEndpoint::ReadWaits).
  std::vector<std::pair<TcpEndpoint*, uint32_t>> reaped_ GUARDED_BY(mu_);
  std::atomic<bool> any_reaped_{false};
};

// One connection. Posts, status(), outstanding() and destruction: the polling thread of its
// CQ. OnEvents/TryResume/OnRegionGone: the progress thread. See tcp_datapath.cc.
class TcpEndpoint final : public Endpoint {
 public:
  // tls: the connection's TLS session when FabricOptions::tcp_tls is on (null: plain TCP).
  TcpEndpoint(std::shared_ptr<TcpEngine> engine, UniqueFd fd, TcpCompletionQueue* cq,
              const EndpointOptions& options, std::string local, std::string remote,
              std::unique_ptr<TlsSession> tls);
  ~TcpEndpoint() override;

  bool gathers_read_lists() const override { return true; }
  Status status() const override;
  int outstanding() const override { return credits_.outstanding(); }
  std::string DebugString() const override;

  int fd() const { return fd_.get(); }

  // Polling thread (from TcpCompletionQueue::Poll / destructor).
  void ReturnCredits(uint32_t n) { credits_.Return(static_cast<int>(n)); }
  void OnRecvImmReaped();
  // The application came back for more after taking n immediates of this endpoint.
  void OnImmsDone(uint32_t n) { imm_done_.fetch_add(n, std::memory_order_release); }
  void DetachCq();
  // Sends what deferred unsignaled posts left in the send queue (from the CQ's Poll).
  void FlushDeferred();
  std::atomic<bool> deferred_listed_{false};  // on its CQ's deferred list

  // Progress thread: called by this endpoint's engine with its progress_mu() held (the
  // analysis cannot tie ep->engine_ to the caller's `this`; each asserts it, and the helpers
  // below require it).
  void OnEvents(uint32_t events);
  void OnReadable();
  bool TryResume();  // true when no longer waiting for the app to reap immediates
  // A pass over the engine's read waits (AddReadWait): reads on, or waits again.
  void RetryReadWait();
  void OnRegionGone(const char* base, uint64_t length);

 private:
  struct PendingOp {
    uint64_t context;
    uint64_t length;
    char* local;  // read sink
    uint64_t raddr;
    uint32_t rkey;
    uint32_t imm;
    OpType type;
    bool signaled;
  };
  struct Segment {
    FrameHeader hdr;
    const char* payload;
    uint64_t payload_len;
    bool headerless = false;  // more payload of the previous segment's frame (a read list's)
    // A gathered read-list response: its payload is filled from staged_ (the k-th staged
    // segment in the queue is staged_[k]) when its turn to be sent comes.
    bool staged = false;
  };
  // A read list of small pieces (AnswerReadList), answered from one buffer. It is filled when
  // every byte queued before it has gone to the kernel (FlushLocked), so that the bytes of the
  // responses are taken from memory in the order the requests executed, as when every
  // response is sent from the regions: a pull's header read before its rows sees no newer
  // version than the rows.
  struct Gather {
    std::vector<std::pair<const char*, uint64_t>> pieces;  // in the regions (zeros once gone)
    std::unique_ptr<char[]> buf;                            // null until filled
    uint64_t cap = 0;                                       // buf's bytes
    uint64_t len = 0;
  };
  // Buffers of sent gathers, reused rather than allocated (and page-faulted) per response:
  // (buffer, capacity), at most kGatherPoolBytes in all per endpoint (a 4,096-row pull of
  // 288-byte records is 4 gathers of 295 KB; a socket's own buffers are larger).
  static constexpr uint64_t kGatherPoolBytes = 2ull << 20;
  std::vector<std::pair<std::unique_ptr<char[]>, uint64_t>> gather_pool_ GUARDED_BY(send_mu_);
  uint64_t gather_pool_bytes_ GUARDED_BY(send_mu_) = 0;

  enum class RxState : uint8_t { kHeader, kPayload, kDrain };
  enum class RxAction : uint8_t {
    kNone,
    kWrite,
    kWriteImm,
    kReadResp,
    kNak,
    kReadRespGone,
    kReadList,  // a read list's pieces arrived (into read_list_rx_): answer it
  };
  enum class IoResult : uint8_t { kAgain, kRetry, kDead };

  Status PostChecked(OpType type, const LocalSlice& local, const RemoteSlice& remote, uint32_t imm,
                     uint64_t context, uint32_t flags) override;
  Status PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                             uint64_t context, uint32_t flags) override;
  void AnswerReadList() REQUIRES(engine_->progress_mu());
  void CompleteLocked(const PendingOp& op, WcStatus status) REQUIRES(op_mu_);
  void CompleteUpToLocked(uint64_t seq) REQUIRES(op_mu_);
  void PushSegmentLocked(const Segment& s) REQUIRES(send_mu_);
  void FillGather(Gather& g) REQUIRES(send_mu_);
  Status FlushLocked() REQUIRES(send_mu_);
  // Progress thread.
  IoResult HandleIoError(ssize_t n) REQUIRES(engine_->progress_mu());
  void HandleHeader() REQUIRES(engine_->progress_mu());
  void StartPayload(char* dest, uint64_t len, RxAction action) REQUIRES(engine_->progress_mu());
  void StartDrain(uint64_t len, RxAction action) REQUIRES(engine_->progress_mu());
  void FinishPayload() REQUIRES(engine_->progress_mu());
  bool TryDeliverImm(uint64_t seq, uint32_t imm, uint64_t len) REQUIRES(engine_->progress_mu());
  // Whether the read request whose header is in hdr_buf_ waits (see tcp_datapath.cc).
  bool ReadWaits() REQUIRES(engine_->progress_mu());
  void MaybeAck() REQUIRES(engine_->progress_mu());
  void SendResponse(const Segment& s) REQUIRES(engine_->progress_mu());
  // Refuses request `req`; `why` goes to this side's log only, never on the wire.
  void SendNak(const FrameHeader& req, AccessCheck why) REQUIRES(engine_->progress_mu());
  void ProtocolError(const std::string& what) REQUIRES(engine_->progress_mu());
  void Fail(WcStatus wc, Status why) REQUIRES(engine_->progress_mu());

  std::shared_ptr<TcpEngine> engine_;
  UniqueFd fd_;
  const std::unique_ptr<TlsSession> tls_;  // every byte goes through it when set
  const int send_depth_;
  const int recv_depth_;
  const std::string local_;
  const std::string remote_;
  SendCredits credits_;  // polling thread

  // Initiator side: pending operations, error state, CQ pointer.
  mutable Mutex op_mu_;
  TcpCompletionQueue* cq_ GUARDED_BY(op_mu_);       // written by the polling thread
  std::vector<PendingOp> ring_ GUARDED_BY(op_mu_);  // index seq % send_depth_
  // A read list's encoded pieces, kept until its request is sent (index seq % send_depth_).
  std::vector<std::vector<ReadListEntry>> read_lists_ GUARDED_BY(op_mu_);
  std::vector<ReadListEntry> read_list_rx_;  // target: the pieces of the request being received
  std::vector<const char*> read_list_src_;    // target: their local pointers (AnswerReadList)
  uint64_t post_seq_ GUARDED_BY(op_mu_) = 0;        // last posted
  uint64_t acked_seq_ GUARDED_BY(op_mu_) = 0;       // last completed
  uint32_t unsignaled_credits_ GUARDED_BY(op_mu_) = 0;
  Status error_ GUARDED_BY(op_mu_);
  bool errored_ GUARDED_BY(op_mu_) = false;

  // Send side (both roles).
  Mutex send_mu_;
  std::vector<Segment> txq_ GUARDED_BY(send_mu_);  // ring
  std::deque<Gather> staged_ GUARDED_BY(send_mu_);
  // Bytes of staged_: a peer that sends lists without taking the responses makes the queue
  // grow; past kGatherQueuedMax the lists go out piece by piece (no memory held).
  std::atomic<uint64_t> staged_bytes_{0};
  size_t tx_head_ GUARDED_BY(send_mu_) = 0;
  size_t tx_count_ GUARDED_BY(send_mu_) = 0;
  uint64_t tx_off_ GUARDED_BY(send_mu_) = 0;  // bytes of the head segment sent
  bool tx_closed_ GUARDED_BY(send_mu_) = false;
  Status tx_error_ GUARDED_BY(send_mu_);

  // Receive side: progress thread only, except the atomics.
  RxState rx_state_ = RxState::kHeader;
  RxAction rx_action_ = RxAction::kNone;
  FrameHeader rx_hdr_{};
  alignas(8) char hdr_buf_[kHeaderSize];
  size_t hdr_got_ = 0;
  // Received and not yet consumed: [rxb_pos_, rxb_len_) of rxb_ (OnReadable).
  static constexpr size_t kRxBufferBytes = 16 * 1024;
  std::unique_ptr<char[]> rxb_;
  size_t rxb_pos_ = 0, rxb_len_ = 0;
  bool rx_sock_drained_ = false;  // the last buffer fill was short
  char* rx_dest_ = nullptr;
  uint64_t rx_left_ = 0;
  AccessCheck rx_refusal_ = AccessCheck::kOk;  // why the request being drained is refused
  bool rx_discard_ = false;                    // a NAK was sent: later requests are discarded
  bool rx_dead_ = false;
  bool resp_pending_ = false;  // responses queued, not yet flushed
  uint64_t exec_seq_ = 0;      // last request executed (target role)
  uint64_t acked_sent_ = 0;    // last seq acknowledged to the peer
  uint64_t unacked_bytes_ = 0;
  uint64_t pend_seq_ = 0;  // a kRecvImm waiting for the app to reap (paused)
  uint32_t pend_imm_ = 0;
  uint64_t pend_len_ = 0;
  // A read request that arrived behind immediates the application is not done with waits for
  // them (ReadWaits), at most FabricOptions::tcp_read_wait_us: since when (0: not waiting), whether it is on the
  // engine's read_wait_ list, and whether the wait ran out (no read waits again until the
  // application is done with the immediates delivered by then: read_wait_expired_at_).
  int64_t read_wait_since_ns_ = 0;
  bool read_wait_listed_ = false;
  bool read_wait_expired_ = false;
  uint64_t read_wait_expired_at_ = 0;
  uint64_t imm_delivered_ = 0;          // immediates pushed to the CQ (progress thread)
  std::atomic<uint64_t> imm_done_{0};  // of them, those the application is done with
  std::atomic<bool> rx_paused_{false};
  std::atomic<int> recv_unreaped_{0};
};

// Parses "host:port" (host may be a name; empty = any).
Status ParseAddress(const std::string& address, struct sockaddr_in* out);
std::string SockaddrToString(const struct sockaddr_in& sa);

}  // namespace shardps::transport::tcp

#endif  // SHARDPS_TRANSPORT_TCP_TCP_INTERNAL_H_
