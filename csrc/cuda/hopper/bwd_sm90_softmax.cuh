// Hopper backward: scores to probabilities in bwd_sm90_kernel.cuh's consumers
// (BwdSm90Softmax): the step's row statistics (lse in log2, D) for a thread's
// accumulator columns, and P^T = exp2(S^T * scale * log2(e) - lse) in place,
// masked, with the attention variants' scores (bwd_sm90_variants.cuh) first.
#pragma once
#include <cstdint>

#include "../../params.h"
#include "../common/fwd_softmax.cuh"
#include "../common/ptx.cuh"
#include "bwd_sm90_smem.cuh"
#include "bwd_sm90_variants.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

// params, seq, b, n0: the call, the sequence, the batch entry and the key
// tile's first key of the CTA; lane, wg_key0, key_row: the consumer thread's
// (BwdSm90Consumer). References to the kernel's locals, as BwdSm90Consumer
// holds them.
template <typename Traits, bool kIsCausal, bool kHasVariants, bool kHasAttnMask>
struct BwdSm90Softmax {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;

  const AttentionBwdParams& params;
  const SeqBounds& seq;
  const BwdSm90Smem<Traits>& smem;
  const int &b, &n0;
  const int &lane, &wg_key0, &key_row;

  // With variants: the Mask of this sequence and the step's query head h (its
  // own ALiBi slope and attn_mask slice; kWalkGroup: h changes along the walk)
  // and the score modifiers, made where used: most fields stay in the
  // constant bank, and none holds a register across the step's GEMMs (the
  // consumers are at the register limit).
  FAE_DEVICE ScoreVariants make_variants(int h) const {
    return ScoreVariants::make(params, seq, b, h);
  }

  // The step's lse (log2, +inf where P = 0) or D for the thread's accumulator
  // columns 8j + 2q + {0, 1}, from the stage's row statistics: with 64-query
  // steps preloaded while the score GEMMs run (RowStat), with 128-query steps
  // read where used (another 2 x 32 registers beside S^T and dP^T would spill;
  // so does the variant kernel of the key split: ptxas -v, 32 registers).
  static constexpr bool kPreloadRowStats =
      kBlockM == 64 && (!kHasVariants || Traits::kSplitHeadDim);
  using RowStat = float[kPreloadRowStats ? kBlockM / 8 : 1][2];
  FAE_DEVICE void load_row_stat(uint32_t row_stat, RowStat& out) const {
    if constexpr (kPreloadRowStats) {
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        sm90::ld_shared_v2_f32(row_stat + (8 * j + 2 * (lane % 4)) * 4, out[j][0], out[j][1]);
      }
    }
  }
  FAE_DEVICE void row_stat_pair(uint32_t row_stat, const RowStat& pre, int j,
                                float (&out)[2]) const {
    if constexpr (kPreloadRowStats) {
      out[0] = pre[j][0];
      out[1] = pre[j][1];
    } else {
      sm90::ld_shared_v2_f32(row_stat + (8 * j + 2 * (lane % 4)) * 4, out[0], out[1]);
    }
  }

  // S^T -> P^T in place. Causal: only tiles crossing the diagonal need the
  // per-element test. Variants: every tile with score modifiers, and those
  // the window cuts for this warpgroup's keys, take bwd_sm90_variant_scores
  // first (then P = exp2(score * unit - lse), unit from it); softcapped: the
  // caller has applied the softcap's tanh (and kept df/ds). Dropout: P^T comes
  // out times the dropout scale, the row statistics being lse - log2(scale)
  // and D / scale (bwd_preprocess.cuh), so no element is multiplied by it.
  // staged_mask: the warp's staged attn_mask block (key split, 16-bit masks;
  // 0 = read per element), see bwd_sm90_stage_attn_mask.
  FAE_DEVICE void scores_to_probs(int h, int m_block, int stage, float (&s)[kBlockM / 8][4],
                                  uint32_t lse_row_stat, const RowStat& lse_pre, bool softcapped,
                                  uint32_t staged_mask = 0) const {
    const int query_base = m_block * kBlockM + 2 * (lane % 4);  // + 8j + e % 2
    float scale_log2 = params.scale_log2;
    if constexpr (kHasVariants) {
      const ScoreVariants variants = make_variants(h);
      const bool mask_elements =
          !bwd_sm90_keys_inside_window<kBlockM, 64>(variants.mask, m_block, n0 + wg_key0);
      // attn_mask: whether this consumer's keys need the mask on this step
      // (the loader's word, from the mask's block summary).
      bool read_attn_mask = true;
      if constexpr (kHasAttnMask) {
        read_attn_mask =
            ((sm90::ld_shared_b32(smem.mask_reads(stage)) >> (wg_key0 / 64)) & 1u) != 0u;
      }
      if (variants.mask.has_score_mod() || mask_elements) {
        scale_log2 = bwd_sm90_variant_scores<kBlockM, kHasAttnMask>(
            s, variants, query_base, n0 + key_row, softcapped, mask_elements,
            read_attn_mask && staged_mask == 0);
        if constexpr (kHasAttnMask && !Traits::kSplitHeadDim) {
          if (staged_mask != 0) {
            bwd_sm90_add_staged_attn_mask<kBlockM, kBlockN * 128>(
                s, staged_mask, variants.mask.bias_type, 1.4426950408889634f / scale_log2, lane);
          }
        }
      }
    }
    const bool needs_mask = kIsCausal && n0 + kBlockN - 1 > m_block * kBlockM + seq.causal_offset;
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      float lse_log2[2];
      row_stat_pair(lse_row_stat, lse_pre, j, lse_log2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[j][e] * scale_log2 - lse_log2[e % 2]);
        if (needs_mask &&
            n0 + key_row + 8 * (e / 2) > query_base + 8 * j + e % 2 + seq.causal_offset) {
          p = 0.f;
        }
        s[j][e] = p;
      }
    }
  }
};

}  // namespace cuda
}  // namespace flash_attn_ext
