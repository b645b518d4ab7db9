// The forward of DeepSeek MLA's absorbed decode shape: q / k head dim 576
// (512 latent + 64 rope columns), v head dim 512, where v is usually the
// first 512 columns of the same latent cache as k (FlashMLA's layout). Head
// dims above 256 exceed every other kernel here (wgmma N, the registers of a
// 16-row O), so this one splits both products across the warps of a CTA:
//
//   CTA = 8 warps, 16 query rows (a GQA decode's heads, regrouped into rows by
//         the op layer), one split of the keys; grid (row blocks, splits,
//         batch * heads)
//
//              S = Q K^T partial: keys x Q.K^T columns (576)   O / V columns (512)
//   warp 0   | first half of the tile's keys,   0 .. 143  |   0 ..  63  O += P V
//   warp 1   | first half,                    144 .. 287  |  64 .. 127
//   warp 2   | first half,                    288 .. 431  | 128 .. 191
//   warp 3   | first half,                    432 .. 575  | 192 .. 255
//   warp 4-7 | second half of the keys, the same columns  | 256 .. 511
//
// Per key tile (kBlockN keys, cp.async double-buffered): each warp forms its
// 16 x kBlockN / 2 partial of S = Q K^T over its 144 columns (mma.sync
// m16n8k16, Q fragments held in registers for the whole CTA), the partials
// are summed through shared memory (every warp adds the four of each key half
// in the same order, so all hold the same S), every warp runs the same online
// softmax on it and adds P V for its 64 columns of V. Eight warps rather than
// four: the mma chains of one tile are short, so the SM needs more warps in
// flight (H200, 16 heads, 64k cache: 2.0 TB/s with four). K and V are one tile when v is a view of k's
// first 512 columns (same pointer and strides: the latent cache, read once
// from HBM), two tiles otherwise.
//
// Every CTA writes its split's partial result, normalised (O / l, and its
// lse, fp32) into the workspace; a combine kernel merges the splits (and
// folds a learnable sink) into out and lse. A decode step with 16 heads per
// latent head does ~30 FLOPs per cache byte, so the split count fills the
// GPU several CTAs deep (fwd_mla_num_splits) to stream the cache; measured
// (H100): 2.2-2.4 TB/s, 72-78% of a copy kernel's bandwidth, at ~70 TFLOP/s
// of mma.sync, i.e. issue-bound. With 128 heads it is compute-bound (~90-100
// TFLOP/s): wgmma tiles (FlashMLA's) would be the next step for both.
// Causal (bottom-right), seqused_k, varlen (cu_seqlens), block_table,
// cache_batch_idx and cache_leftpad go through seq_bounds / kv_row like every
// other kernel; window / softcap / ALiBi / attn_mask / dropout are not
// implemented here (the op layer raises NotImplementedError).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "../common/ptx.cuh"
#include "../flash_api.h"

namespace flash_attn_ext {
namespace cuda {
namespace {

template <bool kSharedKV>
struct MlaConfig {
  static constexpr int kHeadDim = 576;   // q / k
  static constexpr int kHeadDimV = 512;  // v / out
  static constexpr int kBlockM = 16;     // query rows per CTA (one mma M)
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeyGroups = 2;  // S: warps 0-3 the first half of a tile's keys
  static constexpr int kDimGroups = kWarps / kKeyGroups;
  // Keys per tile: two stages of K (and V when it is a tile of its own) must
  // fit the 99 KB an sm_86 / sm_89 block may have.
  static constexpr int kBlockN = kSharedKV ? 32 : 16;
  static constexpr int kStages = 2;  // the tile computed and the next one loading
  static constexpr int kQkCols = kHeadDim / kDimGroups;  // a warp's share of the Q.K^T sum
  static constexpr int kGroupTiles = kBlockN / kKeyGroups / 8;  // S n-tiles of a warp
  static constexpr int kVCols = kHeadDimV / kWarps;  // a warp's O columns
  // Rows padded by 16 bytes: ldmatrix's 8 row addresses then fall into
  // different bank groups (1152 bytes is a multiple of 128).
  static constexpr int kKRowBytes = kHeadDim * 2 + 16;
  static constexpr int kVRowBytes = kHeadDimV * 2 + 16;
  static constexpr int kKTileBytes = kBlockN * kKRowBytes;
  static constexpr int kVTileBytes = kSharedKV ? 0 : kBlockN * kVRowBytes;
  static constexpr int kStageBytes = kKTileBytes + kVTileBytes;
  // S partials: [warp][n-tile][lane] float4, the accumulator layout as is.
  static constexpr int kExchangeBytes = kWarps * kGroupTiles * 32 * 16;
  static constexpr int kSmemBytes = kStages * kStageBytes + kExchangeBytes;

  static_assert(kQkCols % 16 == 0, "a warp's Q.K^T columns are whole k-steps");
  static_assert(kVCols % 16 == 0, "a warp's O columns are whole ldmatrix.x4.trans pairs");
  static_assert(kBlockN % 16 == 0, "P V k-steps of 16 keys");
  static_assert(kGroupTiles == 1 || kGroupTiles == 2, "a warp's keys: one ldmatrix x2 or x4");
  static_assert(kThreads % kBlockN == 0, "whole threads per tile row (the loads)");
  static_assert(kSmemBytes <= 99 * 1024, "fits an sm_86 / sm_89 block");
};

// Two CTAs per SM (at most 128 registers): 16 warps to hide the mma and
// shared-memory latencies of the short per-tile chains.
template <typename T, bool kSharedKV>
__global__ void __launch_bounds__(MlaConfig<kSharedKV>::kThreads, 2)
    flash_fwd_mla_kernel(const __grid_constant__ AttentionFwdParams params, int num_splits,
                         int tiles_per_split) {
  using Cfg = MlaConfig<kSharedKV>;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kQkSteps = Cfg::kQkCols / 16;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kGroupTiles = Cfg::kGroupTiles;
  constexpr int kOTiles = Cfg::kVCols / 8;
  extern __shared__ __align__(16) uint8_t smem[];

  const int m_block = blockIdx.x, split = blockIdx.y;
  const int b = blockIdx.z / params.heads, h = blockIdx.z % params.heads;
  const int h_k = h / (params.heads / params.heads_k);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q4 = lane % 4;
  const int key_group = warp / Cfg::kDimGroups, dim_group = warp % Cfg::kDimGroups;

  const SeqBounds seq = seq_bounds<true, true>(params, b);
  const int row0 = m_block * Cfg::kBlockM;
  if (row0 >= seq.seqlen_q) return;
  const int n_tiles_total = (seq.seqlen_k + kBlockN - 1) / kBlockN;
  // Causal: the block's last row sees keys up to row + causal_offset.
  int n_end = n_tiles_total;
  if (params.causal) {
    const int last_row = min(row0 + Cfg::kBlockM, seq.seqlen_q) - 1;
    const int last_key = last_row + seq.causal_offset;
    n_end = max(0, min(n_tiles_total, last_key / kBlockN + 1));
    if (last_key < 0) n_end = 0;
  }
  const int n_begin = split * tiles_per_split;
  const int n_stop = min(n_end, n_begin + tiles_per_split);

  // Q fragments of this warp's 144 columns, for the whole CTA (36 registers).
  const T* q = static_cast<const T*>(params.q);
  uint32_t qa[kQkSteps][4];
  {
    const T* row_lo = q + row_offset(params.q_strides, b, h, seq.row0_q + row0 + g);
    const T* row_hi = q + row_offset(params.q_strides, b, h, seq.row0_q + row0 + g + 8);
    const bool lo_ok = row0 + g < seq.seqlen_q, hi_ok = row0 + g + 8 < seq.seqlen_q;
#pragma unroll
    for (int ks = 0; ks < kQkSteps; ++ks) {
      const int col = dim_group * Cfg::kQkCols + ks * 16 + 2 * q4;
      qa[ks][0] = lo_ok ? *reinterpret_cast<const uint32_t*>(row_lo + col) : 0u;
      qa[ks][1] = hi_ok ? *reinterpret_cast<const uint32_t*>(row_hi + col) : 0u;
      qa[ks][2] = lo_ok ? *reinterpret_cast<const uint32_t*>(row_lo + col + 8) : 0u;
      qa[ks][3] = hi_ok ? *reinterpret_cast<const uint32_t*>(row_hi + col + 8) : 0u;
    }
  }

  // K (and V) tile n into stage `stage`: 16-byte pieces, kThreads / kBlockN
  // threads per key row (its address found once: a paged cache's table read),
  // rows past the sequence zero-filled (their scores are masked; zero V keeps
  // P V finite).
  const T* k = static_cast<const T*>(params.k);
  const T* v = static_cast<const T*>(params.v);
  constexpr int kThreadsPerRow = Cfg::kThreads / kBlockN;
  const int load_row = threadIdx.x / kThreadsPerRow, load_piece = threadIdx.x % kThreadsPerRow;
  auto load_tile = [&](int n, int stage) {
    uint8_t* k_smem = smem + stage * Cfg::kStageBytes + load_row * Cfg::kKRowBytes;
    const int key = n * kBlockN + load_row;
    const bool ok = key < seq.seqlen_k;
    const KVRow kv = kv_row(params, b, ok ? seq.row0_k + key : 0);
    const T* k_src = k + kv_offset(params.k_strides, kv, h_k);
    constexpr int kKPieces = Cfg::kHeadDim * 2 / 16;  // 72 per row
#pragma unroll
    for (int c = load_piece; c < kKPieces; c += kThreadsPerRow) {
      cp_async_16(k_smem + c * 16, k_src + c * 8, ok);
    }
    if constexpr (!kSharedKV) {
      uint8_t* v_smem = smem + stage * Cfg::kStageBytes + Cfg::kKTileBytes +
                        load_row * Cfg::kVRowBytes;
      const T* v_src = v + kv_offset(params.v_strides, kv, h_k);
      constexpr int kVPieces = Cfg::kHeadDimV * 2 / 16;  // 64 per row
#pragma unroll
      for (int c = load_piece; c < kVPieces; c += kThreadsPerRow) {
        cp_async_16(v_smem + c * 16, v_src + c * 8, ok);
      }
    }
  };

  float o[kOTiles][4];
#pragma unroll
  for (int j = 0; j < kOTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float4* exchange = reinterpret_cast<float4*>(smem + Cfg::kStages * Cfg::kStageBytes);

  // One tile ahead: tile n + 1 loads into the stage tile n - 1 used, once
  // every warp is past tile n - 1 (the barrier that also publishes tile n),
  // so that a tile costs two barriers, not three; 2 CTAs x ~37 KB in flight
  // per SM cover HBM's latency.
  if (n_begin < n_stop) load_tile(n_begin, 0);
  cp_async_commit();

  for (int n = n_begin; n < n_stop; ++n) {
    const int stage = (n - n_begin) % Cfg::kStages;
    cp_async_wait<0>();
    __syncthreads();  // tile n is in; every warp is done with tile n - 1 (stage, exchange)
    if (n + 1 < n_stop) load_tile(n + 1, stage ^ 1);
    cp_async_commit();
    const uint8_t* k_smem = smem + stage * Cfg::kStageBytes;
    const uint8_t* v_smem = kSharedKV ? k_smem : k_smem + Cfg::kKTileBytes;
    constexpr int kVRowBytes = kSharedKV ? Cfg::kKRowBytes : Cfg::kVRowBytes;

    // This warp's partial S: its key half, its 144 columns. ldmatrix on K
    // rows gives the B fragments of one k-step: x4 for n-tiles (0, 1) of the
    // half (matrix j: key rows + 8 (j / 2), columns + 8 (j % 2)), x2 for one.
    float part[kGroupTiles][4];
#pragma unroll
    for (int j = 0; j < kGroupTiles; ++j) part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.f;
    const uint8_t* k_rows = k_smem + key_group * (kBlockN / Cfg::kKeyGroups) * Cfg::kKRowBytes;
#pragma unroll
    for (int ks = 0; ks < kQkSteps; ++ks) {
      const int col = dim_group * Cfg::kQkCols + ks * 16;
      const int mat = lane / 8;
      if constexpr (kGroupTiles == 2) {
        uint32_t r[4];
        ldmatrix_x4(r, k_rows + (8 * (mat / 2) + lane % 8) * Cfg::kKRowBytes +
                           (col + 8 * (mat % 2)) * 2);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_16816<T>(part[0], qa[ks], b0);
        mma_16816<T>(part[kGroupTiles - 1], qa[ks], b1);
      } else {
        uint32_t r[2];
        ldmatrix_x2(r, k_rows + (lane % 8) * Cfg::kKRowBytes + (col + 8 * (mat % 2)) * 2);
        mma_16816<T>(part[0], qa[ks], r);
      }
    }
    // Each key half's four partials summed in warp order by every warp (all
    // hold the same S): n-tile j of S is tile j % kGroupTiles of key half
    // j / kGroupTiles.
#pragma unroll
    for (int j = 0; j < kGroupTiles; ++j) {
      exchange[(warp * kGroupTiles + j) * 32 + lane] =
          make_float4(part[j][0], part[j][1], part[j][2], part[j][3]);
    }
    __syncthreads();
    float s[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int first_warp = (j / kGroupTiles) * Cfg::kDimGroups;
      float4 sum = exchange[(first_warp * kGroupTiles + j % kGroupTiles) * 32 + lane];
#pragma unroll
      for (int w = 1; w < Cfg::kDimGroups; ++w) {
        const float4 x = exchange[((first_warp + w) * kGroupTiles + j % kGroupTiles) * 32 + lane];
        sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
      }
      s[j][0] = sum.x, s[j][1] = sum.y, s[j][2] = sum.z, s[j][3] = sum.w;
    }

    // Online softmax in the log2 domain (scale folded into the exponent),
    // keys past the sequence or the causal diagonal masked.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + g + 8 * half;
      const int key_limit = params.causal ? min(seq.seqlen_k, row + seq.causal_offset + 1)
                                          : seq.seqlen_k;
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = n * kBlockN + 8 * j + 2 * q4 + e;
          float& x = s[j][2 * half + e];
          x = key < key_limit ? x * params.scale_log2 : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      }
      tile_max = quad_max(tile_max);
      const float new_max = fmaxf(row_max[half], tile_max);
      // A row without a visible key so far keeps max -inf: its P are 0.
      const float base = new_max == -INFINITY ? 0.f : new_max;
      const float factor = exp2f(row_max[half] - base);
      float tile_sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * half + e];
          x = exp2f(x - base);
          tile_sum += x;
        }
      }
      row_sum[half] = row_sum[half] * factor + quad_sum(tile_sum);
      row_max[half] = new_max;
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        o[j][2 * half] *= factor;
        o[j][2 * half + 1] *= factor;
      }
    }

    // O += P V over this warp's 64 columns: P from the S accumulators (A
    // fragments of 16-key k-steps), V by ldmatrix.x4.trans: matrix j is key
    // rows 16 kk + 8 (j % 2) .. + 7 at columns 16 p + 8 (j / 2).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                              pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int p = 0; p < kOTiles / 2; ++p) {
        const int mat = lane / 8;
        const uint8_t* addr = v_smem + (16 * kk + 8 * (mat % 2) + lane % 8) * kVRowBytes +
                              (warp * Cfg::kVCols + 16 * p + 8 * (mat / 2)) * 2;
        uint32_t r[4];
        ldmatrix_x4_trans(r, addr);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_16816<T>(o[2 * p], pa, b0);
        mma_16816<T>(o[2 * p + 1], pa, b1);
      }
    }
  }
  cp_async_wait<0>();

  // This split's result for its rows: O / l and lse (natural log; -inf and
  // O = 0 for a row without visible keys in the split).
  float* out_accum = params.out_accum;
  float* lse_accum = params.lse_accum;
  const int64_t rows_total = params.q_rows_total;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= seq.seqlen_q) continue;
    const int64_t idx = static_cast<int64_t>(split) * rows_total + seq.lse_index(params, b, h, row);
    const float inv = row_sum[half] > 0.f ? 1.f / row_sum[half] : 0.f;
    float* dst = out_accum + idx * Cfg::kHeadDimV + warp * Cfg::kVCols;
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
      *reinterpret_cast<float2*>(dst + 8 * j + 2 * q4) =
          make_float2(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
    }
    if (warp == 0 && q4 == 0) {
      lse_accum[idx] = row_sum[half] > 0.f
                           ? (row_max[half] + log2f(row_sum[half])) * 0.6931471805599453f
                           : -INFINITY;
    }
  }
}

// Merges the splits of one row (and a learnable sink, a term of the row's
// softmax denominator without a value): lse = log(sum exp(lse_s) + exp(sink)),
// out = sum exp(lse_s - lse) O_s. Grid (rows, heads, batch); 128 threads,
// 4 columns each.
template <typename T>
__global__ void __launch_bounds__(128)
    flash_fwd_mla_combine_kernel(const __grid_constant__ AttentionFwdParams params,
                                 int num_splits) {
  constexpr int kHeadDimV = 512;
  const int row = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const SeqBounds seq = seq_bounds<true, true>(params, b);
  if (row >= seq.seqlen_q) return;
  const int64_t rows_total = params.q_rows_total;
  const int64_t idx = seq.lse_index(params, b, h, row);
  float max_lse = -INFINITY;
  for (int s = 0; s < num_splits; ++s) max_lse = fmaxf(max_lse, params.lse_accum[s * rows_total + idx]);
  const float sink = params.learnable_sink != nullptr ? params.learnable_sink[h] : -INFINITY;
  max_lse = fmaxf(max_lse, sink);
  float total = 0.f;
  if (max_lse != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) total += expf(params.lse_accum[s * rows_total + idx] - max_lse);
    total += expf(sink - max_lse);
  }
  const float lse = total > 0.f ? max_lse + logf(total) : -INFINITY;
  const int col = 4 * threadIdx.x;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lse != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) {
      const float w = expf(params.lse_accum[s * rows_total + idx] - lse);
      if (w == 0.f) continue;  // (an empty split's O is 0 anyway)
      const float4 x = *reinterpret_cast<const float4*>(
          params.out_accum + (s * rows_total + idx) * kHeadDimV + col);
      acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
    }
  }
  T* out = static_cast<T*>(params.out) + row_offset(params.out_strides, b, h, seq.row0_q + row) + col;
  *reinterpret_cast<uint2*>(out) = make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
  if (threadIdx.x == 0) params.lse[idx] = lse;
}

template <typename T, bool kSharedKV>
void launch_mla(const AttentionFwdParams& params, int num_splits, cudaStream_t stream) {
  using Cfg = MlaConfig<kSharedKV>;
  const int n_tiles = (params.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int tiles_per_split = std::max(1, (n_tiles + num_splits - 1) / num_splits);
  auto kernel = flash_fwd_mla_kernel<T, kSharedKV>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: cudaFuncSetAttribute(MLA forward): ") +
                             cudaGetErrorString(err));
  }
  const dim3 grid((params.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, num_splits,
                  params.batch * params.heads);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, num_splits, tiles_per_split);
  flash_fwd_mla_combine_kernel<T><<<dim3(params.seqlen_q, params.heads, params.batch), 128, 0,
                                    stream>>>(params, num_splits);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: MLA forward launch: ") +
                             cudaGetErrorString(err));
  }
}

}  // namespace

bool fwd_mla_head_dims(int head_dim, int head_dim_v) { return head_dim == 576 && head_dim_v == 512; }

bool fwd_mla_shares_kv(const AttentionFwdParams& p) {
  return p.k == p.v && p.k_strides.batch == p.v_strides.batch &&
         p.k_strides.head == p.v_strides.head && p.k_strides.row == p.v_strides.row;
}

int fwd_mla_num_splits(const AttentionFwdParams& p, int num_sms) {
  if (p.num_splits > 0) return std::min(p.num_splits, 256);
  const int block_n = fwd_mla_shares_kv(p) ? MlaConfig<true>::kBlockN : MlaConfig<false>::kBlockN;
  const int n_tiles = std::max(1, (p.seqlen_k + block_n - 1) / block_n);
  const int64_t ctas = static_cast<int64_t>((p.seqlen_q + 15) / 16) * p.batch * p.heads;
  // About four CTAs per SM (each holds 2 stages of ~37 KB), at least 4 key
  // tiles per split so that the pipeline runs.
  const int64_t want = (4 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, n_tiles / 4, 256})));
}

int64_t fwd_mla_workspace_floats(const AttentionFwdParams& p, int num_splits) {
  return static_cast<int64_t>(num_splits) * p.q_rows_total * (512 + 1);
}

void fwd_mla_set_workspace(AttentionFwdParams& p, float* workspace, int num_splits) {
  p.out_accum = workspace;
  p.lse_accum = workspace + static_cast<int64_t>(num_splits) * p.q_rows_total * 512;
}

void run_fwd_mla(const AttentionFwdParams& params, int num_splits, cudaStream_t stream) {
  if (!fwd_mla_head_dims(params.head_dim, params.head_dim_v) || has_variants(params) ||
      params.kv_dtype != params.dtype || params.out_accum == nullptr) {
    throw std::runtime_error("flash_attn_ext: internal error: unsupported params reached the "
                             "MLA forward");
  }
  const bool shared = fwd_mla_shares_kv(params);
  switch (params.dtype) {
#ifdef FAE_HAS_FP16
    case DType::kFloat16:
      return shared ? launch_mla<__half, true>(params, num_splits, stream)
                    : launch_mla<__half, false>(params, num_splits, stream);
#endif
#ifdef FAE_HAS_BF16
    case DType::kBFloat16:
      return shared ? launch_mla<__nv_bfloat16, true>(params, num_splits, stream)
                    : launch_mla<__nv_bfloat16, false>(params, num_splits, stream);
#endif
    default:
      throw std::runtime_error("flash_attn_ext: the MLA forward (head dims 576 / 512) takes "
                               "float16 or bfloat16 (compiled dtypes only)");
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
