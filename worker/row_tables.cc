#include "worker/row_tables.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

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

bool RowTables::HasPendingRows(uint32_t chunk) const {
  const auto [ti, k] = shard_of_chunk_[chunk];
  return tables_[ti].pending[k].index.size() != 0;
}

bool RowTables::ScalePending(uint32_t tensor, float factor) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  bool finite = true;
  for (Table::Pending& p : t.pending) {
    const size_t used = p.index.size() * t.dim;  // values may hold more than the rows in use
    for (size_t i = 0; i < used && i < p.values.size(); ++i) {
      if (factor != 1.0f) p.values[i] *= factor;
      finite &= std::isfinite(p.values[i]);
    }
  }
  return finite;
}

double RowTables::SquaredNormOfPending(uint32_t tensor) const {
  const Table& t = tables_[table_of_tensor_.at(tensor)];
  double sum = 0;
  for (const Table::Pending& p : t.pending) {
    const size_t used = std::min(p.index.size() * t.dim, p.values.size());
    for (size_t i = 0; i < used; ++i) sum += double{p.values[i]} * p.values[i];
  }
  return sum;
}

void RowTables::DropPending(uint32_t tensor) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  for (Table::Pending& p : t.pending) {
    p.index.Clear();
    p.values.clear();
  }
}

Status RowTables::AddGradients(uint32_t tensor, const int64_t* ids, size_t n, const void* grads) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  const std::string& name = tensors_[tensor].name;
  if (n != 0 && (ids == nullptr || grads == nullptr)) return InvalidArgumentError("null ids or grads");
  // One pass over the ids: each is checked and entered into its shard's index, its row's
  // index kept for the second pass (with kAdded when this call created the row). An error
  // takes back what the pass entered: an error adds nothing.
  constexpr uint32_t kAdded = 1u << 31;
  std::vector<size_t>& before = add_before_;
  before.resize(t.shards);
  for (uint32_t k = 0; k < t.shards; ++k) before[k] = t.pending[k].index.size();
  auto undo = [&] {
    for (uint32_t k = 0; k < t.shards; ++k) t.pending[k].index.Truncate(before[k]);
  };
  std::vector<uint32_t>& at_of = add_at_;
  at_of.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (!t.hashed && (id < 0 || static_cast<uint64_t>(id) >= t.rows)) {
      undo();
      return InvalidArgumentError("table '" + name + "': row id " + std::to_string(id) +
                                  " is outside [0, " + std::to_string(t.rows) + ")");
    }
    const auto [at, added] =
        t.pending[t.geometry.ShardOf(static_cast<uint64_t>(id))].index.Insert(
            static_cast<uint64_t>(id));
    at_of[i] = at | (added ? kAdded : 0);
  }
  for (uint32_t k = 0; k < t.shards; ++k) {
    const size_t touched = t.pending[k].index.size();
    if (touched > t.max_ids) {
      undo();
      return ResourceExhaustedError(
          "table '" + name + "': this step's gradient would touch " + std::to_string(touched) +
          " distinct rows of shard " + std::to_string(k) + ", more than its max_ids " +
          std::to_string(t.max_ids) + " (register the table with a larger max_ids, or push more often)");
    }
  }
  // Each shard's sums grow once, to its new row count.
  for (uint32_t k = 0; k < t.shards; ++k) {
    Table::Pending& p = t.pending[k];
    if (p.index.size() != before[k]) p.values.resize(p.index.size() * uint64_t{t.dim});
  }
  std::vector<float> tmp(t.dim);
  const auto* src = static_cast<const char*>(grads);
  const uint64_t row_bytes = uint64_t{t.dim} * t.elem;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    Table::Pending& p = t.pending[t.geometry.ShardOf(static_cast<uint64_t>(id))];
    if (!t.cache.empty()) t.cache.erase(id);  // this worker's own update: read it again
    const uint32_t at = at_of[i] & ~kAdded;
    const char* row = src + i * row_bytes;
    float* dst = p.values.data() + uint64_t{at} * t.dim;
    if (at_of[i] & kAdded) {
      // A new row: its gradient as it is (no zeroing, then adding).
      if (t.elem == 4) {
        std::memcpy(dst, row, row_bytes);
      } else {
        DecodeHalf(static_cast<uint32_t>(tensors_[tensor].dtype),
                   reinterpret_cast<const uint16_t*>(row), dst, t.dim);
      }
      continue;
    }
    const float* g;
    if (t.elem == 4 && reinterpret_cast<uintptr_t>(row) % alignof(float) == 0) {
      g = reinterpret_cast<const float*>(row);
    } else if (t.elem == 4) {
      std::memcpy(tmp.data(), row, row_bytes);
      g = tmp.data();
    } else {
      DecodeHalf(static_cast<uint32_t>(tensors_[tensor].dtype),
                 reinterpret_cast<const uint16_t*>(row), tmp.data(), t.dim);
      g = tmp.data();
    }
    for (uint32_t j = 0; j < t.dim; ++j) dst[j] += g[j];
  }
  return Status::OK();
}

uint64_t RowTables::Stage(uint32_t chunk, uint32_t parity) {
  const auto [ti, k] = shard_of_chunk_[chunk];
  Table& t = tables_[ti];
  Table::Pending& p = t.pending[k];
  char* dst = static_cast<char*>(t.push_staging->data()) + (2 * uint64_t{k} + parity) * t.push_slot_bytes;
  const uint64_t n = p.index.size();
  std::memcpy(dst, p.index.keys().data(), n * sizeof(uint64_t));
  char* rows = dst + n * sizeof(uint64_t);
  if (t.elem == 4) {
    std::memcpy(rows, p.values.data(), p.values.size() * sizeof(float));
  } else {
    EncodeHalf(static_cast<uint32_t>(tensors_[t.tensor].dtype), p.values.data(),
               reinterpret_cast<uint16_t*>(rows), p.values.size());
  }
  return n * (sizeof(uint64_t) + uint64_t{t.dim} * t.elem);
}

void RowTables::CommitStage(uint32_t chunk) {
  const auto [ti, k] = shard_of_chunk_[chunk];
  Table::Pending& p = tables_[ti].pending[k];
  rows_pushed_ += p.index.size();
  p.index.Clear();
  p.values.clear();
}

RowTables::Shape RowTables::shape(uint32_t tensor) const {
  const Table& t = tables_[table_of_tensor_.at(tensor)];
  return Shape{t.shards, t.dim, t.elem, t.max_ids, t.rows, t.hashed, t.geometry, &t.shard_chunk};
}

void RowTables::Forget(uint32_t tensor, const int64_t* ids, size_t n) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  if (t.cache.empty()) return;
  for (size_t i = 0; i < n; ++i) t.cache.erase(ids[i]);  // cache_order is pruned lazily
}

void RowTables::SetOpPayload(uint32_t chunk, std::vector<char> payload, bool f32_rows) {
  op_chunk_ = chunk;
  op_payload_ = std::move(payload);
  op_f32_rows_ = f32_rows;
}

uint64_t RowTables::StageOp(uint32_t chunk, uint32_t parity) {
  const auto [ti, k] = shard_of_chunk_[chunk];
  const Table& t = tables_[ti];
  // The callers (ClientImpl's state transfers) size payloads within max_ids entries.
  const uint64_t bytes = chunk == op_chunk_ ? std::min<uint64_t>(op_payload_.size(), t.push_slot_bytes) : 0;
  char* dst = static_cast<char*>(t.push_staging->data()) + (2 * uint64_t{k} + parity) * t.push_slot_bytes;
  if (bytes != 0) std::memcpy(dst, op_payload_.data(), bytes);
  return bytes;
}

transport::LocalSlice RowTables::Staged(uint32_t chunk, uint32_t parity, uint64_t bytes) const {
  const auto [ti, k] = shard_of_chunk_[chunk];
  const Table& t = tables_[ti];
  return {t.push_staging.get(), (2 * uint64_t{k} + parity) * t.push_slot_bytes, bytes};
}

Status RowTables::PostShard(Table& t, const ShardRead& r, uint32_t read, uint64_t round,
                            int* signaled) {
  const uint32_t chunk = t.shard_chunk[r.shard];
  const ChunkPlacement& p = chunks_[chunk];
  ServerSession& s = sessions_.at(p.server);
  if (!s.ep) return sessions_.ServerError(p.server, "not connected");
  // The header first: reads on one endpoint execute in order, so the rows read after it hold
  // at least the version it names, and it has landed when any of them completes.
  RETURN_IF_ERROR(sessions_.PostWithCredit([&] {
    return s.ep->PostRead({t.header_staging.get(), uint64_t{r.shard} * layout::kAlign, layout::kAlign},
                          transport::AtOffset(s.weights, s.layout->header_offset(p.slot)),
                          MakeContext(kOpRows, chunk, round << kListBits),
                          transport::kUnsignaled | transport::kMore);
  }));
  const uint64_t unit = t.unit_bytes();
  const uint64_t max_op = s.ep->max_operation_bytes();
  const uint64_t max_run = std::max<uint64_t>(1, max_op / unit);
  // Runs of adjacent units (one piece each) gathered into read lists: the units of a first
  // read sit in consecutive staging slots, so a list's pieces land back to back (tcp: one
  // request and one response per list). A retry's scattered slots read run by run. Every list
  // is signaled, so the worker verifies and copies each one while the server answers the next;
  // all but the shard's first and last go with kMore (tcp: their requests leave in one
  // sendmsg).
  // Pieces per list: a provider that reads per piece takes a credit per piece (256 is within
  // any provider's send depth); one that gathers answers a list in one response, and fewer,
  // longer lists cost less per row (tcp, 4,096 x 64-dim rows: 1,024 pieces gave 8-9 M rows/s,
  // 256 gave 7-8 M) while still overlapping the worker's checks with the server's gathers.
  // The server's side (gather, send) is the longer one, so two things keep it busy from as early
  // and the worker's after it as short as possible:
  //  - the shard's first list leaves at once (no kMore): the server gathers it while the worker
  //    builds and sends the rest;
  //  - the shard's last list is a short one (the last kTailDivisor-th of a full list), so the
  //    worker's checks after the server's last response are of a few rows, not of a full list.
  // tcp 1x1, 4,096 x 64 (timestamps on both sides): the first request reached the server 108 ->
  // 75 us after the pull began, and the worker's checks after the server's last response took
  // 29 -> 4 us.
  const size_t pieces_per_list = s.ep->gathers_read_lists() ? 1024 : 256;
  constexpr size_t kTailDivisor = 8;
  const size_t tail = pieces_per_list / kTailDivisor;
  int lists_posted = 0;
  std::vector<transport::ReadPiece>& pieces = pieces_;
  pieces.clear();
  uint32_t list_first_slot = 0;
  uint64_t list_bytes = 0;
  size_t list_begin = 0;  // index into r.locals of the list's first unit
  auto flush = [&](size_t end, bool last) -> Status {
    if (pieces.empty()) return Status::OK();
    const uint64_t index = lists_.size();
    lists_.push_back(ListRead{read, static_cast<uint32_t>(list_begin), static_cast<uint32_t>(end)});
    const uint64_t ctx = MakeContext(kOpRows, chunk, (round << kListBits) | index);
    const uint32_t flags = last || lists_posted == 0 ? transport::kSignaled : transport::kMore;
    Status st = sessions_.PostWithCredit([&] {
      if (pieces.size() == 1) {
        return s.ep->PostRead({t.pull_staging.get(), uint64_t{list_first_slot} * unit, list_bytes},
                              pieces[0].remote, ctx, flags);
      }
      return s.ep->PostReadList({t.pull_staging.get(), uint64_t{list_first_slot} * unit,
                                 list_bytes},
                                pieces.data(), pieces.size(), ctx, flags);
    });
    if (!st.ok()) {
      lists_.pop_back();
      return st;
    }
    row_reads_ += pieces.size();
    ++lists_posted;
    ++*signaled;
    pieces.clear();
    list_bytes = 0;
    list_begin = end;
    return Status::OK();
  };
  // The address of local row 0 (layout::ServerLayout::row_offset, without the call per row).
  const uint64_t remote_base = transport::AtOffset(s.weights, s.layout->row_offset(p.slot, 0)).addr;
  const uint64_t remote_stride = s.layout->row_offset(p.slot, 1) - s.layout->row_offset(p.slot, 0);
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
        (!contiguous || pieces.size() == pieces_per_list || list_bytes + bytes > max_op ||
         r.locals.size() - i == tail)) {
      RETURN_IF_ERROR(flush(i, false));
    }
    if (pieces.empty()) list_first_slot = r.slots[i];
    transport::ReadPiece& piece = pieces.emplace_back();
    piece.remote.addr = remote_base + r.locals[i] * remote_stride;
    piece.remote.rkey = s.weights.rkey;
    piece.length = bytes;
    list_bytes += bytes;
    i = j + 1;
  }
  return flush(r.locals.size(), true);
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
    // (ASP requires nothing: required_plus1 is 0, and a cached row serves until evicted, also
    // one read from a header that names no min clock.)
    if (it != t.cache.end() && it->second.min_clock_plus1 >= required_plus1) {
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

namespace {

// Sorts (key, at) pairs by key, least significant digit first (stable; 11-bit digits, only as
// many passes as the largest key needs). A pull of 4,096 ids sorts in a few microseconds, an
// order of magnitude less than std::sort of the same pairs.
template <typename Item>
void RadixSortByKey(std::vector<Item>& v, std::vector<Item>& tmp, uint64_t max_key) {
  if (v.size() < 256) {
    std::sort(v.begin(), v.end(), [](const Item& a, const Item& b) { return a.key < b.key; });
    return;
  }
  constexpr int kDigitBits = 11;
  constexpr size_t kBuckets = size_t{1} << kDigitBits;
  tmp.resize(v.size());
  uint32_t count[kBuckets];
  for (int shift = 0; shift < 64 && (max_key >> shift) != 0; shift += kDigitBits) {
    std::memset(count, 0, sizeof(count));
    for (const Item& x : v) ++count[(x.key >> shift) & (kBuckets - 1)];
    uint32_t sum = 0;
    for (size_t b = 0; b < kBuckets; ++b) {
      const uint32_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (const Item& x : v) tmp[count[(x.key >> shift) & (kBuckets - 1)]++] = x;
    v.swap(tmp);
  }
}

}  // namespace

Status RowTables::Read(uint32_t tensor, const int64_t* ids, size_t n, void* out,
                       uint64_t required_plus1, const std::function<Status()>& recover,
                       std::vector<uint64_t>* id_min_clock_plus1) {
  Table& t = tables_[table_of_tensor_.at(tensor)];
  const std::string& name = tensors_[tensor].name;
  if (n == 0) return Status::OK();
  if (ids == nullptr || out == nullptr) return InvalidArgumentError("null ids or output");
  if (n > kMaxPullIds) {
    return InvalidArgumentError("table '" + name + "': " + std::to_string(n) +
                                " ids in one PullRows, more than " + std::to_string(kMaxPullIds) +
                                " (pull them in parts)");
  }
  for (size_t i = 0; i < n && !t.hashed; ++i) {
    if (ids[i] < 0 || static_cast<uint64_t>(ids[i]) >= t.rows) {
      return InvalidArgumentError("table '" + name + "': row id " + std::to_string(ids[i]) +
                                  " is outside [0, " + std::to_string(t.rows) + ")");
    }
  }
  // Each id's read unit (dense: its row; hashed: its bucket) as one key, shard-major:
  // shard * per + first local row, where `per` bounds any shard's local rows. Sorted, units
  // adjacent in a server's memory are adjacent in the staging and go in one read; distinct
  // units only (duplicate ids, and keys sharing a bucket, read it once).
  const layout::RowGeometry& g = t.geometry;
  const uint64_t per = layout::RowGeometry::ShardRows(t.rows, t.shards, 0, t.hashed);
  layout::RowGeometry gk = g;
  gk.rows = per;  // hashed: every shard has the same buckets (ShardRows rounds up per shard)
  want_.resize(n);
  if (t.hashed) {
    for (size_t i = 0; i < n; ++i) {
      const uint64_t key = static_cast<uint64_t>(ids[i]);
      want_[i] = Want{uint64_t{g.ShardOf(key)} * per + gk.BucketOf(key) * layout::kBucketSlots,
                      static_cast<uint32_t>(i)};
    }
  } else if (t.shards == 1) {  // the key is the id (no division)
    for (size_t i = 0; i < n; ++i) want_[i] = Want{static_cast<uint64_t>(ids[i]), static_cast<uint32_t>(i)};
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint64_t id = static_cast<uint64_t>(ids[i]);
      const uint64_t local = id / t.shards;  // g.LocalRow, and g.ShardOf = the remainder
      want_[i] = Want{(id - local * t.shards) * per + local, static_cast<uint32_t>(i)};
    }
  }
  RadixSortByKey(want_, want_tmp_, uint64_t{t.shards} * per);
  // The distinct units, in staging order; unit j's ids are want_[first_[j], first_[j + 1]).
  // Branch-free: every id writes its slot, and only a new key moves on (a duplicate's write is
  // overwritten by the next distinct key's).
  first_.resize(n + 1);
  unit_keys_.resize(n + 1);
  size_t units = 0;
  {
    const Want* w = want_.data();
    uint32_t* first = first_.data();
    uint64_t* keys = unit_keys_.data();
    uint64_t prev = ~uint64_t{0};
    for (size_t k = 0; k < n; ++k) {
      const uint64_t key = w[k].key;
      first[units] = static_cast<uint32_t>(k);
      keys[units] = key;
      units += key != prev ? 1 : 0;
      prev = key;
    }
  }
  first_[units] = static_cast<uint32_t>(n);
  // One shard read per shard asked for: its units are a run of the sorted keys. The shard
  // reads reuse reads_'s vectors from the last pull (no allocation in steady state).
  std::vector<ShardRead>& reads = reads_;
  size_t used = 0;
  for (size_t u = 0; u < units;) {
    const uint64_t shard = unit_keys_[u] / per;
    const uint64_t base = shard * per, end_key = base + per;
    size_t v = u;
    while (v < units && unit_keys_[v] < end_key) ++v;
    if (used == reads.size()) reads.emplace_back();
    ShardRead& r = reads[used++];
    r.shard = static_cast<uint32_t>(shard);
    r.locals.resize(v - u);
    r.slots.resize(v - u);
    for (size_t i = 0; i < v - u; ++i) {
      r.locals[i] = unit_keys_[u + i] - base;
      r.slots[i] = static_cast<uint32_t>(u + i);
    }
    u = v;
  }
  reads.resize(used);
  const uint64_t unit_bytes = t.unit_bytes();
  const uint64_t need = units * unit_bytes;
  if (!t.pull_staging || t.pull_staging->length() < need) {
    uint64_t cap = 1 << 16;
    while (cap < need) cap *= 2;
    t.pull_staging.reset();
    ASSIGN_OR_RETURN(t.pull_staging, fabric_.AllocateMemory(cap, transport::Access::kLocalOnly));
  }
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  const char* staging = static_cast<const char*>(t.pull_staging->data());
  const uint64_t row_bytes = uint64_t{t.dim} * t.elem;
  auto* dst = static_cast<char*>(out);
  std::vector<float> init(t.hashed ? t.dim : 0);
  if (id_min_clock_plus1 != nullptr) id_min_clock_plus1->assign(n, 0);
  // One shard read's state in a round: its header not looked at yet, behind the bound (read
  // it again, whole), or good with this min clock (+1).
  constexpr uint64_t kUnchecked = ~uint64_t{0}, kBehind = ~uint64_t{0} - 1;
  std::vector<uint64_t> shard_mc;
  std::vector<ShardRead> torn;
  // A completed list: checks its shard's header (once a round), then every record of its units
  // (crc, and a dense record's key), and copies each good unit's rows to the ids that asked for
  // them; a torn unit goes to `torn`, to be read again.
  auto verify = [&](const ListRead& l) {
    const ShardRead& r = reads[l.read];
    uint64_t& mc = shard_mc[l.read];
    if (mc == kUnchecked) {
      const auto* h = reinterpret_cast<const layout::ChunkHeader*>(
          static_cast<const char*>(t.header_staging->data()) + uint64_t{r.shard} * layout::kAlign);
      const uint64_t v = h->state.load(std::memory_order_relaxed) >> 1;
      const uint64_t hmc = h->min_clock_plus1[0].load(std::memory_order_relaxed);
      mc = (v < 1 || hmc < required_plus1) ? kBehind : hmc;
    }
    if (mc == kBehind) return;
    const uint64_t per_unit = t.unit_rows();
    records_.clear();
    for (uint32_t i = l.begin; i < l.end; ++i) {
      const char* u = staging + uint64_t{r.slots[i]} * unit_bytes;
      for (uint64_t q = 0; q < per_unit; ++q) records_.push_back(u + q * t.stride);
    }
    crcs_.resize(records_.size());
    layout::RowRecordCrcs(records_.data(), records_.size(), row_bytes, crcs_.data());
    for (uint32_t i = l.begin; i < l.end; ++i) {
      const uint32_t j = r.slots[i];
      const char* u = staging + uint64_t{j} * unit_bytes;
      const size_t c0 = size_t{i - l.begin} * per_unit;
      bool ok = true;
      for (uint64_t q = 0; q < per_unit && ok; ++q) {
        layout::RowHeader rh;
        std::memcpy(&rh, u + q * t.stride, sizeof(rh));
        ok = crcs_[c0 + q] == rh.crc &&
             (t.hashed || rh.key == (r.locals[i] + q) * t.shards + r.shard);
      }
      if (!ok) {
        if (torn[l.read].locals.empty()) torn[l.read].shard = r.shard;
        torn[l.read].locals.push_back(r.locals[i]);
        torn[l.read].slots.push_back(j);
        continue;
      }
      for (uint32_t k = first_[j]; k < first_[j + 1]; ++k) {
        const uint32_t at = want_[k].at;
        if (id_min_clock_plus1 != nullptr) (*id_min_clock_plus1)[at] = mc;
        if (!t.hashed) {
          std::memcpy(dst + at * row_bytes, u + sizeof(layout::RowHeader), row_bytes);
          continue;
        }
        const char* found = nullptr;
        for (uint64_t q = 0; q < layout::kBucketSlots && found == nullptr; ++q) {
          layout::RowHeader rh;
          std::memcpy(&rh, u + q * t.stride, sizeof(rh));
          if ((rh.stamp & layout::kRowOccupied) != 0 && rh.key == static_cast<uint64_t>(ids[at])) {
            found = u + q * t.stride + sizeof(rh);
          }
        }
        if (found != nullptr) {
          std::memcpy(dst + at * row_bytes, found, row_bytes);
          continue;
        }
        // No row for this key (never admitted, or evicted): its initial value, computed here
        // as the server would have.
        InitRow(static_cast<RowInitKind>(t.options.init), t.options.init_scale,
                t.options.init_seed, static_cast<uint64_t>(ids[at]), t.dim, init.data());
        if (t.elem == 4) {
          std::memcpy(dst + at * row_bytes, init.data(), row_bytes);
        } else {
          EncodeHalf(static_cast<uint32_t>(tensors_[tensor].dtype), init.data(),
                     reinterpret_cast<uint16_t*>(dst + at * row_bytes), t.dim);
        }
      }
    }
  };
  // Why the last round read again (empty: no round did): the deadline's error says it.
  std::string retrying;
  auto timed_out = [&] {
    const std::string within = " within " + std::to_string(options_.wait_timeout.count()) + " ms";
    if (retrying.empty()) {
      return DeadlineExceededError("table '" + name + "': row reads did not complete" + within);
    }
    return DeadlineExceededError("table '" + name + "': " + retrying + within);
  };
  while (!reads.empty()) {
    round_ = (round_ + 1) & ((uint64_t{1} << (32 - kListBits)) - 1);
    if (round_ == 0) round_ = 1;
    completed_ = 0;
    failed_ = false;
    lists_.clear();
    done_.clear();
    shard_mc.assign(reads.size(), kUnchecked);
    torn.assign(reads.size(), ShardRead{});
    int expected = 0;
    Status posted;
    for (uint32_t i = 0; i < reads.size(); ++i) {
      posted = PostShard(t, reads[i], i, round_, &expected);
      if (!posted.ok()) break;
    }
    size_t verified = 0;
    IdleClock idle(options_.busy_poll);
    while (posted.ok() && !failed_) {
      if (verified < done_.size()) idle.Progressed();
      while (verified < done_.size()) verify(lists_[done_[verified++]]);
      if (completed_ >= expected) break;
      RETURN_IF_ERROR(sessions_.ProgressOrSleep(idle.Idle() ? std::chrono::microseconds(1000)
                                                            : std::chrono::microseconds(0)));
      if (SteadyClock::now() > deadline) return timed_out();
    }
    if (!posted.ok() && !sessions_.AnyFailed()) return posted.WithContext("table '" + name + "'");
    if (!posted.ok() || failed_ || sessions_.AnyFailed()) {
      // A server failed: reconnect or fail over (or the reason why not), then read again (rows
      // copied already are copied again from the new reads).
      RETURN_IF_ERROR(recover());
      continue;
    }
    std::vector<ShardRead> again;
    bool behind = false;
    for (uint32_t i = 0; i < reads.size(); ++i) {
      if (shard_mc[i] == kBehind) {
        row_retries_ += reads[i].locals.size();
        behind = true;
        again.push_back(std::move(reads[i]));  // the shard is behind the bound: all of it again
      } else if (!torn[i].locals.empty()) {
        row_retries_ += torn[i].locals.size();
        again.push_back(std::move(torn[i]));
      }
    }
    reads.swap(again);
    if (reads.empty()) break;
    retrying = behind ? "shard " + std::to_string(reads.front().shard) +
                            " did not reach the consistency bound (clock " +
                            std::to_string(step_.clock) + ")"
                      : "shard " + std::to_string(reads.front().shard) + ": " +
                            std::to_string(reads.front().locals.size()) +
                            " row(s) read torn (crc mismatch) every time";
    if (SteadyClock::now() > deadline) return timed_out();
    std::this_thread::yield();
  }
  rows_pulled_ += units;
  return Status::OK();
}

void RowTables::OnCompletion(uint32_t /*chunk*/, uint64_t handle, const Status& err) {
  if ((handle >> kListBits) != round_) return;  // a leftover of an earlier round
  if (!err.ok()) {
    failed_ = true;
    return;
  }
  const uint64_t list = handle & ((uint64_t{1} << kListBits) - 1);
  if (list < lists_.size()) done_.push_back(static_cast<uint32_t>(list));
  ++completed_;
}

}  // namespace shardps::worker
