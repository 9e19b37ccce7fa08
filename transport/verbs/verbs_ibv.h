// RAII ownership of libibverbs / librdmacm objects (internal to transport/verbs).
//
// Every verbs object is a std::unique_ptr with a stateless deleter. Deleters log a failure and
// never throw; the create*() helpers take their parent by reference and report failures as
// Status values carrying errno. Owners declare members in dependency order (context, pd,
// channel, cq, qp, mr) so that teardown in reverse declaration order is always legal.
//
// Thread safety: these are plain owning handles; the owner decides who may touch them.
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_IBV_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_IBV_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <memory>

#include "common/status.h"

namespace shardps::transport::verbs {

struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};
struct ContextDeleter {
  void operator()(ibv_context* c) const;
};
struct PdDeleter {
  void operator()(ibv_pd* pd) const;
};
struct CompChannelDeleter {
  void operator()(ibv_comp_channel* ch) const;
};
struct CqDeleter {
  void operator()(ibv_cq* cq) const;
};
struct QpDeleter {
  void operator()(ibv_qp* qp) const;
};
struct MrDeleter {
  void operator()(ibv_mr* mr) const;
};
struct CmIdDeleter {
  void operator()(rdma_cm_id* id) const;
};

using DeviceListPtr = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using ContextPtr = std::unique_ptr<ibv_context, ContextDeleter>;
using PdPtr = std::unique_ptr<ibv_pd, PdDeleter>;
using CompChannelPtr = std::unique_ptr<ibv_comp_channel, CompChannelDeleter>;
using CqPtr = std::unique_ptr<ibv_cq, CqDeleter>;
using QpPtr = std::unique_ptr<ibv_qp, QpDeleter>;
using MrPtr = std::unique_ptr<ibv_mr, MrDeleter>;
using CmIdPtr = std::unique_ptr<rdma_cm_id, CmIdDeleter>;

// Device list; *count receives the number of devices (0 when RDMA is absent).
DeviceListPtr getDeviceList(int* count);
StatusOr<ContextPtr> createContext(ibv_device& device);
StatusOr<PdPtr> createPd(ibv_context& context);
StatusOr<CompChannelPtr> createCompChannel(ibv_context& context);
StatusOr<CqPtr> createCq(ibv_context& context, int cqe, ibv_comp_channel* channel);
StatusOr<QpPtr> createQp(ibv_pd& pd, ibv_qp_init_attr* attr);
StatusOr<MrPtr> createMr(ibv_pd& pd, void* addr, size_t length, int access);

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_IBV_H_
