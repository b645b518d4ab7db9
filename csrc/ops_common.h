// Shared by the CPU and CUDA op implementations: input validation and the
// translation of torch tensors into the plain AttentionFwdParams /
// AttentionBwdParams structs that kernels consume.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "params.h"

namespace flash_attn_ext {

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "flash_attn_ext: unsupported dtype ", t,
                  "; expected float32, float16 or bfloat16");
  }
}

// Every tensor is [batch, seqlen, heads, head_dim] with a contiguous last dim.
inline void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "flash_attn_ext: ", name, " is undefined");
  TORCH_CHECK(t.dim() == 4, "flash_attn_ext: ", name,
              " must be a 4-D tensor [batch, seqlen, heads, head_dim], got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(t.numel() > 0, "flash_attn_ext: ", name,
              " must not be empty, got shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_ext: ", name,
              " must have a contiguous last (head_dim) dimension, got stride ",
              t.stride(-1), " (call .contiguous() first)");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kBFloat16,
              "flash_attn_ext: ", name, " has dtype ", t.scalar_type(),
              "; expected float32, float16 or bfloat16");
  TORCH_CHECK(t.size(0) <= std::numeric_limits<int>::max() &&
                  t.size(1) <= std::numeric_limits<int>::max() &&
                  t.size(2) <= std::numeric_limits<int>::max(),
              "flash_attn_ext: ", name, " has a dimension too large: ", t.sizes());
}

inline void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                       const char* b_name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "flash_attn_ext: ", a_name, " and ",
              b_name, " must have the same dtype, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "flash_attn_ext: ", a_name, " and ", b_name,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

inline TensorStrides strides_of(const at::Tensor& t) {
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

// Validates q/k/v and fills everything of AttentionFwdParams except the
// output pointers (which the device implementation allocates).
inline AttentionFwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, double softmax_scale,
                                          bool causal, bool causal_bottom_right) {
  check_bshd(q, "q");
  check_bshd(k, "k");
  check_bshd(v, "v");
  check_same(q, "q", k, "k");
  check_same(q, "q", v, "v");
  TORCH_CHECK(k.sizes() == v.sizes(), "flash_attn_ext: k and v must have the same shape, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0), "flash_attn_ext: q and k must have the same batch size, got ",
              q.size(0), " and ", k.size(0));
  TORCH_CHECK(q.size(2) == k.size(2),
              "flash_attn_ext: q and k/v must have the same number of heads, got ", q.size(2),
              " and ", k.size(2), " (grouped-query attention is not supported yet)");
  TORCH_CHECK(q.size(3) == k.size(3), "flash_attn_ext: q, k and v must have the same head_dim, got ",
              q.size(3), " (q) and ", k.size(3), " (k/v)");
  TORCH_CHECK(std::isfinite(softmax_scale), "flash_attn_ext: softmax_scale must be finite, got ",
              softmax_scale);

  AttentionFwdParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_strides = strides_of(q);
  p.k_strides = strides_of(k);
  p.v_strides = strides_of(v);
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.heads = static_cast<int>(q.size(2));
  p.heads_k = static_cast<int>(k.size(2));
  p.seqlen_k = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(q.size(3));
  p.dtype = to_dtype(q.scalar_type());
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.causal_offset = (causal && causal_bottom_right) ? p.seqlen_k - p.seqlen_q : 0;
  return p;
}

// Outputs keep the memory layout of the matching input when that input is
// dense (so SDPA's [B,H,S,D] stays [B,H,S,D]); empty_like falls back to a
// contiguous [B,S,H,D] tensor otherwise. python/ops.py's fake mirrors this.
// The forward's tuning knobs (both only steer the CUDA 16-bit kernels).
inline void check_fwd_tuning_args(int64_t num_splits, int64_t tile) {
  TORCH_CHECK(num_splits >= 0, "flash_attn_ext: num_splits must be >= 0, got ", num_splits);
  TORCH_CHECK(tile >= kFwdTileAuto && tile <= kFwdTileSmallM,
              "flash_attn_ext: tile must be 0 (auto), 1 (large) or 2 (small-M), got ", tile);
}

inline at::Tensor empty_lse(const at::Tensor& q) {
  return at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
}

// Points the backward params at the gradient outputs.
inline void set_grad_outputs(AttentionBwdParams& p, const at::Tensor& dq, const at::Tensor& dk,
                             const at::Tensor& dv) {
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_strides = strides_of(dq);
  p.dk_strides = strides_of(dk);
  p.dv_strides = strides_of(dv);
}

inline AttentionBwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& out, const at::Tensor& lse,
                                          double softmax_scale, bool causal,
                                          bool causal_bottom_right, bool deterministic) {
  AttentionFwdParams fwd = make_fwd_params(q, k, v, softmax_scale, causal, causal_bottom_right);
  check_bshd(out, "out");
  check_bshd(dout, "dout");
  check_same(q, "q", out, "out");
  check_same(q, "q", dout, "dout");
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn_ext: out must have the shape of q ",
              q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(dout.sizes() == q.sizes(), "flash_attn_ext: dout must have the shape of q ",
              q.sizes(), ", got ", dout.sizes());
  TORCH_CHECK(lse.defined() && lse.scalar_type() == at::kFloat,
              "flash_attn_ext: lse must be a float32 tensor");
  TORCH_CHECK(lse.device() == q.device(), "flash_attn_ext: lse must be on the device of q (",
              q.device(), "), got ", lse.device());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(2) &&
                  lse.size(2) == q.size(1),
              "flash_attn_ext: lse must have shape [batch, heads, seqlen_q] = [", q.size(0), ", ",
              q.size(2), ", ", q.size(1), "], got ", lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), "flash_attn_ext: lse must be contiguous");

  AttentionBwdParams p;
  static_cast<AttentionFwdParams&>(p) = fwd;
  p.out = const_cast<void*>(out.data_ptr());
  p.out_strides = strides_of(out);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = dout.data_ptr();
  p.dout_strides = strides_of(dout);
  p.deterministic = deterministic;
  return p;
}

}  // namespace flash_attn_ext
