// Hopper backward: the producer warpgroup's helpers in bwd_sm90_kernel.cuh
// (24 registers; the rest of the warpgroup idles):
//   bwd_sm90_mask_reads: the loader's (thread 0) word per step of the
//     attn_mask kernels, which consumers must read the mask on the step;
//   bwd_sm90_write_dq (threads 32 and 64, one per consumer): the consumer's
//     staged dQ chunks of every step into the fp32 dQ accumulator by TMA
//     reduce-adds, in the deterministic order where asked.
// The loader's step loop stays in the kernel: as a function it compiled to
// different SASS (the same instructions, registers numbered otherwise).
// Scalar arguments are taken by reference, as the kernel's lambdas captured
// them: taken by value they compiled differently too.
#pragma once
#include <cuda.h>

#include "../../params.h"
#include "../common/mask_blocks.cuh"
#include "../common/ptx.cuh"
#include "bwd_sm90_smem.cuh"
#include "bwd_sm90_steps.cuh"
#include "bwd_sm90_variants.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

// attn_mask kernels: bit w = consumer w's 64 keys need the mask on the step
// of query rows [m0, m0 + kBlockM) (the summary's blocks of kMaskBlock rows x
// 64 keys); all without a summary.
template <int kBlockM, int kBlockN>
FAE_DEVICE uint32_t bwd_sm90_mask_reads(const AttentionBwdParams& params, const SeqBounds& seq,
                                        const int& b, const int& h, const int& m0, const int& n0) {
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
  return reads;
}

// The dQ writer of consumer w: TMA reduce-adds of its staged chunks.
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
// n_block, n_tiles: the key tile and the sequence's key tiles; packed: the
// tensors hold packed sequences (varlen), the sequence's rows from q_row0.
// kFlatDq: one bulk reduce of the consumer's 16 KB chunk into its block of
// the flat accumulator (bwd_sm90.h) instead of the tensor map's boxes.
template <typename Traits, bool kIsCausal, bool kHasVariants, bool kFlatDq, bool kWalkGroup>
FAE_DEVICE void bwd_sm90_write_dq(const CUtensorMap* tmap_dq_accum,
                                  const AttentionBwdParams& params,
                                  const BwdSm90Smem<Traits>& smem,
                                  const BwdSm90StepWalk<kWalkGroup>& walk, const SeqBounds& seq,
                                  const int& w, const int& b, const int& h_first,
                                  const int& n_block, const int& n_tiles, const bool& packed,
                                  const int& q_row0) {
  using namespace sm90;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kDqBuffers = Traits::kDqBuffers;
  constexpr int kDqCols = Traits::kDqCols, kDqRows = Traits::kDqRows;
  prefetch_tensor_map(tmap_dq_accum);
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
    mbar_wait(smem.dq_full(w, buf), (i / kDqBuffers) & 1);
    const auto step = walk.published(i, smem.step_word(i));
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
    if constexpr (kFlatDq) {
      static_assert(!Traits::kSplitHeadDim && Traits::kDqChunks == 1 && !Traits::kDqPieces,
                    "the key split's one kDqRows x 64 chunk per consumer and step");
      // (The base again per step, from the kernel's b and q_row0: a value
      // kept across the loop spilled in these 24-register warps.) Blocks of
      // kDqRows rows (params.dq_flat_rows, checked by the launcher).
      const int block_row = flat_dq_block_base(params, b, q_row0, kDqRows) +
                            (h_first + step.g) * flat_dq_head_blocks(params, kDqRows) +
                            (m_block * kBlockM + smem.dq_row0(w)) / kDqRows;
      float* block = params.dq_accum + static_cast<int64_t>(block_row * (Traits::kHeadDim / 64) +
                                                            smem.dq_col0(w, 0) / 64) *
                                           (kDqRows * 64);
      bulk_reduce_add_f32(block, smem.dq_buffer(w, stage, buf, 0), Traits::kDqBufferBytes);
    } else if constexpr (Traits::kDqPieces) {
#pragma unroll
      for (int box = 0; box < Traits::kDqBoxes; ++box) {
        tma_reduce_add_3d(tmap_dq_accum, smem.dq_buffer(w, stage, buf, 0) + box * kDqRows * 128,
                          smem.dq_box_col(w, box), q_row0 + m_block * kBlockM, dq_slice);
      }
    } else {
#pragma unroll
      for (int c = 0; c < Traits::kDqChunks; ++c) {
#pragma unroll
        for (int box = 0; box < kDqCols / Traits::kDqBoxCols; ++box) {
          tma_reduce_add_3d(tmap_dq_accum, smem.dq_buffer(w, stage, buf, c) + box * kDqRows * 128,
                            smem.dq_col0(w, c) + box * Traits::kDqBoxCols,
                            q_row0 + m_block * kBlockM + smem.dq_row0(w), dq_slice);
        }
      }
    }
    bulk_commit_group();
    bulk_wait_group_read<0>();
    // The buffer may be written again (head-dim split: the stage reloaded),
    // before the adds complete: the consumers and the loader go on while
    // a deterministic turn is handed over.
    mbar_arrive(Traits::kDqInQdoStage ? smem.qdo_empty(stage) : smem.dq_empty(w, buf));
    if (turn != nullptr) {
      bulk_wait_group<0>();
      release_flag_increment(turn);
    }
  }
  // No wait for the last adds to complete: their shared-memory sources were
  // read (above), and the kernel's end orders them before the dQ convert
  // kernel, as a TMA store epilogue relies on; waiting held the CTA's SM
  // until the L2 had applied them.
}

}  // namespace cuda
}  // namespace flash_attn_ext
