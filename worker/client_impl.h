// The implementation of shardps::Client (worker/include/shardps/client.h). Internal.
//
// ClientImpl is the public face and the lifecycle (client_lifecycle.h); the work is done by
// components that own their state, all created at Start:
//
//   ServerSessions (server_sessions.h)  endpoints to the servers: connect, hello, generations,
//                                       the completion queue, staging, setup and acks reads
//   PushPipeline   (push_pipeline.h)    per-chunk push sequence, inbox slots, acks, resends
//   PullPipeline   (pull_pipeline.h)    per-chunk consistent one-sided reads
//   Recovery       (recovery.h)         reconnect or fail over a failed server, resynchronise
//
// Data path per chunk (wire/region_layout.h has the offsets):
//   push  = WRITE grads -> inbox[rank][slot][parity].data            (unsignaled)
//           WRITE_IMM push header -> inbox[rank][slot][parity].hdr   (imm = kPush slot|parity)
//   pull  = READ header, READ buffer b, READ header   (one round trip when b is guessed right)
//           consistent iff gen[b] is the same in both header reads; retried otherwise.
// Inbox slots alternate by the parity of the push sequence number, so a push may be posted
// while the previous one is still being applied; the one before that must be acknowledged
// (acks region) first.
//
// Thread safety: one thread (the trainer's), like the public Client; so are its components.
#ifndef SHARDPS_WORKER_CLIENT_IMPL_H_
#define SHARDPS_WORKER_CLIENT_IMPL_H_

#include <atomic>
#include <chrono>
#include <map>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/trace.h"
#include "proto/control_client.h"
#include "shardps/client.h"
#include "transport/transport.h"
#include "wire/region_layout.h"
#include "worker/client_lifecycle.h"
#include "worker/data_path.h"
#include "worker/pull_pipeline.h"
#include "worker/push_pipeline.h"
#include "worker/recovery.h"
#include "worker/client_metrics.h"
#include "worker/row_tables.h"
#include "worker/server_sessions.h"

namespace shardps::worker {

class ClientImpl final : public Client, private CompletionSink {
 public:
  explicit ClientImpl(const ClientOptions& options) : options_(options) {}
  ~ClientImpl() override;

  // Fabric (`fabric`, or one opened from the options when null) and control plane join.
  Status Init(std::unique_ptr<transport::Fabric> fabric = nullptr);

  Status RegisterTensor(const std::string& name, float* weights, float* grads,
                        const std::vector<int64_t>& shape) override;
  Status RegisterTensor(const std::string& name, void* weights, void* grads,
                        const std::vector<int64_t>& shape, TensorDType dtype) override;
  Status RegisterEmbedding(const std::string& name, int64_t rows, int64_t dim, TensorDType dtype,
                           const EmbeddingOptions& options) override;
  Status PullRows(const std::string& table, const int64_t* ids, size_t n, void* out) override;
  StatusOr<bool> ScaleRowGradients(const std::string& table, float factor) override;
  StatusOr<double> RowGradientsSquaredNorm(const std::string& table) override;
  Status ClearRowGradients(const std::string& table) override;
  Status AddRowGradients(const std::string& table, const int64_t* ids, size_t n,
                         const void* grads) override;
  Status Start() override;
  StatusOr<Handle> Push(const std::string& name) override;
  StatusOr<Handle> Pull(const std::string& name) override;
  StatusOr<std::vector<Handle>> PushMany(const std::vector<std::string>& names) override;
  StatusOr<std::vector<Handle>> PullMany(const std::vector<std::string>& names) override;
  Status Wait(Handle handle) override;
  Status Clock() override;
  Status Step() override;
  StatusOr<uint64_t> RequestCheckpoint(const std::string& dir) override;
  Status Barrier(std::chrono::milliseconds timeout) override;
  Status SetLearningRate(const std::string& tensor, float lr) override;
  Status SetUpdateRule(const std::string& tensor, const UpdateRule& rule) override;
  void MarkNonFinite(bool non_finite) override { step_.non_finite = non_finite; }
  Status SetNoGradient(const std::string& tensor, bool no_gradient) override;
  void SetPushWeight(uint32_t weight) { step_.weight = weight == 0 ? 1 : weight; }
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
  uint32_t rank() const override { return rank_; }
  uint32_t num_workers() const override;
  uint64_t clock() const override { return step_.clock; }
  uint64_t barrier_generation() const override;
  std::string consistency() const override { return ConsistencyName(config_); }
  ClientCounters counters() const override;
  std::string transport_name() const override;
  StatusOr<TensorPath> tensor_path(const std::string& name) const override;
  StatusOr<const void*> WeightsView(const std::string& name) const override;
  Status Close() override;

 private:
  // Step() without its entry check: push, wait, clock, pull, wait (and, replicated ASP/SSP, the
  // acknowledgements).
  Status StepOnce();
  // PushMany (push) or PullMany (!push); `what` names the call in a refusal.
  StatusOr<std::vector<Handle>> Many(const char* what, const std::vector<std::string>& names,
                                     bool push);
  // Posts the pushes (push) or pulls of tensors `ts` as one burst (kMore; sent by one poll at
  // the end). `step`: Step()'s pushes, which pass the worker.before_push crash and stall points.
  // Which chunks each push sends: ScopeOfPush.
  StatusOr<std::vector<Handle>> PostBurst(const std::vector<uint32_t>& ts, bool push, bool step);
  // Which chunks of tensor t a push sends now. A push that failed part way is completed by the
  // next push of the tensor (the chunks it left out), in every mode. Step() (`step`) leaves out
  // a tensor pushed whole in its clock (by Push or PushMany), in every mode. An explicit push
  // of a tensor pushed whole: ASP and SSP send every chunk again (each push applies); BSP, which
  // sums one push per chunk per worker per clock, refuses (FAILED_PRECONDITION). A row table
  // with rows added behind its push in this clock: ASP and SSP push it whole again (those
  // rows), BSP refuses.
  enum class PushScope { kAll, kMissing, kNone };
  StatusOr<PushScope> ScopeOfPush(uint32_t t, bool step, const char* what) const;
  // CompletionSink: push and pull completions, from ServerSessions::Progress.
  void OnPushCompletion(uint32_t chunk, uint64_t handle, const Status& err) override;
  void OnPullCompletion(uint32_t chunk, uint64_t handle, const Status& err) override;
  void OnRowsCompletion(uint32_t chunk, uint64_t handle, const Status& err) override;

  Status RegisterDeviceTensor(Tensor& t);
  // Start() past its argument checks: its error leaves the client in kStartFailed.
  Status StartCluster();
  Status WaitForWorkers();
  StatusOr<control::ShardMap> RegisterModel();
  // The chunks of the shard map (checked: it comes from a peer), and the components over them.
  Status ApplyShardMap(const control::ShardMap& map);
  // Rank 0: its weights become the initial weights of every server.
  Status PublishInitialWeights();
  StatusOr<int> ChunksWithoutWeights(const std::vector<char>* which, std::vector<char>* missing);
  // Failovers PublishInitialWeights rides out before it gives up (each waits for its own).
  static constexpr int kStartRecoveries = 3;
  // Every worker pulls them; one joining a running cluster starts at the cluster's clock.
  Status PullInitialWeights();
  // A failed session is repaired (Recovery); what cannot be moves the client to kBroken.
  Status MaybeRecover();
  Status RecoverOrBreak();
  // Wait's backstops: an endpoint in the error state with operations outstanding past a grace
  // period, and the absolute deadline.
  Status CheckEndpoints(std::chrono::steady_clock::time_point now);
  Status WaitTimedOut(const HandleState& hs) const;
  StatusOr<uint32_t> TensorIndex(const std::string& name) const;
  StatusOr<uint32_t> TableIndex(const std::string& name) const;  // a row table's

  // Declared in dependency order: the components (endpoints, staging) are destroyed before the
  // tensors whose memory they access, the control client and the fabric.
  ClientOptions options_;
  std::unique_ptr<ClientMetrics> metrics_;  // null unless options_.metrics_port != 0
  trace::ScopedTrace trace_;  // options_.trace_file: stopped (flushed) at Close, or last
  // What this worker's heartbeats report (`shardps status`): written by the trainer's thread
  // at every Clock(), read by the control client's thread (hence atomics, and shared).
  struct HeartbeatBoard {
    std::atomic<uint64_t> clock{0}, bytes_pushed{0}, bytes_pulled{0};
  };
  std::shared_ptr<HeartbeatBoard> board_ = std::make_shared<HeartbeatBoard>();
  void PublishBoard();  // trainer thread
  std::unique_ptr<transport::Fabric> fabric_;
  std::unique_ptr<control::ControlClient> control_;
  control::ClusterConfig config_;
  uint32_t rank_ = 0;
  ClientLifecycle lifecycle_;
  std::vector<Tensor> tensors_;
  std::map<std::string, uint32_t> tensor_index_;
  std::vector<ChunkPlacement> chunks_;
  HandleTable handles_;
  StepClock step_;
  uint64_t control_baseline_ = 0;
  std::map<uint32_t, std::chrono::steady_clock::time_point> errored_since_;  // by server
  std::unique_ptr<ServerSessions> sessions_;
  std::unique_ptr<PullPipeline> pull_;
  std::unique_ptr<PushPipeline> push_;
  std::unique_ptr<RowTables> rows_;
  std::unique_ptr<transport::MemoryRegion> state_staging_;  // GetState's outbox reads
  // SetStateValues' float32 payloads; only rewritten or replaced once every push is
  // acknowledged (a push not yet acknowledged may be resent from it).
  std::unique_ptr<transport::MemoryRegion> values_staging_;
  uint64_t barrier_generation_ = 0;  // the newest Barrier() this worker arrived at
  bool barrier_waiting_ = false;     // ... and was not released from yet (a timeout)
  uint64_t state_nonce_ = 0;
  // The state staging, at least `bytes` long (grown, never shrunk).
  Status EnsureStateStaging(uint64_t bytes);
  // Reads a server's answer to this worker's request `nonce` on `chunk` (kGetState,
  // kListRows): `bytes` of its outbox into the state staging (which must hold AlignUp(bytes) +
  // kAlign), then the header once more behind them. True when both headers name this request:
  // the server has one outbox, and another worker's request answered while it was being read
  // shows in the second (the server clears the magic before it writes an answer).
  // Whether attempt `attempt` (0, 1, ...) of an outbox request may go, before `until`; from
  // the second on, after a random pause growing with the attempts (up to ~4 ms): workers
  // whose requests keep overwriting each other's answers fall out of step.
  bool OutboxRetry(int attempt, std::chrono::steady_clock::time_point until);
  StatusOr<bool> ReadOwnOutbox(uint32_t server, uint64_t bytes, uint64_t nonce, uint32_t chunk,
                               layout::OutboxHeader* header);
  // A row shard's answer to a kGetState / kListRows (RowTables::SetOpPayload set already) of
  // `n` rows, read into the state staging: pushes, reads the outbox, checks the header (the
  // server's single outbox may have answered another request meanwhile: asked again).
  Status RowOutboxRound(uint32_t chunk, layout::PushOp op, uint64_t n, uint32_t dim,
                        layout::OutboxHeader* header);
  // One kGetState of rows ids[at[0]], ..., ids[at[m - 1]] of one shard (`chunk`): asked,
  // answered into the state staging (RowOutbox{m, dim}), each key checked against its id.
  Status GetRowsRound(const std::string& table, uint32_t chunk, const int64_t* ids,
                      const size_t* at, size_t m, uint32_t dim, layout::OutboxHeader* header);
  // Every get round of ids grouped by shard (`by_shard`, indices into ids; max_ids a round):
  // `each(at, m, header, staging)` with the round's m indices and its answer (RowOutbox{m}).
  using RowsAnswerFn = std::function<void(const size_t* at, size_t m,
                                          const layout::OutboxHeader& header, const char* base)>;
  Status ForEachRowsAnswer(const std::string& table, const RowTables::Shape& s,
                           const std::vector<std::vector<size_t>>& by_shard, const int64_t* ids,
                           const RowsAnswerFn& each);
  // The table's ids checked (dense: in range) and grouped by shard (indices into ids).
  StatusOr<std::vector<std::vector<size_t>>> RowIdsByShard(uint32_t tensor, const int64_t* ids,
                                                           size_t n) const;
  std::unique_ptr<Recovery> recovery_;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CLIENT_IMPL_H_
