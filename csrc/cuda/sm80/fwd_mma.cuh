// Warp-level mma.sync products of the sm80 forward kernel (fwd_kernel.cuh):
// Q A-fragments (load_q_frag, QFragments), S = Q K^T (gemm_qk), P -> 16-bit
// A-fragments and O += P V (pack_p_step, pv_step, gemm_pv; the variant kernels'
// packed P with dropout: PFragments, pack_p, dropout_packed_p, gemm_pv_packed),
// and their FP8 K / V counterparts (e4m3x2_to_f16x2, load_q_frag_fp8,
// fp8_prepare_q, gemm_qk_fp8, pv_step_fp8, gemm_pv_fp8, gemm_pv_packed_fp8,
// unpermute_o_fp8).
// Separate because it is the register side of the main loop: shared memory ->
// fragments -> tensor cores, with no global addressing (fwd_tile_load.cuh) or
// pipeline control (fwd_pipeline.cuh).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../common/dropout_tile.cuh"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"
#include "fwd_tile_load.cuh"

namespace flash_attn_ext {
namespace cuda {

// Two e4m3 values (the low (kHalf = 0) or high 16 bits of w) -> an f16x2,
// exactly: every e4m3 value is an fp16 value. sm_89 and later have an
// instruction for it (F2FP.F16.E4M3.UNPACK_B, the half chosen by an operand
// selector; NaN stays NaN); older GPUs move the bits (fp16's exponent bias is
// 8 above e4m3's, so the moved bits are the value x 2^-8, subnormals
// included) and multiply by 2^8 (e4m3's NaN comes out as +-480 there).
template <int kHalf>
FAE_DEVICE uint32_t e4m3x2_to_f16x2(uint32_t w) {
  static_assert(kHalf == 0 || kHalf == 1, "a word holds two e4m3 pairs");
  uint32_t out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kHalf == 0) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
        : "=r"(out) : "r"(w));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
        : "=r"(out) : "r"(w));
  }
#else
  const uint32_t t = __byte_perm(w, 0u, kHalf == 0 ? 0x1404 : 0x3424);  // [0, b_lo, 0, b_hi]
  const uint32_t bits = (t & 0x80008000u) | ((t >> 1) & 0x3F803F80u);   // x 2^-8
  // 2^8 = fp16 0x5C00; -0 keeps the sign of zeros.
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(bits), "r"(0x5C005C00u), "r"(0x80008000u));
#endif
  return out;
}

// A-fragments of the warp's Q rows for head-dim k-step kk (16 columns).
// ldmatrix.x4: lanes 0-15 address rows 0-15 at chunk 2kk, lanes 16-31 rows
// 0-15 at chunk 2kk+1, giving a[0..3] = (g,lo) (g+8,lo) (g,hi) (g+8,hi).
template <typename Traits>
FAE_DEVICE void load_q_frag(uint32_t (&a)[4], const typename Traits::T* smem_q, int warp_row0,
                            int m, int kk, int lane) {
  const int row = warp_row0 + m * 16 + (lane & 15);
  ldmatrix_x4(a, smem_q + Traits::QLayout::offset(row, 2 * kk + (lane >> 4)));
}

// S[m] += Q[m] K^T over the whole head dim, for the warp's kWarpKeys keys of
// the tile (smem_k points at the warp's first key row).
template <typename Traits, typename QFrags>
FAE_DEVICE void gemm_qk(float (&s)[Traits::kMmaM][Traits::kTilesN][4], const QFrags& q_frags,
                        const typename Traits::T* smem_q, const typename Traits::T* smem_k,
                        int warp_row0, int lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsD; ++kk) {
    uint32_t a[Traits::kMmaM][4];
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m) {
      if constexpr (Traits::kQInRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[m][r] = q_frags[m][kk][r];
      } else {
        load_q_frag<Traits>(a[m], smem_q, warp_row0, m, kk, lane);
      }
    }
#pragma unroll
    for (int jn = 0; jn < Traits::kWarpKeys / 16; ++jn) {
      // K is [key][dim] = the "col" B operand as stored: no transpose.
      // Matrices: (keys 0-7, dims lo) (keys 0-7, dims hi) (keys 8-15, lo) (keys 8-15, hi)
      // = b0/b1 of n-tile 2jn, then b0/b1 of n-tile 2jn+1.
      uint32_t b[4];
      const int key = jn * 16 + ((lane >> 4) << 3) + (lane & 7);
      ldmatrix_x4(b, smem_k + Traits::KVLayout::offset(key, 2 * kk + ((lane >> 3) & 1)));
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        mma_16816<T>(s[m][2 * jn], a[m], b_lo);
        mma_16816<T>(s[m][2 * jn + 1], a[m], b_hi);
      }
    }
  }
}

// O[m] += P[m] V. The accumulator layout of S for n-tiles (2kk, 2kk+1) is
// exactly the A-fragment layout of a 16x16 operand, so P is only converted
// to 16 bits and re-packed, never staged through shared memory. One k-step
// (16 keys) at a time: pack_p_step, then pv_step.
template <typename Traits>
FAE_DEVICE void pack_p_step(uint32_t (&a)[Traits::kMmaM][4],
                            const float (&p)[Traits::kMmaM][Traits::kTilesN][4], int kk) {
  using T = typename Traits::MmaT;
#pragma unroll
  for (int m = 0; m < Traits::kMmaM; ++m) {
    a[m][0] = pack2<T>(p[m][2 * kk][0], p[m][2 * kk][1]);          // row g,   keys lo
    a[m][1] = pack2<T>(p[m][2 * kk][2], p[m][2 * kk][3]);          // row g+8, keys lo
    a[m][2] = pack2<T>(p[m][2 * kk + 1][0], p[m][2 * kk + 1][1]);  // row g,   keys hi
    a[m][3] = pack2<T>(p[m][2 * kk + 1][2], p[m][2 * kk + 1][3]);  // row g+8, keys hi
  }
}

template <typename Traits>
FAE_DEVICE void pv_step(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                        const uint32_t (&a)[Traits::kMmaM][4], const typename Traits::T* smem_v,
                        int kk, int lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int jd = 0; jd < Traits::kHeadDim / 16; ++jd) {
    // V is [key][dim]; the B operand wants (k = key, n = dim) pairs along k,
    // hence ldmatrix.trans. Matrices: (keys 0-7, dims lo) (keys 8-15, dims lo)
    // (keys 0-7, dims hi) (keys 8-15, dims hi) = b0/b1 of d-tile 2jd, 2jd+1.
    uint32_t b[4];
    const int key = kk * 16 + (lane & 15);
    ldmatrix_x4_trans(b, smem_v + Traits::KVLayout::offset(key, 2 * jd + (lane >> 4)));
    const uint32_t b_lo[2] = {b[0], b[1]};
    const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m) {
      mma_16816<T>(o[m][2 * jd], a[m], b_lo);
      mma_16816<T>(o[m][2 * jd + 1], a[m], b_hi);
    }
  }
}

template <typename Traits>
FAE_DEVICE void gemm_pv(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                        const float (&p)[Traits::kMmaM][Traits::kTilesN][4],
                        const typename Traits::T* smem_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) {
    uint32_t a[Traits::kMmaM][4];
    pack_p_step<Traits>(a, p, kk);
    pv_step<Traits>(o, a, smem_v, kk, lane);
  }
}

// The variant kernels' P V, in two steps: P -> 16-bit A fragments right after
// the softmax (half the registers of fp32 P while the V tile is awaited and
// the dropout's Philox calls run), then O += P V from them. Dropout clears the
// dropped halves (dropout_pair_mask); its scale is applied to O in the
// epilogue (O is linear in P, and the row sums are of the undropped P).
template <typename Traits>
using PFragments = uint32_t[Traits::kStepsN][Traits::kMmaM][4];

template <typename Traits>
FAE_DEVICE void pack_p(PFragments<Traits>& a, const float (&p)[Traits::kMmaM][Traits::kTilesN][4]) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) pack_p_step<Traits>(a[kk], p, kk);
}

// Dropout's keep mask on packed P: s[m][j][2h + e] is half e of a[j / 2][m][2 (j % 2) + h].
template <typename Traits>
FAE_DEVICE void dropout_packed_p(PFragments<Traits>& a, const Dropout& d, int row_base,
                                 int col_base) {
  for_each_dropout_pair<Traits::kWarpKeys, Traits::kMmaM, Traits::kTilesN>(
      d, row_base, col_base, [&](int m, int h, int j, bool keep_even, bool keep_odd) {
        a[j / 2][m][2 * (j % 2) + h] &= dropout_pair_mask(keep_even, keep_odd);
      });
}

// O[m] += P[m] V from packed P.
template <typename Traits>
FAE_DEVICE void gemm_pv_packed(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                               const PFragments<Traits>& a, const typename Traits::T* smem_v,
                               int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) pv_step<Traits>(o, a[kk], smem_v, kk, lane);
}

// Q A-fragments, loaded once in the prologue when they fit in registers
// (Traits::kQInRegs); otherwise a placeholder and gemm_qk reads shared memory.
template <typename Traits>
using QFragments = uint32_t[Traits::kQInRegs ? Traits::kMmaM : 1]
                           [Traits::kQInRegs ? Traits::kStepsD : 1][4];

// ---------------------------------------------------------------------------
// FP8 tiles straight into mma fragments (Traits::kKVFp8). ldmatrix reads the
// e4m3 staging tile as 16-bit pairs and e4m3x2_to_f16x2 widens each pair of
// bytes in registers: no 16-bit copy of the tile in shared memory. The MMAs
// run in fp16 (Traits::MmaT) whatever q's type: e4m3 -> fp16 is one
// instruction per pair, e4m3 -> bf16 took five integer / bf16x2 ones, and the
// widening was then half of the kernel's instructions (ncu: issue-bound, DRAM
// at 76%). A bf16 q goes to fp16 times a power of two that puts its largest
// |value| in [2^14, 2^15) (fp8_prepare_q; exact for every element above 2^-32
// of that maximum), and the softmax scale takes the inverse; P is fp16 (more
// mantissa than bf16's). Two orders change, both undone where they must be:
//
//  * Q K^T sums over the head dim, so its 16 columns of a k-step may be taken
//    in any order that Q and K share. ldmatrix (no .trans) gives lane (g, q)
//    bytes 4q..4q+3 of key row g's 16-byte chunk: head-dim columns 4q, 4q+1
//    are taken as the fragment's k = 2q, 2q+1 (b0 b1) and 4q+2, 4q+3 as
//    k = 2q+8, 2q+9 (b2 b3); Q's A fragments are read in that order
//    (load_q_frag_fp8: one 8-byte load per row).
//
//      chunk columns  0 1 2 3 | 4 5 6 7  | 8 ... 11  | 12 ... 15
//      lane q         0       | 1        | 2         | 3
//      mma k          0 1 8 9 | 2 3 10 11| 4 5 12 13 | 6 7 14 15
//
//  * P V: ldmatrix.trans of 8 keys x one chunk gives lane (g, q) the pairs
//    (key 2q: columns 2g, 2g+1) and (key 2q+1: columns 2g, 2g+1) in one
//    word; bytes (0, 2) are the B fragment of column 2g, bytes (1, 3) that of
//    column 2g+1. So accumulator tile 2c + p of O holds columns 16c + 2n + p
//    (n = the fragment column), i.e. lane q holds columns 16c + 4q .. 4q+3 of
//    its rows; unpermute_o_fp8 moves them back to the 16-bit layout (8-column
//    tiles, lane q: columns 2q, 2q+1) before the epilogue.
// ---------------------------------------------------------------------------
// Q's A fragment of k-step kk in gemm_qk_fp8's column order: a[0] / a[2] =
// row g's columns 16kk + 4q, +1 / +2, +3; a[1] / a[3] the same of row g+8
// (q's type T; fp8_q_to_mma converts them).
template <typename Traits>
FAE_DEVICE void load_q_frag_fp8(uint32_t (&a)[4], const typename Traits::T* smem_q, int warp_row0,
                                int m, int kk, int lane) {
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + m * 16 + h * 8 + g;
    const uint2 v = *reinterpret_cast<const uint2*>(
        smem_q + Traits::QLayout::offset(row, 2 * kk + q / 2) + (q % 2) * 4);
    a[h] = v.x;
    a[2 + h] = v.y;
  }
}

// A pair of q's type T -> the MMA type (fp16), times q_mult (a power of two).
template <typename T>
FAE_DEVICE uint32_t fp8_q_to_mma(uint32_t pair, float q_mult) {
  if constexpr (std::is_same_v<T, __half>) {
    return pair;  // q_mult == 1
  } else {
    const float2 f = unpack2<T>(pair);
    return pack2<__half>(f.x * q_mult, f.y * q_mult);
  }
}

// The power of two fp8_q_to_mma multiplies q by (1 for an fp16 q): it puts
// the largest |q| of the tile (every warp holds all of its rows, kRowWarps ==
// 1) in [2^14, 2^15). Converts q_frags (Q in registers) in place.
template <typename Traits>
FAE_DEVICE float fp8_prepare_q(QFragments<Traits>& q_frags, const typename Traits::T* smem_q,
                               int warp_row0, int lane) {
  using T = typename Traits::T;
  static_assert(Traits::kRowWarps == 1, "every warp must see the whole Q tile (one scale)");
  if constexpr (std::is_same_v<T, __half>) {
    return 1.f;
  } else {
    float max_abs = 0.f;
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
      for (int kk = 0; kk < Traits::kStepsD; ++kk) {
        uint32_t a[4];
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = q_frags[m][kk][r];
        } else {
          load_q_frag_fp8<Traits>(a, smem_q, warp_row0, m, kk, lane);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 f = unpack2<T>(a[r]);
          max_abs = fmaxf(max_abs, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
    }
    // max_abs in [2^(e-127), 2^(e-126)): times 2^(141-e) it is in [2^14, 2^15).
    // Kept in [-126, 126] so that the factor and its inverse are normal floats
    // (q = 0: the largest factor; q = inf / NaN stay inf / NaN).
    const int biased_exp = static_cast<int>((__float_as_uint(max_abs) >> 23) & 0xFF);
    const int shift = min(126, max(-126, 141 - biased_exp));
    const float q_mult = __uint_as_float(static_cast<uint32_t>(127 + shift) << 23);
    if constexpr (Traits::kQInRegs) {
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
        for (int kk = 0; kk < Traits::kStepsD; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) q_frags[m][kk][r] = fp8_q_to_mma<T>(q_frags[m][kk][r], q_mult);
    }
    return q_mult;
  }
}

// S[m] += Q[m] K^T from an FP8 staging tile (stage_k: the warp's first key
// row, tile-relative rows swizzle the same), two k-steps per ldmatrix.x4.
// q_frags: fp16 (fp8_prepare_q); else Q from shared memory times q_mult.
template <typename Traits, typename QFrags>
FAE_DEVICE void gemm_qk_fp8(float (&s)[Traits::kMmaM][Traits::kTilesN][4], const QFrags& q_frags,
                            const typename Traits::T* smem_q, float q_mult,
                            const uint8_t* stage_k, int warp_row0, int lane) {
  using MmaT = typename Traits::MmaT;
  static_assert(Traits::kStepsD % 2 == 0, "two k-steps (one 16-byte chunk pair) per ldmatrix");
#pragma unroll
  for (int kp = 0; kp < Traits::kStepsD / 2; ++kp) {
    uint32_t a[2][Traits::kMmaM][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[h][m][r] = q_frags[m][2 * kp + h][r];
        } else {
          load_q_frag_fp8<Traits>(a[h][m], smem_q, warp_row0, m, 2 * kp + h, lane);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            a[h][m][r] = fp8_q_to_mma<typename Traits::T>(a[h][m][r], q_mult);
          }
        }
      }
#pragma unroll
    for (int jn = 0; jn < Traits::kWarpKeys / 16; ++jn) {
      // Matrices: (keys 0-7, chunk 2kp) (keys 8-15, 2kp) (keys 0-7, 2kp+1)
      // (keys 8-15, 2kp+1) = n-tiles 2jn, 2jn+1 of k-step 2kp, then of 2kp+1.
      uint32_t w[4];
      const int key = jn * 16 + (lane & 15);
      ldmatrix_x4(w, stage_k + fp8_stage_offset<Traits>(key, 2 * kp + (lane >> 4)));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t b[2] = {e4m3x2_to_f16x2<0>(w[i]), e4m3x2_to_f16x2<1>(w[i])};
#pragma unroll
        for (int m = 0; m < Traits::kMmaM; ++m) {
          mma_16816<MmaT>(s[m][2 * jn + i % 2], a[i / 2][m], b);
        }
      }
    }
  }
}

// O[m] += P[m] V for k-step kk (16 keys) from an FP8 staging tile, into the
// permuted accumulator tiles described above.
template <typename Traits>
FAE_DEVICE void pv_step_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                            const uint32_t (&a)[Traits::kMmaM][4], const uint8_t* stage_v, int kk,
                            int lane) {
  using MmaT = typename Traits::MmaT;
#pragma unroll
  for (int jc = 0; jc < Traits::kHeadDim / 32; ++jc) {
    // Matrices: (keys 0-7, chunk 2jc) (keys 8-15, 2jc) (keys 0-7, 2jc+1) (keys 8-15, 2jc+1).
    uint32_t w[4];
    const int key = kk * 16 + (lane & 15);
    ldmatrix_x4_trans(w, stage_v + fp8_stage_offset<Traits>(key, 2 * jc + (lane >> 4)));
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      // Bytes (0, 2, 1, 3): the low half is column 2g of keys 2q, 2q+1, the high one column 2g+1.
      const uint32_t keys_lo = __byte_perm(w[2 * c], 0u, 0x3120);
      const uint32_t keys_hi = __byte_perm(w[2 * c + 1], 0u, 0x3120);
      const uint32_t b_even[2] = {e4m3x2_to_f16x2<0>(keys_lo), e4m3x2_to_f16x2<0>(keys_hi)};
      const uint32_t b_odd[2] = {e4m3x2_to_f16x2<1>(keys_lo), e4m3x2_to_f16x2<1>(keys_hi)};
      const int tile = 2 * (2 * jc + c);  // accumulator tiles of chunk 2jc + c
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        mma_16816<MmaT>(o[m][tile], a[m], b_even);
        mma_16816<MmaT>(o[m][tile + 1], a[m], b_odd);
      }
    }
  }
}

template <typename Traits>
FAE_DEVICE void gemm_pv_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                            const float (&p)[Traits::kMmaM][Traits::kTilesN][4],
                            const uint8_t* stage_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) {
    uint32_t a[Traits::kMmaM][4];
    pack_p_step<Traits>(a, p, kk);
    pv_step_fp8<Traits>(o, a, stage_v, kk, lane);
  }
}

template <typename Traits>
FAE_DEVICE void gemm_pv_packed_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                                   const PFragments<Traits>& a, const uint8_t* stage_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) pv_step_fp8<Traits>(o, a[kk], stage_v, kk, lane);
}

// pv_step_fp8's accumulator order -> the 16-bit kernels' (lane q: columns 2q,
// 2q+1 of every 8-column tile), inside each quad. Per 16 columns of a row,
// lane q holds pairs 2q (columns 4q, 4q+1) and 2q+1 and needs pairs q and
// q+4; two rounds of shuffles move one pair to every lane each:
//   round 1: lane 0 <- pair 0 of lane 0, 1 <- 5 of 2, 2 <- 6 of 3, 3 <- 3 of 1
//   round 2: lane 0 <- pair 4 of lane 2, 1 <- 1 of 0, 2 <- 2 of 1, 3 <- 7 of 3
// (a lane offers its odd pair in round 1 when q ^ (q >> 1) is odd).
template <typename Traits>
FAE_DEVICE void unpermute_o_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4], int lane) {
  const int q = lane % 4;
  const int quad = lane & ~3;
  const bool odd_first = ((q ^ (q >> 1)) & 1) != 0;  // offers its odd pair in round 1
  const int src1 = quad + ((0x1320 >> (4 * q)) & 0xF);
  const int src2 = quad + ((0x3102 >> (4 * q)) & 0xF);
#pragma unroll
  for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
    for (int c = 0; c < Traits::kHeadDim / 16; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* lo = &o[m][2 * c][2 * h];  // columns 4q, 4q+2 (lo[0], lo[1])
        float* hi = &o[m][2 * c + 1][2 * h];  // columns 4q+1, 4q+3
        const float even0 = lo[0], even1 = hi[0], odd0 = lo[1], odd1 = hi[1];
        const float r1x = __shfl_sync(0xffffffffu, odd_first ? odd0 : even0, src1);
        const float r1y = __shfl_sync(0xffffffffu, odd_first ? odd1 : even1, src1);
        const float r2x = __shfl_sync(0xffffffffu, odd_first ? even0 : odd0, src2);
        const float r2y = __shfl_sync(0xffffffffu, odd_first ? even1 : odd1, src2);
        // Lanes 0 and 3 got pair q in round 1, lanes 1 and 2 in round 2.
        lo[0] = odd_first ? r2x : r1x;
        lo[1] = odd_first ? r2y : r1y;
        hi[0] = odd_first ? r1x : r2x;
        hi[1] = odd_first ? r1y : r2y;
      }
}

}  // namespace cuda
}  // namespace flash_attn_ext
