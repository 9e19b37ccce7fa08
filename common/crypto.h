// The few cryptographic primitives ShardPS uses (docs/security.md), over OpenSSL's libcrypto:
// HMAC-SHA256 for membership credentials and handshake proofs, the kernel's CSPRNG for secrets,
// nonces and rkeys, and a constant-time comparison for anything secret.
//
// Thread safety: every function is safe from any thread.
#ifndef SHARDPS_COMMON_CRYPTO_H_
#define SHARDPS_COMMON_CRYPTO_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace shardps::crypto {

inline constexpr size_t kMacBytes = 32;

// HMAC-SHA256(key, message): kMacBytes raw bytes.
std::string HmacSha256(std::string_view key, std::string_view message);

// n bytes from the kernel's CSPRNG (getrandom(2)); an error only if the kernel refuses.
StatusOr<std::string> RandomBytes(size_t n);
// A uniformly random 64-bit value from the CSPRNG (aborts only if the kernel has none: a
// machine without getrandom cannot run a secure cluster at all).
uint64_t RandomU64();

// a == b in time independent of where they differ (lengths are not secret).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// Lower-case hex, for logs of non-secret digests (never log a key or a credential).
std::string Hex(std::string_view bytes);

}  // namespace shardps::crypto

#endif  // SHARDPS_COMMON_CRYPTO_H_
