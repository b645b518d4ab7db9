// Merging partial results of the forward pass. Each part is O normalised by
// its own row sum plus its lse; three places merge them:
//   merge_key_warps          the key warps of a decode CTA (Traits::kKeyWarps > 1),
//                            through shared memory, before the epilogue
//   merge_splits_in_cluster  the splits of a split-KV call whose CTAs form one
//                            thread-block cluster (sm_90), over distributed
//                            shared memory
//   flash_fwd_combine_kernel everywhere else: a second kernel over the fp32
//                            partials that split-KV CTAs wrote to global memory
#pragma once
#include <cmath>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"

namespace flash_attn_ext {
namespace cuda {

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
