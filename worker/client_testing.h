// The testing seam of libshardps: a Client over a fabric the caller supplies instead of one it
// opens itself, e.g. a fault-injecting decorator of the real fabric
// (tests/integration/fault_injecting_fabric.h). Internal: not installed, not in
// worker/include; only tests and test fixtures include it.
//
// Thread safety: as Client::Connect (any thread; the client then belongs to that thread).
#ifndef SHARDPS_WORKER_CLIENT_TESTING_H_
#define SHARDPS_WORKER_CLIENT_TESTING_H_

#include <memory>

#include "shardps/client.h"
#include "transport/transport.h"

namespace shardps::worker {

// The options Client::Connect opens its fabric with (provider, bind address, RDMA device).
transport::FabricOptions ClientFabricOptions(const ClientOptions& options);

// Client::Connect, over `fabric` (open, of the cluster's provider; owned by the client from
// then on). options.transport and the other fabric fields are not used to open anything.
StatusOr<std::unique_ptr<Client>> ConnectOverFabric(const ClientOptions& options,
                                                    std::unique_ptr<transport::Fabric> fabric);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CLIENT_TESTING_H_
