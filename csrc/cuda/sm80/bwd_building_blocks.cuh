// Building blocks of the 16-bit backward main kernel (bwd_kernel.cuh): tile
// loads, the two mma.sync product shapes (keys x queries, and accumulation
// into dK / dV), C -> A fragment reuse, and the element-wise softmax backward.
#pragma once
#include <cmath>

#include "../../params.h"
#include "../common/dropout_tile.cuh"
#include "../common/fwd_softmax.cuh"
#include "../common/ptx.cuh"
#include "bwd_kernel_traits.cuh"

namespace flash_attn_ext {
namespace cuda {
namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;

// Adds (x, y) to two consecutive fp32 words of global memory. sm_90 has a
// vector reduction (one instruction, half the L2 atomic traffic).
FAE_DEVICE void atomic_add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// cp.async a [kRows][kHeadDim] tile (rows row0.., only the first rows_valid
// rows and head_dim columns are real; the rest is zero-filled) into shared
// memory with the padded row pitch. Consecutive threads take consecutive
// 16-byte chunks of a row: coalesced global reads.
template <typename Kt, int kRows>
FAE_DEVICE void load_tile_async(typename Kt::T* smem_tile, const typename Kt::T* gmem_rows,
                                int64_t row_stride, int rows_valid, int head_dim) {
  constexpr int kChunks = kRows * Kt::kChunksPerRow;
  constexpr int kIters = (kChunks + Kt::kNThreads - 1) / Kt::kNThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = threadIdx.x + i * Kt::kNThreads;
    if (kChunks % Kt::kNThreads == 0 || idx < kChunks) {
      const int row = idx / Kt::kChunksPerRow;
      const int col = (idx % Kt::kChunksPerRow) * 8;
      const bool valid = row < rows_valid && col < head_dim;
      // With src-size 0 nothing is read, but keep the address inside the tensor.
      const auto* src = valid ? gmem_rows + row * row_stride + col : gmem_rows;
      cp_async_16(smem_tile + row * Kt::kRowPitch + col, src, valid);
    }
  }
}

// acc[kM][kN][4] += A B^T over the full head dim, where A is kM*16 rows (keys)
// of sA and B is kN*8 rows (queries) of sB, both [rows][kHeadDim] tiles.
// Result in mma C layout: acc[m][j] = keys 16m + g, 16m + g + 8 x queries
// 8j + 2q, 8j + 2q + 1. Every B fragment feeds kM mma's and every A fragment
// kN: with kM = 2 that is half the shared-memory reads per mma of kM = 1.
template <typename Kt, int kM, int kN>
FAE_DEVICE void gemm_keys_by_queries(float (&acc)[kM][kN][4], const typename Kt::T* sA,
                                     const typename Kt::T* sB, int lane) {
  using T = typename Kt::T;
  static_assert(kN % 2 == 0, "queries come in pairs of 8-wide n-tiles (ldmatrix x4)");
  // A (row-major 16x16 per k-step): ldmatrix x4 matrices = (rows 0-7, k 0-7),
  // (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a[0..3].
  const T* a_row = sA + (lane % 8 + 8 * ((lane / 8) % 2)) * Kt::kRowPitch + 8 * (lane / 16);
  // B^T rows are queries: x4 matrices = (queries 0-7, k 0-7) -> b[0] of n-tile
  // 2jj, (queries 0-7, k 8-15) -> b[1], then the same for queries 8-15.
  const T* b_row = sB + (lane % 8 + 8 * (lane / 16)) * Kt::kRowPitch + 8 * ((lane / 8) % 2);
  // Not fully unrolled: that would let the scheduler hoist every ldmatrix
  // of the head dim and blow the register budget (dK/dV stay resident).
#pragma unroll(Kt::kGemmUnroll)
  for (int kk = 0; kk < Kt::kHeadDim / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) ldmatrix_x4(a[m], a_row + m * 16 * Kt::kRowPitch + kk * 16);
#pragma unroll
    for (int jj = 0; jj < kN / 2; ++jj) {
      uint32_t b[4];
      ldmatrix_x4(b, b_row + jj * 16 * Kt::kRowPitch + kk * 16);
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma_16816<T>(acc[m][2 * jj], a[m], b_lo);
        mma_16816<T>(acc[m][2 * jj + 1], a[m], b_hi);
      }
    }
  }
}

// acc[m][kDimPerWarp/8][4] += A_m (16 keys x 16 queries, mma A fragment) *
// sB[16 queries, columns col0..col0+kDimPerWarp) (row-major, read with
// ldmatrix.trans because the contraction runs down sB's rows), for the
// kMmaKeys m-tiles of the warp: each B fragment feeds kMmaKeys mma's.
template <typename Kt>
FAE_DEVICE void gemm_accumulate_kv(float (&acc)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4],
                                   const uint32_t (&a)[Kt::kMmaKeys][4],
                                   const typename Kt::T* sB_rows, int lane) {
  using T = typename Kt::T;
  // x4.trans matrices = (k 0-7, n 0-7) -> b[0] of n-tile 2nn, (k 8-15, n 0-7)
  // -> b[1], (k 0-7, n 8-15) -> b[0] of n-tile 2nn+1, (k 8-15, n 8-15) -> b[1].
  const T* b_row = sB_rows + (lane % 8 + 8 * ((lane / 8) % 2)) * Kt::kRowPitch + 8 * (lane / 16);
#pragma unroll
  for (int nn = 0; nn < Kt::kDimPerWarp / 16; ++nn) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, b_row + nn * 16);
    const uint32_t b_lo[2] = {b[0], b[1]};
    const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
    for (int m = 0; m < Kt::kMmaKeys; ++m) {
      mma_16816<T>(acc[m][2 * nn], a[m], b_lo);
      mma_16816<T>(acc[m][2 * nn + 1], a[m], b_hi);
    }
  }
}

// Packs the C fragments of n-tiles 2kq, 2kq+1 (16 keys x 16 queries) into
// the A fragment of an m16n8k16 whose K dim is those 16 queries: the C layout
// (row g/g+8, cols 2q..2q+1 of each 8-wide tile) is exactly the A layout.
template <typename T>
FAE_DEVICE void c_to_a_fragment(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// Stores an A fragment of a 16 keys x 16 queries block into a [keys][queries]
// tile at (key_row0, query_col0). 32-bit stores; with the padded pitch the
// 32 lanes hit 32 distinct banks.
template <typename Kt>
FAE_DEVICE void store_a_fragment(typename Kt::T* tile, const uint32_t (&a)[4], int key_row0,
                                 int query_col0, int lane) {
  const int g = lane / 4, q4 = lane % 4;
  auto* base = tile + (key_row0 + g) * Kt::kKeyRowPitch + query_col0 + 2 * q4;
  *reinterpret_cast<uint32_t*>(base) = a[0];
  *reinterpret_cast<uint32_t*>(base + 8 * Kt::kKeyRowPitch) = a[1];
  *reinterpret_cast<uint32_t*>(base + 8) = a[2];
  *reinterpret_cast<uint32_t*>(base + 8 * Kt::kKeyRowPitch + 8) = a[3];
}

// P^T and dS^T from S^T (in: acc_s) and dP^T (in: acc_dp), in place, for kM
// 16-key m-tiles starting at key0 and kN 8-query n-tiles starting at query0.
// lse2 = lse * log2(e) per query (from query0), +inf for padded /
// fully-masked rows (so P = exp2(-inf) = 0, never NaN); dsum = D per query.
// kHasVariants: P from the modified score (ScoreVariants::score_log2), keys
// outside the query's [key_begin, key_end) masked, and dS multiplied by the
// softcap's 1 - tanh^2 (the chain factor of the dK / dQ products). Dropout
// (dropout != nullptr and active; Z = keep ? scale : 0, csrc/dropout.h):
//   dS^T = P^T o (dP^T o Z^T - D),  and acc_s leaves as P^T o Z^T (for dV);
// key0 must then be a multiple of 16 and query0 of 32 (dropout_bits_transposed).
template <typename Kt, bool kIsCausal, int kM, int kN, bool kHasVariants = false>
FAE_DEVICE void softmax_backward(float (&acc_s)[kM][kN][4], float (&acc_dp)[kM][kN][4],
                                 const float* lse2, const float* dsum, float scale_log2,
                                 bool apply_mask, int key0, int query0, int seqlen_k,
                                 int causal_offset, int lane,
                                 const ScoreVariants* variants = nullptr,
                                 const Dropout* dropout = nullptr) {
  const int g = lane / 4, q4 = lane % 4;
  // Dropout: the keep bits of the lane's elements (dropout_bit_transposed), and
  // dP^T o Z^T before the element loop below.
  DropoutBitsT<kM, kN> keep = 0;
  if constexpr (kHasVariants) {
    if (dropout != nullptr && dropout->active()) {  // uniform
      keep = dropout_bits_transposed<kM, kN>(*dropout, key0, query0, lane);
      apply_dropout_transposed(acc_dp, keep, dropout->scale);
    }
  }
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const int q_local = j * 8 + 2 * q4;
    const float2 l2 = *reinterpret_cast<const float2*>(lse2 + q_local);
    const float2 dd = *reinterpret_cast<const float2*>(dsum + q_local);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if constexpr (kHasVariants) {
          const int key = key0 + 16 * m + g + ((c & 2) ? 8 : 0);
          const int query = query0 + q_local + (c & 1);
          float dfds = 1.f;
          const float x = variants->score_log2(acc_s[m][j][c], query, key, &dfds);
          float p = fast_exp2(x - ((c & 1) ? l2.y : l2.x));
          if (apply_mask) {
            const bool visible =
                key >= variants->mask.key_begin(query) && key < variants->mask.key_end(query);
            p = visible ? p : 0.f;
          }
          acc_s[m][j][c] = p;
          acc_dp[m][j][c] = p * (acc_dp[m][j][c] - ((c & 1) ? dd.y : dd.x)) * dfds;
          continue;
        }
        float p = fast_exp2(acc_s[m][j][c] * scale_log2 - ((c & 1) ? l2.y : l2.x));
        if (apply_mask) {
          const int key = key0 + 16 * m + g + ((c & 2) ? 8 : 0);
          const int query = query0 + q_local + (c & 1);
          const bool visible = key < seqlen_k && (!kIsCausal || key <= query + causal_offset);
          p = visible ? p : 0.f;
        }
        acc_s[m][j][c] = p;
        acc_dp[m][j][c] = p * (acc_dp[m][j][c] - ((c & 1) ? dd.y : dd.x));
      }
    }
  }
  if constexpr (kHasVariants) {
    if (dropout != nullptr && dropout->active()) {
      apply_dropout_transposed(acc_s, keep, dropout->scale);  // P^T o Z^T, for dV
    }
  }
}

// Writes the 16-bit A fragments of acc (kM key m-tiles x kN query n-tiles, C
// layout) into a [keys][queries] tile at (key_row0, query_col0).
template <typename Kt, int kM, int kN>
FAE_DEVICE void store_key_query_tile(typename Kt::T* tile, const float (&acc)[kM][kN][4],
                                     int key_row0, int query_col0, int lane) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int kq = 0; kq < kN / 2; ++kq) {
      uint32_t a[4];
      c_to_a_fragment<typename Kt::T>(a, acc[m][2 * kq], acc[m][2 * kq + 1]);
      store_a_fragment<Kt>(tile, a, key_row0 + 16 * m, query_col0 + 16 * kq, lane);
    }
  }
}

}  // namespace bwd
}  // namespace cuda
}  // namespace flash_attn_ext
