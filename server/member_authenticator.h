// The server's side of data-path authentication (docs/security.md): maps the member identity a
// connecting peer claims ("role:member_id:rank", control::IdentityString) to the peer key the
// coordinator gave that member for this server, PeerKey(this server's credential, identity).
// Only that member (and the coordinator) holds it, so a proof names the member for certain.
//
// Thread-safe: the listener calls KeyFor from the apply thread; SetCredential is called once,
// after the join, from the setup thread.
#ifndef SHARDPS_SERVER_MEMBER_AUTHENTICATOR_H_
#define SHARDPS_SERVER_MEMBER_AUTHENTICATOR_H_

#include <string>
#include <string_view>

#include "common/thread_annotations.h"
#include "transport/handshake_auth.h"

namespace shardps::server {

class MemberAuthenticator final : public transport::Authenticator {
 public:
  // Until this is called every peer is refused (nobody can know the server's address yet).
  void SetCredential(std::string credential);
  // Workers and servers (a primary's replication stream) may connect; the caller checks what
  // the proven identity may do (ShardServer: a worker's rank, the replication role).
  StatusOr<std::string> KeyFor(std::string_view identity) const override;

 private:
  mutable Mutex mu_;
  std::string credential_ GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_MEMBER_AUTHENTICATOR_H_
