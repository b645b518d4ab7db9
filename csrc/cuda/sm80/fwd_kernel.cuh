// FlashAttention-2 style forward kernel (sm_80+ mma.sync): flash_fwd_kernel,
// the file the launchers (fwd_launch_template.cuh) include. Its parts, by
// concern:
//   fwd_tile_load.cuh  global -> shared cp.async tiles: strided, through the KV
//                      cache addressing, FP8 staging tiles
//   fwd_mma.cuh        Q K^T and P V on mma fragments (16-bit, packed P with
//                      dropout, FP8 K / V)
//   fwd_pipeline.cuh   FwdThread, KVTileLoader (the K/V stage ring), fwd_prologue
//   fwd_epilogue.cuh   store_output, store_split_partials
//   fwd_merge.cuh      merging key-warp and split-KV partials, the combine kernel
//   ../common/fwd_softmax.cuh  key-tile range, masks, online softmax
// The main loop stays inline in the kernel (see there).
//
// One CTA computes one kBlockM-row query tile of one (batch, head) against a
// contiguous range of key tiles (all of them unless split-KV is on):
//
//   prologue   cp.async Q and the first kStages-1 K/V tiles into shared memory
//              (Q -> registers when Traits::kQInRegs)
//   main loop  for each key tile n:
//                wait K_n; prefetch K/V tile n+kStages-1
//                S = Q K_n^T                       (fp32, in registers)
//                scale to log2 domain, mask        (only on boundary tiles)
//                online softmax: P = exp2(S - m), rescale O and row sums
//                (variants: P -> 16 bits; dropout clears dropped elements)
//                wait V_n;  O += P V_n             (P straight from registers)
//   epilogue   O /= row_sum, lse = m*ln2 + ln(row_sum);  (dropout: O *= scale)
//              O -> shared memory -> 16-byte global stores (or fp32 partials
//              to out_accum / lse_accum when split-KV is on)
#pragma once
#include <cmath>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"
#include "fwd_merge.cuh"
#include "../common/dropout_tile.cuh"
#include "../common/fwd_softmax.cuh"
#include "fwd_tile_load.cuh"
#include "fwd_mma.cuh"
#include "fwd_pipeline.cuh"
#include "fwd_epilogue.cuh"

namespace flash_attn_ext {
namespace cuda {

// ---------------------------------------------------------------------------
// Main kernel. Grid: x = m-tile + num_m_blocks * (batch*heads + head), y = KV split.
// kHasVariants: window / softcap / ALiBi / attn_mask (csrc/mask.h, ScoreVariants)
// and dropout (csrc/dropout.h, common/dropout_tile.cuh), instead of the
// causal-only mask (instantiated with kIsCausal = false, kVarSeq = true:
// causal is the window's right bound 0; see run_fwd_variants_impl).
// kKVCache: K/V through the KV cache addressing (block table, cache_batch_idx,
// left padding; KVTileLoader), instantiated for the decode tiles only
// (run_fwd_kvcache_impl), so the other kernels compile as without it.
// Traits::kKVFp8 (with kKVCache; run_fwd_kvcache_fp8_impl): an FP8 KV cache,
// staged and read into 16-bit fragments (gemm_qk_fp8, pv_step_fp8), k_descale
// folded into the softmax scale and v_descale into the epilogue.
// ---------------------------------------------------------------------------
template <typename Traits, bool kIsCausal, bool kVarSeq, bool kClusterMerge = false,
          bool kHasVariants = false, bool kAttnMask = false, bool kKVCache = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel(const __grid_constant__ AttentionFwdParams params) {
  static_assert(!kKVCache || kVarSeq, "KV cache addressing reads per-sequence bounds");
  static_assert(!Traits::kKVFp8 || kKVCache, "FP8 K/V: the KV cache kernels only");
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMmaM = Traits::kMmaM;
  constexpr int kStages = Traits::kStages;
  using KVLayout = typename Traits::KVLayout;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem_q = reinterpret_cast<T*>(smem_raw);
  T* smem_k = smem_q + Traits::kSmemQElems;                     // kKVSlots K tiles
  T* smem_v = smem_k + Traits::kKVSlots * Traits::kSmemKVElems;  // kKVSlots V tiles
  const FwdThread<Traits> th;

  // ---- which tile ----------------------------------------------------------
  const int num_m_blocks = ceil_div_dev(params.seqlen_q, kBlockM);
  const int bh = blockIdx.x / num_m_blocks;
  int m_block = blockIdx.x % num_m_blocks;
  // Causal tiles further down see more keys; start those first so the short
  // ones fill the tail of the wave (the x order keeps a head's tiles adjacent
  // for L2 reuse of its K/V).
  if (kIsCausal || (kHasVariants && params.causal)) m_block = num_m_blocks - 1 - m_block;
  const int batch = bh / params.heads;
  const int head = bh % params.heads;
  const int head_k = head / (params.heads / params.heads_k);
  const int split = blockIdx.y;
  const int num_splits = gridDim.y;
  // This sequence's lengths / first rows / causal offset (varlen, seqused_k).
  const SeqBounds seq = seq_bounds<kVarSeq, kKVCache>(params, batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // varlen: past this sequence (CTA-uniform)

  ScoreVariants variants;
  if constexpr (kHasVariants) variants = ScoreVariants::make(params, seq, batch, head);
  // FP8 K: real K = k_descale(batch, kv head) x stored, a factor of the scores
  // folded into the softmax scale (and fp8_prepare_q's factor of q, below).
  float kv_scale_log2 = 0.f;  // kKVFp8: the scale of this CTA's scores
  if constexpr (Traits::kKVFp8) {
    const float k_factor = descale_at(params.k_descale, batch, head_k);
    kv_scale_log2 = params.scale_log2 * k_factor;
    if constexpr (kHasVariants) {
      variants.scale_log2 *= k_factor;
      variants.softcap_in *= k_factor;
    }
  }
  const KeyTileRange range =
      kHasVariants ? key_tile_range_variants<kBlockM, kBlockN>(seq, variants.mask, m_block, split,
                                                                num_splits)
                   : key_tile_range<kBlockM, kBlockN, kIsCausal>(seq, m_block, split, num_splits);
  const int n_tiles = range.end - range.begin;

  const int64_t row_stride_k = params.k_strides.row;
  const int64_t row_stride_v = params.v_strides.row;
  const T* q_tile = static_cast<const T*>(params.q) + batch * params.q_strides.batch +
                    head * params.q_strides.head +
                    (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.q_strides.row;
  const T* k_head = nullptr;  // kKVCache: rows through kv_row instead
  const T* v_head = nullptr;
  if constexpr (!kKVCache) {
    k_head = static_cast<const T*>(params.k) + batch * params.k_strides.batch +
             head_k * params.k_strides.head + seq.row0_k * row_stride_k;
    v_head = static_cast<const T*>(params.v) + batch * params.v_strides.batch +
             head_k * params.v_strides.head + seq.row0_k * row_stride_v;
  }
  const KVTileLoader<Traits, kKVCache> kv{params,       smem_k,       smem_v,       k_head,
                                          v_head,       row_stride_k, row_stride_v, range.begin,
                                          seq.seqlen_k, th.tid,       batch,        head_k,
                                          seq.row0_k};

  float acc_o[kMmaM][Traits::kTilesD][4];
#pragma unroll
  for (int m = 0; m < kMmaM; ++m)
#pragma unroll
    for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_o[m][d][r] = 0.f;
  OnlineSoftmax<kMmaM> softmax;

  if (n_tiles > 0) {  // CTA-uniform; an empty range writes O = 0, lse = -inf
    QFragments<Traits> q_frags;
    fwd_prologue<Traits>(q_frags, kv, smem_q, q_tile, params.q_strides.row,
                         seq.seqlen_q - m_block * kBlockM, params.head_dim, n_tiles, th);
    float q_mult = 1.f;  // kKVFp8: q's factor in the fp16 MMAs
    if constexpr (Traits::kKVFp8) {
      q_mult = fp8_prepare_q<Traits>(q_frags, smem_q, th.warp_row0, th.lane);
      const float q_unscale = 1.f / q_mult;  // a power of two: exact
      kv_scale_log2 *= q_unscale;
      if constexpr (kHasVariants) {
        variants.scale_log2 *= q_unscale;
        variants.softcap_in *= q_unscale;
      }
    }

    // ---- main loop over key tiles --------------------------------------------
    // (Inline here: as a device function it cost the D=192 causal varlen kernel
    // 40 more bytes of spills, same PTX up to register numbering.)
    const int row_base = m_block * kBlockM + th.warp_row0 + th.g;  // lane's first global row
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int n_block = range.begin + tile;
      const int slot = tile % kStages;
      // The warp's key slice: whole rows, so the swizzle (row % 8) is unchanged.
      // (kKVFp8: the staging tiles of slot `slot`.)
      const int slice = slot * Traits::kSmemKVElems + th.warp_key0 * KVLayout::kRowStride;
      const T* smem_k_tile = smem_k + slice;
      const T* smem_v_tile = smem_v + slice;
      const int stage_slice = fp8_stage_offset<Traits>(th.warp_key0, 0);
      const uint8_t* stage_k_tile = kv.stage(slot, 0) + stage_slice;
      const uint8_t* stage_v_tile = kv.stage(slot, 1) + stage_slice;

      // Groups newer than K_tile: V_tile and 2 per tile tile+1 .. tile+kStages-2.
      cp_async_wait<2 * kStages - 3>();
      // K_tile is visible to all threads, and every warp has finished tile-1,
      // so its slot ((tile-1) % kStages) can be refilled.
      __syncthreads();
      const int prefetch = tile + kStages - 1;
      if (prefetch < n_tiles) {
        kv.load_tile(prefetch, prefetch % kStages);
      } else {
        kv.commit_empty();
      }

      float acc_s[kMmaM][Traits::kTilesN][4];
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int j = 0; j < Traits::kTilesN; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_s[m][j][r] = 0.f;
      if constexpr (Traits::kKVFp8) {
        gemm_qk_fp8<Traits>(acc_s, q_frags, smem_q, q_mult, stage_k_tile, th.warp_row0,
                            th.lane);
      } else {
        gemm_qk<Traits>(acc_s, q_frags, smem_q, smem_k_tile, th.warp_row0, th.lane);
      }

      const int col_base = n_block * kBlockN + th.warp_key0 + 2 * th.q;
      if constexpr (kHasVariants) {
        score_and_mask_variants<kAttnMask, /*kFold=*/false>(acc_s, variants, row_base, col_base,
                                                            /*mask_elements=*/true);
      } else if (key_tile_needs_mask<kBlockM, kBlockN, kIsCausal>(seq, m_block, n_block)) {
        scale_and_mask<true, kIsCausal>(acc_s,
                                        Traits::kKVFp8 ? kv_scale_log2 : params.scale_log2,
                                        row_base, col_base, seq.seqlen_k, seq.causal_offset);
      } else {
        scale_and_mask<false, kIsCausal>(acc_s,
                                         Traits::kKVFp8 ? kv_scale_log2 : params.scale_log2,
                                         row_base, col_base, seq.seqlen_k, seq.causal_offset);
      }
      softmax.update(acc_s, acc_o);
      PFragments<Traits> p16;  // variants: P, 16-bit (gemm_pv_packed)
      if constexpr (kHasVariants) {
        pack_p<Traits>(p16, acc_s);
        // Dropout: the dropped elements of P cleared for the P V product (the
        // row sums above, and so lse, are of the undropped P; the scale comes
        // in the epilogue). Keys are numbered within the sequence (col_base),
        // so split-KV and the key-warp decode tile draw the same mask. Built
        // per tile: its seed and offset would otherwise hold registers across
        // the whole loop.
        const Dropout dropout = make_dropout(params, batch, head);
        if (dropout.active()) {  // uniform
          dropout_packed_p<Traits>(p16, dropout, row_base, col_base);
        }
      }

      // Groups newer than V_tile: 2 per tile tile+1 .. tile+kStages-1.
      cp_async_wait<2 * kStages - 2>();
      __syncthreads();  // V_tile visible to all threads
      if constexpr (Traits::kKVFp8 && kHasVariants) {
        gemm_pv_packed_fp8<Traits>(acc_o, p16, stage_v_tile, th.lane);
      } else if constexpr (Traits::kKVFp8) {
        gemm_pv_fp8<Traits>(acc_o, acc_s, stage_v_tile, th.lane);
      } else if constexpr (kHasVariants) {
        gemm_pv_packed<Traits>(acc_o, p16, smem_v_tile, th.lane);
      } else {
        gemm_pv<Traits>(acc_o, acc_s, smem_v_tile, th.lane);
      }
    }
    cp_async_wait<0>();  // only empty groups remain; keeps the smem reuse below obviously safe
  }
  if constexpr (Traits::kKVFp8) unpermute_o_fp8<Traits>(acc_o, th.lane);

  // ---- epilogue: normalise, merge key warps / splits, store ------------------
  float lse[kMmaM][2];
  // A learnable sink joins one partial of the row: split 0's key warp 0.
  softmax.finalize(acc_o, lse,
                   split == 0 && th.warp_key0 == 0 ? sink_log2_of(params, head) : -INFINITY);
  if constexpr (Traits::kKVFp8) {
    // FP8 V: O = v_descale(batch, kv head) x P V (the merges of
    // key warps and splits are linear in O; every split has the same factor).
    const float v_factor = descale_at(params.v_descale, batch, head_k);
#pragma unroll
    for (int m = 0; m < kMmaM; ++m)
#pragma unroll
      for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_o[m][d][r] *= v_factor;
  }
  if constexpr (kHasVariants) {
    // Dropout's scale of the kept probabilities (dropout_packed_p), on the
    // normalised O: the key-warp and split-KV merges are linear in O.
    if (params.dropout_threshold > 0) {
      const float scale = params.dropout_scale;
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_o[m][d][r] *= scale;
    }
  }
  const bool holds_output = merge_key_warps<Traits>(acc_o, lse, smem_raw, th.warp, th.lane);

  const int row_in_head0 = m_block * kBlockM + th.warp_row0;  // sequence row of warp row 0

  if constexpr (kClusterMerge) {
    T* out_tile = static_cast<T*>(params.out) + batch * params.out_strides.batch +
                  head * params.out_strides.head +
                  (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.out_strides.row;
    float* lse_tile = params.lse + seq.lse_index(params, batch, head, m_block * kBlockM);
    merge_splits_in_cluster<Traits>(acc_o, lse, holds_output, smem_raw, th.warp_row0,
                                    min(kBlockM, seq.seqlen_q - m_block * kBlockM),
                                    params.head_dim, out_tile, params.out_strides.row, lse_tile);
    return;
  }
  if (!holds_output) return;  // the key warps' results are merged into warp 0's
  if (num_splits == 1) {
    store_output<Traits>(acc_o, lse, smem_q, params, seq, batch, head, row_in_head0, th);
  } else {
    store_split_partials<Traits>(acc_o, lse, params, seq, batch, head, split, row_in_head0, th);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
