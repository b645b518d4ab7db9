// Dropout (csrc/dropout.h) on the mma.sync accumulator fragments of the
// tensor-core kernels: the keep bits of a lane's elements from as few Philox
// calls as the fragment layout allows, and Z = keep ? scale : 0 applied in
// place (apply_dropout, apply_dropout_transposed), or the keep mask alone on
// 16-bit packed P (dropout_pair_mask; the sm80 forward, which scales O once in
// its epilogue). Only the kernels instantiated with variants include these.
//
// Philox groups (dropout.h): the keys {32c + 8t + 2u + e : t < 4, e < 2} of one
// row share a call, and keep_bits(i, j) returns bit 2t + e of row i's group
// holding key j.
//
// Forward (rows = queries, fwd_softmax.cuh): s[m][j][c] is row
// row_base + 16m + 8(c / 2) (row_base includes the lane's g = lane / 4), key
// col_base + 8j + (c % 2) (col_base includes 2u, u = lane % 4). The lane's keys
// of n-tiles 4c'..4c'+3 of a 32-aligned run are exactly one group: one call per
// row per 32 keys, all 8 bits used.
//
// Backward (transposed, rows = keys, bwd_building_blocks.cuh): acc[m][j][c] is
// key key_base + 16m + g + 8(c / 2), query query_base + 8j + 2u + (c % 2). For
// one query the lane's keys g + 8t' (t' = 2m + c / 2) are 2 or 4 keys of the
// group (g / 2, e = g % 2); lanes g and g ^ 1 (lane ^ 4) need the same calls
// (queries 2u, 2u + 1), so each makes one of the two and they swap results.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../dropout.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// x * scale if bit b of bits is set, else 0.
template <typename Bits>
FAE_DEVICE float dropout_select(float x, Bits bits, int b, float scale) {
  return ((bits >> b) & 1u) ? x * scale : 0.f;
}

// ---------------------------------------------------------------------------
// Forward (row-major fragments): for every row (m, h) and n-tile j of the lane,
// f(m, h, j, pair) with pair = the keep bits of keys (col_base + 8j, +1) of
// row row_base + 16m + 8h in bits 0 and 1.
// kKeyAlign: a compile-time multiple of which col_base - 2u always is (>= 8).
// With kKeyAlign % 32 == 0 and kTilesN % 4 == 0 every 4 n-tiles are one Philox
// group; with 16 (the decode tile's 16-key warp slices) every 2 n-tiles are
// half a group; otherwise one call per n-tile (8 keys, 2 of its 8 bits used).
// ---------------------------------------------------------------------------
template <int kKeyAlign, int kMmaM, int kTilesN, typename F>
FAE_DEVICE void for_each_dropout_pair(const Dropout& d, int row_base, int col_base, F&& f) {
  static_assert(kKeyAlign % 8 == 0, "n-tiles start at multiples of 8 keys");
  constexpr int kG = (kKeyAlign % 32 == 0 && kTilesN % 4 == 0)   ? 4
                     : (kKeyAlign % 16 == 0 && kTilesN % 2 == 0) ? 2
                                                                 : 1;
#pragma unroll
  for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 16 * m + 8 * h;
#pragma unroll
      for (int j0 = 0; j0 < kTilesN; j0 += kG) {
        // Key col_base + 8 j0 = 32c + 8t0 + 2u: its group's bits, from t0 on.
        uint32_t bits = d.keep_bits(row, col_base + 8 * j0);
        if constexpr (kKeyAlign % 32 == 0) {
          bits >>= 2 * (j0 % 4);
        } else {
          bits >>= 2 * (((col_base >> 3) + j0) & 3);
        }
#pragma unroll
        for (int jj = 0; jj < kG; ++jj) f(m, h, j0 + jj, (bits >> (2 * jj)) & 3u);
      }
    }
  }
}

// s[kMmaM][kTilesN][4] (probabilities) *= Z.
template <int kKeyAlign, int kMmaM, int kTilesN>
FAE_DEVICE void apply_dropout(float (&s)[kMmaM][kTilesN][4], const Dropout& d, int row_base,
                              int col_base) {
  const float scale = d.scale;
  for_each_dropout_pair<kKeyAlign, kMmaM, kTilesN>(
      d, row_base, col_base, [&](int m, int h, int j, uint32_t pair) {
        s[m][j][2 * h] = dropout_select(s[m][j][2 * h], pair, 0, scale);
        s[m][j][2 * h + 1] = dropout_select(s[m][j][2 * h + 1], pair, 1, scale);
      });
}

// The AND mask that keeps the kept halves of a packed 16-bit pair (low half =
// bit 0): dropout on P after its conversion to 16 bits, without the scale.
FAE_DEVICE uint32_t dropout_pair_mask(uint32_t pair) {
  return ((pair & 1u) ? 0x0000ffffu : 0u) | ((pair & 2u) ? 0xffff0000u : 0u);
}

// ---------------------------------------------------------------------------
// Backward: the lane's keep bits of a transposed [16 kM keys x 8 kN queries]
// tile, bit 4kM * j + 4m + c for acc[m][j][c]. key_base (a multiple of
// kKeyAlign: 16 with kM = 1, 32 with kM = 2) is the tile's first key,
// query_base its first query. Every lane of the warp must call this (shuffles).
// ---------------------------------------------------------------------------
template <int kM, int kN>
using DropoutBitsT = std::conditional_t<(4 * kM * kN <= 32), uint32_t, uint64_t>;

template <int kKeyAlign, int kM, int kN>
FAE_DEVICE DropoutBitsT<kM, kN> dropout_bits_transposed(const Dropout& d, int key_base,
                                                        int query_base, int lane) {
  static_assert(kM == 1 || kM == 2, "16 or 32 keys per warp");
  static_assert(kKeyAlign % (16 * kM) == 0, "the warp's keys lie in one 32-key group");
  using Bits = DropoutBitsT<kM, kN>;
  const int g = lane / 4, u = lane % 4, e = g & 1;
  // The lane's group: keys 32c + 2(g / 2) + {0, 1} + 8t.
  const int group_key = key_base + (g & 6);
  // Its keys are bits 2t + e of the group's word; t = t0 + 2m + c / 2.
  int shift = e;
  if constexpr (kKeyAlign % 32 != 0) shift += 2 * ((key_base >> 3) & 3);
  Bits bits = 0;
#pragma unroll
  for (int j4 = 0; j4 < kN; j4 += 4) {
    // This lane computes query 2u + e of n-tiles j4..j4+3 (8 bits each, packed),
    // its partner (lane ^ 4) query 2u + (1 - e).
    uint32_t mine = 0;
#pragma unroll
    for (int jj = 0; jj < 4 && j4 + jj < kN; ++jj) {
      const int query = query_base + 8 * (j4 + jj) + 2 * u + e;
      mine |= d.keep_bits(query, group_key) << (8 * jj);
    }
    const uint32_t other = __shfl_xor_sync(0xffffffffu, mine, 4);
    // Words of queries 2u (even) and 2u + 1 (odd), shifted to the lane's keys:
    // bits 0, 2 (kM = 2: also 4, 6) of each byte.
    const uint32_t w0 = (e ? other : mine) >> shift;
    const uint32_t w1 = (e ? mine : other) >> shift;
    constexpr uint32_t kByteMask = kM == 2 ? 0x55u : 0x05u;
#pragma unroll
    for (int jj = 0; jj < 4 && j4 + jj < kN; ++jj) {
      // Interleave: bit 2t' + (query parity) = 4m + c.
      const uint32_t b = ((w0 >> (8 * jj)) & kByteMask) | (((w1 >> (8 * jj)) & kByteMask) << 1);
      bits |= static_cast<Bits>(b) << (4 * kM * (j4 + jj));
    }
  }
  return bits;
}

// acc[m][j][c] *= Z, with the bits of dropout_bits_transposed.
template <int kM, int kN, typename Bits>
FAE_DEVICE void apply_dropout_transposed(float (&acc)[kM][kN][4], Bits bits, float scale) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[m][j][c] = dropout_select(acc[m][j][c], bits, 4 * kM * j + 4 * m + c, scale);
      }
    }
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
