// Output stores of the sm80 forward kernel (fwd_kernel.cuh), after the
// normalisation and the key-warp merge (fwd_merge.cuh): store_output (unsplit:
// O through shared memory to 16-byte global stores, and lse) and
// store_split_partials (split-KV through global memory: this split's fp32
// partials and lse for flash_fwd_combine_kernel).
// Separate because it is the kernel's last stage, with its own global layouts
// (out / lse, out_accum / lse_accum); the cluster merge of split-KV partials
// stays in fwd_merge.cuh.
#pragma once
#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"
#include "fwd_pipeline.cuh"

namespace flash_attn_ext {
namespace cuda {

// ---- epilogue, unsplit: O -> shared memory -> 16-byte global stores; lse -----
template <typename Traits>
FAE_DEVICE void store_output(const float (&acc_o)[Traits::kMmaM][Traits::kTilesD][4],
                             const float (&lse)[Traits::kMmaM][2], typename Traits::T* smem_q,
                             const AttentionFwdParams& params, const SeqBounds& seq, int batch,
                             int head, int row_in_head0, const FwdThread<Traits>& th) {
  using T = typename Traits::T;
  using QLayout = typename Traits::QLayout;
  const int g = th.g, q = th.q, lane = th.lane, warp_row0 = th.warp_row0;
  // O -> shared memory (the warp's own Q rows: no other warp touches them,
  // so a warp barrier suffices) -> 16-byte coalesced global stores.
  T* smem_o = smem_q;
  __syncwarp();
#pragma unroll
  for (int m = 0; m < Traits::kMmaM; ++m)
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
  // A local copy: read through `params` inside the && below, the bound check
  // compiled to a branch per chunk instead of one predicate (ISETP.OR).
  const int head_dim = params.head_dim;
#pragma unroll
  for (int i = 0; i < kChunksPerLane; ++i) {
    const int idx = lane + 32 * i;
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const int row = row_in_head0 + r;
    if (row < seq.seqlen_q && c * 8 < head_dim) {
      *reinterpret_cast<uint4*>(out_head + row * params.out_strides.row + c * 8) =
          *reinterpret_cast<const uint4*>(smem_o + QLayout::offset(warp_row0 + r, c));
    }
  }
  if (q == 0) {
    float* lse_head = params.lse + seq.lse_index(params, batch, head, 0);
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_in_head0 + m * 16 + h * 8 + g;
        if (row < seq.seqlen_q) lse_head[row] = lse[m][h];
      }
  }
}

// ---- epilogue, split-KV through global memory: this split's fp32 partials ---
//   out_accum[split][lse row][0:kHeadDim], lse_accum[split][lse row]
// normalised by this split's own row sum (lse rows: params.h; split-KV is
// never used with varlen), for flash_fwd_combine_kernel. Each quad writes 32
// contiguous bytes per (row, 8-column tile).
template <typename Traits>
FAE_DEVICE void store_split_partials(const float (&acc_o)[Traits::kMmaM][Traits::kTilesD][4],
                                     const float (&lse)[Traits::kMmaM][2],
                                     const AttentionFwdParams& params, const SeqBounds& seq,
                                     int batch, int head, int split, int row_in_head0,
                                     const FwdThread<Traits>& th) {
  const int g = th.g, q = th.q;
  const int64_t split_row0 = split * params.q_rows_total + seq.lse_index(params, batch, head, 0);
  float* o_accum = params.out_accum + split_row0 * Traits::kHeadDim;
  float* l_accum = params.lse_accum + split_row0;
#pragma unroll
  for (int m = 0; m < Traits::kMmaM; ++m)
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

}  // namespace cuda
}  // namespace flash_attn_ext
