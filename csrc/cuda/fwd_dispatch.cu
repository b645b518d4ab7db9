// The forward half of flash_api.h: split-KV policy, workspace layout, and the
// dtype / head-dim / causal dispatch onto the compiled instantiations.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/compact_tiles.cuh"
#include "flash_api.h"
#include "hopper/fwd_sm90.h"
#include "simt/fwd_fp32.h"
#include "sm80/fwd_kernel_traits.cuh"
#include "sm80/fwd_launch.h"
#include "static_switch.h"

namespace flash_attn_ext {
namespace cuda {
namespace {

// ---- compiled configurations ------------------------------------------------
std::string compiled_head_dims() {
  std::string s;
  for_each_compiled_head_dim([&](auto tag) {
    s += (s.empty() ? "" : ",") + std::to_string(decltype(tag)::value);
  });
  return s.empty() ? "none" : s;
}

std::string compiled_dtypes() {
  std::string s;
#ifdef FAE_HAS_FP16
  s += "fp16";
#endif
#ifdef FAE_HAS_BF16
  s += s.empty() ? "bf16" : ",bf16";
#endif
  return s.empty() ? "none" : s;
}

[[noreturn]] void throw_head_dim_not_compiled(int head_dim, int kernel_dim) {
  throw std::runtime_error("flash_attn_ext: head_dim " + std::to_string(head_dim) +
                           " (kernel head dim " + std::to_string(kernel_dim) +
                           ") is not compiled in this build (FLASH_ATTN_EXT_HEAD_DIMS=" +
                           compiled_head_dims() + ")");
}

[[noreturn, maybe_unused]] void throw_dtype_not_compiled(const char* dtype) {
  throw std::runtime_error(std::string("flash_attn_ext: ") + dtype +
                           " kernels are not compiled in this build (FLASH_ATTN_EXT_DTYPES=" +
                           compiled_dtypes() + ")");
}

// ---- tile shape per head dim (host copy of the FwdTileConfig table) --------
struct TileShape {
  int block_m;
  int block_n;
  int ctas_per_sm;  // estimate: registers (<= 255 per thread) and shared memory
};

template <typename X>
struct TypeTag {
  using type = X;
};

// kv_fp8: the FP8 KV cache kernels' traits (decode tiles; their shared memory).
template <int D>
TileShape tile_shape_of(bool causal, FwdTile family, bool kv_fp8) {
  auto shape = [](auto config, auto traits) {
    using C = decltype(config);
    using Traits = typename decltype(traits)::type;
    // Up to 255 registers per thread, 64K per SM, at most 32 CTAs per SM.
    const int by_regs = std::max(1, std::min(32, 65536 / (Traits::kNThreads * 255)));
    const int by_smem = std::max(1, (227 * 1024) / Traits::kSmemBytes);
    return TileShape{C::kBlockM, C::kBlockN, std::min(by_regs, by_smem)};
  };
  auto decode_shape = [&](auto config) {
    using C = decltype(config);
    return kv_fp8 ? shape(config, TypeTag<typename C::template Traits<__half, true>>{})
                  : shape(config, TypeTag<typename C::template Traits<__half>>{});
  };
  if (family == kFwdTileSmallMKeyWarps) {
    return decode_shape(FwdTileConfigDecode<D, kFwdDecodeKeyWarps>{});
  }
  if (family == kFwdTileSmallM) {
    // Bandwidth-bound: what matters is bytes in flight per SM, not filling
    // every CTA slot. Measured (H200, B=8 H=32 Sq=1 D=128, Sk 8k-64k, GB/s of
    // K/V): 2 splits (~3.9 CTAs/SM) 4299-4623 > 3 splits (5.8/SM, one full
    // wave of 6) 4240-4565 > 4 splits (two waves) 3822-4057; cuDNN 4268-4572.
    // So the split heuristic sizes one wave as 4 CTAs per SM.
    TileShape s = decode_shape(FwdTileConfigDecode<D>{});
    s.ctas_per_sm = std::min(s.ctas_per_sm, 4);
    return s;
  }
  using Causal = FwdTileConfig<D, true>;
  using Full = FwdTileConfig<D, false>;
  return causal ? shape(Causal{}, TypeTag<typename Causal::template Traits<__half>>{})
                : shape(Full{}, TypeTag<typename Full::template Traits<__half>>{});
}

TileShape tile_shape(int kernel_dim, bool causal, FwdTile family, bool kv_fp8) {
  switch (kernel_dim) {
    case 32: return tile_shape_of<32>(causal, family, kv_fp8);
    case 64: return tile_shape_of<64>(causal, family, kv_fp8);
    case 96: return tile_shape_of<96>(causal, family, kv_fp8);
    case 128: return tile_shape_of<128>(causal, family, kv_fp8);
    case 160: return tile_shape_of<160>(causal, family, kv_fp8);
    case 192: return tile_shape_of<192>(causal, family, kv_fp8);
    case 224: return tile_shape_of<224>(causal, family, kv_fp8);
    default: return tile_shape_of<256>(causal, family, kv_fp8);
  }
}

// The tile family a call runs on (params.fwd_tile resolved: never kFwdTileAuto).
FwdTile tile_family(const AttentionFwdParams& params) {
  if (fwd_uses_key_warp_tile(params)) return kFwdTileSmallMKeyWarps;
  return fwd_uses_decode_tile(params) ? kFwdTileSmallM : kFwdTileLarge;
}

// CTAs of the unsplit grid on this tile.
int64_t unsplit_ctas(const AttentionFwdParams& params, const TileShape& shape) {
  return static_cast<int64_t>(params.batch) * params.heads *
         ((params.seqlen_q + shape.block_m - 1) / shape.block_m);
}

// Bytes of K and V a call reads at most (16-bit or FP8 elements, the full
// seqlen_k): the size both the cluster-merge cost model and the L2 policy go by.
double kv_bytes(const AttentionFwdParams& params) {
  const int elem_bytes = params.kv_dtype == DType::kFloat8E4M3 ? 1 : 2;
  return 2.0 * params.batch * params.heads_k * params.seqlen_k * params.head_dim * elem_bytes;
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// FA2's num_splits_heuristic: split only when the CTAs of the unsplit grid
// fill less than ~80% of one wave, then take the smallest split count whose
// wave efficiency (ctas / (waves * slots)) is within 85% of the best.
int num_splits_heuristic(int64_t ctas, int slots, int n_blocks, int max_splits) {
  if (ctas >= 0.8 * slots) return 1;
  max_splits = std::min({max_splits, slots, n_blocks});
  if (max_splits <= 1) return 1;
  auto eligible = [&](int s) {
    // s splits that leave the per-split tile count unchanged vs s-1 only add
    // empty splits.
    return s == 1 || ceil_div(n_blocks, s) != ceil_div(n_blocks, s - 1);
  };
  auto efficiency = [&](int s) {
    const double waves = static_cast<double>(ctas * s) / slots;
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int s = 1; s <= max_splits; ++s) {
    if (eligible(s)) best = std::max(best, efficiency(s));
  }
  for (int s = 1; s <= max_splits; ++s) {
    if (eligible(s) && efficiency(s) >= 0.85 * best) return s;
  }
  return 1;
}

// The Hopper (wgmma + TMA) forward takes a call when it was compiled
// (an sm_90a target), the device is sm_90, FLASH_ATTN_EXT_FWD_IMPL allows it,
// and the call is one it implements: 16-bit, kernel head dim 64/128/256,
// a padded batch or packed varlen sequences, seqused_k, a paged KV cache,
// cache_batch_idx or cache_leftpad (a prefill chunk: more than 16 query rows),
// no attn_mask with them (fwd_sm90_takes_seqs), no split-KV, not the small-M
// decode tile, softmax_scale > 0 (the kernel folds the scale into exp2 after
// the max), no broadcast (stride-0) dimension. Window / softcap / ALiBi /
// attn_mask / dropout calls take its variant instantiation
// (run_fwd_sm90_variants_impl). Never an FP8 KV cache (16-bit q, e4m3 K/V):
// the mma.sync decode kernels. A v head dim other than q's: the pairs of
// fwd_sm90_head_dims_v, without variants (kernel_dim is not used then).
bool use_sm90_forward(const AttentionFwdParams& params, int kernel_dim) {
#ifdef FAE_HAS_SM90A
  if (kernel_impl_requested("FLASH_ATTN_EXT_FWD_IMPL") == KernelImpl::kMma) return false;
  if (params.kv_dtype == DType::kFloat8E4M3) return false;
  const bool dims_ok = params.head_dim_v == params.head_dim
                           ? fwd_sm90_head_dim(kernel_dim)
                           : fwd_sm90_head_dims_v(params.head_dim, params.head_dim_v) &&
                                 !has_variants(params);
  // Packed (varlen) tensors are one batch entry of all their rows.
  const bool packed = params.cu_seqlens_q != nullptr;
  const int64_t rows_q = packed ? params.total_q : params.seqlen_q;
  const int map_batch = packed ? 1 : params.batch;
  const KVMapShape kv = fwd_sm90_kv_map_shape(params);
  return params.dtype != DType::kFloat32 && dims_ok &&
         fwd_sm90_takes_seqs(params) && params.num_splits <= 1 &&
         params.fwd_tile == kFwdTileAuto && !fwd_uses_decode_tile(params) &&
         params.scale_log2 > 0.f && params.heads <= 65535 && params.batch <= 65535 &&
         rows_q <= INT32_MAX && kv.rows <= INT32_MAX && kv.batch <= INT32_MAX &&
         tma_strides_ok(params.q_strides, rows_q, params.heads, map_batch) &&
         tma_strides_ok(params.k_strides, kv.rows, params.heads_k, static_cast<int>(kv.batch)) &&
         tma_strides_ok(params.v_strides, kv.rows, params.heads_k, static_cast<int>(kv.batch)) &&
         device_is_sm90();
#else
  (void)params;
  (void)kernel_dim;
  return false;
#endif
}

// A v head dim other than q's: the Hopper forward of that pair (the op layer
// pads every call that fwd_runs_head_dims turns down to one head dim).
template <typename T>
void dispatch_head_dims_v(AttentionFwdParams& params, cudaStream_t stream) {
#if defined(FAE_HAS_SM90A) && defined(FAE_HAS_HDIM_192)
  if (use_sm90_forward(params, 0)) {
    with_causal(params.causal, [&](auto causal_tag) {
      run_fwd_sm90_impl<T, 192, decltype(causal_tag)::value, 128>(params, stream);
    });
    return;
  }
#endif
  throw std::runtime_error("flash_attn_ext: internal error: head_dim " +
                           std::to_string(params.head_dim) + " with head_dim_v " +
                           std::to_string(params.head_dim_v) + " reached the forward without "
                           "a kernel for the pair (the op layer pads such calls)");
}

template <typename T>
void dispatch_head_dim(AttentionFwdParams& params, cudaStream_t stream) {
  if (params.head_dim_v != params.head_dim) return dispatch_head_dims_v<T>(params, stream);
  const int kernel_dim = fwd_rounded_head_dim(params.head_dim);
  const bool sm90 = use_sm90_forward(params, kernel_dim);
  auto run = [&](auto dim_tag) {
    if (params.kv_dtype == DType::kFloat8E4M3) {  // an FP8 KV cache: its decode tiles
      return run_fwd_kvcache_fp8_impl<T, decltype(dim_tag)::value>(params, stream);
    }
    if (has_kv_cache_addressing(params) && !sm90) {  // decode tiles with cache addressing
      return run_fwd_kvcache_impl<T, decltype(dim_tag)::value>(params, stream);
    }
    if (has_variants(params)) {  // causal or not: the variant kernels' Mask
      constexpr int kDim = decltype(dim_tag)::value;
#ifdef FAE_HAS_SM90A
      if constexpr (kDim == 64 || kDim == 128 || kDim == 256) {
        if (sm90) return run_fwd_sm90_variants_impl<T, kDim>(params, stream);
      }
#endif
      return run_fwd_variants_impl<T, kDim>(params, stream);
    }
    with_causal(params.causal, [&](auto causal_tag) {
      constexpr bool kCausal = decltype(causal_tag)::value;
      constexpr int kDim = decltype(dim_tag)::value;
#ifdef FAE_HAS_SM90A
      // The Hopper instantiations exist for these head dims (generate_instantiations.py)
      // and are filtered by FLASH_ATTN_EXT_HEAD_DIMS like the others.
      if constexpr (kDim == 64 || kDim == 128 || kDim == 256) {
        if (sm90) return run_fwd_sm90_impl<T, kDim, kCausal>(params, stream);
      }
#endif
      (void)sm90;
      run_fwd_impl<T, kDim, kCausal>(params, stream);
    });
  };
  if (!with_compiled_head_dim(kernel_dim, run)) {
    throw_head_dim_not_compiled(params.head_dim, kernel_dim);
  }
}

}  // namespace

// Split clusters of the key-warp tile: 4-CTA clusters of it ran at 0.81-0.83x
// cuDNN where the combine kernel with the same 4 splits ran at 1.01x and 3-CTA
// clusters at 1.03-1.05x (H200, D=128, B=8 H_kv=8 16k/64k and B=2 H_kv=32 16k).
constexpr int kMaxKeyWarpClusterSplits = 3;

// The shape of the tile the call runs on (tile_family).
static TileShape call_tile_shape(const AttentionFwdParams& params) {
  // Variant calls run the non-causal tile (run_fwd_variants_impl).
  return tile_shape(fwd_rounded_head_dim(params.head_dim), params.causal && !has_variants(params),
                    tile_family(params), params.kv_dtype == DType::kFloat8E4M3);
}

// The split heuristic on the call's tile, then: a few splits past the tile's
// cluster limit round down to the limit where a thread-block cluster merges
// them and they still fill 70-100% of one wave (B=8 H_kv=8 decode: the
// one-warp tile's 7 -> 6 splits, kMaxClusterSplits; the key-warp tile's 4 -> 3).
// CTA slots of one wave of the tile.
static int wave_slots(const TileShape& shape, int num_sms) {
  return std::max(1, num_sms) * shape.ctas_per_sm;
}

static int wave_splits(const AttentionFwdParams& params, int num_sms) {
  const TileShape shape = call_tile_shape(params);
  const int n_blocks = ceil_div(params.seqlen_k, shape.block_n);
  const int64_t ctas = unsplit_ctas(params, shape);
  const int slots = wave_slots(shape, num_sms);
  const int splits = num_splits_heuristic(ctas, slots, n_blocks, 128);
  const int cluster_limit =
      fwd_uses_key_warp_tile(params) ? kMaxKeyWarpClusterSplits : kMaxClusterSplits;
  if (splits > cluster_limit && ctas * cluster_limit >= 0.7 * slots &&
      ctas * cluster_limit <= slots && fwd_merges_splits_in_cluster(params, cluster_limit)) {
    return cluster_limit;
  }
  return splits;
}

// The one-warp tile with one full wave of CTAs (4 per SM), merged by the
// combine kernel: as many splits as fill the wave, at most one key tile each.
static int one_wave_splits(const AttentionFwdParams& params, int num_sms) {
  AttentionFwdParams one_warp = params;
  one_warp.fwd_tile = kFwdTileSmallM;
  const TileShape shape = call_tile_shape(one_warp);
  const int n_blocks = ceil_div(params.seqlen_k, shape.block_n);
  const int64_t ctas = std::max<int64_t>(1, unsplit_ctas(one_warp, shape));
  const int64_t slots = wave_slots(shape, num_sms);
  const int64_t want = ctas >= slots ? 1 : slots / ctas;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, n_blocks)));
}

// Decode calls that take the one-warp tile with one full wave (one_wave_splits):
//  * FP8 caches. H100, B=8 H=32/8 D=128 bf16 q, caches 4k / 16k / 64k, GB/s of
//    the FP8 cache: 8 splits (one wave) 1592 / 2392 / 2827, 12 (5.8 CTAs per
//    SM) 1541 / 2371 / 2788, 16 (two waves) 1460 / 2147 / 2498, 24 1473 / 2289
//    / 2747; the key-warp tile with 2 / 3 splits 1590 / 2227 / 2491, 1530 /
//    2240 / 2593.
//  * Paged caches. 16-token pages in a shuffled pool, same shape (bf16 cache),
//    µs contiguous / paged at 16k and 64k: key-warp tile, 3 splits 192 / 207,
//    711 / 766 (1.08x); one warp, 6 splits in clusters 193 / 200, 706 / 737;
//    one warp, 8 splits 194 / 197, 709 / 722 (1.02x).
//  * Long contiguous 16-bit caches whose key-warp splits would fill less than
//    80% of that tile's wave, from kOneWaveMinKeysPerSplit keys per split on.
//    H100, B=8 H=32/8 D=128 bf16, µs at 16k / 32k / 64k: key-warp tile, 3
//    splits (73% of its slots) 193.6 / 369.2 / 718.0; one warp, 8 splits 193.3
//    / 365.3 / 709.7; cuDNN 194.1 / 365.3 / 708.8. D=64, 32k / 64k: 199.4 /
//    380.2 -> 195.5 / 368.8 (cuDNN 193 / 362.5). Shapes that fill the key-warp
//    wave (B=8 H_kv=32, B=16 H_kv=8) or have under 4k keys per split keep it.
constexpr int kOneWaveMinKeysPerSplit = 4096;

static bool fwd_decode_one_wave(const AttentionFwdParams& params, int num_sms) {
  if ((params.kv_dtype == DType::kFloat8E4M3 && params.dtype != DType::kFloat8E4M3) ||
      params.block_table != nullptr) {
    return true;
  }
  // A forced split count keeps the tile fwd_choose_tile gives it.
  if (params.dtype == DType::kFloat32 || params.num_splits > 0 || !fwd_uses_decode_tile(params) ||
      fwd_uses_key_warp_tile(params)) {
    return false;
  }
  AttentionFwdParams key_warps = params;
  key_warps.fwd_tile = kFwdTileSmallMKeyWarps;
  const TileShape shape = call_tile_shape(key_warps);
  const int64_t filled = unsplit_ctas(key_warps, shape) * wave_splits(key_warps, num_sms);
  const int64_t slots = wave_slots(shape, num_sms);
  return filled < 0.8 * slots &&
         params.seqlen_k >= int64_t{kOneWaveMinKeysPerSplit} * one_wave_splits(params, num_sms);
}

static int heuristic_splits(const AttentionFwdParams& params, int num_sms) {
  return fwd_decode_one_wave(params, num_sms) ? one_wave_splits(params, num_sms)
                                              : wave_splits(params, num_sms);
}

// kFwdTileAuto on a decode shape: the key-warp tile where it runs with at most
// 3 splits (heuristic_splits), the one-warp tile elsewhere. Measured on an H200
// (bf16, Sq=1, H=32, ours / cuDNN, same process; key-warp tile's splits in
// brackets; D=64 with the 64 / 128-key tiles of fwd_kernel_traits.cuh):
//
//   D    B  H_kv  cache   one-warp  key warps
//   64   8   32    16k     0.984    0.999 (1)
//   64   4   32     8k     1.050    1.074 (2)
//   64   8    8     4k     1.152    1.163 (3)   (16k 1.021 / 1.026, 64k 1.012 / 1.022)
//   64   1    8    16k     1.060    1.041 (many)
//   128  8   32    16k     0.992    1.001 (1)   (8k-64k: 0.994-0.997 vs 1.003-1.007)
//   128  4   32     8k     0.966    0.985 (2)
//   128  8    8     4k     1.116    1.124 (3)   (16k 1.047 / 1.043, 64k 0.988 / 1.029)
//   128  2   32    16k     1.049    1.039 (3)
//   128  1    8    16k     1.088    1.070 (many)
//   256  8    8    16k     0.878    1.278 (2)   (one CTA per SM; 4k and 64k alike)
//   256  4   32     8k     0.833    1.222 (2)
//   256  1    8    16k     1.251    1.232 (many)
// A forced split count > 1 keeps the one-warp tile.
// KV cache addressing and FP8 KV caches are compiled for the decode tiles only
// (run_fwd_kvcache_impl, run_fwd_kvcache_fp8_impl): such calls run them at any
// seqlen_q (a forced large tile included), unless the Hopper forward takes a
// longer query (a KV-cache prefill chunk, use_sm90_forward:
// 4.1-4.7x faster, H100, `python -m flash_attn_ext.bench paged-prefill`). The decode tiles are
// correct for any shape, but a long query re-reads K/V once per 16 query rows
// there instead of once per 128.
void fwd_choose_tile(AttentionFwdParams& params, int num_sms) {
  if (params.dtype == DType::kFloat32 || params.head_dim <= 0 || params.head_dim > 256) return;
  if (params.head_dim_v != params.head_dim) return;  // the Hopper forward (fwd_runs_head_dims)
  if (fwd_runs_kvcache_kernels(params) && !fwd_uses_decode_tile(params) &&
      !use_sm90_forward(params, fwd_rounded_head_dim(params.head_dim))) {
    params.fwd_tile = kFwdTileSmallM;
  }
  if (params.fwd_tile != kFwdTileAuto || params.num_splits > 1 || !fwd_uses_decode_tile(params)) {
    return;
  }
  if (fwd_decode_one_wave(params, num_sms)) {  // many splits (heuristic_splits): one warp
    params.fwd_tile = kFwdTileSmallM;
    return;
  }
  AttentionFwdParams key_warps = params;
  key_warps.fwd_tile = kFwdTileSmallMKeyWarps;
  if (heuristic_splits(key_warps, num_sms) <= kMaxKeyWarpClusterSplits) {
    params.fwd_tile = kFwdTileSmallMKeyWarps;
  }
}

bool fwd_runs_head_dims(const AttentionFwdParams& params) {
  if (params.head_dim_v == params.head_dim) return true;
#if defined(FAE_HAS_SM90A) && defined(FAE_HAS_HDIM_192)
  const bool dtype_compiled =
#ifdef FAE_HAS_FP16
      params.dtype == DType::kFloat16 ||
#endif
#ifdef FAE_HAS_BF16
      params.dtype == DType::kBFloat16 ||
#endif
      false;
  return dtype_compiled && params.kv_dtype == params.dtype && use_sm90_forward(params, 0);
#else
  return false;
#endif
}

int fwd_num_splits(const AttentionFwdParams& params, int num_sms) {
  // The fp32 SIMT path has no split-KV.
  if (params.dtype == DType::kFloat32) return 1;
  if (params.head_dim <= 0 || params.head_dim > 256) return 1;
  if (params.head_dim_v != params.head_dim) return 1;  // the Hopper forward (fwd_runs_head_dims)
  // A KV cache call left on the auto tile past the decode rows: the Hopper
  // forward's (fwd_choose_tile), which does not split.
  if (params.num_splits <= 0 && fwd_runs_kvcache_kernels(params) && !fwd_uses_decode_tile(params)) {
    return 1;
  }
  if (params.num_splits > 0) {
    // Forced: at most one key tile per split, and within the grid's y limit.
    const int n_blocks = ceil_div(params.seqlen_k, call_tile_shape(params).block_n);
    return std::max(1, std::min({params.num_splits, n_blocks, 65535}));
  }
  return heuristic_splits(params, num_sms);
}

// Cluster merge vs combine kernel, measured on an H200 (B=8, H=32, D=128, bf16
// decode, same process): the cluster saves the combine's ~3-4 us per call but
// its CTA placement costs the main kernel ~0.15% with 2-CTA clusters and ~1.1%
// with 8-CTA clusters (H_kv=8, 64k cache: 497 vs 492 us). As a cost model:
// ~0.16% x (splits - 1) of a main kernel that streams K/V at ~4.4 TB/s, which
// passes the ~3.5 us saved at (K/V bytes) x (splits - 1) ~ 8 GB. Measured gains
// below that: H_kv=8 cache 4k +7%, 16k +2%; H_kv=32 cache 8k +1%, 16k +0.7%.
constexpr double kClusterMergeMaxBytesTimesSplits = 8e9;

bool fwd_merges_splits_in_cluster(const AttentionFwdParams& params, int num_splits) {
#ifdef FAE_HAS_SM90A
  // Variant calls: the combine kernel (their kernels have no cluster merge);
  // so do KV cache calls that run the variant kernel (causal ones included).
  if (num_splits <= 1 || num_splits > kMaxClusterSplits || params.dtype == DType::kFloat32 ||
      params.cu_seqlens_q != nullptr || !fwd_uses_decode_tile(params) || has_variants(params) ||
      (fwd_runs_kvcache_kernels(params) && fwd_kvcache_uses_variant_kernel(params))) {
    return false;
  }
  return kv_bytes(params) * (num_splits - 1) <= kClusterMergeMaxBytesTimesSplits &&
         device_is_sm90();
#else
  (void)params;
  (void)num_splits;
  return false;
#endif
}

// One 4-byte slot for the Hopper forward's tile counter (fwd_sm90_launch.cuh)
// when the call may take that kernel; split-KV calls never do.
static bool fwd_needs_tile_counter(const AttentionFwdParams& params, int num_splits) {
  return num_splits <= 1 && params.dtype != DType::kFloat32 &&
         use_sm90_forward(params, fwd_rounded_head_dim(params.head_dim));
}

// A packed call's compact tile list
// (params.h compact_tiles) after the counter and a pad (8-byte entries):
// two ints per (head, query tile) entry, sized for the smallest query tile
// (64 rows), which bounds every kernel's.
static int64_t fwd_compact_tiles_ints(const AttentionFwdParams& params) {
  if (!compact_tiles_apply(params)) return 0;
  const int64_t entries = compact_tiles_capacity(params.total_q, params.batch, 64) * params.heads;
  return entries <= 0x7fffffff ? 2 * entries : 0;  // larger lists: the padded grid
}

int64_t fwd_workspace_floats(const AttentionFwdParams& params, int num_splits) {
  if (params.dtype == DType::kFloat32) return 0;
  if (num_splits <= 1) {
    if (!fwd_needs_tile_counter(params, num_splits)) return 0;
    const int64_t list = fwd_compact_tiles_ints(params);
    return list > 0 ? 2 + list : 1;
  }
  if (fwd_merges_splits_in_cluster(params, num_splits)) return 0;
  const int64_t rows = params.q_rows_total;
  return num_splits * rows * (fwd_rounded_head_dim(params.head_dim) + 1);
}

void fwd_set_workspace(AttentionFwdParams& params, float* workspace, int num_splits) {
  params.tile_counter = nullptr;
  if (num_splits <= 1 || workspace == nullptr) {
    params.out_accum = nullptr;
    params.lse_accum = nullptr;
    // Unsplit calls get a workspace only for the tile counter and maybe a
    // compact tile list (fwd_workspace_floats).
    params.tile_counter = reinterpret_cast<int*>(workspace);
    params.compact_tiles = nullptr;
    if (workspace != nullptr && fwd_needs_tile_counter(params, num_splits)) {
      const int64_t list = fwd_compact_tiles_ints(params);
      if (list > 0) {
        params.compact_tiles = params.tile_counter + 2;
        params.compact_tiles_capacity = static_cast<int>(list / 2);
      }
    }
    return;
  }
  // out_accum [splits, q_rows_total, kernel head dim], then
  // lse_accum [splits, q_rows_total] (rows indexed like lse, params.h).
  const int64_t rows = params.q_rows_total;
  params.out_accum = workspace;
  params.lse_accum = workspace + num_splits * rows * fwd_rounded_head_dim(params.head_dim);
}

// Whether each K/V byte of the call has exactly one reading CTA: the decode
// tile with a single query tile per head (seqlen_q <= its 16 rows) and one
// query head per kv head (MHA, or GQA regrouped by ops_cuda.cpp). Where CTAs
// share K/V (query tiles of one head, query heads of one group) the default
// policy keeps that reuse.
static bool fwd_reads_kv_once(const AttentionFwdParams& params) {
  return params.dtype != DType::kFloat32 && fwd_uses_decode_tile(params) &&
         params.seqlen_q <= kFwdDecodeMaxSeqlenQ && params.heads == params.heads_k;
}

// evict_first pays while K/V are small next to L2. Measured on an H200 (L2
// 60 MiB by the driver; bf16 decode, D=128; triton do_bench, whose L2 flush
// leaves L2 full of dirty lines; same process; ours / cuDNN):
//
//   shape (B, H_kv, cache)   K+V      default policy   evict_first
//   8, 8, 4k                 134 MB       1.047           1.120
//   1, 8, 16k                 67 MB       0.981           1.069
//   1, 32, 16k               268 MB       0.983           0.972
//   1, 8, 64k                268 MB       0.990           0.990
//   8, 8, 16k                537 MB       0.997           0.943
//   8, 8, 64k                2.1 GB       0.995           0.945
//   8, 32, 8k / 32k      1.1 / 4.3 GB  0.996 / 0.996   0.926 / 0.943
//
// The gain is the write-back of those dirty lines, which the K/V stream no
// longer evicts (under ncu, which starts each kernel from a clean L2, both
// policies take the same time: 129.6 vs 130.9 us at 537 MB); the loss grows
// with the stream, which then gets only the L2 space the kept lines leave.
// Fractional policies (evict_first on 25-75% of the lines) landed in between
// at every size. Hence evict_first while K/V <= 4x the L2 size.
constexpr int64_t kEvictFirstMaxL2Multiple = 4;

void fwd_set_kv_l2_policy(AttentionFwdParams& params, int64_t l2_cache_bytes) {
  params.kv_evict_first =
      fwd_reads_kv_once(params) &&
      kv_bytes(params) <= static_cast<double>(kEvictFirstMaxL2Multiple * l2_cache_bytes);
}

void run_fwd(AttentionFwdParams& params, cudaStream_t stream) {
  if (params.head_dim <= 0 || params.head_dim % 8 != 0 || params.head_dim > 256) {
    throw std::runtime_error("flash_attn_ext: CUDA forward needs head_dim % 8 == 0 and <= 256, got " +
                             std::to_string(params.head_dim));
  }
  if (params.kv_dtype != params.dtype &&
      (params.kv_dtype != DType::kFloat8E4M3 || params.dtype == DType::kFloat32 ||
       params.head_dim % 16 != 0)) {
    // ops_params.h admits an FP8 K/V only under a 16-bit q; ops_cuda.cpp pads its head dim.
    throw std::runtime_error("flash_attn_ext: internal error: FP8 K/V need a 16-bit q and a "
                             "head dim that is a multiple of 16 on CUDA");
  }
  if (params.heads_k <= 0 || params.heads % params.heads_k != 0) {
    throw std::runtime_error("flash_attn_ext: heads (" + std::to_string(params.heads) +
                             ") must be a multiple of heads_k (" +
                             std::to_string(params.heads_k) + ")");
  }
  switch (params.dtype) {
    case DType::kFloat32:
      run_fwd_fp32(params, stream);
      return;
    case DType::kFloat16:
#ifdef FAE_HAS_FP16
      dispatch_head_dim<__half>(params, stream);
      return;
#else
      throw_dtype_not_compiled("fp16");
#endif
    case DType::kBFloat16:
#ifdef FAE_HAS_BF16
      dispatch_head_dim<__nv_bfloat16>(params, stream);
      return;
#else
      throw_dtype_not_compiled("bf16");
#endif
  }
  throw std::runtime_error("flash_attn_ext: unknown dtype in run_fwd");
}

}  // namespace cuda
}  // namespace flash_attn_ext
