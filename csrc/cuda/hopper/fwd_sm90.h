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

// The sequence layouts the Hopper forward reads: a padded batch, packed
// sequences (varlen, cu_seqlens) and key counts cut by seqused_k (a plain KV
// cache's cache_seqlens), with variants too, never with an attn_mask (its
// kernel has no kVarSeq instance). Rows past a sequence or past seqused_k may
// hold anything: the kVarSeq kernel zeroes the V rows a tile reads there (0 *
// NaN in P V). Not the KV cache addressing (TMA addresses K/V by strides).
inline bool fwd_sm90_takes_seqs(const AttentionFwdParams& p) {
  return !has_var_seqs(p) || (!has_kv_cache_addressing(p) && p.attn_bias == nullptr);
}

template <typename T, int kHeadDim, bool kIsCausal>
void run_fwd_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream);

// Window / softcap / ALiBi (has_variants), causal or not.
template <typename T, int kHeadDim>
void run_fwd_sm90_variants_impl(const AttentionFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
