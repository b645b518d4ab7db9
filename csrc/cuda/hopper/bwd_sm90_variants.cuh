// Attention variants (window / softcap / ALiBi / attn_mask, csrc/mask.h; and
// dropout, csrc/dropout.h, at the end) in the Hopper backward
// (bwd_sm90_kernel.cuh, kHasVariants), whose CTAs own a key tile and walk the
// query tiles that see it: which query tiles those are, which key tiles add
// into a query tile's dQ (the deterministic order), and
// which tiles need no element mask, and the scores of the tiles that do
// (ScoreVariants' score_log2, common/fwd_softmax.cuh, taken apart into one
// pass per modifier: the consumers are at the register limit, and one
// uniform test per tile instead of per element keeps the unrolled code flat).
//
// Both tile ranges below are exact: query tile m lies in key tile n's range
// iff key tile n lies in query tile m's, iff some valid row of m sees some
// valid key of n. A key's visible rows [query_begin, query_end) have
// non-decreasing bounds, and the rows of consecutive keys overlap or touch
// (query_begin(j + 1) <= query_end(j): window bounds are >= 0, or unbounded),
// so the rows that see a key of the tile are the hull [query_begin(first key),
// query_end(last key)); the same holds for the keys a query tile's rows see.
// The deterministic mode depends on it: a key tile waits for exactly the key
// tiles that add into the same query tile.
#pragma once
#include <cmath>
#include <cstdint>

#include "../../dropout.h"
#include "../../mask.h"
#include "../common/dropout_tile.cuh"
#include "../common/fwd_softmax.cuh"
#include "../common/mask_blocks.cuh"
#include "../common/ptx.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

struct BwdSm90QueryTiles {
  int begin;
  int end;
};

// Query tiles (kBlockM rows) holding a row that sees a key of [key0, key0 +
// kBlockN) within seqlen_k; none when no row sees any (the CTA then writes
// dK = dV = 0).
template <int kBlockM, int kBlockN>
FAE_DEVICE BwdSm90QueryTiles bwd_sm90_query_tiles(const Mask& window, int key0) {
  const int first = window.query_begin(key0);
  const int end = window.query_end(min(key0 + kBlockN, window.seqlen_k) - 1);
  if (first >= end) return {0, 0};
  return {first / kBlockM, (end + kBlockM - 1) / kBlockM};
}

// One past the last key tile (kBlockN keys) that adds into query tile m_block:
// the tile of the last key its last valid row sees. The first is the tile of
// key_begin(first row).
template <int kBlockM, int kBlockN>
FAE_DEVICE int bwd_sm90_key_tiles_end(const Mask& window, int m_block) {
  const int last_row = min((m_block + 1) * kBlockM, window.seqlen_q) - 1;
  return (window.key_end(last_row) + kBlockN - 1) / kBlockN;
}

// Whether every key of [key0, key0 + kKeys) is visible to every row of query
// tile m_block (seqlen_k included: key_end is clamped to it). Then a call
// without score modifiers needs no element mask there: the plain
// exp2(S * scale_log2 - lse) is exact, padded rows having lse = +inf.
template <int kBlockM, int kKeys>
FAE_DEVICE bool bwd_sm90_keys_inside_window(const Mask& window, int m_block, int key0) {
  const int first_row = m_block * kBlockM;
  const int last_row = min(first_row + kBlockM, window.seqlen_q) - 1;
  return key0 >= window.key_begin(last_row) && key0 + kKeys <= window.key_end(first_row);
}

// Rows [begin, end) that see key `key` (none past seqlen_k): the element mask
// of a thread's accumulator row (a key) of S^T, for the thread's whole CTA.
FAE_DEVICE BwdSm90QueryTiles bwd_sm90_rows_seeing(const Mask& window, int key) {
  if (key >= window.seqlen_k) return {0, 0};
  return {window.query_begin(key), window.query_end(key)};
}

// The S^T fragments of the kernel (wgmma accumulators, keys as rows): s[j][e]
// of a thread holds query row query_base + 8j + e % 2 and key key0 + 8 (e / 2).
// The attn_mask term (natural-log units) times factor is added where visible.
template <BiasType kType, int kCols>
FAE_DEVICE void bwd_sm90_add_attn_mask(float (&s)[kCols / 8][4], const Mask& mask,
                                       int query_base, int key0,
                                       const BwdSm90QueryTiles (&rows)[2], float factor) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int query = query_base + 8 * j + e % 2, key = key0 + 8 * (e / 2);
      if (query >= rows[e / 2].begin && query < rows[e / 2].end) {
        s[j][e] += bias_value<kType>(mask.bias, query * mask.bias_row_stride +
                                                    key * mask.bias_col_stride) *
                   factor;
      }
    }
  }
}

// S^T (raw q.k; softcapped: already tanh(q.k * scale / softcap)) ->
// ScoreVariants::score_log2 / unit where the row sees the key, -inf elsewhere
// (rows past seqlen_q and keys past seqlen_k included: the attn_mask is read
// only where visible, it has no element there). Returns unit (softcap *
// log2(e) with softcap, else softmax_scale * log2(e) when > 0, else 1), which
// the caller's exp2(s * unit - lse) applies: no multiply pass. mask_elements = false: the
// warpgroup's keys are inside the window of every row of the tile
// (bwd_sm90_keys_inside_window), no element mask; read_attn_mask = false: the
// attn_mask masks nothing there (mask_blocks.cuh). The mask per element is a
// range of query rows per key: a thread's keys are fixed.
// kAttnMask: the kernel instantiated for attn_mask calls (its loads cost
// registers that the others keep).
template <int kCols, bool kAttnMask>
FAE_DEVICE float bwd_sm90_variant_scores(float (&s)[kCols / 8][4], const ScoreVariants& v,
                                         int query_base, int key0, bool softcapped,
                                         bool mask_elements, bool read_attn_mask) {
  constexpr float kLog2e = 1.4426950408889634f;
  float unit = softcapped ? v.softcap_log2 : v.scale_log2;
  if (!(unit > 0.f)) {
    // softmax_scale <= 0 (allowed, no softcap) is applied here: a -inf mask
    // times a negative unit would turn into +inf.
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= unit;
    }
    unit = 1.f;
  }
  const BwdSm90QueryTiles rows[2] = {bwd_sm90_rows_seeing(v.mask, key0),
                                     bwd_sm90_rows_seeing(v.mask, key0 + 8)};
  if (mask_elements) {
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = query_base + 8 * j + e % 2;
        if (query < rows[e / 2].begin || query >= rows[e / 2].end) s[j][e] = -INFINITY;
      }
    }
  }
  if (v.alibi_log2 != 0.f) {
    // |query + diag - key| in fp32 from the thread's first query (exact below
    // 2^24): constants per element instead of int -> float conversions, which
    // issue at the MUFU's quarter rate.
    const float slope = v.alibi_log2 / unit;
    const float dist0 = static_cast<float>(query_base + v.mask.diag - key0);
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] -= slope * fabsf(dist0 + static_cast<float>(8 * j + e % 2 - 8 * (e / 2)));
      }
    }
  }
  if constexpr (kAttnMask) {
    if (!read_attn_mask) return unit;
    with_bias_type(v.mask.bias_type, [&](auto type) {
      bwd_sm90_add_attn_mask<decltype(type)::value, kCols>(s, v.mask, query_base, key0, rows,
                                                           kLog2e / unit);
    });
  }
  return unit;
}

// ---------------------------------------------------------------------------
// A 16-bit additive attn_mask staged through shared memory (key split; the
// forward's stage_attn_mask in fwd_softmax.cuh is the model). Read per element
// from global memory (bwd_sm90_add_attn_mask: a 2-byte load, its address and a
// range test per score), the mask cost the backward 2.4x the plain kernel's
// time (H100, bf16, D = 128, S = 4k, a [1, H, S, S] bias; 0.74x cuDNN). Each
// warp copies its step's block (kCols queries x its 16 keys) with 16-byte
// cp.async into its own rows of the step's dS^T buffer, which it overwrites
// with its dS^T later in the same step (the buffer's previous readers, step
// i - 2's dQ products, are done by then: bwd_sm90_kernel.cuh), and reads it
// back transposed with ldmatrix: one instruction per 8 scores of a lane.
//
// Layout per 64-query chunk c (region + c * kChunkStride, 2 KB = the warp's 16
// key rows of the dS^T chunk): query q's 16 keys at (q % 64) * 32, key half h
// at ((h ^ (q / 4) % 2) * 16), so that the 8 rows of a matrix hit 32 banks.
// ---------------------------------------------------------------------------
template <int kChunkStride>
FAE_DEVICE uint32_t bwd_sm90_staged_mask_addr(uint32_t region, int q, int h) {
  return region + (q / 64) * kChunkStride + (q % 64) * 32 + ((h ^ ((q / 4) % 2)) * 16);
}

// Every lane calls it. Lane l copies key half l % 2 of queries l / 2 + 16i,
// so its source steps by 16 rows and its destination by constants; rows past
// the sequence and keys past it are zero-filled (those scores are masked).
template <int kCols, int kChunkStride>
FAE_DEVICE void bwd_sm90_stage_attn_mask(uint32_t region, const Mask& m, int query0, int key0,
                                         int lane) {
  static_assert(kCols % 64 == 0, "whole 64-query chunks");
  const int h = lane % 2, col = key0 + 8 * h;
  const int col_bytes = 2 * max(0, min(8, m.seqlen_k - col));
  const unsigned char* src = m.bias + ((query0 + lane / 2) * m.bias_row_stride + col) * 2;
  const int64_t src_step = 32 * m.bias_row_stride;  // 16 rows of 2-byte elements
  const uint32_t dst = bwd_sm90_staged_mask_addr<kChunkStride>(region, lane / 2, h);
#pragma unroll
  for (int i = 0; i < kCols / 16; ++i) {
    const int bytes = query0 + lane / 2 + 16 * i < m.seqlen_q ? col_bytes : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     dst + (i / 4) * kChunkStride + (i % 4) * 512),
                 "l"(bytes > 0 ? src + i * src_step : m.bias), "r"(bytes));
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits for the warp's copies and adds the mask times factor to s (the S^T
// fragments: s[j][e] is query 8j + 2u + e % 2, key g + 8 (e / 2) of the block).
// ldmatrix.trans of matrix (n-tile j + m / 2, key half m % 2) hands lane l
// exactly those two queries of key g = l / 4 in one register.
template <int kCols, int kChunkStride>
FAE_DEVICE void bwd_sm90_add_staged_attn_mask(float (&s)[kCols / 8][4], uint32_t region,
                                              BiasType type, float factor, int lane) {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncwarp();
  const bool bf16 = type == BiasType::kBFloat16;
  const int m = lane / 8;
#pragma unroll
  for (int j = 0; j < kCols / 8; j += 2) {
    uint32_t w[4];
    sm90::ldmatrix_x4_trans_at(
        bwd_sm90_staged_mask_addr<kChunkStride>(region, 8 * (j + m / 2) + lane % 8, m % 2),
        w);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float lo, hi;
      if (bf16) {  // (fp16 below through the hardware conversion, not mask.h's bit path)
        lo = bf16_bits_to_float(static_cast<uint16_t>(w[r]));
        hi = bf16_bits_to_float(static_cast<uint16_t>(w[r] >> 16));
      } else {
        const __half2 pair = *reinterpret_cast<const __half2*>(&w[r]);
        lo = __low2float(pair);
        hi = __high2float(pair);
      }
      s[j + r / 2][2 * (r % 2)] += lo * factor;
      s[j + r / 2][2 * (r % 2) + 1] += hi * factor;
    }
  }
}

// ---------------------------------------------------------------------------
// Dropout (Z = keep ? scale : 0 per element, csrc/dropout.h) on the S^T / dP^T
// accumulators: a warp's m64nN fragment rows are keys key_base + g and
// key_base + 8 + g (key_base = the warp's first key, a multiple of 16), its
// columns queries query_base + 8j + 2u + {0, 1}: acc[j][e] is
// dropout_tile.cuh's transposed acc[m = 0][j][c = e], so its bit
// dropout_bit_transposed<1>(0, j, e) (bwd_sm90_dropout_bit).
// ---------------------------------------------------------------------------
template <int kCols>
using BwdSm90DropoutBits = DropoutBitsT<1, kCols / 8>;

FAE_HOST_DEVICE constexpr int bwd_sm90_dropout_bit(int j, int e) {
  return dropout_bit_transposed<1>(0, j, e);
}

// The lane's keep bits of the warp's [16 keys x kCols queries]: kCols / 32
// Philox calls per lane, each a whole call group (16 elements), as
// dropout_bits_transposed<1, kCols / 8> (dropout_tile.cuh, whose bit layout
// this returns), but one call at a time: the consumers are at the register
// limit (ptxas -v: calls in flight together spilled in the D = 128 varlen and
// the D = 64 attn_mask kernels). Pure ALU work: the kernel runs it while the
// step's score GEMMs are in flight. query_base: a multiple of 32.
template <int kCols>
FAE_DEVICE BwdSm90DropoutBits<kCols> bwd_sm90_dropout_bits(const Dropout& d, int key_base,
                                                           int query_base, int lane) {
  static_assert(kCols % 32 == 0, "whole 32-query call groups");
  using Bits = BwdSm90DropoutBits<kCols>;
  const int g = lane / 4, u = lane % 4;
  Bits bits = 0;
#pragma unroll 1
  for (int c = 0; c < kCols / 32; ++c) {
    const uint32_t call = d.call_keep_bits(query_base + 32 * c + 2 * u, key_base + g);
    bits |= static_cast<Bits>(call) << (16 * c);
  }
  return bits;
}

// acc[j][e] = 0 where dropped (the kernel folds the scale elsewhere:
// BwdSm90Softmax::scores_to_probs, bwd_sm90_softmax.cuh).
template <int kCols>
FAE_DEVICE void bwd_sm90_drop(float (&acc)[kCols / 8][4], BwdSm90DropoutBits<kCols> bits) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!dropout_keep_bit(bits, bwd_sm90_dropout_bit(j, e))) acc[j][e] = 0.f;
    }
  }
}

// Head-dim split: consumer 0 hands consumer 1 P^T (softcap: P^T o df/ds,
// also >= 0) in fp32 with the dropped elements' sign bit set, so that one
// word carries both the undropped value (for dS^T) and Z (for dP^T and the
// dV operand). x >= 0 (+0 included) for every element.
FAE_DEVICE float bwd_sm90_mark_dropped(float x, bool kept) {
  return __uint_as_float(__float_as_uint(x) | (kept ? 0u : 0x80000000u));
}
FAE_DEVICE bool bwd_sm90_is_dropped(float x) { return (__float_as_uint(x) >> 31) != 0u; }

}  // namespace cuda
}  // namespace flash_attn_ext
