// Host-side launcher of one Hopper backward configuration, included by the
// generated instantiations/bwd_sm90_<dtype>_hdim<D>_<causal|full>.cu files:
//   1. D = rowsum(dO o O), zeroed fp32 dQ accumulator, padded lse (log2) and D
//      rows (bwd_preprocess.cuh, shared with mma.sync),
//   2. the wgmma kernel: dK, dV, dQ sums   (bwd_sm90_kernel.cuh; dQ added into the
//      accumulator by TMA reduce-adds),
//   3. dq = softmax_scale * dQ accumulator (bwd_preprocess.cuh).
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "../bwd_preprocess.cuh"
#include "bwd_sm90.h"
#include "bwd_sm90_kernel.cuh"

namespace flash_attn_ext {
namespace cuda {

template <typename T, int kHeadDim, bool kIsCausal>
void run_bwd_sm90_impl(const AttentionBwdParams& params, cudaStream_t stream) {
  using Traits = BwdSm90Traits<T, kHeadDim>;
  if (params.head_dim > kHeadDim || params.deterministic || has_var_seqs(params)) {
    throw std::runtime_error("flash_attn_ext: internal error: unsupported params reached the "
                             "Hopper backward");
  }
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  // Workspace rows have the kernel head dim as pitch (bwd_dispatch.cu: accum_dim).
  if (params.lse_log2_padded == nullptr) {
    throw std::runtime_error("flash_attn_ext: internal error: no row-statistics workspace for the "
                             "Hopper backward");
  }
  launch_bwd_preprocess<T>(params, kHeadDim, 1, stream, /*padded_row_stats=*/true);

  const CUtensorMap tmap_q = query_tensor_map(params, params.q, params.q_strides, kBf16, Traits::kBlockM);
  const CUtensorMap tmap_k = key_tensor_map(params, params.k, params.k_strides, kBf16, Traits::kBlockN);
  const CUtensorMap tmap_v = key_tensor_map(params, params.v, params.v_strides, kBf16, Traits::kBlockN);
  const CUtensorMap tmap_do =
      query_tensor_map(params, params.dout, params.dout_strides, kBf16, Traits::kBlockM);
  // The padded batch's accumulator rows are [batch * heads][seqlen_q] (params.h).
  const CUtensorMap tmap_dq_accum = make_dq_accum_tensor_map(
      params.dq_accum, kHeadDim, params.seqlen_q, params.batch * params.heads, Traits::kBlockM);

  auto kernel = flash_bwd_sm90_kernel<Traits, kIsCausal>;
  bwd_check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Traits::kSmemBytes),
                 "shared-memory opt-in");
  // One CTA per key tile; blockIdx.x = 0 holds the first keys, which under
  // causal masking see the most queries, so the longest CTAs start first.
  const dim3 grid((params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, params.heads,
                  params.batch);
  if (grid.x > 0) {
    kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(tmap_q, tmap_k, tmap_v, tmap_do,
                                                                    tmap_dq_accum, params);
    bwd_check_cuda(cudaGetLastError(), "Hopper kernel launch");
  }
  launch_bwd_convert_dq<T>(params, kHeadDim, 1, stream);
}

}  // namespace cuda
}  // namespace flash_attn_ext
