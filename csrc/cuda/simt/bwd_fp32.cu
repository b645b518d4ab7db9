// fp32 backward: plain FFMA kernels with true fp32 accuracy (no tensor cores,
// so no tf32 rounding). Same decomposition as the 16-bit kernel, smaller:
// one block of 8 warps per 32-key tile, looping over 32-query tiles.
//
//   S, dP  : lane = query row i, warp w = keys 4w..4w+3  (float4 along d)
//   dV, dK : lane = key j,       warp w = columns {32c + 4w .. +3}
//   dQ     : lane = query row i, warp w = columns {32c + 4w .. +3}
//
// Shared-memory tiles use a row pitch of kD + 4 floats: a warp reading
// float4s from 32 different rows (same column) hits each bank once per
// 8-lane phase; reads of one row by the whole warp are broadcasts. P and dS
// use a pitch of 33 floats so both row- and column-wise accesses are
// conflict-free.
//
// Attention variants (window_size, softcap, alibi_slopes; csrc/mask.h): a
// third instantiation, kVariants = true (kIsCausal = false: causal is the
// Mask's right bound 0), so the causal / non-causal kernels compile exactly as
// before. Per (sequence, head) it builds the Mask, and per key tile
//   * loops over the query tiles [query_begin(first key), query_end(last key))
//     only (mask_query_tiles); keys no query sees keep dK = dV = 0;
//   * key j of query i is visible iff key_begin(i) <= j < key_end(i);
//   * with softcap / ALiBi (a CTA-uniform branch) the score is
//     f = mask.score(scale * q.k, i, j, &dfds, TanhAccurate()) (Mask::score at fp32
//     accuracy), P = exp(f - lse) with the forward's lse of the modified
//     scores, and dS = P o (dP - D) o dfds (dfds = 1 - tanh^2 with softcap,
//     else 1): the gradient with respect to scale * q.k, so dK and dQ take the
//     softmax scale as before (store_dk_dv, bwd_convert_dq);
//   * dropout (csrc/dropout.h, Z = keep ? scale : 0): dV from P o Z and
//     dS = P o (dP o Z - D) (o dfds), with the forward's undropped lse and D
//     computed from the dropped output as usual.
// Rows without a visible key have lse = -inf: P = 0, so zero gradients.
#include <cmath>
#include <stdexcept>
#include <string>

#include "../../dropout.h"
#include "../common/bwd_preprocess.cuh"
#include "bwd_fp32.h"
#include "mask_fp32.cuh"

namespace flash_attn_ext {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

template <int kD>
struct Fp32Smem {
  static constexpr int kPitch = kD + 4;
  static constexpr int kPPitch = kBwdFp32BlockN + 1;
  static constexpr int kOffQ = 0;
  static constexpr int kOffdO = kOffQ + kBwdFp32BlockM * kPitch;
  static constexpr int kOffK = kOffdO + kBwdFp32BlockM * kPitch;
  static constexpr int kOffV = kOffK + kBwdFp32BlockN * kPitch;
  static constexpr int kOffP = kOffV + kBwdFp32BlockN * kPitch;
  static constexpr int kOffdS = kOffP + kBwdFp32BlockM * kPPitch;
  static constexpr int kOffLse = kOffdS + kBwdFp32BlockM * kPPitch;
  static constexpr int kOffDsum = kOffLse + kBwdFp32BlockM;
  static constexpr int kFloats = kOffDsum + kBwdFp32BlockM;
  static constexpr int kBytes = kFloats * 4;
  static_assert(kD % 32 == 0, "columns are dealt out as 32c + 4*warp");
  static_assert(kOffdO % 4 == 0 && kOffK % 4 == 0 && kOffV % 4 == 0, "float4 tiles");
};

// [32][kD] fp32 tile -> smem (pitch kD + 4); rows >= rows_valid and columns
// >= head_dim are zero.
template <int kD>
__device__ __forceinline__ void load_tile(float* s, const float* g, int64_t row_stride,
                                          int rows_valid, int head_dim) {
  constexpr int kVecPerRow = kD / 4;
  for (int idx = threadIdx.x; idx < 32 * kVecPerRow; idx += kThreads) {
    const int row = idx / kVecPerRow, col = (idx % kVecPerRow) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < rows_valid && col < head_dim)
      v = *reinterpret_cast<const float4*>(g + row * row_stride + col);
    *reinterpret_cast<float4*>(s + row * Fp32Smem<kD>::kPitch + col) = v;
  }
}

__device__ __forceinline__ void add4(float4& acc, const float4& x) {
  acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
}
__device__ __forceinline__ void fma4(float4& acc, float s, const float4& v) {
  acc.x = fmaf(s, v.x, acc.x);
  acc.y = fmaf(s, v.y, acc.y);
  acc.z = fmaf(s, v.z, acc.z);
  acc.w = fmaf(s, v.w, acc.w);
}
__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// ---- stages of one (key tile, query tile) step; the kernel keeps the barriers
// Q, dO and the row stats (lse in log2 units, D) of the query tile at query0.
template <int kD>
FAE_DEVICE void load_query_tile(float* sQ, float* sdO, float* sLse2, float* sDsum,
                                const AttentionBwdParams& params, const float* q_bh,
                                const float* do_bh, const float* lse_bh, const float* dsum_bh,
                                int query0, int seqlen_q) {
  constexpr int BM = kBwdFp32BlockM;
  load_tile<kD>(sQ, q_bh + query0 * params.q_strides.row, params.q_strides.row,
                min(BM, seqlen_q - query0), params.head_dim);
  load_tile<kD>(sdO, do_bh + query0 * params.dout_strides.row, params.dout_strides.row,
                min(BM, seqlen_q - query0), params.head_dim);
  if (threadIdx.x < BM) {
    const int row = query0 + threadIdx.x;
    float lse2 = INFINITY, dsum = 0.f;  // padded rows: P = exp2(-inf) = 0
    if (row < seqlen_q) {
      const float lse = lse_bh[row];
      lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;  // fully masked row: P = 0
      dsum = dsum_bh[row];
    }
    sLse2[threadIdx.x] = lse2;
    sDsum[threadIdx.x] = dsum;
  }
}

// S = Q K^T, dP = dO V^T for query `lane` and keys 4*warp + r; P and
// dS = P o (dP - D) -> shared memory. Dropout (kVariants, Z = keep ? scale : 0):
// P o Z -> sP (for dV) and dS = P o (dP o Z - D).
template <int kD, bool kIsCausal, bool kVariants>
FAE_DEVICE void scores_tile(float* sP, float* sdS, const float* sQ, const float* sdO,
                            const float* sK, const float* sV, const float* sLse2,
                            const float* sDsum, float scale_log2, int key0, int query0,
                            int seqlen_k, int causal_offset, int lane, int warp, const Mask& mask,
                            float softmax_scale, const Dropout* dropout) {
  constexpr int kPitch = Fp32Smem<kD>::kPitch, kPP = Fp32Smem<kD>::kPPitch;
  float s[4] = {0.f, 0.f, 0.f, 0.f}, dp[4] = {0.f, 0.f, 0.f, 0.f};
  const float* q_row = sQ + lane * kPitch;
  const float* do_row = sdO + lane * kPitch;
#pragma unroll 4
  for (int d = 0; d < kD; d += 4) {
    const float4 qv = *reinterpret_cast<const float4*>(q_row + d);
    const float4 dov = *reinterpret_cast<const float4*>(do_row + d);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = 4 * warp + r;
      s[r] = dot4(qv, *reinterpret_cast<const float4*>(sK + key * kPitch + d), s[r]);
      dp[r] = dot4(dov, *reinterpret_cast<const float4*>(sV + key * kPitch + d), dp[r]);
    }
  }
  const int query = query0 + lane;
  const float lse2 = sLse2[lane], dsum = sDsum[lane];
  if constexpr (kVariants) {
    const int key_begin = mask.key_begin(query), key_end = mask.key_end(query);  // <= seqlen_k
    const bool score_mod = mask.has_score_mod();  // CTA-uniform
    // Dropout: the element (query, key0 + 4 warp + r) is byte `byte` of the
    // Philox call group (keys 4 (warp % 2) + r + {0, 8}, queries with the same
    // (query / 2) % 4 in the 32-query block; csrc/dropout.h), whose 8 queries
    // here are lanes 2v + {0, 1} + 8t. Lane 8r + 2v makes that call (the
    // others a duplicate) and the lanes read theirs by shuffle: one call per
    // lane for its 4 keys. query0 % 32 == 0.
    static_assert(kBwdFp32BlockN == 32 && kBwdFp32BlockM == 32 && kThreads == 256,
                  "8 warps x 4 keys, 32 queries = one lane each");
    const bool dropout_on = dropout != nullptr && dropout->active();  // CTA-uniform
    uint32_t keep = 0;  // bit r: key key0 + 4 warp + r
    if (dropout_on) {
      const uint32_t mine =
          dropout->call_keep_bits(query0 + (lane & 6), key0 + 4 * warp + (lane >> 3));
      const int byte = dropout_byte(query, key0 + 4 * warp);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        keep |= ((__shfl_sync(0xffffffffu, mine, 8 * r + (lane & 6)) >> byte) & 1u) << r;
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = key0 + 4 * warp + r;
      float x = s[r] * scale_log2, dfds = 1.f;
      if (score_mod) x = mask.score(s[r] * softmax_scale, query, key, &dfds, TanhAccurate()) * kLog2e;
      const bool visible = key >= key_begin && key < key_end;
      const float p = visible ? exp2f(x - lse2) : 0.f;
      float pz = p, dpz = dp[r];
      if (dropout_on) {
        const float z = ((keep >> r) & 1u) ? dropout->scale : 0.f;
        pz = p * z;
        dpz = dp[r] * z;
      }
      sP[lane * kPP + 4 * warp + r] = pz;
      sdS[lane * kPP + 4 * warp + r] = p * (dpz - dsum) * dfds;
    }
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = key0 + 4 * warp + r;
      const bool visible = key < seqlen_k && (!kIsCausal || key <= query + causal_offset);
      const float p = visible ? exp2f(s[r] * scale_log2 - lse2) : 0.f;
      sP[lane * kPP + 4 * warp + r] = p;
      sdS[lane * kPP + 4 * warp + r] = p * (dp[r] - dsum);
    }
  }
}

// dV += P^T dO, dK += dS^T Q for key `lane`, columns 32c + 4*warp.
// Summed per query tile first, then added to the running total: a two-level
// sum keeps fp32 rounding error growing with seqlen_q / BM instead of
// seqlen_q (a long sequential sum loses ~sqrt(n) ulps).
template <int kD>
FAE_DEVICE void accumulate_dk_dv(float4 (&acc_dk)[kD / 32], float4 (&acc_dv)[kD / 32],
                                 const float* sP, const float* sdS, const float* sQ,
                                 const float* sdO, int lane, int warp) {
  constexpr int kPitch = Fp32Smem<kD>::kPitch, kPP = Fp32Smem<kD>::kPPitch;
#pragma unroll
  for (int c = 0; c < kD / 32; ++c) {
    const int col = 32 * c + 4 * warp;
    float4 tile_dv = make_float4(0.f, 0.f, 0.f, 0.f), tile_dk = tile_dv;
#pragma unroll 4
    for (int i = 0; i < kBwdFp32BlockM; ++i) {
      fma4(tile_dv, sP[i * kPP + lane], *reinterpret_cast<const float4*>(sdO + i * kPitch + col));
      fma4(tile_dk, sdS[i * kPP + lane], *reinterpret_cast<const float4*>(sQ + i * kPitch + col));
    }
    add4(acc_dv[c], tile_dv);
    add4(acc_dk[c], tile_dk);
  }
}

// dQ += dS K for query `lane`, columns 32c + 4*warp, into the fp32
// accumulator (atomics, or this block's own split when deterministic).
template <int kD, bool kDeterministic>
FAE_DEVICE void accumulate_dq(float* dq_bh, const float* sdS, const float* sK, int query0,
                              int seqlen_q, int head_dim, int lane, int warp) {
  constexpr int kCols = kD / 32;
  float4 acc_dq[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc_dq[c] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int j = 0; j < kBwdFp32BlockN; ++j) {
    const float ds = sdS[lane * Fp32Smem<kD>::kPPitch + j];
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      fma4(acc_dq[c], ds,
           *reinterpret_cast<const float4*>(sK + j * Fp32Smem<kD>::kPitch + 32 * c + 4 * warp));
  }
  const int row = query0 + lane;
  if (row < seqlen_q) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = 32 * c + 4 * warp;
      if (col >= head_dim) continue;
      float* dst = dq_bh + static_cast<int64_t>(row) * kD + col;
      if constexpr (kDeterministic) {
        // Sole writer of these words (one block per split, fixed map).
        float4 old = *reinterpret_cast<float4*>(dst);
        old.x += acc_dq[c].x, old.y += acc_dq[c].y, old.z += acc_dq[c].z, old.w += acc_dq[c].w;
        *reinterpret_cast<float4*>(dst) = old;
      } else {
        atomicAdd(dst + 0, acc_dq[c].x);
        atomicAdd(dst + 1, acc_dq[c].y);
        atomicAdd(dst + 2, acc_dq[c].z);
        atomicAdd(dst + 3, acc_dq[c].w);
      }
    }
  }
}

// Epilogue of a key tile: dK (scaled), dV straight from registers; keys no
// query can see get their zeros here too.
template <int kD>
FAE_DEVICE void store_dk_dv(const AttentionBwdParams& params, float* dk_bh, float* dv_bh,
                            const float4 (&acc_dk)[kD / 32], const float4 (&acc_dv)[kD / 32],
                            int key0, int seqlen_k, int lane, int warp) {
  const int key = key0 + lane;
  if (key < seqlen_k) {
    const float scale = params.softmax_scale;
#pragma unroll
    for (int c = 0; c < kD / 32; ++c) {
      const int col = 32 * c + 4 * warp;
      if (col >= params.head_dim) continue;
      const float4 dk = make_float4(acc_dk[c].x * scale, acc_dk[c].y * scale,
                                    acc_dk[c].z * scale, acc_dk[c].w * scale);
      *reinterpret_cast<float4*>(dk_bh + key * params.dk_strides.row + col) = dk;
      *reinterpret_cast<float4*>(dv_bh + key * params.dv_strides.row + col) = acc_dv[c];
    }
  }
}

template <int kD, bool kIsCausal, bool kDeterministic, bool kVariants>
__global__ void __launch_bounds__(kThreads) bwd_fp32_kernel(const AttentionBwdParams params) {
  using L = Fp32Smem<kD>;
  constexpr int BM = kBwdFp32BlockM, BN = kBwdFp32BlockN;
  constexpr int kCols = kD / 32;  // float4 column groups per thread
  extern __shared__ __align__(16) float smem_f[];
  float* sQ = smem_f + L::kOffQ;
  float* sdO = smem_f + L::kOffdO;
  float* sK = smem_f + L::kOffK;
  float* sV = smem_f + L::kOffV;
  float* sP = smem_f + L::kOffP;
  float* sdS = smem_f + L::kOffdS;
  float* sLse2 = smem_f + L::kOffLse;
  float* sDsum = smem_f + L::kOffDsum;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (params.heads / params.heads_k);  // GQA: see sm80/bwd_kernel.cuh
  const SeqBounds seq = seq_bounds(params, b);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = params.head_dim;
  const int num_m_blocks = (seqlen_q + BM - 1) / BM;
  const int num_n_blocks = (seqlen_k + BN - 1) / BN;
  auto head_rows = [&](const void* base, const TensorStrides& st, int head, int64_t row0) {
    return static_cast<const float*>(base) + row_offset(st, b, head, row0);
  };
  const float* q_bh = head_rows(params.q, params.q_strides, h, seq.row0_q);
  const float* k_bh = head_rows(params.k, params.k_strides, h_kv, seq.row0_k);
  const float* v_bh = head_rows(params.v, params.v_strides, h_kv, seq.row0_k);
  const float* do_bh = head_rows(params.dout, params.dout_strides, h, seq.row0_q);
  float* dk_bh = const_cast<float*>(head_rows(params.dk, params.dk_strides, h, seq.row0_k));
  float* dv_bh = const_cast<float*>(head_rows(params.dv, params.dv_strides, h, seq.row0_k));
  const int64_t stats_row0 = seq.lse_index(params, b, h, 0);
  const float* lse_bh = params.lse + stats_row0;
  const float* dsum_bh = params.dsoftmax_sum + stats_row0;
  const int split = kDeterministic ? blockIdx.x : 0;
  float* dq_bh = params.dq_accum + (split * params.q_rows_total + stats_row0) * kD;
  Mask mask;
  Dropout dropout_v;
  const Dropout* dropout = nullptr;
  if constexpr (kVariants) {
    mask = make_mask(params, seq, b, h);
    dropout_v = make_dropout(params, b, h);
    dropout = &dropout_v;
  }

  for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
    // ---- prologue: this key tile's K / V, the first query tile it meets ------
    const int key0 = n_block * BN;
    int m_begin = 0, m_end = num_m_blocks;
    if constexpr (kVariants) {
      mask_query_tiles<BM>(mask, key0, min(BN, seqlen_k - key0), m_begin, m_end);
    } else if (kIsCausal) {
      const int first_query = key0 - seq.causal_offset;
      m_begin = first_query <= 0 ? 0 : first_query / BM;
    }
    __syncthreads();  // previous n_block done with sK / sV
    load_tile<kD>(sK, k_bh + key0 * params.k_strides.row, params.k_strides.row,
                  min(BN, seqlen_k - key0), head_dim);
    load_tile<kD>(sV, v_bh + key0 * params.v_strides.row, params.v_strides.row,
                  min(BN, seqlen_k - key0), head_dim);

    float4 acc_dk[kCols], acc_dv[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      acc_dk[c] = acc_dv[c] = make_float4(0.f, 0.f, 0.f, 0.f);

    // ---- main loop over query tiles -----------------------------------------
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
      const int query0 = m_block * BM;
      __syncthreads();  // previous tile done with sQ / sdO / sP / sdS
      load_query_tile<kD>(sQ, sdO, sLse2, sDsum, params, q_bh, do_bh, lse_bh, dsum_bh, query0,
                          seqlen_q);
      __syncthreads();
      scores_tile<kD, kIsCausal, kVariants>(sP, sdS, sQ, sdO, sK, sV, sLse2, sDsum,
                                            params.scale_log2, key0, query0, seqlen_k,
                                            seq.causal_offset, lane, warp, mask,
                                            params.softmax_scale, dropout);
      __syncthreads();
      accumulate_dk_dv<kD>(acc_dk, acc_dv, sP, sdS, sQ, sdO, lane, warp);
      accumulate_dq<kD, kDeterministic>(dq_bh, sdS, sK, query0, seqlen_q, head_dim, lane, warp);
    }

    // ---- epilogue -------------------------------------------------------------
    store_dk_dv<kD>(params, dk_bh, dv_bh, acc_dk, acc_dv, key0, seqlen_k, lane, warp);
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("flash_attn_ext: fp32 backward ") + what + " failed: " +
                             cudaGetErrorString(err));
}

template <int kD, bool kIsCausal, bool kVariants = false>
void run_fp32(const AttentionBwdParams& params, cudaStream_t stream) {
  const int splits = params.deterministic ? params.num_splits : 1;
  if (splits < 1) throw std::runtime_error("flash_attn_ext: backward needs num_splits >= 1");
  launch_bwd_preprocess<float>(params, kD, splits, stream);
  const int num_n_blocks = (params.seqlen_k + kBwdFp32BlockN - 1) / kBwdFp32BlockN;
  const dim3 grid(params.deterministic ? splits : num_n_blocks, params.heads, params.batch);
  auto kernel = params.deterministic ? &bwd_fp32_kernel<kD, kIsCausal, true, kVariants>
                                     : &bwd_fp32_kernel<kD, kIsCausal, false, kVariants>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Fp32Smem<kD>::kBytes),
        "shared-memory opt-in");
  kernel<<<grid, kThreads, Fp32Smem<kD>::kBytes, stream>>>(params);
  launch_bwd_convert_dq<float>(params, kD, splits, stream);
}

template <int kD>
void run_fp32_causal_switch(const AttentionBwdParams& params, cudaStream_t stream) {
  if (has_variants(params)) {  // window / softcap / ALiBi: causal is part of the Mask
    run_fp32<kD, false, true>(params, stream);
  } else if (params.causal) {
    run_fp32<kD, true>(params, stream);
  } else {
    run_fp32<kD, false>(params, stream);
  }
}

}  // namespace

void run_bwd_fp32(const AttentionBwdParams& params, cudaStream_t stream) {
  switch (bwd_fp32_accum_dim(params.head_dim)) {
    case 32: return run_fp32_causal_switch<32>(params, stream);
    case 64: return run_fp32_causal_switch<64>(params, stream);
    case 128: return run_fp32_causal_switch<128>(params, stream);
    default: return run_fp32_causal_switch<256>(params, stream);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
