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

// FLASH_ATTN_EXT_SM90_PINGPONG (default 1): whether the two consumer
// warpgroups alternate their GEMMs (a tuning switch, see the tile table).
bool fwd_sm90_pingpong();

// How the Hopper forward hands query tiles to CTAs:
//   kPerTile  one CTA per tile, the hardware block scheduler balances;
//   kStatic   persistent (one CTA per SM), tile c, c + SMs, ... (equal tiles);
//   kDynamic  persistent, each CTA claims the next tile from an atomic counter.
// FLASH_ATTN_EXT_SM90_SCHED=auto|tile|static|dynamic (a tuning switch);
// auto = dynamic when causal, static otherwise (measurements in
// fwd_sm90_launch.cuh).
enum class Sm90Schedule { kPerTile, kStatic, kDynamic };
Sm90Schedule fwd_sm90_schedule(bool causal);

template <typename T, int kHeadDim, bool kIsCausal>
void run_fwd_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
