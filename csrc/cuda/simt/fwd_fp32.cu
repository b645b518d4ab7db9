// fp32 forward: a SIMT (FFMA) FlashAttention kernel with true fp32
// arithmetic (no tensor cores, no tf32). Same semantics as the 16-bit
// kernels: strided [B,S,H,D] inputs, causal offset, sequence-end masking,
// natural-log LSE, fully masked rows -> O = 0 and lse = -inf.
//
// Tiling: a CTA of 256 threads = 16 x 16 (ty, tx) computes kBlockM = 16*R
// query rows (R = 8 at D <= 64, else 4) against kBlockN = 64-key tiles.
// Thread (ty, tx) owns
//   S rows  ty + 16*i (i < R)  x  S cols  tx + 16*j (j < 4)    (R x 4 register tile)
//   O rows  ty + 16*i          x  O cols  4*tx + 64*c .. +3   (c < kHeadDim/64)
// Rows and columns are interleaved by 16 so that the 8 threads of one
// LDS.128 phase read 8 different rows (conflict-free with the +4 float row
// padding: an odd number of 16-byte chunks per row) or broadcast one row.
// The 16 threads that share an S row are 16 consecutive lanes, so row max /
// row sum are 4 xor-shuffles. P goes through shared memory because P V needs
// a whole P row per thread.
//
// Attention variants (window_size, softcap, alibi_slopes; csrc/mask.h): a
// third instantiation, kVariants = true (kIsCausal = false: causal is the
// Mask's right bound 0), so the causal / non-causal kernels compile exactly as
// before. It builds the (sequence, head) Mask once per CTA and
//   * loops over the key tiles [key_begin(first row), key_end(last row)) of
//     its query tile only (mask_key_tiles), so a window's work falls with its
//     width and a query tile no key reaches stores O = 0, lse = -inf;
//   * masks key j of row i unless key_begin(i) <= j < key_end(i), on the key
//     tiles that some row does not see whole (mask_tile_full);
//   * with softcap / ALiBi (a CTA-uniform branch), replaces scale * q.k by
//     mask.score(scale * q.k, i, j, .., TanhAccurate()) (fp32 accuracy) before
//     the log2-domain online softmax; lse is then the LSE of the modified
//     scores, as the backward expects;
//   * with dropout (csrc/dropout.h; a CTA-uniform branch), multiplies the
//     probabilities that P V reads by Z = keep ? scale : 0 (row sums and lse
//     stay those of the undropped probabilities).
// Rows without a visible key keep row_sum 0 and are stored as O = 0, lse = -inf.
//
// KV cache addressing (block table, cache_batch_idx, left padding; params.h):
// the variants instantiation once more with kKVCache = true, whose K/V tiles
// look every row up through kv_row (load_cache_tile_fp32); the Mask covers
// causal, so no other instantiation needs it.
#include <cmath>
#include <stdexcept>
#include <string>

#include "../../params.h"
#include "../../dropout.h"
#include "../common/fwd_softmax.cuh"
#include "../common/ptx.cuh"
#include "fwd_fp32.h"
#include "mask_fp32.cuh"

namespace flash_attn_ext {
namespace cuda {
namespace {

constexpr int kFp32BlockN = 64;
constexpr int kFp32Threads = 256;

#ifndef FAE_FP32_ROWS_D64  // tuning builds: -DFAE_FP32_ROWS_D64=4
#define FAE_FP32_ROWS_D64 8
#endif

template <int kHeadDim>
struct Fp32Tile {
  static_assert(kHeadDim % 64 == 0, "each of 16 threads owns 4-column groups 64 apart");
  // Query rows per thread (kBlockM = 16 * kRowsPerThread). At D=64, 8 rows
  // (128-row tiles) make every K/V value read from shared memory feed twice
  // the FFMAs of 4 rows, and the register cost (S and O: 64 floats) still
  // allows two CTAs per SM; at D >= 128 O alone would be 64+ floats per 4 rows.
  static constexpr int kRowsPerThread = kHeadDim <= 64 ? FAE_FP32_ROWS_D64 : 4;
  static constexpr int kBlockM = 16 * kRowsPerThread;
  static constexpr int kRowStride = kHeadDim + 4;      // floats; odd number of 16-byte chunks
  static constexpr int kPStride = kFp32BlockN + 4;     // floats
  static constexpr int kColGroups = kHeadDim / 64;     // float4 O column groups per thread
  static constexpr int kSmemFloats =
      (kBlockM + 2 * kFp32BlockN) * kRowStride + kBlockM * kPStride;
  static constexpr int kSmemBytes = kSmemFloats * 4;
  static_assert(kSmemBytes <= 227 * 1024, "fp32 tiles exceed shared memory");
};

// [kRows x kHeadDim] fp32 tile, zero-filled past valid_rows / head_dim.
template <int kHeadDim, int kRows>
__device__ __forceinline__ void load_tile_fp32(float* smem, const float* gmem, int64_t row_stride,
                                               int valid_rows, int head_dim, int tid) {
  constexpr int kChunks = kHeadDim / 4;
  constexpr int kTotal = kRows * kChunks;
  static_assert(kTotal % kFp32Threads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kTotal / kFp32Threads; ++i) {
    const int idx = tid + i * kFp32Threads;
    const int row = idx / kChunks;
    const int chunk = idx % kChunks;
    const bool valid = row < valid_rows && chunk * 4 < head_dim;
    cp_async_16(smem + row * Fp32Tile<kHeadDim>::kRowStride + chunk * 4,
                valid ? gmem + row * row_stride + chunk * 4 : gmem, valid);
  }
}

// load_tile_fp32 of K/V rows [row0, row0 + kRows) of (batch, kv head `head`)
// through the KV cache addressing (kv_row_offset, params.h): each copy's row
// is its own look-up (the block table stays in L1; fp32 is not the fast path).
template <int kHeadDim, int kRows>
__device__ __forceinline__ void load_cache_tile_fp32(float* smem, const float* base,
                                                     const TensorStrides& st,
                                                     const AttentionFwdParams& params, int batch,
                                                     int head, int64_t row0, int valid_rows,
                                                     int head_dim, int tid) {
  constexpr int kChunks = kHeadDim / 4;
  constexpr int kTotal = kRows * kChunks;
  static_assert(kTotal % kFp32Threads == 0, "tile must split evenly over the threads");
  static_assert(kFp32Threads % kChunks == 0, "a thread keeps one column chunk");
  constexpr int kRowsPerIter = kFp32Threads / kChunks;
  const int chunk = tid % kChunks;
  const bool col_valid = chunk * 4 < head_dim;
  // Not unrolled: unrolled, the look-ups of every row stayed live at once and
  // spilled (D=64 under the 128-register bound of two CTAs per SM).
#pragma unroll 1
  for (int row = tid / kChunks; row < kRows; row += kRowsPerIter) {
    const bool valid = col_valid && row < valid_rows;
    cp_async_16(smem + row * Fp32Tile<kHeadDim>::kRowStride + chunk * 4,
                valid ? base + kv_row_offset(params, st, batch, head, row0 + row) + chunk * 4
                      : base,
                valid);
  }
}

FAE_DEVICE float row_group_max(float x) {  // over the 16 lanes sharing a row
#pragma unroll
  for (int off = 1; off < 16; off *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, off));
  return x;
}
FAE_DEVICE float row_group_sum(float x) {
#pragma unroll
  for (int off = 1; off < 16; off *= 2) x += __shfl_xor_sync(0xffffffff, x, off);
  return x;
}

// ---- main-loop stages (one key tile); the kernel below keeps the barriers --
// S = Q K_n^T over the real head dim (padded columns are zero), for the
// thread's rows ty + 16*i and keys tx + 16*j.
template <int kHeadDim>
FAE_DEVICE void qk_tile(float (&s)[Fp32Tile<kHeadDim>::kRowsPerThread][4], const float* smem_q,
                        const float* smem_k, int tx, int ty) {
  constexpr int kRows = Fp32Tile<kHeadDim>::kRowsPerThread;
  constexpr int kStride = Fp32Tile<kHeadDim>::kRowStride;
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
  // Compile-time trip count (padded columns are zero). Unrolled by 4 with 4
  // rows per thread; with 8 rows not at all: the 128-register cap (two CTAs
  // per SM) spills otherwise, as does a full unroll at 4 rows.
#pragma unroll(kRows >= 8 ? 1 : 4)
  for (int d = 0; d < kHeadDim; d += 4) {
    float4 qv[kRows], kv[4];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      qv[i] = *reinterpret_cast<const float4*>(smem_q + (ty + 16 * i) * kStride + d);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      kv[j] = *reinterpret_cast<const float4*>(smem_k + (tx + 16 * j) * kStride + d);
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = fmaf(qv[i].x, kv[j].x, s[i][j]);
        s[i][j] = fmaf(qv[i].y, kv[j].y, s[i][j]);
        s[i][j] = fmaf(qv[i].z, kv[j].z, s[i][j]);
        s[i][j] = fmaf(qv[i].w, kv[j].w, s[i][j]);
      }
  }
}

// Dropout keep bits of the thread's elements of key tile n_block (rows
// row_base + 16i, keys n_block * kBlockN + tx + 16j): bit 4i + j. The threads
// tx % 8 = k of both row groups (ty) of a warp (lanes k + 8q, q < 4) hold, for
// rows row_base + 32i' (+ 16) and each key column 16j + k (+ 8), 8 elements of
// one Philox call group (csrc/dropout.h: keys k + {0, 8}, queries of one
// (i / 2) % 4 in a 32-row block; kBlockM % 32 == 0 keeps row_base + 32i' and
// + 16 in one block): lane k + 8q makes the call of key column j = q and the
// four lanes swap. All threads of the warp must call this.
template <int kRows>
FAE_DEVICE uint32_t fp32_dropout_bits(const Dropout& d, int n_block, int row_base, int tx) {
  static_assert(kRows % 2 == 0 && 4 * kRows <= 32, "row pairs, 4 bits per row");
  const int lane = threadIdx.x % 32;
  const int key0 = n_block * kFp32BlockN;
  // The byte of (row row_base + 32i', key tx + 16j) in its group; row + 16: + 4.
  const int byte = dropout_byte(row_base, key0 + tx);
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < kRows / 2; ++k) {
    const uint32_t mine = d.call_keep_bits(row_base + 32 * k, key0 + (tx & 7) + 16 * (lane >> 3));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t call = __shfl_sync(0xffffffffu, mine, (lane & 7) + 8 * j);
#pragma unroll
      for (int r = 0; r < 2; ++r) bits |= ((call >> (byte + 4 * r)) & 1u) << (4 * (2 * k + r) + j);
    }
  }
  return bits;
}

// Scale, mask, online softmax of key tile n_block: P -> smem_p, O and the
// row sums rescaled to the new row max (log2 domain, as OnlineSoftmax).
// Dropout (kVariants): smem_p gets P o Z, Z = keep ? scale : 0; the row sums
// are of the undropped P.
template <int kHeadDim, bool kIsCausal, bool kVariants>
FAE_DEVICE void softmax_tile(float (&s)[Fp32Tile<kHeadDim>::kRowsPerThread][4],
                             float (&row_max)[Fp32Tile<kHeadDim>::kRowsPerThread],
                             float (&row_sum)[Fp32Tile<kHeadDim>::kRowsPerThread],
                             float (&acc_o)[Fp32Tile<kHeadDim>::kRowsPerThread]
                                           [Fp32Tile<kHeadDim>::kColGroups][4],
                             float* smem_p, float scale_log2, bool needs_mask, int n_block,
                             int row_base, const SeqBounds& seq, int tx, int ty,
                             const Mask& mask, float softmax_scale, const Dropout& dropout) {
  using Tile = Fp32Tile<kHeadDim>;
  constexpr float kLog2e = 1.4426950408889634f;
  uint32_t keep = 0;
  if constexpr (kVariants) {
    if (dropout.active()) {  // uniform
      keep = fp32_dropout_bits<Tile::kRowsPerThread>(dropout, n_block, row_base, tx);
    }
  }
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {
    float tile_max = row_max[i];
    if constexpr (kVariants) {
      const int row = row_base + 16 * i;
      const int key_begin = mask.key_begin(row), key_end = mask.key_end(row);  // <= seqlen_k
      const bool score_mod = mask.has_score_mod();  // CTA-uniform
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = n_block * kFp32BlockN + tx + 16 * j;
        if (score_mod) {
          float dfds;
          s[i][j] = mask.score(s[i][j] * softmax_scale, row, key, &dfds, TanhAccurate()) * kLog2e;
        } else {
          s[i][j] *= scale_log2;
        }
        if (needs_mask && (key < key_begin || key >= key_end)) s[i][j] = -INFINITY;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
    } else {
      int key_limit = seq.seqlen_k;
      if (kIsCausal) key_limit = min(key_limit, row_base + 16 * i + seq.causal_offset + 1);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] *= scale_log2;  // before masking: -inf * (scale <= 0) would be NaN
        if (needs_mask && n_block * kFp32BlockN + tx + 16 * j >= key_limit) s[i][j] = -INFINITY;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
    }
    const float new_max = row_group_max(tile_max);
    const float base = new_max == -INFINITY ? 0.f : new_max;  // see OnlineSoftmax
    const float rescale = fast_exp2(row_max[i] - base);
    row_max[i] = new_max;
    float tile_sum = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float p = fast_exp2(s[i][j] - base);
      tile_sum += p;
      if constexpr (kVariants) {
        if (dropout.active()) p = ((keep >> (4 * i + j)) & 1u) ? p * dropout.scale : 0.f;
      }
      smem_p[(ty + 16 * i) * Tile::kPStride + tx + 16 * j] = p;
    }
    row_sum[i] = row_sum[i] * rescale + tile_sum;
#pragma unroll
    for (int c = 0; c < Tile::kColGroups; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[i][c][e] *= rescale;
  }
}

// O += P V_n: the thread's rows ty + 16*i, columns 4*tx + 64*c .. +3.
template <int kHeadDim>
FAE_DEVICE void pv_tile(float (&acc_o)[Fp32Tile<kHeadDim>::kRowsPerThread]
                                      [Fp32Tile<kHeadDim>::kColGroups][4],
                        const float* smem_p, const float* smem_v, int tx, int ty) {
  using Tile = Fp32Tile<kHeadDim>;
  constexpr int kRows = Tile::kRowsPerThread;
#pragma unroll 4
  for (int j = 0; j < kFp32BlockN; j += 4) {
    float4 pv[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      pv[i] = *reinterpret_cast<const float4*>(smem_p + (ty + 16 * i) * Tile::kPStride + j);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int c = 0; c < Tile::kColGroups; ++c) {
        const float4 v = *reinterpret_cast<const float4*>(smem_v + (j + jj) * Tile::kRowStride +
                                                          4 * tx + 64 * c);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          const float p = jj == 0 ? pv[i].x : jj == 1 ? pv[i].y : jj == 2 ? pv[i].z : pv[i].w;
          acc_o[i][c][0] = fmaf(p, v.x, acc_o[i][c][0]);
          acc_o[i][c][1] = fmaf(p, v.y, acc_o[i][c][1]);
          acc_o[i][c][2] = fmaf(p, v.z, acc_o[i][c][2]);
          acc_o[i][c][3] = fmaf(p, v.w, acc_o[i][c][3]);
        }
      }
    }
  }
}

// ---- epilogue: normalise, store O (16-byte stores) and LSE -----------------
template <int kHeadDim>
FAE_DEVICE void store_output(const AttentionFwdParams& params,
                             const float (&acc_o)[Fp32Tile<kHeadDim>::kRowsPerThread]
                                                 [Fp32Tile<kHeadDim>::kColGroups][4],
                             const float (&row_max)[Fp32Tile<kHeadDim>::kRowsPerThread],
                             const float (&row_sum)[Fp32Tile<kHeadDim>::kRowsPerThread],
                             const SeqBounds& seq, int batch, int head, int row_base, int tx) {
  using Tile = Fp32Tile<kHeadDim>;
  constexpr float kLn2 = 0.69314718055994531f;
  float* out_head = static_cast<float*>(params.out) + batch * params.out_strides.batch +
                    head * params.out_strides.head + seq.row0_q * params.out_strides.row;
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {
    float sum = row_group_sum(row_sum[i]);
    float max = row_max[i];
    const float sink_log2 = sink_log2_of(params, head);
    const float o_factor = sink_log2 == -INFINITY ? 1.f : fold_sink_into_row(sink_log2, max, sum);
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : o_factor / sum;
    const int row = row_base + 16 * i;
    if (row >= seq.seqlen_q) continue;
#pragma unroll
    for (int c = 0; c < Tile::kColGroups; ++c) {
      const int col = 4 * tx + 64 * c;
      if (col < params.head_dim) {
        *reinterpret_cast<float4*>(out_head + row * params.out_strides.row + col) =
            make_float4(acc_o[i][c][0] * inv, acc_o[i][c][1] * inv, acc_o[i][c][2] * inv,
                        acc_o[i][c][3] * inv);
      }
    }
    if (tx == 0) {
      params.lse[seq.lse_index(params, batch, head, row)] =
          empty ? -INFINITY : max * kLn2 + logf(sum);
    }
  }
}

// Two CTAs per SM at D <= 64 (<= 128 registers per thread): 16 warps hide the
// shared-memory latency of the FFMA loops; without the bound ptxas spends ~156
// registers on unrolled loads and only one CTA fits.
template <int kHeadDim, bool kIsCausal, bool kVariants, bool kKVCache>
__global__ void __launch_bounds__(kFp32Threads, kHeadDim <= 64 ? 2 : 1)
    flash_fwd_fp32_kernel(const __grid_constant__ AttentionFwdParams params) {
  static_assert(!kKVCache || kVariants, "KV cache calls run the variants kernel (its Mask)");
  using Tile = Fp32Tile<kHeadDim>;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kRows = Tile::kRowsPerThread;
  constexpr int kBlockN = kFp32BlockN;
  constexpr int kStride = Tile::kRowStride;

  extern __shared__ float4 smem_f4[];
  float* smem_q = reinterpret_cast<float*>(smem_f4);
  float* smem_k = smem_q + kBlockM * kStride;
  float* smem_v = smem_k + kBlockN * kStride;
  float* smem_p = smem_v + kBlockN * kStride;

  const int tid = threadIdx.x;
  const int tx = tid % 16;
  const int ty = tid / 16;

  // ---- which tile ----------------------------------------------------------
  const int num_m_blocks = ceil_div_dev(params.seqlen_q, kBlockM);
  const int bh = blockIdx.x / num_m_blocks;
  int m_block = blockIdx.x % num_m_blocks;
  if (kIsCausal || (kVariants && params.causal)) m_block = num_m_blocks - 1 - m_block;  // long rows first
  const int batch = bh / params.heads;
  const int head = bh % params.heads;
  const int head_k = head / (params.heads / params.heads_k);
  const SeqBounds seq = seq_bounds<true, kKVCache>(params, batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // varlen: past this sequence (CTA-uniform)
  KeyTileRange range;
  Mask mask;
  Dropout dropout;
  if constexpr (kVariants) {
    mask = make_mask(params, seq, batch, head);
    dropout = make_dropout(params, batch, head);
    mask_key_tiles<kBlockN>(mask, m_block * kBlockM, min(kBlockM, seq.seqlen_q - m_block * kBlockM),
                            range.begin, range.end);
  } else {
    range = key_tile_range<kBlockM, kBlockN, kIsCausal>(seq, m_block, 0, 1);
  }

  const float* q_tile = static_cast<const float*>(params.q) + batch * params.q_strides.batch +
                        head * params.q_strides.head +
                        (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.q_strides.row;
  const float* k_head = static_cast<const float*>(params.k) + batch * params.k_strides.batch +
                        head_k * params.k_strides.head + seq.row0_k * params.k_strides.row;
  const float* v_head = static_cast<const float*>(params.v) + batch * params.v_strides.batch +
                        head_k * params.v_strides.head + seq.row0_k * params.v_strides.row;

  float acc_o[kRows][Tile::kColGroups][4];
  float row_max[kRows], row_sum[kRows];  // log2 domain; row_sum is this thread's share
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
#pragma unroll
    for (int c = 0; c < Tile::kColGroups; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[i][c][e] = 0.f;
  }

  // ---- prologue: Q, K_0, V_0 -----------------------------------------------
  // K and V have one buffer each but separate commit groups, so each load
  // overlaps the other half of the tile's work: K_{n+1} streams in during
  // softmax and P V of tile n, V_{n+1} during Q K_{n+1}^T. (A second buffer
  // per tile would cost 35 KB at D=64 and drop the CTAs per SM from 2 to 1.)
  // Commit groups, oldest first: Q+K_0 | V_0 | K_1 | V_1 | ...
  auto load_key_tile = [&](float* smem, const float* head, int64_t row_stride, int n_block,
                           const void* tensor, const TensorStrides& strides) {
    const int64_t key0 = static_cast<int64_t>(n_block) * kBlockN;
    if constexpr (kKVCache) {  // `head` unused: rows through kv_row
      load_cache_tile_fp32<kHeadDim, kBlockN>(smem, static_cast<const float*>(tensor), strides,
                                              params, batch, head_k, seq.row0_k + key0,
                                              seq.seqlen_k - n_block * kBlockN, params.head_dim,
                                              tid);
    } else {
      load_tile_fp32<kHeadDim, kBlockN>(smem, head + key0 * row_stride, row_stride,
                                        seq.seqlen_k - n_block * kBlockN, params.head_dim, tid);
    }
    cp_async_commit();
  };
  auto load_k = [&](int n_block) {
    load_key_tile(smem_k, k_head, params.k_strides.row, n_block, params.k, params.k_strides);
  };
  auto load_v = [&](int n_block) {
    load_key_tile(smem_v, v_head, params.v_strides.row, n_block, params.v, params.v_strides);
  };
  if (range.end > range.begin) {
    load_tile_fp32<kHeadDim, kBlockM>(smem_q, q_tile, params.q_strides.row,
                                      seq.seqlen_q - m_block * kBlockM, params.head_dim, tid);
    load_k(range.begin);
    load_v(range.begin);
  }

  // ---- main loop over key tiles --------------------------------------------
  const int row_base = m_block * kBlockM + ty;
  for (int n_block = range.begin; n_block < range.end; ++n_block) {
    const bool has_next = n_block + 1 < range.end;
    cp_async_wait<1>();  // Q and K_n landed (V_n may still be in flight)
    __syncthreads();
    float s[kRows][4];
    qk_tile<kHeadDim>(s, smem_q, smem_k, tx, ty);

    __syncthreads();  // every thread is done with K_n (and with P of tile n-1)
    if (has_next) {
      load_k(n_block + 1);
    } else {
      cp_async_commit();  // empty group: keeps the wait counts uniform
    }
    bool needs_mask;
    if constexpr (kVariants) {
      needs_mask = !mask_tile_full(mask, m_block * kBlockM,
                                   min(kBlockM, seq.seqlen_q - m_block * kBlockM),
                                   n_block * kBlockN, kBlockN);
    } else {
      needs_mask = key_tile_needs_mask<kBlockM, kBlockN, kIsCausal>(seq, m_block, n_block);
    }
    softmax_tile<kHeadDim, kIsCausal, kVariants>(s, row_max, row_sum, acc_o, smem_p,
                                                 params.scale_log2, needs_mask, n_block, row_base,
                                                 seq, tx, ty, mask, params.softmax_scale,
                                                 dropout);

    cp_async_wait<1>();  // V_n landed (K_{n+1} may still be in flight)
    __syncthreads();     // ... for every thread's chunks, and P is complete
    pv_tile<kHeadDim>(acc_o, smem_p, smem_v, tx, ty);

    __syncthreads();  // every thread is done with V_n
    if (has_next) {
      load_v(n_block + 1);
    } else {
      cp_async_commit();
    }
  }
  cp_async_wait<0>();

  store_output<kHeadDim>(params, acc_o, row_max, row_sum, seq, batch, head, row_base, tx);
}

template <int kHeadDim, bool kIsCausal, bool kVariants = false, bool kKVCache = false>
void launch_fp32(const AttentionFwdParams& params, cudaStream_t stream) {
  auto kernel = flash_fwd_fp32_kernel<kHeadDim, kIsCausal, kVariants, kKVCache>;
  constexpr int kSmem = Fp32Tile<kHeadDim>::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: cudaFuncSetAttribute(fp32 forward): ") +
                             cudaGetErrorString(err));
  }
  constexpr int kBlockM = Fp32Tile<kHeadDim>::kBlockM;
  const int64_t m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t grid = m_blocks * params.batch * params.heads;
  if (grid > 0x7fffffff) throw std::runtime_error("flash_attn_ext: fp32 forward grid too large");
  kernel<<<static_cast<unsigned>(grid), kFp32Threads, kSmem, stream>>>(params);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: fp32 forward launch: ") +
                             cudaGetErrorString(err));
  }
}

template <int kHeadDim>
void launch_fp32_causal(const AttentionFwdParams& params, cudaStream_t stream) {
  if (has_kv_cache_addressing(params)) {  // the variants kernel reading through kv_row
    launch_fp32<kHeadDim, false, true, true>(params, stream);
  } else if (has_variants(params)) {  // window / softcap / ALiBi: causal is part of the Mask
    launch_fp32<kHeadDim, false, true>(params, stream);
  } else if (params.causal) {
    launch_fp32<kHeadDim, true>(params, stream);
  } else {
    launch_fp32<kHeadDim, false>(params, stream);
  }
}

}  // namespace

void run_fwd_fp32(const AttentionFwdParams& params, cudaStream_t stream) {
  // Three tile widths cover every head dim (multiple of 8, <= 256); padded
  // columns are zero-filled on load and never stored.
  if (params.head_dim <= 64) {
    launch_fp32_causal<64>(params, stream);
  } else if (params.head_dim <= 128) {
    launch_fp32_causal<128>(params, stream);
  } else if (params.head_dim <= 256) {
    launch_fp32_causal<256>(params, stream);
  } else {
    throw std::runtime_error("flash_attn_ext: fp32 forward supports head_dim <= 256, got " +
                             std::to_string(params.head_dim));
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
