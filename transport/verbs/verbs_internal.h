// The verbs provider's classes (internal to transport/verbs). Setup lives in verbs_fabric.cc,
// the data path (posts, polling, error handling) in verbs_datapath.cc.
//
// Ownership: VerbsDevice (context + pd) is shared by everything a fabric creates. A
// CompletionQueue is a handle to a shared CqState (comp channel + ibv_cq), which every attached
// endpoint also holds, so the ibv_cq outlives its queue pairs whatever order the caller destroys
// things in.
//
// Threading: VerbsFabric's setup calls are serialised by its mutex. A CqState and all endpoints
// attached to it are used by that CQ's one polling thread (the contract of transport.h); the
// functions named *OnPollingThread must only be called there. Connect/Accept attach the new
// endpoint to its CQ, so they run on that CQ's polling thread or while nobody polls it (as in
// the tests, which connect from a helper thread before polling starts). There is no provider
// thread: the HCA executes the operations, Poll/Wait reap them.
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_INTERNAL_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_INTERNAL_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "transport/flow_control.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_handshake.h"
#include "transport/verbs/verbs_ibv.h"

namespace shardps::transport::verbs {

class VerbsEndpoint;

// wr_id layout: kind:2 | cq slot:16 | generation:14 | sequence:32. Send ops carry their
// endpoint's 32-bit post sequence (ring slot = sequence % send_depth), so a completion maps back
// to (endpoint, slot) with no per-op allocation.
enum class WrKind : uint64_t { kSend = 0, kRecv = 1, kDrain = 2 };
constexpr int kCqSlotBits = 16;
constexpr int kGenBits = 14;
constexpr uint64_t kMaxEndpointsPerCq = uint64_t{1} << kCqSlotBits;
static_assert(2 + kCqSlotBits + kGenBits + 32 == 64, "wr_id fields must fill 64 bits");
inline uint64_t MakeWrId(WrKind kind, uint32_t cq_slot, uint32_t gen, uint32_t seq) {
  return (static_cast<uint64_t>(kind) << 62) | (static_cast<uint64_t>(cq_slot) << 46) |
         (static_cast<uint64_t>(gen & ((1u << kGenBits) - 1)) << 32) | seq;
}
inline WrKind WrIdKind(uint64_t id) { return static_cast<WrKind>(id >> 62); }
inline uint32_t WrIdSlot(uint64_t id) { return (id >> 46) & (kMaxEndpointsPerCq - 1); }
inline uint32_t WrIdGen(uint64_t id) { return (id >> 32) & ((1u << kGenBits) - 1); }
inline uint32_t WrIdSeq(uint64_t id) { return static_cast<uint32_t>(id); }

// epoll data of a CqState's epoll set: a bootstrap socket is (gen << 32 | cq slot), which
// never reaches these.
constexpr uint64_t kEpollAsyncTag = ~uint64_t{0};     // the device's async event fd
constexpr uint64_t kEpollWakeTag = ~uint64_t{0} - 1;  // the CqState's wake_ eventfd

class VerbsMemoryRegion final : public MemoryRegion {
 public:
  struct MmapDeleter {
    size_t length = 0;
    void operator()(void* p) const;
  };
  using MappingPtr = std::unique_ptr<void, MmapDeleter>;

  VerbsMemoryRegion(std::shared_ptr<VerbsDevice> device, MappingPtr mapping, MrPtr mr, void* data,
                    size_t length, Access access, MemoryKind kind);
  RegionDescriptor descriptor() const override;
  uint32_t lkey() const { return mr_->lkey; }
  const VerbsDevice* device() const { return device_.get(); }

 private:
  // Dependency order: the MR is deregistered before the memory is unmapped.
  std::shared_ptr<VerbsDevice> device_;
  MappingPtr mapping_;  // only for AllocateMemory
  MrPtr mr_;
};

// State of one CompletionQueue; shared with the endpoints attached to it.
class CqState {
 public:
  CqState(std::shared_ptr<VerbsDevice> device, int depth);
  ~CqState();
  Status init();

  // One user completion waiting to be handed out. Credits and receive buffers go back to the
  // endpoint only when the caller actually polls the completion ("polling returns credits").
  struct Pending {
    Completion completion;
    VerbsEndpoint* endpoint = nullptr;  // detach removes an endpoint's entries
    int credits = 0;                    // send credits this completion returns
    bool repost_recv = false;           // a kRecvImm: give one receive back to the QP
  };

  int PollOnPollingThread(Completion* out, int max);
  int WaitOnPollingThread(Completion* out, int max, std::chrono::microseconds timeout);

  // Attach/detach (polling thread, or under the fabric lock before the endpoint is handed out).
  Status attach(VerbsEndpoint* ep, int slots, uint32_t* cq_slot, uint32_t* gen);
  void detach(VerbsEndpoint* ep, uint32_t cq_slot, int slots);
  void push(const Pending& p);  // from an endpoint, while processing completions
  void markSoftwareProgress(VerbsEndpoint* ep);
  // An endpoint holding work requests posted with kMore: the next Poll hands them to its QP.
  void markDeferred(VerbsEndpoint* ep);
  // The CQ's epoll set holds the bootstrap sockets of its healthy endpoints, so liveness costs
  // one epoll_wait per check (and one extra fd in Wait) however many endpoints are attached.
  void watchBootstrap(int fd, uint32_t cq_slot, uint32_t gen);
  void unwatchBootstrap(int fd);

  ibv_cq* cq() const { return cq_.get(); }
  int depth() const { return quota_.depth(); }
  // OK when an endpoint of `slots` would fit now (RESOURCE_EXHAUSTED otherwise): Connect fails
  // fast, before it waits on the listener's challenge. Polling thread, like attach.
  Status checkRoom(int slots) {
    RETURN_IF_ERROR(usable());
    RETURN_IF_ERROR(quota_.Reserve(slots));
    quota_.Release(slots);
    return Status::OK();
  }
  const VerbsDevice& device() const { return *device_; }

 private:
  // OK unless the device's async events made this CQ unusable (an overrun, a fatal device).
  Status usable() const;
  void processWc(const ibv_wc& wc);
  void checkLivenessIfDue();
  // The device's async events recorded since the last look: the endpoints they concern fail.
  void applyAsyncEvents();
  int handOut(Completion* out, int max);

  struct EndpointSlot {
    VerbsEndpoint* ep = nullptr;
    uint32_t gen = 0;
  };

  // Dependency order: the cq uses the channel, both use the device's context.
  std::shared_ptr<VerbsDevice> device_;
  CompChannelPtr channel_;
  CqPtr cq_;
  // Bootstrap sockets of the attached endpoints, the device's async event fd and wake_.
  UniqueFd epoll_;
  UniqueFd wake_;  // eventfd: AsyncEvents::Drain recorded something (possibly for us)
  uint64_t async_generation_seen_ = 0;
  CqQuota quota_;
  unsigned unacked_events_ = 0;
  bool armed_ = false;
  std::vector<EndpointSlot> slots_;
  std::vector<uint32_t> free_slots_;
  // Ring of completions not yet handed out; capacity depth()+1 suffices because every entry
  // holds a send credit or a posted receive of an attached endpoint.
  std::vector<Pending> pending_;
  size_t pending_head_ = 0;
  size_t pending_count_ = 0;
  std::vector<VerbsEndpoint*> software_progress_;  // errored endpoints with unposted ops
  std::vector<VerbsEndpoint*> deferred_;           // endpoints holding a kMore chain
  std::chrono::steady_clock::time_point next_liveness_check_{};
};

class VerbsCompletionQueue final : public CompletionQueue {
 public:
  explicit VerbsCompletionQueue(std::shared_ptr<CqState> state) : state_(std::move(state)) {}
  int Poll(Completion* out, int max) override { return state_->PollOnPollingThread(out, max); }
  int Wait(Completion* out, int max, std::chrono::microseconds timeout) override {
    return state_->WaitOnPollingThread(out, max, timeout);
  }
  int depth() const override { return state_->depth(); }
  const std::shared_ptr<CqState>& state() const { return state_; }

 private:
  std::shared_ptr<CqState> state_;
};

// Tunables of one endpoint, fixed at connect time.
struct EndpointConfig {
  EndpointOptions options;
  int max_inline = 0;       // effective: min(options.max_inline, the QP's max_inline_data)
  int signal_interval = 1;  // effective: clamp(options.signal_interval, 1, send_depth)
  std::string description;  // "verbs:local->remote"
};

// One operation moves at most 2 GiB (ibv_sge::length is 32 bits; 2^31 is the portable cap).
constexpr uint64_t kMaxOperationBytes = uint64_t{1} << 31;

class VerbsEndpoint final : public Endpoint {
 public:
  // One send-queue slot per outstanding operation.
  struct OpSlot {
    uint64_t context = 0;
    uint32_t imm = 0;
    uint32_t length = 0;
    OpType op = OpType::kWrite;
    bool user_signaled = false;  // the caller asked for a completion
    bool posted = false;         // handed to the QP (false: posted after the error; software)
  };

  VerbsEndpoint(std::shared_ptr<VerbsDevice> device, std::shared_ptr<CqState> cq, QpPtr qp,
                EndpointConfig config);
  ~VerbsEndpoint() override;
  // Posts the initial receives and registers with the CQ (setup, before hand-out).
  Status start();
  // Takes the bootstrap socket once the handshake is over; it becomes the liveness channel.
  void adoptBootstrap(UniqueFd fd);
  void setDescription(std::string d) { config_.description = std::move(d); }

  Status status() const override { return error_; }
  int outstanding() const override { return credits_.outstanding(); }
  std::string DebugString() const override { return config_.description; }

  // Called by CqState on the polling thread.
  uint32_t qp_num() const { return qp_->qp_num; }
  void onSendWcOnPollingThread(const ibv_wc& wc);
  void onRecvWcOnPollingThread(const ibv_wc& wc);
  void onDrainWcOnPollingThread();
  void onHandedOutOnPollingThread(int credits, bool repost_recv);
  void completeUnpostedOnPollingThread();
  void probeLivenessOnPollingThread();
  // The device reported an async error for this endpoint's QP, its CQ or itself (AsyncEvents).
  // `completions_lost`: the CQ overran or the device failed, so the outstanding operations
  // complete in software (failed) instead of by the QP's flush.
  void onAsyncErrorOnPollingThread(Status why, bool completions_lost);
  // Hands the work requests held by kMore to the QP (the CQ's Poll); a failure moves the
  // endpoint into the error state (those posts were accepted: they complete flushed).
  void flushDeferredOnPollingThread();

 private:
  Status PostChecked(OpType op, const LocalSlice& local, const RemoteSlice& remote, uint32_t imm,
                     uint64_t context, uint32_t flags) override;
  // A read list as one chain of n RDMA READ work requests handed to the QP by one
  // ibv_post_send (one doorbell): n credits, taken all or none; the last WR carries `flags`,
  // the others are unsignaled (save the signal_interval ones); with kMore it is held like a
  // single post.
  Status PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                             uint64_t context, uint32_t flags) override;
  Status postRecv(int count);
  // The chain: work requests accepted but not yet handed to the QP (their ring slots say
  // posted = false), the newest posts. appendWr adds one; flushChain hands all of them to the
  // QP with one ibv_post_send (one doorbell) and marks the slots of those it took.
  void appendWr(const ibv_send_wr& wr, const ibv_sge* sge);
  Status flushChain();
  // After a post's own work requests were appended: held (kMore) or handed to the QP. If the
  // QP refuses the chain and it holds only this post's `own` requests, they are taken back
  // (`head_seq_`, credits and the signal run restored from `undo_*`) and the error returned:
  // nothing was posted; otherwise the endpoint enters the error state.
  Status finishPost(uint32_t flags, size_t own, uint32_t undo_head, int undo_run);
  // Moves the endpoint into the error state (first error wins), flushes the QP and posts the
  // drain marker. `first_status` is reported by the oldest outstanding op if no error
  // completion carries the cause itself. Without `drain_via_qp` (the CQ can no longer be
  // trusted to deliver the marker) the outstanding ops complete in software at once.
  void enterError(Status why, WcStatus first_status, bool drain_via_qp = true);
  // Moves the QP to RESET (synchronous: the device stops using the buffers) and completes every
  // outstanding op as flushed, for when no drain marker can be relied on.
  void completeInSoftware();
  void emit(uint32_t seq, WcStatus status, int credits);

  // Dependency order: the QP uses the CQ, both use the device.
  std::shared_ptr<VerbsDevice> device_;
  std::shared_ptr<CqState> cq_;
  QpPtr qp_;
  UniqueFd bootstrap_;
  EndpointConfig config_;  // fixed once the handshake is over
  SendCredits credits_;
  std::vector<OpSlot> ring_;  // send_depth slots
  uint32_t head_seq_ = 0;     // next post
  uint32_t tail_seq_ = 0;     // oldest op whose completion is not yet generated
  int unsignaled_run_ = 0;    // posts since the last signaled WR
  std::vector<ibv_send_wr> chain_wrs_;
  std::vector<ibv_sge> chain_sges_;  // chain_wrs_[i]'s (num_sge 0 or 1), linked at flush
  uint32_t chain_first_seq_ = 0;
  bool in_deferred_list_ = false;
  uint32_t cq_slot_ = 0;
  uint32_t gen_ = 0;
  bool attached_ = false;
  Status error_;
  WcStatus pending_first_status_ = WcStatus::kFlushed;  // cause not carried by a completion
  bool first_failure_reported_ = false;
  bool drain_posted_ = false;
  bool drained_ = false;  // every WR given to the QP has completed
  bool in_software_list_ = false;
  friend class CqState;
};

class VerbsListener final : public Listener {
 public:
  VerbsListener(class VerbsFabric* fabric, UniqueFd fd, std::string address)
      : fabric_(fabric),
        fd_(std::move(fd)),
        address_(std::move(address)),
        gate_("verbs: listener " + address_, HandshakeGate::Limits{}) {}
  std::string address() const override { return address_; }
  StatusOr<std::unique_ptr<Endpoint>> Accept(CompletionQueue* cq, const EndpointOptions& options,
                                             std::chrono::milliseconds timeout) override;
  HandshakeGate::Stats gate_stats() const override { return gate_.stats(); }

 private:
  VerbsFabric* fabric_;  // the fabric outlives its listeners (caller contract)
  UniqueFd fd_;
  std::string address_;
  HandshakeGate gate_;  // bootstrap connections that have not yet authenticated
};

class VerbsFabric final : public Fabric {
 public:
  VerbsFabric(std::shared_ptr<VerbsDevice> device, FabricOptions options)
      : device_(std::move(device)), options_(std::move(options)) {}
  std::string name() const override { return "verbs"; }
  int max_cq_depth() const override { return device_->device_attr().max_cqe / 2; }
  std::string DebugString() const override { return device_->DebugString(); }
  StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length, Access access,
                                                         MemoryKind kind) override;
  StatusOr<std::unique_ptr<MemoryRegion>> AllocateMemory(size_t length, Access access) override;
  StatusOr<std::unique_ptr<CompletionQueue>> CreateCompletionQueue(int depth) override;
  StatusOr<std::unique_ptr<Listener>> Listen(const std::string& address) override;
  StatusOr<std::unique_ptr<Endpoint>> Connect(const std::string& address, CompletionQueue* cq,
                                              const EndpointOptions& options) override;

  // Runs the QP handshake over an established bootstrap socket (both sides).
  StatusOr<std::unique_ptr<Endpoint>> establish(UniqueFd fd, CompletionQueue* cq,
                                                const EndpointOptions& options,
                                                const std::string& local, const std::string& remote,
                                                Deadline deadline);

 private:
  std::shared_ptr<VerbsDevice> device_;
  const FabricOptions options_;
  // Serialises setup calls (registration, CQ and QP creation on device_'s protection
  // domain). It guards no member: device_ and options_ are immutable, and the verbs objects it
  // orders are owned by what the calls return.
  Mutex mu_;
};

// Maps an ibv_wc_status to the provider-neutral WcStatus.
WcStatus MapWcStatus(ibv_wc_status s);

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_INTERNAL_H_
