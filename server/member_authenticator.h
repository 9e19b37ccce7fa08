// The server's side of data-path authentication (docs/security.md): maps the member identity a
// connecting peer claims ("role:member_id:rank", control::IdentityString) to the peer key the
// coordinator gave that member for this server, PeerKey(this server's credential, identity).
// Only that member (and the coordinator) holds it, so a proof names the member for certain.
//
// Thread-safe: the listener calls KeyFor from the apply thread; SetCredential is called once,
// after the join, from the setup thread.
#ifndef SHARDPS_SERVER_MEMBER_AUTHENTICATOR_H_
#define SHARDPS_SERVER_MEMBER_AUTHENTICATOR_H_

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "common/thread_annotations.h"
#include "transport/handshake_auth.h"

namespace shardps::server {

class MemberAuthenticator final : public transport::Authenticator {
 public:
  // Until this is called every peer is refused (nobody can know the server's address yet).
  void SetCredential(std::string credential);
  // The member ids of the latest membership this server saw. A member id no newer than the
  // newest seen and absent from the latest membership is a member that left or was removed:
  // its credential no longer opens a connection. (Newer ids are members that joined after the
  // last membership this server saw; they may connect before it sees them.) Existing endpoints
  // are not closed by this: the worker table deals with departures.
  void SetMembership(std::set<uint32_t> member_ids);
  // Workers and servers (a primary's replication stream) may connect; the caller checks what
  // the proven identity may do (ShardServer: a worker's rank, the replication role).
  StatusOr<std::string> KeyFor(std::string_view identity) const override;

 private:
  mutable Mutex mu_;
  std::string credential_ GUARDED_BY(mu_);
  std::set<uint32_t> members_ GUARDED_BY(mu_);
  uint32_t newest_seen_ GUARDED_BY(mu_) = 0;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_MEMBER_AUTHENTICATOR_H_
