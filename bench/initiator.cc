#include "bench/initiator.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <glog/logging.h>

#include "bench/bench_util.h"

namespace shardps::bench {

using transport::Access;
using transport::Completion;
using transport::EndpointOptions;
using transport::Fabric;
using transport::LocalSlice;

namespace {
constexpr int kRecvDepth = 16;
constexpr int kSendDepth = TransportInitiator::kMaxWindow + 1;
constexpr int kCqDepth = 2 * (kSendDepth + kRecvDepth);
static_assert(kCqDepth >= kSendDepth + kRecvDepth, "CQ quota must cover the endpoint");
}  // namespace

StatusOr<std::unique_ptr<TransportInitiator>> TransportInitiator::Connect(
    const InitiatorConfig& config) {
  std::unique_ptr<TransportInitiator> t(new TransportInitiator(config));
  ASSIGN_OR_RETURN(t->fabric_, Fabric::Open(config.fabric));
  ASSIGN_OR_RETURN(t->local_, t->fabric_->AllocateMemory(config.local_bytes, Access::kLocalOnly));
  ASSIGN_OR_RETURN(t->verify_,
                   t->fabric_->AllocateMemory(config.verify_bytes, Access::kLocalOnly));
  Prefault(t->local_->data(), t->local_->length());
  Prefault(t->verify_->data(), t->verify_->length());
  ASSIGN_OR_RETURN(t->cq_, t->fabric_->CreateCompletionQueue(kCqDepth));
  EndpointOptions eo;
  eo.endpoint_id = 1;
  eo.send_depth = kSendDepth;
  eo.recv_depth = kRecvDepth;
  eo.connect_timeout = std::chrono::milliseconds(60000);
  eo.auth_identity = kBenchIdentity;
  eo.auth_key = BenchKey();
  ASSIGN_OR_RETURN(t->ep_, t->fabric_->Connect(config.peer_address, t->cq_.get(), eo));
  LOG(INFO) << "initiator: " << t->DebugString();
  return t;
}

std::string TransportInitiator::DebugString() const {
  return ep_ ? ep_->DebugString() + " remote " + config_.remote.DebugString() : "unconnected";
}

Status TransportInitiator::Post(BenchOp op, const LocalSlice& local, uint64_t remote_offset,
                                uint64_t context, uint32_t flags) {
  const transport::RemoteSlice remote = transport::AtOffset(config_.remote, remote_offset);
  return op == BenchOp::kWrite ? ep_->PostWrite(local, remote, context, flags)
                               : ep_->PostRead(local, remote, context, flags);
}

StatusOr<int> TransportInitiator::WaitSome(Completion* wc, int max) {
  const double deadline = NowSeconds() + 60;
  for (;;) {
    const int n = config_.poll == PollMode::kSpin
                      ? cq_->Poll(wc, max)
                      : cq_->Wait(wc, max, std::chrono::microseconds(200000));
    if (n < 0) return InternalError("completion queue returned " + std::to_string(n));
    if (n > 0) return n;
    if (NowSeconds() > deadline) {
      return DeadlineExceededError("no completion for 60 s; endpoint " + ep_->DebugString() +
                                   " status: " + ep_->status().ToString());
    }
  }
}

namespace {
Status CompletionError(const Completion& c, const transport::Endpoint& ep) {
  return InternalError(std::string("operation ") + transport::OpTypeName(c.op) + " context " +
                       std::to_string(c.context) + " failed: " +
                       transport::WcStatusName(c.status) + "; endpoint: " +
                       ep.status().ToString());
}
}  // namespace

Status TransportInitiator::RunWindow(BenchOp op, const PointParams& p, double seconds,
                                     uint64_t* ops) {
  const int window = std::clamp(p.window, 1, kMaxWindow);
  const int slots = std::max(1, p.slots);
  if (static_cast<uint64_t>(slots) * p.size > local_->length() ||
      static_cast<uint64_t>(slots) * p.size > config_.remote.length) {
    return InvalidArgumentError("benchmark point needs " + std::to_string(slots) + " slots of " +
                                std::to_string(p.size) + " bytes; a region is too small");
  }
  const int sig = config_.signal_every > 0 ? config_.signal_every : std::max(1, window / 4);
  // Contexts are absolute sequence numbers so that a completion retires everything before it.
  const uint64_t base = next_context_;
  uint64_t posted = 0, done = 0;
  bool last_signaled = true;
  Completion wc[64];
  const double start = NowSeconds();
  for (;;) {
    const bool stop = NowSeconds() - start >= seconds;
    while (!stop && posted - done < static_cast<uint64_t>(window)) {
      const bool signaled = !config_.unsignaled || (posted + 1) % sig == 0 ||
                            posted + 1 - done == static_cast<uint64_t>(window);
      const size_t off = (posted % slots) * p.size;
      RETURN_IF_ERROR(Post(op, LocalSlice{local_.get(), off, p.size}, off, base + posted,
                           signaled ? transport::kSignaled : transport::kUnsignaled));
      ++posted;
      last_signaled = signaled;
    }
    if (posted == done) break;
    if (stop && !last_signaled) {
      // The tail is unsignaled: one more signaled op (it counts) retires it. The endpoint has a
      // spare credit: send_depth = kMaxWindow + 1.
      const size_t off = (posted % slots) * p.size;
      RETURN_IF_ERROR(Post(op, LocalSlice{local_.get(), off, p.size}, off, base + posted,
                           transport::kSignaled));
      ++posted;
      last_signaled = true;
    }
    ASSIGN_OR_RETURN(int n, WaitSome(wc, 64));
    for (int i = 0; i < n; ++i) {
      if (!wc[i].ok()) return CompletionError(wc[i], *ep_);
      if (wc[i].context >= base + posted || wc[i].context < base) {
        return InternalError("completion with unexpected context " +
                             std::to_string(wc[i].context));
      }
      done = std::max(done, wc[i].context - base + 1);
    }
  }
  next_context_ = base + posted;
  *ops = done;
  return Status::OK();
}

Status TransportInitiator::Bandwidth(BenchOp op, const PointParams& p, BwResult* out) {
  return TimedBandwidth(
      [&](double seconds, uint64_t* ops) { return RunWindow(op, p, seconds, ops); }, p, out);
}

Status TransportInitiator::OneOp(BenchOp op, const LocalSlice& local, uint64_t remote_offset) {
  const uint64_t ctx = next_context_++;
  RETURN_IF_ERROR(Post(op, local, remote_offset, ctx, transport::kSignaled));
  Completion wc[4];
  for (;;) {
    ASSIGN_OR_RETURN(int n, WaitSome(wc, 4));
    for (int i = 0; i < n; ++i) {
      if (!wc[i].ok()) return CompletionError(wc[i], *ep_);
      if (wc[i].context == ctx) return Status::OK();
    }
  }
}

Status TransportInitiator::Latency(BenchOp op, const PointParams& p, LatResult* out) {
  const int slots = std::max(1, p.slots);
  if (p.remote_slots > 0 && static_cast<uint64_t>(p.remote_slots) * p.size > config_.remote.length) {
    return InvalidArgumentError("latency: " + std::to_string(p.remote_slots) + " remote slots of " +
                                std::to_string(p.size) + " bytes exceed the remote region");
  }
  for (int i = 0; i < 3; ++i) {  // warm-up
    RETURN_IF_ERROR(OneOp(op, LocalSlice{local_.get(), 0, p.size}, 0));
  }
  out->us.clear();
  const double c0 = SelfCpuSeconds(), start = NowSeconds();
  for (int i = 0; i < p.lat_max_iters; ++i) {
    if (i >= p.lat_min_iters && NowSeconds() - start >= p.lat_seconds) break;
    const size_t off = (i % slots) * p.size;
    const size_t roff = p.remote_slots > 0 ? (i % p.remote_slots) * p.size : off;
    const double t0 = NowSeconds();
    RETURN_IF_ERROR(OneOp(op, LocalSlice{local_.get(), off, p.size}, roff));
    out->us.push_back((NowSeconds() - t0) * 1e6);
  }
  out->seconds = NowSeconds() - start;
  out->cpu_self = SelfCpuSeconds() - c0;
  return Status::OK();
}

Status TransportInitiator::Verify(size_t size, uint64_t seed) {
  if (size > verify_->length() || size > local_->length() || size > config_.remote.length) {
    return InvalidArgumentError("verify: size larger than a region");
  }
  FillPattern(local_->data(), size, seed);
  RETURN_IF_ERROR(OneOp(BenchOp::kWrite, LocalSlice{local_.get(), 0, size}, 0));
  std::memset(verify_->data(), 0, size);
  RETURN_IF_ERROR(OneOp(BenchOp::kRead, LocalSlice{verify_.get(), 0, size}, 0));
  const int64_t bad = FirstMismatch(local_->data(), verify_->data(), size);
  if (bad >= 0) {
    return DataLossError("verify: " + std::to_string(size) + "-byte write then read back differ "
                         "at offset " + std::to_string(bad));
  }
  return Status::OK();
}

}  // namespace shardps::bench
