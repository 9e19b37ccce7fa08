#include "worker/row_tables.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_set>

#include "common/crc32c.h"
#include "common/half.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;

RowTables::RowTables(const ClientOptions& options, const control::ClusterConfig& config,
                     transport::Fabric& fabric, ServerSessions& sessions,
                     std::vector<Tensor>& tensors, const std::vector<ChunkPlacement>& chunks,
                     const StepClock& step)
    : options_(options),
      config_(config),
      fabric_(fabric),
      sessions_(sessions),
      tensors_(tensors),
      chunks_(chunks),
      step_(step) {}

Status RowTables::Setup() {
  shard_of_chunk_.assign(chunks_.size(), {~0u, 0});
  for (uint32_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& ten = tensors_[i];
    if (!ten.embedding) continue;
    Table t;
    t.tensor = i;
    t.rows = static_cast<uint64_t>(ten.shape[0]);
    t.dim = static_cast<uint32_t>(ten.shape[1]);
    t.elem = ten.dtype == TensorDType::kFloat32 ? 4 : 2;
    t.max_ids = ten.embedding_options.max_ids;
    t.shards = static_cast<uint32_t>(ten.chunks.size());
    if (t.shards == 0) return FailedPreconditionError("table '" + ten.name + "' has no shards");
    t.shard_chunk.assign(t.shards, ~0u);
    for (uint32_t id : ten.chunks) {
      const ChunkPlacement& c = chunks_[id];
      if (c.offset >= t.shards || t.shard_chunk[c.offset] != ~0u || !c.rows.rows_kind()) {
        return FailedPreconditionError("shard map: table '" + ten.name + "' has a bad shard");
      }
      t.shard_chunk[c.offset] = id;
      t.stride = c.rows.row_stride();
      shard_of_chunk_[id] = {static_cast<uint32_t>(tables_.size()), static_cast<uint32_t>(c.offset)};
    }
    t.pending.resize(t.shards);
    t.push_slot_bytes = layout::AlignUp(uint64_t{t.max_ids} * (sizeof(uint64_t) + uint64_t{t.dim} * t.elem));
    ASSIGN_OR_RETURN(t.push_staging, fabric_.AllocateMemory(2 * t.shards * t.push_slot_bytes,
                                                            transport::Access::kLocalOnly));
    ASSIGN_OR_RETURN(t.header_staging, fabric_.AllocateMemory(t.shards * layout::kAlign,
                                                              transport::Access::kLocalOnly));
    table_of_tensor_[i] = static_cast<uint32_t>(tables_.size());
    tables_.push_back(std::move(t));
  }
  return Status::OK();
}

Status RowTables::AddGradients(uint32_t tensor, const int64_t* ids, size_t n, const void* grads) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  const std::string& name = tensors_[tensor].name;
  if (n != 0 && (ids == nullptr || grads == nullptr)) return InvalidArgumentError("null ids or grads");
  // Checked first: an error adds nothing.
  std::vector<uint64_t> fresh(t.shards, 0);
  std::unordered_set<int64_t> seen;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || static_cast<uint64_t>(id) >= t.rows) {
      return InvalidArgumentError("table '" + name + "': row id " + std::to_string(id) +
                                  " is outside [0, " + std::to_string(t.rows) + ")");
    }
    const uint32_t k = static_cast<uint32_t>(static_cast<uint64_t>(id) % t.shards);
    if (t.pending[k].index.count(id) == 0 && seen.insert(id).second) ++fresh[k];
  }
  for (uint32_t k = 0; k < t.shards; ++k) {
    if (t.pending[k].ids.size() + fresh[k] > t.max_ids) {
      return ResourceExhaustedError(
          "table '" + name + "': this step's gradient would touch " +
          std::to_string(t.pending[k].ids.size() + fresh[k]) + " distinct rows of shard " +
          std::to_string(k) + ", more than its max_ids " + std::to_string(t.max_ids) +
          " (register the table with a larger max_ids, or push more often)");
    }
  }
  std::vector<float> tmp(t.dim);
  const auto* src = static_cast<const char*>(grads);
  const uint64_t row_bytes = uint64_t{t.dim} * t.elem;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    Table::Pending& p = t.pending[static_cast<uint64_t>(id) % t.shards];
    auto [it, added] = p.index.try_emplace(id, static_cast<uint32_t>(p.ids.size()));
    if (added) {
      p.ids.push_back(id);
      p.values.resize(p.values.size() + t.dim, 0.0f);
    }
    float* dst = p.values.data() + uint64_t{it->second} * t.dim;
    const char* row = src + i * row_bytes;
    if (t.elem == 4) {
      std::memcpy(tmp.data(), row, row_bytes);
    } else {
      DecodeHalf(static_cast<uint32_t>(tensors_[tensor].dtype),
                 reinterpret_cast<const uint16_t*>(row), tmp.data(), t.dim);
    }
    for (uint32_t j = 0; j < t.dim; ++j) dst[j] += tmp[j];
  }
  return Status::OK();
}

uint64_t RowTables::Stage(uint32_t chunk, uint32_t parity) {
  const auto [ti, k] = shard_of_chunk_[chunk];
  Table& t = tables_[ti];
  Table::Pending& p = t.pending[k];
  char* dst = static_cast<char*>(t.push_staging->data()) + (2 * uint64_t{k} + parity) * t.push_slot_bytes;
  const uint64_t n = p.ids.size();
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t id = static_cast<uint64_t>(p.ids[i]);
    std::memcpy(dst + i * sizeof(uint64_t), &id, sizeof(id));
  }
  char* rows = dst + n * sizeof(uint64_t);
  if (t.elem == 4) {
    std::memcpy(rows, p.values.data(), p.values.size() * sizeof(float));
  } else {
    EncodeHalf(static_cast<uint32_t>(tensors_[t.tensor].dtype), p.values.data(),
               reinterpret_cast<uint16_t*>(rows), p.values.size());
  }
  rows_pushed_ += n;
  p.index.clear();
  p.ids.clear();
  p.values.clear();
  return n * (sizeof(uint64_t) + uint64_t{t.dim} * t.elem);
}

transport::LocalSlice RowTables::Staged(uint32_t chunk, uint32_t parity, uint64_t bytes) const {
  const auto [ti, k] = shard_of_chunk_[chunk];
  const Table& t = tables_[ti];
  return {t.push_staging.get(), (2 * uint64_t{k} + parity) * t.push_slot_bytes, bytes};
}

Status RowTables::PostShard(Table& t, const ShardRead& r, uint64_t handle, int* signaled) {
  const uint32_t chunk = t.shard_chunk[r.shard];
  const ChunkPlacement& p = chunks_[chunk];
  ServerSession& s = sessions_.at(p.server);
  if (!s.ep) return sessions_.ServerError(p.server, "not connected");
  const uint64_t ctx = MakeContext(kOpRows, chunk, handle);
  // The header first: reads on one endpoint execute in order, so the rows read after it hold
  // at least the version it names.
  RETURN_IF_ERROR(sessions_.PostWithCredit([&] {
    return s.ep->PostRead({t.header_staging.get(), uint64_t{r.shard} * layout::kAlign, layout::kAlign},
                          transport::AtOffset(s.weights, s.layout->header_offset(p.slot)), ctx,
                          transport::kUnsignaled);
  }));
  const uint64_t max_run = std::max<uint64_t>(1, s.ep->max_operation_bytes() / t.stride);
  int since_signal = 0;
  for (size_t i = 0; i < r.locals.size();) {
    size_t j = i;
    while (j + 1 < r.locals.size() && r.locals[j + 1] == r.locals[j] + 1 &&
           r.slots[j + 1] == r.slots[j] + 1 && j + 1 - i + 1 <= max_run) {
      ++j;
    }
    const bool last = j + 1 == r.locals.size();
    const bool signal = last || ++since_signal == 16;
    if (signal) since_signal = 0;
    RETURN_IF_ERROR(sessions_.PostWithCredit([&] {
      return s.ep->PostRead(
          {t.pull_staging.get(), uint64_t{r.slots[i]} * t.stride, (j - i + 1) * t.stride},
          transport::AtOffset(s.weights, s.layout->row_offset(p.slot, r.locals[i])), ctx,
          signal ? transport::kSignaled : transport::kUnsignaled);
    }));
    ++row_reads_;
    if (signal) ++*signaled;
    i = j + 1;
  }
  return Status::OK();
}

Status RowTables::Pull(uint32_t tensor, const int64_t* ids, size_t n, void* out,
                       uint64_t required_plus1, const std::function<Status()>& recover) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  const std::string& name = tensors_[tensor].name;
  if (n == 0) return Status::OK();
  if (ids == nullptr || out == nullptr) return InvalidArgumentError("null ids or output");
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || static_cast<uint64_t>(ids[i]) >= t.rows) {
      return InvalidArgumentError("table '" + name + "': row id " + std::to_string(ids[i]) +
                                  " is outside [0, " + std::to_string(t.rows) + ")");
    }
  }
  // The distinct rows, by (shard, local row): each shard's rows ascending, so neighbours in the
  // server's memory are neighbours in the staging and go in one read.
  const uint64_t shards = t.shards;
  auto before = [shards](int64_t a, int64_t b) {
    const uint64_t ka = static_cast<uint64_t>(a) % shards, kb = static_cast<uint64_t>(b) % shards;
    return ka != kb ? ka < kb : a < b;
  };
  std::vector<int64_t> u(ids, ids + n);
  std::sort(u.begin(), u.end(), before);
  u.erase(std::unique(u.begin(), u.end()), u.end());
  const uint64_t need = u.size() * t.stride;
  if (!t.pull_staging || t.pull_staging->length() < need) {
    uint64_t cap = 1 << 16;
    while (cap < need) cap *= 2;
    t.pull_staging.reset();
    ASSIGN_OR_RETURN(t.pull_staging, fabric_.AllocateMemory(cap, transport::Access::kLocalOnly));
  }
  std::vector<ShardRead> reads;
  for (uint32_t i = 0; i < u.size(); ++i) {
    const uint32_t k = static_cast<uint32_t>(static_cast<uint64_t>(u[i]) % shards);
    if (reads.empty() || reads.back().shard != k) reads.push_back(ShardRead{k, {}, {}});
    reads.back().locals.push_back(static_cast<uint64_t>(u[i]) / shards);
    reads.back().slots.push_back(i);
  }
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  const char* staging = static_cast<const char*>(t.pull_staging->data());
  const uint64_t row_bytes = uint64_t{t.dim} * t.elem;
  while (!reads.empty()) {
    pull_handle_ = (pull_handle_ + 1) & 0xffffffffull;
    if (pull_handle_ == 0) pull_handle_ = 1;
    completed_ = 0;
    failed_ = false;
    int expected = 0;
    Status posted;
    for (const ShardRead& r : reads) {
      posted = PostShard(t, r, pull_handle_, &expected);
      if (!posted.ok()) break;
    }
    while (posted.ok() && completed_ < expected && !failed_) {
      RETURN_IF_ERROR(sessions_.Progress());
      if (SteadyClock::now() > deadline) {
        return DeadlineExceededError("table '" + name + "': row reads did not complete within " +
                                     std::to_string(options_.wait_timeout.count()) + " ms");
      }
    }
    if (!posted.ok() || failed_ || sessions_.AnyFailed()) {
      // A server failed: reconnect or fail over (or the reason why not), then read again.
      RETURN_IF_ERROR(recover());
      continue;
    }
    std::vector<ShardRead> again;
    for (const ShardRead& r : reads) {
      const auto* h = reinterpret_cast<const layout::ChunkHeader*>(
          static_cast<const char*>(t.header_staging->data()) + uint64_t{r.shard} * layout::kAlign);
      const uint64_t v = h->state.load(std::memory_order_relaxed) >> 1;
      if (v < 1 || h->min_clock_plus1[0].load(std::memory_order_relaxed) < required_plus1) {
        row_retries_ += r.locals.size();
        again.push_back(r);  // the shard is behind the bound: all of it again
        continue;
      }
      ShardRead torn{r.shard, {}, {}};
      for (size_t i = 0; i < r.locals.size(); ++i) {
        const char* rec = staging + uint64_t{r.slots[i]} * t.stride;
        layout::RowHeader rh;
        std::memcpy(&rh, rec, sizeof(rh));
        const uint32_t crc = crc32c::Extend(crc32c::Value(&rh.version, sizeof(rh.version)),
                                            rec + sizeof(rh), row_bytes);
        if (crc != rh.crc) {
          torn.locals.push_back(r.locals[i]);
          torn.slots.push_back(r.slots[i]);
        }
      }
      if (!torn.locals.empty()) {
        row_retries_ += torn.locals.size();
        again.push_back(std::move(torn));
      }
    }
    reads = std::move(again);
    if (reads.empty()) break;
    if (SteadyClock::now() > deadline) {
      return DeadlineExceededError(
          "table '" + name + "': shard " + std::to_string(reads.front().shard) +
          " did not reach the consistency bound (clock " + std::to_string(step_.clock) +
          ") within " + std::to_string(options_.wait_timeout.count()) + " ms");
    }
    std::this_thread::yield();
  }
  auto* dst = static_cast<char*>(out);
  for (size_t i = 0; i < n; ++i) {
    const size_t j = static_cast<size_t>(std::lower_bound(u.begin(), u.end(), ids[i], before) - u.begin());
    std::memcpy(dst + i * row_bytes, staging + j * t.stride + sizeof(layout::RowHeader), row_bytes);
  }
  rows_pulled_ += u.size();
  return Status::OK();
}

void RowTables::OnCompletion(uint32_t /*chunk*/, uint64_t handle, const Status& err) {
  if (handle != pull_handle_) return;  // a leftover of an earlier pull
  if (!err.ok()) {
    failed_ = true;
    return;
  }
  ++completed_;
}

}  // namespace shardps::worker
