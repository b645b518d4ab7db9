// Hopper forward: TMA loads, wgmma, one producer warpgroup feeding two or
// three consumer warpgroups through an mbarrier ring; a persistent grid.
//
//   CTA = 1 + W warpgroups (W = 2, or 3 at D = 64), one CTA per SM, looping
//   over (query tile of 64 W rows, head, batch)
//
//   warpgroup 0 (producer, 24 registers, 32 with W = 3): one thread picks
//       the CTA's next tile (round-robin, or from a global atomic counter:
//       the dynamic scheduler of the causal grid) and issues TMA copies per
//       tile:
//       K_j, V_j for j = last .. first key tile into ring stage (running
//       count % kStages) once the consumers released that stage, and after
//       the first K the tile's Q, one 64-row slice per consumer warpgroup,
//       each once that warpgroup ran the previous tile's last Q K^T.
//       (kVarSeq kernels: its first warp, lane 0 doing the above and every
//       lane a share of a paged K/V tile's per-page copies. kVtInKernel, FP8
//       short calls: V's tile goes to a staging buffer, and all four warps
//       transpose it into the V^T stage, fwd_sm90_transpose_v.cuh.)
//   warpgroups 1 .. W (consumers, 240 registers, 160 with W = 3): rows
//       [64w, 64w + 64) of the query tile each; per key tile j,
//       software-pipelined:
//       S_j = Q K_j^T            wgmma SS (Q, K both K-major in smem)
//       O  += P_{j-1} V_{j-1}    wgmma RS (P from registers, V MN-major)
//       mask, online softmax of S_j while that P V runs (fwd_softmax.cuh)
//       and the warpgroups take turns issuing their GEMMs (ping-pong with
//       two, round-robin with three).
//   epilogue: O / rowsum and LSE straight from registers to global memory.
//       The Q slices were released after the tile's last S = Q K^T, so the
//       producer is already loading the next tile's Q, K and V meanwhile.
//
// Key tiles are visited from the last to the first, so the tiles that need
// the causal / sequence-end mask come first and the steady state has none.
//
// Where the pieces live: fwd_sm90_traits.cuh has the tile configuration
// (FwdSm90TileConfig, FwdSm90Fp8TileConfig, with the measurements behind
// them) and FwdSm90Traits (tile sizes, shared-memory layout, register
// split); fwd_sm90_smem.cuh the shared-memory addresses and mbarriers
// (FwdSm90Smem); fwd_sm90_scheduler.cuh the tile list (FwdSm90Tile,
// fwd_sm90_tile_at); this file has the kernel: the producer and consumers
// (mainloop, softmax, epilogue) are one function, whose steps are lambdas
// over its shared state. The rest of the code includes this file.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "../../params.h"
#include "../common/ptx.cuh"
#include "../common/dropout_tile.cuh"
#include "../common/fwd_softmax.cuh"
#include "../common/mask_blocks.cuh"
#include "fwd_sm90.h"
#include "sm90_primitives.cuh"
#include "wgmma_ops.cuh"
#include "fwd_sm90_scheduler.cuh"
#include "fwd_sm90_smem.cuh"
#include "fwd_sm90_traits.cuh"
#include "fwd_sm90_transpose_v.cuh"

namespace flash_attn_ext {
namespace cuda {

// kHasVariants: window / softcap / ALiBi (csrc/mask.h) with causal as the
// window's right bound (kIsCausal = false then): the key tiles of a query
// tile are those its window reaches (key_tile_range_variants), tiles the
// window cuts get the element mask, and softcap / ALiBi turn every score into
// ScoreVariants::score_log2 before a plain (unfolded) online softmax; dropout
// multiplies P by its keep factor after the row sums. kAttnMask: the variant
// kernel of calls with an attn_mask. kDropout: the variant kernel may apply
// dropout (checked at run time); the calls without it take a kernel without
// the dropout code, whose mere presence in the softmax made softcap / ALiBi
// 4-6% slower at D = 64 (H200, same run; not at D = 128).
// kVarSeq: sequences of their own lengths: packed (varlen, cu_seqlens) and/or
// key counts cut by seqused_k (a KV cache's used rows) and/or the KV cache's
// addressing (a paged cache's block_table, cache_batch_idx: load_kv_tile;
// cache_leftpad: the keys start at row0_k), never with an attn_mask (fwd_sm90_takes_seqs). Packed tensor maps span all
// packed rows as one batch entry, and a tile's loads start at its sequence's
// first row: the
// keys a tile reads past its sequence (or past seqused_k) are masked (P
// exactly 0), the query rows not stored, and the V rows zeroed in shared
// memory (FP8: V^T, padded per sequence, holds zeros there already). The
// producer walks a compact list of the tiles that exist (params.h
// compact_tiles), or with more than kCompactTilesMaxBatch sequences skips
// the tiles past a sequence's end (the padded grid counts max_seqlen_q rows).
template <typename Traits, bool kIsCausal, bool kHasVariants = false, bool kAttnMask = false,
          bool kDropout = kAttnMask, bool kVarSeq = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tmap_q,
                          const __grid_constant__ CUtensorMap tmap_k,
                          const __grid_constant__ CUtensorMap tmap_v,
                          const __grid_constant__ AttentionFwdParams params,
                          int* tile_counter) {
#if defined(FAE_SM90_ENABLED)
  using T = typename Traits::T;
  using TOut = typename Traits::TOut;
  constexpr bool kFp8 = Traits::kFp8;
  static_assert(!(kFp8 && kHasVariants), "the FP8 forward has no variants");
  static_assert(!(kVarSeq && kAttnMask), "varlen calls have no attn_mask");
  static_assert(!kAttnMask || Traits::kConsumerWarpgroups == 2,
                "attn_mask kernels: the summary's two 64-row blocks per tile are the warpgroups'");
  constexpr int kWarpgroups = Traits::kConsumerWarpgroups;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;  // of V and O (kHeadDim unless MLA)
  constexpr int kStages = Traits::kStages;
  constexpr int kChunks = Traits::kChunks;
  constexpr int kChunksV = Traits::kChunksV;
  // FP8 calls without varlen / seqused_k where V^T's pass would cost more
  // (fwd_fp8_transposes_v): the producer warpgroup transposes V in shared
  // memory (fwd_sm90_transpose_v.cuh).
  constexpr bool kVtInKernel = Traits::kVtInKernel;
  static_assert(!kVtInKernel || !kVarSeq, "varlen FP8 calls read the V^T pass's padded tiles");
  using namespace sm90;

  extern __shared__ uint8_t smem_raw[];
  constexpr int kQRing = Traits::kQRing;
  const FwdSm90Smem<Traits> smem(smem_raw);  // addresses, mbarriers: fwd_sm90_smem.cuh

  // Persistent grid over the list of tiles (m_block, head, batch), m_block
  // fastest, so the CTAs running at one time share a few heads' K/V in L2,
  // and m_block counting down, so under causal masking each head's longest
  // tiles come first. CTA c starts with tile c; its next tile is
  // c + gridDim.x, ... (static round-robin, equal tiles) or, with a
  // tile_counter, the next unclaimed one (dynamic: tiles of unequal length
  // under causal masking go to whichever CTA is free first).
  // A packed batch's compact list (params.h compact_tiles, written before
  // this kernel by compact_query_tiles_kernel): the (sequence, head, query
  // tile) triples that exist, longest sequences first, then head by head,
  // m_block fastest as above; tile t is entry t, and the list ends at the
  // first entry with b = -1.
  const bool listed = kVarSeq && params.compact_tiles != nullptr;
  const int num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
  const int num_tiles = listed ? params.compact_tiles_capacity * params.heads
                               : num_m_blocks * params.heads * params.batch;
  // The tile list and tile t of it (fwd_sm90_scheduler.cuh).
  using Tile = FwdSm90Tile;
  auto tile_at = [&](int t, bool trim) {
    return fwd_sm90_tile_at<kBlockM, kBlockN, kIsCausal, kHasVariants, kAttnMask, kVarSeq>(
        params, num_m_blocks, t, trim);
  };
  // TMA coordinates: packed sequences are one batch entry of all rows, each
  // starting at its first row (re-read from cu_seqlens where a load needs it:
  // the producer has no registers to hold it); a padded batch with seqused_k
  // keeps its batch entries (row0 = 0).
  auto map_batch = [&](const Tile& tile) {
    return kVarSeq && params.cu_seqlens_q != nullptr ? 0 : tile.b;
  };
  auto row0_q = [&](const Tile& tile) {
    return kVarSeq ? static_cast<int>(seq_bounds<kVarSeq, kVarSeq>(params, tile.b).row0_q) : 0;
  };
  auto row0_k = [&](const Tile& tile) {
    return kVarSeq ? static_cast<int>(seq_bounds<kVarSeq, kVarSeq>(params, tile.b).row0_k) : 0;
  };
  // The producer: one thread, or in the kVarSeq and kVtInKernel kernels the
  // whole first warp (lane 0 alone claims tiles, arrives on barriers and
  // issues the Q and whole-tile copies; every lane issues a paged tile's
  // boxes, load_kv_tile, and takes its share of each V transpose, whose
  // ldmatrix / stmatrix are warp-wide). kVtInKernel: warps 1 .. 3 of the
  // producer warpgroup transpose V only, following the staging buffer.
  constexpr int kProducerLanes = kVarSeq || kVtInKernel ? 32 : 1;
  constexpr unsigned kProducerMask = kVarSeq || kVtInKernel ? 0xffffffffu : 1u;
  // Named barrier of the producer warpgroup's 128 threads after each V
  // transpose (ids 3 .. 3 + W are the consumers', see below).
  constexpr int kTransposeBarrier = 4 + Traits::kConsumerWarpgroups;
  // K / V tile n_block of the tile's sequence into shared memory (the key
  // rows [n_block * kBlockN, + kBlockN) of the sequence; fwd_sm90_kv_map_shape
  // has the maps). A paged cache (kVarSeq kernels; pages of 2^k rows, so the
  // page and the row in it are a shift and a mask: a division made the
  // 24-register producer spill): one box per page piece, each from the
  // page that the sequence's block_table row names. Rows past the sequence
  // read whatever page the table has there (masked, K, or zeroed, V, like any
  // row past seqused_k); table indices stay inside the row and page ids are
  // clamped to the pool, so a bad table reads wrong keys, never outside the
  // pool, as kv_row() does in the other kernels. cache_batch_idx: the batch
  // entry's cache row, clamped alike. chunks_tag: the tile's 64-column chunks
  // (K's kChunks, V's kChunksV).
  auto load_kv_tile = [&](const CUtensorMap* map, uint32_t dst, uint32_t full, const Tile& tile,
                          int n_block, int lane, auto chunks_tag) {
    constexpr int kTileChunks = decltype(chunks_tag)::value;
    if constexpr (kVarSeq) {
      if (params.block_table != nullptr) {
        // One TMA box per page piece, lane i of the producer warp taking
        // pieces i, i + 32, ...: 16-row pages at D = 128 need 16 boxes per K
        // or V tile, ~60 instructions each (table read, coordinates into
        // uniform registers, issue), which one thread did not get through
        // under a tile's GEMMs (H100: 1.7x the contiguous cache's time, 1.1x
        // with the warp).
        const int* table = params.block_table + tile.b * params.block_table_batch_stride;
        const int page_shift = 31 - __clz(params.page_size);
        const int box_rows = fwd_sm90_paged_box_rows(params.page_size, kBlockN);
        for (int r = lane * box_rows; r < kBlockN; r += kProducerLanes * box_rows) {
          const int key = n_block * kBlockN + r;
          const int page = min(max(table[min(key >> page_shift, params.block_table_pages - 1)], 0),
                               params.num_pages - 1);
#pragma unroll
          for (int c = 0; c < kTileChunks; ++c) {
            tma_load_4d(dst + (c * kBlockN + r) * 128, map, full, c * Traits::kChunkCols,
                        key & (params.page_size - 1), tile.h_k, page);
          }
        }
        return;
      }
    }
    int batch = map_batch(tile);
    if (kVarSeq && params.kv_batch_idx != nullptr) {
      batch = min(max(params.kv_batch_idx[tile.b], 0), params.kv_batch - 1);
    }
    if (lane == 0) {
      tma_load_tile<kTileChunks, Traits::kChunkCols>(map, dst, kBlockN, full,
                                                     row0_k(tile) + n_block * kBlockN, tile.h_k,
                                                     batch);
    }
  };
  // Warp-uniform (shuffled from lane 0), so the role branches below are
  // uniform and the value is not kept (spilled) across setmaxnreg.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    for (int slot = 0; slot < kQRing; ++slot) {
      mbar_init(smem.q_full(slot), 1);
      mbar_init(smem.q_empty(slot), Traits::kConsumerWarps / Traits::kConsumerWarpgroups);
    }
    if constexpr (Traits::kVtInKernel) mbar_init(smem.v_staging_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem.k_full(s), 1);
      mbar_init(smem.v_full(s), 1);
      mbar_init(smem.k_empty(s), Traits::kConsumerWarps);
      mbar_init(smem.v_empty(s), Traits::kConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<Traits::kProducerRegs>();
    // kVtInKernel: the count-th V tile (in the staging buffer) into V^T stage
    // count % kStages once the consumers released it; all 128 threads. The
    // barrier at the end is also what frees the staging buffer for the next
    // TMA (every thread's ldmatrix reads are done).
    auto transpose_v = [&](int count) {
      if constexpr (kVtInKernel) {
        const int stage = count % kStages;
        mbar_wait(smem.v_staging_full(), static_cast<uint32_t>(count & 1));
        mbar_wait(smem.v_empty(stage), ((count / kStages) & 1) ^ 1);
        // The lanes leave their mbarrier polls apart; ldmatrix / stmatrix are
        // .aligned (the whole warp, converged).
        __syncwarp();
        transpose_v_tile_e4m3<kBlockN, kHeadDim>(smem.v(stage), smem.v_staging, threadIdx.x / 32,
                                                 threadIdx.x % 32);
        fence_proxy_async_smem();  // the P V wgmma reads V^T through the async proxy
        // The first warp and the others reach it from different code.
        named_barrier_sync_unaligned(kTransposeBarrier, 128);
      }
    };
    if constexpr (kVtInKernel) {
      if (threadIdx.x >= kProducerLanes) {  // warps 1 .. 3: until the stop word
        for (int count = 0;; ++count) {
          mbar_wait(smem.v_staging_full(), static_cast<uint32_t>(count & 1));
          if (ld_shared_b32(smem.v_staging_word()) != 0u) break;
          transpose_v(count);
        }
        return;
      }
    }
    if (threadIdx.x < kProducerLanes) {
      const int lane = threadIdx.x;
      const bool leader = lane == 0;
      if (leader) {
        prefetch_tensor_map(&tmap_q);
        prefetch_tensor_map(&tmap_k);
        prefetch_tensor_map(&tmap_v);
      }
      int kv_count = 0;  // K/V tiles loaded so far: ring stage and phase
      int t = blockIdx.x;
      // The next tile to claim: round-robin, or from the tile counter.
      auto next_tile = [&](int current) {
        if (tile_counter == nullptr) return current + static_cast<int>(gridDim.x);
        const int claimed = leader ? atomicAdd(tile_counter, 1) : 0;
        return __shfl_sync(kProducerMask, claimed, 0) + static_cast<int>(gridDim.x);
      };
      for (int tile_count = 0;; ++tile_count) {
        // A Q slice (and its tile slot) is free once the warpgroup reading it
        // ran the previous tile's last Q K^T. tile == nullptr: no more tiles.
        auto send_q = [&](const Tile* tile) {
          for (int wg = 0; wg < Traits::kConsumerWarpgroups; ++wg) {
            const int u = Traits::kConsumerWarpgroups * tile_count + wg;
            const int slot = smem.q_slot_of(u);
            mbar_wait(smem.q_empty(slot), smem.q_phase_of(u) ^ 1);
            if (!leader) continue;
            st_shared_b32(smem.tile_slot(slot), static_cast<uint32_t>(t));
            if (kAttnMask && tile != nullptr) {
              st_shared_b32(smem.tile_slot(slot) + 4, static_cast<uint32_t>(tile->keys.begin));
              st_shared_b32(smem.tile_slot(slot) + 8, static_cast<uint32_t>(tile->keys.end));
            }
            if (listed && tile != nullptr) {  // the list entry, so consumers need not load it
              st_shared_b32(smem.tile_slot(slot) + 4,
                            static_cast<uint32_t>(tile->m_block * params.heads + tile->h));
              st_shared_b32(smem.tile_slot(slot) + 8, static_cast<uint32_t>(tile->b));
            }
            if (tile == nullptr) {
              mbar_arrive(smem.q_full(slot));
              continue;
            }
            constexpr int kRows = Traits::kQSliceRows;
            mbar_arrive_expect_tx(smem.q_full(slot), Traits::kQSliceBytes);
            tma_load_tile<kChunks, Traits::kChunkCols>(
                &tmap_q, smem.q(slot), kRows, smem.q_full(slot),
                row0_q(*tile) + tile->m_block * kBlockM + wg * kRows, tile->h, map_batch(*tile));
          }
        };
        if constexpr (kVarSeq) {  // past its sequence's rows: nothing to do
          while (t < num_tiles) {
            const Tile probe = tile_at(t, true);
            if (probe.has_rows) break;
            t = probe.b < 0 ? num_tiles : next_tile(t);  // past a compact list's end: no more
          }
        }
        if (t >= num_tiles) {
          send_q(nullptr);
          if (kVtInKernel && leader) {  // the transposing warps stop too
            st_shared_b32(smem.v_staging_word(), 1u);
            mbar_arrive(smem.v_staging_full());
          }
          break;
        }
        const Tile tile = tile_at(t, true);
        // K_n then V_n into ring stage (kv_count % kStages) once the
        // consumers released the K / V held there kStages key tiles earlier.
        auto load_k = [&](int n_block, int count) {
          const int stage = count % kStages;
          mbar_wait(smem.k_empty(stage), ((count / kStages) & 1) ^ 1);
          if constexpr (kAttnMask) {
            uint32_t reads = 3u;  // without a summary both warpgroups read
            if (params.attn_mask_blocks != nullptr) {
              const SeqBounds seq = seq_bounds<kVarSeq, kVarSeq>(params, tile.b);
              // Row block 2 m_block + w is warpgroup w's (past the sequence:
              // the last one's, whose rows are discarded).
              const int row0 = attn_mask_block_row(params, tile.b, tile.h, tile.m_block * 2);
              const int last = attn_mask_block_row(params, tile.b, tile.h,
                                                   (seq.seqlen_q - 1) / kMaskBlock);
              const int row1 = min(row0 + params.attn_mask_block_strides.row, last);
              reads = (attn_mask_block_at(params, row0, n_block) & kMaskBlockMasks ? 1u : 0u) |
                      (attn_mask_block_at(params, row1, n_block) & kMaskBlockMasks ? 2u : 0u);
            }
            if (leader) st_shared_b32(smem.mask_reads(stage), reads);
          }
          if (leader) mbar_arrive_expect_tx(smem.k_full(stage), Traits::kKTileBytes);
          __syncwarp(kProducerMask);
          load_kv_tile(&tmap_k, smem.k(stage), smem.k_full(stage), tile, n_block, lane,
                       std::integral_constant<int, kChunks>());
        };
        auto load_v = [&](int n_block, int count) {
          const int stage = count % kStages;
          if constexpr (kVtInKernel) {
            // V's tile into the staging buffer (free: the last transpose ended
            // with the warpgroup's barrier), then this warp's share of its
            // transpose, then V^T is the consumers'.
            if (leader) {
              st_shared_b32(smem.v_staging_word(), 0u);
              mbar_arrive_expect_tx(smem.v_staging_full(), Traits::kVStagingBytes);
            }
            __syncwarp();
            load_kv_tile(&tmap_v, smem.v_staging, smem.v_staging_full(), tile, n_block, lane,
                         std::integral_constant<int, kChunks>());
            // The next K's copy goes out before this V's transpose, not after
            // it (measured 1-3% faster at S >= 4k).
            if (n_block > tile.keys.begin) load_k(n_block - 1, count + 1);
            transpose_v(count);
            if (leader) mbar_arrive(smem.v_full(stage));
            return;
          }
          mbar_wait(smem.v_empty(stage), ((count / kStages) & 1) ^ 1);
          if (leader) mbar_arrive_expect_tx(smem.v_full(stage), Traits::kVTileBytes);
          __syncwarp(kProducerMask);
          if constexpr (kFp8) {
            if (!leader) return;
            // V^T [head_dim x keys]: boxes of kVtChunkKeys keys, every head-dim
            // row (varlen: V^T is padded per sequence, so the batch coordinate
            // is the sequence's and the keys start at 0).
            constexpr int kChunkKeys = Traits::kVtChunkKeys;
#pragma unroll
            for (int c = 0; c < Traits::kVtChunks; ++c) {
              tma_load_4d(smem.v(stage) + c * kHeadDim * kChunkKeys, &tmap_v, smem.v_full(stage),
                          n_block * kBlockN + c * kChunkKeys, 0, tile.h_k, tile.b);
            }
          } else {
            load_kv_tile(&tmap_v, smem.v(stage), smem.v_full(stage), tile, n_block, lane,
                         std::integral_constant<int, kChunksV>());
          }
        };
        // The tile's first K goes out before its Q: its stage was freed by
        // the previous tile's second-to-last Q K^T, Q's slices only by the
        // last one of each warpgroup.
        const int n_last = tile.keys.end - 1;
        if (n_last >= tile.keys.begin) load_k(n_last, kv_count);
        send_q(&tile);
        for (int n_block = n_last; n_block >= tile.keys.begin; --n_block, ++kv_count) {
          load_v(n_block, kv_count);
          if (kVtInKernel) continue;  // load_v sent the next K
          if (n_block > tile.keys.begin) load_k(n_block - 1, kv_count + 1);
        }
        // Claim the next tile only now (holding it through the loop spilled
        // at 24 registers); the consumers are still kStages key tiles behind.
        t = next_tile(t);
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int wg = warpgroup - 1;  // which 64 query rows
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;

  // S = Q K^T: kHeadDim / kKStep k-steps; inside a 128-byte chunk a k-step
  // moves 32 bytes, across chunks a whole [rows x 128 B] chunk. desc_q: this
  // warpgroup's Q slice (set per tile).
  uint64_t desc_q = 0;
  auto issue_qk = [&](float (&s)[1][kBlockN / 8][4], int stage) {
    const uint64_t desc_k = smem_desc_sw128(smem.k(stage), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / Traits::kKStep; ++kk) {
      const uint32_t chunk_offset = (kk % 4) * 32;
      const uint32_t q_offset = (kk / 4) * Traits::kQSliceRows * 128 + chunk_offset;
      WgmmaOps<T, kBlockN>::ss_kmajor(
          &s[0][0][0], smem_desc_advance(desc_q, q_offset),
          smem_desc_advance(desc_k, (kk / 4) * kBlockN * 128 + chunk_offset), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // O += P V: kBlockN / 16 k-steps of 16 V rows (2048 bytes) each; the head
  // dim (wgmma N) spans the chunks, LBO apart. FP8: kBlockN / 32 k-steps
  // along the keys of V^T, addressed like K in S = Q K^T.
  auto issue_pv = [&](float (&o)[1][kHeadDimV / 8][4],
                      const uint32_t (&p)[kBlockN / Traits::kKStep][4], int stage) {
    if constexpr (kFp8) {
      // k-step kk: 32 keys, within a 128-key chunk or a 32-key chunk of its own.
      constexpr int kChunkKeys = Traits::kVtChunkKeys;
      constexpr int kStepsPerChunk = kChunkKeys / 32;
      const uint64_t desc_vt = kChunkKeys == 128 ? smem_desc_sw128(smem.v(stage), 16, 1024)
                                                 : smem_desc_sw32_kmajor(smem.v(stage));
      [[maybe_unused]] const uint64_t desc_p = smem_desc_sw128(smem.p(wg), 16, 1024);
#pragma unroll
      for (int kk = 0; kk < kBlockN / Traits::kKStep; ++kk) {
        const uint64_t b = smem_desc_advance(
            desc_vt, (kk / kStepsPerChunk) * kHeadDim * kChunkKeys + (kk % kStepsPerChunk) * 32);
        if constexpr (Traits::kPInSmem) {
          WgmmaOps<T, kHeadDim>::ss_kmajor(
              &o[0][0][0], smem_desc_advance(desc_p, (kk / 4) * 64 * 128 + (kk % 4) * 32), b, 1);
        } else {
          WgmmaOps<T, kHeadDim>::rs_kmajor(&o[0][0][0], p[kk], b, 1);
        }
      }
    } else {
      const uint64_t desc_v = smem_desc_sw128(smem.v(stage), kBlockN * 128, 1024);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        WgmmaOps<T, kHeadDimV>::rs_mnmajor(&o[0][0][0], p[kk],
                                           smem_desc_advance(desc_v, kk * 2048), 1);
      }
    }
    wgmma_commit();
  };
  // Ping-pong: the consumer warpgroups take turns issuing their GEMMs, in
  // the order 0, 1 (, 2), 0, ... (barrier kPingPongBarrier + wg, 256 threads
  // = own sync + the previous warpgroup's arrive), so one warpgroup's softmax
  // runs while the others' GEMMs occupy the tensor cores. The turn passes on
  // across tiles too: every warpgroup takes the same number of turns per tile
  // (n_tiles + 1), so warpgroup 0 starts the next tile's first Q K^T while
  // the last one is still in its epilogue. The last warpgroup hands out the
  // very first turn; warpgroup 0 takes the one left over after the last
  // tile, so every barrier sees as many arrives as syncs.
  constexpr int kPingPongBarrier = 3;  // .. 3 + kWarpgroups - 1
  // kVarSeq: a V tile's rows past the sequence zeroed by all consumers.
  constexpr int kZeroedBarrier = kPingPongBarrier + kWarpgroups;
  constexpr int kConsumerThreads = 128 * kWarpgroups;
  auto gemm_turn_begin = [&]() { named_barrier_sync(kPingPongBarrier + wg, 256); };
  auto gemm_turn_end = [&]() {
    named_barrier_arrive(kPingPongBarrier + (wg + 1) % kWarpgroups, 256);
  };
  if (wg == kWarpgroups - 1) named_barrier_arrive(kPingPongBarrier, 256);

  int kv_count = 0;  // K/V tiles consumed so far (same sequence as the producer)
  for (int tile_count = 0;; ++tile_count) {
    const int q_slice = Traits::kConsumerWarpgroups * tile_count + wg;
    const int q_slot = smem.q_slot_of(q_slice);
    mbar_wait(smem.q_full(q_slot), smem.q_phase_of(q_slice));
    // Lane 0 reads the slot for its warp (and is the lane that later arrives
    // on q_empty, which lets the producer rewrite it).
    const int t = __shfl_sync(
        0xffffffffu, lane == 0 ? static_cast<int>(ld_shared_b32(smem.tile_slot(q_slot))) : 0,
        0);
    if (t >= num_tiles) break;
    desc_q = smem_desc_sw128(smem.q(q_slot), 16, 1024);
    // Where the tile is: a compact list's entry from the producer (in the
    // slot's other words), else from t.
    auto slot_word = [&](int offset) {
      return __shfl_sync(
          0xffffffffu,
          lane == 0 ? static_cast<int>(ld_shared_b32(smem.tile_slot(q_slot) + offset)) : 0, 0);
    };
    const int listed_tile = listed ? slot_word(4) : 0;  // m_block * heads + h
    const FwdSm90TileCoords coords =
        listed ? FwdSm90TileCoords{listed_tile / params.heads, listed_tile % params.heads,
                                   slot_word(8)}
               : fwd_sm90_tile_coords<kAttnMask, false>(params, num_m_blocks, t);
    Tile tile = fwd_sm90_tile_of<kBlockM, kBlockN, kIsCausal, kHasVariants, kAttnMask, kVarSeq>(
        params, coords.m_block, coords.h, coords.b, false);
    if constexpr (kAttnMask) {  // the producer's range (trimmed to the mask)
      tile.keys.begin = __shfl_sync(
          0xffffffffu,
          lane == 0 ? static_cast<int>(ld_shared_b32(smem.tile_slot(q_slot) + 4)) : 0, 0);
      tile.keys.end = __shfl_sync(
          0xffffffffu,
          lane == 0 ? static_cast<int>(ld_shared_b32(smem.tile_slot(q_slot) + 8)) : 0, 0);
    }
    const SeqBounds seq = seq_bounds<kVarSeq, kVarSeq>(params, tile.b);
    const int n_tiles = tile.keys.end - tile.keys.begin;
    // FP8: the scores carry q's and k's factors (folded into the exponent's
    // scale), O v's (the epilogue).
    float scale_log2 = params.scale_log2;
    if constexpr (kFp8) {
      scale_log2 *= descale_at(params.q_descale, tile.b, tile.h_k) *
                    descale_at(params.k_descale, tile.b, tile.h_k);
    }
    // A 16-bit additive attn_mask goes through the warp's scratch: key tile i
    // of the loop (i = 0 the last tile) in buffer i % kMaskBuffers, copied
    // kMaskBuffers - 1 tiles ahead (stage_mask(i + kMaskBuffers - 1) while
    // tile i's GEMMs run), added in the softmax. One cp.async group per tile,
    // empty past the last, so that "all but the kMaskBuffers - 1 newest groups
    // done" always covers tile i's copies.
    bool staged = false;
    if constexpr (kAttnMask && Traits::kStageAttnMask) {
      staged = attn_mask_stageable(make_mask(params, seq, tile.b, tile.h));
    }
    constexpr int kMaskBufferBytes = kStagedMaskWarpBytes<kBlockN>;
    constexpr int kMaskBuffers = Traits::kMaskBuffers;
    const uint32_t warp_scratch =
        smem.mask_scratch + (wg * 4 + warp) * kMaskBuffers * kMaskBufferBytes;
    auto stage_mask = [&](int i) {
      if constexpr (kAttnMask && Traits::kStageAttnMask) {
        if (staged) {
          if (kMaskBuffers == 1 || i < n_tiles) {  // (one buffer: always a tile)
            stage_attn_mask<kBlockN>(warp_scratch + (i % kMaskBuffers) * kMaskBufferBytes,
                                     make_mask(params, seq, tile.b, tile.h),
                                     tile.m_block * kBlockM + wg * 64 + warp * 16,
                                     (tile.keys.end - 1 - i) * kBlockN, lane);
          } else {
            cp_async_commit();
          }
        }
      }
    };
    // Accumulator layout of m64nN (per warp: 16 rows, as mma.sync m16n8):
    // acc[j][e], lane = 4g + q: e = 0,1 -> row g, cols 8j + 2q + {0,1};
    // e = 2,3 -> row g + 8. So fwd_softmax.cuh applies with one m-tile.
    const int row_base = tile.m_block * kBlockM + wg * 64 + warp * 16 + lane / 4;
    // Scores stay unscaled: only the masked ones become -inf, and the scale
    // is folded into the exponent (update_scores_folded; the dispatcher sends
    // softmax_scale <= 0 to the mma.sync kernels).
    // With variants: this warpgroup's rows (the window bounds of its first
    // and last row decide which tiles it must mask) and the score modifiers.
    // ScoreVariants and Dropout are rebuilt per key tile from the kernel
    // parameters (constant bank) rather than held across the loop: kept live,
    // their ~30 registers made the D = 128 / 256 consumers spill inside the
    // softmax (5x slower with ALiBi, H100).
    // mask_reads: this warpgroup reads the attn_mask on the tile (attn_mask
    // kernels; from the producer's word at smem.mask_reads).
    using Softmax = OnlineSoftmax<1, Traits::kPExp2Offset>;
    // Softcapped bf16 calls without additive terms skip the running max and the
    // rescaling of O (update_scores_unshifted; fp16 P has too narrow a range):
    // softcap forward 4% faster at D = 128, 11-14% at D = 256 (H100, S = 4k), but
    // 4% slower at D = 64, which keeps the running max.
    const bool unshifted = kHasVariants && kHeadDim >= 128 &&
                           std::is_same_v<T, __nv_bfloat16> && softcap_bounds_scores(params);
    // softmax_tile returns whether O needs the rescale: OnlineSoftmax's lazy
    // rescaling at D = 256, whose 128 O registers per thread make the rescale
    // worth a vote (H100, bf16, same machine: forward 1.5-4% faster at D = 256;
    // D = 128 within +-2%, D = 64 3-5% slower). The FP8 kernel's P, 2^8-scaled
    // already, always rescales.
    constexpr bool kLazyRescale = !kFp8 && kHeadDimV >= 256;
    // Plain non-causal calls at D = 128: the softmax's row maxima and the
    // exponents' arguments (the max reduction's shuffles and the FFMAs, 190 of
    // the loop's ~790 instructions) run under the warpgroup's own P V, the
    // exponentials, row sums and O's rescale after its wait. That is the order
    // of FlashAttention-4's SASS. ncu (H100, S = 8k, per 176-key step and
    // consumer warp) had shown our consumers waiting on that P V with nothing
    // to do, and the code after the wait (ptxas hoists the wait above all of
    // it otherwise) 47% longer per key than FA4's, which is what the other
    // warpgroup's GEMMs must cover. Measured, two rounds: 1.04 / 1.05 / 1.03
    // faster at S = 1k / 4k / 16k (best of two; per round 1.01-1.05, once 0.99
    // at 16k); the maxima alone under the P V: 1.00 / 1.05 / 0.99
    // (docs/PERFORMANCE.md). Causal, D = 64 and varlen kernels keep the whole
    // softmax after the wait: the same split there measured 0.998x (H100, D = 64
    // / 128, S 1k-16k, two rounds; 0.98-1.02 per config).
    constexpr bool kMaxUnderOwnPv =
        !kIsCausal && !kHasVariants && !kVarSeq && !kFp8 && kHeadDim == 128 && kHeadDimV == 128;
    auto softmax_tile = [&](Softmax& softmax, float (&s)[1][kBlockN / 8][4], int n_block,
                            float (&rescale)[1][2], bool mask_reads) -> bool {
      const int col_base = n_block * kBlockN + 2 * (lane % 4);
      if constexpr (kHasVariants) {
        const ScoreVariants variants = ScoreVariants::make(params, seq, tile.b, tile.h);
        const int wg_first_row = tile.m_block * kBlockM + wg * 64;
        const int wg_last_row = min(wg_first_row + 64, seq.seqlen_q) - 1;
        // Folded: the scale (softcap's with softcap) goes into the exp2 FMA.
        const bool mask_elements =
            !key_tile_inside_window<kBlockN>(variants.mask, wg_first_row, wg_last_row, n_block);
        const float unit = score_and_mask_variants<kAttnMask, /*kFold=*/true>(
            s, variants, row_base, col_base, mask_elements, mask_reads && !staged);
        if constexpr (kAttnMask && Traits::kStageAttnMask) {
          if (staged) {
            const int i = tile.keys.end - 1 - n_block;  // stage_mask's buffer
            add_staged_attn_mask<kBlockN / 8, kMaskBuffers - 1>(
                s, warp_scratch + (i % kMaskBuffers) * kMaskBufferBytes, lane,
                variants.mask.bias_type, 1.4426950408889634f / unit);
          }
        }
        bool rescale_o = false;
        if (unshifted) {
          softmax.update_scores_unshifted(s, unit);
        } else {
          rescale_o = softmax.template update_scores_folded<kLazyRescale>(s, unit, rescale);
        }
        // Dropout on P after the row sums (csrc/dropout.h): the accumulator layout
        // is mma.sync's, so one Philox call per 8 elements (dropout_tile.cuh);
        // the dropped elements cleared here, the scale applied to O (epilogue).
        if constexpr (kDropout) {
          const Dropout dropout = make_dropout(params, tile.b, tile.h);
          if (dropout.active()) {
            drop_elements<kBlockN, 1, kBlockN / 8>(s, dropout, row_base, col_base);
          }
        }
        return rescale_o;
      }
      if (key_tile_needs_mask<kBlockM, kBlockN, kIsCausal>(seq, tile.m_block, n_block)) {
        scale_and_mask<true, kIsCausal, 1, kBlockN / 8, false>(
            s, scale_log2, row_base, col_base, seq.seqlen_k, seq.causal_offset);
      }
      return softmax.template update_scores_folded<kLazyRescale>(s, scale_log2, rescale);
    };

    // Lane 0 reads the stage's word before it releases the stage (k_empty),
    // after which the producer may rewrite it.
    auto read_mask_flag = [&](int stage) {
      if constexpr (!kAttnMask) return false;
      const uint32_t reads = __shfl_sync(0xffffffffu, lane == 0 ? ld_shared_b32(smem.mask_reads(stage)) : 0u, 0);
      return ((reads >> wg) & 1u) != 0u;
    };

    // P as the A operand of P V: fragments in registers, or (kPInSmem) stored
    // into this warpgroup's buffer by stmatrix (lane l addresses row l % 8 of
    // 8x8 matrix l / 8, which takes fragment word l / 8: rows + 8 (word % 2),
    // 16-byte unit + word / 2; the backward's store_ds) and fenced for the
    // async proxy. The next gemm_turn_begin (a bar.sync of this warpgroup's
    // 128 threads) orders every thread's stores before the SS wgmma reads
    // them; the buffer is rewritten only after the wait for that P V.
    auto to_p_fragments = [&](const float (&s)[1][kBlockN / 8][4],
                              uint32_t (&p)[kBlockN / Traits::kKStep][4]) {
      if constexpr (kFp8) {
        accumulators_to_a_fragments_e4m3<kBlockN>(s[0], p);
      } else {
        accumulators_to_a_fragments<T, kBlockN>(s[0], p);
      }
      if constexpr (Traits::kPInSmem) {
        const int r = warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
        for (int kk = 0; kk < kBlockN / Traits::kKStep; ++kk) {
          stmatrix_x4(smem.p(wg) + (kk / 4) * 64 * 128 + r * 128 +
                          (((2 * (kk % 4) + lane / 16) ^ (r % 8)) * 16),
                      p[kk]);
        }
        fence_proxy_async_smem();
      }
    };

    float o[1][kHeadDimV / 8][4];
#pragma unroll
    for (int j = 0; j < kHeadDimV / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[0][j][e] = 0.f;
    }
    Softmax softmax;

    // Every consumer warp arrives on q_empty once per tile, right after its
    // last Q K^T (or now, for a tile without keys).
    if (n_tiles == 0 && lane == 0) mbar_arrive(smem.q_empty(q_slot));
    if (n_tiles > 0) {
      // Software pipeline (intra-warpgroup overlap): iteration i issues
      // S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back, then runs the
      // softmax of S_i while the P V product is still on the tensor cores.
      float s[1][kBlockN / 8][4];
      uint32_t p[kBlockN / Traits::kKStep][4];
      float rescale[1][2];
      auto stage_of = [&](int i) { return (kv_count + i) % kStages; };
      auto parity_of = [&](int i) { return static_cast<uint32_t>(((kv_count + i) / kStages) & 1); };

#pragma unroll
      for (int i = 0; i < Traits::kMaskBuffers; ++i) stage_mask(i);
      mbar_wait(smem.k_full(stage_of(0)), parity_of(0));
      gemm_turn_begin();
      wgmma_fence();
      issue_qk(s, stage_of(0));
      gemm_turn_end();
      wgmma_wait<0>();
      fence_registers(reinterpret_cast<float(&)[kBlockN / 2]>(s));
      bool mask_reads = read_mask_flag(stage_of(0));
      if (lane == 0) {
        mbar_arrive(smem.k_empty(stage_of(0)));
        if (n_tiles == 1) mbar_arrive(smem.q_empty(q_slot));
      }
      softmax_tile(softmax, s, tile.keys.end - 1, rescale, mask_reads);  // O is 0: no rescale
      to_p_fragments(s, p);  // P: A operand of P V
      if constexpr (kVarSeq && !kFp8) {
        // The first key tile (the sequence's last) may run past the sequence
        // into rows that hold anything (NaN in a padded buffer's tail or in a
        // cache's rows past seqused_k): its
        // masked P is exactly 0, but 0 * NaN is not, so those V rows become
        // zeros before any warpgroup's P V reads them. All warpgroups get
        // here on the same tile (same key range), each past its first turn.
        const int valid_keys = seq.seqlen_k - (tile.keys.end - 1) * kBlockN;
        if (valid_keys < kBlockN) {
          mbar_wait(smem.v_full(stage_of(0)), parity_of(0));
          zero_swizzled_tile_rows<kChunksV>(smem.v(stage_of(0)), kBlockN, valid_keys,
                                           wg * 128 + tid, kConsumerThreads);
          fence_proxy_async_smem();  // the wgmma reads through the async proxy
          named_barrier_sync(kZeroedBarrier, kConsumerThreads);
        }
      }

      for (int i = 1; i < n_tiles; ++i) {
        mbar_wait(smem.k_full(stage_of(i)), parity_of(i));
        mbar_wait(smem.v_full(stage_of(i - 1)), parity_of(i - 1));
        gemm_turn_begin();
        wgmma_fence();
        issue_qk(s, stage_of(i));
        issue_pv(o, p, stage_of(i - 1));
        gemm_turn_end();
        stage_mask(i + Traits::kMaskBuffers - 1);  // while the GEMMs run
        wgmma_wait<1>();  // S_i done (groups retire in order), P V still running
        fence_registers(reinterpret_cast<float(&)[kBlockN / 2]>(s));
        mask_reads = read_mask_flag(stage_of(i));
        if (lane == 0) {
          mbar_arrive(smem.k_empty(stage_of(i)));
          if (i == n_tiles - 1) mbar_arrive(smem.q_empty(q_slot));
        }
        bool rescale_o = true;
        if constexpr (kMaxUnderOwnPv) {
          const int n_block = tile.keys.end - 1 - i;
          if (key_tile_needs_mask<kBlockM, kBlockN, kIsCausal>(seq, tile.m_block, n_block)) {
            scale_and_mask<true, kIsCausal, 1, kBlockN / 8, false>(
                s, scale_log2, row_base, n_block * kBlockN + 2 * (lane % 4), seq.seqlen_k,
                seq.causal_offset);
          }
          float base[1][2];
          softmax.exponent_args(s, scale_log2, rescale, base);
          fence_registers(reinterpret_cast<float(&)[kBlockN / 2]>(s));
          keep_above_next_wait_uniform(base[0][0] + base[0][1] + rescale[0][0] + rescale[0][1]);
        } else {
          rescale_o = softmax_tile(softmax, s, tile.keys.end - 1 - i, rescale, mask_reads);
          // The softmax's exponentials overlap this warpgroup's own P V (FA3's
          // intra-warpgroup overlap) only if the wait stays below them.
          if constexpr (Traits::kSoftmaxUnderOwnPv) {
            keep_above_next_wait(softmax.row_sum[0][0] + softmax.row_sum[0][1]);
          }
        }
        wgmma_wait<0>();
        fence_registers(reinterpret_cast<float(&)[kHeadDimV / 2]>(o));
        if constexpr (!Traits::kPInSmem) {
          fence_registers(reinterpret_cast<uint32_t(&)[kBlockN / Traits::kKStep * 4]>(p));
        }
        if (lane == 0) mbar_arrive(smem.v_empty(stage_of(i - 1)));
        if constexpr (kMaxUnderOwnPv) softmax.exponentiate(s, rescale);
        if (rescale_o) Softmax::rescale_rows(o, rescale);
        to_p_fragments(s, p);  // P: A operand of P V
      }

      const int last = n_tiles - 1;
      mbar_wait(smem.v_full(stage_of(last)), parity_of(last));
      gemm_turn_begin();
      wgmma_fence();
      issue_pv(o, p, stage_of(last));
      gemm_turn_end();
      wgmma_wait<0>();
      fence_registers(reinterpret_cast<float(&)[kHeadDimV / 2]>(o));
      if constexpr (!Traits::kPInSmem) {
        fence_registers(reinterpret_cast<uint32_t(&)[kBlockN / Traits::kKStep * 4]>(p));
      }
      if (lane == 0) mbar_arrive(smem.v_empty(stage_of(last)));
      kv_count += n_tiles;
    }

    // ---------------- epilogue ----------------
    float lse[1][2];
    softmax.finalize(o, lse, sink_log2_of(params, tile.h));
    if (lane % 4 == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = row_base + 8 * hh;
        if (row < seq.seqlen_q) params.lse[seq.lse_index(params, tile.b, tile.h, row)] = lse[0][hh];
      }
    }
    // O straight from the accumulators, 16 bytes per lane and store (see
    // store_accumulator_row). Rows past seqlen_q and the columns past the
    // true head dim are not written.
    TOut* out = static_cast<TOut*>(params.out);
    // FP8: V's descale; dropout: the scale of the kept probabilities (1 without).
    const float out_scale = kFp8          ? descale_at(params.v_descale, tile.b, tile.h_k)
                            : kDropout     ? params.dropout_scale
                                           : 1.f;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = row_base + 8 * hh;
      const bool row_ok = row < seq.seqlen_q;
      TOut* out_row =
          out + row_offset(params.out_strides, tile.b, tile.h, seq.row0_q + (row_ok ? row : 0));
      if constexpr (kVtInKernel) {  // O's columns permuted as V^T's rows
        store_accumulator_row_dim_permuted<TOut, kHeadDimV>(out_row, o[0], hh, out_scale,
                                                            params.head_dim_v, row_ok, lane);
      } else {
        store_accumulator_row<TOut, kHeadDimV>(out_row, o[0], hh, out_scale, 0,
                                               params.head_dim_v, row_ok, lane);
      }
    }
  }
  if (wg == 0) gemm_turn_begin();  // the turn left over (see above)
#endif
}

}  // namespace cuda
}  // namespace flash_attn_ext
