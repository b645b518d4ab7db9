// The SDPA-layout adapter of the sdpa_fwd operator: torch SDPA's [batch, heads,
// seqlen, head_dim] tensors on a forward operator implementation (fwd_cpu /
// fwd_cuda). Separate because it is an operator wrapper, neither a check nor
// params filling; ops.cpp and cuda/ops_cuda.cpp share it.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>

namespace flash_attn_ext {

// flash_attn_ext::sdpa_fwd: torch SDPA's layout [batch, heads, seqlen,
// head_dim] on a forward operator implementation `fwd` (fwd_cpu / fwd_cuda,
// [batch, seqlen, heads, head_dim]): transposed views in, the output
// transposed back. The inference path of scaled_dot_product_attention, where
// four Python-level transposes around the call cost ~4 us of host time.
template <typename Fwd>
std::tuple<at::Tensor, at::Tensor> sdpa_fwd_via(Fwd&& fwd, const at::Tensor& query,
                                                const at::Tensor& key, const at::Tensor& value,
                                                double softmax_scale, bool causal,
                                                double dropout_p,
                                                const std::optional<at::Tensor>& rng_state,
                                                const std::optional<at::Tensor>& attn_mask) {
  for (const at::Tensor* t : {&query, &key, &value}) {
    TORCH_CHECK(t->dim() == 4, "flash_attn_ext: query, key and value must be 4-D tensors "
                "[batch, heads, seqlen, head_dim], got shape ", t->sizes());
  }
  auto [out, lse] = fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        softmax_scale, causal, /*causal_bottom_right=*/false, /*num_splits=*/0,
                        /*tile=*/0, std::nullopt, -1, -1, 0.0, std::nullopt, dropout_p, rng_state,
                        attn_mask, /*learnable_sink=*/std::nullopt, std::nullopt, std::nullopt,
                        std::nullopt, std::nullopt, std::nullopt);
  return {out.transpose(1, 2), lse};
}

}  // namespace flash_attn_ext
