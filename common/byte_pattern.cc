#include "common/byte_pattern.h"

#include <cstring>

namespace shardps {

void FillPattern(void* p, size_t n, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(p);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(b + i, &x, 8);
  }
  for (; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 131);
}

int64_t FirstMismatch(const void* a, const void* b, size_t n) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  if (std::memcmp(x, y, n) == 0) return -1;
  for (size_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace shardps
