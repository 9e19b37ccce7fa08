// RowTables: the worker side of row tables (embeddings; docs/embeddings.md). Per table: the
// gradient rows added this step (duplicates summed), registered staging for its pushes (per
// shard, per inbox parity: [ids | rows], kept until the server acknowledged the push, so a
// failover can resend it), and registered staging for its reads.
//
//   pull  = per shard: READ the slot's ChunkHeader, then read lists of the rows asked for
//           (adjacent rows coalesced), posted back to back on one endpoint (executed in order).
//           The header's min clock says the rows include every push the consistency bound
//           needs (the server publishes it after writing them); each row's crc32c says it is
//           not torn. Each list is verified and copied out as it completes, while the server
//           answers the next. A shard behind the bound, or a torn row, is read again (until
//           wait_timeout).
//   push  = the staged entries of one shard, written like a chunk's gradient (PushPipeline).
//
// No server code runs on either path.
//
// Thread safety: none. Owned by the client; the trainer's thread only.
#ifndef SHARDPS_WORKER_ROW_TABLES_H_
#define SHARDPS_WORKER_ROW_TABLES_H_

#include <chrono>
#include <deque>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "common/flat_index.h"
#include "common/status.h"
#include "proto/control.pb.h"
#include "transport/transport.h"
#include "worker/data_path.h"
#include "worker/server_sessions.h"

namespace shardps::worker {

class RowTables {
 public:
  RowTables(const ClientOptions& options, transport::Fabric& fabric, ServerSessions& sessions,
            std::vector<Tensor>& tensors, const std::vector<ChunkPlacement>& chunks,
            const StepClock& step);

  // After the shard map: the staging of every table.
  Status Setup();

  Status AddGradients(uint32_t tensor, const int64_t* ids, size_t n, const void* grads);
  // Whether the shard of row chunk `chunk` has gradient rows added since its last push.
  bool HasPendingRows(uint32_t chunk) const;
  // Multiplies those rows by `factor`; whether every value is finite then.
  bool ScalePending(uint32_t tensor, float factor);
  // The sum of their squares (double); inf or NaN where one is not finite.
  double SquaredNormOfPending(uint32_t tensor) const;
  // Drops them: the table's next push carries none of them.
  void DropPending(uint32_t tensor);
  // PushPipeline: copies a shard's pending gradient rows into its push staging of `parity`
  // (whose previous push the server has acknowledged); returns the bytes staged. They stay
  // pending until CommitStage (the push was posted, or left to be resent): a post that fails
  // loses no row.
  uint64_t Stage(uint32_t chunk, uint32_t parity);
  void CommitStage(uint32_t chunk);
  // Where Stage put them.
  transport::LocalSlice Staged(uint32_t chunk, uint32_t parity, uint64_t bytes) const;

  // State transfers (Client::SetRows / GetRows / TableKeys): a table's shape, and the payload
  // (layout::PushOp on a row shard: entries, ids or a slot range) that the next non-gradient
  // push of `chunk` carries instead of the step's gradient rows, which stay pending.
  struct Shape {
    uint32_t shards = 0, dim = 0, elem = 4, max_ids = 0;
    uint64_t rows = 0;  // dense: ids < rows; hashed: the capacity
    bool hashed = false;
    layout::RowGeometry geometry;              // shard 0's (ShardOf is the same for all)
    const std::vector<uint32_t>* shard_chunk;  // chunk id of shard k
  };
  Shape shape(uint32_t tensor) const;
  // Drops ids from the table's row cache (a set by this worker: read them again).
  void Forget(uint32_t tensor, const int64_t* ids, size_t n);
  // The payload of the next state transfer on `chunk`; `f32_rows`: a set whose rows are float32
  // (layout::kPushF32Rows: a 16-bit table's exact set).
  void SetOpPayload(uint32_t chunk, std::vector<char> payload, bool f32_rows = false);
  // PushPipeline, for a non-gradient push: moves that payload into the push staging of
  // `parity` (whose previous push the server has acknowledged); returns its bytes.
  uint64_t StageOp(uint32_t chunk, uint32_t parity);
  // The push flags of that payload (kPushF32Rows or 0).
  uint32_t OpFlags(uint32_t chunk) const {
    return chunk == op_chunk_ && op_f32_rows_ ? layout::kPushF32Rows : 0;
  }

  // Client::PullRows. `required_plus1`: the min clock (+1) the rows must include.
  // `recover` repairs a failed session (reconnect or failover) or says why not.
  Status Pull(uint32_t tensor, const int64_t* ids, size_t n, void* out, uint64_t required_plus1,
              const std::function<Status()>& recover);
  void OnCompletion(uint32_t chunk, uint64_t handle, const Status& err);

  uint64_t rows_pulled() const { return rows_pulled_; }
  uint64_t row_reads() const { return row_reads_; }
  uint64_t row_retries() const { return row_retries_; }
  uint64_t rows_pushed() const { return rows_pushed_; }
  uint64_t cache_hits() const { return cache_hits_; }
  uint64_t cache_misses() const { return cache_misses_; }
  uint64_t cache_staleness() const { return cache_staleness_; }

 private:
  struct Table {
    uint32_t tensor = 0;
    uint32_t shards = 0;
    uint32_t dim = 0;
    uint32_t elem = 4;
    uint32_t max_ids = 0;
    uint64_t rows = 0;    // dense: ids < rows; hashed: the capacity
    bool hashed = false;  // any 64-bit key (bucketed, wire/region_layout.h)
    layout::RowGeometry geometry;  // shard 0's (ShardOf and BucketOf are the same for all)
    EmbeddingOptions options;      // the initialiser: a hashed key without a row reads it
    uint64_t stride = 0;  // a row record's bytes (wire/region_layout.h RowHeader + values)
    // A read unit: one record (dense) or one bucket of kBucketSlots records (hashed).
    uint64_t unit_rows() const { return hashed ? layout::kBucketSlots : 1; }
    uint64_t unit_bytes() const { return unit_rows() * stride; }
    std::vector<uint32_t> shard_chunk;  // chunk id of shard k
    // This step's gradient rows per shard: id -> index into values (float32 sums); the ids in
    // index.keys(), in the same order.
    struct Pending {
      FlatIndex index;
      std::vector<float> values;
    };
    std::vector<Pending> pending;
    uint64_t push_slot_bytes = 0;  // one (shard, parity)'s staging
    std::unique_ptr<transport::MemoryRegion> push_staging;
    std::unique_ptr<transport::MemoryRegion> header_staging;  // one ChunkHeader per shard
    std::unique_ptr<transport::MemoryRegion> pull_staging;    // grows to the largest pull
    // The row cache (EmbeddingOptions::cache_rows): id -> its row bytes and the min clock (+1)
    // of the read that brought it; FIFO eviction.
    struct Cached {
      std::vector<char> row;
      uint64_t min_clock_plus1 = 0;
    };
    std::unordered_map<int64_t, Cached> cache;
    std::deque<int64_t> cache_order;
  };
  // One shard's reads in flight: its read units (dense: rows; hashed: buckets), in staging
  // order.
  struct ShardRead {
    uint32_t shard = 0;
    std::vector<uint64_t> locals;  // first local row of each unit to (re)read, ascending
    std::vector<uint32_t> slots;   // their places (in units) in the pull staging
  };
  // One signaled read list of a round: units [begin, end) of reads[read].
  struct ListRead {
    uint32_t read = 0;
    uint32_t begin = 0, end = 0;
  };
  // A pull's id i wants the unit `key` (shard-major); sorted by key.
  struct Want {
    uint64_t key = 0;
    uint32_t at = 0;
  };
  // A completion's handle: the round (upper bits) and the list's index in lists_.
  static constexpr int kListBits = 20;
  // The most ids one PullRows takes (so that a round's lists fit in kListBits).
  static constexpr size_t kMaxPullIds = size_t{1} << kListBits;
  Status PostShard(Table& t, const ShardRead& r, uint32_t read, uint64_t round, int* signaled);
  // Pull without the cache: the rows from the servers. `id_min_clock_plus1` (may be null): per
  // id, the min clock (+1) its shard's header named when its row was read.
  Status Read(uint32_t tensor, const int64_t* ids, size_t n, void* out, uint64_t required_plus1,
              const std::function<Status()>& recover, std::vector<uint64_t>* id_min_clock_plus1);

  const ClientOptions& options_;
  transport::Fabric& fabric_;
  ServerSessions& sessions_;
  std::vector<Tensor>& tensors_;
  const std::vector<ChunkPlacement>& chunks_;
  const StepClock& step_;
  std::vector<Table> tables_;
  std::unordered_map<uint32_t, uint32_t> table_of_tensor_;
  std::vector<char> op_payload_;  // SetOpPayload's, for op_chunk_
  uint32_t op_chunk_ = ~0u;
  bool op_f32_rows_ = false;
  std::vector<std::pair<uint32_t, uint32_t>> shard_of_chunk_;  // (table, shard); table ~0u: dense
  // The pull in flight: its round, its lists, those completed (in completion order), how many,
  // and whether one failed.
  uint64_t round_ = 0;
  std::vector<ListRead> lists_;
  std::vector<uint32_t> done_;
  int completed_ = 0;
  bool failed_ = false;
  // Scratch of Read and PostShard, kept to avoid allocating per pull.
  std::vector<Want> want_, want_tmp_;
  // AddGradients' scratch: each shard's index size before the call, each id's row index.
  std::vector<size_t> add_before_;
  std::vector<uint32_t> add_at_;
  std::vector<ShardRead> reads_;
  std::vector<uint32_t> first_;
  std::vector<uint64_t> unit_keys_;
  std::vector<const char*> records_;
  std::vector<uint32_t> crcs_;
  std::vector<transport::ReadPiece> pieces_;
  uint64_t rows_pulled_ = 0, row_reads_ = 0, row_retries_ = 0, rows_pushed_ = 0;
  uint64_t cache_hits_ = 0, cache_misses_ = 0, cache_staleness_ = 0;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_ROW_TABLES_H_
