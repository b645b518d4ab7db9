// The dropout keep-mask as a tensor (the dropout_mask operator): one thread per
// Philox call, i.e. per eight keys of one row (csrc/dropout.h). For tests and
// for return_attn_probs; the attention kernels never materialise it.
#include "dropout_mask.h"

namespace flash_attn_ext {
namespace cuda {

namespace {

// Grid: x = groups of 8 keys of a 32-key slice (4 per slice: the lane's u),
// y = row, z = batch * heads.
__global__ void dropout_mask_kernel(AttentionFwdParams params, bool* mask) {
  const int bh = blockIdx.z, i = blockIdx.y;
  const int slot = blockIdx.x * blockDim.x + threadIdx.x;  // = 4 * slice + u
  const int j0 = (slot >> 2) * 32 + 2 * (slot & 3);         // the group's first key
  if (j0 >= params.seqlen_k) return;
  const Dropout d = make_dropout(params, bh / params.heads, bh % params.heads);
  const uint32_t bits = d.keep_bits(i, j0);
  bool* row = mask + (static_cast<int64_t>(bh) * params.seqlen_q + i) * params.seqlen_k;
  for (int t = 0; t < 4; ++t) {
    for (int e = 0; e < 2; ++e) {
      const int j = j0 + 8 * t + e;
      if (j < params.seqlen_k) row[j] = (bits >> (2 * t + e)) & 1u;
    }
  }
}

}  // namespace

void dropout_mask(const AttentionFwdParams& params, bool* mask, cudaStream_t stream) {
  const int slots = (params.seqlen_k + 31) / 32 * 4;
  const dim3 block(128);
  const dim3 grid((slots + 127) / 128, params.seqlen_q, params.batch * params.heads);
  dropout_mask_kernel<<<grid, block, 0, stream>>>(params, mask);
}

}  // namespace cuda
}  // namespace flash_attn_ext
