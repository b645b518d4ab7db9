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
//
// The kernel body is the loop skeleton with every barrier; the stages are the
// device functions above it (S^T / dP^T per layout, dK / dV, dQ, the dK / dV
// epilogue), built from bwd_building_blocks.cuh.
#pragma once
#include <cmath>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "bwd_building_blocks.cuh"
#include "bwd_kernel_traits.cuh"

namespace flash_attn_ext {
namespace cuda {
namespace bwd {

// ---------------------------------------------------------------------------
// The stages of the main kernel below and what they share.
// ---------------------------------------------------------------------------
// The kernel's shared-memory tiles (offsets: bwd_kernel_traits.cuh).
template <typename Kt>
struct BwdSmem {
  using T = typename Kt::T;
  T* sK;
  T* sV;
  T* sQ;       // [kStages][kBlockM][kPitch]
  T* sdO;      // [kStages][kBlockM][kPitch]
  T* sdS;      // dS^T [kBlockN][kKeyRowPitch]
  T* sP;       // P^T [kBlockN][kKeyRowPitch]
  float* sdP;  // dP^T fragments, split phase only
  float* sLse2;  // [kStages][kBlockM]
  float* sDsum;  // [kStages][kBlockM]

  explicit FAE_DEVICE BwdSmem(unsigned char* smem)
      : sK(reinterpret_cast<T*>(smem + Kt::kOffK)),
        sV(reinterpret_cast<T*>(smem + Kt::kOffV)),
        sQ(reinterpret_cast<T*>(smem + Kt::kOffQ)),
        sdO(reinterpret_cast<T*>(smem + Kt::kOffdO)),
        sdS(reinterpret_cast<T*>(smem + Kt::kOffdS)),
        sP(reinterpret_cast<T*>(smem + Kt::kOffP)),
        sdP(reinterpret_cast<float*>(smem + Kt::kOffdP)),
        sLse2(reinterpret_cast<float*>(smem + Kt::kOffLse)),
        sDsum(reinterpret_cast<float*>(smem + Kt::kOffDsum)) {}
};

// A thread's warp and that warp's keys / head-dim part of the tile.
template <typename Kt>
struct BwdThread {
  int tid, lane, warp;
  int wk;  // which kKeysPerWarp keys (every phase)
  // dK/dV phase: which head-dim half; S^T phase: which query half (tiled) or
  // S^T vs dP^T (split).
  int wd;
  int warp_key0;

  FAE_DEVICE BwdThread()
      : tid(threadIdx.x),
        lane(tid % 32),
        warp(tid / 32),
        wk(warp % Kt::kWarpsKeys),
        wd(warp / Kt::kWarpsKeys),
        warp_key0(wk * Kt::kKeysPerWarp) {}
};

// One query tile as the main-loop stages read it: its stage of the Q / dO /
// row-stats double buffer, and whether the (key tile, query tile) pair needs
// masks.
template <typename Kt>
struct QueryTile {
  const typename Kt::T* sQ;
  const typename Kt::T* sdO;
  const float* lse2;
  const float* dsum;
  int query0;
  bool apply_mask;
};

// The per-query-tile inputs (Q, dO: cp.async; lse, D: registers, stored
// late) of one (batch, head), into stage `stage` of the double buffer.
template <typename Kt>
struct QueryTileLoader {
  using T = typename Kt::T;
  const AttentionBwdParams& params;
  const BwdSmem<Kt>& smem;
  const T* q_bh;
  const T* do_bh;
  const float* lse_bh;
  const float* dsum_bh;
  int seqlen_q, head_dim, tid;

  // lse (in log2 units) and D of one query tile, into registers: issued early,
  // stored to shared memory late, so the global latency hides under the mmas.
  FAE_DEVICE void load_row_stats(int m_block, float& lse2, float& dsum) const {
    lse2 = INFINITY;
    dsum = 0.f;
    const int row = m_block * Kt::kBlockM + tid;
    if (tid < Kt::kBlockM && row < seqlen_q) {
      const float lse = lse_bh[row];
      // lse = -inf: the forward saw no visible key, P must be 0 (not exp2(+inf)).
      lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
      dsum = dsum_bh[row];
    }
  }
  FAE_DEVICE void store_row_stats(int stage, float lse2, float dsum) const {
    if (tid < Kt::kBlockM) {
      smem.sLse2[stage * Kt::kBlockM + tid] = lse2;
      smem.sDsum[stage * Kt::kBlockM + tid] = dsum;
    }
  }
  FAE_DEVICE void load_q_do_async(int m_block, int stage) const {
    constexpr int kBlockM = Kt::kBlockM, kPitch = Kt::kRowPitch;
    const int row0 = m_block * kBlockM;
    const int rows_valid = min(kBlockM, seqlen_q - row0);
    load_tile_async<Kt, kBlockM>(smem.sQ + stage * kBlockM * kPitch,
                                 q_bh + row0 * params.q_strides.row, params.q_strides.row,
                                 rows_valid, head_dim);
    load_tile_async<Kt, kBlockM>(smem.sdO + stage * kBlockM * kPitch,
                                 do_bh + row0 * params.dout_strides.row, params.dout_strides.row,
                                 rows_valid, head_dim);
  }
};

// ---- kRegisters: S^T, dP^T, P^T, dS^T of 16 keys x all queries in registers,
// then dV += P^T dO, dK += dS^T Q straight from the accumulators (their C
// layout is the A layout); only dS^T goes to smem, for dQ.
template <typename Kt, bool kIsCausal, bool kHasVariants>
FAE_DEVICE void scores_and_dkdv_in_registers(
    float (&acc_dv)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4],
    float (&acc_dk)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4], const BwdSmem<Kt>& smem,
    const QueryTile<Kt>& tile, float scale_log2, int key0, int seqlen_k, int causal_offset,
    const BwdThread<Kt>& th, const ScoreVariants* variants, const Dropout* dropout) {
  using T = typename Kt::T;
  constexpr int kQTiles = Kt::kQTiles, kPitch = Kt::kRowPitch;
  const int lane = th.lane, warp_key0 = th.warp_key0;
  float acc_s[1][kQTiles][4], acc_dp[1][kQTiles][4];
#pragma unroll
  for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc_s[0][j][c] = acc_dp[0][j][c] = 0.f;
  }
  gemm_keys_by_queries<Kt, 1, kQTiles>(acc_s, smem.sK + warp_key0 * kPitch, tile.sQ, lane);
  gemm_keys_by_queries<Kt, 1, kQTiles>(acc_dp, smem.sV + warp_key0 * kPitch, tile.sdO, lane);
  softmax_backward<Kt, kIsCausal, 1, kQTiles, kHasVariants>(
      acc_s, acc_dp, tile.lse2, tile.dsum, scale_log2, tile.apply_mask, key0 + warp_key0,
      tile.query0, seqlen_k, causal_offset, lane, variants, dropout);
#pragma unroll
  for (int kq = 0; kq < Kt::kBlockM / 16; ++kq) {
    uint32_t a_p[1][4], a_ds[1][4];
    c_to_a_fragment<T>(a_p[0], acc_s[0][2 * kq], acc_s[0][2 * kq + 1]);
    c_to_a_fragment<T>(a_ds[0], acc_dp[0][2 * kq], acc_dp[0][2 * kq + 1]);
    store_a_fragment<Kt>(smem.sdS, a_ds[0], warp_key0, kq * 16, lane);
    gemm_accumulate_kv<Kt>(acc_dv, a_p, tile.sdO + kq * 16 * kPitch, lane);
    gemm_accumulate_kv<Kt>(acc_dk, a_ds, tile.sQ + kq * 16 * kPitch, lane);
  }
}

// ---- kTiled: S^T, dP^T for 32 keys x kBlockM/2 queries; P^T, dS^T -> smem --
template <typename Kt, bool kIsCausal, bool kHasVariants>
FAE_DEVICE void scores_tiled(const BwdSmem<Kt>& smem, const QueryTile<Kt>& tile,
                             float scale_log2, int key0, int seqlen_k, int causal_offset,
                             const BwdThread<Kt>& th, const ScoreVariants* variants,
                             const Dropout* dropout) {
  constexpr int kM = Kt::kMmaKeys, kQTiles = Kt::kQTiles, kPitch = Kt::kRowPitch;
  const int lane = th.lane, warp_key0 = th.warp_key0;
  const int warp_q0 = th.wd * Kt::kQueriesPerWarpS;
  float acc_s[kM][kQTiles][4], acc_dp[kM][kQTiles][4];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc_s[m][j][c] = acc_dp[m][j][c] = 0.f;
    }
  }
  gemm_keys_by_queries<Kt, kM, kQTiles>(acc_s, smem.sK + warp_key0 * kPitch,
                                        tile.sQ + warp_q0 * kPitch, lane);
  gemm_keys_by_queries<Kt, kM, kQTiles>(acc_dp, smem.sV + warp_key0 * kPitch,
                                        tile.sdO + warp_q0 * kPitch, lane);
  softmax_backward<Kt, kIsCausal, kM, kQTiles, kHasVariants>(
      acc_s, acc_dp, tile.lse2 + warp_q0, tile.dsum + warp_q0, scale_log2, tile.apply_mask,
      key0 + warp_key0, tile.query0 + warp_q0, seqlen_k, causal_offset, lane, variants, dropout);
  store_key_query_tile<Kt, kM, kQTiles>(smem.sP, acc_s, warp_key0, warp_q0, lane);
  store_key_query_tile<Kt, kM, kQTiles>(smem.sdS, acc_dp, warp_key0, warp_q0, lane);
}

// ---- kSplit: group 0: S^T = K Q^T;  group 1: dP^T = V dO^T (16 keys each);
// group 0 forms P^T, dS^T -> smem.
template <typename Kt, bool kIsCausal, bool kHasVariants>
FAE_DEVICE void scores_split(const BwdSmem<Kt>& smem, const QueryTile<Kt>& tile,
                             float scale_log2, int key0, int seqlen_k, int causal_offset,
                             const BwdThread<Kt>& th, const ScoreVariants* variants,
                             const Dropout* dropout) {
  constexpr int kQTiles = Kt::kQTiles, kPitch = Kt::kRowPitch;
  const int lane = th.lane, wd = th.wd, warp_key0 = th.warp_key0;
  float acc[1][kQTiles][4];
#pragma unroll
  for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[0][j][c] = 0.f;
  }
  gemm_keys_by_queries<Kt, 1, kQTiles>(acc, (wd == 0 ? smem.sK : smem.sV) + warp_key0 * kPitch,
                                       wd == 0 ? tile.sQ : tile.sdO, lane);
  // Fragment-order hand-off: lane l of warp (wk, 1) writes what lane l of
  // warp (wk, 0) needs, 16 contiguous bytes per lane (conflict-free).
  float4* dp_frag = reinterpret_cast<float4*>(smem.sdP) + (th.wk * kQTiles) * 32 + lane;
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
      acc_dp[0][j][0] = v.x, acc_dp[0][j][1] = v.y, acc_dp[0][j][2] = v.z, acc_dp[0][j][3] = v.w;
    }
    softmax_backward<Kt, kIsCausal, 1, kQTiles, kHasVariants>(
        acc, acc_dp, tile.lse2, tile.dsum, scale_log2, tile.apply_mask, key0 + warp_key0,
        tile.query0, seqlen_k, causal_offset, lane, variants, dropout);
    store_key_query_tile<Kt, 1, kQTiles>(smem.sP, acc, warp_key0, 0, lane);
    store_key_query_tile<Kt, 1, kQTiles>(smem.sdS, acc_dp, warp_key0, 0, lane);
  }
}

// ---- kTiled / kSplit: dV += P^T dO, dK += dS^T Q for this warp's keys x
// head-dim half, with P^T and dS^T read back from shared memory.
template <typename Kt>
FAE_DEVICE void accumulate_dkdv_from_smem(float (&acc_dv)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4],
                                          float (&acc_dk)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4],
                                          const BwdSmem<Kt>& smem, const QueryTile<Kt>& tile,
                                          const BwdThread<Kt>& th) {
  constexpr int kPitch = Kt::kRowPitch;
  const int lane = th.lane;
  const int a_off = (th.warp_key0 + lane % 8 + 8 * ((lane / 8) % 2)) * Kt::kKeyRowPitch +
                    8 * (lane / 16);
  const int col0 = th.wd * Kt::kDimPerWarp;
#pragma unroll
  for (int kq = 0; kq < Kt::kBlockM / 16; ++kq) {
    uint32_t a_p[Kt::kMmaKeys][4], a_ds[Kt::kMmaKeys][4];
#pragma unroll
    for (int m = 0; m < Kt::kMmaKeys; ++m) {
      ldmatrix_x4(a_p[m], smem.sP + a_off + m * 16 * Kt::kKeyRowPitch + kq * 16);
      ldmatrix_x4(a_ds[m], smem.sdS + a_off + m * 16 * Kt::kKeyRowPitch + kq * 16);
    }
    gemm_accumulate_kv<Kt>(acc_dv, a_p, tile.sdO + kq * 16 * kPitch + col0, lane);
    gemm_accumulate_kv<Kt>(acc_dk, a_ds, tile.sQ + kq * 16 * kPitch + col0, lane);
  }
}

// ---- dQ_m += dS_m K (this block's keys only), into the fp32 accumulator -----
// (atomics; deterministic: this block's own split, plain read-modify-write).
template <typename Kt, bool kDeterministic>
FAE_DEVICE void accumulate_dq(float* dq_bh, const BwdSmem<Kt>& smem, int query0, int seqlen_q,
                              int head_dim, const BwdThread<Kt>& th) {
  using T = typename Kt::T;
  constexpr int kPitch = Kt::kRowPitch, kHeadDim = Kt::kHeadDim;
  constexpr int kMi = Kt::kRowsdQ / 16, kNi = Kt::kColsdQ / 8;
  const int lane = th.lane, warp = th.warp;
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
  const T* a_row = smem.sdS + (lane % 8 + 8 * (lane / 16)) * Kt::kKeyRowPitch + row0 +
                   8 * ((lane / 8) % 2);
  // B = K (keys x head dim), contraction down its rows: ldmatrix.trans.
  const T* b_row = smem.sK + (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + col0 + 8 * (lane / 16);
#pragma unroll(Kt::kGemmUnroll)
  for (int kk = 0; kk < Kt::kBlockN / 16; ++kk) {
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

// ---- epilogue: dK (scaled), dV -> 16-bit, staged through sK / sV -------------
// The caller has made sure every warp is done reading sK and sV.
template <typename Kt>
FAE_DEVICE void store_dk_dv(const float (&acc_dv)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4],
                            const float (&acc_dk)[Kt::kMmaKeys][Kt::kDimPerWarp / 8][4],
                            const BwdSmem<Kt>& smem, const AttentionBwdParams& params,
                            typename Kt::T* dk_bh, typename Kt::T* dv_bh, int key0, int seqlen_k,
                            int head_dim, const BwdThread<Kt>& th) {
  using T = typename Kt::T;
  constexpr int kPitch = Kt::kRowPitch, kDimPerWarp = Kt::kDimPerWarp;
  {
    const int g = th.lane / 4, q4 = th.lane % 4;
    const float scale = params.softmax_scale;
#pragma unroll
    for (int m = 0; m < Kt::kMmaKeys; ++m) {
#pragma unroll
      for (int ni = 0; ni < kDimPerWarp / 8; ++ni) {
        const int col = th.wd * kDimPerWarp + ni * 8 + 2 * q4;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = th.warp_key0 + 16 * m + g + 8 * half;
          *reinterpret_cast<uint32_t*>(smem.sV + row * kPitch + col) =
              pack2<T>(acc_dv[m][ni][2 * half], acc_dv[m][ni][2 * half + 1]);
          *reinterpret_cast<uint32_t*>(smem.sK + row * kPitch + col) =
              pack2<T>(acc_dk[m][ni][2 * half] * scale, acc_dk[m][ni][2 * half + 1] * scale);
        }
      }
    }
  }
  __syncthreads();
  {
    // 16-byte coalesced stores; rows >= seqlen_k and columns >= head_dim are
    // never written. Keys no query can see still get their zeros here.
    constexpr int kChunks = Kt::kBlockN * Kt::kChunksPerRow;
    for (int idx = th.tid; idx < kChunks; idx += Kt::kNThreads) {
      const int row = idx / Kt::kChunksPerRow;
      const int col = (idx % Kt::kChunksPerRow) * 8;
      if (key0 + row < seqlen_k && col < head_dim) {
        *reinterpret_cast<uint4*>(dk_bh + (key0 + row) * params.dk_strides.row + col) =
            *reinterpret_cast<const uint4*>(smem.sK + row * kPitch + col);
        *reinterpret_cast<uint4*>(dv_bh + (key0 + row) * params.dv_strides.row + col) =
            *reinterpret_cast<const uint4*>(smem.sV + row * kPitch + col);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Main kernel. Grid: x = key tile (deterministic: dQ split), y = head, z = batch.
// kHasVariants: window / softcap / ALiBi / attn_mask (csrc/mask.h, ScoreVariants)
// and dropout (csrc/dropout.h; softmax_backward), instantiated with
// kIsCausal = false and kVarSeq = true (run_bwd_variants_impl).
// ---------------------------------------------------------------------------
template <typename Kt, bool kIsCausal, bool kDeterministic, bool kVarSeq,
          bool kHasVariants = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1) bwd_main_kernel(const AttentionBwdParams params) {
  using T = typename Kt::T;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kPitch = Kt::kRowPitch;
  constexpr int kDimPerWarp = Kt::kDimPerWarp;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const BwdSmem<Kt> smem(smem_raw);
  const BwdThread<Kt> th;
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
  const QueryTileLoader<Kt> loader{params, smem, q_bh, do_bh, lse_bh, dsum_bh,
                                   seqlen_q, head_dim, th.tid};
  ScoreVariants variants;
  if constexpr (kHasVariants) variants = ScoreVariants::make(params, seq, b, h);

  for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
    // ---- prologue: this key tile's K / V, the first query tile that sees it --
    const int key0 = n_block * kBlockN;
    // Causal: the first query that sees key `key0` is key0 - causal_offset;
    // tiles above it are skipped entirely (they contribute nothing).
    int m_begin = 0;
    int m_end = num_m_blocks;
    if (kIsCausal) {
      const int first_query = key0 - causal_offset;
      m_begin = first_query <= 0 ? 0 : first_query / kBlockM;
    }
    if constexpr (kHasVariants) {
      // Query tiles holding a row that sees a key of this tile (query_begin /
      // query_end are non-decreasing in the key).
      m_begin = variants.mask.query_begin(key0) / kBlockM;
      m_end = (variants.mask.query_end(min(key0 + kBlockN, seqlen_k) - 1) + kBlockM - 1) / kBlockM;
    }

    __syncthreads();  // the previous n_block's epilogue is done with sK / sV
    {
      const int rows_valid = min(kBlockN, seqlen_k - key0);
      load_tile_async<Kt, kBlockN>(smem.sK, k_bh + key0 * params.k_strides.row,
                                   params.k_strides.row, rows_valid, head_dim);
      load_tile_async<Kt, kBlockN>(smem.sV, v_bh + key0 * params.v_strides.row,
                                   params.v_strides.row, rows_valid, head_dim);
    }
    if (m_begin < m_end) {
      loader.load_q_do_async(m_begin, 0);
      float lse2, dsum;
      loader.load_row_stats(m_begin, lse2, dsum);
      loader.store_row_stats(0, lse2, dsum);
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

    // ---- main loop over the query tiles that see this key tile ---------------
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
      const int stage = (m_block - m_begin) & 1;
      const int query0 = m_block * kBlockM;
      cp_async_wait<0>();
      // Q/dO/lse/D of this tile are visible, and every warp is done with the
      // other stage and with sdS / sP / sdP of the previous tile.
      __syncthreads();

      const bool has_next = m_block + 1 < m_end;
      if (has_next) loader.load_q_do_async(m_block + 1, stage ^ 1);
      cp_async_commit();
      float next_lse2, next_dsum;
      if (has_next) loader.load_row_stats(m_block + 1, next_lse2, next_dsum);

      // Only tiles crossing the diagonal or the seqlen_k boundary need masks.
      // (Query rows >= seqlen_q need none: their lse2 = +inf gives P = 0.)
      // Variants: also tiles that a window bound crosses.
      bool apply_mask =
          key0 + kBlockN > seqlen_k || (kIsCausal && query0 + causal_offset < key0 + kBlockN - 1);
      if constexpr (kHasVariants) {
        apply_mask = apply_mask || key0 < variants.mask.key_begin(query0 + kBlockM - 1) ||
                     key0 + kBlockN > variants.mask.key_end(query0);
      }
      const QueryTile<Kt> tile{smem.sQ + stage * kBlockM * kPitch,
                               smem.sdO + stage * kBlockM * kPitch, smem.sLse2 + stage * kBlockM,
                               smem.sDsum + stage * kBlockM, query0, apply_mask};

      // Dropout (variants): built per query tile, so that its seed and offset
      // do not hold registers across the loop (the kernels are at 255).
      Dropout dropout_v;
      const Dropout* dropout = nullptr;
      if constexpr (kHasVariants) {
        dropout_v = make_dropout(params, b, h);
        dropout = &dropout_v;
      }
      if constexpr (Kt::kLayout == BwdLayout::kRegisters) {
        scores_and_dkdv_in_registers<Kt, kIsCausal, kHasVariants>(
            acc_dv, acc_dk, smem, tile, params.scale_log2, key0, seqlen_k, causal_offset, th,
            &variants, dropout);
        __syncthreads();  // dS^T complete before the dQ product reads all of it
      } else {
        if constexpr (Kt::kTiledSdP) {
          scores_tiled<Kt, kIsCausal, kHasVariants>(smem, tile, params.scale_log2, key0,
                                                    seqlen_k, causal_offset, th, &variants,
                                                    dropout);
        } else {
          scores_split<Kt, kIsCausal, kHasVariants>(smem, tile, params.scale_log2, key0,
                                                    seqlen_k, causal_offset, th, &variants,
                                                    dropout);
        }
        __syncthreads();  // P^T, dS^T complete (also for the dQ product below)
        accumulate_dkdv_from_smem<Kt>(acc_dv, acc_dk, smem, tile, th);
      }
      accumulate_dq<Kt, kDeterministic>(dq_bh, smem, query0, seqlen_q, head_dim, th);

      // Row stats of tile m+1 into the other stage: that stage was last read
      // before this iteration's first barrier.
      if (has_next) loader.store_row_stats(stage ^ 1, next_lse2, next_dsum);
    }

    // ---- epilogue ---------------------------------------------------------------
    cp_async_wait<0>();
    __syncthreads();  // all warps are done reading sK (dQ product) and sV
    store_dk_dv<Kt>(acc_dv, acc_dk, smem, params, dk_bh, dv_bh, key0, seqlen_k, head_dim, th);
  }
}

}  // namespace bwd
}  // namespace cuda
}  // namespace flash_attn_ext
