// Provider factories, called only by Fabric::Open. Internal to transport/.
#ifndef SHARDPS_TRANSPORT_PROVIDERS_H_
#define SHARDPS_TRANSPORT_PROVIDERS_H_

#include <memory>

#include "transport/transport.h"

namespace shardps::transport {

StatusOr<std::unique_ptr<Fabric>> OpenTcpFabric(const FabricOptions& options);
StatusOr<std::unique_ptr<Fabric>> OpenShmFabric(const FabricOptions& options);
#ifdef SHARDPS_HAVE_VERBS
StatusOr<std::unique_ptr<Fabric>> OpenVerbsFabric(const FabricOptions& options);
#endif

}  // namespace shardps::transport

#endif  // SHARDPS_TRANSPORT_PROVIDERS_H_
