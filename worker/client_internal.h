// Internal hooks of libshardps for other parts of the tree (the host aggregator). Not
// installed, not in worker/include.
//
// Thread safety: as the Client they act on (its owner's thread).
#ifndef SHARDPS_WORKER_CLIENT_INTERNAL_H_
#define SHARDPS_WORKER_CLIENT_INTERNAL_H_

#include <cstdint>

#include "shardps/client.h"

namespace shardps::worker {

// The next pushes of `client` carry PushHeader::weight = `weight` (>= 1): they sum that many
// trainers' gradients. False if `client` is not a cluster client (a host-group client).
bool SetPushWeight(Client* client, uint32_t weight);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CLIENT_INTERNAL_H_
