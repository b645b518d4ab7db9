// AttentionParams: everything a kernel needs, and nothing from torch.
//
// The C++ op layer (csrc/ops.cpp) validates tensors and fills these structs;
// the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda) only ever see
// raw pointers, sizes and element strides. Keeping torch types out of the
// kernels keeps the .cu files fast to compile and independent of torch's ABI.
//
// Layout convention: every [batch, seqlen, heads, head_dim] tensor is addressed
// as  base + b*batch_stride + s*row_stride + h*head_stride + d  (the last dim is
// contiguous, which ops.cpp checks). Both flash-attn's [B,S,H,D] and torch
// SDPA's [B,H,S,D] layouts are expressed by these strides, so neither needs a
// copy.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FAE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FAE_HOST_DEVICE inline
#endif

namespace flash_attn_ext {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };

// The element type of an attn_mask (params.attn_bias).
enum class BiasType : int { kNone = 0, kBool = 1, kFloat32 = 2, kFloat16 = 3, kBFloat16 = 4 };

// Strides (in elements) of an attn_mask seen as [batch, heads, seqlen_q, seqlen_k].
struct BiasStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
  int64_t col = 0;
};

// Rows and keys per block of the boolean attn_mask summary
// (AttentionFwdParams::attn_mask_blocks): the Hopper kernels' query tiles are
// 64 rows per warpgroup, their key tiles 64 to 176 keys.
constexpr int kMaskBlock = 64;

// The dequantisation factor of an FP8 (e4m3) tensor (FA3's q_descale /
// k_descale / v_descale): the real values are factor * the stored ones. The
// factor of (batch b, kv head hk) sits at ptr[b * batch_stride + hk *
// head_stride]; strides 0 = one factor for the whole tensor; ptr nullptr = 1.
// q's factors are per kv head too (query head h uses its kv head's, as FA3).
struct Descale {
  const float* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
};

FAE_HOST_DEVICE float descale_at(const Descale& d, int b, int h_k) {
  return d.ptr == nullptr ? 1.f : d.ptr[b * d.batch_stride + h_k * d.head_stride];
}

// Strides (in elements) of one [B, S, H, D] tensor.
struct TensorStrides {
  int64_t batch = 0;
  int64_t row = 0;   // seqlen dimension
  int64_t head = 0;
};

// Element offset of row `row` of (batch b, head h).
FAE_HOST_DEVICE int64_t row_offset(const TensorStrides& st, int b, int h, int64_t row) {
  return b * st.batch + h * st.head + row * st.row;
}

// Paged KV caches: pages hold a multiple of this many keys. The CUDA K/V tile
// loaders look a page up once per 16 consecutive rows of a tile (tiles start
// at multiples of 16 keys), which is exact only when no 16-row group
// straddles two pages; ops_params.h rejects other page sizes.
constexpr int kKVPageRowAlign = 16;

// Forward tile families of the CUDA mma.sync kernel (fwd_kernel_traits.cuh):
// the large per-head-dim tiles, the 16-row decode tile of one warp, and the
// 16-row decode tile whose 4 warps split each key tile ("key warps").
enum FwdTile : int {
  kFwdTileAuto = 0,
  kFwdTileLarge = 1,
  kFwdTileSmallM = 2,
  kFwdTileSmallMKeyWarps = 3,
};

struct AttentionFwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [batch, heads, seqlen_q], contiguous, natural log

  TensorStrides q_strides, k_strides, v_strides, out_strides;

  int batch = 0;
  int heads = 0;     // query heads
  int heads_k = 0;   // key/value heads: query head h reads kv head h / (heads / heads_k)
  int seqlen_q = 0;  // varlen: the longest query sequence (sizes the grid)
  int seqlen_k = 0;  // varlen: the longest key sequence
  int head_dim = 0;  // true head dim of q and k (kernels may pad internally)
  // v's head dim, and out's, dout's and dv's (DeepSeek MLA: 192 / 128 in
  // training, 576 / 512 decoding); equal to head_dim in most models. Set
  // by point_at_inputs (ops_params.h) from v.
  int head_dim_v = 0;

  DType dtype = DType::kFloat32;  // of q (and of k, v and out unless said below)
  // FP8 (kFloat8E4M3) calls: k / v may be e4m3 under a 16-bit q (an FP8 KV
  // cache; kv_dtype), and e4m3 q / k / v give a 16-bit out (out_dtype). The
  // scores are q_descale * k_descale * (q . k) and the output v_descale *
  // (P V): the kernels fold the factors into the softmax scale and the
  // epilogue, so the tiles stay in their stored type.
  DType kv_dtype = DType::kFloat32;
  DType out_dtype = DType::kFloat32;
  Descale q_descale, k_descale, v_descale;
  // The FP8 Hopper forward reads V transposed: e4m3 [batch, heads_k,
  // head_dim, v_transposed_seqlen] (keys contiguous, padded to a multiple of
  // 32 with zeros, each 32-key block in the order the P fragments want;
  // cuda/hopper/fp8_v_transpose.cu writes it from v before the kernel).
  void* v_transposed = nullptr;
  int64_t v_transposed_seqlen = 0;

  float softmax_scale = 1.f;
  float scale_log2 = 1.f;  // softmax_scale * log2(e): kernels use exp2

  // Causal masking with a single offset per sequence: key j is visible to
  // query i iff  j <= i + causal_offset  (see seq_bounds below). Top-left
  // alignment (torch SDPA) is offset 0; bottom-right alignment (flash-attn) is
  // offset seqlen_k - seqlen_q of that sequence.
  bool causal = false;
  bool causal_bottom_right = false;
  // The offset of a padded batch without seqused_k (every sequence alike):
  // seqlen_k - seqlen_q when bottom-right, else 0.
  int causal_offset = 0;

  // ---- attention variants (flash-attn's window_size, softcap, alibi_slopes) --
  // All are relative to the same diagonal as causal: query i of a sequence
  // "is at" key  i + causal_offset  (SeqBounds; bottom-right alignment gives
  // offset seqlen_k - seqlen_q, and causal_bottom_right is set whenever a
  // window or ALiBi is active, not only with causal).
  // Sliding window: key j is visible to query i iff
  //   i + offset - window_left <= j <= i + offset + window_right,
  // -1 = unbounded on that side. csrc/ops_params.h canonicalises: causal keeps
  // `causal` (its right bound is 0, window_right stays -1), window (-1, 0)
  // becomes causal, and bounds that no row can reach become -1, so
  // has_window() is false for a window wider than the sequences.
  int window_left = -1;
  int window_right = -1;
  // Logit softcapping: a scaled score s = softmax_scale * q.k becomes
  // softcap * tanh(s / softcap) before the softmax; 0 = off.
  float softcap = 0.f;
  // ALiBi: fp32 slopes, slope(b, h) = alibi_slopes[b * alibi_slopes_batch_stride
  // + h] (batch stride 0 for [heads] slopes); the bias
  // -slope * |i + offset - j| is added after the softcap. nullptr = off.
  const float* alibi_slopes = nullptr;
  int64_t alibi_slopes_batch_stride = 0;
  // Learnable attention sink (gpt-oss): fp32 [heads], one extra logit per
  // query head in every row's softmax denominator, exp(sink[h] - max), with no
  // value (its probability is dropped from the output); lse includes it. Only
  // the forward's epilogue reads it (OnlineSoftmax::finalize): the backward's
  // P = exp(S - lse) and D = rowsum(dO o O) already account for it, and
  // d_sink[h] = -sum_rows exp(sink[h] - lse) D comes from where D is formed:
  // the CUDA backward's preprocess kernel (per-block partials,
  // dsink_partials), the CPU's D rows (ops_outputs.h add_sink_grad). Not a
  // variant: the kernels without variants take it too. nullptr = off.
  const float* learnable_sink = nullptr;
  // attn_mask (torch SDPA's): an additive bias on the scores, after softcap and
  // ALiBi, or a boolean mask (false = -inf). Element (b, h, i, j) (query head h,
  // rows and keys numbered within the sequence) sits at
  //   attn_bias + b*batch + h*head + i*row + j*col   (attn_bias_strides, in
  // elements; 0 where the mask broadcasts). Read tile by tile, never copied.
  // Padded batches only (ops_params.h rejects it with varlen).
  const void* attn_bias = nullptr;
  BiasType attn_bias_type = BiasType::kNone;
  BiasStrides attn_bias_strides;
  // Summary of a boolean attn_mask per block of kMaskBlock x kMaskBlock
  // elements (cuda/common/mask_blocks.cuh; CUDA only, computed on the stream
  // before the Hopper kernels): bit 0 = some element attends, bit 1 = some
  // element is masked. Block (b, h, i / kMaskBlock, j / kMaskBlock) sits at
  // b*batch + h*head + (i / kMaskBlock)*row + (j / kMaskBlock)*col
  // (attn_mask_block_strides, 0 where the mask broadcasts). Key tiles without
  // an attending element are skipped, tiles without a masked one read no mask.
  // nullptr = no summary (the kernels read every element).
  uint8_t* attn_mask_blocks = nullptr;
  struct {
    int batch = 0, head = 0, row = 0, col = 0;  // int: the summary has < 2^31 blocks
  } attn_mask_block_strides;
  // Dropout on the attention probabilities (csrc/dropout.h): element (b, h, i, j)
  // is kept iff an 8-bit Philox random number is >= dropout_threshold
  // (round(dropout_p * 256), >= 1 for dropout_p > 0), and kept values are scaled
  // by dropout_scale = 256 / (256 - threshold), so the expectation is exact. The numbers come
  // from rng_state = {seed, offset} (int64 [2] on the kernels' device, drawn
  // from torch's generator by the Python layer and saved for the backward,
  // which regenerates the same mask). threshold 0 = off.
  uint32_t dropout_threshold = 0;
  float dropout_scale = 1.f;
  const int64_t* rng_state = nullptr;

  // ---- variable-length batches and key padding (all optional) -------------
  // Varlen: cu_seqlens_q / cu_seqlens_k (int32 [batch + 1], on the kernels'
  // device) hold the first row of each sequence in packed [total, heads, dim]
  // tensors. Those are passed as [1, total, heads, dim] with batch stride 0,
  // so  base + b * batch_stride + (row0(b) + row) * row_stride  addresses
  // both the padded and the packed case.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  // Varlen: rows of the packed q and k tensors (the Hopper kernels' tensor
  // maps span them, seq_bounds clamps the sequences into them); 0 for a
  // padded batch and for a paged k.
  int64_t total_q = 0;
  int64_t total_k = 0;
  // Key padding: sequence b uses keys [0, seqused_k[b]) only (clamped to
  // [0, its key count]). Used by the KV cache (cache_seqlens).
  const int* seqused_k = nullptr;

  // ---- KV cache addressing (forward only; all optional) ----------------------
  // flash-attn's block_table / cache_batch_idx / cache_leftpad. kv_row() below
  // is the one definition of where a key row lives; ops_params.h validates
  // and fills these fields (apply_kv_cache).
  // Paged KV: k / v are pools [num_pages, page_size, heads_k, dim] (so
  // k_strides.batch steps pages) and key row r of sequence b lives in page
  // block_table[b * block_table_batch_stride + r / page_size], slot
  // r % page_size. page_size % kKVPageRowAlign == 0 (see there); page ids
  // are clamped to [0, num_pages) so that a bad table reads wrong keys rather
  // than out of bounds (flash_attn_ext's debug checks report it).
  const int* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int block_table_pages = 0;  // entries per row (max_pages)
  int page_size = 0;
  int num_pages = 0;
  // cache_batch_idx (not with a block table): batch entry b reads K / V batch
  // kv_batch_idx[b], clamped to [0, kv_batch).
  const int* kv_batch_idx = nullptr;
  int kv_batch = 0;
  // cache_leftpad (not with a block table): sequence b's keys are the rows
  // [leftpad_k[b], seqused_k[b]) of its cache; key j of the sequence is row
  // leftpad_k[b] + j (seq_bounds puts the pad into row0_k), and causal / window
  // / ALiBi align to the shortened sequence (flash-attn's leftpad_k).
  const int* leftpad_k = nullptr;

  // fp32 per-query-row arrays (lse, and the backward's D and dQ accumulator
  // rows) are indexed as
  //   b * lse_batch_stride + h * lse_head_stride + row0_q(b) + row
  // padded: [batch, heads, seqlen_q] (strides heads*seqlen_q, seqlen_q);
  // varlen: [heads, total_q] (strides 0, total_q).
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;
  int64_t q_rows_total = 0;  // elements of one such array: batch*heads*seqlen_q or heads*total_q

  // Split-KV (CUDA): 0 = heuristic, 1 = off, n > 1 = force n splits.
  int num_splits = 0;
  // Forward tile family (CUDA 16-bit kernels): kFwdTileAuto picks by shape
  // (a small-M "decode" tile when seqlen_q <= 16; fwd_choose_tile resolves
  // which), the others force one; the autotuner (flash_attn_ext/autotune.py)
  // times them.
  int fwd_tile = 0;
  // Scratch for split-KV partial results, owned by the caller (fp32):
  //   out_accum [num_splits, batch, heads, seqlen_q, head_dim_rounded]
  //   lse_accum [num_splits, batch, heads, seqlen_q]
  float* out_accum = nullptr;
  float* lse_accum = nullptr;
  // The decode tile copies K/V with an L2 evict_first policy: they are read
  // once and then replace each other instead of lines other kernels left in L2
  // (fwd_set_kv_l2_policy in fwd_dispatch.cu says when).
  bool kv_evict_first = false;
  // Scratch int of the Hopper forward's dynamic tile scheduler (zeroed by its
  // launcher on the stream before each launch); nullptr where not needed.
  int* tile_counter = nullptr;
  // A packed (varlen) batch's compact tile list for the Hopper forward
  // (cuda/common/compact_tiles.cuh): the (sequence, head, query tile)
  // triples that exist, as {b, tile * heads + head} int pairs (tile t of the
  // persistent grid is entry t; written by a small kernel before it), where
  // the padded grid counts the longest sequence's tiles for every sequence
  // and skips the tiles past each one. Sequences with more tiles first
  // (longest-first, the same in every run), each head's tiles side by side,
  // last tile first. Entries past the last pair hold b = -1.
  // compact_tiles_capacity: the list's room in entries (fwd_set_workspace);
  // in the kernel's params, the tiles per head (an upper bound on a head's
  // pairs, (total + batch (block - 1)) / block). nullptr: the padded grid.
  int* compact_tiles = nullptr;
  int compact_tiles_capacity = 0;
};

// One sequence of the batch: its lengths, where its rows start, its causal
// offset. Kernels (CPU and CUDA) call this once per batch entry and never read
// seqlen_q / seqlen_k directly for masking.
struct SeqBounds {
  int seqlen_q;      // query rows of this sequence
  int seqlen_k;      // keys it may attend to (after seqused_k)
  int64_t row0_q;    // first row in the (packed) row dimension
  int64_t row0_k;
  int causal_offset; // key j visible to query i iff j <= i + causal_offset (when causal);
                     // also the diagonal of windows and ALiBi (csrc/mask.h)

  FAE_HOST_DEVICE int64_t lse_index(const AttentionFwdParams& p, int b, int h, int row) const {
    return b * p.lse_batch_stride + h * p.lse_head_stride + row0_q + row;
  }
};

// Sequence b of packed rows: [cu[b], cu[b + 1]) clamped into [0, total) and to
// max_len (max_seqlen, which sized the grids and the scratch). cu_seqlens on a
// GPU are checked on the host only on request (FLASH_ATTN_EXT_DEBUG_CHECKS=1:
// the check needs a device-to-host copy, which would stall the CPU and break
// CUDA graph capture), so bad values must give wrong rows, never accesses
// outside the tensors.
FAE_HOST_DEVICE void packed_sequence(const int* cu, int b, int64_t total, int max_len,
                                     int64_t& row0, int& len) {
  int64_t begin = cu[b], end = cu[b + 1];
  begin = begin < 0 ? 0 : (begin < total ? begin : total);
  end = end < begin ? begin : (end < total ? end : total);
  row0 = begin;
  len = static_cast<int>(end - begin < max_len ? end - begin : max_len);
}

// kVarSeq = false: the caller knows the batch is padded and has no seqused_k
// (every sequence alike), so all fields come straight from params. The CUDA
// 16-bit kernels are instantiated both ways: read from params, the values stay
// in the constant bank instead of occupying registers (~6 registers, which
// spilled in kernels already at the 255 limit).
//
// kKVCache = true also applies the KV cache addressing (block_table,
// cache_leftpad); only the kernels instantiated for it (and the general form
// below) pay for the extra reads.
template <bool kVarSeq, bool kKVCache = false>
FAE_HOST_DEVICE SeqBounds seq_bounds(const AttentionFwdParams& p, int b) {
  SeqBounds s;
  if (!kVarSeq) {
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
    s.row0_q = s.row0_k = 0;
    s.causal_offset = p.causal_offset;
    return s;
  }
  if (p.cu_seqlens_q != nullptr) {
    packed_sequence(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, s.row0_q, s.seqlen_q);
    // A paged k's cu_seqlens_k only count keys (no packed rows to stay in).
    const int64_t rows_k = p.block_table != nullptr ? INT64_MAX : p.total_k;
    packed_sequence(p.cu_seqlens_k, b, rows_k, p.seqlen_k, s.row0_k, s.seqlen_k);
  } else {
    s.row0_q = s.row0_k = 0;
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
  }
  if (p.seqused_k != nullptr) {
    const int used = p.seqused_k[b];
    s.seqlen_k = used < 0 ? 0 : (used < s.seqlen_k ? used : s.seqlen_k);
  }
  if constexpr (kKVCache) {
    // A paged sequence's rows start at its own block table, not at a packed
    // row (varlen cu_seqlens_k then only give lengths, as in flash-attn).
    if (p.block_table != nullptr) s.row0_k = 0;
    if (p.leftpad_k != nullptr) {  // keys [pad, seqlen_k) of the cache rows
      int pad = p.leftpad_k[b];
      pad = pad < 0 ? 0 : (pad < s.seqlen_k ? pad : s.seqlen_k);
      s.row0_k += pad;
      s.seqlen_k -= pad;
    }
  }
  s.causal_offset = p.causal_bottom_right ? s.seqlen_k - s.seqlen_q : 0;
  return s;
}

// ---- KV cache addressing ------------------------------------------------------
// Where a key row lives: (batch or page, row within it). `row` is a row of the
// sequence's own numbering, i.e. SeqBounds::row0_k + key (leftpad and varlen
// offsets included). The one definition of the K/V addressing that the CPU,
// SIMT and mma.sync kernels share; kv_offset turns it into an element offset
// with the strides of K or V (both use the same KVRow).
struct KVRow {
  int batch;  // batch entry of the K/V tensor, or page of the pool
  int row;    // row within it
};

FAE_HOST_DEVICE KVRow kv_row(const AttentionFwdParams& p, int b, int64_t row) {
  if (p.block_table != nullptr) {
    // Unsigned: row >= 0, and division by a run-time divisor is cheaper so.
    const uint32_t r = static_cast<uint32_t>(row);
    const uint32_t size = static_cast<uint32_t>(p.page_size);
    int page = p.block_table[b * p.block_table_batch_stride + r / size];
    page = page < 0 ? 0 : (page < p.num_pages ? page : p.num_pages - 1);
    return {page, static_cast<int>(r % size)};
  }
  int kb = b;
  if (p.kv_batch_idx != nullptr) {
    kb = p.kv_batch_idx[b];
    kb = kb < 0 ? 0 : (kb < p.kv_batch ? kb : p.kv_batch - 1);
  }
  return {kb, static_cast<int>(row)};
}

FAE_HOST_DEVICE int64_t kv_offset(const TensorStrides& st, KVRow r, int h) {
  return r.batch * st.batch + h * st.head + static_cast<int64_t>(r.row) * st.row;
}

// Element offset of key row `row` of batch entry b, kv head h (see kv_row).
FAE_HOST_DEVICE int64_t kv_row_offset(const AttentionFwdParams& p, const TensorStrides& st, int b,
                                      int h, int64_t row) {
  return kv_offset(st, kv_row(p, b, row), h);
}

// The learnable sink of query head `head` (params learnable_sink) in the log2
// domain of the kernels' row maxima; -inf without one.
FAE_HOST_DEVICE float sink_log2_of(const AttentionFwdParams& p, int head) {
  return p.learnable_sink == nullptr ? -INFINITY : p.learnable_sink[head] * 1.4426950408889634f;
}

// Folds a learnable sink into a finished softmax row: max is the row's max
// (log2 domain, -inf for a row without visible keys) and sum its sum of
// exp2(score - max + offset). The max is raised to the sink when the sink is
// larger (no term can overflow); returns the factor, exp2(old max - new max),
// that takes O (accumulated relative to the old max) to the new one.
FAE_HOST_DEVICE float fold_sink_into_row(float sink_log2, float& max, float& sum,
                                         float offset = 0.f) {
  const float new_max = fmaxf(max, sink_log2);
  const float o_factor = exp2f(max - new_max);  // 0 for a row without visible keys
  sum = sum * o_factor + exp2f(sink_log2 - new_max + offset);
  max = new_max;
  return o_factor;
}

// Whether a window bound is active (after canonicalisation, see above).
FAE_HOST_DEVICE bool has_window(const AttentionFwdParams& p) {
  return p.window_left >= 0 || p.window_right >= 0;
}

FAE_HOST_DEVICE bool has_dropout(const AttentionFwdParams& p) { return p.dropout_threshold > 0; }

// Whether any of window / softcap / ALiBi / attn_mask / dropout is active:
// those calls run the kernels instantiated with variants (csrc/mask.h and
// csrc/dropout.h have their semantics).
FAE_HOST_DEVICE bool has_variants(const AttentionFwdParams& p) {
  return has_window(p) || p.softcap > 0.f || p.alibi_slopes != nullptr ||
         p.attn_bias != nullptr || has_dropout(p);
}

// K/V rows read through kv_row (a block table or cache_batch_idx) rather than
// through (batch, row) strides.
FAE_HOST_DEVICE bool has_kv_indirection(const AttentionFwdParams& p) {
  return p.block_table != nullptr || p.kv_batch_idx != nullptr;
}

// Any KV cache addressing (indirection or left padding): the CUDA forward runs
// the kernels instantiated for it (kKVCache), the Hopper kernels never see it.
FAE_HOST_DEVICE bool has_kv_cache_addressing(const AttentionFwdParams& p) {
  return has_kv_indirection(p) || p.leftpad_k != nullptr;
}

// Whether sequences differ (varlen, key padding, KV cache addressing): picks
// seq_bounds<true>.
FAE_HOST_DEVICE bool has_var_seqs(const AttentionFwdParams& p) {
  return p.cu_seqlens_q != nullptr || p.seqused_k != nullptr || has_kv_cache_addressing(p);
}

// The general form, for code that is not register-bound. Without the KV cache
// addressing, which only forward kernels see: they ask for it explicitly
// (seq_bounds<true, true> on the CPU, <true, kKVCache> in the CUDA kernels), so
// that the backward kernels, which call this form, compile as without it.
FAE_HOST_DEVICE SeqBounds seq_bounds(const AttentionFwdParams& p, int b) {
  return seq_bounds<true>(p, b);
}

struct AttentionBwdParams : AttentionFwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;

  // D_i = rowsum(dO_i * O_i), fp32, indexed like lse (scratch).
  float* dsoftmax_sum = nullptr;
  // fp32 dQ accumulator(s) (CUDA) [splits][q_rows_total][accum dim], rows
  // indexed like lse.
  float* dq_accum = nullptr;
  // dq_accum is the caller's (the bwd operators' dq_accum argument), not the
  // workspace's: the Hopper backward adds this call's unscaled dQ into it
  // (not zeroed first) and writes no dq. Its layout in floats: [slices][rows]
  // [head_dim] with these pitches (slices = batch * heads padded, heads packed,
  // as the workspace's; rows = seqlen_q padded, total_q packed).
  bool dq_accum_external = false;
  int64_t dq_accum_row_pitch = 0, dq_accum_slice_pitch = 0;
  // The Hopper backward's flat dQ accumulator (cuda/hopper/bwd_sm90.h
  // bwd_sm90_flat_dq): [batch * heads][seqlen_q_padded / rows][accum dim /
  // 64] blocks of dq_flat_rows x 64 floats in the consumers' fragment order:
  // 64 rows, or 80 for the 80-query steps (bwd_sm90_flat_dq_rows), whose
  // blocks hold dQ^T's fragments.
  bool dq_accum_flat = false;
  int dq_flat_rows = 64;
  bool deterministic = false;
  // GQA: dk / dv have heads_k heads and the kernel sums each group of query
  // heads itself (the Hopper backward's group walk); else they have `heads`
  // heads and the op layer sums the groups. Set by the op layer from
  // cuda::bwd_sums_gqa_groups_in_kernel.
  bool dkv_per_kv_head = false;
  // Padded-batch row statistics for the Hopper backward, [batch * heads]
  // [seqlen_q_padded] each (seqlen_q rounded up to 128, the longest query
  // step, or to 80 for 80-query steps, so that a step's bulk copy stays
  // inside its head): lse as log2, +inf
  // where P = 0 (rows past seqlen_q, fully masked rows), and D, 0 past
  // seqlen_q. The preprocess kernel writes them when asked (scratch, nullptr
  // where the workspace has none), so that the kernel copies a step's rows
  // with one bulk copy each.
  float* lse_log2_padded = nullptr;
  float* dsum_padded = nullptr;
  int seqlen_q_padded = 0;
  // Deterministic Hopper backward: counters that order the key tiles' dQ adds,
  // one per (batch * heads, query step, consumer) (bwd_sm90_kernel.cuh), room
  // for 2 per 64 rows of seqlen_q_padded, zeroed by the preprocess kernel;
  // nullptr otherwise.
  int* dq_semaphore = nullptr;
  // The learnable sink's gradient (learnable_sink): the preprocess kernel
  // writes each block's sum over its rows of exp(sink[h] - lse) * D, block x of
  // (batch b, head h) at (b * heads + h) * dsink_partials_stride + x, so that
  // the op layer adds them up in a fixed order (deterministic); nullptr when
  // no sink gradient is wanted.
  float* dsink_partials = nullptr;
  int dsink_partials_stride = 0;
};

// The flat dQ accumulator (dq_accum_flat; cuda/hopper/bwd_sm90.h) in blocks
// of R = dq_flat_rows (64 or 80) rows x 64 floats, accum_dim / 64 column
// chunks per block row. Padded batch: seqlen_q_padded / R block rows per
// (batch, head). Packed: per head total_q / R + batch + 1, sequence b's rows
// from block row row0_q / R + b (each sequence rounded up to whole blocks, the
// + b absorbing what the roundings add, as FlashAttention-4's padded offsets:
// no two sequences share a block, and a sequence inside the packed rows stays
// inside its head's). The block row of sequence b's (rows from row0_q) first
// R rows of head h: flat_dq_block_base(b) + h * flat_dq_head_blocks. Block
// rows are at most 20 KB x accum_dim / 64 each, so their count fits an int
// with room to spare (2^23 block rows fill 176 GB); only float offsets need
// 64 bits.
// rows: p.dq_flat_rows, which the Hopper kernel passes as its compile-time
// kDqRows (a division by a constant in its 24-register dQ writers).
FAE_HOST_DEVICE int flat_dq_head_blocks(const AttentionBwdParams& p, int rows) {
  return p.cu_seqlens_q != nullptr ? static_cast<int>(p.total_q / rows) + p.batch + 1
                                   : p.seqlen_q_padded / rows;
}
FAE_HOST_DEVICE int flat_dq_block_base(const AttentionBwdParams& p, int b, int64_t row0_q, int rows) {
  return p.cu_seqlens_q != nullptr ? static_cast<int>(row0_q / rows) + b
                                   : b * p.heads * (p.seqlen_q_padded / rows);
}
FAE_HOST_DEVICE int flat_dq_block_row0(const AttentionBwdParams& p, int b, int h, int64_t row0_q,
                                       int rows) {
  return flat_dq_block_base(p, b, row0_q, rows) + h * flat_dq_head_blocks(p, rows);
}
// All block rows (the accumulator's size over dq_flat_rows * accum_dim floats).
FAE_HOST_DEVICE int64_t flat_dq_block_rows(const AttentionBwdParams& p) {
  return (p.cu_seqlens_q != nullptr ? 1 : static_cast<int64_t>(p.batch)) * p.heads *
         flat_dq_head_blocks(p, p.dq_flat_rows);
}

// Merging blocks' partial attention results into a running one by their
// log-sum-exps (flash_attn_ext::merge_partial_, ring attention's forward): with
// the running (prev, lse) and the blocks j = 0 .. num_blocks - 1,
//   lse' = log(exp(lse) + sum_j exp(block_lse_j))
//   out  = exp(lse - lse') * prev + sum_j exp(block_lse_j - lse') * block_out_j
// where prev is prev_out when given, else out itself (in place), and a term of
// weight 0 is skipped (prev is not read where lse = -inf: a fresh result may
// hold anything); rows without any key get out = 0, lse' = -inf. Every output
// tensor is addressed as [batch, seqlen, heads, head_dim] with element strides
// (a packed [total, heads, head_dim] one as batch 1), every lse as [batch,
// heads, seqlen] fp32. A fixed array of blocks keeps the params a kernel
// argument (no device copy of the pointers).
constexpr int kMaxMergeBlocks = 8;
// The rows both partial-result operators walk: [batch, seqlen, heads] of their
// [batch, seqlen, heads, head_dim] tensors, heads fastest like the tensors.
struct PartialRows {
  int batch = 0;
  int seqlen = 0;
  int heads = 0;
  int head_dim = 0;
  FAE_HOST_DEVICE int64_t rows() const { return int64_t(batch) * seqlen * heads; }
};
struct MergePartialParams : PartialRows {
  int num_blocks = 0;
  void* out = nullptr;
  const void* prev_out = nullptr;  // == out when merging in place
  DType out_dtype = DType::kFloat32, prev_dtype = DType::kFloat32, block_dtype = DType::kFloat32;
  TensorStrides out_strides, prev_strides;
  float* lse = nullptr;
  int64_t lse_strides[3] = {0, 0, 0};  // batch, head, row
  const void* block_outs[kMaxMergeBlocks] = {};
  TensorStrides block_strides[kMaxMergeBlocks];
  const float* block_lses[kMaxMergeBlocks] = {};
  int64_t block_lse_strides[kMaxMergeBlocks][3] = {};  // batch, head, row
};

// Summing partial results (flash_attn_ext::sum_partial_, ring attention's
// gradients): out = prev + pieces[0] + ... + pieces[num_pieces - 1], added in
// float32 in that order and rounded once on the store; prev is optional
// (nullptr: 0) and may be out itself. Addressed like MergePartialParams. A
// fixed array of pieces keeps the params a kernel argument (no device copy of
// the pointers).
constexpr int kMaxSumPieces = 8;
struct SumPartialParams : PartialRows {
  int num_pieces = 0;
  void* out = nullptr;
  const void* prev = nullptr;
  const void* pieces[kMaxSumPieces] = {};
  DType out_dtype = DType::kFloat32, prev_dtype = DType::kFloat32, piece_dtype = DType::kFloat32;
  TensorStrides out_strides, prev_strides;
  TensorStrides piece_strides[kMaxSumPieces];
};

}  // namespace flash_attn_ext
