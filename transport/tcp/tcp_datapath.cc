// tcp provider, datapath: posting and sending (application thread, continued by the progress
// thread on EPOLLOUT), the receive state machine of the progress thread (target role: access
// checks, payload straight into the region, READ_RESP straight from it, coalesced ACKs;
// initiator role: completions). The completion queue is in tcp_cq.cc.
//
// Zero intermediate copies: a write's payload is sent with sendmsg(header, source region) and
// received with readv(target region, next header); a read response likewise. Only rejected
// payloads go to a scratch sink. No heap allocation per operation: pending operations live in
// a ring of send_depth entries, the send queue is a ring that grows only while the peer is
// slower than we post.
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <glog/logging.h>

#include "transport/tcp/tcp_internal.h"

namespace shardps::transport::tcp {
namespace {

constexpr int kMaxIov = 64;
constexpr uint64_t kMaxIovBytes = 1ull << 30;
// A read list whose pieces average under kGatherPieceBytes (and total at most kGatherMaxBytes)
// is answered from one gathered copy rather than an iovec per piece.
constexpr uint64_t kGatherPieceBytes = 16 * 1024;
constexpr uint64_t kGatherMaxBytes = 4ull << 20;
constexpr uint64_t kGatherQueuedMax = 16ull << 20;  // per endpoint, queued and not yet sent
constexpr uint64_t kAckEveryOps = 64;
constexpr uint64_t kAckEveryBytes = 4ull << 20;
// Bytes one endpoint may read per round before the others get their turn (fairness).
constexpr uint64_t kReadBudgetBytes = 16ull << 20;

uint32_t SaturateLen(uint64_t n) {
  return n > 0xffffffffull ? 0xffffffffu : static_cast<uint32_t>(n);
}

std::string Hex(uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

const char* AccessCheckName(AccessCheck c) {
  switch (c) {
    case AccessCheck::kOk:
      return "ok";
    case AccessCheck::kUnknownRkey:
      return "unknown rkey";
    case AccessCheck::kOutOfBounds:
      return "outside the region";
    case AccessCheck::kNoAccess:
      return "access right missing";
    case AccessCheck::kDeregistered:
      return "region deregistered during the transfer";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// TcpEndpoint: setup and teardown

TcpEndpoint::TcpEndpoint(std::shared_ptr<TcpEngine> engine, UniqueFd fd, TcpCompletionQueue* cq,
                         const EndpointOptions& options, std::string local, std::string remote,
                         std::unique_ptr<TlsSession> tls)
    : Endpoint(options.endpoint_id, engine.get(), kMaxMessageBytes),
      engine_(std::move(engine)),
      fd_(std::move(fd)),
      tls_(std::move(tls)),
      send_depth_(options.send_depth),
      recv_depth_(options.recv_depth),
      local_(std::move(local)),
      remote_(std::move(remote)),
      credits_(options.send_depth),
      cq_(cq),
      ring_(options.send_depth),
      read_lists_(options.send_depth),
      txq_(static_cast<size_t>(options.send_depth) + 64) {
  MutexLock l(&engine_->setup_mu());
  cq_->attached().insert(this);
}

TcpEndpoint::~TcpEndpoint() {
  // After this the progress thread never looks at this endpoint again.
  engine_->RunSync([this]() REQUIRES(engine_->progress_mu()) { engine_->RemoveEndpoint(this); });
  TcpCompletionQueue* cq;
  {
    MutexLock l(&op_mu_);
    cq = cq_;
    cq_ = nullptr;
  }
  if (cq != nullptr) {
    {
      MutexLock l(&engine_->setup_mu());
      cq->quota().Release(send_depth_ + recv_depth_);
      cq->attached().erase(this);
    }
    cq->Purge(this);
  }
}

void TcpEndpoint::DetachCq() {
  MutexLock l(&op_mu_);
  cq_ = nullptr;
}

Status TcpEndpoint::status() const {
  MutexLock l(&op_mu_);
  return error_;
}

std::string TcpEndpoint::DebugString() const {
  return std::string(tls_ != nullptr ? "tcp+tls:" : "tcp:") + local_ + "->" + remote_;
}

// ---------------------------------------------------------------------------------------------
// Posting (polling thread)

Status TcpEndpoint::PostChecked(OpType type, const LocalSlice& local, const RemoteSlice& remote,
                                uint32_t imm, uint64_t context, uint32_t flags) {
  const auto* region = static_cast<const TcpRegion*>(local.region);  // checked: ours
  RETURN_IF_ERROR(credits_.Take());
  char* lptr = static_cast<char*>(region->data()) + local.offset;
  const PendingOp op{context,     local.length, lptr, remote.addr,
                     remote.rkey, imm,          type, (flags & kUnsignaled) == 0};
  Segment seg;
  TcpCompletionQueue* cq = nullptr;
  {
    MutexLock l(&op_mu_);
    cq = cq_;
    if (errored_) {  // like verbs: the post is accepted and completes flushed
      CompleteLocked(op, WcStatus::kFlushed);
      return Status::OK();
    }
    const uint64_t seq = ++post_seq_;
    ring_[seq % send_depth_] = op;
    seg.hdr = FrameHeader{};
    seg.hdr.magic = kFrameMagic;
    seg.hdr.opcode = type == OpType::kWrite      ? kOpWrite
                     : type == OpType::kWriteImm ? kOpWriteImm
                                                 : kOpReadReq;
    seg.hdr.imm = imm;
    seg.hdr.rkey = remote.rkey;
    seg.hdr.addr = remote.addr;
    seg.hdr.length = local.length;
    seg.hdr.seq = seq;
    seg.payload = type == OpType::kRead ? nullptr : lptr;
    seg.payload_len = type == OpType::kRead ? 0 : local.length;
  }
  // Doorbell batching: an unsignaled op (or one posted with kMore) is only queued. It leaves with the next post that is
  // sent (a signaled one, as selective signaling requires sooner or later), or when the
  // owning thread next polls this endpoint's CQ, whichever comes first; so a push (data write +
  // write-imm) or a pull (three reads) costs one sendmsg and reaches the target in one piece.
  // Ordering is unchanged: the queue is sent in post order. (The progress thread may also send
  // it earlier, with an ACK or on EPOLLOUT.)
  const bool defer = (flags & (kUnsignaled | kMore)) != 0 && cq != nullptr;
  {
    MutexLock l(&send_mu_);
    if (tx_closed_) return Status::OK();  // the progress thread fails (flushes) the op
    PushSegmentLocked(seg);
    if (!defer) {
      Status s = FlushLocked();
      if (!s.ok()) {
        // The progress thread owns the error transition: make it see the broken connection.
        tx_error_ = s;
        tx_closed_ = true;
        ::shutdown(fd_.get(), SHUT_RDWR);
      }
      return Status::OK();
    }
  }
  cq->AddDeferred(this);
  return Status::OK();
}

Status TcpEndpoint::PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                                        uint64_t context, uint32_t flags) {
  for (size_t i = 0; i < n; ++i) {
    if (pieces[i].length > UINT32_MAX) {
      return Endpoint::PostReadListChecked(dst, pieces, n, context, flags);  // as single reads
    }
  }
  const auto* region = static_cast<const TcpRegion*>(dst.region);  // checked: ours
  RETURN_IF_ERROR(credits_.Take());
  char* lptr = static_cast<char*>(region->data()) + dst.offset;
  const PendingOp op{context,     dst.length, lptr, pieces[0].remote.addr,
                     pieces[0].remote.rkey, 0, OpType::kRead, (flags & kUnsignaled) == 0};
  Segment seg;
  TcpCompletionQueue* cq = nullptr;
  {
    MutexLock l(&op_mu_);
    cq = cq_;
    if (errored_) {
      CompleteLocked(op, WcStatus::kFlushed);
      return Status::OK();
    }
    const uint64_t seq = ++post_seq_;
    ring_[seq % send_depth_] = op;
    std::vector<ReadListEntry>& list = read_lists_[seq % send_depth_];
    list.resize(n);
    for (size_t i = 0; i < n; ++i) {
      list[i] = ReadListEntry{pieces[i].remote.addr, pieces[i].remote.rkey,
                              static_cast<uint32_t>(pieces[i].length)};
    }
    seg.hdr = FrameHeader{};
    seg.hdr.magic = kFrameMagic;
    seg.hdr.opcode = kOpReadListReq;
    seg.hdr.imm = static_cast<uint32_t>(n);
    seg.hdr.length = dst.length;
    seg.hdr.seq = seq;
    // The list stays in read_lists_ until this slot of the ring is reused, which is after the
    // operation completed, hence after the request was sent.
    seg.payload = reinterpret_cast<const char*>(list.data());
    seg.payload_len = n * sizeof(ReadListEntry);
  }
  const bool defer = (flags & (kUnsignaled | kMore)) != 0 && cq != nullptr;
  {
    MutexLock l(&send_mu_);
    if (tx_closed_) return Status::OK();
    PushSegmentLocked(seg);
    if (!defer) {
      Status s = FlushLocked();
      if (!s.ok()) {
        tx_error_ = s;
        tx_closed_ = true;
        ::shutdown(fd_.get(), SHUT_RDWR);
      }
      return Status::OK();
    }
  }
  cq->AddDeferred(this);
  return Status::OK();
}

void TcpEndpoint::FlushDeferred() {
  MutexLock l(&send_mu_);
  if (tx_closed_ || tx_count_ == 0) return;
  Status s = FlushLocked();
  if (!s.ok()) {
    tx_error_ = s;
    tx_closed_ = true;
    ::shutdown(fd_.get(), SHUT_RDWR);
  }
}

void TcpEndpoint::CompleteLocked(const PendingOp& op, WcStatus status) {
  if (status == WcStatus::kSuccess && !op.signaled) {
    ++unsignaled_credits_;
    return;
  }
  const uint32_t credits = 1 + unsignaled_credits_;
  unsignaled_credits_ = 0;
  if (cq_ == nullptr) return;
  Completion c;
  c.context = op.context;
  c.endpoint_id = endpoint_id();
  c.op = op.type;
  c.status = status;
  c.imm = op.type == OpType::kWriteImm ? op.imm : 0;
  c.byte_len = SaturateLen(op.length);
  cq_->Push(c, this, credits);
}

void TcpEndpoint::CompleteUpToLocked(uint64_t seq) {
  for (uint64_t s = acked_seq_ + 1; s <= seq; ++s) {
    CompleteLocked(ring_[s % send_depth_], WcStatus::kSuccess);
  }
  if (seq > acked_seq_) acked_seq_ = seq;
}

// ---------------------------------------------------------------------------------------------
// Send queue (send_mu_ held)

void TcpEndpoint::PushSegmentLocked(const Segment& s) {
  if (tx_count_ == txq_.size()) {
    std::vector<Segment> bigger(txq_.size() * 2);
    for (size_t i = 0; i < tx_count_; ++i) bigger[i] = txq_[(tx_head_ + i) % txq_.size()];
    txq_.swap(bigger);
    tx_head_ = 0;
  }
  txq_[(tx_head_ + tx_count_) % txq_.size()] = s;
  ++tx_count_;
}

// Sends as much of the queue as the socket takes. OK when all sent or the socket is full (the
// progress thread continues on EPOLLOUT); an error when the connection is broken.
Status TcpEndpoint::FlushLocked() {
  while (tx_count_ > 0) {
    iovec iov[kMaxIov];
    int cnt = 0;
    uint64_t off = tx_off_;
    size_t staged_at = 0;     // staged_ index of the next staged segment
    bool payload_before = false;  // this iov already takes bytes from memory
    for (size_t i = 0; i < tx_count_ && cnt + 2 <= kMaxIov; ++i) {
      Segment& s = txq_[(tx_head_ + i) % txq_.size()];
      if (s.staged) {
        Gather& g = staged_[staged_at++];
        if (g.buf == nullptr) {
          // Filled only once everything before it is in the kernel: memory is read in the
          // order the requests executed.
          if (payload_before) break;
          FillGather(g);
          s.payload = g.buf.get();
        }
      }
      if (s.payload_len > 0) payload_before = true;
      bool capped = false;
      const uint64_t hb = s.headerless ? 0 : kHeaderSize;
      if (off < hb) {
        iov[cnt++] = {const_cast<char*>(reinterpret_cast<const char*>(&s.hdr)) + off, hb - off};
        if (s.payload_len > 0) {
          const uint64_t n = std::min(s.payload_len, kMaxIovBytes);
          iov[cnt++] = {const_cast<char*>(s.payload), n};
          capped = n < s.payload_len;
        }
      } else {
        const uint64_t done = off - hb;
        const uint64_t n = std::min(s.payload_len - done, kMaxIovBytes);
        iov[cnt++] = {const_cast<char*>(s.payload) + done, n};
        capped = n < s.payload_len - done;
      }
      off = 0;
      if (capped) break;
    }
    ssize_t n;
    if (tls_ != nullptr) {
      n = tls_->Writev(iov, cnt);
    } else {
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<size_t>(cnt);
      n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return Status::OK();
      return ErrnoError("tcp: send to " + remote_, errno);
    }
    uint64_t left = static_cast<uint64_t>(n);
    while (left > 0 && tx_count_ > 0) {
      const Segment& s = txq_[tx_head_];
      const uint64_t rest = (s.headerless ? 0 : kHeaderSize) + s.payload_len - tx_off_;
      if (left >= rest) {
        left -= rest;
        tx_off_ = 0;
        if (s.staged) {
          Gather& g = staged_.front();
          staged_bytes_.fetch_sub(g.len, std::memory_order_relaxed);
          if (g.buf != nullptr && gather_pool_bytes_ + g.cap <= kGatherPoolBytes) {
            gather_pool_bytes_ += g.cap;
            gather_pool_.emplace_back(std::move(g.buf), g.cap);
          }
          staged_.pop_front();
        }
        tx_head_ = (tx_head_ + 1) % txq_.size();
        --tx_count_;
      } else {
        tx_off_ += left;
        left = 0;
      }
    }
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Progress thread

void TcpEndpoint::OnEvents(uint32_t events) {
  engine_->progress_mu().AssertHeld();  // the engine calls with it held
  if (rx_dead_) return;
  if (events & EPOLLOUT) {
    Status s;
    {
      MutexLock l(&send_mu_);
      if (tx_count_ > 0 && !tx_closed_) {
        s = FlushLocked();
        if (!s.ok()) {
          tx_error_ = s;
          tx_closed_ = true;
        }
      }
    }
    if (!s.ok()) return Fail(WcStatus::kRemoteDisconnected, s);
  }
  if (rx_paused_.load(std::memory_order_relaxed)) {
    // Not reading (the app has recv_depth immediates to reap); still notice a dead peer.
    if (events & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
      Fail(WcStatus::kRemoteDisconnected,
           UnavailableError("tcp: peer " + remote_ + " closed the connection"));
    }
    return;
  }
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) OnReadable();
}

TcpEndpoint::IoResult TcpEndpoint::HandleIoError(ssize_t n) {
  if (n == 0) {
    Status why;
    {
      MutexLock l(&send_mu_);
      why = tx_error_;
    }
    if (why.ok()) why = UnavailableError("tcp: peer " + remote_ + " closed the connection");
    Fail(WcStatus::kRemoteDisconnected, why);
    return IoResult::kDead;
  }
  const int err = errno;
  if (err == EINTR) return IoResult::kRetry;
  if (err == EAGAIN || err == EWOULDBLOCK) return IoResult::kAgain;
  Fail(err == ETIMEDOUT ? WcStatus::kRetryExceeded : WcStatus::kRemoteDisconnected,
       ErrnoError("tcp: connection to " + remote_, err));
  return IoResult::kDead;
}

// Reads until the socket is drained, the endpoint pauses (recv_depth) or dies; then sends the
// coalesced ACK and any queued responses.
void TcpEndpoint::OnReadable() {
  engine_->progress_mu().AssertHeld();  // the engine calls with it held
  uint64_t budget = kReadBudgetBytes;
  while (!rx_dead_ && !rx_paused_.load(std::memory_order_relaxed)) {
    if (budget == 0) {
      engine_->AddAgain(this);  // edge-triggered: nobody would come back otherwise
      break;
    }
    if (rx_state_ == RxState::kHeader && hdr_got_ == kHeaderSize) {  // a whole header
      const uint8_t op = static_cast<uint8_t>(hdr_buf_[offsetof(FrameHeader, opcode)]);
      if ((op == kOpReadReq || op == kOpReadListReq) && ReadWaits()) {
        if (!read_wait_listed_) {
          read_wait_listed_ = true;
          engine_->AddReadWait(this);
        }
        // An edge that comes while the read waits is taken by a pass that reads nothing, so
        // a short last recv() says nothing once it has run: read the socket again then.
        rx_sock_drained_ = false;
        break;
      }
      hdr_got_ = 0;
      std::memcpy(&rx_hdr_, hdr_buf_, kHeaderSize);
      HandleHeader();
      continue;
    }
    // Bytes already received into the buffer first: headers, and small payloads, come from
    // one recv() for many frames (a stream of read requests, or of small read responses, costs
    // one system call per buffer, not one per frame).
    if (rxb_pos_ < rxb_len_) {
      const size_t avail = rxb_len_ - rxb_pos_;
      if (rx_state_ == RxState::kHeader) {
        const size_t take = std::min(avail, kHeaderSize - hdr_got_);
        std::memcpy(hdr_buf_ + hdr_got_, rxb_.get() + rxb_pos_, take);
        rxb_pos_ += take;
        hdr_got_ += take;
        budget -= std::min<uint64_t>(budget, take + 256);  // a frame costs more than its bytes
        continue;  // a whole header is handled above
      }
      const uint64_t take = std::min<uint64_t>(avail, rx_left_);
      if (rx_state_ == RxState::kPayload) {
        std::memcpy(rx_dest_, rxb_.get() + rxb_pos_, take);
        rx_dest_ += take;
      }
      rxb_pos_ += take;
      rx_left_ -= take;
      budget -= std::min(budget, take);
      if (rx_left_ == 0) FinishPayload();
      continue;
    }
    // The buffer is empty.
    if (rx_sock_drained_) {
      // The last recv() was short: the socket is drained, and new data raises a new edge.
      rx_sock_drained_ = false;
      break;
    }
    if (rx_state_ == RxState::kHeader || rx_left_ < kRxBufferBytes) {
      if (!rxb_) rxb_.reset(new char[kRxBufferBytes]);
      const iovec one{rxb_.get(), kRxBufferBytes};
      const ssize_t n = tls_ != nullptr ? tls_->Readv(&one, 1)
                                        : ::recv(fd_.get(), one.iov_base, one.iov_len, 0);
      if (n <= 0) {
        if (HandleIoError(n) == IoResult::kRetry) continue;
        break;
      }
      rxb_pos_ = 0;
      rxb_len_ = static_cast<size_t>(n);
      rx_sock_drained_ = rxb_len_ < kRxBufferBytes;
      continue;
    }
    // A large payload: straight into memory (or the scratch sink), plus the next header if it
    // is there.
    const bool to_mem = rx_state_ == RxState::kPayload;
    const uint64_t cap = to_mem ? kMaxIovBytes : engine_->scratch_size();
    const uint64_t chunk = std::min(rx_left_, cap);
    iovec iov[2];
    iov[0] = {to_mem ? rx_dest_ : engine_->scratch(), chunk};
    iov[1] = {hdr_buf_, kHeaderSize};
    const int iovcnt = chunk == rx_left_ ? 2 : 1;
    const ssize_t n = tls_ != nullptr ? tls_->Readv(iov, iovcnt) : ::readv(fd_.get(), iov, iovcnt);
    if (n <= 0) {
      if (HandleIoError(n) == IoResult::kRetry) continue;
      break;
    }
    uint64_t got = static_cast<uint64_t>(n);
    budget -= std::min(budget, got);
    const bool drained = got < chunk + (iovcnt == 2 ? kHeaderSize : 0);
    if (got > chunk) {
      hdr_got_ = got - chunk;
      got = chunk;
    }
    if (to_mem) rx_dest_ += got;
    rx_left_ -= got;
    if (rx_left_ == 0) FinishPayload();
    if (drained) {
      // Like a short recv(): drained, unless a complete header came with it (then go on: it
      // may be followed by frames the edge already announced).
      if (hdr_got_ == kHeaderSize || rx_state_ != RxState::kHeader) continue;
      break;
    }
  }
  if (!rx_dead_) MaybeAck();
}

// A read request that arrives while the application is not yet done with the immediates
// delivered before it waits, at most FabricOptions::tcp_read_wait_us, until it is. "Done" is the next Poll
// after the one that returned them (TcpCompletionQueue::Poll): an application takes its
// completions and acts on them (a server applies a worker's push) before it polls again, so
// the read then sees what the application made of the writes before it. Without the wait,
// the pull a worker sends right behind its push of the same chunk was served the version
// before the push about one time in five, and read again once the worker found it stale
// (docs/transport.md). An RC responder may execute a READ at any time after the writes before
// it; the wait picks a later time, bounded, so reads stay one-sided: an application that does
// not come back for that long delays reads by that much once, and not again until it is done
// with the immediates it had then.
bool TcpEndpoint::ReadWaits() {
  const int64_t max_ns = int64_t{engine_->options().tcp_read_wait_us} * 1000;
  if (rx_discard_ || max_ns <= 0) return false;  // refused anyway / never waits
  if (imm_done_.load(std::memory_order_acquire) >= imm_delivered_) {
    read_wait_since_ns_ = 0;
    read_wait_expired_ = false;
    return false;
  }
  if (read_wait_expired_) {
    // Reads go at once until the application is done with the immediates it had been given
    // when the wait ran out; later ones are waited for again (an expiry once, on a busy host,
    // must not switch the wait off for good while pushes keep the application behind).
    if (imm_done_.load(std::memory_order_acquire) < read_wait_expired_at_) return false;
    read_wait_expired_ = false;
  }
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  if (read_wait_since_ns_ == 0) read_wait_since_ns_ = now;
  if (now - read_wait_since_ns_ < max_ns) return true;
  read_wait_since_ns_ = 0;
  read_wait_expired_ = true;
  read_wait_expired_at_ = imm_delivered_;
  return false;
}

void TcpEndpoint::RetryReadWait() {
  engine_->progress_mu().AssertHeld();  // the engine calls with it held
  read_wait_listed_ = false;
  if (!rx_dead_ && !rx_paused_.load(std::memory_order_relaxed)) OnReadable();
}

void TcpEndpoint::HandleHeader() {
  const FrameHeader& h = rx_hdr_;
  if (h.magic != kFrameMagic) return ProtocolError("bad frame magic " + Hex(h.magic));
  switch (h.opcode) {
    case kOpWrite:
    case kOpWriteImm: {
      if (h.length > kMaxMessageBytes) return ProtocolError("write of " + Hex(h.length) + " bytes");
      if (rx_discard_) return StartDrain(h.length, RxAction::kNone);
      if (h.seq != exec_seq_ + 1) {
        return ProtocolError("request seq " + std::to_string(h.seq) + ", expected " +
                             std::to_string(exec_seq_ + 1));
      }
      char* dst = nullptr;
      const AccessCheck chk = engine_->Lookup(h.rkey, h.addr, h.length, true, &dst);
      if (chk != AccessCheck::kOk) {
        rx_refusal_ = chk;
        return StartDrain(h.length, RxAction::kNak);
      }
      return StartPayload(dst, h.length,
                          h.opcode == kOpWrite ? RxAction::kWrite : RxAction::kWriteImm);
    }
    case kOpReadReq: {
      if (h.length > kMaxMessageBytes) return ProtocolError("read of " + Hex(h.length) + " bytes");
      if (rx_discard_) return;
      if (h.seq != exec_seq_ + 1) {
        return ProtocolError("request seq " + std::to_string(h.seq) + ", expected " +
                             std::to_string(exec_seq_ + 1));
      }
      char* src = nullptr;
      const AccessCheck chk = engine_->Lookup(h.rkey, h.addr, h.length, false, &src);
      if (chk != AccessCheck::kOk) return SendNak(h, chk);
      exec_seq_ = h.seq;
      acked_sent_ = h.seq;  // READ_RESP acknowledges everything before it
      unacked_bytes_ = 0;
      Segment s;
      s.hdr = h;
      s.hdr.opcode = kOpReadResp;
      s.payload = src;
      s.payload_len = h.length;
      return SendResponse(s);
    }
    case kOpReadListReq: {
      if (h.length > kMaxMessageBytes || h.imm == 0 || h.imm > kMaxReadPieces) {
        return ProtocolError("read list of " + std::to_string(h.imm) + " pieces, " +
                             Hex(h.length) + " bytes");
      }
      const uint64_t list_bytes = uint64_t{h.imm} * sizeof(ReadListEntry);
      if (rx_discard_) return StartDrain(list_bytes, RxAction::kNone);
      if (h.seq != exec_seq_ + 1) {
        return ProtocolError("request seq " + std::to_string(h.seq) + ", expected " +
                             std::to_string(exec_seq_ + 1));
      }
      read_list_rx_.resize(h.imm);
      return StartPayload(reinterpret_cast<char*>(read_list_rx_.data()), list_bytes,
                          RxAction::kReadList);
    }
    case kOpReadResp: {
      char* dest = nullptr;
      bool ok = false;
      {
        MutexLock l(&op_mu_);
        if (h.seq > acked_seq_ && h.seq <= post_seq_) {
          const PendingOp& op = ring_[h.seq % send_depth_];
          if (op.type == OpType::kRead && op.length == h.length) {
            CompleteUpToLocked(h.seq - 1);
            dest = op.local;
            ok = true;
          }
        }
      }
      if (!ok) return ProtocolError("unexpected READ_RESP for seq " + std::to_string(h.seq));
      return StartPayload(dest, h.length, RxAction::kReadResp);
    }
    case kOpAck: {
      bool ok;
      {
        MutexLock l(&op_mu_);
        ok = h.seq >= acked_seq_ && h.seq <= post_seq_;
        if (ok) CompleteUpToLocked(h.seq);
      }
      if (!ok) return ProtocolError("ACK for seq " + std::to_string(h.seq) + " never posted");
      return;
    }
    case kOpNak: {
      PendingOp op{};
      bool ok;
      {
        MutexLock l(&op_mu_);
        ok = h.seq > acked_seq_ && h.seq <= post_seq_;
        if (ok) {
          CompleteUpToLocked(h.seq - 1);
          op = ring_[h.seq % send_depth_];
        }
      }
      if (!ok) return ProtocolError("NAK for seq " + std::to_string(h.seq) + " not outstanding");
      // Every reason means the same (tcp_wire.h): the target does not say which check failed.
      const std::string what = op.type == OpType::kRead ? "read" : "write";
      return Fail(WcStatus::kRemoteAccessError,
                  PermissionDeniedError("remote access error: the target refused the " + what +
                                        " [" + Hex(op.raddr) + ", +" + std::to_string(op.length) +
                                        ") with rkey " + Hex(op.rkey) +
                                        " (unknown or stale rkey, range outside the region, or no "
                                        "remote " +
                                        what + " right; the target does not say which)"));
    }
    default:
      return ProtocolError("unknown opcode " + std::to_string(h.opcode));
  }
}

void TcpEndpoint::StartPayload(char* dest, uint64_t len, RxAction action) {
  rx_state_ = RxState::kPayload;
  rx_dest_ = dest;
  rx_left_ = len;
  rx_action_ = action;
  if (len == 0) FinishPayload();
}

void TcpEndpoint::StartDrain(uint64_t len, RxAction action) {
  rx_state_ = RxState::kDrain;
  rx_dest_ = nullptr;
  rx_left_ = len;
  rx_action_ = action;
  if (len == 0) FinishPayload();
}

void TcpEndpoint::FinishPayload() {
  const RxAction action = rx_action_;
  const FrameHeader& h = rx_hdr_;
  rx_state_ = RxState::kHeader;
  rx_action_ = RxAction::kNone;
  switch (action) {
    case RxAction::kNone:
      return;
    case RxAction::kWrite:
      exec_seq_ = h.seq;
      unacked_bytes_ += h.length;
      break;
    case RxAction::kWriteImm:
      if (!TryDeliverImm(h.seq, h.imm, h.length)) return;  // paused; OnReadable acks the rest
      break;
    case RxAction::kReadResp: {
      MutexLock l(&op_mu_);
      CompleteUpToLocked(h.seq);
      return;
    }
    case RxAction::kNak:
      return SendNak(h, rx_refusal_);
    case RxAction::kReadList:
      return AnswerReadList();
    case RxAction::kReadRespGone:
      return Fail(WcStatus::kLocalError,
                  InternalError("tcp: the local region of a read was deregistered while the "
                                "read was in flight"));
  }
  if (exec_seq_ - acked_sent_ >= kAckEveryOps || unacked_bytes_ >= kAckEveryBytes) MaybeAck();
}

bool TcpEndpoint::TryDeliverImm(uint64_t seq, uint32_t imm, uint64_t len) {
  if (recv_unreaped_.load() >= recv_depth_) {
    // Publish "paused" before re-checking, so a concurrent reap either sees it and wakes us or
    // is seen by the re-check.
    rx_paused_.store(true);
    if (recv_unreaped_.load() >= recv_depth_) {
      pend_seq_ = seq;
      pend_imm_ = imm;
      pend_len_ = len;
      engine_->AddPaused(this);
      return false;
    }
    rx_paused_.store(false);
  }
  recv_unreaped_.fetch_add(1);
  {
    MutexLock l(&op_mu_);
    if (cq_ != nullptr) {
      ++imm_delivered_;
      Completion c;
      c.endpoint_id = endpoint_id();
      c.op = OpType::kRecvImm;
      c.imm = imm;
      c.byte_len = SaturateLen(len);
      cq_->Push(c, this, 0);
    }
  }
  exec_seq_ = seq;
  unacked_bytes_ += len;
  return true;
}

bool TcpEndpoint::TryResume() {
  engine_->progress_mu().AssertHeld();  // the engine calls with it held
  if (rx_dead_) return true;
  if (recv_unreaped_.load() >= recv_depth_) return false;
  rx_paused_.store(false);
  if (!TryDeliverImm(pend_seq_, pend_imm_, pend_len_)) return true;  // re-queued itself
  // The EPOLLIN edges that came while paused were ignored (OnEvents), so the last recv() being
  // short says nothing now: read the socket again, or the frames that arrived during the pause
  // wait for an edge that may never come (the peer may be waiting on their completions).
  rx_sock_drained_ = false;
  OnReadable();  // edge-triggered: continue with what is already buffered, then the socket
  return true;
}

void TcpEndpoint::OnRecvImmReaped() {
  recv_unreaped_.fetch_sub(1);
  if (rx_paused_.load()) engine_->Wake();
}

void TcpEndpoint::SendNak(const FrameHeader& req, AccessCheck why) {
  // Only seq and the one reason go out: rkey, addr and length stay 0, so the NAK of an unknown
  // rkey is byte-identical to that of a valid rkey out of range or without the right.
  Segment s;
  s.hdr = FrameHeader{};
  s.hdr.magic = kFrameMagic;
  s.hdr.opcode = kOpNak;
  s.hdr.reason = kNakRefused;
  s.hdr.seq = req.seq;
  s.payload = nullptr;
  s.payload_len = 0;
  VLOG(1) << "tcp: refusing request " << req.seq << " from " << remote_ << " (rkey "
          << Hex(req.rkey) << ", [" << Hex(req.addr) << ", +" << req.length
          << "): " << AccessCheckName(why) << ")";
  rx_discard_ = true;  // like an RC responder: nothing after the NAK is executed
  acked_sent_ = exec_seq_;
  SendResponse(s);
}

void TcpEndpoint::AnswerReadList() {
  const FrameHeader& h = rx_hdr_;
  // Every piece checked before anything is sent: a refused piece refuses the whole request.
  std::vector<const char*>& src = read_list_src_;
  src.resize(read_list_rx_.size());
  const AccessCheck chk =
      engine_->LookupReadList(read_list_rx_.data(), read_list_rx_.size(), src.data());
  if (chk != AccessCheck::kOk) return SendNak(h, chk);
  uint64_t total = 0;
  for (const ReadListEntry& e : read_list_rx_) total += e.length;
  if (total != h.length) return ProtocolError("read list pieces do not sum to its length");
  exec_seq_ = h.seq;
  acked_sent_ = h.seq;  // READ_RESP acknowledges everything before it
  unacked_bytes_ = 0;
  // Small pieces go out as one buffer gathered just before it is sent (FillGather): the
  // kernel costs about half a microsecond per iovec, more than the copy of a 256-byte row, and
  // a 4096-row list would otherwise be 4096 iovecs. Large pieces go out from the regions.
  const size_t n = read_list_rx_.size();
  const bool gather = n > 1 && total <= kGatherMaxBytes && total < kGatherPieceBytes * n &&
                      staged_bytes_.load(std::memory_order_relaxed) + total <= kGatherQueuedMax;
  MutexLock l(&send_mu_);
  if (tx_closed_) return;
  Segment s;
  s.hdr = h;
  s.hdr.opcode = kOpReadResp;
  s.hdr.imm = 0;
  s.payload = nullptr;
  s.payload_len = 0;
  PushSegmentLocked(s);
  if (gather) {
    Gather g;
    g.len = total;
    g.pieces.reserve(n);
    for (size_t i = 0; i < n; ++i) g.pieces.emplace_back(src[i], read_list_rx_[i].length);
    staged_.push_back(std::move(g));
    staged_bytes_.fetch_add(total, std::memory_order_relaxed);
    Segment p;
    p.hdr = FrameHeader{};
    p.headerless = true;
    p.staged = true;
    p.payload = nullptr;  // FillGather
    p.payload_len = total;
    PushSegmentLocked(p);
    resp_pending_ = true;
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    // Adjacent pieces go out as one.
    Segment p;
    p.hdr = FrameHeader{};
    p.headerless = true;
    p.payload = src[i];
    p.payload_len = read_list_rx_[i].length;
    while (i + 1 < n && src[i + 1] == p.payload + p.payload_len) {
      p.payload_len += read_list_rx_[++i].length;
    }
    PushSegmentLocked(p);
  }
  resp_pending_ = true;
}

void TcpEndpoint::FillGather(Gather& g) {
  for (size_t i = gather_pool_.size(); i-- > 0;) {
    if (gather_pool_[i].second < g.len) continue;
    g.buf = std::move(gather_pool_[i].first);
    g.cap = gather_pool_[i].second;
    gather_pool_bytes_ -= g.cap;
    gather_pool_.erase(gather_pool_.begin() + static_cast<ptrdiff_t>(i));
    break;
  }
  if (g.buf == nullptr) {
    g.cap = g.len;
    g.buf.reset(new char[g.cap]);
  }
  char* d = g.buf.get();
  // Scattered pieces miss the cache one by one: the first 320 bytes of the piece kAhead ahead
  // are prefetched, so that the misses of an embedding table's rows overlap. (A prefetch never
  // faults, past the piece or not; GCC drops prefetches in a loop of their own.)
  constexpr size_t kAhead = 8;
  const size_t n = g.pieces.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const char* p = g.pieces[i + kAhead].first;
      __builtin_prefetch(p);
      __builtin_prefetch(p + 64);
      __builtin_prefetch(p + 128);
      __builtin_prefetch(p + 192);
      __builtin_prefetch(p + 256);
    }
    std::memcpy(d, g.pieces[i].first, g.pieces[i].second);
    d += g.pieces[i].second;
  }
}

void TcpEndpoint::SendResponse(const Segment& s) {
  MutexLock l(&send_mu_);
  if (tx_closed_) return;
  PushSegmentLocked(s);
  resp_pending_ = true;
}

void TcpEndpoint::MaybeAck() {
  const bool ack = exec_seq_ > acked_sent_;
  if (!ack && !resp_pending_) return;
  Status s;
  {
    MutexLock l(&send_mu_);
    if (tx_closed_) return;
    if (ack) {
      Segment a;
      a.hdr = FrameHeader{};
      a.hdr.magic = kFrameMagic;
      a.hdr.opcode = kOpAck;
      a.hdr.seq = exec_seq_;
      a.payload = nullptr;
      a.payload_len = 0;
      PushSegmentLocked(a);
    }
    s = FlushLocked();
    if (!s.ok()) {
      tx_error_ = s;
      tx_closed_ = true;
    }
  }
  if (ack) {
    acked_sent_ = exec_seq_;
    unacked_bytes_ = 0;
  }
  resp_pending_ = false;
  if (!s.ok()) Fail(WcStatus::kRemoteDisconnected, s);
}

void TcpEndpoint::ProtocolError(const std::string& what) {
  LOG(WARNING) << "tcp: protocol error from " << remote_ << ": " << what
               << "; closing the connection";
  Fail(WcStatus::kRemoteOperationError,
       DataLossError("tcp: protocol error from peer " + remote_ + ": " + what));
}

void TcpEndpoint::Fail(WcStatus wc, Status why) {
  if (rx_dead_) return;
  rx_dead_ = true;
  rx_paused_.store(false);
  uint64_t failed = 0;
  {
    MutexLock l(&op_mu_);
    if (!errored_) {
      errored_ = true;
      error_ = why;
      for (uint64_t s = acked_seq_ + 1; s <= post_seq_; ++s) {
        CompleteLocked(ring_[s % send_depth_], failed++ == 0 ? wc : WcStatus::kFlushed);
      }
      acked_seq_ = post_seq_;
    }
  }
  {
    MutexLock l(&send_mu_);
    tx_closed_ = true;
    tx_head_ = tx_count_ = 0;
    tx_off_ = 0;
    staged_.clear();
    staged_bytes_.store(0, std::memory_order_relaxed);
  }
  ::shutdown(fd_.get(), SHUT_RDWR);
  engine_->Unwatch(fd_.get());
  if (failed == 0 && wc == WcStatus::kRemoteDisconnected) {
    VLOG(1) << "tcp: endpoint " << DebugString() << " (id " << endpoint_id()
            << ") disconnected: " << why;
  } else {
    LOG(INFO) << "tcp: endpoint " << DebugString() << " (id " << endpoint_id()
              << ") entered the error state with " << failed
              << " operation(s) outstanding: " << why;
  }
}

void TcpEndpoint::OnRegionGone(const char* base, uint64_t length) {
  engine_->progress_mu().AssertHeld();  // the engine calls with it held
  const char* end = base + length;
  if (rx_state_ == RxState::kPayload && rx_left_ > 0 && rx_dest_ < end &&
      rx_dest_ + rx_left_ > base) {
    rx_state_ = RxState::kDrain;  // the rest goes to the scratch sink
    if (rx_action_ == RxAction::kWrite || rx_action_ == RxAction::kWriteImm) {
      rx_action_ = RxAction::kNak;
      rx_refusal_ = AccessCheck::kDeregistered;
    } else if (rx_action_ == RxAction::kReadResp) {
      rx_action_ = RxAction::kReadRespGone;
    }
  }
  MutexLock l(&send_mu_);
  // Pieces of gathered responses not filled yet: zeros, as for a queued send below.
  for (Gather& g : staged_) {
    if (g.buf != nullptr) continue;
    for (auto& [p, len] : g.pieces) {
      if (p >= end || p + len <= base) continue;
      LOG(WARNING) << "tcp: region deregistered with a read-list response from it queued to "
                   << remote_;
      const char* zeros = engine_->Zeros(len);
      if (zeros != nullptr) {
        p = zeros;
      } else {
        tx_closed_ = true;
        ::shutdown(fd_.get(), SHUT_RDWR);
      }
    }
  }
  for (size_t i = 0; i < tx_count_; ++i) {
    Segment& s = txq_[(tx_head_ + i) % txq_.size()];
    if (s.staged) continue;  // its pieces: above
    if (s.payload_len == 0 || s.payload >= end || s.payload + s.payload_len <= base) continue;
    // The source vanished under a queued send (a read response, or a caller bug): the byte
    // count on the wire is already promised, so zeros go out instead.
    LOG(WARNING) << "tcp: region deregistered with a send from it queued to " << remote_;
    const char* zeros = engine_->Zeros(s.payload_len);
    if (zeros != nullptr) {
      s.payload = zeros;
    } else {
      tx_closed_ = true;
      ::shutdown(fd_.get(), SHUT_RDWR);
    }
  }
}

}  // namespace shardps::transport::tcp
