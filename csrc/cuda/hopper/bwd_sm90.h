// The Hopper backward's interface to the dispatcher (bwd_dispatch.cu): when it
// applies, and the per-(dtype, head dim, causal) launchers generated into
// instantiations/bwd_sm90_*.cu (variants: per (dtype, head dim), bwd_sm90_var_*.cu).
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"
#include "sm90_host.h"

namespace flash_attn_ext {
namespace cuda {

// Kernel head dims (bwd_rounded_head_dim) with a Hopper backward; the others
// use mma.sync (bwd_sm90_traits.cuh: D = 256 splits dK / dV by head-dim halves).
inline bool bwd_sm90_head_dim(int kernel_dim) {
  return kernel_dim == 64 || kernel_dim == 128 || kernel_dim == 256;
}

// Keys per CTA tile (BwdSm90Traits::kBlockN): the grid has one CTA per tile.
constexpr int bwd_sm90_block_n(int kernel_dim) { return kernel_dim > 128 ? 64 : 128; }

// GQA calls whose dK / dV the Hopper backward sums over each kv head's group
// of query heads itself (a CTA walks the group: kWalkGroup in
// bwd_sm90_kernel.cuh) and writes per kv head, [.., heads_k, D]; every variant
// included. The op layer decides (params.dkv_per_kv_head, from the dispatch's
// bwd_sums_gqa_groups_in_kernel) and then allocates no per-query-head dK / dV.
inline bool bwd_sm90_sums_gqa_groups(const AttentionBwdParams& p) {
  return p.dkv_per_kv_head && p.heads > p.heads_k;
}

// kHeadDimV: v's head dim where it is not q's (instantiations/bwd_sm90_*_v<Dv>_*.cu:
// MLA's 192 / 128).
template <typename T, int kHeadDim, bool kIsCausal, int kHeadDimV = kHeadDim>
void run_bwd_sm90_impl(const AttentionBwdParams& params, cudaStream_t stream);

// Window / softcap / ALiBi / attn_mask / dropout (has_variants), causal or not.
template <typename T, int kHeadDim>
void run_bwd_sm90_variants_impl(const AttentionBwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
