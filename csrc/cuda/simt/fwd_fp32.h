// fp32 forward (SIMT / FFMA, no tensor cores, no tf32): the declaration shared
// by fwd_fp32.cu and ../fwd_dispatch.cu.
#pragma once
#include <cuda_runtime.h>

#include "../../params.h"

namespace flash_attn_ext {
namespace cuda {

// fp32 inputs: SIMT kernel with true fp32 accumulation (no tf32), no split-KV.
void run_fwd_fp32(const AttentionFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
