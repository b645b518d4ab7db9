// Validation and params of the FP8 (e4m3) forward operator
// (flash_attn_ext::fwd_fp8; the CUDA side is cuda/ops_fp8_cuda.cpp):
// e4m3 q / k / v [batch, seqlen, heads, head_dim] with FA3's dequantisation
// factors, a 16-bit out and an fp32 lse.
#pragma once
#include "ops_common.h"

namespace flash_attn_ext {

inline void check_e4m3_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "flash_attn_ext: ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, "flash_attn_ext: the FP8 forward needs ",
              name, " in torch.float8_e4m3fn like q (mixing FP8 and 16-bit inputs is only "
              "supported for an FP8 KV cache in flash_attn_with_kvcache), got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 4, "flash_attn_ext: ", name,
              " must be a 4-D tensor [batch, seqlen, heads, head_dim], got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_ext: ", name,
              " must have a contiguous last (head_dim) dimension, got stride ", t.stride(-1));
  TORCH_CHECK(t.size(0) <= std::numeric_limits<int>::max() &&
                  t.size(1) <= std::numeric_limits<int>::max() &&
                  t.size(2) <= std::numeric_limits<int>::max(),
              "flash_attn_ext: ", name, " has a dimension too large: ", t.sizes());
}

// Checks every argument of fwd_fp8 and fills the params (pointers of q, k,
// v as given; the CUDA op re-points them at aligned copies where needed).
inline AttentionFwdParams make_fwd_fp8_params(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& q_descale,
                                              const at::Tensor& k_descale,
                                              const at::Tensor& v_descale, double softmax_scale,
                                              bool causal, bool causal_bottom_right,
                                              at::ScalarType out_dtype) {
  check_e4m3_bshd(q, "q");
  check_e4m3_bshd(k, "k");
  check_e4m3_bshd(v, "v");
  check_same(q, "q", k, "k");
  check_same(q, "q", v, "v");
  check_qkv_shapes(q, k, v, /*same_batch=*/true);
  TORCH_CHECK(q.size(3) % 16 == 0 && q.size(3) <= 256,
              "flash_attn_ext: the FP8 forward needs head_dim to be a multiple of 16 up to 256 "
              "(16-byte rows), got ", q.size(3));
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "flash_attn_ext: the FP8 forward writes out as bfloat16 or float16, got ",
              out_dtype);
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
              "flash_attn_ext: the FP8 forward needs a finite softmax_scale > 0, got ",
              softmax_scale);

  AttentionFwdParams p;
  fill_padded_params(p, q, k, v, softmax_scale, causal, causal_bottom_right);
  p.dtype = p.kv_dtype = DType::kFloat8E4M3;
  p.out_dtype = out_dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  p.q_descale = make_descale(q_descale, "q_descale", q, q.size(0), k.size(2));
  p.k_descale = make_descale(k_descale, "k_descale", q, q.size(0), k.size(2));
  p.v_descale = make_descale(v_descale, "v_descale", q, q.size(0), k.size(2));
  return p;
}

}  // namespace flash_attn_ext
