// Setup half of the verbs provider: fabric, memory registration, completion queue creation and
// the RC connection handshake (INIT -> RTR -> RTS). The data path is in verbs_datapath.cc.
#include <glog/logging.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#ifdef SHARDPS_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

#include "common/net.h"
#include "transport/populate.h"
#include "transport/providers.h"
#include "transport/verbs/verbs_internal.h"
#include "transport/verbs/verbs_testing.h"

namespace shardps::transport::verbs {
namespace {

// Queue pair constants. rnr_retry 7 means "retry forever": a target whose receive queue is
// momentarily empty (its caller has recv_depth kRecvImm completions unpolled) makes the
// initiator wait, as transport.h specifies, instead of failing.
constexpr int kRnrRetryInfinite = 7;
constexpr int kMinRnrTimer = 12;  // 0.64 ms
constexpr int kMaxRdAtomic = 16;
constexpr int kHopLimit = 64;
// One extra send-queue entry per QP for the drain marker posted after an error.
constexpr int kDrainWrs = 1;
// Soft-RoCE (rdma_rxe) reports this vendor id. Its completer treats retry_cnt == 7 as "retry
// forever" (rxe_comp.c: `if (qp->comp.retry_cnt != 7) qp->comp.retry_cnt--;`), unlike the IB
// spec where only rnr_retry 7 is infinite. We still pass 7 through: rxe's responder does not
// pace large RDMA READ responses (the veth drops them, "Failed sending ACK"), and only endless
// retries get a 16 MiB read through there. A dead peer is then reported by the bootstrap
// socket instead (EOF within milliseconds, TCP keepalive within ~15 s; verbs_handshake.cc).
constexpr uint32_t kRxeVendorId = 0xffffff;

void LogRetryPolicy(const VerbsDevice& device, int retry_count) {
  if (device.device_attr().vendor_id == kRxeVendorId && retry_count == 7) {
    static std::once_flag once;
    std::call_once(once, [&] {
      LOG(INFO) << "verbs: " << device.name() << " is Soft-RoCE (rxe), which treats retry_cnt 7 "
                << "as infinite: peer death is bounded by the bootstrap socket (EOF, or TCP "
                << "keepalive ~15 s), not by the QP retry budget";
    });
  }
}

int IbvAccess(Access access) {
  int a = IBV_ACCESS_LOCAL_WRITE;
  if (AllowsRemoteRead(access)) a |= IBV_ACCESS_REMOTE_READ;
  if (AllowsRemoteWrite(access)) a |= IBV_ACCESS_REMOTE_WRITE;
  return a;
}

Status ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, const char* what) {
  if (int rc = ibv_modify_qp(qp, attr, mask); rc != 0) {
    return UnavailableError(std::string("verbs: ibv_modify_qp to ") + what +
                            " failed: " + strerror(rc));
  }
  return Status::OK();
}

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng{std::random_device{}()};
  return rng() & 0xffffff;
}

#ifdef SHARDPS_HAVE_CUDA
// Registers device memory through dma-buf (the upstream path, no nvidia-peermem needed). The
// driver entry point is looked up through the runtime so nothing links libcuda directly.
StatusOr<MrPtr> RegisterCudaDmabuf(ibv_pd& pd, void* addr, size_t length, int access) {
  using GetHandleFn =
      CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &fn, 12000,
                                       cudaEnableDefault, &q) != cudaSuccess ||
      fn == nullptr) {
    return UnavailableError("cuMemGetHandleForAddressRange is not available from the driver");
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + length + page - 1) & ~(page - 1);
  int fd = -1;
  CUresult cr = reinterpret_cast<GetHandleFn>(fn)(&fd, static_cast<CUdeviceptr>(begin), end - begin,
                                                  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (cr != CUDA_SUCCESS || fd < 0) {
    return UnavailableError("cuMemGetHandleForAddressRange(DMA_BUF_FD) failed: CUresult " +
                            std::to_string(static_cast<int>(cr)));
  }
  UniqueFd owned(fd);
  MrPtr mr(ibv_reg_dmabuf_mr(&pd, reinterpret_cast<uintptr_t>(addr) - begin, length,
                             reinterpret_cast<uint64_t>(addr), fd, access));
  if (!mr) return ErrnoError("ibv_reg_dmabuf_mr", errno);
  return mr;
}
#endif

}  // namespace

// ---------------------------------------------------------------------------------------------
// Memory regions

void VerbsMemoryRegion::MmapDeleter::operator()(void* p) const {
  if (munmap(p, length) != 0) PLOG(ERROR) << "verbs: munmap of an allocated region";
}

VerbsMemoryRegion::VerbsMemoryRegion(std::shared_ptr<VerbsDevice> device, MappingPtr mapping,
                                     MrPtr mr, void* data, size_t length, Access access,
                                     MemoryKind kind)
    : MemoryRegion(device.get(), data, length, access, kind),
      device_(std::move(device)),
      mapping_(std::move(mapping)),
      mr_(std::move(mr)) {}

RegionDescriptor VerbsMemoryRegion::descriptor() const {
  RegionDescriptor d;
  d.provider = "verbs";
  d.addr = reinterpret_cast<uint64_t>(data());
  d.length = length();
  d.rkey = mr_->rkey;
  d.access = access();
  return d;
}

StatusOr<std::unique_ptr<MemoryRegion>> VerbsFabric::RegisterMemory(void* addr, size_t length,
                                                                    Access access,
                                                                    MemoryKind kind) {
  if (addr == nullptr || length == 0) {
    return InvalidArgumentError("verbs: RegisterMemory needs a non-null address and length > 0");
  }
  MutexLock lock(&mu_);
  MrPtr mr;
  if (kind == MemoryKind::kCuda) {
#ifdef SHARDPS_HAVE_CUDA
    auto dmabuf = RegisterCudaDmabuf(device_->pd(), addr, length, IbvAccess(access));
    if (dmabuf.ok()) {
      mr = std::move(dmabuf).value();
    } else {
      LOG(WARNING) << "verbs: dma-buf registration of CUDA memory failed ("
                   << dmabuf.status().message()
                   << "); falling back to ibv_reg_mr, which needs nvidia-peermem";
      ASSIGN_OR_RETURN(mr, createMr(device_->pd(), addr, length, IbvAccess(access)));
    }
#else
    return UnimplementedError("verbs: CUDA memory needs a build with CUDA (SHARDPS_HAVE_CUDA)");
#endif
  } else {
    ASSIGN_OR_RETURN(mr, createMr(device_->pd(), addr, length, IbvAccess(access)));
  }
  return std::unique_ptr<MemoryRegion>(
      new VerbsMemoryRegion(device_, VerbsMemoryRegion::MappingPtr(nullptr, {0}), std::move(mr),
                            addr, length, access, kind));
}

StatusOr<std::unique_ptr<MemoryRegion>> VerbsFabric::AllocateMemory(size_t length, Access access) {
  if (length == 0) return InvalidArgumentError("verbs: AllocateMemory of 0 bytes");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t mapped = (length + page - 1) / page * page;
  // Written before it is pinned: a read-only registration of untouched anonymous memory would
  // otherwise pin the shared zero page. ibv_reg_mr then faults nothing in.
  ASSIGN_OR_RETURN(void* p, MapPopulated(mapped, "verbs"));
  VerbsMemoryRegion::MappingPtr mapping(p, {mapped});
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(MrPtr mr, createMr(device_->pd(), p, length, IbvAccess(access)));
  return std::unique_ptr<MemoryRegion>(new VerbsMemoryRegion(
      device_, std::move(mapping), std::move(mr), p, length, access, MemoryKind::kHost));
}

// ---------------------------------------------------------------------------------------------
// Completion queues

CqState::CqState(std::shared_ptr<VerbsDevice> device, int depth)
    : device_(std::move(device)), quota_(depth) {}

CqState::~CqState() {
  if (wake_.get() >= 0) device_->async_events().RemoveWaker(wake_.get());
  if (cq_ && unacked_events_ > 0) ibv_ack_cq_events(cq_.get(), unacked_events_);
  // As for a QP: destroyed first, then what an async event recorded for it is dropped.
  if (cq_) {
    const ibv_cq* cq = cq_.get();
    cq_.reset();
    device_->async_events().ForgetCq(cq);
  }
}

Status CqState::init() {
  ASSIGN_OR_RETURN(channel_, createCompChannel(device_->context()));
  // Live CQEs never exceed depth (+1 drain marker per endpoint), but rxe does not purge the
  // CQEs of a destroyed QP from its CQ; twice the depth leaves room for such stale entries,
  // which PollOnPollingThread drops by generation.
  int entries = 2 * quota_.depth() + 64;
  entries = std::min(entries, device_->device_attr().max_cqe);
  ASSIGN_OR_RETURN(cq_, createCq(device_->context(), entries, channel_.get()));
  epoll_ = UniqueFd(epoll_create1(EPOLL_CLOEXEC));
  if (epoll_.get() < 0) return ErrnoError("verbs: epoll_create1", errno);
  // The device's async events (verbs_async.h): its fd, shared by every CQ of the device, and
  // our own wake-up for events another CQ's thread read.
  wake_ = UniqueFd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake_.get() < 0) return ErrnoError("verbs: eventfd", errno);
  for (auto [fd, tag] : {std::pair<int, uint64_t>{device_->async_events().fd(), kEpollAsyncTag},
                         std::pair<int, uint64_t>{wake_.get(), kEpollWakeTag}}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return ErrnoError("verbs: epoll_ctl(ADD) of an async event fd", errno);
    }
  }
  device_->async_events().AddWaker(wake_.get());
  pending_.resize(static_cast<size_t>(quota_.depth()) + 1);
  return Status::OK();
}

StatusOr<std::unique_ptr<CompletionQueue>> VerbsFabric::CreateCompletionQueue(int depth) {
  if (depth <= 0) return InvalidArgumentError("verbs: completion queue depth must be > 0");
  if (depth > device_->device_attr().max_cqe / 2) {
    return InvalidArgumentError("verbs: completion queue depth " + std::to_string(depth) +
                                " exceeds half the device's max_cqe (" +
                                std::to_string(device_->device_attr().max_cqe) + ")");
  }
  MutexLock lock(&mu_);
  auto state = std::make_shared<CqState>(device_, depth);
  RETURN_IF_ERROR(state->init());
  return std::unique_ptr<CompletionQueue>(new VerbsCompletionQueue(std::move(state)));
}

// ---------------------------------------------------------------------------------------------
// Connections

StatusOr<std::unique_ptr<Listener>> VerbsFabric::Listen(const std::string& address) {
  std::string ip;
  int port = 0;
  ASSIGN_OR_RETURN(UniqueFd fd, TcpListen(address, options_.bind_ip, &ip, &port));
  if (ip == "0.0.0.0" || ip == "::") {
    // Advertise the address of the RDMA port itself when it has an IPv4-mapped GID.
    const uint8_t* g = device_->gid().raw;
    static const uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (std::memcmp(g, kPrefix, 12) == 0) {
      ip = std::to_string(g[12]) + "." + std::to_string(g[13]) + "." + std::to_string(g[14]) + "." +
           std::to_string(g[15]);
    }
  }
  const std::string resolved =
      (ip.find(':') != std::string::npos ? "[" + ip + "]" : ip) + ":" + std::to_string(port);
  LOG(INFO) << "verbs: listening on " << resolved << " (bootstrap TCP), " << DebugString();
  return std::unique_ptr<Listener>(new VerbsListener(this, std::move(fd), resolved));
}

StatusOr<std::unique_ptr<Endpoint>> VerbsListener::Accept(CompletionQueue* cq,
                                                          const EndpointOptions& options,
                                                          std::chrono::milliseconds timeout) {
  // The gate multiplexes every bootstrap connection that has not yet authenticated, so a
  // silent stranger never holds this call; the queue pair is created only for a peer that
  // passed it.
  auto accept_one = [this]() -> StatusOr<HandshakeGate::Accepted> {
    std::string peer, ip;
    ASSIGN_OR_RETURN(UniqueFd fd, TcpAcceptNow(fd_.get(), &peer, &ip));
    return HandshakeGate::Accepted{std::move(fd), ip};
  };
  ASSIGN_OR_RETURN(HandshakeGate::Passed passed,
                   gate_.Next(fd_.get(), accept_one, authenticator(),
                              std::chrono::steady_clock::now() + timeout));
  const std::string peer = passed.source;
  const Deadline deadline = std::chrono::steady_clock::now() + options.connect_timeout;
  auto ep = fabric_->establish(std::move(passed.fd), cq, options, address_, peer, deadline);
  if (!ep.ok()) return ep.status().WithContext("verbs: accept from " + peer);
  (*ep)->set_peer_identity(std::move(passed.identity));
  return ep;
}

StatusOr<std::unique_ptr<Endpoint>> VerbsFabric::Connect(const std::string& address,
                                                         CompletionQueue* cq,
                                                         const EndpointOptions& options) {
  const Deadline deadline = std::chrono::steady_clock::now() + options.connect_timeout;
  // A full CQ fails here, before the listener's challenge is awaited (establish re-checks).
  if (auto* vcq = dynamic_cast<VerbsCompletionQueue*>(cq);
      vcq != nullptr && options.send_depth > 0 && options.recv_depth >= 0) {
    RETURN_IF_ERROR(vcq->state()->checkRoom(options.send_depth + options.recv_depth)
                        .WithContext("verbs: connect to " + address));
  }
  std::string local;
  ASSIGN_OR_RETURN(UniqueFd fd,
                   TcpConnect(address, options_.bind_ip, deadline, &local, options.retry_refused));
  RETURN_IF_ERROR(
      auth::ConnectorHandshake(fd.get(), options.auth_identity, options.auth_key, deadline)
          .WithContext("verbs: connect to " + address));
  auto ep = establish(std::move(fd), cq, options, local, address, deadline);
  if (!ep.ok()) return ep.status().WithContext("verbs: connect to " + address);
  return ep;
}

StatusOr<std::unique_ptr<Endpoint>> VerbsFabric::establish(UniqueFd fd, CompletionQueue* cq,
                                                           const EndpointOptions& options,
                                                           const std::string& local,
                                                           const std::string& remote,
                                                           Deadline deadline) {
  auto* vcq = dynamic_cast<VerbsCompletionQueue*>(cq);
  if (vcq == nullptr) {
    return InvalidArgumentError("the completion queue was not created by a verbs fabric");
  }
  if (&vcq->state()->device() != device_.get()) {
    return InvalidArgumentError("the completion queue belongs to another verbs fabric");
  }
  const ibv_device_attr& da = device_->device_attr();
  if (options.send_depth < 1 || options.recv_depth < 0 ||
      options.send_depth + kDrainWrs > da.max_qp_wr || options.recv_depth > da.max_qp_wr) {
    return InvalidArgumentError("verbs: send_depth " + std::to_string(options.send_depth) +
                                " / recv_depth " + std::to_string(options.recv_depth) +
                                " out of range (device max_qp_wr " + std::to_string(da.max_qp_wr) +
                                ")");
  }

  // 1. Create the RC queue pair and move it to INIT.
  QpPtr qp;
  int max_inline = std::max(0, options_.max_inline);
  {
    MutexLock lock(&mu_);
    ibv_qp_init_attr ia{};
    ia.send_cq = vcq->state()->cq();
    ia.recv_cq = vcq->state()->cq();
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;
    ia.cap.max_send_wr = static_cast<uint32_t>(options.send_depth + kDrainWrs);
    ia.cap.max_recv_wr = static_cast<uint32_t>(std::max(options.recv_depth, 1));
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = static_cast<uint32_t>(max_inline);
    auto created = createQp(device_->pd(), &ia);
    if (!created.ok() && max_inline > 0) {
      LOG(WARNING) << "verbs: ibv_create_qp with max_inline_data " << max_inline << " failed ("
                   << created.status().message() << "); retrying without inline data";
      ia.cap.max_inline_data = 0;
      created = createQp(device_->pd(), &ia);
    }
    if (!created.ok()) return created.status();
    qp = std::move(created).value();
    max_inline = std::min<int>(max_inline, static_cast<int>(ia.cap.max_inline_data));
  }
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = static_cast<uint8_t>(device_->port());
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  RETURN_IF_ERROR(ModifyQp(qp.get(), &attr,
                           IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                           "INIT"));

  // 2. The endpoint owns the QP from here on. Attaching it reserves its CQ quota (a full CQ
  //    fails here, before anything is sent), and its receives are posted before RTR so a peer
  //    that reaches RTS first never finds an empty receive queue.
  EndpointConfig config;
  config.options = options;
  config.max_inline = max_inline;
  config.signal_interval = std::clamp(options_.signal_interval, 1, options.send_depth);
  config.description = "verbs:" + local + "->" + remote;
  ibv_qp* raw_qp = qp.get();
  auto ep = std::make_unique<VerbsEndpoint>(device_, vcq->state(), std::move(qp), config);
  RETURN_IF_ERROR(ep->start());

  // 3. Exchange attributes over the bootstrap socket.
  QpInfo mine;
  mine.link_layer = device_->is_roce() ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
  mine.mtu = static_cast<uint8_t>(device_->active_mtu());
  mine.qpn = raw_qp->qp_num;
  mine.psn = RandomPsn();
  mine.lid = device_->lid();
  mine.responder_resources = static_cast<uint8_t>(std::clamp(da.max_qp_rd_atom, 1, kMaxRdAtomic));
  mine.recv_depth = static_cast<uint32_t>(options.recv_depth);
  std::memcpy(mine.gid, device_->gid().raw, 16);
  uint8_t wire[kQpInfoWireSize];
  EncodeQpInfo(mine, wire);
  RETURN_IF_ERROR(
      net::SendAll(fd.get(), wire, sizeof(wire), deadline, "verbs bootstrap: send queue pair"));
  RETURN_IF_ERROR(
      net::RecvAll(fd.get(), wire, sizeof(wire), deadline, "verbs bootstrap: peer's queue pair"));
  ASSIGN_OR_RETURN(QpInfo peer, DecodeQpInfo(wire, sizeof(wire)));
  if (peer.link_layer != mine.link_layer) {
    return InvalidArgumentError("verbs handshake: link layer mismatch (peer " +
                                std::to_string(peer.link_layer) + ", local " +
                                std::to_string(mine.link_layer) + ")");
  }

  ep->setDescription("verbs:" + local + "(qpn " + std::to_string(mine.qpn) + ")->" + remote +
                     "(qpn " + std::to_string(peer.qpn) + ")");

  // 4. RTR, then RTS.
  attr = {};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = std::min(device_->active_mtu(), static_cast<ibv_mtu>(peer.mtu));
  attr.dest_qp_num = peer.qpn;
  attr.rq_psn = peer.psn;
  attr.max_dest_rd_atomic = mine.responder_resources;
  attr.min_rnr_timer = kMinRnrTimer;
  attr.ah_attr.port_num = static_cast<uint8_t>(device_->port());
  if (device_->is_roce()) {
    attr.ah_attr.is_global = 1;
    std::memcpy(attr.ah_attr.grh.dgid.raw, peer.gid, 16);
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(device_->gid_index());
    attr.ah_attr.grh.hop_limit = kHopLimit;
  } else {
    attr.ah_attr.dlid = peer.lid;
  }
  RETURN_IF_ERROR(ModifyQp(raw_qp, &attr,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                           "RTR"));
  attr = {};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = static_cast<uint8_t>(options_.rdma_timeout);
  attr.retry_cnt = static_cast<uint8_t>(options_.rdma_retry_count);
  LogRetryPolicy(*device_, options_.rdma_retry_count);
  attr.rnr_retry = kRnrRetryInfinite;
  attr.sq_psn = mine.psn;
  attr.max_rd_atomic =
      static_cast<uint8_t>(std::min({std::max(da.max_qp_init_rd_atom, 1),
                                     static_cast<int>(peer.responder_resources), kMaxRdAtomic}));
  RETURN_IF_ERROR(ModifyQp(raw_qp, &attr,
                           IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                               IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                           "RTS"));

  // 5. Both sides in RTS: exchange `ready`, then keep the socket as the liveness channel.
  uint8_t ready[4] = {static_cast<uint8_t>(kReadyMagic), static_cast<uint8_t>(kReadyMagic >> 8),
                      static_cast<uint8_t>(kReadyMagic >> 16),
                      static_cast<uint8_t>(kReadyMagic >> 24)};
  RETURN_IF_ERROR(
      net::SendAll(fd.get(), ready, sizeof(ready), deadline, "verbs bootstrap: send ready"));
  uint8_t got[4] = {};
  RETURN_IF_ERROR(
      net::RecvAll(fd.get(), got, sizeof(got), deadline, "verbs bootstrap: peer's ready"));
  if (std::memcmp(got, ready, sizeof(ready)) != 0) {
    return InvalidArgumentError("verbs handshake: malformed peer message: bad ready marker");
  }
  ep->adoptBootstrap(std::move(fd));
  VLOG(1) << "verbs: connected " << ep->DebugString() << " mtu "
          << (128 << static_cast<int>(attr.path_mtu)) << " inline " << max_inline
          << " signal_interval " << config.signal_interval;
  return std::unique_ptr<Endpoint>(std::move(ep));
}

}  // namespace shardps::transport::verbs

namespace shardps::transport {

StatusOr<std::unique_ptr<Fabric>> OpenVerbsFabric(const FabricOptions& options) {
  if (options.rdma_timeout < 0 || options.rdma_timeout > 31) {
    return InvalidArgumentError("verbs: rdma_timeout must be in 0..31");
  }
  if (options.rdma_retry_count < 0 || options.rdma_retry_count > 7) {
    return InvalidArgumentError("verbs: rdma_retry_count must be in 0..7");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<verbs::VerbsDevice> device, verbs::VerbsDevice::open(options));
  return std::unique_ptr<Fabric>(new verbs::VerbsFabric(std::move(device), options));
}

}  // namespace shardps::transport

namespace shardps::transport::verbs {

Status DropLivenessChannelForTesting(Endpoint* endpoint) {
  auto* ep = dynamic_cast<VerbsEndpoint*>(endpoint);
  if (ep == nullptr) return InvalidArgumentError("not a verbs endpoint");
  ep->adoptBootstrap(UniqueFd());
  return Status::OK();
}

}  // namespace shardps::transport::verbs

namespace shardps::transport::verbs {

Status ResizeCqForTesting(CompletionQueue* cq, int entries) {
  auto* vcq = dynamic_cast<VerbsCompletionQueue*>(cq);
  if (vcq == nullptr) return InvalidArgumentError("not a verbs completion queue");
  if (int rc = ibv_resize_cq(vcq->state()->cq(), entries); rc != 0) {
    return ErrnoError("ibv_resize_cq(" + std::to_string(entries) + ")", rc);
  }
  return Status::OK();
}

uint64_t AsyncEventsSeenForTesting(CompletionQueue* cq) {
  auto* vcq = dynamic_cast<VerbsCompletionQueue*>(cq);
  return vcq == nullptr ? 0 : vcq->state()->device().async_events().events_seen();
}

}  // namespace shardps::transport::verbs
