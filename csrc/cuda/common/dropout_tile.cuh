// Dropout (csrc/dropout.h) on the mma.sync / wgmma accumulator fragments of
// the tensor-core kernels: the keep bits of a lane's elements from as few
// Philox calls as the fragment layout allows, and Z = keep ? scale : 0 applied
// in place (apply_dropout_transposed), or the keep mask alone, on fp32 P
// (drop_elements; the Hopper forward) or 16-bit packed P (dropout_pair_mask;
// the sm80 forward): the forwards scale O once in their epilogues. Only the
// kernels instantiated with variants include these.
//
// Call groups (dropout.h): keys {16a + k, 16a + k + 8} x queries
// {32c + 2v + e + 8t : t < 4, e < 2} share a call; call_keep_bits returns bit
// 8h + 2t + e for key 16a + k + 8h, query 32c + 2v + 8t + e.
//
// Backward (transposed, rows = keys): acc[m][j][c] is key key_base + 16m + g +
// 8(c / 2), query query_base + 8j + 2u + (c % 2) (g = lane / 4, u = lane % 4).
// With key_base % 16 == 0 and query_base % 32 == 0, n-tiles 4c'..4c'+3 of
// m-tile m are one whole call group (k = g, v = u): one call per 16 elements,
// no shuffles.
//
// Forward (rows = queries, fwd_softmax.cuh): s[m][j][c] is row row_base + 16m +
// 8(c / 2) (row_base includes g), key col_base + 8j + (c % 2) (col_base
// includes 2u). A call group holds 4 of the lane's elements (rows g, g + 8 x
// keys of n-tiles 2j', 2j' + 1 with one key parity) and 4 of its partner's
// (lane ^ 4: rows g ^ 1): each makes the call of one key parity and they swap.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../dropout.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// The 32-bit word of a lane's keep bits (uint32_t or uint64_t) that holds bit
// b (a compile-time constant once the caller's loops unroll), as bit b % 32.
// The halves of 64-bit bits come out of an opaque mov.b64: the compiler folds
// a plain truncation back into 64-bit shifts and compares.
template <typename Bits>
FAE_DEVICE uint32_t dropout_keep_word(Bits bits, int b) {
  if constexpr (sizeof(Bits) == 4) {
    return bits;
  } else {
    uint32_t lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(bits));
    return b < 32 ? lo : hi;
  }
}

// x if bit b of bits is set, else 0: one LOP3 into a predicate and one FSEL.
// Written in C++, `(bits >> b) & 1u ? x : 0.f` compiled (nvcc 13, sm_90a) to
// a shift, an AND and a compare per element, two more compares (and a funnel
// shift) on 64-bit bits: the Hopper backward at D = 64, whose 128-query steps
// hold 64 bits per lane, selects twice per score. The same test repeated for
// another value is one LOP3 again after ptxas's common subexpressions.
template <typename Bits>
FAE_DEVICE float dropout_keep_or_zero(float x, Bits bits, int b) {
  float out;
  asm("{\n\t.reg .pred kept;\n\t.reg .b32 t;\n\t"
      "and.b32 t, %1, %2;\n\tsetp.ne.u32 kept, t, 0;\n\tselp.f32 %0, %3, 0f00000000, kept;\n\t}"
      : "=f"(out)
      : "r"(dropout_keep_word(bits, b)), "r"(1u << (b & 31)), "f"(x));
  return out;
}

// Whether bit b of bits is set, in C++ (ptxas schedules it with the code
// around it): the Hopper backward's softcap + dropout path uses this, where
// the PTX select above made the D = 128 variant kernel spill and its softcap
// backward 1.5% slower.
template <typename Bits>
FAE_DEVICE bool dropout_keep_bit(Bits bits, int b) {
  return (dropout_keep_word(bits, b) >> (b & 31)) & 1u;
}

// x * scale if bit b of bits is set, else 0.
template <typename Bits>
FAE_DEVICE float dropout_select(float x, Bits bits, int b, float scale) {
  return dropout_keep_or_zero(x * scale, bits, b);
}

// ---------------------------------------------------------------------------
// Forward (row-major fragments): for every row (m, h) and n-tile j of the lane,
// f(m, h, j, keep_even, keep_odd): whether keys col_base + 8j and + 1 of row
// row_base + 16m + 8h are kept. kKeyAlign: a compile-time multiple of which
// col_base - 2u always is. Every lane of the warp must call this (shuffles).
// ---------------------------------------------------------------------------
template <int kKeyAlign, int kMmaM, int kTilesN, typename F>
FAE_DEVICE void for_each_dropout_pair(const Dropout& d, int row_base, int col_base, F&& f) {
  static_assert(kKeyAlign % 16 == 0 && kTilesN % 2 == 0,
                "n-tile pairs start at multiples of 16 keys (one call group's keys)");
  const int parity = (threadIdx.x >> 2) & 1;  // g % 2: the lane's query parity
#pragma unroll
  for (int m = 0; m < kMmaM; ++m) {
    const int row = row_base + 16 * m;
    // Rows row and row + 8 are t = t0 and t0 + 1 of their call groups, t0 =
    // 2 ((row / 16) % 2), so words t0 / 2 (keys k) and 2 + t0 / 2 (keys k + 8)
    // hold every number of this lane and its partner: byte 2 (t - t0) + the
    // row parity. The other two words are the other 16 rows'.
    const bool upper = (row >> 4) & 1;
#pragma unroll
    for (int j = 0; j < kTilesN; j += 2) {
      // This lane: the group of keys with parity g % 2; its partner the
      // other. They swap the two words (the raw numbers: each lane then
      // compares only its own 8).
      const PhiloxWords r = d.call(row, col_base + 8 * j + parity);
      const uint32_t mine[2] = {upper ? r.w[1] : r.w[0], upper ? r.w[3] : r.w[2]};  // [key half]
      uint32_t even[2], odd[2];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const uint32_t other = __shfl_xor_sync(0xffffffffu, mine[jj], 4);
        even[jj] = parity ? other : mine[jj];
        odd[jj] = parity ? mine[jj] : other;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int byte = 2 * h + parity;  // row + 8 h
          f(m, h, j + jj, d.keep_byte(even[jj], byte), d.keep_byte(odd[jj], byte));
        }
      }
    }
  }
}

// s[kMmaM][kTilesN][4] (probabilities): the dropped elements set to 0, the
// kept ones left as they are (the caller applies the scale to O, which is
// linear in P: one multiply per output element instead of one per score).
template <int kKeyAlign, int kMmaM, int kTilesN>
FAE_DEVICE void drop_elements(float (&s)[kMmaM][kTilesN][4], const Dropout& d, int row_base,
                              int col_base) {
  for_each_dropout_pair<kKeyAlign, kMmaM, kTilesN>(
      d, row_base, col_base, [&](int m, int h, int j, bool keep_even, bool keep_odd) {
        if (!keep_even) s[m][j][2 * h] = 0.f;
        if (!keep_odd) s[m][j][2 * h + 1] = 0.f;
      });
}

// The AND mask that keeps the kept halves of a packed 16-bit pair (low half =
// the even key): dropout on P after its conversion to 16 bits, without the scale.
FAE_DEVICE uint32_t dropout_pair_mask(bool keep_even, bool keep_odd) {
  return (keep_even ? 0x0000ffffu : 0u) | (keep_odd ? 0xffff0000u : 0u);
}

// ---------------------------------------------------------------------------
// Backward: the lane's keep bits of a transposed [16 kM keys x 8 kN queries]
// tile, call group (m, j / 4) in bits [16 (kM (j / 4) + m), +16), so acc[m][j][c]
// is bit dropout_bit_transposed<kM>(m, j, c). key_base (the tile's first key)
// must be a multiple of 16, query_base (its first query) of 32.
// ---------------------------------------------------------------------------
template <int kM, int kN>
using DropoutBitsT = std::conditional_t<(4 * kM * kN <= 32), uint32_t, uint64_t>;

template <int kM>
FAE_HOST_DEVICE constexpr int dropout_bit_transposed(int m, int j, int c) {
  return 16 * (kM * (j / 4) + m) + 8 * (c / 2) + 2 * (j % 4) + (c % 2);
}

template <int kM, int kN>
FAE_DEVICE DropoutBitsT<kM, kN> dropout_bits_transposed(const Dropout& d, int key_base,
                                                        int query_base, int lane) {
  static_assert(kN % 4 == 0 && 4 * kM * kN <= 64, "whole 32-query call groups, <= 64 bits");
  using Bits = DropoutBitsT<kM, kN>;
  const int g = lane / 4, u = lane % 4;
  Bits bits = 0;
#pragma unroll
  for (int c = 0; c < kN / 4; ++c) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const uint32_t call = d.call_keep_bits(query_base + 32 * c + 2 * u, key_base + 16 * m + g);
      bits |= static_cast<Bits>(call) << (16 * (kM * c + m));
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
        acc[m][j][c] =
            dropout_select(acc[m][j][c], bits, dropout_bit_transposed<kM>(m, j, c), scale);
      }
    }
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
