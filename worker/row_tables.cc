#include "worker/row_tables.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_set>

#include "common/crc32c.h"
#include "common/half.h"
#include "common/row_init.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;

RowTables::RowTables(const ClientOptions& options,
                     transport::Fabric& fabric, ServerSessions& sessions,
                     std::vector<Tensor>& tensors, const std::vector<ChunkPlacement>& chunks,
                     const StepClock& step)
    : options_(options),
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
    t.hashed = ten.embedding_options.hashed;
    t.options = ten.embedding_options;
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
      t.geometry = c.rows;
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
    if (!t.hashed && (id < 0 || static_cast<uint64_t>(id) >= t.rows)) {
      return InvalidArgumentError("table '" + name + "': row id " + std::to_string(id) +
                                  " is outside [0, " + std::to_string(t.rows) + ")");
    }
    const uint32_t k = t.geometry.ShardOf(static_cast<uint64_t>(id));
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
    Table::Pending& p = t.pending[t.geometry.ShardOf(static_cast<uint64_t>(id))];
    if (!t.cache.empty()) t.cache.erase(id);  // this worker's own update: read it again
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
  const uint64_t unit = t.unit_bytes();
  const uint64_t max_op = s.ep->max_operation_bytes();
  const uint64_t max_run = std::max<uint64_t>(1, max_op / unit);
  // Runs of adjacent units (one piece each) gathered into read lists: the units of a first
  // read sit in consecutive staging slots, so a list's pieces land back to back (tcp: one
  // request and one response per list). A retry's scattered slots read run by run.
  constexpr size_t kPiecesPerList = 256;  // within any provider's credits when it reads per piece
  std::vector<transport::ReadPiece> pieces;
  uint32_t list_first_slot = 0;
  uint64_t list_bytes = 0;
  auto flush = [&](bool last) -> Status {
    if (pieces.empty()) return Status::OK();
    // Every list signaled: a provider that reads per piece returns the credits of the list's
    // unsignaled pieces only with a signaled one (so at most kPiecesPerList are held).
    (void)last;
    const bool signal = true;
    const uint32_t flags = transport::kSignaled;
    Status st = sessions_.PostWithCredit([&] {
      if (pieces.size() == 1) {
        return s.ep->PostRead({t.pull_staging.get(), uint64_t{list_first_slot} * unit, list_bytes},
                              pieces[0].remote, ctx, flags);
      }
      return s.ep->PostReadList({t.pull_staging.get(), uint64_t{list_first_slot} * unit,
                                 list_bytes},
                                pieces.data(), pieces.size(), ctx, flags);
    });
    row_reads_ += pieces.size();
    if (signal) ++*signaled;
    pieces.clear();
    list_bytes = 0;
    return st;
  };
  for (size_t i = 0; i < r.locals.size();) {
    size_t j = i;
    while (j + 1 < r.locals.size() && r.locals[j + 1] == r.locals[j] + t.unit_rows() &&
           r.slots[j + 1] == r.slots[j] + 1 && j + 1 - i + 1 <= max_run) {
      ++j;
    }
    const uint64_t bytes = (j - i + 1) * unit;
    const bool contiguous =
        !pieces.empty() && r.slots[i] == list_first_slot + list_bytes / unit;
    if (!pieces.empty() &&
        (!contiguous || pieces.size() == kPiecesPerList || list_bytes + bytes > max_op)) {
      RETURN_IF_ERROR(flush(false));
    }
    if (pieces.empty()) list_first_slot = r.slots[i];
    pieces.push_back(transport::ReadPiece{
        transport::AtOffset(s.weights, s.layout->row_offset(p.slot, r.locals[i])), bytes});
    list_bytes += bytes;
    i = j + 1;
  }
  RETURN_IF_ERROR(flush(true));
  return Status::OK();
}

Status RowTables::Pull(uint32_t tensor, const int64_t* ids, size_t n, void* out,
                       uint64_t required_plus1, const std::function<Status()>& recover) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  const uint32_t cap = t.options.cache_rows;
  if (cap == 0 || n == 0) return Read(tensor, ids, n, out, required_plus1, recover, nullptr);
  // The cache first: a row read at a min clock that still meets the bound is served from it.
  const uint64_t row_bytes = uint64_t{t.dim} * t.elem;
  auto* dst = static_cast<char*>(out);
  std::vector<int64_t> miss;
  std::vector<size_t> miss_at;
  for (size_t i = 0; i < n; ++i) {
    auto it = t.cache.find(ids[i]);
    if (it != t.cache.end() && it->second.min_clock_plus1 >= required_plus1 &&
        it->second.min_clock_plus1 > 0) {
      std::memcpy(dst + i * row_bytes, it->second.row.data(), row_bytes);
      ++cache_hits_;
      cache_staleness_ += step_.clock + 1 - std::min(step_.clock + 1, it->second.min_clock_plus1);
      continue;
    }
    miss.push_back(ids[i]);
    miss_at.push_back(i);
  }
  if (miss.empty()) return Status::OK();
  cache_misses_ += miss.size();
  std::vector<char> got(miss.size() * row_bytes);
  std::vector<uint64_t> mc;
  RETURN_IF_ERROR(Read(tensor, miss.data(), miss.size(), got.data(), required_plus1, recover, &mc));
  for (size_t m = 0; m < miss.size(); ++m) {
    std::memcpy(dst + miss_at[m] * row_bytes, got.data() + m * row_bytes, row_bytes);
    auto [it, fresh] = t.cache.try_emplace(miss[m]);
    it->second.row.assign(got.data() + m * row_bytes, got.data() + (m + 1) * row_bytes);
    it->second.min_clock_plus1 = mc[m];
    if (fresh) t.cache_order.push_back(miss[m]);
  }
  while (t.cache.size() > cap && !t.cache_order.empty()) {
    t.cache.erase(t.cache_order.front());
    t.cache_order.pop_front();
  }
  if (t.cache_order.size() > 2 * uint64_t{cap} + 64) {  // ids dropped by own updates linger
    t.cache_order.clear();
    for (const auto& [id, c] : t.cache) t.cache_order.push_back(id);
  }
  return Status::OK();
}

Status RowTables::Read(uint32_t tensor, const int64_t* ids, size_t n, void* out,
                       uint64_t required_plus1, const std::function<Status()>& recover,
                       std::vector<uint64_t>* id_min_clock_plus1) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  const std::string& name = tensors_[tensor].name;
  if (n == 0) return Status::OK();
  if (ids == nullptr || out == nullptr) return InvalidArgumentError("null ids or output");
  for (size_t i = 0; i < n && !t.hashed; ++i) {
    if (ids[i] < 0 || static_cast<uint64_t>(ids[i]) >= t.rows) {
      return InvalidArgumentError("table '" + name + "': row id " + std::to_string(ids[i]) +
                                  " is outside [0, " + std::to_string(t.rows) + ")");
    }
  }
  // Each distinct id's read unit (dense: its row; hashed: its bucket) as (shard, first local
  // row), sorted, so units adjacent in a server's memory are adjacent in the staging and go in
  // one read; distinct units only (keys sharing a bucket read it once).
  const layout::RowGeometry& g = t.geometry;
  auto unit_of = [&](int64_t id) -> std::pair<uint32_t, uint64_t> {
    const uint64_t key = static_cast<uint64_t>(id);
    const uint32_t k = g.ShardOf(key);
    if (!t.hashed) return {k, g.LocalRow(key)};
    layout::RowGeometry gk = g;
    gk.shard = k;
    gk.rows = layout::RowGeometry::ShardRows(t.rows, t.shards, k, true);
    return {k, gk.BucketOf(key) * layout::kBucketSlots};
  };
  // (unit, position in ids) sorted; u = the distinct units, slot_of[i] = id i's index in u.
  struct Want {
    std::pair<uint32_t, uint64_t> unit;
    size_t at;
    bool operator<(const Want& o) const { return unit < o.unit; }
  };
  std::vector<Want> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = {unit_of(ids[i]), i};
  std::sort(want.begin(), want.end());
  std::vector<std::pair<uint32_t, uint64_t>> u;
  u.reserve(n);
  std::vector<uint32_t> slot_of(n);
  for (const Want& w : want) {
    if (u.empty() || u.back() != w.unit) u.push_back(w.unit);
    slot_of[w.at] = static_cast<uint32_t>(u.size() - 1);
  }
  const uint64_t unit_bytes = t.unit_bytes();
  const uint64_t need = u.size() * unit_bytes;
  if (!t.pull_staging || t.pull_staging->length() < need) {
    uint64_t cap = 1 << 16;
    while (cap < need) cap *= 2;
    t.pull_staging.reset();
    ASSIGN_OR_RETURN(t.pull_staging, fabric_.AllocateMemory(cap, transport::Access::kLocalOnly));
  }
  std::vector<ShardRead> reads;
  for (uint32_t i = 0; i < u.size(); ++i) {
    if (reads.empty() || reads.back().shard != u[i].first) {
      reads.push_back(ShardRead{u[i].first, {}, {}});
    }
    reads.back().locals.push_back(u[i].second);
    reads.back().slots.push_back(i);
  }
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  const char* staging = static_cast<const char*>(t.pull_staging->data());
  const uint64_t row_bytes = uint64_t{t.dim} * t.elem;
  // Per distinct unit: the min clock (+1) of the header read with it (the cache's freshness).
  std::vector<uint64_t> unit_mc(u.size(), 0);
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
    if (!posted.ok() && !sessions_.AnyFailed()) return posted.WithContext("table '" + name + "'");
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
      // Every record of a unit must verify (a hashed lookup needs the whole bucket); a dense
      // record must also name the row asked for.
      ShardRead torn{r.shard, {}, {}};
      const uint64_t mc = h->min_clock_plus1[0].load(std::memory_order_relaxed);
      for (size_t i = 0; i < r.locals.size(); ++i) {
        unit_mc[r.slots[i]] = mc;
        bool ok = true;
        for (uint64_t q = 0; q < t.unit_rows() && ok; ++q) {
          const char* rec = staging + uint64_t{r.slots[i]} * unit_bytes + q * t.stride;
          layout::RowHeader rh;
          std::memcpy(&rh, rec, sizeof(rh));
          ok = layout::RowRecordCrc(rh, rec + sizeof(rh), row_bytes) == rh.crc &&
               (t.hashed || rh.key == (r.locals[i] + q) * t.shards + r.shard);
        }
        if (!ok) {
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
  std::vector<float> init(t.hashed ? t.dim : 0);
  if (id_min_clock_plus1 != nullptr) id_min_clock_plus1->assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const size_t j = slot_of[i];
    if (id_min_clock_plus1 != nullptr) (*id_min_clock_plus1)[i] = unit_mc[j];
    const char* unit = staging + j * unit_bytes;
    if (!t.hashed) {
      std::memcpy(dst + i * row_bytes, unit + sizeof(layout::RowHeader), row_bytes);
      continue;
    }
    const char* found = nullptr;
    for (uint64_t q = 0; q < layout::kBucketSlots && found == nullptr; ++q) {
      layout::RowHeader rh;
      std::memcpy(&rh, unit + q * t.stride, sizeof(rh));
      if ((rh.flags & layout::kRowOccupied) != 0 && rh.key == static_cast<uint64_t>(ids[i])) {
        found = unit + q * t.stride + sizeof(rh);
      }
    }
    if (found != nullptr) {
      std::memcpy(dst + i * row_bytes, found, row_bytes);
      continue;
    }
    // No row for this key (never admitted, or evicted): its initial value, computed here as the
    // server would have.
    InitRow(static_cast<RowInitKind>(t.options.init), t.options.init_scale, t.options.init_seed,
            static_cast<uint64_t>(ids[i]), t.dim, init.data());
    if (t.elem == 4) {
      std::memcpy(dst + i * row_bytes, init.data(), row_bytes);
    } else {
      EncodeHalf(static_cast<uint32_t>(tensors_[tensor].dtype), init.data(),
                 reinterpret_cast<uint16_t*>(dst + i * row_bytes), t.dim);
    }
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
