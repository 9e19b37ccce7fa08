// The initial value of a row table's rows: a pure function of (seed, global row id, column), so
// every server of a table (primary and backup alike) fills its rows without any traffic, and a
// one-process reference (tests, examples/ctr) builds the identical table (python:
// shardps.row_init). Counter-based: splitmix64 of the seed, row and column; normal values by
// Box-Muller over two such draws.
//
//   kNormal:  N(0, scale^2)          (torch.nn.Embedding's default is N(0, 1))
//   kUniform: U(-scale, scale)
//   kZeros:   0
//
// Thread safety: pure functions.
#ifndef SHARDPS_COMMON_ROW_INIT_H_
#define SHARDPS_COMMON_ROW_INIT_H_

#include <cmath>
#include <cstdint>

namespace shardps {

enum class RowInitKind : uint32_t { kNormal = 0, kUniform = 1, kZeros = 2 };

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform double in (0, 1) from 53 random bits (never 0: log() below stays finite).
inline double UnitOpen(uint64_t bits) { return ((bits >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

// Fills `out[0, dim)` with the initial values of global row `row`.
inline void InitRow(RowInitKind kind, float scale, uint64_t seed, uint64_t row, uint32_t dim,
                    float* out) {
  const uint64_t base = SplitMix64(seed ^ SplitMix64(row));
  for (uint32_t j = 0; j < dim; ++j) {
    if (kind == RowInitKind::kZeros) {
      out[j] = 0.0f;
      continue;
    }
    const uint64_t a = SplitMix64(base + 2 * uint64_t{j});
    if (kind == RowInitKind::kUniform) {
      out[j] = static_cast<float>((2.0 * UnitOpen(a) - 1.0) * scale);
    } else {
      const uint64_t b = SplitMix64(base + 2 * uint64_t{j} + 1);
      const double r = std::sqrt(-2.0 * std::log(UnitOpen(a)));
      out[j] = static_cast<float>(r * std::cos(6.283185307179586 * UnitOpen(b)) * scale);
    }
  }
}

}  // namespace shardps

#endif  // SHARDPS_COMMON_ROW_INIT_H_
