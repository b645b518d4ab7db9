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

// The flat dQ accumulator (measured 1.8% faster than the tensor map's boxes
// over D = 64 / 128, docs/PERFORMANCE.md): a consumer's 64 x 64 fp32 dQ
// partial of a step is staged in its registers' fragment order (8 16-byte
// stores per thread at fixed offsets: no swizzle, no bank conflict, no row
// selects) and added by one 16 KB bulk reduce (cp.reduce.async.bulk) into a
// block of the same order, which the convert kernel un-permutes; as
// FlashAttention-4 does (ncu: our D = 128 step issues 37% more instructions
// and three times its MIO stalls, a third of the difference the dQ staging's;
// docs/PERFORMANCE.md). The block of block row R (params.h
// flat_dq_block_row0: per (batch, head), or per head and sequence for packed
// rows) and 64 columns c starts at float (R * accum_dim / 64 + c) * 4096;
// float (k * 128 + t) * 4 + e of it is consumer thread t's dq[k][e]: row
// 16 (t / 32) + (t % 32) / 4 + 8 (e / 2), column 8 k + 2 (t % 4) + e % 2.
// With 80-query steps (bwd_sm90_flat_dq_rows) a block is 80 rows x 64
// columns, 5120 floats, of dQ^T's fragments: the same formula with row and
// column swapped, k < 10. For
// the key split (D <= 128), plain kernels (padded, packed, seqused_k) and the
// workspace's accumulator; the variant kernels (window, softcap, ALiBi,
// attn_mask, dropout) at D = 128, where it measured 2-5% faster than the
// boxes (H100, 2026-12-07). D = 64's variant kernels (not measured) and a
// caller's accumulator keep the tensor map's [rows][accum dim].
inline bool bwd_sm90_flat_dq(const AttentionBwdParams& p, int kernel_dim) {
  return kernel_dim <= 128 && p.head_dim_v == p.head_dim && !p.dq_accum_external &&
         !has_kv_cache_addressing(p) && (!has_variants(p) || kernel_dim == 128);
}

// Causal calls take 80-query steps from this many query rows on: the
// diagonal's masked share of the work grows with the step (about 5% of a 4k
// causal call against 3% with 64-query steps), which the larger step's gain
// outweighs only on long rows (H100, 2026-12-07, one build: 0.98x at 1k,
// 1.015x at 4k, 1.05x at 16k against 64-query steps).
constexpr int kBwdSm90CausalQ80MinRows = 4096;

// Rows per block of the flat dQ accumulator, and queries per step of the
// kernel that fills it: 80 for plain D = 128 calls, non-causal or with at
// least kBwdSm90CausalQ80MinRows query rows (bwd_sm90_traits.cuh
// kDqTransposed: 80-query steps, dQ^T's fragments in the blocks), else 64.
// Deterministic calls keep 64-query steps (their order counters are laid out
// per 64 rows), and so do the variant kernels.
inline int bwd_sm90_flat_dq_rows(const AttentionBwdParams& p, int kernel_dim) {
  const bool long_enough = !p.causal || p.seqlen_q >= kBwdSm90CausalQ80MinRows;
  return bwd_sm90_flat_dq(p, kernel_dim) && kernel_dim == 128 && !p.deterministic &&
                 !has_variants(p) && long_enough
             ? 80
             : 64;
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
