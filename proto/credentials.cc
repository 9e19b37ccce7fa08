#include "proto/credentials.h"

#include "common/crypto.h"

namespace shardps::control {
namespace {

std::string Describe(const char* label, const Identity& m) {
  return std::string(label) + "|" + std::to_string(m.member_id) + "|" + std::to_string(m.role) +
         "|" + std::to_string(m.rank);
}

}  // namespace

std::string MemberCredential(std::string_view secret, const Identity& member) {
  return crypto::HmacSha256(secret, Describe("shardps-member-credential-v1", member));
}

std::string PeerKey(std::string_view server_credential, const Identity& client) {
  return crypto::HmacSha256(server_credential, Describe("shardps-peer-key-v1", client));
}

std::string IdentityString(const Identity& who) {
  return std::to_string(who.role) + ":" + std::to_string(who.member_id) + ":" +
         std::to_string(who.rank);
}

StatusOr<Identity> ParseIdentity(std::string_view s) {
  const std::string_view original = s;
  uint64_t parts[3];
  for (int i = 0; i < 3; ++i) {
    const size_t end = i < 2 ? s.find(':') : s.size();
    if (end == std::string_view::npos || end == 0 || end > 10) {
      return InvalidArgumentError("not a member identity");
    }
    uint64_t v = 0;
    for (char ch : s.substr(0, end)) {
      if (ch < '0' || ch > '9') return InvalidArgumentError("not a member identity");
      v = v * 10 + static_cast<uint64_t>(ch - '0');
    }
    if (v > UINT32_MAX) return InvalidArgumentError("not a member identity");
    parts[i] = v;
    s.remove_prefix(i < 2 ? end + 1 : end);
  }
  Identity who;
  who.role = static_cast<int>(parts[0]);
  who.member_id = static_cast<uint32_t>(parts[1]);
  who.rank = static_cast<uint32_t>(parts[2]);
  // One spelling per identity ("02:..." is not "2:..."): the key is derived from this one.
  if (IdentityString(who) != original) return InvalidArgumentError("not a member identity");
  return who;
}

}  // namespace shardps::control
