#include "server/member_authenticator.h"

#include "proto/control.pb.h"
#include "proto/credentials.h"

namespace shardps::server {

void MemberAuthenticator::SetCredential(std::string credential) {
  MutexLock l(&mu_);
  credential_ = std::move(credential);
}

StatusOr<std::string> MemberAuthenticator::KeyFor(std::string_view identity) const {
  ASSIGN_OR_RETURN(control::Identity who, control::ParseIdentity(identity));
  if (who.role != control::ROLE_WORKER && who.role != control::ROLE_SERVER) {
    return PermissionDeniedError("role " + std::to_string(who.role) + " may not connect");
  }
  MutexLock l(&mu_);
  if (credential_.empty()) {
    return UnavailableError("this server has not joined yet (no credential)");
  }
  return control::PeerKey(credential_, who);
}

}  // namespace shardps::server
