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
//   rows: 128 at D = 64, 80 at D = 128 for plain calls with the flat dQ
//   accumulator, causal ones from 4096 rows on (dQ then computed transposed,
//   bwd_sm90_traits.cuh, bwd_sm90.h bwd_sm90_flat_dq_rows), else 64):
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
// Files: this one holds the kernel: the CTA's coordinates and query tiles,
// the loader's step loop and the consumers' step loops (which product when,
// the waits and barriers). Its pieces, by concern:
//   bwd_sm90_traits.cuh    tile shapes, shared-memory layout, register budget
//   bwd_sm90_smem.cuh      BwdSm90Smem: shared-memory addresses, mbarriers,
//                          the words the loader publishes, dQ staging buffers
//   bwd_sm90_steps.cuh     BwdSm90StepWalk: the order of the CTA's steps
//   bwd_sm90_producer.cuh  the loader's attn_mask word, the dQ writers
//   bwd_sm90_mainloop.cuh  BwdSm90Consumer: the consumers' wgmmas, dS^T and
//                          dQ staging, rows zeroed past a sequence
//   bwd_sm90_softmax.cuh   BwdSm90Softmax: row statistics, S^T -> P^T
//   bwd_sm90_epilogue.cuh  dK, dV to global memory
//   bwd_sm90_variants.cuh  the variants' tile ranges, masks and dropout bits
// The helpers take the kernel's scalars by reference (the structs hold
// references), as its lambdas captured them; by value, or with the loader's
// loop in a function, they compiled to different SASS (registers assigned
// otherwise; in an attn_mask kernel, more spills).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include "../../params.h"
#include "../common/fwd_softmax.cuh"
#include "../common/ptx.cuh"
#include "bwd_sm90_epilogue.cuh"
#include "bwd_sm90_mainloop.cuh"
#include "bwd_sm90_producer.cuh"
#include "bwd_sm90_smem.cuh"
#include "bwd_sm90_softmax.cuh"
#include "bwd_sm90_steps.cuh"
#include "bwd_sm90_traits.cuh"
#include "bwd_sm90_variants.cuh"
#include "sm90_primitives.cuh"
#include "wgmma_ops.cuh"

namespace flash_attn_ext {
namespace cuda {

// kFlatDq: the flat dQ accumulator (bwd_sm90.h bwd_sm90_flat_dq).
template <typename Traits, bool kIsCausal, bool kVarSeq, bool kHasVariants = false,
          bool kHasAttnMask = false, bool kWalkGroup = false, bool kFlatDq = false>
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
  constexpr int kStages = Traits::kStages;
  constexpr int kDqBuffers = Traits::kDqBuffers;
  constexpr int kChunks = Traits::kChunks;
  constexpr int kChunksV = Traits::kChunksV;
  using namespace sm90;
  static_assert(!Traits::kDqTransposed || (kFlatDq && !kHasVariants),
                "80-query steps: plain kernels with the flat dQ accumulator");

  extern __shared__ uint8_t smem_raw[];
  const BwdSm90Smem<Traits> smem(smem_raw);

  // Grid (key tile, head, batch), or (batch, key tile, head) for an attn_mask
  // that broadcasts over the batch (mask_blocks.cuh). The grid's head is the
  // query head, or with kWalkGroup the kv head, whose group the CTA walks
  // (query heads [h_first, h_first + walk_heads)). Packed sequences keep the
  // padded grid (the longest sequence's key tiles for every sequence; the
  // CTAs past a sequence exit here): one CTA per (sequence, key tile) that
  // exists, longest sequences first, measured no faster (docs/PERFORMANCE.md,
  // "Varlen: compact grids").
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
  // the dQ writer, bwd_sm90_producer.cuh).
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
            for (int c = c0; c <= c1; ++c) {
              bits |= attn_mask_block(params, b, h_first + g, r, c);
            }
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
  // Packed (varlen) tensors are one batch entry of total rows; this
  // sequence's rows start at row0 (params.h).
  const bool packed = kVarSeq && params.cu_seqlens_q != nullptr;
  const int tma_batch = packed ? 0 : b;
  const int q_row0 = static_cast<int>(seq.row0_q), k_row0 = static_cast<int>(seq.row0_k);
  // Broadcast from lane 0 so that ptxas sees a warp-uniform value: wgmmas
  // under a branch on it are then not serialised as in a divergent path.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    mbar_init(smem.kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem.qdo_full(s), 1);
      mbar_init(smem.qdo_empty(s), Traits::kQdoReleases);
    }
    for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) {
      for (int buf = 0; buf < kDqBuffers; ++buf) {
        mbar_init(smem.dq_full(w, buf), 128);  // every thread of consumer w, after staging
        mbar_init(smem.dq_empty(w, buf), 1);   // its writer, after the TMA read
      }
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------- producer (helpers: bwd_sm90_producer.cuh) ----------------
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
      mbar_arrive_expect_tx(smem.kv_full(), kBlockN * (kChunks + kChunksV) * 128);
      tma_load_tile<kChunks>(&tmap_k, smem.k, kBlockN, smem.kv_full(), k_row0 + n0, h_k, tma_batch);
      tma_load_tile<kChunksV>(&tmap_v, smem.v, kBlockN, smem.kv_full(), k_row0 + n0, h_k, tma_batch);
      for (auto step = walk.first(); walk.more(step.i); walk.advance(step)) {
        const int i = step.i, h = h_first + step.g;
        const int stage = i % kStages;
        mbar_wait(smem.qdo_empty(stage), ((i / kStages) & 1) ^ 1);
        const int m0 = step.m_block * kBlockM;
        const float* row_stats_head =
            row_stats_first + static_cast<int64_t>(step.g) * params.seqlen_q_padded;
        walk.publish(step, smem.step_word(i));  // before qdo_full's arrive
        if constexpr (kHasAttnMask) {
          const uint32_t reads = bwd_sm90_mask_reads<kBlockM, kBlockN>(params, seq, b, h, m0, n0);
          st_shared_b32(smem.mask_reads(stage), reads);  // before qdo_full's arrive
        }
        mbar_arrive_expect_tx(smem.qdo_full(stage),
                              kBlockM * (kChunks + kChunksV) * 128 + Traits::kRowStatBytes);
        bulk_load(smem.lse(stage), row_stats_head + m0, kBlockM * 4, smem.qdo_full(stage));
        bulk_load(smem.dsum(stage), row_stats_head + dsum_offset + m0, kBlockM * 4,
                  smem.qdo_full(stage));
        tma_load_tile<kChunks>(&tmap_q, smem.q(stage), kBlockM, smem.qdo_full(stage),
                               q_row0 + m0, h, tma_batch);
        tma_load_tile<kChunksV>(&tmap_do, smem.dO(stage), kBlockM, smem.qdo_full(stage),
                               q_row0 + m0, h, tma_batch);
      }
    } else if (threadIdx.x == 32 || threadIdx.x == 64) {
      const int w = threadIdx.x / 32 - 1;
      bwd_sm90_write_dq<Traits, kIsCausal, kHasVariants, kFlatDq>(
          &tmap_dq_accum, params, smem, walk, seq, w, b, h_first, n_block, n_tiles, packed, q_row0);
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
  const int wg_col0 = Traits::grad_col_a(wg);

  // The accumulators (layout: bwd_sm90_mainloop.cuh): rows are keys. dK in
  // the traits' pieces (dk_b: D = 192's 32-column piece; a dead placeholder
  // elsewhere).
  constexpr int kColsKB = Traits::kGradColsB > 0 ? Traits::kGradColsB : 8;
  float dk[Traits::kGradColsA / 8][4], dk_b[kColsKB / 8][4], dv[Traits::kGradColsV / 8][4];
#pragma unroll
  for (int j = 0; j < Traits::kGradColsA / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < kColsKB / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_b[j][e] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < Traits::kGradColsV / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[j][e] = 0.f;
  }
  const int key_row = wg_key0 + warp * 16 + lane / 4;  // + 8 * (e / 2), within the tile
  // The step's GEMMs and staging (bwd_sm90_mainloop.cuh), its probabilities
  // (bwd_sm90_softmax.cuh).
  const BwdSm90Consumer<Traits> consumer{smem, wg, tid, warp, lane, wg_key0, wg_col0, key_row};
  using Softmax = BwdSm90Softmax<Traits, kIsCausal, kHasVariants, kHasAttnMask>;
  const Softmax softmax{params, seq, smem, b, n0, lane, wg_key0, key_row};
  using RowStat = typename Softmax::RowStat;
  constexpr int kZeroedBarrier = BwdSm90Consumer<Traits>::kZeroedBarrier;

  if constexpr (kChunksV < kChunks) {
    // V / dO chunks past v's head dim: zeros for dP^T's extra k-steps (the
    // TMA never writes them), once per CTA.
    consumer.zero_pad_chunks();
    fence_proxy_async_smem();
    named_barrier_sync(kZeroedBarrier, 256);
  }
  if (m_begin < m_end) {
    mbar_wait(smem.kv_full(), 0);
    if (kVarSeq && n0 + kBlockN > seq.seqlen_k) {
      consumer.zero_tile_rows(smem.k, kBlockN, seq.seqlen_k - n0);
      consumer.zero_tile_rows(smem.v, kBlockN, seq.seqlen_k - n0);
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
      mbar_wait(smem.qdo_full(stage), (i / kStages) & 1);
      const auto step = walk.published(i, smem.step_word(i));
      const int m_block = step.m_block, h = h_first + step.g;
      if constexpr (kVarSeq) {
        consumer.zero_rows_past_sequence(packed, seq.seqlen_q, m_block, stage);
      }

      float s[kBlockM / 8][4], dp[kBlockM / 8][4];
      wgmma_fence();
      consumer.issue_transposed_scores(s, smem.k, smem.q(stage));
      consumer.issue_transposed_scores(dp, smem.v, smem.dO(stage));
      // A 16-bit attn_mask: the warp's block into its rows of this step's dS^T
      // buffer while the GEMMs run (bwd_sm90_stage_attn_mask).
      uint32_t staged_mask = 0;
      if constexpr (kHasAttnMask) {
        const Mask mask = softmax.make_variants(h).mask;
        const bool reads = ((ld_shared_b32(smem.mask_reads(stage)) >> (wg_key0 / 64)) & 1u) != 0u;
        if (reads && attn_mask_stageable(mask)) {  // uniform
          staged_mask = smem.ds(i % 2) + (wg_key0 + warp * 16) * 128;
          bwd_sm90_stage_attn_mask<kBlockM, kBlockN * 128>(staged_mask, mask, m_block * kBlockM,
                                                           n0 + wg_key0 + warp * 16, lane);
        }
      }
      RowStat lse_log2, dsum;  // while the GEMMs run
      softmax.load_row_stat(smem.lse(stage), lse_log2);
      softmax.load_row_stat(smem.dsum(stage), dsum);
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
        softmax.scores_to_probs(h, m_block, stage, s, smem.lse(stage), lse_log2, false,
                                staged_mask);
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
        const ScoreVariants variants = softmax.make_variants(h);
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          float d[2];
          softmax.row_stat_pair(smem.dsum(stage), dsum, j, d);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float dfds;  // scores_to_probs applies softcap * log2(e)
            s[j][e] = softcap_score(s[j][e], variants.softcap_in, 1.f, &dfds, TanhApprox());
            dp[j][e] = (dp[j][e] - d[e % 2]) * dfds;
          }
        }
        softmax.scores_to_probs(h, m_block, stage, s, smem.lse(stage), lse_log2, true, staged_mask);
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
          softmax.row_stat_pair(smem.dsum(stage), dsum, j, d);
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
          softmax.row_stat_pair(smem.dsum(stage), dsum, j, d);
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
      consumer.issue_grad_update<Traits::kGradColsV>(dv, p_frag, smem.dO(stage), 0);
      wgmma_commit();
      const uint32_t ds_buf = smem.ds(i % 2);
      consumer.store_ds(ds_buf, ds_frag);
      fence_proxy_async_smem();
      named_barrier_sync(kDsBarrier, 256);
      float dq[Traits::kDqAccN / 8][4];  // 80-query steps: dQ^T
      if constexpr (Traits::kDqTransposed) {
        // dV retired first: its P^T operand's 20 registers would not fit
        // beside dQ^T's 40 (ptxas serialised every wgmma, C7512).
        wgmma_wait<0>();
        consumer.fence_grads(dk, dv);
        fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(p_frag));
        consumer.issue_dq_transposed(dq, ds_buf);
      } else {
        consumer.issue_dq_chunk(dq, ds_buf, 0);
      }
      consumer.issue_grad_update<Traits::kGradColsA>(dk, ds_frag, smem.q(stage), 0);
      wgmma_commit();
      wgmma_wait<1>();  // dV, dQ
      fence_registers(reinterpret_cast<float(&)[Traits::kDqAccN / 2]>(dq));
      const int buf = i % kDqBuffers;
      // The buffer's previous chunk (step i - kDqBuffers) has been read.
      mbar_wait(smem.dq_empty(wg, buf), ((i / kDqBuffers) & 1) ^ 1);
      if constexpr (kFlatDq) {
        consumer.stage_dq_flat(smem.dq_buffer(wg, stage, buf, 0), dq);
      } else if constexpr (!Traits::kDqTransposed) {
        consumer.stage_dq(smem.dq_buffer(wg, stage, buf, 0), dq);
      }
      consumer.hand_dq_to_writer(i);
      wgmma_wait<0>();  // dK
      consumer.fence_grads(dk, dv);
      mbar_arrive(smem.qdo_empty(stage));
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
    const uint32_t p_slot = smem.p + tid * 16;  // + q * 128 * 16 for float4 q
    for (int i = 0; walk.more(i); ++i) {
      const int stage = i % kStages;
      mbar_wait(smem.qdo_full(stage), (i / kStages) & 1);
      const auto step = walk.published(i, smem.step_word(i));
      const int m_block = step.m_block, h = h_first + step.g;
      if constexpr (kVarSeq) {
        consumer.zero_rows_past_sequence(packed, seq.seqlen_q, m_block, stage);
      }
      const uint32_t ds_buf = smem.ds(i % 2);

      // The wgmmas stay outside the warpgroup branches (operands selected
      // instead): inside a divergent branch ptxas serialises them.
      float acc[kBlockM / 8][4];  // consumer 0: S^T -> P^T; consumer 1: dP^T -> dS^T
      wgmma_fence();
      consumer.issue_transposed_scores(acc, wg == 0 ? smem.k : smem.v,
                                       wg == 0 ? smem.q(stage) : smem.dO(stage));
      static_assert(Softmax::kPreloadRowStats, "the head-dim split takes 64-query steps");
      RowStat row_terms;  // consumer 0: lse (log2); consumer 1: D
      softmax.load_row_stat(wg == 0 ? smem.lse(stage) : smem.dsum(stage), row_terms);
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
          const ScoreVariants variants = softmax.make_variants(h);
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
          softmax.scores_to_probs(h, m_block, stage, acc, smem.lse(stage), row_terms, true);
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
          consumer.store_ds(ds_buf, p_frag);
        } else {
          softmax.scores_to_probs(h, m_block, stage, acc, smem.lse(stage), row_terms, false);
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
          consumer.load_ds(ds_buf, p_frag);
        } else {
          accumulators_to_a_fragments<T, kBlockM>(p, p_frag);
        }
        accumulators_to_a_fragments<T, kBlockM>(acc, ds_frag);
        consumer.store_ds(ds_buf, ds_frag);
        fence_proxy_async_smem();
      }
      wgmma_fence();
      consumer.issue_grad_update<Traits::kGradColsV>(dv, p_frag, smem.dO(stage),
                                                     Traits::grad_col_v(wg));
      wgmma_commit();
      named_barrier_sync(kDsReady, 256);
      if (wg == 0) {
        consumer.load_ds(ds_buf, ds_frag);
      }
      wgmma_fence();
      consumer.issue_grad_update<Traits::kGradColsA>(dk, ds_frag, smem.q(stage), wg_col0);
      if constexpr (Traits::kGradColsB > 0) {
        consumer.issue_grad_update<Traits::kGradColsB>(dk_b, ds_frag, smem.q(stage),
                                                       Traits::grad_col_b(wg));
      }
      wgmma_commit();
      if constexpr (Traits::kDqPieces) {
        consumer.accumulate_dq_pieces(ds_buf, stage, i, dk, dk_b, dv);
      } else {
        consumer.accumulate_dq_in_stage(ds_buf, stage, i, dk, dv);
      }
      fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(p_frag));
      fence_registers(reinterpret_cast<uint32_t(&)[kBlockM / 4]>(ds_frag));
    }
  }

  // ---------------- epilogue (bwd_sm90_epilogue.cuh) ----------------
  // The gradients' head: with kWalkGroup the kv head (the group is summed
  // above), else the query head (GQA there: per query head, summed by the op
  // layer).
  const int grad_head = kWalkGroup ? h_k : h_first;
  bwd_sm90_store_dk_dv<Traits, kColsKB>(params, dk, dk_b, dv, b, grad_head, k_row0, n0, key_row,
                                        seq.seqlen_k, wg, lane);
#endif
}

}  // namespace cuda
}  // namespace flash_attn_ext
