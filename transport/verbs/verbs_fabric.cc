// Placeholder until the verbs provider lands: the provider reports itself unavailable.
#include "transport/providers.h"

namespace shardps::transport {

StatusOr<std::unique_ptr<Fabric>> OpenVerbsFabric(const FabricOptions&) {
  return UnimplementedError("the verbs provider is not implemented yet");
}

}  // namespace shardps::transport
