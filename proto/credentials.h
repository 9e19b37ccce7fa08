// Membership credentials and data-path peer keys: the key schedule (docs/security.md).
//
//   secret              32 random bytes, the coordinator's own (its state file keeps them);
//                       never derived from the cluster token
//   credential(m)       HMAC-SHA256(secret, "shardps-member-credential-v1|id|role|rank")
//                       given to member m alone, in its JoinReply; proves m at a rejoin
//   peer_key(s <- c)    HMAC-SHA256(credential(s), "shardps-peer-key-v1|id|role|rank" of c)
//                       given by the coordinator to client c for server s (ShardMap
//                       ServerEntry.peer_key for workers, ReplicaTarget.peer_key for a primary
//                       replicating to its backup); server s derives it from its own credential
//                       and the identity c claims, so c proves that identity, and only c and s
//                       (and the coordinator) hold the key.
//   data-path proof     the transport's challenge-response under peer_key
//                       (transport/handshake_auth.h), naming c by IdentityString(c).
//
// The role is the Role enum's number. Pure functions: safe from any thread.
#ifndef SHARDPS_PROTO_CREDENTIALS_H_
#define SHARDPS_PROTO_CREDENTIALS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace shardps::control {

// Who a credential or peer key names.
struct Identity {
  uint32_t member_id = 0;
  int role = 0;  // control::Role
  uint32_t rank = 0;
};

std::string MemberCredential(std::string_view secret, const Identity& member);
std::string PeerKey(std::string_view server_credential, const Identity& client);

// "role:member_id:rank", the identity a client claims on the data path.
std::string IdentityString(const Identity& who);
// The inverse; an error for anything IdentityString did not produce.
StatusOr<Identity> ParseIdentity(std::string_view s);

}  // namespace shardps::control

#endif  // SHARDPS_PROTO_CREDENTIALS_H_
