// Declarations shared by the forward dispatcher (fwd_dispatch.cu) and the
// translation units that define them: the per-(dtype, head dim, causal)
// launchers live in instantiations/fwd_*.cu (via fwd_launch_template.cuh),
// the fp32 path in fwd_fp32.cu.
#pragma once
#include <cuda_runtime.h>

#include "../params.h"

namespace flash_attn_ext {
namespace cuda {

// T in {__half, __nv_bfloat16}; kHeadDim in {32, 64, ..., 256} (>= params.head_dim).
// Launches the main kernel, then the combine kernel when params.num_splits > 1.
template <typename T, int kHeadDim, bool kIsCausal>
void run_fwd_impl(const AttentionFwdParams& params, cudaStream_t stream);

// fp32 inputs: SIMT kernel with true fp32 accumulation (no tf32), no split-KV.
void run_fwd_fp32(const AttentionFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
