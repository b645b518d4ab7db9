// The translation of torch tensors into the plain params structs that kernels
// consume (params.h): AttentionFwdParams (padded, varlen, KV cache, FP8 KV,
// variants, dropout_mask), AttentionBwdParams, MergePartialParams and
// SumPartialParams, through the apply_* / make_* / fill_* / set_* helpers and
// point_at_inputs, with the argument bundles they take (VariantArgs,
// KVCacheArgs). Separate from ops_checks.h, whose plain input checks these use,
// so that the checks read on their own; validation that depends on params
// fields (window canonicalisation, page sizes, descales) stays with its filling.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dropout.h"
#include "ops_checks.h"
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

// Strides of a [batch, seqlen, heads, dim] tensor, or of a packed [total, heads,
// dim] one seen as [1, total, heads, dim]. A batch dimension of size 1 gets
// stride 0: it is never stepped by a padded call, and varlen calls walk batch
// indices 0..B-1 over it while their rows come from cu_seqlens (params.h).
inline TensorStrides strides_of(const at::Tensor& t) {
  const at::Tensor v = as_4d(t);
  return TensorStrides{v.size(0) == 1 ? 0 : v.stride(0), v.stride(1), v.stride(2)};
}

// flash-attn's window_size / softcap / alibi_slopes / dropout_p and torch
// SDPA's attn_mask as the operators receive them (defaults: off). rng_state:
// int64 [2] = {seed, offset} on q's device, needed when dropout_p > 0.
struct VariantArgs {
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
  double dropout_p = 0.0;
  std::optional<at::Tensor> rng_state;
  std::optional<at::Tensor> attn_mask;
  // Not a variant (the kernels without variants take it too), but passed with
  // them: gpt-oss's learnable sink, float32 [heads] (params.h).
  std::optional<at::Tensor> learnable_sink;
};

inline BiasType to_bias_type(at::ScalarType t) {
  switch (t) {
    case at::kBool: return BiasType::kBool;
    case at::kFloat: return BiasType::kFloat32;
    case at::kHalf: return BiasType::kFloat16;
    case at::kBFloat16: return BiasType::kBFloat16;
    default:
      TORCH_CHECK(false, "flash_attn_ext: attn_mask must be bool, float32, float16 or bfloat16, "
                  "got ", t);
  }
}

// attn_mask: broadcastable to [batch, heads, seqlen_q, seqlen_k] (torch SDPA's
// rule: its trailing dims line up with those, each of size 1 or the full
// size); kept as is, broadcast dims get stride 0.
inline void apply_attn_mask(AttentionFwdParams& p, const at::Tensor& m, const at::Tensor& q) {
  TORCH_CHECK(m.device() == q.device(), "flash_attn_ext: attn_mask must be on the device of q (",
              q.device(), "), got ", m.device());
  const BiasType type = to_bias_type(m.scalar_type());
  const int64_t full[4] = {p.batch, p.heads, p.seqlen_q, p.seqlen_k};
  bool ok = m.dim() >= 1 && m.dim() <= 4;
  int64_t strides[4] = {0, 0, 0, 0};
  for (int64_t d = 0; ok && d < m.dim(); ++d) {
    const int64_t target = 4 - m.dim() + d;
    const int64_t size = m.size(d);
    ok = size == full[target] || size == 1;
    strides[target] = size == 1 ? 0 : m.stride(d);
  }
  TORCH_CHECK(ok, "flash_attn_ext: attn_mask of shape ", m.sizes(),
              " is not broadcastable to [batch, heads, seqlen_q, seqlen_k] = [", p.batch, ", ",
              p.heads, ", ", p.seqlen_q, ", ", p.seqlen_k, "]");
  p.attn_bias = m.data_ptr();
  p.attn_bias_type = type;
  p.attn_bias_strides = BiasStrides{strides[0], strides[1], strides[2], strides[3]};
}

inline void apply_dropout(AttentionFwdParams& p, double dropout_p,
                          const std::optional<at::Tensor>& rng_state, const at::Tensor& q) {
  TORCH_CHECK(std::isfinite(dropout_p) && dropout_p >= 0.0 && dropout_p < 1.0,
              "flash_attn_ext: dropout_p must be in [0, 1), got ", dropout_p);
  dropout_threshold_and_scale(dropout_p, p.dropout_threshold, p.dropout_scale);
  if (p.dropout_threshold == 0) return;
  TORCH_CHECK(rng_state.has_value(), "flash_attn_ext: dropout_p > 0 needs rng_state (int64 [2] "
              "= {seed, offset} on the device of q)");
  const at::Tensor& r = *rng_state;
  TORCH_CHECK(r.scalar_type() == at::kLong && r.numel() == 2 && r.is_contiguous(),
              "flash_attn_ext: rng_state must be a contiguous int64 tensor of 2 elements, got ",
              r.scalar_type(), " of shape ", r.sizes());
  TORCH_CHECK(r.device() == q.device(), "flash_attn_ext: rng_state must be on the device of q (",
              q.device(), "), got ", r.device());
  p.rng_state = r.data_ptr<int64_t>();
}

// Validates the variants and stores them in canonical form (params.h): after
// p.batch / p.heads / p.seqlen_q / p.seqlen_k (the longest sequences for
// varlen) and p.causal are set. bottom_right: the alignment of the diagonal
// that windows and ALiBi share with causal.
inline void apply_variants(AttentionFwdParams& p, const VariantArgs& va, const at::Tensor& q,
                           bool bottom_right) {
  TORCH_CHECK(va.window_left >= -1 && va.window_right >= -1,
              "flash_attn_ext: window_size entries must be >= 0, or -1 for unbounded, got (",
              va.window_left, ", ", va.window_right, ")");
  TORCH_CHECK(std::isfinite(va.softcap) && va.softcap >= 0.0,
              "flash_attn_ext: softcap must be a finite number >= 0 (0 = off), got ", va.softcap);
  // Causal: right bound 0 whatever window_size says (flash-attn's rule).
  int64_t left = va.window_left, right = p.causal ? -1 : va.window_right;
  // Bounds that every row already satisfies are dropped (exactly equivalent):
  // bottom-right, row i's window starts at i + seqlen_k - seqlen_q - left <= 0
  // for every row once left >= seqlen_k - 1, and ends at or after its last
  // key once right >= seqlen_q - 1; top-left, the other way round.
  const int64_t full_left = (bottom_right ? p.seqlen_k : p.seqlen_q) - 1;
  const int64_t full_right = (bottom_right ? p.seqlen_q : p.seqlen_k) - 1;
  if (left >= full_left) left = -1;
  if (right >= full_right) right = -1;
  if (!p.causal && left < 0 && right == 0) {  // window (-1, 0) is causal
    p.causal = true;
    right = -1;
  }
  p.window_left = static_cast<int>(left);
  p.window_right = static_cast<int>(right);
  p.softcap = static_cast<float>(va.softcap);
  if (va.alibi_slopes.has_value()) {
    const at::Tensor& a = *va.alibi_slopes;
    TORCH_CHECK(a.scalar_type() == at::kFloat, "flash_attn_ext: alibi_slopes must be float32, got ",
                a.scalar_type());
    TORCH_CHECK(a.device() == q.device(), "flash_attn_ext: alibi_slopes must be on the device of q (",
                q.device(), "), got ", a.device());
    const bool per_head = a.dim() == 1 && a.size(0) == p.heads;
    const bool per_batch = a.dim() == 2 && a.size(0) == p.batch && a.size(1) == p.heads;
    TORCH_CHECK(per_head || per_batch, "flash_attn_ext: alibi_slopes must have shape [heads] = [",
                p.heads, "] or [batch, heads] = [", p.batch, ", ", p.heads, "], got ", a.sizes());
    TORCH_CHECK(a.stride(-1) == 1 || a.size(-1) == 1,
                "flash_attn_ext: alibi_slopes must have a contiguous last dimension");
    p.alibi_slopes = a.data_ptr<float>();
    p.alibi_slopes_batch_stride = per_batch && a.size(0) > 1 ? a.stride(0) : 0;
  }
  if (va.attn_mask.has_value()) {
    TORCH_CHECK(p.cu_seqlens_q == nullptr,
                "flash_attn_ext: attn_mask is not supported with packed (varlen) sequences");
    apply_attn_mask(p, *va.attn_mask, q);
  }
  apply_dropout(p, va.dropout_p, va.rng_state, q);
  if (va.learnable_sink.has_value()) {
    const at::Tensor& s = *va.learnable_sink;
    TORCH_CHECK(s.scalar_type() == at::kFloat, "flash_attn_ext: learnable_sink must be float32, "
                "got ", s.scalar_type());
    TORCH_CHECK(s.device() == q.device(), "flash_attn_ext: learnable_sink must be on the device "
                "of q (", q.device(), "), got ", s.device());
    TORCH_CHECK(s.dim() == 1 && s.size(0) == p.heads, "flash_attn_ext: learnable_sink must have "
                "shape [heads] = [", p.heads, "] (one logit per query head), got ", s.sizes());
    TORCH_CHECK(s.stride(0) == 1 || s.size(0) == 1,
                "flash_attn_ext: learnable_sink must be contiguous");
    p.learnable_sink = s.data_ptr<float>();
  }
  if (p.causal || has_window(p) || p.alibi_slopes != nullptr) {  // the diagonal matters
    p.causal_bottom_right = bottom_right;
    p.causal_offset = bottom_right ? p.seqlen_k - p.seqlen_q : 0;
  }
}

// flash-attn's KV cache addressing as the forward operators receive it
// (params.h, "KV cache addressing"): block_table int32 [batch, max_pages] with
// k / v pools [num_pages, page_size, heads_k, dim]; cache_batch_idx and
// cache_leftpad int32 [batch].
// k_descale / v_descale: the dequantisation factors of an FP8 (e4m3) cache
// (apply_kv_fp8), required with one and rejected otherwise.
struct KVCacheArgs {
  std::optional<at::Tensor> block_table;
  std::optional<at::Tensor> cache_batch_idx;
  std::optional<at::Tensor> cache_leftpad;
  std::optional<at::Tensor> k_descale = {};
  std::optional<at::Tensor> v_descale = {};

  // k / v have their own batch dimension (pages, or cache rows picked per entry).
  bool indexes_kv_batch() const { return block_table.has_value() || cache_batch_idx.has_value(); }
};

// Validates the KV cache addressing against k (4-D: the cache, or the page
// pool) and fills its params fields, after p.batch is set. A paged cache's key
// capacity, max_pages * page_size, becomes p.seqlen_k (varlen callers cap it).
inline void apply_kv_cache(AttentionFwdParams& p, const KVCacheArgs& c, const at::Tensor& q,
                           const at::Tensor& k) {
  if (c.block_table.has_value()) {
    TORCH_CHECK(!c.cache_batch_idx.has_value(),
                "flash_attn_ext: cache_batch_idx cannot be combined with block_table (a paged "
                "KV cache selects each sequence's pages through its block_table row)");
    TORCH_CHECK_NOT_IMPLEMENTED(!c.cache_leftpad.has_value(),
                                "flash_attn_ext: cache_leftpad with a paged KV cache (block_table) "
                                "is not implemented");
    const at::Tensor& t = *c.block_table;
    TORCH_CHECK(t.scalar_type() == at::kInt, "flash_attn_ext: block_table must be int32, got ",
                t.scalar_type());
    TORCH_CHECK(t.device() == q.device(), "flash_attn_ext: block_table must be on the device of q (",
                q.device(), "), got ", t.device());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == p.batch && t.size(1) >= 1,
                "flash_attn_ext: block_table must have shape [batch, max_pages] = [", p.batch,
                ", >= 1], got ", t.sizes());
    TORCH_CHECK(t.stride(1) == 1 || t.size(1) == 1,
                "flash_attn_ext: block_table must have a contiguous last dimension");
    const int64_t page_size = k.size(1);
    TORCH_CHECK(page_size % kKVPageRowAlign == 0, "flash_attn_ext: a paged KV cache needs a page "
                "size (k_cache.shape[1]) that is a multiple of ", kKVPageRowAlign, ", got ",
                page_size);
    const int64_t capacity = t.size(1) * page_size;
    TORCH_CHECK(capacity <= std::numeric_limits<int>::max(),
                "flash_attn_ext: block_table addresses too many keys (", t.size(1), " pages x ",
                page_size, ")");
    p.block_table = t.data_ptr<int>();
    p.block_table_batch_stride = t.size(0) > 1 ? t.stride(0) : 0;
    p.block_table_pages = static_cast<int>(t.size(1));
    p.page_size = static_cast<int>(page_size);
    p.num_pages = static_cast<int>(k.size(0));
    p.seqlen_k = static_cast<int>(capacity);
  }
  if (c.cache_batch_idx.has_value()) {
    check_seq_tensor(*c.cache_batch_idx, "cache_batch_idx", q, p.batch);
    p.kv_batch_idx = c.cache_batch_idx->data_ptr<int>();
    p.kv_batch = static_cast<int>(k.size(0));
  }
  if (c.cache_leftpad.has_value()) {
    check_seq_tensor(*c.cache_leftpad, "cache_leftpad", q, p.batch);
    p.leftpad_k = c.cache_leftpad->data_ptr<int>();
  }
}

inline bool is_fp8_kv(const at::Tensor& k, const at::Tensor& v) {
  return k.scalar_type() == at::kFloat8_e4m3fn || v.scalar_type() == at::kFloat8_e4m3fn;
}

// An FP8 tensor's dequantisation factor (FA3's q_descale / k_descale /
// v_descale): fp32 on q's device, one factor ([] / [1]) or one per (query
// batch entry, kv head) ([batch, heads_k], any strides; with cache_batch_idx
// or a block table row b is that of q's batch entry b, not of a cache row).
inline Descale make_descale(const at::Tensor& d, const char* name, const at::Tensor& q,
                               int64_t batch, int64_t heads_k) {
  TORCH_CHECK(d.defined(), "flash_attn_ext: ", name, " is undefined");
  TORCH_CHECK(d.scalar_type() == at::kFloat, "flash_attn_ext: ", name,
              " must be float32, got ", d.scalar_type());
  TORCH_CHECK(d.device() == q.device(), "flash_attn_ext: ", name,
              " must be on the device of q (", q.device(), "), got ", d.device());
  Descale out;
  out.ptr = d.data_ptr<float>();
  if (d.numel() == 1 && d.dim() <= 2) return out;  // one factor: strides 0
  TORCH_CHECK(d.dim() == 2 && d.size(0) == batch && d.size(1) == heads_k, "flash_attn_ext: ",
              name, " must have shape [], [1] or [batch, heads_k] = [", batch, ", ", heads_k,
              "], got ", d.sizes());
  out.batch_stride = d.stride(0);
  out.head_stride = d.stride(1);
  return out;
}

// An FP8 (float8_e4m3fn) KV cache under a 16-bit q (params.h kv_dtype): both
// k and v in e4m3, k_descale and v_descale given; after p.batch / p.heads_k.
// Descales with a 16-bit cache are an error. The forward operator only (the
// KV cache path): the backward and varlen operators reject FP8 k / v.
inline void apply_kv_fp8(AttentionFwdParams& p, const KVCacheArgs& c, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v) {
  if (!is_fp8_kv(k, v)) {
    TORCH_CHECK(!c.k_descale.has_value() && !c.v_descale.has_value(),
                "flash_attn_ext: k_descale / v_descale are the dequantisation factors of an FP8 "
                "(float8_e4m3fn) KV cache, but k / v have dtype ", k.scalar_type());
    return;
  }
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "flash_attn_ext: k and v must have the same "
              "dtype, got ", k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "flash_attn_ext: q, k and v must be on the same device, got ", q.device(), ", ",
              k.device(), " and ", v.device());
  TORCH_CHECK_NOT_IMPLEMENTED(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                              "flash_attn_ext: an FP8 KV cache needs q in float16 or bfloat16 "
                              "(float32 q is not implemented), got ", q.scalar_type());
  TORCH_CHECK(c.k_descale.has_value() && c.v_descale.has_value(),
              "flash_attn_ext: an FP8 (float8_e4m3fn) KV cache needs k_descale and v_descale "
              "(float32, shape [], [1] or [batch, heads_k] = [", p.batch, ", ", p.heads_k,
              "]; pass torch.ones((), device=q.device) for a cache stored unscaled)");
  p.kv_dtype = DType::kFloat8E4M3;
  p.k_descale = make_descale(*c.k_descale, "k_descale", q, p.batch, p.heads_k);
  p.v_descale = make_descale(*c.v_descale, "v_descale", q, p.batch, p.heads_k);
}

// Points the params at q, k, v ([batch, seqlen, heads, head_dim] or packed
// 3-D) and their strides; the op layers re-point them at kernel-friendly
// copies with this too.
inline void point_at_inputs(AttentionFwdParams& p, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_strides = strides_of(q);
  p.k_strides = strides_of(k);
  p.v_strides = strides_of(v);
  p.head_dim = static_cast<int>(q.size(-1));
  p.head_dim_v = static_cast<int>(v.size(-1));
}

// Pointers, sizes, scale, causal alignment and the lse layout ([batch, heads,
// seqlen_q]) of a padded forward call, from checked q, k, v.
inline void fill_padded_params(AttentionFwdParams& p, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, double softmax_scale, bool causal,
                               bool causal_bottom_right) {
  point_at_inputs(p, q, k, v);
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.heads = static_cast<int>(q.size(2));
  p.heads_k = static_cast<int>(k.size(2));
  p.seqlen_k = static_cast<int>(k.size(1));
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.causal_bottom_right = causal && causal_bottom_right;
  p.causal_offset = p.causal_bottom_right ? p.seqlen_k - p.seqlen_q : 0;
  p.lse_head_stride = p.seqlen_q;
  p.lse_batch_stride = static_cast<int64_t>(p.heads) * p.seqlen_q;
  p.q_rows_total = p.batch * p.lse_batch_stride;
}

// Validates q/k/v ([batch, seqlen, heads, head_dim]) and fills everything of
// AttentionFwdParams except the output pointers (which the device
// implementation allocates). seqused_k: optional int32 [batch] key counts.
// cache: the KV cache addressing (forward operator only); with a block table
// or cache_batch_idx, k / v have a batch size of their own.
inline AttentionFwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, double softmax_scale,
                                          bool causal, bool causal_bottom_right,
                                          const std::optional<at::Tensor>& seqused_k = {},
                                          const VariantArgs* variants = nullptr,
                                          const KVCacheArgs* cache = nullptr,
                                          bool kv_batch_free = false) {
  // An FP8 KV cache (float8_e4m3fn k / v under a 16-bit q): the forward
  // operator's KV cache path only (apply_kv_fp8).
  const bool kv_fp8 = cache != nullptr && is_fp8_kv(k, v);
  check_bshd(q, "q");
  check_bshd(k, "k", kv_fp8);
  check_bshd(v, "v", kv_fp8);
  if (!kv_fp8) {
    check_same(q, "q", k, "k");
    check_same(q, "q", v, "v");
  }
  check_qkv_shapes(q, k, v, !kv_batch_free && !(cache != nullptr && cache->indexes_kv_batch()));
  TORCH_CHECK(std::isfinite(softmax_scale), "flash_attn_ext: softmax_scale must be finite, got ",
              softmax_scale);

  AttentionFwdParams p;
  fill_padded_params(p, q, k, v, softmax_scale, causal, causal_bottom_right);
  p.dtype = to_dtype(q.scalar_type());
  p.kv_dtype = p.out_dtype = p.dtype;
  if (seqused_k.has_value()) {
    check_seq_tensor(*seqused_k, "seqused_k", q, q.size(0));
    p.seqused_k = seqused_k->data_ptr<int>();
  }
  if (cache != nullptr) {
    apply_kv_fp8(p, *cache, q, k, v);
    apply_kv_cache(p, *cache, q, k);
  }
  if (variants != nullptr) apply_variants(p, *variants, q, causal_bottom_right);
  return p;
}

// The varlen fields of params filled for [1, total, heads, dim] tensors: the
// cu_seqlens values (checked where that is cheap, above), the sequences' count and longest
// lengths, the packed totals, and lse [heads, total_q]. paged: k is a page
// pool, whose sequences' keys are the first rows of their pages (no total).
inline void apply_varlen(AttentionFwdParams& p, const at::Tensor& q, const at::Tensor& k,
                         const VarlenArgs& va, int64_t batch, bool paged) {
  check_cu_seqlens(va.cu_seqlens_q, "cu_seqlens_q", q.size(0), va.max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens(va.cu_seqlens_k, "cu_seqlens_k",
                   paged ? std::numeric_limits<int64_t>::max() : k.size(0), va.max_seqlen_k,
                   "max_seqlen_k");
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(va.max_seqlen_q);
  p.seqlen_k = static_cast<int>(va.max_seqlen_k);
  p.cu_seqlens_q = va.cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = va.cu_seqlens_k.data_ptr<int>();
  p.total_q = q.size(0);
  p.total_k = paged ? 0 : k.size(0);
  p.lse_batch_stride = 0;
  p.lse_head_stride = q.size(0);
  p.q_rows_total = static_cast<int64_t>(p.heads) * q.size(0);
}

// block_table (forward only): k / v are page pools [num_pages, page_size,
// heads_k, dim] and cu_seqlens_k only gives the key counts (flash-attn's
// paged varlen forward, e.g. chunked prefill against a paged cache).
inline AttentionFwdParams make_varlen_fwd_params(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const VarlenArgs& va,
                                                 double softmax_scale, bool causal,
                                                 const std::optional<at::Tensor>& seqused_k,
                                                 const VariantArgs* variants = nullptr,
                                                 const std::optional<at::Tensor>& block_table = {}) {
  const bool paged = block_table.has_value();
  check_varlen_3d(q, "q");
  if (paged) {
    TORCH_CHECK(k.defined() && k.dim() == 4 && v.defined() && v.dim() == 4,
                "flash_attn_ext: with a block_table, k and v must be 4-D page pools [num_pages, "
                "page_size, heads_k, head_dim], got shapes ", k.sizes(), " and ", v.sizes());
  } else {
    check_varlen_3d(k, "k");
    check_varlen_3d(v, "v");
  }
  const int64_t batch = varlen_batch(q, va);
  AttentionFwdParams p = make_fwd_params(q.unsqueeze(0), paged ? k : k.unsqueeze(0),
                                         paged ? v : v.unsqueeze(0), softmax_scale, causal,
                                         /*causal_bottom_right=*/true, {}, nullptr, nullptr,
                                         /*kv_batch_free=*/paged);
  apply_varlen(p, q, k, va, batch, paged);
  if (paged) {
    apply_kv_cache(p, KVCacheArgs{block_table, {}, {}}, q, k);
    TORCH_CHECK(va.max_seqlen_k <= p.seqlen_k, "flash_attn_ext: max_seqlen_k = ", va.max_seqlen_k,
                " exceeds the keys a block_table row addresses (", p.seqlen_k, ")");
    p.seqlen_k = static_cast<int>(va.max_seqlen_k);
  }
  if (seqused_k.has_value()) {
    check_seq_tensor(*seqused_k, "seqused_k", q, batch);
    p.seqused_k = seqused_k->data_ptr<int>();
  }
  if (variants != nullptr) apply_variants(p, *variants, q, /*bottom_right=*/true);
  return p;
}

// The dropout_mask operator's params: sizes, threshold and rng_state (its
// values checked like the attention operators' dropout arguments).
inline AttentionFwdParams make_dropout_mask_params(const at::Tensor& rng_state, int64_t batch,
                                                   int64_t heads, int64_t seqlen_q,
                                                   int64_t seqlen_k, double dropout_p) {
  TORCH_CHECK(batch >= 0 && heads >= 0 && seqlen_q >= 0 && seqlen_k >= 0 &&
                  batch * heads <= 65535 && seqlen_q <= 65535 &&
                  seqlen_k <= std::numeric_limits<int>::max(),
              "flash_attn_ext: dropout_mask sizes out of range (batch * heads and seqlen_q at "
              "most 65535): ", batch, ", ", heads, ", ", seqlen_q, ", ", seqlen_k);
  AttentionFwdParams p;
  p.batch = static_cast<int>(batch);
  p.heads = static_cast<int>(heads);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  apply_dropout(p, dropout_p, rng_state, rng_state);
  return p;
}

// Points the backward params at the gradient outputs.
inline void set_grad_outputs(AttentionBwdParams& p, const at::Tensor& dq, const at::Tensor& dk,
                             const at::Tensor& dv) {
  // dq undefined: the kernels add dQ into the caller's accumulator instead.
  p.dq = dq.defined() ? dq.data_ptr() : nullptr;
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_strides = dq.defined() ? strides_of(dq) : TensorStrides{};
  p.dk_strides = strides_of(dk);
  p.dv_strides = strides_of(dv);
}

// The forward's out shape (and dout's): q's, with v's head dim.
inline std::vector<int64_t> out_shape(const at::Tensor& q, int64_t head_dim_v) {
  std::vector<int64_t> shape = q.sizes().vec();
  shape.back() = head_dim_v;
  return shape;
}

// The forward's out: q's shape with v's head dim, in q's memory layout
// (empty_like(q) where the head dims agree; e.g. SDPA's transposed views keep
// [batch, heads, seqlen, head_dim] memory). Otherwise q's dimension order by
// stride (outermost first, ties in dimension order; the head dim is innermost,
// check_bshd), as ops.py's fake kernel orders them too.
inline at::Tensor empty_out(const at::Tensor& q, int64_t head_dim_v) {
  if (q.size(-1) == head_dim_v) return at::empty_like(q);
  std::vector<int64_t> order(q.dim());
  for (int64_t d = 0; d < q.dim(); ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return q.stride(a) > q.stride(b); });
  std::vector<int64_t> sizes(q.dim()), inverse(q.dim());
  for (int64_t i = 0; i < q.dim(); ++i) {
    sizes[i] = order[i] == q.dim() - 1 ? head_dim_v : q.size(order[i]);
    inverse[order[i]] = i;
  }
  return at::empty(sizes, q.options()).permute(inverse);
}

// The backward's own inputs on top of validated forward params. out / dout
// have q's shape with v's head dim (4-D here; varlen callers pass the
// unsqueezed views).
inline AttentionBwdParams add_bwd_inputs(const AttentionFwdParams& fwd, const at::Tensor& q,
                                         const at::Tensor& dout, const at::Tensor& out,
                                         const at::Tensor& lse, at::IntArrayRef lse_shape,
                                         bool deterministic) {
  check_bshd(out, "out");
  check_bshd(dout, "dout");
  check_same(q, "q", out, "out");
  check_same(q, "q", dout, "dout");
  const std::vector<int64_t> expected = out_shape(q, fwd.head_dim_v);
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), "flash_attn_ext: out must have the shape "
              "of q with v's head_dim, ", at::IntArrayRef(expected), ", got ", out.sizes());
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(expected), "flash_attn_ext: dout must have the "
              "shape of q with v's head_dim, ", at::IntArrayRef(expected), ", got ", dout.sizes());
  TORCH_CHECK(lse.defined() && lse.scalar_type() == at::kFloat,
              "flash_attn_ext: lse must be a float32 tensor");
  TORCH_CHECK(lse.device() == q.device(), "flash_attn_ext: lse must be on the device of q (",
              q.device(), "), got ", lse.device());
  TORCH_CHECK(lse.sizes() == lse_shape, "flash_attn_ext: lse must have shape ", lse_shape,
              " (", lse_shape.size() == 3 ? "[batch, heads, seqlen_q]" : "[heads, total_q]",
              "), got ", lse.sizes());
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

inline AttentionBwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& out, const at::Tensor& lse,
                                          double softmax_scale, bool causal,
                                          bool causal_bottom_right, bool deterministic,
                                          const std::optional<at::Tensor>& seqused_k = {},
                                          const VariantArgs* variants = nullptr) {
  const AttentionFwdParams fwd =
      make_fwd_params(q, k, v, softmax_scale, causal, causal_bottom_right, seqused_k, variants);
  return add_bwd_inputs(fwd, q, dout, out, lse, {q.size(0), q.size(2), q.size(1)}, deterministic);
}

inline AttentionBwdParams make_varlen_bwd_params(const at::Tensor& dout, const at::Tensor& q,
                                                 const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& out, const at::Tensor& lse,
                                                 const VarlenArgs& va, double softmax_scale,
                                                 bool causal, bool deterministic,
                                                 const std::optional<at::Tensor>& seqused_k,
                                                 const VariantArgs* variants = nullptr) {
  const AttentionFwdParams fwd =
      make_varlen_fwd_params(q, k, v, va, softmax_scale, causal, seqused_k, variants);
  check_varlen_3d(out, "out");
  check_varlen_3d(dout, "dout");
  AttentionBwdParams p = add_bwd_inputs(fwd, q.unsqueeze(0), dout.unsqueeze(0), out.unsqueeze(0),
                                        lse, {q.size(1), q.size(0)}, deterministic);
  return p;
}

// The rows of out (checked by check_partial_tensors) into the params.
inline void set_partial_rows(PartialRows& p, const at::Tensor& out) {
  const at::Tensor out4 = as_4d(out);
  p.batch = static_cast<int>(out4.size(0));
  p.seqlen = static_cast<int>(out4.size(1));
  p.heads = static_cast<int>(out4.size(2));
  p.head_dim = static_cast<int>(out4.size(3));
}

// flash_attn_ext::merge_partial_'s checks and params (params.h,
// MergePartialParams): check_partial_tensors' for out, prev_out and the
// block_outs, and lse and every block_lse float32 [batch, heads, seqlen] or
// [heads, total].
inline MergePartialParams make_merge_partial_params(const at::Tensor& out, const at::Tensor& lse,
                                                    const std::vector<at::Tensor>& block_outs,
                                                    const std::vector<at::Tensor>& block_lses,
                                                    const std::optional<at::Tensor>& prev_out) {
  check_partial_tensors("merge_partial_", out, prev_out, "prev_out", block_outs, "block_outs",
                        kMaxMergeBlocks, "blocks", "block_outs[0]'s");
  TORCH_CHECK(block_lses.size() == block_outs.size(), "flash_attn_ext: merge_partial_: ",
              block_outs.size(), " block_outs but ", block_lses.size(), " block_lses");
  const at::Tensor& prev = prev_out.has_value() ? *prev_out : out;
  const at::ScalarType block_dtype = block_outs[0].scalar_type();
  const bool packed = out.dim() == 3;
  const std::vector<int64_t> lse_shape =
      packed ? std::vector<int64_t>{out.size(1), out.size(0)}
             : std::vector<int64_t>{out.size(0), out.size(2), out.size(1)};
  auto check_lse = [&](const at::Tensor& t, const std::string& name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == lse_shape,
                "flash_attn_ext: merge_partial_: ", name, " must be float32 of shape ",
                at::IntArrayRef(lse_shape), " (",
                packed ? "[heads, total]" : "[batch, heads, seqlen]", "), got ",
                t.scalar_type(), " of shape ", t.sizes());
    TORCH_CHECK(t.device() == out.device(), "flash_attn_ext: merge_partial_: ", name,
                " must be on out's device ", out.device());
  };
  check_lse(lse, "lse");
  for (size_t i = 0; i < block_lses.size(); ++i) {
    check_lse(block_lses[i], "block_lses[" + std::to_string(i) + "]");
  }
  // lse strides as [batch, heads, seqlen] (a packed [heads, total] one as batch 1).
  auto lse_strides = [&](const at::Tensor& t, int64_t (&strides)[3]) {
    const at::Tensor t3 = packed ? t.unsqueeze(0) : t;
    for (int i = 0; i < 3; ++i) strides[i] = t3.size(i) == 1 ? 0 : t3.stride(i);
  };
  MergePartialParams p;
  set_partial_rows(p, out);
  p.num_blocks = static_cast<int>(block_outs.size());
  p.out = out.data_ptr();
  p.prev_out = prev.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.prev_dtype = to_dtype(prev.scalar_type());
  p.block_dtype = to_dtype(block_dtype);
  p.out_strides = strides_of(out);
  p.prev_strides = strides_of(prev);
  p.lse = lse.data_ptr<float>();
  lse_strides(lse, p.lse_strides);
  for (int i = 0; i < p.num_blocks; ++i) {
    p.block_outs[i] = block_outs[i].data_ptr();
    p.block_strides[i] = strides_of(block_outs[i]);
    p.block_lses[i] = block_lses[i].data_ptr<float>();
    lse_strides(block_lses[i], p.block_lse_strides[i]);
  }
  return p;
}

// flash_attn_ext::sum_partial_'s checks (check_partial_tensors') and params
// (params.h, SumPartialParams).
inline SumPartialParams make_sum_partial_params(const at::Tensor& out,
                                                const std::vector<at::Tensor>& pieces,
                                                const std::optional<at::Tensor>& prev) {
  check_partial_tensors("sum_partial_", out, prev, "prev", pieces, "pieces", kMaxSumPieces,
                        "pieces", "the first piece's");
  const at::ScalarType piece_dtype = pieces[0].scalar_type();
  SumPartialParams p;
  set_partial_rows(p, out);
  p.num_pieces = static_cast<int>(pieces.size());
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.out_strides = strides_of(out);
  if (prev.has_value()) {
    p.prev = prev->data_ptr();
    p.prev_dtype = to_dtype(prev->scalar_type());
    p.prev_strides = strides_of(*prev);
  }
  p.piece_dtype = to_dtype(piece_dtype);
  for (int i = 0; i < p.num_pieces; ++i) {
    p.pieces[i] = pieces[i].data_ptr();
    p.piece_strides[i] = strides_of(pieces[i]);
  }
  return p;
}

}  // namespace flash_attn_ext
