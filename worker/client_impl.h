// The implementation of shardps::Client (worker/include/shardps/client.h). Internal.
//
// Data path per chunk (server/layout.h has the offsets):
//   push  = WRITE grads -> inbox[rank][slot][parity].data            (unsignaled)
//           WRITE_IMM push header -> inbox[rank][slot][parity].hdr   (imm = kPush slot|parity)
//   pull  = READ header, READ buffer b, READ header   (one round trip when b is guessed right)
//           consistent iff gen[b] is the same in both header reads; retried otherwise.
// Inbox slots alternate by the parity of the push sequence number, so a push may be posted
// while the previous one is still being applied; the one before that must be acknowledged
// (acks region) first.
//
// Thread safety: one thread (the trainer's), like the public Client.
#ifndef SHARDPS_WORKER_CLIENT_IMPL_H_
#define SHARDPS_WORKER_CLIENT_IMPL_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "proto/control_client.h"
#include "server/layout.h"
#include "shardps/client.h"
#include "transport/transport.h"
#include "worker/client_lifecycle.h"
#include "worker/cuda_staging.h"

namespace shardps::worker {

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(const ClientOptions& options) : options_(options) {}
  ~ClientImpl() override;

  Status Init();  // fabric + control plane join

  Status RegisterTensor(const std::string& name, float* weights, float* grads,
                        const std::vector<int64_t>& shape) override;
  Status Start() override;
  StatusOr<Handle> Push(const std::string& name) override;
  StatusOr<Handle> Pull(const std::string& name) override;
  Status Wait(Handle handle) override;
  Status Clock() override;
  Status Step() override;
  StatusOr<uint64_t> RequestCheckpoint(const std::string& dir) override;
  uint32_t rank() const override { return rank_; }
  uint32_t num_workers() const override;
  uint64_t clock() const override { return clock_; }
  std::string consistency() const override;
  ClientCounters counters() const override;
  std::string transport_name() const override;
  StatusOr<TensorPath> tensor_path(const std::string& name) const override;
  Status Close() override;

 private:
  struct Tensor {
    std::string name;
    float* weights = nullptr;
    float* grads = nullptr;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;
    // Regions the network reads and writes: the tensor itself (host, kCudaDirect) or the
    // pinned host mirrors of `staging` (kCudaStaged).
    std::unique_ptr<transport::MemoryRegion> wmr;
    std::unique_ptr<transport::MemoryRegion> gmr;
    std::vector<uint32_t> chunks;  // global chunk ids
    TensorPath path = TensorPath::kHost;
    std::unique_ptr<CudaStaging> staging;  // kCudaStaged only
    uint64_t push_handle = 0;              // kCudaStaged: the push whose data is in the mirror
  };
  struct Server {
    uint32_t rank = 0;       // the shard group
    uint32_t member_id = 0;  // the server process serving it now
    uint32_t server_rank = 0;
    uint32_t gen = 0;     // endpoint generation: completions of older endpoints are stale
    bool failed = false;  // its endpoint failed: waiting for a failover
    std::string address;
    transport::RegionDescriptor weights, inbox, acks, clocks;
    std::unique_ptr<layout::ServerLayout> layout;
    std::unique_ptr<transport::Endpoint> ep;
    std::vector<uint32_t> chunk_of_slot;
  };
  enum class PullPhase { kAll, kHeaderOnly, kDataCheck };
  struct ChunkRt {
    uint32_t id = 0;
    uint32_t tensor = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
    uint32_t server = 0;
    uint32_t slot = 0;
    uint64_t seq = 0;
    uint64_t known_acked = 0;
    // Pushes in flight per inbox parity: their handle (0 = none) and sequence number.
    uint64_t push_handle[2] = {0, 0};
    uint64_t push_seq[2] = {0, 0};
    // The latest push, to send it again after a failover (from the caller's grads buffer).
    uint64_t last_push_clock = 0;
    uint64_t last_push_base = 0;
    uint64_t pulled_min_clock_plus1 = 0;
    uint64_t push_step = 0;  // the Step() that pushed it (0: pushed outside Step())
    uint64_t pulled_version = 0;
    uint32_t last_buf = 1;  // version 1 is published into buffer 0
    // Parity of the number of versions published between our last two pulls: every new version
    // flips the buffer, so the next pull guesses last_buf ^ flip. 1 fits a training step (one
    // version per step); 0 fits repeated pulls of an unchanged chunk (or two versions per pull).
    uint32_t flip = 1;
    // Small chunks: staging offset of [PushHeader | data] x 2 parities (0 = not small).
    uint64_t small_staging = 0;
    // Pull state machine.
    uint64_t pull_handle = 0;
    PullPhase phase = PullPhase::kAll;
    uint32_t guess = 0;
    uint64_t required_plus1 = 0;
    std::chrono::steady_clock::time_point pull_deadline;
  };
  struct HandleState {
    int pending = 0;  // chunks not yet finished
    Status error;
    int64_t staged_pull_tensor = -1;  // a pull of a kCudaStaged tensor: sync its copies
  };
  enum OpKind : uint32_t { kOpPush = 0, kOpPull = 1, kOpAcks = 2, kOpSetup = 3, kOpClock = 4 };

  Status Progress();  // polls the CQ once, dispatches
  Status PostWithCredit(const std::function<Status()>& post);
  void OnCompletion(const transport::Completion& c);
  void StartPull(ChunkRt& c, PullPhase phase);
  void EvaluatePull(ChunkRt& c);
  void FinishChunk(uint64_t handle, const Status& s);
  Status EnsureAcked(ChunkRt& c, uint64_t need);
  Status WaitSetupOps(int count, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  uint64_t RequiredPlus1() const;
  char* Staging(uint32_t chunk, int which);  // 0,1: push headers; 2,3: header reads
  uint64_t StagingOffset(uint32_t chunk, int which) const;
  Status ServerError(uint32_t server, const std::string& what) const;
  // Failover: when a server's endpoint fails and the cluster has backups, wait for the
  // coordinator's new shard map, reconnect to the promoted backup, resend what it lacks and
  // restart the pulls in flight. Bounded by the failover timeout.
  Status MaybeRecover();
  Status Recover();
  // Recover(), turning its failure into the broken state.
  Status RecoverOrBreak();
  // Start() past its argument checks: its error leaves the client in kStartFailed.
  Status StartCluster();
  // Connects (a new endpoint generation) and says hello, within `timeout` (0: the setup bounds).
  Status ConnectServer(Server& s, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  Status ApplyServerEntry(const control::ServerEntry& se, Server& s);
  Status ResyncServer(uint32_t server);
  Status PostPush(ChunkRt& c, uint64_t seq, uint64_t handle);
  Status SendClock(Server& s);
  bool replicated() const { return config_.replicas() >= 2; }
  Status RegisterDeviceTensor(Tensor& t);
  // Posts the data writes of one chunk's push, piece by piece for staged tensors.
  Status PostPushData(Tensor& t, ChunkRt& c, Server& s, uint32_t parity, uint64_t handle);

  ClientOptions options_;
  std::unique_ptr<transport::Fabric> fabric_;
  std::unique_ptr<control::ControlClient> control_;
  control::ClusterConfig config_;
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::unique_ptr<transport::MemoryRegion> staging_;
  uint64_t acks_staging_offset_ = 0;
  uint64_t clock_staging_offset_ = 0;  // one u64 per server: the clock value written
  uint32_t rank_ = 0;
  uint64_t clock_ = 0;
  ClientLifecycle lifecycle_;
  std::vector<Tensor> tensors_;
  std::map<std::string, uint32_t> tensor_index_;
  std::vector<Server> servers_;
  std::vector<ChunkRt> chunks_;
  std::unordered_map<uint64_t, HandleState> handles_;
  std::map<uint32_t, std::chrono::steady_clock::time_point> errored_since_;  // by server
  uint64_t next_handle_ = 1;
  int setup_done_ = 0;
  Status setup_error_;
  int acks_pending_ = 0;
  ClientCounters counters_;
  uint64_t control_baseline_ = 0;
  uint64_t map_epoch_ = 0;
  bool recovering_ = false;
  uint64_t inject_data_error_every_ = 0;  // SHARDPS_FAULT_INJECT (tests)
  uint64_t step_id_ = 0;                  // Step() calls so far
  bool in_step_ = false;  // inside Step(): its pushes' gradients are still in the buffers
  Status WaitServing(uint32_t server);
  uint64_t pushes_posted_ = 0;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CLIENT_IMPL_H_
