// Hopper backward: dK, dV (and dQ partial sums) for one key tile at a time,
// with TMA loads and wgmma; one producer warpgroup feeding two consumer
// warpgroups.
//
//   CTA = 3 warpgroups, one key tile, grid = (key tiles, heads, batch);
//   GQA (kWalkGroup): grid = (key tiles, heads_k, batch), see below
//
//   warpgroup 0 (producer, 24 registers): thread 0 loads K_j, V_j (mbarrier
//       kv_full), then Q_i, dO_i, lse_i, D_i for every step i (a query tile
//       that sees key tile j) into a kStages ring (qdo_full / qdo_empty); threads 32 and
//       64, one per consumer, are its dQ writers: each waits for the consumer's
//       staged dQ_i (dq_full), adds it into the fp32 accumulator with TMA
//       reduce-adds and frees the buffer once the TMA has read it (dq_empty).
//   warpgroups 1, 2 (consumers, 240 registers). Per query tile i (kBlockM
//   rows: 128 at D = 64, else 64):
//       S^T  = K Q_i^T                   wgmma SS (both K-major, as loaded)
//       dP^T = V dO_i^T                  wgmma SS
//       P^T  = exp2(S^T * scale*log2e - lse*log2e), masked   (registers)
//       dS^T = P^T o (dP^T - D)                              (registers)
//       dV  += P^T dO_i                  wgmma RS (dO MN-major: read transposed)
//       dS^T -> shared memory, then
//       dQ_i += dS K                     wgmma SS, both MN-major (dS^T and K
//                                        read transposed), added into the fp32
//                                        dQ accumulator (bwd_preprocess.cuh
//                                        converts it at the end): staged in
//                                        shared memory for the dQ writer, so
//                                        the math warps issue no atomics and
//                                        never wait for the TMA
//       dK  += dS^T Q_i                  wgmma RS (Q MN-major), issued after
//                                        dQ (key split): it runs while dQ is
//                                        staged
//   epilogue: dK * softmax_scale and dV from registers to global memory.
//
// GQA (heads > heads_k, kWalkGroup): a CTA owns (key tile, kv head h_k,
// batch) and its steps are the query tiles of every query head of the group,
// h = h_k * group .. h_k * group + group - 1 in that order, for each head the
// same query-tile walk [m_begin, m_end) (BwdSm90StepWalk). dK / dV stay in
// registers across the heads and are written once, into the [.., heads_k, D]
// gradients: no per-query-head dK / dV and no group sum afterwards (the op
// layer's reshape + sum + copy cost up to ~5% at 32 / 8 heads). Everything
// per step (Q / dO / lse / D rows, the dQ reduce-adds and deterministic
// counters, attn_mask / ALiBi / dropout) takes the step's query head h. The
// step counter i runs on across heads, so the Q/dO ring, the dS^T and dQ
// buffers and every mbarrier phase continue as within one head. The other
// calls (kWalkGroup = false: one query head per CTA; a GQA call there writes
// dK / dV per query head) compile to the same code as before the walk.
//
// Varlen (packed rows) and seqused_k (kVarSeq): the tensor maps span all rows
// of the packed tensors and tiles start at the sequence's first row, so a
// tile's rows past the sequence hold other sequences' rows (or unused cache
// keys); the consumers zero them in shared memory before the first wgmma reads
// them, and the kernel then runs exactly as on a padded batch.
//
// The transposed formulation (S^T rather than S) puts the keys on wgmma's M
// side, so the accumulators of S^T / dP^T are already the A operands (P^T,
// dS^T) of the dV / dK products: no shared-memory round trip for them.
//
// How the consumers share the work per head dim, the measured choices and the
// shared-memory layout: bwd_sm90_traits.cuh.
//
// Attention variants (kHasVariants: window / softcap / ALiBi / attn_mask,
// csrc/mask.h, and dropout, csrc/dropout.h) with causal as the window's right
// bound (kIsCausal = false then): a key tile walks the query
// tiles whose rows see one of its keys (bwd_sm90_variants.cuh), P^T comes from
// ScoreVariants::score_log2 with the element mask on tiles the window cuts (a
// plain window skips it on the others), and softcap multiplies dS^T by its
// df/ds = 1 - tanh^2, which P^T then waits for dP^T to carry (no registers
// held for it; head-dim split: consumer 0 hands over P^T o df/ds instead of
// P^T, and P^T for consumer 1's dV as 16-bit fragments in the step's dS^T
// buffer, which consumer 1 then overwrites with dS^T). kHasAttnMask: the
// variant kernel of attn_mask calls, whose per-element mask loads need
// registers that spill (ptxas -v; bwd_sm90_launch.cuh picks it per call), so
// the other variant calls get a kernel without them.
//
// Dropout (a uniform branch in the variant kernels; Z = keep ? scale : 0):
// dS^T = P^T o (dP^T o Z^T - D) (o df/ds) and dV += (P^T o Z^T) dO, computed as
// P'^T o (dP^T o keep^T - D / scale) and P'^T o keep^T with P' = P * scale from
// the exponential (the row statistics hold lse - log2 scale and D / scale:
// bwd_preprocess.cuh): no multiply by the scale per element. The
// keep bits of a thread's S^T elements (bwd_sm90_dropout_bits, one Philox call
// per 16 elements) are computed while the step's score GEMMs run. Key split: held
// in 1-2 registers until dP^T and P^T have taken Z. Head-dim split: consumer 0
// computes them and hands them to consumer 1 as the sign bits of the fp32
// P^T (softcap: P^T o df/ds; both >= 0), its 16-bit P^T fragments (softcap)
// already times Z.
//
// Files: this one holds the kernel; its helpers (shared-memory addresses,
// mbarriers, dS^T / dQ staging, row statistics, scores to probabilities) are
// lambdas in its body and stay there (as functions they could compile
// differently). The step walk (BwdSm90StepWalk) is in bwd_sm90_steps.cuh;
// tile shapes, shared-memory layout and register budget in
// bwd_sm90_traits.cuh; the variants' tile ranges, masks and dropout bits in
// bwd_sm90_variants.cuh.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../params.h"
#include "../common/fwd_softmax.cuh"
#include "../common/ptx.cuh"
#include "bwd_sm90_steps.cuh"
#include "bwd_sm90_traits.cuh"
#include "bwd_sm90_variants.cuh"
#include "sm90_primitives.cuh"
#include "wgmma_ops.cuh"

namespace flash_attn_ext {
namespace cuda {

template <typename Traits, bool kIsCausal, bool kVarSeq, bool kHasVariants = false,
          bool kHasAttnMask = false, bool kWalkGroup = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ CUtensorMap tmap_q,
                          const __grid_constant__ CUtensorMap tmap_k,
                          const __grid_constant__ CUtensorMap tmap_v,
                          const __grid_constant__ CUtensorMap tmap_do,
                          const __grid_constant__ CUtensorMap tmap_dq_accum,
                          const __grid_constant__ AttentionBwdParams params) {
#if defined(FAE_SM90_ENABLED)
  using T = typename Traits::T;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kChunks = Traits::kChunks;
  constexpr int kGradCols = Traits::kGradCols;
  constexpr int kDqBuffers = Traits::kDqBuffers;
  using namespace sm90;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_base = smem_align_1024(smem_raw);
  const uint32_t k_smem = smem_base;
  const uint32_t v_smem = k_smem + Traits::kKVBytes;
  const uint32_t q_smem0 = v_smem + Traits::kKVBytes;
  const uint32_t do_smem0 = q_smem0 + kStages * Traits::kQBytes;
  const uint32_t ds_smem0 = do_smem0 + kStages * Traits::kQBytes;
  const uint32_t dq_smem0 = ds_smem0 + Traits::kDsBuffers * Traits::kDsBytes;
  const uint32_t p_smem = dq_smem0 + Traits::kDqSmemBytes;  // head-dim split
  const uint32_t row_stats0 = p_smem + Traits::kPBytes;
  const uint32_t bar0 = row_stats0 + kStages * Traits::kRowStatBytes;
  auto q_smem = [&](int stage) { return q_smem0 + stage * Traits::kQBytes; };
  auto do_smem = [&](int stage) { return do_smem0 + stage * Traits::kQBytes; };
  auto ds_smem = [&](int buf) { return ds_smem0 + buf * Traits::kDsBytes; };
  auto lse_smem = [&](int stage) { return row_stats0 + stage * Traits::kRowStatBytes; };
  auto dsum_smem = [&](int stage) { return lse_smem(stage) + kBlockM * 4; };
  const uint32_t kv_full = bar0;
  auto qdo_full = [&](int stage) { return bar0 + 8 * (1 + stage); };
  auto qdo_empty = [&](int stage) { return bar0 + 8 * (1 + kStages + stage); };
  // Consumer w's dQ buffer `buf` staged (dq_full) / read by the TMA (dq_empty).
  auto dq_full = [&](int w, int buf) { return bar0 + 8 * (1 + 2 * kStages + w * kDqBuffers + buf); };
  auto dq_empty = [&](int w, int buf) {
    return bar0 + 8 * (1 + 2 * kStages + (Traits::kConsumerWarpgroups + w) * kDqBuffers + buf);
  };
  // attn_mask kernels: per Q/dO stage, bit w = consumer w's keys need the mask
  // on that step (the loader writes it before qdo_full's arrive).
  auto mask_reads_slot = [&](int stage) {
    return bar0 + 8 * (1 + 2 * kStages + 2 * Traits::kConsumerWarpgroups * kDqBuffers) + 4 * stage;
  };
  // kWalkGroup: step i's m_block and (+4) g (BwdSm90StepWalk) in word pair
  // i % kStepWords, written by the loader before qdo_full's arrive of step i
  // (see the traits for why the pair is not overwritten before its readers,
  // the consumers and dQ writers of step i, have read it).
  auto step_word = [&](int i) {
    return mask_reads_slot(kStages) + 8 * (i % Traits::kStepWords);  // after the mask words
  };

  // Grid (key tile, head, batch), or (batch, key tile, head) for an attn_mask
  // that broadcasts over the batch (mask_blocks.cuh). The grid's head is the
  // query head, or with kWalkGroup the kv head, whose group the CTA walks
  // (query heads [h_first, h_first + walk_heads)).
  const bool batch_first = kHasAttnMask && attn_mask_grid_batch_first(params);
  const int grid_head = batch_first ? blockIdx.z : blockIdx.y;
  const int b = batch_first ? blockIdx.x : blockIdx.z;
  const int grid_block = batch_first ? blockIdx.y : blockIdx.x;
  const int group = params.heads / params.heads_k;
  const int h_k = kWalkGroup ? grid_head : grid_head / group;
  const int h_first = kWalkGroup ? h_k * group : grid_head;
  const int walk_heads = kWalkGroup ? group : 1;
  const SeqBounds seq = seq_bounds<kVarSeq>(params, b);
  const int n_tiles = (seq.seqlen_k + kBlockN - 1) / kBlockN;
  // Deterministic and causal (or with variants): the last key tile first (see
  // the dQ writer).
  const int n_block = (kIsCausal || kHasVariants) && params.deterministic
                          ? n_tiles - 1 - grid_block
                          : grid_block;
  if (n_block < 0 || n_block >= n_tiles) return;  // a shorter sequence of a varlen batch
  const int n0 = n_block * kBlockN;
  // Query tiles that see a key of this tile: causal, query m sees key n iff
  // n <= m + offset, so the first is the one holding m = n0 - offset. With
  // variants: those the window lets see one (possibly none).
  BwdSm90QueryTiles query_tiles;
  if constexpr (kHasVariants) {
    query_tiles = bwd_sm90_query_tiles<kBlockM, kBlockN>(make_window(params, seq), n0);
  } else {
    query_tiles = {kIsCausal ? max(0, n0 - seq.causal_offset) / kBlockM : 0,
                   (seq.seqlen_q + kBlockM - 1) / kBlockM};
  }
  if constexpr (kHasAttnMask) {
    // A boolean attn_mask's summary: query tiles at either end of which no
    // row attends to a key of this tile are dropped (not in the deterministic
    // mode, whose dQ order expects every tile of the window). kWalkGroup: the
    // heads of the walk share one range, so a tile stays where a row of any
    // of them attends (the others' steps there add zeros).
    if (params.attn_mask_blocks != nullptr && !params.deterministic) {
      // Summary blocks: kMaskBlock rows x 64 keys (one consumer's keys).
      const int c0 = n0 / 64, c1 = (min(n0 + kBlockN, seq.seqlen_k) - 1) / 64;
      auto attends = [&](int m) {
        const int r1 = (min((m + 1) * kBlockM, seq.seqlen_q) - 1) / kMaskBlock;
        uint32_t bits = 0;
        for (int g = 0; g < walk_heads; ++g) {
          for (int r = m * kBlockM / kMaskBlock; r <= r1; ++r) {
            for (int c = c0; c <= c1; ++c) bits |= attn_mask_block(params, b, h_first + g, r, c);
          }
        }
        return (bits & kMaskBlockAttends) != 0u;
      };
      while (query_tiles.end > query_tiles.begin && !attends(query_tiles.end - 1)) --query_tiles.end;
      while (query_tiles.begin < query_tiles.end && !attends(query_tiles.begin)) ++query_tiles.begin;
    }
  }
  const int m_begin = query_tiles.begin, m_end = query_tiles.end;
  const BwdSm90StepWalk<kWalkGroup> walk{
      m_begin, m_end, kWalkGroup ? walk_heads * max(0, m_end - m_begin) : 0};
  // Step i as the consumers and dQ writers see it (after the step's qdo_full
  // or dq_full wait): published by the loader with kWalkGroup, else as before
  // the walk.
  auto published_step = [&](int i) {
    using Step = typename BwdSm90StepWalk<kWalkGroup>::Step;
    if constexpr (kWalkGroup) {
      return Step{i, static_cast<int>(ld_shared_b32(step_word(i))),
                  static_cast<int>(ld_shared_b32(step_word(i) + 4))};
    } else {
      return Step{i, m_begin + i, 0};
    }
  };
  // Packed (varlen) tensors are one batch entry of total rows; this
  // sequence's rows start at row0 (params.h).
  const bool packed = kVarSeq && params.cu_seqlens_q != nullptr;
  const int tma_batch = packed ? 0 : b;
  const int q_row0 = static_cast<int>(seq.row0_q), k_row0 = static_cast<int>(seq.row0_k);
  // Broadcast from lane 0 so that ptxas sees a warp-uniform value: wgmmas
  // under a branch on it are then not serialised as in a divergent path.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(qdo_full(s), 1);
      mbar_init(qdo_empty(s), Traits::kQdoReleases);
    }
    for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) {
      for (int buf = 0; buf < kDqBuffers; ++buf) {
        mbar_init(dq_full(w, buf), 128);  // every thread of consumer w, after staging
        mbar_init(dq_empty(w, buf), 1);   // its writer, after the TMA read
      }
    }
    fence_barrier_init();
  }
  __syncthreads();

  // dQ chunk c of consumer w's step (stage, buf) goes out through shared
  // memory (see the traits): the key split's own buffers in turn, or consumer
  // w's column half of the step's Q tile (chunk 0) / dO tile (chunk 1), which
  // the 64-column chunks of those tiles hold contiguously (16 KB, 1024-byte
  // aligned).
  auto dq_buffer = [&](int w, int stage, int buf, int c) {
    if constexpr (Traits::kDqInQdoStage) {
      return (c == 0 ? q_smem(stage) : do_smem(stage)) + w * (kGradCols / 64) * kBlockM * 128;
    } else {
      return dq_smem0 + (w * kDqBuffers + buf) * Traits::kDqBufferBytes;
    }
  };
  constexpr int kDqCols = Traits::kDqCols, kDqRows = Traits::kDqRows;
  // First column of consumer w's dQ chunk c, and its first row within the step.
  auto dq_col0 = [&](int w, int c) {
    return (Traits::kDqByRows ? c : w * Traits::kDqChunks + c) * kDqCols;
  };
  auto dq_row0 = [&](int w) { return Traits::kDqByRows ? w * kDqRows : 0; };

  if (warpgroup == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (m_begin >= m_end) return;
    if (threadIdx.x == 0) {
      // ---- loader: K, V once, then Q, dO, lse, D of every step ----
      prefetch_tensor_map(&tmap_q);
      prefetch_tensor_map(&tmap_k);
      prefetch_tensor_map(&tmap_v);
      prefetch_tensor_map(&tmap_do);
      // The first head's padded lse (log2) rows (the next head's follow
      // seqlen_q_padded further); its D rows are dsum_offset further.
      const int64_t head_rows =
          (static_cast<int64_t>(b) * params.heads + h_first) * params.seqlen_q_padded;
      const float* row_stats_first = params.lse_log2_padded + head_rows;
      const int64_t dsum_offset = params.dsum_padded - params.lse_log2_padded;
      mbar_arrive_expect_tx(kv_full, 2 * Traits::kKVBytes);
      tma_load_tile<kChunks>(&tmap_k, k_smem, kBlockN, kv_full, k_row0 + n0, h_k, tma_batch);
      tma_load_tile<kChunks>(&tmap_v, v_smem, kBlockN, kv_full, k_row0 + n0, h_k, tma_batch);
      for (auto step = walk.first(); walk.more(step.i); walk.advance(step)) {
        const int i = step.i, h = h_first + step.g;
        const int stage = i % kStages;
        mbar_wait(qdo_empty(stage), ((i / kStages) & 1) ^ 1);
        const int m0 = step.m_block * kBlockM;
        const float* row_stats_head =
            row_stats_first + static_cast<int64_t>(step.g) * params.seqlen_q_padded;
        if constexpr (kWalkGroup) {  // published_step, before qdo_full's arrive
          st_shared_b32(step_word(i), step.m_block);
          st_shared_b32(step_word(i) + 4, step.g);
        }
        if constexpr (kHasAttnMask) {
          // Bit w: consumer w's 64 keys need the mask on this step (the
          // summary's blocks of kMaskBlock rows x 64 keys); all without one.
          uint32_t reads = 3u;
          if (params.attn_mask_blocks != nullptr) {
            // The step's row blocks: one, or two of 128-query steps (the
            // second only where it has rows).
            const int row0 = attn_mask_block_row(params, b, h, m0 / kMaskBlock);
            const int row1 = kBlockM > kMaskBlock && m0 + kMaskBlock < seq.seqlen_q
                                 ? row0 + params.attn_mask_block_strides.row
                                 : row0;
            reads = 0u;
#pragma unroll
            for (int w = 0; w < kBlockN / 64; ++w) {
              const int c = min(n0 / 64 + w, (seq.seqlen_k - 1) / 64);
              if ((attn_mask_block_at(params, row0, c) | attn_mask_block_at(params, row1, c)) &
                  kMaskBlockMasks) {
                reads |= 1u << w;
              }
            }
          }
          st_shared_b32(mask_reads_slot(stage), reads);  // before qdo_full's arrive
        }
        mbar_arrive_expect_tx(qdo_full(stage), 2 * Traits::kQBytes + Traits::kRowStatBytes);
        bulk_load(lse_smem(stage), row_stats_head + m0, kBlockM * 4, qdo_full(stage));
        bulk_load(dsum_smem(stage), row_stats_head + dsum_offset + m0, kBlockM * 4,
                  qdo_full(stage));
        tma_load_tile<kChunks>(&tmap_q, q_smem(stage), kBlockM, qdo_full(stage), q_row0 + m0, h,
                               tma_batch);
        tma_load_tile<kChunks>(&tmap_do, do_smem(stage), kBlockM, qdo_full(stage), q_row0 + m0, h,
                               tma_batch);
      }
    } else if (threadIdx.x == 32 || threadIdx.x == 64) {
      // ---- dQ writer of consumer w: TMA reduce-adds of its staged chunks ----
      // Deterministic mode: the key tiles add into a query tile's rows in a
      // fixed order, handed over through a counter per (query tile, consumer)
      // that the preprocess zeroed: the tile of rank r waits until r tiles have
      // added (their adds completed), adds, completes, and counts itself.
      // Without causal masking every key tile sees every query tile, and rank =
      // key tile. With it, query tile m is seen by key tiles 0..last(m) and
      // rank = last(m) - key tile: the last tile, which starts with m, comes
      // first. With variants, query tile m is seen by the key tiles from
      // key_begin(its first row) / kBlockN to bwd_sm90_key_tiles_end(m) - 1
      // (exactly those that visit it, bwd_sm90_variants.cuh) and rank =
      // end - 1 - key tile, last first as with causal. A CTA only ever waits
      // for tiles of smaller grid_block (the grid launches causal and variant
      // tiles last-first; a batch-first grid keeps the key tiles of one
      // (b, h) in that order), which started before it, so the order cannot
      // deadlock. kWalkGroup: the counters are those of the step's query head
      // h, and the key tiles that add into (h, m) are the CTAs of (b, h_k)
      // with the same ranks for every h of the group. Each CTA walks the heads
      // in the same order and still waits only for CTAs of smaller grid_block
      // (whose own waits, at any of their steps, again go to smaller ones), so
      // the argument holds step by step across heads.
      const int w = threadIdx.x / 32 - 1;
      prefetch_tensor_map(&tmap_dq_accum);
      // The first head's accumulator slice and counters; the next heads'
      // follow (slices and counters of one batch entry are per head).
      const int dq_slice0 = (packed ? 0 : b * params.heads) + h_first;  // make_dq_accum_tensor_map
      int* order = params.deterministic
                       ? params.dq_semaphore +
                             (static_cast<int64_t>(b) * params.heads + h_first) *
                                 (params.seqlen_q_padded / kBlockM) * Traits::kConsumerWarpgroups +
                             w
                       : nullptr;
      for (int i = 0; walk.more(i); ++i) {
        const int stage = i % kStages, buf = i % kDqBuffers;
        mbar_wait(dq_full(w, buf), (i / kDqBuffers) & 1);
        const auto step = published_step(i);
        const int m_block = step.m_block, dq_slice = dq_slice0 + step.g;
        int* turn = nullptr;
        if (params.deterministic) {
          // (The offset fits in 32 bits, as the step count does: a group's
          // counters number heads x seqlen_q_padded / 32 at most, 2^31 of
          // which would take a Q of terabytes.)
          turn = order + (step.g * (params.seqlen_q_padded / kBlockM) + m_block) *
                             Traits::kConsumerWarpgroups;
          int rank;
          if constexpr (kHasVariants) {
            rank = bwd_sm90_key_tiles_end<kBlockM, kBlockN>(make_window(params, seq), m_block) - 1 -
                   n_block;
          } else {
            const int last =
                min(n_tiles - 1, (m_block * kBlockM + kBlockM - 1 + seq.causal_offset) / kBlockN);
            rank = kIsCausal ? last - n_block : n_block;
          }
          wait_flag_equal(turn, rank);
        }
#pragma unroll
        for (int c = 0; c < Traits::kDqChunks; ++c) {
#pragma unroll
          for (int box = 0; box < kDqCols / Traits::kDqBoxCols; ++box) {
            tma_reduce_add_3d(&tmap_dq_accum, dq_buffer(w, stage, buf, c) + box * kDqRows * 128,
                              dq_col0(w, c) + box * Traits::kDqBoxCols,
                              q_row0 + m_block * kBlockM + dq_row0(w), dq_slice);
          }
        }
        bulk_commit_group();
        bulk_wait_group_read<0>();
        // The buffer may be written again (head-dim split: the stage reloaded),
        // before the adds complete: the consumers and the loader go on while
        // a deterministic turn is handed over.
        mbar_arrive(Traits::kDqInQdoStage ? qdo_empty(stage) : dq_empty(w, buf));
        if (turn != nullptr) {
          bulk_wait_group<0>();
          release_flag_increment(turn);
        }
      }
      bulk_wait_group<0>();  // the CTA's adds are done before it retires
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int wg = warpgroup - 1;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;
  // This warpgroup's 64 keys (rows of S^T, dK, dV) within the tile, and its
  // first dK / dV column.
  const int wg_key0 = Traits::kSplitHeadDim ? 0 : wg * 64;
  static_assert(Traits::kSplitHeadDim ? kBlockN == 64 : kBlockN == 64 * Traits::kConsumerWarpgroups,
                "each consumer's keys are one 64-key block of the attn_mask summary");
  const int wg_col0 = Traits::kSplitHeadDim ? wg * kGradCols : 0;

  // Accumulator layout of m64nN (per warp 16 rows, as mma.sync m16n8):
  // acc[j][e], lane = 4g + q: e = 0,1 -> row g, cols 8j + 2q + {0,1};
  // e = 2,3 -> row g + 8. Rows are keys here, columns queries (or head dim).
  float dk[kGradCols / 8][4], dv[kGradCols / 8][4];
#pragma unroll
  for (int j = 0; j < kGradCols / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  }
  const int key_row = wg_key0 + warp * 16 + lane / 4;  // + 8 * (e / 2), within the tile
  // With variants: the Mask of this sequence and the step's query head h (its
  // own ALiBi slope and attn_mask slice; kWalkGroup: h changes along the walk)
  // and the score modifiers, made where used: most fields stay in the
  // constant bank, and none holds a register across the step's GEMMs (the
  // consumers are at the register limit).
  auto make_variants = [&](int h) { return ScoreVariants::make(params, seq, b, h); };

  // X^T = A B^T for K-major A (this warpgroup's 64 keys) and B (queries):
  // kHeadDim / 16 k-steps, 32 bytes apart inside a 64-column chunk.
  auto issue_transposed_scores = [&](float (&acc)[kBlockM / 8][4], uint32_t a_tile,
                                     uint32_t b_tile) {
    const uint32_t a_rows = a_tile + wg_key0 * 128;
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
  // acc += A^T B[:, this warpgroup's columns] with A^T from registers (query
  // k-steps of 16 rows = 2048 B of the MN-major B tile; its head-dim chunks
  // are kBlockM * 128 B apart).
  auto issue_grad_update = [&](float (&acc)[kGradCols / 8][4],
                               const uint32_t (&a)[kBlockM / 16][4], uint32_t b_tile) {
    const uint32_t b_cols = b_tile + (wg_col0 / 64) * kBlockM * 128;
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint64_t desc_b = smem_desc_sw128(b_cols + kk * 2048, kBlockM * 128, 1024);
      WgmmaOps<T, kGradCols>::rs_mnmajor(&acc[0][0], a[kk], desc_b, 1);
    }
  };
  // dS^T (kBlockN keys x kBlockM queries, queries contiguous) in shared
  // memory, in the swizzled layout the dQ wgmma reads: 64-query chunks of
  // [kBlockN rows x 128 B], 16-byte unit u of row r at unit u ^ (r % 8). A
  // quad touches one unit per row, the 8 rows of a warp 8 different units:
  // conflict-free. A-fragment word (kk, w) of a thread holds row
  // key_row + 8 (w % 2), chunk kk / 4, unit 2 (kk % 4) + w / 2.
  auto ds_word_addr = [&](uint32_t ds_buf, int kk, int w) {
    const int r = key_row + 8 * (w % 2);
    return ds_buf + (kk / 4) * kBlockN * 128 + r * 128 + (((2 * (kk % 4) + w / 2) ^ (r % 8)) * 16) +
           (lane % 4) * 4;
  };
  // The key split stores a fragment with one stmatrix.x4 (a quarter of the
  // shared-memory instructions; ncu showed our consumers stalled on a full MIO
  // queue, cuDNN's not): lane l addresses row l % 8 of 8x8 matrix l / 8, which
  // receives words w = l / 8 (rows + 8 (w % 2), unit + w / 2). The head-dim
  // split keeps 32-bit stores and loads: there stmatrix / ldmatrix measured
  // 1-6% slower (H100, 6 configs, same process).
  auto ds_row_addr = [&](uint32_t ds_buf, int kk) {
    const int r = wg_key0 + warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
    return ds_buf + (kk / 4) * kBlockN * 128 + r * 128 + (((2 * (kk % 4) + lane / 16) ^ (r % 8)) * 16);
  };
  auto store_ds = [&](uint32_t ds_buf, const uint32_t (&ds_frag)[kBlockM / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      if constexpr (!Traits::kSplitHeadDim) {
        stmatrix_x4(ds_row_addr(ds_buf, kk), ds_frag[kk]);
      } else {
#pragma unroll
        for (int w = 0; w < 4; ++w) st_shared_b32(ds_word_addr(ds_buf, kk, w), ds_frag[kk][w]);
      }
    }
  };
  auto load_ds = [&](uint32_t ds_buf, uint32_t (&ds_frag)[kBlockM / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
      for (int w = 0; w < 4; ++w) ds_frag[kk][w] = ld_shared_b32(ds_word_addr(ds_buf, kk, w));
    }
  };
  // The step's lse (log2, +inf where P = 0) or D for the thread's accumulator
  // columns 8j + 2q + {0, 1}, from the stage's row statistics: with 64-query
  // steps preloaded while the score GEMMs run (RowStat), with 128-query steps
  // read where used (another 2 x 32 registers beside S^T and dP^T would spill;
  // so does the variant kernel of the key split: ptxas -v, 32 registers).
  constexpr bool kPreloadRowStats = kBlockM == 64 && (!kHasVariants || Traits::kSplitHeadDim);
  using RowStat = float[kPreloadRowStats ? kBlockM / 8 : 1][2];
  auto load_row_stat = [&](uint32_t row_stat, RowStat& out) {
    if constexpr (kPreloadRowStats) {
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        ld_shared_v2_f32(row_stat + (8 * j + 2 * (lane % 4)) * 4, out[j][0], out[j][1]);
      }
    }
  };
  auto row_stat_pair = [&](uint32_t row_stat, const RowStat& pre, int j, float (&out)[2]) {
    if constexpr (kPreloadRowStats) {
      out[0] = pre[j][0];
      out[1] = pre[j][1];
    } else {
      ld_shared_v2_f32(row_stat + (8 * j + 2 * (lane % 4)) * 4, out[0], out[1]);
    }
  };
  // S^T -> P^T in place. Causal: only tiles crossing the diagonal need the
  // per-element test. Variants: every tile with score modifiers, and those
  // the window cuts for this warpgroup's keys, take bwd_sm90_variant_scores
  // first (then P = exp2(score * unit - lse), unit from it); softcapped: the
  // caller has applied the softcap's tanh (and kept df/ds). Dropout: P^T comes
  // out times the dropout scale, the row statistics being lse - log2(scale)
  // and D / scale (bwd_preprocess.cuh), so no element is multiplied by it.
  // staged_mask: the warp's staged attn_mask block (key split, 16-bit masks;
  // 0 = read per element), see bwd_sm90_stage_attn_mask.
  auto scores_to_probs = [&](int h, int m_block, int stage, float (&s)[kBlockM / 8][4],
                             uint32_t lse_row_stat, const RowStat& lse_pre, bool softcapped,
                             uint32_t staged_mask = 0) {
    const int query_base = m_block * kBlockM + 2 * (lane % 4);  // + 8j + e % 2
    float scale_log2 = params.scale_log2;
    if constexpr (kHasVariants) {
      const ScoreVariants variants = make_variants(h);
      const bool mask_elements =
          !bwd_sm90_keys_inside_window<kBlockM, 64>(variants.mask, m_block, n0 + wg_key0);
      // attn_mask: whether this consumer's keys need the mask on this step
      // (the loader's word, from the mask's block summary).
      bool read_attn_mask = true;
      if constexpr (kHasAttnMask) {
        read_attn_mask = ((ld_shared_b32(mask_reads_slot(stage)) >> (wg_key0 / 64)) & 1u) != 0u;
      }
      if (variants.mask.has_score_mod() || mask_elements) {
        scale_log2 = bwd_sm90_variant_scores<kBlockM, kHasAttnMask>(
            s, variants, query_base, n0 + key_row, softcapped, mask_elements,
            read_attn_mask && staged_mask == 0);
        if constexpr (kHasAttnMask && !Traits::kSplitHeadDim) {
          if (staged_mask != 0) {
            bwd_sm90_add_staged_attn_mask<kBlockM, kBlockN * 128>(
                s, staged_mask, variants.mask.bias_type, 1.4426950408889634f / scale_log2, lane);
          }
        }
      }
    }
    const bool needs_mask = kIsCausal && n0 + kBlockN - 1 > m_block * kBlockM + seq.causal_offset;
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      float lse_log2[2];
      row_stat_pair(lse_row_stat, lse_pre, j, lse_log2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[j][e] * scale_log2 - lse_log2[e % 2]);
        if (needs_mask && n0 + key_row + 8 * (e / 2) > query_base + 8 * j + e % 2 + seq.causal_offset) {
          p = 0.f;
        }
        s[j][e] = p;
      }
    }
  };
  // dQ_i (64 queries x this warpgroup's dQ columns) = dS K, kDqCols columns
  // (chunk c) at a time: A = dS^T read transposed (k-steps of 16 keys = 2048
  // B), B = K read transposed from column dq_col0(c) of its 64-column chunk
  // (32 columns: +64 B inside the 128-byte swizzle row, as the K-major k-steps
  // step by 32 B; the swizzle applies to the absolute address). Issued and
  // committed here; staged and sent after the wait.
  auto issue_dq_chunk = [&](float (&dq)[kDqCols / 8][4], uint32_t ds_buf, int c) {
    const int col0 = dq_col0(wg, c);
    const uint32_t k_cols = k_smem + (col0 / 64) * kBlockN * 128 + (col0 % 64) * 2;
    ds_buf += (dq_row0(wg) / 64) * kBlockN * 128;  // this consumer's query chunk of dS^T
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t desc_a = smem_desc_sw128(ds_buf + kk * 2048, kBlockM * 128, 1024);
      const uint64_t desc_b = smem_desc_sw128(k_cols + kk * 2048, kBlockN * 128, 1024);
      WgmmaOps<T, kDqCols>::ss_mnmajor(&dq[0][0], desc_a, desc_b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  auto fence_grads = [&]() {
    fence_registers(reinterpret_cast<float(&)[kGradCols / 2]>(dk));
    fence_registers(reinterpret_cast<float(&)[kGradCols / 2]>(dv));
  };
  constexpr int kDqBoxes = kDqCols / Traits::kDqBoxCols;
  // A chunk is kDqCols / 32 boxes of [64 rows x 128 B] in the 128-byte swizzle
  // of the dQ tensor map: 16-byte unit u of row r sits at unit u ^ (r % 8).
  // The float2 of (row r, columns 8j + 2q) is unit 2 (j % 4) + q / 2, byte
  // 8 (q % 2): for one j a warp's 8 rows x 4 quads cover all 32 banks twice.
  auto stage_dq = [&](uint32_t buf, const float (&dq)[kDqCols / 8][4]) {
#pragma unroll
    for (int j = 0; j < kDqCols / 8; ++j) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = warp * 16 + lane / 4 + 8 * hh;
        const int unit = 2 * (j % 4) + (lane % 4) / 2;
        const uint32_t addr = buf + (j / 4) * kDqRows * 128 + r * 128 + ((unit ^ (r % 8)) * 16) +
                              (lane % 2) * 8;
        st_shared_v2_f32(addr, dq[j][2 * hh], dq[j][2 * hh + 1]);
      }
    }
  };
  // Staged dQ chunks of step i go to this consumer's dQ writer (dq_full).
  auto hand_dq_to_writer = [&](int i) {
    fence_proxy_async_smem();
    mbar_arrive(dq_full(wg, i % kDqBuffers));
  };
  // Head-dim split: every chunk in turn, issued after the step's dK. The
  // first wait also retires the step's dV / dK products; the chunks are staged
  // in the step's Q/dO stage, which the writer releases after the TMA read.
  auto accumulate_dq_in_stage = [&](uint32_t ds_buf, int stage, int i) {
#pragma unroll
    for (int c = 0; c < Traits::kDqChunks; ++c) {
      float dq[kDqCols / 8][4];
      issue_dq_chunk(dq, ds_buf, c);
      wgmma_wait<0>();
      fence_registers(reinterpret_cast<float(&)[kDqCols / 2]>(dq));
      fence_grads();
      if (c == 0) mbar_arrive(qdo_empty(stage));
      stage_dq(dq_buffer(wg, stage, 0, c), dq);
    }
    hand_dq_to_writer(i);
  };

  // Packed sequences and key padding: rows of a tile past the sequence hold
  // other sequences' rows (or unused cache rows) instead of TMA's zeros.
  // They are zeroed in shared memory, so that every product sees what it
  // sees in a padded batch: P = 0 for padded queries (lse = +inf), and zero
  // contributions from padded keys (their dK / dV rows are not written).
  // Rows [row_begin, kRows) of every 64-column chunk, whole 128-byte rows (so
  // the swizzle does not matter), by the 256 consumer threads; the caller
  // syncs them (kZeroedBarrier) before any wgmma reads the tile.
  constexpr int kZeroedBarrier = 5;
  auto zero_tile_rows = [&](uint32_t tile, int tile_rows, int row_begin) {
    zero_swizzled_tile_rows<kChunks>(tile, tile_rows, row_begin, wg * 128 + tid, 256);
  };
  auto zero_rows_past_sequence = [&](int m_block, int stage) {
    if (packed && (m_block + 1) * kBlockM > seq.seqlen_q) {
      zero_tile_rows(q_smem(stage), kBlockM, seq.seqlen_q - m_block * kBlockM);
      zero_tile_rows(do_smem(stage), kBlockM, seq.seqlen_q - m_block * kBlockM);
      fence_proxy_async_smem();
      named_barrier_sync(kZeroedBarrier, 256);
    }
  };

  if (m_begin < m_end) {
    mbar_wait(kv_full, 0);
    if (kVarSeq && n0 + kBlockN > seq.seqlen_k) {
      zero_tile_rows(k_smem, kBlockN, seq.seqlen_k - n0);
      zero_tile_rows(v_smem, kBlockN, seq.seqlen_k - n0);
      fence_proxy_async_smem();
      named_barrier_sync(kZeroedBarrier, 256);
    }
  }
  if constexpr (!Traits::kSplitHeadDim) {
    // ---- key split: each consumer runs the whole step for its 64 keys ----
    // Every wgmma is waited for in the iteration that issued it: one left in
    // flight across the loop's back edge, or waited for under a branch, made
    // ptxas serialise all of them.
    constexpr int kDsBarrier = 1;  // both consumers' dS^T written
    for (int i = 0; walk.more(i); ++i) {
      const int stage = i % kStages;
      mbar_wait(qdo_full(stage), (i / kStages) & 1);
      const auto step = published_step(i);
      const int m_block = step.m_block, h = h_first + step.g;
      if constexpr (kVarSeq) zero_rows_past_sequence(m_block, stage);

      float s[kBlockM / 8][4], dp[kBlockM / 8][4];
      wgmma_fence();
      issue_transposed_scores(s, k_smem, q_smem(stage));
      issue_transposed_scores(dp, v_smem, do_smem(stage));
      // A 16-bit attn_mask: the warp's block into its rows of this step's dS^T
      // buffer while the GEMMs run (bwd_sm90_stage_attn_mask).
      uint32_t staged_mask = 0;
      if constexpr (kHasAttnMask) {
        const Mask mask = make_variants(h).mask;
        const bool reads = ((ld_shared_b32(mask_reads_slot(stage)) >> (wg_key0 / 64)) & 1u) != 0u;
        if (reads && attn_mask_stageable(mask)) {  // uniform
          staged_mask = ds_smem(i % 2) + (wg_key0 + warp * 16) * 128;
          bwd_sm90_stage_attn_mask<kBlockM, kBlockN * 128>(staged_mask, mask, m_block * kBlockM,
                                                           n0 + wg_key0 + warp * 16, lane);
        }
      }
      RowStat lse_log2, dsum;  // while the GEMMs run
      load_row_stat(lse_smem(stage), lse_log2);
      load_row_stat(dsum_smem(stage), dsum);
      // Dropout: the keep bits of the warp's 16 keys, also while the GEMMs run.
      const bool dropout_on = kHasVariants && has_dropout(params);
      BwdSm90DropoutBits<kBlockM> keep = 0;
      if constexpr (kHasVariants) {
        if (dropout_on) {  // uniform
          keep = bwd_sm90_dropout_bits<kBlockM>(make_dropout(params, b, h), n0 + wg_key0 + warp * 16,
                                                m_block * kBlockM, lane);
        }
      }

      wgmma_wait<1>();
      fence_registers(reinterpret_cast<float(&)[kBlockM / 2]>(s));
      // Softcap: P^T after dP^T, which carries df/ds = 1 - tanh^2 from the
      // softcap to dS^T = P^T o ((dP^T - D) o df/ds) (no registers held for it).
      const bool softcap = kHasVariants && params.softcap > 0.f;
      if (!softcap) {
        scores_to_probs(h, m_block, stage, s, lse_smem(stage), lse_log2, false, staged_mask);
      }
      wgmma_wait<0>();
      fence_registers(reinterpret_cast<float(&)[kBlockM / 2]>(dp));
      // Dropout: dS^T = P^T o (dP^T o Z^T - D) (o df/ds), and dV takes P^T o Z^T,
      // with Z = keep * scale and P^T already times the scale (scores_to_probs):
      // dS^T = P^T o (dP^T o keep - D / scale), dV's operand P^T o keep.
      if (softcap) {
        if constexpr (kHasVariants) {
          if (dropout_on) bwd_sm90_drop<kBlockM>(dp, keep);
        }
        const ScoreVariants variants = make_variants(h);
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          float d[2];
          row_stat_pair(dsum_smem(stage), dsum, j, d);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float dfds;  // scores_to_probs applies softcap * log2(e)
            s[j][e] = softcap_score(s[j][e], variants.softcap_in, 1.f, &dfds, TanhApprox());
            dp[j][e] = (dp[j][e] - d[e % 2]) * dfds;
          }
        }
        scores_to_probs(h, m_block, stage, s, lse_smem(stage), lse_log2, true, staged_mask);
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) dp[j][e] *= s[j][e];
        }
        if constexpr (kHasVariants) {
          if (dropout_on) bwd_sm90_drop<kBlockM>(s, keep);
        }
      } else if (dropout_on) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          float d[2];
          row_stat_pair(dsum_smem(stage), dsum, j, d);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int bit = bwd_sm90_dropout_bit(j, e);
            dp[j][e] = s[j][e] * (dropout_keep_or_zero(dp[j][e], keep, bit) - d[e % 2]);
            s[j][e] = dropout_keep_or_zero(s[j][e], keep, bit);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          float d[2];
          row_stat_pair(dsum_smem(stage), dsum, j, d);
#pragma unroll
          for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - d[e % 2]);
        }
      }
      uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
      accumulators_to_a_fragments<T, kBlockM>(s, p_frag);
      accumulators_to_a_fragments<T, kBlockM>(dp, ds_frag);

      // dV, then (once both consumers' dS^T is in shared memory) dQ before
      // dK: the dQ staging waits only for dQ and runs under dK's wgmma.
      wgmma_fence();
      issue_grad_update(dv, p_frag, do_smem(stage));
      wgmma_commit();
      const uint32_t ds_buf = ds_smem(i % 2);
      store_ds(ds_buf, ds_frag);
      fence_proxy_async_smem();
      named_barrier_sync(kDsBarrier, 256);
      float dq[kDqCols / 8][4];
      issue_dq_chunk(dq, ds_buf, 0);
      issue_grad_update(dk, ds_frag, q_smem(stage));
      wgmma_commit();
      wgmma_wait<1>();  // dV, dQ
      fence_registers(reinterpret_cast<float(&)[kDqCols / 2]>(dq));
      const int buf = i % kDqBuffers;
      // The buffer's previous chunk (step i - kDqBuffers) has been read.
      mbar_wait(dq_empty(wg, buf), ((i / kDqBuffers) & 1) ^ 1);
      stage_dq(dq_buffer(wg, stage, buf, 0), dq);
      hand_dq_to_writer(i);
      wgmma_wait<0>();  // dK
      fence_grads();
      mbar_arrive(qdo_empty(stage));
      fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(p_frag));
      fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(ds_frag));
    }
  } else {
    // ---- head-dim split: consumer 0 computes P^T, consumer 1 dP^T and dS^T ----
    // Every buffer reuse is separated by a bar.sync of both consumers: P^T of
    // step i + 1 is written after kDsReady of step i (consumer 1 has read P^T
    // of step i), dS^T of step i + 2 (the buffer of step i) after kPReady of
    // step i + 2 (consumer 0 has read dS^T of step i and waited for its dQ).
    // kPReady as bar.arrive for consumer 0 measured no faster, and
    // compute-sanitizer racecheck flagged the dS^T reads under it. Both
    // barriers are single instructions outside the warpgroup branches.
    constexpr int kPReady = 1, kDsReady = 2;
    const uint32_t p_slot = p_smem + tid * 16;  // + q * 128 * 16 for float4 q
    for (int i = 0; walk.more(i); ++i) {
      const int stage = i % kStages;
      mbar_wait(qdo_full(stage), (i / kStages) & 1);
      const auto step = published_step(i);
      const int m_block = step.m_block, h = h_first + step.g;
      if constexpr (kVarSeq) zero_rows_past_sequence(m_block, stage);
      const uint32_t ds_buf = ds_smem(i % 2);

      // The wgmmas stay outside the warpgroup branches (operands selected
      // instead): inside a divergent branch ptxas serialises them.
      float acc[kBlockM / 8][4];  // consumer 0: S^T -> P^T; consumer 1: dP^T -> dS^T
      wgmma_fence();
      issue_transposed_scores(acc, wg == 0 ? k_smem : v_smem, wg == 0 ? q_smem(stage) : do_smem(stage));
      static_assert(kPreloadRowStats, "the head-dim split takes 64-query steps");
      RowStat row_terms;  // consumer 0: lse (log2); consumer 1: D
      load_row_stat(wg == 0 ? lse_smem(stage) : dsum_smem(stage), row_terms);
      // Dropout: consumer 0's keep bits while its S^T GEMM runs (consumer 1
      // reads them from the sign bits of the fp32 P^T it is handed).
      const bool dropout_on = kHasVariants && has_dropout(params);
      BwdSm90DropoutBits<kBlockM> keep = 0;
      if constexpr (kHasVariants) {
        if (dropout_on && wg == 0) {  // uniform per warp
          keep = bwd_sm90_dropout_bits<kBlockM>(make_dropout(params, b, h), n0 + warp * 16,
                                                m_block * kBlockM, lane);
        }
      }
      wgmma_wait<0>();
      fence_registers(reinterpret_cast<float(&)[kBlockM / 2]>(acc));

      uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
      // Softcap: consumer 0 hands over P^T o df/ds (for dS^T) in the fp32 slots
      // and P^T (for consumer 1's dV) as 16-bit A fragments in this step's dS^T
      // buffer: the same thread of consumer 1 reads the same words (key_row
      // does not depend on the consumer here), then writes dS^T over them. The
      // buffer's last readers (step i - 2's dQ products) finished before
      // kDsReady of step i - 1.
      const bool softcap = kHasVariants && params.softcap > 0.f;
      if (wg == 0) {
        if (softcap) {
          // df/ds parked in the thread's own fp32 slots until P^T is known
          // (dropout: marked, so that the keep bits die here; P^T o df/ds >= 0
          // then carries the mark).
          const ScoreVariants variants = make_variants(h);
#pragma unroll
          for (int q = 0; q < kBlockM / 8; ++q) {
            float dfds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              // scores_to_probs applies softcap * log2(e)
              acc[q][e] = softcap_score(acc[q][e], variants.softcap_in, 1.f, &dfds[e],
                                        TanhApprox());
              if (dropout_on) {
                const bool kept = dropout_keep_bit(keep, bwd_sm90_dropout_bit(q, e));
                dfds[e] = bwd_sm90_mark_dropped(dfds[e], kept);
              }
            }
            st_shared_v4_f32(p_slot + q * 128 * 16, dfds[0], dfds[1], dfds[2], dfds[3]);
          }
          scores_to_probs(h, m_block, stage, acc, lse_smem(stage), row_terms, true);
#pragma unroll
          for (int q = 0; q < kBlockM / 8; ++q) {
            float dfds[4];
            ld_shared_v4_f32(p_slot + q * 128 * 16, dfds[0], dfds[1], dfds[2], dfds[3]);
            st_shared_v4_f32(p_slot + q * 128 * 16, acc[q][0] * dfds[0], acc[q][1] * dfds[1],
                             acc[q][2] * dfds[2], acc[q][3] * dfds[3]);
            // Dropout: consumer 1's dV operand is P^T o Z^T.
            if (dropout_on) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                acc[q][e] = bwd_sm90_is_dropped(dfds[e]) ? 0.f : acc[q][e];
              }
            }
          }
          accumulators_to_a_fragments<T, kBlockM>(acc, p_frag);
          store_ds(ds_buf, p_frag);
        } else {
          scores_to_probs(h, m_block, stage, acc, lse_smem(stage), row_terms, false);
          if constexpr (kHasVariants) {
            if (dropout_on) {
#pragma unroll
              for (int q = 0; q < kBlockM / 8; ++q) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const bool kept = dropout_keep_bit(keep, bwd_sm90_dropout_bit(q, e));
                  acc[q][e] = bwd_sm90_mark_dropped(acc[q][e], kept);
                }
              }
            }
          }
#pragma unroll
          for (int q = 0; q < kBlockM / 8; ++q) {
            st_shared_v4_f32(p_slot + q * 128 * 16, acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
          }
          // Dropout: this consumer's dV operand is P^T o Z^T (the marked
          // elements are the dropped ones, which become 0).
          if constexpr (kHasVariants) {
            if (dropout_on) bwd_sm90_drop<kBlockM>(acc, keep);
          }
        }
      }
      // One barrier instruction for both consumers: the same named barrier
      // synced from two branches was flagged by compute-sanitizer synccheck.
      named_barrier_sync(kPReady, 256);
      if (wg == 0) {
        accumulators_to_a_fragments<T, kBlockM>(acc, p_frag);
      } else {
        float p[kBlockM / 8][4];  // P^T (softcap: P^T o df/ds)
#pragma unroll
        for (int q = 0; q < kBlockM / 8; ++q) {
          ld_shared_v4_f32(p_slot + q * 128 * 16, p[q][0], p[q][1], p[q][2], p[q][3]);
        }
        if (dropout_on) {
          // Z from the sign bits: dS^T = P^T o (dP^T o keep - D / scale), and
          // the dV operand P^T o keep (P^T times the scale: scores_to_probs;
          // softcap: consumer 0's 16-bit fragments instead).
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const bool dropped = bwd_sm90_is_dropped(p[j][e]);
              const float pa = fabsf(p[j][e]);
              const float p_kept = dropped ? 0.f : pa;
              acc[j][e] = p_kept * acc[j][e] - pa * row_terms[j][e % 2];
              p[j][e] = p_kept;
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = p[j][e] * (acc[j][e] - row_terms[j][e % 2]);
          }
        }
        if (softcap) {
          load_ds(ds_buf, p_frag);
        } else {
          accumulators_to_a_fragments<T, kBlockM>(p, p_frag);
        }
        accumulators_to_a_fragments<T, kBlockM>(acc, ds_frag);
        store_ds(ds_buf, ds_frag);
        fence_proxy_async_smem();
      }
      wgmma_fence();
      issue_grad_update(dv, p_frag, do_smem(stage));
      wgmma_commit();
      named_barrier_sync(kDsReady, 256);
      if (wg == 0) {
        load_ds(ds_buf, ds_frag);
      }
      wgmma_fence();
      issue_grad_update(dk, ds_frag, q_smem(stage));
      wgmma_commit();
      accumulate_dq_in_stage(ds_buf, stage, i);
      fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(p_frag));
      fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(ds_frag));
    }
  }

  // ---------------- epilogue ----------------
  // dK = softmax_scale * sum dS^T Q; keys past seqlen_k and padded head-dim
  // columns are not written. Keys no query sees get zeros. The gradients'
  // head: with kWalkGroup the kv head (the group is summed above), else the
  // query head (GQA there: per query head, summed by the op layer).
  const int grad_head = kWalkGroup ? h_k : h_first;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + key_row + 8 * hh;
    const bool key_ok = key < seq.seqlen_k;
    const int64_t row = k_row0 + (key_ok ? key : 0);
    T* dk_row = static_cast<T*>(params.dk) + row_offset(params.dk_strides, b, grad_head, row);
    T* dv_row = static_cast<T*>(params.dv) + row_offset(params.dv_strides, b, grad_head, row);
    store_accumulator_row<T, kGradCols>(dk_row, dk, hh, params.softmax_scale, wg_col0,
                                        params.head_dim, key_ok, lane);
    store_accumulator_row<T, kGradCols>(dv_row, dv, hh, 1.f, wg_col0, params.head_dim, key_ok,
                                        lane);
  }
#endif
}

}  // namespace cuda
}  // namespace flash_attn_ext
