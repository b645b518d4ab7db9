// Host-side launcher of one Hopper forward configuration, included by the
// generated instantiations/fwd_sm90_<dtype>_hdim<D>_<causal|full>.cu files.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common/compact_tiles.cuh"
#include "fwd_sm90.h"
#include "fwd_sm90_kernel.cuh"

namespace flash_attn_ext {
namespace cuda {

// One traits configuration: tensor maps, then the kernel.
template <typename Traits, bool kIsCausal, bool kHasVariants>
void launch_fwd_sm90(const AttentionFwdParams& params, cudaStream_t stream) {
  using T = typename Traits::T;
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  // A query tile (Traits::kBlockM rows) is one 64-row Q slice per consumer
  // warpgroup (see FwdSm90Traits).
  // Varlen (fwd_sm90_takes_seqs): packed tensors are one batch entry of all
  // their rows (the kernel starts each sequence's tiles at its first row);
  // FP8's V^T is padded per sequence. Packed sequences and seqused_k take the
  // kVarSeq kernel (var_seqs).
  // A paged cache's maps address its pool (boxes of a page piece) and
  // cache_batch_idx's the cache's batch entries (fwd_sm90_kv_map_shape).
  const bool packed = params.cu_seqlens_q != nullptr;
  const bool var_seqs = has_var_seqs(params);
  const int rows_q = packed ? static_cast<int>(params.total_q) : params.seqlen_q;
  const int map_batch = packed ? 1 : params.batch;
  const KVMapShape kv_shape = fwd_sm90_kv_map_shape(params);
  const int rows_k = static_cast<int>(kv_shape.rows);
  const int kv_batch = static_cast<int>(kv_shape.batch);
  const int kv_box_rows = params.block_table != nullptr
                              ? fwd_sm90_paged_box_rows(params.page_size, Traits::kBlockN)
                              : Traits::kBlockN;
  CUtensorMap tmap_q, tmap_k, tmap_v;
  if constexpr (Traits::kFp8) {
    tmap_q = make_attention_tensor_map_e4m3(params.q, params.head_dim, rows_q, params.heads,
                                            map_batch, params.q_strides, Traits::kQSliceRows);
    tmap_k = make_attention_tensor_map_e4m3(params.k, params.head_dim, rows_k, params.heads_k,
                                            map_batch, params.k_strides, Traits::kBlockN);
    if (Traits::kVtInKernel) {  // V as it is: the kernel transposes it
      tmap_v = make_attention_tensor_map_e4m3(params.v, params.head_dim, rows_k, params.heads_k,
                                              map_batch, params.v_strides, Traits::kBlockN);
    } else {
      tmap_v = make_transposed_v_tensor_map_e4m3(params.v_transposed, params.head_dim,
                                                 params.v_transposed_seqlen, params.heads_k,
                                                 params.batch, Traits::kHeadDim,
                                                 Traits::kVtChunkKeys);
    }
  } else {
    tmap_q = make_attention_tensor_map(params.q, kBf16, params.head_dim, rows_q, params.heads,
                                       map_batch, params.q_strides, Traits::kQSliceRows);
    tmap_k = make_attention_tensor_map(params.k, kBf16, params.head_dim, rows_k, params.heads_k,
                                       kv_batch, params.k_strides, kv_box_rows);
    tmap_v = make_attention_tensor_map(params.v, kBf16, params.head_dim_v, rows_k, params.heads_k,
                                       kv_batch, params.v_strides, kv_box_rows);
  }

  // Calls with an attn_mask run a variant kernel of their own (fwd_softmax.cuh);
  // each variant kernel comes with and without the dropout code (the attn_mask
  // one without it: 1.3% faster on a [1, H, S, S] bias, H100, D = 128).
  auto kernel = flash_fwd_sm90_kernel<Traits, kIsCausal, kHasVariants, false>;
  if constexpr (!Traits::kVtInKernel) {  // (never with var_seqs: fwd_fp8_transposes_v)
    if (var_seqs) kernel = flash_fwd_sm90_kernel<Traits, kIsCausal, kHasVariants, false, false, true>;
  }
  if constexpr (kHasVariants) {
    if (params.attn_bias != nullptr) {  // (never packed)
      kernel = has_dropout(params) ? flash_fwd_sm90_kernel<Traits, kIsCausal, true, true, true>
                                   : flash_fwd_sm90_kernel<Traits, kIsCausal, true, true, false>;
    } else if (has_dropout(params)) {
      kernel = var_seqs ? flash_fwd_sm90_kernel<Traits, kIsCausal, true, false, true, true>
                        : flash_fwd_sm90_kernel<Traits, kIsCausal, true, false, true>;
    }
  }
  const int smem_bytes =
      kHasVariants && params.attn_bias != nullptr ? Traits::kSmemBytesAttnMask : Traits::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem_bytes);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: cudaFuncSetAttribute(Hopper forward): ") +
                             cudaGetErrorString(err));
  }
  // A packed batch's compact tile list (params.h compact_tiles), in the room
  // the workspace has for 64-row tiles (compact_tiles_capacity: its entries):
  // one entry per (head, query tile), compact_capacity tiles per head.
  const bool compact = packed && params.compact_tiles != nullptr;
  const int64_t compact_capacity =
      compact ? compact_tiles_capacity(params.total_q, params.batch, Traits::kBlockM) : 0;
  if (compact_capacity * params.heads > params.compact_tiles_capacity) {
    throw std::runtime_error("flash_attn_ext: internal error: the Hopper forward's tile list "
                             "does not fit its workspace");
  }
  const int64_t num_tiles =
      compact ? compact_capacity * params.heads
              : static_cast<int64_t>((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM) *
                    params.heads * params.batch;
  if (num_tiles == 0) return;
  if (num_tiles > 0x7fffffff) {
    throw std::runtime_error("flash_attn_ext: too many query tiles for the Hopper forward");
  }
  // Persistent grid, one CTA per SM. Non-causal tiles are equal: CTA c takes
  // tiles c, c + grid, ... (static round-robin). Causal tiles differ in cost
  // (up to kBlockN-fold): a static round-robin over them measured 0.56-0.76x
  // cuDNN against 0.71-0.93x for one CTA per tile (e.g. with 4 query tiles per
  // head and 132 SMs every CTA got the same m_block over and over), so each
  // CTA claims its next causal tile from an atomic counter (dynamic
  // scheduler), which balances like the hardware and, being persistent, still
  // loads the next tile under this one. Without the counter's workspace (not
  // expected: fwd_workspace_floats asks for it) causal tiles go round-robin.
  // Variant tiles (causal, windows) and sequences of different lengths
  // (packed, seqused_k) differ alike.
  int* tile_counter = kIsCausal || kHasVariants || var_seqs ? params.tile_counter : nullptr;
  AttentionFwdParams kernel_params = params;
  if (compact) {
    // One launch lists the tiles and zeroes the counter (the kernel needs both).
    if (tile_counter == nullptr) {
      throw std::runtime_error("flash_attn_ext: internal error: a compact tile list without the "
                               "Hopper forward's tile counter");
    }
    kernel_params.compact_tiles_capacity = static_cast<int>(compact_capacity);  // per head
    compact_query_tiles_kernel<Traits::kBlockM><<<params.batch, 256, 0, stream>>>(kernel_params);
    err = cudaGetLastError();
  } else if (tile_counter != nullptr) {
    err = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream);
  }
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: Hopper forward tile counter: ") +
                             cudaGetErrorString(err));
  }
  // A boolean attn_mask's block summary, at this kernel's key tiles.
  if (kHasVariants) compute_attn_mask_blocks(kernel_params, Traits::kBlockN, stream);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(num_tiles, device_sm_count())));
  kernel<<<grid, Traits::kNThreads, smem_bytes, stream>>>(tmap_q, tmap_k, tmap_v, kernel_params,
                                                          tile_counter);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: Hopper forward kernel launch: ") +
                             cudaGetErrorString(err));
  }
}

// One key tile size and consumer warpgroup count. Config: the tile
// configuration (FwdSm90TileConfig); with fewer warpgroups than it has, one
// Q slot per warpgroup.
template <typename T, int kHeadDim, bool kIsCausal, bool kHasVariants, typename Config, int kBlockN,
          int kWarpgroups = Config::kConsumerWarpgroups, int kHeadDimV = kHeadDim>
void launch_fwd_sm90_block_n(const AttentionFwdParams& params, cudaStream_t stream) {
  constexpr int kQRing = kWarpgroups == Config::kConsumerWarpgroups ? Config::kQRing : kWarpgroups;
  launch_fwd_sm90<
      FwdSm90Traits<T, kHeadDim, kBlockN, Config::kStages, kQRing, T, kWarpgroups, kHeadDimV>,
      kIsCausal, kHasVariants>(params, stream);
}

// kHeadDimV: v's head dim where it is not q's (MLA): exactly these dims.
template <typename T, int kHeadDim, bool kIsCausal, bool kHasVariants, typename Config,
          int kHeadDimV = kHeadDim>
void run_fwd_sm90_config(const AttentionFwdParams& params, cudaStream_t stream) {
  const bool dims_ok = kHeadDimV == kHeadDim
                           ? params.head_dim <= kHeadDim && params.head_dim_v == params.head_dim
                           : params.head_dim == kHeadDim && params.head_dim_v == kHeadDimV;
  if (!dims_ok || params.num_splits > 1 || !fwd_sm90_takes_seqs(params) ||
      has_variants(params) != kHasVariants) {
    throw std::runtime_error("flash_attn_ext: internal error: unsupported params reached the "
                             "Hopper forward");
  }
  if constexpr (Config::kShortCausalRows > 0) {
    if (params.seqlen_q <= Config::kShortCausalRows) {  // (varlen: the longest sequence)
      launch_fwd_sm90_block_n<T, kHeadDim, kIsCausal, kHasVariants, Config, Config::kBlockN, 2,
                              kHeadDimV>(params, stream);
      return;
    }
  }
  if constexpr (Config::kBlockNShort > 0) {
    if (params.seqlen_k <= Config::kShortSeqlenK) {
      launch_fwd_sm90_block_n<T, kHeadDim, kIsCausal, kHasVariants, Config, Config::kBlockNShort,
                              Config::kConsumerWarpgroups, kHeadDimV>(params, stream);
      return;
    }
  }
  launch_fwd_sm90_block_n<T, kHeadDim, kIsCausal, kHasVariants, Config, Config::kBlockN,
                          Config::kConsumerWarpgroups, kHeadDimV>(params, stream);
}

template <typename T, int kHeadDim, bool kIsCausal, int kHeadDimV>
void run_fwd_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  run_fwd_sm90_config<T, kHeadDim, kIsCausal, false,
                      FwdSm90TileConfig<kHeadDim, kIsCausal, false, kHeadDimV>, kHeadDimV>(
      params, stream);
}

// FP8 (e4m3) q, k, v with V already transposed (params.v_transposed, see
// fp8_v_transpose.cu), out in TOut.
template <typename TOut, int kHeadDim, bool kIsCausal>
void run_fwd_fp8_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  using Config = FwdSm90Fp8TileConfig<kHeadDim>;
  // No V^T scratch: the call is one whose kernel transposes V itself
  // (fwd_fp8_transposes_v, which the op layer asked before allocating it).
  const bool vt_in_kernel = params.v_transposed == nullptr;
  if (params.head_dim > kHeadDim || params.num_splits > 1 || !fwd_sm90_takes_seqs(params) ||
      has_variants(params) || (vt_in_kernel && (!Config::kVtInKernel || has_var_seqs(params)))) {
    throw std::runtime_error("flash_attn_ext: internal error: unsupported params reached the "
                             "FP8 Hopper forward");
  }
  auto launch = [&](auto block_n, auto q_ring, auto vt_in_kernel_tag) {
    launch_fwd_sm90<FwdSm90Traits<__nv_fp8_e4m3, kHeadDim, decltype(block_n)::value,
                                  Config::kStages, decltype(q_ring)::value, TOut,
                                  Config::kConsumerWarpgroups, kHeadDim,
                                  decltype(vt_in_kernel_tag)::value>,
                    kIsCausal, false>(params, stream);
  };
  auto with_v = [&](auto block_n, auto q_ring) {
    if constexpr (Config::kVtInKernel) {
      if (vt_in_kernel) return launch(block_n, q_ring, std::true_type());
    }
    launch(block_n, q_ring, std::false_type());
  };
  using std::integral_constant;
  if constexpr (kIsCausal && Config::kShortCausalRows > 0) {
    if (params.seqlen_q <= Config::kShortCausalRows) {  // (varlen: the longest sequence)
      with_v(integral_constant<int, Config::kShortCausalBlockN>(), integral_constant<int, 2>());
      return;
    }
  }
  if constexpr (Config::kBlockNVtPass != Config::kBlockN) {
    if (!vt_in_kernel && (!kIsCausal || Config::kVtPassCausal)) {
      launch(integral_constant<int, Config::kBlockNVtPass>(),
             integral_constant<int, Config::kQRing>(), std::false_type());
      return;
    }
  }
  with_v(integral_constant<int, Config::kBlockN>(), integral_constant<int, Config::kQRing>());
}

// Window / softcap / ALiBi calls, causal or not (the Mask's right bound): the
// causal tile configuration (its smaller key tiles waste less where a window
// cuts them).
template <typename T, int kHeadDim>
void run_fwd_sm90_variants_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  run_fwd_sm90_config<T, kHeadDim, /*kIsCausal=*/false, /*kHasVariants=*/true,
                      FwdSm90TileConfig<kHeadDim, true, true>>(params, stream);
}

}  // namespace cuda
}  // namespace flash_attn_ext
