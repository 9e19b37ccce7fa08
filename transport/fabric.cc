// Provider selection, descriptor encoding and the small shared helpers of transport.h.
#include <glog/logging.h>

#include <cstdio>
#include <cstring>
#include <sstream>

#include "transport/providers.h"
#include "transport/transport.h"

namespace shardps::transport {
namespace {

std::string ToHex(uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

const char* AccessName(Access a) {
  switch (a) {
    case Access::kLocalOnly:
      return "local-only";
    case Access::kRemoteRead:
      return "remote-read";
    case Access::kRemoteWrite:
      return "remote-write";
    case Access::kRemoteReadWrite:
      return "remote-read-write";
  }
  return "?";
}

const char* OpTypeName(OpType t) {
  switch (t) {
    case OpType::kWrite:
      return "write";
    case OpType::kWriteImm:
      return "write-imm";
    case OpType::kRead:
      return "read";
    case OpType::kRecvImm:
      return "recv-imm";
  }
  return "?";
}

const char* WcStatusName(WcStatus s) {
  switch (s) {
    case WcStatus::kSuccess:
      return "success";
    case WcStatus::kRemoteAccessError:
      return "remote-access-error";
    case WcStatus::kFlushed:
      return "flushed";
    case WcStatus::kRetryExceeded:
      return "retry-exceeded";
    case WcStatus::kRemoteDisconnected:
      return "remote-disconnected";
    case WcStatus::kLocalError:
      return "local-error";
    case WcStatus::kRemoteOperationError:
      return "remote-operation-error";
  }
  return "?";
}

namespace {

// Descriptor wire format, version 1 (little-endian; see docs/transport.md):
//   u8 version=1 | u8 access | u16 provider_len | u32 rkey | u64 addr | u64 length |
//   u32 provider_data_len | provider bytes | provider_data bytes
constexpr uint8_t kDescriptorVersion = 1;
constexpr size_t kDescriptorFixed = 1 + 1 + 2 + 4 + 8 + 8 + 4;
constexpr size_t kMaxProviderName = 32;
constexpr size_t kMaxProviderData = 4096;

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

std::string RegionDescriptor::Encode() const {
  std::string out;
  out.reserve(kDescriptorFixed + provider.size() + provider_data.size());
  PutLe(&out, kDescriptorVersion, 1);
  PutLe(&out, static_cast<uint32_t>(access), 1);
  PutLe(&out, provider.size(), 2);
  PutLe(&out, rkey, 4);
  PutLe(&out, addr, 8);
  PutLe(&out, length, 8);
  PutLe(&out, provider_data.size(), 4);
  out += provider;
  out += provider_data;
  return out;
}

StatusOr<RegionDescriptor> RegionDescriptor::Decode(std::string_view bytes) {
  if (bytes.size() < kDescriptorFixed) {
    return InvalidArgumentError("region descriptor: truncated (" + std::to_string(bytes.size()) +
                                " bytes)");
  }
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  if (p[0] != kDescriptorVersion) {
    return InvalidArgumentError("region descriptor: unknown version " + std::to_string(p[0]));
  }
  RegionDescriptor d;
  if (p[1] > 3) return InvalidArgumentError("region descriptor: bad access bits");
  d.access = static_cast<Access>(p[1]);
  const size_t provider_len = GetLe(p + 2, 2);
  d.rkey = static_cast<uint32_t>(GetLe(p + 4, 4));
  d.addr = GetLe(p + 8, 8);
  d.length = GetLe(p + 16, 8);
  const size_t data_len = GetLe(p + 24, 4);
  if (provider_len == 0 || provider_len > kMaxProviderName || data_len > kMaxProviderData) {
    return InvalidArgumentError("region descriptor: bad field lengths");
  }
  if (bytes.size() != kDescriptorFixed + provider_len + data_len) {
    return InvalidArgumentError("region descriptor: length mismatch");
  }
  if (d.addr + d.length < d.addr) return InvalidArgumentError("region descriptor: wraps around");
  d.provider.assign(bytes.substr(kDescriptorFixed, provider_len));
  d.provider_data.assign(bytes.substr(kDescriptorFixed + provider_len, data_len));
  return d;
}

std::string RegionDescriptor::DebugString() const {
  std::ostringstream os;
  os << provider << "{addr=0x" << std::hex << addr << std::dec << " len=" << length << " rkey=0x"
     << std::hex << rkey << std::dec << " " << AccessName(access);
  if (!provider_data.empty()) os << " +" << provider_data.size() << "B";
  os << "}";
  return os.str();
}

Status Endpoint::Post(OpType type, const LocalSlice& local, const RemoteSlice& remote, uint32_t imm,
                      uint64_t context, uint32_t flags) {
  // The contract's "Checked posts", in its order; every provider relies on them.
  const MemoryRegion* region = local.region;
  if (region == nullptr) {
    return InvalidArgumentError(std::string("post ") + OpTypeName(type) +
                                ": the local slice names no region");
  }
  if (region->fabric() != fabric_) {
    return InvalidArgumentError(std::string("post ") + OpTypeName(type) +
                                ": the local region was not registered by this endpoint's fabric");
  }
  if ((flags & ~static_cast<uint32_t>(kUnsignaled | kMore)) != 0) {
    return InvalidArgumentError(std::string("post ") + OpTypeName(type) + ": unknown flags 0x" +
                                ToHex(flags));
  }
  if (local.length > max_operation_bytes_) {
    return InvalidArgumentError(std::string("post ") + OpTypeName(type) + ": " +
                                std::to_string(local.length) + " bytes is more than one " +
                                "operation moves on this provider (" +
                                std::to_string(max_operation_bytes_) + ")");
  }
  if (local.offset > region->length() || local.length > region->length() - local.offset) {
    return OutOfRangeError(std::string("post ") + OpTypeName(type) + ": local slice [" +
                           std::to_string(local.offset) + ", +" + std::to_string(local.length) +
                           ") exceeds its region of " + std::to_string(region->length()) +
                           " bytes");
  }
  if (local.length > 0 && remote.addr + local.length - 1 < remote.addr) {
    return OutOfRangeError(std::string("post ") + OpTypeName(type) + ": remote slice [0x" +
                           ToHex(remote.addr) + ", +" + std::to_string(local.length) +
                           ") wraps around the address space");
  }
  return PostChecked(type, local, remote, imm, context, flags);
}

Status Endpoint::PostReadList(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                              uint64_t context, uint32_t flags) {
  if (pieces == nullptr || n == 0 || n > kMaxReadPieces) {
    return InvalidArgumentError("post read list: " + std::to_string(n) + " pieces (1 to " +
                                std::to_string(kMaxReadPieces) + ")");
  }
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const ReadPiece& p = pieces[i];
    if (p.length == 0 || p.length > max_operation_bytes_ ||
        p.remote.addr + p.length - 1 < p.remote.addr) {
      return OutOfRangeError("post read list: piece " + std::to_string(i) + " [0x" +
                             ToHex(p.remote.addr) + ", +" + std::to_string(p.length) +
                             ") is empty, too large or wraps");
    }
    total += p.length;
  }
  if (total != dst.length) {
    return InvalidArgumentError("post read list: the pieces hold " + std::to_string(total) +
                                " bytes, the local slice " + std::to_string(dst.length));
  }
  // The local slice as any read's (region, fabric, flags, size, bounds).
  const MemoryRegion* region = dst.region;
  if (region == nullptr || region->fabric() != fabric_) {
    return InvalidArgumentError("post read list: the local slice names no region of this fabric");
  }
  if ((flags & ~static_cast<uint32_t>(kUnsignaled | kMore)) != 0) {
    return InvalidArgumentError("post read list: unknown flags 0x" + ToHex(flags));
  }
  if (dst.length > max_operation_bytes_) {
    return InvalidArgumentError("post read list: " + std::to_string(dst.length) +
                                " bytes is more than one operation moves on this provider (" +
                                std::to_string(max_operation_bytes_) + ")");
  }
  if (dst.offset > region->length() || dst.length > region->length() - dst.offset) {
    return OutOfRangeError("post read list: local slice [" + std::to_string(dst.offset) + ", +" +
                           std::to_string(dst.length) + ") exceeds its region of " +
                           std::to_string(region->length()) + " bytes");
  }
  return PostReadListChecked(dst, pieces, n, context, flags);
}

Status Endpoint::PostReadListChecked(const LocalSlice& dst, const ReadPiece* pieces, size_t n,
                                     uint64_t context, uint32_t flags) {
  uint64_t off = dst.offset;
  for (size_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(PostChecked(OpType::kRead, {dst.region, off, pieces[i].length},
                                pieces[i].remote, 0, context,
                                i + 1 == n ? flags : static_cast<uint32_t>(kUnsignaled)));
    off += pieces[i].length;
  }
  return Status::OK();
}

std::string CompiledProviders() {
  std::string s = "tcp,shm";
#ifdef SHARDPS_HAVE_VERBS
  s += ",verbs";
#endif
  return s;
}

StatusOr<std::unique_ptr<Fabric>> Fabric::Open(const FabricOptions& options) {
  const std::string& name = options.provider;
  if (name == "tcp") {
    auto f = OpenTcpFabric(options);
    if (f.ok()) LOG(INFO) << "transport: tcp (asked for by name): " << (*f)->DebugString();
    return f;
  }
  if (name == "shm") {
    auto f = OpenShmFabric(options);
    if (f.ok()) LOG(INFO) << "transport: shm (asked for by name): " << (*f)->DebugString();
    return f;
  }
  if (name == "verbs") {
#ifdef SHARDPS_HAVE_VERBS
    auto f = OpenVerbsFabric(options);
    if (f.ok()) LOG(INFO) << "transport: verbs (asked for by name): " << (*f)->DebugString();
    return f;
#else
    return UnavailableError(
        "transport 'verbs' was asked for, but this binary was built without verbs support "
        "(configure with -DSHARDPS_WITH_VERBS=ON and libibverbs-dev/librdmacm-dev installed)");
#endif
  }
  if (name == "auto") {
#ifdef SHARDPS_HAVE_VERBS
    auto f = OpenVerbsFabric(options);
    if (f.ok()) {
      LOG(INFO) << "transport: auto picked verbs, because an active RDMA port was found: "
                << (*f)->DebugString();
      return f;
    }
    const std::string why = f.status().ToString();
#else
    const std::string why = "built without verbs support";
#endif
    auto t = OpenTcpFabric(options);
    if (t.ok()) {
      LOG(INFO) << "transport: auto picked tcp, because verbs is not usable (" << why
                << "): " << (*t)->DebugString();
    }
    return t;
  }
  return InvalidArgumentError("unknown transport '" + name + "' (known: verbs, tcp, shm, auto)");
}

}  // namespace shardps::transport
