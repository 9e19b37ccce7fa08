// Device, port and GID selection for the verbs provider (internal to transport/verbs).
//
// VerbsDevice is the opened HCA of one fabric: the ibv_context, the protection domain, the port
// and the GID every queue pair of the fabric uses. It is shared (std::shared_ptr) by the fabric
// and by every region, completion queue and endpoint created from it, so it outlives them all
// whatever order the caller destroys them in.
//
// Thread safety: immutable after open(); all accessors may be called from any thread (the
// async events object synchronises itself).
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_DEVICE_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_DEVICE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"
#include "transport/verbs/verbs_async.h"
#include "transport/verbs/verbs_ibv.h"

namespace shardps::transport::verbs {

enum class GidType { kIb, kRoceV1, kRoceV2, kUnknown };

// One populated entry of a port's GID table.
struct GidEntry {
  int index = 0;
  GidType type = GidType::kUnknown;
  std::array<uint8_t, 16> raw{};
};

struct GidChoice {
  int index = -1;
  std::string reason;  // why this entry, for logs and DebugString()
};

// Automatic GID selection (rdma_gid_index = -1), a pure function so it is testable without a
// device: the RoCEv2 entry whose address is IPv4-mapped (::ffff:a.b.c.d), preferring the one
// equal to bind_ip; failing that the first IPv4-mapped RoCEv1 entry, then the first RoCEv2 one.
// NotFound when the table has none of these.
StatusOr<GidChoice> ChooseAutoGid(const std::vector<GidEntry>& table, const std::string& bind_ip);

// "fe80::..." / "::ffff:192.168.77.1" style text.
std::string GidToString(const uint8_t raw[16]);
// "RoCEv2", "RoCEv1", "IB/RoCEv1", "unknown".
const char* GidTypeName(GidType t);

// Read-only inspection for diagnostics (shardps doctor): every device, each port's state and
// GID table, and the GID that automatic selection (ChooseAutoGid, the rule VerbsDevice::open
// applies for rdma_gid_index = -1) would pick for bind_ip. Opens contexts only: no PD, no QP.
struct PortInfo {
  int port = 0;
  std::string state;        // ibv_port_state_str: "active", "down", ...
  bool active = false;
  bool roce = false;        // Ethernet link layer
  int active_mtu = 0;       // bytes
  int gid_tbl_len = 0;
  std::vector<GidEntry> gids;  // populated entries only
  std::string auto_gid_error;  // non-empty when no GID can be chosen automatically
  GidChoice auto_gid;          // valid when auto_gid_error is empty (RoCE ports)
};
struct DeviceInfo {
  std::string name;
  std::string error;  // non-empty when the device could not be opened or queried
  std::vector<PortInfo> ports;
};
// Empty when ibv_get_device_list finds no device.
std::vector<DeviceInfo> InspectDevices(const std::string& bind_ip);

class VerbsDevice {
 public:
  // Selects and opens the device (see verbs_device.cc for the rules). Every failure is an
  // UnavailableError (or InvalidArgument for bad options) that names what was looked for.
  static StatusOr<std::shared_ptr<VerbsDevice>> open(const FabricOptions& options);

  ibv_context& context() const { return *context_; }
  ibv_pd& pd() const { return *pd_; }
  const std::string& name() const { return name_; }
  int port() const { return port_; }
  bool is_roce() const { return port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET; }
  uint16_t lid() const { return port_attr_.lid; }
  ibv_mtu active_mtu() const { return port_attr_.active_mtu; }
  int gid_index() const { return gid_index_; }
  const ibv_gid& gid() const { return gid_; }
  const ibv_device_attr& device_attr() const { return device_attr_; }
  // The context's asynchronous events (thread-safe; see verbs_async.h).
  AsyncEvents& async_events() const { return *async_; }
  std::string DebugString() const;

 private:
  VerbsDevice() = default;

  // Dependency order: the pd must be released before the context.
  ContextPtr context_;
  std::unique_ptr<AsyncEvents> async_;  // reads context_'s events: released before it
  PdPtr pd_;
  std::string name_;
  int port_ = 1;
  ibv_port_attr port_attr_{};
  ibv_device_attr device_attr_{};
  int gid_index_ = -1;
  ibv_gid gid_{};
  std::string how_chosen_;  // why this device/port
  std::string gid_reason_;  // why this GID
};

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_DEVICE_H_
