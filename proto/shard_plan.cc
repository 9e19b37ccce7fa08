#include "proto/shard_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

namespace shardps {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
  }
  return 0;
}

uint64_t TensorSpec::elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

uint64_t TensorSpec::bytes() const { return elements() * DTypeSize(dtype); }

double ShardPlan::imbalance() const {
  if (server_bytes.empty()) return 1.0;
  const double total = std::accumulate(server_bytes.begin(), server_bytes.end(), 0.0);
  if (total == 0) return 1.0;
  const double mean = total / server_bytes.size();
  return *std::max_element(server_bytes.begin(), server_bytes.end()) / mean;
}

double ShardPlan::weighted_imbalance() const {
  if (capacity.empty()) return imbalance();
  const double total = std::accumulate(server_bytes.begin(), server_bytes.end(), 0.0);
  const double wsum = std::accumulate(capacity.begin(), capacity.end(), 0.0);
  if (total == 0 || wsum <= 0) return 1.0;
  double worst = 0;
  for (size_t s = 0; s < server_bytes.size() && s < capacity.size(); ++s) {
    worst = std::max(worst, server_bytes[s] / (total * capacity[s] / wsum));
  }
  return worst;
}

std::string ShardPlan::Fingerprint() const {
  std::ostringstream os;
  os << partition_bytes << "|";
  // Weighted plans only: an unweighted plan's fingerprint is unchanged.
  for (double w : capacity) os << "w" << w;
  if (!capacity.empty()) os << "|";
  for (const auto& t : tensors) {
    os << t.name << ":" << static_cast<int>(t.dtype);
    for (auto d : t.shape) os << "x" << d;
    if (t.embedding) {
      os << "E" << t.max_ids << "i" << t.init << "/" << t.init_scale << "/" << t.init_seed;
      if (t.hashed) os << "H" << t.admit_probability;
    }
    os << ";";
  }
  os << "|";
  for (const auto& c : chunks) os << c.tensor << "@" << c.offset << "+" << c.bytes << ">" << c.server << ",";
  return os.str();
}

StatusOr<ShardLayout> ParseShardLayout(const std::string& s) {
  if (s.empty() || s == "lpt") return ShardLayout::kLpt;
  if (s == "balanced") return ShardLayout::kBalanced;
  return InvalidArgumentError("shard layout '" + s + "': want lpt or balanced");
}

namespace {

// kBalanced: the dense tensors as one buffer, cut into one part per server.
Status PlanBalancedDense(const std::vector<TensorSpec>& tensors, uint32_t num_servers,
                         uint64_t partition_bytes, const std::vector<double>& capacity,
                         ShardPlan* plan, std::vector<bool>* fixed) {
  std::vector<uint32_t> dense;
  std::vector<uint64_t> start;  // each dense tensor's offset in the buffer
  uint64_t total = 0;
  for (uint32_t ti = 0; ti < tensors.size(); ++ti) {
    if (tensors[ti].embedding) continue;
    dense.push_back(ti);
    start.push_back(total);
    total += tensors[ti].bytes();
  }
  if (dense.empty()) return Status::OK();
  // The exact cut points (server s owns [cut[s], cut[s+1])), each moved down to the element
  // boundary of the tensor it falls in.
  const double sum = capacity.empty()
                         ? static_cast<double>(num_servers)
                         : std::accumulate(capacity.begin(), capacity.end(), 0.0);
  std::vector<uint64_t> cut(num_servers + 1, 0);
  double acc = 0;
  for (uint32_t r = 1; r < num_servers; ++r) {
    acc += capacity.empty() ? 1.0 : capacity[r - 1];
    const uint64_t exact = std::min<uint64_t>(
        total, static_cast<uint64_t>(static_cast<long double>(total) * acc / sum));
    // The tensor holding byte `exact`: the last one starting at or before it.
    const size_t k = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), exact) -
                                         start.begin()) - 1;
    const uint64_t esize = DTypeSize(tensors[dense[k]].dtype);
    cut[r] = std::max(cut[r - 1], start[k] + (exact - start[k]) / esize * esize);
  }
  cut[num_servers] = total;
  for (size_t k = 0; k < dense.size(); ++k) {
    const uint32_t ti = dense[k];
    const uint64_t esize = DTypeSize(tensors[ti].dtype);
    const uint64_t lo = start[k], hi = start[k] + tensors[ti].bytes();
    for (uint32_t r = 0; r < num_servers; ++r) {
      const uint64_t a = std::max(lo, cut[r]), b = std::min(hi, cut[r + 1]);
      if (a >= b) continue;
      // This server's piece of the tensor, in near-equal chunks of at most one partition.
      const uint64_t elems = (b - a) / esize;
      const uint64_t per = std::max<uint64_t>(1, partition_bytes / esize);
      const uint64_t n = (elems + per - 1) / per;
      if (n > kMaxPlanChunks - plan->chunks.size()) {
        return ResourceExhaustedError("shard plan: more than " + std::to_string(kMaxPlanChunks) +
                                      " chunks (partition size " +
                                      std::to_string(partition_bytes) + " B is too small)");
      }
      const uint64_t base = elems / n, extra = elems % n;
      uint64_t off = a - lo;
      for (uint64_t j = 0; j < n; ++j) {
        ChunkPlan c;
        c.tensor = ti;
        c.offset = off;
        c.bytes = (base + (j < extra ? 1 : 0)) * esize;
        c.server = r;
        off += c.bytes;
        plan->chunks.push_back(c);
        fixed->push_back(true);
        plan->server_bytes[r] += c.bytes;
      }
    }
  }
  return Status::OK();
}

}  // namespace

StatusOr<ShardPlan> PlanShards(const std::vector<TensorSpec>& tensors, uint32_t num_servers,
                               uint64_t partition_bytes, const std::vector<double>& capacity,
                               ShardLayout layout) {
  if (num_servers == 0) return InvalidArgumentError("shard plan: no servers");
  if (partition_bytes < 64) return InvalidArgumentError("shard plan: partition size below 64 B");
  bool weighted = false;
  uint64_t multiple = num_servers;  // a big tensor's chunk count is a multiple of this
  if (!capacity.empty()) {
    if (capacity.size() != num_servers) {
      return InvalidArgumentError("shard plan: " + std::to_string(capacity.size()) +
                                  " capacities for " + std::to_string(num_servers) + " servers");
    }
    for (double w : capacity) {
      if (!std::isfinite(w) || w <= 0) {
        return InvalidArgumentError("shard plan: a server capacity is not a positive number");
      }
    }
    const double lo = *std::min_element(capacity.begin(), capacity.end());
    const double hi = *std::max_element(capacity.begin(), capacity.end());
    weighted = hi > lo;  // all equal: the byte-balanced plan, bit for bit
    if (weighted) {
      const double sum = std::accumulate(capacity.begin(), capacity.end(), 0.0);
      multiple = std::clamp<uint64_t>(static_cast<uint64_t>(std::llround(sum / lo)), num_servers,
                                      64);
    }
  }
  ShardPlan plan;
  if (weighted) plan.capacity = capacity;
  plan.tensors = tensors;
  plan.partition_bytes = partition_bytes;
  plan.server_bytes.assign(num_servers, 0);
  for (uint32_t ti = 0; ti < tensors.size(); ++ti) {
    const TensorSpec& t = tensors[ti];
    if (t.name.empty()) return InvalidArgumentError("shard plan: tensor without a name");
    // Checked product: a peer's shape must not wrap the element count (found by
    // tests/fuzz/fuzz_coordinator: a wrapped count of 0 divided by zero below).
    uint64_t checked_elems = 1;
    for (int64_t d : t.shape) {
      if (d <= 0) return InvalidArgumentError("shard plan: tensor '" + t.name + "' has a dimension <= 0");
      if (__builtin_mul_overflow(checked_elems, static_cast<uint64_t>(d), &checked_elems) ||
          checked_elems > kMaxTensorBytes / DTypeSize(t.dtype)) {
        return InvalidArgumentError("shard plan: tensor '" + t.name + "' is larger than " +
                                    std::to_string(kMaxTensorBytes) + " bytes");
      }
    }
    for (uint32_t tj = 0; tj < ti; ++tj) {
      if (tensors[tj].name == t.name) {
        return InvalidArgumentError("shard plan: tensor '" + t.name + "' registered twice");
      }
    }
    const uint64_t esize = DTypeSize(t.dtype);
    const uint64_t elems = t.elements();
    if (t.embedding) {
      if (t.shape.size() != 2 || t.shape[1] > kMaxRowDim) {
        return InvalidArgumentError("shard plan: row table '" + t.name +
                                    "' must have shape {rows, dim} with dim <= " +
                                    std::to_string(kMaxRowDim));
      }
      if (t.hashed && !(t.admit_probability > 0.0f && t.admit_probability <= 1.0f)) {
        return InvalidArgumentError("shard plan: row table '" + t.name +
                                    "': admit_probability must be in (0, 1]");
      }
      if (t.init > 2 || !(std::isfinite(t.init_scale) && t.init_scale >= 0)) {
        return InvalidArgumentError("shard plan: row table '" + t.name + "': bad initialiser");
      }
      if (t.max_ids == 0 || t.max_ids > kMaxIdsPerPush) {
        return InvalidArgumentError("shard plan: row table '" + t.name + "': max_ids " +
                                    std::to_string(t.max_ids) + " not in [1, " +
                                    std::to_string(kMaxIdsPerPush) + "]");
      }
      const uint64_t rows = static_cast<uint64_t>(t.shape[0]);
      const uint64_t k = t.hashed ? multiple : std::min<uint64_t>(multiple, rows);
      if (k > kMaxPlanChunks - plan.chunks.size()) {
        return ResourceExhaustedError("shard plan: more than " + std::to_string(kMaxPlanChunks) +
                                      " chunks");
      }
      for (uint64_t j = 0; j < k; ++j) {
        ChunkPlan c;
        c.tensor = ti;
        c.offset = j;
        c.bytes = (t.hashed ? ((rows + k - 1) / k + 3) / 4 * 4 : (rows - j + k - 1) / k) *
                  static_cast<uint64_t>(t.shape[1]) * esize;
        if (t.hashed && c.bytes == 0) c.bytes = 4 * static_cast<uint64_t>(t.shape[1]) * esize;
        plan.chunks.push_back(c);
      }
      continue;
    }
    if (layout == ShardLayout::kBalanced) continue;  // checked here, planned below
    const uint64_t per_chunk_elems = std::max<uint64_t>(1, partition_bytes / esize);
    uint64_t n = (elems + per_chunk_elems - 1) / per_chunk_elems;
    // A tensor bigger than one partition is cut into a multiple of the server count, so every
    // server gets an equal share of it (Herring's point: balance bytes, not keys).
    if (n > 1 && n % multiple != 0) n = std::min(elems, (n / multiple + 1) * multiple);
    if (n > kMaxPlanChunks - plan.chunks.size()) {
      return ResourceExhaustedError("shard plan: more than " + std::to_string(kMaxPlanChunks) +
                                    " chunks (partition size " +
                                    std::to_string(partition_bytes) + " B is too small)");
    }
    // Near-equal split: the first (elems % n) chunks get one element more.
    const uint64_t base = elems / n, extra = elems % n;
    uint64_t off = 0;
    for (uint64_t k = 0; k < n; ++k) {
      ChunkPlan c;
      c.tensor = ti;
      c.offset = off * esize;
      c.bytes = (base + (k < extra ? 1 : 0)) * esize;
      off += base + (k < extra ? 1 : 0);
      plan.chunks.push_back(c);
    }
  }
  std::vector<bool> fixed(plan.chunks.size(), false);  // placed by the balanced layout
  if (layout == ShardLayout::kBalanced) {
    RETURN_IF_ERROR(PlanBalancedDense(tensors, num_servers, partition_bytes,
                                      weighted ? capacity : std::vector<double>{}, &plan, &fixed));
  }
  // Largest first onto the least-loaded server (LPT); stable for determinism.
  std::vector<size_t> order;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    if (!fixed[i]) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return plan.chunks[a].bytes > plan.chunks[b].bytes; });
  for (size_t idx : order) {
    uint32_t s = 0;
    if (!weighted) {
      s = static_cast<uint32_t>(
          std::min_element(plan.server_bytes.begin(), plan.server_bytes.end()) -
          plan.server_bytes.begin());
    } else {
      // Earliest finish: the least (load + this chunk) / capacity.
      double best = 0;
      for (uint32_t r = 0; r < num_servers; ++r) {
        const double t = (plan.server_bytes[r] + plan.chunks[idx].bytes) / capacity[r];
        if (r == 0 || t < best) {
          best = t;
          s = r;
        }
      }
    }
    plan.chunks[idx].server = s;
    plan.server_bytes[s] += plan.chunks[idx].bytes;
  }
  std::vector<uint32_t> slots(num_servers, 0);
  for (uint32_t i = 0; i < plan.chunks.size(); ++i) {
    plan.chunks[i].chunk_id = i;
    plan.chunks[i].server_slot = slots[plan.chunks[i].server]++;
  }
  return plan;
}

}  // namespace shardps
