// Host-side launcher of one forward configuration. Included by the generated
// instantiations/fwd_<dtype>_hdim<D>_<causal|full>.cu files, each of which
// instantiates run_fwd_impl once (so configurations compile in parallel), and
// fwd_var_<dtype>_hdim<D>.cu (run_fwd_variants_impl).
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../../params.h"
#include "fwd_kernel.cuh"
#include "fwd_kernel_traits.cuh"
#include "fwd_launch.h"
#include "fwd_merge.cuh"

namespace flash_attn_ext {
namespace cuda {

inline void fwd_check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// Launches one traits configuration: the main kernel, then the combine kernel
// when split-KV is on, unless the splits merge inside a thread-block cluster
// (kMayClusterMerge: the configurations that instantiate that variant).
// kHasVariants: the window / softcap / ALiBi kernel (one per tile: kVarSeq
// covers padded batches too, causal is the window's right bound).
// kKVCache: the kernels reading K/V through the KV cache addressing
// (run_fwd_kvcache_impl; always kVarSeq, never with an attn_mask).
template <typename Traits, bool kIsCausal, bool kMayClusterMerge = false,
          bool kHasVariants = false, bool kKVCache = false>
void launch_fwd(const AttentionFwdParams& params, cudaStream_t stream) {
  const int num_splits = params.num_splits > 1 ? params.num_splits : 1;
  const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t grid_x = num_m_blocks * params.batch * params.heads;
  if (grid_x > 0x7fffffff) {
    throw std::runtime_error("flash_attn_ext: batch * heads * ceil(seqlen_q / " +
                             std::to_string(Traits::kBlockM) + ") = " + std::to_string(grid_x) +
                             " exceeds the CUDA grid limit");
  }
  AttentionFwdParams launch_params = params;
  launch_params.num_splits = num_splits;
  const dim3 grid(static_cast<unsigned>(grid_x), num_splits);
  constexpr int kSmemBytes = Traits::kSmemBytes;
  auto allow_smem = [](auto kernel) {
    if (kSmemBytes > 48 * 1024) {
      fwd_check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kSmemBytes),
                     "cudaFuncSetAttribute(forward kernel shared memory)");
    }
  };

  if constexpr (kMayClusterMerge) {
    if (num_splits > 1 && fwd_merges_splits_in_cluster(params, num_splits)) {
      auto kernel = [&] {
        if constexpr (kKVCache) {
          return flash_fwd_kernel<Traits, kIsCausal, true, true, false, false, true>;
        } else {
          return has_var_seqs(params) ? flash_fwd_kernel<Traits, kIsCausal, true, true>
                                      : flash_fwd_kernel<Traits, kIsCausal, false, true>;
        }
      }();
      allow_smem(kernel);
      cudaLaunchAttribute cluster;
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 1;
      cluster.val.clusterDim.y = static_cast<unsigned>(num_splits);  // one query tile's splits
      cluster.val.clusterDim.z = 1;
      cudaLaunchConfig_t config = {};
      config.gridDim = grid;
      config.blockDim = dim3(Traits::kNThreads);
      config.dynamicSmemBytes = kSmemBytes;
      config.stream = stream;
      config.attrs = &cluster;
      config.numAttrs = 1;
      fwd_check_cuda(cudaLaunchKernelEx(&config, kernel, launch_params),
                     "forward kernel launch (split-KV cluster merge)");
      return;
    }
  }

  // Varlen / seqused_k calls get their own instantiation (see seq_bounds).
  if constexpr (kKVCache) {
    auto kernel = flash_fwd_kernel<Traits, kIsCausal, true, false, kHasVariants, false, true>;
    allow_smem(kernel);
    kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(launch_params);
  } else if constexpr (kHasVariants) {  // with an attn_mask: a kernel of its own (fwd_softmax.cuh)
    auto kernel = params.attn_bias != nullptr ? flash_fwd_kernel<Traits, false, true, false, true, true>
                                              : flash_fwd_kernel<Traits, false, true, false, true>;
    allow_smem(kernel);
    kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(launch_params);
  } else {
    auto kernel = has_var_seqs(params) ? flash_fwd_kernel<Traits, kIsCausal, true>
                                       : flash_fwd_kernel<Traits, kIsCausal, false>;
    allow_smem(kernel);
    kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(launch_params);
  }
  fwd_check_cuda(cudaGetLastError(), "forward kernel launch");

  if (num_splits > 1) {
    const int warps_per_row = combine_warps_per_row(num_splits);
    const int64_t rows_per_block = kCombineWarps / warps_per_row;
    const int64_t blocks = (params.q_rows_total + rows_per_block - 1) / rows_per_block;
    if (blocks > 0x7fffffff) {
      throw std::runtime_error("flash_attn_ext: split-KV combine grid exceeds the CUDA limit");
    }
    flash_fwd_combine_kernel<typename Traits::T, Traits::kHeadDim>
        <<<static_cast<unsigned>(blocks), kCombineWarps * 32, 0, stream>>>(launch_params,
                                                                           warps_per_row);
    fwd_check_cuda(cudaGetLastError(), "split-KV combine kernel launch");
  }
}

// What every forward launcher checks of its params first.
template <int kHeadDim>
void check_fwd_launch(const AttentionFwdParams& params) {
  if (params.head_dim > kHeadDim || params.head_dim % 8 != 0) {
    throw std::runtime_error("flash_attn_ext: internal error: head_dim " +
                             std::to_string(params.head_dim) + " dispatched to kernel head dim " +
                             std::to_string(kHeadDim));
  }
  if (params.num_splits > 1 && !fwd_merges_splits_in_cluster(params, params.num_splits) &&
      (params.out_accum == nullptr || params.lse_accum == nullptr)) {
    throw std::runtime_error(
        "flash_attn_ext: internal error: split-KV forward without a workspace "
        "(call fwd_set_workspace)");
  }
  if (params.num_splits > 1 && params.cu_seqlens_q != nullptr) {
    throw std::runtime_error("flash_attn_ext: internal error: split-KV is not supported for varlen");
  }
  if (params.num_splits > 65535) {
    throw std::runtime_error("flash_attn_ext: num_splits " + std::to_string(params.num_splits) +
                             " exceeds the grid limit 65535");
  }
}

template <typename T, int kHeadDim, bool kIsCausal, bool kHasVariants>
void run_fwd_tiles(const AttentionFwdParams& params, cudaStream_t stream) {
  check_fwd_launch<kHeadDim>(params);
  if (fwd_runs_kvcache_kernels(params)) {
    throw std::runtime_error("flash_attn_ext: internal error: a KV cache call reached the "
                             "kernels without cache addressing (run_fwd_kvcache_impl)");
  }
  // The split count was chosen (fwd_num_splits) for the same tile as here.
  // Variant calls never merge splits in a cluster (fwd_merges_splits_in_cluster).
  constexpr bool kMayClusterMerge = !kHasVariants;
  if (fwd_uses_key_warp_tile(params)) {
    launch_fwd<typename FwdTileConfigDecode<kHeadDim, kFwdDecodeKeyWarps>::template Traits<T>,
               kIsCausal, kMayClusterMerge, kHasVariants>(params, stream);
  } else if (fwd_uses_decode_tile(params)) {
    launch_fwd<typename FwdTileConfigDecode<kHeadDim>::template Traits<T>, kIsCausal,
               kMayClusterMerge, kHasVariants>(params, stream);
  } else {
    launch_fwd<typename FwdTileConfig<kHeadDim, kIsCausal>::template Traits<T>, kIsCausal,
               /*kMayClusterMerge=*/false, kHasVariants>(params, stream);
  }
}

template <typename T, int kHeadDim, bool kIsCausal>
void run_fwd_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  run_fwd_tiles<T, kHeadDim, kIsCausal, /*kHasVariants=*/false>(params, stream);
}

// Window / softcap / ALiBi calls (has_variants), causal or not: the tiles of
// the non-causal configuration with the variant kernels.
template <typename T, int kHeadDim>
void run_fwd_variants_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  run_fwd_tiles<T, kHeadDim, /*kIsCausal=*/false, /*kHasVariants=*/true>(params, stream);
}

// KV cache addressing (has_kv_cache_addressing): the decode tiles only
// (fwd_choose_tile sends every such call there, any seqlen_q), as the plain
// non-causal kernel (split clusters allowed) or, for masks and score
// modifiers (fwd_kvcache_uses_variant_kernel: causal included), the variant
// kernel: 6 kernels per (dtype, head dim) in instantiations/fwd_kv_*.cu.
// kKVFp8: an FP8 (e4m3) cache (run_fwd_kvcache_fp8_impl), the same 6 kernels
// on FP8 tiles.
template <typename T, int kHeadDim, bool kKVFp8>
void run_fwd_kvcache_tiles(const AttentionFwdParams& params, cudaStream_t stream) {
  check_fwd_launch<kHeadDim>(params);
  if (!fwd_uses_decode_tile(params)) {
    throw std::runtime_error("flash_attn_ext: internal error: KV cache addressing runs the "
                             "decode tiles only (fwd_choose_tile)");
  }
  if ((params.kv_dtype == DType::kFloat8E4M3) != kKVFp8) {
    throw std::runtime_error("flash_attn_ext: internal error: the K/V dtype does not match the "
                             "KV cache kernel (run_fwd_kvcache_fp8_impl for an FP8 cache)");
  }
  using OneWarp = typename FwdTileConfigDecode<kHeadDim>::template Traits<T, kKVFp8>;
  using KeyWarps =
      typename FwdTileConfigDecode<kHeadDim, kFwdDecodeKeyWarps>::template Traits<T, kKVFp8>;
  const bool variants = fwd_kvcache_uses_variant_kernel(params);
  if (fwd_uses_key_warp_tile(params)) {
    if (variants) {
      launch_fwd<KeyWarps, false, false, true, true>(params, stream);
    } else {
      launch_fwd<KeyWarps, false, true, false, true>(params, stream);
    }
  } else if (variants) {
    launch_fwd<OneWarp, false, false, true, true>(params, stream);
  } else {
    launch_fwd<OneWarp, false, true, false, true>(params, stream);
  }
}

template <typename T, int kHeadDim>
void run_fwd_kvcache_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  run_fwd_kvcache_tiles<T, kHeadDim, /*kKVFp8=*/false>(params, stream);
}

// An FP8 (e4m3) KV cache under a 16-bit q (params.kv_dtype; with or without
// cache addressing): instantiations/fwd_kvfp8_*.cu.
template <typename T, int kHeadDim>
void run_fwd_kvcache_fp8_impl(const AttentionFwdParams& params, cudaStream_t stream) {
  run_fwd_kvcache_tiles<T, kHeadDim, /*kKVFp8=*/true>(params, stream);
}

}  // namespace cuda
}  // namespace flash_attn_ext
