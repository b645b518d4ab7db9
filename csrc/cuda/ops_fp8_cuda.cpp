// CUDA implementation of flash_attn_ext::fwd_fp8 and varlen_fwd_fp8
// (csrc/ops_fp8.h checks the arguments): allocates out, lse, the transposed-V
// scratch (for the calls whose kernel does not transpose V itself) and the tile
// counter, then runs cuda::run_fwd_fp8 on torch's current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>

#include "../ops_fp8.h"
#include "flash_api.h"

namespace flash_attn_ext {
namespace {

// TMA needs 16-byte aligned bases and byte strides that are multiples of 16.
at::Tensor tma_friendly(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && t.stride(d) % 16 == 0;
  return ok ? t : t.contiguous();
}

// Runs the FP8 forward on checked params p of q_in / k_in / v_in (padded
// [batch, seqlen, heads, dim] or, with cu_seqlens, packed [total, heads, dim]).
std::tuple<at::Tensor, at::Tensor> run_fwd_fp8_op(AttentionFwdParams& p, const at::Tensor& q_in,
                                                  const at::Tensor& k_in,
                                                  const at::Tensor& v_in,
                                                  at::ScalarType out_dtype) {
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: expected every tensor on one CUDA device, but q is "
              "on ", q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  std::string why;
  TORCH_CHECK_NOT_IMPLEMENTED(cuda::fwd_fp8_supported(p.head_dim, &why),
                              "flash_attn_ext: the FP8 forward is not available here: ", why);

  const at::Tensor q = tma_friendly(q_in), k = tma_friendly(k_in), v = tma_friendly(v_in);
  point_at_inputs(p, q, k, v);
  const bool packed = p.cu_seqlens_q != nullptr;

  // Varlen: rows outside every sequence are zeros, lse -inf (as the 16-bit varlen forward).
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(out_dtype));
  at::Tensor lse = empty_lse(q);
  p.out = out.data_ptr();
  p.out_strides = strides_of(out);
  p.lse = lse.data_ptr<float>();
  if (packed) {
    cuda::finish_rows_past_sequences(p, static_cast<int>(out.size(-1)),
                                     at::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (p.seqlen_q == 0 || p.batch == 0 || p.heads == 0) return {out, lse};
  if (p.seqlen_k == 0) {  // no key: zeros and -inf, as the 16-bit kernels give
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }

  // V^T: [batch (sequences), heads_k, head_dim, seqlen_k (varlen: the longest) padded],
  // unless the kernel transposes V itself (short calls).
  at::Tensor v_transposed;
  if (!cuda::fwd_fp8_transposes_v(p)) {
    p.v_transposed_seqlen = cuda::fwd_fp8_v_transposed_seqlen(p.seqlen_k);
    v_transposed = at::empty({p.batch, p.heads_k, p.head_dim, p.v_transposed_seqlen},
                             q.options().dtype(at::kByte));
    p.v_transposed = v_transposed.data_ptr();
  }
  // The tile counter of the dynamic scheduler (causal tiles, and packed
  // sequences of different lengths).
  at::Tensor tile_counter;
  if (p.causal || packed) {
    tile_counter = at::empty({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
  }
  try {
    cuda::run_fwd_fp8(p, at::cuda::getCurrentCUDAStream().stream());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> fwd_fp8_cuda(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const at::Tensor& q_descale,
                                                const at::Tensor& k_descale,
                                                const at::Tensor& v_descale,
                                                double softmax_scale, bool causal,
                                                bool causal_bottom_right,
                                                at::ScalarType out_dtype) {
  AttentionFwdParams p = make_fwd_fp8_params(q, k, v, q_descale, k_descale, v_descale,
                                             softmax_scale, causal, causal_bottom_right,
                                             out_dtype);
  return run_fwd_fp8_op(p, q, k, v, out_dtype);
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_fp8_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const at::Tensor& q_descale, const at::Tensor& k_descale,
    const at::Tensor& v_descale, double softmax_scale, bool causal, at::ScalarType out_dtype) {
  const VarlenArgs va{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  AttentionFwdParams p = make_fwd_fp8_params(q, k, v, q_descale, k_descale, v_descale,
                                             softmax_scale, causal, /*causal_bottom_right=*/true,
                                             out_dtype, &va);
  return run_fwd_fp8_op(p, q, k, v, out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("fwd_fp8", &fwd_fp8_cuda);
  m.impl("varlen_fwd_fp8", &varlen_fwd_fp8_cuda);
}

}  // namespace flash_attn_ext
