// float32 <-> float16 (IEEE binary16) and bfloat16 conversions, as PyTorch (c10::Half,
// c10::BFloat16) and CUDA do them: round to nearest, ties to even; NaN stays NaN (a quiet one);
// overflow to float16 gives infinity; float16 subnormals are kept. A trainer's 16-bit tensors
// travel as they are; the servers decode them into float32 master weights and encode the new
// weights back (server/chunk_store.h), so a worker pulls exactly what torch's .to(dtype) of the
// master weights would give.
//
// Thread safety: pure functions.
#ifndef SHARDPS_COMMON_HALF_H_
#define SHARDPS_COMMON_HALF_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shardps {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float BF16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBF16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // ties to even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsFloat(sign);  // +-0
  // Subnormal: normalise.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return BitsFloat(sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ffu) << 13));
}

inline uint16_t FloatToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a >= 0x38800000u) {  // normal in float16
    const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: 0
  // Subnormal: shift the mantissa (with its implicit 1) into place, rounding to even.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// Whole buffers. kind: 1 float16, 2 bfloat16 (layout::DType).
inline void DecodeHalf(uint32_t kind, const uint16_t* src, float* dst, size_t n) {
  if (kind == 2) {
    for (size_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = F16ToFloat(src[i]);
  }
}
inline void AddDecodedHalf(uint32_t kind, const uint16_t* src, float* dst, size_t n) {
  if (kind == 2) {
    for (size_t i = 0; i < n; ++i) dst[i] += BF16ToFloat(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] += F16ToFloat(src[i]);
  }
}
inline void EncodeHalf(uint32_t kind, const float* src, uint16_t* dst, size_t n) {
  if (kind == 2) {
    for (size_t i = 0; i < n; ++i) dst[i] = FloatToBF16(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = FloatToF16(src[i]);
  }
}

}  // namespace shardps

#endif  // SHARDPS_COMMON_HALF_H_
