#include "common/crypto.h"

#include <errno.h>
#include <sys/random.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <glog/logging.h>

namespace shardps::crypto {

std::string HmacSha256(std::string_view key, std::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  const unsigned char* r =
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  // HMAC with a built-in digest fails only on allocation failure: a programmer/host error.
  CHECK(r != nullptr && len == kMacBytes) << "HMAC-SHA256 failed";
  return std::string(reinterpret_cast<const char*>(out), len);
}

StatusOr<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t off = 0;
  while (off < n) {
    const ssize_t k = getrandom(out.data() + off, n - off, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return ErrnoError("getrandom", errno);
    off += static_cast<size_t>(k);
  }
  return out;
}

uint64_t RandomU64() {
  StatusOr<std::string> b = RandomBytes(sizeof(uint64_t));
  CHECK(b.ok()) << "no CSPRNG: " << b.status();
  uint64_t v = 0;
  for (char c : *b) v = (v << 8) | static_cast<unsigned char>(c);
  return v;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

std::string Hex(std::string_view bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) {
    out += kDigits[static_cast<unsigned char>(c) >> 4];
    out += kDigits[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

}  // namespace shardps::crypto
