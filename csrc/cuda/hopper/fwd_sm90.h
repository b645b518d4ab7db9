// The Hopper forward's interface to the dispatcher (fwd_dispatch.cu): when it
// applies, and the per-(dtype, head dim, causal) launchers generated into
// instantiations/fwd_sm90_*.cu.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"
#include "sm90_host.h"

namespace flash_attn_ext {
namespace cuda {

// Head dims with a Hopper kernel (others use mma.sync).
inline bool fwd_sm90_head_dim(int kernel_dim) {
  return kernel_dim == 64 || kernel_dim == 128 || kernel_dim == 256;
}

// (q / k, v) head-dim pairs with a Hopper forward of their own
// (generate_instantiations.py HEAD_DIMS_V_SM90; plain calls only, no variants).
inline bool fwd_sm90_head_dims_v(int head_dim, int head_dim_v) {
  return head_dim == 192 && head_dim_v == 128;
}

// The sequence layouts the Hopper forward reads: a padded batch, packed
// sequences (varlen, cu_seqlens), key counts cut by seqused_k (a KV cache's
// cache_seqlens), and the KV cache addressing, a paged cache (block_table),
// cache_batch_idx and cache_leftpad (a sequence's keys start at its pad: the
// kVarSeq kernel's seq_bounds<true, true>), with variants too; never with an
// attn_mask (its kernel has no kVarSeq instance). Rows past a sequence or past
// seqused_k may hold anything: the kVarSeq kernel zeroes the V rows a tile
// reads there (0 * NaN in P V).
// A paged cache's pages must hold 2^k rows (16, 32, ... 256: what serving
// stacks use; the kernel's producer shifts instead of dividing); other page
// sizes run the mma.sync kernels.
inline bool fwd_sm90_takes_seqs(const AttentionFwdParams& p) {
  const bool pages_ok = p.block_table == nullptr || (p.page_size & (p.page_size - 1)) == 0;
  return !has_var_seqs(p) || (p.attn_bias == nullptr && pages_ok);
}

// The K / V tensors as the forward's TMA maps see them: [batch][rows][heads_k]
// [head_dim]. Padded: the batch; packed: one entry of all rows; a paged cache:
// its pool, a page per entry ([num_pages][page_size]); cache_batch_idx: the
// cache's own batch entries.
struct KVMapShape {
  int64_t rows;
  int64_t batch;
};
inline KVMapShape fwd_sm90_kv_map_shape(const AttentionFwdParams& p) {
  if (p.block_table != nullptr) return {p.page_size, p.num_pages};
  if (p.cu_seqlens_q != nullptr) return {p.total_k, 1};
  return {p.seqlen_k, p.kv_batch_idx != nullptr ? p.kv_batch : p.batch};
}

// Rows per TMA box of a paged K / V tile: the largest power of two that
// divides both the key tile and the page (pages of 2^k >= 16 rows,
// fwd_sm90_takes_seqs; key tiles of 16m rows), i.e. the whole tile where pages
// hold whole tiles. A box then never crosses a page, and its rows start at a
// multiple of 8 rows of the tile, which keeps the 128-byte swizzle pattern. No
// division: the kernel's producer evaluates it per tile (a loop of run-time
// remainders took a quarter of a one-thread producer's time).
FAE_HOST_DEVICE int fwd_sm90_paged_box_rows(int page_size, int block_n) {
  const int tile_pow2 = block_n & -block_n;
  return page_size < tile_pow2 ? page_size : tile_pow2;
}

// kHeadDimV: v's and out's head dim (kHeadDim but for MLA's 192 / 128,
// fwd_sm90_head_dims_v).
template <typename T, int kHeadDim, bool kIsCausal, int kHeadDimV = kHeadDim>
void run_fwd_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream);

// Window / softcap / ALiBi (has_variants), causal or not.
template <typename T, int kHeadDim>
void run_fwd_sm90_variants_impl(const AttentionFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
