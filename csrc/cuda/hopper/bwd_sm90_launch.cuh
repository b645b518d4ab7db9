// Host-side launcher of one Hopper backward configuration, included by the
// generated instantiations/bwd_sm90_<dtype>_hdim<D>_<causal|full>.cu files
// (window / softcap / ALiBi / attn_mask / dropout: bwd_sm90_var_<dtype>_hdim<D>_mask.cu):
//   1. D = rowsum(dO o O), zeroed fp32 dQ accumulator, padded lse (log2) and D
//      rows (bwd_preprocess.cuh, shared with mma.sync),
//   2. the wgmma kernel: dK, dV, dQ sums   (bwd_sm90_kernel.cuh; dQ added into the
//      accumulator by bulk (flat, bwd_sm90_flat_dq) or TMA reduce-adds;
//      deterministic: in a fixed order; GQA: dK, dV summed over each kv
//      head's group, bwd_sm90_sums_gqa_groups),
//   3. dq = softmax_scale * dQ accumulator (bwd_preprocess.cuh; the flat one
//      un-permuted on the way).
// With the caller's accumulator (params.dq_accum_external) step 1 leaves it
// as it is and step 3 is skipped: the caller converts once after many calls.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common/bwd_preprocess.cuh"
#include "bwd_sm90.h"
#include "bwd_sm90_kernel.cuh"

namespace flash_attn_ext {
namespace cuda {

// kHeadDimV: v's head dim where it is not q's (MLA's 192 / 128): exactly these dims.
// kBlockM: the traits' queries per step where not the default (80: the
// 80-query steps of bwd_sm90_flat_dq_rows, whose calls are all flat).
template <typename T, int kHeadDim, bool kIsCausal, bool kHasVariants, int kHeadDimV = kHeadDim,
          int kBlockM = 0>
void run_bwd_sm90_kernels(const AttentionBwdParams& params, cudaStream_t stream) {
  using Traits = BwdSm90Traits<T, kHeadDim, kHeadDimV, kBlockM>;
  static_assert(Traits::kBlockN == bwd_sm90_block_n(kHeadDim), "bwd_sm90.h names the key tile");
  const bool dims_ok = kHeadDimV == kHeadDim
                           ? params.head_dim <= kHeadDim && params.head_dim_v == params.head_dim
                           : params.head_dim == kHeadDim && params.head_dim_v == kHeadDimV;
  if (!dims_ok || params.num_splits != 1 ||
      params.deterministic != (params.dq_semaphore != nullptr) ||
      has_variants(params) != kHasVariants) {
    throw std::runtime_error("flash_attn_ext: internal error: unsupported params reached the "
                             "Hopper backward");
  }
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  // Workspace rows have the kernel head dim as pitch (bwd_dispatch.cu: accum_dim).
  if (params.lse_log2_padded == nullptr) {
    throw std::runtime_error("flash_attn_ext: internal error: no row-statistics workspace for the "
                             "Hopper backward");
  }
  // The caller's accumulator (params.dq_accum_external) is added into as it
  // is: no zeroing here, no conversion at the end.
  const bool external = params.dq_accum_external;
  // The flat dQ accumulator (bwd_sm90.h): the workspace was sized for it.
  if (params.dq_accum_flat != bwd_sm90_flat_dq(params, kHeadDim) ||
      (params.dq_accum_flat && params.dq_flat_rows != Traits::kDqRows) ||
      (Traits::kDqTransposed && !params.dq_accum_flat)) {
    throw std::runtime_error("flash_attn_ext: internal error: the dQ accumulator's layout does "
                             "not match the Hopper backward's");
  }
  launch_bwd_preprocess<T>(params, kHeadDim, external ? 0 : 1, stream, /*padded_row_stats=*/true);

  // Packed (varlen) tensors are mapped as one batch entry of all their rows;
  // the kernel offsets each sequence's tiles by its first row.
  const bool packed = params.cu_seqlens_q != nullptr;
  const int rows_q = packed ? static_cast<int>(params.total_q) : params.seqlen_q;
  const int rows_k = packed ? static_cast<int>(params.total_k) : params.seqlen_k;
  const int map_batch = packed ? 1 : params.batch;
  auto map_of = [&](const void* base, const TensorStrides& strides, int rows, int heads,
                    int box_rows, int head_dim) {
    return make_attention_tensor_map(base, kBf16, head_dim, rows, heads, map_batch, strides,
                                     box_rows);
  };
  const CUtensorMap tmap_q =
      map_of(params.q, params.q_strides, rows_q, params.heads, Traits::kBlockM, params.head_dim);
  const CUtensorMap tmap_k =
      map_of(params.k, params.k_strides, rows_k, params.heads_k, Traits::kBlockN, params.head_dim);
  const CUtensorMap tmap_v = map_of(params.v, params.v_strides, rows_k, params.heads_k,
                                    Traits::kBlockN, params.head_dim_v);
  const CUtensorMap tmap_do = map_of(params.dout, params.dout_strides, rows_q, params.heads,
                                     Traits::kBlockM, params.head_dim_v);
  // The accumulator rows (params.h) as [batch * heads][seqlen_q] padded,
  // [heads][total_q] packed.
  const int slices = (packed ? 1 : params.batch) * params.heads;
  const CUtensorMap tmap_dq_accum =
      external ? make_dq_accum_tensor_map(params.dq_accum, params.head_dim, rows_q, slices,
                                          params.dq_accum_row_pitch, params.dq_accum_slice_pitch,
                                          Traits::kDqRows)
               : make_dq_accum_tensor_map(params.dq_accum, kHeadDim, rows_q, slices, kHeadDim,
                                          int64_t{rows_q} * kHeadDim, Traits::kDqRows);

  // One CTA per key tile. blockIdx.x = 0 holds the first keys, which under
  // causal masking see the most queries, so the longest CTAs start first;
  // deterministic and causal (or with variants), the kernel maps blockIdx.x
  // to the last tiles first (its dQ order needs that).
  const int n_tiles = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // (batch, key tile, head) where an attn_mask plane broadcasts over the batch
  // (attn_mask_grid_batch_first), else (key tile, head, batch). GQA: the head
  // is the kv head, whose CTAs walk its group's query heads (kWalkGroup).
  const bool walk_group = bwd_sm90_sums_gqa_groups(params);
  const int grid_heads = walk_group ? params.heads_k : params.heads;
  const bool batch_first = kHasVariants && attn_mask_grid_batch_first(params);
  const dim3 grid = batch_first ? dim3(params.batch, n_tiles, grid_heads)
                                : dim3(n_tiles, grid_heads, params.batch);
  AttentionBwdParams kernel_params = params;  // + the attn_mask summary's strides
  auto launch = [&](auto kernel) {
    bwd_check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Traits::kSmemBytes),
                   "shared-memory opt-in");
    kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, tmap_do,
                                                                    tmap_dq_accum, kernel_params);
    bwd_check_cuda(cudaGetLastError(), "Hopper kernel launch");
  };
  // Varlen and seqused_k read per-sequence bounds (and zero rows past them);
  // the padded batch keeps them in the constant bank.
  // Variants: attn_mask calls (padded batches, maybe seqused_k) take the
  // kernel that reads the mask. Calls with the flat dQ accumulator
  // (bwd_sm90.h bwd_sm90_flat_dq: plain calls of the key split, variant
  // calls at D = 128) take its kernels.
  auto launch_seqs = [&](auto var_tag, auto walk_tag) {
    constexpr bool kVar = decltype(var_tag)::value, kWalk = decltype(walk_tag)::value;
    // The flat kernels built: those bwd_sm90_flat_dq can choose.
    constexpr bool kHasFlatDq = !Traits::kSplitHeadDim && (!kHasVariants || kHeadDim == 128);
    auto launch_dq = [&](auto mask_tag) {
      constexpr bool kMask = decltype(mask_tag)::value;
      if constexpr (kHasFlatDq) {
        if (params.dq_accum_flat) {
          launch(flash_bwd_sm90_kernel<Traits, kIsCausal, kVar, kHasVariants, kMask, kWalk, true>);
          return;
        }
      }
      if constexpr (!Traits::kDqTransposed) {
        launch(flash_bwd_sm90_kernel<Traits, kIsCausal, kVar, kHasVariants, kMask, kWalk>);
      }
    };
    if constexpr (kHasVariants) {
      if (params.attn_bias != nullptr) {
        launch_dq(std::true_type{});
        return;
      }
    }
    launch_dq(std::false_type{});
  };
  auto launch_walk = [&](auto walk_tag) {
    if (has_var_seqs(params)) {
      launch_seqs(std::true_type{}, walk_tag);
    } else {
      launch_seqs(std::false_type{}, walk_tag);
    }
  };
  if (n_tiles > 0) {
    // A boolean attn_mask's block summary, per consumer's 64 keys.
    if (kHasVariants) compute_attn_mask_blocks(kernel_params, 64, stream);
    if (walk_group) {
      launch_walk(std::true_type{});
    } else {
      launch_walk(std::false_type{});
    }
  }
  if (!external) launch_bwd_convert_dq<T>(params, kHeadDim, 1, stream);
}

template <typename T, int kHeadDim, bool kIsCausal, int kHeadDimV>
void run_bwd_sm90_impl(const AttentionBwdParams& params, cudaStream_t stream) {
  if constexpr (kHeadDim == 128 && kHeadDimV == kHeadDim) {
    if (params.dq_accum_flat && params.dq_flat_rows == 80) {  // bwd_sm90_flat_dq_rows
      run_bwd_sm90_kernels<T, kHeadDim, kIsCausal, false, kHeadDimV, 80>(params, stream);
      return;
    }
  }
  run_bwd_sm90_kernels<T, kHeadDim, kIsCausal, /*kHasVariants=*/false, kHeadDimV>(params, stream);
}

// Window / softcap / ALiBi / attn_mask / dropout calls (has_variants), causal
// or not (the Mask's right bound).
template <typename T, int kHeadDim>
void run_bwd_sm90_variants_impl(const AttentionBwdParams& params, cudaStream_t stream) {
  run_bwd_sm90_kernels<T, kHeadDim, /*kIsCausal=*/false, /*kHasVariants=*/true>(params, stream);
}

}  // namespace cuda
}  // namespace flash_attn_ext
