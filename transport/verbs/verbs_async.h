// Asynchronous events of one device context (ibv_get_async_event). Some failures produce no
// completion at all: a completion-queue overrun drops the completions that did not fit, a
// fatal device error completes nothing, and a QP the HCA moved to the error state for a
// responder-side fault may report nothing on the requester's side until the next post. A
// caller waiting on those completions would wait forever; this turns each into an error of
// the endpoints concerned, with the event named.
//
// There is no thread of its own (the provider has none): the context's async fd, made
// non-blocking, sits in every CqState's epoll set. Whichever polling thread sees it readable
// calls Drain(), which reads every pending event, records what it means (an error for a QP,
// for a CQ, or for the whole device), logs it, acknowledges it at once (so destroying a QP or
// CQ never waits on us), bumps generation() and wakes every registered CqState through its
// eventfd. Each CqState, on its own polling thread, then takes what concerns its endpoints.
//
// Thread safety: every method may be called from any thread (one mutex).
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_ASYNC_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_ASYNC_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"

namespace shardps::transport::verbs {

class AsyncEvents {
 public:
  AsyncEvents(ibv_context* context, std::string device_name);
  AsyncEvents(const AsyncEvents&) = delete;
  AsyncEvents& operator=(const AsyncEvents&) = delete;

  // Makes the async fd non-blocking (the device is not opened without it).
  Status Init();
  int fd() const { return context_->async_fd; }

  // Reads, records, logs and acknowledges the events pending now (at most kMaxEventsPerDrain;
  // none when another thread is draining: it wakes everyone). False when the fd itself
  // failed (a device removed or reset: read returns EIO for ever), recorded as fatal: callers
  // then take it out of their epoll sets.
  bool Drain();
  // Changes whenever Drain recorded an error: a CqState compares it with the value it saw last.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // The error recorded for a QP, removed (OK when none).
  Status TakeQpError(uint32_t qp_num);
  // The error recorded for a CQ (OK when none); it stays: a CQ that lost completions is unusable.
  Status CqError(const ibv_cq* cq) const;
  // A fatal device error (OK when none); it stays.
  Status fatal() const;

  // After the QP or CQ is destroyed (so that no event of it can still be read): drops what was
  // recorded for it, so that a later QP or CQ reusing the number or address inherits nothing.
  void ForgetQp(uint32_t qp_num);
  void ForgetCq(const ibv_cq* cq);

  // The eventfds Drain writes to (one per CqState).
  void AddWaker(int eventfd);
  void RemoveWaker(int eventfd);

  // Events read so far (all kinds), for tests and logs.
  uint64_t events_seen() const { return events_seen_.load(std::memory_order_relaxed); }

 private:
  static constexpr int kMaxEventsPerDrain = 256;
  bool DrainLocked() REQUIRES(mu_);
  // Logs an event and records what it means; true when it recorded a new error.
  bool RecordLocked(const ibv_async_event& ev) REQUIRES(mu_);

  ibv_context* const context_;
  const std::string device_name_;
  mutable Mutex mu_;
  std::unordered_map<uint32_t, Status> qp_errors_ GUARDED_BY(mu_);
  std::unordered_map<const ibv_cq*, Status> cq_errors_ GUARDED_BY(mu_);
  Status fatal_ GUARDED_BY(mu_);
  std::vector<int> wakers_ GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> events_seen_{0};
};

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_ASYNC_H_
