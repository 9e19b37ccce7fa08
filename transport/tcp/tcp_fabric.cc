// Placeholder until the tcp provider lands: the provider reports itself unavailable.
#include "transport/providers.h"

namespace shardps::transport {

StatusOr<std::unique_ptr<Fabric>> OpenTcpFabric(const FabricOptions&) {
  return UnimplementedError("the tcp provider is not implemented yet");
}

}  // namespace shardps::transport
