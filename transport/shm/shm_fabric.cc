// Placeholder until the shm provider lands: the provider reports itself unavailable.
#include "transport/providers.h"

namespace shardps::transport {

StatusOr<std::unique_ptr<Fabric>> OpenShmFabric(const FabricOptions&) {
  return UnimplementedError("the shm provider is not implemented yet");
}

}  // namespace shardps::transport
