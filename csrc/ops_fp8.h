// Validation and params of the FP8 (e4m3) forward operator
// (flash_attn_ext::fwd_fp8 and varlen_fwd_fp8; the CUDA side is
// cuda/ops_fp8_cuda.cpp): e4m3 q / k / v [batch, seqlen, heads, head_dim] (or
// packed [total, heads, head_dim] with cu_seqlens) with FA3's dequantisation
// factors, a 16-bit out and an fp32 lse.
#pragma once
#include "ops_common.h"

namespace flash_attn_ext {

// e4m3 q / k / v: [batch, seqlen, heads, head_dim], or (varlen) packed
// [total, heads, head_dim].
inline void check_e4m3_bshd(const at::Tensor& t, const char* name, bool packed = false) {
  TORCH_CHECK(t.defined(), "flash_attn_ext: ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, "flash_attn_ext: the FP8 forward needs ",
              name, " in torch.float8_e4m3fn like q (mixing FP8 and 16-bit inputs is only "
              "supported for an FP8 KV cache in flash_attn_with_kvcache), got ",
              t.scalar_type());
  if (packed) {
    TORCH_CHECK(t.dim() == 3, "flash_attn_ext: varlen ", name,
                " must be a 3-D tensor [total_tokens, heads, head_dim], got ", t.dim(),
                "-D with shape ", t.sizes());
  } else {
    TORCH_CHECK(t.dim() == 4, "flash_attn_ext: ", name,
                " must be a 4-D tensor [batch, seqlen, heads, head_dim], got ", t.dim(),
                "-D with shape ", t.sizes());
  }
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_ext: ", name,
              " must have a contiguous last (head_dim) dimension, got stride ", t.stride(-1));
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK(t.size(d) <= std::numeric_limits<int>::max(), "flash_attn_ext: ", name,
                " has a dimension too large: ", t.sizes());
  }
}

// Checks every argument of fwd_fp8 (varlen_fwd_fp8 with va: packed q / k / v
// and cu_seqlens) and fills the params (pointers of q, k, v as given; the CUDA
// op re-points them at aligned copies where needed). The descales' batch is
// the sequences' with varlen.
inline AttentionFwdParams make_fwd_fp8_params(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& q_descale,
                                              const at::Tensor& k_descale,
                                              const at::Tensor& v_descale, double softmax_scale,
                                              bool causal, bool causal_bottom_right,
                                              at::ScalarType out_dtype,
                                              const VarlenArgs* va = nullptr) {
  const bool packed = va != nullptr;
  check_e4m3_bshd(q, "q", packed);
  check_e4m3_bshd(k, "k", packed);
  check_e4m3_bshd(v, "v", packed);
  check_same(q, "q", k, "k");
  check_same(q, "q", v, "v");
  const at::Tensor q4 = packed ? q.unsqueeze(0) : q, k4 = packed ? k.unsqueeze(0) : k,
                   v4 = packed ? v.unsqueeze(0) : v;
  check_qkv_shapes(q4, k4, v4, /*same_batch=*/true);
  TORCH_CHECK_NOT_IMPLEMENTED(v.size(-1) == q.size(-1), "flash_attn_ext: the FP8 forward needs "
                              "v's head_dim to be q's, got ", q.size(-1), " and ", v.size(-1));
  TORCH_CHECK(q.size(-1) % 16 == 0 && q.size(-1) <= 256,
              "flash_attn_ext: the FP8 forward needs head_dim to be a multiple of 16 up to 256 "
              "(16-byte rows), got ", q.size(-1));
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "flash_attn_ext: the FP8 forward writes out as bfloat16 or float16, got ",
              out_dtype);
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
              "flash_attn_ext: the FP8 forward needs a finite softmax_scale > 0, got ",
              softmax_scale);

  const int64_t batch = packed ? varlen_batch(q, *va) : q.size(0);
  AttentionFwdParams p;
  fill_padded_params(p, q4, k4, v4, softmax_scale, causal, causal_bottom_right);
  if (packed) apply_varlen(p, q, k, *va, batch, /*paged=*/false);
  p.dtype = p.kv_dtype = DType::kFloat8E4M3;
  p.out_dtype = out_dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  const int64_t heads_k = k4.size(2);
  p.q_descale = make_descale(q_descale, "q_descale", q, batch, heads_k);
  p.k_descale = make_descale(k_descale, "k_descale", q, batch, heads_k);
  p.v_descale = make_descale(v_descale, "v_descale", q, batch, heads_k);
  return p;
}

}  // namespace flash_attn_ext
