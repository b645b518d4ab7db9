// Hopper backward: dK, dV (and dQ partial sums) for one key tile per CTA, with
// TMA loads and wgmma; one producer warpgroup feeding two consumer warpgroups.
//
//   CTA = 3 warpgroups, grid = (key tiles, heads, batch)
//
//   warpgroup 0 (producer, 24 registers): one thread loads K_j, V_j once,
//       then Q_i, dO_i for every query tile i that sees key tile j into a
//       kStages ring (mbarriers qdo_full / qdo_empty).
//   warpgroups 1, 2 (consumers, 240 registers): keys [64w, 64w + 64) of the
//       tile each (one wgmma M). Per query tile i (64 rows):
//       S^T  = K_w Q_i^T                 wgmma SS (both K-major, as loaded)
//       dP^T = V_w dO_i^T                wgmma SS
//       P^T  = exp2(S^T * scale*log2e - lse*log2e), masked   (registers)
//       dS^T = P^T o (dP^T - D)                              (registers)
//       dV  += P^T dO_i                  wgmma RS (dO MN-major: read transposed)
//       dK  += dS^T Q_i                  wgmma RS (Q MN-major)
//       dS^T -> shared memory, then
//       dQ_i += dS K                     wgmma SS, both MN-major (dS^T and K
//                                        read transposed), fp32 atomics into
//                                        the dQ accumulator (bwd_preprocess.cuh
//                                        converts it at the end)
//   epilogue: dK * softmax_scale and dV from registers to global memory.
//
// The transposed formulation (S^T rather than S) puts the keys on wgmma's M
// side, so the accumulators of S^T / dP^T are already the A operands (P^T,
// dS^T) of the dV / dK products: no shared-memory round trip for them.
//
// dQ = dS K has 64 query rows x kHeadDim columns and sums over the 128 keys
// of both consumers. With two 64-column chunks (D = 128) each consumer takes
// one chunk over all 128 keys (dS^T of both consumers is shared through
// shared memory, one 256-thread barrier per step, dS double-buffered); with
// one chunk (D = 64) each consumer sums over its own 64 keys and both add
// into the same accumulator rows (no cross-warpgroup barrier).
//
// Shared memory (tiles in 64-column chunks of [rows x 128 B], TMA's 128-byte
// swizzle; every tile 1024-byte aligned):
//   | K [kChunks][128][64] | V | Q [kStages][kChunks][64][64] | dO [...] |
//   | dS^T [2][128 keys][64 queries] | mbarriers |
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "sm90_primitives.cuh"
#include "wgmma_ops.cuh"

namespace flash_attn_ext {
namespace cuda {

template <typename T_, int kHeadDim_>
struct BwdSm90Traits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 64 * kConsumerWarpgroups;  // keys: one wgmma M per consumer
  static constexpr int kBlockM = 64;                        // queries per step: wgmma N of S^T
  static constexpr int kStages = 2;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;

  static constexpr int kChunkCols = 64;
  static constexpr int kChunks = kHeadDim / kChunkCols;
  // dQ split between the consumers: by 64-column chunk when there are two.
  static constexpr bool kDqSplitCols = kChunks == kConsumerWarpgroups;
  static constexpr int kDqKeys = kDqSplitCols ? kBlockN : 64;  // keys summed per consumer

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // one Q (or dO) stage
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kBarrierBytes = 8 * (1 + 2 * kStages);
  // +1024: the dynamic shared memory base is only 16-byte aligned.
  static constexpr int kSmemBytes =
      2 * kKVBytes + 2 * kStages * kQBytes + 2 * kDsBytes + kBarrierBytes + 1024;

  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static_assert(sizeof(T) == 2, "16-bit inputs only");
  static_assert(kHeadDim == 64 || kHeadDim == 128,
                "D = 64 or 128: dK + dV accumulators (kHeadDim fp32 registers per thread) "
                "must leave room for S^T, dP^T within 240 registers");
  static_assert(kBlockM * 2 == 128, "one 64-query step is one 128-byte swizzle row of dS^T");
  static_assert(kDqSplitCols || kChunks == 1, "dQ split: one chunk per consumer, or one chunk");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one CTA per SM");
  static_assert(128 * kProducerRegs + 128 * kConsumerWarpgroups * kConsumerRegs <= 65536,
                "register file split between producer and consumers");
};

template <typename Traits, bool kIsCausal>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ CUtensorMap tmap_q,
                          const __grid_constant__ CUtensorMap tmap_k,
                          const __grid_constant__ CUtensorMap tmap_v,
                          const __grid_constant__ CUtensorMap tmap_do,
                          const __grid_constant__ AttentionBwdParams params) {
#if defined(FAE_SM90_ENABLED)
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kChunks = Traits::kChunks;
  using namespace sm90;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t k_smem = smem_base;
  const uint32_t v_smem = k_smem + Traits::kKVBytes;
  const uint32_t q_smem0 = v_smem + Traits::kKVBytes;
  const uint32_t do_smem0 = q_smem0 + kStages * Traits::kQBytes;
  const uint32_t ds_smem0 = do_smem0 + kStages * Traits::kQBytes;
  const uint32_t bar0 = ds_smem0 + 2 * Traits::kDsBytes;
  auto q_smem = [&](int stage) { return q_smem0 + stage * Traits::kQBytes; };
  auto do_smem = [&](int stage) { return do_smem0 + stage * Traits::kQBytes; };
  auto ds_smem = [&](int buf) { return ds_smem0 + buf * Traits::kDsBytes; };
  const uint32_t kv_full = bar0;
  auto qdo_full = [&](int stage) { return bar0 + 8 * (1 + stage); };
  auto qdo_empty = [&](int stage) { return bar0 + 8 * (1 + kStages + stage); };

  const int n_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int h_k = h / (params.heads / params.heads_k);
  const SeqBounds seq = seq_bounds<false>(params, b);
  const int n0 = n_block * kBlockN;
  // Query tiles that see a key of this tile: causal, query m sees key n iff
  // n <= m + offset, so the first is the one holding m = n0 - offset.
  const int m_begin = kIsCausal ? max(0, n0 - seq.causal_offset) / kBlockM : 0;
  const int m_end = (seq.seqlen_q + kBlockM - 1) / kBlockM;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(qdo_full(s), 1);
      mbar_init(qdo_empty(s), Traits::kConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x == 0 && m_begin < m_end) {
      prefetch_tensor_map(&tmap_q);
      prefetch_tensor_map(&tmap_k);
      prefetch_tensor_map(&tmap_v);
      prefetch_tensor_map(&tmap_do);
      mbar_arrive_expect_tx(kv_full, 2 * Traits::kKVBytes);
      tma_load_tile<kChunks>(&tmap_k, k_smem, kBlockN, kv_full, n0, h_k, b);
      tma_load_tile<kChunks>(&tmap_v, v_smem, kBlockN, kv_full, n0, h_k, b);
      for (int i = 0; m_begin + i < m_end; ++i) {
        const int stage = i % kStages;
        mbar_wait(qdo_empty(stage), ((i / kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(qdo_full(stage), 2 * Traits::kQBytes);
        const int m0 = (m_begin + i) * kBlockM;
        tma_load_tile<kChunks>(&tmap_q, q_smem(stage), kBlockM, qdo_full(stage), m0, h, b);
        tma_load_tile<kChunks>(&tmap_do, do_smem(stage), kBlockM, qdo_full(stage), m0, h, b);
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int wg = warpgroup - 1;  // which 64 keys of the tile
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const uint32_t k_rows = k_smem + wg * 64 * 128;  // this warpgroup's keys in chunk 0
  const uint32_t v_rows = v_smem + wg * 64 * 128;

  // Accumulator layout of m64nN (per warp 16 rows, as mma.sync m16n8):
  // acc[j][e], lane = 4g + q: e = 0,1 -> row g, cols 8j + 2q + {0,1};
  // e = 2,3 -> row g + 8. Rows are keys here, columns queries (or head dim).
  float dk[kHeadDim / 8][4], dv[kHeadDim / 8][4];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  }
  const int key_base = n0 + wg * 64 + warp * 16 + lane / 4;  // + 8 * (e / 2)

  // X^T = A_w B^T for K-major A (keys) and B (queries): kHeadDim / 16 k-steps,
  // 32 bytes apart inside a 64-column chunk.
  auto issue_transposed_scores = [&](float (&acc)[kBlockM / 8][4], uint32_t a_rows,
                                     uint32_t b_tile) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t chunk_offset = (kk % 4) * 32;
      const uint64_t desc_a =
          smem_desc_sw128(a_rows + (kk / 4) * kBlockN * 128 + chunk_offset, 16, 1024);
      const uint64_t desc_b =
          smem_desc_sw128(b_tile + (kk / 4) * kBlockM * 128 + chunk_offset, 16, 1024);
      WgmmaOps<T, kBlockM>::ss_kmajor(&acc[0][0], desc_a, desc_b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // acc += A^T B with A^T from registers (query k-steps of 16 rows = 2048 B of
  // the MN-major B tile; its head-dim chunks are kBlockM * 128 B apart).
  auto issue_grad_update = [&](float (&acc)[kHeadDim / 8][4], const uint32_t (&a)[kBlockM / 16][4],
                               uint32_t b_tile) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint64_t desc_b = smem_desc_sw128(b_tile + kk * 2048, kBlockM * 128, 1024);
      WgmmaOps<T, kHeadDim>::rs_mnmajor(&acc[0][0], a[kk], desc_b, 1);
    }
  };
  float* dq_accum_head = params.dq_accum + seq.lse_index(params, b, h, 0) * kHeadDim;
  const float* lse_head = params.lse + seq.lse_index(params, b, h, 0);
  const float* dsum_head = params.dsoftmax_sum + seq.lse_index(params, b, h, 0);
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kDsBarrier = 1;  // named barrier ids 1 (shared dS) or 1 + wg (own dS)

  if (m_begin < m_end) mbar_wait(kv_full, 0);
  for (int i = 0; m_begin + i < m_end; ++i) {
    const int m_block = m_begin + i;
    const int stage = i % kStages;
    mbar_wait(qdo_full(stage), (i / kStages) & 1);

    float s[kBlockM / 8][4], dp[kBlockM / 8][4];
    wgmma_fence();
    issue_transposed_scores(s, k_rows, q_smem(stage));
    issue_transposed_scores(dp, v_rows, do_smem(stage));

    // Per-query terms while the GEMMs run: lse (as log2; rows past seqlen_q
    // and fully masked rows, lse = -inf, get +inf so that P = 0) and D.
    const int query_base = m_block * kBlockM + 2 * (lane % 4);  // + 8j + e % 2
    float lse_log2[kBlockM / 8][2], dsum[kBlockM / 8][2];
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = query_base + 8 * j + e;
        const float lse = m < seq.seqlen_q ? lse_head[m] : -INFINITY;
        lse_log2[j][e] = lse == -INFINITY ? INFINITY : lse * kLog2e;
        dsum[j][e] = m < seq.seqlen_q ? dsum_head[m] : 0.f;
      }
    }

    wgmma_wait<1>();
    fence_registers(reinterpret_cast<float(&)[kBlockM / 2]>(s));
    // Causal: only tiles crossing the diagonal need the per-element test.
    const bool needs_mask = kIsCausal && n0 + kBlockN - 1 > m_block * kBlockM + seq.causal_offset;
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[j][e] * params.scale_log2 - lse_log2[j][e % 2]);
        if (needs_mask && key_base + 8 * (e / 2) > query_base + 8 * j + e % 2 + seq.causal_offset) {
          p = 0.f;
        }
        s[j][e] = p;
      }
    }
    wgmma_wait<0>();
    fence_registers(reinterpret_cast<float(&)[kBlockM / 2]>(dp));
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - dsum[j][e % 2]);
    }
    uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
    accumulators_to_a_fragments<T, kBlockM>(s, p_frag);
    accumulators_to_a_fragments<T, kBlockM>(dp, ds_frag);

    wgmma_fence();
    issue_grad_update(dv, p_frag, do_smem(stage));
    issue_grad_update(dk, ds_frag, q_smem(stage));
    wgmma_commit();

    // dS^T (keys x 64 queries, queries contiguous) into this step's buffer in
    // the swizzled layout: 16-byte unit u of row r sits at unit u ^ (r % 8).
    // A quad writes one unit per row, 8 rows of a warp hit 8 different units:
    // conflict-free. Fragment word (kk, w) holds row g + 8 (w % 2), unit 2kk + w / 2.
    const uint32_t ds_buf = ds_smem(i % 2);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int r = wg * 64 + warp * 16 + lane / 4 + 8 * (w % 2);
        const int unit = 2 * kk + w / 2;
        const uint32_t addr = ds_buf + r * 128 + ((unit ^ (r % 8)) * 16) + (lane % 4) * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(ds_frag[kk][w]) : "memory");
      }
    }
    fence_proxy_async_smem();
    if (Traits::kDqSplitCols) {
      named_barrier_sync(kDsBarrier, 256);
    } else {
      named_barrier_sync(kDsBarrier + wg, 128);
    }

    // dQ_i (64 queries x 64 columns) = dS K: A = dS^T read transposed (one
    // 64-query chunk, k-steps of 16 keys = 2048 B), B = K read transposed.
    float dq[8][4];
    const uint32_t dq_a = ds_buf + (Traits::kDqSplitCols ? 0 : wg * 64 * 128);
    const uint32_t dq_b = Traits::kDqSplitCols ? k_smem + wg * kBlockN * 128 : k_rows;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Traits::kDqKeys / 16; ++kk) {
      const uint64_t desc_a = smem_desc_sw128(dq_a + kk * 2048, kBlockM * 128, 1024);
      const uint64_t desc_b = smem_desc_sw128(dq_b + kk * 2048, kBlockN * 128, 1024);
      WgmmaOps<T, 64>::ss_mnmajor(&dq[0][0], desc_a, desc_b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(reinterpret_cast<float(&)[32]>(dq));
    fence_registers(reinterpret_cast<float(&)[kHeadDim / 2]>(dk));
    fence_registers(reinterpret_cast<float(&)[kHeadDim / 2]>(dv));
    fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(p_frag));
    fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(ds_frag));
    if (lane == 0) mbar_arrive(qdo_empty(stage));

    // dQ rows are queries here: row g (+8) of the warp's 16, columns 8j + 2q.
    const int dq_col0 = (Traits::kDqSplitCols ? wg * 64 : 0) + 2 * (lane % 4);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int m = m_block * kBlockM + warp * 16 + lane / 4 + 8 * hh;
      if (m < seq.seqlen_q) {
        float* row = dq_accum_head + static_cast<int64_t>(m) * kHeadDim + dq_col0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          atomicAdd(reinterpret_cast<float2*>(row + 8 * j),
                    make_float2(dq[j][2 * hh], dq[j][2 * hh + 1]));
        }
      }
    }
  }

  // ---------------- epilogue ----------------
  // dK = softmax_scale * sum dS^T Q; keys past seqlen_k and padded head-dim
  // columns are not written. Keys no query sees get zeros.
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = key_base + 8 * hh;
    if (key >= seq.seqlen_k) continue;
    T* dk_row = static_cast<T*>(params.dk) + row_offset(params.dk_strides, b, h, key);
    T* dv_row = static_cast<T*>(params.dv) + row_offset(params.dv_strides, b, h, key);
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      if (col < params.head_dim) {
        *reinterpret_cast<uint32_t*>(dk_row + col) =
            pack2<T>(dk[j][2 * hh] * params.softmax_scale, dk[j][2 * hh + 1] * params.softmax_scale);
        *reinterpret_cast<uint32_t*>(dv_row + col) = pack2<T>(dv[j][2 * hh], dv[j][2 * hh + 1]);
      }
    }
  }
#endif
}

}  // namespace cuda
}  // namespace flash_attn_ext
