// Attention variants (window / softcap / ALiBi / attn_mask; csrc/mask.h) in
// the Hopper backward (bwd_sm90_kernel.cuh, kHasVariants), whose CTAs own a
// key tile and walk the query tiles that see it: which query tiles those are,
// which key tiles add into a query tile's dQ (the deterministic order), and
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

#include "../../mask.h"
#include "../common/fwd_softmax.cuh"
#include "../common/ptx.cuh"

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

// Mask::bias_at with the element type a template argument.
template <BiasType kType>
FAE_DEVICE float bwd_sm90_bias_value(const unsigned char* bias, int64_t e) {
  if constexpr (kType == BiasType::kBool) {
    return bias[e] ? 0.f : -INFINITY;
  } else if constexpr (kType == BiasType::kFloat32) {
    return reinterpret_cast<const float*>(bias)[e];
  } else if constexpr (kType == BiasType::kFloat16) {
    return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(bias)[e]);
  } else {
    return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(bias)[e]);
  }
}

// The S^T fragments of the kernel (wgmma accumulators, keys as rows): s[j][e]
// of a thread holds query row query_base + 8j + e % 2 and key key0 + 8 (e / 2).
template <BiasType kType, int kCols>
FAE_DEVICE void bwd_sm90_add_attn_mask(float (&s)[kCols / 8][4], const Mask& mask,
                                       int query_base, int key0,
                                       const BwdSm90QueryTiles (&rows)[2]) {
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int query = query_base + 8 * j + e % 2, key = key0 + 8 * (e / 2);
      if (query >= rows[e / 2].begin && query < rows[e / 2].end) {
        s[j][e] += bwd_sm90_bias_value<kType>(
                       mask.bias, query * mask.bias_row_stride + key * mask.bias_col_stride) *
                   kLog2e;
      }
    }
  }
}

// S^T (raw q.k; softcapped: already softcap * log2(e) * tanh(q.k * scale /
// softcap)) -> ScoreVariants::score_log2 where the row sees the key, -inf
// elsewhere (rows past seqlen_q and keys past seqlen_k included: the
// attn_mask is read only where visible, it has no element there). The mask
// per element is a range of query rows per key: a thread's keys are fixed.
// kAttnMask: the kernel instantiated for attn_mask calls (its loads cost
// registers that the others keep).
template <int kCols, bool kAttnMask>
FAE_DEVICE void bwd_sm90_variant_scores(float (&s)[kCols / 8][4], const ScoreVariants& v,
                                        int query_base, int key0, bool softcapped) {
  const BwdSm90QueryTiles rows[2] = {bwd_sm90_rows_seeing(v.mask, key0),
                                     bwd_sm90_rows_seeing(v.mask, key0 + 8)};
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int query = query_base + 8 * j + e % 2;
      const bool visible = query >= rows[e / 2].begin && query < rows[e / 2].end;
      const float x = softcapped ? s[j][e] : s[j][e] * v.scale_log2;
      s[j][e] = visible ? x : -INFINITY;
    }
  }
  if (v.alibi_log2 != 0.f) {
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dist = query_base + 8 * j + e % 2 + v.mask.diag - (key0 + 8 * (e / 2));
        s[j][e] -= v.alibi_log2 * static_cast<float>(dist < 0 ? -dist : dist);
      }
    }
  }
  if (kAttnMask && v.mask.bias != nullptr) {
    switch (v.mask.bias_type) {
      case BiasType::kBool:
        bwd_sm90_add_attn_mask<BiasType::kBool, kCols>(s, v.mask, query_base, key0, rows);
        break;
      case BiasType::kFloat32:
        bwd_sm90_add_attn_mask<BiasType::kFloat32, kCols>(s, v.mask, query_base, key0, rows);
        break;
      case BiasType::kFloat16:
        bwd_sm90_add_attn_mask<BiasType::kFloat16, kCols>(s, v.mask, query_base, key0, rows);
        break;
      case BiasType::kBFloat16:
        bwd_sm90_add_attn_mask<BiasType::kBFloat16, kCols>(s, v.mask, query_base, key0, rows);
        break;
      default:
        break;
    }
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
