// The Hopper forward's interface to the dispatcher (fwd_dispatch.cu): when it
// applies, and the per-(dtype, head dim, causal) launchers generated into
// instantiations/fwd_sm90_*.cu.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"

namespace flash_attn_ext {
namespace cuda {

// Which forward implementation FLASH_ATTN_EXT_FWD_IMPL asks for:
//   auto  (default) the Hopper kernel wherever it applies, else mma.sync
//   mma   always the mma.sync kernels (sm_80 code path)
//   wgmma the Hopper kernel wherever it applies (same as auto today; kept
//         separate so benchmarks can name the path they mean)
enum class FwdImpl { kAuto, kMma, kWgmma };
FwdImpl fwd_impl_requested();  // throws on an unknown value

// Head dims with a Hopper kernel (others use mma.sync).
inline bool fwd_sm90_head_dim(int kernel_dim) {
  return kernel_dim == 64 || kernel_dim == 128 || kernel_dim == 256;
}

// FLASH_ATTN_EXT_SM90_PINGPONG (default 1): whether the two consumer
// warpgroups alternate their GEMMs (a tuning switch, see the tile table).
bool fwd_sm90_pingpong();

// Whether the current device is compute capability 9.0 (cached per device).
bool device_is_sm90();
// Multiprocessors of the current device (cached per device).
int device_sm_count();

// A 4-D TMA descriptor over a [batch, seqlen, heads, head_dim] tensor given by
// element strides (any order: [B,S,H,D] and [B,H,S,D] alike), 16-bit
// elements, boxes of [box_rows x 64 columns] stored with the 128-byte swizzle.
// Rows past seqlen and columns past head_dim read as zeros and are not written.
CUtensorMap make_attention_tensor_map(const void* base, bool bf16, int head_dim, int seqlen,
                                      int heads, int batch, const TensorStrides& strides,
                                      int box_rows);

template <typename T, int kHeadDim, bool kIsCausal>
void run_fwd_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
