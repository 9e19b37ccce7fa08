// Test-only hooks into the verbs provider (internal; not for production callers).
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_TESTING_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_TESTING_H_

#include "transport/transport.h"

namespace shardps::transport::verbs {

// Closes the endpoint's bootstrap (liveness) socket, so that only the queue pair's own
// timeout/retry machinery can detect a dead peer. The peer sees EOF on its side. Used to
// measure the retry-exceeded bound that applies when a peer host vanishes without a TCP FIN.
Status DropLivenessChannelForTesting(Endpoint* endpoint);

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_TESTING_H_
