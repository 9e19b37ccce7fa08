// Deleters and create*() helpers of verbs_ibv.h.
#include "transport/verbs/verbs_ibv.h"

#include <glog/logging.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace shardps::transport::verbs {

void ContextDeleter::operator()(ibv_context* c) const {
  if (int rc = ibv_close_device(c); rc != 0) LOG(ERROR) << "verbs: ibv_close_device failed: " << rc;
}
void PdDeleter::operator()(ibv_pd* pd) const {
  if (int rc = ibv_dealloc_pd(pd); rc != 0) {
    LOG(ERROR) << "verbs: ibv_dealloc_pd failed: " << strerror(rc) << " (objects still use it)";
  }
}
void CompChannelDeleter::operator()(ibv_comp_channel* ch) const {
  if (int rc = ibv_destroy_comp_channel(ch); rc != 0) {
    LOG(ERROR) << "verbs: ibv_destroy_comp_channel failed: " << strerror(rc);
  }
}
void CqDeleter::operator()(ibv_cq* cq) const {
  if (int rc = ibv_destroy_cq(cq); rc != 0) {
    LOG(ERROR) << "verbs: ibv_destroy_cq failed: " << strerror(rc);
  }
}
void QpDeleter::operator()(ibv_qp* qp) const {
  if (int rc = ibv_destroy_qp(qp); rc != 0) {
    LOG(ERROR) << "verbs: ibv_destroy_qp(qpn " << qp->qp_num << ") failed: " << strerror(rc);
  }
}
void MrDeleter::operator()(ibv_mr* mr) const {
  if (int rc = ibv_dereg_mr(mr); rc != 0) LOG(ERROR) << "verbs: ibv_dereg_mr failed: " << strerror(rc);
}
void CmIdDeleter::operator()(rdma_cm_id* id) const {
  if (rdma_destroy_id(id) != 0) LOG(ERROR) << "verbs: rdma_destroy_id failed: " << strerror(errno);
}

DeviceListPtr getDeviceList(int* count) {
  *count = 0;
  DeviceListPtr list(ibv_get_device_list(count));
  if (!list) *count = 0;
  return list;
}

StatusOr<ContextPtr> createContext(ibv_device& device) {
  ContextPtr ctx(ibv_open_device(&device));
  if (!ctx) {
    return ErrnoError(std::string("ibv_open_device(") + ibv_get_device_name(&device) + ")", errno);
  }
  return ctx;
}

StatusOr<PdPtr> createPd(ibv_context& context) {
  PdPtr pd(ibv_alloc_pd(&context));
  if (!pd) return ErrnoError("ibv_alloc_pd", errno);
  return pd;
}

StatusOr<CompChannelPtr> createCompChannel(ibv_context& context) {
  CompChannelPtr ch(ibv_create_comp_channel(&context));
  if (!ch) return ErrnoError("ibv_create_comp_channel", errno);
  return ch;
}

StatusOr<CqPtr> createCq(ibv_context& context, int cqe, ibv_comp_channel* channel) {
  CqPtr cq(ibv_create_cq(&context, cqe, nullptr, channel, 0));
  if (!cq) return ErrnoError("ibv_create_cq(" + std::to_string(cqe) + " entries)", errno);
  return cq;
}

StatusOr<QpPtr> createQp(ibv_pd& pd, ibv_qp_init_attr* attr) {
  QpPtr qp(ibv_create_qp(&pd, attr));
  if (!qp) return ErrnoError("ibv_create_qp", errno);
  return qp;
}

StatusOr<MrPtr> createMr(ibv_pd& pd, void* addr, size_t length, int access) {
  MrPtr mr(ibv_reg_mr(&pd, addr, length, access));
  if (!mr) return ErrnoError("ibv_reg_mr(" + std::to_string(length) + " bytes)", errno);
  return mr;
}

}  // namespace shardps::transport::verbs
