// Device, port and GID selection (see verbs_device.h).
//
// Device rules, first match wins:
//   1. options.rdma_device names the device (missing name -> UnavailableError);
//   2. options.bind_ip: librdmacm binds a cm_id to that address; the device and port that own
//      it are the answer (address not on an RDMA device -> UnavailableError);
//   3. the first device with an ACTIVE port.
// The chosen port must be ACTIVE. Nothing falls back to another device silently.
//
// GID rules: rdma_gid_index >= 0 is used as given; -1 picks the RoCEv2 IPv4-mapped entry (see
// ChooseAutoGid). On an InfiniBand link layer queue pairs are addressed by LID (GID index 0 is
// recorded for logs only).
#include "transport/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <glog/logging.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <sstream>

namespace shardps::transport::verbs {
namespace {

bool IsV4Mapped(const std::array<uint8_t, 16>& raw) {
  for (int i = 0; i < 10; ++i) {
    if (raw[i] != 0) return false;
  }
  return raw[10] == 0xff && raw[11] == 0xff;
}

GidType FromIbvGidType(uint32_t t) {
  switch (t) {
    case IBV_GID_TYPE_IB: return GidType::kIb;
    case IBV_GID_TYPE_ROCE_V1: return GidType::kRoceV1;
    case IBV_GID_TYPE_ROCE_V2: return GidType::kRoceV2;
  }
  return GidType::kUnknown;
}

const char* MtuName(ibv_mtu m) {
  switch (m) {
    case IBV_MTU_256: return "256";
    case IBV_MTU_512: return "512";
    case IBV_MTU_1024: return "1024";
    case IBV_MTU_2048: return "2048";
    case IBV_MTU_4096: return "4096";
  }
  return "?";
}

const char* PortStateName(ibv_port_state s) { return ibv_port_state_str(s); }

std::string DeviceNames(ibv_device** list, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += ibv_get_device_name(list[i]);
  }
  return s.empty() ? "none" : s;
}

// Reads the port's GID table: ibv_query_gid_table (one ioctl) when the kernel supports it, else
// ibv_query_gid_ex entry by entry (which itself falls back to sysfs gid_attrs/types/<i>).
std::vector<GidEntry> ReadGidTable(ibv_context& ctx, int port, int table_len) {
  std::vector<GidEntry> out;
  std::vector<ibv_gid_entry> entries(static_cast<size_t>(table_len) * 4 + 16);
  ssize_t n = ibv_query_gid_table(&ctx, entries.data(), entries.size(), 0);
  if (n >= 0) {
    for (ssize_t i = 0; i < n; ++i) {
      if (static_cast<int>(entries[i].port_num) != port) continue;
      GidEntry e;
      e.index = static_cast<int>(entries[i].gid_index);
      e.type = FromIbvGidType(entries[i].gid_type);
      std::memcpy(e.raw.data(), entries[i].gid.raw, 16);
      out.push_back(e);
    }
    return out;
  }
  VLOG(1) << "verbs: ibv_query_gid_table failed (" << strerror(errno)
          << "), reading entries one by one";
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(&ctx, port, i, &entry, 0) != 0) continue;  // empty slot: ENODATA
    GidEntry e;
    e.index = i;
    e.type = FromIbvGidType(entry.gid_type);
    std::memcpy(e.raw.data(), entry.gid.raw, 16);
    out.push_back(e);
  }
  return out;
}

// Finds the device and port owning `ip` with librdmacm. Returns the device name.
StatusOr<std::string> DeviceOwningIp(const std::string& ip, int* port) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  auto* sin = reinterpret_cast<sockaddr_in*>(&ss);
  auto* sin6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, ip.c_str(), &sin->sin_addr) == 1) {
    sin->sin_family = AF_INET;
    len = sizeof(*sin);
  } else if (inet_pton(AF_INET6, ip.c_str(), &sin6->sin6_addr) == 1) {
    sin6->sin6_family = AF_INET6;
    len = sizeof(*sin6);
  } else {
    return InvalidArgumentError("verbs: bind_ip '" + ip + "' is not a numeric IP address");
  }
  (void)len;
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(nullptr, &raw, nullptr, RDMA_PS_TCP) != 0) {
    return UnavailableError(std::string("verbs: rdma_create_id failed: ") + strerror(errno) +
                            " (is rdma_cm / ib_uverbs loaded?)");
  }
  CmIdPtr id(raw);
  if (rdma_bind_addr(id.get(), reinterpret_cast<sockaddr*>(&ss)) != 0) {
    return UnavailableError("verbs: bind_ip " + ip + " is not usable by RDMA CM (" +
                            strerror(errno) + "): no RDMA device owns that address");
  }
  if (id->verbs == nullptr) {
    return UnavailableError("verbs: bind_ip " + ip +
                            " is a local address but no RDMA device owns it");
  }
  *port = id->port_num;
  return std::string(ibv_get_device_name(id->verbs->device));
}

}  // namespace

const char* GidTypeName(GidType t) {
  switch (t) {
    case GidType::kIb: return "IB/RoCEv1";
    case GidType::kRoceV1: return "RoCEv1";
    case GidType::kRoceV2: return "RoCEv2";
    case GidType::kUnknown: return "unknown";
  }
  return "?";
}

std::string GidToString(const uint8_t raw[16]) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (!inet_ntop(AF_INET6, raw, buf, sizeof(buf))) return "?";
  return buf;
}

StatusOr<GidChoice> ChooseAutoGid(const std::vector<GidEntry>& table, const std::string& bind_ip) {
  std::array<uint8_t, 4> want{};
  const bool have_ip = !bind_ip.empty() && inet_pton(AF_INET, bind_ip.c_str(), want.data()) == 1;
  auto matches = [&](const GidEntry& e) {
    return have_ip && std::memcmp(e.raw.data() + 12, want.data(), 4) == 0;
  };
  auto text = [](const GidEntry& e) { return GidToString(e.raw.data()); };
  if (have_ip) {
    for (const auto& e : table) {
      if (e.type == GidType::kRoceV2 && IsV4Mapped(e.raw) && matches(e)) {
        return GidChoice{e.index, "RoCEv2 IPv4-mapped GID " + text(e) + " matches bind_ip " +
                                      bind_ip};
      }
    }
  }
  const std::string why_not =
      have_ip ? " (no RoCEv2 GID matches bind_ip " + bind_ip + ")" : " (no bind_ip given)";
  for (const auto& e : table) {
    if (e.type == GidType::kRoceV2 && IsV4Mapped(e.raw)) {
      return GidChoice{e.index, "first RoCEv2 IPv4-mapped GID " + text(e) + why_not};
    }
  }
  for (const auto& e : table) {
    if ((e.type == GidType::kRoceV1 || e.type == GidType::kIb) && IsV4Mapped(e.raw)) {
      return GidChoice{e.index, "no RoCEv2 IPv4-mapped GID; first IPv4-mapped " +
                                    std::string(GidTypeName(e.type)) + " GID " + text(e)};
    }
  }
  for (const auto& e : table) {
    if (e.type == GidType::kRoceV2) {
      return GidChoice{e.index, "no IPv4-mapped GID; first RoCEv2 GID " + text(e)};
    }
  }
  return NotFoundError("no RoCEv2 or IPv4-mapped GID in the port's GID table (" +
                       std::to_string(table.size()) +
                       " entries); is an IP address configured on the netdev?");
}

StatusOr<std::shared_ptr<VerbsDevice>> VerbsDevice::open(const FabricOptions& options) {
  int n = 0;
  DeviceListPtr list = getDeviceList(&n);
  if (n == 0) {
    return UnavailableError(
        "verbs: no RDMA device found (ibv_get_device_list returned none; load rdma_rxe or an "
        "HCA driver)");
  }
  std::shared_ptr<VerbsDevice> dev(new VerbsDevice());
  ibv_device* chosen = nullptr;
  int port = options.rdma_port;

  auto find_by_name = [&](const std::string& name) -> ibv_device* {
    for (int i = 0; i < n; ++i) {
      if (name == ibv_get_device_name(list.get()[i])) return list.get()[i];
    }
    return nullptr;
  };

  if (!options.rdma_device.empty()) {
    chosen = find_by_name(options.rdma_device);
    if (!chosen) {
      return UnavailableError("verbs: RDMA device '" + options.rdma_device +
                              "' not found (devices present: " + DeviceNames(list.get(), n) +
                              ")");
    }
    dev->how_chosen_ = "named by rdma_device";
  } else if (!options.bind_ip.empty()) {
    ASSIGN_OR_RETURN(std::string name, DeviceOwningIp(options.bind_ip, &port));
    chosen = find_by_name(name);
    if (!chosen) {
      return UnavailableError("verbs: RDMA CM maps bind_ip " + options.bind_ip + " to '" + name +
                              "', which ibv_get_device_list does not list");
    }
    dev->how_chosen_ = "owns bind_ip " + options.bind_ip + " (rdma_bind_addr)";
  } else {
    std::string seen;
    for (int i = 0; i < n && !chosen; ++i) {
      auto ctx = createContext(*list.get()[i]);
      if (!ctx.ok()) {
        seen += std::string(" ") + ibv_get_device_name(list.get()[i]) + ": cannot open;";
        continue;
      }
      ibv_device_attr da{};
      if (ibv_query_device(ctx->get(), &da) != 0) continue;
      for (int p = 1; p <= da.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx->get(), p, &pa) != 0) continue;
        seen += std::string(" ") + ibv_get_device_name(list.get()[i]) + ":" +
                std::to_string(p) + " " + PortStateName(pa.state) + ";";
        if (pa.state == IBV_PORT_ACTIVE) {
          chosen = list.get()[i];
          port = p;
          break;
        }
      }
    }
    if (!chosen) return UnavailableError("verbs: no RDMA device has an ACTIVE port:" + seen);
    dev->how_chosen_ = "first device with an ACTIVE port";
  }

  dev->name_ = ibv_get_device_name(chosen);
  ASSIGN_OR_RETURN(dev->context_, createContext(*chosen));
  dev->async_ = std::make_unique<AsyncEvents>(dev->context_.get(), dev->name_);
  RETURN_IF_ERROR(dev->async_->Init());
  if (ibv_query_device(dev->context_.get(), &dev->device_attr_) != 0) {
    return UnavailableError("verbs: ibv_query_device(" + dev->name_ + "): " + strerror(errno));
  }
  if (port < 1 || port > dev->device_attr_.phys_port_cnt) {
    return InvalidArgumentError("verbs: device " + dev->name_ + " has no port " +
                                std::to_string(port) + " (it has " +
                                std::to_string(dev->device_attr_.phys_port_cnt) + ")");
  }
  dev->port_ = port;
  if (ibv_query_port(dev->context_.get(), port, &dev->port_attr_) != 0) {
    return UnavailableError("verbs: ibv_query_port(" + dev->name_ + ":" + std::to_string(port) +
                            "): " + strerror(errno));
  }
  if (dev->port_attr_.state != IBV_PORT_ACTIVE) {
    return UnavailableError("verbs: port " + std::to_string(port) + " of " + dev->name_ +
                            " is " + PortStateName(dev->port_attr_.state) + ", not ACTIVE");
  }
  ASSIGN_OR_RETURN(dev->pd_, createPd(*dev->context_));

  // GID.
  const int table_len = dev->port_attr_.gid_tbl_len;
  if (options.rdma_gid_index >= 0) {
    if (options.rdma_gid_index >= table_len) {
      return InvalidArgumentError("verbs: rdma_gid_index " + std::to_string(options.rdma_gid_index) +
                                  " is outside the GID table of " + dev->name_ + " (" +
                                  std::to_string(table_len) + " entries)");
    }
    dev->gid_index_ = options.rdma_gid_index;
    dev->gid_reason_ = "rdma_gid_index given";
  } else if (!dev->is_roce()) {
    dev->gid_index_ = 0;
    dev->gid_reason_ = "InfiniBand link layer: queue pairs are addressed by LID";
  } else {
    std::vector<GidEntry> table = ReadGidTable(*dev->context_, port, table_len);
    auto choice = ChooseAutoGid(table, options.bind_ip);
    if (!choice.ok()) {
      return UnavailableError("verbs: " + dev->name_ + ":" + std::to_string(port) + ": " +
                              choice.status().message());
    }
    dev->gid_index_ = choice->index;
    dev->gid_reason_ = choice->reason;
  }
  if (ibv_query_gid(dev->context_.get(), port, dev->gid_index_, &dev->gid_) != 0) {
    return UnavailableError("verbs: ibv_query_gid(" + dev->name_ + ", index " +
                            std::to_string(dev->gid_index_) + "): " + strerror(errno));
  }
  LOG(INFO) << "verbs: device " << dev->name_ << " port " << port << " (" << dev->how_chosen_
            << "), GID index " << dev->gid_index_ << " " << GidToString(dev->gid_.raw) << ": "
            << dev->gid_reason_;
  return dev;
}

std::vector<DeviceInfo> InspectDevices(const std::string& bind_ip) {
  std::vector<DeviceInfo> out;
  int n = 0;
  DeviceListPtr list = getDeviceList(&n);
  for (int i = 0; i < n; ++i) {
    DeviceInfo d;
    d.name = ibv_get_device_name(list.get()[i]);
    auto ctx = createContext(*list.get()[i]);
    ibv_device_attr da{};
    if (!ctx.ok()) {
      d.error = ctx.status().message();
    } else if (ibv_query_device(ctx->get(), &da) != 0) {
      d.error = std::string("ibv_query_device: ") + strerror(errno);
    } else {
      for (int p = 1; p <= da.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx->get(), p, &pa) != 0) continue;
        PortInfo pi;
        pi.port = p;
        pi.state = PortStateName(pa.state);
        pi.active = pa.state == IBV_PORT_ACTIVE;
        pi.roce = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
        pi.active_mtu = 128 << static_cast<int>(pa.active_mtu);
        pi.gid_tbl_len = pa.gid_tbl_len;
        pi.gids = ReadGidTable(**ctx, p, pa.gid_tbl_len);
        if (pi.roce) {
          auto choice = ChooseAutoGid(pi.gids, bind_ip);
          if (choice.ok()) {
            pi.auto_gid = *choice;
          } else {
            pi.auto_gid_error = choice.status().message();
          }
        } else {
          pi.auto_gid = GidChoice{0, "InfiniBand link layer: queue pairs are addressed by LID"};
        }
        d.ports.push_back(std::move(pi));
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

std::string VerbsDevice::DebugString() const {
  std::ostringstream os;
  os << "verbs{device=" << name_ << " port=" << port_
     << " link=" << (is_roce() ? "ethernet(RoCE)" : "infiniband") << " gid_index=" << gid_index_
     << " gid=" << GidToString(gid_.raw);
  if (!is_roce()) os << " lid=0x" << std::hex << port_attr_.lid << std::dec;
  os << " mtu=" << MtuName(port_attr_.active_mtu) << " chosen_by=\"" << how_chosen_
     << "\" gid_by=\"" << gid_reason_ << "\"}";
  return os.str();
}

}  // namespace shardps::transport::verbs
