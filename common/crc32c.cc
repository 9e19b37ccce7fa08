#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace shardps::crc32c {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli

// kTables[0] is the classic byte table; kTables[k][b] is the CRC of byte b followed by k zero
// bytes, which lets the portable loop fold 8 bytes per step (slicing-by-8).
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
    }
  }
};
constexpr Tables kTables;

inline uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // little-endian host (x86_64, aarch64): checked in checkpoint_format.cc
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p,
                                                        size_t n) {
  uint64_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

// Four independent streams of n bytes each, in lockstep: the crc32 instruction has a latency of
// three cycles and a throughput of one, so four chains keep it busy.
__attribute__((target("sse4.2"))) void ExtendSse42x4(uint32_t* crc, const void* const* data,
                                                      size_t n) {
  const auto* p0 = static_cast<const uint8_t*>(data[0]);
  const auto* p1 = static_cast<const uint8_t*>(data[1]);
  const auto* p2 = static_cast<const uint8_t*>(data[2]);
  const auto* p3 = static_cast<const uint8_t*>(data[3]);
  uint64_t c0 = ~crc[0], c1 = ~crc[1], c2 = ~crc[2], c3 = ~crc[3];
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v0, v1, v2, v3;
    std::memcpy(&v0, p0 + i, 8);
    std::memcpy(&v1, p1 + i, 8);
    std::memcpy(&v2, p2 + i, 8);
    std::memcpy(&v3, p3 + i, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
    c3 = _mm_crc32_u64(c3, v3);
  }
  for (; i < n; ++i) {
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), p0[i]);
    c1 = _mm_crc32_u8(static_cast<uint32_t>(c1), p1[i]);
    c2 = _mm_crc32_u8(static_cast<uint32_t>(c2), p2[i]);
    c3 = _mm_crc32_u8(static_cast<uint32_t>(c3), p3[i]);
  }
  crc[0] = ~static_cast<uint32_t>(c0);
  crc[1] = ~static_cast<uint32_t>(c1);
  crc[2] = ~static_cast<uint32_t>(c2);
  crc[3] = ~static_cast<uint32_t>(c3);
}
#endif

}  // namespace

void ExtendLanes(uint32_t* crc, const void* const* data, size_t lanes, size_t n) {
  size_t i = 0;
#if defined(__x86_64__)
  if (HardwareAvailable()) {
    for (; i + 4 <= lanes; i += 4) ExtendSse42x4(crc + i, data + i, n);
  }
#endif
  for (; i < lanes; ++i) crc[i] = Extend(crc[i], data[i], n);
}

uint32_t ExtendPortable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = kTables.t;
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo = Load32(p) ^ c;
    uint32_t hi = Load32(p + 4);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
    --n;
  }
  return ~c;
}

bool HardwareAvailable() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

uint32_t ExtendHardware(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (HardwareAvailable()) return ExtendSse42(crc, static_cast<const uint8_t*>(data), n);
#endif
  return ExtendPortable(crc, data, n);
}

uint32_t Extend(uint32_t crc, const void* data, size_t n) {
  return HardwareAvailable() ? ExtendHardware(crc, data, n) : ExtendPortable(crc, data, n);
}

}  // namespace shardps::crc32c
