// Input validation of the torch operators, before anything reaches the
// kernels' params (params.h): dtype / shape / device / stride checks of q, k, v
// and their relatives, the cu_seqlens checks (VarlenArgs, debug-check switch),
// the forward's tuning arguments, the bwd operators' dq_accum and the tensors of
// the partial-result operators. Separate from ops_params.h because it fills
// nothing: it only rejects inputs (ops_params.h includes it and adds the checks
// that need the params being filled).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "params.h"

namespace flash_attn_ext {

// Every tensor is [batch, seqlen, heads, head_dim] with a contiguous last dim.
// allow_fp8: float8_e4m3fn is accepted too (k / v of an FP8 KV cache).
inline void check_bshd(const at::Tensor& t, const char* name, bool allow_fp8 = false) {
  TORCH_CHECK(t.defined(), "flash_attn_ext: ", name, " is undefined");
  TORCH_CHECK(t.dim() == 4, "flash_attn_ext: ", name,
              " must be a 4-D tensor [batch, seqlen, heads, head_dim], got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(t.numel() > 0, "flash_attn_ext: ", name,
              " must not be empty, got shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_ext: ", name,
              " must have a contiguous last (head_dim) dimension, got stride ",
              t.stride(-1), " (call .contiguous() first)");
  TORCH_CHECK(allow_fp8 || t.scalar_type() != at::kFloat8_e4m3fn, "flash_attn_ext: ", name,
              " has dtype float8_e4m3fn: FP8 inputs take flash_attn_func with q, k and v in FP8 "
              "and q_descale / k_descale / v_descale, or an FP8 KV cache "
              "(flash_attn_with_kvcache with k_descale / v_descale)");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kBFloat16 ||
                  (allow_fp8 && t.scalar_type() == at::kFloat8_e4m3fn),
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

// Packed varlen tensors [total, heads, dim] as the kernels' [1, total, heads, dim].
inline at::Tensor as_4d(const at::Tensor& t) { return t.dim() == 3 ? t.unsqueeze(0) : t; }

// Key/value heads may be fewer than query heads (GQA / MQA), never more.
inline void check_heads(int64_t heads, int64_t heads_k) {
  TORCH_CHECK(heads_k > 0 && heads % heads_k == 0, "flash_attn_ext: the number of query heads (",
              heads, ") must be a multiple of the number of key/value heads (", heads_k, ")");
}

// int32 per-sequence tensors (cu_seqlens, seqused_k): dtype, device, shape.
inline void check_seq_tensor(const at::Tensor& t, const char* name, const at::Tensor& q,
                             int64_t expected_len) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "flash_attn_ext: ", name, " must be int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "flash_attn_ext: ", name, " must be on the device of q (",
              q.device(), "), got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == expected_len, "flash_attn_ext: ", name,
              " must be a 1-D tensor of length ", expected_len, ", got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "flash_attn_ext: ", name, " must be contiguous");
}

// The shape rules every padded forward shares: k and v alike but for the
// last dim (v's head dim may differ: DeepSeek MLA's 192 / 128), heads a
// multiple of heads_k, q's head_dim k's; the batch sizes equal unless k / v
// are indexed by a block table or cache_batch_idx (same_batch = false).
inline void check_qkv_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             bool same_batch) {
  TORCH_CHECK(k.dim() == v.dim() && k.sizes().slice(0, k.dim() - 1) == v.sizes().slice(0, v.dim() - 1),
              "flash_attn_ext: k and v must have the same shape but for the last (head_dim) "
              "dimension, got ", k.sizes(), " and ", v.sizes());
  if (same_batch) {
    TORCH_CHECK(q.size(0) == k.size(0),
                "flash_attn_ext: q and k must have the same batch size, got ", q.size(0), " and ",
                k.size(0));
  }
  check_heads(q.size(2), k.size(2));
  TORCH_CHECK(q.size(3) == k.size(3), "flash_attn_ext: q and k must have the same head_dim, got ",
              q.size(3), " (q) and ", k.size(3), " (k)");
}

// Variable-length batches: q [total_q, heads, dim], k/v [total_k, heads_k,
// dim], cu_seqlens int32 [batch + 1]. Their values (cu[0] == 0,
// non-decreasing, cu[batch] <= total, no sequence longer than max_seqlen) are
// checked where that is free, on CPU tensors, and on a GPU only with
// FLASH_ATTN_EXT_DEBUG_CHECKS=1: the check needs a device-to-host copy, which
// stalls the host behind the queued kernels and cannot be captured in a CUDA
// graph. Unchecked, the kernels clamp every sequence into the packed rows and
// to max_seqlen (params.h, packed_sequence). Kernels see [1, total, heads,
// dim] tensors with batch stride 0 (see params.h).
struct VarlenArgs {
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
};

// FLASH_ATTN_EXT_DEBUG_CHECKS set to anything but "" or "0" (the Python
// package's kvcache.debug_checks_enabled reads the same variable).
inline bool debug_checks_enabled() {
  const char* value = std::getenv("FLASH_ATTN_EXT_DEBUG_CHECKS");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

inline void check_cu_seqlens(const at::Tensor& cu, const char* name, int64_t total,
                             int64_t max_seqlen, const char* max_name) {
  if (!cu.is_cpu() && !debug_checks_enabled()) return;
  const at::Tensor host = cu.to(at::kCPU);
  const int* c = host.data_ptr<int>();
  const int64_t n = host.size(0);
  TORCH_CHECK(c[0] == 0, "flash_attn_ext: ", name, "[0] must be 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(c[i] >= c[i - 1], "flash_attn_ext: ", name, " must be non-decreasing, but ",
                name, "[", i, "] = ", c[i], " < ", name, "[", i - 1, "] = ", c[i - 1]);
    longest = std::max<int64_t>(longest, c[i] - c[i - 1]);
  }
  TORCH_CHECK(c[n - 1] <= total, "flash_attn_ext: ", name, "[-1] = ", c[n - 1],
              " exceeds the number of packed rows (", total, ")");
  TORCH_CHECK(longest <= max_seqlen, "flash_attn_ext: ", max_name, " = ", max_seqlen,
              " is smaller than the longest sequence in ", name, " (", longest, ")");
}

inline void check_varlen_3d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined() && t.dim() == 3, "flash_attn_ext: varlen ", name,
              " must be a 3-D tensor [total_tokens, heads, head_dim], got shape ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
}

// The number of sequences of a varlen call (cu_seqlens' length - 1), with the
// checks of cu_seqlens' dtype / device / shape and of max_seqlen's range.
inline int64_t varlen_batch(const at::Tensor& q, const VarlenArgs& va) {
  const int64_t batch = va.cu_seqlens_q.dim() == 1 ? va.cu_seqlens_q.size(0) - 1 : -1;
  TORCH_CHECK(batch >= 1, "flash_attn_ext: cu_seqlens_q must be a 1-D tensor of length batch + 1 "
              ">= 2, got shape ", va.cu_seqlens_q.sizes());
  check_seq_tensor(va.cu_seqlens_q, "cu_seqlens_q", q, batch + 1);
  check_seq_tensor(va.cu_seqlens_k, "cu_seqlens_k", q, batch + 1);
  TORCH_CHECK(va.max_seqlen_q >= 0 && va.max_seqlen_k >= 0 &&
                  va.max_seqlen_q <= std::numeric_limits<int>::max() &&
                  va.max_seqlen_k <= std::numeric_limits<int>::max(),
              "flash_attn_ext: max_seqlen_q / max_seqlen_k out of range: ", va.max_seqlen_q, ", ",
              va.max_seqlen_k);
  return batch;
}

// The forward's tuning knobs (both only steer the CUDA 16-bit kernels).
inline void check_fwd_tuning_args(int64_t num_splits, int64_t tile) {
  TORCH_CHECK(num_splits >= 0, "flash_attn_ext: num_splits must be >= 0, got ", num_splits);
  TORCH_CHECK(tile >= kFwdTileAuto && tile <= kFwdTileSmallMKeyWarps,
              "flash_attn_ext: tile must be 0 (auto), 1 (large), 2 (small-M) or 3 (small-M, "
              "key warps), got ", tile);
}

// The bwd operators' dq_accum argument: float32 with q's rows in lse's layout
// and head_dim last, [batch, heads, seqlen_q, head_dim] (varlen_bwd: [heads,
// total_q, head_dim]), on q's device, with a contiguous last dim. It is added
// into (dQ / softmax_scale, the kernels' unscaled accumulator: a caller that
// accumulates many calls multiplies by softmax_scale once), so the scale must
// not be 0.
inline void check_dq_accum(const std::optional<at::Tensor>& acc, const at::Tensor& q,
                           bool packed, double softmax_scale) {
  if (!acc.has_value()) return;
  const std::vector<int64_t> shape =
      packed ? std::vector<int64_t>{q.size(1), q.size(0), q.size(2)}
             : std::vector<int64_t>{q.size(0), q.size(2), q.size(1), q.size(3)};
  TORCH_CHECK(acc->scalar_type() == at::kFloat && acc->sizes() == shape,
              "flash_attn_ext: bwd: dq_accum must be float32 of shape ", at::IntArrayRef(shape),
              packed ? " ([heads, total_q, head_dim])" : " ([batch, heads, seqlen_q, head_dim])",
              ", got ", acc->scalar_type(), " of shape ", acc->sizes());
  TORCH_CHECK(acc->device() == q.device(), "flash_attn_ext: bwd: dq_accum must be on q's device ",
              q.device(), ", got ", acc->device());
  TORCH_CHECK(acc->stride(-1) == 1 || acc->size(-1) == 1,
              "flash_attn_ext: bwd: dq_accum must have a contiguous last dimension");
  TORCH_CHECK(softmax_scale != 0.0, "flash_attn_ext: bwd: dq_accum holds dQ / softmax_scale, "
              "so softmax_scale must not be 0");
}

// The bwd operators' dsink: the gradient of learnable_sink (float32 [heads],
// params.h), added into; only with a learnable_sink. A call with a sink and
// no dsink computes no sink gradient.
inline void check_dsink(const std::optional<at::Tensor>& dsink,
                        const std::optional<at::Tensor>& learnable_sink, const at::Tensor& q) {
  if (!dsink.has_value()) return;
  TORCH_CHECK(learnable_sink.has_value(), "flash_attn_ext: bwd: dsink (the gradient of "
              "learnable_sink) needs the learnable_sink of the forward");
  TORCH_CHECK(dsink->scalar_type() == at::kFloat && dsink->sizes() == learnable_sink->sizes(),
              "flash_attn_ext: bwd: dsink must be float32 of learnable_sink's shape ",
              learnable_sink->sizes(), ", got ", dsink->scalar_type(), " of shape ",
              dsink->sizes());
  TORCH_CHECK(dsink->device() == q.device(), "flash_attn_ext: bwd: dsink must be on q's device ",
              q.device(), ", got ", dsink->device());
}

// The tensors of merge_partial_ / sum_partial_ (`op`): 1 .. max_inputs
// `inputs` of one dtype (float32 or 16-bit), out and the running result (when
// given) float32 or that dtype, all of one shape, [batch, seqlen, heads,
// head_dim] or packed [total, heads, head_dim], with a contiguous last dim, on
// out's device, each dimension an int. noun: what the inputs are ("blocks");
// first: the first input, possessive ("block_outs[0]'s").
inline void check_partial_tensors(const char* op, const at::Tensor& out,
                                  const std::optional<at::Tensor>& running,
                                  const char* running_name, const std::vector<at::Tensor>& inputs,
                                  const char* inputs_name, int max_inputs, const char* noun,
                                  const char* first) {
  TORCH_CHECK(!inputs.empty() && inputs.size() <= static_cast<size_t>(max_inputs),
              "flash_attn_ext: ", op, " takes 1 to ", max_inputs, " ", noun, ", got ",
              inputs.size());
  const at::ScalarType in_dtype = inputs[0].scalar_type();
  TORCH_CHECK(in_dtype == at::kFloat || in_dtype == at::kHalf || in_dtype == at::kBFloat16,
              "flash_attn_ext: ", op, ": ", inputs_name,
              " must be float32, float16 or bfloat16, got ", in_dtype);
  auto check = [&](const at::Tensor& t, const std::string& name, bool is_input) {
    TORCH_CHECK(t.dim() == 3 || t.dim() == 4, "flash_attn_ext: ", op, ": ", name,
                " must be [batch, seqlen, heads, head_dim] or [total, heads, head_dim], got "
                "shape ", t.sizes());
    TORCH_CHECK(t.sizes() == out.sizes(), "flash_attn_ext: ", op, ": ", name,
                " must have out's shape ", out.sizes(), ", got ", t.sizes());
    TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "flash_attn_ext: ", op, ": ", name,
                " must have a contiguous last dimension");
    TORCH_CHECK(t.device() == out.device(), "flash_attn_ext: ", op, ": every tensor must be on "
                "out's device ", out.device(), ", ", name, " is on ", t.device());
    const at::ScalarType dtype = t.scalar_type();
    TORCH_CHECK(dtype == in_dtype || (!is_input && dtype == at::kFloat), "flash_attn_ext: ", op,
                ": ", name, " must be ", is_input ? "of " : "float32 or ",
                is_input ? std::string(first) : std::string("the ") + noun + "'", " dtype ",
                in_dtype, ", got ", dtype);
  };
  check(out, "out", false);
  if (running.has_value()) check(*running, running_name, false);
  for (size_t i = 0; i < inputs.size(); ++i) {
    check(inputs[i], std::string(inputs_name) + "[" + std::to_string(i) + "]", true);
  }
  const at::Tensor out4 = as_4d(out);
  for (int d = 0; d < 4; ++d) {
    TORCH_CHECK(out4.size(d) <= std::numeric_limits<int>::max(), "flash_attn_ext: ", op,
                ": out has a dimension too large: ", out.sizes());
  }
}

}  // namespace flash_attn_ext
