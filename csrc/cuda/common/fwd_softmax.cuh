// Building blocks of the forward main loop that act on the S = Q K^T
// accumulator fragments: which key tiles a CTA visits, the causal /
// sequence-end mask, and the online softmax (running max and sum per row).
//
// Fragment convention (see sm80/fwd_kernel_traits.cuh): s[m][j][e] is the mma
// accumulator of m-tile m (16 rows) and 8-column n-tile j; with lane = 4g + q,
//   e = 0,1 -> row g,   columns 8j + 2q + {0,1}
//   e = 2,3 -> row g+8, columns 8j + 2q + {0,1}
// so index (m, h = e / 2) names one of the lane's 2*kMmaM rows.
#pragma once
#include <cmath>
#include <type_traits>

#include "../../mask.h"
#include "../../params.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

FAE_DEVICE constexpr int ceil_div_dev(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------
// Key tiles [begin, end) that one CTA (query tile m_block, KV split `split`)
// must visit. Causal: tiles entirely above the diagonal of the tile's last
// valid row are skipped. Split-KV: the nominal tiles 0..n_blocks-1 are cut into
// num_splits contiguous ranges, then intersected with the causal bound, so a
// split may end up empty (it then writes O = 0, lse = -inf).
// ---------------------------------------------------------------------------
struct KeyTileRange {
  int begin;
  int end;
};

template <int kBlockM, int kBlockN, bool kIsCausal>
FAE_DEVICE KeyTileRange key_tile_range(const SeqBounds& seq, int m_block, int split,
                                       int num_splits) {
  const int n_blocks = ceil_div_dev(seq.seqlen_k, kBlockN);
  int end = n_blocks;
  if (kIsCausal) {
    const int last_row = min((m_block + 1) * kBlockM, seq.seqlen_q) - 1;
    const int last_key = last_row + seq.causal_offset;  // last key any row may see
    end = last_key < 0 ? 0 : min(end, last_key / kBlockN + 1);
  }
  const int per_split = ceil_div_dev(n_blocks, num_splits);
  const int begin = split * per_split;
  end = min(end, begin + per_split);
  return {begin, max(begin, end)};
}

// Whether key tile n_block needs the element mask: it crosses seqlen_k, or
// (causal) some key of it lies right of the diagonal of the tile's first row.
template <int kBlockM, int kBlockN, bool kIsCausal>
FAE_DEVICE bool key_tile_needs_mask(const SeqBounds& seq, int m_block, int n_block) {
  const int tile_end = (n_block + 1) * kBlockN;  // one past the tile's last key
  if (tile_end > seq.seqlen_k) return true;
  return kIsCausal && tile_end - 1 > m_block * kBlockM + seq.causal_offset;
}

// ---------------------------------------------------------------------------
// S (raw dot products) -> scaled log2-domain scores, with invisible keys set
// to -inf. The scale is applied before the max so a negative softmax_scale
// is handled exactly, and before the mask so -inf never meets a 0 or negative
// scale (-inf * 0 = NaN).
//   row_base: global query row of the lane's row (m = 0, h = 0)
//   col_base: global key of the lane's column (j = 0, e = 0)
// ---------------------------------------------------------------------------
// kScale = false only masks (for OnlineSoftmax::update_scores_folded).
template <bool kMask, bool kIsCausal, int kMmaM, int kTilesN, bool kScale = true>
FAE_DEVICE void scale_and_mask(float (&s)[kMmaM][kTilesN][4], float scale_log2, int row_base,
                               int col_base, int seqlen_k, int causal_offset) {
#pragma unroll
  for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // keys < key_limit are visible to this row
      int key_limit = seqlen_k;
      if (kIsCausal) key_limit = min(key_limit, row_base + m * 16 + h * 8 + causal_offset + 1);
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[m][j][2 * h + e];
          if (kScale) x *= scale_log2;
          if (kMask && col_base + j * 8 + e >= key_limit) x = -INFINITY;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Attention variants (window, softcap, ALiBi; csrc/mask.h) in the kernels'
// log2 domain, for the kernels instantiated with kHasVariants: the Mask of one
// (sequence, head) plus its constants, runtime-uniform (a call without softcap
// or ALiBi skips those steps on a uniform branch).
//   score_log2(x, i, j) = log2(e) * Mask::score(softmax_scale * x, i, j)
// for the raw dot product x of query row i and key j (attn_mask included).
// ---------------------------------------------------------------------------
// The 16-bit kernels' tanh for softcap_score (csrc/mask.h): tanh.approx.f32,
// see ScoreVariants for why.
struct TanhApprox {
  FAE_DEVICE float operator()(float x) const {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
};

struct ScoreVariants {
  Mask mask;
  float scale_log2 = 0.f;    // no softcap: x -> x * softmax_scale * log2(e)
  float softcap_in = 0.f;    // softcap: tanh(x * softmax_scale / softcap) ...
  float softcap_log2 = 0.f;  // ... * softcap * log2(e)
  float alibi_log2 = 0.f;    // slope * log2(e)

  static FAE_DEVICE ScoreVariants make(const AttentionFwdParams& p, const SeqBounds& seq, int b,
                                       int h) {
    constexpr float kLog2e = 1.4426950408889634f;
    ScoreVariants v;
    v.mask = make_mask(p, seq, b, h);
    v.scale_log2 = p.scale_log2;
    v.softcap_in = p.softmax_scale * v.mask.inv_softcap;
    v.softcap_log2 = v.mask.softcap * kLog2e;
    v.alibi_log2 = v.mask.alibi_slope * kLog2e;
    return v;
  }

  // tanh.approx.f32: one MUFU op, max relative error 2^-10.99 (flash-attn 2 and 3
  // use it too). An accurate tanh (ex2 + rcp) made the MUFU unit, which the
  // softmax's exp2 already keeps busy, the bottleneck of the Hopper kernels: H100,
  // bf16, D = 128, softcap 30: forward 1.7x and backward 1.3x the plain kernel.
  // The error it leaves, softcap * 2^-11 on a score (0.015 at softcap 30) and
  // 2^-10 on df/ds = 1 - tanh^2, is below the 16-bit rounding of the scores
  // that these kernels' inputs carry; the fp32 SIMT kernels use an accurate
  // tanh (simt/mask_fp32.cuh).
  // (TanhApprox below; softcap_score in csrc/mask.h.)

  // With softcap, *dfds = 1 - tanh^2 (the backward's chain factor; else untouched).
  FAE_DEVICE float score_log2(float x, int i, int j, float* dfds = nullptr) const {
    if (mask.has_softcap()) {
      x = softcap_score(x, softcap_in, softcap_log2, dfds, TanhApprox());
    } else {
      x *= scale_log2;
    }
    if (alibi_log2 != 0.f) {
      const int dist = i + mask.diag - j;
      x -= alibi_log2 * static_cast<float>(dist < 0 ? -dist : dist);
    }
    if (mask.bias != nullptr) x += mask.bias_at(i, j) * 1.4426950408889634f;  // attn_mask
    return x;
  }
};

// Whether every score of a call lies in [-softcap, softcap] * log2(e) with
// softcap <= kMaxUnshiftedSoftcap (softcap on, no additive ALiBi or attn_mask
// term; masked scores are -inf), so that a softmax with bf16 P may skip the
// running max (OnlineSoftmax::update_scores_unshifted): 2^(+-80) and a row sum
// of up to 2^31 such terms stay far inside fp32's and bf16's normal range.
// Gemma 2 caps at 50, Grok at 30.
constexpr float kMaxUnshiftedSoftcap = 55.f;  // 55 * log2(e) = 79.3
FAE_HOST_DEVICE bool softcap_bounds_scores(const AttentionFwdParams& p) {
  return p.softcap > 0.f && p.softcap <= kMaxUnshiftedSoftcap && p.alibi_slopes == nullptr &&
         p.attn_bias == nullptr;
}

// Key tiles [begin, end) of a CTA with variants: those holding a key that some
// valid row of the query tile sees ([key_begin(first row), key_end(last row)),
// both bounds non-decreasing in the row), cut into num_splits contiguous
// ranges (a split may be empty, as in key_tile_range).
template <int kBlockM, int kBlockN>
FAE_DEVICE KeyTileRange key_tile_range_variants(const SeqBounds& seq, const Mask& mask,
                                                int m_block, int split, int num_splits) {
  const int first_row = m_block * kBlockM;
  const int last_row = min(first_row + kBlockM, seq.seqlen_q) - 1;
  const int lo = mask.key_begin(first_row) / kBlockN;
  const int hi = ceil_div_dev(mask.key_end(last_row), kBlockN);
  const int per_split = ceil_div_dev(max(hi - lo, 0), num_splits);
  const int begin = lo + split * per_split;
  const int end = min(hi, begin + per_split);
  return {begin, max(begin, end)};
}

// Whether every key of tile n_block is visible to every row in [first_row,
// last_row] (then a window without score modifiers needs no element mask):
// the tile starts at or after the last row's first key and ends at or before
// the first row's end (seqlen_k included: key_end is clamped to it).
template <int kBlockN>
FAE_DEVICE bool key_tile_inside_window(const Mask& mask, int first_row, int last_row,
                                       int n_block) {
  return n_block * kBlockN >= mask.key_begin(last_row) &&
         (n_block + 1) * kBlockN <= mask.key_end(first_row);
}

// Calls f(x, row, col) for every element of the lane's fragments (row and col
// as in scale_and_mask).
template <int kMmaM, int kTilesN, typename F>
FAE_DEVICE void for_each_score(float (&s)[kMmaM][kTilesN][4], int row_base, int col_base, F&& f) {
#pragma unroll
  for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          f(s[m][j][2 * h + e], row_base + m * 16 + h * 8, col_base + j * 8 + e);
        }
      }
    }
  }
}

// f(std::integral_constant<BiasType, t>{}) for the run-time attn_mask type t
// (nothing without a mask): code that reads the mask is instantiated once per
// element type, with no branch per element.
template <typename F>
FAE_DEVICE void with_bias_type(BiasType t, F&& f) {
  switch (t) {
    case BiasType::kBool: f(std::integral_constant<BiasType, BiasType::kBool>{}); break;
    case BiasType::kFloat32: f(std::integral_constant<BiasType, BiasType::kFloat32>{}); break;
    case BiasType::kFloat16: f(std::integral_constant<BiasType, BiasType::kFloat16>{}); break;
    case BiasType::kBFloat16: f(std::integral_constant<BiasType, BiasType::kBFloat16>{}); break;
    default: break;
  }
}

// The attn_mask term (Mask::bias_at, natural-log units) times factor added to
// every element.
// Rows and keys past the sequence read its last row / key instead (never past
// the tensor); those elements are masked afterwards.
template <BiasType kType, int kMmaM, int kTilesN>
FAE_DEVICE void add_attn_mask(float (&s)[kMmaM][kTilesN][4], const Mask& mask, int row_base,
                              int col_base, float factor) {
  for_each_score(s, row_base, col_base, [&](float& x, int row, int col) {
    x += bias_value<kType>(mask.bias, min(row, mask.seqlen_q - 1) * mask.bias_row_stride +
                                          min(col, mask.seqlen_k - 1) * mask.bias_col_stride) *
         factor;
  });
}

// ---------------------------------------------------------------------------
// A 16-bit additive attn_mask staged through shared memory (the Hopper
// forward): each warp copies the mask block of its 16 rows x kCols keys with
// coalesced 16-byte cp.async while the tile's GEMMs run, and its lanes add
// their elements from there. Loaded directly in the softmax, 2-byte loads per
// element with their latency on its critical path, the mask cost 2.4x the
// plain kernel's time (H100, bf16, D = 128, S = 4k, a [1, H, S, S] bias).
//
// Scratch of one warp: 16 rows of kCols * 2 bytes, the 16-byte chunk k of row r
// stored at chunk k ^ (r % 8), so that the lanes' 4-byte reads (lane 4g + q:
// rows g, g + 8, keys 8j + 2q + {0, 1}) hit 32 different banks.
// ---------------------------------------------------------------------------
// Whether mask m can be staged: fp16 / bf16, keys contiguous, rows 16-byte
// aligned.
FAE_DEVICE bool attn_mask_stageable(const Mask& m) {
  return (m.bias_type == BiasType::kFloat16 || m.bias_type == BiasType::kBFloat16) &&
         m.bias_col_stride == 1 && m.bias_row_stride % 8 == 0 &&
         reinterpret_cast<uintptr_t>(m.bias) % 16 == 0;
}

template <int kCols>
constexpr int kStagedMaskWarpBytes = 16 * kCols * 2;

// The warp's copies of rows [row0, row0 + 16) x keys [col0, col0 + kCols) into
// `scratch` (kStagedMaskWarpBytes): rows past the sequence read its last row,
// keys past it are zero-filled (those scores are masked anyway). Every lane
// calls it; the lanes' reads of the previous block must be done (syncwarp).
template <int kCols>
FAE_DEVICE void stage_attn_mask(uint32_t scratch, const Mask& m, int row0, int col0, int lane) {
  static_assert(kCols % 64 == 0, "the chunk swizzle works on groups of 8 chunks");
  constexpr int kChunksPerRow = kCols / 8;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int c = lane + 32 * i, r = c / kChunksPerRow, k = c % kChunksPerRow;
    const int row = min(row0 + r, m.seqlen_q - 1), col = col0 + 8 * k;
    const int bytes = 2 * max(0, min(8, m.seqlen_k - col));
    const unsigned char* src = bytes > 0 ? m.bias + (row * m.bias_row_stride + col) * 2 : m.bias;
    const uint32_t dst = scratch + r * (kCols * 2) + ((k ^ (r % 8)) * 16);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes));
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits for the warp's copies but the kPending newest groups (those of the
// tiles that the Hopper forward stages ahead) and adds each lane's values
// times factor to its scores (the m16 accumulator layout of one warp: kMmaM = 1). An 8 x 8 matrix
// of the staged rows (8 rows, one 16-byte chunk) read by ldmatrix lands in the
// lanes exactly as the accumulator holds it (lane 4g + q: row g, elements 2q,
// 2q + 1), so one ldmatrix.x4 hands a lane 8 values (rows g and g + 8 of
// n-tiles j and j + 1): a quarter of the loads of one 4-byte read per pair.
template <int kTilesN, int kPending>
FAE_DEVICE void add_staged_attn_mask(float (&s)[1][kTilesN][4], uint32_t scratch, int lane,
                                     BiasType type, float factor) {
  static_assert(kTilesN % 2 == 0, "n-tiles in pairs, one ldmatrix.x4 per pair");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
  __syncwarp();
  const bool bf16 = type == BiasType::kBFloat16;
  // Lane l addresses row l % 8 of matrix l / 8 = (row half m % 2, n-tile
  // j + m / 2); stage_attn_mask's chunk swizzle keeps the 8 rows of a matrix on
  // distinct banks.
  const int m = lane / 8, r = lane % 8 + 8 * (m % 2);
  const uint32_t row_addr = scratch + r * (kTilesN * 16);
#pragma unroll
  for (int j = 0; j < kTilesN; j += 2) {
    uint32_t w[4];
    ldmatrix_x4_at(w, row_addr + (((j + m / 2) ^ (lane % 8)) * 16));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float lo, hi;
      if (bf16) {  // (fp16 below through the hardware conversion, not mask.h's bit path)
        lo = bf16_bits_to_float(static_cast<uint16_t>(w[i]));
        hi = bf16_bits_to_float(static_cast<uint16_t>(w[i] >> 16));
      } else {
        const __half2 pair = *reinterpret_cast<const __half2*>(&w[i]);
        lo = __low2float(pair);
        hi = __high2float(pair);
      }
      // w[i]: row half i % 2 (elements 0, 1 or 2, 3) of n-tile j + i / 2.
      s[0][j + i / 2][2 * (i % 2)] += lo * factor;
      s[0][j + i / 2][2 * (i % 2) + 1] += hi * factor;
    }
  }
}

// scale_and_mask with variants: every score becomes score_log2 (softcap,
// ALiBi, attn_mask) / unit, and keys outside the row's [key_begin, key_end)
// become -inf. Returns unit, the factor that takes the results to the log2
// domain: 1 with kFold = false; with kFold = true (callers whose scale is > 0)
// softcap * log2(e) with softcap, else softmax_scale * log2(e), so that the
// caller's OnlineSoftmax::update_scores_folded applies it inside its exp2 FMA
// (no multiply pass; without modifiers the raw scores stay as they are).
// mask_elements = false skips the element mask (a tile inside the window of
// all the lane's rows: key_tile_inside_window), read_attn_mask = false the
// attn_mask (a tile that it masks nowhere: mask_blocks.cuh).
// One pass over the tile per modifier, each behind one uniform branch: with the
// branches per element (score_log2 in the loop) the compiler issued every
// element's dependent chain, attn_mask loads included, one after the other
// (H100, bf16, D = 128, S = 4k: ALiBi 4.6x and an additive mask 9.8x the time
// of the plain Hopper forward). kAttnMask: the kernel instantiated for calls
// with an attn_mask (its loads, issued together, cost registers the others
// need not pay for).
template <bool kAttnMask, bool kFold, int kMmaM, int kTilesN>
FAE_DEVICE float score_and_mask_variants(float (&s)[kMmaM][kTilesN][4], const ScoreVariants& v,
                                         int row_base, int col_base, bool mask_elements,
                                         bool read_attn_mask = true) {
  constexpr float kLog2e = 1.4426950408889634f;
  const bool softcap = v.mask.has_softcap();
  const float unit = kFold ? (softcap ? v.softcap_log2 : v.scale_log2) : 1.f;
  if (softcap) {
    for_each_score(s, row_base, col_base, [&](float& x, int, int) {
      // Folded: softcap * log2(e) goes into the exp2 FMA (the factor 1 costs nothing).
      x = softcap_score(x, v.softcap_in, kFold ? 1.f : v.softcap_log2, nullptr, TanhApprox());
    });
  } else if constexpr (!kFold) {
    for_each_score(s, row_base, col_base, [&](float& x, int, int) { x *= v.scale_log2; });
  }
  if (v.alibi_log2 != 0.f) {
    // The distance |row + diag - col| in fp32 from the lane's first key of the
    // row (exact below 2^24): a constant per element instead of an int -> float
    // conversion, which issues at the MUFU's quarter rate.
    const float slope = v.alibi_log2 / unit;
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float dist0 = static_cast<float>(row_base + m * 16 + h * 8 + v.mask.diag - col_base);
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[m][j][2 * h + e];
            x -= slope * fabsf(dist0 - static_cast<float>(j * 8 + e));
          }
        }
      }
    }
  }
  if constexpr (kAttnMask) {
    if (read_attn_mask) {
      with_bias_type(v.mask.bias_type, [&](auto type) {
        add_attn_mask<decltype(type)::value>(s, v.mask, row_base, col_base, kLog2e / unit);
      });
    }
  }
  if (mask_elements) {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_base + m * 16 + h * 8;
        const int lo = v.mask.key_begin(row), hi = v.mask.key_end(row);
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = col_base + j * 8 + e;
            if (col < lo || col >= hi) s[m][j][2 * h + e] = -INFINITY;
          }
        }
      }
    }
  }
  return unit;
}

// ---------------------------------------------------------------------------
// Online softmax state for the lane's 2*kMmaM rows.
//   row_max: running max of the scaled (log2-domain) scores, -inf while the
//            row has seen no visible key
//   row_sum: this lane's share of sum(exp2(score - row_max)); the 4 lanes of a
//            quad are only reduced in finalize() (rescaling is per row, so
//            partial sums can be rescaled independently)
// kPExp2Offset (update_scores_folded): probabilities come out as
// exp2(score - row_max + kPExp2Offset), and row_sum alike, so O / row_sum is
// unchanged; finalize() takes the offset off the LSE. The FP8 forward uses 8
// to keep P (quantised to e4m3 for P V) out of e4m3's subnormal range.
// ---------------------------------------------------------------------------
template <int kMmaM, int kPExp2Offset = 0>
struct OnlineSoftmax {
  float row_max[kMmaM][2];
  float row_sum[kMmaM][2];

  FAE_DEVICE OnlineSoftmax() {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[m][h] = -INFINITY;
        row_sum[m][h] = 0.f;
      }
    }
  }

  // Turns the scores s into probabilities p = exp2(s - new_max) in place,
  // and rescales the O accumulator and the running sum by exp2(old - new).
  template <int kTilesN, int kTilesD>
  FAE_DEVICE void update(float (&s)[kMmaM][kTilesN][4], float (&o)[kMmaM][kTilesD][4]) {
    float rescale[kMmaM][2];
    update_scores(s, rescale);
    rescale_rows(o, rescale);
  }

  // The two halves of update(), for kernels that must rescale O later (the
  // Hopper kernel: the previous tile's O += P V is still in flight while the
  // scores of this tile are turned into probabilities).
  template <int kTilesN>
  FAE_DEVICE void update_scores(float (&s)[kMmaM][kTilesN][4], float (&rescale)[kMmaM][2]) {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float new_max = row_max[m][h];
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
          new_max = fmaxf(new_max, fmaxf(s[m][j][2 * h], s[m][j][2 * h + 1]));
        }
        new_max = quad_max(new_max);
        // A row with no visible key so far keeps max = -inf. Subtracting 0
        // instead makes every exp2 below exp2(-inf) = 0 rather than NaN, and
        // the rescale exp2(-inf - 0) = 0 multiplies an O row that is 0 anyway.
        const float base = new_max == -INFINITY ? 0.f : new_max;
        rescale[m][h] = fast_exp2(row_max[m][h] - base);
        row_max[m][h] = new_max;

        float tile_sum = 0.f;
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = fast_exp2(s[m][j][2 * h + e] - base);
            s[m][j][2 * h + e] = p;
            tile_sum += p;
          }
        }
        row_sum[m][h] = row_sum[m][h] * rescale[m][h] + tile_sum;
      }
    }
  }

  // Row (m, h) of the lane's scores -> p = exp2(s * scale_log2 + offset) in
  // place; returns their sum (two independent chains, see update_scores_folded).
  template <int kTilesN>
  static FAE_DEVICE float exp2_row(float (&s)[kMmaM][kTilesN][4], int m, int h, float scale_log2,
                                   float offset) {
    float sum_even = 0.f, sum_odd = 0.f;
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {
      const float p0 = fast_exp2(fmaf(s[m][j][2 * h], scale_log2, offset));
      const float p1 = fast_exp2(fmaf(s[m][j][2 * h + 1], scale_log2, offset));
      s[m][j][2 * h] = p0;
      s[m][j][2 * h + 1] = p1;
      sum_even += p0;
      sum_odd += p1;
    }
    return sum_even + sum_odd;
  }

  // The maximum of row (m, h) of the tile over the quad's lanes (two chains).
  template <int kTilesN>
  static FAE_DEVICE float row_tile_max(const float (&s)[kMmaM][kTilesN][4], int m, int h) {
    float max_even = s[m][0][2 * h], max_odd = s[m][0][2 * h + 1];
#pragma unroll
    for (int j = 1; j < kTilesN; ++j) {
      max_even = fmaxf(max_even, s[m][j][2 * h]);
      max_odd = fmaxf(max_odd, s[m][j][2 * h + 1]);
    }
    return quad_max(fmaxf(max_even, max_odd));
  }

  // update_scores for raw (unscaled) scores with the scale folded into the
  // exponent: p = exp2(s * scale_log2 - max * scale_log2), one FFMA per score
  // instead of an FMUL and an FADD. Needs scale_log2 > 0 (the max of the raw
  // scores is then the max of the scaled ones; a masked -inf stays -inf), so
  // callers dispatch other scales elsewhere. The row max and sum reductions
  // use two independent chains each: their latency, not just the exp2
  // throughput, sits on the critical path of the Hopper kernel's softmax.
  //
  // kLazyRescale (FlashAttention 4's conditional rescaling): a row keeps its
  // running max while the tile's scores exceed it by at most kLazyRescaleLog2
  // (its probabilities then reach 2^8 instead of 1, exact in fp32 and far from
  // the 16-bit P's limits), so that once the maxima settle, most tiles leave O
  // alone. Returns whether some row of the warp changed its max (the caller
  // rescales O only then; the rows that kept theirs have rescale = 1).
  static constexpr float kLazyRescaleLog2 = 8.f;
  template <bool kLazyRescale = false, int kTilesN>
  FAE_DEVICE bool update_scores_folded(float (&s)[kMmaM][kTilesN][4], float scale_log2,
                                       float (&rescale)[kMmaM][2]) {
    static_assert(!kLazyRescale || kPExp2Offset == 0,
                  "P scaled by 2^kPExp2Offset and by up to 2^8 would overflow e4m3");
    bool max_changed = false;
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float tile_max = row_tile_max(s, m, h) * scale_log2;
        float new_max = fmaxf(row_max[m][h], tile_max);
        // (-inf + 8 = -inf: a row without visible keys takes its first finite max.)
        if (kLazyRescale && tile_max <= row_max[m][h] + kLazyRescaleLog2) new_max = row_max[m][h];
        const float base = new_max == -INFINITY ? 0.f : new_max;  // see update_scores
        rescale[m][h] = fast_exp2(row_max[m][h] - base);
        max_changed |= new_max != row_max[m][h];
        row_max[m][h] = new_max;

        const float tile_sum =
            exp2_row(s, m, h, scale_log2, static_cast<float>(kPExp2Offset) - base);
        row_sum[m][h] = row_sum[m][h] * rescale[m][h] + tile_sum;
      }
    }
    return !kLazyRescale || __any_sync(0xffffffffu, max_changed);
  }

  // update_scores_folded in two halves, for a caller that runs the first under
  // a wgmma and only the second after its wait (the Hopper forward at D = 128:
  // fwd_sm90_kernel.cuh, kMaxUnderOwnPv). exponent_args: the row maxima, the
  // rescale factors of O and the running sum, and every exponent's argument
  // s * scale_log2 - max in place. exponentiate: p = exp2(argument) in place
  // and the row sums (two chains each, as update_scores_folded). No lazy
  // rescaling (the D = 256 kernels keep update_scores_folded). base: the
  // subtracted maxima, for the caller's keep_above_next_wait.
  template <int kTilesN>
  FAE_DEVICE void exponent_args(float (&s)[kMmaM][kTilesN][4], float scale_log2,
                                float (&rescale)[kMmaM][2], float (&base)[kMmaM][2]) {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float tile_max = row_tile_max(s, m, h) * scale_log2;
        const float new_max = fmaxf(row_max[m][h], tile_max);
        base[m][h] = new_max == -INFINITY ? 0.f : new_max;  // see update_scores
        rescale[m][h] = fast_exp2(row_max[m][h] - base[m][h]);
        row_max[m][h] = new_max;
        const float offset = static_cast<float>(kPExp2Offset) - base[m][h];
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
          s[m][j][2 * h] = fmaf(s[m][j][2 * h], scale_log2, offset);
          s[m][j][2 * h + 1] = fmaf(s[m][j][2 * h + 1], scale_log2, offset);
        }
      }
    }
  }
  template <int kTilesN>
  FAE_DEVICE void exponentiate(float (&s)[kMmaM][kTilesN][4], const float (&rescale)[kMmaM][2]) {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum_even = 0.f, sum_odd = 0.f;
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
          s[m][j][2 * h] = fast_exp2(s[m][j][2 * h]);
          s[m][j][2 * h + 1] = fast_exp2(s[m][j][2 * h + 1]);
          sum_even += s[m][j][2 * h];
          sum_odd += s[m][j][2 * h + 1];
        }
        row_sum[m][h] = row_sum[m][h] * rescale[m][h] + (sum_even + sum_odd);
      }
    }
  }

  // update_scores_folded for scores bounded in magnitude (softcap_bounds_scores):
  // p = exp2(s * scale_log2), no running max, so no max reduction and no
  // rescaling of O or of the row sum (the softmax is shift-invariant; the LSE
  // comes out as log(row sum)). What it leaves out offsets part of the cost of
  // the softcap's tanh (docs/PERFORMANCE.md).
  // Without the max, the row's largest probability is some exp2(x), not 1,
  // and P V reads P rounded to bf16: a row sum of the unrounded p would make
  // out = bf16(p) v / p != v on a row with one visible key (one bf16 ulp off at
  // |v| ~ 2-4). So p is rounded to bf16 here (the P V conversion is then
  // exact) and the row sum adds the rounded values: O / row sum is exactly v
  // again on such rows, and a peaked row's weights are ratios of the P that
  // P V used, as with the running max (whose largest p is exactly 1). bf16
  // only: this path is taken for bf16 P alone (fp16's range is too narrow).
  template <int kTilesN>
  FAE_DEVICE void update_scores_unshifted(float (&s)[kMmaM][kTilesN][4], float scale_log2) {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[m][h] = 0.f;
        float sum_even = 0.f, sum_odd = 0.f;  // two chains, as exp2_row
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
          float& x0 = s[m][j][2 * h];
          float& x1 = s[m][j][2 * h + 1];
          const float offset = static_cast<float>(kPExp2Offset);
          // One cvt for the pair; the bf16 halves back to fp32 are a shift and a mask.
          const uint32_t pair = pack2<__nv_bfloat16>(fast_exp2(fmaf(x0, scale_log2, offset)),
                                                     fast_exp2(fmaf(x1, scale_log2, offset)));
          x0 = __uint_as_float(pair << 16);
          x1 = __uint_as_float(pair & 0xffff0000u);
          sum_even += x0;
          sum_odd += x1;
        }
        row_sum[m][h] += sum_even + sum_odd;
      }
    }
  }

  template <int kTilesD>
  static FAE_DEVICE void rescale_rows(float (&o)[kMmaM][kTilesD][4],
                                      const float (&rescale)[kMmaM][2]) {
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int d = 0; d < kTilesD; ++d) {
          o[m][d][2 * h] *= rescale[m][h];
          o[m][d][2 * h + 1] *= rescale[m][h];
        }
      }
    }
  }

  // Normalises O by the row sums and returns the natural-log LSE per row.
  // Rows that never saw a visible key have sum 0: O stays exactly 0 and
  // lse = -inf (no 1/0, no -inf - -inf).
  // sink_log2: a learnable sink's logit in the log2 domain of row_max
  // (sink_log2_of, params.h), -inf without one: one more term of the
  // denominator, no value (fold_sink_into_row). A row without visible keys
  // then has O = 0 and lse = sink. Split-KV / key-warp partials pass it in
  // exactly one partial (their merges are log-sum-exps).
  template <int kTilesD>
  FAE_DEVICE void finalize(float (&o)[kMmaM][kTilesD][4], float (&lse)[kMmaM][2],
                           float sink_log2 = -INFINITY) {
    constexpr float kLn2 = 0.69314718055994531f;
    constexpr float kOffset = static_cast<float>(kPExp2Offset);
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = quad_sum(row_sum[m][h]);
        float max = row_max[m][h];
        float o_factor = 1.f;  // exp2(old max - new max): O holds terms relative to row_max
        if (sink_log2 != -INFINITY) o_factor = fold_sink_into_row(sink_log2, max, sum, kOffset);
        const bool empty = !(sum > 0.f);
        const float inv = empty ? 0.f : o_factor / sum;
        lse[m][h] = empty ? -INFINITY : (max - kOffset) * kLn2 + logf(sum);
#pragma unroll
        for (int d = 0; d < kTilesD; ++d) {
          o[m][d][2 * h] *= inv;
          o[m][d][2 * h + 1] *= inv;
        }
      }
    }
  }
};

}  // namespace cuda
}  // namespace flash_attn_ext
