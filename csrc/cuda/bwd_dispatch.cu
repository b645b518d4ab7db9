// The three backward entry points of flash_api.h: workspace sizing, workspace
// hand-out, and the dtype / head-dim / causal dispatch to the compiled
// instantiations (instantiations/bwd_*.cu, filtered by setup.py, which
// defines FAE_HAS_HDIM_<D> / FAE_HAS_FP16 / FAE_HAS_BF16 for what it built).
//
// Workspace (fp32), in this order:
//   dsoftmax_sum  [q_rows_total]  (lse-shaped, params.h; padded to 64 floats)
//   dq_accum      [splits][q_rows_total][accum_dim]  (none where the Hopper
//                 backward adds into the caller's, params.dq_accum_external)
//   lse_log2_padded, dsum_padded  [batch * heads][seqlen_q_padded] each, for
//                 the calls the Hopper backward may take (params.h)
// accum_dim = the instantiated head dim. splits = 1 unless deterministic; then
// each of `splits` blocks per head owns one accumulator (see bwd_dq_splits).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/env.h"
#include "flash_api.h"
#include "simt/bwd_fp32.h"
#include "sm80/bwd_kernel_traits.cuh"
#include "static_switch.h"
#ifdef FAE_HAS_SM90A
#include "hopper/bwd_sm90.h"
#endif

namespace flash_attn_ext {
namespace cuda {

template <typename T, int kHeadDim, bool kIsCausal>
void run_bwd_impl(const AttentionBwdParams& params, cudaStream_t stream);
// Window / softcap / ALiBi calls, causal or not (instantiations/bwd_var_*.cu).
template <typename T, int kHeadDim>
void run_bwd_variants_impl(const AttentionBwdParams& params, cudaStream_t stream);

namespace {

bool is_fp32(const AttentionBwdParams& p) { return p.dtype == DType::kFloat32; }

int accum_dim(const AttentionBwdParams& p) {
  return is_fp32(p) ? bwd_fp32_accum_dim(p.head_dim) : bwd_rounded_head_dim(p.head_dim);
}

#ifdef FAE_HAS_SM90A
bool use_sm90_backward(const AttentionBwdParams& p);
#endif

// Deterministic mode. mma.sync: the blocks along seqlen_k of one (batch,
// head) are folded into `splits` blocks, each walking n_blocks split,
// split + splits, ... in order and owning a private fp32 dQ accumulator
// (plain read-modify-write, no atomics); the convert kernel sums the splits in
// order 0..splits-1. `splits` targets one wave of blocks and costs splits x
// the dQ accumulator memory. Hopper: one accumulator, the key tiles' adds
// ordered by counters (bwd_sm90_kernel.cuh). Either way the result is
// bit-identical run to run.
int bwd_dq_splits(const AttentionBwdParams& p, int num_sms) {
  if (!p.deterministic) return 1;
#ifdef FAE_HAS_SM90A
  if (use_sm90_backward(p)) return 1;
#endif
  const int block_n = is_fp32(p) ? kBwdFp32BlockN : bwd_block_n(accum_dim(p));
  const int num_n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  const int64_t heads_total = static_cast<int64_t>(p.batch) * p.heads;
  const int64_t wanted = (std::max(num_sms, 1) + heads_total - 1) / heads_total;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, num_n_blocks)));
}

int64_t dsum_floats(const AttentionBwdParams& p) {
  return (p.q_rows_total + 63) / 64 * 64;  // keeps dq_accum 256-byte aligned
}

// The padded row statistics of the Hopper backward and, deterministic, its
// dQ order counters (params.h, 4-byte ints), reserved for the calls it takes.
int flat_dq_rows(const AttentionBwdParams& p);
// Rounded up to the longest query step (128 rows), or to 80 for 80-query
// steps (bwd_sm90_flat_dq_rows: the flat accumulator's blocks, whole steps).
int seqlen_q_padded(const AttentionBwdParams& p) {
  const int step = flat_dq_rows(p) == 80 ? 80 : 128;
  return (p.seqlen_q + step - 1) / step * step;
}
int64_t row_stat_floats(const AttentionBwdParams& p) {
#ifdef FAE_HAS_SM90A
  if (use_sm90_backward(p)) return 2 * static_cast<int64_t>(p.batch) * p.heads * seqlen_q_padded(p);
#endif
  return 0;
}
int64_t dq_semaphore_ints(const AttentionBwdParams& p) {
  if (row_stat_floats(p) == 0 || !p.deterministic) return 0;
  return 2 * static_cast<int64_t>(p.batch) * p.heads * (seqlen_q_padded(p) / 64);
}

[[noreturn]] void not_compiled(const AttentionBwdParams& p, const char* what) {
  throw std::runtime_error(std::string("flash_attn_ext: backward ") + what +
                           " is not compiled in this build (head_dim " +
                           std::to_string(p.head_dim) + " -> kernel head dim " +
                           std::to_string(bwd_rounded_head_dim(p.head_dim)) +
                           "); rebuild with it in FLASH_ATTN_EXT_HEAD_DIMS / FLASH_ATTN_EXT_DTYPES");
}

// The Hopper (wgmma + TMA) backward takes a call when it was compiled (an
// sm_90a target), the device is sm_90, FLASH_ATTN_EXT_BWD_IMPL allows it, and
// the call is one it implements: 16-bit, kernel head dim 64/128/256, no
// broadcast (stride-0) dimension, packed rows addressable by TMA's int32
// coordinates (README "Hopper backward"). Varlen, seqused_k and deterministic
// calls included, and window / softcap / ALiBi / attn_mask / dropout calls (its
// variant instantiation, run_bwd_sm90_variants_impl).
#ifdef FAE_HAS_SM90A
// A v head dim other than q's with a Hopper backward of its own: MLA's
// 192 / 128 (instantiations/bwd_sm90_*_hdim192_v128_*.cu), without variants
// (those, and every other pair, run padded: bwd_kernel_head_dim).
bool bwd_sm90_head_dims_v(const AttentionBwdParams& p) {
#ifdef FAE_HAS_HDIM_192
  return p.head_dim == 192 && p.head_dim_v == 128 && !has_variants(p);
#else
  (void)p;
  return false;
#endif
}

bool use_sm90_backward(const AttentionBwdParams& p) {
  if (kernel_impl_requested("FLASH_ATTN_EXT_BWD_IMPL") == KernelImpl::kMma) return false;
  const bool packed = p.cu_seqlens_q != nullptr;
  // What the tensor maps see (bwd_sm90_launch.cuh): packed tensors as one
  // batch entry of total rows.
  const int64_t rows_q = packed ? p.total_q : p.seqlen_q, rows_k = packed ? p.total_k : p.seqlen_k;
  const int map_batch = packed ? 1 : p.batch;
  const bool rows_fit = rows_q < (int64_t{1} << 31) - 64 && rows_k < (int64_t{1} << 31) - 128;
  const bool dims_ok = p.head_dim_v == p.head_dim
                           ? bwd_sm90_head_dim(bwd_rounded_head_dim(p.head_dim))
                           : bwd_sm90_head_dims_v(p);
  return !is_fp32(p) && dims_ok &&
         rows_fit &&
         p.heads <= 65535 && p.batch <= 65535 &&
         tma_strides_ok(p.q_strides, rows_q, p.heads, map_batch) &&
         tma_strides_ok(p.dout_strides, rows_q, p.heads, map_batch) &&
         tma_strides_ok(p.k_strides, rows_k, p.heads_k, map_batch) &&
         tma_strides_ok(p.v_strides, rows_k, p.heads_k, map_batch) && device_is_sm90();
}
#endif

// A v head dim other than q's: the Hopper backward of that pair (the op layer
// pads every call that bwd_runs_head_dims turns down to one head dim).
template <typename T>
void dispatch_head_dims_v(const AttentionBwdParams& p, cudaStream_t stream) {
#if defined(FAE_HAS_SM90A) && defined(FAE_HAS_HDIM_192)
  if (use_sm90_backward(p)) {
    with_causal(p.causal, [&](auto causal_tag) {
      run_bwd_sm90_impl<T, 192, decltype(causal_tag)::value, 128>(p, stream);
    });
    return;
  }
#endif
  throw std::runtime_error("flash_attn_ext: internal error: head_dim " +
                           std::to_string(p.head_dim) + " with head_dim_v " +
                           std::to_string(p.head_dim_v) + " reached the backward without a "
                           "kernel for the pair (the op layer pads such calls)");
}

template <typename T>
void run_head_dim_switch(const AttentionBwdParams& p, cudaStream_t stream) {
  if (p.head_dim_v != p.head_dim) return dispatch_head_dims_v<T>(p, stream);
  auto run = [&](auto dim_tag) {
    if (has_variants(p)) {  // causal or not: the variant kernels' Mask
      constexpr int kDim = decltype(dim_tag)::value;
#ifdef FAE_HAS_SM90A
      if constexpr (kDim == 64 || kDim == 128 || kDim == 256) {
        if (use_sm90_backward(p)) return run_bwd_sm90_variants_impl<T, kDim>(p, stream);
      }
#endif
      return run_bwd_variants_impl<T, kDim>(p, stream);
    }
    with_causal(p.causal, [&](auto causal_tag) {
      constexpr bool kCausal = decltype(causal_tag)::value;
      constexpr int kHeadDim = decltype(dim_tag)::value;
#ifdef FAE_HAS_SM90A
      // The Hopper instantiations exist for these head dims (generate_instantiations.py)
      // and are filtered by FLASH_ATTN_EXT_HEAD_DIMS like the others.
      if constexpr (kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256) {
        if (use_sm90_backward(p)) return run_bwd_sm90_impl<T, kHeadDim, kCausal>(p, stream);
      }
#endif
      run_bwd_impl<T, kHeadDim, kCausal>(p, stream);
    });
  };
  if (!with_compiled_head_dim(bwd_rounded_head_dim(p.head_dim), run)) not_compiled(p, "head dim");
}

}  // namespace

bool bwd_runs_head_dims(const AttentionBwdParams& params) {
  if (params.head_dim_v == params.head_dim) return true;
#ifdef FAE_HAS_SM90A
  return use_sm90_backward(params);
#else
  return false;
#endif
}

int bwd_kernel_head_dim(const AttentionBwdParams& params, int width) {
#ifdef FAE_HAS_SM90A
  const int hopper_dim = width <= 64 ? 64 : width <= 128 ? 128 : 256;
  if (width > 64 && width < hopper_dim && with_compiled_head_dim(hopper_dim, [](auto) {})) {
    AttentionBwdParams padded = params;
    padded.head_dim = padded.head_dim_v = hopper_dim;
    if (use_sm90_backward(padded)) return hopper_dim;
  }
#endif
  (void)params;
  return width;
}

bool bwd_adds_into_caller_dq_accum(const AttentionBwdParams& params) {
#ifdef FAE_HAS_SM90A
  return use_sm90_backward(params);
#else
  (void)params;
  return false;
#endif
}

// The Hopper backward sums GQA groups in the kernel (bwd_sm90.h) for
// non-causal calls whose grid of (key tile, kv head, batch) CTAs still fills
// the GPU twice over. The walk divides the CTA count by the group size (MQA
// at B = 1, S = 2k: 16 CTAs), and fewer, longer CTAs leave SMs idle in the
// tail. Causal grids are unbalanced already (a key tile's CTA sees the queries
// after it), and walking the group makes the longest CTAs group times longer:
// H100, bf16, 32 / 8 heads, D = 128, backward, walk against per-query-head
// dK / dV, S = 4k / 16k: non-causal 1.04 / 1.06x faster, causal 0.98 / 0.89x
// (32 / 4 heads, S = 2k causal: 0.80x). The mma.sync backward writes dK / dV
// per query head. FLASH_ATTN_EXT_GQA_BWD_WALK = auto (default), 1 (every GQA
// call the Hopper backward takes: the tests' way to reach the walk with small
// shapes) or 0 (never).
bool bwd_sums_gqa_groups_in_kernel(const AttentionBwdParams& params, int num_sms) {
#ifdef FAE_HAS_SM90A
  if (params.heads <= params.heads_k || !use_sm90_backward(params)) return false;
  const int choice = env_choice("FLASH_ATTN_EXT_GQA_BWD_WALK", {"auto", "1", "0"});
  if (choice != 0) return choice == 1;
  if (params.causal) return false;
  const int block_n = bwd_sm90_block_n(bwd_rounded_head_dim(params.head_dim));
  const int64_t ctas = static_cast<int64_t>(params.batch) * params.heads_k *
                       ((params.seqlen_k + block_n - 1) / block_n);
  return ctas >= 2 * static_cast<int64_t>(num_sms);
#else
  (void)params;
  (void)num_sms;
  return false;
#endif
}

namespace {
// The Hopper backward's flat dQ accumulator (bwd_sm90.h bwd_sm90_flat_dq):
// blocks of 64 (or 80) x 64 floats (params.h flat_dq_block_rows).
bool flat_dq(const AttentionBwdParams& params) {
#ifdef FAE_HAS_SM90A
  return use_sm90_backward(params) && bwd_sm90_flat_dq(params, accum_dim(params));
#else
  (void)params;
  return false;
#endif
}
// Rows per block of the flat accumulator (bwd_sm90.h bwd_sm90_flat_dq_rows).
int flat_dq_rows(const AttentionBwdParams& params) {
#ifdef FAE_HAS_SM90A
  if (flat_dq(params)) return bwd_sm90_flat_dq_rows(params, accum_dim(params));
#endif
  (void)params;
  return 64;
}
int64_t dq_accum_floats(const AttentionBwdParams& params, int num_sms) {
  if (params.dq_accum_external) return 0;
  if (flat_dq(params)) {
    AttentionBwdParams padded = params;  // (bwd_set_workspace sets these)
    padded.seqlen_q_padded = seqlen_q_padded(params);
    padded.dq_flat_rows = flat_dq_rows(params);
    return flat_dq_block_rows(padded) * padded.dq_flat_rows * accum_dim(params);
  }
  return static_cast<int64_t>(bwd_dq_splits(params, num_sms)) * params.q_rows_total *
         accum_dim(params);
}
}  // namespace

int64_t bwd_workspace_floats(const AttentionBwdParams& params, int num_sms) {
  return dsum_floats(params) + dq_accum_floats(params, num_sms) + row_stat_floats(params) +
         dq_semaphore_ints(params);
}

void bwd_set_workspace(AttentionBwdParams& params, float* workspace, int num_sms) {
  params.dsoftmax_sum = workspace;
  float* const after_dq = workspace + dsum_floats(params) + dq_accum_floats(params, num_sms);
  if (!params.dq_accum_external) params.dq_accum = workspace + dsum_floats(params);
  params.num_splits = bwd_dq_splits(params, num_sms);
  params.dq_accum_flat = flat_dq(params);
  params.dq_flat_rows = flat_dq_rows(params);
  const int64_t row_stats = row_stat_floats(params);
  if (row_stats > 0) {
    params.seqlen_q_padded = seqlen_q_padded(params);
    params.lse_log2_padded = after_dq;
    params.dsum_padded = params.lse_log2_padded + row_stats / 2;
    if (dq_semaphore_ints(params) > 0) {
      params.dq_semaphore = reinterpret_cast<int*>(params.dsum_padded + row_stats / 2);
    }
  }
}

void run_bwd(AttentionBwdParams& params, int num_sms, cudaStream_t stream) {
  if (params.head_dim <= 0 || params.head_dim % 8 != 0 || params.head_dim > 256) {
    throw std::runtime_error("flash_attn_ext: backward needs head_dim % 8 == 0 and <= 256, got " +
                             std::to_string(params.head_dim));
  }
  // The number of dQ accumulators the workspace was sized for (flash_api.h:
  // bwd_workspace_floats and run_bwd see the same num_sms).
  params.num_splits = bwd_dq_splits(params, num_sms);
  if (params.dq_accum_external && !bwd_adds_into_caller_dq_accum(params)) {
    throw std::runtime_error("flash_attn_ext: internal error: a caller's dQ accumulator reached "
                             "a backward that does not add into it");
  }
  switch (params.dtype) {
    case DType::kFloat32: return run_bwd_fp32(params, stream);
    case DType::kFloat16:
#ifdef FAE_HAS_FP16
      return run_head_dim_switch<__half>(params, stream);
#else
      not_compiled(params, "dtype float16");
#endif
    case DType::kBFloat16:
#ifdef FAE_HAS_BF16
      return run_head_dim_switch<__nv_bfloat16>(params, stream);
#else
      not_compiled(params, "dtype bfloat16");
#endif
  }
  throw std::runtime_error("flash_attn_ext: backward: unknown dtype");
}

}  // namespace cuda
}  // namespace flash_attn_ext
