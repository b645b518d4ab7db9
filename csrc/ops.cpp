// Operator schemas (TORCH_LIBRARY) and the CPU implementations.
//
//   flash_attn_ext::fwd(q, k, v, softmax_scale, causal, causal_bottom_right, num_splits, tile,
//                       seqused_k, *variants) -> (out, lse)
//   flash_attn_ext::bwd(dout, q, k, v, out, lse, softmax_scale, causal,
//                       causal_bottom_right, deterministic, seqused_k, *variants,
//                       dq_accum=None) -> (dq, dk, dv)
//       dq_accum (float32 [batch, heads, seqlen_q, head_dim], varlen_bwd [heads,
//       total_q, head_dim]): dQ / softmax_scale is added into it instead of
//       returned (dq comes back empty), so that a caller with many calls over the
//       same rows (ring attention) converts once; the Hopper backward adds into it
//       in its kernel, other paths add the computed dq (ops_checks.h check_dq_accum).
//   with *variants = window_left, window_right, softcap, alibi_slopes, dropout_p,
//                    rng_state, attn_mask
//   fwd also takes block_table, cache_batch_idx, cache_leftpad, then k_descale,
//   v_descale last, varlen_fwd block_table (KV cache addressing, forward only;
//   params.h). k_descale / v_descale: an FP8 (float8_e4m3fn) KV cache under a
//   16-bit q (ops_params.h apply_kv_fp8; the CPU kernel dequantises its tiles).
//   flash_attn_ext::varlen_fwd / varlen_bwd: the same over packed sequences
//       (cu_seqlens_q / cu_seqlens_k, max_seqlen_q / max_seqlen_k; causal is
//       bottom-right per sequence, as flash-attn's varlen API).
//   flash_attn_ext::dropout_mask(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p)
//       -> bool [batch, heads, seqlen_q, seqlen_k]: the keep-mask dropout applies.
//   flash_attn_ext::sdpa_fwd(query, key, value, softmax_scale, causal, dropout_p, rng_state,
//                            attn_mask) -> (out, lse): fwd in torch SDPA's layout [batch,
//       heads, seqlen, head_dim], top-left causal (scaled_dot_product_attention's
//       inference path; no autograd).
//   flash_attn_ext::fwd_fp8(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
//                           causal_bottom_right, out_dtype) -> (out, lse): e4m3 inputs
//       (csrc/ops_fp8.h), Hopper only (cuda/ops_fp8_cuda.cpp); the CPU raises
//       NotImplementedError.
//   flash_attn_ext::varlen_fwd_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
//                                  max_seqlen_k, q_descale, k_descale, v_descale,
//                                  softmax_scale, causal, out_dtype) -> (out, lse): the same
//       for packed sequences (varlen_fwd's layout; descales per sequence and kv head).
//   flash_attn_ext::merge_partial_(out, lse, block_outs, block_lses, prev_out=None) -> ():
//       folds 1 to 8 blocks' partial results (block_outs[j], block_lses[j]: forwards over
//       some of the keys) into the running (out, lse), in place, by the log-sum-exp;
//       prev_out, when given, is read as the running output instead of out (out is then
//       only written, e.g. a 16-bit result from a float32 accumulator). A running result
//       with lse -inf is not read (a fresh one may hold anything). Ring attention's merge
//       (flash_attn_ext/distributed/merge.py; the formula: params.h, MergePartialParams).
//   flash_attn_ext::sum_partial_(out, pieces, prev=None) -> (): out = prev + pieces[0] + ...
//       (1 to 8 pieces of one shape and dtype; out and prev float32 or the pieces' dtype),
//       added in float32 in that order and rounded once; prev may be out itself. Ring
//       attention's gradient sums (params.h, SumPartialParams).
//
// Padded: q/k/v/out/dout are [batch, seqlen, heads, head_dim] with any batch,
// seqlen and head strides and a contiguous last dim; lse is [batch, heads,
// seqlen_q] float32. k/v may have fewer heads than q (GQA / MQA). Varlen:
// [total, heads, head_dim] and lse [heads, total_q]. seqused_k (int32
// [batch]) limits the keys of each sequence. window_left / window_right
// (-1 = unbounded), softcap (0 = off) and alibi_slopes (float32 [heads] or
// [batch, heads]) are flash-attn's variants, aligned like causal (see
// csrc/params.h, csrc/mask.h). The CUDA implementations live in
// csrc/cuda/ops_cuda.cpp.
#include <torch/library.h>

#include <limits>
#include <optional>
#include <tuple>

#include "cpu/attention_cpu.h"
#include "ops_common.h"
#include "ops_fp8.h"

namespace flash_attn_ext {

namespace {

// Varlen: the kernels write every row of every sequence, so only the out rows
// past the last one, which belong to none, need zeros. cu_seqlens_q are host
// values here, checked (ops_checks.h: check_cu_seqlens).
void zero_rows_past_sequences(const at::Tensor& out, const AttentionFwdParams& p) {
  if (p.cu_seqlens_q == nullptr) return;
  const int64_t rows = p.cu_seqlens_q[p.batch];
  if (rows < out.size(0)) out.narrow(0, rows, out.size(0) - rows).zero_();
}

// Allocates out / lse like q (packed 3-D q for varlen: the rows outside every
// sequence zeroed, lse -inf there) and runs the CPU kernel.
std::tuple<at::Tensor, at::Tensor> run_fwd_cpu(AttentionFwdParams p, const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu(), "flash_attn_ext: fwd (CPU) got q on ", q.device());
  const bool varlen = p.cu_seqlens_q != nullptr;
  at::Tensor out = empty_out(q, p.head_dim_v);
  zero_rows_past_sequences(out, p);
  at::Tensor lse = empty_lse(q);
  if (varlen) lse.fill_(-std::numeric_limits<float>::infinity());
  p.out = out.data_ptr();
  p.out_strides = strides_of(out);
  p.lse = lse.data_ptr<float>();
  cpu::run_fwd(p);
  return {out, lse};
}

// dk / dv are zero-filled when some keys may be in no sequence or unused.
// dsink (with a learnable sink): its gradient is added into it (add_sink_grad).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_bwd_cpu(AttentionBwdParams p,
                                                           const at::Tensor& q,
                                                           const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           const at::Tensor& lse,
                                                           const std::optional<at::Tensor>& sink,
                                                           const std::optional<at::Tensor>& dsink) {
  TORCH_CHECK(q.device().is_cpu(), "flash_attn_ext: bwd (CPU) got q on ", q.device());
  const bool partial = has_var_seqs(p);
  auto alloc = [&](const at::Tensor& t) { return partial ? at::zeros_like(t) : at::empty_like(t); };
  at::Tensor dq = alloc(q), dk = alloc(k), dv = alloc(v);
  // Zeros where the sink's gradient reads rows outside every sequence.
  at::Tensor dsoftmax_sum = dsink.has_value()
                                ? at::zeros({p.q_rows_total}, q.options().dtype(at::kFloat))
                                : at::empty({p.q_rows_total}, q.options().dtype(at::kFloat));
  set_grad_outputs(p, dq, dk, dv);
  p.dsoftmax_sum = dsoftmax_sum.data_ptr<float>();
  cpu::run_bwd(p);
  if (dsink.has_value()) add_sink_grad(*dsink, *sink, lse, dsoftmax_sum);
  return {dq, dk, dv};
}

// The bwd operators' dq_accum on the CPU: dQ / softmax_scale added into it,
// dq returned empty (check_dq_accum).
std::tuple<at::Tensor, at::Tensor, at::Tensor> accumulate_dq(
    std::tuple<at::Tensor, at::Tensor, at::Tensor> grads,
    const std::optional<at::Tensor>& dq_accum, double softmax_scale, bool packed) {
  if (!dq_accum.has_value()) return grads;
  auto& [dq, dk, dv] = grads;
  add_into_dq_accum(*dq_accum, dq, softmax_scale, packed);
  return {at::empty({0}, dq.options()), dk, dv};
}

}  // namespace

static std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k,
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
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const KVCacheArgs cache{block_table, cache_batch_idx, cache_leftpad, k_descale, v_descale};
  const AttentionFwdParams p = make_fwd_params(q, k, v, softmax_scale, causal, causal_bottom_right,
                                               seqused_k, &var, &cache);
  check_fwd_tuning_args(num_splits, tile);  // accepted and ignored: one CPU kernel
  return run_fwd_cpu(p, q);
}

static std::tuple<at::Tensor, at::Tensor> sdpa_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double softmax_scale,
    bool causal, double dropout_p, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& attn_mask) {
  return sdpa_fwd_via(fwd_cpu, query, key, value, softmax_scale, causal, dropout_p, rng_state,
                      attn_mask);
}

static std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, const std::optional<at::Tensor>& seqused_k,
    int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& block_table) {
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const AttentionFwdParams p = make_varlen_fwd_params(
      q, k, v, {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k}, softmax_scale, causal,
      seqused_k, &var, block_table);
  return run_fwd_cpu(p, q);
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
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
  return accumulate_dq(run_bwd_cpu(p, q, k, v, lse, learnable_sink, dsink), dq_accum,
                       softmax_scale, /*packed=*/false);
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, bool deterministic,
    const std::optional<at::Tensor>& seqused_k, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& dq_accum,
    const std::optional<at::Tensor>& dsink) {
  const VariantArgs var{window_left, window_right, softcap,   alibi_slopes,
                         dropout_p,   rng_state,    attn_mask, learnable_sink};
  const AttentionBwdParams p = make_varlen_bwd_params(
      dout, q, k, v, out, lse, {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k},
      softmax_scale, causal, deterministic, seqused_k, &var);
  check_dq_accum(dq_accum, q, /*packed=*/true, softmax_scale);
  check_dsink(dsink, learnable_sink, q);
  return accumulate_dq(run_bwd_cpu(p, q, k, v, lse, learnable_sink, dsink), dq_accum,
                       softmax_scale, /*packed=*/true);
}

// The dropout keep-mask (csrc/dropout.h) as bool [batch, heads, seqlen_q,
// seqlen_k]: what the kernels apply for this rng_state and dropout_p.
static at::Tensor dropout_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                                   int64_t seqlen_q, int64_t seqlen_k, double dropout_p) {
  const AttentionFwdParams p =
      make_dropout_mask_params(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p);
  at::Tensor mask = at::ones({batch, heads, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  if (!has_dropout(p)) return mask;
  bool* m = mask.data_ptr<bool>();
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const Dropout d = make_dropout(p, static_cast<int>(bh / heads), static_cast<int>(bh % heads));
    for (int i = 0; i < p.seqlen_q; ++i) {
      bool* row = m + (bh * seqlen_q + i) * seqlen_k;
      for (int j = 0; j < p.seqlen_k; ++j) row[j] = d.keep(i, j);
    }
  }
  return mask;
}

std::tuple<at::Tensor, at::Tensor> fwd_fp8_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& q_descale,
                                               const at::Tensor& k_descale,
                                               const at::Tensor& v_descale, double softmax_scale,
                                               bool causal, bool causal_bottom_right,
                                               at::ScalarType out_dtype) {
  make_fwd_fp8_params(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                      causal_bottom_right, out_dtype);  // bad arguments first
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "flash_attn_ext: the FP8 forward runs on Hopper (sm_90) GPUs only "
                              "(FP8 wgmma); on the CPU dequantise the inputs (x.float() * "
                              "descale) and call flash_attn_func");
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_fp8_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const at::Tensor& q_descale, const at::Tensor& k_descale,
    const at::Tensor& v_descale, double softmax_scale, bool causal, at::ScalarType out_dtype) {
  const VarlenArgs va{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  make_fwd_fp8_params(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                      /*causal_bottom_right=*/true, out_dtype, &va);  // bad arguments first
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "flash_attn_ext: the FP8 forward runs on Hopper (sm_90) GPUs only "
                              "(FP8 wgmma); on the CPU dequantise the inputs (x.float() * "
                              "descale) and call flash_attn_varlen_func");
}

// merge_partial_ with ATen ops in float32 (the CUDA kernel does it in one pass:
// cuda/partial_results.cu), the same formula: weights exp(lse_j - lse'), terms
// of weight 0 skipped.
void merge_partial_cpu(at::Tensor out, at::Tensor lse, const std::vector<at::Tensor>& block_outs,
                       const std::vector<at::Tensor>& block_lses,
                       const std::optional<at::Tensor>& prev_out) {
  make_merge_partial_params(out, lse, block_outs, block_lses, prev_out);  // the checks
  std::vector<at::Tensor> lses{lse};
  lses.insert(lses.end(), block_lses.begin(), block_lses.end());
  const at::Tensor all = at::stack(lses);
  const at::Tensor merged = at::logsumexp(all, 0);
  // Rows without any key: every weight 0 (exp(-inf - 0)), out 0.
  const at::Tensor weights = at::exp(all - merged.masked_fill(at::isneginf(merged), 0.0));
  const int64_t seq_dim = out.dim() - 3;
  std::vector<at::Tensor> terms{prev_out.has_value() ? *prev_out : out};
  terms.insert(terms.end(), block_outs.begin(), block_outs.end());
  at::Tensor sum = at::zeros(out.sizes(), out.options().dtype(at::kFloat));
  for (size_t j = 0; j < terms.size(); ++j) {
    const at::Tensor w = weights[static_cast<int64_t>(j)].movedim(-1, seq_dim).unsqueeze(-1);
    // where(): a term of weight 0 is not read (a fresh result may hold NaNs).
    sum.add_(at::where(w > 0, w * terms[j].to(at::kFloat), at::zeros_like(w)));
  }
  out.copy_(sum);
  lse.copy_(merged);
}

// sum_partial_ with ATen ops: a float32 sum, added in the CUDA kernel's order.
void sum_partial_cpu(at::Tensor out, const std::vector<at::Tensor>& pieces,
                     const std::optional<at::Tensor>& prev) {
  make_sum_partial_params(out, pieces, prev);  // the checks
  at::Tensor sum = prev.has_value() ? prev->to(at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                                    : at::zeros(out.sizes(), out.options().dtype(at::kFloat));
  for (const at::Tensor& piece : pieces) sum.add_(piece);
  out.copy_(sum);
}

// The attention variants (flash-attn's window_size, softcap, alibi_slopes,
// dropout_p with its rng_state = {seed, offset}, and torch SDPA's attn_mask),
// the last arguments of every operator; their defaults turn them off.
#define FAE_VARIANT_ARGS                                                                     \
  "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, " \
  "float dropout_p=0.0, Tensor? rng_state=None, Tensor? attn_mask=None, " \
  "Tensor? learnable_sink=None"

// The KV cache addressing of the forward operators (flash-attn's names; see
// params.h): a paged cache's block table, and per batch entry the cache row
// and the left padding. Forward only: the backward operators have none. fwd's
// k_descale / v_descale (last): the factors of an FP8 KV cache.
TORCH_LIBRARY(flash_attn_ext, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "bool causal_bottom_right, int num_splits=0, int tile=0, Tensor? seqused_k=None, "
      FAE_VARIANT_ARGS ", Tensor? block_table=None, Tensor? cache_batch_idx=None, "
      "Tensor? cache_leftpad=None, Tensor? k_descale=None, Tensor? v_descale=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, bool causal_bottom_right, bool deterministic=False, "
      "Tensor? seqused_k=None, " FAE_VARIANT_ARGS ", Tensor(a!)? dq_accum=None, "
      "Tensor(b!)? dsink=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
      "Tensor? seqused_k=None, " FAE_VARIANT_ARGS ", Tensor? block_table=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
      "float softmax_scale, bool causal, bool deterministic=False, Tensor? seqused_k=None, "
      FAE_VARIANT_ARGS ", Tensor(a!)? dq_accum=None, Tensor(b!)? dsink=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "dropout_mask(Tensor rng_state, int batch, int heads, int seqlen_q, int seqlen_k, "
      "float dropout_p) -> Tensor");
  m.def(
      "sdpa_fwd(Tensor query, Tensor key, Tensor value, float softmax_scale, bool causal, "
      "float dropout_p=0.0, Tensor? rng_state=None, Tensor? attn_mask=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor q_descale, Tensor k_descale, "
      "Tensor v_descale, float softmax_scale, bool causal, bool causal_bottom_right, "
      "ScalarType out_dtype) -> (Tensor out, Tensor lse)");
  m.def(
      "varlen_fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, Tensor q_descale, Tensor k_descale, "
      "Tensor v_descale, float softmax_scale, bool causal, ScalarType out_dtype) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "merge_partial_(Tensor(a!) out, Tensor(b!) lse, Tensor[] block_outs, "
      "Tensor[] block_lses, Tensor? prev_out=None) -> ()");
  m.def("sum_partial_(Tensor(a!) out, Tensor[] pieces, Tensor? prev=None) -> ()");
}
#undef FAE_VARIANT_ARGS

TORCH_LIBRARY_IMPL(flash_attn_ext, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("varlen_fwd", &varlen_fwd_cpu);
  m.impl("varlen_bwd", &varlen_bwd_cpu);
  m.impl("dropout_mask", &dropout_mask_cpu);
  m.impl("fwd_fp8", &fwd_fp8_cpu);
  m.impl("varlen_fwd_fp8", &varlen_fwd_fp8_cpu);
  m.impl("sdpa_fwd", &sdpa_fwd_cpu);
  m.impl("merge_partial_", &merge_partial_cpu);
  m.impl("sum_partial_", &sum_partial_cpu);
}

}  // namespace flash_attn_ext
