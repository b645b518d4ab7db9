// The sm80 forward kernel's thread coordinates and K/V pipeline (the kernel:
// fwd_kernel.cuh): FwdThread (a thread's mma fragment coordinates and its
// warp's slice of the tile), KVTileLoader (K/V tiles into the kStages
// shared-memory slots: strided, through the KV cache addressing, or FP8
// staging tiles; one cp.async commit group each for K and V) and fwd_prologue
// (Q, then K/V tiles 0 .. kStages-2).
// Separate because it is the state the kernel's inline main loop, prologue and
// epilogue (fwd_epilogue.cuh) share; the copies themselves are in
// fwd_tile_load.cuh, the Q fragment loads in fwd_mma.cuh.
#pragma once
#include "../../params.h"
#include "../common/ptx.cuh"
#include "fwd_kernel_traits.cuh"
#include "fwd_mma.cuh"
#include "fwd_tile_load.cuh"

namespace flash_attn_ext {
namespace cuda {

// ---------------------------------------------------------------------------
// What the main kernel (fwd_kernel.cuh) shares with its prologue and epilogue stages: the
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

}  // namespace cuda
}  // namespace flash_attn_ext
