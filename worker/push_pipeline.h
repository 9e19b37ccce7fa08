// The push pipeline: per chunk the push sequence, the pushes in flight per inbox parity and what
// the server has acknowledged; posts pushes (data, then the header with the immediate), waits
// for the acks that free an inbox slot, and after a reconnect or failover decides per chunk
// what the server lacks (finished, resent, or counted lost).
//
//   push = WRITE grads -> inbox[rank][slot][parity].data            (unsignaled)
//          WRITE_IMM push header -> inbox[rank][slot][parity].hdr   (imm = kPush slot|parity)
// Small chunks (<= kSmallPushBytes) go as one WRITE_IMM of [header | data] from staging.
// Inbox slots alternate by the parity of the push sequence number, so a push may be posted
// while the previous one is still being applied; the one before that must be acknowledged
// (acks region) first.
//
// Thread safety: none. Owned by the client; called from the client's (trainer's) thread only.
#ifndef SHARDPS_WORKER_PUSH_PIPELINE_H_
#define SHARDPS_WORKER_PUSH_PIPELINE_H_

#include <functional>
#include <vector>

#include "proto/control_client.h"
#include "worker/data_path.h"
#include "worker/pull_pipeline.h"
#include "worker/server_sessions.h"

namespace shardps::worker {

class RowTables;

class PushPipeline {
 public:
  PushPipeline(const ClientOptions& options, const control::ClusterConfig& config,
               control::ControlClient& control, uint32_t rank, ServerSessions& sessions,
               std::vector<Tensor>& tensors, const std::vector<ChunkPlacement>& chunks,
               HandleTable& handles, const StepClock& step, const PullPipeline& pull);

  // Row tables: where their pushes are staged (set once, before the first push).
  void set_row_tables(RowTables* rows) { rows_ = rows; }
  // Start: the staging bytes the small pushes need, then where they were placed.
  uint64_t SmallStagingBytes() const;
  void PlaceSmallStaging(uint64_t base);

  // Pushes every chunk of a tensor at the current clock (`only_missing`: those whose gradient
  // was not pushed in this clock yet, e.g. left out by a push that failed part way). `recover`
  // is called when a server fails while an inbox slot is awaited (it reconnects or fails over,
  // or reports why not). A chunk that could not be pushed fails the handle (its error), and
  // the chunks after it are not pushed either.
  StatusOr<Handle> Push(uint32_t tensor, const std::function<Status()>& recover,
                        bool only_missing = false);
  // How many of a tensor's chunks had their gradient pushed in the current clock (a posted
  // push, or one left to be resent after a recovery), of how many.
  struct PushedCount {
    size_t pushed = 0, chunks = 0;
    bool none() const { return pushed == 0; }
    bool all() const { return pushed == chunks; }
  };
  PushedCount PushedThisClock(uint32_t tensor) const;
  // A row table: whether a shard pushed in this clock has gradient rows added since.
  bool RowsBehindPush(uint32_t tensor) const;
  // The error of a push handle so far (OK while none of its chunks failed).
  Status ErrorOf(Handle h) const;
  // Starts the device->host copies of the CUDA-staged tensors among `tensors` that are about to
  // be pushed one after the other (Step, PushMany), so that they run back to back on the copy
  // engine while the first ones are on the wire, instead of one copy per Push call. Tensors
  // whose previous push is not waited for are left to Push (which refuses them).
  void Prestart(const std::vector<uint32_t>& tensors);
  // A state transfer (SetState) of a CUDA-staged tensor pushes its gradient buffer like a
  // gradient: copies it to the pinned mirror first (the chunks' posts wait for the copy), or
  // refuses while a push of the tensor is not waited for (the mirror still holds its bytes).
  Status StageForStateTransfer(uint32_t tensor);
  // Forgets every prestarted copy that no Push took (a burst ended early): the caller may
  // rewrite its gradients before the next Push, which must then copy them again.
  void CancelPrestart();
  void OnCompletion(uint32_t chunk, uint64_t handle, const Status& err);
  // A state transfer of one chunk (layout::PushOp other than kGradient): posted once the
  // chunk's previous push is acknowledged, pushed like a gradient (from the tensor's gradient
  // buffer, or a row shard's op payload; kGetState's payload is ignored for a dense chunk),
  // then awaited until the server acknowledged it (applied, or answered in its outbox).
  // `values` (a dense set only): the push carries these float32 values of the chunk's
  // elements [first, first + length / 4) instead of the gradient buffer (layout::
  // kPushF32Values); the caller keeps them unchanged until the call returns.
  struct F32Values {
    transport::LocalSlice payload;
    uint64_t first = 0;
  };
  Status PushOpAndAwait(uint32_t id, layout::PushOp op, uint64_t arg,
                        const std::function<Status()>& recover,
                        const F32Values* values = nullptr);
  // Waits until every chunk's latest push is acknowledged (consumed, hence replicated where
  // the group has a backup): after it, the caller may overwrite its gradient buffers without
  // risking a push that a failover could neither find on the backup nor resend.
  Status AwaitAllAcked(const std::function<Status()>& recover);
  // After a reconnect or failover of `server`, given its acks of this worker's pushes: finishes
  // the pushes it has, resends the latest one where it lacks it and the gradient is certainly
  // still in the caller's buffer, counts the rest lost.
  Status Resync(uint32_t server, const uint64_t* acks);

  // While set, each push's last post goes with transport::kMore: the caller (PushMany) posts a
  // burst and then polls, which sends it.
  void set_more(bool more) { more_ = more; }

  uint64_t pushes() const { return pushes_; }
  uint64_t bytes_pushed() const { return bytes_pushed_; }
  uint64_t pushes_resent() const { return pushes_resent_; }
  uint64_t pushes_lost() const { return pushes_lost_; }

 private:
  void Prestart(Tensor& t);
  // Copies a CUDA-staged tensor's gradient to its mirror (unless prestarted), or refuses
  // (`what` names the caller) while a push of it is not waited for. No-op for other tensors.
  Status StageGradients(Tensor& t, const char* what);
  struct ChunkPush {
    uint64_t seq = 0;
    uint64_t known_acked = 0;
    // Pushes in flight per inbox parity: their handle (0 = none) and sequence number.
    uint64_t handle[2] = {0, 0};
    uint64_t seq_of[2] = {0, 0};
    // The latest push, to send it again after a failover (from the caller's grads buffer).
    uint64_t last_clock = 0;
    uint64_t last_base = 0;
    layout::UpdateRule last_rule{};  // the rule it carries (the same when resent)
    uint32_t last_flags = 0;         // kPushNonFinite (the same when resent)
    uint32_t last_weight = 1;        // PushHeader::weight (the same when resent)
    layout::PushOp last_op = layout::PushOp::kGradient;  // (the same when resent)
    uint64_t last_arg = 0;
    uint64_t step = 0;  // the Step() that pushed it (0: pushed outside Step())
    uint64_t last_handle = 0;  // the latest push's handle (the caller's until it is waited for)
    uint64_t grad_clock_plus1 = 0;  // the clock (+1) of its latest gradient push (0: none)
    // The tensor's latest push failed before this chunk was posted: the chunk lacks it (the
    // tensor's next push completes it).
    bool left_out = false;
    // Its gradient for this clock is posted (or left to be resent after a recovery).
    bool PushedIn(uint64_t clock) const { return grad_clock_plus1 == clock + 1 && !left_out; }
    // Pushes up to this one were counted lost in a failover (never resent): no ack of them
    // will come, and AwaitAllAcked does not wait for one (the next push's ack covers them).
    uint64_t lost_through = 0;
    // The pushes up to this one need no acknowledgement any more: acknowledged, or lost.
    uint64_t Settled() const { return known_acked > lost_through ? known_acked : lost_through; }
    // Small chunks: staging offset of [PushHeader | data] x 2 parities (0 = not small).
    uint64_t small_staging = 0;
    uint64_t last_bytes = 0;  // a row shard's latest push: its staged entries' bytes
    // The latest push's float32 values (kPushF32Values; region null: none, or acknowledged),
    // resent as they are.
    F32Values last_values;
    bool op_awaited = false;  // PushOpAndAwait is waiting for the latest push (a state op)
  };

  // Pushes one chunk as part of handle h (its pending count already taken).
  Status PushChunk(uint32_t id, uint64_t h, const std::function<Status()>& recover,
                   layout::PushOp op = layout::PushOp::kGradient, uint64_t arg = 0,
                   const F32Values* values = nullptr);
  // Waits until the server acknowledged push `need` of a chunk (its inbox slot is free).
  Status EnsureAcked(uint32_t id, uint64_t need, const std::function<Status()>& recover);
  // Posts push `seq` of a chunk: the header's clock and base version are those of the chunk's
  // latest push (a resend after a failover repeats them exactly).
  // `hold`: the push's last post goes with kMore (an acks-ahead read follows it).
  Status PostPush(uint32_t id, uint64_t seq, uint64_t h, bool hold = false);
  // Folds a server's acks (slot order) into known_acked.
  void ApplyAcks(uint32_t server, const uint64_t* acks);
  // Posts the data writes of one chunk's push, piece by piece for staged tensors.
  Status PostPushData(uint32_t id, uint32_t parity, uint64_t h);
  Status ResyncChunk(uint32_t id, uint64_t acked);

  const ClientOptions& options_;
  const control::ClusterConfig& config_;
  control::ControlClient& control_;
  const uint32_t rank_;
  ServerSessions& sessions_;
  std::vector<Tensor>& tensors_;
  const std::vector<ChunkPlacement>& chunks_;
  HandleTable& handles_;
  const StepClock& step_;
  const PullPipeline& pull_;     // a push names the version its gradient was computed on
  std::vector<ChunkPush> push_;  // by chunk id
  RowTables* rows_ = nullptr;
  uint64_t pushes_ = 0;
  uint64_t bytes_pushed_ = 0;
  uint64_t pushes_resent_ = 0;
  uint64_t pushes_lost_ = 0;
  bool more_ = false;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_PUSH_PIPELINE_H_
