// Operator schemas (TORCH_LIBRARY) and the CPU implementations.
//
//   flash_attn_ext::fwd(q, k, v, softmax_scale, causal, causal_bottom_right, num_splits, tile)
//       -> (out, lse)
//   flash_attn_ext::bwd(dout, q, k, v, out, lse, softmax_scale, causal,
//                       causal_bottom_right, deterministic) -> (dq, dk, dv)
//
// All of q/k/v/out/dout are [batch, seqlen, heads, head_dim] with any batch,
// seqlen and head strides and a contiguous last dim; lse is [batch, heads,
// seqlen_q] float32. The CUDA implementations live in csrc/cuda/ops_cuda.cpp.
#include <torch/library.h>

#include <tuple>

#include "cpu/attention_cpu.h"
#include "ops_common.h"

namespace flash_attn_ext {

static std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double softmax_scale,
                                                  bool causal, bool causal_bottom_right,
                                                  int64_t num_splits, int64_t tile) {
  AttentionFwdParams p = make_fwd_params(q, k, v, softmax_scale, causal, causal_bottom_right);
  TORCH_CHECK(q.device().is_cpu(), "flash_attn_ext: fwd (CPU) got q on ", q.device());
  check_fwd_tuning_args(num_splits, tile);  // accepted and ignored: one CPU kernel
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = empty_lse(q);
  p.out = out.data_ptr();
  p.out_strides = strides_of(out);
  p.lse = lse.data_ptr<float>();
  cpu::run_fwd(p);
  return {out, lse};
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
    bool causal_bottom_right, bool deterministic) {
  AttentionBwdParams p = make_bwd_params(dout, q, k, v, out, lse, softmax_scale, causal,
                                         causal_bottom_right, deterministic);
  TORCH_CHECK(q.device().is_cpu(), "flash_attn_ext: bwd (CPU) got q on ", q.device());
  at::Tensor dq = at::empty_like(q);
  at::Tensor dk = at::empty_like(k);
  at::Tensor dv = at::empty_like(v);
  at::Tensor dsoftmax_sum = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  set_grad_outputs(p, dq, dk, dv);
  p.dsoftmax_sum = dsoftmax_sum.data_ptr<float>();
  cpu::run_bwd(p);
  return {dq, dk, dv};
}

TORCH_LIBRARY(flash_attn_ext, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "bool causal_bottom_right, int num_splits=0, int tile=0) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, bool causal_bottom_right, bool deterministic=False) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_attn_ext, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

}  // namespace flash_attn_ext
