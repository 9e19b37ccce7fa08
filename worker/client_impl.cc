#include "worker/client_impl.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <cstring>
#include <thread>

#include <glog/logging.h>

#include "common/crash_point.h"
#include "common/stall_point.h"
#include "common/trace.h"
#include "proto/shard_plan.h"
#include <cmath>
#include "worker/client_internal.h"
#include "worker/client_testing.h"
#include "worker/host_client.h"

namespace shardps {

ClientOptions WithEnvironmentDefaults(ClientOptions o, std::string* sources) {
  std::string from;
  auto take = [&](std::string* field, const char* var, const char* what) {
    const char* v = getenv(var);
    if (v == nullptr || *v == '\0') return false;
    *field = v;
    from += std::string(from.empty() ? "" : ", ") + what + " from " + var;
    return true;
  };
  if (o.coordinator.empty()) take(&o.coordinator, "SHARDPS_COORDINATOR", "coordinator");
  if (o.cluster_token.empty()) take(&o.cluster_token, "SHARDPS_CLUSTER_TOKEN", "cluster token");
  if (o.transport.empty() || o.transport == "auto") {
    take(&o.transport, "SHARDPS_TRANSPORT", "transport");
  }
  if (o.bind_ip.empty()) take(&o.bind_ip, "SHARDPS_BIND_IP", "data-path address");
  if (o.trace_file.empty()) take(&o.trace_file, "SHARDPS_TRACE_FILE", "trace file");
  if (o.requested_rank < 0) {
    for (const char* var :
         {"SHARDPS_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"}) {
      const char* v = getenv(var);
      if (v == nullptr || *v == '\0') continue;
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (*end != '\0' || r < 0 || r > 65535) continue;
      o.requested_rank = static_cast<int>(r);
      from += std::string(from.empty() ? "" : ", ") + "rank " + std::to_string(r) + " from " + var;
      break;
    }
  }
  if (o.aggregator.empty()) take(&o.aggregator, "SHARDPS_AGGREGATOR", "host aggregator");
  if (o.local_rank < 0) {
    for (const char* var : {"SHARDPS_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                            "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
      const char* v = getenv(var);
      if (v == nullptr || *v == '\0') continue;
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (*end != '\0' || r < 0 || r > 65535) continue;
      o.local_rank = static_cast<int>(r);
      from += std::string(from.empty() ? "" : ", ") + "local rank " + std::to_string(r) +
              " from " + var;
      break;
    }
  }
  if (o.busy_poll == ClientOptions().busy_poll) {
    std::string us;
    if (take(&us, "SHARDPS_BUSY_POLL_US", "busy poll")) {
      char* end = nullptr;
      const long long v = std::strtoll(us.c_str(), &end, 10);
      if (*end == '\0' && v >= -1 && v <= 1000000000) {
        o.busy_poll = std::chrono::microseconds(v);
      } else {
        LOG(WARNING) << "SHARDPS_BUSY_POLL_US='" << us
                     << "' is not an integer of microseconds (-1 .. 1e9); keeping "
                     << o.busy_poll.count() << " us";
      }
    }
  }
  // Metrics, for trainers that cannot change code (torchrun): the one place these are read.
  if (o.metrics_port == 0) {
    std::string port;
    if (take(&port, "SHARDPS_METRICS_PORT", "metrics port")) {
      char* end = nullptr;
      const long p = std::strtol(port.c_str(), &end, 10);
      // An unparsable value becomes an out-of-range port: Connect reports it.
      o.metrics_port = (*end == '\0' && p >= -1 && p <= 65535) ? static_cast<int>(p) : -2;
    }
  }
  if (o.metrics_address.empty() || o.metrics_address == "127.0.0.1") {
    take(&o.metrics_address, "SHARDPS_METRICS_ADDRESS", "metrics address");
  }
  if (o.metrics_address_file.empty()) {
    take(&o.metrics_address_file, "SHARDPS_METRICS_ADDRESS_FILE", "metrics address file");
  }
  if (sources != nullptr) *sources = from;
  return o;
}

// The defaults (HostClient: nothing to batch, a push is a copy into shared memory): one call
// each, and on a failure the handles before it waited for, as the contract says.
namespace {

StatusOr<std::vector<Handle>> EachThenWait(
    Client* c, const std::vector<std::string>& names,
    const std::function<StatusOr<Handle>(const std::string&)>& one) {
  std::vector<Handle> hs;
  hs.reserve(names.size());
  for (const std::string& n : names) {
    StatusOr<Handle> h = one(n);
    if (!h.ok()) {
      for (Handle x : hs) (void)c->Wait(x);
      return h.status();
    }
    hs.push_back(*h);
  }
  return hs;
}

}  // namespace

StatusOr<std::vector<Handle>> Client::PushMany(const std::vector<std::string>& names) {
  return EachThenWait(this, names, [this](const std::string& n) { return Push(n); });
}

StatusOr<std::vector<Handle>> Client::PullMany(const std::vector<std::string>& names) {
  return EachThenWait(this, names, [this](const std::string& n) { return Pull(n); });
}

StatusOr<bool> Client::ScaleRowGradients(const std::string& table, float) {
  return UnimplementedError("ScaleRowGradients('" + table + "'): this client holds no rows");
}

StatusOr<double> Client::RowGradientsSquaredNorm(const std::string& table) {
  return UnimplementedError("RowGradientsSquaredNorm('" + table + "'): this client holds no rows");
}

Status Client::ClearRowGradients(const std::string& table) {
  return UnimplementedError("ClearRowGradients('" + table + "'): this client holds no rows");
}

StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& given) {
  std::string sources;
  const ClientOptions options = WithEnvironmentDefaults(given, &sources);
  if (!options.aggregator.empty()) {
    if (!sources.empty()) LOG(INFO) << "client settings from the environment: " << sources;
    return worker::HostClient::Connect(options);
  }
  if (options.coordinator.empty()) {
    return InvalidArgumentError(
        "no coordinator: set ClientOptions.coordinator (Python: Client(coordinator=...)) or "
        "SHARDPS_COORDINATOR");
  }
  if (!sources.empty()) LOG(INFO) << "client settings from the environment: " << sources;
  auto c = std::make_unique<worker::ClientImpl>(options);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<Client>(std::move(c));
}

bool BuiltWithCuda() {
#ifdef SHARDPS_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool IsCudaDeviceMemory(const void* ptr) { return worker::IsCudaDevicePointer(ptr); }

const char* TensorPathName(TensorPath p) {
  switch (p) {
    case TensorPath::kHost:
      return "host";
    case TensorPath::kCudaDirect:
      return "cuda-direct";
    case TensorPath::kCudaStaged:
      return "cuda-staged";
  }
  return "unknown";
}

namespace worker {

using transport::Access;
using SteadyClock = std::chrono::steady_clock;

namespace {

std::string Hostname() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

bool SetPushWeight(Client* client, uint32_t weight) {
  auto* c = dynamic_cast<ClientImpl*>(client);
  if (c == nullptr) return false;
  c->SetPushWeight(weight);
  return true;
}

transport::FabricOptions ClientFabricOptions(const ClientOptions& options) {
  transport::FabricOptions fo;
  fo.provider = options.transport;
  fo.bind_ip = options.bind_ip;
  fo.rdma_device = options.rdma_device;
  fo.rdma_gid_index = options.rdma_gid_index;
  return fo;
}

StatusOr<std::unique_ptr<Client>> ConnectOverFabric(const ClientOptions& options,
                                                    std::unique_ptr<transport::Fabric> fabric) {
  if (fabric == nullptr) return InvalidArgumentError("ConnectOverFabric: null fabric");
  auto c = std::make_unique<ClientImpl>(WithEnvironmentDefaults(options));
  RETURN_IF_ERROR(c->Init(std::move(fabric)));
  return std::unique_ptr<Client>(std::move(c));
}

ClientImpl::~ClientImpl() { Close().IgnoreError(); }

Status ClientImpl::Init(std::unique_ptr<transport::Fabric> fabric) {
  // First: a metrics port that cannot be bound fails Connect before the cluster sees a join.
  ASSIGN_OR_RETURN(metrics_, ClientMetrics::Start(options_));
  if (fabric != nullptr) {
    fabric_ = std::move(fabric);
  } else {
    ASSIGN_OR_RETURN(fabric_, transport::Fabric::Open(ClientFabricOptions(options_)));
  }
  control::ControlClientOptions co;
  co.coordinator_address = options_.coordinator;
  co.cluster_token = options_.cluster_token;
  co.join.set_role(control::ROLE_WORKER);
  co.join.set_hostname(Hostname());
  co.join.set_pid(static_cast<uint32_t>(getpid()));
  co.join.set_transport(fabric_->name());
  co.join.set_requested_rank(options_.requested_rank);
  co.connect_timeout = std::min(options_.setup_timeout, std::chrono::milliseconds(30000));
  co.heartbeat_stats = [board = board_](control::MemberStats* s) {
    s->set_clock(board->clock.load(std::memory_order_relaxed));
    s->set_bytes_pushed(board->bytes_pushed.load(std::memory_order_relaxed));
    s->set_bytes_pulled(board->bytes_pulled.load(std::memory_order_relaxed));
  };
  ASSIGN_OR_RETURN(control_, control::ControlClient::Join(co));
  CrashPoint("worker.after_join");
  rank_ = control_->reply().rank();
  config_ = control_->reply().config();
  if (!options_.trace_file.empty()) {
    RETURN_IF_ERROR(trace_.Begin({options_.trace_file, options_.trace_max_events}));
    if (trace_.owns()) {
      trace::SetIdentity("worker", rank_);
      trace::NameThread("trainer");
      LOG(INFO) << "worker rank " << rank_ << ": tracing to " << trace::CurrentPath();
    }
  }
  LOG(INFO) << "worker rank " << rank_ << ": joined (member " << control_->member_id()
            << "), data path " << fabric_->name() << ", " << consistency();
  return Status::OK();
}

Status ClientImpl::RegisterTensor(const std::string& name, float* weights, float* grads,
                                  const std::vector<int64_t>& shape) {
  return RegisterTensor(name, static_cast<void*>(weights), static_cast<void*>(grads), shape,
                        TensorDType::kFloat32);
}

Status ClientImpl::RegisterTensor(const std::string& name, void* weights, void* grads,
                                  const std::vector<int64_t>& shape, TensorDType dtype) {
  RETURN_IF_ERROR(lifecycle_.Require("RegisterTensor()", {ClientState::kJoined}));
  if (static_cast<uint32_t>(dtype) > static_cast<uint32_t>(TensorDType::kBFloat16)) {
    return InvalidArgumentError("tensor '" + name + "': unknown dtype");
  }
  if (tensor_index_.count(name))
    return AlreadyExistsError("tensor '" + name + "' registered twice");
  if (weights == nullptr || grads == nullptr) return InvalidArgumentError("null tensor buffer");
  Tensor t;
  t.name = name;
  t.weights = weights;
  t.grads = grads;
  t.shape = shape;
  t.dtype = dtype;
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d <= 0) return InvalidArgumentError("tensor '" + name + "' has a dimension <= 0");
    n *= static_cast<uint64_t>(d);
  }
  t.bytes = n * (dtype == TensorDType::kFloat32 ? 4 : 2);
  const bool dw = IsCudaDevicePointer(weights);
  const bool dg = IsCudaDevicePointer(grads);
  if (dw != dg) {
    return InvalidArgumentError("tensor '" + name +
                                "': weights and grads must both be host or both be CUDA memory");
  }
  if (dw) {
    RETURN_IF_ERROR(RegisterDeviceTensor(t));
  } else {
    // Registered once: pulls land straight in `weights`, pushes leave straight from `grads`.
    ASSIGN_OR_RETURN(t.wmr, fabric_->RegisterMemory(weights, t.bytes, Access::kLocalOnly,
                                                    transport::MemoryKind::kHost));
    ASSIGN_OR_RETURN(t.gmr, fabric_->RegisterMemory(grads, t.bytes, Access::kLocalOnly,
                                                    transport::MemoryKind::kHost));
  }
  VLOG(1) << "tensor '" << name << "': " << t.bytes << " bytes, path " << TensorPathName(t.path);
  tensor_index_[name] = static_cast<uint32_t>(tensors_.size());
  tensors_.push_back(std::move(t));
  return Status::OK();
}

Status ClientImpl::RegisterEmbedding(const std::string& name, int64_t rows, int64_t dim,
                                     TensorDType dtype, const EmbeddingOptions& options) {
  RETURN_IF_ERROR(lifecycle_.Require("RegisterEmbedding()", {ClientState::kJoined}));
  if (static_cast<uint32_t>(dtype) > static_cast<uint32_t>(TensorDType::kBFloat16)) {
    return InvalidArgumentError("table '" + name + "': unknown dtype");
  }
  if (tensor_index_.count(name)) return AlreadyExistsError("tensor '" + name + "' registered twice");
  if (rows <= 0 || rows >= (int64_t{1} << 44) || dim <= 0 || dim > kMaxRowDim) {
    return InvalidArgumentError("table '" + name + "': rows must be in [1, 2^44) and dim in [1, " +
                                std::to_string(kMaxRowDim) + "]");
  }
  if (options.max_ids == 0 || options.max_ids > kMaxIdsPerPush) {
    return InvalidArgumentError("table '" + name + "': max_ids must be in [1, " +
                                std::to_string(kMaxIdsPerPush) + "]");
  }
  if (options.hashed && !(options.admit_probability > 0.0f && options.admit_probability <= 1.0f)) {
    return InvalidArgumentError("table '" + name + "': admit_probability must be in (0, 1]");
  }
  if (static_cast<uint32_t>(options.init) > 2 ||
      !(std::isfinite(options.init_scale) && options.init_scale >= 0)) {
    return InvalidArgumentError("table '" + name + "': bad initialiser");
  }
  Tensor t;
  t.name = name;
  t.shape = {rows, dim};
  t.dtype = dtype;
  t.bytes = static_cast<uint64_t>(rows) * static_cast<uint64_t>(dim) *
            (dtype == TensorDType::kFloat32 ? 4 : 2);
  t.embedding = true;
  t.embedding_options = options;
  LOG(INFO) << "row table '" << name << "': " << rows << " x " << dim << " "
            << (dtype == TensorDType::kFloat32 ? "float32" : "16-bit") << ", max_ids "
            << options.max_ids << (options.hashed ? ", hashed ids" : "");
  tensor_index_[name] = static_cast<uint32_t>(tensors_.size());
  tensors_.push_back(std::move(t));
  return Status::OK();
}

StatusOr<uint32_t> ClientImpl::TableIndex(const std::string& name) const {
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  if (!tensors_[t].embedding) {
    return InvalidArgumentError("'" + name + "' is a dense tensor, not a row table");
  }
  return t;
}

Status ClientImpl::PullRows(const std::string& table, const int64_t* ids, size_t n, void* out) {
  RETURN_IF_ERROR(lifecycle_.Require("PullRows()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  RETURN_IF_ERROR(MaybeRecover());
  return rows_->Pull(t, ids, n, out, pull_->RequiredPlus1(), [this] { return RecoverOrBreak(); });
}

Status ClientImpl::AddRowGradients(const std::string& table, const int64_t* ids, size_t n,
                                   const void* grads) {
  RETURN_IF_ERROR(lifecycle_.Require("AddRowGradients()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  return rows_->AddGradients(t, ids, n, grads);
}

void ClientImpl::OnRowsCompletion(uint32_t chunk, uint64_t handle, const Status& err) {
  if (rows_ != nullptr) rows_->OnCompletion(chunk, handle, err);
}

// Device memory: registered with the NIC where the fabric can (verbs: dma-buf, else
// nvidia-peermem), else staged through pinned host mirrors. The choice is logged per tensor.
Status ClientImpl::RegisterDeviceTensor(Tensor& t) {
  auto w =
      fabric_->RegisterMemory(t.weights, t.bytes, Access::kLocalOnly, transport::MemoryKind::kCuda);
  if (w.ok()) {
    auto g =
        fabric_->RegisterMemory(t.grads, t.bytes, Access::kLocalOnly, transport::MemoryKind::kCuda);
    if (g.ok()) {
      t.wmr = std::move(w).value();
      t.gmr = std::move(g).value();
      t.path = TensorPath::kCudaDirect;
      LOG(INFO) << "tensor '" << t.name << "' (" << t.bytes << " bytes, CUDA): path "
                << TensorPathName(t.path) << " (device memory registered with " << fabric_->name()
                << ")";
      return Status::OK();
    }
    w = g.status();
  }
  const Status why = w.status();
  if (options_.cuda_pipeline_bytes == 0) {
    return InvalidArgumentError("cuda_pipeline_bytes must be > 0");
  }
  ASSIGN_OR_RETURN(t.staging,
                   CudaStaging::Create(static_cast<float*>(t.weights), static_cast<float*>(t.grads),
                                       t.bytes, options_.cuda_pipeline_bytes));
  ASSIGN_OR_RETURN(t.wmr,
                   fabric_->RegisterMemory(t.staging->host_weights(), t.bytes, Access::kLocalOnly,
                                           transport::MemoryKind::kHost));
  ASSIGN_OR_RETURN(t.gmr,
                   fabric_->RegisterMemory(t.staging->host_grads(), t.bytes, Access::kLocalOnly,
                                           transport::MemoryKind::kHost));
  t.path = TensorPath::kCudaStaged;
  LOG(INFO) << "tensor '" << t.name << "' (" << t.bytes << " bytes, CUDA): path "
            << TensorPathName(t.path) << " (pinned host pipeline, " << options_.cuda_pipeline_bytes
            << "-byte pieces; direct registration: " << why.message() << ")";
  return Status::OK();
}

StatusOr<TensorPath> ClientImpl::tensor_path(const std::string& name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return NotFoundError("no tensor '" + name + "'");
  return tensors_[it->second].path;
}

StatusOr<const void*> ClientImpl::WeightsView(const std::string& name) const {
  RETURN_IF_ERROR(lifecycle_.Require("WeightsView()", {ClientState::kRunning}));
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end() || tensors_[it->second].embedding) {
    return NotFoundError("no dense tensor '" + name + "'");
  }
  return static_cast<const void*>(tensors_[it->second].weights);
}

uint32_t ClientImpl::num_workers() const {
  uint32_t n = 0;
  const control::Membership membership = control_->membership();
  for (const auto& m : membership.members()) n += m.role() == control::ROLE_WORKER;
  return n;
}

std::string ClientImpl::transport_name() const { return fabric_ ? fabric_->name() : ""; }

ClientCounters ClientImpl::counters() const {
  ClientCounters c;
  const control::ControlCounters cc = control_->counters();
  c.control_messages_sent = cc.other_messages_sent;
  c.heartbeats_sent = cc.heartbeats_sent;
  if (push_ != nullptr) {
    c.pushes = push_->pushes();
    c.bytes_pushed = push_->bytes_pushed();
    c.pushes_resent = push_->pushes_resent();
    c.pushes_lost = push_->pushes_lost();
  }
  if (pull_ != nullptr) {
    c.pulls = pull_->pulls();
    c.pull_retries = pull_->pull_retries();
    c.pull_other_buffer = pull_->pull_other_buffer();
    c.bytes_pulled = pull_->bytes_pulled();
  }
  if (recovery_ != nullptr) {
    c.failovers = recovery_->failovers();
    c.reconnects = recovery_->reconnects();
  }
  if (rows_ != nullptr) {
    c.rows_pulled = rows_->rows_pulled();
    c.row_reads = rows_->row_reads();
    c.row_retries = rows_->row_retries();
    c.rows_pushed = rows_->rows_pushed();
    c.row_cache_hits = rows_->cache_hits();
    c.row_cache_misses = rows_->cache_misses();
    c.row_cache_staleness = rows_->cache_staleness();
  }
  return c;
}

StatusOr<uint32_t> ClientImpl::TensorIndex(const std::string& name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return NotFoundError("no tensor '" + name + "'");
  return it->second;
}

Status ClientImpl::Start() {
  RETURN_IF_ERROR(lifecycle_.Require("Start()", {ClientState::kJoined}));
  if (tensors_.empty()) return FailedPreconditionError("Start() without registered tensors");
  lifecycle_.BeginStart();
  return lifecycle_.FinishStart(StartCluster());
}

Status ClientImpl::StartCluster() {
  RETURN_IF_ERROR(WaitForWorkers());
  ASSIGN_OR_RETURN(const control::ShardMap map, RegisterModel());
  CrashPoint("worker.after_shard_map");
  RETURN_IF_ERROR(ApplyShardMap(map));
  RETURN_IF_ERROR(sessions_->ConnectAll(step_.clock));
  // A server that died after the shard map was published: its group fails over (or is lost)
  // as during training.
  if (sessions_->AnyFailed()) RETURN_IF_ERROR(recovery_->Recover());
  CrashPoint("worker.after_connect");
  // (tests: a restarted rank 0 stopped here while a server it connected to dies)
  StallPoint("worker.after_connect");
  if (rank_ == 0) RETURN_IF_ERROR(PublishInitialWeights());
  RETURN_IF_ERROR(PullInitialWeights());
  CrashPoint("worker.after_first_pull");
  control_baseline_ = control_->counters().other_messages_sent;
  LOG(INFO) << "worker rank " << rank_ << ": started: " << tensors_.size() << " tensors, "
            << chunks_.size() << " chunks on " << sessions_->size() << " servers";
  return Status::OK();
}

// Every expected worker must be there before step 0, or BSP's first steps would average over
// fewer workers than the job has.
Status ClientImpl::WaitForWorkers() {
  // A worker joining a running cluster (elastic growth, a restarted worker) starts at once.
  if (control_->reply().cluster_started()) return Status::OK();
  const uint32_t want = std::max<uint32_t>(1, config_.num_workers());
  auto ready = control_->WaitFor(
      [&](const control::Membership& m) {
        // All there now, or all there at some point (the others may have finished already).
        uint32_t n = 0;
        for (const auto& mem : m.members()) n += mem.role() == control::ROLE_WORKER;
        return n >= want || m.workers_complete();
      },
      options_.setup_timeout);
  if (!ready.ok()) {
    return ready.status().WithContext("waiting for " + std::to_string(want) + " workers to join");
  }
  return Status::OK();
}

StatusOr<control::ShardMap> ClientImpl::RegisterModel() {
  control::Envelope reg;
  for (const Tensor& t : tensors_) {
    control::TensorSpecProto* p = reg.mutable_register_model()->add_tensors();
    p->set_name(t.name);
    p->set_dtype(static_cast<uint32_t>(t.dtype));
    for (int64_t d : t.shape) p->add_shape(d);
    if (t.embedding) {
      p->set_embedding(true);
      p->set_max_ids(t.embedding_options.max_ids);
      p->set_init(static_cast<uint32_t>(t.embedding_options.init));
      p->set_init_scale(t.embedding_options.init_scale);
      p->set_init_seed(t.embedding_options.init_seed);
      p->set_hashed(t.embedding_options.hashed);
      p->set_admit_probability(t.embedding_options.admit_probability);
    }
  }
  // Again after every rejoin until the map arrives: a coordinator that died before saving the
  // registration would never send it.
  RETURN_IF_ERROR(control_->SendAndRepeatOnRejoin(reg));
  auto got = control_->WaitMessage(control::Envelope::kShardMap, options_.setup_timeout);
  control_->Forget(control::Envelope::kRegisterModel);
  ASSIGN_OR_RETURN(control::Envelope env, std::move(got));
  const control::ShardMap& map = env.shard_map();
  if (map.tensors_size() != static_cast<int>(tensors_.size())) {
    return FailedPreconditionError("shard map names a different model");
  }
  for (int i = 0; i < map.tensors_size(); ++i) {
    if (map.tensors(i).name() != tensors_[i].name) {
      return FailedPreconditionError("shard map tensor " + std::to_string(i) + " is '" +
                                     map.tensors(i).name() + "', not '" + tensors_[i].name + "'");
    }
  }
  if (rank_ >= map.max_workers()) {
    return ResourceExhaustedError("worker rank " + std::to_string(rank_) +
                                  " has no inbox slot (max_workers " +
                                  std::to_string(map.max_workers()) + ")");
  }
  return map;
}

Status ClientImpl::ApplyShardMap(const control::ShardMap& map) {
  const uint64_t num_servers = static_cast<uint64_t>(map.servers_size());
  chunks_.resize(map.chunks_size());
  // A row table's shard count: its chunks in the map.
  std::vector<uint32_t> shards(tensors_.size(), 0);
  for (const auto& ce : map.chunks()) {
    if (ce.tensor() < tensors_.size()) ++shards[ce.tensor()];
  }
  for (const auto& ce : map.chunks()) {
    if (ce.tensor() < tensors_.size() && tensors_[ce.tensor()].embedding) {
      // A row shard: offset is its index k, bytes its rows' values.
      const Tensor& t = tensors_[ce.tensor()];
      const uint32_t k = static_cast<uint32_t>(ce.offset());
      layout::RowGeometry g;
      g.table_rows = static_cast<uint64_t>(t.shape[0]);
      g.shards = shards[ce.tensor()];
      g.shard = k;
      g.hashed = t.embedding_options.hashed;
      g.rows = layout::RowGeometry::ShardRows(g.table_rows, g.shards, k, g.hashed);
      g.dim = static_cast<uint32_t>(t.shape[1]);
      g.elem_bytes = t.dtype == TensorDType::kFloat32 ? 4 : 2;
      g.max_ids = t.embedding_options.max_ids;
      if (ce.chunk_id() >= chunks_.size() || ce.server_rank() >= num_servers ||
          ce.slot() >= chunks_.size() || ce.offset() >= g.shards || g.rows == 0 ||
          ce.bytes() != g.rows * g.row_value_bytes()) {
        return InvalidArgumentError("shard map: row shard out of range");
      }
      ChunkPlacement& c = chunks_[ce.chunk_id()];
      c.id = ce.chunk_id();
      c.tensor = ce.tensor();
      c.offset = k;
      c.bytes = ce.bytes();
      c.server = ce.server_rank();
      c.slot = ce.slot();
      c.rows = g;
      tensors_[c.tensor].chunks.push_back(c.id);
      continue;
    }
    // The map comes from the coordinator, a peer: every index and range is checked before use
    // (a slot beyond the chunk count, or an offset + bytes that wraps, would index out of bounds).
    if (ce.chunk_id() >= chunks_.size() || ce.tensor() >= tensors_.size() ||
        ce.server_rank() >= num_servers || ce.slot() >= chunks_.size() || ce.bytes() == 0 ||
        ce.bytes() % (tensors_[ce.tensor()].dtype == TensorDType::kFloat32 ? 4 : 2) != 0 ||
        ce.offset() > tensors_[ce.tensor()].bytes ||
        ce.bytes() > tensors_[ce.tensor()].bytes - ce.offset()) {
      return InvalidArgumentError("shard map: chunk out of range");
    }
    ChunkPlacement& c = chunks_[ce.chunk_id()];
    c.id = ce.chunk_id();
    c.tensor = ce.tensor();
    c.offset = ce.offset();
    c.bytes = ce.bytes();
    c.server = ce.server_rank();
    c.slot = ce.slot();
    tensors_[c.tensor].chunks.push_back(c.id);
  }
  CompletionSink& sink = *this;
  sessions_ = std::make_unique<ServerSessions>(options_, *fabric_, *control_, rank_, sink);
  pull_ = std::make_unique<PullPipeline>(options_, config_, *sessions_, tensors_, chunks_, handles_,
                                         step_);
  push_ = std::make_unique<PushPipeline>(options_, config_, *control_, rank_, *sessions_, tensors_,
                                         chunks_, handles_, step_, *pull_);
  recovery_ = std::make_unique<Recovery>(options_, config_, *control_, rank_, *sessions_, *push_,
                                         *pull_, step_);
  sessions_->set_departure_check([this] { recovery_->NoteDepartures(); });
  RETURN_IF_ERROR(sessions_->Configure(map, chunks_));
  rows_ = std::make_unique<RowTables>(options_, *fabric_, *sessions_, tensors_, chunks_, step_);
  RETURN_IF_ERROR(rows_->Setup());
  push_->set_row_tables(rows_.get());
  const uint64_t small_push = push_->SmallStagingBytes();
  ASSIGN_OR_RETURN(const uint64_t small,
                   sessions_->AllocateStaging(small_push + pull_->SpareStagingBytes()));
  push_->PlaceSmallStaging(small);
  pull_->PlaceSpareStaging(small + small_push);
  return Status::OK();
}

// Rank 0 writes its initial weights into its own inbox slot of parity 0 of every dense chunk
// (ImmKind::kInit); a server takes them for a chunk without weights and ignores them otherwise.
// A rank 0 that joins a running cluster (it was restarted) must not write where a chunk has
// weights: its dead predecessor's BSP push of a clock not yet complete may lie in that slot
// (pushes with an even sequence number do), summed only when every worker's push of that clock
// is in, and the init bytes would replace the gradient. So it reads every dense chunk's header
// first and publishes only to chunks whose version is 0. Then no worker has pushed anything
// yet: every worker's Start pulls every chunk, and waits while one has no weights, before its
// first push (RestartAheadTest.ARestartedRankZeroLeavesItsPredecessorsPendingPushAlone).
//
// The writes are confirmed: a write completes once its bytes are in the server's memory, and a
// server that dies before it applies them (and replicates the version) leaves its backup
// without weights, which nobody would write again: every worker's first pull would wait for
// them until its timeout. So rank 0 reads the headers back until every chunk it wrote shows a
// version (published only once the backup has the record); a server that fails meanwhile is
// failed over and the chunks still without weights are written again there.
Status ClientImpl::PublishInitialWeights() {
  std::vector<char> publish(chunks_.size(), 1);
  // A server may die between the connect and these operations (a restarted rank 0 that
  // arrives during a failover, or a primary that dies as it takes the initial weights): its
  // group is failed over, as during training, and the operations are made again on whoever
  // serves it then. Reads are idempotent, and so is the init write (a server ignores an init
  // for a chunk that has weights).
  auto with_recovery = [&](const char* what, const std::function<Status()>& ops) -> Status {
    for (int attempt = 1;; ++attempt) {
      Status st = ops();
      if (st.ok() || !sessions_->MarkFailed() || attempt > kStartRecoveries) return st;
      LOG(WARNING) << "worker rank 0: " << what << " failed (" << st.ToString()
                   << "); recovering the failed server group(s), attempt " << attempt;
      RETURN_IF_ERROR(recovery_->Recover());
    }
  };
  if (control_->reply().cluster_started()) {
    RETURN_IF_ERROR(with_recovery("reading the chunk headers", [&]() -> Status {
      ASSIGN_OR_RETURN(const int missing, ChunksWithoutWeights(nullptr, &publish));
      const int dense = static_cast<int>(std::count_if(
          chunks_.begin(), chunks_.end(), [](const ChunkPlacement& c) { return !c.rows.rows_kind(); }));
      LOG(INFO) << "worker rank 0: joined a running cluster: " << dense - missing
                << " dense chunk(s) have weights (left alone), " << missing
                << " get the initial weights";
      return Status::OK();
    }));
  }
  for (Tensor& t : tensors_) {
    if (t.staging != nullptr) RETURN_IF_ERROR(t.staging->WeightsToHost());
  }
  return with_recovery("publishing the initial weights", [&]() -> Status {
    sessions_->BeginSetupOps();
    int posted = 0;
    for (const ChunkPlacement& c : chunks_) {
      if (c.rows.rows_kind()) continue;  // row shards are initialised by their servers
      if (!publish[c.id]) continue;
      ++posted;
      ServerSession& s = sessions_->at(c.server);
      if (!s.ep) return sessions_->ServerError(c.server, "not connected");
      RETURN_IF_ERROR(sessions_->PostWithCredit([&] {
        return s.ep->PostWriteImm(
            {tensors_[c.tensor].wmr.get(), c.offset, c.bytes},
            transport::AtOffset(s.inbox, s.layout->push_data_offset(0, c.slot, 0)),
            layout::MakeImm(layout::ImmKind::kInit, c.slot), sessions_->setup_context(c.id));
      }));
    }
    RETURN_IF_ERROR(sessions_->WaitSetupOps(posted));
    // Confirmed chunk by chunk: a retry after a failover writes only those still without.
    const auto deadline = SteadyClock::now() + options_.wait_timeout;
    for (int missing = posted; missing > 0;) {
      std::vector<char> still(chunks_.size(), 0);
      ASSIGN_OR_RETURN(missing, ChunksWithoutWeights(&publish, &still));
      publish.swap(still);
      if (missing == 0) break;
      if (SteadyClock::now() > deadline) {
        return DeadlineExceededError(std::to_string(missing) +
                                     " chunk(s) did not publish the initial weights within " +
                                     std::to_string(options_.wait_timeout.count()) + " ms");
      }
      RETURN_IF_ERROR(sessions_->ProgressOrSleep(std::chrono::microseconds(200)));
    }
    return Status::OK();
  });
}

// Reads the headers of the dense chunks `which` selects (all of them when null), posted
// together; (*missing)[id] = 1 for those that have no weights yet (version 0). Returns how many.
StatusOr<int> ClientImpl::ChunksWithoutWeights(const std::vector<char>* which,
                                               std::vector<char>* missing) {
  auto wanted = [&](const ChunkPlacement& c) {
    return !c.rows.rows_kind() && (which == nullptr || (*which)[c.id]);
  };
  sessions_->BeginSetupOps();
  int reads = 0;
  for (const ChunkPlacement& c : chunks_) {
    if (!wanted(c)) continue;
    ++reads;
    ServerSession& s = sessions_->at(c.server);
    if (!s.ep) return sessions_->ServerError(c.server, "not connected");
    RETURN_IF_ERROR(sessions_->PostWithCredit([&] {
      return s.ep->PostRead(
          {sessions_->staging(), sessions_->ChunkStagingOffset(c.id, 2), layout::kAlign},
          transport::AtOffset(s.weights, s.layout->header_offset(c.slot)),
          sessions_->setup_context(c.id));
    }));
  }
  RETURN_IF_ERROR(sessions_->WaitSetupOps(reads));
  int n = 0;
  for (const ChunkPlacement& c : chunks_) {
    const bool none =
        wanted(c) && (reinterpret_cast<const layout::ChunkHeader*>(sessions_->ChunkStaging(c.id, 2))
                          ->state.load(std::memory_order_relaxed) >> 1) == 0;
    (*missing)[c.id] = none ? 1 : 0;
    n += none ? 1 : 0;
  }
  return n;
}

Status ClientImpl::PullInitialWeights() {
  for (uint32_t t = 0; t < tensors_.size(); ++t) {
    if (tensors_[t].embedding) continue;  // read by rows, when a batch needs them
    ASSIGN_OR_RETURN(Handle h, Pull(tensors_[t].name));
    RETURN_IF_ERROR(Wait(h));
  }
  // A worker that joins a running cluster (elastic growth, or a restarted worker) starts at the
  // cluster's clock: the weights it pulled contain every push of the clocks before it.
  const uint64_t cluster_clock = pull_->ClusterClock();
  if (cluster_clock > step_.clock) {
    LOG(INFO) << "worker rank " << rank_ << ": joined a running cluster at clock " << cluster_clock;
    step_.clock = cluster_clock;
    PublishBoard();
    for (uint32_t s = 0; s < sessions_->size(); ++s) {
      RETURN_IF_ERROR(sessions_->SendClock(s, step_.clock));
    }
    // The cluster's clock is the furthest chunk's: another chunk may not have applied the
    // clocks before it yet (a live worker's push of them still on its way). Pull again under
    // the mode's bound at the new clock, so that the weights it starts from hold every push of
    // the clocks it skipped, on every chunk (BSP: min_clock >= clock - 1 everywhere). Without
    // it, a restarted worker's first push could reach a lagging chunk before the others' push
    // of the clock it skipped (the server now holds such a push back: ConsistencyGate::OnPush).
    // SHARDPS_TEST_NO_CATCH_UP_PULL=1 (tests only) skips it, so that the servers' own hold
    // on such a push is tested alone.
    static const bool skip = [] {
      const char* v = std::getenv("SHARDPS_TEST_NO_CATCH_UP_PULL");
      return v != nullptr && std::string(v) == "1";
    }();
    for (uint32_t t = 0; t < tensors_.size() && !skip; ++t) {
      if (tensors_[t].embedding) continue;
      ASSIGN_OR_RETURN(Handle h, Pull(tensors_[t].name));
      RETURN_IF_ERROR(Wait(h));
    }
  }
  return Status::OK();
}

void ClientImpl::OnPushCompletion(uint32_t chunk, uint64_t handle, const Status& err) {
  push_->OnCompletion(chunk, handle, err);
}

void ClientImpl::OnPullCompletion(uint32_t chunk, uint64_t handle, const Status& err) {
  pull_->OnCompletion(chunk, handle, err);
}

Status ClientImpl::MaybeRecover() {
  const ClientState st = lifecycle_.state();
  if (st != ClientState::kStarting && st != ClientState::kRunning) return Status::OK();
  return lifecycle_.Break(recovery_->MaybeRecover());
}

Status ClientImpl::RecoverOrBreak() { return lifecycle_.Break(recovery_->Recover()); }

StatusOr<Handle> ClientImpl::Push(const std::string& name) {
  RETURN_IF_ERROR(lifecycle_.Require("Push()", {ClientState::kRunning}));
  // "@N": the Nth tensor push of this process (Step() pushes its tensors in order).
  CrashPoint("worker.before_push");
  StallPoint("worker.before_push");
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  ASSIGN_OR_RETURN(const PushScope scope, ScopeOfPush(t, /*step=*/false, "Push()"));
  RETURN_IF_ERROR(MaybeRecover());
  return push_->Push(t, [this] { return RecoverOrBreak(); }, scope == PushScope::kMissing);
}

StatusOr<bool> ClientImpl::ScaleRowGradients(const std::string& table, float factor) {
  RETURN_IF_ERROR(lifecycle_.Require("ScaleRowGradients()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  return rows_->ScalePending(t, factor);
}

StatusOr<double> ClientImpl::RowGradientsSquaredNorm(const std::string& table) {
  RETURN_IF_ERROR(lifecycle_.Require("RowGradientsSquaredNorm()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  return rows_->SquaredNormOfPending(t);
}

Status ClientImpl::ClearRowGradients(const std::string& table) {
  RETURN_IF_ERROR(lifecycle_.Require("ClearRowGradients()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TableIndex(table));
  rows_->DropPending(t);
  return Status::OK();
}

// BSP sums one gradient per worker per chunk per clock: a second push of a chunk in the same
// clock would replace the first at the server (its inbox slot's header names the same clock),
// and the first's gradient would be lost without an error. ASP and SSP apply every push, so
// Step() must not push again what was pushed in its clock: it would count twice.
StatusOr<ClientImpl::PushScope> ClientImpl::ScopeOfPush(uint32_t t, bool step,
                                                        const char* what) const {
  const PushPipeline::PushedCount pushed = push_->PushedThisClock(t);
  if (pushed.none()) return PushScope::kAll;
  const bool rows_behind = push_->RowsBehindPush(t);
  // A push that failed part way (a chunk's inbox slot never freed in time) is completed by the
  // tensor's next push, in every mode: the chunks it left out, not again those it sent.
  if (!pushed.all() && !rows_behind) return PushScope::kMissing;
  if (config_.mode() != control::BSP) {
    return !step || rows_behind ? PushScope::kAll : PushScope::kNone;
  }
  if (step && !rows_behind) return PushScope::kNone;
  return FailedPreconditionError(
      std::string(what) + ": '" + tensors_[t].name + "' was already pushed at clock " +
      std::to_string(step_.clock) +
      (rows_behind ? " and gradient rows were added behind its push" : "") +
      ": under BSP a tensor's gradient is pushed once per clock (by Push or by Step, not both; "
      "Step does not push again what Push sent), and a second push would replace the first. "
      "Clock() (Step does) before pushing it again" +
      (rows_behind ? ", or drop those rows (ClearRowGradients)" : ""));
}

StatusOr<Handle> ClientImpl::Pull(const std::string& name) {
  // kStarting: Start() pulls the initial weights.
  RETURN_IF_ERROR(lifecycle_.Require("Pull()", {ClientState::kStarting, ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  if (tensors_[t].embedding) {
    return InvalidArgumentError("'" + name + "' is a row table: read it with PullRows");
  }
  RETURN_IF_ERROR(MaybeRecover());
  return pull_->Pull(t);
}

// PushMany / PullMany: the tensors' posts go with kMore (transport.h) and leave together when
// the burst ends, by the poll below, before the call returns (a poll also flushes whatever an
// early return left queued). On a failure the handles before it are waited for.
StatusOr<std::vector<Handle>> ClientImpl::Many(const char* what,
                                               const std::vector<std::string>& names,
                                               bool push) {
  if (push) {
    RETURN_IF_ERROR(lifecycle_.Require(what, {ClientState::kRunning}));
  } else {  // kStarting: Start() pulls the initial weights
    RETURN_IF_ERROR(lifecycle_.Require(what, {ClientState::kStarting, ClientState::kRunning}));
  }
  std::vector<uint32_t> ts;
  ts.reserve(names.size());
  for (const std::string& n : names) {
    ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(n));
    if (!push && tensors_[t].embedding) {
      return InvalidArgumentError("'" + n + "' is a row table: read it with PullRows");
    }
    ts.push_back(t);
  }
  return PostBurst(ts, push, /*step=*/false);
}

StatusOr<std::vector<Handle>> ClientImpl::PostBurst(const std::vector<uint32_t>& all, bool push,
                                                    bool step) {
  // Step() pushes what this clock has not pushed yet, in every mode (ScopeOfPush). Every
  // tensor's scope is decided before anything is posted: a refusal posts nothing.
  std::vector<uint32_t> ts;
  std::vector<bool> only_missing;
  ts.reserve(all.size());
  for (uint32_t t : all) {
    if (push) {
      ASSIGN_OR_RETURN(const PushScope scope, ScopeOfPush(t, step, step ? "Step()" : "PushMany()"));
      if (scope == PushScope::kNone) continue;
      only_missing.push_back(scope == PushScope::kMissing);
    }
    ts.push_back(t);
  }
  std::vector<Handle> hs;
  hs.reserve(ts.size());
  Status failed;
  if (push) push_->Prestart(ts);
  push ? push_->set_more(true) : pull_->set_more(true);
  for (size_t i = 0; i < ts.size(); ++i) {
    const uint32_t t = ts[i];
    if (push && step) {
      // "@N": the Nth tensor push of this process, as Push(name) counts them. A crash or a
      // stall here comes after the pushes before it have left ("between two pushes").
      if (CrashPointDue("worker.before_push") || StallPointDue("worker.before_push")) {
        (void)sessions_->Progress();
      }
      CrashPoint("worker.before_push");
      StallPoint("worker.before_push");
    }
    // The client broke during the tensors before this one (a push's recovery found its group
    // lost): stop here with the cause, as Push(name) refuses once broken. Going on would wait
    // for a failover again at every later tensor of that group.
    if (lifecycle_.state() == ClientState::kBroken) {
      failed = lifecycle_.cause();
      break;
    }
    // As Push(name) and Pull(name) do: a server that failed during the tensors before this
    // one is recovered (or the client breaks) before this one is posted.
    if (failed = MaybeRecover(); !failed.ok()) break;
    StatusOr<Handle> h =
        push ? push_->Push(t, [this] { return RecoverOrBreak(); }, only_missing[i])
             : pull_->Pull(t);
    if (!h.ok()) {
      failed = h.status();
      break;
    }
    hs.push_back(*h);
    // A push that failed part way (a chunk's inbox slot never freed): stop here, as a refused
    // one does; the chunks it left out go with the next push of the tensor.
    if (push && !(failed = push_->ErrorOf(*h)).ok()) break;
  }
  push ? push_->set_more(false) : pull_->set_more(false);
  if (push) push_->CancelPrestart();  // those no Push took (an early failure)
  Status polled = sessions_->Progress();  // sends what kMore held back
  if (failed.ok()) failed = polled;
  if (!failed.ok()) {
    for (Handle h : hs) (void)Wait(h);
    return failed;
  }
  return hs;
}

StatusOr<std::vector<Handle>> ClientImpl::PushMany(const std::vector<std::string>& names) {
  return Many("PushMany()", names, /*push=*/true);
}

StatusOr<std::vector<Handle>> ClientImpl::PullMany(const std::vector<std::string>& names) {
  return Many("PullMany()", names, /*push=*/false);
}

Status ClientImpl::Wait(Handle handle) {
  RETURN_IF_ERROR(lifecycle_.Require("Wait()", {ClientState::kStarting, ClientState::kRunning}));
  HandleState* hs = handles_.Find(handle.id);
  if (hs == nullptr) return NotFoundError("unknown handle");
  trace::Span span("wait", "worker");
  span.Arg("handle", handle.id).Arg("clock", step_.clock);
  // Bounded: every pending chunk has its own deadline, and endpoints fail within the
  // transport's bound when a server dies (their operations then complete in error). Two
  // backstops: an endpoint that has been in the error state for a grace period fails the wait
  // with its error even if a completion never arrived, and an absolute deadline.
  const auto deadline = SteadyClock::now() + options_.wait_timeout + std::chrono::seconds(30);
  auto next_check = SteadyClock::now();
  IdleClock idle(options_.busy_poll);
  auto pending = hs->pending;
  while (hs->pending > 0) {
    // Polls; after options.busy_poll with none of this handle's chunks finishing, sleeps until
    // a completion, the next header re-read, or 1 ms (the endpoint checks' pace is 50 ms).
    RETURN_IF_ERROR(sessions_->ProgressOrSleep(idle.Idle()
                                                   ? pull_->UntilTick(std::chrono::milliseconds(1))
                                                   : std::chrono::microseconds(0)));
    if (hs->pending != pending) {
      pending = hs->pending;
      idle.Progressed();
    }
    pull_->Tick();  // header re-reads whose backoff has passed
    if (sessions_->AnyFailed() && !recovery_->recovering()) {
      RETURN_IF_ERROR(MaybeRecover());
      continue;
    }
    const auto now = SteadyClock::now();
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(50);
      RETURN_IF_ERROR(CheckEndpoints(now));
      // A server declared dead whose endpoint still looks healthy (stopped, cut off).
      if (!recovery_->recovering()) RETURN_IF_ERROR(MaybeRecover());
    }
    if (now > deadline) return WaitTimedOut(*hs);
  }
  Status s = hs->error;
  if (hs->staged_pull_tensor >= 0) {
    Status synced = tensors_[hs->staged_pull_tensor].staging->SyncWeights();
    if (s.ok()) s = synced;
  }
  handles_.Erase(handle.id);
  // Outside Step() (which publishes once at its end): at most every 100 ms.
  if (metrics_ && !step_.in_step && metrics_->PublishDue()) {
    metrics_->Publish(counters(), rank_, step_.clock);
  }
  return s;
}

Status ClientImpl::CheckEndpoints(SteadyClock::time_point now) {
  constexpr auto kErrorGrace = std::chrono::seconds(2);
  for (uint32_t i = 0; i < sessions_->size(); ++i) {
    const ServerSession& sv = sessions_->at(i);
    if (!sv.ep || sv.ep->status().ok()) {
      errored_since_.erase(i);
      continue;
    }
    if (!recovery_->recovering()) {
      RETURN_IF_ERROR(MaybeRecover());
      continue;
    }
    auto [e, fresh] = errored_since_.emplace(i, now);
    if (!fresh && now - e->second > kErrorGrace && sv.ep->outstanding() > 0) {
      return lifecycle_.Break(
          sessions_->ServerError(i, "endpoint failed with operations still outstanding"));
    }
  }
  return Status::OK();
}

Status ClientImpl::WaitTimedOut(const HandleState& hs) const {
  std::string who;
  for (uint32_t i = 0; i < sessions_->size(); ++i) {
    const ServerSession& sv = sessions_->at(i);
    if (!sv.ep || sv.ep->outstanding() == 0) continue;
    who += "; server rank " + std::to_string(sv.rank) + " at " + sv.address + ": " +
           std::to_string(sv.ep->outstanding()) + " operations outstanding, endpoint " +
           (sv.ep->status().ok() ? std::string("healthy") : sv.ep->status().ToString());
  }
  return DeadlineExceededError("Wait timed out with " + std::to_string(hs.pending) +
                               " chunks outstanding" + who);
}

Status ClientImpl::SetLearningRate(const std::string& tensor, float lr) {
  if (!(lr >= 0.0f && lr < 1e6f)) {
    return InvalidArgumentError("learning rate " + std::to_string(lr) + " is out of [0, 1e6)");
  }
  if (tensor.empty()) {
    for (Tensor& t : tensors_) t.rule.lr = lr;
    return Status::OK();
  }
  auto it = tensor_index_.find(tensor);
  if (it == tensor_index_.end()) return NotFoundError("no tensor '" + tensor + "' registered");
  tensors_[it->second].rule.lr = lr;
  return Status::OK();
}

Status ClientImpl::SetUpdateRule(const std::string& tensor, const UpdateRule& rule) {
  layout::UpdateRule w;
  w.kind_flags = static_cast<uint32_t>(rule.kind) | (rule.nesterov ? layout::kRuleNesterov : 0);
  w.lr = rule.lr;
  w.momentum = rule.momentum;
  w.dampening = rule.dampening;
  w.weight_decay = rule.weight_decay;
  w.beta1 = rule.beta1;
  w.beta2 = rule.beta2;
  w.eps = rule.eps;
  if (rule.kind == UpdateRule::Kind::kAdagrad) {
    w.momentum = rule.lr_decay;  // the wire's Adagrad fields (wire/region_layout.h)
    w.dampening = rule.initial_accumulator_value;
  }
  if (const char* bad = layout::CheckUpdateRule(w)) {
    return InvalidArgumentError(std::string("update rule for '") + tensor + "': " + bad);
  }
  if (tensor.empty()) {
    for (Tensor& t : tensors_) {
      if (!t.embedding) t.rule = w;
    }
    return Status::OK();
  }
  auto it = tensor_index_.find(tensor);
  if (it == tensor_index_.end()) return NotFoundError("no tensor '" + tensor + "' registered");
  if (tensors_[it->second].embedding) {
    if (const char* bad = layout::CheckRowRule(w)) {
      return InvalidArgumentError("update rule for row table '" + tensor + "': " + bad);
    }
  }
  tensors_[it->second].rule = w;
  return Status::OK();
}

Status ClientImpl::SetNoGradient(const std::string& name, bool no_gradient) {
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  if (tensors_[t].embedding) {
    return InvalidArgumentError("'" + name + "' is a row table: its pushes carry only the rows "
                                "a step touched");
  }
  tensors_[t].no_gradient = no_gradient;
  return Status::OK();
}

Status ClientImpl::SetState(const std::string& name, StatePart part, uint64_t steps) {
  RETURN_IF_ERROR(lifecycle_.Require("SetState()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  if (static_cast<uint32_t>(part) < 1 || static_cast<uint32_t>(part) > 4) {
    return InvalidArgumentError("unknown state part");
  }
  if (tensors_[t].embedding) {
    return UnimplementedError("state transfer of row table '" + name +
                              "' (its rows are in the servers' checkpoints)");
  }
  RETURN_IF_ERROR(MaybeRecover());
  // A CUDA tensor staged through host memory: its gradient buffer reaches the mirror first.
  RETURN_IF_ERROR(push_->StageForStateTransfer(t));
  const auto op = static_cast<layout::PushOp>(part);  // the same numbers
  for (uint32_t id : tensors_[t].chunks) {
    RETURN_IF_ERROR(push_->PushOpAndAwait(id, op, steps, [this] { return RecoverOrBreak(); }));
  }
  return Status::OK();
}

Status ClientImpl::SetStateValues(const std::string& name, StatePart part, const float* values,
                                  uint64_t steps) {
  RETURN_IF_ERROR(lifecycle_.Require("SetStateValues()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  if (part != StatePart::kWeights && part != StatePart::kState1 && part != StatePart::kState2) {
    return InvalidArgumentError("SetStateValues of '" + name +
                                "': the part is the weights or a state buffer");
  }
  if (values == nullptr) return InvalidArgumentError("SetStateValues of '" + name + "': no values");
  if (tensors_[t].embedding) {
    return InvalidArgumentError("SetStateValues of row table '" + name + "': use SetRows");
  }
  RETURN_IF_ERROR(MaybeRecover());
  const Tensor& tensor = tensors_[t];
  const uint64_t esize = tensor.dtype == TensorDType::kFloat32 ? 4 : 2;
  // Every push acknowledged first: none may still be resent from the staging rewritten here.
  RETURN_IF_ERROR(push_->AwaitAllAcked([this] { return RecoverOrBreak(); }));
  uint64_t most = 0;
  for (uint32_t id : tensor.chunks) most = std::max(most, chunks_[id].bytes / esize * 4);
  if (values_staging_ == nullptr || values_staging_->length() < most) {
    values_staging_.reset();
    ASSIGN_OR_RETURN(values_staging_,
                     fabric_->AllocateMemory(std::max<uint64_t>(most, layout::kAlign),
                                             transport::Access::kLocalOnly));
  }
  const auto op = static_cast<layout::PushOp>(part);  // the same numbers
  for (uint32_t id : tensor.chunks) {
    const ChunkPlacement& c = chunks_[id];
    const uint64_t elems = c.bytes / esize;
    // The chunk's values stay whole in the staging while its ranges are pushed: a range
    // resent after a failover finds its own bytes.
    std::memcpy(values_staging_->data(), values + c.offset / esize, elems * 4);
    // As many float32 values per push as the inbox slot holds (AlignUp'd: at least 16).
    const uint64_t per_push =
        sessions_->at(c.server).layout->push_capacity(c.slot) / sizeof(float);
    for (uint64_t first = 0; first < elems; first += per_push) {
      const uint64_t n = std::min(per_push, elems - first);
      const PushPipeline::F32Values v{{values_staging_.get(), first * 4, n * 4}, first};
      RETURN_IF_ERROR(
          push_->PushOpAndAwait(id, op, steps, [this] { return RecoverOrBreak(); }, &v));
    }
  }
  return Status::OK();
}

Status ClientImpl::GetState(const std::string& name, float* weights, float* state1,
                            float* state2, uint64_t* steps, bool* has1, bool* has2) {
  RETURN_IF_ERROR(lifecycle_.Require("GetState()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(name));
  if (tensors_[t].embedding) {
    return UnimplementedError("state transfer of row table '" + name +
                              "' (its rows are in the servers' checkpoints)");
  }
  RETURN_IF_ERROR(MaybeRecover());
  const Tensor& tensor = tensors_[t];
  const uint64_t esize = tensor.dtype == TensorDType::kFloat32 ? 4 : 2;
  uint64_t most = 0;
  for (const ChunkPlacement& c : chunks_) {
    if (c.rows.rows_kind()) continue;  // a row shard's answers are sized by rows (GetRows)
    const uint64_t e = c.bytes / (tensors_[c.tensor].dtype == TensorDType::kFloat32 ? 4 : 2);
    most = std::max(most, layout::OutboxBytes(e * sizeof(float)));
  }
  RETURN_IF_ERROR(EnsureStateStaging(layout::AlignUp(most) + layout::kAlign));
  bool all1 = !tensor.chunks.empty(), all2 = all1;
  uint64_t most_steps = 0;
  const auto* base = static_cast<const char*>(state_staging_->data());
  for (uint32_t id : tensor.chunks) {
    const ChunkPlacement& c = chunks_[id];
    const uint64_t elems = c.bytes / esize;
    const uint64_t stride = layout::AlignUp(elems * sizeof(float));
    const uint64_t at = c.offset / esize;  // elements into the tensor
    layout::OutboxHeader oh{};
    // The server has one outbox: another worker's request may overwrite it between this
    // worker's acknowledgement and its read; the nonce shows it, and the request is repeated.
    bool got = false;
    const auto until = std::chrono::steady_clock::now() + options_.wait_timeout;
    for (int attempt = 0; !got && OutboxRetry(attempt, until); ++attempt) {
      const uint64_t nonce = (static_cast<uint64_t>(rank_) << 48) | ++state_nonce_;
      RETURN_IF_ERROR(push_->PushOpAndAwait(id, layout::PushOp::kGetState, nonce,
                                            [this] { return RecoverOrBreak(); }));
      ASSIGN_OR_RETURN(const bool mine,
                       ReadOwnOutbox(c.server, layout::OutboxBytes(elems * sizeof(float)), nonce,
                                     id, &oh));
      got = mine && oh.elems == elems;
    }
    if (!got) return AbortedError("state of '" + name + "': the servers' outboxes stayed busy");
    if (weights != nullptr) std::memcpy(weights + at, base + layout::kAlign, elems * 4);
    const bool h1 = oh.state1 == elems, h2 = oh.state2 == elems;
    if (state1 != nullptr && h1) std::memcpy(state1 + at, base + layout::kAlign + stride, elems * 4);
    if (state2 != nullptr && h2) {
      std::memcpy(state2 + at, base + layout::kAlign + 2 * stride, elems * 4);
    }
    all1 = all1 && h1;
    all2 = all2 && h2;
    most_steps = std::max(most_steps, oh.steps);
  }
  if (steps != nullptr) *steps = most_steps;
  if (has1 != nullptr) *has1 = all1;
  if (has2 != nullptr) *has2 = all2;
  return Status::OK();
}

Status ClientImpl::Clock() {
  RETURN_IF_ERROR(lifecycle_.Require("Clock()", {ClientState::kRunning}));
  ++step_.clock;
  PublishBoard();
  RETURN_IF_ERROR(MaybeRecover());
  // Tell every server, one-sidedly: write the clock into this worker's clock slot with an
  // immediate. It follows this clock's pushes on the same endpoint, so the server knows every
  // push of the finished clocks is in (chunks this worker did not push stop waiting for it).
  for (uint32_t s = 0; s < sessions_->size(); ++s) {
    if (!sessions_->SendClock(s, step_.clock).ok()) {
      // Sent again after the reconnect or failover (Recovery::Resync).
      sessions_->at(s).failed = true;
    }
  }
  return Status::OK();
}

void ClientImpl::PublishBoard() {
  board_->clock.store(step_.clock, std::memory_order_relaxed);
  if (push_ != nullptr) {
    board_->bytes_pushed.store(push_->bytes_pushed(), std::memory_order_relaxed);
  }
  if (pull_ != nullptr) {
    board_->bytes_pulled.store(pull_->bytes_pulled(), std::memory_order_relaxed);
  }
}

Status ClientImpl::Step() {
  RETURN_IF_ERROR(lifecycle_.Require("Step()", {ClientState::kRunning}));
  Status st = StepOnce();
  if (metrics_) metrics_->Publish(counters(), rank_, step_.clock);  // one copy per step
  // A step during which the client broke reports why (e.g. DATA_LOSS), not the refusal of the
  // call it made after the break (a push's error can surface in its handle first).
  if (!st.ok() && lifecycle_.state() == ClientState::kBroken) return lifecycle_.cause();
  return st;
}

Status ClientImpl::StepOnce() {
  struct InStep {
    bool* f;
    ~InStep() { *f = false; }
  } guard{&step_.in_step};
  step_.in_step = true;
  ++step_.step_id;
  trace::Span span("step", "worker");
  span.Arg("step", step_.step_id).Arg("clock", step_.clock);
  // The pushes, then the pulls, each as one burst (PostBurst): over tcp a round of small
  // tensors leaves for each server in one sendmsg, over verbs as one chain per QP.
  // (CUDA-staged tensors: PostBurst starts every device->host copy first, back to back.)
  std::vector<Handle> hs;
  {
    std::vector<uint32_t> all(tensors_.size());
    for (uint32_t t = 0; t < all.size(); ++t) all[t] = t;
    ASSIGN_OR_RETURN(hs, PostBurst(all, /*push=*/true, /*step=*/true));
  }
  Status first;
  for (Handle h : hs) {
    Status s = Wait(h);
    if (first.ok() && !s.ok()) first = s;
  }
  RETURN_IF_ERROR(first);
  RETURN_IF_ERROR(Clock());
  // "@N": the Nth step of the process, its pushes sent and its clock announced, its pull not
  // yet begun (a BSP push of this clock may still wait for another worker's at the server).
  CrashPoint("worker.after_clock");
  {
    std::vector<uint32_t> dense;
    dense.reserve(tensors_.size());
    for (uint32_t t = 0; t < tensors_.size(); ++t) {
      if (!tensors_[t].embedding) dense.push_back(t);  // row tables: PullRows, per batch
    }
    ASSIGN_OR_RETURN(hs, PostBurst(dense, /*push=*/false, /*step=*/false));
  }
  for (Handle h : hs) {
    Status s = Wait(h);
    if (first.ok() && !s.ok()) first = s;
  }
  RETURN_IF_ERROR(first);
  if (metrics_) {
    const uint64_t oldest = pull_->OldestPulledPlus1();
    if (oldest != 0) metrics_->ObserveStepStaleness(step_.clock > oldest ? step_.clock - oldest : 0);
  }
  // "Step() never loses a push" (docs/fault-tolerance.md): once Step returns, the trainer
  // overwrites its gradient buffers, so a push that is not yet replicated then could not be
  // resent after a failover. BSP's pull already implies it (the version it waits for holds this
  // worker's push, and is published only once replicated); ASP and SSP pulls do not: wait for
  // the acknowledgements (one read of this worker's acks per server, usually already there).
  if (config_.replicas() >= 2 && config_.mode() != control::BSP) {
    RETURN_IF_ERROR(push_->AwaitAllAcked([this] { return RecoverOrBreak(); }));
  }
  return Status::OK();
}

StatusOr<uint64_t> ClientImpl::RequestCheckpoint(const std::string& dir) {
  RETURN_IF_ERROR(lifecycle_.Require("RequestCheckpoint()", {ClientState::kRunning}));
  control::Envelope e;
  e.mutable_checkpoint()->set_clock(step_.clock + 1);
  e.mutable_checkpoint()->set_dir(dir);
  RETURN_IF_ERROR(control_->Send(e));
  return step_.clock + 1;
}

uint64_t ClientImpl::barrier_generation() const {
  const uint64_t passed = barrier_waiting_ ? barrier_generation_ - 1 : barrier_generation_;
  return control_ ? std::max(passed, control_->reply().barrier_generation()) : passed;
}

Status ClientImpl::Barrier(std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(lifecycle_.Require("Barrier()", {ClientState::kRunning}));
  if (timeout.count() <= 0) timeout = options_.setup_timeout;
  // A day at most: the deadline below must not overflow.
  timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24));
  // A call after a timeout waits for the same barrier again: this worker has arrived there.
  if (!barrier_waiting_) {
    // Generations count from the last one the cluster released when this worker joined.
    if (barrier_generation_ < control_->reply().barrier_generation()) {
      barrier_generation_ = control_->reply().barrier_generation();
    }
    ++barrier_generation_;
    // Arrived from here on, even if the send fails: the arrival is queued to be repeated on
    // the rejoin, so a retry must wait for this generation, not arrive at the next.
    barrier_waiting_ = true;
    control::Envelope e;
    e.mutable_barrier()->set_generation(barrier_generation_);
    // The newest arrival only is repeated after a rejoin (even once released: a restarted
    // coordinator learns from it where this worker is).
    control_->Forget(control::Envelope::kBarrier);
    RETURN_IF_ERROR(control_->SendAndRepeatOnRejoin(e));
  }
  const uint64_t generation = barrier_generation_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return DeadlineExceededError("barrier " + std::to_string(generation) +
                                   ": not every worker arrived within " +
                                   std::to_string(timeout.count()) +
                                   " ms (call Barrier again to keep waiting for it)");
    }
    StatusOr<control::Envelope> got =
        control_->WaitMessage(control::Envelope::kBarrierRelease, left);
    if (!got.ok()) {
      if (got.status().code() == StatusCode::kDeadlineExceeded) continue;  // the check above
      return got.status();
    }
    // An older generation's release is a repeat after a rejoin: not this barrier's.
    if (got->barrier_release().generation() >= generation) {
      barrier_waiting_ = false;
      return Status::OK();
    }
  }
}

Status ClientImpl::Close() {
  if (!lifecycle_.Close()) return Status::OK();
  if (sessions_ != nullptr) sessions_->Disconnect();
  trace_.End();
  if (control_) return control_->Leave("worker closing");
  return Status::OK();
}

}  // namespace worker
}  // namespace shardps
