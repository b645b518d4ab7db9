// FlashAttention-2 style forward kernel (sm_80+ mma.sync). The merging of
// key-warp and split-KV partials, and the combine kernel: fwd_merge.cuh.
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
//                (variants: P -> 16 bits; dropout clears dropped elements)
//                wait V_n;  O += P V_n             (P straight from registers)
//   epilogue   O /= row_sum, lse = m*ln2 + ln(row_sum);  (dropout: O *= scale)
//              O -> shared memory -> 16-byte global stores (or fp32 partials
//              to out_accum / lse_accum when split-KV is on)
#pragma once
#include <cmath>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"
#include "fwd_merge.cuh"
#include "../common/dropout_tile.cuh"
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

// ---------------------------------------------------------------------------
// K/V tiles through the KV cache addressing (kernels instantiated with
// kKVCache: block table, cache_batch_idx, left padding; params.h kv_row, the
// one definition of where a key row lives). The thread -> (row, chunk) map is
// load_tile_async's. Row-wise map: a thread looks its rows up once per
// 16-row group of the tile (kKVPageRowAlign; a group never straddles a page:
// tiles start at multiples of 16 keys, a paged sequence's rows at 0, and pages
// hold multiples of 16 keys) and steps by the row stride inside the group, so
// a tile costs a handful of block-table reads per thread, shared by K and V.
// The other map (head dims whose chunk count does not divide the threads)
// looks every copy up.
// ---------------------------------------------------------------------------
// kChunkElems: elements per 16-byte copy (8 of a 16-bit tile; 16 of an FP8 one).
template <typename Traits, int kChunkElems = 8>
struct CacheTileMap {
  static constexpr int kChunks = Traits::kHeadDim / kChunkElems;
  static constexpr int kThreads = Traits::kNThreads;
  static constexpr int kRows = Traits::kBlockN;
  static constexpr bool kRowWise =
      kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0;  // as load_tile_async
  static constexpr int kRowsPerIter = kRowWise ? kThreads / kChunks : 1;
  static constexpr int kItersPerGroup =
      kRowsPerIter >= kKVPageRowAlign ? 1 : kKVPageRowAlign / kRowsPerIter;
  // Look-ups per thread and tile (1 unused slot for the other map).
  static constexpr int kGroups = kRowWise ? kRows / kRowsPerIter / kItersPerGroup : 1;
  static_assert(kRows % kKVPageRowAlign == 0,
                "K/V tiles must start at multiples of kKVPageRowAlign keys (one page per group)");
  static_assert(!kRowWise || (kRowsPerIter >= kKVPageRowAlign
                                  ? kRowsPerIter % kKVPageRowAlign == 0
                                  : kKVPageRowAlign % kRowsPerIter == 0),
                "a thread's rows must fall into whole 16-row groups");
};

// The cache rows (kv_row) of the thread's first row in each 16-row group of the
// tile whose row 0 is sequence row `row0` (row-wise map); rows past valid_rows
// are not looked up (their block-table entries may not exist).
template <typename Traits, int kChunkElems = 8>
FAE_DEVICE void cache_tile_rows(KVRow (&rows)[CacheTileMap<Traits, kChunkElems>::kGroups],
                                const AttentionFwdParams& params, int batch, int64_t row0,
                                int valid_rows, int tid) {
  using Map = CacheTileMap<Traits, kChunkElems>;
  if constexpr (Map::kRowWise) {
#pragma unroll
    for (int g = 0; g < Map::kGroups; ++g) {
      const int row = tid / Map::kChunks + g * Map::kItersPerGroup * Map::kRowsPerIter;
      rows[g] = row < valid_rows ? kv_row(params, batch, row0 + row) : KVRow{0, 0};
    }
  }
}

// The 16-byte copies of a K or V tile through the KV cache addressing, with
// kChunkElems elements per copy: copy(row, chunk, offset, valid) for each of
// the thread's copies, offset = the element offset of the chunk in the K or V
// tensor (strides `st`; meaningful only where valid). `rows` from
// cache_tile_rows (row-wise map: a look-up per 16-row group, then the row
// stride), else a look-up per copy (batch, head, row0). kAllValid: every row
// and column in range (no tests). Rows past valid_rows and columns past
// head_dim are not valid (the copies zero-fill them).
template <typename Traits, int kChunkElems, bool kAllValid, typename Copy>
FAE_DEVICE void for_each_cache_copy(const TensorStrides& st,
                                    const KVRow (&rows)[CacheTileMap<Traits, kChunkElems>::kGroups],
                                    const AttentionFwdParams& params, int batch, int head,
                                    int64_t row0, int valid_rows, int head_dim, int tid,
                                    Copy&& copy) {
  using Map = CacheTileMap<Traits, kChunkElems>;
  if constexpr (Map::kRowWise) {
    const int chunk = tid % Map::kChunks;
    const int row_first = tid / Map::kChunks;
    const bool col_valid = kAllValid || chunk * kChunkElems < head_dim;
#pragma unroll
    for (int g = 0; g < Map::kGroups; ++g) {
      int64_t offset = kv_offset(st, rows[g], head) + chunk * kChunkElems;
#pragma unroll
      for (int j = 0; j < Map::kItersPerGroup; ++j) {
        const int row = row_first + (g * Map::kItersPerGroup + j) * Map::kRowsPerIter;
        copy(row, chunk, offset, kAllValid || (col_valid && row < valid_rows));
        offset += Map::kRowsPerIter * st.row;
      }
    }
  } else {
    constexpr int kTotal = Map::kRows * Map::kChunks;
    constexpr int kIters = (kTotal + Map::kThreads - 1) / Map::kThreads;
#pragma unroll(kIters <= 8 ? kIters : 4)
    for (int i = 0; i < kIters; ++i) {
      const int idx = tid + i * Map::kThreads;
      if (kTotal % Map::kThreads != 0 && idx >= kTotal) break;
      const int row = idx / Map::kChunks;
      const int chunk = idx % Map::kChunks;
      const bool valid = kAllValid || (row < valid_rows && chunk * kChunkElems < head_dim);
      copy(row, chunk,
           valid ? kv_row_offset(params, st, batch, head, row0 + row) + chunk * kChunkElems : 0,
           valid);
    }
  }
}

// load_tile_async of a K or V tile (tensor base `base`) through the KV cache
// addressing (for_each_cache_copy).
template <typename Traits, bool kFullL2Hint>
FAE_DEVICE void load_cache_tile_async(typename Traits::T* smem, const typename Traits::T* base,
                                      const TensorStrides& st,
                                      const KVRow (&rows)[CacheTileMap<Traits>::kGroups],
                                      const AttentionFwdParams& params, int batch, int head,
                                      int64_t row0, int valid_rows, int head_dim, int tid,
                                      uint64_t l2_policy) {
  using Layout = typename Traits::KVLayout;
  for_each_cache_copy<Traits, 8, kFullL2Hint>(
      st, rows, params, batch, head, row0, valid_rows, head_dim, tid,
      [&](int row, int chunk, int64_t offset, bool valid) {
        copy_16<kFullL2Hint>(smem + Layout::offset(row, chunk), valid ? base + offset : base,
                             valid, l2_policy);
      });
}

// ---------------------------------------------------------------------------
// FP8 (e4m3) K / V tiles (Traits::kKVFp8: an FP8 KV cache under a 16-bit q).
// A tile row of kHeadDim bytes is copied in 16-byte chunks (16 elements) with
// the cache map of 16-element chunks (CacheTileMap<Traits, 16>) into a staging
// tile (Traits::KVFp8Layout: 16-byte chunks swizzled or padded like a 16-bit
// tile's), by the same cp.async pipeline as the 16-bit tiles (without their L2
// evict_first hint, see load_cache_fp8); rows past valid_rows and columns past
// head_dim (a multiple of 16: ops_cuda.cpp pads) are zero-filled. The MMA code
// reads the staging tiles directly (gemm_qk_fp8, pv_step_fp8).
// ---------------------------------------------------------------------------
// Byte offset of 16-byte chunk `chunk` of row `row` of a staging tile.
template <typename Traits>
FAE_DEVICE int fp8_stage_offset(int row, int chunk) {
  return 2 * Traits::KVFp8Layout::offset(row, chunk);
}

template <typename Traits>
FAE_DEVICE void load_cache_tile_fp8_async(uint8_t* stage, const uint8_t* base,
                                          const TensorStrides& st,
                                          const KVRow (&rows)[CacheTileMap<Traits, 16>::kGroups],
                                          const AttentionFwdParams& params, int batch, int head,
                                          int64_t row0, int valid_rows, int head_dim, int tid) {
  for_each_cache_copy<Traits, 16, false>(
      st, rows, params, batch, head, row0, valid_rows, head_dim, tid,
      [&](int row, int chunk, int64_t offset, bool valid) {
        cp_async_16(stage + fp8_stage_offset<Traits>(row, chunk), valid ? base + offset : base,
                    valid);
      });
}

// Two e4m3 values (the low (kHalf = 0) or high 16 bits of w) -> an f16x2,
// exactly: every e4m3 value is an fp16 value. sm_89 and later have an
// instruction for it (F2FP.F16.E4M3.UNPACK_B, the half chosen by an operand
// selector; NaN stays NaN); older GPUs move the bits (fp16's exponent bias is
// 8 above e4m3's, so the moved bits are the value x 2^-8, subnormals
// included) and multiply by 2^8 (e4m3's NaN comes out as +-480 there).
template <int kHalf>
FAE_DEVICE uint32_t e4m3x2_to_f16x2(uint32_t w) {
  static_assert(kHalf == 0 || kHalf == 1, "a word holds two e4m3 pairs");
  uint32_t out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kHalf == 0) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
        : "=r"(out) : "r"(w));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
        : "=r"(out) : "r"(w));
  }
#else
  const uint32_t t = __byte_perm(w, 0u, kHalf == 0 ? 0x1404 : 0x3424);  // [0, b_lo, 0, b_hi]
  const uint32_t bits = (t & 0x80008000u) | ((t >> 1) & 0x3F803F80u);   // x 2^-8
  // 2^8 = fp16 0x5C00; -0 keeps the sign of zeros.
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(bits), "r"(0x5C005C00u), "r"(0x80008000u));
#endif
  return out;
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
// to 16 bits and re-packed, never staged through shared memory. One k-step
// (16 keys) at a time: pack_p_step, then pv_step.
template <typename Traits>
FAE_DEVICE void pack_p_step(uint32_t (&a)[Traits::kMmaM][4],
                            const float (&p)[Traits::kMmaM][Traits::kTilesN][4], int kk) {
  using T = typename Traits::MmaT;
#pragma unroll
  for (int m = 0; m < Traits::kMmaM; ++m) {
    a[m][0] = pack2<T>(p[m][2 * kk][0], p[m][2 * kk][1]);          // row g,   keys lo
    a[m][1] = pack2<T>(p[m][2 * kk][2], p[m][2 * kk][3]);          // row g+8, keys lo
    a[m][2] = pack2<T>(p[m][2 * kk + 1][0], p[m][2 * kk + 1][1]);  // row g,   keys hi
    a[m][3] = pack2<T>(p[m][2 * kk + 1][2], p[m][2 * kk + 1][3]);  // row g+8, keys hi
  }
}

template <typename Traits>
FAE_DEVICE void pv_step(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                        const uint32_t (&a)[Traits::kMmaM][4], const typename Traits::T* smem_v,
                        int kk, int lane) {
  using T = typename Traits::T;
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

template <typename Traits>
FAE_DEVICE void gemm_pv(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                        const float (&p)[Traits::kMmaM][Traits::kTilesN][4],
                        const typename Traits::T* smem_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) {
    uint32_t a[Traits::kMmaM][4];
    pack_p_step<Traits>(a, p, kk);
    pv_step<Traits>(o, a, smem_v, kk, lane);
  }
}

// The variant kernels' P V, in two steps: P -> 16-bit A fragments right after
// the softmax (half the registers of fp32 P while the V tile is awaited and
// the dropout's Philox calls run), then O += P V from them. Dropout clears the
// dropped halves (dropout_pair_mask); its scale is applied to O in the
// epilogue (O is linear in P, and the row sums are of the undropped P).
template <typename Traits>
using PFragments = uint32_t[Traits::kStepsN][Traits::kMmaM][4];

template <typename Traits>
FAE_DEVICE void pack_p(PFragments<Traits>& a, const float (&p)[Traits::kMmaM][Traits::kTilesN][4]) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) pack_p_step<Traits>(a[kk], p, kk);
}

// Dropout's keep mask on packed P: s[m][j][2h + e] is half e of a[j / 2][m][2 (j % 2) + h].
template <typename Traits>
FAE_DEVICE void dropout_packed_p(PFragments<Traits>& a, const Dropout& d, int row_base,
                                 int col_base) {
  for_each_dropout_pair<Traits::kWarpKeys, Traits::kMmaM, Traits::kTilesN>(
      d, row_base, col_base, [&](int m, int h, int j, bool keep_even, bool keep_odd) {
        a[j / 2][m][2 * (j % 2) + h] &= dropout_pair_mask(keep_even, keep_odd);
      });
}

// O[m] += P[m] V from packed P.
template <typename Traits>
FAE_DEVICE void gemm_pv_packed(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                               const PFragments<Traits>& a, const typename Traits::T* smem_v,
                               int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) pv_step<Traits>(o, a[kk], smem_v, kk, lane);
}

// Q A-fragments, loaded once in the prologue when they fit in registers
// (Traits::kQInRegs); otherwise a placeholder and gemm_qk reads shared memory.
template <typename Traits>
using QFragments = uint32_t[Traits::kQInRegs ? Traits::kMmaM : 1]
                           [Traits::kQInRegs ? Traits::kStepsD : 1][4];

// ---------------------------------------------------------------------------
// FP8 tiles straight into mma fragments (Traits::kKVFp8). ldmatrix reads the
// e4m3 staging tile as 16-bit pairs and e4m3x2_to_f16x2 widens each pair of
// bytes in registers: no 16-bit copy of the tile in shared memory. The MMAs
// run in fp16 (Traits::MmaT) whatever q's type: e4m3 -> fp16 is one
// instruction per pair, e4m3 -> bf16 took five integer / bf16x2 ones, and the
// widening was then half of the kernel's instructions (ncu: issue-bound, DRAM
// at 76%). A bf16 q goes to fp16 times a power of two that puts its largest
// |value| in [2^14, 2^15) (fp8_prepare_q; exact for every element above 2^-32
// of that maximum), and the softmax scale takes the inverse; P is fp16 (more
// mantissa than bf16's). Two orders change, both undone where they must be:
//
//  * Q K^T sums over the head dim, so its 16 columns of a k-step may be taken
//    in any order that Q and K share. ldmatrix (no .trans) gives lane (g, q)
//    bytes 4q..4q+3 of key row g's 16-byte chunk: head-dim columns 4q, 4q+1
//    are taken as the fragment's k = 2q, 2q+1 (b0 b1) and 4q+2, 4q+3 as
//    k = 2q+8, 2q+9 (b2 b3); Q's A fragments are read in that order
//    (load_q_frag_fp8: one 8-byte load per row).
//
//      chunk columns  0 1 2 3 | 4 5 6 7  | 8 ... 11  | 12 ... 15
//      lane q         0       | 1        | 2         | 3
//      mma k          0 1 8 9 | 2 3 10 11| 4 5 12 13 | 6 7 14 15
//
//  * P V: ldmatrix.trans of 8 keys x one chunk gives lane (g, q) the pairs
//    (key 2q: columns 2g, 2g+1) and (key 2q+1: columns 2g, 2g+1) in one
//    word; bytes (0, 2) are the B fragment of column 2g, bytes (1, 3) that of
//    column 2g+1. So accumulator tile 2c + p of O holds columns 16c + 2n + p
//    (n = the fragment column), i.e. lane q holds columns 16c + 4q .. 4q+3 of
//    its rows; unpermute_o_fp8 moves them back to the 16-bit layout (8-column
//    tiles, lane q: columns 2q, 2q+1) before the epilogue.
// ---------------------------------------------------------------------------
// Q's A fragment of k-step kk in gemm_qk_fp8's column order: a[0] / a[2] =
// row g's columns 16kk + 4q, +1 / +2, +3; a[1] / a[3] the same of row g+8
// (q's type T; fp8_q_to_mma converts them).
template <typename Traits>
FAE_DEVICE void load_q_frag_fp8(uint32_t (&a)[4], const typename Traits::T* smem_q, int warp_row0,
                                int m, int kk, int lane) {
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + m * 16 + h * 8 + g;
    const uint2 v = *reinterpret_cast<const uint2*>(
        smem_q + Traits::QLayout::offset(row, 2 * kk + q / 2) + (q % 2) * 4);
    a[h] = v.x;
    a[2 + h] = v.y;
  }
}

// A pair of q's type T -> the MMA type (fp16), times q_mult (a power of two).
template <typename T>
FAE_DEVICE uint32_t fp8_q_to_mma(uint32_t pair, float q_mult) {
  if constexpr (std::is_same_v<T, __half>) {
    return pair;  // q_mult == 1
  } else {
    const float2 f = unpack2<T>(pair);
    return pack2<__half>(f.x * q_mult, f.y * q_mult);
  }
}

// The power of two fp8_q_to_mma multiplies q by (1 for an fp16 q): it puts
// the largest |q| of the tile (every warp holds all of its rows, kRowWarps ==
// 1) in [2^14, 2^15). Converts q_frags (Q in registers) in place.
template <typename Traits>
FAE_DEVICE float fp8_prepare_q(QFragments<Traits>& q_frags, const typename Traits::T* smem_q,
                               int warp_row0, int lane) {
  using T = typename Traits::T;
  static_assert(Traits::kRowWarps == 1, "every warp must see the whole Q tile (one scale)");
  if constexpr (std::is_same_v<T, __half>) {
    return 1.f;
  } else {
    float max_abs = 0.f;
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
      for (int kk = 0; kk < Traits::kStepsD; ++kk) {
        uint32_t a[4];
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = q_frags[m][kk][r];
        } else {
          load_q_frag_fp8<Traits>(a, smem_q, warp_row0, m, kk, lane);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 f = unpack2<T>(a[r]);
          max_abs = fmaxf(max_abs, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
    }
    // max_abs in [2^(e-127), 2^(e-126)): times 2^(141-e) it is in [2^14, 2^15).
    // Kept in [-126, 126] so that the factor and its inverse are normal floats
    // (q = 0: the largest factor; q = inf / NaN stay inf / NaN).
    const int biased_exp = static_cast<int>((__float_as_uint(max_abs) >> 23) & 0xFF);
    const int shift = min(126, max(-126, 141 - biased_exp));
    const float q_mult = __uint_as_float(static_cast<uint32_t>(127 + shift) << 23);
    if constexpr (Traits::kQInRegs) {
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
        for (int kk = 0; kk < Traits::kStepsD; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) q_frags[m][kk][r] = fp8_q_to_mma<T>(q_frags[m][kk][r], q_mult);
    }
    return q_mult;
  }
}

// S[m] += Q[m] K^T from an FP8 staging tile (stage_k: the warp's first key
// row, tile-relative rows swizzle the same), two k-steps per ldmatrix.x4.
// q_frags: fp16 (fp8_prepare_q); else Q from shared memory times q_mult.
template <typename Traits, typename QFrags>
FAE_DEVICE void gemm_qk_fp8(float (&s)[Traits::kMmaM][Traits::kTilesN][4], const QFrags& q_frags,
                            const typename Traits::T* smem_q, float q_mult,
                            const uint8_t* stage_k, int warp_row0, int lane) {
  using MmaT = typename Traits::MmaT;
  static_assert(Traits::kStepsD % 2 == 0, "two k-steps (one 16-byte chunk pair) per ldmatrix");
#pragma unroll
  for (int kp = 0; kp < Traits::kStepsD / 2; ++kp) {
    uint32_t a[2][Traits::kMmaM][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[h][m][r] = q_frags[m][2 * kp + h][r];
        } else {
          load_q_frag_fp8<Traits>(a[h][m], smem_q, warp_row0, m, 2 * kp + h, lane);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            a[h][m][r] = fp8_q_to_mma<typename Traits::T>(a[h][m][r], q_mult);
          }
        }
      }
#pragma unroll
    for (int jn = 0; jn < Traits::kWarpKeys / 16; ++jn) {
      // Matrices: (keys 0-7, chunk 2kp) (keys 8-15, 2kp) (keys 0-7, 2kp+1)
      // (keys 8-15, 2kp+1) = n-tiles 2jn, 2jn+1 of k-step 2kp, then of 2kp+1.
      uint32_t w[4];
      const int key = jn * 16 + (lane & 15);
      ldmatrix_x4(w, stage_k + fp8_stage_offset<Traits>(key, 2 * kp + (lane >> 4)));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t b[2] = {e4m3x2_to_f16x2<0>(w[i]), e4m3x2_to_f16x2<1>(w[i])};
#pragma unroll
        for (int m = 0; m < Traits::kMmaM; ++m) {
          mma_16816<MmaT>(s[m][2 * jn + i % 2], a[i / 2][m], b);
        }
      }
    }
  }
}

// O[m] += P[m] V for k-step kk (16 keys) from an FP8 staging tile, into the
// permuted accumulator tiles described above.
template <typename Traits>
FAE_DEVICE void pv_step_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                            const uint32_t (&a)[Traits::kMmaM][4], const uint8_t* stage_v, int kk,
                            int lane) {
  using MmaT = typename Traits::MmaT;
#pragma unroll
  for (int jc = 0; jc < Traits::kHeadDim / 32; ++jc) {
    // Matrices: (keys 0-7, chunk 2jc) (keys 8-15, 2jc) (keys 0-7, 2jc+1) (keys 8-15, 2jc+1).
    uint32_t w[4];
    const int key = kk * 16 + (lane & 15);
    ldmatrix_x4_trans(w, stage_v + fp8_stage_offset<Traits>(key, 2 * jc + (lane >> 4)));
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      // Bytes (0, 2, 1, 3): the low half is column 2g of keys 2q, 2q+1, the high one column 2g+1.
      const uint32_t keys_lo = __byte_perm(w[2 * c], 0u, 0x3120);
      const uint32_t keys_hi = __byte_perm(w[2 * c + 1], 0u, 0x3120);
      const uint32_t b_even[2] = {e4m3x2_to_f16x2<0>(keys_lo), e4m3x2_to_f16x2<0>(keys_hi)};
      const uint32_t b_odd[2] = {e4m3x2_to_f16x2<1>(keys_lo), e4m3x2_to_f16x2<1>(keys_hi)};
      const int tile = 2 * (2 * jc + c);  // accumulator tiles of chunk 2jc + c
#pragma unroll
      for (int m = 0; m < Traits::kMmaM; ++m) {
        mma_16816<MmaT>(o[m][tile], a[m], b_even);
        mma_16816<MmaT>(o[m][tile + 1], a[m], b_odd);
      }
    }
  }
}

template <typename Traits>
FAE_DEVICE void gemm_pv_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                            const float (&p)[Traits::kMmaM][Traits::kTilesN][4],
                            const uint8_t* stage_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) {
    uint32_t a[Traits::kMmaM][4];
    pack_p_step<Traits>(a, p, kk);
    pv_step_fp8<Traits>(o, a, stage_v, kk, lane);
  }
}

template <typename Traits>
FAE_DEVICE void gemm_pv_packed_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4],
                                   const PFragments<Traits>& a, const uint8_t* stage_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kStepsN; ++kk) pv_step_fp8<Traits>(o, a[kk], stage_v, kk, lane);
}

// pv_step_fp8's accumulator order -> the 16-bit kernels' (lane q: columns 2q,
// 2q+1 of every 8-column tile), inside each quad. Per 16 columns of a row,
// lane q holds pairs 2q (columns 4q, 4q+1) and 2q+1 and needs pairs q and
// q+4; two rounds of shuffles move one pair to every lane each:
//   round 1: lane 0 <- pair 0 of lane 0, 1 <- 5 of 2, 2 <- 6 of 3, 3 <- 3 of 1
//   round 2: lane 0 <- pair 4 of lane 2, 1 <- 1 of 0, 2 <- 2 of 1, 3 <- 7 of 3
// (a lane offers its odd pair in round 1 when q ^ (q >> 1) is odd).
template <typename Traits>
FAE_DEVICE void unpermute_o_fp8(float (&o)[Traits::kMmaM][Traits::kTilesD][4], int lane) {
  const int q = lane % 4;
  const int quad = lane & ~3;
  const bool odd_first = ((q ^ (q >> 1)) & 1) != 0;  // offers its odd pair in round 1
  const int src1 = quad + ((0x1320 >> (4 * q)) & 0xF);
  const int src2 = quad + ((0x3102 >> (4 * q)) & 0xF);
#pragma unroll
  for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
    for (int c = 0; c < Traits::kHeadDim / 16; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* lo = &o[m][2 * c][2 * h];  // columns 4q, 4q+2 (lo[0], lo[1])
        float* hi = &o[m][2 * c + 1][2 * h];  // columns 4q+1, 4q+3
        const float even0 = lo[0], even1 = hi[0], odd0 = lo[1], odd1 = hi[1];
        const float r1x = __shfl_sync(0xffffffffu, odd_first ? odd0 : even0, src1);
        const float r1y = __shfl_sync(0xffffffffu, odd_first ? odd1 : even1, src1);
        const float r2x = __shfl_sync(0xffffffffu, odd_first ? even0 : odd0, src2);
        const float r2y = __shfl_sync(0xffffffffu, odd_first ? even1 : odd1, src2);
        // Lanes 0 and 3 got pair q in round 1, lanes 1 and 2 in round 2.
        lo[0] = odd_first ? r2x : r1x;
        lo[1] = odd_first ? r2y : r1y;
        hi[0] = odd_first ? r1x : r2x;
        hi[1] = odd_first ? r1y : r2y;
      }
}

// ---------------------------------------------------------------------------
// What the main kernel below shares with its prologue and epilogue stages: the
// thread's place in the CTA and the K/V pipeline.
// ---------------------------------------------------------------------------
// A thread's mma fragment coordinates and its warp's slice of the tile.
template <typename Traits>
struct FwdThread {
  int tid, warp, lane;
  int g;          // mma row group
  int q;          // lane within the quad
  int warp_row0;  // the warp's first tile row
  int warp_key0;  // first key of the warp's slice of every key tile

  FAE_DEVICE FwdThread()
      : tid(threadIdx.x),
        warp(tid / 32),
        lane(tid % 32),
        g(lane / 4),
        q(lane % 4),
        warp_row0(warp / Traits::kKeyWarps * Traits::kRowsPerWarp),
        warp_key0(warp % Traits::kKeyWarps * Traits::kWarpKeys) {}
};

// The CTA's K/V tiles (tile t = key tile range_begin + t) into the kStages
// shared-memory slots, one cp.async commit group for K and one for V.
// kKVCache: rows through the KV cache addressing (load_cache_tile_async)
// instead of k_head / v_head (unused then).
template <typename Traits, bool kKVCache = false>
struct KVTileLoader {
  using T = typename Traits::T;
  const AttentionFwdParams& params;
  T* smem_k;  // kKVSlots K tiles (kStages; kKVFp8: none, the staging tiles follow Q)
  T* smem_v;  // kKVSlots V tiles
  const T* k_head;
  const T* v_head;
  int64_t row_stride_k;
  int64_t row_stride_v;
  int range_begin;
  int seqlen_k;
  int tid;
  // kKVCache: batch entry, kv head and sequence row of key 0 (SeqBounds::row0_k).
  int batch = 0;
  int head_k = 0;
  int64_t row0_k = 0;

  // Decode tile: K/V that only this CTA reads stream through L2 as evict_first
  // (params.kv_evict_first) in every tile that is wholly in range; the
  // partial last tile and padded head dims take the plain zero-filling copies.
  FAE_DEVICE void load(T* smem, const T* gmem, int64_t row_stride, int valid_rows) const {
    if constexpr (Traits::kKVL2Policy) {
      if (params.kv_evict_first && valid_rows >= Traits::kBlockN &&
          params.head_dim == Traits::kHeadDim) {
        load_tile_async<Traits, typename Traits::KVLayout, Traits::kBlockN, /*kFullL2Hint=*/true>(
            smem, gmem, row_stride, valid_rows, params.head_dim, tid, l2_policy_evict_first());
        return;
      }
    }
    load_tile_async<Traits, typename Traits::KVLayout, Traits::kBlockN>(
        smem, gmem, row_stride, valid_rows, params.head_dim, tid);
  }

  // One K or V tile through the cache addressing, with load()'s L2 policy rule.
  FAE_DEVICE void load_cache(T* smem, const void* base, const TensorStrides& st,
                             const KVRow (&rows)[CacheTileMap<Traits>::kGroups], int64_t row0,
                             int valid_rows) const {
    const T* tensor = static_cast<const T*>(base);
    if constexpr (Traits::kKVL2Policy) {
      if (params.kv_evict_first && valid_rows >= Traits::kBlockN &&
          params.head_dim == Traits::kHeadDim) {
        load_cache_tile_async<Traits, /*kFullL2Hint=*/true>(smem, tensor, st, rows, params, batch,
                                                            head_k, row0, valid_rows,
                                                            params.head_dim, tid,
                                                            l2_policy_evict_first());
        return;
      }
    }
    load_cache_tile_async<Traits, false>(smem, tensor, st, rows, params, batch, head_k, row0,
                                         valid_rows, params.head_dim, tid, 0);
  }

  // kKVFp8: staging tile `slot` of K (which = 0) or V (1), right after Q.
  FAE_DEVICE uint8_t* stage(int slot, int which) const {
    return reinterpret_cast<uint8_t*>(smem_v + Traits::kKVSlots * Traits::kSmemKVElems) +
           (which * Traits::kStages + slot) * Traits::kSmemKVFp8Bytes;
  }

  // kKVFp8: one K or V tile into its staging tile. Without load()'s L2
  // evict_first hint: with it, the FP8 kernels hit an illegal instruction at
  // the hinted cp.async on an H200 (sm_90a, nvcc 13.0; 2026-11-26).
  FAE_DEVICE void load_cache_fp8(uint8_t* staging, const void* base, const TensorStrides& st,
                                 const KVRow (&rows)[CacheTileMap<Traits, 16>::kGroups],
                                 int64_t row0, int valid_rows) const {
    load_cache_tile_fp8_async<Traits>(staging, static_cast<const uint8_t*>(base), st, rows,
                                      params, batch, head_k, row0, valid_rows, params.head_dim,
                                      tid);
  }

  FAE_DEVICE void load_tile(int tile, int slot) const {
    const int n_block = range_begin + tile;
    const int64_t key0 = static_cast<int64_t>(n_block) * Traits::kBlockN;
    const int valid_rows = seqlen_k - n_block * Traits::kBlockN;
    if constexpr (Traits::kKVFp8) {
      static_assert(kKVCache, "FP8 K/V tiles are read by the KV cache kernels only");
      const int64_t row0 = row0_k + key0;
      KVRow rows[CacheTileMap<Traits, 16>::kGroups];
      cache_tile_rows<Traits, 16>(rows, params, batch, row0, valid_rows, tid);
      load_cache_fp8(stage(slot, 0), params.k, params.k_strides, rows, row0, valid_rows);
      cp_async_commit();
      load_cache_fp8(stage(slot, 1), params.v, params.v_strides, rows, row0, valid_rows);
      cp_async_commit();
    } else if constexpr (kKVCache) {
      // K and V share the look-ups (same rows, their own strides).
      const int64_t row0 = row0_k + key0;
      KVRow rows[CacheTileMap<Traits>::kGroups];
      cache_tile_rows<Traits>(rows, params, batch, row0, valid_rows, tid);
      load_cache(smem_k + slot * Traits::kSmemKVElems, params.k, params.k_strides, rows, row0,
                 valid_rows);
      cp_async_commit();
      load_cache(smem_v + slot * Traits::kSmemKVElems, params.v, params.v_strides, rows, row0,
                 valid_rows);
      cp_async_commit();
    } else {
      load(smem_k + slot * Traits::kSmemKVElems, k_head + key0 * row_stride_k, row_stride_k,
           valid_rows);
      cp_async_commit();
      load(smem_v + slot * Traits::kSmemKVElems, v_head + key0 * row_stride_v, row_stride_v,
           valid_rows);
      cp_async_commit();
    }
  }

  // Keeps the commit-group count uniform past the last tile, so the
  // cp_async_wait counts of the main loop hold for every iteration.
  static FAE_DEVICE void commit_empty() {
    cp_async_commit();
    cp_async_commit();
  }
};

// ---- prologue: Q, then K/V tiles 0 .. kStages-2 -----------------------------
// Commit groups in flight, oldest first: Q | K0 | V0 | K1 | V1 | ...
template <typename Traits, typename Loader>
FAE_DEVICE void fwd_prologue(QFragments<Traits>& q_frags, const Loader& kv,
                             typename Traits::T* smem_q, const typename Traits::T* q_tile,
                             int64_t q_row_stride, int q_valid_rows, int head_dim, int n_tiles,
                             const FwdThread<Traits>& th) {
  constexpr int kStages = Traits::kStages;
  load_tile_async<Traits, typename Traits::QLayout, Traits::kBlockM>(smem_q, q_tile, q_row_stride,
                                                                    q_valid_rows, head_dim, th.tid);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) {
      kv.load_tile(s, s);
    } else {
      kv.commit_empty();
    }
  }

  if constexpr (Traits::kQInRegs || Traits::kKVFp8) {  // kKVFp8: fp8_prepare_q reads Q
    cp_async_wait<2 * (kStages - 1)>();  // all but the K/V groups: Q has landed
    __syncthreads();                      // ... for every thread's chunks
  }
  if constexpr (Traits::kQInRegs) {
#pragma unroll
    for (int m = 0; m < Traits::kMmaM; ++m)
#pragma unroll
      for (int kk = 0; kk < Traits::kStepsD; ++kk)
        if constexpr (Traits::kKVFp8) {
          load_q_frag_fp8<Traits>(q_frags[m][kk], smem_q, th.warp_row0, m, kk, th.lane);
        } else {
          load_q_frag<Traits>(q_frags[m][kk], smem_q, th.warp_row0, m, kk, th.lane);
        }
  }
}

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

// ---------------------------------------------------------------------------
// Main kernel. Grid: x = m-tile + num_m_blocks * (batch*heads + head), y = KV split.
// kHasVariants: window / softcap / ALiBi / attn_mask (csrc/mask.h, ScoreVariants)
// and dropout (csrc/dropout.h, common/dropout_tile.cuh), instead of the
// causal-only mask (instantiated with kIsCausal = false, kVarSeq = true:
// causal is the window's right bound 0; see run_fwd_variants_impl).
// kKVCache: K/V through the KV cache addressing (block table, cache_batch_idx,
// left padding; KVTileLoader), instantiated for the decode tiles only
// (run_fwd_kvcache_impl), so the other kernels compile as without it.
// Traits::kKVFp8 (with kKVCache; run_fwd_kvcache_fp8_impl): an FP8 KV cache,
// staged and read into 16-bit fragments (gemm_qk_fp8, pv_step_fp8), k_descale
// folded into the softmax scale and v_descale into the epilogue.
// ---------------------------------------------------------------------------
template <typename Traits, bool kIsCausal, bool kVarSeq, bool kClusterMerge = false,
          bool kHasVariants = false, bool kAttnMask = false, bool kKVCache = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel(const __grid_constant__ AttentionFwdParams params) {
  static_assert(!kKVCache || kVarSeq, "KV cache addressing reads per-sequence bounds");
  static_assert(!Traits::kKVFp8 || kKVCache, "FP8 K/V: the KV cache kernels only");
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMmaM = Traits::kMmaM;
  constexpr int kStages = Traits::kStages;
  using KVLayout = typename Traits::KVLayout;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem_q = reinterpret_cast<T*>(smem_raw);
  T* smem_k = smem_q + Traits::kSmemQElems;                     // kKVSlots K tiles
  T* smem_v = smem_k + Traits::kKVSlots * Traits::kSmemKVElems;  // kKVSlots V tiles
  const FwdThread<Traits> th;

  // ---- which tile ----------------------------------------------------------
  const int num_m_blocks = ceil_div_dev(params.seqlen_q, kBlockM);
  const int bh = blockIdx.x / num_m_blocks;
  int m_block = blockIdx.x % num_m_blocks;
  // Causal tiles further down see more keys; start those first so the short
  // ones fill the tail of the wave (the x order keeps a head's tiles adjacent
  // for L2 reuse of its K/V).
  if (kIsCausal || (kHasVariants && params.causal)) m_block = num_m_blocks - 1 - m_block;
  const int batch = bh / params.heads;
  const int head = bh % params.heads;
  const int head_k = head / (params.heads / params.heads_k);
  const int split = blockIdx.y;
  const int num_splits = gridDim.y;
  // This sequence's lengths / first rows / causal offset (varlen, seqused_k).
  const SeqBounds seq = seq_bounds<kVarSeq, kKVCache>(params, batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // varlen: past this sequence (CTA-uniform)

  ScoreVariants variants;
  if constexpr (kHasVariants) variants = ScoreVariants::make(params, seq, batch, head);
  // FP8 K: real K = k_descale(batch, kv head) x stored, a factor of the scores
  // folded into the softmax scale (and fp8_prepare_q's factor of q, below).
  float kv_scale_log2 = 0.f;  // kKVFp8: the scale of this CTA's scores
  if constexpr (Traits::kKVFp8) {
    const float k_factor = descale_at(params.k_descale, batch, head_k);
    kv_scale_log2 = params.scale_log2 * k_factor;
    if constexpr (kHasVariants) {
      variants.scale_log2 *= k_factor;
      variants.softcap_in *= k_factor;
    }
  }
  const KeyTileRange range =
      kHasVariants ? key_tile_range_variants<kBlockM, kBlockN>(seq, variants.mask, m_block, split,
                                                                num_splits)
                   : key_tile_range<kBlockM, kBlockN, kIsCausal>(seq, m_block, split, num_splits);
  const int n_tiles = range.end - range.begin;

  const int64_t row_stride_k = params.k_strides.row;
  const int64_t row_stride_v = params.v_strides.row;
  const T* q_tile = static_cast<const T*>(params.q) + batch * params.q_strides.batch +
                    head * params.q_strides.head +
                    (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.q_strides.row;
  const T* k_head = nullptr;  // kKVCache: rows through kv_row instead
  const T* v_head = nullptr;
  if constexpr (!kKVCache) {
    k_head = static_cast<const T*>(params.k) + batch * params.k_strides.batch +
             head_k * params.k_strides.head + seq.row0_k * row_stride_k;
    v_head = static_cast<const T*>(params.v) + batch * params.v_strides.batch +
             head_k * params.v_strides.head + seq.row0_k * row_stride_v;
  }
  const KVTileLoader<Traits, kKVCache> kv{params,       smem_k,       smem_v,       k_head,
                                          v_head,       row_stride_k, row_stride_v, range.begin,
                                          seq.seqlen_k, th.tid,       batch,        head_k,
                                          seq.row0_k};

  float acc_o[kMmaM][Traits::kTilesD][4];
#pragma unroll
  for (int m = 0; m < kMmaM; ++m)
#pragma unroll
    for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_o[m][d][r] = 0.f;
  OnlineSoftmax<kMmaM> softmax;

  if (n_tiles > 0) {  // CTA-uniform; an empty range writes O = 0, lse = -inf
    QFragments<Traits> q_frags;
    fwd_prologue<Traits>(q_frags, kv, smem_q, q_tile, params.q_strides.row,
                         seq.seqlen_q - m_block * kBlockM, params.head_dim, n_tiles, th);
    float q_mult = 1.f;  // kKVFp8: q's factor in the fp16 MMAs
    if constexpr (Traits::kKVFp8) {
      q_mult = fp8_prepare_q<Traits>(q_frags, smem_q, th.warp_row0, th.lane);
      const float q_unscale = 1.f / q_mult;  // a power of two: exact
      kv_scale_log2 *= q_unscale;
      if constexpr (kHasVariants) {
        variants.scale_log2 *= q_unscale;
        variants.softcap_in *= q_unscale;
      }
    }

    // ---- main loop over key tiles --------------------------------------------
    // (Inline here: as a device function it cost the D=192 causal varlen kernel
    // 40 more bytes of spills, same PTX up to register numbering.)
    const int row_base = m_block * kBlockM + th.warp_row0 + th.g;  // lane's first global row
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int n_block = range.begin + tile;
      const int slot = tile % kStages;
      // The warp's key slice: whole rows, so the swizzle (row % 8) is unchanged.
      // (kKVFp8: the staging tiles of slot `slot`.)
      const int slice = slot * Traits::kSmemKVElems + th.warp_key0 * KVLayout::kRowStride;
      const T* smem_k_tile = smem_k + slice;
      const T* smem_v_tile = smem_v + slice;
      const int stage_slice = fp8_stage_offset<Traits>(th.warp_key0, 0);
      const uint8_t* stage_k_tile = kv.stage(slot, 0) + stage_slice;
      const uint8_t* stage_v_tile = kv.stage(slot, 1) + stage_slice;

      // Groups newer than K_tile: V_tile and 2 per tile tile+1 .. tile+kStages-2.
      cp_async_wait<2 * kStages - 3>();
      // K_tile is visible to all threads, and every warp has finished tile-1,
      // so its slot ((tile-1) % kStages) can be refilled.
      __syncthreads();
      const int prefetch = tile + kStages - 1;
      if (prefetch < n_tiles) {
        kv.load_tile(prefetch, prefetch % kStages);
      } else {
        kv.commit_empty();
      }

      float acc_s[kMmaM][Traits::kTilesN][4];
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int j = 0; j < Traits::kTilesN; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_s[m][j][r] = 0.f;
      if constexpr (Traits::kKVFp8) {
        gemm_qk_fp8<Traits>(acc_s, q_frags, smem_q, q_mult, stage_k_tile, th.warp_row0,
                            th.lane);
      } else {
        gemm_qk<Traits>(acc_s, q_frags, smem_q, smem_k_tile, th.warp_row0, th.lane);
      }

      const int col_base = n_block * kBlockN + th.warp_key0 + 2 * th.q;
      if constexpr (kHasVariants) {
        score_and_mask_variants<kAttnMask, /*kFold=*/false>(acc_s, variants, row_base, col_base,
                                                            /*mask_elements=*/true);
      } else if (key_tile_needs_mask<kBlockM, kBlockN, kIsCausal>(seq, m_block, n_block)) {
        scale_and_mask<true, kIsCausal>(acc_s,
                                        Traits::kKVFp8 ? kv_scale_log2 : params.scale_log2,
                                        row_base, col_base, seq.seqlen_k, seq.causal_offset);
      } else {
        scale_and_mask<false, kIsCausal>(acc_s,
                                         Traits::kKVFp8 ? kv_scale_log2 : params.scale_log2,
                                         row_base, col_base, seq.seqlen_k, seq.causal_offset);
      }
      softmax.update(acc_s, acc_o);
      PFragments<Traits> p16;  // variants: P, 16-bit (gemm_pv_packed)
      if constexpr (kHasVariants) {
        pack_p<Traits>(p16, acc_s);
        // Dropout: the dropped elements of P cleared for the P V product (the
        // row sums above, and so lse, are of the undropped P; the scale comes
        // in the epilogue). Keys are numbered within the sequence (col_base),
        // so split-KV and the key-warp decode tile draw the same mask. Built
        // per tile: its seed and offset would otherwise hold registers across
        // the whole loop.
        const Dropout dropout = make_dropout(params, batch, head);
        if (dropout.active()) {  // uniform
          dropout_packed_p<Traits>(p16, dropout, row_base, col_base);
        }
      }

      // Groups newer than V_tile: 2 per tile tile+1 .. tile+kStages-1.
      cp_async_wait<2 * kStages - 2>();
      __syncthreads();  // V_tile visible to all threads
      if constexpr (Traits::kKVFp8 && kHasVariants) {
        gemm_pv_packed_fp8<Traits>(acc_o, p16, stage_v_tile, th.lane);
      } else if constexpr (Traits::kKVFp8) {
        gemm_pv_fp8<Traits>(acc_o, acc_s, stage_v_tile, th.lane);
      } else if constexpr (kHasVariants) {
        gemm_pv_packed<Traits>(acc_o, p16, smem_v_tile, th.lane);
      } else {
        gemm_pv<Traits>(acc_o, acc_s, smem_v_tile, th.lane);
      }
    }
    cp_async_wait<0>();  // only empty groups remain; keeps the smem reuse below obviously safe
  }
  if constexpr (Traits::kKVFp8) unpermute_o_fp8<Traits>(acc_o, th.lane);

  // ---- epilogue: normalise, merge key warps / splits, store ------------------
  float lse[kMmaM][2];
  // A learnable sink joins one partial of the row: split 0's key warp 0.
  softmax.finalize(acc_o, lse,
                   split == 0 && th.warp_key0 == 0 ? sink_log2_of(params, head) : -INFINITY);
  if constexpr (Traits::kKVFp8) {
    // FP8 V: O = v_descale(batch, kv head) x P V (the merges of
    // key warps and splits are linear in O; every split has the same factor).
    const float v_factor = descale_at(params.v_descale, batch, head_k);
#pragma unroll
    for (int m = 0; m < kMmaM; ++m)
#pragma unroll
      for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_o[m][d][r] *= v_factor;
  }
  if constexpr (kHasVariants) {
    // Dropout's scale of the kept probabilities (dropout_packed_p), on the
    // normalised O: the key-warp and split-KV merges are linear in O.
    if (params.dropout_threshold > 0) {
      const float scale = params.dropout_scale;
#pragma unroll
      for (int m = 0; m < kMmaM; ++m)
#pragma unroll
        for (int d = 0; d < Traits::kTilesD; ++d)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_o[m][d][r] *= scale;
    }
  }
  const bool holds_output = merge_key_warps<Traits>(acc_o, lse, smem_raw, th.warp, th.lane);

  const int row_in_head0 = m_block * kBlockM + th.warp_row0;  // sequence row of warp row 0

  if constexpr (kClusterMerge) {
    T* out_tile = static_cast<T*>(params.out) + batch * params.out_strides.batch +
                  head * params.out_strides.head +
                  (seq.row0_q + static_cast<int64_t>(m_block) * kBlockM) * params.out_strides.row;
    float* lse_tile = params.lse + seq.lse_index(params, batch, head, m_block * kBlockM);
    merge_splits_in_cluster<Traits>(acc_o, lse, holds_output, smem_raw, th.warp_row0,
                                    min(kBlockM, seq.seqlen_q - m_block * kBlockM),
                                    params.head_dim, out_tile, params.out_strides.row, lse_tile);
    return;
  }
  if (!holds_output) return;  // the key warps' results are merged into warp 0's
  if (num_splits == 1) {
    store_output<Traits>(acc_o, lse, smem_q, params, seq, batch, head, row_in_head0, th);
  } else {
    store_split_partials<Traits>(acc_o, lse, params, seq, batch, head, split, row_in_head0, th);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
