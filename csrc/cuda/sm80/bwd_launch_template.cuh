// run_bwd_impl<T, kHeadDim, kIsCausal>: the 16-bit backward for one compiled
// configuration (explicitly instantiated in instantiations/bwd_*.cu; with
// window / softcap / ALiBi run_bwd_variants_impl<T, kHeadDim>, bwd_var_*.cu):
//   1. D = rowsum(dO o O), zeroed fp32 dQ accumulator(s)  (bwd_preprocess.cuh),
//   2. main kernel: dK, dV, dQ partial sums                 (bwd_kernel.cuh),
//   3. dq = softmax_scale * sum of dQ splits                (bwd_preprocess.cuh).
// params.num_splits holds the number of dQ accumulators (1 unless
// params.deterministic); bwd_dispatch.cu sets it and sizes the workspace.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../../params.h"
#include "bwd_kernel.cuh"
#include "bwd_kernel_traits.cuh"
#include "../common/bwd_preprocess.cuh"

namespace flash_attn_ext {
namespace cuda {

template <typename T, int kHeadDim, bool kIsCausal, bool kHasVariants>
void run_bwd_kernels(const AttentionBwdParams& params, cudaStream_t stream) {
  using Kt = BwdKernelTraits<T, kHeadDim>;
  const int splits = params.deterministic ? params.num_splits : 1;
  if (splits < 1) throw std::runtime_error("flash_attn_ext: backward needs num_splits >= 1");

  launch_bwd_preprocess<T>(params, kHeadDim, splits, stream);

  const int num_n_blocks = (params.seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN;
  // Deterministic: `splits` blocks per head, each walking n_blocks
  // split, split + splits, ... and owning dQ accumulator `split`.
  const dim3 grid(params.deterministic ? splits : num_n_blocks, params.heads, params.batch);
  // Varlen / seqused_k calls get their own instantiation (see seq_bounds).
  const bool var_seqs = has_var_seqs(params);
  auto choose = [&] {
    if constexpr (kHasVariants) {
      // Variants: one kernel for padded / varlen and causal / not (the Mask).
      return params.deterministic ? &bwd::bwd_main_kernel<Kt, false, true, true, true>
                                  : &bwd::bwd_main_kernel<Kt, false, false, true, true>;
    } else {
      return params.deterministic
                 ? (var_seqs ? &bwd::bwd_main_kernel<Kt, kIsCausal, true, true>
                             : &bwd::bwd_main_kernel<Kt, kIsCausal, true, false>)
                 : (var_seqs ? &bwd::bwd_main_kernel<Kt, kIsCausal, false, true>
                             : &bwd::bwd_main_kernel<Kt, kIsCausal, false, false>);
    }
  };
  auto kernel = choose();
  bwd_check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Kt::kSmemBytes),
                 "shared-memory opt-in");
  kernel<<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(params);

  launch_bwd_convert_dq<T>(params, kHeadDim, splits, stream);
}

template <typename T, int kHeadDim, bool kIsCausal>
void run_bwd_impl(const AttentionBwdParams& params, cudaStream_t stream) {
  run_bwd_kernels<T, kHeadDim, kIsCausal, /*kHasVariants=*/false>(params, stream);
}

// Window / softcap / ALiBi calls (has_variants), causal or not.
template <typename T, int kHeadDim>
void run_bwd_variants_impl(const AttentionBwdParams& params, cudaStream_t stream) {
  run_bwd_kernels<T, kHeadDim, /*kIsCausal=*/false, /*kHasVariants=*/true>(params, stream);
}

}  // namespace cuda
}  // namespace flash_attn_ext
