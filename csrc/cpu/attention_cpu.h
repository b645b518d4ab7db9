// CPU FlashAttention: tiled forward with online softmax and a recomputing
// backward. Plain params in, no tensors.
#pragma once
#include "../params.h"

namespace flash_attn_ext {
namespace cpu {

// Writes params.out and params.lse.
void run_fwd(const AttentionFwdParams& params);

// Reads dout/q/k/v/out/lse, writes dq/dk/dv. dsoftmax_sum must point at
// batch*heads*seqlen_q floats of scratch.
void run_bwd(const AttentionBwdParams& params);

}  // namespace cpu
}  // namespace flash_attn_ext
