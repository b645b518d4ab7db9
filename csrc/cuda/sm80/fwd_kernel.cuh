// FlashAttention-2 style forward kernel (sm_80+ mma.sync) and the split-KV
// combine kernel.
//
// One CTA computes one kBlockM-row query tile of one (batch, head) against a
// contiguous range of key tiles (all of them unless split-KV is on):
//
//   prologue   cp.async Q and the first kStages-1 K/V tiles into shared memory
//              (Q -> registers when Traits::kQInRegs)
//   main loop  for each key tile n:
//                wait K_n; prefetch K/V tile n+kStages-1
//                S = Q K_n^T                       (fp32, in registers)
//                scale to log2 domain, mask        (only on boundary tiles)
//                online softmax: P = exp2(S - m), rescale O and row sums
//                wait V_n;  O += P V_n             (P straight from registers)
//   epilogue   O /= row_sum, lse = m*ln2 + ln(row_sum);
//              O -> shared memory -> 16-byte global stores (or fp32 partials
//              to out_accum / lse_accum when split-KV is on)
#pragma once
#include <cmath>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"
#include "../common/fwd_softmax.cuh"

namespace flash_attn_ext {
namespace cuda {

// ---------------------------------------------------------------------------
// Global -> shared copy of a [kRows x kHeadDim] tile with 16-byte cp.async.
// Consecutive threads take consecutive 16-byte chunks of a row (coalesced).
// Rows >= valid_rows and columns >= head_dim are zero-filled, which is what
// makes partial tiles and padded head dims safe: zero Q/K columns leave Q K^T
// unchanged, zero V rows keep 0 * garbage out of P V.
// `gmem` points at row 0 of the tile, which is always in bounds.
// kFullL2Hint: the caller knows the whole tile is in range (valid_rows >=
// kRows, head_dim == kHeadDim); every copy then carries `l2_policy` (ptx.cuh)
// and none is predicated (zero-fills cannot carry a policy: cp_async_16_l2).
// ---------------------------------------------------------------------------
template <bool kFullL2Hint>
FAE_DEVICE void copy_16(void* smem, const void* gmem, bool valid, uint64_t l2_policy) {
  if constexpr (kFullL2Hint) {
    cp_async_16_l2(smem, gmem, l2_policy);
  } else {
    cp_async_16(smem, gmem, valid);
  }
}

template <typename Traits, typename Layout, int kRows, bool kFullL2Hint = false>
FAE_DEVICE void load_tile_async(typename Traits::T* smem, const typename Traits::T* gmem,
                                int64_t row_stride, int valid_rows, int head_dim, int tid,
                                uint64_t l2_policy = 0) {
  constexpr int kChunks = Traits::kHeadDim / 8;
  constexpr int kThreads = Traits::kNThreads;
  if constexpr (kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0) {
    // Each thread keeps one column chunk and walks rows kRowsPerIter apart:
    // one base address per thread plus compile-time row increments.
    constexpr int kRowsPerIter = kThreads / kChunks;
    const int chunk = tid % kChunks;
    const int row0 = tid / kChunks;
    const bool col_valid = kFullL2Hint || chunk * 8 < head_dim;
    // Stepping the pointer (rather than base + i * stride) keeps the compiler
    // from hoisting one 64-bit offset per row out of the main loop.
    const auto* src = gmem + row0 * row_stride + chunk * 8;
    const int64_t step = kRowsPerIter * row_stride;
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerIter; ++i) {
      const int row = row0 + i * kRowsPerIter;
      const bool valid = kFullL2Hint || (col_valid && row < valid_rows);
      copy_16<kFullL2Hint>(smem + Layout::offset(row, chunk), valid ? src : gmem, valid, l2_policy);
      src += step;
    }
  } else {
    constexpr int kTotal = kRows * kChunks;
    constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
    // Partial unroll when one warp copies a wide tile (decode tile, D=224: 28
    // copies per row group): fully unrolled, ptxas kept every address live
    // and spilled ~850 bytes.
#pragma unroll(kIters <= 8 ? kIters : 4)
    for (int i = 0; i < kIters; ++i) {
      const int idx = tid + i * kThreads;
      if (kTotal % kThreads != 0 && idx >= kTotal) break;
      const int row = idx / kChunks;
      const int chunk = idx % kChunks;
      const bool valid = kFullL2Hint || (row < valid_rows && chunk * 8 < head_dim);
      copy_16<kFullL2Hint>(smem + Layout::offset(row, chunk),
                         valid ? gmem + row * row_stride + chunk * 8 : gmem, valid, l2_policy);
    }
  }
}

// A-fragments of the warp's Q rows for head-dim k-step kk (16 columns).
// ldmatrix.x4: lanes 0-15 address rows 0-15 at chunk 2kk, lanes 16-31 rows
// 0-15 at chunk 2kk+1, giving a[0..3] = (g,lo) (g+8,lo) (g,hi) (g+8,hi).
template <typename Traits>
FAE_DEVICE void load_q_frag(uint32_t (&a)[4], const typename Traits::T* smem_q, int warp_row0,
                            int m, int kk, int lane) {
  const int row = warp_row0 + m * 16 + (lane & 15);
  ldmatrix_x4(a, smem_q + Traits::QLayout::offset(row, 2 * kk + (lane >> 4)));
}

// S[m] += Q[m] K^T over the whole head dim, for the warp's kWarpKeys keys of
// the tile (smem_k points at the warp's first key row).
template <typename Traits, typename QFrags>
FAE_DEVICE void gemm_qk(float (&s)[Traits::kMmaM][Traits::kTilesN][4], const QFrags& q_frags,
                        const typename Traits::T* smem_q, const typename Traits::T* smem_k,
                        int warp_row0, int lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsD; ++kk) {
    uint32_t a[Traits::kMmaM][4];
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m) {
      if constexpr (Traits::kQInRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[m][r] = q_frags[m][kk][r];
      } else {
        load_q_frag<Traits>(a[m], smem_q, warp_row0, m, kk, lane);
      }
    }
#pragma unroll
    for (int jn = 0; jn < Traits::kWarpKeys / 16; ++jn) {
      // K is [key][dim] = the "col" B operand as stored: no transpose.
      // Matrices: (keys 0-7, dims lo) (keys 0-7, dims hi) (keys 8-15, lo) (keys 8-15, hi)
      // = b0/b1 of n-tile 2jn, then b0/b1 of n-tile 2jn+1.
      uint32_t b[4];
      const int key = jn * 16 + ((lane >> 4) << 3) + (lane & 7);
      ldmatrix_x4(b, smem_k + Traits::KVLayout::offset(key, 2 * kk + ((lane >> 3) & 1)));
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        mma_16816<T>(s[m][2 * jn], a[m], b_lo);
        mma_16816<T>(s[m][2 * jn + 1], a[m], b_hi);
      }
    }
  }
}

// O[m] += P[m] V. The accumulator layout of S for n-tiles (2kk, 2kk+1) is
// exactly the A-fragment layout of a 16x16 operand, so P is only converted
// to 16 bits and re-packed, never staged through shared memory.
template <typename Traits>
FAE_DEVICE void gemm_pv(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                        const float (&p)[Traits::kMmaM][Traits::kTilesN][4],
                        const typename Traits::T* smem_v, int lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) {
    uint32_t a[Traits::kMmaM][4];
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m) {
      a[m][0] = pack2<T>(p[m][2 * kk][0], p[m][2 * kk][1]);          // row g,   keys lo
      a[m][1] = pack2<T>(p[m][2 * kk][2], p[m][2 * kk][3]);          // row g+8, keys lo
      a[m][2] = pack2<T>(p[m][2 * kk + 1][0], p[m][2 * kk + 1][1]);  // row g,   keys hi
      a[m][3] = pack2<T>(p[m][2 * kk + 1][2], p[m][2 * kk + 1][3]);  // row g+8, keys hi
    }
#pragma unroll
    for (int jd = 0; jd < Traits::kHeadDim / 16; ++jd) {
      // V is [key][dim]; the B operand wants (k = key, n = dim) pairs along k,
      // hence ldmatrix.trans. Matrices: (keys 0-7, dims lo) (keys 8-15, dims lo)
      // (keys 0-7, dims hi) (keys 8-15, dims hi) = b0/b1 of d-tile 2jd, 2jd+1.
      uint32_t b[4];
      const int key = kk * 16 + (lane & 15);
      ldmatrix_x4_trans(b, smem_v + Traits::KVLayout::offset(key, 2 * jd + (lane >> 4)));
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        mma_16816<T>(o[m][2 * jd], a[m], b_lo);
        mma_16816<T>(o[m][2 * jd + 1], a[m], b_hi);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Merging kN partial results of one row (a split's, or a key warp's): each is
// O_s normalised by its own row sum plus lse_s (natural log; -inf when it saw
// no key). Returns lse = log(sum_s exp(lse_s)) and sets weight[s] =
// exp(lse_s - lse), so O = sum_s weight[s] * O_s; when every part is empty,
// lse = -inf and every weight is 0 (O = 0).
// ---------------------------------------------------------------------------
template <int kN>
FAE_DEVICE float merge_lse(const float (&lse_s)[kN], float (&weight)[kN]) {
  float max_lse = -INFINITY;
#pragma unroll
  for (int s = 0; s < kN; ++s) max_lse = fmaxf(max_lse, lse_s[s]);
  if (max_lse == -INFINITY) {
#pragma unroll
    for (int s = 0; s < kN; ++s) weight[s] = 0.f;
    return -INFINITY;
  }
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < kN; ++s) sum += expf(lse_s[s] - max_lse);  // exp(-inf) = 0
  const float lse = max_lse + logf(sum);
#pragma unroll
  for (int s = 0; s < kN; ++s) weight[s] = expf(lse_s[s] - lse);
  return lse;
}

// ---------------------------------------------------------------------------
// Key-warp merge (Traits::kKeyWarps > 1, the decode tile): the warps of a CTA
// saw disjoint key slices of every tile, so each holds a partial result (O
// normalised by its own row sums, lse per row). Warps 1.. park theirs in
// shared memory in fragment order, value-major and lane-minor (a warp's 32
// stores of one value hit 32 banks); warp 0 reads them back at its own
// fragment positions, so no lane needs another lane's data, and merges them
// (merge_lse) into its registers. Returns whether this warp now holds the CTA's result.
// ---------------------------------------------------------------------------
template <typename Traits>
struct KeyWarpMergeSmem {
  static constexpr int kOValues = Traits::kMmaM * Traits::kTilesD * 4;  // per lane
  static constexpr int kValues = kOValues + Traits::kMmaM * 2;          // + lse per row
  static constexpr int kBytes = Traits::kNWarps * kValues * 32 * 4;
  static_assert(kBytes <= Traits::kSmemBytes, "the partials reuse the Q/K/V shared memory");
  // Warp 0 writes its O tile into the Q region right after reading the others'
  // partials; with one row group no other warp reads them any more.
  static_assert(Traits::kKeyWarps == 1 || Traits::kRowWarps == 1,
                "key warps merge through a buffer that only one row group may use");
};

template <typename Traits>
FAE_DEVICE bool merge_key_warps(float (&acc_o)[Traits::kMmaM][Traits::kTilesD][4],
                                float (&lse)[Traits::kMmaM][2], void* smem, int warp, int lane) {
  if constexpr (Traits::kKeyWarps == 1) {
    return true;
  } else {
    using Smem = KeyWarpMergeSmem<Traits>;
    constexpr int kMmaM = Traits::kMmaM;
    constexpr int kTilesD = Traits::kTilesD;
    float* part = static_cast<float*>(smem) + lane;  // value v of warp w: part[(w*kValues+v)*32]
    auto o_index = [](int m, int d, int r) { return (m * kTilesD + d) * 4 + r; };
    auto lse_index = [](int m, int h) { return Smem::kOValues + m * 2 + h; };

    __syncthreads();  // every warp is done reading Q/K/V: the partials may overwrite them
    if (warp != 0) {
      float* mine = part + warp * Smem::kValues * 32;
#pragma unroll
      for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
        for (int d = 0; d < kTilesD; ++d)
#pragma unroll
          for (int r = 0; r < 4; ++r) mine[o_index(m, d, r) * 32] = acc_o[m][d][r];
#pragma unroll
        for (int h = 0; h < 2; ++h) mine[lse_index(m, h) * 32] = lse[m][h];
      }
    }
    __syncthreads();
    if (warp != 0) return false;

#pragma unroll
    for (int m = 0; m < kMmaM; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float lse_w[Traits::kKeyWarps];
        lse_w[0] = lse[m][h];
#pragma unroll
        for (int w = 1; w < Traits::kKeyWarps; ++w) {
          lse_w[w] = part[(w * Smem::kValues + lse_index(m, h)) * 32];
        }
        float weight[Traits::kKeyWarps];
        const float lse_row = merge_lse(lse_w, weight);
#pragma unroll
        for (int d = 0; d < kTilesD; ++d)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int r = 2 * h + e;
            float o = weight[0] * acc_o[m][d][r];
#pragma unroll
            for (int w = 1; w < Traits::kKeyWarps; ++w) {
              o += weight[w] * part[(w * Smem::kValues + o_index(m, d, r)) * 32];
            }
            acc_o[m][d][r] = o;
          }
        lse[m][h] = lse_row;
      }
    return true;
  }
}

// ---------------------------------------------------------------------------
// Split-KV merge inside a thread-block cluster (sm_90; launch_fwd decides).
// The num_splits CTAs of one query tile form one cluster (1 x num_splits);
// each parks its partial in its own shared memory, fp32:
//   part_o[row][col]  O normalised by this split's row sum
//   part_lse[row]     this split's lse (-inf: the split saw no key of the row)
// After a cluster barrier every CTA merges a share of the (row, 8-column
// chunk) items, reading all splits' partials over distributed shared memory,
//   lse = log(sum_s exp(lse_s)),  O = sum_s exp(lse_s - lse) * O_s
// and writes O / lse where the unsplit epilogue would. This replaces the
// partials' round trip through global memory and the combine kernel (its
// launch gap and run time were ~4 us of a ~250-us decode step, the whole
// difference to cuDNN's single kernel).
// ---------------------------------------------------------------------------
// Both split merges (in a cluster, and the combine kernel) give each lane 8
// consecutive head-dim columns of a row: acc += w * O_s[8 columns], then one
// 16-byte store of the result.
FAE_DEVICE void add_weighted_8(float (&acc)[8], float w, float4 lo, float4 hi) {
  acc[0] += w * lo.x; acc[1] += w * lo.y; acc[2] += w * lo.z; acc[3] += w * lo.w;
  acc[4] += w * hi.x; acc[5] += w * hi.y; acc[6] += w * hi.z; acc[7] += w * hi.w;
}

template <typename T>
FAE_DEVICE void store_8(T* dst, const float (&acc)[8]) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<T>(acc[0], acc[1]), pack2<T>(acc[2], acc[3]),
                                              pack2<T>(acc[4], acc[5]), pack2<T>(acc[6], acc[7]));
}

template <typename Traits>
struct ClusterMergeSmem {
  // +8 floats per row: the float2 stores of one accumulator column tile (8
  // rows g, lanes q) then hit 32 distinct banks per half-warp instead of the
  // same 8 (rows kHeadDim floats apart all start at bank 0).
  static constexpr int kRowStride = Traits::kHeadDim + 8;
  static constexpr int kBytes = (Traits::kBlockM * kRowStride + Traits::kBlockM) * 4;
  static_assert(kBytes <= Traits::kSmemBytes, "the partials reuse the Q/K/V shared memory");
};

// holds_output: this warp holds its rows' result (after merge_key_warps).
template <typename Traits>
FAE_DEVICE void merge_splits_in_cluster(
    const float (&acc_o)[Traits::kMmaM][Traits::kTilesD][4], const float (&lse)[Traits::kMmaM][2],
    bool holds_output, void* smem, int warp_row0, int rows_valid, int head_dim,
    typename Traits::T* out_tile, int64_t out_row_stride, float* lse_tile) {
  using T = typename Traits::T;
  using Smem = ClusterMergeSmem<Traits>;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int q = lane % 4;
  float* part_o = static_cast<float*>(smem);
  float* part_lse = part_o + Traits::kBlockM * Smem::kRowStride;

  __syncthreads();  // every warp is done reading K/V: the partials may overwrite them
  if (holds_output) {
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + m * 16 + h * 8 + g;
#pragma unroll
        for (int d = 0; d < Traits::kTilesD; ++d) {
          *reinterpret_cast<float2*>(part_o + row * Smem::kRowStride + d * 8 + 2 * q) =
              make_float2(acc_o[m][d][2 * h], acc_o[m][d][2 * h + 1]);
        }
        if (q == 0) part_lse[row] = lse[m][h];
      }
  }
  cluster_sync();  // all partials written and visible cluster-wide

  const int num_splits = gridDim.y;  // == the cluster size
  const int rank = cluster_cta_rank();
  const int chunks = head_dim / 8;
  // Items interleaved over the cluster (item = rank + splits * k), so one row
  // of a single-row decode tile is spread over every CTA.
  for (int item = rank + num_splits * tid; item < rows_valid * chunks;
       item += num_splits * Traits::kNThreads) {
    const int row = item / chunks;
    const int col = (item % chunks) * 8;
    float lse_s[kMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lse_s[s] = s < num_splits ? ld_cluster_f32(cluster_map_shared(part_lse + row, s)) : -INFINITY;
    }
    float weight[kMaxClusterSplits];
    const float lse_row = merge_lse(lse_s, weight);
    float acc[8] = {};
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (lse_s[s] == -INFINITY) continue;  // empty or absent split (weight 0)
      const uint32_t addr = cluster_map_shared(part_o + row * Smem::kRowStride + col, s);
      add_weighted_8(acc, weight[s], ld_cluster_f32x4(addr), ld_cluster_f32x4(addr + 16));
    }
    store_8(out_tile + row * out_row_stride + col, acc);
    if (col == 0) lse_tile[row] = lse_row;
  }
  cluster_sync();  // no CTA exits (freeing its shared memory) while others still read it
}

// ---------------------------------------------------------------------------
// Main kernel. Grid: x = m-tile + num_m_blocks * (batch*heads + head), y = KV split.
// ---------------------------------------------------------------------------
template <typename Traits, bool kIsCausal, bool kVarSeq, bool kClusterMerge = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel(const __grid_constant__ AttentionFwdParams params) {
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMmaM = Traits::kMmaM;
  constexpr int kStages = Traits::kStages;
  using QLayout = typename Traits::QLayout;
  using KVLayout = typename Traits::KVLayout;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem_q = reinterpret_cast<T*>(smem_raw);
  T* smem_k = smem_q + Traits::kSmemQElems;          // kStages K tiles
  T* smem_v = smem_k + kStages * Traits::kSmemKVElems;  // kStages V tiles

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // mma row group
  const int q = lane % 4;  // lane within the quad
  const int key_warp = warp % Traits::kKeyWarps;       // which key slice of every tile
  const int warp_row0 = warp / Traits::kKeyWarps * Traits::kRowsPerWarp;  // first tile row
  const int warp_key0 = key_warp * Traits::kWarpKeys;  // first key of the slice in a tile

  // ---- which tile ----------------------------------------------------------
  const int num_m_blocks = ceil_div_dev(params.seqlen_q, kBlockM);
  const int bh = blockIdx.x / num_m_blocks;
  int m_block = blockIdx.x % num_m_blocks;
  // Causal tiles further down see more keys; start those first so the short
  // ones fill the tail of the wave (the x order keeps a head's tiles adjacent
  // for L2 reuse of its K/V).
  if (kIsCausal) m_block = num_m_blocks - 1 - m_block;
  const int batch = bh / params.heads;
  const int head = bh % params.heads;
  const int head_k = head / (params.heads / params.heads_k);
  const int split = blockIdx.y;
  const int num_splits = gridDim.y;
  // This sequence's lengths / first rows / causal offset (varlen, seqused_k).
  const SeqBounds seq = seq_bounds<kVarSeq>(params, batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // varlen: past this sequence (CTA-uniform)

  const KeyTileRange range =
      key_tile_range<kBlockM, kBlockN, kIsCausal>(seq, m_block, split, num_splits);
  const int n_tiles = range.end - range.begin;

  const int64_t row_stride_k = params.k_strides.row;
  const int64_t row_stride_v = params.v_strides.row;
  const T* q_tile = static_cast<const T*>(params.q) + batch * params.q_strides.batch +
                    head * params.q_strides.head +
                    (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.q_strides.row;
  const T* k_head = static_cast<const T*>(params.k) + batch * params.k_strides.batch +
                    head_k * params.k_strides.head + seq.row0_k * row_stride_k;
  const T* v_head = static_cast<const T*>(params.v) + batch * params.v_strides.batch +
                    head_k * params.v_strides.head + seq.row0_k * row_stride_v;

  // Decode tile: K/V that only this CTA reads stream through L2 as evict_first
  // (params.kv_evict_first) in every tile that is wholly in range; the
  // partial last tile and padded head dims take the plain zero-filling copies.
  auto load_kv = [&](T* smem, const T* gmem, int64_t row_stride, int valid_rows) {
    if constexpr (Traits::kKVL2Policy) {
      if (params.kv_evict_first && valid_rows >= kBlockN && params.head_dim == Traits::kHeadDim) {
        load_tile_async<Traits, KVLayout, kBlockN, /*kFullL2Hint=*/true>(
            smem, gmem, row_stride, valid_rows, params.head_dim, tid, l2_policy_evict_first());
        return;
      }
    }
    load_tile_async<Traits, KVLayout, kBlockN>(smem, gmem, row_stride, valid_rows,
                                               params.head_dim, tid);
  };
  auto load_kv_tile = [&](int tile, int slot) {
    const int n_block = range.begin + tile;
    const int64_t key0 = static_cast<int64_t>(n_block) * kBlockN;
    const int valid_rows = seq.seqlen_k - n_block * kBlockN;
    load_kv(smem_k + slot * Traits::kSmemKVElems, k_head + key0 * row_stride_k, row_stride_k,
            valid_rows);
    cp_async_commit();
    load_kv(smem_v + slot * Traits::kSmemKVElems, v_head + key0 * row_stride_v, row_stride_v,
            valid_rows);
    cp_async_commit();
  };
  // Keeps the commit-group count uniform past the last tile, so the
  // cp_async_wait counts below hold for every iteration.
  auto commit_empty_kv = [] {
    cp_async_commit();
    cp_async_commit();
  };

  float acc_o[kMmaM][Traits::kTilesD][4];
#pragma unroll
  for (int m = 0; m < kMmaM; ++m)
#pragma unroll
    for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_o[m][d][r] = 0.f;
  OnlineSoftmax<kMmaM> softmax;

  if (n_tiles > 0) {  // CTA-uniform; an empty range writes O = 0, lse = -inf
    // ---- prologue: Q, then K/V tiles 0 .. kStages-2 -------------------------
    // Commit groups in flight, oldest first: Q | K0 | V0 | K1 | V1 | ...
    load_tile_async<Traits, QLayout, kBlockM>(smem_q, q_tile, params.q_strides.row,
                                              seq.seqlen_q - m_block * kBlockM,
                                              params.head_dim, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) {
        load_kv_tile(s, s);
      } else {
        commit_empty_kv();
      }
    }

    // Q A-fragments, loaded once (only when they fit in registers).
    uint32_t q_frags[Traits::kQInRegs ? kMmaM : 1][Traits::kQInRegs ? Traits::kStepsD : 1][4];
    if constexpr (Traits::kQInRegs) {
      cp_async_wait<2 * (kStages - 1)>();  // all but the K/V groups: Q has landed
      __syncthreads();                      // ... for every thread's chunks
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int kk = 0; kk < Traits::kStepsD; ++kk)
          load_q_frag<Traits>(q_frags[m][kk], smem_q, warp_row0, m, kk, lane);
    }

    const int row_base = m_block * kBlockM + warp_row0 + g;  // lane's first global row
    // ---- main loop over key tiles --------------------------------------------
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int n_block = range.begin + tile;
      const int slot = tile % kStages;
      // The warp's key slice: whole rows, so the swizzle (row % 8) is unchanged.
      const int slice = slot * Traits::kSmemKVElems + warp_key0 * KVLayout::kRowStride;
      const T* smem_k_tile = smem_k + slice;
      const T* smem_v_tile = smem_v + slice;

      // Groups newer than K_tile: V_tile and 2 per tile tile+1 .. tile+kStages-2.
      cp_async_wait<2 * kStages - 3>();
      // K_tile is visible to all threads, and every warp has finished tile-1,
      // so its slot ((tile-1) % kStages) can be refilled.
      __syncthreads();
      const int prefetch = tile + kStages - 1;
      if (prefetch < n_tiles) {
        load_kv_tile(prefetch, prefetch % kStages);
      } else {
        commit_empty_kv();
      }

      float acc_s[kMmaM][Traits::kTilesN][4];
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int j = 0; j < Traits::kTilesN; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_s[m][j][r] = 0.f;
      gemm_qk<Traits>(acc_s, q_frags, smem_q, smem_k_tile, warp_row0, lane);

      const int col_base = n_block * kBlockN + warp_key0 + 2 * q;
      if (key_tile_needs_mask<kBlockM, kBlockN, kIsCausal>(seq, m_block, n_block)) {
        scale_and_mask<true, kIsCausal>(acc_s, params.scale_log2, row_base, col_base,
                                        seq.seqlen_k, seq.causal_offset);
      } else {
        scale_and_mask<false, kIsCausal>(acc_s, params.scale_log2, row_base, col_base,
                                         seq.seqlen_k, seq.causal_offset);
      }
      softmax.update(acc_s, acc_o);

      // Groups newer than V_tile: 2 per tile tile+1 .. tile+kStages-1.
      cp_async_wait<2 * kStages - 2>();
      __syncthreads();  // V_tile visible to all threads
      gemm_pv<Traits>(acc_o, acc_s, smem_v_tile, lane);
    }
    cp_async_wait<0>();  // only empty groups remain; keeps the smem reuse below obviously safe
  }

  // ---- epilogue --------------------------------------------------------------
  float lse[kMmaM][2];
  softmax.finalize(acc_o, lse);
  const bool holds_output = merge_key_warps<Traits>(acc_o, lse, smem_raw, warp, lane);

  const int row_in_head0 = m_block * kBlockM + warp_row0;  // sequence row of warp row 0

  if constexpr (kClusterMerge) {
    T* out_tile = static_cast<T*>(params.out) + batch * params.out_strides.batch +
                  head * params.out_strides.head +
                  (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.out_strides.row;
    float* lse_tile = params.lse + seq.lse_index(params, batch, head, m_block * kBlockM);
    merge_splits_in_cluster<Traits>(acc_o, lse, holds_output, smem_raw, warp_row0,
                                    min(kBlockM, seq.seqlen_q - m_block * kBlockM),
                                    params.head_dim, out_tile, params.out_strides.row, lse_tile);
    return;
  }
  if (!holds_output) return;  // the key warps' results are merged into warp 0's
  if (num_splits == 1) {
    // O -> shared memory (the warp's own Q rows: no other warp touches them,
    // so a warp barrier suffices) -> 16-byte coalesced global stores.
    T* smem_o = smem_q;
    __syncwarp();
#pragma unroll
    for (int m = 0; m < kMmaM; ++m)
#pragma unroll
      for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + m * 16 + h * 8 + g;
          *reinterpret_cast<uint32_t*>(smem_o + QLayout::offset(row, d) + 2 * q) =
              pack2<T>(acc_o[m][d][2 * h], acc_o[m][d][2 * h + 1]);
        }
    __syncwarp();

    constexpr int kChunks = Traits::kHeadDim / 8;
    constexpr int kChunksPerLane = Traits::kRowsPerWarp * kChunks / 32;
    T* out_head = static_cast<T*>(params.out) + batch * params.out_strides.batch +
                  head * params.out_strides.head + seq.row0_q * params.out_strides.row;
#pragma unroll
    for (int i = 0; i < kChunksPerLane; ++i) {
      const int idx = lane + 32 * i;
      const int r = idx / kChunks;
      const int c = idx % kChunks;
      const int row = row_in_head0 + r;
      if (row < seq.seqlen_q && c * 8 < params.head_dim) {
        *reinterpret_cast<uint4*>(out_head + row * params.out_strides.row + c * 8) =
            *reinterpret_cast<const uint4*>(smem_o + QLayout::offset(warp_row0 + r, c));
      }
    }
    if (q == 0) {
      float* lse_head = params.lse + seq.lse_index(params, batch, head, 0);
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_in_head0 + m * 16 + h * 8 + g;
          if (row < seq.seqlen_q) lse_head[row] = lse[m][h];
        }
    }
  } else {
    // Split-KV partials, fp32, normalised by this split's own row sum:
    //   out_accum[split][lse row][0:kHeadDim], lse_accum[split][lse row]
    // (lse rows: params.h; split-KV is never used with varlen). Each quad
    // writes 32 contiguous bytes per (row, 8-column tile).
    const int64_t split_row0 = split * params.q_rows_total + seq.lse_index(params, batch, head, 0);
    float* o_accum = params.out_accum + split_row0 * Traits::kHeadDim;
    float* l_accum = params.lse_accum + split_row0;
#pragma unroll
    for (int m = 0; m < kMmaM; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_in_head0 + m * 16 + h * 8 + g;
        if (row >= seq.seqlen_q) continue;
#pragma unroll
        for (int d = 0; d < Traits::kTilesD; ++d) {
          const int col = d * 8 + 2 * q;
          if (col < params.head_dim) {
            *reinterpret_cast<float2*>(o_accum + static_cast<int64_t>(row) * Traits::kHeadDim +
                                       col) = make_float2(acc_o[m][d][2 * h], acc_o[m][d][2 * h + 1]);
          }
        }
        if (q == 0) l_accum[row] = lse[m][h];
      }
  }
}

// ---------------------------------------------------------------------------
// Split-KV combine kernel (wherever the cluster merge above does not apply).
//   lse   = log(sum_s exp(lse_s))            (-inf when every split is empty)
//   O     = sum_s exp(lse_s - lse) * O_s     (O_s already normalised per split)
// Latency-bound (a few hundred rows, up to ~100 splits), so the splits of a
// row are spread over warps_per_row warps of the CTA (1 for <= 8 splits, up to
// all 8 for > 32), each warp reads its splits' O_s in batches of independent
// loads, and the warps' sums meet in shared memory. Lane l owns head-dim
// columns [8l, 8l+8): 256 columns = 32 lanes x 8, one 16-byte store per lane.
// (B=1, H=32, H_kv=8, 16k-key decode, ~60 splits: one warp per row with one
// dependent load chain per split 16.0 us; batched loads 7.2 us; spread over
// 8 warps 4.1 us.)
// ---------------------------------------------------------------------------
constexpr int kCombineWarps = 8;
constexpr int kCombineBatch = 8;  // splits whose O_s loads are in flight together

// Warps per row for this many splits: a power of two, so rows pack the CTA.
inline int combine_warps_per_row(int num_splits) {
  int warps = 1;
  while (warps < kCombineWarps && warps * kCombineBatch < num_splits) warps *= 2;
  return warps;
}

// (max, sum of exp(x - max)) pairs: merging two partial log-sum-exps.
FAE_DEVICE void merge_lse_pair(float& max_a, float& sum_a, float max_b, float sum_b) {
  const float m = fmaxf(max_a, max_b);
  if (m == -INFINITY) return;  // both empty
  sum_a = sum_a * expf(max_a - m) + sum_b * expf(max_b - m);
  max_a = m;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32, 1)
    flash_fwd_combine_kernel(const __grid_constant__ AttentionFwdParams params,
                             int warps_per_row) {
  static_assert(kHeadDim <= 32 * 8, "one 8-column chunk per lane");
  __shared__ float2 warp_lse[kCombineWarps];               // (max, sum) per warp
  __shared__ float4 warp_acc[kCombineWarps][32][2];        // 8 columns per lane
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int part = warp % warps_per_row;  // this warp's share of the row's splits
  const int warp0 = warp - part;          // first warp of the row
  // Padded layouts only (the op layer never splits varlen calls): row r of the
  // lse-shaped arrays is (batch, head, row) = (r / (heads*seqlen_q), ...).
  const int64_t rows_total = params.q_rows_total;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kCombineWarps / warps_per_row) +
                    warp / warps_per_row;
  const bool row_ok = r < rows_total;  // no early return: block barriers below
  const int num_splits = row_ok ? params.num_splits : 0;
  const int stride = warps_per_row;  // this warp takes splits part, part + stride, ...
  const float* lse_split = params.lse_accum + r;  // split s at lse_split[s * rows_total]

  float max_lse = -INFINITY, sum = 0.f;
  for (int s = part + stride * lane; s < num_splits; s += stride * 32) {
    merge_lse_pair(max_lse, sum, lse_split[s * rows_total], 1.f);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float other_max = __shfl_xor_sync(0xffffffff, max_lse, off);
    const float other_sum = __shfl_xor_sync(0xffffffff, sum, off);
    merge_lse_pair(max_lse, sum, other_max, other_sum);
  }
  if (lane == 0) warp_lse[warp] = make_float2(max_lse, sum);
  __syncthreads();
  max_lse = -INFINITY;
  sum = 0.f;
  for (int w = warp0; w < warp0 + warps_per_row; ++w) {
    merge_lse_pair(max_lse, sum, warp_lse[w].x, warp_lse[w].y);
  }
  const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);

  const int col = lane * 8;
  const bool col_ok = col < params.head_dim;
  // Lanes past the head dim read column 0 and store nothing: no branch around
  // the loads, so a batch of them is in flight before the first use.
  const float* o_row = params.out_accum + r * kHeadDim + (col_ok ? col : 0);
  const int64_t split_stride = rows_total * kHeadDim;
  float acc[8] = {};
  // exp(-inf) = 0: empty splits weigh nothing; their O_s is finite (zeros), so
  // it is read like any other.
  auto weight = [&](int s) { return expf(lse_split[s * rows_total] - lse); };
  if (lse != -INFINITY) {  // warp-uniform
    int s = part;
    for (; s + stride * (kCombineBatch - 1) < num_splits; s += stride * kCombineBatch) {
      float w[kCombineBatch];
      float4 lo[kCombineBatch], hi[kCombineBatch];
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) {
        const float* o_s = o_row + (s + stride * i) * split_stride;
        w[i] = weight(s + stride * i);
        lo[i] = *reinterpret_cast<const float4*>(o_s);
        hi[i] = *reinterpret_cast<const float4*>(o_s + 4);
      }
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) add_weighted_8(acc, w[i], lo[i], hi[i]);
    }
    for (; s < num_splits; s += stride) {
      const float* o_s = o_row + s * split_stride;
      add_weighted_8(acc, weight(s), *reinterpret_cast<const float4*>(o_s),
                     *reinterpret_cast<const float4*>(o_s + 4));
    }
  }
  if (warps_per_row > 1) {  // CTA-uniform
    warp_acc[warp][lane][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    warp_acc[warp][lane][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    __syncthreads();
    if (part == 0) {
      for (int w = warp0 + 1; w < warp0 + warps_per_row; ++w) {
        add_weighted_8(acc, 1.f, warp_acc[w][lane][0], warp_acc[w][lane][1]);
      }
    }
  }
  if (part != 0 || !row_ok) return;
  if (col_ok) {
    const int64_t bh = r / params.seqlen_q;
    const int row = static_cast<int>(r % params.seqlen_q);
    const int batch = static_cast<int>(bh / params.heads);
    const int head = static_cast<int>(bh % params.heads);
    T* dst = static_cast<T*>(params.out) + batch * params.out_strides.batch +
             row * params.out_strides.row + head * params.out_strides.head + col;
    store_8(dst, acc);
  }
  if (lane == 0) params.lse[r] = lse;
}

}  // namespace cuda
}  // namespace flash_attn_ext
