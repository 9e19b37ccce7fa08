// The Client of a local worker under a host aggregator (docs/hierarchical.md): what
// Client::Connect returns when ClientOptions::aggregator (SHARDPS_AGGREGATOR) is set. It talks
// to its host's shardps_aggregator only: a unix socket for set-up and departures, the group's
// shared memory for everything else. Push copies the trainer's gradient into this worker's
// gradient area; Clock marks the clock done and rings the aggregator; Wait on a pull sleeps
// until the aggregator has pulled the clock's weights into the shared weights area (mapped
// read-only here), then copies them into the trainer's buffer.
//
// Within a host the local workers step together (the aggregator sums a clock once every live
// local worker has finished it); between hosts the cluster's consistency mode holds, the host
// being one worker. Row tables, state transfer, checkpoints requests and CUDA tensors are not
// built for this mode: those calls return UNIMPLEMENTED naming the flat mode.
//
// If the aggregator dies, the next call that waits for it reconnects to the socket path (a
// restarted aggregator, within failover_timeout, 60 s by default) and goes on at the
// aggregator's clock; a clock this worker had finished but the dead aggregator had not
// published is counted in pushes_lost (it may have been applied on some servers, never twice).
//
// Thread safety: as Client: the trainer's thread only.
#ifndef SHARDPS_WORKER_HOST_CLIENT_H_
#define SHARDPS_WORKER_HOST_CLIENT_H_

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/fd.h"
#include "shardps/client.h"
#include "worker/client_lifecycle.h"
#include "worker/host_group.h"

namespace shardps::worker {

class HostClient final : public Client {
 public:
  static StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~HostClient() override;

  Status RegisterTensor(const std::string& name, float* weights, float* grads,
                        const std::vector<int64_t>& shape) override;
  Status RegisterTensor(const std::string& name, void* weights, void* grads,
                        const std::vector<int64_t>& shape, TensorDType dtype) override;
  Status RegisterEmbedding(const std::string& name, int64_t rows, int64_t dim, TensorDType dtype,
                           const EmbeddingOptions& options) override;
  Status PullRows(const std::string& table, const int64_t* ids, size_t n, void* out) override;
  Status AddRowGradients(const std::string& table, const int64_t* ids, size_t n,
                         const void* grads) override;
  Status Start() override;
  StatusOr<Handle> Push(const std::string& name) override;
  StatusOr<Handle> Pull(const std::string& name) override;
  Status Wait(Handle handle) override;
  Status Clock() override;
  Status Step() override;
  StatusOr<uint64_t> RequestCheckpoint(const std::string& dir) override;
  Status Barrier(std::chrono::milliseconds timeout) override;
  Status SetLearningRate(const std::string& tensor, float lr) override;
  Status SetUpdateRule(const std::string& tensor, const UpdateRule& rule) override;
  void MarkNonFinite(bool non_finite) override { non_finite_ = non_finite; }
  // Not applied through the aggregator yet (client.h): the learners' zeros are summed.
  Status SetNoGradient(const std::string& tensor, bool no_gradient) override;
  Status SetState(const std::string& tensor, StatePart part, uint64_t steps) override;
  Status SetStateValues(const std::string& tensor, StatePart part, const float* values,
                        uint64_t steps) override;
  Status SetRows(const std::string& table, StatePart part, const int64_t* ids, size_t n,
                 const float* values, uint64_t steps) override;
  Status GetRows(const std::string& table, const int64_t* ids, size_t n, float* weights,
                 float* state1, float* state2, RowStateInfo* info) override;
  StatusOr<std::vector<int64_t>> TableKeys(const std::string& table) override;
  Status GetState(const std::string& tensor, float* weights, float* state1, float* state2,
                  uint64_t* steps, bool* has1, bool* has2) override;
  uint32_t rank() const override;
  uint32_t num_workers() const override;
  uint64_t clock() const override { return clock_; }
  uint64_t barrier_generation() const override;
  std::string consistency() const override { return consistency_; }
  ClientCounters counters() const override { return counters_; }
  std::string transport_name() const override;
  StatusOr<TensorPath> tensor_path(const std::string& name) const override;
  StatusOr<const void*> WeightsView(const std::string& name) const override;
  Status Close() override;

 private:
  struct Tensor {
    std::string name;
    void* weights = nullptr;
    void* grads = nullptr;
    std::vector<int64_t> shape;
    uint32_t dtype = 0;
    uint64_t bytes = 0;
    float lr = 0;
    bool has_rule = false;
    UpdateRule rule;
    bool no_gradient = false;  // SetNoGradient
  };
  struct Pending {
    bool pull = false;
    uint32_t tensor = 0;
  };

  explicit HostClient(const ClientOptions& options, uint32_t local_rank)
      : options_(options), local_rank_(local_rank) {}
  Status ConnectSocket(std::chrono::milliseconds timeout);
  // Join, map the region, (local rank 0) hand over the initial weights, wait for started.
  Status Join(std::chrono::milliseconds timeout, bool initial);
  // Waits until the weights area satisfies clock `c`; reconnects to a restarted aggregator.
  Status WaitForWeights(uint64_t c);
  // The aggregator is gone: reconnect (within the failover timeout) or break.
  Status Rejoin();
  // Inside a wait (its `spins`-th look): the group failed (an error), or its aggregator is
  // gone (then rejoins its restart: true; the socket is checked every 8th look).
  StatusOr<bool> RejoinIfGone(uint32_t spins);
  // Stores barrier_ in this learner's slot and rings the aggregator.
  void ArriveAtBarrier();
  StatusOr<uint32_t> TensorIndex(const std::string& name) const;
  void TakeFacts(const control::LocalStarted& s);
  host::GroupHeader* header() const { return reinterpret_cast<host::GroupHeader*>(rw_.data()); }
  host::LocalSlot* my_slot() const {
    return reinterpret_cast<host::LocalSlot*>(rw_.data() + layout_.slot_offset(local_rank_));
  }
  host::TensorControl* my_control(uint32_t t) const {
    return reinterpret_cast<host::TensorControl*>(rw_.data() + layout_.control_offset(local_rank_, t));
  }

  ClientOptions options_;
  uint32_t local_rank_;
  ClientLifecycle life_;
  UniqueFd sock_;
  host::GroupLayout layout_;
  host::Mapping rw_;  // header, slots, gradient areas
  host::Mapping ro_;  // the weights area (read-only)
  uint64_t generation_ = 0;
  std::vector<Tensor> tensors_;
  std::unordered_map<uint64_t, Pending> pending_;
  uint64_t next_handle_ = 1;
  uint64_t clock_ = 0;
  // The cluster's barrier generation this learner arrived at last (host barriers are numbered
  // as the cluster's, so a restarted aggregator continues the count), and whether it has not
  // passed it yet (a timeout; a rejoin arrives there again in the new group's slot).
  uint32_t barrier_ = 0;
  bool barrier_waiting_ = false;
  uint32_t cluster_rank_ = 0;
  uint32_t hosts_ = 1;
  uint32_t local_workers_ = 1;
  bool started_ = false;
  bool non_finite_ = false;
  std::string consistency_ = "unknown";
  std::string cluster_transport_;
  ClientCounters counters_;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_HOST_CLIENT_H_
