// What the client's data-path components share (worker/client_impl.h has the picture): the
// registered tensors, the placement of each chunk (fixed at Start), operation contexts, the
// handles of asynchronous calls and the worker's step clock. Internal.
//
// Thread safety: none; everything here belongs to the client's (trainer's) thread.
#ifndef SHARDPS_WORKER_DATA_PATH_H_
#define SHARDPS_WORKER_DATA_PATH_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "wire/region_layout.h"
#include "shardps/client.h"
#include "transport/transport.h"
#include "worker/cuda_staging.h"

namespace shardps::worker {

// Send queue depth of every endpoint to a server.
constexpr int kSendDepth = 512;
// Staging per chunk: 4 slots of kStagingSlot bytes: 2 push headers (one per inbox parity) + 2
// chunk-header reads of a pull.
constexpr uint32_t kStagingSlot = sizeof(layout::PushHeader);
constexpr uint32_t kStagingPerChunk = 4 * kStagingSlot;
// A push of a chunk up to this size is one WRITE_WITH_IMM of [PushHeader | data] (the inbox
// keeps them adjacent) from staging, after copying the gradient there: one operation on the
// wire instead of two, which on tcp saves a sendmsg and a receive round per push (a 16 KiB
// copy costs well under a microsecond).
constexpr uint64_t kSmallPushBytes = 16 * 1024;
// A pull of a chunk up to this size whose buffer guess missed recently reads both buffers: the
// guessed one into the trainer's buffer, the other into staging (worker/pull_pipeline.h). A
// miss then costs a copy of the chunk, not a second round trip.
constexpr uint64_t kBothBuffersBytes = 16 * 1024;

// The context of every post: what it was (OpKind), for which chunk and which handle.
enum OpKind : uint32_t {
  kOpPush = 0,
  kOpPull = 1,
  kOpAcks = 2,
  kOpSetup = 3,
  kOpClock = 4,
  kOpRows = 5,  // a row table's reads (worker/row_tables.h)
  kOpAcksAhead = 6,  // ServerSessions::PostAcksAhead
  // A signaled write inside a long run of unsignaled ones (a staged CUDA push's pieces): its
  // completion only returns the run's send credits; a failure fails the session like any other.
  kOpCredit = 7,
};
// The most unsignaled posts a run may make before one of them is signaled (kOpCredit), well
// under kSendDepth: their credits come back only with a signaled completion.
constexpr int kMaxUnsignaledRun = kSendDepth / 4;
inline uint64_t MakeContext(uint32_t kind, uint32_t chunk, uint64_t handle) {
  return (static_cast<uint64_t>(kind) << 60) | (static_cast<uint64_t>(chunk & 0x0fffffff) << 32) |
         (handle & 0xffffffffull);
}
inline uint32_t ContextKind(uint64_t c) { return static_cast<uint32_t>(c >> 60); }
inline uint32_t ContextChunk(uint64_t c) { return static_cast<uint32_t>((c >> 32) & 0x0fffffff); }
inline uint64_t ContextHandle(uint64_t c) { return c & 0xffffffffull; }

struct Tensor {
  std::string name;
  void* weights = nullptr;
  void* grads = nullptr;
  TensorDType dtype = TensorDType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  // Regions the network reads and writes: the tensor itself (host, kCudaDirect) or the
  // pinned host mirrors of `staging` (kCudaStaged).
  std::unique_ptr<transport::MemoryRegion> wmr;
  std::unique_ptr<transport::MemoryRegion> gmr;
  std::vector<uint32_t> chunks;  // global chunk ids
  TensorPath path = TensorPath::kHost;
  std::unique_ptr<CudaStaging> staging;  // kCudaStaged only
  uint64_t push_handle = 0;              // kCudaStaged: the push whose data is in the mirror
  // kCudaStaged: the device->host copy of the gradient for the next Push was already started
  // (PushPipeline::Prestart, by Step and PushMany); Push then does not start it again.
  bool staging_prestarted = false;
  layout::UpdateRule rule{};  // what its pushes ask the servers to apply (Client::SetUpdateRule)
  bool no_gradient = false;   // its pushes carry kPushNoGradient (Client::SetNoGradient)
  // A row table (Client::RegisterEmbedding): shape {rows, dim}; no weights or grads buffers
  // (worker/row_tables.h holds its staging).
  bool embedding = false;
  EmbeddingOptions embedding_options;
};

// Where a chunk lives: fixed by the shard map at Start (a failover changes the server process
// behind a group, never the placement).
struct ChunkPlacement {
  uint32_t id = 0;
  uint32_t tensor = 0;
  uint64_t offset = 0;  // in the tensor, bytes
  uint64_t bytes = 0;
  uint32_t server = 0;  // the shard group
  uint32_t slot = 0;    // on that server
  layout::RowGeometry rows;  // a row table's shard (rows != 0); offset is then the shard index
};

// The handle of a Push or Pull: the chunks still pending and the first error.
struct HandleState {
  int pending = 0;
  Status error;
  int64_t staged_pull_tensor = -1;  // a pull of a kCudaStaged tensor: sync its copies
};

class HandleTable {
 public:
  // A new handle (ids are 32 bits: they travel in operation contexts).
  uint64_t Create() { return next_++ & 0xffffffffull; }
  HandleState& operator[](uint64_t h) { return handles_[h]; }
  HandleState* Find(uint64_t h) {
    auto it = handles_.find(h);
    return it == handles_.end() ? nullptr : &it->second;
  }
  const HandleState* Find(uint64_t h) const {
    auto it = handles_.find(h);
    return it == handles_.end() ? nullptr : &it->second;
  }
  bool Contains(uint64_t h) const { return handles_.count(h) != 0; }
  void Erase(uint64_t h) { handles_.erase(h); }
  // One chunk of handle h is done (with its error, if any).
  void FinishChunk(uint64_t h, const Status& s) {
    auto it = handles_.find(h);
    if (it == handles_.end()) return;
    if (!s.ok() && it->second.error.ok()) it->second.error = s;
    --it->second.pending;
  }

 private:
  std::unordered_map<uint64_t, HandleState> handles_;
  uint64_t next_ = 1;
};

// The worker's progress through training, read by the pipelines.
struct StepClock {
  uint64_t clock = 0;    // this worker's clock
  uint64_t step_id = 0;  // Step() calls so far
  bool in_step = false;  // inside Step(): its pushes' gradients are still in the buffers
  bool non_finite = false;  // Client::MarkNonFinite: the pushes carry kPushNonFinite
  uint32_t weight = 1;      // trainers whose gradients a push sums (a host aggregator: > 1)
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_DATA_PATH_H_
