// Data path of the verbs provider: posting, completion processing, selective signaling, the
// RC error state, and Poll/Wait. Everything here runs on the polling thread of one CQ.
//
// Send-queue bookkeeping. Each endpoint numbers its posts with a 32-bit sequence; the op ring
// slot is sequence % send_depth and the sequence travels in the wr_id. RC completes in post
// order, so a completion for sequence s also completes every earlier unsignaled post: their
// send credits ride on that completion (returned to the caller when it is polled, or at once
// when the WR was signaled only so that the queue could be reaped). Because one WR in every
// signal_interval (<= send_depth) is signaled, the send queue can always be reaped.
//
// Error state. The first error completion (or a dead bootstrap socket) moves the QP to ERR and
// posts a signaled drain marker (the send queue has one spare entry for it, like the kernel's
// ib_drain_sq). Everything still outstanding then completes with kFlushed, whether or not the
// provider emits a flush completion for unsignaled WRs; posts made after the error are never
// handed to the QP and complete with kFlushed from the next Poll, in post order.
#include <arpa/inet.h>
#include <glog/logging.h>
#include <poll.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/verbs/verbs_internal.h"

namespace shardps::transport::verbs {
namespace {

constexpr int kPollBatch = 32;
// The CQ's epoll set of bootstrap sockets is checked at most this often from Poll (one
// epoll_wait, then a recv only on the sockets that turned readable); Wait also sleeps on it, so a
// dead peer is noticed within a few milliseconds.
constexpr auto kLivenessInterval = std::chrono::milliseconds(2);
constexpr auto kWaitSpin = std::chrono::microseconds(50);
constexpr unsigned kAckEventsBatch = 64;
static_assert(kPollBatch > 0 && kAckEventsBatch > 0, "batch sizes must be positive");

// The endpoint's status() after an error completion: the cause first, then where and the raw
// verbs status, e.g. "remote access error (bad rkey, out of bounds or missing access right):
// write on verbs:a->b [ibv: remote access error, vendor_err 0x0]".
Status StatusForWc(const ibv_wc& wc, const std::string& where) {
  char vendor[16];
  snprintf(vendor, sizeof(vendor), "%x", wc.vendor_err);
  const std::string tail =
      ": " + where + " [ibv: " + ibv_wc_status_str(wc.status) + ", vendor_err 0x" + vendor + "]";
  switch (wc.status) {
    case IBV_WC_REM_ACCESS_ERR:
      return PermissionDeniedError(
          "remote access error (bad rkey, out of bounds or missing access right)" + tail);
    case IBV_WC_RETRY_EXC_ERR:
      return UnavailableError("retry exceeded: peer not answering" + tail);
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return UnavailableError("RNR retry exceeded: peer not receiving" + tail);
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
    case IBV_WC_REM_ABORT_ERR:
      return AbortedError("remote operation error" + tail);
    default:
      return InternalError("local error" + tail);
  }
}

}  // namespace

WcStatus MapWcStatus(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS:
      return WcStatus::kSuccess;
    case IBV_WC_REM_ACCESS_ERR:
      return WcStatus::kRemoteAccessError;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return WcStatus::kRetryExceeded;
    case IBV_WC_WR_FLUSH_ERR:
      return WcStatus::kFlushed;
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
    case IBV_WC_REM_ABORT_ERR:
    case IBV_WC_BAD_RESP_ERR:
      return WcStatus::kRemoteOperationError;
    default:
      return WcStatus::kLocalError;  // LOC_*, MW_BIND, FATAL, GENERAL, ...
  }
}

// ---------------------------------------------------------------------------------------------
// VerbsEndpoint

VerbsEndpoint::VerbsEndpoint(std::shared_ptr<VerbsDevice> device, std::shared_ptr<CqState> cq,
                             QpPtr qp, EndpointConfig config)
    : Endpoint(config.options.endpoint_id, device.get(), kMaxOperationBytes),
      device_(std::move(device)),
      cq_(std::move(cq)),
      qp_(std::move(qp)),
      config_(std::move(config)),
      credits_(config_.options.send_depth),
      ring_(static_cast<size_t>(config_.options.send_depth)) {}

VerbsEndpoint::~VerbsEndpoint() {
  if (bootstrap_.get() >= 0 && error_.ok()) cq_->unwatchBootstrap(bootstrap_.get());
  if (attached_) {
    cq_->detach(this, cq_slot_, config_.options.send_depth + config_.options.recv_depth);
  }
  // The QP goes first here, so that no async event of it can be read after ForgetQp (its
  // destroy waits until every event read for it is acknowledged, which Drain does only once
  // recorded).
  if (qp_) {
    const uint32_t qpn = qp_->qp_num;
    qp_.reset();
    device_->async_events().ForgetQp(qpn);
  }
  // Members then go in reverse order: socket (the peer sees EOF), CQ, device.
}

void VerbsEndpoint::adoptBootstrap(UniqueFd fd) {
  if (bootstrap_.get() >= 0 && error_.ok()) cq_->unwatchBootstrap(bootstrap_.get());
  bootstrap_ = std::move(fd);
  if (bootstrap_.get() >= 0 && error_.ok()) cq_->watchBootstrap(bootstrap_.get(), cq_slot_, gen_);
}

Status VerbsEndpoint::start() {
  RETURN_IF_ERROR(
      cq_->attach(this, config_.options.send_depth + config_.options.recv_depth, &cq_slot_, &gen_));
  attached_ = true;
  return postRecv(config_.options.recv_depth);
}

Status VerbsEndpoint::postRecv(int count) {
  for (int i = 0; i < count; ++i) {
    ibv_recv_wr wr{};
    wr.wr_id = MakeWrId(WrKind::kRecv, cq_slot_, gen_, 0);
    wr.sg_list = nullptr;  // write-with-immediate consumes a receive but carries no payload
    wr.num_sge = 0;
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(qp_.get(), &wr, &bad); rc != 0) {
      return InternalError(std::string("verbs: ibv_post_recv: ") + strerror(rc));
    }
  }
  return Status::OK();
}

Status VerbsEndpoint::PostChecked(OpType op, const LocalSlice& local, const RemoteSlice& remote,
                                  uint32_t imm, uint64_t context, uint32_t flags) {
  const auto* region = static_cast<const VerbsMemoryRegion*>(local.region);  // checked: ours
  RETURN_IF_ERROR(credits_.Take());
  const uint32_t seq = head_seq_++;
  OpSlot& slot = ring_[seq % ring_.size()];
  slot.context = context;
  slot.imm = imm;
  slot.length = static_cast<uint32_t>(local.length);
  slot.op = op;
  slot.user_signaled = !(flags & kUnsignaled);
  slot.posted = false;
  if (!error_.ok()) {
    // Verbs-like: the op is accepted and completes with kFlushed from the next Poll.
    if (drained_) cq_->markSoftwareProgress(this);
    return Status::OK();
  }

  const bool signaled = slot.user_signaled || unsignaled_run_ + 1 >= config_.signal_interval;
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(region->data()) + local.offset;
  sge.length = static_cast<uint32_t>(local.length);
  sge.lkey = region->lkey();
  ibv_send_wr wr{};
  wr.wr_id = MakeWrId(WrKind::kSend, cq_slot_, gen_, seq);
  wr.sg_list = local.length > 0 ? &sge : nullptr;
  wr.num_sge = local.length > 0 ? 1 : 0;
  switch (op) {
    case OpType::kWrite:
      wr.opcode = IBV_WR_RDMA_WRITE;
      break;
    case OpType::kWriteImm:
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(imm);
      break;
    default:
      wr.opcode = IBV_WR_RDMA_READ;
      break;
  }
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  if (op != OpType::kRead && local.length > 0 &&
      local.length <= static_cast<uint64_t>(config_.max_inline)) {
    wr.send_flags |= IBV_SEND_INLINE;
  }
  wr.wr.rdma.remote_addr = remote.addr;
  wr.wr.rdma.rkey = remote.rkey;
  const int undo_run = unsignaled_run_;
  unsignaled_run_ = signaled ? 0 : unsignaled_run_ + 1;
  appendWr(wr, local.length > 0 ? &sge : nullptr);
  return finishPost(flags, 1, seq, undo_run);
}

void VerbsEndpoint::appendWr(const ibv_send_wr& wr, const ibv_sge* sge) {
  if (chain_wrs_.empty()) chain_first_seq_ = WrIdSeq(wr.wr_id);
  chain_wrs_.push_back(wr);
  chain_sges_.push_back(sge != nullptr ? *sge : ibv_sge{});
}

Status VerbsEndpoint::flushChain() {
  const size_t n = chain_wrs_.size();
  if (n == 0) return Status::OK();
  for (size_t i = 0; i < n; ++i) {
    ibv_send_wr& wr = chain_wrs_[i];
    wr.sg_list = wr.num_sge > 0 ? &chain_sges_[i] : nullptr;
    wr.next = i + 1 < n ? &chain_wrs_[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qp_.get(), chain_wrs_.data(), &bad);
  // On a failure the requests before `bad` were taken by the QP; `bad` and after were not.
  const size_t taken =
      rc == 0 ? n : (bad == nullptr ? 0 : static_cast<size_t>(bad - chain_wrs_.data()));
  for (size_t i = 0; i < taken; ++i) {
    ring_[(chain_first_seq_ + static_cast<uint32_t>(i)) % ring_.size()].posted = true;
  }
  chain_wrs_.clear();
  chain_sges_.clear();
  if (rc != 0) {
    return InternalError(std::string("verbs: ibv_post_send: ") + strerror(rc) + " (" +
                         std::to_string(taken) + " of " + std::to_string(n) +
                         " work requests taken)");
  }
  return Status::OK();
}

Status VerbsEndpoint::finishPost(uint32_t flags, size_t own, uint32_t undo_head, int undo_run) {
  if (flags & kMore) {
    cq_->markDeferred(this);
    return Status::OK();
  }
  const bool only_own = chain_wrs_.size() == own && chain_first_seq_ == undo_head;
  Status s = flushChain();
  if (s.ok()) return s;
  if (only_own && !ring_[undo_head % ring_.size()].posted) {
    head_seq_ = undo_head;
    credits_.Return(static_cast<int>(own));
    unsignaled_run_ = undo_run;
    return Status(s.code(), s.message() + "; nothing was posted");
  }
  // Posts accepted earlier (kMore) were in the chain, or the QP took part of it: they cannot be
  // taken back, so they complete flushed, as after any error.
  enterError(s, WcStatus::kLocalError);
  return Status::OK();
}

void VerbsEndpoint::flushDeferredOnPollingThread() {
  in_deferred_list_ = false;
  if (!error_.ok()) return;
  if (Status s = flushChain(); !s.ok()) enterError(s, WcStatus::kLocalError);
}

Status VerbsEndpoint::PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces,
                                          size_t n, uint64_t context, uint32_t flags) {
  const auto* region = static_cast<const VerbsMemoryRegion*>(dst.region);  // checked: ours
  for (size_t i = 0; i < n; ++i) {
    if (pieces[i].length > UINT32_MAX) {  // a WR moves < 4 GiB: as single reads (refused there)
      return Endpoint::PostReadListChecked(dst, pieces, n, context, flags);
    }
  }
  if (credits_.outstanding() + static_cast<int>(n) > credits_.depth()) {
    return ResourceExhaustedError("send queue full: " + std::to_string(credits_.outstanding()) +
                                  " operations outstanding, a read list of " + std::to_string(n) +
                                  " needs as many credits; poll the completion queue");
  }
  const uint32_t first_seq = head_seq_;
  for (size_t i = 0; i < n; ++i) {
    (void)credits_.Take();  // cannot fail: checked above
    OpSlot& slot = ring_[(first_seq + i) % ring_.size()];
    slot.context = context;
    slot.imm = 0;
    slot.length = static_cast<uint32_t>(pieces[i].length);
    slot.op = OpType::kRead;
    slot.user_signaled = i + 1 == n && !(flags & kUnsignaled);
    slot.posted = false;
  }
  head_seq_ += static_cast<uint32_t>(n);
  if (!error_.ok()) {
    // As PostChecked: accepted, completed with kFlushed from the next Poll.
    if (drained_) cq_->markSoftwareProgress(this);
    return Status::OK();
  }
  uint64_t off = reinterpret_cast<uint64_t>(region->data()) + dst.offset;
  const int undo_run = unsignaled_run_;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t seq = first_seq + static_cast<uint32_t>(i);
    const bool signaled =
        ring_[seq % ring_.size()].user_signaled || unsignaled_run_ + 1 >= config_.signal_interval;
    unsignaled_run_ = signaled ? 0 : unsignaled_run_ + 1;
    ibv_sge sge{};
    sge.addr = off;
    sge.length = static_cast<uint32_t>(pieces[i].length);
    sge.lkey = region->lkey();
    off += pieces[i].length;
    ibv_send_wr wr{};
    wr.wr_id = MakeWrId(WrKind::kSend, cq_slot_, gen_, seq);
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = pieces[i].remote.addr;
    wr.wr.rdma.rkey = pieces[i].remote.rkey;
    appendWr(wr, &sge);
  }
  return finishPost(flags, n, first_seq, undo_run);
}

void VerbsEndpoint::emit(uint32_t seq, WcStatus status, int credits) {
  const OpSlot& s = ring_[seq % ring_.size()];
  CqState::Pending p;
  p.completion.context = s.context;
  p.completion.endpoint_id = endpoint_id();
  p.completion.op = s.op;
  p.completion.status = status;
  p.completion.imm = s.op == OpType::kWriteImm ? s.imm : 0;
  p.completion.byte_len = s.length;
  p.endpoint = this;
  p.credits = credits;
  cq_->push(p);
}

// The status of the oldest op that fails without its own error: the cause for the first one
// (e.g. kRemoteDisconnected when the bootstrap socket died), kFlushed afterwards.
static WcStatus TakeFailure(bool* reported, WcStatus first, WcStatus own) {
  if (*reported) return own;
  *reported = true;
  return own == WcStatus::kFlushed ? first : own;
}

void VerbsEndpoint::onSendWcOnPollingThread(const ibv_wc& wc) {
  const uint32_t seq = WrIdSeq(wc.wr_id);
  const uint32_t inflight = head_seq_ - tail_seq_;
  if (seq - tail_seq_ >= inflight) {
    VLOG(1) << config_.description << ": dropping a completion for sequence " << seq
            << " that is no longer outstanding";
    return;
  }
  const bool was_healthy = error_.ok();
  const WcStatus st = MapWcStatus(wc.status);
  // RC completes in order: a later success, or the error of the op that failed first, means
  // every earlier op succeeded. A flush says nothing of them (the cause may have been lost).
  const bool earlier_succeeded = st != WcStatus::kFlushed;
  // Earlier posts have no completion of their own: succeeded if the endpoint was healthy.
  int covered = 0;
  for (; tail_seq_ != seq; ++tail_seq_) {
    if (was_healthy && ring_[tail_seq_ % ring_.size()].user_signaled) {
      // Its own completion was lost (a CQ overrun drops completions); its caller still gets
      // one, a success only where the order proves it.
      emit(tail_seq_, earlier_succeeded ? WcStatus::kSuccess : WcStatus::kFlushed, 1);
    } else if (was_healthy) {
      ++covered;
    } else {
      emit(tail_seq_,
           TakeFailure(&first_failure_reported_, pending_first_status_, WcStatus::kFlushed), 1);
    }
  }
  const OpSlot& slot = ring_[seq % ring_.size()];
  if (st == WcStatus::kSuccess && was_healthy) {
    if (slot.user_signaled) {
      emit(seq, st, covered + 1);
    } else {
      credits_.Return(covered + 1);  // signaled only to reap the send queue
    }
  } else {
    if (covered > 0) credits_.Return(covered);
    if (st != WcStatus::kSuccess && was_healthy) {
      enterError(StatusForWc(wc, std::string(OpTypeName(slot.op)) + " on " + config_.description),
                 st);
    }
    // Success reported after the error (the op raced the flush) is still a success.
    const WcStatus final_st =
        st == WcStatus::kSuccess ? st
                                 : TakeFailure(&first_failure_reported_, pending_first_status_, st);
    emit(seq, final_st, 1);
  }
  tail_seq_ = seq + 1;
}

void VerbsEndpoint::onDrainWcOnPollingThread() {
  // Every WR the QP accepted is complete: the rest of the posted ones were flushed.
  for (; tail_seq_ != head_seq_ && ring_[tail_seq_ % ring_.size()].posted; ++tail_seq_) {
    emit(tail_seq_,
         TakeFailure(&first_failure_reported_, pending_first_status_, WcStatus::kFlushed), 1);
  }
  drained_ = true;
  if (tail_seq_ != head_seq_) cq_->markSoftwareProgress(this);
}

void VerbsEndpoint::completeUnpostedOnPollingThread() {
  in_software_list_ = false;
  if (!drained_) return;
  for (; tail_seq_ != head_seq_; ++tail_seq_) emit(tail_seq_, WcStatus::kFlushed, 1);
}

void VerbsEndpoint::onRecvWcOnPollingThread(const ibv_wc& wc) {
  if (wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    CqState::Pending p;
    p.completion.context = 0;
    p.completion.endpoint_id = endpoint_id();
    p.completion.op = OpType::kRecvImm;
    p.completion.status = WcStatus::kSuccess;
    p.completion.imm = ntohl(wc.imm_data);
    p.completion.byte_len = wc.byte_len;
    p.endpoint = this;
    p.repost_recv = true;
    cq_->push(p);
    return;
  }
  if (wc.status == IBV_WC_WR_FLUSH_ERR) return;  // receives are ours, not the caller's
  if (wc.status == IBV_WC_SUCCESS) {
    LOG(WARNING) << config_.description << ": unexpected receive opcode " << wc.opcode
                 << " (the peer sent a two-sided message); ignored";
    if (Status s = postRecv(1); !s.ok()) enterError(s, WcStatus::kLocalError);
    return;
  }
  const WcStatus st = MapWcStatus(wc.status);
  enterError(StatusForWc(wc, "receive on " + config_.description), st);
  CqState::Pending p;
  p.completion.endpoint_id = endpoint_id();
  p.completion.op = OpType::kRecvImm;
  p.completion.status = st;
  p.endpoint = this;
  cq_->push(p);
}

void VerbsEndpoint::onHandedOutOnPollingThread(int credits, bool repost_recv) {
  if (credits > 0) credits_.Return(credits);
  if (repost_recv && error_.ok()) {
    if (Status s = postRecv(1); !s.ok()) enterError(s, WcStatus::kLocalError);
  }
}

void VerbsEndpoint::probeLivenessOnPollingThread() {
  if (!error_.ok() || bootstrap_.get() < 0) return;
  Status s = ProbePeer(bootstrap_.get());
  if (!s.ok()) {
    enterError(UnavailableError(s.message() + ": " + config_.description),
               WcStatus::kRemoteDisconnected);
  }
}

void VerbsEndpoint::onAsyncErrorOnPollingThread(Status why, bool completions_lost) {
  if (error_.ok()) {
    enterError(std::move(why), WcStatus::kLocalError, /*drain_via_qp=*/!completions_lost);
  } else if (completions_lost && !drained_) {
    completeInSoftware();  // the marker posted earlier may never complete
  }
}

void VerbsEndpoint::completeInSoftware() {
  // ERR -> RESET is synchronous: once it returns the device processes none of the QP's work
  // requests, so the buffers of the operations completed here are their caller's again (ERR
  // alone stops the QP asynchronously; that is why the drain marker exists).
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RESET;
  if (int rc = ibv_modify_qp(qp_.get(), &attr, IBV_QP_STATE); rc != 0) {
    LOG(ERROR) << "verbs: moving QP " << qp_->qp_num << " to RESET failed: " << strerror(rc);
  }
  onDrainWcOnPollingThread();
}

void VerbsEndpoint::enterError(Status why, WcStatus first_status, bool drain_via_qp) {
  if (!error_.ok()) return;
  error_ = std::move(why);
  // Held (kMore) requests never reach the QP: their slots say posted = false, so they
  // complete flushed after the drain, in post order.
  chain_wrs_.clear();
  chain_sges_.clear();
  pending_first_status_ = first_status;
  // An EOF stays readable: stop watching, or Wait would wake up for it forever. The socket
  // itself stays open until destruction, which is when the peer learns we are gone.
  if (bootstrap_.get() >= 0) cq_->unwatchBootstrap(bootstrap_.get());
  // INFO, as tcp's: the owner learns it from status() and decides what it means.
  LOG(INFO) << "verbs: endpoint " << endpoint_id() << " entered the error state: " << error_ << " ("
            << (head_seq_ - tail_seq_) << " ops outstanding)";
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  if (int rc = ibv_modify_qp(qp_.get(), &attr, IBV_QP_STATE); rc != 0) {
    LOG(ERROR) << "verbs: moving QP " << qp_->qp_num << " to ERR failed: " << strerror(rc);
  }
  if (!drain_via_qp) {
    completeInSoftware();
    return;
  }
  ibv_send_wr wr{};
  wr.wr_id = MakeWrId(WrKind::kDrain, cq_slot_, gen_, 0);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.num_sge = 0;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp_.get(), &wr, &bad); rc == 0) {
    drain_posted_ = true;
  } else {
    LOG(WARNING) << "verbs: posting the drain marker failed (" << strerror(rc)
                 << "); flushing outstanding ops in software";
    completeInSoftware();
  }
}

// ---------------------------------------------------------------------------------------------
// CqState

Status CqState::usable() const {
  const AsyncEvents& events = device_->async_events();
  RETURN_IF_ERROR(events.fatal());
  return events.CqError(cq_.get());
}

Status CqState::attach(VerbsEndpoint* ep, int slots, uint32_t* cq_slot, uint32_t* gen) {
  // A CQ that overran (or a failed device) stays unusable: an endpoint attached now would
  // never see its completions.
  RETURN_IF_ERROR(usable());
  RETURN_IF_ERROR(quota_.Reserve(slots));
  uint32_t idx;
  if (!free_slots_.empty()) {
    idx = free_slots_.back();
    free_slots_.pop_back();
  } else if (slots_.size() < kMaxEndpointsPerCq) {
    idx = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  } else {
    quota_.Release(slots);
    return ResourceExhaustedError("verbs: too many endpoints on one completion queue");
  }
  slots_[idx].ep = ep;
  slots_[idx].gen = (slots_[idx].gen + 1) & ((1u << kGenBits) - 1);
  *cq_slot = idx;
  *gen = slots_[idx].gen;
  return Status::OK();
}

void CqState::detach(VerbsEndpoint* ep, uint32_t cq_slot, int slots) {
  slots_[cq_slot].ep = nullptr;
  free_slots_.push_back(cq_slot);
  quota_.Release(slots);
  // Its completions not yet handed out go now (the rest keep their order): the quota just
  // released may be reserved again at once, and the ring holds only depth + 1 entries.
  size_t kept = 0;
  for (size_t i = 0; i < pending_count_; ++i) {
    const Pending& p = pending_[(pending_head_ + i) % pending_.size()];
    if (p.endpoint == ep) continue;
    pending_[(pending_head_ + kept++) % pending_.size()] = p;
  }
  pending_count_ = kept;
  software_progress_.erase(std::remove(software_progress_.begin(), software_progress_.end(), ep),
                           software_progress_.end());
  deferred_.erase(std::remove(deferred_.begin(), deferred_.end(), ep), deferred_.end());
}

void CqState::push(const Pending& p) {
  CHECK_LT(pending_count_, pending_.size())
      << "verbs: completion backlog overflow; the CQ quota invariant is broken";
  pending_[(pending_head_ + pending_count_) % pending_.size()] = p;
  ++pending_count_;
}

void CqState::markDeferred(VerbsEndpoint* ep) {
  if (ep->in_deferred_list_) return;
  ep->in_deferred_list_ = true;
  deferred_.push_back(ep);
}

void CqState::markSoftwareProgress(VerbsEndpoint* ep) {
  if (ep->in_software_list_) return;
  ep->in_software_list_ = true;
  software_progress_.push_back(ep);
}

void CqState::processWc(const ibv_wc& wc) {
  const uint32_t idx = WrIdSlot(wc.wr_id);
  VerbsEndpoint* ep = idx < slots_.size() ? slots_[idx].ep : nullptr;
  if (ep == nullptr || slots_[idx].gen != WrIdGen(wc.wr_id) || ep->qp_num() != wc.qp_num) {
    VLOG(1) << "verbs: dropping a stale completion of QP " << wc.qp_num;
    return;
  }
  switch (WrIdKind(wc.wr_id)) {
    case WrKind::kSend:
      ep->onSendWcOnPollingThread(wc);
      break;
    case WrKind::kRecv:
      ep->onRecvWcOnPollingThread(wc);
      break;
    case WrKind::kDrain:
      ep->onDrainWcOnPollingThread();
      break;
  }
}

void CqState::watchBootstrap(int fd, uint32_t cq_slot, uint32_t gen) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = (static_cast<uint64_t>(gen) << 32) | cq_slot;
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    PLOG(WARNING) << "verbs: epoll_ctl(ADD) of a bootstrap socket; its peer's death will be "
                     "noticed by the QP retry budget only";
  }
}

void CqState::unwatchBootstrap(int fd) {
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr) != 0 && errno != ENOENT) {
    PLOG(WARNING) << "verbs: epoll_ctl(DEL) of a bootstrap socket";
  }
}

void CqState::checkLivenessIfDue() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_liveness_check_) return;
  next_liveness_check_ = now + kLivenessInterval;
  epoll_event evs[16];
  const int n = epoll_wait(epoll_.get(), evs, 16, 0);  // level-triggered: the rest come next
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == kEpollAsyncTag) {
      // A device that went away (removed, reset) leaves its async fd failing for ever: out of
      // this epoll set then, or every Wait would return at once (Drain records it as fatal).
      if (!device_->async_events().Drain() || (evs[i].events & (EPOLLERR | EPOLLHUP)) != 0) {
        epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, device_->async_events().fd(), nullptr);
      }
      continue;
    }
    if (evs[i].data.u64 == kEpollWakeTag) {
      uint64_t count;
      if (::read(wake_.get(), &count, sizeof(count)) < 0 && errno != EAGAIN) {
        PLOG(WARNING) << "verbs: reading the async wake-up eventfd";
      }
      continue;
    }
    const uint32_t idx = static_cast<uint32_t>(evs[i].data.u64);
    const uint32_t gen = static_cast<uint32_t>(evs[i].data.u64 >> 32);
    if (idx < slots_.size() && slots_[idx].ep != nullptr && slots_[idx].gen == gen) {
      slots_[idx].ep->probeLivenessOnPollingThread();
    }
  }
  applyAsyncEvents();
}

void CqState::applyAsyncEvents() {
  AsyncEvents& events = device_->async_events();
  const uint64_t generation = events.generation();
  if (generation == async_generation_seen_) return;
  async_generation_seen_ = generation;  // before reading: a later event bumps it again
  const Status fatal = events.fatal();
  const Status cq_error = events.CqError(cq_.get());
  if (!fatal.ok() || !cq_error.ok()) {
    // What the CQ still holds did complete: taken first, so that only the operations whose
    // completions were lost fail.
    ibv_wc wcs[kPollBatch];
    int n;
    while ((n = ibv_poll_cq(cq_.get(), kPollBatch, wcs)) > 0) {
      for (int i = 0; i < n; ++i) processWc(wcs[i]);
    }
  }
  for (const EndpointSlot& slot : slots_) {
    if (slot.ep == nullptr) continue;
    Status qp_error = events.TakeQpError(slot.ep->qp_num());
    if (!fatal.ok()) {
      slot.ep->onAsyncErrorOnPollingThread(fatal, /*completions_lost=*/true);
    } else if (!cq_error.ok()) {
      slot.ep->onAsyncErrorOnPollingThread(cq_error, /*completions_lost=*/true);
    } else if (!qp_error.ok()) {
      slot.ep->onAsyncErrorOnPollingThread(std::move(qp_error), /*completions_lost=*/false);
    }
  }
}

int CqState::handOut(Completion* out, int max) {
  int n = 0;
  while (n < max && pending_count_ > 0) {
    Pending p = pending_[pending_head_];
    pending_head_ = (pending_head_ + 1) % pending_.size();
    --pending_count_;
    out[n++] = p.completion;
    p.endpoint->onHandedOutOnPollingThread(p.credits, p.repost_recv);
  }
  return n;
}

int CqState::PollOnPollingThread(Completion* out, int max) {
  if (max <= 0) return 0;
  checkLivenessIfDue();
  if (!deferred_.empty()) {  // what kMore held goes to the QPs before the CQ is polled
    std::vector<VerbsEndpoint*> eps;
    eps.swap(deferred_);
    for (VerbsEndpoint* ep : eps) ep->flushDeferredOnPollingThread();
  }
  if (!software_progress_.empty()) {
    std::vector<VerbsEndpoint*> eps;
    eps.swap(software_progress_);
    for (VerbsEndpoint* ep : eps) ep->completeUnpostedOnPollingThread();
  }
  if (pending_count_ < static_cast<size_t>(max)) {
    ibv_wc wcs[kPollBatch];
    int n = ibv_poll_cq(cq_.get(), kPollBatch, wcs);
    if (n < 0) {
      LOG_EVERY_N(ERROR, 1000) << "verbs: ibv_poll_cq failed: " << n;
    }
    for (int i = 0; i < n; ++i) processWc(wcs[i]);
  }
  return handOut(out, max);
}

int CqState::WaitOnPollingThread(Completion* out, int max, std::chrono::microseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  int n = PollOnPollingThread(out, max);
  if (n > 0) return n;
  const auto spin_until = std::min(deadline, Clock::now() + kWaitSpin);
  while (Clock::now() < spin_until) {
    if ((n = PollOnPollingThread(out, max)) > 0) return n;
  }
  for (;;) {
    if (!armed_) {
      if (int rc = ibv_req_notify_cq(cq_.get(), 0); rc != 0) {
        LOG_EVERY_N(ERROR, 1000) << "verbs: ibv_req_notify_cq failed: " << strerror(rc);
      } else {
        armed_ = true;
      }
    }
    // Poll again after arming: a completion that arrived before the arm raises no event.
    if ((n = PollOnPollingThread(out, max)) > 0) return n;
    const auto now = Clock::now();
    if (now >= deadline) return 0;
    pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {epoll_.get(), POLLIN, 0}};
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
    if (!armed_) left = std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(1));
    timespec ts{static_cast<time_t>(left.count() / 1000000000),
                static_cast<long>(left.count() % 1000000000)};
    int rc = ppoll(fds, 2, &ts, nullptr);
    if (rc > 0 && (fds[0].revents & POLLIN)) {
      ibv_cq* ev_cq = nullptr;
      void* ev_ctx = nullptr;
      if (ibv_get_cq_event(channel_.get(), &ev_cq, &ev_ctx) == 0) {
        armed_ = false;
        if (++unacked_events_ >= kAckEventsBatch) {
          ibv_ack_cq_events(cq_.get(), unacked_events_);
          unacked_events_ = 0;
        }
      }
    }
    if (rc > 0 && (fds[1].revents & POLLIN)) next_liveness_check_ = {};  // probe now
  }
}

}  // namespace shardps::transport::verbs
