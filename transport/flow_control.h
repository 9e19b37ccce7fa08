// Credit accounting shared by the providers.
//
// The invariant (docs/transport.md, "Flow control"): an endpoint attached to a completion queue
// reserves send_depth + recv_depth slots of the queue's quota for its whole life, and a post
// takes one send credit before anything is handed to the provider. Hence
//   sum over endpoints (send_depth + recv_depth) <= cq depth, and
//   outstanding operations of an endpoint <= send_depth,
// so neither a send queue nor a completion queue can overflow.
//
// Thread safety: CqQuota is used under the fabric's setup lock or by the CQ's polling thread
// (attach/detach happen on that thread); SendCredits by the endpoint's polling thread only.
#ifndef SHARDPS_TRANSPORT_FLOW_CONTROL_H_
#define SHARDPS_TRANSPORT_FLOW_CONTROL_H_

#include <string>

#include "common/status.h"

namespace shardps::transport {

class CqQuota {
 public:
  explicit CqQuota(int depth) : depth_(depth) {}
  int depth() const { return depth_; }
  int reserved() const { return reserved_; }
  Status Reserve(int slots) {
    if (slots <= 0) return InvalidArgumentError("cq quota: non-positive reservation");
    if (reserved_ + slots > depth_) {
      return ResourceExhaustedError("completion queue full: " + std::to_string(reserved_) +
                                    " of " + std::to_string(depth_) +
                                    " slots reserved, endpoint needs " + std::to_string(slots) +
                                    " (create the CQ with a larger depth)");
    }
    reserved_ += slots;
    return Status::OK();
  }
  void Release(int slots) { reserved_ -= slots; }

 private:
  const int depth_;
  int reserved_ = 0;
};

class SendCredits {
 public:
  explicit SendCredits(int depth) : depth_(depth) {}
  // Takes one credit, or fails with kResourceExhausted (nothing is queued then).
  Status Take() {
    if (outstanding_ >= depth_) {
      return ResourceExhaustedError("send queue full: " + std::to_string(outstanding_) +
                                    " operations outstanding; poll the completion queue");
    }
    ++outstanding_;
    return Status::OK();
  }
  void Return(int n) { outstanding_ -= n; }
  int outstanding() const { return outstanding_; }
  int depth() const { return depth_; }

 private:
  const int depth_;
  int outstanding_ = 0;
};

}  // namespace shardps::transport

#endif  // SHARDPS_TRANSPORT_FLOW_CONTROL_H_
