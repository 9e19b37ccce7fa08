// How tensors are cut into chunks and chunks assigned to servers. A pure, deterministic
// function of (tensor specs, number of servers, partition size), so every worker computes the
// same plan and the coordinator can check that they agree.
//
// Thread safety: free functions, no state.
#ifndef SHARDPS_PROTO_SHARD_PLAN_H_
#define SHARDPS_PROTO_SHARD_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace shardps {

// The element type of a tensor (TensorSpecProto.dtype; the same numbers as layout::DType).
// 16-bit tensors travel as they are; the servers keep float32 master weights.
enum class DType : uint32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
inline bool ValidDType(uint32_t d) { return d <= 2; }
size_t DTypeSize(DType t);

struct TensorSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // A row table (an embedding, shape {rows, dim}): cut into row shards, not byte chunks, and
  // pushed and pulled by row id (wire/region_layout.h, RowGeometry). max_ids: the ids one
  // worker's push may carry to one shard.
  bool embedding = false;
  uint32_t max_ids = 0;
  uint32_t init = 0;  // common/row_init.h RowInitKind
  float init_scale = 1.0f;
  uint64_t init_seed = 0;
  bool hashed = false;              // any 64-bit key; shape[0] is the capacity
  float admit_probability = 1.0f;   // hashed: a new key's chance of a row at its first touch
  uint64_t bytes() const;
  uint64_t elements() const;
};

struct ChunkPlan {
  uint32_t chunk_id = 0;     // global, dense: 0..num_chunks-1
  uint32_t tensor = 0;       // index into the spec list
  uint64_t offset = 0;       // byte offset inside the tensor (element aligned); row shard: k
  uint64_t bytes = 0;        // row shard: its rows' value bytes
  uint32_t server = 0;       // server rank
  uint32_t server_slot = 0;  // index of this chunk among its server's chunks
};

struct ShardPlan {
  std::vector<TensorSpec> tensors;
  std::vector<ChunkPlan> chunks;
  std::vector<uint64_t> server_bytes;  // bytes owned per server
  uint64_t partition_bytes = 0;
  std::vector<double> capacity;       // the weights planned for (empty: equal)
  // max(server_bytes) / mean(server_bytes); 1.0 is perfect balance.
  double imbalance() const;
  // max over servers of (server_bytes / capacity share) / (total bytes): 1.0 when every
  // server's bytes are exactly proportional to its capacity (equals imbalance() unweighted).
  double weighted_imbalance() const;
  std::string Fingerprint() const;  // equal for equal plans
};

// Bounds on what a plan may hold: a model comes from a peer (RegisterModel), so its size must
// not be able to exhaust the coordinator's memory, and the shard map built from the plan must
// fit in one control frame (about 30 bytes per chunk entry, 16 MiB per frame).
inline constexpr uint64_t kMaxPlanChunks = uint64_t{1} << 18;
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 50;  // 1 PiB

// Cuts each tensor into ceil(bytes / partition_bytes) near-equal, element-aligned chunks (for a
// tensor above one partition, rounded up to a multiple of num_servers) and assigns chunks to
// servers largest first, each to the least-loaded server (ties: lowest rank).
//
// capacity (optional; empty = all equal, which is exactly the byte-balanced plan above): one
// positive weight per server, e.g. measured bandwidth. Each server's bytes are then made
// proportional to its weight: a tensor above one partition is cut into a multiple of
// K = clamp(round(sum(capacity) / min(capacity)), num_servers, 64) chunks (so the small share is
// representable), and each chunk, largest first, goes to the server whose load after taking it,
// divided by its weight, is least (earliest finish on uniform machines; ties: lowest rank).
//
// A row table (TensorSpec::embedding) is cut into K row shards (K = num_servers, or the weighted
// multiple above; at most its row count): row r in shard r % K (hashing ids by their residue
// spreads a Zipf head over every shard); its shards are assigned like chunks, by bytes.
//
// INVALID_ARGUMENT for a tensor over kMaxTensorBytes (or whose element count overflows) and
// RESOURCE_EXHAUSTED for a plan over kMaxPlanChunks chunks.
//
// layout kBalanced (Herring's balanced fusion buffers; docs/hierarchical.md): the dense tensors,
// in registration order, are taken as one buffer that is cut into one contiguous part per server
// (bytes proportional to capacity, equal without), each cut on the element boundary at or below
// the exact share; a part's piece of each tensor is then cut into near-equal chunks of at most
// partition_bytes. Every server's dense bytes are thus its exact share to less than one element
// at each end (equal servers of a one-dtype model differ by at most one element; with mixed
// dtypes by less than two of the largest), whatever the tensor sizes; small
// tensors share a server with their neighbours instead of each being placed whole. Row tables
// are placed as in kLpt, on top.
enum class ShardLayout { kLpt = 0, kBalanced = 1 };
StatusOr<ShardPlan> PlanShards(const std::vector<TensorSpec>& tensors, uint32_t num_servers,
                               uint64_t partition_bytes,
                               const std::vector<double>& capacity = {},
                               ShardLayout layout = ShardLayout::kLpt);
// "lpt" or "balanced"; INVALID_ARGUMENT otherwise.
StatusOr<ShardLayout> ParseShardLayout(const std::string& s);

// Limits on row tables: dims and ids per push (a peer's RegisterModel is checked against them).
inline constexpr uint32_t kMaxRowDim = 1u << 16;
inline constexpr uint32_t kMaxIdsPerPush = 1u << 22;

}  // namespace shardps

#endif  // SHARDPS_PROTO_SHARD_PLAN_H_
