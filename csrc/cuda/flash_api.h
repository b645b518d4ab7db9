// The contract between the torch-facing op layer (ops_cuda.cpp, compiled by
// the host compiler) and the CUDA kernels (.cu files). Only plain types cross
// it. The op layer guarantees, before calling in:
//   * q/k/v/out/dout/dq/dk/dv base pointers are 16-byte aligned,
//   * head_dim % 8 == 0 and head_dim <= 256 (ops_cuda.cpp pads other head dims),
//   * every batch/row/head stride is a multiple of 8 elements,
//   * with a block table (paged KV cache), page_size % kKVPageRowAlign == 0
//     (params.h; the decode kernels look pages up per 16 rows),
//   * an FP8 (e4m3) KV cache (params.kv_dtype) has head_dim % 16 == 0 and
//     strides that are multiples of 16 elements (16-byte rows of 16 values);
//     the FP8 forward's q/k/v likewise (ops_fp8_cuda.cpp),
//   * all tensors live on the current device; `stream` is torch's current stream.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../params.h"

namespace flash_attn_ext {
namespace cuda {

// ---- forward -------------------------------------------------------------
// Whether a kernel takes the call's head dims as they are: always where v's
// head dim is q's; where it differs (DeepSeek MLA's 192 / 128), when the
// Hopper forward of that pair takes the call (compiled, an sm_90 device, no
// window / softcap / ALiBi / attn_mask / dropout, not a decode tile, no
// split-KV). Otherwise the op layer pads q / k / v to one head dim (the
// narrower ones with zero columns). Decided on the params as the op layer
// filled them (num_splits and fwd_tile as the caller gave them);
// fwd_choose_tile and fwd_num_splits then keep such calls unsplit.
bool fwd_runs_head_dims(const AttentionFwdParams& params);
// Number of KV splits the forward will use for these params (>= 1): honours
// params.num_splits when > 0, else a heuristic from the SM count.
int fwd_num_splits(const AttentionFwdParams& params, int num_sms);
// Resolves params.fwd_tile == kFwdTileAuto on decode shapes to the decode
// variant (one warp or key warps) before fwd_num_splits sizes the splits.
void fwd_choose_tile(AttentionFwdParams& params, int num_sms);

// fp32 scratch (in floats) the forward needs with `num_splits` splits
// (0 when num_splits == 1). The op layer allocates it and sets
// params.out_accum / params.lse_accum via fwd_set_workspace.
int64_t fwd_workspace_floats(const AttentionFwdParams& params, int num_splits);
void fwd_set_workspace(AttentionFwdParams& params, float* workspace, int num_splits);

// Sets params.kv_evict_first for this call (after GQA regrouping) on a device
// with `l2_cache_bytes` of L2 (the rule and its measurements: fwd_dispatch.cu).
void fwd_set_kv_l2_policy(AttentionFwdParams& params, int64_t l2_cache_bytes);

// DeepSeek MLA's absorbed decode shape, q / k head dim 576 and v 512 (v
// usually the first 512 columns of k's latent cache): a forward of its own
// (sm80/fwd_mla.cu; 16-bit, no window / softcap / ALiBi / attn_mask /
// dropout), always split-KV into fp32 partials that a combine kernel merges.
bool fwd_mla_head_dims(int head_dim, int head_dim_v);
int fwd_mla_num_splits(const AttentionFwdParams& params, int num_sms);
int64_t fwd_mla_workspace_floats(const AttentionFwdParams& params, int num_splits);
void fwd_mla_set_workspace(AttentionFwdParams& params, float* workspace, int num_splits);
void run_fwd_mla(const AttentionFwdParams& params, int num_splits, cudaStream_t stream);

// Launches the forward (and the split-KV combine when num_splits > 1).
// Throws std::runtime_error with a clear message for unsupported configs
// (e.g. a head dim that was not compiled in).
void run_fwd(AttentionFwdParams& params, cudaStream_t stream);

// ---- FP8 (e4m3) forward (fp8_fwd.cu) -----------------------------------------
// Whether this device and build run it for `head_dim`; else *why says why.
bool fwd_fp8_supported(int head_dim, std::string* why);
// Keys of the transposed V scratch (params.v_transposed: e4m3 [batch, heads_k,
// head_dim, this]) the op layer allocates.
int64_t fwd_fp8_v_transposed_seqlen(int seqlen_k);
// Whether the FP8 kernel transposes V itself for this call (short calls at head
// dims <= 128), which then needs no params.v_transposed.
bool fwd_fp8_transposes_v(const AttentionFwdParams& params);
// Transposes V into params.v_transposed (unless it is null: see above), then
// runs the Hopper FP8 kernel (needs params.tile_counter when causal).
void run_fwd_fp8(const AttentionFwdParams& params, cudaStream_t stream);

// ---- boolean attn_mask summary (common/mask_blocks.cuh) --------------------
// Bytes of the block summary of params' attn_mask: 0 unless it is a boolean
// mask of a padded batch. The op layer allocates them (after any change to
// params' shape) and calls set_attn_mask_blocks; the Hopper launchers then
// fill them (compute_attn_mask_blocks, mask_blocks.cuh) on the stream before
// their kernels.
int64_t attn_mask_blocks_bytes(const AttentionFwdParams& params);
void set_attn_mask_blocks(AttentionFwdParams& params, uint8_t* blocks);

// ---- varlen: the rows past the last sequence (varlen_rows.cu) --------------
// Packed rows [cu_seqlens_q[batch], total_q) belong to no sequence: zeros in
// params.out (its first `cols` columns) and -inf in params.lse, on the stream
// after the caller allocated them. cu_seqlens_q[batch] is read on the device,
// so that a varlen call needs no host copy (and can be captured).
void finish_rows_past_sequences(const AttentionFwdParams& params, int cols, cudaStream_t stream);
// The backward's gradients (dQ, dK, dV in `rows`, any of them null to skip):
// zeros in every row outside a sequence (past the last one, keys past
// seqused_k), on the stream after the backward's kernels, so that they can be
// allocated uninitialised. Not for KV-cache addressing (paged / leftpad keys),
// whose gradient rows the caller zero-fills.
struct GradRows {
  void* ptr[3];
  TensorStrides strides[3];
  int heads[3], cols[3];
};
void finish_grad_rows_outside_sequences(const AttentionBwdParams& params, const GradRows& rows,
                                        int elem_bytes, cudaStream_t stream);

// ---- ring attention: partial results (partial_results.cu) ----
// One pass over the rows of params (MergePartialParams / SumPartialParams,
// params.h). vectorized: head_dim % 4 == 0 and every tensor's base and strides
// aligned to 4 elements (the op layer decides); else one element per thread.
void merge_partial(const MergePartialParams& params, bool vectorized, cudaStream_t stream);
void sum_partial(const SumPartialParams& params, bool vectorized, cudaStream_t stream);

// ---- backward ------------------------------------------------------------
// Whether the backward that takes this call adds its dQ into a caller's fp32
// accumulator (params.dq_accum_external; the Hopper backward), so that the op
// layer may hand it one; other calls get dq and the op layer adds it.
bool bwd_adds_into_caller_dq_accum(const AttentionBwdParams& params);

// The head dim the backward runs a call of (padded) head dim `width` at: the
// next Hopper backward's (128 or 256) where that kernel takes the call and
// width lies between its head dims (96, 160, 192, 224; MLA's 192 / 128
// padded to one head dim), else width (the mma.sync kernels have those
// dims). Zero columns cost the Hopper kernel up to 1.6x the FLOPs of the
// call, still about twice the mma.sync kernels' speed (H200,
// docs/PERFORMANCE.md).
int bwd_kernel_head_dim(const AttentionBwdParams& params, int width);
// Whether the backward runs the call's head dims as they are: equal ones, or
// a pair with a Hopper backward of its own (MLA's 192 / 128, no variants; q /
// k / v / dout strides of the tensors the kernel will read). Other pairs run
// one padded head dim (bwd_kernel_head_dim of max(head_dim, head_dim_v)).
bool bwd_runs_head_dims(const AttentionBwdParams& params);
// GQA (heads > heads_k): whether the backward that takes this call sums dK /
// dV over each kv head's group of query heads itself and writes them per kv
// head into params.dk / dv ([.., heads_k, D]; the Hopper backward). Otherwise
// it writes them per query head ([.., heads, D]) and the op layer sums.
// Sets nothing: the op layer stores the answer in params.dkv_per_kv_head.
bool bwd_sums_gqa_groups_in_kernel(const AttentionBwdParams& params, int num_sms);
// fp32 scratch (in floats) for D = rowsum(dO*O), the dQ accumulator(s), etc.
int64_t bwd_workspace_floats(const AttentionBwdParams& params, int num_sms);
// Points params.dsoftmax_sum / params.dq_accum (unless the caller's) into `workspace`.
void bwd_set_workspace(AttentionBwdParams& params, float* workspace, int num_sms);
// Launches preprocess, main kernel and dQ conversion. Zeroes what it accumulates
// (but the caller's dQ accumulator, which it adds into, converting nothing).
void run_bwd(AttentionBwdParams& params, int num_sms, cudaStream_t stream);

}  // namespace cuda
}  // namespace flash_attn_ext
