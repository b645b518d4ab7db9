// CUDA implementations of flash_attn_ext::fwd / bwd: allocate outputs and
// scratch with torch, make inputs kernel-friendly (see flash_api.h for what
// the kernels may assume), call into the kernels on torch's current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "../ops_common.h"
#include "dropout_mask.h"
#include "flash_api.h"

namespace flash_attn_ext {
namespace {

constexpr int kMaxHeadDim = 256;

// Every row of t (its last dim) starts at a multiple of `elems` elements.
bool rows_aligned_to(const at::Tensor& t, int64_t elems) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % (elems * t.element_size()) != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.stride(d) % elems != 0) return false;
  }
  return true;
}

bool is_aligned_16(const at::Tensor& t) { return rows_aligned_to(t, 16 / t.element_size()); }

// Kernels need 16-byte aligned rows and a head dim that is a multiple of 8.
// Most inputs already qualify (no copy). Otherwise pad the head dim with
// zeros (zeros leave QK^T unchanged, and the padded columns of O / dQ / dK /
// dV are sliced away) or copy to a fresh contiguous tensor.
// FP8 (e4m3) tensors are padded as bytes (0x00 is +0).
at::Tensor kernel_friendly(const at::Tensor& t, int64_t padded_head_dim) {
  if (t.size(-1) != padded_head_dim) {
    if (t.scalar_type() == at::kFloat8_e4m3fn) {
      return at::constant_pad_nd(t.view(at::kByte), {0, padded_head_dim - t.size(-1)}, 0)
          .view(t.scalar_type());
    }
    return at::constant_pad_nd(t, {0, padded_head_dim - t.size(-1)}, 0);
  }
  return is_aligned_16(t) ? t : t.contiguous();
}

int64_t round_up_head_dim(int64_t d) { return (d + 7) / 8 * 8; }

// The head dim the kernels run: q / k and v (out, dout) all padded to one
// width. A value head dim other than q's (DeepSeek MLA's 192 / 128) runs as
// max(head_dim, head_dim_v) with the narrower tensors zero-padded: zero q / k
// columns leave QK^T unchanged, zero v / dout columns give zero out / dV
// columns (sliced away) and leave dP = dO V^T and D = rowsum(dO o O) unchanged.
int64_t kernel_head_dim(int64_t head_dim, int64_t head_dim_v, int64_t multiple = 8) {
  const int64_t d = std::max(head_dim, head_dim_v);
  return (d + multiple - 1) / multiple * multiple;
}

// forward: MLA's absorbed decode dims (576 / 512) have a CUDA forward too.
void check_cuda_inputs(const at::Tensor& q, int64_t head_dim_v = 0, bool forward = false) {
  // Reached when any argument is a CUDA tensor (the dispatcher picks CUDA).
  TORCH_CHECK(q.is_cuda(), "flash_attn_ext: expected every tensor on one CUDA device, but q is on ",
              q.device());
  const bool mla = cuda::fwd_mla_head_dims(static_cast<int>(q.size(-1)),
                                           static_cast<int>(head_dim_v));
  TORCH_CHECK_NOT_IMPLEMENTED((q.size(-1) <= kMaxHeadDim && head_dim_v <= kMaxHeadDim) ||
                                  (forward && mla),
                              "flash_attn_ext: the CUDA ", forward ? "forward" : "backward",
                              " takes head dims up to ", kMaxHeadDim,
                              forward ? " and DeepSeek MLA's 576 / 512" : "", ", got ",
                              q.size(-1), " (q / k) and ", head_dim_v, " (v)",
                              mla ? "; MLA's absorbed 576 / 512 has a CUDA forward (decode) "
                                    "only, the CPU computes its backward"
                                  : "");
  const auto props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major >= 8, "flash_attn_ext: CUDA kernels need compute capability >= 8.0 (Ampere "
              "or newer), this GPU is ", props->major, ".", props->minor);
}

int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

template <typename F>
void call_kernels(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The block summary of a boolean attn_mask (cuda/common/mask_blocks.cuh),
// allocated here and filled by the Hopper launchers; an undefined tensor when
// the call has none. Keep the result alive until the kernels are queued.
at::Tensor attach_attn_mask_blocks(AttentionFwdParams& p, const at::Tensor& q) {
  const int64_t bytes = cuda::attn_mask_blocks_bytes(p);
  if (bytes == 0) return {};
  at::Tensor blocks = at::empty({bytes}, q.options().dtype(at::kByte));
  cuda::set_attn_mask_blocks(p, blocks.data_ptr<uint8_t>());
  return blocks;
}

// Grouped-query decode (one query per sequence): the `group` query heads that
// share a kv head become `group` query rows of that kv head, so each K/V tile
// is read once per kv head instead of once per query head. q [B, 1, H, D] is
// re-viewed as [B, group, H_kv, D] (row stride = head stride, head stride =
// group * head stride: a stride change, no copy); out likewise; lse [B, H, 1]
// is the same memory as [B, H_kv, group]. With one query row, bottom-right
// causal masks nothing, so the regrouped call is non-causal. Not with a window,
// ALiBi, attn_mask, dropout or a learnable sink: they depend on the row or the
// query head (softcap does not care which row is which head).
bool can_regroup_decode(const AttentionFwdParams& p) {
  return p.cu_seqlens_q == nullptr && p.seqlen_q == 1 && p.heads > p.heads_k &&
         (!p.causal || p.causal_bottom_right) && !has_window(p) && p.alibi_slopes == nullptr &&
         p.attn_bias == nullptr && !has_dropout(p) && p.learnable_sink == nullptr;
}

at::Tensor regroup_view(const at::Tensor& t, int group) {
  const int64_t head_stride = t.stride(2);
  return t.as_strided({t.size(0), group, t.size(2) / group, t.size(3)},
                      {t.stride(0), head_stride, head_stride * group, 1});
}

void regroup_decode(AttentionFwdParams& p, const at::Tensor& q, const at::Tensor& out) {
  const int group = p.heads / p.heads_k;
  p.q_strides = strides_of(regroup_view(q, group));
  p.out_strides = strides_of(regroup_view(out, group));
  p.seqlen_q = group;
  p.heads = p.heads_k;
  p.causal = p.causal_bottom_right = false;
  p.causal_offset = 0;
  p.lse_head_stride = group;
  p.lse_batch_stride = static_cast<int64_t>(p.heads_k) * group;
  // q_rows_total (batch * heads) is unchanged.
}

// MLA's absorbed decode dims (576 / 512, cuda::fwd_mla_head_dims): their own
// forward, which writes out directly (rows of 1 KB: 16-byte aligned) and
// always runs split-KV through an fp32 workspace. A GQA decode's heads become
// rows as in run_fwd_cuda (MLA decodes with one latent kv head).
std::tuple<at::Tensor, at::Tensor> run_mla_fwd_cuda(AttentionFwdParams p, const at::Tensor& q_in,
                                                    const at::Tensor& k_in,
                                                    const at::Tensor& v_in, int64_t num_splits) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !has_variants(p), "flash_attn_ext: window_size, softcap, alibi_slopes, attn_mask and "
      "dropout with head dims 576 / 512 (MLA) are not implemented on CUDA");
  TORCH_CHECK_NOT_IMPLEMENTED(
      p.dtype != DType::kFloat32 && p.kv_dtype == p.dtype,
      "flash_attn_ext: the CUDA forward of head dims 576 / 512 (MLA) takes float16 or bfloat16 "
      "q, k and v (no float32, no FP8 KV cache)");
  const at::Tensor q = kernel_friendly(q_in, q_in.size(-1));
  const at::Tensor k = kernel_friendly(k_in, k_in.size(-1));
  // v a view of k's first columns (the latent cache) stays one: the kernel then reads it once.
  const at::Tensor v = v_in.data_ptr() == k_in.data_ptr() && v_in.strides() == k_in.strides()
                           ? k.narrow(-1, 0, v_in.size(-1))
                           : kernel_friendly(v_in, v_in.size(-1));
  point_at_inputs(p, q, k, v);
  at::Tensor out = empty_out(q_in, p.head_dim_v);
  at::Tensor lse = empty_lse(q);
  p.out = out.data_ptr();
  p.out_strides = strides_of(out);
  p.lse = lse.data_ptr<float>();
  p.num_splits = static_cast<int>(num_splits);
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  if (p.cu_seqlens_q != nullptr) {
    call_kernels([&] { cuda::finish_rows_past_sequences(p, p.head_dim_v, stream); });
  }
  if (can_regroup_decode(p)) regroup_decode(p, q, out);
  // Its grid's z dimension is (batch, head) pairs, its combine's y / z heads and batch.
  TORCH_CHECK_NOT_IMPLEMENTED(static_cast<int64_t>(p.batch) * p.heads <= 65535,
                              "flash_attn_ext: the CUDA forward of head dims 576 / 512 (MLA) "
                              "takes batch * heads <= 65535 (a decode step's heads per kv head "
                              "count as rows), got ", p.batch, " x ", p.heads);
  if (p.seqlen_q > 0) {
    const int splits = cuda::fwd_mla_num_splits(p, num_sms());
    at::Tensor workspace = at::empty({cuda::fwd_mla_workspace_floats(p, splits)},
                                     q.options().dtype(at::kFloat));
    cuda::fwd_mla_set_workspace(p, workspace.data_ptr<float>(), splits);
    call_kernels([&] { cuda::run_fwd_mla(p, splits, stream); });
  }
  return {out, lse};
}

// Shared by fwd and varlen_fwd: `p` is validated against the user's tensors.
std::tuple<at::Tensor, at::Tensor> run_fwd_cuda(AttentionFwdParams p, const at::Tensor& q_in,
                                                const at::Tensor& k_in, const at::Tensor& v_in,
                                                int64_t num_splits, int64_t tile) {
  check_cuda_inputs(q_in, v_in.size(-1), /*forward=*/true);
  check_fwd_tuning_args(num_splits, tile);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (cuda::fwd_mla_head_dims(p.head_dim, p.head_dim_v)) {
    return run_mla_fwd_cuda(p, q_in, k_in, v_in, num_splits);
  }

  const int64_t head_dim_v = v_in.size(-1);
  // An FP8 cache's rows are copied 16 elements (bytes) at a time
  // (sm80/fwd_tile_load.cuh, load_cache_tile_fp8_async): head dim a multiple of 16.
  const int64_t multiple = p.kv_dtype == DType::kFloat8E4M3 ? 16 : 8;
  // p points at the caller's tensors here: a pair with a kernel of its own
  // (fwd_runs_head_dims) keeps its head dims, every other pair runs one padded
  // head dim (kernel_head_dim), decided before anything is copied.
  p.num_splits = static_cast<int>(num_splits);
  p.fwd_tile = static_cast<int>(tile);
  const bool own_dims = cuda::fwd_runs_head_dims(p);
  const int64_t width = kernel_head_dim(q_in.size(-1), head_dim_v, multiple);
  auto kernel_width = [&](const at::Tensor& t) {
    return own_dims ? kernel_head_dim(t.size(-1), 0, multiple) : width;
  };
  at::Tensor q = kernel_friendly(q_in, kernel_width(q_in));
  at::Tensor k = kernel_friendly(k_in, kernel_width(k_in));
  at::Tensor v = kernel_friendly(v_in, kernel_width(v_in));
  point_at_inputs(p, q, k, v);

  // `out` has the layout the fake kernel promises (empty_out); the kernel
  // writes into it directly unless it needs a padded / aligned scratch copy.
  // Varlen: rows outside every sequence are zeros, lse -inf.
  at::Tensor out = empty_out(q_in, head_dim_v);
  const bool write_direct = p.head_dim_v == head_dim_v && is_aligned_16(out);
  at::Tensor out_kernel =
      write_direct ? out : at::empty(out_shape(q, p.head_dim_v), q.options());
  at::Tensor lse = empty_lse(q);
  p.out = out_kernel.data_ptr();
  p.out_strides = strides_of(out_kernel);
  p.lse = lse.data_ptr<float>();
  if (varlen) {
    call_kernels([&] {
      cuda::finish_rows_past_sequences(p, static_cast<int>(out_kernel.size(-1)),
                                        at::cuda::getCurrentCUDAStream().stream());
    });
  }
  if (can_regroup_decode(p)) regroup_decode(p, q, out_kernel);

  if (p.seqlen_q > 0) {  // varlen with max_seqlen_q == 0: nothing to compute
    const int sms = num_sms();
    call_kernels([&] {
      cuda::fwd_choose_tile(p, sms);
      cuda::fwd_set_kv_l2_policy(p, at::cuda::getCurrentDeviceProperties()->l2CacheSize);
    });
    const int splits = varlen ? 1 : cuda::fwd_num_splits(p, sms);
    p.num_splits = splits;
    const int64_t ws_floats = cuda::fwd_workspace_floats(p, splits);
    at::Tensor workspace;
    if (ws_floats > 0) {
      workspace = at::empty({ws_floats}, q.options().dtype(at::kFloat));
      cuda::fwd_set_workspace(p, workspace.data_ptr<float>(), splits);
    }
    const at::Tensor mask_blocks = attach_attn_mask_blocks(p, q);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    call_kernels([&] { cuda::run_fwd(p, stream); });
  }

  if (!write_direct) out.copy_(out_kernel.narrow(-1, 0, head_dim_v));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, double softmax_scale,
                                            bool causal, bool causal_bottom_right,
                                            int64_t num_splits, int64_t tile,
                                            const std::optional<at::Tensor>& seqused_k,
                                            int64_t window_left, int64_t window_right,
                                            double softcap,
                                            const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                            const std::optional<at::Tensor>& rng_state,
                                            const std::optional<at::Tensor>& attn_mask,
                                            const std::optional<at::Tensor>& learnable_sink,
                                            const std::optional<at::Tensor>& block_table,
                                            const std::optional<at::Tensor>& cache_batch_idx,
                                            const std::optional<at::Tensor>& cache_leftpad,
                                            const std::optional<at::Tensor>& k_descale,
                                            const std::optional<at::Tensor>& v_descale) {
  // Validate the user's tensors first so messages name their shapes.
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const KVCacheArgs cache{block_table, cache_batch_idx, cache_leftpad, k_descale, v_descale};
  const AttentionFwdParams p = make_fwd_params(q, k, v, softmax_scale, causal, causal_bottom_right,
                                               seqused_k, &var, &cache);
  return run_fwd_cuda(p, q, k, v, num_splits, tile);
}

std::tuple<at::Tensor, at::Tensor> sdpa_fwd_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double softmax_scale,
    bool causal, double dropout_p, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& attn_mask) {
  return sdpa_fwd_via(fwd_cuda, query, key, value, softmax_scale, causal, dropout_p, rng_state,
                      attn_mask);
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& block_table) {
  check_cuda_inputs(q, v.size(-1), /*forward=*/true);
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const AttentionFwdParams p = make_varlen_fwd_params(
      q, k, v, {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k}, softmax_scale, causal,
      seqused_k, &var, block_table);
  return run_fwd_cuda(p, q, k, v, /*num_splits=*/1, /*tile=*/0);
}

// Points the Hopper backward at the caller's dQ accumulator (check_dq_accum's
// layout) when TMA can describe it: 16-byte aligned rows and slices (slices
// as in params.h: batch * heads padded, heads packed, one pitch for all).
// Returns false (nothing set) otherwise.
bool point_at_caller_dq_accum(AttentionBwdParams& p, const at::Tensor& acc, bool packed) {
  const at::Tensor acc4 = packed ? acc.unsqueeze(0) : acc;  // [batch, heads, rows, head_dim]
  const int64_t batch = acc4.size(0), heads = acc4.size(1), rows = acc4.size(2);
  // Pitches of dimensions of one element are free: pick the dense ones.
  const int64_t row_pitch = rows > 1 ? acc4.stride(2) : (acc4.size(3) + 3) / 4 * 4;
  const int64_t slice_pitch =
      heads > 1 ? acc4.stride(1) : batch > 1 ? acc4.stride(0) : rows * row_pitch;
  if (batch > 1 && heads > 1 && acc4.stride(0) != heads * slice_pitch) return false;
  if (row_pitch <= 0 || slice_pitch <= 0 || row_pitch % 4 != 0 || slice_pitch % 4 != 0 ||
      reinterpret_cast<uintptr_t>(acc.data_ptr()) % 16 != 0) {
    return false;
  }
  p.dq_accum_external = true;
  p.dq_accum = acc.data_ptr<float>();
  p.dq_accum_row_pitch = row_pitch;
  p.dq_accum_slice_pitch = slice_pitch;
  return true;
}

// Shared by bwd and varlen_bwd. GQA: the Hopper backward sums each kv head's
// group of query heads in the kernel where the grid stays large enough
// (p.dkv_per_kv_head); otherwise the kernels write dK / dV per query head
// (expanded [.., heads, D] buffers) and the group sum happens here, as
// FlashAttention-2 does. Varlen / seqused_k: keys or rows outside every
// sequence get zero gradients (written after the kernels, see zero_filled).
// dq_accum (checked, check_dq_accum): dQ / softmax_scale is added into it, by
// the Hopper kernel where it takes the call, else here, and dq is returned
// empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_bwd_cuda(
    AttentionBwdParams p, const at::Tensor& dout_in, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in,
    const std::optional<at::Tensor>& dq_accum, double softmax_scale,
    const std::optional<at::Tensor>& dsink) {
  check_cuda_inputs(q_in, v_in.size(-1));
  const c10::cuda::CUDAGuard guard(q_in.device());
  const bool partial = has_var_seqs(p);
  // Rows outside every sequence get zero gradients: written after the kernels
  // (finish_grad_rows_outside_sequences) where they are known on the device,
  // else by zero-filled buffers (KV-cache addressing; no kernel runs).
  const bool zero_filled =
      partial && (has_kv_cache_addressing(p) || p.seqlen_q <= 0 || p.seqlen_k <= 0);
  const int group = p.heads / p.heads_k;

  const int64_t head_dim = q_in.size(-1);
  // A pair of head dims with a kernel of its own (bwd_runs_head_dims: MLA's
  // 192 / 128 on Hopper) keeps both; every other pair runs one padded head dim.
  const bool own_dims = v_in.size(-1) != head_dim && cuda::bwd_runs_head_dims(p);
  const int64_t head_dim_padded =
      own_dims ? head_dim
               : cuda::bwd_kernel_head_dim(
                     p, static_cast<int>(kernel_head_dim(head_dim, v_in.size(-1))));
  const int64_t head_dim_v_padded = own_dims ? v_in.size(-1) : head_dim_padded;
  at::Tensor q = kernel_friendly(q_in, head_dim_padded);
  at::Tensor k = kernel_friendly(k_in, head_dim_padded);
  at::Tensor v = kernel_friendly(v_in, head_dim_v_padded);
  at::Tensor out = kernel_friendly(out_in, head_dim_v_padded);
  at::Tensor dout = kernel_friendly(dout_in, head_dim_v_padded);
  point_at_inputs(p, q, k, v);
  p.out = out.data_ptr();
  p.dout = dout.data_ptr();
  p.out_strides = strides_of(out);
  p.dout_strides = strides_of(dout);

  // Gradients are allocated in the layout of their input (what the fake kernel
  // promises) and written directly unless a padded / aligned / expanded
  // scratch is needed. same_head_dim: dQ's columns are the kernel's.
  const bool same_head_dim = head_dim_padded == head_dim;
  const bool packed = p.cu_seqlens_q != nullptr;
  const bool adds_into_caller_accum = dq_accum.has_value() && same_head_dim &&
                                      cuda::bwd_adds_into_caller_dq_accum(p) &&
                                      point_at_caller_dq_accum(p, *dq_accum, packed);
  auto alloc = [&](const at::Tensor& like) {
    return zero_filled ? at::zeros_like(like) : at::empty_like(like);
  };
  at::Tensor dq_user = adds_into_caller_accum ? at::Tensor() : alloc(q_in);
  at::Tensor dk_user = alloc(k_in), dv_user = alloc(v_in);
  auto kernel_grad = [&](const at::Tensor& user, const at::Tensor& kernel_in, bool per_query_head) {
    if (!per_query_head && user.size(-1) == kernel_in.size(-1) && is_aligned_16(user)) return user;
    std::vector<int64_t> sizes = kernel_in.sizes().vec();
    if (per_query_head) sizes[sizes.size() - 2] = p.heads;
    return zero_filled ? at::zeros(sizes, kernel_in.options())
                       : at::empty(sizes, kernel_in.options());
  };
  at::Tensor dq = adds_into_caller_accum ? at::Tensor() : kernel_grad(dq_user, q, false);
  p.dkv_per_kv_head = group > 1 && cuda::bwd_sums_gqa_groups_in_kernel(p, num_sms());
  const bool per_query_head = group > 1 && !p.dkv_per_kv_head;
  at::Tensor dk = kernel_grad(dk_user, k, per_query_head);
  at::Tensor dv = kernel_grad(dv_user, v, per_query_head);
  set_grad_outputs(p, dq, dk, dv);

  if (p.seqlen_q > 0 && p.seqlen_k > 0) {
    const int sms = num_sms();
    at::Tensor workspace =
        at::empty({cuda::bwd_workspace_floats(p, sms)}, q.options().dtype(at::kFloat));
    cuda::bwd_set_workspace(p, workspace.data_ptr<float>(), sms);
    // The sink's gradient: per-block partials from the preprocess kernel, one
    // slot per 32 rows of the longest (padded) query length per (batch, head).
    at::Tensor dsink_partials;
    if (dsink.has_value()) {
      p.dsink_partials_stride = static_cast<int>((p.seqlen_q + 127) / 128 * 4);
      dsink_partials = at::zeros({static_cast<int64_t>(p.batch) * p.heads *
                                  p.dsink_partials_stride}, q.options().dtype(at::kFloat));
      p.dsink_partials = dsink_partials.data_ptr<float>();
    }
    const at::Tensor mask_blocks = attach_attn_mask_blocks(p, q);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    call_kernels([&] { cuda::run_bwd(p, sms, stream); });
    if (partial && !zero_filled) {
      cuda::GradRows rows{};
      const at::Tensor* grads[3] = {&dq, &dk, &dv};
      for (int i = 0; i < 3; ++i) {
        if (!grads[i]->defined()) continue;
        rows.ptr[i] = grads[i]->data_ptr();
        rows.strides[i] = i == 0 ? p.dq_strides : i == 1 ? p.dk_strides : p.dv_strides;
        rows.heads[i] = static_cast<int>(grads[i]->size(-2));
        rows.cols[i] = static_cast<int>(grads[i]->size(-1));
      }
      call_kernels([&] {
        cuda::finish_grad_rows_outside_sequences(p, rows, static_cast<int>(q.element_size()),
                                                 stream);
      });
    }
    if (dsink.has_value()) {
      add_sink_grad_partials(*dsink, dsink_partials, p.batch, p.heads);
    }
  }

  auto to_user = [&](at::Tensor& user, const at::Tensor& g) {
    if (g.is_same(user)) return;
    const int64_t cols = user.size(-1);
    at::Tensor grad = g.narrow(-1, 0, cols);
    if (grad.size(-2) != user.size(-2)) {  // GQA: sum the group's query heads
      std::vector<int64_t> sizes = grad.sizes().vec();
      sizes.back() = group;
      sizes.push_back(cols);
      sizes[sizes.size() - 3] = p.heads_k;
      grad = grad.reshape(sizes).sum(-2);
    }
    user.copy_(grad);
  };
  to_user(dk_user, dk);
  to_user(dv_user, dv);
  if (!dq_accum.has_value()) {
    to_user(dq_user, dq);
    return {dq_user, dk_user, dv_user};
  }
  if (!adds_into_caller_accum) {
    to_user(dq_user, dq);
    add_into_dq_accum(*dq_accum, dq_user, softmax_scale, packed);
  }
  return {at::empty({0}, q_in.options()), dk_user, dv_user};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
    bool causal_bottom_right, bool deterministic, const std::optional<at::Tensor>& seqused_k,
    int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& dq_accum,
    const std::optional<at::Tensor>& dsink) {
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const AttentionBwdParams p = make_bwd_params(dout, q, k, v, out, lse, softmax_scale, causal,
                                               causal_bottom_right, deterministic, seqused_k, &var);
  check_dq_accum(dq_accum, q, /*packed=*/false, softmax_scale);
  check_dsink(dsink, learnable_sink, q);
  return run_bwd_cuda(p, dout, q, k, v, out, dq_accum, softmax_scale, dsink);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, bool deterministic,
    const std::optional<at::Tensor>& seqused_k, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& dq_accum,
    const std::optional<at::Tensor>& dsink) {
  check_cuda_inputs(q);
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const AttentionBwdParams p = make_varlen_bwd_params(
      dout, q, k, v, out, lse, {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k},
      softmax_scale, causal, deterministic, seqused_k, &var);
  check_dq_accum(dq_accum, q, /*packed=*/true, softmax_scale);
  check_dsink(dsink, learnable_sink, q);
  return run_bwd_cuda(p, dout, q, k, v, out, dq_accum, softmax_scale, dsink);
}

at::Tensor dropout_mask_cuda(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t seqlen_q, int64_t seqlen_k, double dropout_p) {
  const AttentionFwdParams p =
      make_dropout_mask_params(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p);
  const c10::cuda::CUDAGuard guard(rng_state.device());
  at::Tensor mask = at::ones({batch, heads, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  if (has_dropout(p) && mask.numel() > 0) {
    call_kernels([&] {
      cuda::dropout_mask(p, mask.data_ptr<bool>(), at::cuda::getCurrentCUDAStream().stream());
    });
  }
  return mask;
}


void merge_partial_cuda(at::Tensor out, at::Tensor lse, const std::vector<at::Tensor>& block_outs,
                        const std::vector<at::Tensor>& block_lses,
                        const std::optional<at::Tensor>& prev_out) {
  TORCH_CHECK(out.is_cuda(), "flash_attn_ext: merge_partial_: expected CUDA tensors, out is on ",
              out.device());
  const MergePartialParams p = make_merge_partial_params(out, lse, block_outs, block_lses, prev_out);
  // 4-element vectors when every row start is aligned to them.
  bool vectorized = p.head_dim % 4 == 0 && rows_aligned_to(out, 4) &&
                    rows_aligned_to(prev_out.has_value() ? *prev_out : out, 4);
  for (const at::Tensor& block : block_outs) vectorized = vectorized && rows_aligned_to(block, 4);
  const c10::cuda::CUDAGuard guard(out.device());
  call_kernels([&] {
    cuda::merge_partial(p, vectorized, at::cuda::getCurrentCUDAStream().stream());
  });
}

void sum_partial_cuda(at::Tensor out, const std::vector<at::Tensor>& pieces,
                      const std::optional<at::Tensor>& prev) {
  TORCH_CHECK(out.is_cuda(), "flash_attn_ext: sum_partial_: expected CUDA tensors, out is on ",
              out.device());
  const SumPartialParams p = make_sum_partial_params(out, pieces, prev);
  bool vectorized = p.head_dim % 4 == 0 && rows_aligned_to(out, 4) &&
                    (!prev.has_value() || rows_aligned_to(*prev, 4));
  for (const at::Tensor& piece : pieces) vectorized = vectorized && rows_aligned_to(piece, 4);
  const c10::cuda::CUDAGuard guard(out.device());
  call_kernels([&] {
    cuda::sum_partial(p, vectorized, at::cuda::getCurrentCUDAStream().stream());
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("sdpa_fwd", &sdpa_fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("varlen_fwd", &varlen_fwd_cuda);
  m.impl("varlen_bwd", &varlen_bwd_cuda);
  m.impl("dropout_mask", &dropout_mask_cuda);
  m.impl("merge_partial_", &merge_partial_cuda);
  m.impl("sum_partial_", &sum_partial_cuda);
}

}  // namespace flash_attn_ext
