// FlashAttention-2 style backward main kernel for 16-bit inputs (sm_80+).
//
// One thread block per (K/V tile, head, batch); see bwd_kernel_traits.cuh for
// the warp decomposition and the tile table. Per query tile m the block does
//
//   S^T  = K Q_m^T                     (recomputed, 16 keys x kBlockM per warp)
//   P^T  = exp2(S^T * scale_log2 - lse_m * log2 e)     (masked -> 0)
//   dP^T = V dO_m^T
//   dS^T = P^T o (dP^T - D_m)
//   dV  += P^T dO_m,   dK += dS^T Q_m    (registers, across the whole loop)
//   dQ_m += dS_m K                        (fp32, global accumulator)
//
// and finally writes dK * softmax_scale and dV. dQ is scaled by the convert
// kernel. Q_m / dO_m are double-buffered with cp.async: tile m+1 streams in
// while tile m is computed.
#pragma once
#include <cmath>

#include "../../params.h"
#include "bwd_kernel_traits.cuh"
#include "../common/ptx.cuh"

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
template <typename Kt, bool kIsCausal, int kM, int kN>
FAE_DEVICE void softmax_backward(float (&acc_s)[kM][kN][4], float (&acc_dp)[kM][kN][4],
                                 const float* lse2, const float* dsum, float scale_log2,
                                 bool apply_mask, int key0, int query0, int seqlen_k,
                                 int causal_offset, int lane) {
  const int g = lane / 4, q4 = lane % 4;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const int q_local = j * 8 + 2 * q4;
    const float2 l2 = *reinterpret_cast<const float2*>(lse2 + q_local);
    const float2 dd = *reinterpret_cast<const float2*>(dsum + q_local);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
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

template <typename Kt, bool kIsCausal, bool kDeterministic, bool kVarSeq>
__global__ void __launch_bounds__(Kt::kNThreads, 1) bwd_main_kernel(const AttentionBwdParams params) {
  using T = typename Kt::T;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kPitch = Kt::kRowPitch;
  constexpr int kQTiles = Kt::kQTiles;
  constexpr int kDimPerWarp = Kt::kDimPerWarp;

  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + Kt::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Kt::kOffV);
  T* sQ = reinterpret_cast<T*>(smem + Kt::kOffQ);    // [kStages][kBlockM][kPitch]
  T* sdO = reinterpret_cast<T*>(smem + Kt::kOffdO);  // [kStages][kBlockM][kPitch]
  T* sdS = reinterpret_cast<T*>(smem + Kt::kOffdS);  // dS^T [kBlockN][kKeyRowPitch]
  T* sP = reinterpret_cast<T*>(smem + Kt::kOffP);    // P^T [kBlockN][kKeyRowPitch]
  float* sdP = reinterpret_cast<float*>(smem + Kt::kOffdP);  // dP^T fragments, split phase only
  float* sLse2 = reinterpret_cast<float*>(smem + Kt::kOffLse);  // [kStages][kBlockM]
  float* sDsum = reinterpret_cast<float*>(smem + Kt::kOffDsum);  // [kStages][kBlockM]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wk = warp % Kt::kWarpsKeys;  // which kKeysPerWarp keys (every phase)
  // dK/dV phase: which head-dim half; S^T phase: which query half (tiled) or
  // S^T vs dP^T (split).
  const int wd = warp / Kt::kWarpsKeys;
  const int warp_key0 = wk * Kt::kKeysPerWarp;
  const int h = blockIdx.y, b = blockIdx.z;
  // GQA: K/V are read from the group's kv head; dK / dV are written per query
  // head (the op layer sums each group when heads_k < heads).
  const int h_kv = h / (params.heads / params.heads_k);
  // This sequence's lengths / first rows / causal offset (varlen, seqused_k).
  const SeqBounds seq = seq_bounds<kVarSeq>(params, b);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = params.head_dim;
  const int causal_offset = seq.causal_offset;
  const int num_m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  const int num_n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;

  auto head_rows = [&](const void* base, const TensorStrides& st, int head, int64_t row0) {
    return static_cast<const T*>(base) + row_offset(st, b, head, row0);
  };
  const T* q_bh = head_rows(params.q, params.q_strides, h, seq.row0_q);
  const T* k_bh = head_rows(params.k, params.k_strides, h_kv, seq.row0_k);
  const T* v_bh = head_rows(params.v, params.v_strides, h_kv, seq.row0_k);
  const T* do_bh = head_rows(params.dout, params.dout_strides, h, seq.row0_q);
  T* dk_bh = const_cast<T*>(head_rows(params.dk, params.dk_strides, h, seq.row0_k));
  T* dv_bh = const_cast<T*>(head_rows(params.dv, params.dv_strides, h, seq.row0_k));
  const int64_t stats_row0 = seq.lse_index(params, b, h, 0);
  const float* lse_bh = params.lse + stats_row0;
  const float* dsum_bh = params.dsoftmax_sum + stats_row0;
  // Deterministic: block x owns dQ split x exclusively (plain read-modify-write
  // in a fixed n_block order); otherwise all blocks share split 0 via atomics.
  const int split = kDeterministic ? blockIdx.x : 0;
  float* dq_bh = params.dq_accum + (split * params.q_rows_total + stats_row0) * kHeadDim;

  // lse (in log2 units) and D of one query tile, into registers: issued early,
  // stored to shared memory late, so the global latency hides under the mmas.
  auto load_row_stats = [&](int m_block, float& lse2, float& dsum) {
    lse2 = INFINITY;
    dsum = 0.f;
    const int row = m_block * kBlockM + tid;
    if (tid < kBlockM && row < seqlen_q) {
      const float lse = lse_bh[row];
      // lse = -inf: the forward saw no visible key, P must be 0 (not exp2(+inf)).
      lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
      dsum = dsum_bh[row];
    }
  };
  auto store_row_stats = [&](int stage, float lse2, float dsum) {
    if (tid < kBlockM) {
      sLse2[stage * kBlockM + tid] = lse2;
      sDsum[stage * kBlockM + tid] = dsum;
    }
  };
  auto load_q_do_async = [&](int m_block, int stage) {
    const int row0 = m_block * kBlockM;
    const int rows_valid = min(kBlockM, seqlen_q - row0);
    load_tile_async<Kt, kBlockM>(sQ + stage * kBlockM * kPitch, q_bh + row0 * params.q_strides.row,
                                 params.q_strides.row, rows_valid, head_dim);
    load_tile_async<Kt, kBlockM>(sdO + stage * kBlockM * kPitch,
                                 do_bh + row0 * params.dout_strides.row, params.dout_strides.row,
                                 rows_valid, head_dim);
  };

  for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
    const int key0 = n_block * kBlockN;
    // Causal: the first query that sees key `key0` is key0 - causal_offset;
    // tiles above it are skipped entirely (they contribute nothing).
    int m_begin = 0;
    if (kIsCausal) {
      const int first_query = key0 - causal_offset;
      m_begin = first_query <= 0 ? 0 : first_query / kBlockM;
    }

    __syncthreads();  // the previous n_block's epilogue is done with sK / sV
    {
      const int rows_valid = min(kBlockN, seqlen_k - key0);
      load_tile_async<Kt, kBlockN>(sK, k_bh + key0 * params.k_strides.row, params.k_strides.row,
                                   rows_valid, head_dim);
      load_tile_async<Kt, kBlockN>(sV, v_bh + key0 * params.v_strides.row, params.v_strides.row,
                                   rows_valid, head_dim);
    }
    if (m_begin < num_m_blocks) {
      load_q_do_async(m_begin, 0);
      float lse2, dsum;
      load_row_stats(m_begin, lse2, dsum);
      store_row_stats(0, lse2, dsum);
    }
    cp_async_commit();

    float acc_dv[Kt::kMmaKeys][kDimPerWarp / 8][4];
    float acc_dk[Kt::kMmaKeys][kDimPerWarp / 8][4];
#pragma unroll
    for (int m = 0; m < Kt::kMmaKeys; ++m) {
#pragma unroll
      for (int i = 0; i < kDimPerWarp / 8; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_dv[m][i][c] = acc_dk[m][i][c] = 0.f;
      }
    }

    for (int m_block = m_begin; m_block < num_m_blocks; ++m_block) {
      const int stage = (m_block - m_begin) & 1;
      const int query0 = m_block * kBlockM;
      cp_async_wait<0>();
      // Q/dO/lse/D of this tile are visible, and every warp is done with the
      // other stage and with sdS / sP / sdP of the previous tile.
      __syncthreads();

      const bool has_next = m_block + 1 < num_m_blocks;
      if (has_next) load_q_do_async(m_block + 1, stage ^ 1);
      cp_async_commit();
      float next_lse2, next_dsum;
      if (has_next) load_row_stats(m_block + 1, next_lse2, next_dsum);

      const T* sQ_m = sQ + stage * kBlockM * kPitch;
      const T* sdO_m = sdO + stage * kBlockM * kPitch;
      const float* lse2_m = sLse2 + stage * kBlockM;
      const float* dsum_m = sDsum + stage * kBlockM;
      // Only tiles crossing the diagonal or the seqlen_k boundary need masks.
      // (Query rows >= seqlen_q need none: their lse2 = +inf gives P = 0.)
      const bool apply_mask = key0 + kBlockN > seqlen_k ||
                              (kIsCausal && query0 + causal_offset < key0 + kBlockN - 1);

      if constexpr (Kt::kLayout == BwdLayout::kRegisters) {
        // ---- S^T, dP^T, P^T, dS^T of 16 keys x all queries in registers -----
        float acc_s[1][kQTiles][4], acc_dp[1][kQTiles][4];
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_s[0][j][c] = acc_dp[0][j][c] = 0.f;
        }
        gemm_keys_by_queries<Kt, 1, kQTiles>(acc_s, sK + warp_key0 * kPitch, sQ_m, lane);
        gemm_keys_by_queries<Kt, 1, kQTiles>(acc_dp, sV + warp_key0 * kPitch, sdO_m, lane);
        softmax_backward<Kt, kIsCausal, 1, kQTiles>(
            acc_s, acc_dp, lse2_m, dsum_m, params.scale_log2, apply_mask, key0 + warp_key0,
            query0, seqlen_k, causal_offset, lane);
        // dV += P^T dO, dK += dS^T Q straight from the accumulators (their C
        // layout is the A layout); only dS^T goes to smem, for dQ.
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq) {
          uint32_t a_p[1][4], a_ds[1][4];
          c_to_a_fragment<T>(a_p[0], acc_s[0][2 * kq], acc_s[0][2 * kq + 1]);
          c_to_a_fragment<T>(a_ds[0], acc_dp[0][2 * kq], acc_dp[0][2 * kq + 1]);
          store_a_fragment<Kt>(sdS, a_ds[0], warp_key0, kq * 16, lane);
          gemm_accumulate_kv<Kt>(acc_dv, a_p, sdO_m + kq * 16 * kPitch, lane);
          gemm_accumulate_kv<Kt>(acc_dk, a_ds, sQ_m + kq * 16 * kPitch, lane);
        }
        __syncthreads();  // dS^T complete before the dQ product reads all of it
      } else if constexpr (Kt::kTiledSdP) {
        // ---- S^T, dP^T for 32 keys x kBlockM/2 queries; P^T, dS^T -> smem ----
        constexpr int kM = Kt::kMmaKeys;
        const int warp_q0 = wd * Kt::kQueriesPerWarpS;
        float acc_s[kM][kQTiles][4], acc_dp[kM][kQTiles][4];
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
          for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc_s[m][j][c] = acc_dp[m][j][c] = 0.f;
          }
        }
        gemm_keys_by_queries<Kt, kM, kQTiles>(acc_s, sK + warp_key0 * kPitch,
                                              sQ_m + warp_q0 * kPitch, lane);
        gemm_keys_by_queries<Kt, kM, kQTiles>(acc_dp, sV + warp_key0 * kPitch,
                                              sdO_m + warp_q0 * kPitch, lane);
        softmax_backward<Kt, kIsCausal, kM, kQTiles>(
            acc_s, acc_dp, lse2_m + warp_q0, dsum_m + warp_q0, params.scale_log2, apply_mask,
            key0 + warp_key0, query0 + warp_q0, seqlen_k, causal_offset, lane);
        store_key_query_tile<Kt, kM, kQTiles>(sP, acc_s, warp_key0, warp_q0, lane);
        store_key_query_tile<Kt, kM, kQTiles>(sdS, acc_dp, warp_key0, warp_q0, lane);
      } else {
        // ---- group 0: S^T = K Q^T;  group 1: dP^T = V dO^T (16 keys each) ---
        float acc[1][kQTiles][4];
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[0][j][c] = 0.f;
        }
        gemm_keys_by_queries<Kt, 1, kQTiles>(acc, (wd == 0 ? sK : sV) + warp_key0 * kPitch,
                                             wd == 0 ? sQ_m : sdO_m, lane);
        // Fragment-order hand-off: lane l of warp (wk, 1) writes what lane l of
        // warp (wk, 0) needs, 16 contiguous bytes per lane (conflict-free).
        float4* dp_frag = reinterpret_cast<float4*>(sdP) + (wk * kQTiles) * 32 + lane;
        if (wd == 1) {
#pragma unroll
          for (int j = 0; j < kQTiles; ++j)
            dp_frag[j * 32] = make_float4(acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3]);
        }
        __syncthreads();
        if (wd == 0) {
          float acc_dp[1][kQTiles][4];
#pragma unroll
          for (int j = 0; j < kQTiles; ++j) {
            const float4 v = dp_frag[j * 32];
            acc_dp[0][j][0] = v.x, acc_dp[0][j][1] = v.y, acc_dp[0][j][2] = v.z,
            acc_dp[0][j][3] = v.w;
          }
          softmax_backward<Kt, kIsCausal, 1, kQTiles>(
              acc, acc_dp, lse2_m, dsum_m, params.scale_log2, apply_mask, key0 + warp_key0,
              query0, seqlen_k, causal_offset, lane);
          store_key_query_tile<Kt, 1, kQTiles>(sP, acc, warp_key0, 0, lane);
          store_key_query_tile<Kt, 1, kQTiles>(sdS, acc_dp, warp_key0, 0, lane);
        }
      }
      // ---- dV += P^T dO, dK += dS^T Q for this warp's keys x head-dim half ----
      if constexpr (Kt::kLayout != BwdLayout::kRegisters) {
        __syncthreads();  // P^T, dS^T complete (also for the dQ product below)
        const int a_off = (warp_key0 + lane % 8 + 8 * ((lane / 8) % 2)) * Kt::kKeyRowPitch +
                          8 * (lane / 16);
        const int col0 = wd * kDimPerWarp;
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq) {
          uint32_t a_p[Kt::kMmaKeys][4], a_ds[Kt::kMmaKeys][4];
#pragma unroll
          for (int m = 0; m < Kt::kMmaKeys; ++m) {
            ldmatrix_x4(a_p[m], sP + a_off + m * 16 * Kt::kKeyRowPitch + kq * 16);
            ldmatrix_x4(a_ds[m], sdS + a_off + m * 16 * Kt::kKeyRowPitch + kq * 16);
          }
          gemm_accumulate_kv<Kt>(acc_dv, a_p, sdO_m + kq * 16 * kPitch + col0, lane);
          gemm_accumulate_kv<Kt>(acc_dk, a_ds, sQ_m + kq * 16 * kPitch + col0, lane);
        }
      }

      // ---- dQ_m += dS_m K  (this block's keys only) --------------------------
      {
        constexpr int kMi = Kt::kRowsdQ / 16, kNi = Kt::kColsdQ / 8;
        const int row0 = (warp % Kt::kWarpsMdQ) * Kt::kRowsdQ;
        const int col0 = (warp / Kt::kWarpsMdQ) * Kt::kColsdQ;
        float acc_dq[kMi][kNi][4];
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
          for (int ni = 0; ni < kNi; ++ni) {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc_dq[mi][ni][c] = 0.f;
          }
        }
        // A = dS (queries x keys) is stored transposed: ldmatrix.trans of the
        // [keys][queries] tile; x4 matrices = (keys 0-7, queries 0-7) -> a[0],
        // (keys 0-7, queries 8-15) -> a[1], (keys 8-15, q 0-7) -> a[2], ...
        const T* a_row = sdS + (lane % 8 + 8 * (lane / 16)) * Kt::kKeyRowPitch + row0 +
                         8 * ((lane / 8) % 2);
        // B = K (keys x head dim), contraction down its rows: ldmatrix.trans.
        const T* b_row = sK + (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + col0 + 8 * (lane / 16);
#pragma unroll(Kt::kGemmUnroll)
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          uint32_t a[kMi][4];
#pragma unroll
          for (int mi = 0; mi < kMi; ++mi)
            ldmatrix_x4_trans(a[mi], a_row + kk * 16 * Kt::kKeyRowPitch + mi * 16);
#pragma unroll
          for (int nn = 0; nn < kNi / 2; ++nn) {
            uint32_t bk[4];
            ldmatrix_x4_trans(bk, b_row + kk * 16 * kPitch + nn * 16);
            const uint32_t b_lo[2] = {bk[0], bk[1]};
            const uint32_t b_hi[2] = {bk[2], bk[3]};
#pragma unroll
            for (int mi = 0; mi < kMi; ++mi) {
              mma_16816<T>(acc_dq[mi][2 * nn], a[mi], b_lo);
              mma_16816<T>(acc_dq[mi][2 * nn + 1], a[mi], b_hi);
            }
          }
        }
        const int g = lane / 4, q4 = lane % 4;
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = query0 + row0 + mi * 16 + g + 8 * half;
            if (row >= seqlen_q) continue;
            float* dq_row = dq_bh + static_cast<int64_t>(row) * kHeadDim;
#pragma unroll
            for (int ni = 0; ni < kNi; ++ni) {
              const int col = col0 + ni * 8 + 2 * q4;
              if (col >= head_dim) continue;
              const float x = acc_dq[mi][ni][2 * half], y = acc_dq[mi][ni][2 * half + 1];
              if constexpr (kDeterministic) {
                // This thread is the only writer of these two words (fixed
                // thread <-> element map, one block per split): no atomics,
                // and the order of additions is the n_block order.
                float2* p = reinterpret_cast<float2*>(dq_row + col);
                const float2 old = *p;
                *p = make_float2(old.x + x, old.y + y);
              } else {
                atomic_add_pair(dq_row + col, x, y);
              }
            }
          }
        }
      }

      // Row stats of tile m+1 into the other stage: that stage was last read
      // before this iteration's first barrier.
      if (has_next) store_row_stats(stage ^ 1, next_lse2, next_dsum);
    }

    // ---- epilogue: dK (scaled), dV -> 16-bit, staged through sK / sV ----------
    cp_async_wait<0>();
    __syncthreads();  // all warps are done reading sK (dQ product) and sV
    {
      const int g = lane / 4, q4 = lane % 4;
      const float scale = params.softmax_scale;
#pragma unroll
      for (int m = 0; m < Kt::kMmaKeys; ++m) {
#pragma unroll
        for (int ni = 0; ni < kDimPerWarp / 8; ++ni) {
          const int col = wd * kDimPerWarp + ni * 8 + 2 * q4;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = warp_key0 + 16 * m + g + 8 * half;
            *reinterpret_cast<uint32_t*>(sV + row * kPitch + col) =
                pack2<T>(acc_dv[m][ni][2 * half], acc_dv[m][ni][2 * half + 1]);
            *reinterpret_cast<uint32_t*>(sK + row * kPitch + col) =
                pack2<T>(acc_dk[m][ni][2 * half] * scale, acc_dk[m][ni][2 * half + 1] * scale);
          }
        }
      }
    }
    __syncthreads();
    {
      // 16-byte coalesced stores; rows >= seqlen_k and columns >= head_dim are
      // never written. Keys no query can see still get their zeros here.
      constexpr int kChunks = kBlockN * Kt::kChunksPerRow;
      for (int idx = tid; idx < kChunks; idx += Kt::kNThreads) {
        const int row = idx / Kt::kChunksPerRow;
        const int col = (idx % Kt::kChunksPerRow) * 8;
        if (key0 + row < seqlen_k && col < head_dim) {
          *reinterpret_cast<uint4*>(dk_bh + (key0 + row) * params.dk_strides.row + col) =
              *reinterpret_cast<const uint4*>(sK + row * kPitch + col);
          *reinterpret_cast<uint4*>(dv_bh + (key0 + row) * params.dv_strides.row + col) =
              *reinterpret_cast<const uint4*>(sV + row * kPitch + col);
        }
      }
    }
  }
}

}  // namespace bwd
}  // namespace cuda
}  // namespace flash_attn_ext
