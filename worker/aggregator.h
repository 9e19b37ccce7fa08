// The host aggregator (shardps_aggregator; docs/hierarchical.md): one per host. It joins the
// cluster as ONE worker, gathers the gradients of the host's local workers through shared
// memory, sums them in local-rank order, pushes the sum once per chunk (the push's weight says
// how many trainers it sums, so averaging servers divide by trainers, not pushes), pulls the
// weights once into shared memory that the local workers map read-only, and tells them.
//
//   local workers  --(memfd, futex bells)-->  Aggregator  --(one-sided push/pull)-->  servers
//
// A local worker that dies (its socket reaches EOF) is dropped: its gradient of a clock counts
// when it had finished that clock (clock_done stored after the data) before the sum was taken,
// and never later, so no gradient is summed twice or in part. A local worker that comes back
// is admitted at the next clock boundary. The aggregator never times a local worker out:
// a descheduled process is alive as long as its socket is open.
//
// Thread safety: one thread (Run's caller) does everything; Stop() may be called from any
// thread or a signal handler.
#ifndef SHARDPS_WORKER_AGGREGATOR_H_
#define SHARDPS_WORKER_AGGREGATOR_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "proto/control.pb.h"
#include "shardps/client.h"
#include "worker/host_group.h"

namespace shardps::worker {

struct AggregatorOptions {
  std::string socket_path;       // unix socket of the local workers ("@name": abstract)
  uint32_t local_workers = 0;    // workers on this host; all must join before the first step
  ClientOptions client;          // how the aggregator joins the cluster
  std::chrono::milliseconds setup_timeout{120000};  // for the local workers to join
  // Fault injection for the kill tests: the aggregator _exit(9)s at this host clock, after
  // pushing (kAfterPush) or before (kBeforePush). 0 = never.
  uint64_t crash_at_clock = 0;
  bool crash_after_push = false;
};

class Aggregator {
 public:
  // Binds the socket (a stale socket file of a dead aggregator is replaced; a live one is
  // ALREADY_EXISTS) and joins the cluster.
  static StatusOr<std::unique_ptr<Aggregator>> Create(const AggregatorOptions& options);
  ~Aggregator();

  // Admits the local workers, starts the cluster client, then serves steps until every local
  // worker has left (OK) or the cluster client fails (its error, also shown to the workers).
  Status Run();
  // Makes Run return OK at the next clock boundary (async-signal-safe).
  void Stop() { stop_.store(true, std::memory_order_relaxed); }

  uint64_t steps() const { return steps_; }

 private:
  struct Local {
    UniqueFd sock;
    uint32_t pid = 0;
    bool live = false;       // admitted and its socket open
    uint64_t joined_at = 0;  // host clock at admission: it owes clocks >= this
  };
  struct Pending {  // connected, not yet admitted
    UniqueFd sock;
    std::chrono::steady_clock::time_point since;
    bool joined = false;
    control::LocalJoin join;
  };

  explicit Aggregator(const AggregatorOptions& options) : options_(options) {}
  Status Bind();
  // Accepts connections and reads their joins (never blocks).
  void PollPending();
  // Checks a join against the group's tensors (the first join defines them).
  Status CheckJoin(const control::LocalJoin& j);
  void FillStarted(control::LocalStarted* st) const;
  Status SetupRegion();
  Status Admit(Pending p, bool initial);
  Status StartCluster();
  // One host clock: wait, sum, push, clock, pull, publish. *done: no local worker is left.
  Status StepOnce(bool* done);
  // Waits until every live local worker owes no clock below `c` + 1 or has gone.
  Status WaitForLocals(uint64_t c);
  // Once every live local worker arrived at the barrier after the one released: passes that
  // generation of the cluster's barrier, then publishes it as passed.
  Status MaybePassBarrier();
  void DropGone();
  void Fail(const Status& s);
  host::GroupHeader* header() const { return reinterpret_cast<host::GroupHeader*>(region_.data()); }
  host::LocalSlot* slot(uint32_t l) const {
    return reinterpret_cast<host::LocalSlot*>(region_.data() + layout_.slot_offset(l));
  }
  host::TensorControl* control(uint32_t l, uint32_t t) const {
    return reinterpret_cast<host::TensorControl*>(region_.data() + layout_.control_offset(l, t));
  }

  AggregatorOptions options_;
  std::atomic<bool> stop_{false};
  UniqueFd listen_;
  std::unique_ptr<Client> client_;
  std::vector<control::TensorSpecProto> tensors_;  // from the first join
  std::vector<Local> locals_;                       // by local rank
  std::vector<Pending> pending_;
  host::GroupLayout layout_;
  UniqueFd memfd_;          // header, slots, gradient areas
  UniqueFd weights_fd_;     // the weights area (sealed F_SEAL_FUTURE_WRITE once mapped here)
  host::Mapping region_;
  host::Mapping weights_;
  std::vector<host::Mapping> sums_;  // per tensor: the pushed sum (the client's grads)
  std::vector<float> scratch_;       // 16-bit tensors are summed in float32
  std::vector<float> lr_;            // per tensor: the rate last set on the client
  std::vector<UpdateRule> rule_;     // per tensor: the rule last set (has_rule_)
  std::vector<bool> has_rule_;
  uint64_t generation_ = 0;
  uint64_t steps_ = 0;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_AGGREGATOR_H_
