// dropout_mask (dropout_mask.cu): the keep-mask of csrc/dropout.h as a tensor.
#pragma once
#include <cuda_runtime.h>

#include "../dropout.h"
#include "../params.h"

namespace flash_attn_ext {
namespace cuda {

// mask: bool [batch, heads, seqlen_q, seqlen_k], contiguous, on the device;
// params: batch, heads, seqlen_q, seqlen_k, dropout_threshold, rng_state (device).
void dropout_mask(const AttentionFwdParams& params, bool* mask, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
