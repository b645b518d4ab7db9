// Operator outputs the op layers produce besides the params: the lse tensor
// they allocate and the add of a computed dq into the caller's dq_accum.
// Separate from ops_params.h because these make or update tensors rather than
// describe them to a kernel. (The backward's fp32 workspace is sized and laid
// out in cuda/bwd_dispatch.cu, not here.)
#pragma once
#include <ATen/ATen.h>

namespace flash_attn_ext {

// Outputs keep the memory layout of the matching input when that input is
// dense (so SDPA's [B,H,S,D] stays [B,H,S,D]); empty_like falls back to a
// contiguous [B,S,H,D] tensor otherwise. python/ops.py's fake mirrors this.

// lse: [batch, heads, seqlen_q] for 4-D q, [heads, total_q] for packed 3-D q.
inline at::Tensor empty_lse(const at::Tensor& q) {
  if (q.dim() == 3) return at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  return at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
}

// dq_accum += dq / softmax_scale, dq in q's layout: what the paths whose kernels
// do not add into the caller's accumulator do after computing dq.
inline void add_into_dq_accum(const at::Tensor& acc, const at::Tensor& dq, double softmax_scale,
                              bool packed) {
  acc.add_(packed ? dq.transpose(0, 1) : dq.transpose(1, 2), 1.0 / softmax_scale);
}

}  // namespace flash_attn_ext
