// libshardps: the worker client library. A trainer registers its tensors (weights and
// gradients, in its own memory), then each step pushes gradients into the servers' memory and
// pulls weights back, with one-sided operations only. A steady-state step sends no control
// message (counters().control_messages_sent stays flat).
//
//   shardps::ClientOptions o;
//   o.coordinator = "10.0.0.1:7070";
//   o.cluster_token = "secret";
//   auto client = shardps::Client::Connect(o);             // joins the cluster
//   (*client)->RegisterTensor("fc1.weight", w, g, {256, 64});
//   (*client)->Start();                                     // shard map, endpoints, weights
//   for (...) { compute gradients into g; (*client)->Step(); }   // push, clock, pull
//
// Thread safety: a Client belongs to one thread (the training loop's). Its control-plane
// heartbeats run on an internal thread.
//
// Lifecycle. A client is in one of these states; every call either works in it or returns
// FAILED_PRECONDITION naming the call and the state ("Clock() before Start()"), and none
// crashes or hangs:
//
//   joined ──Start() ok──> running ──unrecoverable data-path error──> broken
//      └──Start() error──> start failed                (any state) ──Close()──> closed
//
//   joined        after Connect. RegisterTensor works; Start() works once tensors are
//                 registered (without any it is refused and the client stays joined). Push,
//                 Pull, Wait, Clock, Step, Barrier and RequestCheckpoint are refused.
//   running       after a successful Start(). Push, Pull, Wait, Clock, Step, Barrier and
//                 RequestCheckpoint work (their own errors, e.g. NOT_FOUND for an unknown
//                 tensor or handle, or DEADLINE_EXCEEDED for a pull that missed its bound, leave
//                 the client running). RegisterTensor and Start are refused.
//   start failed  Start() returned an error: every call but Close() and the getters is refused,
//                 naming Start's error. Close it and Connect again.
//   broken        the data path failed beyond recovery (a server died with no backup to fail
//                 over to, a failover that did not complete in time, lost state): the call that
//                 hit it returned that error; every later call but Close() and the getters is
//                 refused, naming it.
//   closed        after Close() (or the destructor): every call but Close() (OK again) and the
//                 getters is refused; handles not yet waited for are abandoned.
//
// The getters (rank, num_workers, clock, consistency, counters, transport_name, tensor_path)
// work in every state and report the latest values known.
#ifndef SHARDPS_CLIENT_H_
#define SHARDPS_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardps/export.h"
#include "shardps/status.h"

namespace shardps {

struct ClientOptions {
  std::string coordinator;    // host:port of shardps_coordinator
  std::string cluster_token;  // must match the coordinator's
  int requested_rank = -1;    // -1: the coordinator picks
  // Data path.
  std::string transport = "auto";  // verbs, tcp, shm, auto (must match the cluster's)
  std::string bind_ip;             // local address for the data path (verbs: picks the NIC)
  std::string rdma_device;         // verbs: device name, "" = by bind_ip or first active
  int rdma_gid_index = -1;         // verbs: -1 = automatic RoCEv2 GID
  // Setup and failure bounds.
  std::chrono::milliseconds setup_timeout{60000};
  // How long a pull may wait for the consistency condition before it reports an error
  // (a dead server or a stuck cluster must not hang the trainer).
  std::chrono::milliseconds wait_timeout{30000};
  // How long to wait for a failed server's group to be failed over to its backup (a new shard
  // map) before reporting the failure; 0 = the cluster's failover_timeout_ms.
  std::chrono::milliseconds failover_timeout{0};
  // How long a waiting call (Wait, PullRows, Step) polls its completion queue with nothing
  // arriving before it sleeps on the transport's event until the next completion (or its next
  // timed re-read). Polling answers fastest on a core of its own; on a host with more busy
  // threads than cores (several workers, their servers, an aggregator) a poller takes the CPU
  // from the very threads it waits for. An operation that completes within it never sleeps.
  // Negative: never sleep (pure busy polling). SHARDPS_BUSY_POLL_US sets it.
  std::chrono::microseconds busy_poll{200};
  // CUDA tensors that the fabric cannot register directly are staged through pinned host
  // buffers in pieces of this many bytes: the copy of piece k+1 overlaps the write of piece k.
  uint64_t cuda_pipeline_bytes = 1u << 20;
  // Prometheus metrics of this client (docs/operations.md, "Metrics"), served at
  // http://metrics_address:metrics_port/metrics from a thread of the client: 0 = off, -1 = any
  // free port (written to metrics_address_file; "%p" in it becomes the process id). A port that
  // cannot be bound fails Connect.
  int metrics_port = 0;
  std::string metrics_address = "127.0.0.1";
  std::string metrics_address_file;
  // Timeline trace of this process (docs/tracing.md): Chrome-trace JSON of its steps, pushes,
  // pulls and waits, written at Close(), when its buffer fills, and as the client goes away.
  // "" = off. "{rank}" or "%r" in the name become "<rank>-<pid>" (one file per worker).
  std::string trace_file;
  uint64_t trace_max_events = 1000000;  // events kept; later ones are dropped (and counted)
  // Host aggregation (docs/hierarchical.md): the unix socket of this host's
  // shardps_aggregator ("" = none: this worker joins the coordinator itself). With it, the
  // worker talks to the aggregator only, through shared memory; coordinator, transport and the
  // other cluster fields are the aggregator's business. local_rank: this worker's index on its
  // host, 0..local_workers-1 (-1: from the environment).
  std::string aggregator;
  int local_rank = -1;
  // Under a host aggregator: pulls leave the weights in the host's shared read-only mapping
  // (Client::WeightsView), which every local worker reads in place, instead of copying them into
  // each worker's registered weights buffer (that buffer then only supplies the initial
  // weights). No effect on a flat worker, whose pulls land in its buffer with no copy anyway.
  bool host_weights_in_place = false;
};

// Fills in what `options` leaves unset from the environment, as launchers set it (shardps.run,
// torchrun, mpirun, Slurm), so a trainer needs no flags of its own:
//   coordinator     ""     <- SHARDPS_COORDINATOR ("host:port", or a comma list of HA coordinators)
//   cluster_token   ""     <- SHARDPS_CLUSTER_TOKEN
//   requested_rank  < 0    <- the first set of SHARDPS_RANK, OMPI_COMM_WORLD_RANK, PMI_RANK,
//                             SLURM_PROCID, RANK (a non-negative integer)
//   transport       "auto" <- SHARDPS_TRANSPORT
//   busy_poll       200 us <- SHARDPS_BUSY_POLL_US (an integer; negative: never sleep)
//   metrics_port    0      <- SHARDPS_METRICS_PORT (an integer, -1..65535)
//   metrics_address "127.0.0.1" <- SHARDPS_METRICS_ADDRESS
//   metrics_address_file "" <- SHARDPS_METRICS_ADDRESS_FILE
//   trace_file      ""     <- SHARDPS_TRACE_FILE (docs/tracing.md)
//   aggregator      ""     <- SHARDPS_AGGREGATOR (docs/hierarchical.md)
//   local_rank      < 0    <- the first set of SHARDPS_LOCAL_RANK, LOCAL_RANK (torchrun),
//                             OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID
// What the caller set always wins. `sources`, if given, gets "field from VARIABLE" for each
// value taken. Client::Connect applies it (and logs the sources).
SHARDPS_EXPORT ClientOptions WithEnvironmentDefaults(ClientOptions options,
                                                     std::string* sources = nullptr);

// How a registered tensor's memory reaches the network (logged at RegisterTensor).
enum class TensorPath {
  kHost = 0,        // host memory, registered as it is
  kCudaDirect = 1,  // device memory registered with the NIC (verbs: ibv_reg_dmabuf_mr)
  kCudaStaged = 2,  // device memory staged through pinned host buffers (chunked pipeline)
};
SHARDPS_EXPORT const char* TensorPathName(TensorPath p);

// Whether this library was built with CUDA (SHARDPS_HAVE_CUDA): only then are device tensors
// recognised and staged or registered. Thread-safe.
SHARDPS_EXPORT bool BuiltWithCuda();
// Whether `ptr` is CUDA device memory as this library sees it: false in a build without CUDA and
// on a machine without a CUDA driver or device. RegisterTensor decides host or device by it; a
// caller that knows its buffer is device memory (a framework's is_cuda) checks here first, since
// device memory taken for host memory would be read by the transport's CPU. Thread-safe.
SHARDPS_EXPORT bool IsCudaDeviceMemory(const void* ptr);

struct ClientCounters {
  uint64_t control_messages_sent = 0;  // excluding periodic heartbeats
  uint64_t heartbeats_sent = 0;
  uint64_t pushes = 0;        // chunk pushes of gradients (state transfers not counted)
  uint64_t pulls = 0;         // chunk pulls (consistent snapshots)
  uint64_t pull_retries = 0;  // torn or not-yet-ready reads that were repeated
  uint64_t bytes_pushed = 0;
  uint64_t bytes_pulled = 0;
  // Fault tolerance (docs/fault-tolerance.md).
  uint64_t failovers = 0;      // server groups this worker moved to a promoted backup
  uint64_t pushes_resent = 0;  // pushes sent again after a failover (duplicates are dropped)
  uint64_t pushes_lost = 0;    // pushes neither replicated nor resendable (ASP/SSP only)
  uint64_t reconnects = 0;     // data-path failures survived by reconnecting to the same server
  // Row tables.
  uint64_t rows_pulled = 0;      // distinct rows read (PullRows)
  uint64_t row_reads = 0;        // one-sided reads posted for them (adjacent rows coalesced)
  uint64_t row_retries = 0;      // rows read again: torn (crc) or behind the consistency bound
  uint64_t rows_pushed = 0;      // distinct gradient rows pushed
  uint64_t row_cache_hits = 0;   // rows served from the worker's cache (EmbeddingOptions)
  uint64_t row_cache_misses = 0;
  // Sum over hits of (the clock now - the clock the row's read included): staleness = this /
  // hits, in clocks.
  uint64_t row_cache_staleness = 0;
  // Pulls of small chunks whose buffer guess missed, served from the other buffer read
  // alongside (a copy instead of a second round trip; docs/region-layout.md). Fields are
  // appended here, never inserted: the struct is returned by value across the ABI.
  uint64_t pull_other_buffer = 0;
};

// Handle of an asynchronous Push or Pull.
// How the servers apply a tensor's gradients (Client::SetUpdateRule). The semantics and
// operation order are torch.optim's (1.13), in float32 with float64 bias corrections.
struct UpdateRule {
  // kStore: the new value is the pushed value (BSP: the clock's pushes summed).
  enum class Kind : uint32_t {
    kServer = 0,
    kSgd = 1,
    kAdam = 2,
    kAdamW = 3,
    kStore = 4,
    kAdagrad = 5,
  };
  Kind kind = Kind::kServer;  // kServer: the servers' --optimizer; `lr` replaces --lr if > 0
  float lr = 0.0f;
  float momentum = 0.0f;   // SGD
  float dampening = 0.0f;  // SGD
  bool nesterov = false;   // SGD
  float weight_decay = 0.0f;  // SGD and Adam: L2 added to the gradient; AdamW: decoupled
  float beta1 = 0.9f;      // Adam, AdamW
  float beta2 = 0.999f;
  float eps = 1e-8f;       // Adam, AdamW, Adagrad (torch's Adagrad default is 1e-10)
  float lr_decay = 0.0f;   // Adagrad
  float initial_accumulator_value = 0.0f;  // Adagrad
};
// A row table (Client::RegisterEmbedding; docs/embeddings.md).
struct EmbeddingOptions {
  // The most distinct rows one push of this worker may carry to one shard (a step's gradient
  // rows of the table, over its shards). Sizes the servers' inbox: per worker and shard
  // 2 x max_ids x (8 + dim x dtype bytes).
  uint32_t max_ids = 16384;
  // Initial rows, computed by the servers from (seed, row id): no upload.
  enum class Init : uint32_t { kNormal = 0, kUniform = 1, kZeros = 2 };
  Init init = Init::kNormal;  // kNormal: N(0, scale^2) (torch.nn.Embedding: N(0, 1))
  float init_scale = 1.0f;    // kUniform: U(-scale, scale)
  uint64_t init_seed = 0;
  // Hashed ids: any 64-bit id (a feature hash) instead of 0 <= id < rows; `rows` is then the
  // capacity, the rows held at most. A key gets a row the first time its gradient is applied,
  // with probability admit_probability (deterministic per key and step); a full bucket gives it
  // the slot of its least recently updated row, whose key is forgotten (reads of a key without
  // a row return its initial value). docs/embeddings.md, "Hashed ids".
  bool hashed = false;
  float admit_probability = 1.0f;
  // Worker-side cache of rows read (0: none): a row read before is served from here while the
  // min clock it was read at still meets the consistency bound (BSP: within the same clock;
  // SSP: up to s clocks; ASP: until evicted); rows this worker adds gradients to are dropped
  // from it (it reads its own updates). Hit rate and staleness: ClientCounters.
  uint32_t cache_rows = 0;
};

// Element types of registered tensors (the numbers are the wire's).
enum class TensorDType : uint32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct Handle {
  uint64_t id = 0;
};

class SHARDPS_EXPORT Client {
 public:
  static StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  virtual ~Client() = default;
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Registers a float32 tensor. `weights` receives pulled weights; `grads` is the source of
  // pushes. Both stay owned by the caller and must outlive the client; their memory is
  // registered, never copied (host memory, and CUDA memory on a fabric that can register it).
  // Device pointers are recognised by themselves (builds with CUDA): both buffers must then be
  // on the device. Before Start() only; every worker registers the same tensors in the same
  // order. For CUDA tensors the work that produced `grads` must be complete or ordered on the
  // legacy default stream before Push().
  virtual Status RegisterTensor(const std::string& name, float* weights, float* grads,
                                const std::vector<int64_t>& shape) = 0;
  // The same for a tensor of another element type: float16 and bfloat16 tensors travel as
  // they are (half the bytes of float32); the servers keep float32 master weights and
  // optimizer state, and pulls deliver the master weights rounded to the tensor's type.
  virtual Status RegisterTensor(const std::string& name, void* weights, void* grads,
                                const std::vector<int64_t>& shape, TensorDType dtype) = 0;
  // Registers a row table (an embedding) of `rows` x `dim` values of `dtype`, partitioned by
  // row id over the servers (row r on shard r % shards). Its rows live on the servers only
  // (initialised there, options.init); a worker reads the rows a batch needs (PullRows) and
  // pushes the gradient rows it produced (AddRowGradients, then Push or Step). Before Start()
  // only; every worker registers the same tables, in the same order as its other tensors.
  virtual Status RegisterEmbedding(const std::string& name, int64_t rows, int64_t dim,
                                   TensorDType dtype, const EmbeddingOptions& options) = 0;
  // Reads rows ids[0, n) of a table into out (n x dim values of its dtype, row-major),
  // satisfying the consistency mode at the current clock (BSP: every worker's pushes of the
  // clocks before). One-sided reads only: each distinct row once, adjacent rows in one read,
  // each verified (crc) and read again if torn. Duplicate ids are fine. INVALID_ARGUMENT for an
  // id outside [0, rows).
  virtual Status PullRows(const std::string& table, const int64_t* ids, size_t n, void* out) = 0;
  // Adds gradient rows (n x dim values of the table's dtype) for ids[0, n) to the table's
  // gradient of this step; duplicate ids are summed here. The next Push(table) or Step() sends
  // it (one push per shard, every step in BSP, even an empty one) and clears it.
  // RESOURCE_EXHAUSTED, adding nothing, if a shard would get more than max_ids distinct rows.
  virtual Status AddRowGradients(const std::string& table, const int64_t* ids, size_t n,
                                 const void* grads) = 0;
  // Publishes the model, receives the shard map, connects to every server. Rank 0's current
  // weights become the initial weights; every worker then pulls them.
  virtual Status Start() = 0;

  // Asynchronous push of a tensor's gradients at the current clock; Wait() before reusing grads.
  // For a row table: its gradient rows added since its last push (AddRowGradients).
  // Step() does not push again what Push() sent in its clock, in any mode (a row table with
  // rows added since its push: ASP and SSP push those rows; BSP refuses, posting nothing). A
  // push not yet waited for is resent after a failover, in Step() or not (its buffer is the
  // caller's to reuse only once Wait returns). A push that failed part way (a chunk's inbox slot not freed in time: its
  // Wait fails) is completed by the tensor's next Push or Step: the chunks it left out only.
  // BSP sums one push per tensor per worker per clock: a second push of a tensor in the same
  // clock is refused (FAILED_PRECONDITION). ASP and SSP apply every explicit push.
  virtual StatusOr<Handle> Push(const std::string& name) = 0;
  // Asynchronous pull of a tensor's weights, satisfying the consistency mode at the current
  // clock; Wait() before reading weights.
  virtual StatusOr<Handle> Pull(const std::string& name) = 0;
  virtual Status Wait(Handle handle) = 0;
  // Push (Pull) of several tensors in one call: each as Push (Pull) of it would, in order, one
  // handle per name, each to Wait. Their posts leave together: over tcp, a round of small
  // tensors goes to each server in one sendmsg instead of one per tensor (like MSG_MORE; shm
  // and verbs post as before). Everything is sent before the call returns, so computing
  // before the Waits still overlaps the transfers. An unknown name refuses the call before
  // anything is posted; if one push (pull) cannot be started, those before it are waited
  // for and its error is returned: a failed call leaves nothing in flight. Known limit: when a
  // server group is lost mid-call (its failover target died too), the DATA_LOSS can take the
  // failover wait (26 s by default) to arrive; Step() therefore still pushes one tensor at a
  // time.
  virtual StatusOr<std::vector<Handle>> PushMany(const std::vector<std::string>& names);
  virtual StatusOr<std::vector<Handle>> PullMany(const std::vector<std::string>& names);
  // Advances this worker's clock by one.
  virtual Status Clock() = 0;
  // One training step: push every tensor not pushed yet in this clock (row tables: their
  // gradient rows), wait, Clock(), pull every dense tensor, wait. Row tables are read with PullRows, for the rows a batch needs.
  virtual Status Step() = 0;
  // Asks every server for a checkpoint at the next clock (after this worker's next Step, in
  // BSP): written to the cluster's checkpoint directory, or `dir` if given. Returns the clock.
  // One control message; the write itself happens on the servers' writer threads.
  virtual StatusOr<uint64_t> RequestCheckpoint(const std::string& dir = "") = 0;
  // Waits until every live worker of the cluster has called Barrier as often as this one (ps-lite's
  // Postoffice::Barrier, torch.distributed.barrier): e.g. after every worker loaded a checkpoint
  // under SSP or ASP, before any trains on. One control message each way, sent again after a
  // coordinator restart; a worker that departs is no longer waited for, and none is released
  // before every expected worker has joined. DEADLINE_EXCEEDED after `timeout` (0: the
  // options' setup_timeout); this worker stays arrived, and the next call waits for the same
  // barrier again (a retry), not for the next one.
  virtual Status Barrier(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) = 0;
  // The learning rate the servers apply to this worker's next pushes of `tensor` ("" = every
  // registered tensor); 0 = the servers' --lr. It travels in each push's header, so an LR
  // schedule costs no control message. In BSP a clock is applied with its lowest rank's rate:
  // give every worker the same schedule. Range [0, 1e6).
  virtual Status SetLearningRate(const std::string& tensor, float lr) = 0;
  // The update rule the servers apply to this worker's next pushes of `tensor` ("" = every
  // registered dense tensor; a row table's is set by its name, and must be one of its sparse
  // rules: SGD without momentum or weight decay, Adam (lazy, torch's SparseAdam), Adagrad, or
  // kServer): torch.optim's SGD (momentum, dampening, nesterov, weight decay), Adam
  // or AdamW, with their exact semantics (docs/python.md), state kept per chunk on the
  // servers. Like the rate, it travels in the push headers (no control message), so schedulers
  // may change any field every step. kServer: the servers' own --optimizer (the default).
  virtual Status SetUpdateRule(const std::string& tensor, const UpdateRule& rule) = 0;
  // Marks this worker's next pushes (until called again with false) as coming from a step
  // whose gradients were not all finite (a mixed-precision overflow, as torch's GradScaler
  // finds it). BSP skips the whole clock's update on every server, consistently (every worker
  // pushes every chunk, so every chunk sees the mark); ASP and SSP skip each marked push's
  // update. Tensors with the kStore rule are stored all the same (shardps.torch counts the
  // workers that overflowed in one, so every worker's GradScaler backs off alike).
  virtual void MarkNonFinite(bool non_finite) = 0;
  // Marks this worker's next pushes of `tensor` (until called again with false) as carrying no
  // gradient: a frozen parameter (requires_grad=False) or one that got no .grad this step. The
  // pushes still go (every clock needs every push) with the gradient buffer as it is, which the
  // caller keeps at zero. BSP: a chunk whose pushes of a clock all carry the mark is left as it
  // is, optimizer state and step count included (torch skips a parameter whose .grad is None);
  // if any worker's push has a gradient, the marked zeros are summed in (as DDP's unused
  // parameters). ASP/SSP: a marked push changes nothing. A kStore tensor is stored all the
  // same. NOT_FOUND for an unknown tensor; INVALID_ARGUMENT for a row table (its pushes carry
  // only the rows touched). Under a host aggregator (hierarchical mode) the host's summed push
  // carries the mark when every one of its learners' pushes of the clock does.
  virtual Status SetNoGradient(const std::string& tensor, bool no_gradient) = 0;

  // Moving a tensor's state between this trainer and the servers (shardps.torch's
  // state_dict / load_state_dict, docs/python.md), between steps. Each chunk's transfer is a
  // push through the data path (exactly once, replicated like an update), acknowledged before
  // the call returns; neither is a control message.
  enum class StatePart : uint32_t { kWeights = 1, kState1 = 2, kState2 = 3, kNoState = 4 };
  // Sets `part` of `tensor` on the servers to the values now in its GRADIENT buffer (in the
  // tensor's dtype), and every chunk's optimizer step count to `steps`: kWeights the master
  // weights, kState1/kState2 the optimizer's first/second state buffer (momentum or Adam's
  // first moment; Adam's second), kNoState drops the state (a torch optimizer that never
  // stepped). The servers publish a new version; pull to see new weights. A CUDA gradient
  // buffer must be written by work that is complete or ordered on the legacy default stream, as
  // for Push.
  virtual Status SetState(const std::string& tensor, StatePart part, uint64_t steps) = 0;
  // As SetState, from `values` (elements() float32, host memory) instead of the gradient
  // buffer, whatever the tensor's dtype: a 16-bit tensor's float32 master weights and state
  // are set exactly, so what GetState read loads back bit for bit. Each chunk is sent as
  // float32 ranges of at most its inbox slot's bytes (at most two pushes for a 16-bit chunk),
  // each acknowledged before the next; readers may see a chunk half set until the last. The
  // gradient buffer is not touched. kNoState is refused (SetState drops the state).
  virtual Status SetStateValues(const std::string& tensor, StatePart part, const float* values,
                                uint64_t steps) = 0;
  // Reads the servers' float32 master weights and optimizer state of `tensor` (elements()
  // floats each; any output may be null). *has1/*has2: whether that state buffer exists on
  // every chunk; *steps: the optimizer's step count (the largest of the chunks').
  virtual Status GetState(const std::string& tensor, float* weights, float* state1,
                          float* state2, uint64_t* steps, bool* has1, bool* has2) = 0;

  // Row tables' state (shardps.torch's Embedding state_dict / load_state_dict, a pretrained
  // embedding, a table's optimizer state), between steps, through the data path as SetState:
  // per shard, pushes of at most max_ids rows, each acknowledged before the next (exactly once,
  // replicated like an update). The gradient rows added this step stay pending.
  // Sets `part` of rows ids[0, n) to `values` (n x dim float32, row-major; a 16-bit table's
  // are rounded to its dtype on the wire): kWeights the rows' values; kState1 / kState2 their
  // optimizer state rows (Adagrad's sum, Adam's first moment / Adam's second moment), and the
  // table's step count to `steps` (lazy Adam's bias correction). Rows not named keep theirs.
  // A hashed table's keys are given a row (admission bypassed: the load is explicit; a full
  // bucket evicts as for an update); the keys are then read back, and RESOURCE_EXHAUSTED names
  // how many of them hold no row (evicted: the capacity is too small for them; the others are
  // set). INVALID_ARGUMENT, nothing set, for an id out of range, an id given twice, or
  // kNoState. A state part reaches every shard (the step count is the table's). Readers see
  // the new rows as soon as each push is applied: set a table before training (every worker
  // may set the same rows: the sets are idempotent); this worker's row cache drops them.
  virtual Status SetRows(const std::string& table, StatePart part, const int64_t* ids,
                         size_t n, const float* values, uint64_t steps) = 0;
  struct RowStateInfo {
    uint64_t steps = 0;  // the table's optimizer step count (the largest of its shards')
    bool has1 = false;   // whether state 1 / 2 exists on some shard (elsewhere: a fresh row's)
    bool has2 = false;
  };
  // Reads rows ids[0, n) (duplicates fine; any output may be null; n x dim float32 each): the
  // values (a 16-bit table's float32 master copy) and optimizer state rows, as of everything
  // the servers have applied. A hashed key without a row reads as a new row would be (its
  // initial value and state). INVALID_ARGUMENT for an id out of range.
  virtual Status GetRows(const std::string& table, const int64_t* ids, size_t n, float* weights,
                         float* state1, float* state2, RowStateInfo* info) = 0;
  // The keys holding a row in a hashed table, sorted, each once (with GetRows: a hashed
  // table's state_dict). Read shard by shard, max_ids slots at a time: a snapshot only while no
  // worker trains. INVALID_ARGUMENT for a dense table (every id in [0, rows) holds one).
  virtual StatusOr<std::vector<int64_t>> TableKeys(const std::string& table) = 0;

  virtual uint32_t rank() const = 0;
  virtual uint32_t num_workers() const = 0;  // live workers at the latest membership epoch
  virtual uint64_t clock() const = 0;
  // The newest barrier generation this worker has passed, or the one the cluster had released
  // when it joined (a late or restarted worker): its next Barrier() is this + 1. A Barrier()
  // that timed out has not passed.
  virtual uint64_t barrier_generation() const = 0;
  virtual std::string consistency() const = 0;  // "bsp", "ssp(s=2)", ...
  virtual ClientCounters counters() const = 0;
  virtual std::string transport_name() const = 0;
  // The path chosen for a registered tensor, or kNotFound.
  virtual StatusOr<TensorPath> tensor_path(const std::string& name) const = 0;
  // The weights of dense tensor `name` as of this worker's last completed pull, without a copy:
  // under a host aggregator, the host's shared mapping (read-only; every local worker reads the
  // same memory; valid until this worker's next Clock() or Step(), after which the aggregator
  // may overwrite it); on a flat worker, its own registered weights buffer. Never write through
  // it. FAILED_PRECONDITION before Start(), NOT_FOUND for an unknown or row tensor.
  virtual StatusOr<const void*> WeightsView(const std::string& name) const = 0;

  // Leaves the cluster cleanly (also done by the destructor). Idempotent: OK in every state.
  virtual Status Close() = 0;
  // A table's gradient rows of this step not yet pushed (AddRowGradients): every value
  // multiplied by `factor` (a GradScaler's 1/scale; 1.0 changes nothing), then whether all are
  // finite (a mixed-precision overflow; MarkNonFinite then skips the step). A client that holds
  // no rows itself (host mode): UNIMPLEMENTED.
  virtual StatusOr<bool> ScaleRowGradients(const std::string& table, float factor);
  // The sum of the squares of those values (a global gradient norm's share: clipping that
  // covers the rows as well as the dense gradients); inf or NaN where one is not finite.
  virtual StatusOr<double> RowGradientsSquaredNorm(const std::string& table);
  // Drops them (zero_grad): the table's next push carries none of this step's rows, as a step
  // a trainer abandoned must not leak its rows into the next one. Under BSP, a table already
  // pushed in this clock may then be stepped again (nothing is left behind its push).
  virtual Status ClearRowGradients(const std::string& table);

 protected:
  Client() = default;
};

}  // namespace shardps

#endif  // SHARDPS_CLIENT_H_
