// fp32 backward (SIMT / FFMA, no tensor cores, no tf32): declarations shared
// by bwd_fp32.cu and ../bwd_dispatch.cu.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"

namespace flash_attn_ext {
namespace cuda {

constexpr int kBwdFp32BlockM = 32;  // queries per tile (one per lane)
constexpr int kBwdFp32BlockN = 32;  // keys per block (one per lane)

// Head dim the fp32 kernel is instantiated for (and the dQ accumulator pitch).
inline int bwd_fp32_accum_dim(int head_dim) {
  return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// Zeroes the dQ accumulator(s), runs preprocess, main kernel and convert.
// Uses params.num_splits dQ accumulators when params.deterministic.
void run_bwd_fp32(const AttentionBwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
