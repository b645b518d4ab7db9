// Declarations shared by the forward dispatcher (../fwd_dispatch.cu) and the
// translation units that define them: the per-(dtype, head dim, causal)
// launchers live in ../instantiations/fwd_*.cu (via fwd_launch_template.cuh).
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"

namespace flash_attn_ext {
namespace cuda {

// T in {__half, __nv_bfloat16}; kHeadDim in {32, 64, ..., 256} (>= params.head_dim).
// Launches the main kernel, then the combine kernel when params.num_splits > 1.
template <typename T, int kHeadDim, bool kIsCausal>
void run_fwd_impl(const AttentionFwdParams& params, cudaStream_t stream);

// The same for calls with window / softcap / ALiBi (has_variants(params)),
// causal included: instantiations/fwd_var_*.cu.
template <typename T, int kHeadDim>
void run_fwd_variants_impl(const AttentionFwdParams& params, cudaStream_t stream);

// The same for calls with KV cache addressing (has_kv_cache_addressing: block
// table, cache_batch_idx, left padding), on the decode tiles:
// instantiations/fwd_kv_*.cu.
template <typename T, int kHeadDim>
void run_fwd_kvcache_impl(const AttentionFwdParams& params, cudaStream_t stream);

// The same kernels for an FP8 (e4m3) KV cache under a 16-bit q (params.kv_dtype
// == kFloat8E4M3, k_descale / v_descale), with or without cache addressing:
// instantiations/fwd_kvfp8_*.cu.
template <typename T, int kHeadDim>
void run_fwd_kvcache_fp8_impl(const AttentionFwdParams& params, cudaStream_t stream);

// Whether a call runs the KV cache kernels (run_fwd_kvcache_impl or, for an
// FP8 cache, run_fwd_kvcache_fp8_impl): the decode tiles, never the Hopper
// forward.
inline bool fwd_runs_kvcache_kernels(const AttentionFwdParams& params) {
  return has_kv_cache_addressing(params) || params.kv_dtype == DType::kFloat8E4M3;
}

// Whether a KV cache call runs the variant kernel (its Mask handles causal)
// rather than the plain non-causal one: with window / softcap / ALiBi /
// dropout, and when causal masks something, i.e. unless the only query row
// of each sequence sits bottom-right (then causal hides no key). The cache
// kernels have no causal instantiation of their own, to keep the build small.
inline bool fwd_kvcache_uses_variant_kernel(const AttentionFwdParams& params) {
  return has_variants(params) ||
         (params.causal && !(params.causal_bottom_right && params.seqlen_q == 1));
}

// Whether a split-KV call (num_splits > 1) merges its splits inside a
// thread-block cluster (fwd_merge.cuh, merge_splits_in_cluster) instead of
// through a global workspace and the combine kernel: sm_90 code on an sm_90
// device, the small-M decode tile, num_splits <= kMaxClusterSplits (6, see
// fwd_kernel_traits.cuh), a padded batch, the cost model in fwd_dispatch.cu.
// More splits (e.g. a forced num_splits = 7) take the combine kernel.
bool fwd_merges_splits_in_cluster(const AttentionFwdParams& params, int num_splits);

}  // namespace cuda
}  // namespace flash_attn_ext
