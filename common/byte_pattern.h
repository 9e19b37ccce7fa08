// Deterministic test and benchmark bytes, and where two buffers first differ. The pattern
// depends on the seed and on the position, so a shifted, stale or partial copy never matches.
//
// Thread safety: pure functions.
#ifndef SHARDPS_COMMON_BYTE_PATTERN_H_
#define SHARDPS_COMMON_BYTE_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace shardps {

// Fills n bytes at p with the pattern of `seed` (xorshift64 words, then a byte tail).
void FillPattern(void* p, size_t n, uint64_t seed);

// The offset of the first byte where a and b differ, or -1 when the n bytes are equal.
int64_t FirstMismatch(const void* a, const void* b, size_t n);

}  // namespace shardps

#endif  // SHARDPS_COMMON_BYTE_PATTERN_H_
