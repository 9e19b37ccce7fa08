#include "transport/verbs/verbs_async.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace shardps::transport::verbs {

AsyncEvents::AsyncEvents(ibv_context* context, std::string device_name)
    : context_(context), device_name_(std::move(device_name)) {}

Status AsyncEvents::Init() {
  const int flags = fcntl(context_->async_fd, F_GETFL);
  if (flags < 0 || fcntl(context_->async_fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return ErrnoError("verbs: making the async event fd of " + device_name_ + " non-blocking",
                      errno);
  }
  return Status::OK();
}

bool AsyncEvents::Drain() {
  // Another thread draining now wakes everyone when it is done, and an event that arrives
  // after its last read keeps the fd readable for the next look (every CQ's, within 2 ms): no
  // need to queue up behind it. rxe raises one CQ_ERR per completion it drops, so a drain is
  // also capped; the rest stays readable.
  if (!mu_.TryLock()) return true;
  const bool usable = DrainLocked();
  mu_.Unlock();
  return usable;
}

bool AsyncEvents::DrainLocked() {
  bool recorded = false;
  bool usable = true;
  for (int read = 0; read < kMaxEventsPerDrain; ++read) {
    ibv_async_event ev{};
    if (ibv_get_async_event(context_, &ev) != 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err != EAGAIN && err != EWOULDBLOCK) {
        usable = false;
        if (fatal_.ok()) {
          LOG(ERROR) << "verbs: " << device_name_ << ": reading its async events failed ("
                     << strerror(err) << "): the device is gone; every endpoint on it fails";
          fatal_ = UnavailableError("verbs: device " + device_name_ +
                                    " stopped delivering async events (" + strerror(err) +
                                    "): removed or reset");
          recorded = true;
        }
      }
      break;  // EAGAIN: none left
    }
    events_seen_.fetch_add(1, std::memory_order_relaxed);
    recorded |= RecordLocked(ev);
    // Acknowledged only once recorded: a thread destroying this QP or CQ waits for the
    // acknowledgement, so once its destroy returns the record exists and ForgetQp/ForgetCq
    // removes it.
    ibv_ack_async_event(&ev);
  }
  if (!recorded) return usable;
  generation_.fetch_add(1, std::memory_order_acq_rel);
  const uint64_t one = 1;
  for (int fd : wakers_) {
    if (::write(fd, &one, sizeof(one)) < 0 && errno != EAGAIN) {
      PLOG(WARNING) << "verbs: waking a completion queue for an async event";
    }
  }
  return usable;
}

bool AsyncEvents::RecordLocked(const ibv_async_event& ev) {
  const char* name = ibv_event_type_str(ev.event_type);
  switch (ev.event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR: {
      const uint32_t qpn = ev.element.qp->qp_num;
      const char* what = ev.event_type == IBV_EVENT_QP_FATAL
                             ? "a fatal error of the queue pair"
                             : ev.event_type == IBV_EVENT_QP_REQ_ERR
                                   ? "the peer sent a request the QP could not execute"
                                   : "the peer's request violated this QP's access rights";
      LOG(WARNING) << "verbs: " << device_name_ << ": async event " << name << " on QP " << qpn
                   << " (" << what << "); its endpoint fails";
      // Replaces an older record of the number (a QP destroyed on a setup path that never
      // reached ForgetQp): the newest event is this QP's.
      qp_errors_.insert_or_assign(qpn, InternalError("verbs: the device reported " + std::string(name) +
                                            " on QP " + std::to_string(qpn) + " (" + what + ")"));
      return true;
    }
    case IBV_EVENT_CQ_ERR: {
      if (cq_errors_.count(ev.element.cq) != 0) return false;  // one per dropped completion
      LOG(WARNING) << "verbs: " << device_name_ << ": async event " << name
                   << ": a completion queue overran and lost completions; every endpoint on "
                      "it fails";
      cq_errors_.emplace(ev.element.cq,
                         InternalError("verbs: completion queue overrun (" + std::string(name) +
                                       "): completions were lost, so every operation still "
                                       "outstanding on it is failed"));
      return true;
    }
    case IBV_EVENT_DEVICE_FATAL:
      LOG(ERROR) << "verbs: " << device_name_ << ": async event " << name
                 << ": the device failed; every endpoint on it fails";
      if (!fatal_.ok()) return false;
      fatal_ = UnavailableError("verbs: device " + device_name_ + " reported " + name +
                                " (it must be reset or the host rebooted)");
      return true;
    case IBV_EVENT_PORT_ERR:
      LOG(WARNING) << "verbs: " << device_name_ << ": port " << ev.element.port_num
                   << " went down (" << name << "); operations on it fail once a QP's retry "
                   << "budget or its bootstrap socket's keepalive runs out";
      return false;
    case IBV_EVENT_PORT_ACTIVE:
      LOG(INFO) << "verbs: " << device_name_ << ": port " << ev.element.port_num
                << " is active again (" << name << ")";
      return false;
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
    case IBV_EVENT_PATH_MIG:
      VLOG(1) << "verbs: " << device_name_ << ": async event " << name;
      return false;
    default:
      LOG(INFO) << "verbs: " << device_name_ << ": async event " << name;
      return false;
  }
}

Status AsyncEvents::TakeQpError(uint32_t qp_num) {
  MutexLock l(&mu_);
  auto it = qp_errors_.find(qp_num);
  if (it == qp_errors_.end()) return Status::OK();
  Status s = std::move(it->second);
  qp_errors_.erase(it);
  return s;
}

Status AsyncEvents::CqError(const ibv_cq* cq) const {
  MutexLock l(&mu_);
  auto it = cq_errors_.find(cq);
  return it == cq_errors_.end() ? Status::OK() : it->second;
}

Status AsyncEvents::fatal() const {
  MutexLock l(&mu_);
  return fatal_;
}

void AsyncEvents::ForgetQp(uint32_t qp_num) {
  MutexLock l(&mu_);
  qp_errors_.erase(qp_num);
}

void AsyncEvents::ForgetCq(const ibv_cq* cq) {
  MutexLock l(&mu_);
  cq_errors_.erase(cq);
}

void AsyncEvents::AddWaker(int eventfd) {
  MutexLock l(&mu_);
  wakers_.push_back(eventfd);
}

void AsyncEvents::RemoveWaker(int eventfd) {
  MutexLock l(&mu_);
  for (size_t i = 0; i < wakers_.size(); ++i) {
    if (wakers_[i] == eventfd) {
      wakers_.erase(wakers_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
}

}  // namespace shardps::transport::verbs
