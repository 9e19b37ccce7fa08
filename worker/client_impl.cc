#include "worker/client_impl.h"

#include <unistd.h>

#include <cstring>
#include <functional>
#include <thread>

#include <glog/logging.h>

namespace shardps {

StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto c = std::make_unique<worker::ClientImpl>(options);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<Client>(std::move(c));
}

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
using transport::Completion;
using transport::LocalSlice;
using transport::RemoteSlice;
using transport::WcStatus;
using SteadyClock = std::chrono::steady_clock;

namespace {

constexpr int kSendDepth = 512;
constexpr uint32_t kStagingPerChunk = 4 * layout::kAlign;  // 2 push headers + 2 header reads
// A push of a chunk up to this size is one WRITE_WITH_IMM of [PushHeader | data] (the inbox
// keeps them adjacent) from staging, after copying the gradient there: one operation on the
// wire instead of two, which on tcp saves a sendmsg and a receive round per push (a 16 KiB
// copy costs well under a microsecond).
constexpr uint64_t kSmallPushBytes = 16 * 1024;

uint64_t MakeContext(uint32_t kind, uint32_t chunk, uint64_t handle) {
  return (static_cast<uint64_t>(kind) << 60) | (static_cast<uint64_t>(chunk & 0x0fffffff) << 32) |
         (handle & 0xffffffffull);
}
uint32_t ContextKind(uint64_t c) { return static_cast<uint32_t>(c >> 60); }
uint32_t ContextChunk(uint64_t c) { return static_cast<uint32_t>((c >> 32) & 0x0fffffff); }
uint64_t ContextHandle(uint64_t c) { return c & 0xffffffffull; }

std::string Hostname() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

ClientImpl::~ClientImpl() { Close().IgnoreError(); }

Status ClientImpl::Init() {
  transport::FabricOptions fo;
  fo.provider = options_.transport;
  fo.bind_ip = options_.bind_ip;
  fo.rdma_device = options_.rdma_device;
  fo.rdma_gid_index = options_.rdma_gid_index;
  if (const char* f = getenv("SHARDPS_FAULT_INJECT")) {
    // Testing only: "data_error_every=N".
    unsigned n = 0;
    if (sscanf(f, "data_error_every=%u", &n) == 1 && n > 0) {
      inject_data_error_every_ = n;
      LOG(WARNING) << "SHARDPS_FAULT_INJECT: every " << n
                   << "th push gets an error completion (testing only)";
    } else if (*f != '\0') {
      return InvalidArgumentError(std::string("SHARDPS_FAULT_INJECT='") + f +
                                  "': want data_error_every=N");
    }
  }
  ASSIGN_OR_RETURN(fabric_, transport::Fabric::Open(fo));
  control::ControlClientOptions co;
  co.coordinator_address = options_.coordinator;
  co.cluster_token = options_.cluster_token;
  co.join.set_role(control::ROLE_WORKER);
  co.join.set_hostname(Hostname());
  co.join.set_pid(static_cast<uint32_t>(getpid()));
  co.join.set_transport(fabric_->name());
  co.join.set_requested_rank(options_.requested_rank);
  co.connect_timeout = std::min(options_.setup_timeout, std::chrono::milliseconds(30000));
  ASSIGN_OR_RETURN(control_, control::ControlClient::Join(co));
  rank_ = control_->reply().rank();
  config_ = control_->reply().config();
  LOG(INFO) << "worker rank " << rank_ << ": joined (member " << control_->member_id()
            << "), data path " << fabric_->name() << ", " << consistency();
  return Status::OK();
}

Status ClientImpl::RegisterTensor(const std::string& name, float* weights, float* grads,
                                  const std::vector<int64_t>& shape) {
  RETURN_IF_ERROR(lifecycle_.Require("RegisterTensor()", {ClientState::kJoined}));
  if (tensor_index_.count(name))
    return AlreadyExistsError("tensor '" + name + "' registered twice");
  if (weights == nullptr || grads == nullptr) return InvalidArgumentError("null tensor buffer");
  Tensor t;
  t.name = name;
  t.weights = weights;
  t.grads = grads;
  t.shape = shape;
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d <= 0) return InvalidArgumentError("tensor '" + name + "' has a dimension <= 0");
    n *= static_cast<uint64_t>(d);
  }
  t.bytes = n * sizeof(float);
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
                   CudaStaging::Create(t.weights, t.grads, t.bytes, options_.cuda_pipeline_bytes));
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

uint32_t ClientImpl::num_workers() const {
  uint32_t n = 0;
  const control::Membership membership = control_->membership();
  for (const auto& m : membership.members()) n += m.role() == control::ROLE_WORKER;
  return n;
}

std::string ClientImpl::consistency() const {
  std::string m = control::ConsistencyMode_Name(config_.mode());
  for (char& ch : m) ch = static_cast<char>(tolower(ch));
  if (config_.mode() == control::SSP || config_.mode() == control::VSGD) {
    m += "(s=" + std::to_string(config_.staleness()) + ")";
  }
  return m;
}

std::string ClientImpl::transport_name() const { return fabric_ ? fabric_->name() : ""; }

ClientCounters ClientImpl::counters() const {
  ClientCounters c = counters_;
  const control::ControlCounters cc = control_->counters();
  c.control_messages_sent = cc.other_messages_sent;
  c.heartbeats_sent = cc.heartbeats_sent;
  return c;
}

char* ClientImpl::Staging(uint32_t chunk, int which) {
  return static_cast<char*>(staging_->data()) + StagingOffset(chunk, which);
}

uint64_t ClientImpl::StagingOffset(uint32_t chunk, int which) const {
  return static_cast<uint64_t>(chunk) * kStagingPerChunk + which * layout::kAlign;
}

Status ClientImpl::ServerError(uint32_t server, const std::string& what) const {
  const Server& s = servers_[server];
  Status st = s.ep ? s.ep->status() : UnavailableError("not connected");
  return UnavailableError("server rank " + std::to_string(s.rank) + " at " + s.address + ": " +
                          what + (st.ok() ? "" : " (" + st.ToString() + ")"));
}

Status ClientImpl::Start() {
  RETURN_IF_ERROR(lifecycle_.Require("Start()", {ClientState::kJoined}));
  if (tensors_.empty()) return FailedPreconditionError("Start() without registered tensors");
  lifecycle_.BeginStart();
  return lifecycle_.FinishStart(StartCluster());
}

Status ClientImpl::StartCluster() {
  // Every expected worker must be there before step 0, or BSP's first steps would average
  // over fewer workers than the job has.
  const uint32_t want = std::max<uint32_t>(1, config_.num_workers());
  auto ready = control_->WaitFor(
      [&](const control::Membership& m) {
        uint32_t n = 0;
        for (const auto& mem : m.members()) n += mem.role() == control::ROLE_WORKER;
        return n >= want;
      },
      options_.setup_timeout);
  if (!ready.ok()) {
    return ready.status().WithContext("waiting for " + std::to_string(want) + " workers to join");
  }
  control::Envelope reg;
  for (const Tensor& t : tensors_) {
    control::TensorSpecProto* p = reg.mutable_register_model()->add_tensors();
    p->set_name(t.name);
    p->set_dtype(0);
    for (int64_t d : t.shape) p->add_shape(d);
  }
  RETURN_IF_ERROR(control_->Send(reg));
  ASSIGN_OR_RETURN(control::Envelope env,
                   control_->WaitMessage(control::Envelope::kShardMap, options_.setup_timeout));
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
  // Servers and their regions.
  servers_.resize(map.servers_size());
  map_epoch_ = map.epoch();
  for (const auto& se : map.servers()) {
    if (se.rank() >= servers_.size()) return InvalidArgumentError("shard map: bad server rank");
    RETURN_IF_ERROR(ApplyServerEntry(se, servers_[se.rank()]));
  }
  chunks_.resize(map.chunks_size());
  std::vector<std::vector<uint64_t>> slot_bytes(servers_.size());
  for (const auto& ce : map.chunks()) {
    // The map comes from the coordinator, a peer: every index and range is checked before use
    // (a slot beyond the chunk count, or an offset + bytes that wraps, would index out of bounds).
    if (ce.chunk_id() >= chunks_.size() || ce.tensor() >= tensors_.size() ||
        ce.server_rank() >= servers_.size() || ce.slot() >= chunks_.size() || ce.bytes() == 0 ||
        ce.bytes() % sizeof(float) != 0 || ce.offset() > tensors_[ce.tensor()].bytes ||
        ce.bytes() > tensors_[ce.tensor()].bytes - ce.offset()) {
      return InvalidArgumentError("shard map: chunk out of range");
    }
    ChunkRt& c = chunks_[ce.chunk_id()];
    c.id = ce.chunk_id();
    c.tensor = ce.tensor();
    c.offset = ce.offset();
    c.bytes = ce.bytes();
    c.server = ce.server_rank();
    c.slot = ce.slot();
    tensors_[c.tensor].chunks.push_back(c.id);
    auto& sb = slot_bytes[c.server];
    if (sb.size() <= c.slot) sb.resize(c.slot + 1);
    sb[c.slot] = c.bytes;
    auto& cos = servers_[c.server].chunk_of_slot;
    if (cos.size() <= c.slot) cos.resize(c.slot + 1);
    cos[c.slot] = c.id;
  }
  for (size_t s = 0; s < servers_.size(); ++s) {
    servers_[s].layout = std::make_unique<layout::ServerLayout>(slot_bytes[s], map.max_workers());
    if (servers_[s].inbox.length < servers_[s].layout->inbox_bytes() ||
        servers_[s].weights.length < servers_[s].layout->weights_bytes() ||
        servers_[s].clocks.length < servers_[s].layout->clocks_bytes()) {
      return FailedPreconditionError("server " + std::to_string(s) +
                                     "'s regions are smaller than its layout");
    }
  }
  // Staging: per chunk 2 push headers + 2 header reads; then per server an acks buffer.
  acks_staging_offset_ = layout::AlignUp(chunks_.size() * kStagingPerChunk + layout::kAlign);
  uint64_t staging_bytes = acks_staging_offset_;
  for (const auto& s : servers_) staging_bytes += layout::AlignUp(s.layout->acks_of_worker_bytes());
  clock_staging_offset_ = staging_bytes;
  staging_bytes += layout::kAlign * servers_.size();
  for (ChunkRt& c : chunks_) {
    if (c.bytes > kSmallPushBytes) continue;
    c.small_staging = staging_bytes;
    staging_bytes += 2 * (layout::kAlign + layout::AlignUp(c.bytes));
  }
  ASSIGN_OR_RETURN(staging_, fabric_->AllocateMemory(staging_bytes, Access::kLocalOnly));

  // Endpoints, one per server, all on one CQ owned by this thread. Room for the completions of
  // endpoints replaced by failovers, whose flushed operations may still arrive.
  ASSIGN_OR_RETURN(cq_, fabric_->CreateCompletionQueue(
                            2 * static_cast<int>(servers_.size()) * (kSendDepth + 8) + 64));
  for (Server& s : servers_) RETURN_IF_ERROR(ConnectServer(s));
  // Rank 0's weights become the initial weights.
  if (rank_ == 0) {
    for (Tensor& t : tensors_) {
      if (t.staging != nullptr) RETURN_IF_ERROR(t.staging->WeightsToHost());
    }
    for (ChunkRt& c : chunks_) {
      Server& s = servers_[c.server];
      RETURN_IF_ERROR(PostWithCredit([&] {
        return s.ep->PostWriteImm(
            {tensors_[c.tensor].wmr.get(), c.offset, c.bytes},
            transport::AtOffset(s.inbox, s.layout->push_data_offset(0, c.slot, 0)),
            layout::MakeImm(layout::ImmKind::kInit, c.slot), MakeContext(kOpSetup, c.id, 0));
      }));
    }
    RETURN_IF_ERROR(WaitSetupOps(static_cast<int>(chunks_.size())));
  }
  for (uint32_t t = 0; t < tensors_.size(); ++t) {
    ASSIGN_OR_RETURN(Handle h, Pull(tensors_[t].name));
    RETURN_IF_ERROR(Wait(h));
  }
  // A worker that joins a running cluster (elastic growth, or a restarted worker) starts at the
  // cluster's clock: the weights it pulled contain every push of the clocks before it.
  uint64_t cluster_clock = 0;
  for (const ChunkRt& c : chunks_)
    cluster_clock = std::max(cluster_clock, c.pulled_min_clock_plus1);
  if (cluster_clock > clock_) {
    LOG(INFO) << "worker rank " << rank_ << ": joined a running cluster at clock " << cluster_clock;
    clock_ = cluster_clock;
    for (Server& s : servers_) RETURN_IF_ERROR(SendClock(s));
  }
  control_baseline_ = control_->counters().other_messages_sent;
  LOG(INFO) << "worker rank " << rank_ << ": started: " << tensors_.size() << " tensors, "
            << chunks_.size() << " chunks on " << servers_.size() << " servers";
  return Status::OK();
}

Status ClientImpl::ApplyServerEntry(const control::ServerEntry& se, Server& s) {
  if (se.lost()) {
    return DataLossError("server group " + std::to_string(se.rank()) +
                         " is lost: its primary (server rank " + std::to_string(se.server_rank()) +
                         ") died and no backup was left (replicas=1, or the backup had died "
                         "first); restart the cluster from the latest checkpoint");
  }
  s.rank = se.rank();
  s.member_id = se.member_id();
  s.server_rank = se.server_rank();
  s.address = se.data_address();
  for (const auto& r : se.regions()) {
    ASSIGN_OR_RETURN(transport::RegionDescriptor d,
                     transport::RegionDescriptor::Decode(r.encoded_descriptor()));
    if (r.name() == "weights") s.weights = d;
    if (r.name() == "inbox") s.inbox = d;
    if (r.name() == "acks") s.acks = d;
    if (r.name() == "clocks") s.clocks = d;
  }
  if (s.layout != nullptr &&
      (s.inbox.length < s.layout->inbox_bytes() || s.weights.length < s.layout->weights_bytes() ||
       s.clocks.length < s.layout->clocks_bytes())) {
    return FailedPreconditionError("server " + std::to_string(s.rank) +
                                   "'s regions are smaller than its layout");
  }
  return Status::OK();
}

Status ClientImpl::ConnectServer(Server& s, std::chrono::milliseconds timeout) {
  s.ep.reset();
  ++s.gen;
  transport::EndpointOptions eo;
  eo.endpoint_id = (static_cast<uint64_t>(s.gen) << 32) | s.rank;
  eo.send_depth = kSendDepth;
  eo.recv_depth = 4;
  eo.connect_timeout = timeout.count() > 0
                           ? timeout
                           : std::min(options_.setup_timeout, std::chrono::milliseconds(30000));
  auto ep = fabric_->Connect(s.address, cq_.get(), eo);
  if (!ep.ok()) {
    return ep.status().WithContext("connecting to server group " + std::to_string(s.rank) + " at " +
                                   s.address);
  }
  s.ep = std::move(*ep);
  s.failed = false;
  // Hello: tells the server which worker (rank and incarnation) this endpoint belongs to.
  const uint64_t hello_off = chunks_.size() * kStagingPerChunk;
  auto* hello = reinterpret_cast<layout::Hello*>(static_cast<char*>(staging_->data()) + hello_off);
  std::memset(hello, 0, sizeof(*hello));
  hello->clock = clock_;
  hello->incarnation = control_->member_id();
  hello->magic = layout::kHelloMagic;
  RETURN_IF_ERROR(PostWithCredit([&] {
    return s.ep->PostWriteImm({staging_.get(), hello_off, sizeof(layout::Hello)},
                              transport::AtOffset(s.clocks, s.layout->clock_offset(rank_)),
                              layout::MakeImm(layout::ImmKind::kHello, rank_),
                              MakeContext(kOpSetup, 0, 0));
  }));
  return WaitSetupOps(1, timeout);
}

Status ClientImpl::SendClock(Server& s) {
  const uint64_t off = clock_staging_offset_ + s.rank * layout::kAlign;
  std::memcpy(static_cast<char*>(staging_->data()) + off, &clock_, sizeof(clock_));
  return PostWithCredit([&] {
    return s.ep->PostWriteImm(
        {staging_.get(), off, sizeof(uint64_t)},
        transport::AtOffset(s.clocks, s.layout->clock_offset(rank_)),
        layout::MakeImm(layout::ImmKind::kClock, static_cast<uint32_t>(clock_)),
        MakeContext(kOpClock, 0, 0), transport::kUnsignaled);
  });
}

Status ClientImpl::MaybeRecover() {
  const ClientState st = lifecycle_.state();
  if ((st != ClientState::kStarting && st != ClientState::kRunning) || recovering_) {
    return Status::OK();
  }
  bool any = false;
  for (Server& s : servers_) {
    if (s.ep && !s.ep->status().ok()) s.failed = true;
    any = any || s.failed;
  }
  if (!any) return Status::OK();
  return RecoverOrBreak();
}

Status ClientImpl::RecoverOrBreak() { return lifecycle_.Break(Recover()); }

Status ClientImpl::Recover() {
  recovering_ = true;
  struct Reset {
    bool* f;
    ~Reset() { *f = false; }
  } reset{&recovering_};
  const auto t0 = SteadyClock::now();
  const auto timeout = options_.failover_timeout.count() > 0
                           ? options_.failover_timeout
                           : std::chrono::milliseconds(config_.failover_timeout_ms() > 0
                                                           ? config_.failover_timeout_ms()
                                                           : 20000);
  const auto deadline = t0 + timeout;
  auto next_reconnect = t0 + std::chrono::milliseconds(20);
  control::ShardMap newest;
  bool have = false;
  // The newest map's entry for group i (null: no newer map yet).
  auto entry_of = [&](uint32_t i) -> const control::ServerEntry* {
    if (!have) return nullptr;
    for (const auto& e : newest.servers()) {
      if (e.rank() == i) return &e;
    }
    return nullptr;
  };
  auto consider = [&](const control::Envelope& e) {
    if (e.shard_map().epoch() > map_epoch_ && (!have || e.shard_map().epoch() > newest.epoch())) {
      newest = e.shard_map();
      have = true;
    }
  };
  std::string names;
  for (const Server& s : servers_) {
    if (s.failed) names += (names.empty() ? "" : ", ") + std::to_string(s.rank);
  }
  LOG(WARNING) << "worker rank " << rank_ << ": server group(s) " << names
               << " failed; waiting up to " << timeout.count() << " ms for a failover";
  while (true) {
    while (true) {
      auto m = control_->WaitMessage(control::Envelope::kShardMap, std::chrono::milliseconds(0));
      if (!m.ok()) break;
      consider(*m);
    }
    bool all = true;
    const control::Membership members = control_->membership();
    for (uint32_t i = 0; i < servers_.size(); ++i) {
      Server& s = servers_[i];
      if (!s.failed) continue;
      const control::ServerEntry* se = entry_of(i);
      if (se != nullptr && se->lost()) return ApplyServerEntry(*se, s);  // the DataLoss error
      if (se != nullptr && se->member_id() != s.member_id) continue;     // failed over
      all = false;
      // Not replaced: if its process is still a member, the data path failed without the server
      // dying (an error completion, a reset connection): reconnect to the same server. Its
      // exactly-once state survives (same incarnation), so resending is safe.
      bool member = false;
      for (const auto& m : members.members()) member = member || m.member_id() == s.member_id;
      if (member && SteadyClock::now() >= next_reconnect) {
        // Bounded: a server that just died may not refuse at once (a verbs bootstrap behind a
        // slow route, a half-open connection); the membership decides soon anyway.
        Status st = ConnectServer(s, std::chrono::milliseconds(1000));
        if (st.ok()) st = ResyncServer(i);
        if (st.ok()) {
          ++counters_.reconnects;
          LOG(WARNING) << "worker rank " << rank_ << ": reconnected to server group " << i
                       << " (server rank " << s.server_rank << ", still a member) after a "
                       << "data-path failure";
        } else {
          s.failed = true;
          VLOG(1) << "reconnect to server group " << i << ": " << st;
        }
      } else if (!member && !replicated()) {
        return ServerError(i,
                           "failed, and the cluster has no backups (replicas=1): the state of "
                           "its shards is lost; restart from the latest checkpoint");
      }
    }
    if (SteadyClock::now() >= next_reconnect) {
      next_reconnect = SteadyClock::now() + std::chrono::milliseconds(100);
    }
    all = true;
    for (uint32_t i = 0; i < servers_.size(); ++i) {
      if (!servers_[i].failed) continue;
      const control::ServerEntry* se = entry_of(i);
      if (se == nullptr || se->member_id() == servers_[i].member_id) all = false;
    }
    if (all) break;
    if (SteadyClock::now() > deadline) {
      for (uint32_t i = 0; i < servers_.size(); ++i) {
        if (servers_[i].failed) {
          return ServerError(i, "failed, and no backup took over within " +
                                    std::to_string(timeout.count()) + " ms");
        }
      }
    }
    auto m = control_->WaitMessage(control::Envelope::kShardMap, std::chrono::milliseconds(20));
    if (m.ok()) consider(*m);
    Progress().IgnoreError();  // completions of the healthy servers keep flowing
  }
  if (!have) return Status::OK();  // every failed server was reconnected
  map_epoch_ = newest.epoch();
  for (const auto& se : newest.servers()) {
    if (se.rank() >= servers_.size()) continue;
    Server& s = servers_[se.rank()];
    if (se.member_id() == s.member_id && !s.failed) continue;
    RETURN_IF_ERROR(ApplyServerEntry(se, s));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline + timeout -
                                                                            SteadyClock::now());
    RETURN_IF_ERROR(ConnectServer(s, std::max(left, std::chrono::milliseconds(1000))));
    RETURN_IF_ERROR(WaitServing(se.rank()));
    RETURN_IF_ERROR(ResyncServer(se.rank()));
    ++counters_.failovers;
    LOG(WARNING)
        << "worker rank " << rank_ << ": server group " << se.rank()
        << " failed over to server rank " << se.server_rank() << " at " << se.data_address()
        << " (epoch " << newest.epoch() << ") in "
        << std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - t0).count()
        << " ms";
  }
  return Status::OK();
}

// A promoted backup serves (and its acks are final) once it has applied every record of the old
// primary: it then sets serving_epoch in its chunk headers. Read before trusting its acks.
Status ClientImpl::WaitServing(uint32_t server) {
  Server& s = servers_[server];
  if (s.chunk_of_slot.empty()) return Status::OK();
  const uint32_t chunk = s.chunk_of_slot[0];
  const auto deadline = SteadyClock::now() + options_.setup_timeout;
  while (true) {
    acks_pending_ = 1;
    setup_error_ = Status::OK();
    RETURN_IF_ERROR(PostWithCredit([&] {
      return s.ep->PostRead({staging_.get(), StagingOffset(chunk, 2), layout::kAlign},
                            transport::AtOffset(s.weights, s.layout->header_offset(0)),
                            MakeContext(kOpAcks, chunk, 0));
    }));
    while (acks_pending_ > 0) {
      RETURN_IF_ERROR(Progress());
      if (SteadyClock::now() > deadline) return ServerError(server, "never started serving");
    }
    RETURN_IF_ERROR(setup_error_);
    const auto* h = reinterpret_cast<const layout::ChunkHeader*>(Staging(chunk, 2));
    if (h->serving_epoch.load(std::memory_order_relaxed) != 0) return Status::OK();
    if (SteadyClock::now() > deadline) return ServerError(server, "never started serving");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// After reconnecting to a promoted backup: learn which pushes it has (its acks follow the
// replicated sequence numbers), send the latest push of each chunk again if it is missing
// (a duplicate would be dropped by sequence number anyway), tell it our clock, and restart the
// pulls that were in flight.
Status ClientImpl::ResyncServer(uint32_t server) {
  Server& s = servers_[server];
  uint64_t off = acks_staging_offset_;
  for (uint32_t i = 0; i < server; ++i)
    off += layout::AlignUp(servers_[i].layout->acks_of_worker_bytes());
  acks_pending_ = 1;
  setup_error_ = Status::OK();
  RETURN_IF_ERROR(PostWithCredit([&] {
    return s.ep->PostRead({staging_.get(), off, s.layout->acks_of_worker_bytes()},
                          transport::AtOffset(s.acks, s.layout->acks_of_worker_offset(rank_)),
                          MakeContext(kOpAcks, 0, 0));
  }));
  const auto deadline = SteadyClock::now() + options_.setup_timeout;
  while (acks_pending_ > 0) {
    RETURN_IF_ERROR(Progress());
    if (SteadyClock::now() > deadline) return ServerError(server, "no answer after failover");
  }
  RETURN_IF_ERROR(setup_error_);
  const auto* acks = reinterpret_cast<const uint64_t*>(static_cast<char*>(staging_->data()) + off);
  for (uint32_t slot = 0; slot < s.chunk_of_slot.size(); ++slot) {
    ChunkRt& c = chunks_[s.chunk_of_slot[slot]];
    const uint64_t a = acks[slot];
    c.known_acked = a;
    for (int p = 0; p < 2; ++p) {
      const uint64_t h = c.push_handle[p];
      if (h == 0 || c.push_seq[p] == c.seq) continue;
      c.push_handle[p] = 0;
      FinishChunk(h, c.push_seq[p] <= a
                         ? Status::OK()
                         : DataLossError("push " + std::to_string(c.push_seq[p]) + " of chunk " +
                                         std::to_string(c.id) +
                                         " was lost in a failover (not replicated, and its "
                                         "gradient buffer was reused by a later push)"));
    }
    if (c.seq > a) {
      const uint32_t p = static_cast<uint32_t>(c.seq & 1);
      // The latest push is resent from the caller's gradient buffer only when its bytes are
      // certainly still there: its handle has not completed (the caller may not touch the
      // buffer yet), or it was pushed by the Step() we are inside, or the mode is BSP (where a
      // gradient buffer is rewritten only after the pull that needs this push). Otherwise the
      // caller may have reused the buffer: resending would apply other bytes — never twice,
      // never wrong: count it lost instead.
      const bool resendable = c.push_handle[p] != 0 || config_.mode() == control::BSP ||
                              (in_step_ && c.push_step == step_id_);
      const uint64_t lost = resendable ? c.seq - 1 - a : c.seq - a;
      if (lost > 0) {
        counters_.pushes_lost += lost;
        LOG(WARNING) << "worker rank " << rank_ << ": chunk " << c.id << ": pushes " << a + 1
                     << ".." << (resendable ? c.seq - 1 : c.seq)
                     << " were not replicated before the failover and cannot be resent (their "
                        "gradient buffer may have been reused)";
      }
      if (resendable) {
        RETURN_IF_ERROR(PostPush(c, c.seq, c.push_handle[p]));
        ++counters_.pushes_resent;
      }
    } else {
      const uint32_t p = static_cast<uint32_t>(c.seq & 1);
      if (c.push_handle[p] != 0) {
        const uint64_t h = c.push_handle[p];
        c.push_handle[p] = 0;
        FinishChunk(h, Status::OK());  // it was replicated before the primary died
      }
    }
  }
  // The clock goes after the pushes: it tells the server every push of the earlier clocks is in.
  if (clock_ > 0) RETURN_IF_ERROR(SendClock(s));
  for (uint32_t slot = 0; slot < s.chunk_of_slot.size(); ++slot) {
    ChunkRt& c = chunks_[s.chunk_of_slot[slot]];
    if (c.pull_handle != 0) StartPull(c, PullPhase::kAll);
  }
  return Status::OK();
}

Status ClientImpl::WaitSetupOps(int count, std::chrono::milliseconds timeout) {
  setup_done_ = 0;
  setup_error_ = Status::OK();
  const auto deadline =
      SteadyClock::now() + (timeout.count() > 0 ? timeout : options_.setup_timeout);
  while (setup_done_ < count) {
    RETURN_IF_ERROR(Progress());
    if (!setup_error_.ok()) return setup_error_;
    if (SteadyClock::now() > deadline) return DeadlineExceededError("setup writes timed out");
  }
  return setup_error_;
}

Status ClientImpl::PostWithCredit(const std::function<Status()>& post) {
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  while (true) {
    Status s = post();
    if (s.code() != StatusCode::kResourceExhausted) return s;
    RETURN_IF_ERROR(Progress());  // reap completions, returning credits
    if (SteadyClock::now() > deadline) return s;
  }
}

Status ClientImpl::Progress() {
  Completion wc[64];
  const int n = cq_->Poll(wc, 64);
  for (int i = 0; i < n; ++i) OnCompletion(wc[i]);
  return Status::OK();
}

void ClientImpl::OnCompletion(const Completion& wc) {
  const uint32_t kind = ContextKind(wc.context);
  const uint32_t chunk = ContextChunk(wc.context);
  const uint64_t handle = ContextHandle(wc.context);
  const uint32_t server = static_cast<uint32_t>(wc.endpoint_id & 0xffffffffu);
  const uint32_t gen = static_cast<uint32_t>(wc.endpoint_id >> 32);
  if (server >= servers_.size() || servers_[server].gen != gen) return;  // a replaced endpoint
  const Status err =
      wc.ok() ? Status::OK() : ServerError(server, std::string(transport::WcStatusName(wc.status)));
  // A failed operation is not the caller's error yet: the server's group fails over to its
  // backup, or the endpoint is reconnected if the server is alive, and the operation is sent
  // again (Recover); Recover reports the error if neither happens in time.
  const bool hold = !wc.ok();
  if (!wc.ok()) servers_[server].failed = true;
  switch (kind) {
    case kOpSetup:
      if (!wc.ok() && setup_error_.ok()) setup_error_ = err;
      ++setup_done_;
      return;
    case kOpAcks:
      --acks_pending_;
      if (!wc.ok() && setup_error_.ok()) setup_error_ = err;
      return;
    case kOpPush: {
      if (chunk >= chunks_.size() || handle == 0) return;
      ChunkRt& c = chunks_[chunk];
      const int p = c.push_handle[0] == handle ? 0 : c.push_handle[1] == handle ? 1 : -1;
      if (p < 0) return;  // already finished (an unsignaled write's error after the header's)
      if (hold) return;
      c.push_handle[p] = 0;
      FinishChunk(handle, err);
      return;
    }
    case kOpPull: {
      if (chunk >= chunks_.size()) return;
      ChunkRt& c = chunks_[chunk];
      if (c.pull_handle != handle) return;  // a flushed leftover of a finished pull
      if (hold) return;                     // restarted on the new server after the failover
      if (!wc.ok()) {
        c.pull_handle = 0;
        FinishChunk(handle, err);
        return;
      }
      EvaluatePull(c);
      return;
    }
    default:
      return;
  }
}

void ClientImpl::FinishChunk(uint64_t handle, const Status& s) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return;
  if (!s.ok() && it->second.error.ok()) it->second.error = s;
  --it->second.pending;
}

uint64_t ClientImpl::RequiredPlus1() const {
  switch (config_.mode()) {
    case control::BSP:
      return clock_;  // min_clock >= clock-1
    case control::SSP:
    case control::VSGD:
      return clock_ > config_.staleness() ? clock_ - config_.staleness() : 0;
    default:
      return 0;
  }
}

Status ClientImpl::EnsureAcked(ChunkRt& c, uint64_t need) {
  if (c.known_acked >= need) return Status::OK();
  Server& s = servers_[c.server];
  uint64_t off = acks_staging_offset_;
  for (uint32_t i = 0; i < c.server; ++i) {
    off += layout::AlignUp(servers_[i].layout->acks_of_worker_bytes());
  }
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  while (c.known_acked < need) {
    acks_pending_ = 1;
    setup_error_ = Status::OK();
    RETURN_IF_ERROR(PostWithCredit([&] {
      return s.ep->PostRead({staging_.get(), off, s.layout->acks_of_worker_bytes()},
                            transport::AtOffset(s.acks, s.layout->acks_of_worker_offset(rank_)),
                            MakeContext(kOpAcks, c.id, 0));
    }));
    while (acks_pending_ > 0) {
      RETURN_IF_ERROR(Progress());
      if (SteadyClock::now() > deadline) {
        return DeadlineExceededError("waiting for server " + std::to_string(c.server) +
                                     " to acknowledge pushes");
      }
      if (s.failed) break;
    }
    if (s.failed && !recovering_) {
      acks_pending_ = 0;
      RETURN_IF_ERROR(RecoverOrBreak());  // resynchronises known_acked with the new server
      continue;
    }
    if (!setup_error_.ok()) return setup_error_;
    const auto* acks =
        reinterpret_cast<const uint64_t*>(static_cast<char*>(staging_->data()) + off);
    for (uint32_t slot = 0; slot < s.chunk_of_slot.size(); ++slot) {
      ChunkRt& o = chunks_[s.chunk_of_slot[slot]];
      o.known_acked = std::max(o.known_acked, acks[slot]);
    }
    if (c.known_acked < need) std::this_thread::yield();
  }
  return Status::OK();
}

StatusOr<Handle> ClientImpl::Push(const std::string& name) {
  RETURN_IF_ERROR(lifecycle_.Require("Push()", {ClientState::kRunning}));
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return NotFoundError("no tensor '" + name + "'");
  RETURN_IF_ERROR(MaybeRecover());
  Tensor& t = tensors_[it->second];
  if (t.staging != nullptr) {
    // The mirror still holds the bytes of a push the caller has not waited for.
    if (handles_.count(t.push_handle)) {
      return FailedPreconditionError("Push of '" + name + "' before Wait() on its previous push");
    }
    RETURN_IF_ERROR(t.staging->StartGradsToHost());
  }
  const uint64_t h = next_handle_++ & 0xffffffffull;
  HandleState& hs = handles_[h];
  t.push_handle = h;
  for (uint32_t id : t.chunks) {
    ChunkRt& c = chunks_[id];
    const uint64_t seq = c.seq + 1;
    const uint32_t parity = static_cast<uint32_t>(seq & 1);
    // The inbox slot of this parity was last used by push seq-2: it must be consumed.
    if (seq > 2) {
      Status st = EnsureAcked(c, seq - 2);
      if (!st.ok()) {
        hs.error = st;
        break;
      }
    }
    if (c.push_handle[parity] != 0) {
      // Push seq-2 is acknowledged (so applied), even if its completion is not polled yet.
      FinishChunk(c.push_handle[parity], Status::OK());
      c.push_handle[parity] = 0;
    }
    c.seq = seq;
    c.last_push_clock = clock_;
    c.last_push_base = c.pulled_version;
    c.push_step = in_step_ ? step_id_ : 0;
    c.push_handle[parity] = h;
    c.push_seq[parity] = seq;
    ++hs.pending;
    Status st = PostPush(c, seq, h);
    if (!st.ok()) {
      if (servers_[c.server].failed) continue;  // resent after the reconnect or failover
      c.push_handle[parity] = 0;
      --hs.pending;
      hs.error = st;
      break;
    }
    ++counters_.pushes;
    counters_.bytes_pushed += c.bytes;
  }
  return Handle{h};
}

// Posts push `seq` of a chunk (its data, then the header with the immediate). The header's
// clock and base version are those of the chunk's latest push (a resend after a failover
// repeats them exactly).
Status ClientImpl::PostPush(ChunkRt& c, uint64_t seq, uint64_t h) {
  Tensor& t = tensors_[c.tensor];
  Server& s = servers_[c.server];
  if (!s.ep) return ServerError(c.server, "not connected");
  const uint32_t parity = static_cast<uint32_t>(seq & 1);
  auto* ph = reinterpret_cast<layout::PushHeader*>(Staging(c.id, static_cast<int>(parity)));
  std::memset(ph, 0, sizeof(*ph));
  ph->seq = seq;
  ph->clock = c.last_push_clock;
  ph->base_version = c.last_push_base;
  ph->chunk_id = c.id;
  ph->worker = rank_;
  ph->bytes = c.bytes;
  ph->epoch = std::max(control_->epoch(), map_epoch_);
  ph->magic = layout::kPushMagic;
  // Fault injection (tests): every Nth push names a wrong rkey, so the server's NIC (or the
  // provider's target) refuses it with a remote access error: an error completion on the data
  // path, which puts the endpoint into the error state. The push is then resent.
  transport::RegionDescriptor inbox = s.inbox;
  if (inject_data_error_every_ > 0 && ++pushes_posted_ % inject_data_error_every_ == 0) {
    inbox.rkey ^= 0x5a5a5a5au;
    ++counters_.injected_errors;
    LOG(WARNING) << "worker rank " << rank_ << ": fault injection: push " << seq << " of chunk "
                 << c.id << " with a wrong rkey";
  }
  if (c.small_staging != 0 && t.staging == nullptr) {
    // [PushHeader | data] in one write; this staging parity was last sent by push seq-2,
    // which the server has consumed (EnsureAcked).
    const uint64_t off = c.small_staging + parity * (layout::kAlign + layout::AlignUp(c.bytes));
    char* p = static_cast<char*>(staging_->data()) + off;
    std::memcpy(p, ph, sizeof(*ph));
    std::memcpy(p + layout::kAlign, reinterpret_cast<const char*>(t.grads) + c.offset, c.bytes);
    return PostWithCredit([&] {
      return s.ep->PostWriteImm(
          {staging_.get(), off, layout::kAlign + c.bytes},
          transport::AtOffset(inbox, s.layout->push_header_offset(rank_, c.slot, parity)),
          layout::MakeImm(layout::ImmKind::kPush, (c.slot << 1) | parity),
          MakeContext(kOpPush, c.id, h));
    });
  }
  RETURN_IF_ERROR(PostPushData(t, c, s, parity, h));
  return PostWithCredit([&] {
    return s.ep->PostWriteImm(
        {staging_.get(), StagingOffset(c.id, static_cast<int>(parity)), sizeof(layout::PushHeader)},
        transport::AtOffset(inbox, s.layout->push_header_offset(rank_, c.slot, parity)),
        layout::MakeImm(layout::ImmKind::kPush, (c.slot << 1) | parity),
        MakeContext(kOpPush, c.id, h));
  });
}

Status ClientImpl::PostPushData(Tensor& t, ChunkRt& c, Server& s, uint32_t parity, uint64_t h) {
  const uint64_t dst = s.layout->push_data_offset(rank_, c.slot, parity);
  if (t.staging == nullptr) {
    return PostWithCredit([&] {
      return s.ep->PostWrite({t.gmr.get(), c.offset, c.bytes}, transport::AtOffset(s.inbox, dst),
                             MakeContext(kOpPush, c.id, h), transport::kUnsignaled);
    });
  }
  // Staged: each piece is written as soon as its device->host copy is done; later pieces are
  // still being copied meanwhile. Writes on one endpoint execute in post order, so the header
  // (posted after the last piece) still lands after all of the data.
  const uint64_t piece = t.staging->piece_bytes();
  const auto deadline = SteadyClock::now() + options_.wait_timeout;
  for (uint64_t a = c.offset; a < c.offset + c.bytes;) {
    const uint64_t b = std::min(c.offset + c.bytes, (a / piece + 1) * piece);
    while (true) {
      ASSIGN_OR_RETURN(bool ready, t.staging->GradsOnHost(b));
      if (ready) break;
      RETURN_IF_ERROR(Progress());
      if (SteadyClock::now() > deadline) {
        return DeadlineExceededError("device->host copy of '" + t.name + "' timed out");
      }
    }
    RETURN_IF_ERROR(PostWithCredit([&] {
      return s.ep->PostWrite({t.gmr.get(), a, b - a},
                             transport::AtOffset(s.inbox, dst + (a - c.offset)),
                             MakeContext(kOpPush, c.id, h), transport::kUnsignaled);
    }));
    a = b;
  }
  return Status::OK();
}

void ClientImpl::StartPull(ChunkRt& c, PullPhase phase) {
  Server& s = servers_[c.server];
  const Tensor& t = tensors_[c.tensor];
  c.phase = phase;
  const uint64_t hdr = s.layout->header_offset(c.slot);
  Status st;
  const uint64_t ctx = MakeContext(kOpPull, c.id, c.pull_handle);
  if (phase == PullPhase::kHeaderOnly) {
    st = PostWithCredit([&] {
      return s.ep->PostRead({staging_.get(), StagingOffset(c.id, 2), layout::kAlign},
                            transport::AtOffset(s.weights, hdr), ctx);
    });
  } else {
    // kAll: header, data of the guessed buffer, header; kDataCheck: data then header.
    if (phase == PullPhase::kAll) {
      st = PostWithCredit([&] {
        return s.ep->PostRead({staging_.get(), StagingOffset(c.id, 2), layout::kAlign},
                              transport::AtOffset(s.weights, hdr), ctx, transport::kUnsignaled);
      });
    }
    if (st.ok()) {
      st = PostWithCredit([&] {
        return s.ep->PostRead(
            {t.wmr.get(), c.offset, c.bytes},
            transport::AtOffset(s.weights, s.layout->buffer_offset(c.slot, c.guess)), ctx,
            transport::kUnsignaled);
      });
    }
    if (st.ok()) {
      st = PostWithCredit([&] {
        return s.ep->PostRead({staging_.get(), StagingOffset(c.id, 3), layout::kAlign},
                              transport::AtOffset(s.weights, hdr), ctx);
      });
    }
  }
  if (!st.ok()) {
    const uint64_t h = c.pull_handle;
    c.pull_handle = 0;
    FinishChunk(h, st);
  }
}

void ClientImpl::EvaluatePull(ChunkRt& c) {
  const auto* h1 = reinterpret_cast<const layout::ChunkHeader*>(Staging(c.id, 2));
  const auto* h2 = reinterpret_cast<const layout::ChunkHeader*>(Staging(c.id, 3));
  const uint64_t state = h1->state.load(std::memory_order_relaxed);
  const uint64_t v = state >> 1;
  const uint32_t b = static_cast<uint32_t>(state & 1);
  const bool ready =
      v >= 1 && h1->min_clock_plus1[b].load(std::memory_order_relaxed) >= c.required_plus1;
  if (!ready) {
    if (SteadyClock::now() > c.pull_deadline) {
      const uint64_t h = c.pull_handle;
      c.pull_handle = 0;
      FinishChunk(h, DeadlineExceededError(
                         "chunk " + std::to_string(c.id) + " on server " +
                         std::to_string(c.server) + " did not reach the consistency bound (" +
                         consistency() + ", clock " + std::to_string(clock_) + ") within " +
                         std::to_string(options_.wait_timeout.count()) + " ms"));
      return;
    }
    ++counters_.pull_retries;
    StartPull(c, PullPhase::kHeaderOnly);
    return;
  }
  if (c.phase == PullPhase::kHeaderOnly || b != c.guess) {
    // Now we know the buffer: read it, then the header again.
    if (c.phase != PullPhase::kHeaderOnly) ++counters_.pull_retries;
    c.guess = b;
    StartPull(c, PullPhase::kDataCheck);
    return;
  }
  if (h2->gen[b].load(std::memory_order_relaxed) != h1->gen[b].load(std::memory_order_relaxed)) {
    ++counters_.pull_retries;  // torn: the server began rewriting buffer b during our read
    StartPull(c, PullPhase::kHeaderOnly);
    return;
  }
  if (c.pulled_version != 0) c.flip = static_cast<uint32_t>((v - c.pulled_version) & 1);
  c.pulled_version = v;
  c.pulled_min_clock_plus1 = h1->min_clock_plus1[b].load(std::memory_order_relaxed);
  c.last_buf = b;
  const uint64_t h = c.pull_handle;
  c.pull_handle = 0;
  ++counters_.pulls;
  counters_.bytes_pulled += c.bytes;
  Status st;
  if (CudaStaging* staging = tensors_[c.tensor].staging.get()) {
    // This chunk goes to the device while the other chunks are still being read.
    st = staging->WeightsToDevice(c.offset, c.bytes);
  }
  FinishChunk(h, st);
}

StatusOr<Handle> ClientImpl::Pull(const std::string& name) {
  // kStarting: Start() pulls the initial weights.
  RETURN_IF_ERROR(lifecycle_.Require("Pull()", {ClientState::kStarting, ClientState::kRunning}));
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return NotFoundError("no tensor '" + name + "'");
  RETURN_IF_ERROR(MaybeRecover());
  const uint64_t h = next_handle_++ & 0xffffffffull;
  HandleState& hs = handles_[h];
  if (tensors_[it->second].staging != nullptr) hs.staged_pull_tensor = it->second;
  for (uint32_t id : tensors_[it->second].chunks) {
    ChunkRt& c = chunks_[id];
    if (c.pull_handle != 0) {
      hs.error = FailedPreconditionError("a pull of tensor '" + name + "' is already in flight");
      break;
    }
    c.pull_handle = h;
    c.required_plus1 = RequiredPlus1();
    c.pull_deadline = SteadyClock::now() + options_.wait_timeout;
    // Each version goes to the other buffer; guess that as many versions (mod 2) were
    // published since the last pull as between the last two (one per step in training, none
    // when the chunk is pulled again unchanged). A wrong guess costs a second round trip.
    c.guess = c.pulled_version == 0 ? 0 : c.last_buf ^ c.flip;
    ++hs.pending;
    StartPull(c, PullPhase::kAll);
  }
  return Handle{h};
}

Status ClientImpl::Wait(Handle handle) {
  RETURN_IF_ERROR(lifecycle_.Require("Wait()", {ClientState::kStarting, ClientState::kRunning}));
  auto it = handles_.find(handle.id);
  if (it == handles_.end()) return NotFoundError("unknown handle");
  // Bounded: every pending chunk has its own deadline, and endpoints fail within the
  // transport's bound when a server dies (their operations then complete in error). Two
  // backstops: an endpoint that has been in the error state for a grace period fails the wait
  // with its error even if a completion never arrived, and an absolute deadline.
  const auto deadline = SteadyClock::now() + options_.wait_timeout + std::chrono::seconds(30);
  constexpr auto kErrorGrace = std::chrono::seconds(2);
  auto next_check = SteadyClock::now();
  while (it->second.pending > 0) {
    RETURN_IF_ERROR(Progress());
    {
      bool failed = false;
      for (const Server& sv : servers_) failed = failed || sv.failed;
      if (failed && !recovering_) {
        RETURN_IF_ERROR(MaybeRecover());
        continue;
      }
    }
    const auto now = SteadyClock::now();
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(50);
      for (uint32_t i = 0; i < servers_.size(); ++i) {
        const Server& sv = servers_[i];
        if (!sv.ep || sv.ep->status().ok()) {
          errored_since_.erase(i);
          continue;
        }
        if (!recovering_) {
          RETURN_IF_ERROR(MaybeRecover());
          continue;
        }
        auto [e, fresh] = errored_since_.emplace(i, now);
        if (!fresh && now - e->second > kErrorGrace && sv.ep->outstanding() > 0) {
          return lifecycle_.Break(
              ServerError(i, "endpoint failed with operations still outstanding"));
        }
      }
    }
    if (now > deadline) {
      std::string who;
      for (uint32_t i = 0; i < servers_.size(); ++i) {
        const Server& sv = servers_[i];
        if (!sv.ep || sv.ep->outstanding() == 0) continue;
        who += "; server rank " + std::to_string(sv.rank) + " at " + sv.address + ": " +
               std::to_string(sv.ep->outstanding()) + " operations outstanding, endpoint " +
               (sv.ep->status().ok() ? std::string("healthy") : sv.ep->status().ToString());
      }
      return DeadlineExceededError("Wait timed out with " + std::to_string(it->second.pending) +
                                   " chunks outstanding" + who);
    }
  }
  Status s = it->second.error;
  if (it->second.staged_pull_tensor >= 0) {
    Status synced = tensors_[it->second.staged_pull_tensor].staging->SyncWeights();
    if (s.ok()) s = synced;
  }
  handles_.erase(it);
  return s;
}

Status ClientImpl::Clock() {
  RETURN_IF_ERROR(lifecycle_.Require("Clock()", {ClientState::kRunning}));
  ++clock_;
  RETURN_IF_ERROR(MaybeRecover());
  // Tell every server, one-sidedly: write the clock into this worker's clock slot with an
  // immediate. It follows this clock's pushes on the same endpoint, so the server knows every
  // push of the finished clocks is in (chunks this worker did not push stop waiting for it).
  for (Server& s : servers_) {
    Status st = SendClock(s);
    if (!st.ok()) {
      s.failed = true;  // the clock is sent again after the reconnect or failover (ResyncServer)
    }
  }
  return Status::OK();
}

Status ClientImpl::Step() {
  RETURN_IF_ERROR(lifecycle_.Require("Step()", {ClientState::kRunning}));
  struct InStep {
    bool* f;
    ~InStep() { *f = false; }
  } guard{&in_step_};
  in_step_ = true;
  ++step_id_;
  std::vector<Handle> hs;
  for (const Tensor& t : tensors_) {
    ASSIGN_OR_RETURN(Handle h, Push(t.name));
    hs.push_back(h);
  }
  Status first;
  for (Handle h : hs) {
    Status s = Wait(h);
    if (first.ok() && !s.ok()) first = s;
  }
  RETURN_IF_ERROR(first);
  RETURN_IF_ERROR(Clock());
  hs.clear();
  for (const Tensor& t : tensors_) {
    ASSIGN_OR_RETURN(Handle h, Pull(t.name));
    hs.push_back(h);
  }
  for (Handle h : hs) {
    Status s = Wait(h);
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

StatusOr<uint64_t> ClientImpl::RequestCheckpoint(const std::string& dir) {
  RETURN_IF_ERROR(lifecycle_.Require("RequestCheckpoint()", {ClientState::kRunning}));
  control::Envelope e;
  e.mutable_checkpoint()->set_clock(clock_ + 1);
  e.mutable_checkpoint()->set_dir(dir);
  RETURN_IF_ERROR(control_->Send(e));
  return clock_ + 1;
}

Status ClientImpl::Close() {
  if (!lifecycle_.Close()) return Status::OK();
  for (Server& s : servers_) s.ep.reset();
  if (control_) return control_->Leave("worker closing");
  return Status::OK();
}

}  // namespace worker
}  // namespace shardps
