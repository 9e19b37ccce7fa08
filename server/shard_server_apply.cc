// ShardServer's data path: the handlers of the completions the apply thread polls. Decisions
// come from the components (WorkerTable, ConsistencyGate, ReplicationStream, CheckpointCapture);
// these handlers carry them out. None of them calls another handler: a published version puts
// its slot on work_, and DrainWork() retries the slot's deferred pushes and (BSP) completes its
// next clock, once per completion handled, until no work is left.
#include <algorithm>
#include <atomic>
#include <cstring>

#include <glog/logging.h>

#include "server/shard_server.h"

#include "common/crash_point.h"
#include "common/stall_point.h"
#include "common/trace.h"
#include "proto/credentials.h"

namespace shardps::server {

using transport::Completion;

void ShardServer::HandleRecvImm(const Completion& c) {
  const uint32_t arg = layout::ImmArg(c.imm);
  const layout::ImmKind kind = layout::ImmKindOf(c.imm);
  if (kind == layout::ImmKind::kReplHello || kind == layout::ImmKind::kRepl) {
    HandleReplication(c, kind, arg);
    return;
  }
  if (backup_) {
    // A worker that reached the backup before its promotion: kept until then.
    if (early_.size() < 1u << 20) early_.push_back(c);
    return;
  }
  if (kind == layout::ImmKind::kHello) {
    HandleHello(c.endpoint_id, arg);
    return;
  }
  const std::optional<uint32_t> sender = endpoints_->WorkerOf(c.endpoint_id);
  if (!sender) {
    LOG(WARNING) << "server rank " << rank_ << ": immediate from an endpoint that never said hello";
    stats_.Bump(&ShardServerCounters::rejected_pushes);
    return;
  }
  const uint32_t worker = *sender;
  if (kind == layout::ImmKind::kInit) {
    HandleInit(worker, arg);
  } else if (kind == layout::ImmKind::kPush) {
    HandlePush(worker, arg >> 1, arg & 1, false);
  } else if (kind == layout::ImmKind::kClock) {
    HandleClock(worker, arg);
  } else {
    stats_.Bump(&ShardServerCounters::rejected_pushes);
  }
}

void ShardServer::HandleReplication(const Completion& c, layout::ImmKind kind, uint32_t arg) {
  if (!backup_) {
    // A primary that lost its group (fenced) still writing: refuse it.
    LOG_EVERY_N(WARNING, 100) << "server rank " << rank_
                              << ": replication traffic to a server that is not a backup "
                                 "(fenced); closing that endpoint";
    endpoints_->Close(c.endpoint_id);
    stats_.Bump(&ShardServerCounters::records_rejected);
    return;
  }
  if (kind == layout::ImmKind::kReplHello) {
    const auto who = control::ParseIdentity(endpoints_->IdentityOf(c.endpoint_id));
    if (!who.ok() || who->role != control::ROLE_SERVER) {
      LOG(WARNING) << "server rank " << rank_ << ": replication hello on endpoint "
                   << c.endpoint_id << " whose peer is not an authenticated server ('"
                   << endpoints_->IdentityOf(c.endpoint_id) << "'): closed";
      stats_.Bump(&ShardServerCounters::identity_mismatches);
      endpoints_->Close(c.endpoint_id);
      return;
    }
    if (arg != group_) {
      LOG(WARNING) << "server rank " << rank_ << ": replication hello for group " << arg
                   << ", but this server backs up group " << group_;
      endpoints_->Close(c.endpoint_id);
      return;
    }
    applier_->set_primary_endpoint(c.endpoint_id);
    LOG(INFO) << "server rank " << rank_ << ": primary of group " << group_
              << " connected its replication stream (endpoint " << c.endpoint_id << ")";
    layout::ReplHello hello;
    std::memcpy(&hello, static_cast<const char*>(ring_->data()) + repl_layout_->hello_offset(),
                sizeof(hello));
    if (hello.magic == layout::kReplHelloMagic && hello.descriptor_bytes != 0) {
      StartCatchUp(c.endpoint_id, hello);
    } else if (awaiting_snapshot_) {
      catch_up_error_ = FailedPreconditionError(
          "the primary of group " + std::to_string(group_) +
          " connected without a snapshot, but this new backup has none of the group's state");
    }
    return;
  }
  if (c.endpoint_id != applier_->primary_endpoint()) {
    stats_.Bump(&ShardServerCounters::records_rejected);
    return;
  }
  if (catch_up_ || awaiting_snapshot_) {
    // The snapshot is being copied: the record waits in the ring (the primary sees the ring's
    // space only once it is applied) and is applied after the snapshot is restored.
    if (catch_up_) catch_up_->held.push_back(arg);
    return;
  }
  ApplyRecord(arg);
}

void ShardServer::ApplyRecord(uint32_t arg) {
  trace::Span span("repl_apply", "server");  // a backup applies its primary's record
  span.Arg("entry", arg);
  Status st = applier_->Apply(arg, fence_epoch_, *chunks_, *workers_, *gate_, *ack_board_);
  if (!st.ok()) {
    LOG(ERROR) << "server rank " << rank_ << ": replication record in entry " << arg
               << " refused: " << st.message() << " (this backup can no longer follow its primary)";
    stats_.Bump(&ShardServerCounters::records_rejected);
    return;
  }
  stats_.Update([](ShardServerCounters& k) {
    ++k.versions_published;
    ++k.records_applied;
  });
}

void ShardServer::HandleHello(uint64_t endpoint_id, uint32_t rank) {
  if (rank >= layout_->max_workers()) {
    LOG(WARNING) << "server rank " << rank_ << ": hello from worker rank " << rank
                 << " beyond max_workers " << layout_->max_workers();
    return;
  }
  layout::Hello hello;
  std::memcpy(&hello, static_cast<const char*>(clocks_->data()) + layout_->clock_offset(rank),
              sizeof(hello));
  const uint64_t incarnation = hello.magic == layout::kHelloMagic ? hello.incarnation : 0;
  // A worker's rank and incarnation are the ones its credential names, not what its hello
  // claims: the endpoint's peer proved "role:member:rank" at accept (docs/security.md).
  const std::string identity = endpoints_->IdentityOf(endpoint_id);
  const auto who = control::ParseIdentity(identity);
  if (!who.ok() || who->role != control::ROLE_WORKER || who->rank != rank ||
      who->member_id != incarnation) {
    LOG(WARNING) << "server rank " << rank_ << ": hello as worker rank " << rank
                 << " (incarnation " << incarnation << ") on an endpoint whose peer proved '"
                 << identity << "': refused, endpoint " << endpoint_id << " closed";
    stats_.Bump(&ShardServerCounters::identity_mismatches);
    endpoints_->Close(endpoint_id);
    return;
  }
  bool fresh = false;
  const bool known = workers_->Hello(rank, incarnation, endpoint_id, &fresh);
  if (fresh) ack_board_->ResetWorker(rank);
  endpoints_->BindWorker(endpoint_id, rank);
  LOG(INFO) << "server rank " << rank_ << ": worker " << rank << " connected (endpoint "
            << endpoint_id << ", incarnation " << incarnation
            << (known ? ", known: keeps its sequence numbers" : "") << ")";
}

void ShardServer::HandleInit(uint32_t worker, uint32_t slot) {
  if (slot >= chunks_->slots() || worker != 0) return;
  if (chunks_->initialised(slot) || gate_->in_flight(slot)) return;  // a duplicate
  const char* src =
      static_cast<const char*>(inbox_->data()) + layout_->push_data_offset(worker, slot, 0);
  ReplRecord r;
  r.slot = slot;
  r.kind = layout::ReplKind::kInit;
  r.bytes = chunks_->bytes(slot);
  r.payload = {weights_.get(), layout_->buffer_offset(slot, 0), r.bytes};
  const uint32_t buffer = chunks_->Init(slot, src);
  // "@N": the Nth initial weights taken (copied in, the worker's write long complete), its
  // record not posted: the backup never sees them, so rank 0 must write them again there.
  CrashPoint("server.before_init_record");
  Commit(buffer, std::move(r));
}

bool ShardServer::HandlePush(uint32_t worker, uint32_t slot, uint32_t parity, bool from_queue) {
  auto reject = [&](const char* why) {
    LOG_EVERY_N(WARNING, 100) << "server rank " << rank_ << ": push from worker " << worker
                              << " slot " << slot << " rejected: " << why;
    stats_.Bump(&ShardServerCounters::rejected_pushes);
    return true;
  };
  if (slot >= chunks_->slots()) return reject("slot out of range");
  const WorkerState* w = workers_->Find(worker);
  if (w == nullptr) return reject("unknown worker");
  const char* base = static_cast<const char*>(inbox_->data());
  layout::PushHeader h;
  std::memcpy(&h, base + layout_->push_header_offset(worker, slot, parity), sizeof(h));
  if (h.magic != layout::kPushMagic) return reject("bad magic");
  const bool rows = chunks_->is_rows(slot);
  const bool f32_values = (h.flags & layout::kPushF32Values) != 0;
  if (h.chunk_id != chunks_->chunk_id(slot) || h.worker != worker ||
      (!rows && !f32_values && h.bytes != chunks_->bytes(slot))) {
    return reject("header does not match the slot");
  }
  const bool set_op = h.op == static_cast<uint32_t>(layout::PushOp::kSetWeights) ||
                      h.op == static_cast<uint32_t>(layout::PushOp::kSetState1) ||
                      h.op == static_cast<uint32_t>(layout::PushOp::kSetState2);
  // Float32 values of a range of the chunk (layout::kPushF32Values) only on a dense set, whole
  // floats, inside the inbox slot and inside the chunk.
  if (f32_values) {
    if (rows || !set_op) return reject("float32 values on a push that is not a dense set");
    const uint64_t elems = chunks_->elems(slot);
    if (h.bytes == 0 || h.bytes % sizeof(float) != 0 || h.bytes > layout_->push_capacity(slot) ||
        h.first > elems || h.bytes / sizeof(float) > elems - h.first) {
      return reject("float32 values outside the slot or the chunk");
    }
  }
  // Float32 rows (layout::kPushF32Rows) only on a row set.
  if ((h.flags & layout::kPushF32Rows) != 0 && (!rows || !set_op)) {
    return reject("float32 rows on a push that is not a row set");
  }
  if (rows) {
    // A row shard's push: n entries (id, row) within the inbox slot's capacity.
    const layout::RowGeometry& g = layout_->rows(slot);
    const char* data = base + layout_->push_data_offset(worker, slot, parity);
    // What the payload holds: entries (a gradient, a set), ids (a get), a slot range (a list).
    uint64_t ids_n = 0;
    const bool f32_rows = (h.flags & layout::kPushF32Rows) != 0;  // a row set's (checked above)
    switch (static_cast<layout::PushOp>(h.op)) {
      case layout::PushOp::kGradient:
      case layout::PushOp::kSetWeights:
      case layout::PushOp::kSetState1:
      case layout::PushOp::kSetState2: {
        // Float32 rows (a 16-bit table's exact set) fill the same slot bytes with fewer entries.
        const uint64_t entry = g.set_entry_bytes(f32_rows);
        if (h.bytes % entry != 0 || h.bytes / entry > g.max_set_entries(f32_rows)) {
          return reject("row push size is not a whole number of entries within max_ids");
        }
        ids_n = h.bytes / entry;
        break;
      }
      case layout::PushOp::kGetState:
        if (h.bytes % sizeof(uint64_t) != 0 || h.bytes / sizeof(uint64_t) > g.max_ids) {
          return reject("row get size is not a whole number of ids within max_ids");
        }
        ids_n = h.bytes / sizeof(uint64_t);
        break;
      case layout::PushOp::kListRows: {
        uint64_t range[2] = {0, 0};
        if (h.bytes == sizeof(range)) std::memcpy(range, data, sizeof(range));
        if (h.bytes != sizeof(range) || range[1] > g.max_ids || range[0] > g.rows ||
            range[1] > g.rows - range[0]) {
          return reject("row list is not a slot range of this shard within max_ids");
        }
        break;
      }
      default:
        return reject("state op not applicable to a row table");
    }
    if (const char* bad = layout::CheckUpdateRule(h.rule)) return reject(bad);
    if (const char* bad = layout::CheckRowRule(h.rule)) return reject(bad);
    if (!workers_->IsDuplicate(worker, slot, h.seq)) {
      const Status ids = chunks_->row_shard(slot)->CheckEntries(data, ids_n);
      if (!ids.ok()) {
        LOG_EVERY_N(WARNING, 100) << "server rank " << rank_ << ": row push from worker "
                                  << worker << " slot " << slot << " rejected: " << ids.message();
        stats_.Bump(&ShardServerCounters::rejected_pushes);
        return true;
      }
    }
  }
  if ((h.seq & 1) != parity) return reject("parity does not match seq");
  // Clocks move by one per step: 2^40 is beyond any run, and keeps every clock arithmetic of the
  // gate (clock - 1, clock + 1 as int64) well defined whatever a peer writes.
  if (h.clock >= (uint64_t{1} << 40)) return reject("clock out of range");
  if (h.epoch < fence_epoch_) return reject("push from an epoch before this server's promotion");
  if (const char* bad = layout::CheckUpdateRule(h.rule)) return reject(bad);
  if (workers_->IsDuplicate(worker, slot, h.seq)) {
    stats_.Bump(&ShardServerCounters::duplicate_pushes);
    return true;  // applied already: exactly once
  }
  if (h.op != static_cast<uint32_t>(layout::PushOp::kGradient)) {
    if (h.op > static_cast<uint32_t>(layout::PushOp::kGetState) && !rows) {
      return reject("unknown op");
    }
    if (!chunks_->initialised(slot)) return reject("state transfer before the chunk has weights");
    return HandleStateOp(worker, slot, parity, h);
  }
  const int64_t clock = static_cast<int64_t>(h.clock);
  const Contributor push{worker, parity, h.seq, w->incarnation, clock, h.rule, h.flags,
                         std::max<uint32_t>(1, h.weight)};
  switch (gate_->OnPush(slot, push, from_queue, chunks_->initialised(slot), *workers_)) {
    case ConsistencyGate::Decision::kDefer:
      if (!from_queue) stats_.Bump(&ShardServerCounters::deferred_pushes);  // once per push
      return false;
    case ConsistencyGate::Decision::kUninitialised:
      return reject("chunk not initialised yet");
    case ConsistencyGate::Decision::kDropStale:
      // Its clock was completed without it: acknowledge and drop it rather than mixing clocks.
      workers_->Consume(worker, slot, h.seq, -1);
      ack_board_->Raise(worker, slot, h.seq);
      LOG_EVERY_N(WARNING, 100) << "server rank " << rank_ << ": BSP push of clock " << clock
                                << " from worker " << worker << " for chunk "
                                << chunks_->chunk_id(slot)
                                << " arrived after that clock was applied; dropped";
      stats_.Bump(&ShardServerCounters::stale_pushes);
      return true;
    case ConsistencyGate::Decision::kAggregate:
      trace::Instant("push_in", "server",
                     {{"chunk", h.chunk_id}, {"clock", clock}, {"worker", worker}, {"seq", h.seq}});
      newest_push_epoch_ = std::max(newest_push_epoch_, h.epoch);
      workers_->Consume(worker, slot, h.seq, clock);
      ObservePushApplied(slot, h);
      // A push of this clock held back while no clock was pending (ConsistencyGate::OnPush)
      // is admissible now that this one made the clock pending: the clock waits for it, and
      // only this drain hands it back.
      if (!from_queue && gate_->ShouldRetryDeferred(slot)) work_.push_back(slot);
      MaybeApplyBsp(slot);
      return true;
    case ConsistencyGate::Decision::kApply:
      break;
  }
  const auto t0 = Clock::now();
  trace::Span span("apply", "server");  // one push applied (ASP, SSP, VSGD)
  span.Arg("chunk", h.chunk_id).Arg("clock", clock).Arg("worker", worker).Arg("seq", h.seq);
  if (WorkerState* ws = workers_->Find(worker)) ws->weight = std::max<uint32_t>(1, h.weight);
  ReplRecord r;
  r.slot = slot;
  // Average over the trainers behind the live workers (a host aggregator counts its locals).
  r.scale = options_.average ? 1.0f / static_cast<float>(workers_->LiveWeight()) : 1.0f;
  if (gate_->value_staleness()) {
    r.lr_scale = chunks_->ValueStalenessScale(slot, h.base_version, options_.vsgd_lambda);
    // lr_scale = 1 / (1 + lambda * drift) (server/optimizer.h): the drift it measured.
    if (options_.vsgd_lambda > 0 && r.lr_scale > 0) {
      stats_.histograms().vsgd_drift.Observe((1.0 / r.lr_scale - 1.0) / options_.vsgd_lambda);
    }
  }
  r.rule = h.rule;
  r.skip = (h.flags & (layout::kPushNonFinite | layout::kPushNoGradient)) != 0 &&
           h.rule.kind() != layout::RuleKind::kStore;
  const uint64_t data = layout_->push_data_offset(worker, slot, parity);
  const float* grad;
  if (rows) {
    // Coalesced into the record's staging as a sparse payload (which the backup applies).
    SparseAccumulator& acc = *row_acc(layout_->rows(slot).dim);
    acc.Clear();
    const Status st =
        chunks_->row_shard(slot)->Accumulate(base + data, h.bytes / layout_->rows(slot).entry_bytes(), acc);
    if (!st.ok()) return reject("row ids");  // checked above: not reached
    r.bytes = SparsePayloadBytes(acc.size(), layout_->rows(slot).dim);
    r.payload = stream_->sum_payload(slot, r.bytes);
    acc.Emit(reinterpret_cast<char*>(stream_->sum(slot)));
    grad = stream_->sum(slot);
  } else if (chunks_->dtype(slot) == layout::DType::kF32) {
    r.bytes = chunks_->bytes(slot);
    r.payload = {inbox_.get(), data, r.bytes};
    grad = reinterpret_cast<const float*>(base + data);
  } else {
    // A 16-bit gradient: decoded once into the record's staging, which the backup applies.
    r.bytes = chunks_->value_bytes(slot);
    r.payload = stream_->sum_payload(slot, r.bytes);
    chunks_->DecodeGradient(slot, base + data, stream_->sum(slot), false);
    grad = stream_->sum(slot);
  }
  if (r.skip) stats_.Bump(&ShardServerCounters::skipped_updates);
  workers_->Consume(worker, slot, h.seq, clock);
  ObservePushApplied(slot, h);
  r.min_clock_plus1 = gate_->SspMinClockPlus1(slot, *workers_);
  r.contributors = {push};
  ComputeAndCommit(grad, std::move(r));
  stats_.histograms().apply_seconds.Observe(
      std::chrono::duration<double>(Clock::now() - t0).count());
  return true;
}

void ShardServer::ObservePushApplied(uint32_t slot, const layout::PushHeader& h) {
  stats_.Update([&](ShardServerCounters& c) {
    ++c.pushes_applied;
    c.bytes_applied += h.bytes;
    c.max_applied_clock = std::max<uint64_t>(c.max_applied_clock, h.clock);
  });
  const uint64_t oldest_open = chunks_->published_min_clock_plus1(slot);
  stats_.histograms().push_clock_lag.Observe(
      h.clock > oldest_open ? static_cast<double>(h.clock - oldest_open) : 0.0);
}

bool ShardServer::HandleStateOp(uint32_t worker, uint32_t slot, uint32_t parity,
                                const layout::PushHeader& h) {
  if (gate_->in_flight(slot)) {
    // After the version in flight (DrainWork retries it, in arrival order).
    deferred_ops_.push_back(DeferredOp{worker, slot, parity});
    return false;
  }
  const auto op = static_cast<layout::PushOp>(h.op);
  if (chunks_->is_rows(slot)) return HandleRowStateOp(worker, slot, parity, h);
  if (op == layout::PushOp::kGetState) {
    // The published version's values and optimizer state, for the worker to read one-sided.
    // One outbox per server: the nonce tells a reader whether another request overwrote it.
    char* out = static_cast<char*>(outbox_->data());
    const ChunkOptimizer& opt = chunks_->optimizer(slot);
    const uint64_t stride = layout::AlignUp(chunks_->value_bytes(slot));
    auto* oh = reinterpret_cast<layout::OutboxHeader*>(out);
    oh->magic = 0;  // a reader racing this copy sees no valid header
    std::memcpy(out + layout::kAlign, chunks_->published(slot), chunks_->value_bytes(slot));
    if (!opt.state1().empty()) {
      std::memcpy(out + layout::kAlign + stride, opt.state1().data(), chunks_->value_bytes(slot));
    }
    if (!opt.state2().empty()) {
      std::memcpy(out + layout::kAlign + 2 * stride, opt.state2().data(),
                  chunks_->value_bytes(slot));
    }
    oh->nonce = h.op_arg;
    oh->worker = worker;
    oh->chunk_id = chunks_->chunk_id(slot);
    oh->version = chunks_->version(slot);
    oh->steps = opt.steps();
    oh->state1 = opt.state1().size();
    oh->state2 = opt.state2().size();
    oh->elems = chunks_->elems(slot);
    std::atomic_thread_fence(std::memory_order_release);
    oh->magic = layout::kOutboxMagic;
    workers_->Consume(worker, slot, h.seq, -1);
    ack_board_->Raise(worker, slot, h.seq);
    stats_.Bump(&ShardServerCounters::state_reads);
    return true;
  }
  // A set: a new version, replicated like an update (the backup sets the same values).
  ReplRecord r = SetRecord(worker, slot, parity, h, chunks_->value_bytes(slot));
  float* values = stream_->sum(slot);
  if (op == layout::PushOp::kClearState) {
    std::memset(values, 0, r.bytes);
  } else if ((h.flags & layout::kPushF32Values) != 0) {
    // A range in float32 (checked by HandlePush, on this copy of the header): the other
    // elements keep the values they have, and the record carries the whole chunk's.
    const ChunkOptimizer& opt = chunks_->optimizer(slot);
    const std::vector<float>* state = op == layout::PushOp::kSetState1   ? &opt.state1()
                                      : op == layout::PushOp::kSetState2 ? &opt.state2()
                                                                         : nullptr;
    if (op == layout::PushOp::kSetWeights) {
      std::memcpy(values, chunks_->published(slot), r.bytes);
    } else if (!state->empty()) {
      std::memcpy(values, state->data(), r.bytes);
    } else {
      std::memset(values, 0, r.bytes);
    }
    const char* base = static_cast<const char*>(inbox_->data());
    std::memcpy(values + h.first, base + layout_->push_data_offset(worker, slot, parity), h.bytes);
  } else {
    const char* base = static_cast<const char*>(inbox_->data());
    chunks_->DecodeGradient(slot, base + layout_->push_data_offset(worker, slot, parity), values,
                            false);
  }
  LOG(INFO) << "server rank " << rank_ << ": worker " << worker << " set "
            << (op == layout::PushOp::kSetWeights   ? "the weights"
                : op == layout::PushOp::kClearState ? "no optimizer state"
                                                    : "optimizer state")
            << " of chunk " << chunks_->chunk_id(slot) << " (steps " << r.steps << ")";
  Commit(chunks_->Set(slot, op, values, r.steps), std::move(r));
  return true;
}

ReplRecord ShardServer::SetRecord(uint32_t worker, uint32_t slot, uint32_t parity,
                                  const layout::PushHeader& h, uint64_t bytes) {
  const WorkerState* w = workers_->Find(worker);
  ReplRecord r;
  r.slot = slot;
  r.kind = layout::ReplKind::kSet;
  r.op = static_cast<layout::PushOp>(h.op);
  r.steps = h.op_arg;
  r.rule = h.rule;  // a row set: Adagrad's initial sum for state it allocates (RowShard::Set)
  r.bytes = bytes;
  r.payload = stream_->sum_payload(slot, r.bytes);
  r.min_clock_plus1 = chunks_->published_min_clock_plus1(slot);
  workers_->Consume(worker, slot, h.seq, -1);
  r.contributors = {Contributor{worker, parity, h.seq, w->incarnation, -1}};
  stats_.Bump(&ShardServerCounters::state_sets);
  return r;
}

bool ShardServer::HandleRowStateOp(uint32_t worker, uint32_t slot, uint32_t parity,
                                   const layout::PushHeader& h) {
  // The op and the payload were checked by HandlePush (its kind, size and ids).
  const auto op = static_cast<layout::PushOp>(h.op);
  const RowShard& shard = *chunks_->row_shard(slot);
  const uint32_t dim = layout_->rows(slot).dim;
  const char* data =
      static_cast<const char*>(inbox_->data()) + layout_->push_data_offset(worker, slot, parity);
  if (op == layout::PushOp::kGetState || op == layout::PushOp::kListRows) {
    // Rows of the published version (rows are updated in place: everything applied so far)
    // into the outbox, which the worker reads one-sided; the nonce tells it whether another
    // request overwrote the outbox meanwhile.
    char* out = static_cast<char*>(outbox_->data());
    auto* oh = reinterpret_cast<layout::OutboxHeader*>(out);
    oh->magic = 0;
    std::atomic_thread_fence(std::memory_order_release);
    uint64_t n;
    std::pair<bool, bool> has{false, false};
    // What is used is copied out of the inbox and checked in the copy: a peer may rewrite
    // its inbox at any time, so what HandlePush checked there proves nothing now.
    if (op == layout::PushOp::kGetState) {
      n = h.bytes / sizeof(uint64_t);
      row_ids_.resize(n);
      std::memcpy(row_ids_.data(), data, n * sizeof(uint64_t));
      if (!shard.CheckEntries(reinterpret_cast<const char*>(row_ids_.data()), n).ok()) {
        stats_.Bump(&ShardServerCounters::rejected_pushes);
        return true;
      }
      has = shard.Read(row_ids_.data(), n, out);
    } else {
      uint64_t range[2];
      std::memcpy(range, data, sizeof(range));
      const uint64_t slots = shard.geometry().rows;
      if (range[1] > layout_->rows(slot).max_ids || range[0] > slots ||
          range[1] > slots - range[0]) {
        stats_.Bump(&ShardServerCounters::rejected_pushes);
        return true;
      }
      n = range[1];
      shard.List(range[0], n, out);
    }
    oh->nonce = h.op_arg;
    oh->worker = worker;
    oh->chunk_id = chunks_->chunk_id(slot);
    oh->version = chunks_->version(slot);
    oh->steps = shard.steps();
    oh->state1 = has.first ? n * dim : 0;
    oh->state2 = has.second ? n * dim : 0;
    oh->elems = op == layout::PushOp::kGetState ? n * dim : n;
    std::atomic_thread_fence(std::memory_order_release);
    oh->magic = layout::kOutboxMagic;
    workers_->Consume(worker, slot, h.seq, -1);
    ack_board_->Raise(worker, slot, h.seq);
    stats_.Bump(&ShardServerCounters::state_reads);
    return true;
  }
  // A set of rows: coalesced into a sparse payload (the record's, which the backup applies
  // alike: float32, whatever the rows were on the wire), a new version.
  SparseAccumulator& acc = *row_acc(dim);
  acc.Clear();
  const bool f32_rows = (h.flags & layout::kPushF32Rows) != 0;
  const uint64_t n_set = h.bytes / layout_->rows(slot).set_entry_bytes(f32_rows);
  if (!shard.Accumulate(data, n_set, acc, f32_rows).ok()) {
    stats_.Bump(&ShardServerCounters::rejected_pushes);  // checked by HandlePush: not reached
    return true;
  }
  ReplRecord r = SetRecord(worker, slot, parity, h, SparsePayloadBytes(acc.size(), dim));
  acc.Emit(reinterpret_cast<char*>(stream_->sum(slot)));
  VLOG(1) << "server rank " << rank_ << ": worker " << worker << " set " << acc.size()
          << (op == layout::PushOp::kSetWeights ? " rows" : " rows' optimizer state")
          << " of chunk " << chunks_->chunk_id(slot);
  // Written in place at FinishCommit, once its record is replicated (as a row update is).
  PendingVersion set;
  set.rows = PendingVersion::Rows::kSet;
  set.payload = stream_->sum(slot);
  set.op = op;
  set.steps = r.steps;
  set.rule = h.rule;
  Commit(0, std::move(r), set);
  return true;
}

SparseAccumulator* ShardServer::row_acc(uint32_t dim) {
  if (!row_acc_ || row_acc_dim_ != dim) {
    row_acc_ = std::make_unique<SparseAccumulator>(dim);
    row_acc_dim_ = dim;
  }
  return row_acc_.get();
}

void ShardServer::HandleClock(uint32_t worker, uint32_t clock_low) {
  // The clock comes from the immediate, not from the slot: by the time this immediate is
  // polled the slot may already hold a later clock whose pushes are still queued behind it.
  if (workers_->AdvanceClock(worker, clock_low)) Reevaluate();
}

void ShardServer::Reevaluate() {
  if (backup_) return;  // a backup follows its primary's records only
  for (uint32_t s = 0; s < chunks_->slots(); ++s) {
    // The gate answers for its mode: a BSP clock may be complete now (never in the other
    // modes), or the published version's min clock may rise (never in BSP).
    MaybeApplyBsp(s);
    // A BSP push that waited for the other workers' clocks (ConsistencyGate::OnPush) may go
    // in now: DrainWork retries the slot's queue.
    if (gate_->ShouldRetryDeferred(s)) work_.push_back(s);
    MaybeRaiseMinClock(s);
  }
}

void ShardServer::MaybeRaiseMinClock(uint32_t slot) {
  const std::optional<uint64_t> mc = gate_->RaisedMinClockPlus1(
      slot, chunks_->published_min_clock_plus1(slot), chunks_->initialised(slot), *workers_);
  if (mc) {
    chunks_->RaisePublishedMinClock(slot, *mc);
    gate_->NoteAppliedThrough(slot, static_cast<int64_t>(*mc) - 1);  // BSP: those clocks are done
  }
}

void ShardServer::MaybeApplyBsp(uint32_t slot) {
  // A clock is complete when every LIVE worker pushed: live as this server knows the
  // membership. A push from a worker that is in a newer epoch says a worker may have joined
  // that this server has not heard of yet (membership reaches servers and workers at
  // different times); completing the clock now would leave that worker's push out and drop it
  // as stale. So wait until this server has the membership of the newest epoch a push came
  // from (RefreshMembership re-evaluates then).
  if (newest_push_epoch_ > seen_epoch_) return;
  std::optional<BspAggregate> a = gate_->TakeBspClock(slot, *workers_);
  if (!a) return;
  const auto t0 = Clock::now();
  trace::Span span("apply", "server");  // one BSP clock of a chunk: its pushes summed, applied
  if (span.active()) {
    std::string who;
    for (const Contributor& k : a->contributors) who += (who.empty() ? "" : ",") + std::to_string(k.worker);
    span.Arg("chunk", chunks_->chunk_id(slot)).Arg("clock", a->clock).Arg("workers", who);
  }
  // Sum in worker-rank order, straight from the inbox slots (a worker reuses an inbox slot
  // only after its push is acknowledged, which happens at publication), so the sum does not
  // depend on arrival order: runs are reproducible bit for bit, failovers included.
  // 16-bit gradients are decoded into the float32 sum. A clock any worker marked non-finite
  // is skipped (every worker pushes every chunk: every server skips it), and so is a chunk whose
  // pushes all carry no gradient (kPushNoGradient: frozen or unused everywhere).
  const char* base = static_cast<const char*>(inbox_->data());
  float* sum = stream_->sum(slot);
  bool first = true;
  bool non_finite = false;
  bool no_gradient = !a->contributors.empty();  // every push marked kPushNoGradient
  uint64_t weight = 0;
  const bool rows = chunks_->is_rows(slot);
  SparseAccumulator* acc = rows ? row_acc(layout_->rows(slot).dim) : nullptr;
  if (acc != nullptr) acc->Clear();
  for (const Contributor& k : a->contributors) {
    if (rows) {
      layout::PushHeader ph;  // its size only: checked again here (the rest is in k)
      std::memcpy(&ph, base + layout_->push_header_offset(k.worker, slot, k.parity), sizeof(ph));
      // Each row's sum over the clock's pushes, in worker-rank order. The header is read again
      // here, from the peer-writable inbox: its size is checked again (within the slot's
      // max_ids) and each id as it is read (Accumulate).
      const layout::RowGeometry& g = layout_->rows(slot);
      const uint64_t n = ph.bytes / g.entry_bytes();
      const Status st =
          ph.bytes % g.entry_bytes() != 0 || n > g.max_ids
              ? InvalidArgumentError("worker " + std::to_string(k.worker) +
                                     "'s row push changed size after it was taken")
              : chunks_->row_shard(slot)->Accumulate(
                    base + layout_->push_data_offset(k.worker, slot, k.parity), n, *acc);
      if (!st.ok()) LOG(ERROR) << "server rank " << rank_ << ": " << st.message();
    } else {
      chunks_->DecodeGradient(slot, base + layout_->push_data_offset(k.worker, slot, k.parity),
                              sum, !first);
    }
    first = false;
    non_finite |= (k.flags & layout::kPushNonFinite) != 0;
    no_gradient &= (k.flags & layout::kPushNoGradient) != 0;
    weight += std::max<uint32_t>(1, k.weight);  // a host aggregator's push sums its locals
  }
  const uint64_t n = std::max<uint64_t>(1, weight);
  ReplRecord r;
  r.slot = slot;
  r.scale = options_.average ? 1.0f / static_cast<float>(n) : 1.0f;
  r.bytes = chunks_->value_bytes(slot);
  if (rows) {
    r.bytes = SparsePayloadBytes(acc->size(), layout_->rows(slot).dim);
    acc->Emit(reinterpret_cast<char*>(sum));
  }
  r.payload = stream_->sum_payload(slot, r.bytes);
  r.min_clock_plus1 = static_cast<uint64_t>(a->clock) + 1;
  if (!a->contributors.empty()) {
    // The clock's update rule and rate: its lowest rank's push carried them (every worker of
    // one LR schedule carries the same), as checked when the push was taken.
    r.rule = a->contributors.front().rule;
  }
  r.skip = (non_finite || no_gradient) && r.rule.kind() != layout::RuleKind::kStore;
  if (r.skip) stats_.Bump(&ShardServerCounters::skipped_updates);
  r.contributors = std::move(a->contributors);
  r.lr_scale = 1.0f;
  ComputeAndCommit(sum, std::move(r));
  stats_.histograms().apply_seconds.Observe(
      std::chrono::duration<double>(Clock::now() - t0).count());
}

void ShardServer::ComputeAndCommit(const float* grad, ReplRecord r) {
  const uint32_t slot = r.slot;
  if (!chunks_->is_rows(slot)) {
    Commit(chunks_->Compute(slot, grad, r.scale, r.lr_scale, r.rule, r.skip), std::move(r));
    return;
  }
  PendingVersion v;
  v.rows = PendingVersion::Rows::kCompute;
  v.payload = grad;
  v.scale = r.scale;
  v.lr_scale = r.lr_scale;
  v.rule = r.rule;
  v.skip = r.skip;
  Commit(0, std::move(r), v);
}

void ShardServer::Commit(uint32_t buffer, ReplRecord r) {
  Commit(buffer, std::move(r), PendingVersion());
}

void ShardServer::Commit(uint32_t buffer, ReplRecord r, PendingVersion rows) {
  const uint32_t slot = r.slot;
  const bool set = r.kind == layout::ReplKind::kSet;
  // "@N": the Nth state set, applied here and consumed, its record not posted: the backup never
  // sees it, so the worker must send it again to the promoted backup.
  if (set) CrashPoint("server.before_state_set_record");
  // "@N": the Nth Commit of this process (any slot: an update, a set or an init), its record
  // not posted yet (a dense chunk's version computed into its unpublished buffer; a row shard's
  // not written). A primary stopped here and killed never replicates it: what a reader could
  // see of it then is what a failover takes back (RowVisibilityTest).
  StallPoint("server.before_record");
  r.version = chunks_->version(slot) + 1;
  rows.buffer = buffer;
  rows.min_clock_plus1 = r.min_clock_plus1;
  pending_[slot] = rows;
  gate_->BeginVersion(slot, r.contributors);
  const ReplicationStream::Disposition d = stream_->Submit(std::move(r));
  // "@N": the Nth state set (a loaded table or tensor), applied and its record posted, neither
  // published nor acknowledged (the worker sends it again to whoever serves next).
  if (set) CrashPoint("server.after_state_set");
  if (d == ReplicationStream::Disposition::kPublishNow) FinishCommit(slot);
}

void ShardServer::FinishCommit(uint32_t slot) {
  if (!gate_->in_flight(slot)) return;
  const bool initialised = chunks_->initialised(slot);
  const std::vector<Contributor> contributors = gate_->EndVersion(slot);
  PendingVersion& v = pending_[slot];
  // Stamped before the version becomes visible: a worker's read may see it (and its pull end)
  // before this thread, descheduled on a busy host, records the event (trace.cluster caught a
  // pull ending 135 us before a publish stamped after it). A row shard's rows are visible from
  // the moment they are written, just below.
  const int64_t publish_ns = trace::NowNs();
  // The record is replicated (or there is no backup): a row shard's version may be written now.
  if (v.rows == PendingVersion::Rows::kCompute) {
    v.buffer = chunks_->Compute(slot, v.payload, v.scale, v.lr_scale, v.rule, v.skip);
  } else if (v.rows == PendingVersion::Rows::kSet) {
    v.buffer = chunks_->Set(slot, v.op, v.payload, v.steps, v.rule);
  }
  v.rows = PendingVersion::Rows::kNone;
  chunks_->Publish(slot, v.buffer,
                   gate_->PublishMinClockPlus1(slot, v.min_clock_plus1, initialised, *workers_));
  stats_.Bump(&ShardServerCounters::versions_published);
  trace::InstantAt("publish", "server", publish_ns,
                   {{"chunk", chunks_->chunk_id(slot)}, {"version", chunks_->version(slot)},
                    {"min_clock_plus1", chunks_->published_min_clock_plus1(slot)}});
  CrashPoint("server.after_publish");  // "@N": the Nth version published (mid-training)
  // The pushes folded into this version are acknowledged only now: their inbox slots (and, for
  // a failover, the workers' own buffers) may be reused once the version is replicated.
  for (const Contributor& a : contributors) {
    const WorkerState* w = workers_->Find(a.worker);
    if (w == nullptr || w->incarnation != a.incarnation) continue;
    ack_board_->Raise(a.worker, slot, a.seq);
  }
  MaybeCapture(slot);
  work_.push_back(slot);
}

void ShardServer::DrainWork() {
  while (!work_.empty()) {
    const uint32_t slot = work_.front();
    work_.pop_front();
    // State transfers that waited for this slot's version, in arrival order.
    for (size_t i = 0; i < deferred_ops_.size() && !gate_->in_flight(slot);) {
      const DeferredOp d = deferred_ops_[i];
      if (d.slot != slot) {
        ++i;
        continue;
      }
      deferred_ops_.erase(deferred_ops_.begin() + static_cast<std::ptrdiff_t>(i));
      HandlePush(d.worker, d.slot, d.parity, true);
    }
    while (std::optional<DeferredPush> d = gate_->NextDeferred(slot)) {
      // Queued by a process that has since been replaced (it died and its rank came back):
      // its inbox slot may hold the new process's push now, which would be credited twice,
      // and the new process's sequence numbers start again. A dead process's push counts at
      // most once: this one never.
      const WorkerState* w = workers_->Find(d->worker);
      if (w != nullptr && d->incarnation != 0 && w->incarnation != 0 &&
          w->incarnation != d->incarnation) {
        stats_.Bump(&ShardServerCounters::stale_pushes);
        LOG(WARNING) << "server rank " << rank_ << ": a queued push of clock " << d->clock
                     << " from worker " << d->worker << "'s previous process (incarnation "
                     << d->incarnation << ", now " << w->incarnation << ") for chunk "
                     << chunks_->chunk_id(slot) << " dropped";
        continue;
      }
      if (!HandlePush(d->worker, slot, d->parity, true)) break;  // it waits again, at the front
    }
    MaybeApplyBsp(slot);  // BSP: the slot's next clock may be complete
    // BSP: the published min clock may rise past clocks no live worker will push now too:
    // Reevaluate could not raise it while a clock was pending or a push queued here, and the
    // clock immediates that would call it again may all have come already (every worker then
    // waits in its pull for this very raise). (SSP/ASP recompute it at every publication; not
    // here, once per push.)
    if (gate_->bsp() && !backup_ && !gate_->in_flight(slot)) MaybeRaiseMinClock(slot);
  }
}

void ShardServer::MaybeCapture(uint32_t slot) {
  if (!ckpt_writer_ || backup_) return;
  if (!capture_->Wants(slot, chunks_->published_min_clock_plus1(slot), control_->epoch())) return;
  // A write that failed leaves increments without a base: every slot's next capture is whole.
  const uint64_t failed = ckpt_writer_->stats().failed;
  if (failed != ckpt_failures_seen_) {
    ckpt_failures_seen_ = failed;
    capture_->ForceFull();
  }
  // A row shard is captured as an increment (the rows written since its last capture) when
  // the capture component allows; a dense chunk always whole.
  trace::Span span("ckpt_capture", "server");
  span.Arg("chunk", chunks_->chunk_id(slot)).Arg("version", chunks_->version(slot));
  const uint32_t buffers = chunks_->state_buffers(slot);
  std::optional<CheckpointCapture::Base> base;
  if (chunks_->is_rows(slot)) base = capture_->IncrementalBase(slot, buffers);
  ChunkState state = base ? chunks_->CaptureIncrement(slot, base->version, base->clock)
                          : chunks_->Capture(slot);
  capture_->NoteCapture(slot, chunks_->version(slot), !base.has_value(), buffers);
  std::optional<ShardSnapshot> snap = capture_->Captured(slot, std::move(state), *workers_);
  if (!snap) return;
  VLOG(1) << "server rank " << rank_ << ": checkpoint of group " << group_ << " at clock "
          << snap->clock << " captured";
  ckpt_writer_->Submit(std::move(*snap));
  CrashPoint("server.after_checkpoint_submit");
  stats_.Bump(&ShardServerCounters::checkpoints_submitted);
}

}  // namespace shardps::server
