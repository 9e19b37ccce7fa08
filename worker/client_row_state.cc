// ClientImpl's state transfers of row tables (Client::SetRows, GetRows, TableKeys): per shard,
// pushes of layout::PushOp on the row shard (wire/region_layout.h), each acknowledged before
// the next; a get or a list is answered in the server's outbox, which the worker reads
// one-sided. Between steps, on the trainer's thread (as the rest of ClientImpl).
#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/crash_point.h"
#include "common/row_init.h"  // SplitMix64
#include "worker/client_impl.h"

namespace shardps::worker {

bool ClientImpl::OutboxRetry(int attempt, std::chrono::steady_clock::time_point until) {
  if (attempt == 0) return true;
  if (std::chrono::steady_clock::now() >= until) return false;
  const uint64_t cap_us = uint64_t{16} << std::min(attempt, 8);  // 32 us .. 4 ms
  const uint64_t r = SplitMix64((uint64_t{rank_} << 32) ^ ++state_nonce_ ^ static_cast<uint64_t>(attempt));
  std::this_thread::sleep_for(std::chrono::microseconds(r % cap_us));
  return std::chrono::steady_clock::now() < until;
}

StatusOr<bool> ClientImpl::ReadOwnOutbox(uint32_t server, uint64_t bytes, uint64_t nonce,
                                         uint32_t chunk, layout::OutboxHeader* header) {
  const uint64_t again = layout::AlignUp(bytes);
  const auto deadline = std::chrono::steady_clock::now() + options_.wait_timeout;
  auto timeout = [] { return DeadlineExceededError("reading a server's outbox"); };
  // Two reads on one endpoint, executed in order: the answer, then its header again.
  RETURN_IF_ERROR(sessions_->ReadOutbox(server, 0, bytes, {state_staging_.get(), 0, bytes},
                                        deadline, timeout));
  RETURN_IF_ERROR(sessions_->ReadOutbox(server, 0, sizeof(layout::OutboxHeader),
                                        {state_staging_.get(), again, sizeof(layout::OutboxHeader)},
                                        deadline, timeout));
  const char* base = static_cast<const char*>(state_staging_->data());
  std::memcpy(header, base, sizeof(*header));
  return header->magic == layout::kOutboxMagic && header->nonce == nonce &&
         header->worker == rank_ && header->chunk_id == chunk &&
         std::memcmp(base, base + again, sizeof(*header)) == 0;
}

Status ClientImpl::EnsureStateStaging(uint64_t bytes) {
  if (state_staging_ != nullptr && state_staging_->length() >= bytes) return Status::OK();
  state_staging_.reset();
  ASSIGN_OR_RETURN(state_staging_, fabric_->AllocateMemory(bytes, transport::Access::kLocalOnly));
  return Status::OK();
}

StatusOr<std::vector<std::vector<size_t>>> ClientImpl::RowIdsByShard(uint32_t tensor,
                                                                     const int64_t* ids,
                                                                     size_t n) const {
  const RowTables::Shape s = rows_->shape(tensor);
  std::vector<std::vector<size_t>> by_shard(s.shards);
  for (size_t i = 0; i < n; ++i) {
    if (!s.hashed && (ids[i] < 0 || static_cast<uint64_t>(ids[i]) >= s.rows)) {
      return InvalidArgumentError("row id " + std::to_string(ids[i]) + " of table '" +
                                  tensors_[tensor].name + "' is outside [0, " +
                                  std::to_string(s.rows) + ")");
    }
    by_shard[s.geometry.ShardOf(static_cast<uint64_t>(ids[i]))].push_back(i);
  }
  return by_shard;
}

Status ClientImpl::SetRows(const std::string& table, StatePart part, const int64_t* ids,
                           size_t n, const float* values, uint64_t steps) {
  RETURN_IF_ERROR(lifecycle_.Require("SetRows()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  if (part != StatePart::kWeights && part != StatePart::kState1 && part != StatePart::kState2) {
    return InvalidArgumentError("a row table's state is set by rows: weights, state 1 or "
                                "state 2 (table '" + table + "')");
  }
  if (n > 0 && (ids == nullptr || values == nullptr)) {
    return InvalidArgumentError("SetRows: null ids or values");
  }
  ASSIGN_OR_RETURN(const auto by_shard, RowIdsByShard(t, ids, n));
  {
    std::vector<int64_t> sorted(ids, ids + n);
    std::sort(sorted.begin(), sorted.end());
    const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
    if (twice != sorted.end()) {
      return InvalidArgumentError("SetRows: id " + std::to_string(*twice) + " of table '" +
                                  table + "' given twice");
    }
  }
  RETURN_IF_ERROR(MaybeRecover());
  const RowTables::Shape s = rows_->shape(t);
  // A 16-bit table's rows go as float32 (layout::kPushF32Rows): its float32 master and state
  // rows are set exactly, as GetRows reads them (a state_dict loads back bit for bit); fewer
  // rows fit one push.
  const bool f32_rows = s.elem != 4;
  const uint64_t row_bytes = uint64_t{s.dim} * (f32_rows ? sizeof(float) : s.elem);
  const size_t per_push = static_cast<size_t>(s.geometry.max_set_entries(f32_rows));
  if (per_push == 0) {
    // A 16-bit table with max_ids 1: its inbox slot holds one 16-bit entry, less than one
    // float32 row (the loop below would never advance).
    return InvalidArgumentError("SetRows('" + table + "'): an inbox slot of max_ids " +
                                std::to_string(s.max_ids) + " holds no float32 row of dim " +
                                std::to_string(s.dim) +
                                ", which a 16-bit table's set sends; register it with max_ids >= 2");
  }
  const auto op = static_cast<layout::PushOp>(part);  // the same numbers
  rows_->Forget(t, ids, n);  // this worker's cache reads them again
  for (uint32_t k = 0; k < s.shards; ++k) {
    const std::vector<size_t>& mine = by_shard[k];
    const uint32_t chunk = (*s.shard_chunk)[k];
    // A state set reaches every shard, one without rows too (an empty push): the step count
    // is the table's, on every shard.
    const bool every = part != StatePart::kWeights && mine.empty();
    for (size_t b = 0; b < mine.size() || (every && b == 0); b += per_push) {
      const size_t m = std::min<size_t>(per_push, mine.size() - b);
      // Entries, as a gradient push's: [ids | float32 rows].
      std::vector<char> payload(m * (sizeof(uint64_t) + row_bytes));
      char* rows = payload.data() + m * sizeof(uint64_t);
      for (size_t j = 0; j < m; ++j) {
        const size_t i = mine[b + j];
        const uint64_t id = static_cast<uint64_t>(ids[i]);
        std::memcpy(payload.data() + j * sizeof(uint64_t), &id, sizeof(id));
        std::memcpy(rows + j * row_bytes, values + i * uint64_t{s.dim}, row_bytes);
      }
      rows_->SetOpPayload(chunk, std::move(payload), f32_rows);
      RETURN_IF_ERROR(push_->PushOpAndAwait(chunk, op, steps, [this] { return RecoverOrBreak(); }));
      CrashPoint("worker.mid_state_transfer");  // "@N": after the Nth acknowledged set push
    }
  }
  if (!s.hashed || n == 0) return Status::OK();
  // A hashed key's bucket holds kBucketSlots rows: a load can evict keys it (or an earlier
  // batch of it) set. Read back which of them hold a row, and say so rather than return OK.
  uint64_t missing = 0;
  int64_t example = 0;
  RETURN_IF_ERROR(ForEachRowsAnswer(table, s, by_shard, ids,
                                    [&](const size_t* at, size_t m, const layout::OutboxHeader&,
                                        const char* base) {
    const layout::RowOutbox ob{m, s.dim};
    for (size_t j = 0; j < m; ++j) {
      uint64_t version;
      std::memcpy(&version, base + ob.versions() + j * sizeof(version), sizeof(version));
      if ((version & layout::kRowVersionOccupied) == 0 && missing++ == 0) example = ids[at[j]];
    }
  }));
  if (missing != 0) {
    return ResourceExhaustedError(
        "hashed table '" + table + "': " + std::to_string(missing) + " of " +
        std::to_string(n) + " keys set hold no row (e.g. key " + std::to_string(example) +
        "): their buckets (" + std::to_string(layout::kBucketSlots) +
        " rows each) were full and evicted them; the table's capacity " +
        std::to_string(s.rows) + " over " + std::to_string(s.shards) +
        " shard(s) is too small for these keys");
  }
  return Status::OK();
}

Status ClientImpl::RowOutboxRound(uint32_t chunk, layout::PushOp op, uint64_t n, uint32_t dim,
                                  layout::OutboxHeader* header) {
  const layout::RowOutbox ob{n, dim};
  const uint64_t bytes = op == layout::PushOp::kGetState ? ob.bytes() : ob.values();
  const uint64_t elems = op == layout::PushOp::kGetState ? n * dim : n;
  RETURN_IF_ERROR(EnsureStateStaging(layout::AlignUp(bytes) + layout::kAlign));
  const ChunkPlacement& c = chunks_[chunk];
  const auto until = std::chrono::steady_clock::now() + options_.wait_timeout;
  for (int attempt = 0; OutboxRetry(attempt, until); ++attempt) {
    const uint64_t nonce = (static_cast<uint64_t>(rank_) << 48) | ++state_nonce_;
    RETURN_IF_ERROR(push_->PushOpAndAwait(chunk, op, nonce, [this] { return RecoverOrBreak(); }));
    ASSIGN_OR_RETURN(const bool mine, ReadOwnOutbox(c.server, bytes, nonce, chunk, header));
    if (mine && header->elems == elems && header->state1 <= elems && header->state2 <= elems) {
      return Status::OK();
    }
  }
  return AbortedError("rows of '" + tensors_[c.tensor].name +
                      "': the servers' outboxes stayed busy");
}

Status ClientImpl::GetRowsRound(const std::string& table, uint32_t chunk, const int64_t* ids,
                                const size_t* at, size_t m, uint32_t dim,
                                layout::OutboxHeader* header) {
  std::vector<char> request(m * sizeof(uint64_t));
  for (size_t j = 0; j < m; ++j) {
    const uint64_t id = static_cast<uint64_t>(ids[at[j]]);
    std::memcpy(request.data() + j * sizeof(uint64_t), &id, sizeof(id));
  }
  rows_->SetOpPayload(chunk, std::move(request));
  RETURN_IF_ERROR(RowOutboxRound(chunk, layout::PushOp::kGetState, m, dim, header));
  const layout::RowOutbox ob{m, dim};
  const char* base = static_cast<const char*>(state_staging_->data());
  for (size_t j = 0; j < m; ++j) {
    uint64_t key;
    std::memcpy(&key, base + ob.keys() + j * sizeof(key), sizeof(key));
    if (key != static_cast<uint64_t>(ids[at[j]])) {
      return DataLossError("rows of '" + table + "': the server answered for another id");
    }
  }
  return Status::OK();
}

Status ClientImpl::ForEachRowsAnswer(const std::string& table, const RowTables::Shape& s,
                                     const std::vector<std::vector<size_t>>& by_shard,
                                     const int64_t* ids, const RowsAnswerFn& each) {
  for (uint32_t k = 0; k < s.shards; ++k) {
    const std::vector<size_t>& mine = by_shard[k];
    for (size_t b = 0; b < mine.size(); b += s.max_ids) {
      const size_t m = std::min<size_t>(s.max_ids, mine.size() - b);
      layout::OutboxHeader oh{};
      RETURN_IF_ERROR(GetRowsRound(table, (*s.shard_chunk)[k], ids, &mine[b], m, s.dim, &oh));
      each(&mine[b], m, oh, static_cast<const char*>(state_staging_->data()));
    }
  }
  return Status::OK();
}

Status ClientImpl::GetRows(const std::string& table, const int64_t* ids, size_t n,
                           float* weights, float* state1, float* state2, RowStateInfo* info) {
  RETURN_IF_ERROR(lifecycle_.Require("GetRows()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  if (n > 0 && ids == nullptr) return InvalidArgumentError("GetRows: null ids");
  ASSIGN_OR_RETURN(const auto by_shard, RowIdsByShard(t, ids, n));
  RETURN_IF_ERROR(MaybeRecover());
  const RowTables::Shape s = rows_->shape(t);
  const uint64_t dim = s.dim;
  // A shard without a state buffer has fresh rows' state there: Adagrad's initial sum, zeros.
  // (The wire rule carries Adagrad's initial_accumulator_value in `dampening`.)
  const layout::UpdateRule& rule = tensors_[t].rule;
  const float fresh1 = rule.kind() == layout::RuleKind::kAdagrad ? rule.dampening : 0.0f;
  RowStateInfo out;
  RETURN_IF_ERROR(ForEachRowsAnswer(table, s, by_shard, ids,
                                    [&](const size_t* at, size_t m, const layout::OutboxHeader& oh,
                                        const char* base) {
    const layout::RowOutbox ob{m, s.dim};
    auto copy = [&](float* dst, uint64_t from, bool has, float fresh) {
      if (dst == nullptr) return;
      for (size_t j = 0; j < m; ++j) {
        float* row = dst + at[j] * dim;
        if (has) {
          std::memcpy(row, base + from + j * dim * sizeof(float), dim * sizeof(float));
        } else {
          std::fill_n(row, dim, fresh);
        }
      }
    };
    copy(weights, ob.values(), true, 0.0f);
    copy(state1, ob.state1(), oh.state1 != 0, fresh1);
    copy(state2, ob.state2(), oh.state2 != 0, 0.0f);
    out.steps = std::max(out.steps, oh.steps);
    out.has1 = out.has1 || oh.state1 != 0;
    out.has2 = out.has2 || oh.state2 != 0;
  }));
  if (info != nullptr) *info = out;
  return Status::OK();
}

StatusOr<std::vector<int64_t>> ClientImpl::TableKeys(const std::string& table) {
  RETURN_IF_ERROR(lifecycle_.Require("TableKeys()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  const RowTables::Shape s = rows_->shape(t);
  if (!s.hashed) {
    return InvalidArgumentError("'" + table + "' has dense ids: every id in [0, " +
                                std::to_string(s.rows) + ") holds a row");
  }
  RETURN_IF_ERROR(MaybeRecover());
  std::vector<int64_t> keys;
  for (uint32_t k = 0; k < s.shards; ++k) {
    const uint32_t chunk = (*s.shard_chunk)[k];
    const uint64_t slots = layout::RowGeometry::ShardRows(s.rows, s.shards, k, true);
    for (uint64_t first = 0; first < slots; first += s.max_ids) {
      const uint64_t m = std::min<uint64_t>(s.max_ids, slots - first);
      std::vector<char> payload(2 * sizeof(uint64_t));
      std::memcpy(payload.data(), &first, sizeof(first));
      std::memcpy(payload.data() + sizeof(first), &m, sizeof(m));
      rows_->SetOpPayload(chunk, std::move(payload));
      layout::OutboxHeader oh{};
      RETURN_IF_ERROR(RowOutboxRound(chunk, layout::PushOp::kListRows, m, s.dim, &oh));
      const layout::RowOutbox ob{m, s.dim};
      const char* base = static_cast<const char*>(state_staging_->data());
      for (uint64_t j = 0; j < m; ++j) {
        uint64_t key, version;
        std::memcpy(&key, base + ob.keys() + j * sizeof(key), sizeof(key));
        std::memcpy(&version, base + ob.versions() + j * sizeof(version), sizeof(version));
        if ((version & layout::kRowVersionOccupied) != 0) keys.push_back(static_cast<int64_t>(key));
      }
    }
  }
  // Not a snapshot while others train: a key moved within its bucket between two rounds could
  // be listed twice (docs/embeddings.md). Each key once.
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  return keys;
}

}  // namespace shardps::worker
