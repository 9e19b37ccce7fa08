// Test-only hooks into the verbs provider (internal; not for production callers).
#ifndef SHARDPS_TRANSPORT_VERBS_VERBS_TESTING_H_
#define SHARDPS_TRANSPORT_VERBS_VERBS_TESTING_H_

#include "transport/transport.h"

namespace shardps::transport::verbs {

// Closes the endpoint's bootstrap (liveness) socket, so that only the queue pair's own
// timeout/retry machinery can detect a dead peer. The peer sees EOF on its side. Used to
// measure the retry-exceeded bound that applies when a peer host vanishes without a TCP FIN.
Status DropLivenessChannelForTesting(Endpoint* endpoint);

// Resizes the completion queue's ibv_cq to `entries` (rounded up by the provider), below what
// its endpoints may have outstanding: a test then overruns it, which loses completions.
Status ResizeCqForTesting(CompletionQueue* cq, int entries);

// Async events read so far on the completion queue's device (all kinds).
uint64_t AsyncEventsSeenForTesting(CompletionQueue* cq);

}  // namespace shardps::transport::verbs

#endif  // SHARDPS_TRANSPORT_VERBS_VERBS_TESTING_H_
