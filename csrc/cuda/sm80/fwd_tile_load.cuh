// Global -> shared memory tile copies of the sm80 forward kernel (fwd_kernel.cuh):
// 16-byte cp.async of Q / K / V tiles (copy_16, load_tile_async), K/V tiles
// through the KV cache addressing (CacheTileMap, cache_tile_rows,
// for_each_cache_copy, load_cache_tile_async) and FP8 K/V staging tiles
// (fp8_stage_offset, load_cache_tile_fp8_async).
// Separate because it is the memory side of the main loop: address maps, L2
// hints and zero-fill rules, independent of the mma fragment layouts
// (fwd_mma.cuh); KVTileLoader (fwd_pipeline.cuh) drives these copies.
#pragma once
#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"

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

}  // namespace cuda
}  // namespace flash_attn_ext
