#include "worker/push_pipeline.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include <glog/logging.h>

#include "common/stall_point.h"
#include "common/trace.h"
#include "worker/row_tables.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;

PushPipeline::PushPipeline(const ClientOptions& options, const control::ClusterConfig& config,
                           control::ControlClient& control, uint32_t rank, ServerSessions& sessions,
                           std::vector<Tensor>& tensors, const std::vector<ChunkPlacement>& chunks,
                           HandleTable& handles, const StepClock& step, const PullPipeline& pull)
    : options_(options),
      config_(config),
      control_(control),
      rank_(rank),
      sessions_(sessions),
      tensors_(tensors),
      chunks_(chunks),
      handles_(handles),
      step_(step),
      pull_(pull),
      push_(chunks.size()) {}

uint64_t PushPipeline::SmallStagingBytes() const {
  uint64_t bytes = 0;
  for (const ChunkPlacement& c : chunks_) {
    if (c.bytes <= kSmallPushBytes && !c.rows.rows_kind()) {
      bytes += 2 * (sizeof(layout::PushHeader) + layout::AlignUp(c.bytes));
    }
  }
  return bytes;
}

void PushPipeline::PlaceSmallStaging(uint64_t base) {
  for (const ChunkPlacement& c : chunks_) {
    if (c.bytes > kSmallPushBytes || c.rows.rows_kind()) continue;
    push_[c.id].small_staging = base;
    base += 2 * (sizeof(layout::PushHeader) + layout::AlignUp(c.bytes));
  }
}

void PushPipeline::Prestart(const std::vector<uint32_t>& tensors) {
  for (uint32_t i : tensors) Prestart(tensors_[i]);
}

void PushPipeline::Prestart(Tensor& t) {
  if (t.staging == nullptr || t.staging_prestarted || handles_.Contains(t.push_handle)) {
    return;  // not staged, already started, or refused by Push (StageGradients)
  }
  // A failure is Push's to report: it starts the copy again itself.
  t.staging_prestarted = t.staging->StartGradsToHost().ok();
}

Status PushPipeline::StageGradients(Tensor& t, const char* what) {
  if (t.staging == nullptr) return Status::OK();
  // The mirror still holds the bytes of a push the caller has not waited for.
  if (handles_.Contains(t.push_handle)) {
    return FailedPreconditionError(std::string(what) + " of '" + t.name +
                                   "' before Wait() on its previous push");
  }
  const bool started = t.staging_prestarted;
  t.staging_prestarted = false;
  return started ? Status::OK() : t.staging->StartGradsToHost();
}

Status PushPipeline::StageForStateTransfer(uint32_t tensor) {
  return StageGradients(tensors_[tensor], "state transfer");
}

void PushPipeline::CancelPrestart() {
  for (Tensor& t : tensors_) t.staging_prestarted = false;
}

StatusOr<Handle> PushPipeline::Push(uint32_t tensor, const std::function<Status()>& recover,
                                     bool only_missing) {
  Tensor& t = tensors_[tensor];
  RETURN_IF_ERROR(StageGradients(t, "Push"));
  const uint64_t h = handles_.Create();
  handles_[h];  // entered now: a Wait on it before any chunk completes waits
  t.push_handle = h;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    if (only_missing && push_[t.chunks[i]].PushedIn(step_.clock)) continue;
    Status st = PushChunk(t.chunks[i], h, recover);
    if (!st.ok()) {
      handles_[h].error = st;
      // This chunk and those after it lack this gradient (PushChunk left this one as it was).
      for (size_t j = i; j < t.chunks.size(); ++j) {
        if (!only_missing || !push_[t.chunks[j]].PushedIn(step_.clock)) {
          push_[t.chunks[j]].left_out = true;
        }
      }
      break;
    }
    push_[t.chunks[i]].left_out = false;
  }
  return Handle{h};
}

PushPipeline::PushedCount PushPipeline::PushedThisClock(uint32_t tensor) const {
  PushedCount n;
  for (uint32_t id : tensors_[tensor].chunks) {
    ++n.chunks;
    if (push_[id].PushedIn(step_.clock)) ++n.pushed;
  }
  return n;
}

bool PushPipeline::RowsBehindPush(uint32_t tensor) const {
  if (rows_ == nullptr || !tensors_[tensor].embedding) return false;
  for (uint32_t id : tensors_[tensor].chunks) {
    if (push_[id].PushedIn(step_.clock) && rows_->HasPendingRows(id)) return true;
  }
  return false;
}

Status PushPipeline::ErrorOf(Handle h) const {
  const HandleState* hs = handles_.Find(h.id);
  return hs != nullptr ? hs->error : Status::OK();
}

Status PushPipeline::PushOpAndAwait(uint32_t id, layout::PushOp op, uint64_t arg,
                                    const std::function<Status()>& recover,
                                    const F32Values* values) {
  // The chunk's previous push first: the server acknowledges an op at once, and an
  // acknowledgement covers every lower sequence number, so an op posted while a gradient push
  // still waits in the inbox (a BSP clock not complete yet, a version replicating) would let
  // the op after it overwrite that push's slot, and a failover skip resending it.
  if (push_[id].seq > 0) RETURN_IF_ERROR(EnsureAcked(id, push_[id].seq, recover));
  const uint64_t h = handles_.Create();
  // While it is awaited the op's payload is certainly where it was posted from (the caller is
  // inside this call): a failover meanwhile resends it (Resync).
  push_[id].op_awaited = true;
  Status st = PushChunk(id, h, recover, op, arg, values);
  if (st.ok()) st = EnsureAcked(id, push_[id].seq, recover);
  push_[id].op_awaited = false;
  // Acknowledged: never resent, so the caller's staging is no longer referenced. (Not
  // acknowledged: the staging stays as it is until every push is, SetStateValues.)
  if (st.ok()) push_[id].last_values = F32Values{};
  if (handles_.Contains(h) && handles_[h].pending == 0) handles_.Erase(h);
  return st;
}

Status PushPipeline::PushChunk(uint32_t id, uint64_t h, const std::function<Status()>& recover,
                               layout::PushOp op, uint64_t arg, const F32Values* values) {
  trace::Span span("push", "worker");  // waiting for the inbox slot, then posting
  span.Arg("chunk", id).Arg("clock", step_.clock).Arg("step", step_.in_step ? step_.step_id : 0)
      .Arg("bytes", chunks_[id].bytes).Arg("server", chunks_[id].server);
  ChunkPush& c = push_[id];
  const uint64_t seq = c.seq + 1;
  const uint32_t parity = static_cast<uint32_t>(seq & 1);
  // The inbox slot of this parity was last used by push seq-2: it must be consumed.
  if (seq > 2) RETURN_IF_ERROR(EnsureAcked(id, seq - 2, recover));
  if (c.handle[parity] != 0) {
    // Push seq-2 is acknowledged (so applied), even if its completion is not polled yet.
    handles_.FinishChunk(c.handle[parity], Status::OK());
    c.handle[parity] = 0;
  }
  // A post that fails with its server's session intact sent nothing the server will take
  // (no header, no immediate): the chunk is left as it was, its sequence number included, so
  // that neither a resend after a later failover nor the next push sends a push numbered
  // seq that never left (and a row shard's rows stay pending).
  const ChunkPush before = c;
  // A row shard: this step's gradient rows go into the staging of this parity, which push
  // seq-2 (acknowledged above) no longer needs.
  // A state transfer's payload instead (RowTables::SetOpPayload): the gradient rows added this
  // step stay pending for the next gradient push.
  if (chunks_[id].rows.rows_kind()) {
    c.last_bytes = op == layout::PushOp::kGradient ? rows_->Stage(id, parity)
                                                   : rows_->StageOp(id, parity);
  }
  c.seq = seq;
  c.last_clock = step_.clock;
  c.last_base = pull_.pulled_version(id);
  c.last_rule = tensors_[chunks_[id].tensor].rule;
  c.last_flags = (step_.non_finite ? layout::kPushNonFinite : 0) |
                 (tensors_[chunks_[id].tensor].no_gradient ? layout::kPushNoGradient : 0);
  if (op != layout::PushOp::kGradient && chunks_[id].rows.rows_kind()) {
    c.last_flags |= rows_->OpFlags(id);  // a row set's float32 rows
  }
  c.last_weight = step_.weight;
  c.last_values = values != nullptr ? *values : F32Values{};
  if (values != nullptr) c.last_flags |= layout::kPushF32Values;
  c.last_op = op;
  c.last_arg = arg;
  c.step = step_.in_step ? step_.step_id : 0;
  c.last_handle = h;
  c.handle[parity] = h;
  c.seq_of[parity] = seq;
  HandleState& hs = handles_[h];
  ++hs.pending;
  // The next push of this chunk will need this one's predecessor acknowledged: read the acks
  // right behind this push (one sendmsg / doorbell with it) unless they already say so.
  const uint32_t server = chunks_[id].server;
  const bool ahead = seq >= 2 && c.known_acked < seq - 1 && !sessions_.acks_ahead_in_flight(server);
  Status st = PostPush(id, seq, h, ahead);
  if (st.ok() && ahead) {
    sessions_.PostAcksAhead(server, more_ ? transport::kMore : transport::kSignaled);
  }
  if (!st.ok() && !sessions_.at(server).failed) {
    c = before;
    --hs.pending;
    return st;
  }
  // Posted, or left to be resent after the recovery: this clock has the chunk's gradient.
  if (op == layout::PushOp::kGradient) {
    c.grad_clock_plus1 = step_.clock + 1;
    if (chunks_[id].rows.rows_kind()) rows_->CommitStage(id);
  }
  if (!st.ok()) return Status::OK();  // the session failed: resent after the recovery
  // Training traffic only: a state transfer (SetState, SetRows, GetRows) is not a push of a
  // gradient.
  if (op == layout::PushOp::kGradient) {
    ++pushes_;
    bytes_pushed_ += chunks_[id].rows.rows_kind() ? c.last_bytes : chunks_[id].bytes;
  }
  return Status::OK();
}

Status PushPipeline::AwaitAllAcked(const std::function<Status()>& recover) {
  // Renewed after a recovery: a failover that took most of the wait is not the servers' delay
  // in acknowledging (the pull waits hold their deadlines likewise).
  auto deadline = SteadyClock::now() + options_.wait_timeout;
  while (true) {
    // The servers that still owe an acknowledgement of some chunk's latest push.
    std::vector<uint32_t> servers;
    for (uint32_t id = 0; id < push_.size(); ++id) {
      const uint32_t server = chunks_[id].server;
      if (push_[id].Settled() < push_[id].seq &&
          std::find(servers.begin(), servers.end(), server) == servers.end()) {
        servers.push_back(server);
      }
    }
    if (servers.empty()) return Status::OK();
    // One read per server, all in flight together: one round trip, not one per server.
    Status st = sessions_.ReadAcks(servers, deadline, [] {
      return DeadlineExceededError("waiting for the servers to acknowledge this step's pushes");
    });
    // A stopped server's acks never move (and over shm or verbs its reads still complete):
    // the membership says when it is gone, checked here too since reads that completed at
    // once never waited.
    sessions_.CheckDepartures();
    bool failed = false;
    for (uint32_t server : servers) failed = failed || sessions_.at(server).failed;
    if (failed) {
      RETURN_IF_ERROR(recover());  // resynchronises known_acked with the servers (Resync)
      deadline = SteadyClock::now() + options_.wait_timeout;
      continue;
    }
    RETURN_IF_ERROR(st);
    for (uint32_t server : servers) ApplyAcks(server, sessions_.Acks(server));
    if (SteadyClock::now() > deadline) {
      return DeadlineExceededError("waiting for the servers to acknowledge this step's pushes");
    }
    std::this_thread::yield();
  }
}

Status PushPipeline::EnsureAcked(uint32_t id, uint64_t need,
                                 const std::function<Status()>& recover) {
  ChunkPush& c = push_[id];
  const uint32_t server = chunks_[id].server;
  auto deadline = SteadyClock::now() + options_.wait_timeout;  // renewed after a recovery
  // A push counted lost in a failover is never acknowledged: not waited for (the new server
  // never had it, so its inbox slot is free).
  if (c.Settled() < need) {
    // An acks read posted behind an earlier push: its answer is on its way (or here) and
    // costs no round trip of its own.
    while (sessions_.acks_ahead_in_flight(server) && !sessions_.at(server).failed &&
           SteadyClock::now() < deadline) {
      RETURN_IF_ERROR(sessions_.Progress());
      sessions_.CheckDepartures();  // a stopped server answers it never
    }
    if (const uint64_t* acks = sessions_.TakeAcksAhead(server)) ApplyAcks(server, acks);
  }
  while (c.Settled() < need) {
    Status st = sessions_.ReadAcks(
        server, id, deadline,
        [&] {
          return DeadlineExceededError("waiting for server " + std::to_string(server) +
                                       " to acknowledge pushes");
        },
        /*stop_if_failed=*/true);
    if (sessions_.at(server).failed) {
      RETURN_IF_ERROR(recover());  // resynchronises known_acked with the server (Resync)
      deadline = SteadyClock::now() + options_.wait_timeout;
      continue;
    }
    RETURN_IF_ERROR(st);
    ApplyAcks(server, sessions_.Acks(server));
    if (c.Settled() < need) std::this_thread::yield();
  }
  return Status::OK();
}

void PushPipeline::ApplyAcks(uint32_t server, const uint64_t* acks) {
  const std::vector<uint32_t>& chunk_of_slot = sessions_.at(server).chunk_of_slot;
  for (uint32_t slot = 0; slot < chunk_of_slot.size(); ++slot) {
    ChunkPush& o = push_[chunk_of_slot[slot]];
    o.known_acked = std::max(o.known_acked, acks[slot]);
  }
}

Status PushPipeline::PostPush(uint32_t id, uint64_t seq, uint64_t h, bool hold) {
  const ChunkPlacement& p = chunks_[id];
  const ChunkPush& c = push_[id];
  const Tensor& t = tensors_[p.tensor];
  ServerSession& s = sessions_.at(p.server);
  if (!s.ep) return sessions_.ServerError(p.server, "not connected");
  const uint32_t parity = static_cast<uint32_t>(seq & 1);
  auto* ph =
      reinterpret_cast<layout::PushHeader*>(sessions_.ChunkStaging(id, static_cast<int>(parity)));
  std::memset(ph, 0, sizeof(*ph));
  ph->seq = seq;
  ph->clock = c.last_clock;
  ph->base_version = c.last_base;
  ph->chunk_id = id;
  ph->worker = rank_;
  const bool f32_values = c.last_values.payload.region != nullptr;
  ph->bytes = f32_values ? c.last_values.payload.length
                         : p.rows.rows_kind() ? c.last_bytes : p.bytes;
  ph->first = c.last_values.first;
  ph->epoch = std::max(control_.epoch(), sessions_.map_epoch());
  ph->magic = layout::kPushMagic;
  ph->rule = c.last_rule;
  ph->flags = c.last_flags;
  ph->weight = c.last_weight;
  ph->op = static_cast<uint32_t>(c.last_op);
  ph->op_arg = c.last_arg;
  const transport::RemoteSlice header_dst =
      transport::AtOffset(s.inbox, s.layout->push_header_offset(rank_, p.slot, parity));
  const uint32_t imm = layout::MakeImm(layout::ImmKind::kPush, (p.slot << 1) | parity);
  const uint32_t last_flags = more_ || hold ? transport::kMore : transport::kSignaled;
  if (c.small_staging != 0 && t.staging == nullptr && !f32_values) {
    // [PushHeader | data] in one write; this staging parity was last sent by push seq-2,
    // which the server has consumed (EnsureAcked).
    const uint64_t off = c.small_staging + parity * (sizeof(layout::PushHeader) + layout::AlignUp(p.bytes));
    char* q = sessions_.StagingAt(off);
    std::memcpy(q, ph, sizeof(*ph));
    std::memcpy(q + sizeof(layout::PushHeader), reinterpret_cast<const char*>(t.grads) + p.offset, p.bytes);
    return sessions_.PostWithCredit([&] {
      return s.ep->PostWriteImm({sessions_.staging(), off, sizeof(layout::PushHeader) + p.bytes}, header_dst,
                                imm, MakeContext(kOpPush, id, h), last_flags);
    });
  }
  RETURN_IF_ERROR(PostPushData(id, parity, h));
  return sessions_.PostWithCredit([&] {
    return s.ep->PostWriteImm(
        {sessions_.staging(), sessions_.ChunkStagingOffset(id, static_cast<int>(parity)),
         sizeof(layout::PushHeader)},
        header_dst, imm, MakeContext(kOpPush, id, h), last_flags);
  });
}

Status PushPipeline::PostPushData(uint32_t id, uint32_t parity, uint64_t h) {
  const ChunkPlacement& c = chunks_[id];
  Tensor& t = tensors_[c.tensor];
  ServerSession& s = sessions_.at(c.server);
  const uint64_t dst = s.layout->push_data_offset(rank_, c.slot, parity);
  if (const F32Values& v = push_[id].last_values; v.payload.region != nullptr) {
    return sessions_.PostWithCredit([&] {
      return s.ep->PostWrite(v.payload, transport::AtOffset(s.inbox, dst),
                             MakeContext(kOpPush, id, h), transport::kUnsignaled);
    });
  }
  if (c.rows.rows_kind()) {
    const uint64_t bytes = push_[id].last_bytes;
    if (bytes == 0) return Status::OK();  // an empty push: the header alone
    return sessions_.PostWithCredit([&] {
      return s.ep->PostWrite(rows_->Staged(id, parity, bytes), transport::AtOffset(s.inbox, dst),
                             MakeContext(kOpPush, id, h), transport::kUnsignaled);
    });
  }
  if (t.staging == nullptr) {
    return sessions_.PostWithCredit([&] {
      return s.ep->PostWrite({t.gmr.get(), c.offset, c.bytes}, transport::AtOffset(s.inbox, dst),
                             MakeContext(kOpPush, id, h), transport::kUnsignaled);
    });
  }
  // Staged: the pieces whose device->host copy is done are written at once, in one write
  // (every piece copied by then, up to the chunk's end); later pieces are still being copied
  // meanwhile. Writes on one endpoint execute in post order, so the header (posted after the
  // last piece) still lands after all of the data. The writes are unsignaled, but every
  // kMaxUnsignaledRun-th is signaled (kOpCredit): a chunk of more pieces than the send queue
  // holds would otherwise never get its credits back before its header.
  const uint64_t piece = t.staging->piece_bytes();
  const uint64_t end = c.offset + c.bytes;
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  int unsignaled = 0;
  for (uint64_t a = c.offset; a < end;) {
    uint64_t b = std::min(end, (a / piece + 1) * piece);
    while (true) {
      ASSIGN_OR_RETURN(bool ready, t.staging->GradsOnHost(b));
      if (ready) break;
      RETURN_IF_ERROR(sessions_.Progress());
      if (SteadyClock::now() > deadline) {
        return DeadlineExceededError("device->host copy of '" + t.name + "' timed out");
      }
    }
    while (b < end) {  // the copies complete in order: take every piece already on the host
      const uint64_t next = std::min(end, b + piece);
      ASSIGN_OR_RETURN(bool ready, t.staging->GradsOnHost(next));
      if (!ready) break;
      b = next;
    }
    const bool credit = ++unsignaled == kMaxUnsignaledRun;
    if (credit) unsignaled = 0;
    RETURN_IF_ERROR(sessions_.PostWithCredit([&] {
      return s.ep->PostWrite({t.gmr.get(), a, b - a},
                             transport::AtOffset(s.inbox, dst + (a - c.offset)),
                             credit ? MakeContext(kOpCredit, id, 0) : MakeContext(kOpPush, id, h),
                             credit ? transport::kSignaled : transport::kUnsignaled);
    }));
    a = b;
  }
  return Status::OK();
}

void PushPipeline::OnCompletion(uint32_t chunk, uint64_t handle, const Status& err) {
  if (chunk >= push_.size() || handle == 0) return;
  ChunkPush& c = push_[chunk];
  const int p = c.handle[0] == handle ? 0 : c.handle[1] == handle ? 1 : -1;
  if (p < 0) return;  // already finished (an unsignaled write's error after the header's)
  // A failed push is not the caller's error yet: it is resent after the reconnect or failover
  // (Resync), or the recovery reports why not.
  if (!err.ok()) return;
  c.handle[p] = 0;
  handles_.FinishChunk(handle, err);
}

Status PushPipeline::Resync(uint32_t server, const uint64_t* acks) {
  const std::vector<uint32_t>& chunk_of_slot = sessions_.at(server).chunk_of_slot;
  for (uint32_t slot = 0; slot < chunk_of_slot.size(); ++slot) {
    RETURN_IF_ERROR(ResyncChunk(chunk_of_slot[slot], acks[slot]));
  }
  return Status::OK();
}

Status PushPipeline::ResyncChunk(uint32_t id, uint64_t a) {
  ChunkPush& c = push_[id];
  c.known_acked = a;
  for (int p = 0; p < 2; ++p) {
    const uint64_t h = c.handle[p];
    if (h == 0 || c.seq_of[p] == c.seq) continue;
    c.handle[p] = 0;
    handles_.FinishChunk(h, c.seq_of[p] <= a
                                ? Status::OK()
                                : DataLossError("push " + std::to_string(c.seq_of[p]) +
                                                " of chunk " + std::to_string(id) +
                                                " was lost in a failover (not replicated, and its "
                                                "gradient buffer was reused by a later push)"));
  }
  const uint32_t p = static_cast<uint32_t>(c.seq & 1);
  if (c.seq <= a) {
    if (c.handle[p] != 0) {
      const uint64_t h = c.handle[p];
      c.handle[p] = 0;
      handles_.FinishChunk(h, Status::OK());  // it was replicated before the primary died
    }
    return Status::OK();
  }
  // The latest push is resent from the caller's gradient buffer only when its bytes are
  // certainly still there: its handle has not completed, or the caller has not waited for it
  // (the caller may not touch the buffer until Wait returns: a push by hand that Step left
  // out, a PushMany still being posted), or it was pushed by the Step() we are inside, or the
  // mode is BSP (where a gradient buffer is rewritten only after the pull that needs this
  // push). Otherwise the caller may have reused the buffer: resending would apply other
  // bytes — never twice, never wrong: count it lost instead.
  // A row shard's push is in the client's own staging until the push after next: always.
  // A state op being awaited (PushOpAndAwait), and float32 values (SetStateValues' staging,
  // rewritten only once every push is acknowledged): always.
  const bool resendable = c.handle[p] != 0 || handles_.Contains(c.last_handle) ||
                          config_.mode() == control::BSP ||
                          (step_.in_step && c.step == step_.step_id) ||
                          chunks_[id].rows.rows_kind() || c.op_awaited ||
                          c.last_values.payload.region != nullptr;
  // Lost: those after the acknowledged ones, up to the latest unless it is resent; those an
  // earlier failover counted lost already are not counted again.
  const uint64_t last_lost = resendable ? c.seq - 1 : c.seq;
  const uint64_t first_lost = std::max(a, c.lost_through) + 1;
  if (last_lost >= first_lost) {
    pushes_lost_ += last_lost - first_lost + 1;
    c.lost_through = last_lost;
    LOG(WARNING) << "worker rank " << rank_ << ": chunk " << id << ": pushes " << first_lost << ".."
                 << last_lost
                 << " were not replicated before the failover and cannot be resent (their "
                    "gradient buffer may have been reused)";
  }
  if (resendable) {
    StallPoint("worker.before_resent_push");  // a push sent again after a failover or reconnect
    RETURN_IF_ERROR(PostPush(id, c.seq, c.handle[p]));
    ++pushes_resent_;
  }
  return Status::OK();
}

}  // namespace shardps::worker
