// Command-line configuration of the transport (gflags). Binaries call FabricOptionsFromFlags();
// library code takes FabricOptions and never reads flags itself.
#ifndef SHARDPS_TRANSPORT_FLAGS_H_
#define SHARDPS_TRANSPORT_FLAGS_H_

#include "transport/transport.h"

namespace shardps::transport {

FabricOptions FabricOptionsFromFlags();

}  // namespace shardps::transport

#endif  // SHARDPS_TRANSPORT_FLAGS_H_
