// Operator outputs the op layers produce besides the params: the lse tensor
// they allocate and the add of a computed dq into the caller's dq_accum.
// Separate from ops_params.h because these make or update tensors rather than
// describe them to a kernel. (The backward's fp32 workspace is sized and laid
// out in cuda/bwd_dispatch.cu, not here.)
#pragma once
#include <ATen/ATen.h>

#include <vector>

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

// dsink += the gradient of the learnable sink (params.h): the sink of head h
// is one more logit of each of its rows with zero value, so
// dS_sink = P_sink (0 - D) and d_sink[h] = -sum over the rows of head h of
// exp(sink[h] - lse) * D, D = rowsum(dO o O) as the backward computed it
// (dsum: the flat q_rows_total floats in lse's layout, zero on rows outside
// every sequence, where lse is -inf: skipped, as exp(+inf) * 0 would be NaN).
// A fixed-order ATen reduction: deterministic.
inline void add_sink_grad(const at::Tensor& dsink, const at::Tensor& sink, const at::Tensor& lse,
                          const at::Tensor& dsum) {
  const bool packed = lse.dim() == 2;  // [heads, total_q], else [batch, heads, seqlen_q]
  const at::Tensor sink_rows = packed ? sink.view({-1, 1}) : sink.view({1, -1, 1});
  const at::Tensor terms = at::where(at::isneginf(lse), at::zeros({}, lse.options()),
                                     at::exp(sink_rows - lse) * dsum.view(lse.sizes()));
  dsink.sub_(packed ? terms.sum(std::vector<int64_t>{1}) : terms.sum(std::vector<int64_t>{0, 2}));
}

// dsink += the per-block partials of the CUDA backward's preprocess kernel
// (params.h dsink_partials, [batch][heads][stride], already negated, zeros in
// the unused slots), summed in a fixed order.
inline void add_sink_grad_partials(const at::Tensor& dsink, const at::Tensor& partials,
                                   int64_t batch, int64_t heads) {
  dsink.add_(partials.view({batch, heads, -1}).sum(std::vector<int64_t>{0, 2}));
}

}  // namespace flash_attn_ext
