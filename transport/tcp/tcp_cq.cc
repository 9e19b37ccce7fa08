// tcp provider, completion queue: the ring the progress thread (and posts on errored
// endpoints) fill and the polling thread drains, the deferred-send list of doorbell batching,
// and Wait's spin-then-sleep. See tcp_internal.h for the threading model.
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <glog/logging.h>

#include "transport/tcp/tcp_internal.h"

namespace shardps::transport::tcp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kWaitSpin = std::chrono::microseconds(30);

}  // namespace

// ---------------------------------------------------------------------------------------------
// TcpCompletionQueue

TcpCompletionQueue::TcpCompletionQueue(std::shared_ptr<TcpEngine> engine, int depth)
    : engine_(std::move(engine)),
      depth_(depth),
      quota_(depth),
      event_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      ring_(depth) {
  // Without the eventfd, Wait degrades to sleeping in short ppoll slices (see Wait).
  if (!event_fd_.valid()) PLOG(ERROR) << "tcp: eventfd for a completion queue";
}

TcpCompletionQueue::~TcpCompletionQueue() {
  // Endpoints should be gone first; if not, they stop delivering here.
  MutexLock l(&engine_->setup_mu());
  for (TcpEndpoint* ep : attached_) ep->DetachCq();
  attached_.clear();
}

void TcpCompletionQueue::Push(const Completion& c, TcpEndpoint* ep, uint32_t credits) {
  MutexLock l(&mu_);
  if (size_ == ring_.size()) {
    // The quota invariant makes this unreachable; grow rather than drop if it is ever broken.
    LOG_FIRST_N(ERROR, 1) << "tcp: completion queue over its depth " << depth_;
    std::vector<Entry> bigger(ring_.size() * 2);
    for (size_t i = 0; i < size_; ++i) bigger[i] = ring_[(head_ + i) % ring_.size()];
    ring_.swap(bigger);
    head_ = 0;
  }
  ring_[(head_ + size_) % ring_.size()] = Entry{c, ep, credits};
  ++size_;
  count_.store(size_, std::memory_order_release);
  if (waiters_ > 0) {
    const uint64_t one = 1;
    ssize_t rc;
    do {
      rc = ::write(event_fd_.get(), &one, sizeof(one));
    } while (rc < 0 && errno == EINTR);
  }
}

int TcpCompletionQueue::Poll(Completion* out, int max) {
  FlushDeferred();
  if (any_reaped_.load(std::memory_order_relaxed)) {
    // The application is back: it has done what it does with the immediates it took last.
    MutexLock l(&mu_);
    for (const auto& [ep, n] : reaped_) ep->OnImmsDone(n);
    reaped_.clear();
    any_reaped_.store(false, std::memory_order_relaxed);
  }
  if (max <= 0) return 0;
  if (count_.load(std::memory_order_acquire) == 0) {
    engine_->TryProgress();
    // At most every 10 ms with nothing completed: re-read endpoints that wait for responses,
    // so a lost edge-triggered event can delay an EOF by 10 ms but never hide it.
    const auto now = Clock::now();
    if (count_.load(std::memory_order_acquire) == 0 &&
        now - last_rescan_ > std::chrono::milliseconds(10)) {
      last_rescan_ = now;
      MutexLock l(&engine_->setup_mu());
      engine_->Rescan(attached_);
    }
    if (count_.load(std::memory_order_acquire) == 0) {
      // A spinning poller must not starve the threads it is waiting for: socket wakeups are
      // "sync" wakeups that the scheduler places on the waker's core, behind this spinner.
      sched_yield();
      return 0;
    }
  }
  MutexLock l(&mu_);
  int n = 0;
  while (n < max && size_ > 0) {
    const Entry& e = ring_[head_];
    out[n++] = e.c;
    if (e.c.op == OpType::kRecvImm) {
      e.ep->OnRecvImmReaped();
      if (!reaped_.empty() && reaped_.back().first == e.ep) {
        ++reaped_.back().second;
      } else {
        reaped_.emplace_back(e.ep, 1);
      }
      any_reaped_.store(true, std::memory_order_relaxed);
    } else {
      e.ep->ReturnCredits(e.credits);
    }
    head_ = (head_ + 1) % ring_.size();
    --size_;
  }
  count_.store(size_, std::memory_order_release);
  return n;
}

// Spins on Poll (which does progress work inline) for a short while, then sleeps in ppoll on
// the engine's epoll fd and this queue's eventfd: data for this fabric wakes this thread
// directly (it then does the work itself), and completions pushed by the progress thread wake
// it through the eventfd.
int TcpCompletionQueue::Wait(Completion* out, int max, std::chrono::microseconds timeout) {
  int n = Poll(out, max);
  if (n != 0) return n;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  const auto spin_end = start + std::min<std::chrono::microseconds>(timeout, kWaitSpin);
  while (Clock::now() < spin_end) {
    n = Poll(out, max);
    if (n != 0) return n;
  }
  // Wait for the fabric's sockets only while an operation of ours is outstanding (its
  // response is what we wait for); a server waiting for immediates leaves the sockets to the
  // progress thread and is woken only for completions.
  bool expecting = false;
  {
    MutexLock l(&engine_->setup_mu());
    for (TcpEndpoint* ep : attached_) expecting = expecting || ep->outstanding() > 0;
  }
  if (!expecting) engine_->Unpark();
  for (;;) {
    {
      MutexLock l(&mu_);
      if (size_ > 0) break;
      ++waiters_;
    }
    const auto left = deadline - Clock::now();
    int64_t left_ns =
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
    if (!event_fd_.valid()) left_ns = std::min<int64_t>(left_ns, 1000000);  // no wakeups: slices
    timespec ts{static_cast<time_t>(left_ns / 1000000000), static_cast<long>(left_ns % 1000000000)};
    pollfd fds[2] = {{expecting ? engine_->epoll_fd() : -1, POLLIN, 0},
                     {event_fd_.get(), POLLIN, 0}};
    const int rc = left_ns > 0 ? ::ppoll(fds, 2, &ts, nullptr) : 0;
    {
      MutexLock l(&mu_);
      --waiters_;
    }
    if (fds[1].revents != 0) {
      uint64_t v;
      while (::read(event_fd_.get(), &v, sizeof(v)) > 0) {
      }
    }
    if (rc > 0 && fds[0].revents != 0) engine_->TryProgress();
    if (count_.load(std::memory_order_acquire) != 0 || Clock::now() >= deadline) break;
    if (rc > 0 && fds[0].revents != 0 && fds[1].revents == 0) {
      // Another thread is handling the ready events; let it finish before polling again.
      sched_yield();
    }
  }
  return Poll(out, max);
}

void TcpCompletionQueue::AddDeferred(TcpEndpoint* ep) {
  if (ep->deferred_listed_.exchange(true, std::memory_order_acq_rel)) return;
  MutexLock l(&deferred_mu_);
  deferred_.push_back(ep);
  has_deferred_.store(true, std::memory_order_release);
}

void TcpCompletionQueue::FlushDeferred() {
  if (!has_deferred_.load(std::memory_order_acquire)) return;
  std::vector<TcpEndpoint*> eps;
  {
    MutexLock l(&deferred_mu_);
    eps.swap(deferred_);
    has_deferred_.store(false, std::memory_order_release);
  }
  for (TcpEndpoint* ep : eps) {
    ep->deferred_listed_.store(false, std::memory_order_release);
    ep->FlushDeferred();
  }
}

void TcpCompletionQueue::Purge(TcpEndpoint* ep) {
  {
    MutexLock l(&deferred_mu_);
    deferred_.erase(std::remove(deferred_.begin(), deferred_.end(), ep), deferred_.end());
    has_deferred_.store(!deferred_.empty(), std::memory_order_release);
  }
  MutexLock l(&mu_);
  reaped_.erase(std::remove_if(reaped_.begin(), reaped_.end(),
                               [ep](const auto& r) { return r.first == ep; }),
                reaped_.end());
  size_t kept = 0;
  for (size_t i = 0; i < size_; ++i) {
    const Entry e = ring_[(head_ + i) % ring_.size()];
    if (e.ep != ep) ring_[(head_ + kept++) % ring_.size()] = e;
  }
  size_ = kept;
  count_.store(size_, std::memory_order_release);
}

}  // namespace shardps::transport::tcp
