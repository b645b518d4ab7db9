// The dropout keep-mask as a tensor (the dropout_mask operator): one thread per
// Philox call group, i.e. per 2 keys x 8 queries (csrc/dropout.h). For tests and
// for return_attn_probs; the attention kernels never materialise it.
#include "dropout_mask.h"

namespace flash_attn_ext {
namespace cuda {

namespace {

// Grid: x = call groups of a 32-query block (32 per 16 keys: slot = 32 *
// (key / 16) + 4 * (key % 8) + (query / 2) % 4), y = 32-query block,
// z = batch * heads.
__global__ void dropout_mask_kernel(AttentionFwdParams params, bool* mask) {
  const int bh = blockIdx.z;
  const int slot = blockIdx.x * blockDim.x + threadIdx.x;
  const int key0 = (slot >> 5) * 16 + ((slot >> 2) & 7);  // the group's keys: + {0, 8}
  const int query0 = blockIdx.y * 32 + 2 * (slot & 3);    // its queries: + 8t + e
  if (key0 >= params.seqlen_k) return;
  const Dropout d = make_dropout(params, bh / params.heads, bh % params.heads);
  const uint32_t bits = d.call_keep_bits(query0, key0);
  for (int b = 0; b < 16; ++b) {
    int i, j;
    dropout_byte_element(query0, key0, b, i, j);
    if (i < params.seqlen_q && j < params.seqlen_k) {
      const int64_t row = static_cast<int64_t>(bh) * params.seqlen_q + i;
      mask[row * params.seqlen_k + j] = (bits >> b) & 1u;
    }
  }
}

}  // namespace

void dropout_mask(const AttentionFwdParams& params, bool* mask, cudaStream_t stream) {
  const int slots = (params.seqlen_k + 15) / 16 * 32;
  const dim3 block(128);
  const dim3 grid((slots + 127) / 128, (params.seqlen_q + 31) / 32, params.batch * params.heads);
  dropout_mask_kernel<<<grid, block, 0, stream>>>(params, mask);
}

}  // namespace cuda
}  // namespace flash_attn_ext
