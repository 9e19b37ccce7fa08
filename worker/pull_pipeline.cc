#include "worker/pull_pipeline.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "common/trace.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;

std::string ConsistencyName(const control::ClusterConfig& config) {
  std::string m = control::ConsistencyMode_Name(config.mode());
  for (char& ch : m) ch = static_cast<char>(tolower(ch));
  if (config.mode() == control::SSP || config.mode() == control::VSGD) {
    m += "(s=" + std::to_string(config.staleness()) + ")";
  }
  return m;
}

PullPipeline::PullPipeline(const ClientOptions& options, const control::ClusterConfig& config,
                           ServerSessions& sessions, std::vector<Tensor>& tensors,
                           const std::vector<ChunkPlacement>& chunks, HandleTable& handles,
                           const StepClock& step)
    : options_(options),
      config_(config),
      sessions_(sessions),
      tensors_(tensors),
      chunks_(chunks),
      handles_(handles),
      step_(step),
      pull_(chunks.size()) {}

namespace {

bool HasSpare(const ChunkPlacement& c, const Tensor& t) {
  return c.bytes <= kBothBuffersBytes && !c.rows.rows_kind() && !t.embedding &&
         t.path != TensorPath::kCudaDirect;  // a copy into device memory is not a memcpy
}

}  // namespace

uint64_t PullPipeline::SpareStagingBytes() const {
  uint64_t bytes = 0;
  for (const ChunkPlacement& c : chunks_) {
    if (HasSpare(c, tensors_[c.tensor])) bytes += layout::AlignUp(c.bytes);
  }
  return bytes;
}

void PullPipeline::PlaceSpareStaging(uint64_t base) {
  for (const ChunkPlacement& c : chunks_) {
    if (!HasSpare(c, tensors_[c.tensor])) continue;
    pull_[c.id].spare = base;
    base += layout::AlignUp(c.bytes);
  }
}

StatusOr<Handle> PullPipeline::Pull(uint32_t tensor) {
  const uint64_t h = handles_.Create();
  HandleState& hs = handles_[h];
  if (tensors_[tensor].staging != nullptr) hs.staged_pull_tensor = tensor;
  for (uint32_t id : tensors_[tensor].chunks) {
    ChunkPull& c = pull_[id];
    if (c.handle != 0) {
      hs.error = FailedPreconditionError("a pull of tensor '" + tensors_[tensor].name +
                                         "' is already in flight");
      break;
    }
    c.handle = h;
    c.trace_start_ns = trace::NowNs();
    c.required_plus1 = RequiredPlus1();
    c.started = SteadyClock::now();
    c.deadline = c.started + options_.wait_timeout;
    // Each version goes to the other buffer; guess that as many versions (mod 2) were
    // published since the last pull as between the last two (one per step in training, none
    // when the chunk is pulled again unchanged). A wrong guess costs a second round trip.
    c.guess = c.pulled_version == 0 ? 0 : c.last_buf ^ c.flip;
    ++hs.pending;
    c.first_read = true;
    StartPull(id, c.speculate ? Phase::kAll : Phase::kHeaderOnly);
  }
  return Handle{h};
}

void PullPipeline::StartPull(uint32_t id, Phase phase) {
  ChunkPull& c = pull_[id];
  const ChunkPlacement& p = chunks_[id];
  ServerSession& s = sessions_.at(p.server);
  const Tensor& t = tensors_[p.tensor];
  c.phase = phase;
  if (!s.ep) {  // a group with no endpoint until the next shard map: as a failed post
    Finish(id, sessions_.ServerError(p.server, "not connected"));
    return;
  }
  const uint64_t hdr = s.layout->header_offset(p.slot);
  const uint64_t ctx = MakeContext(kOpPull, id, c.handle);
  auto read_header = [&](int which, uint32_t flags) {
    return sessions_.PostWithCredit([&] {
      return s.ep->PostRead(
          {sessions_.staging(), sessions_.ChunkStagingOffset(id, which), layout::kAlign},
          transport::AtOffset(s.weights, hdr), ctx, flags);
    });
  };
  const uint32_t last = more_ ? transport::kMore : transport::kSignaled;
  c.both = phase == Phase::kAll && c.spare != 0 && c.misses != 0 &&
           !s.ep->reads_are_local_copies();
  Status st;
  if (phase == Phase::kHeaderOnly) {
    st = read_header(2, last);
  } else {
    // kAll: header, data of the guessed buffer, header; kDataCheck: data then header.
    if (phase == Phase::kAll) st = read_header(2, transport::kUnsignaled);
    if (st.ok()) {
      st = sessions_.PostWithCredit([&] {
        return s.ep->PostRead(
            {t.wmr.get(), p.offset, p.bytes},
            transport::AtOffset(s.weights, s.layout->buffer_offset(p.slot, c.guess)), ctx,
            transport::kUnsignaled);
      });
    }
    if (st.ok() && c.both) {  // the other buffer, into this chunk's staging
      st = sessions_.PostWithCredit([&] {
        return s.ep->PostRead(
            {sessions_.staging(), c.spare, p.bytes},
            transport::AtOffset(s.weights, s.layout->buffer_offset(p.slot, c.guess ^ 1)), ctx,
            transport::kUnsignaled);
      });
    }
    if (st.ok()) st = read_header(3, last);
  }
  if (!st.ok()) Finish(id, st);
}

void PullPipeline::EvaluatePull(uint32_t id) {
  ChunkPull& c = pull_[id];
  const ChunkPlacement& p = chunks_[id];
  const auto* h1 = reinterpret_cast<const layout::ChunkHeader*>(sessions_.ChunkStaging(id, 2));
  const auto* h2 = reinterpret_cast<const layout::ChunkHeader*>(sessions_.ChunkStaging(id, 3));
  const uint64_t state = h1->state.load(std::memory_order_relaxed);
  const uint64_t v = state >> 1;
  const uint32_t b = static_cast<uint32_t>(state & 1);
  const bool ready =
      v >= 1 && h1->min_clock_plus1[b].load(std::memory_order_relaxed) >= c.required_plus1;
  if (c.first_read) {
    // A data read alongside this header would have been used: speculate next time.
    c.speculate = ready && (b == c.guess || c.both);
    if (ready) c.misses = static_cast<uint8_t>(c.misses << 1 | (b != c.guess ? 1 : 0));
    c.first_read = false;
  }
  if (!ready) {
    if (!hold_deadlines_ && SteadyClock::now() > c.deadline) {
      Finish(id, DeadlineExceededError(
                     "chunk " + std::to_string(id) + " on server " + std::to_string(p.server) +
                     " did not reach the consistency bound (" + ConsistencyName(config_) +
                     ", clock " + std::to_string(step_.clock) + ") within " +
                     std::to_string(options_.wait_timeout.count()) + " ms (its header: version " +
                     std::to_string(v) + ", clocks below " +
                     std::to_string(h1->min_clock_plus1[b].load(std::memory_order_relaxed)) +
                     " applied; this pull needs those below " + std::to_string(c.required_plus1) +
                     "; the server logs STALLED with what it waits for)"));
      return;
    }
    ++pull_retries_;
    if (++c.not_ready <= kImmediateRereads) {
      StartPull(id, Phase::kHeaderOnly);
      return;
    }
    Defer(id);
    return;
  }
  c.not_ready = 0;
  // The other buffer was read into staging alongside the guessed one (both buffers, above).
  const bool from_spare = c.phase == Phase::kAll && c.both && b != c.guess;
  if (!from_spare && (c.phase == Phase::kHeaderOnly || b != c.guess)) {
    // Now we know the buffer: read it, then the header again.
    if (c.phase != Phase::kHeaderOnly) ++pull_retries_;
    c.guess = b;
    StartPull(id, Phase::kDataCheck);
    return;
  }
  if (h2->gen[b].load(std::memory_order_relaxed) != h1->gen[b].load(std::memory_order_relaxed)) {
    ++pull_retries_;  // torn: the server began rewriting buffer b during our read
    StartPull(id, Phase::kHeaderOnly);
    return;
  }
  if (from_spare) {
    std::memcpy(static_cast<char*>(tensors_[p.tensor].wmr->data()) + p.offset,
                sessions_.StagingAt(c.spare), p.bytes);
    ++pull_other_buffer_;
  }
  if (c.pulled_version != 0) c.flip = static_cast<uint32_t>((v - c.pulled_version) & 1);
  c.pulled_version = v;
  c.pulled_min_clock_plus1 = h1->min_clock_plus1[b].load(std::memory_order_relaxed);
  c.last_buf = b;
  ++pulls_;
  bytes_pulled_ += p.bytes;
  Status st;
  if (CudaStaging* staging = tensors_[p.tensor].staging.get()) {
    // This chunk goes to the device while the other chunks are still being read.
    st = staging->WeightsToDevice(p.offset, p.bytes);
  }
  Finish(id, st);
}

void PullPipeline::Defer(uint32_t id) {
  ChunkPull& c = pull_[id];
  const auto now = SteadyClock::now();
  // The scout of this pull on this server, if another chunk is it.
  int64_t scout = -1;
  for (uint32_t j : sessions_.at(chunks_[id].server).chunk_of_slot) {
    if (j != id && j < pull_.size() && pull_[j].scout && pull_[j].handle == c.handle) scout = j;
  }
  if (scout > static_cast<int64_t>(id)) {
    c.parked = true;
    c.retry_at = now + kParkedBackoff;
  } else {
    if (scout >= 0) {  // a later chunk of the server takes over; the old scout parks
      ChunkPull& old = pull_[scout];
      old.scout = false;
      old.parked = true;
      if (old.deferred) old.retry_at = std::max(old.retry_at, now + kParkedBackoff);
    }
    c.scout = true;
    c.parked = false;
    const int doublings = std::min(c.not_ready - kImmediateRereads - 1, 16);
    auto delay = std::min<std::chrono::microseconds>(kMaxBackoff, kFirstBackoff * (1 << doublings));
    const auto waited = std::chrono::duration_cast<std::chrono::microseconds>(now - c.started);
    delay = std::max(delay, std::min<std::chrono::microseconds>(kLongWaitBackoff,
                                                                 waited / kWaitedFraction));
    c.retry_at = now + delay;
  }
  if (!c.deferred) deferred_.push_back(id);
  c.deferred = true;
}

void PullPipeline::ReleaseScout(uint32_t id) {
  ChunkPull& c = pull_[id];
  if (!c.scout) return;
  c.scout = false;
  const auto now = SteadyClock::now();
  for (uint32_t j : sessions_.at(chunks_[id].server).chunk_of_slot) {
    if (j >= pull_.size()) continue;
    ChunkPull& o = pull_[j];
    if (o.parked && o.handle == c.handle) {
      o.parked = false;
      if (o.deferred) {
        o.retry_at = now;
        o.woken = true;
      }
    }
  }
}

void PullPipeline::Tick() {
  if (deferred_.empty()) return;
  const auto now = SteadyClock::now();
  // StartPull may wait for a send credit, and the completions it reaps meanwhile re-enter
  // EvaluatePull, which may Defer chunks again: they go into deferred_ while this walks its
  // own copy (appending to the vector being walked lost them, and they were never re-read).
  std::vector<uint32_t> due;
  due.swap(deferred_);
  size_t kept = 0;
  for (uint32_t id : due) {
    ChunkPull& c = pull_[id];
    if (!c.deferred || c.handle == 0) {  // finished, restarted or failed meanwhile
      c.deferred = false;
      continue;
    }
    if (now < c.retry_at) {
      due[kept++] = id;
      continue;
    }
    c.deferred = false;
    StartPull(id, c.woken ? Phase::kAll : Phase::kHeaderOnly);
    c.woken = false;
  }
  due.resize(kept);
  // Those still waiting, then those deferred during this walk (a chunk is in one list only: a
  // chunk kept above is still deferred, so Defer did not add it again).
  due.insert(due.end(), deferred_.begin(), deferred_.end());
  deferred_.swap(due);
}

std::chrono::microseconds PullPipeline::UntilTick(std::chrono::microseconds cap) const {
  if (deferred_.empty()) return cap;
  const auto now = SteadyClock::now();
  auto until = cap;
  for (uint32_t id : deferred_) {
    const ChunkPull& c = pull_[id];
    if (!c.deferred || c.handle == 0) continue;
    if (c.retry_at <= now) return std::chrono::microseconds(0);
    until = std::min(until, std::chrono::duration_cast<std::chrono::microseconds>(c.retry_at - now));
  }
  return until;
}

void PullPipeline::Finish(uint32_t id, const Status& s) {
  trace::Complete("pull", "worker", pull_[id].trace_start_ns,  // posted -> consistent (or failed)
                  {{"chunk", id}, {"clock", step_.clock}, {"bytes", chunks_[id].bytes},
                   {"server", chunks_[id].server}, {"version", pull_[id].pulled_version},
                   {"ok", s.ok() ? 1 : 0}});
  ReleaseScout(id);  // before the handle is cleared: it names the parked chunks
  const uint64_t h = pull_[id].handle;
  pull_[id].handle = 0;
  pull_[id].deferred = false;
  pull_[id].parked = false;
  pull_[id].woken = false;
  pull_[id].not_ready = 0;
  handles_.FinishChunk(h, s);
}

void PullPipeline::OnCompletion(uint32_t chunk, uint64_t handle, const Status& err) {
  if (chunk >= pull_.size()) return;
  if (pull_[chunk].handle != handle) return;  // a flushed leftover of a finished pull
  // A failed read is restarted on the reconnected or promoted server (Restart), or reported
  // by the recovery if neither happens in time.
  if (!err.ok()) return;
  EvaluatePull(chunk);
}

void PullPipeline::Restart(uint32_t server) {
  for (uint32_t id : sessions_.at(server).chunk_of_slot) {
    if (pull_[id].handle != 0) {
      pull_[id].deferred = false;
      pull_[id].parked = false;
      pull_[id].scout = false;
      StartPull(id, Phase::kAll);
    }
  }
}

void PullPipeline::HoldDeadlines(bool hold) {
  hold_deadlines_ = hold;
  if (hold) return;
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  for (ChunkPull& c : pull_) {
    if (c.handle != 0) c.deadline = std::max(c.deadline, deadline);
  }
}

uint64_t PullPipeline::ClusterClock() const {
  uint64_t clock = 0;
  for (const ChunkPull& c : pull_) clock = std::max(clock, c.pulled_min_clock_plus1);
  return clock;
}

uint64_t PullPipeline::OldestPulledPlus1() const {
  uint64_t oldest = 0;
  for (const ChunkPull& c : pull_) {
    if (c.pulled_version == 0) continue;
    if (oldest == 0 || c.pulled_min_clock_plus1 < oldest) oldest = c.pulled_min_clock_plus1;
  }
  return oldest;
}

uint64_t PullPipeline::RequiredPlus1() const {
  switch (config_.mode()) {
    case control::BSP:
      return step_.clock;  // min_clock >= clock-1
    case control::SSP:
    case control::VSGD:
      return step_.clock > config_.staleness() ? step_.clock - config_.staleness() : 0;
    default:
      return 0;
  }
}

}  // namespace shardps::worker
