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

std::string HandshakeProof(std::string_view peer_key, std::string_view challenge) {
  return crypto::HmacSha256(peer_key, "shardps-handshake-v1|" + std::string(challenge));
}

}  // namespace shardps::control
