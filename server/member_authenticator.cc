#include "server/member_authenticator.h"

#include <algorithm>

#include "proto/control.pb.h"
#include "proto/credentials.h"

namespace shardps::server {

void MemberAuthenticator::SetCredential(std::string credential) {
  MutexLock l(&mu_);
  credential_ = std::move(credential);
}

void MemberAuthenticator::SetMembership(std::set<uint32_t> member_ids) {
  MutexLock l(&mu_);
  if (!member_ids.empty()) newest_seen_ = std::max(newest_seen_, *member_ids.rbegin());
  members_ = std::move(member_ids);
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
  if (who.member_id <= newest_seen_ && members_.count(who.member_id) == 0) {
    return PermissionDeniedError("member " + std::to_string(who.member_id) +
                                 " is not in the current membership (it left or was removed)");
  }
  return control::PeerKey(credential_, who);
}

}  // namespace shardps::server
